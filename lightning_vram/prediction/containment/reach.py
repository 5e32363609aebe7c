"""What the user's training code can reach beyond the module it runs on, found without running it.

A replay runs the user's Python a second time (``training_step``, every ``forward``, a ``step_function``), on a
fake copy of the module. The copy holds the module's own state, but the code also reaches what the copy does not:
its closures, the globals its functions name, class attributes, random generators held outside, ``lru_cache``
functions. :func:`reach_of` walks the code objects from a set of roots (:mod:`~.code_roots`),
reading names, closure cells, attributes and the modules a function's own ``import`` statements name (never calling a
property, a ``__getattr__`` or any user function), and lists those places so that the replay can save and restore
them, give the code fresh caches, or decide not to run at all. Some code acts where nothing can be put back: it opens
files, starts threads, runs as the replay's objects are collected (a ``__del__``, a ``weakref.finalize`` callback: after
the replay has put back what it changed), or imports modules it names only as strings (``importlib.import_module``,
or one not imported yet): the walk lists what it does, and the replay is refused.

Of a user class, the walk takes only the attributes the code may reach by name (:mod:`~.method_reach`): dunders,
overrides of what torch's and Lightning's code calls during a training batch, and the names the walked code reads
(``self.export()``, ``getattr(self, "export")``), or all of them where it computes names. A method nothing the step
runs can call (``export`` writing a file with ``torch.save``, a ``validation_step``) neither rules the replay out nor
has its state saved: code that cannot run changes nothing. What the code holds as an object (a bound method, a hook,
a function in a closure) is walked whatever its name.

The same walk tells whether the code uses APIs that refuse saved-tensor hooks (``torch.func``'s ``grad``,
``vjp``, ``jacrev``, ``hessian``; ``disable_saved_tensors_hooks``) or installs its own, which the sampled step's
counting must stand aside for, and whether it calls functions ``torch.compile`` made (or compiled modules held
outside the trained one): dynamo would trace them on the replay's fake tensors and keep what it made of them for
training's later calls, so the step is not replayed; under the CPU's live count (a dispatch mode) dynamo runs them
eagerly, so that count stands aside.
"""

from __future__ import annotations

import array
import builtins
import collections
import contextvars
import dis
import functools
import gc
import importlib
import importlib.machinery
import importlib.util
import itertools
import logging
import os
import random
import sys
import types
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.func
from torch import Tensor

from lightning_vram.measure.compiled import compiled_callable_name
from lightning_vram.prediction.containment.code_roots import Remapped
from lightning_vram.prediction.containment.construction import (
    CONSTRUCTING,
    COPYING,
    CREATING,
    Constructions,
    Copied,
    Member,
    Role,
    constructions,
    rebuilt_by_library,
)
from lightning_vram.prediction.containment.installed import Installed, installed_user_code
from lightning_vram.prediction.containment.isolation import quieted_handlers
from lightning_vram.prediction.containment.method_reach import (
    OUTSIDE_BATCH_HOOKS,
    TRAINER_NAMES,
    MethodReach,
    computed_names,
    library_names,
    names_computed_by,
    string_names,
)
from lightning_vram.prediction.containment.plain_reads import (
    contents,
    dict_items,
    instance_dict,
    is_numpy_array,
    is_numpy_generator,
    is_numpy_seed_sequence,
    is_numpy_state,
    key_text,
    numpy_bit_generator,
    numpy_seed_sequence,
    seed_sequence_state,
    slot_names,
)
from lightning_vram.prediction.containment.user_code import (
    code_names,
    imports,
    is_user_class,
    is_user_file,
    is_user_function,
)

WALK_LIMIT = 20_000
"""The most objects one walk visits; past it the walk stops and says it is incomplete."""

DYNAMIC_NAMES = {
    "globals": "calls globals()",
    "vars": "calls vars()",
    "exec": "runs exec",
    "eval": "runs eval",
    "sys": "reads sys",
    "__import__": "imports modules by name (__import__)",
    "importlib": "imports modules by name (importlib)",
    "inspect": "reads frames (inspect)",
}
"""Global names through which code reaches a module's globals by names it computes at run time (``globals()["n"]``,
``sys.modules``, a frame's ``f_globals``), and what using each does, for the reason a replay is refused."""

BY_NAME = frozenset({"getattr", "setattr", "delattr"})
"""Builtins that reach an object's attribute by a computed name: a module's globals only where the code also names a
module and the name is not a constant (``getattr(config, name)``), not on the code's own objects (``getattr(self.block,
name)``); a constant one (``getattr(config, "Maker")``) reaches that name of a user's module alone."""

OUTSIDE_EFFECTS = {
    "open": "opens files (what it writes would be written again)",
    "atexit": "registers exit callbacks (each replay would add one)",
    "threading": "starts threads (a thread a replay starts would go on running the user's code)",
    "subprocess": "starts processes",
    "multiprocessing": "starts processes",
    "socket": "opens sockets",
    "shutil": "changes files",
}
"""Global names whose use reaches beyond the objects a replay saves and puts back, and what each does."""

SAVED_TENSOR_HOOK_NAMES = frozenset(
    {
        "vjp",
        "jacrev",
        "hessian",
        "grad_and_value",
        "disable_saved_tensors_hooks",
        "saved_tensors_hooks",
        "save_on_cpu",
    }
)
"""Names whose use conflicts with the monitor's saved-tensor hooks."""

REFUSING_NAMES = ("grad", "grad_and_value", "vjp", "jacrev", "hessian")
REFUSING_TRANSFORMS = {id(vars(torch.func)[name]): f"torch.func.{name}" for name in REFUSING_NAMES}
"""torch.func's transforms that raise under saved-tensor hooks, by identity: whatever name the code binds them to
(``from torch.func import grad as G``, ``import torch.func as tf; tf.grad``); their ``__module__`` says only
``torch.func``."""

DESCRIPTOR_WRITES = ("write", "pwrite", "writev", "pwritev", "sendfile")
"""``os``'s functions that write to a descriptor, opened before the step (the audit hook sees only its opening)."""

OUTSIDE_CALLABLES = {
    id(weakref.finalize): "registers a finalizer (weakref.finalize), which runs as its object is collected: for the"
    " replay's objects, after the replay has put back what it changed",
    id(importlib.import_module): "imports modules by name (importlib.import_module): the code of a module it names only"
    " as a string is beyond the walk",
    id(importlib.reload): "reloads a module (importlib.reload), running its code again",
    id(builtins.__import__): "imports modules by name (__import__): the code of a module it names only as a string is"
    " beyond the walk",
    **{
        id(vars(os)[name]): f"writes to a file descriptor (os.{name}; no audit event announces it): what it writes"
        " would be written again"
        for name in DESCRIPTOR_WRITES
        if name in vars(os)
    },
}
"""Callables, by identity (whatever name the code binds them to), whose use reaches beyond the objects a replay saves
and puts back, and what using each does."""

EVERY_NAME = "*"
"""Among the attribute names a module is walked for: every global of it is in reach (code reading the module's
attributes by names it computes, ``vars(config)[name]``, ``getattr(config, name)``); never a real attribute's name."""

ATTRIBUTE_DEPTH = 2
"""Modules followed down attribute names from a global one (``torch.func.grad``: two)."""

_ATOMS = (int, float, complex, str, bytes, bool, type(None), range, torch.dtype, torch.device, torch.Size)

STORE: type | None = getattr(torch.distributed, "Store", None)
"""``torch.distributed``'s key-value store (``None`` on a build without distributed): a step that counts in one
(``store.add``) would count again in each replay, and every rank and later step sees the count."""


@dataclass(frozen=True)
class Slot:
    """A place holding a reference: a namespace's entry, a closure cell, an object's attribute, a list's item."""

    holder: Any
    key: Any = None
    """The entry's key, the attribute's name, the item's index; ``None`` for a closure cell."""

    def get(self) -> Any:
        """The object held now (a missing entry raises ``KeyError`` or ``AttributeError``); a class's own entry."""
        if isinstance(self.holder, types.CellType):
            return self.holder.cell_contents
        if isinstance(self.holder, dict):  # through dict's own methods: never a subclass's of the user's
            return dict.__getitem__(self.holder, self.key)
        if isinstance(self.holder, list):
            return list.__getitem__(self.holder, self.key)
        if isinstance(self.holder, type):  # not what ``__get__`` makes: a singledispatchmethod makes a new function
            return vars(self.holder)[self.key or ""]  # each time, which putting back would set in the class's entry
        return getattr(self.holder, self.key or "")

    def set(self, value: Any) -> None:
        """Point the place at ``value``."""
        if isinstance(self.holder, types.CellType):
            self.holder.cell_contents = value
        elif isinstance(self.holder, dict):
            dict.__setitem__(self.holder, self.key, value)
        elif isinstance(self.holder, list):
            list.__setitem__(self.holder, self.key, value)
        else:
            setattr(self.holder, self.key or "", value)


_FRESH: weakref.WeakSet[Any] = weakref.WeakSet()
"""The caches the replays made (:func:`fresh_cache`): the replay's own, never the user's."""


def fresh_cache(cache: Any, function: Any = None) -> Any:
    """A new, empty ``functools.lru_cache`` of the same settings, over ``function`` (by default the same one).

    Where ``cache`` is a class's static or class method of one, the same kind of method of the new one.
    """
    if isinstance(cache, (staticmethod, classmethod)):
        return type(cache)(fresh_cache(cache.__func__))
    made = functools.lru_cache(**cache.cache_parameters())(cache.__wrapped__ if function is None else function)
    _FRESH.add(made)
    return made


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a user's ``functools.lru_cache`` function, or a class's static or class method of one.

    Not one a replay made (:func:`fresh_cache`), which the replay's copies hold.
    """
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    return isinstance(value, functools._lru_cache_wrapper) and value not in _FRESH


@dataclass
class Reach:
    """What the walked code can reach outside the module it runs on.

    ``slots``: global names, closure cells and class attributes it reads (rebinding one, ``global n; n += 1``,
    changes the user's state). ``objects``: mutable objects it can change in place (lists, dicts, sets, objects'
    attributes, random generators). ``tensors``: tensors held outside the module. ``arrays``: NumPy arrays.
    ``caches``: ``functools.lru_cache`` functions (or a class's static or class methods of one) and the place each is
    read from. ``real_modules``: where the code
    reaches the trained module itself (a ``step_function`` closing over it), by path. ``hook_apis``: the
    saved-tensor-hook APIs the code names. ``compiled``: what it runs through ``torch.compile`` (a compiled function
    or a compiled module outside the trained one), each with where the walk found it. ``unrestorable``: what the
    code reaches whose state cannot be saved (an iterator, a generator), by path. ``effects``: what the code does
    outside the process's objects, which a replay would do again (files it opens, threads, exit callbacks), by path.
    ``complete``: the walk ended before :data:`WALK_LIMIT`. ``paths``: where the walk first found each of
    ``objects``, by id (``the model.seen``: an attribute of the module; ``Model.history``: a class's), for the notes.
    ``methods``: the names in reach and the classes' attributes the walk left for want of theirs
    (:mod:`~.method_reach`), for a later walk to go on from. ``sweeps``: where code reaches every global of its module
    by names it computes (``sys``, ``exec``), as the start of the paths found so, and what that code does.
    ``installed``: the user's code installed in torch's and Python's namespaces and in the library classes the walk
    passed (``F.linear = counting_linear``, :mod:`~.installed`), which library code calls where the walk does not go.
    """

    slots: list[Slot] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    arrays: list[Any] = field(default_factory=list)
    caches: list[tuple[Slot, Any]] = field(default_factory=list)
    real_modules: list[str] = field(default_factory=list)
    hook_apis: set[str] = field(default_factory=set)
    compiled: list[str] = field(default_factory=list)
    unrestorable: list[str] = field(default_factory=list)
    effects: list[str] = field(default_factory=list)
    complete: bool = True
    paths: dict[int, str] = field(default_factory=dict)
    methods: MethodReach = field(default_factory=MethodReach)
    sweeps: dict[str, str] = field(default_factory=dict)
    installed: list[Installed] = field(default_factory=list)

    def add(self, other: Reach) -> None:
        """Take in what ``other`` (another walk) found."""
        self.slots += other.slots
        self.objects += other.objects
        self.tensors += other.tensors
        self.arrays += other.arrays
        self.caches += other.caches
        self.real_modules += other.real_modules
        self.hook_apis |= other.hook_apis
        self.compiled += other.compiled
        self.unrestorable += other.unrestorable
        self.effects += other.effects
        self.installed += [found for found in other.installed if found not in self.installed]
        for swept, what in other.sweeps.items():
            self.sweeps.setdefault(swept, what)
        self.complete = self.complete and other.complete
        for key, path in other.paths.items():
            self.paths.setdefault(key, path)


class _Walk:
    """One walk from code and data roots.

    An object reached through the module's own attributes (``data``) is a copy in the replay unless ``deepcopy``
    shares it; one reached through code (a closure, a global) is the user's own object.
    """

    def __init__(self, inside: set[int], limit: int, ignore: set[int], methods: MethodReach) -> None:
        self.reach = Reach(methods=methods)
        self._quieted = quieted_handlers()
        self._inside = inside
        self._ignore = ignore
        self._seen: set[tuple[int, bool]] = set()
        self._slots: set[tuple[int, str | None]] = set()
        self._limit = limit
        self._namespaces: set[int] = set()
        self._modules: set[tuple[int, frozenset[str]]] = set()  # a module walked for a set of attribute names
        self._compiled: set[int] = set()  # what torch.compile made, listed once however many paths reach it
        self._library_classes: dict[int, type] = {}  # the library classes passed, whose methods library code calls
        self._queue: collections.deque[tuple[Any, str, frozenset[str], bool, Role]] = collections.deque()

    def run(self, roots: Iterable[tuple[str, Any]], data: Iterable[tuple[str, Any]] = ()) -> Reach:
        for path, root in roots:
            self._queue.append((root, path, frozenset(), False, Role.VALUE))
        for path, value in data:
            self._queue.append((value, path, frozenset(), True, Role.VALUE))
        while self._queue:
            if len(self._seen) >= self._limit:
                self.reach.complete = False
                break
            value, path, names, data_path, role = self._queue.popleft()
            self._visit(value, path, names, data_path, role)
        self.reach.installed = installed_user_code(self._library_classes.values())
        return self.reach

    def _hold(self, value: Any, path: str) -> None:
        """``value`` is state the replay may change in place, found at ``path``."""
        self.reach.objects.append(value)
        self.reach.paths.setdefault(id(value), path)

    def _push(
        self, value: Any, path: str, names: frozenset[str] = frozenset(), data: bool = False, role: Role = Role.VALUE
    ) -> None:
        """Walk ``value`` later; ``role``: what reaching it tells of its construction, where it is a class."""
        if not isinstance(value, _ATOMS):
            self._queue.append((value, path, names, data, role))

    def _slot(self, holder: Any, key: str | None, path: str, role: Role = Role.VALUE) -> None:
        marker = (id(holder), key)
        if marker not in self._slots:
            self._slots.add(marker)
            slot = Slot(holder, key)
            self.reach.slots.append(slot)
            try:
                value = slot.get()
            except (KeyError, AttributeError, ValueError):  # an empty cell, a name bound later
                return
            if is_cache(value):
                self.reach.caches.append((slot, value))
            self._push(value, path, role=role)

    def _item(self, holder: Any, key: Any, item: Any, path: str, data: bool) -> None:
        """An item of a container the walk holds: a dict's value, a list's item, an object's ``__dict__`` entry.

        An ``lru_cache`` held so gets a fresh cache for the replay there, as one a global or an attribute holds; one
        held where no fresh cache can be put (a tuple, a set, a ``functools.partial``'s function, ``__slots__``) is a
        reason not to replay: the replay would call the user's own cache, fill it with fake tensors (which the escape
        check clears, with the user's real entries) and count its hits.
        """
        if is_cache(item):
            if isinstance(holder, (dict, list)):
                self.reach.caches.append((Slot(holder, key), item))
            else:
                self.reach.unrestorable.append(
                    f"{path} (a functools.lru_cache held where the replay cannot put a fresh one: it would fill the"
                    " user's cache with fake tensors and count its hits)"
                )
        self._push(item, path, data=data)

    def _visit(self, value: Any, path: str, names: frozenset[str], data: bool, role: Role) -> None:
        if isinstance(value, Copied):
            self._construct(value.cls, Role.COPIED, path)
            value, role = value.cls, Role.NAMED
        elif role is not Role.NAMED:  # held as a value (not a metaclass, a base, an object's class): it may be called
            self._construct_by(value)
            if isinstance(value, type):
                self._construct(value, role, path)
        if (id(value), data) in self._seen:
            return
        self._seen.add((id(value), data))
        if id(value) in self._ignore:
            return
        self._bring_computed(value)
        if id(value) in self._inside:
            if not data:  # code reaching the trained model; through its own attributes it is the copy's
                self.reach.real_modules.append(path)
            return
        if isinstance(value, types.FunctionType):
            self._function(value, path)
        elif isinstance(value, types.MethodType):
            self._push(value.__func__, path)
            if not (data and id(value.__self__) in self._inside):  # deepcopy rebinds it to the copy
                self._push(value.__self__, f"{path}.__self__", data=data)
        elif isinstance(value, Remapped):
            self._push(value.function, path)
        elif isinstance(value, (staticmethod, classmethod)):
            self._push(value.__func__, path)
        elif isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                if accessor is not None:
                    self._push(accessor, path)
        elif isinstance(value, functools.partial):
            self._item(value, None, value.func, path, data=False)
            self._push(value.args, path, data=data)
            self._push(value.keywords, path, data=data)
        elif isinstance(value, functools._lru_cache_wrapper):
            self._push(getattr(value, "__wrapped__", None), path)
        elif isinstance(value, weakref.ref):
            self._push(value(), f"{path}()", data=data)
        elif isinstance(value, type):
            self._class(value, path)
        elif isinstance(value, types.ModuleType):
            self._module(value, path, names)
        else:
            self._state(value, path, data)

    def _state(self, value: Any, path: str, data: bool) -> None:
        """An object that holds state: saved, or (an iterator, a generator) a reason the replay must not run."""
        if isinstance(value, Tensor):
            self.reach.tensors.append(value)
            role = Role.COPIED if data else Role.NAMED  # the replay deep-copies the module's data
            self._push(type(value), path, role=role)  # a subclass's: its ``__torch_function__`` runs on each op
            attributes = instance_dict(value)
            if attributes is not None:  # Python attributes set on the tensor (``GLOBAL_T.counter = n``)
                self._hold(attributes, f"{path}.__dict__")
                for name, item in dict_items(attributes):
                    self._push(item, f"{path}.{name}", data=data)
        elif isinstance(value, logging.Handler) and id(value) in self._quieted:
            # A replay's records never reach its formatter or its stream (a file, sys.stderr): the replay's filter,
            # last on it, drops them. Its filters before that one run, and may be the user's.
            self._push(value.filters, f"{path}.filters", data=data)
        elif isinstance(value, contextvars.ContextVar):  # the replay sets it in a copy of the context (predictor.py),
            self._push(value.get(None), f"{path}.get()", data=data)  # which shares the objects the variable holds
        elif is_numpy_array(value):
            self.reach.arrays.append(value)
            if value.dtype == object:
                for index, item in enumerate(value.flat):
                    self._push(item, f"{path}[{index}]", data=data)
        elif isinstance(value, (random.Random, torch.Generator, bytearray, array.array)) or is_numpy_state(value):
            self._hold(value, path)
            seed_sequence = numpy_seed_sequence(value)  # a bit generator's: its ``spawn`` advances it
            if seed_sequence is not None:
                self._push(seed_sequence, f"{path}.seed_seq", data=data)
        elif is_numpy_generator(value):  # its state is its bit generator's
            self._push(numpy_bit_generator(value), f"{path}.bit_generator", data=data)
        elif is_numpy_seed_sequence(value):  # ``spawn`` counts its children: a count Python cannot set
            if seed_sequence_state(value) is None:
                self.reach.unrestorable.append(
                    f"{path} (a SeedSequence: this NumPy gives no way to set its count of spawned children back)"
                )
            else:
                self._hold(value, path)
        elif isinstance(value, (list, set, collections.deque)):
            self._hold(value, path)
            self._container_class(value, path, data)
            for index, item in enumerate(contents(value)):
                self._item(value, index, item, f"{path}[{index}]", data)
        elif isinstance(value, dict):
            self._hold(value, path)
            self._container_class(value, path, data)
            for key, item in dict_items(value):
                self._item(None, None, key, f"{path} key", data)
                self._item(value, key, item, f"{path}[{key_text(key)}]", data)
        elif isinstance(value, types.MappingProxyType):  # read-only: what it shows is walked, not held
            for shown in gc.get_referents(value):  # the mapping, read without calling its methods
                if type(shown) is dict:
                    for key, item in dict_items(shown):
                        self._push(key, f"{path} key", data=data)
                        self._push(item, f"{path}[{key_text(key)}]", data=data)
                else:  # a mapping of another kind: its own code runs on each read
                    self._push(shown, f"{path} (its mapping)", data=data)
        elif isinstance(value, (tuple, frozenset)):
            self._container_class(value, path, data)
            for index, item in enumerate(contents(value)):
                self._item(value, None, item, f"{path}[{index}]", data)
        elif self._is_compiled(value, path):
            return  # a compiled module held outside the trained one: a reason not to run, not state to save
        elif hasattr(type(value), "__next__"):  # an iterator or a generator: what it has yielded cannot be put back
            self.reach.unrestorable.append(
                f"{path} (a {type(value).__name__}: what it yielded to the replay would be missing from training)"
            )
        elif STORE is not None and isinstance(value, STORE):  # its methods are calls into C++ no dispatch mode sees
            self.reach.unrestorable.append(f"{path} (a torch.distributed store: every rank shares what it holds)")
        elif data and not is_user_class(type(value)):
            return  # a library's object held by the module: the replay's deep copy holds its own copy
        else:
            self._instance(value, path, data)

    def _container_class(self, value: Any, path: str, data: bool) -> None:
        """A user's subclass of a built-in container (an ``OrderedDict``'s, a named tuple): its class is walked.

        Its dunders run on the container's use (``__setitem__``); a copy of it (the replay's of the module's data, or
        ``copy.deepcopy`` in the step) may construct it (``OrderedDict.__reduce__`` calls the class).
        """
        if is_user_class(type(value)):
            self._push(type(value), path, role=Role.COPIED if data else Role.NAMED)

    def _function(self, function: types.FunctionType, path: str) -> None:
        self._is_compiled(function, path)
        wrapped = getattr(function, "__wrapped__", None)
        if wrapped is not None:
            self._push(wrapped, path)
        attributes = instance_dict(function)
        registry = attributes.get("registry") if attributes is not None else None
        if isinstance(registry, types.MappingProxyType):  # functools.singledispatch's: each implementation registered
            for index, implementation in enumerate(types.MappingProxyType.values(registry)):
                self._push(implementation, f"{path}.registry[{index}]")
        if not is_user_function(function):
            return
        if attributes is not None:  # the function's own attributes (``helper.calls += 1``)
            self._hold(attributes, f"{function.__qualname__}.__dict__")
            for name, item in dict_items(attributes):
                if name != "__wrapped__":
                    self._push(item, f"{function.__qualname__}.{name}")
        code = function.__code__
        global_names, attribute_names = code_names(code)
        self._note_hook_apis(global_names, attribute_names, function.__globals__)
        self._bring_names(code, global_names, attribute_names)
        where = f"{function.__qualname__}"
        namespace = function.__globals__
        if namespace is not None and id(namespace) not in self._namespaces:
            self._namespaces.add(id(namespace))
            # a global rebound by any name (globals()[...], sys.modules)
            self._hold(namespace, f"the globals of {function.__module__}")
        names_a_module = any(isinstance(namespace.get(name), types.ModuleType) for name in global_names)
        computed = computed_names(code)
        by_name = global_names & BY_NAME and names_a_module and (computed.reads or computed.writes)
        computing = bool(global_names & DYNAMIC_NAMES.keys() or by_name)
        # a user's module: the names the code holds as strings too (``getattr(config, "Maker")``), or every name
        user_names = attribute_names | string_names(code) | ({EVERY_NAME} if computing else set())
        for name in sorted(global_names):
            if name in namespace:
                value = namespace[name]
                if isinstance(value, types.ModuleType):
                    self._push(value, f"{where}: {name}", user_names if _of_user_file(value) else attribute_names)
                elif not name.startswith("__"):
                    self._slot(namespace, name, f"{where}: global {name}")
        local: dict[str, Any] = {}  # what the function's own ``import`` statements bind
        for imported, level, from_names in sorted(imports(code)):
            module_name = _resolved(imported, level, namespace)
            module = sys.modules.get(module_name) if module_name is not None else None
            if module_name is None or module is None:
                if module_name is None or _may_be_users(module_name):
                    self.reach.effects.append(
                        f"{where} imports {module_name or imported}, not imported yet: a replay would run its code"
                    )
                continue
            top_name = module_name.partition(".")[0]
            top = None if from_names else sys.modules.get(top_name)  # ``import a.b`` binds ``a``
            local.update({name: vars(module).get(name) for name in from_names} | ({top_name: top} if top else {}))
            for held in {id(found): found for found in (module, top) if found is not None}.values():
                names = user_names if _of_user_file(held) else attribute_names
                self._push(held, f"{where}: import {module_name}", names | from_names)
        self._note_hook_apis(frozenset(local), attribute_names, local)
        for name in sorted(global_names & OUTSIDE_EFFECTS.keys()):
            self.reach.effects.append(f"{where} {OUTSIDE_EFFECTS[name]}")
        named = _named_values(global_names, attribute_names, namespace)
        named += _named_values(frozenset(local), attribute_names, local)
        outside = {OUTSIDE_CALLABLES[id(value)] for value in named if id(value) in OUTSIDE_CALLABLES}
        self.reach.effects += [f"{where} {what}" for what in sorted(outside)]
        if "__import__" in global_names and "__import__" not in namespace:  # the builtin, not in the module's globals
            self.reach.effects.append(f"{where} {OUTSIDE_CALLABLES[id(builtins.__import__)]}")
        if _reads_sys_modules(code) or any(namespace.get(name) is sys.modules for name in global_names):
            self.reach.effects.append(
                f"{where} reaches modules by name (sys.modules): the code of a module it names only as a string is"
                " beyond the walk"
            )
        if "save" in attribute_names and isinstance(namespace.get("torch"), types.ModuleType):
            self.reach.effects.append(f"{where} may call torch.save (a file it writes would be written again)")
        if computing:  # names computed then
            # every global of the module is in reach
            what = _dynamic_use(global_names, attribute_names)
            swept = f"{where} ({what}: every global of {function.__module__} in reach)"
            self.reach.sweeps.setdefault(swept, f"{where} {what}")
            for name, value in dict_items(namespace):
                if not name.startswith("__") and not isinstance(value, types.ModuleType):
                    self._slot(namespace, name, f"{swept}: global {name}")
        uses = constructions(code)
        for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
            # the cell zero-argument super() reads: its class is constructed only where the code calls it itself
            called = name != "__class__" or uses.own_class
            self._slot(cell, None, f"{where}: closure {name}", Role.VALUE if called else Role.NAMED)
        self._constructions(function, uses)
        self._push(function.__defaults__, f"{where}: defaults")
        self._push(function.__kwdefaults__, f"{where}: defaults")

    def _is_compiled(self, value: Any, path: str) -> bool:
        """Whether ``torch.compile`` made ``value``; the first time, it is listed with ``path``."""
        name = compiled_callable_name(value)
        if name is not None and id(value) not in self._compiled:
            self._compiled.add(id(value))
            self.reach.compiled.append(f"{name} ({path})")
        return name is not None

    def _note_hook_apis(
        self, global_names: frozenset[str], attribute_names: frozenset[str], namespace: dict[str, Any]
    ) -> None:
        """Note the saved-tensor-hook APIs a function names: by name, and torch.func's transforms by identity.

        A global bound to one (``grad``, ``G``) or reached from a global module by the attribute names the code
        reads (``tf.grad``, ``torch.func.grad``), read from the modules' own dicts (no ``__getattr__`` runs).
        """
        found = set((global_names | attribute_names) & SAVED_TENSOR_HOOK_NAMES)
        for value in _named_values(global_names, attribute_names, namespace):
            name = REFUSING_TRANSFORMS.get(id(value))
            module = getattr(value, "__module__", None) if not isinstance(value, types.ModuleType) else None
            if name is not None:
                found.add(name)
            elif (  # the old functorch package: its own objects
                isinstance(module, str)
                and module.startswith("functorch")
                and (function_name := getattr(value, "__name__", None)) in REFUSING_NAMES
            ):
                found.add(f"functorch.{function_name}")
        self.reach.hook_apis |= found

    def _bring_names(self, code: types.CodeType, global_names: frozenset[str], attribute_names: frozenset[str]) -> None:
        """Put in reach the methods a function's ``code`` may call by name (:mod:`~.method_reach`)."""
        methods = self.reach.methods
        computed = computed_names(code)
        released = methods.bring_everything() if computed.reads else methods.bring(attribute_names | string_names(code))
        if computed.writes:
            released += methods.bring_descriptors()
        if (global_names | attribute_names) & TRAINER_NAMES:
            released += methods.bring(OUTSIDE_BATCH_HOOKS)
        for member in released:
            self._member(member)

    def _bring_computed(self, value: Any) -> None:
        """Put in reach what ``value`` may reach by computed names (``methodcaller(name)``, an alias of ``getattr``)."""
        methods, computed = self.reach.methods, names_computed_by(value)
        released = methods.bring_everything() if computed.reads else []
        if computed.writes:
            released += methods.bring_descriptors()
        for member in released:
            self._member(member)

    def _construct_by(self, value: Any) -> None:
        """Put in reach the construction ``value``, held by the code, may run without naming the class.

        ``copy.deepcopy``, ``torch.load``, ``type`` (``t = type``; ``t(x)()``): every class's; a class's own is
        :meth:`_construct`'s.
        """
        construction = self.reach.methods.construction
        released = construction.construct_everything() if id(value) in CONSTRUCTING else []
        if id(value) in COPYING:
            released += construction.copy_everything()
        if id(value) in CREATING:
            released += construction.create_classes()
        for member in released:
            self._member(member)

    def _constructions(self, function: types.FunctionType, uses: Constructions) -> None:
        """Put in reach the construction ``function``'s code may run (:func:`~.construction.constructions`).

        ``super().__init__(...)`` reaches the bases of the class whose ``__class__`` cell the function holds.
        """
        construction = self.reach.methods.construction
        released: list[Member] = []
        if uses.anything:
            released += construction.construct_everything()
        if uses.copies:
            released += construction.copy_everything()
        if uses.creates:
            released += construction.create_classes()
        if uses.supers:
            cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=False))
            try:
                owner = cells["__class__"].cell_contents
            except (KeyError, ValueError):  # super() without its cell: whatever it names
                owner = None
            if isinstance(owner, type):
                released += construction.construct(owner.__mro__[1:])
            else:
                released += construction.construct_everything()
        for member in released:
            self._member(member)

    def _construct(self, cls: type, role: Role, path: str) -> None:
        """``cls`` may be constructed (``VALUE``) or copied (``COPIED``): its dunders that waited for it are walked."""
        construction = self.reach.methods.construction
        if role is Role.COPIED and rebuilt_by_library(cls):  # ``OrderedDict.__reduce__``: ``cls()``
            role = Role.VALUE
        if role is Role.VALUE:
            released = construction.construct([cls])
        else:  # library code may subclass it (parametrize, FSDP2): its metaclass creates the subclass
            released = construction.copy_class(cls)
            if is_user_class(type(cls)):
                self._push(type(cls), f"{path} (its metaclass)")
        for member in released:
            self._member(member)

    def _class(self, cls: type, path: str) -> None:
        """A user class: its metaclass, its bases, and its attributes whose name is in reach (the others wait).

        A library class is not walked: its dict (and its bases') is searched for the user's code installed there.
        """
        if not is_user_class(cls):
            self._library_classes.setdefault(id(cls), cls)
            return
        methods = self.reach.methods
        for member in methods.construction.visit(cls):
            self._member(member)
        self._push(type(cls), f"{path} (its metaclass)", role=Role.NAMED)  # ``Meta.__call__`` runs on each ``cls()``
        for base in cls.__mro__[1:]:
            if is_user_class(base):
                self._push(base, path, role=Role.NAMED)
            else:  # library code may call an override by the name its class defines
                self._library_classes.setdefault(id(base), base)
                for member in methods.bring(library_names(base)):
                    self._member(member)
        for name, attribute in list(vars(cls).items()):
            dunder_method = callable(attribute) or isinstance(attribute, classmethod)  # ``__init_subclass__``'s too
            if name.startswith("__") and name.endswith("__") and not dunder_method:
                continue
            if methods.admits((cls, name, attribute)):
                self._member((cls, name, attribute))

    def _member(self, member: Member) -> None:
        """A class's attribute whose name is in reach: a method walked, any other value a slot."""
        cls, name, attribute = member
        if name == "__del__" and callable(attribute):
            self.reach.effects.append(
                f"{cls.__qualname__}.__del__ runs as an instance is collected, which for the replay's own objects (its"
                " copy of the module's, what its step makes) is after the replay has put back what it changed"
            )
        if isinstance(attribute, classmethod):  # ``cls(...)``: it may construct its class, or a subclass
            for released in self.reach.methods.construction.add_factory(cls):
                self._member(released)
        if isinstance(attribute, (types.FunctionType, staticmethod, classmethod, property)) and not is_cache(attribute):
            self._push(attribute, f"{cls.__qualname__}.{name}")
        elif not isinstance(attribute, types.MemberDescriptorType | types.GetSetDescriptorType):
            self._slot(cls, name, f"{cls.__qualname__}.{name}")

    def _held_by_library(self, attributes: Iterable[tuple[str, Any]]) -> None:
        """The attributes of a library's object (a Logger's ``filters``), and the items of those that are containers.

        A class of theirs with no library base is wholly in reach: the library calls it by names of its own
        (a duck-typed logging filter's ``filter``), which no code the walk reads names.
        """
        for _, attribute in attributes:
            for item in (attribute, *_items(attribute)):
                mro = type(item).__mro__
                if is_user_class(type(item)) and all(is_user_class(base) for base in mro[1:-1]):
                    for member in self.reach.methods.bring_class(mro[:-1]):
                        self._member(member)

    def _module(self, module: types.ModuleType, path: str, names: frozenset[str]) -> None:
        """The attributes of ``module`` the code names, and (a package's submodules) theirs, at any depth.

        Where ``names`` holds :data:`EVERY_NAME` and the module is a file's, every global of it is in reach.
        """
        self._seen.discard((id(module), False))  # another function may read other names of the same module
        if (id(module), names) in self._modules:
            return
        self._modules.add((id(module), names))
        filename = vars(module).get("__file__")
        namespace = vars(module)
        if isinstance(filename, str) and not is_user_file(filename):
            for name in names & namespace.keys():  # ``torch.load``, ``copy.deepcopy``: constructing what they load
                self._construct_by(namespace[name])
            return
        every = EVERY_NAME in names and isinstance(filename, str)  # a user's file, not a module C made (``sys``)
        chosen = {name for name in namespace if not name.startswith("__")} if every else names & namespace.keys()
        for name in sorted(chosen):
            value = namespace[name]
            if isinstance(value, types.ModuleType):  # ``userpkg.cfg.STATE``: the submodule's names too
                named = name in names  # one the code reaches by a computed name: its attributes by the names it reads
                self._push(value, f"{path}.{name}", names if named else names - {EVERY_NAME})
            else:
                self._slot(namespace, name, f"{path}.{name}")

    def _instance(self, value: Any, path: str, data: bool) -> None:
        attributes = instance_dict(value)
        if attributes is not None:
            self._hold(value, path)
            for name, item in dict_items(attributes):
                self._item(attributes, name, item, f"{path}.{name}", data)
            if not is_user_class(type(value)):
                self._held_by_library(dict_items(attributes))
        if slot_names(type(value)):
            self._hold(value, path)
            for name in slot_names(type(value)):
                try:
                    item = object.__getattribute__(value, name)
                except AttributeError:
                    continue
                self._item(value, None, item, f"{path}.{name}", data)
        self._push(type(value), path, role=Role.COPIED if data else Role.NAMED)  # the replay deep-copies its data


def _resolved(name: str, level: int, namespace: dict[str, Any]) -> str | None:
    """The full name of the module an ``import`` of ``name`` at ``level`` in the module of ``namespace`` names."""
    if not level:
        return name
    package = namespace.get("__package__") or namespace.get("__name__", "").rpartition(".")[0]
    try:
        return importlib.util.resolve_name("." * level + name, package)
    except (ImportError, ValueError):  # beyond the top package, or no package at all
        return None


def _may_be_users(name: str) -> bool:
    """Whether the module ``name``, not imported yet, may be the user's.

    Found (without running anything) in a user's file, under a package of the user's, or not found where a library's
    would be (an editable install's finder).
    """
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        package = sys.modules.get(".".join(parts[:end]))
        if package is not None:  # its submodule is where it is
            filename = vars(package).get("__file__")
            return not isinstance(filename, str) or is_user_file(filename)
    if parts[0] in sys.builtin_module_names:
        return False
    spec = importlib.machinery.PathFinder.find_spec(parts[0])
    return spec is None or not isinstance(spec.origin, str) or is_user_file(spec.origin)


@functools.lru_cache(maxsize=4096)
def _reads_sys_modules(code: types.CodeType) -> bool:
    """Whether ``code`` (or a function defined in it) reads ``sys.modules`` (not a module's ``self.modules()``)."""
    instructions = list(dis.get_instructions(code))
    for load, read in itertools.pairwise(instructions):
        if load.opname in ("LOAD_GLOBAL", "LOAD_NAME") and load.argval == "sys" and read.argval == "modules":
            return True
    return any(_reads_sys_modules(constant) for constant in code.co_consts if isinstance(constant, types.CodeType))


def _of_user_file(module: types.ModuleType) -> bool:
    """Whether ``module`` was loaded from a file of the user's (not a library's, nor one C made: ``sys``)."""
    filename = vars(module).get("__file__")
    return isinstance(filename, str) and is_user_file(filename)


def _named_values(
    global_names: frozenset[str], attribute_names: frozenset[str], namespace: dict[str, Any]
) -> list[Any]:
    """The values a function's code may name: its globals, and what global modules hold by its attribute names.

    Followed :data:`ATTRIBUTE_DEPTH` modules down (``torch.func.grad``), read from the modules' own dicts (no
    ``__getattr__`` runs).
    """
    named: list[Any] = []
    values = [namespace.get(name) for name in global_names]
    for _ in range(ATTRIBUTE_DEPTH + 1):
        named += values
        modules = [value for value in values if isinstance(value, types.ModuleType)]
        values = [vars(module).get(attribute) for module in modules for attribute in attribute_names]
    return named


def _dynamic_use(global_names: frozenset[str], attribute_names: frozenset[str]) -> str:
    """What code reaching its module's globals by computed names does (``reads sys.argv``, ``runs exec``)."""
    uses = [DYNAMIC_NAMES[name] for name in sorted(global_names & DYNAMIC_NAMES.keys())]
    if "sys" in global_names and "argv" in attribute_names:
        uses[uses.index(DYNAMIC_NAMES["sys"])] = "reads sys.argv"
    return " and ".join(uses) or "reads a module's attributes by computed names (getattr)"


def _items(value: Any) -> list[Any]:
    """The items of a built-in container (a dict's values), read through its built-in type; none for anything else."""
    return [item for _, item in dict_items(value)] if isinstance(value, dict) else contents(value)


def reach_of(
    roots: Iterable[tuple[str, Any]],
    inside: set[int],
    data: Iterable[tuple[str, Any]] = (),
    ignore: set[int] | None = None,
    limit: int = WALK_LIMIT,
    after: Reach | None = None,
) -> Reach:
    """Walk from the code ``roots`` and the ``data`` roots (``(path, object)``).

    ``inside``: the ids of the trained module's own objects (code reaching one reaches the real model); ``ignore``:
    ids not to walk (the replay's copy of the module, whose state is its own). ``after``: an earlier walk of the same
    step's code this one goes on from: the names in its reach are in this one's, and the methods it left are walked
    when this walk's code brings their name (a hook on the copy calling ``self.export()``).
    """
    methods = after.methods.copy() if after is not None else MethodReach()
    return _Walk(inside, limit, ignore or set(), methods).run(roots, data)

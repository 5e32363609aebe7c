"""What the user's training code can reach beyond the module it runs on, found without running it.

A replay runs the user's Python a second time (``training_step``, every ``forward``, a ``step_function``), on a
fake copy of the module. The copy holds the module's own state, but the code also reaches what the copy does not:
its closures, the globals its functions name, class attributes, random generators held outside, ``lru_cache`` functions.
:func:`reach_of` walks the code objects from a set of roots, reading names, closure cells and attributes (never
calling a property, a ``__getattr__`` or any user function), and lists those places so that the replay can save and
restore them, give the code fresh caches, or decide not to run at all.

What counts as the user's code: every function whose file is outside the Python installation and its
site-packages (a script, a notebook cell, a project checked out or installed in editable mode) and outside this
package. Libraries (torch, Lightning, transformers) are not walked: their module-level state is theirs.

The same walk tells whether the code uses APIs that refuse saved-tensor hooks (``torch.func``'s ``grad``,
``vjp``, ``jacrev``, ``hessian``; ``disable_saved_tensors_hooks``) or installs its own, which the sampled step's
counting must stand aside for.
"""

from __future__ import annotations

import array
import collections
import dis
import functools
import os
import random
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_vram.measure._torch_hooks import global_hooks, module_hooks_of

WALK_LIMIT = 20_000
"""The most objects one walk visits; past it the walk stops and says it is incomplete."""

DYNAMIC_NAMES = frozenset({"globals", "vars", "setattr", "getattr", "delattr", "exec", "eval", "sys"})
"""Global names through which code reaches names it computes at run time (``globals()["n"]``, ``sys.modules``)."""

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
"""Names whose use conflicts with the monitor's saved-tensor hooks (``torch.func.grad`` is matched as a pair)."""

_ATOMS = (int, float, complex, str, bytes, bool, type(None), range, torch.dtype, torch.device, torch.Size)


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots |= {os.path.dirname(os.path.abspath(__file__)).rsplit(os.sep, 1)[0]}  # this package
    roots |= {getattr(sys, "base_prefix", sys.prefix), sys.prefix}
    return tuple(sorted(os.path.join(os.path.realpath(root), "") for root in roots))


_LIBRARY_ROOTS = _library_roots()


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """Whether code from ``filename`` is the user's (outside the Python installation, site-packages and this package).

    >>> is_user_file(torch.__file__), is_user_file("<stdin>")
    (False, True)
    """
    if filename.startswith("<"):
        return not filename.startswith("<frozen")  # "<stdin>", "<string>", a notebook cell
    return not os.path.realpath(filename).startswith(_LIBRARY_ROOTS)


def _is_user_function(function: types.FunctionType) -> bool:
    return is_user_file(function.__code__.co_filename)


def _is_user_class(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    if filename is None:  # a class defined in __main__ run from stdin, or a builtin
        return cls.__module__ == "__main__"
    return is_user_file(filename)


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME", "DELETE_NAME"})
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR", "LOAD_SUPER_ATTR"})


@functools.lru_cache(maxsize=4096)
def code_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """The global names and the attribute names that ``code`` and the functions defined inside it use.

    >>> code_names((lambda: math.pi).__code__)
    (frozenset({'math'}), frozenset({'pi'}))
    """
    global_names: set[str] = set()
    attribute_names: set[str] = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_OPS:
            global_names.add(str(instruction.argval))
        elif instruction.opname in _ATTRIBUTE_OPS:
            attribute_names.add(str(instruction.argval))
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            inner_globals, inner_attributes = code_names(constant)
            global_names |= inner_globals
            attribute_names |= inner_attributes
    return frozenset(global_names), frozenset(attribute_names)


@dataclass(frozen=True)
class Slot:
    """A place holding a reference: a namespace's entry, a closure cell, or an object's attribute."""

    holder: Any
    key: str | None = None

    def get(self) -> Any:
        """The object held now (a missing entry raises ``KeyError`` or ``AttributeError``)."""
        if isinstance(self.holder, types.CellType):
            return self.holder.cell_contents
        if isinstance(self.holder, dict):
            return self.holder[self.key]
        return getattr(self.holder, self.key or "")

    def set(self, value: Any) -> None:
        """Point the place at ``value``."""
        if isinstance(self.holder, types.CellType):
            self.holder.cell_contents = value
        elif isinstance(self.holder, dict):
            self.holder[self.key] = value
        else:
            setattr(self.holder, self.key or "", value)


@dataclass
class Reach:
    """What the walked code can reach outside the module it runs on.

    ``slots``: global names, closure cells and class attributes it reads (rebinding one, ``global n; n += 1``,
    changes the user's state). ``objects``: mutable objects it can change in place (lists, dicts, sets, objects'
    attributes, random generators). ``tensors``: tensors held outside the module. ``arrays``: NumPy arrays.
    ``caches``: ``functools.lru_cache`` functions and the place each is read from. ``real_modules``: where the code
    reaches the trained module itself (a ``step_function`` closing over it), by path. ``hook_apis``: the
    saved-tensor-hook APIs the code names. ``unrestorable``: what the code reaches whose state cannot be saved (an
    iterator, a generator), by path. ``complete``: the walk ended before :data:`WALK_LIMIT`.
    """

    slots: list[Slot] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    arrays: list[Any] = field(default_factory=list)
    caches: list[tuple[Slot, Any]] = field(default_factory=list)
    real_modules: list[str] = field(default_factory=list)
    hook_apis: set[str] = field(default_factory=set)
    unrestorable: list[str] = field(default_factory=list)
    complete: bool = True

    def add(self, other: Reach) -> None:
        """Take in what ``other`` (another walk) found."""
        self.slots += other.slots
        self.objects += other.objects
        self.tensors += other.tensors
        self.arrays += other.arrays
        self.caches += other.caches
        self.real_modules += other.real_modules
        self.hook_apis |= other.hook_apis
        self.unrestorable += other.unrestorable
        self.complete = self.complete and other.complete


class _Walk:
    """One walk from code and data roots.

    An object reached through the module's own attributes (``data``) is a copy in the replay unless ``deepcopy``
    shares it; one reached through code (a closure, a global) is the user's own object.
    """

    def __init__(self, inside: set[int], limit: int, ignore: set[int]) -> None:
        self.reach = Reach()
        self._inside = inside
        self._ignore = ignore
        self._seen: set[tuple[int, bool]] = set()
        self._slots: set[tuple[int, str | None]] = set()
        self._limit = limit
        self._namespaces: set[int] = set()
        self._queue: collections.deque[tuple[Any, str, frozenset[str], bool]] = collections.deque()

    def run(self, roots: Iterable[tuple[str, Any]], data: Iterable[tuple[str, Any]] = ()) -> Reach:
        for path, root in roots:
            self._queue.append((root, path, frozenset(), False))
        for path, value in data:
            self._queue.append((value, path, frozenset(), True))
        while self._queue:
            if len(self._seen) >= self._limit:
                self.reach.complete = False
                break
            value, path, names, data_path = self._queue.popleft()
            self._visit(value, path, names, data_path)
        return self.reach

    def _push(self, value: Any, path: str, names: frozenset[str] = frozenset(), data: bool = False) -> None:
        if not isinstance(value, _ATOMS):
            self._queue.append((value, path, names, data))

    def _slot(self, holder: Any, key: str | None, path: str) -> None:
        marker = (id(holder), key)
        if marker not in self._slots:
            self._slots.add(marker)
            slot = Slot(holder, key)
            self.reach.slots.append(slot)
            try:
                value = slot.get()
            except (KeyError, AttributeError, ValueError):  # an empty cell, a name bound later
                return
            if isinstance(value, functools._lru_cache_wrapper):
                self.reach.caches.append((slot, value))
            self._push(value, path)

    def _visit(self, value: Any, path: str, names: frozenset[str], data: bool) -> None:
        if (id(value), data) in self._seen:
            return
        self._seen.add((id(value), data))
        if id(value) in self._ignore:
            return
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
        elif isinstance(value, _Remapped):
            self._push(value.function, path)
        elif isinstance(value, (staticmethod, classmethod)):
            self._push(value.__func__, path)
        elif isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                if accessor is not None:
                    self._push(accessor, path)
        elif isinstance(value, functools.partial):
            self._push(value.func, path)
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
        elif _is_numpy_array(value):
            self.reach.arrays.append(value)
            if value.dtype == object:
                for index, item in enumerate(value.flat):
                    self._push(item, f"{path}[{index}]", data=data)
        elif isinstance(value, (random.Random, torch.Generator, bytearray, array.array)) or _is_numpy_generator(value):
            self.reach.objects.append(value)
        elif isinstance(value, (list, set, collections.deque)):
            self.reach.objects.append(value)
            for index, item in enumerate(contents(value)):
                self._push(item, f"{path}[{index}]", data=data)
        elif isinstance(value, dict):
            self.reach.objects.append(value)
            for key, item in dict_items(value):
                self._push(key, f"{path} key", data=data)
                self._push(item, f"{path}[{_key_text(key)}]", data=data)
        elif isinstance(value, (tuple, frozenset)):
            for index, item in enumerate(contents(value)):
                self._push(item, f"{path}[{index}]", data=data)
        elif hasattr(type(value), "__next__"):  # an iterator or a generator: what it has yielded cannot be put back
            self.reach.unrestorable.append(f"{path} (a {type(value).__name__})")
        elif data and not _is_user_class(type(value)):
            return  # a library's object held by the module: the replay's deep copy holds its own copy
        else:
            self._instance(value, path, data)

    def _function(self, function: types.FunctionType, path: str) -> None:
        wrapped = getattr(function, "__wrapped__", None)
        if wrapped is not None:
            self._push(wrapped, path)
        if not _is_user_function(function):
            return
        code = function.__code__
        global_names, attribute_names = code_names(code)
        self._note_hook_apis(global_names | attribute_names, function.__globals__)
        where = f"{function.__qualname__}"
        namespace = function.__globals__
        if namespace is not None and id(namespace) not in self._namespaces:
            self._namespaces.add(id(namespace))
            self.reach.objects.append(namespace)  # a global rebound by any name (globals()[...], sys.modules)
        for name in sorted(global_names):
            if name in namespace:
                value = namespace[name]
                if isinstance(value, types.ModuleType):
                    self._push(value, f"{where}: {name}", attribute_names)
                elif not name.startswith("__"):
                    self._slot(namespace, name, f"{where}: global {name}")
        if global_names & DYNAMIC_NAMES:  # names computed at run time: every global of the module is in reach
            for name, value in dict_items(namespace):
                if not name.startswith("__") and not isinstance(value, types.ModuleType):
                    self._slot(namespace, name, f"{where}: global {name}")
        for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
            self._slot(cell, None, f"{where}: closure {name}")
        self._push(function.__defaults__, f"{where}: defaults")
        self._push(function.__kwdefaults__, f"{where}: defaults")

    def _note_hook_apis(self, names: frozenset[str], namespace: dict[str, Any]) -> None:
        found = names & SAVED_TENSOR_HOOK_NAMES
        if "func" in names and "grad" in names:
            found |= {"torch.func.grad"}
        for name in names:
            value = namespace.get(name)
            module = getattr(value, "__module__", None) or ""
            if callable(value) and module.startswith(("torch._functorch", "functorch")) and name != "vmap":
                found |= {f"torch.func.{name}"}
        self.reach.hook_apis |= found

    def _class(self, cls: type, path: str) -> None:
        if not _is_user_class(cls) or issubclass(cls, BaseException):
            return
        for base in cls.__mro__[1:]:
            self._push(base, path)
        for name, attribute in list(vars(cls).items()):
            if name.startswith("__") and name.endswith("__") and not callable(attribute):
                continue
            if isinstance(attribute, (types.FunctionType, staticmethod, classmethod, property)):
                self._push(attribute, f"{cls.__qualname__}.{name}")
            elif not isinstance(attribute, types.MemberDescriptorType | types.GetSetDescriptorType):
                self._slot(cls, name, f"{cls.__qualname__}.{name}")

    def _module(self, module: types.ModuleType, path: str, names: frozenset[str]) -> None:
        self._seen.discard((id(module), False))  # another function may read other names of the same module
        filename = getattr(module, "__file__", None)
        if filename is not None and not is_user_file(filename):
            return
        namespace = vars(module)
        for name in sorted(names & namespace.keys()):
            value = namespace[name]
            if not isinstance(value, types.ModuleType):
                self._slot(namespace, name, f"{path}.{name}")

    def _instance(self, value: Any, path: str, data: bool) -> None:
        attributes = instance_dict(value)
        if attributes is not None:
            self.reach.objects.append(value)
            for name, item in dict_items(attributes):
                self._push(item, f"{path}.{name}", data=data)
        if slot_names(type(value)):
            self.reach.objects.append(value)
            for name in slot_names(type(value)):
                try:
                    item = object.__getattribute__(value, name)
                except AttributeError:
                    continue
                self._push(item, f"{path}.{name}", data=data)
        self._push(type(value), path)


def contents(value: Any) -> list[Any]:
    """The items of a built-in container, read through the built-in type (a subclass's ``__iter__`` is not run)."""
    bases: tuple[type[Any], ...] = (list, tuple, set, frozenset, collections.deque)
    for base in bases:
        if isinstance(value, base):
            iterate: Callable[[Any], Iterable[Any]] = base.__iter__
            return list(iterate(value))
    return []


def slot_names(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` names of ``cls`` and its bases (``__dict__`` and ``__weakref__`` left out)."""
    names: list[str] = []
    for klass in cls.__mro__:
        declared = vars(klass).get("__slots__", ())
        declared = (declared,) if isinstance(declared, str) else declared
        names += [name for name in declared if name not in ("__dict__", "__weakref__") and name not in names]
    return tuple(names)


def dict_items(value: dict[Any, Any]) -> list[tuple[Any, Any]]:
    """A dict's items, read through ``dict`` itself (a subclass's ``items`` or ``__iter__`` is not run)."""
    return list(dict.items(value))


def instance_dict(value: Any) -> dict[str, Any] | None:
    """An object's own attribute dict, read without running its ``__getattr__`` or ``__getattribute__``."""
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except (AttributeError, TypeError):
        return None
    return attributes if isinstance(attributes, dict) else None


def _key_text(key: Any) -> str:
    """A dict key for a path: shown when it is a plain string or number (never a user's ``__repr__``)."""
    return repr(key) if type(key) in (str, int, float, bool) else f"<{type(key).__name__}>"


def _is_numpy_array(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _is_numpy_generator(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, (numpy.random.Generator, numpy.random.RandomState))


def inside_ids(module: nn.Module) -> set[int]:
    """The ids of ``module``'s own objects: itself, its submodules, parameters, buffers and their ``.grad``."""
    ids = {id(child) for child in module.modules()}
    for tensor in (*module.parameters(), *module.buffers()):
        ids.add(id(tensor))
        if tensor.grad is not None:
            ids.add(id(tensor.grad))
    return ids


@dataclass(frozen=True)
class _Remapped:
    """A method bound to the module's own object: the copy the replay runs rebinds it to the copy's object."""

    function: Any


def _root(value: Any, inside: set[int]) -> Any:
    if isinstance(value, types.MethodType) and id(value.__self__) in inside:
        return _Remapped(value.__func__)
    return value


def code_roots(
    module: nn.Module,
    step_function: Callable[..., Any] | None,
    optimizers: Iterable[Any] = (),
    batch: Any = None,
) -> list[tuple[str, Any]]:
    """Where the code a replay runs starts, before any copy exists.

    Each submodule's class, torch's process-wide module and optimizer hooks, the step function, the optimizers'
    classes and the batch's class. What the module's instances hold (hooks, callables, data) is walked on the copy:
    :func:`instance_roots`.
    """
    roots: list[tuple[str, Any]] = []
    classes: set[type] = set()
    for child in module.modules():
        if type(child) not in classes:
            classes.add(type(child))
            roots.append((type(child).__qualname__, type(child)))
    roots += [(f"torch's {kind}", hook) for kind, hook in global_hooks()]
    if step_function is not None:
        roots.append(("step_function", step_function))
    roots += [(type(optimizer).__qualname__, type(optimizer)) for optimizer in optimizers]
    if batch is not None and not isinstance(batch, (Tensor, list, tuple, dict)):
        roots.append(("the batch's class", type(batch)))
    return roots


def instance_roots(module: nn.Module) -> list[tuple[str, Any]]:
    """The hooks and callables each submodule of ``module`` (the replay's copy) holds as instance attributes.

    A method bound to one of the copy's own objects is its code only; anything else the copy shares with the
    user's module (a function closing over the real one) is reached through it.
    """
    inside = {id(child) for child in module.modules()}
    roots: list[tuple[str, Any]] = []
    for name, child in module.named_modules():
        label = name or "the model"
        attributes = vars(child)
        for kind, hook in module_hooks_of(attributes):
            roots.append((f"{label}: {kind}", _root(hook, inside)))
        for attribute, value in attributes.items():
            if callable(value) and not isinstance(value, (nn.Module, Tensor, type, dict)):
                roots.append((f"{label}.{attribute}", _root(value, inside)))
    return roots


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_trainer", "_fabric"})


def data_roots(module: nn.Module) -> list[tuple[str, Any]]:
    """The attributes of ``module`` (the replay's copy) that are neither tensors nor submodules.

    ``deepcopy`` copied most of them; what it shares (classes, weak references' targets, an object whose
    ``__deepcopy__`` returns itself) is the user's.
    """
    return [
        (f"{name or 'the model'}.{attribute}", value)
        for name, child in module.named_modules()
        for attribute, value in vars(child).items()
        if attribute not in _MODULE_INTERNALS
        and not attribute.endswith("_hooks")
        and not isinstance(value, (Tensor, nn.Module))
    ]


def reach_of(
    roots: Iterable[tuple[str, Any]],
    inside: set[int],
    data: Iterable[tuple[str, Any]] = (),
    ignore: set[int] | None = None,
    limit: int = WALK_LIMIT,
) -> Reach:
    """Walk from the code ``roots`` and the ``data`` roots (``(path, object)``).

    ``inside``: the ids of the trained module's own objects (code reaching one reaches the real model); ``ignore``:
    ids not to walk (the replay's copy of the module, whose state is its own).
    """
    return _Walk(inside, limit, ignore or set()).run(roots, data)

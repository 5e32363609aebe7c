"""The user's functions installed in torch's and Python's own namespaces, which a replay would call again.

A user may put a function of their own in a library's place: ``F.linear = counting_linear`` (a wrapper that counts
its calls, then calls the original), ``torch.Tensor.add = ...``, ``nn.Module.__call__ = ...``, ``builtins.print =
my_print``. The replay runs the step's Python again, and library code the step calls (torch's own, transformers')
reaches these names where the walk does not follow it, so the user's function would run once more in each replay:
a call counter read 7 after 6 training steps. :func:`installed_user_code` finds them, as a class: every value of the
namespaces :data:`NAMESPACES` and :data:`CLASSES` name (and of the library classes a walk passes, their bases
included: a module's ``nn.Linear``, an optimizer's ``SGD``; and of the modules that define them, whose functions
their methods call by name: ``SGD.step`` calls ``torch.optim.sgd.sgd``) that is the user's code by the file its code
objects name (:mod:`~.user_code`): a function, a method's function, a ``functools.partial`` of one, a wrapper whose
``__wrapped__`` chain (or whose closure) holds one (a ``functools.lru_cache`` wrapper, C's, by its ``__wrapped__``),
a class or an object of a class with functions of the user's.
Any one rules every replay out, whether the step names it or not (:func:`installed_refusal`).

It runs before each round of replays (the walk, :mod:`~.reach`) and before the CPU's host measurement
(:mod:`~lightning_vram.prediction.timing.host`): about 2,500 values, each library value (a function, a class, a
module) remembered by identity once judged, with a reference that keeps its id from being reused; the user's own
values are judged again each time and never held.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_vram.prediction.containment.plain_reads import instance_dict
from lightning_vram.prediction.containment.user_code import accessor_functions, is_user_class, is_user_file

NAMESPACES = (
    "torch",
    "torch.nn.functional",
    "torch.nn.init",
    "torch.linalg",
    "torch.special",
    "torch.fft",
    "torch.autograd",
    "torch.utils.checkpoint",
    "builtins",
)
"""Modules whose functions a step's library code calls by name, by their names in ``sys.modules`` (one not imported
holds nothing of the user's)."""

CLASSES: dict[str, type] = {
    "torch.Tensor": torch.Tensor,
    "torch.nn.Parameter": nn.Parameter,
    "torch.nn.Module": nn.Module,
}
"""Library classes whose methods every step calls (``torch.Tensor.add``, ``nn.Module.__call__``), by the name shown."""

NOT_CALLED = frozenset({("builtins", "_")})
"""Entries no library code calls: ``builtins._`` is the interactive interpreter's last result."""

REMEMBERED = 1 << 16
"""Library values :func:`installed_user_code` remembers; past it the memory is emptied and they are judged again."""

_LIBRARY: dict[int, object] = {}
"""Values judged not the user's, by id, each held so that its id is not reused while remembered."""

_PLAIN: dict[int, type] = {}
"""Library classes, by id: an object of one (a ``torch.dtype``, a ``str``) is not the user's code (a method of the
user's installed in the class is found in the class's dict, where it is searched) and is not judged again."""

_LIBRARY_CLASSES: dict[int, type] = {}
"""Classes found not the user's (:func:`~.user_code.is_user_class`), by id: their dicts are searched."""

_KEPT_KINDS = (types.FunctionType, types.ModuleType, type)
"""Kinds of value remembered by identity once judged the library's: functions, modules and classes, never data (a
dict of the user's in ``builtins`` is judged again each time rather than held). A built-in function or a descriptor is
passed by its class (:data:`_PLAIN`)."""


@dataclass(frozen=True)
class Installed:
    """A value of the user's code in a library's namespace.

    ``place``: where (``torch.nn.functional.linear``); ``what`` it is (``your function counting_linear (script.py:7)``).
    """

    place: str
    what: str

    def __str__(self) -> str:
        return f"{self.place} is {self.what}"


def _site(function: types.FunctionType) -> str:
    """``file:line`` of ``function``'s definition, the file by its name alone."""
    code = function.__code__
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"


def _shown_name(function: types.FunctionType) -> str:
    """``function``'s qualified name less the enclosing functions' (``counting_linear``, ``Counter.__call__``).

    As its code says it, from Python 3.11 (``functools.wraps`` gives the wrapper the wrapped function's name).
    """
    code = function.__code__
    name: str = getattr(code, "co_qualname", code.co_name)
    return name.rpartition("<locals>.")[2]


def _user_functions(cls: type) -> list[types.FunctionType]:
    """The user's functions in the dicts of ``cls`` and its bases, by their code's file; ``__call__``'s first.

    Methods, static and class methods, properties' accessors, each followed down its ``__wrapped__`` chain.
    """
    found = []
    for klass in cls.__mro__[:-1]:  # ``object``'s are C's
        for name, attribute in list(vars(klass).items()):
            for candidate in accessor_functions(attribute):
                for _ in range(8):  # a chain of decorators, never a cycle
                    if not issubclass(type(candidate), types.FunctionType):
                        break
                    if is_user_file(candidate.__code__.co_filename):
                        found.append((name != "__call__", candidate))
                        break
                    candidate = vars(candidate).get("__wrapped__")
    return [function for _, function in sorted(found, key=lambda item: item[0])]


def _of_function(function: types.FunctionType, depth: int, real_files: bool) -> str | None:
    """What of the user's ``function`` is or wraps: itself, a ``__wrapped__`` chain's function, a closure's value.

    ``real_files``: code from source of no file (``"<string>"``) is not the user's.
    """
    filename = function.__code__.co_filename
    if is_user_file(filename) and not (real_files and filename.startswith("<")):
        return f"your function {_shown_name(function)} ({_site(function)})"
    if depth <= 0:
        return None
    inner: list[Any] = [vars(function).get("__wrapped__")]
    for cell in function.__closure__ or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for value in inner:
        if value is not None and not issubclass(type(value), types.ModuleType):
            found = _of(value, depth - 1, real_files)
            if found is not None:
                return found
    return None


def _of(value: Any, depth: int = 2, real_files: bool = False) -> str | None:
    """What of the user's code ``value`` is (``None``: nothing), read without calling any of it.

    Types are tested on ``type(value)``: an ``isinstance`` would read a user object's ``__class__``. ``real_files``: a
    function from source of no file is not the user's (in a library class's dict, :func:`installed_user_code`).
    """
    kind = type(value)
    for _ in range(8):  # a chain of wrappers, never a cycle
        if issubclass(kind, (staticmethod, classmethod)):
            value = value.__func__
        elif issubclass(kind, types.MethodType):
            value = types.MethodType.__func__.__get__(value)
        elif issubclass(kind, functools.partial) and not _user_functions(kind):
            value = functools.partial.func.__get__(value)
        elif issubclass(kind, (functools.cached_property, functools.partialmethod)):
            value = value.func
        else:
            break
        kind = type(value)
    if issubclass(kind, types.FunctionType):
        return _of_function(value, depth, real_files)
    if issubclass(kind, property):
        accessors = (value.fget, value.fset, value.fdel)
        return next((found for accessor in accessors if (found := _of(accessor, depth, real_files)) is not None), None)
    if issubclass(kind, type):
        functions = _user_functions(value) if is_user_class(value) else []
        return f"your class {value.__qualname__} ({_site(functions[0])})" if functions else None
    if issubclass(kind, types.ModuleType):
        return None
    if not is_user_class(kind):  # a library's class whose method is the user's is found where the method is
        wrapped = (instance_dict(value) or {}).get("__wrapped__")
        if wrapped is not None:  # a wrapper of C's that ``functools.update_wrapper`` named (``lru_cache``'s)
            return _of(wrapped, depth - 1, real_files) if depth > 0 else None
        _remember(_PLAIN, kind)
        return None
    functions = _user_functions(kind)
    return f"an object of your class {kind.__qualname__} ({_site(functions[0])})" if functions else None


def _remember(memory: dict[int, Any], value: Any) -> None:
    """Keep ``value`` in ``memory`` by its id (emptied first when it holds :data:`REMEMBERED`)."""
    if len(memory) >= REMEMBERED:
        memory.clear()
    memory[id(value)] = value


def _judged(value: Any, real_files: bool = False) -> str | None:
    """:func:`_of`, remembered: library values by id (:data:`_LIBRARY`), objects by their class (:data:`_PLAIN`)."""
    kind = type(value)
    if _LIBRARY.get(id(value)) is value or _PLAIN.get(id(kind)) is kind:
        return None
    found = _of(value, real_files=real_files)
    if found is None and issubclass(kind, _KEPT_KINDS) and not (issubclass(kind, type) and is_user_class(value)):
        _remember(_LIBRARY, value)
    return found


def _namespaces(classes: Iterable[type]) -> Iterator[tuple[str, dict[str, Any], type | None]]:
    """Each namespace searched, with the name it is shown by and the class it is the dict of (``None``: a module's).

    Of ``classes``' bases, the user's own are left out: the walk walks them, and a library may make a class over one
    (FSDP2's ``FSDPBlock``, a parametrized module's class).
    """
    for name in NAMESPACES:
        module = sys.modules.get(name)
        if module is not None:
            yield name, vars(module), None
    shown = {id(cls): (name, cls) for name, cls in CLASSES.items()}
    modules = dict.fromkeys(NAMESPACES)
    for cls in classes:
        for klass in cls.__mro__[:-1]:  # ``object`` is C's and takes no attribute
            if id(klass) in shown:
                continue
            if _LIBRARY_CLASSES.get(id(klass)) is not klass:
                if is_user_class(klass):
                    continue
                _remember(_LIBRARY_CLASSES, klass)
            shown[id(klass)] = (f"{klass.__module__}.{klass.__qualname__}", klass)
            if klass.__module__ not in modules:
                modules[klass.__module__] = None
                module = sys.modules.get(klass.__module__)
                file = vars(module).get("__file__") if module is not None else None
                if isinstance(file, str) and not is_user_file(file):  # a library's (one the user's is the walk's)
                    yield klass.__module__, vars(module), None  # its methods call its functions (``SGD.step``: ``sgd``)
    for name, cls in shown.values():
        yield name, vars(cls), cls  # type: ignore[misc]  # a mappingproxy reads as a dict here


def installed_user_code(classes: Iterable[type] = ()) -> list[Installed]:
    """The user's code installed in :data:`NAMESPACES`, :data:`CLASSES` and ``classes``, in the order found.

    ``classes``: library classes (with their bases) the step's code passes. Empty when nothing of the user's is there.
    In a class's dict only code from the user's files counts: libraries make methods by ``exec`` (a dataclass's
    ``__init__`` and ``__hash__``, a named tuple's ``__new__``, mpmath's operators), whose file is ``"<string>"`` as for
    the user's code run by ``exec``.
    """
    found = []
    library, plain = _LIBRARY.get, _PLAIN.get  # :func:`_judged`'s first test, inline: most values pass it
    for shown, namespace, owner in _namespaces(classes):
        for name, value in tuple(namespace.items()):
            if library(id(value)) is value or plain(id(kind := type(value))) is kind:
                continue
            what = _judged(value, real_files=owner is not None)
            if what is not None and (shown, name) not in NOT_CALLED:
                found.append(Installed(f"{shown}.{name}", what))
    return found


SHOWN = 3
"""Places a refusal names before it counts the rest."""


def installed_refusal(installed: Sequence[Installed]) -> str | None:
    """Why code of the user's installed in a library's namespace rules the replay out; ``None`` when none is."""
    if not installed:
        return None
    named = "; ".join(map(str, installed[:SHOWN]))
    more = f" (and {len(installed) - SHOWN} more)" if len(installed) > SHOWN else ""
    return (
        f"{named}{more}: a replay would call it again. Library code the step calls (torch's own, transformers')"
        " reaches torch's and Python's functions by names the replay's walk does not follow, so a function of yours"
        " installed in their namespaces rules out every replay, whether the step names it or not"
    )

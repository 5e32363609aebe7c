"""Which code is the user's, and which names a piece of code reads: what a replay's walk starts from.

What counts as the user's code: every function whose file is outside the Python installation and its
site-packages (a script, a notebook cell, a project checked out or installed in editable mode) and outside this
package. Libraries (torch, Lightning, transformers) are not walked: their module-level state is theirs. A class is
the user's by its own code's file, not by a ``sys.modules`` entry it may not have (a class loaded with
``spec_from_file_location``, ``runpy.run_path`` or ``exec``).
"""

from __future__ import annotations

import dis
import functools
import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from typing import Any


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    package = os.path.abspath(__file__)
    for _ in range(__name__.count(".") + 1):  # up from this file to the folder of the top package
        package = os.path.dirname(package)
    roots |= {os.path.join(package, __name__.partition(".")[0])}  # this package
    roots |= {getattr(sys, "base_prefix", sys.prefix), sys.prefix}
    return tuple(sorted(os.path.join(os.path.realpath(root), "") for root in roots))


_LIBRARY_ROOTS = _library_roots()


FILES_REMEMBERED = 1 << 16
"""Files whose answer :func:`is_user_file` keeps. A process with torch, Lightning, DeepSpeed and transformers' GPT-2
imported holds 4,435 modules' files: a cache of 4,096 was cycled through by each walk of them, every answer worked out
again (``os.path.realpath``, about 50 µs): 2.2 s of the 44 s profiled in the ranks of tests/test_sharded_advice.py
and tests/hostile/test_live_sharded_steps.py."""


@functools.lru_cache(maxsize=FILES_REMEMBERED)
def is_user_file(filename: str) -> bool:
    """Whether code from ``filename`` is the user's (outside the Python installation, site-packages and this package).

    >>> is_user_file(functools.__file__), is_user_file("<stdin>"), is_user_file(sys.modules["lightning_vram"].__file__)
    (False, True, False)
    """
    if filename.startswith("<"):
        return not filename.startswith("<frozen")  # "<stdin>", "<string>", a notebook cell
    return not os.path.realpath(filename).startswith(_LIBRARY_ROOTS)


def is_user_function(function: types.FunctionType) -> bool:
    """Whether ``function`` is defined in the user's code."""
    return is_user_file(function.__code__.co_filename)


_HEAP_TYPE = 1 << 9
"""``Py_TPFLAGS_HEAPTYPE``: a class made by a ``class`` statement or ``type(...)``, not one of C's static types."""


def accessor_functions(attribute: Any) -> tuple[Any, ...]:
    """What a class attribute runs: a static or class method's function, a property's accessors, else itself.

    Tested on ``type(attribute)``: an ``isinstance`` would read a user object's ``__class__``.
    """
    kind = type(attribute)
    if issubclass(kind, (staticmethod, classmethod)):
        return (attribute.__func__,)
    if issubclass(kind, property):
        return (attribute.fget, attribute.fset, attribute.fdel)
    return (attribute,)


def _own_functions(cls: type) -> Iterator[types.FunctionType]:
    """The functions ``cls`` defines itself (methods, static and class methods, properties' accessors), unwrapped.

    A method a decorator wrapped (``@torch.no_grad()``) is followed through ``__wrapped__`` to the function it wraps:
    that one is the class's, not the decorator's wrapper (a user dataclass's ``__repr__`` is wrapped by
    ``dataclasses``' own code). A function defined for another class (``Enum.__new__``, which ``enum`` copies into
    each enum's ``__dict__``) is not the class's own: one defined in its body, or made for it (a dataclass's
    ``__init__``), has its ``__qualname__`` under the class's.
    """
    prefix = f"{cls.__qualname__}."
    for attribute in list(vars(cls).values()):
        for candidate in accessor_functions(attribute):
            innermost = None
            for _ in range(8):  # a chain of decorators, never a cycle
                if not isinstance(candidate, types.FunctionType):
                    break
                innermost = candidate
                candidate = vars(candidate).get("__wrapped__")
            if innermost is not None and innermost.__qualname__.startswith(prefix):
                yield innermost


def is_user_class(cls: type) -> bool:
    """Whether ``cls`` is defined in the user's code, however it got into the process.

    Decided first by its own functions' files (a class from ``spec_from_file_location`` and ``exec_module``,
    ``runpy.run_path`` or ``exec`` of a file's compiled code has no entry in ``sys.modules``, but its code names the
    file); then by its module's file; a class whose module is not in ``sys.modules`` at all was loaded by hand
    (``exec`` of source into a fresh namespace: its code's file is ``"<string>"``), and so is a class that says it
    is ``builtins``' but is not one of C's own types.

    >>> is_user_class(functools.partial), is_user_class(type("Made", (), {"__module__": "not_imported"}))
    (False, True)
    """
    files = {function.__code__.co_filename for function in _own_functions(cls)}
    real_files = {filename for filename in files if not filename.startswith("<")}
    if real_files:
        return any(is_user_file(filename) for filename in real_files)
    name = cls.__module__
    module = sys.modules.get(name)
    if module is None:
        return True
    filename = vars(module).get("__file__")
    if isinstance(filename, str):
        return is_user_file(filename)
    heap_type = bool(type.__dict__["__flags__"].__get__(cls) & _HEAP_TYPE)
    return name == "__main__" or (name == "builtins" and heap_type)


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


@functools.lru_cache(maxsize=4096)
def imports(code: types.CodeType) -> frozenset[tuple[str, int, frozenset[str]]]:
    """The ``import`` statements of ``code`` and the functions defined inside it.

    Each module's name as written, its level (the dots of a relative import) and the names imported from it
    (``from m import a, b``).

    >>> def step():
    ...     import os.path
    ...     from .helpers import make
    >>> sorted(imports(step.__code__))
    [('helpers', 1, frozenset({'make'})), ('os.path', 0, frozenset())]
    """
    found: set[tuple[str, int, frozenset[str]]] = set()
    instructions = list(dis.get_instructions(code))
    for index, instruction in enumerate(instructions):
        if instruction.opname == "IMPORT_NAME":
            level_load, names_load = instructions[index - 2], instructions[index - 1]
            level = level_load.argval if isinstance(level_load.argval, int) else 0
            names = names_load.argval if isinstance(names_load.argval, tuple) else ()
            found.add((str(instruction.argval), level, frozenset(map(str, names))))
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            found |= imports(constant)
    return frozenset(found)

"""Which code is the user's, and which names a piece of code reads: what a replay's walk starts from.

What counts as the user's code: every function whose file is outside the Python installation and its
site-packages (a script, a notebook cell, a project checked out or installed in editable mode) and outside this
package. Libraries (torch, Lightning, transformers) are not walked: their module-level state is theirs.
"""

from __future__ import annotations

import dis
import functools
import os
import sys
import sysconfig
import types


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


@functools.lru_cache(maxsize=4096)
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


def is_user_class(cls: type) -> bool:
    """Whether ``cls`` is defined in the user's code (``__main__`` included)."""
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

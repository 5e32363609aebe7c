"""Which classes the code a replay runs may construct, and so which of their construction dunders it may run.

Python calls a class's ``__init__``, ``__new__`` (and a dataclass's ``__post_init__``) only when the class is
constructed. A LightningModule whose ``__init__`` parses ``sys.argv`` or ``exec``s a configuration is never constructed
by its training step: walking that ``__init__`` would refuse every replay of the run for code no replay runs. Only a
module's construction is left out (:data:`LEFT_OUT_ONLY_FOR`): other classes' instances are rebuilt by library code the
walk does not read (``dict.fromkeys``, ``apply_to_collection``, a ``defaultdict``'s factory), and classes are created
by it (the enum and dataclass functional APIs, a metaclass called with three arguments), so their construction and
every class's creation dunders (``__init_subclass__``, ``__set_name__``, ``__prepare__``) are always walked. A
module's construction dunders are in reach (:class:`Construction`) where:

- the walk reaches the class as a value (a global or closure the code names, a class attribute, a
  ``functools.partial``'s function, an attribute of the module holding a class): code holding a class may call it;
  its bases' too, which its ``__init__`` may call through ``super()`` or inherit;
- the replay constructs it itself: an optimizer's class (``type(optimizer)(param_groups)``), the batch's class
  (Lightning's transfer rebuilds a named tuple or a dataclass);
- a classmethod of the class (or of a base) is in reach (``cls(...)``): every subclass;
- walked code reads ``__init__`` or ``__new__`` through ``super()`` (a method's own class's bases);
- walked code constructs classes the walk cannot name (:func:`constructions`, :data:`CONSTRUCTING`): ``type(x)(...)``,
  ``x.__class__(...)`` (where the class may be called: ``type(self).__name__``, ``x.__class__ is y.__class__`` or
  ``isinstance(x, type(self))`` do not count), ``type(x).__call__()``, ``type(x).mro()[0]()``,
  ``x.__class__.__subclasses__()``, a name of these held as a string (``getattr(x, "__class__")``),
  ``x.__init__(...)``, ``pickle.loads``, ``torch.load``,
  ``dataclasses.replace``, ``asdict`` or ``astuple`` (which rebuild each container they copy by calling its class:
  a dict subclass's ``__init__``), under whatever name the code binds them: every class's are in reach; where it only
  copies (``copy.copy``, ``copy.deepcopy``: :data:`COPYING`), every class's ``__new__``, and the whole construction of
  those a library base rebuilds by calling them.

A class whose instances the replay deep-copies (the module's classes, what the module holds as data) is copied
through ``__new__`` (``copyreg.__newobj__``), never its ``__init__``, unless a library base of it rebuilds instances
by calling the class (``OrderedDict.__reduce__``: :data:`REBUILDING`); library code may subclass the module's classes
(``torch.nn.utils.parametrize``, FSDP2), which runs their ``__init_subclass__`` and their metaclass's construction.
Walked code creating classes (a ``class`` statement, ``type(name, bases, namespace)``, ``types.new_class``) puts
every class's creation dunders, and every metaclass's construction, in reach.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import dis
import enum
import functools
import pickle
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_vram.prediction.containment.user_code import is_user_class

CONSTRUCTION_DUNDERS = frozenset({"__init__", "__new__", "__post_init__"})
"""What Python (or a dataclass's generated ``__init__``) calls only when the class is constructed."""

CREATION_DUNDERS = frozenset({"__init_subclass__", "__set_name__", "__prepare__"})
"""What Python calls only when a class is created (on the new class's bases, its attributes, its metaclass)."""

COPIED_DUNDERS = frozenset({"__new__", "__init_subclass__"})
"""What a copy (``deepcopy``'s ``copyreg.__newobj__``) or a library's subclass of a copied class runs."""

REBUILDING = frozenset({"__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__"})
"""Names through which a library base of a copied class may rebuild its instances by calling the class."""

HARMLESS_CALLEES = frozenset({"isinstance", "issubclass", "print", "repr", "str", "id", "hash", "format"})
"""Builtins that, given a class (``isinstance(x, type(self))``), never call it."""

COPYING_GLOBALS = frozenset({"copy", "deepcopy"})
COPYING_ATTRIBUTES = frozenset({"deepcopy", "__copy__", "__deepcopy__"})
"""Global and attribute names through which code copies objects it does not name (``copy.copy(x)``,
``x.__deepcopy__(memo)``): through ``__new__`` (``copyreg.__newobj__``), or what a ``__reduce__`` returns."""

COPYING = frozenset(map(id, (copy, copy.copy, copy.deepcopy)))
"""The ``copy`` module and its functions, by identity (``from copy import deepcopy as dc``)."""


CONSTRUCTING = frozenset(
    map(
        id,
        (
            type,
            copyreg,
            dataclasses,
            pickle,
            pickle.load,
            pickle.loads,
            pickle.Unpickler,
            dataclasses.replace,
            dataclasses.asdict,
            dataclasses.astuple,
            torch.load,
            types.new_class,
        ),
    )
)
"""Modules and callables, by identity, that construct classes they are not named (``from copy import deepcopy as
dc``, ``torch.load`` unpickling the user's classes): whatever name the code binds them to."""

LEFT_OUT_ONLY_FOR = torch.nn.Module
"""The classes whose construction dunders the walk leaves out where the step does not construct them: modules (a
LightningModule's ``__init__`` reading ``sys.argv``), which no library rebuilds as it rebuilds containers and
records."""

CONSTRUCTING_NAMES = frozenset({"__init__", "__new__", "__class__", "__call__", "mro", "__subclasses__"})
"""Attributes read (or names held as strings, for ``getattr``) through which code reaches a class it does not name
and may call it: ``type(x).__call__()``, ``type(x).mro()[0]()``, ``x.__class__.__subclasses__()[0]()``."""

CREATING = frozenset(map(id, (type, types.new_class)))
"""Callables, by identity, that create classes."""


class Role(enum.Enum):
    """How the walk reaches a class: what that tells of its construction."""

    VALUE = "value"
    """As a value the code holds (it may call it), or one the replay constructs: its construction is in reach."""
    COPIED = "copied"
    """As the class of what the replay deep-copies: its ``__new__`` and ``__init_subclass__`` are in reach."""
    NAMED = "named"
    """As a base, a metaclass, or the class of an object the code holds: its construction is not in reach."""


@dataclass(frozen=True)
class Copied:
    """A root class whose instances the replay deep-copies (a submodule's), and library code may subclass."""

    cls: type


@dataclass(frozen=True)
class Constructions:
    """How a piece of code constructs or creates classes (:func:`constructions`).

    ``anything``: it constructs classes it does not name (``type(x)(...)``, ``x.__init__()``). ``copies``: it copies
    objects it does not name (``copy.deepcopy``).
    ``supers``: it reads ``__init__`` or ``__new__`` through ``super()`` (its own class's bases). ``own_class``: it
    reads the ``__class__`` cell itself (``__class__(...)``), not only through ``super()``. ``creates``: it creates
    classes (a ``class`` statement, ``type(name, bases, namespace)``).
    """

    anything: bool
    copies: bool
    supers: bool
    own_class: bool
    creates: bool


_SUPER_CALL = ("LOAD_GLOBAL", "PRECALL", "CALL")
_CALL = "PRECALL" if "PRECALL" in dis.opmap else "CALL"  # Python 3.11 counts a call's operands at its PRECALL
_JUMPS = frozenset({*dis.hasjrel, *dis.hasjabs, *getattr(dis, "hasjump", ())})
_COMPARES = frozenset({"IS_OP", "COMPARE_OP"})
_CELL_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})
_ATTRIBUTE_READS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


def _through_super(instructions: list[dis.Instruction], index: int) -> bool:
    """Whether the attribute read at ``index`` is on ``super()`` called with no argument (``super().__init__``)."""
    read = instructions[index]
    if read.opname == "LOAD_SUPER_ATTR":  # Python 3.12: super()'s class, from its cell or named (then constructed)
        return True
    before = [instruction for instruction in instructions[max(0, index - 4) : index] if instruction.opname != "CACHE"]
    names = tuple(instruction.opname for instruction in before[-3:])
    if names == _SUPER_CALL:
        load, precall, call = before[-3:]
        return load.argval == "super" and precall.arg == 0 and call.arg == 0
    if len(before) >= 2 and (before[-2].opname, before[-1].opname) == ("LOAD_GLOBAL", "CALL"):
        return before[-2].argval == "super" and before[-1].arg == 0
    return False


def _effect(instruction: dis.Instruction) -> int | None:
    argument = instruction.arg if instruction.opcode >= dis.HAVE_ARGUMENT else None
    try:
        return dis.stack_effect(instruction.opcode, argument, jump=False)
    except ValueError:
        return None


def _harmless_callee(instructions: list[dis.Instruction], start: int, slot: int) -> bool:
    """Whether stack ``slot`` holds one of :data:`HARMLESS_CALLEES` (a global loaded before ``start``).

    ``slot`` ``0`` is the top of the stack before ``start``, lower ones below it; read back over the straight run of
    instructions before ``start`` (a jump: not known).
    """
    after = 0
    for instruction in reversed(instructions[:start]):
        effect = _effect(instruction)
        if effect is None or instruction.opcode in _JUMPS:
            return False
        before = after - effect
        if before < slot <= after:
            return instruction.opname == "LOAD_GLOBAL" and instruction.argval in HARMLESS_CALLEES
        after = before
    return False


def _called(instructions: list[dis.Instruction], start: int, top: int) -> bool:
    """Whether the class on top of the stack once ``instructions[start - 1]`` ran (at depth ``top``) may be called.

    Followed over the straight run of instructions after it: an attribute read on it (``type(self).__name__``), a
    comparison (``x.__class__ is y.__class__``) or a call to a builtin that only looks at it (``isinstance``) is no
    call. Anything the run does not show (it is stored, returned, passed to another callable, or a jump comes first):
    it may be called.
    """
    depth = top
    for index in range(start, len(instructions)):
        instruction = instructions[index]
        name = instruction.opname
        if instruction.opcode in _JUMPS:
            return True
        if name in ("LOAD_ATTR", "LOAD_METHOD") and depth == top:
            return False
        if name in _COMPARES and depth - 2 < top:
            return False
        if name == _CALL:
            callable_slot = depth - (instruction.arg or 0)
            if callable_slot == top:
                return True
            if callable_slot < top:  # an argument: to what?
                return not _harmless_callee(instructions, start, callable_slot - top)
        effect = _effect(instruction)
        if effect is None:
            return True
        depth += effect
        if depth < top:
            return True
    return True


def _class_called(instructions: list[dis.Instruction], index: int) -> bool:
    """Whether the class read at ``index`` as ``x.__class__`` may be called (``self.__class__(...)``)."""
    read = instructions[index]
    return read.opname == "LOAD_METHOD" or _called(instructions, index + 1, _effect(read) or 1)


def _type_use(instructions: list[dis.Instruction], index: int) -> tuple[bool, bool]:
    """What ``type``, loaded at ``index``, is used for: whether it constructs a class, whether it creates one.

    Called with one argument, its result is a class, followed by :func:`_called`; with three, it creates a class
    (whose metaclass may construct anything); anything else (stored, passed on): both.
    """
    top = _effect(instructions[index]) or 1
    depth = top
    for position in range(index + 1, len(instructions)):
        instruction = instructions[position]
        if instruction.opcode in _JUMPS:
            break
        if instruction.opname == _CALL and depth - (instruction.arg or 0) == top:
            if instruction.arg == 1:
                result = depth - 2  # the call's operands, its callable and the NULL below it give way to its result
                following = position + 1 + (instruction.opname == "PRECALL")
                return _called(instructions, following, result), False
            break
        if instruction.opname == _CALL and depth - (instruction.arg or 0) < top:  # ``isinstance(x, type)``
            harmless = _harmless_callee(instructions, index + 1, depth - (instruction.arg or 0) - top)
            return not harmless, not harmless
        effect = _effect(instruction)
        if effect is None:
            break
        depth += effect
        if depth < top:
            break
    return True, True


@functools.lru_cache(maxsize=4096)
def constructions(code: types.CodeType) -> Constructions:
    """How ``code`` (or a function defined in it) constructs or creates classes.

    >>> constructions((lambda self: type(self)()).__code__).anything
    True
    >>> constructions((lambda self, other: self.__class__ is other.__class__ or type(self).__name__).__code__).anything
    False
    >>> constructions((lambda x, y: isinstance(x, type) and isinstance(y, type(x))).__code__).anything
    False
    >>> constructions((lambda self: self.weight.sum()).__code__)
    Constructions(anything=False, copies=False, supers=False, own_class=False, creates=False)
    """
    instructions = list(dis.get_instructions(code))
    anything = copies = supers = own_class = creates = False
    for index, instruction in enumerate(instructions):
        name = instruction.argval
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            if name == "type":
                constructs, creating = _type_use(instructions, index)
                anything, creates = anything or constructs, creates or creating
            copies = copies or name in COPYING_GLOBALS
            creates = creates or name == "new_class"
        elif instruction.opname in _ATTRIBUTE_READS:
            anything = anything or (name == "__class__" and _class_called(instructions, index))
            anything = anything or name in ("__call__", "mro", "__subclasses__")
            copies = copies or name in COPYING_ATTRIBUTES
            creates = creates or name == "new_class"
            if name in ("__init__", "__new__"):
                through_super = _through_super(instructions, index)
                supers = supers or through_super
                anything = anything or not through_super
        elif instruction.opname in _CELL_LOADS:
            own_class = own_class or name == "__class__"
        elif instruction.opname == "LOAD_BUILD_CLASS":
            creates = True
    anything = anything or bool(CONSTRUCTING_NAMES & {c for c in code.co_consts if isinstance(c, str)})
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            inner = constructions(constant)
            anything, copies = anything or inner.anything, copies or inner.copies
            supers, own_class, creates = supers or inner.supers, own_class or inner.own_class, creates or inner.creates
    return Constructions(anything, copies, supers, own_class, creates)


def rebuilt_by_library(cls: type) -> bool:
    """Whether a library class in ``cls``'s MRO (not ``object``) copies its instances its own way (:data:`REBUILDING`).

    >>> import collections
    >>> rebuilt_by_library(collections.OrderedDict), rebuilt_by_library(type("Plain", (), {}))
    (True, False)
    """
    return any(
        base is not object and not is_user_class(base) and bool(REBUILDING & vars(base).keys()) for base in cls.__mro__
    )


Member = tuple[type, str, Any]
"""A class's attribute, waiting for its name: the class, the name, the value in the class's ``__dict__``."""


@dataclass
class Construction:
    """The classes whose construction (or creation) dunders are in reach so far, and those waiting.

    Classes are kept by id (a metaclass may make its classes unhashable). ``constructed``: classes whose construction
    dunders are in reach (with every class in their MRO). ``copied``: classes the replay copies (``__new__``,
    ``__init_subclass__``). ``factories``: classes a classmethod in reach may construct (``cls(...)``): each subclass.
    ``anything``: every class's construction dunders. ``copies``: every class's ``__new__`` (walked code copies
    objects it does not name). ``creates``: every class's creation dunders, and every metaclass's construction.
    ``waiting``: members not in reach yet, by their class's id.
    """

    constructed: set[int] = field(default_factory=set)
    copied: set[int] = field(default_factory=set)
    factories: dict[int, type] = field(default_factory=dict)
    anything: bool = False
    copies: bool = False
    creates: bool = False
    waiting: dict[int, list[Member]] = field(default_factory=dict)

    def copy(self) -> Construction:
        """A copy to go on from, which changes nothing in this one."""
        waiting = {key: list(members) for key, members in self.waiting.items()}
        known = set(self.constructed), set(self.copied), dict(self.factories)
        return Construction(*known, self.anything, self.copies, self.creates, waiting)

    def in_reach(self, cls: type, name: str) -> bool:
        """Whether ``cls``'s construction or creation dunder ``name`` may run.

        Only a module's construction is ever left out (:data:`LEFT_OUT_ONLY_FOR`): other classes' instances are
        rebuilt by library code the walk does not read (``dict.fromkeys``, ``apply_to_collection``, a
        ``defaultdict``'s factory, the enum and dataclass functional APIs), so their construction and every class's
        creation dunders are always in reach.
        """
        if self.anything or name in CREATION_DUNDERS or not issubclass(cls, LEFT_OUT_ONLY_FOR):
            return True
        copied = name in COPIED_DUNDERS and (self.copies or id(cls) in self.copied)
        if name in CREATION_DUNDERS:
            return self.creates or copied
        return id(cls) in self.constructed or (self.creates and issubclass(cls, type)) or copied

    def admits(self, member: Member) -> bool:
        """Whether ``member`` (a construction or creation dunder) is in reach; if not, it waits for its class."""
        if self.in_reach(member[0], member[1]):
            return True
        self.waiting.setdefault(id(member[0]), []).append(member)
        return False

    def _release(self, keys: Iterable[int]) -> list[Member]:
        """The members waiting under ``keys`` (classes' ids) now in reach; the others wait on."""
        released: list[Member] = []
        for key in keys:
            members = self.waiting.pop(key, [])
            kept = [member for member in members if not self.in_reach(member[0], member[1])]
            released += [member for member in members if self.in_reach(member[0], member[1])]
            if kept:
                self.waiting[key] = kept
        return released

    def waiting_classes(self) -> list[type]:
        """The classes some of whose members wait."""
        return [members[0][0] for members in self.waiting.values()]

    def take(self, classes: Iterable[type]) -> list[Member]:
        """The members of ``classes`` that waited, all of them (the classes are wholly in reach)."""
        return [member for cls in classes for member in self.waiting.pop(id(cls), [])]

    def visit(self, cls: type) -> list[Member]:
        """A class the walk meets: its construction, where something in reach may construct it without naming it.

        A classmethod in reach of one of its bases (``cls()``), or walked code copying objects where a library base of
        it rebuilds copies by calling it (``OrderedDict.__reduce__``).
        """
        if any(id(base) in self.factories for base in cls.__mro__) or (self.copies and rebuilt_by_library(cls)):
            return self.construct([cls])
        return []

    def construct(self, classes: Iterable[type]) -> list[Member]:
        """Put the construction of ``classes`` (and their bases) in reach; the members that waited."""
        new = {id(base) for cls in classes for base in cls.__mro__} - self.constructed
        self.constructed |= new
        return self._release(new)

    def copy_class(self, cls: type) -> list[Member]:
        """``cls``'s instances are copied (and it may be subclassed by library code): the members that waited."""
        new = {id(base) for base in cls.__mro__} - self.copied
        self.copied |= new
        return self._release(new)

    def add_factory(self, cls: type) -> list[Member]:
        """A classmethod of ``cls`` is in reach: ``cls`` and its subclasses the walk met are constructed."""
        if id(cls) in self.factories:
            return []
        self.factories[id(cls)] = cls
        return self.construct([known for known in self.waiting_classes() if issubclass(known, cls)] + [cls])

    def construct_everything(self) -> list[Member]:
        """Every class's construction and creation dunders are in reach; every member that waited."""
        if self.anything:
            return []
        self.anything = True
        return self._release(list(self.waiting))

    def copy_everything(self) -> list[Member]:
        """Walked code copies objects it does not name: the members that waited for it.

        Every class's ``__new__``, and the whole construction of each a library base rebuilds by calling it.
        """
        if self.copies:
            return []
        self.copies = True
        rebuilt = [cls for cls in self.waiting_classes() if rebuilt_by_library(cls)]
        return self.construct(rebuilt) + self._release(list(self.waiting))

    def create_classes(self) -> list[Member]:
        """Walked code creates classes: creation dunders and metaclasses' construction; the members that waited."""
        if self.creates:
            return []
        self.creates = True
        return self._release(list(self.waiting))

"""Which methods of the user's classes the code a replay runs may call: those whose name is in reach.

A replay runs ``training_step`` (or a ``step_function``), every ``forward`` through ``nn.Module.__call__``, the
module's and torch's hooks, ``optimizer_zero_grad``, backward, each optimizer's ``step``; the sampled real step runs
Lightning's batch-level hooks around the same. A method none of that can call need not be walked: a LightningModule's
``export`` that calls ``torch.save``, or a ``validation_step`` that writes a file, would otherwise rule out every
replay of the run. A method's name is in reach when:

- it is a dunder (Python calls those by itself: ``__call__``, ``__getattr__``, ``__deepcopy__``), but for those Python
  calls only as it constructs or creates a class (``__init__``, ``__new__``, ``__init_subclass__``): those are in reach
  where the step may construct the class (:mod:`~.construction`);
- a library class (torch's, Lightning's) in the MRO of a user class the walk visits defines it: library code the step
  runs may call an override by its name (``forward``, ``training_step``, ``on_before_backward``, an optimizer's
  ``step``), except Lightning's hooks that run outside a training batch (:data:`OUTSIDE_BATCH_HOOKS`);
- library code calls it on any object that has it (:data:`PROTOCOL_NAMES`: a batch's ``to``);
- walked user code reads an attribute by that name (``self.export()``, ``super().export``), holds it as a string
  constant (``getattr(self, "export")``) or as an attribute in a constant format string's field (``"{0.line}"``,
  which ``str.format`` reads);
- walked code reads ``trainer`` (``self.trainer.save_checkpoint(...)``): the trainer's code may run any of Lightning's
  hooks, :data:`OUTSIDE_BATCH_HOOKS` come in reach;
- walked code reads attributes by names it computes (:func:`computed_names`: ``getattr(self, name)``, a format string
  it does not hold as a constant, ``attrgetter`` or ``methodcaller`` under any name): every name is in reach; where it
  only sets or deletes them (``setattr(module, name, value)``), every data descriptor (a property's setter) is.

A class with no library base whose instance a library's object holds (a duck-typed logging filter in a Logger's
``filters``) is wholly in reach: the library calls its methods by names of its own, which the walk cannot read
(:meth:`MethodReach.bring_class`; a class with a library base is called by the names that base defines).

Methods whose name is not in reach are parked (:class:`MethodReach`) and walked as soon as it comes in reach, whatever
the order the walk meets the classes and the code in. A class's other attributes (a class-level list, a counter)
follow the same rule: one no code in reach names is neither saved nor put back, as nothing the replay runs can change
it. What code holds as an object (a bound method, a hook, a function in a closure, a ``functools.partial``) is walked
whatever its name.
"""

from __future__ import annotations

import dis
import functools
import inspect
import operator
import re
import string
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lightning_vram.prediction.containment.construction import (
    CONSTRUCTION_DUNDERS,
    CREATION_DUNDERS,
    Construction,
    Member,
)

OUTSIDE_BATCH_HOOKS = frozenset(
    {
        # lightning.pytorch.core.hooks.ModelHooks: fit, epoch and other loops' hooks
        "on_fit_start",
        "on_fit_end",
        "on_train_start",
        "on_train_end",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_validation_start",
        "on_validation_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_validation_model_eval",
        "on_validation_model_train",
        "on_validation_model_zero_grad",
        "on_test_start",
        "on_test_end",
        "on_test_epoch_start",
        "on_test_epoch_end",
        "on_test_batch_start",
        "on_test_batch_end",
        "on_test_model_eval",
        "on_test_model_train",
        "on_predict_start",
        "on_predict_end",
        "on_predict_epoch_start",
        "on_predict_epoch_end",
        "on_predict_batch_start",
        "on_predict_batch_end",
        "on_predict_model_eval",
        "configure_sharded_model",
        # lightning.pytorch.core.hooks.DataHooks, but for the batch's transfer
        "prepare_data",
        "setup",
        "teardown",
        "train_dataloader",
        "val_dataloader",
        "test_dataloader",
        "predict_dataloader",
        # lightning.pytorch.core.hooks.CheckpointHooks
        "on_save_checkpoint",
        "on_load_checkpoint",
        # LightningModule: the other loops' steps, callbacks, and what only the user calls (exports, loading)
        "validation_step",
        "test_step",
        "predict_step",
        "configure_callbacks",
        "to_onnx",
        "to_torchscript",
        "to_tensorrt",
        "load_from_checkpoint",
    }
)
"""Lightning's hooks and methods that neither a training batch nor a replay runs (Lightning 2.x).

Still in reach: ``training_step``, ``on_train_batch_start``/``_end``, ``on_before_backward``, ``backward``,
``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``, ``optimizer_step``,
``optimizer_zero_grad``, ``on_before_zero_grad``, ``lr_scheduler_step``, the batch's transfer hooks, and
``configure_optimizers`` and ``configure_model``, which a replay calls to build its optimizers and shards."""

LIGHTNING_MODULES = ("lightning.pytorch.", "pytorch_lightning.")
"""Where the classes defining :data:`OUTSIDE_BATCH_HOOKS` live (the unified package and the standalone one)."""

PROTOCOL_NAMES = frozenset({"to", "pin_memory", "right_inverse", "write", "flush", "read", "readline", "close", "keys"})
"""Names library code calls on any object that has them, whatever its classes: Lightning moves a batch with its
``to`` (``move_data_to_device``), torch's DataLoader pins one with its ``pin_memory``, ``torch.nn.utils.parametrize``
sets a parametrized weight through its parametrization's ``right_inverse``; Python's own code treats an object as a
file (``print(..., file=sink)``, ``json.dump``, ``pickle.load``: ``write``, ``flush``, ``read``, ``readline``), closes
it (``contextlib.closing``: ``close``) or unpacks it as a mapping (``{**mapping}``, ``dict(mapping)``: ``keys``)."""

TRAINER_NAMES = frozenset({"trainer", "_trainer"})
"""Names through which code reaches Lightning's Trainer, whose code may call any of the module's hooks."""

COMPUTING_GLOBALS = frozenset({"vars", "eval", "exec", "inspect"})
"""Global names through which code reaches an object's attributes by names it computes or runs code it builds."""

READING_ATTRIBUTES = frozenset(
    {
        "__dict__",
        "__getattribute__",
        "__getattr__",
        "getattr",
        "hasattr",
        "attrgetter",
        "methodcaller",
        "getmembers",
        "getattr_static",
    }
)
"""Attribute names through which code reads attributes by names it computes (``operator.attrgetter(name)``,
``object.__getattribute__(self, name)``, ``self.__dict__[name]``)."""

READING_CALLABLES = frozenset(
    map(id, (getattr, hasattr, vars, operator.attrgetter, operator.methodcaller, inspect.getmembers))
)
"""Callables reading attributes by the names they are given, by identity: under whatever name the code binds them
(``from operator import methodcaller``, ``get = getattr``), or held as objects (:func:`names_computed_by`)."""

WRITING_CALLABLES = frozenset(map(id, (setattr, delattr)))

WRITING_ATTRIBUTES = frozenset({"__setattr__", "__delattr__", "setattr", "delattr"})
"""Attribute names through which code sets or deletes attributes by names it computes (``object.__setattr__``)."""

BY_NAME_BUILTINS = {"getattr": (2, 3), "hasattr": (2,), "setattr": (3,), "delattr": (2,)}
"""Builtins reaching an attribute by the name passed second, and how many arguments each takes. ``getattr`` and
``hasattr`` read it (a method, a property's getter); ``setattr`` and ``delattr`` can run only a data descriptor's
setter or deleter (a property's), or the class's ``__setattr__``: no other method."""

WRITING_BUILTINS = frozenset({"setattr", "delattr"})

ACCESS_DUNDERS = frozenset({"__getattr__", "__getattribute__", "__setattr__", "__delattr__"})
"""Methods Python calls with the name of an attribute read or set elsewhere: passing that name on (``getattr(
self.block, name)``, ``super().__getattr__(name)``) reaches only names already in reach."""

FORMATTING_ATTRIBUTES = frozenset({"format", "format_map"})
"""``str``'s methods that read the attributes its fields name (``"{0.line}"``): on a format string held as a constant,
those names are in reach (:func:`string_names`); on any other, every name is."""

_JUMPS = frozenset({*dis.hasjrel, *dis.hasjabs, *getattr(dis, "hasjump", ())})
_CALLS = frozenset({"CALL", "PRECALL", "CALL_FUNCTION"})


def _stack_effect(instruction: dis.Instruction) -> int | None:
    """How many items ``instruction`` leaves on the stack, net, where it does not jump; ``None`` where not known."""
    argument = instruction.arg if instruction.opcode >= dis.HAVE_ARGUMENT else None
    try:
        return dis.stack_effect(instruction.opcode, argument, jump=False)
    except ValueError:  # an opcode this Python's dis has no effect for
        return None


def _reads_attribute(instruction: dis.Instruction) -> bool:
    return "ATTR" in instruction.opname or "METHOD" in instruction.opname


def _by_constant_name(code: types.CodeType, instructions: list[dis.Instruction], start: int) -> bool:
    """Whether the builtin loaded at ``start`` (``getattr`` and the like) is called with a constant name.

    Read from the stack depth each instruction leaves, over the straight run of instructions to the call (a jump: not
    known). The name is the expression pushed last from one above the object's place (``base + 1``); a constant is one
    ``LOAD_CONST``, left as it is by what follows (a default, pushed above it). In :data:`ACCESS_DUNDERS`, the name the
    method was called with counts as constant.
    """
    base = _stack_effect(instructions[start])  # the builtin (and the NULL before it), consumed with the arguments
    if base is None:
        return False
    depth = base
    run: list[tuple[dis.Instruction, int, int]] = []
    for instruction in instructions[start + 1 :]:
        if instruction.opcode in _JUMPS:
            return False
        if instruction.opname in _CALLS and depth - (instruction.arg or 0) == base:
            return instruction.arg in BY_NAME_BUILTINS[str(instructions[start].argval)] and _constant(code, run, base)
        effect = _stack_effect(instruction)
        if effect is None:
            return False
        before, depth = depth, depth + effect
        if depth < base:
            return False
        run.append((instruction, before, depth))
    return False


def _constant(code: types.CodeType, run: list[tuple[dis.Instruction, int, int]], base: int) -> bool:
    """Whether the second argument ``run`` pushes for a call over ``base`` is a constant name (see above)."""
    starts = [index for index, (_, before, _) in enumerate(run) if before <= base + 1]
    if not starts:
        return False
    first = starts[-1]
    name, before, after = run[first]
    if (before, after) != (base + 1, base + 2):
        return False
    if name.opname == "LOAD_CONST":
        constant = isinstance(name.argval, str)
    else:  # ``getattr(self.block, name)`` in ``__getattr__(self, name)``
        passed_on = code.co_name in ACCESS_DUNDERS and code.co_argcount >= 2
        constant = passed_on and name.opname == "LOAD_FAST" and name.argval == code.co_varnames[1]
    rest = run[first + 1 :]
    if not rest:
        return constant
    default, before, after = rest[0]
    pure_load = default.opname.startswith("LOAD_") and not _reads_attribute(default)
    pushed_above = before == base + 2 and after >= base + 3 and pure_load
    return constant and pushed_above and all(after >= base + 3 for _, _, after in rest)


@dataclass(frozen=True)
class ComputedNames:
    """How a piece of code reaches attributes by names it computes at run time.

    ``reads``: it reads them (any method or attribute may be reached). ``writes``: it sets or deletes them (a data
    descriptor's setter or deleter may run).
    """

    reads: bool
    writes: bool


@functools.lru_cache(maxsize=4096)
def computed_names(code: types.CodeType) -> ComputedNames:
    """How ``code`` (or a function defined in it) reaches attributes by names it computes at run time.

    Reads: ``getattr(self, name)``, ``vars(self)``, ``self.__dict__``, ``operator.attrgetter``; not ``getattr(self,
    "export")`` (a constant name, in reach as a string) nor, in ``__getattr__``, passing on the name it was given.
    Writes: ``setattr(module, name, value)``.

    >>> computed_names((lambda self, name: getattr(self, name)).__code__)
    ComputedNames(reads=True, writes=False)
    >>> computed_names((lambda self, name: setattr(self, name, getattr(self, "export", None))).__code__)
    ComputedNames(reads=False, writes=True)
    >>> computed_names((lambda self, template: template.format(self) + "{0.line}".format(self)).__code__)
    ComputedNames(reads=True, writes=False)
    """
    instructions = list(dis.get_instructions(code))
    passed_on = ACCESS_DUNDERS if code.co_name in ACCESS_DUNDERS else frozenset()
    reads = writes = False
    for index, instruction in enumerate(instructions):
        name = instruction.argval
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            computed = name in BY_NAME_BUILTINS and not _by_constant_name(code, instructions, index)
            reads = reads or name in COMPUTING_GLOBALS or (computed and name not in WRITING_BUILTINS)
            writes = writes or (computed and name in WRITING_BUILTINS)
        elif _reads_attribute(instruction):
            reads = reads or name in READING_ATTRIBUTES - passed_on or _formats_unknown(instructions, index)
            writes = writes or name in WRITING_ATTRIBUTES - passed_on
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            inner = computed_names(constant)
            reads, writes = reads or inner.reads, writes or inner.writes
    return ComputedNames(reads, writes)


def _formats_unknown(instructions: list[dis.Instruction], index: int) -> bool:
    """Whether the attribute read at ``index`` is ``format`` on anything but a string constant pushed just before."""
    if instructions[index].argval not in FORMATTING_ATTRIBUTES:
        return False
    before = instructions[index - 1] if index else None
    return before is None or before.opname != "LOAD_CONST" or not isinstance(before.argval, str)


def _field_attributes(text: str) -> Iterable[str]:
    """The attribute names the fields of format string ``text`` read (``"{0.line:>{1.width}}"``: line, width)."""
    try:
        fields = list(string.Formatter().parse(text))
    except ValueError:  # not a format string
        return
    for _, name, spec, _ in fields:
        if name is not None:
            yield from (part for part in re.findall(r"\.([^.\[]+)", name) if part.isidentifier())
        if spec:
            yield from _field_attributes(spec)


def names_computed_by(value: Any) -> ComputedNames:
    """How ``value``, an object the code holds (a global, a closure's, an attribute), reaches attributes by name.

    ``getattr`` bound to another name, ``operator.attrgetter`` and ``methodcaller`` (the classes, and what they make:
    ``methodcaller(name)`` built from a configuration) read them; ``setattr`` and ``delattr`` write them.

    >>> names_computed_by(operator.methodcaller("export")), names_computed_by(len)
    (ComputedNames(reads=True, writes=False), ComputedNames(reads=False, writes=False))
    """
    reads = id(value) in READING_CALLABLES or isinstance(value, (operator.attrgetter, operator.methodcaller))
    return ComputedNames(reads, id(value) in WRITING_CALLABLES)


def _strings(constant: Any) -> Iterable[str]:
    if isinstance(constant, str):
        if constant.isidentifier():
            yield constant
        elif "{" in constant:
            yield from _field_attributes(constant)
    elif isinstance(constant, (tuple, frozenset)):
        for item in constant:
            yield from _strings(item)
    elif isinstance(constant, types.CodeType):
        yield from string_names(constant)


@functools.lru_cache(maxsize=4096)
def string_names(code: types.CodeType) -> frozenset[str]:
    """The names ``code`` and the functions defined in it hold as string constants.

    Identifier-like constants (``getattr(self, "n")``), and the attributes constant format strings' fields read
    (``"{0.line}".format(progress)``).

    >>> sorted(string_names((lambda self: getattr(self, "export") or hasattr(self, "a b")).__code__))
    ['export']
    >>> sorted(string_names((lambda self: "{0.line:>{0.width}} {0[a.b]}".format(self)).__code__))
    ['line', 'width']
    """
    return frozenset(name for constant in code.co_consts for name in _strings(constant))


def library_names(cls: type) -> frozenset[str]:
    """The names a library class ``cls`` defines that the code a training batch runs may call on an override.

    All but :data:`OUTSIDE_BATCH_HOOKS` on Lightning's classes.

    >>> "forward" in library_names(__import__("torch").nn.Module)
    True
    """
    try:
        return _library_names(cls)
    except TypeError:  # a class its metaclass made unhashable: worked out each time
        return _library_names.__wrapped__(cls)


@functools.lru_cache(maxsize=1024)
def _library_names(cls: type) -> frozenset[str]:
    names = frozenset(vars(cls))
    module = vars(cls).get("__module__")
    if isinstance(module, str) and module.startswith(LIGHTNING_MODULES):
        return names - OUTSIDE_BATCH_HOOKS
    return names


def is_dunder(name: str) -> bool:
    """Whether ``name`` is one Python calls by itself (``__call__``).

    >>> is_dunder("__call__"), is_dunder("_Model__helper")
    (True, False)
    """
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


@dataclass
class MethodReach:
    """The names in reach so far, and the classes' attributes waiting for theirs.

    ``everything``: the code reads attributes by names it computes, so every name is in reach. ``descriptors``: it
    sets or deletes attributes by names it computes, so every data descriptor (a property's setter) is.
    ``construction``: the classes whose construction dunders are in reach, and those waiting for it.
    """

    names: set[str] = field(default_factory=lambda: set(PROTOCOL_NAMES))
    everything: bool = False
    descriptors: bool = False
    parked: dict[str, list[Member]] = field(default_factory=dict)
    classes: set[type] = field(default_factory=set)
    """Classes every attribute of which is in reach, whatever its name (:meth:`bring_class`)."""
    construction: Construction = field(default_factory=Construction)

    def copy(self) -> MethodReach:
        """A copy to go on from (another walk continuing this one), which changes nothing in this one."""
        parked = {name: list(members) for name, members in self.parked.items()}
        construction = self.construction.copy()
        return MethodReach(set(self.names), self.everything, self.descriptors, parked, set(self.classes), construction)

    def admits(self, member: Member) -> bool:
        """Whether ``member``'s name is in reach; if not, it waits for its name (or its class's construction)."""
        name = member[1]
        if self.everything:
            return True
        if name in CONSTRUCTION_DUNDERS or name in CREATION_DUNDERS:
            held = any(cls is member[0] for cls in self.classes)  # by identity: a class may be unhashable
            return held or self.construction.admits(member)
        if is_dunder(name) or name in self.names or (self.descriptors and _sets(member)):
            return True
        if member[0] in self.classes:
            return True
        self.parked.setdefault(name, []).append(member)
        return False

    def bring(self, names: Iterable[str]) -> list[Member]:
        """Put ``names`` in reach; the members that waited for them."""
        if self.everything:
            return []
        released: list[Member] = []
        for name in names:
            if name not in self.names:
                self.names.add(name)
                released += self.parked.pop(name, [])
        return released

    def bring_class(self, classes: Iterable[type]) -> list[Member]:
        """Put every attribute of ``classes`` in reach, whatever its name; the members that waited."""
        new = set(classes) - self.classes
        if self.everything or not new:
            return []
        self.classes |= new
        released = self.construction.take(new)
        released += [member for members in self.parked.values() for member in members if member[0] in new]
        for name, members in list(self.parked.items()):
            self.parked[name] = [member for member in members if member[0] not in new]
            if not self.parked[name]:
                del self.parked[name]
        return released

    def bring_everything(self) -> list[Member]:
        """Put every name in reach; every member that waited."""
        self.everything = True
        released = self.construction.take(self.construction.waiting_classes())
        released += [member for members in self.parked.values() for member in members]
        self.parked.clear()
        return released

    def bring_descriptors(self) -> list[Member]:
        """Put every data descriptor in reach; those that waited."""
        if self.everything or self.descriptors:
            return []
        self.descriptors = True
        released = [member for members in self.parked.values() for member in members if _sets(member)]
        for name, members in list(self.parked.items()):
            self.parked[name] = [member for member in members if not _sets(member)]
            if not self.parked[name]:
                del self.parked[name]
        return released


def _sets(member: Member) -> bool:
    """Whether setting or deleting ``member``'s name on an instance runs code (a data descriptor's)."""
    attribute = member[2]
    if isinstance(attribute, property):
        return attribute.fset is not None or attribute.fdel is not None
    return hasattr(type(attribute), "__set__") or hasattr(type(attribute), "__delete__")

"""The walk takes a class's construction dunders only where the step may construct the class, whichever way it does.

A module whose ``__init__`` parses ``sys.argv`` or writes a file is never constructed by its step: that ``__init__``
must not rule the replay out. Each way a step may construct or create a class (its name, ``type(self)(...)``,
``self.__class__(...)``, a factory, ``functools.partial``, ``copy.deepcopy`` through ``__reduce__``, a dataclass's
``__post_init__``, a classmethod's ``cls(...)``, a class statement running ``__init_subclass__``, ``__set_name__`` and
a metaclass) must still bring the code it runs into the walk: each case below pairs a step that constructs with one
that does not, and the effect of the constructed class's code (it opens a file) is found in the first only.

Only a module's construction is ever left out: the helpers here are modules. Other classes (a container subclass, a
dataclass, a class of a user's metaclass) and every class's creation dunders are walked whether or not the step
constructs them, as library code rebuilds and creates them where the walk cannot see (an attack found ten such ways:
``dict.fromkeys``, ``apply_to_collection``, a ``defaultdict``'s factory, the enum functional API, ...).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_vram.prediction.containment.code_roots import code_roots, data_roots, inside_ids, instance_roots
from lightning_vram.prediction.containment.reach import reach_of

LOG = os.devnull
"""Where each case's code writes: the walk sees ``open``, whatever the file (classes made at import write too)."""


def effects(module: nn.Module) -> list[str]:
    """What the walk from ``module``'s code (as a replay's) finds it doing outside the objects a replay puts back."""
    inside = inside_ids(module)
    roots = [*code_roots(module, None), *instance_roots(module)]
    return reach_of(roots, inside, data_roots(module)).effects


def writer(name: str) -> str:
    """The effect the walk reports for ``name``'s code opening a file."""
    return f"{name} opens files (what it writes would be written again)"


class Stepping(nn.Module):
    """A module whose ``forward`` runs ``self.act()``: each case's own (constructing or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.act()
        return self.linear(inputs)  # type: ignore[no-any-return]

    def act(self) -> None:
        """Nothing by default."""


class Writes(nn.Module):
    """A helper module whose construction writes a file."""

    def __init__(self, value: int = 0) -> None:
        super().__init__()
        with open(LOG, "a") as log:
            log.write(f"{value}\n")
        self.value = value


class Rebuilt(Writes):
    """Copied and pickled by calling its class (its ``__reduce__``), which runs ``Writes.__init__``."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Rebuilt, (self.value,))


class WritesAsModule(Stepping):
    """A module whose own ``__init__`` writes a file (and reads ``sys.argv``): only its copies are made."""

    def __init__(self) -> None:
        super().__init__()
        with open(LOG, "a") as log:
            log.write("built\n")


class ConstructsItself(WritesAsModule):
    def act(self) -> None:
        type(self)()


class ConstructsThroughClass(WritesAsModule):
    def act(self) -> None:
        self.__class__()


@dataclasses.dataclass
class Config:
    """A configuration the module holds: its generated ``__eq__`` and ``__repr__`` read ``__class__``, never call it."""

    width: int = 2


class LooksAtClasses(WritesAsModule):
    """Reads classes (its own, its configuration's) without calling them."""

    def __init__(self) -> None:
        super().__init__()
        self.config = Config()

    def act(self) -> None:
        print(type(self).__name__, isinstance(self.config, type(self.config)), f"{self.config!r}")


def test_the_module_s_own_init_is_walked_only_where_the_step_constructs_its_class() -> None:
    assert effects(WritesAsModule()) == []
    assert effects(LooksAtClasses()) == []
    assert writer("WritesAsModule.__init__") in effects(ConstructsItself())
    assert writer("WritesAsModule.__init__") in effects(ConstructsThroughClass())


def make_writer() -> Writes:
    return Writes(1)


HELD = Writes.__new__(Writes)
HELD.value = 0
PARTIAL = functools.partial(Writes, 2)


class ByName(Stepping):
    def act(self) -> None:
        Writes(3)


class ByFactory(Stepping):
    def act(self) -> None:
        make_writer()


class ByPartial(Stepping):
    def act(self) -> None:
        PARTIAL()


class ByDeepcopy(Stepping):
    """``deepcopy`` of an ``OrderedDict`` subclass: ``OrderedDict.__reduce__`` rebuilds it by calling the class."""

    def act(self) -> None:
        copy.deepcopy(ORDERED)


class ByPickle(Stepping):
    def act(self) -> None:
        pickle.loads(pickle.dumps(HELD))


class HoldsTheClass(Stepping):
    """Holds the helper's class as an attribute, and calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.factory = Writes

    def act(self) -> None:
        self.factory()


class UsesHeld(Stepping):
    """Reads the helper it holds, never constructs one."""

    def act(self) -> None:
        print(HELD.value)


class ReInitialises(Stepping):
    """Calls ``__init__`` again on an object it holds."""

    def act(self) -> None:
        HELD.__init__(4)  # type: ignore[misc]


class Ordered(OrderedDict[str, int]):
    """An ``OrderedDict`` whose construction writes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        Writes(5)


ORDERED = Ordered.__new__(Ordered)


class CopiesPlainly(Stepping):
    """``deepcopy`` of a plain object: ``copyreg.__newobj__`` runs its ``__new__``, never its ``__init__``."""

    def act(self) -> None:
        copy.deepcopy(HELD)


class UsesTheOrderedDict(Stepping):
    def act(self) -> None:
        print(ORDERED.get("a"))


class ThroughTypeCall(Stepping):
    """An attack's: ``type(x).__call__()`` constructs the class of an object the step holds."""

    def act(self) -> None:
        type(HELD).__call__()


class ThroughTheMro(Stepping):
    def act(self) -> None:
        type(HELD).mro()[0]()


class ThroughANamedClassAttribute(Stepping):
    """``getattr(x, "__class__")()``: the class read by a name held as a string."""

    def act(self) -> None:
        getattr(HELD, "__class__")()  # noqa: B009 -- the attack's spelling


CONSTRUCTING = [
    ByName,
    ByFactory,
    ByPartial,
    ByDeepcopy,
    ByPickle,
    HoldsTheClass,
    ReInitialises,
    ThroughTypeCall,
    ThroughTheMro,
    ThroughANamedClassAttribute,
]


@pytest.mark.parametrize("case", CONSTRUCTING, ids=lambda case: case.__name__)
def test_a_helper_constructed_in_the_step_has_its_init_walked(case: Callable[[], nn.Module]) -> None:
    assert effects(UsesHeld()) == []  # the helper's class is reached (its instance is), never constructed
    assert effects(CopiesPlainly()) == []
    assert writer("Writes.__init__") in effects(case())


@dataclasses.dataclass
class Point:
    x: int

    def __post_init__(self) -> None:
        with open(LOG, "a") as log:
            log.write(f"{self.x}\n")


class ConstructsADataclass(Stepping):
    def act(self) -> None:
        Point(1)


POINT = Point.__new__(Point)
POINT.x = 0


class ReadsADataclass(Stepping):
    def act(self) -> None:
        print(POINT.x)


def test_a_container_subclass_or_a_dataclass_is_walked_whether_the_step_constructs_it_or_not() -> None:
    """Library code rebuilds these (``dict.fromkeys``, ``apply_to_collection``, ``dataclasses.replace``)."""
    assert writer("Writes.__init__") in effects(UsesTheOrderedDict())  # Ordered.__init__ constructs a Writes
    assert writer("Point.__post_init__") in effects(ReadsADataclass())
    assert writer("Point.__post_init__") in effects(ConstructsADataclass())


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with open(LOG, "a") as log:
            log.write("base\n")

    @classmethod
    def create(cls) -> Base:
        return cls()


class Resets(Base):
    def reset(self) -> None:
        super().__init__()


class DerivedWrites(Base):
    def __init__(self) -> None:
        super().__init__()
        with open(LOG, "a") as log:
            log.write("derived\n")


RESETTABLE = Resets.__new__(Resets)
DERIVED = DerivedWrites.__new__(DerivedWrites)


class ThroughSuper(Stepping):
    """``super().__init__()`` in a method that is no constructor: the base's ``__init__`` runs."""

    def act(self) -> None:
        RESETTABLE.reset()


class ThroughAClassmethod(Stepping):
    """The base's classmethod, called on an instance of the subclass, constructs the subclass (``cls()``)."""

    def act(self) -> None:
        DERIVED.create()


class HoldsInstances(Stepping):
    def act(self) -> None:
        print(RESETTABLE, DERIVED)


def test_a_base_s_init_through_super_and_a_subclass_through_a_classmethod_are_walked() -> None:
    assert effects(HoldsInstances()) == []
    assert writer("Base.__init__") in effects(ThroughSuper())
    assert writer("DerivedWrites.__init__") in effects(ThroughAClassmethod())


class Registry:
    """Writes each subclass made of it to a file."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        with open(LOG, "a") as log:
            log.write(f"{cls.__name__}\n")


class Named:
    """A descriptor that writes the name it is given."""

    def __set_name__(self, owner: type, name: str) -> None:
        with open(LOG, "a") as log:
            log.write(f"{name}\n")


class Meta(type):
    def __init__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> None:
        super().__init__(name, bases, namespace)
        with open(LOG, "a") as log:
            log.write(f"{name}\n")


class Registered(Registry):
    """Made at import, not in the step."""

    field = Named()


class Made(metaclass=Meta):
    pass


class DefinesASubclass(Stepping):
    def act(self) -> None:
        class Local(Registry):
            field = Named()

        print(Local)


class DefinesAClassOfMeta(Stepping):
    def act(self) -> None:
        print(type("Local", (Made,), {}))


class UsesClassesMadeAtImport(Stepping):
    def act(self) -> None:
        print(Registered.field, Made)


def test_creation_dunders_are_walked_whether_the_step_creates_a_class_or_not() -> None:
    """The enum functional API, ``make_dataclass`` and a metaclass called with three arguments create classes."""
    assert writer("Registry.__init_subclass__") in effects(UsesClassesMadeAtImport())
    found = effects(DefinesASubclass())
    assert writer("Registry.__init_subclass__") in found
    assert writer("Named.__set_name__") in found
    assert writer("Meta.__init__") in effects(DefinesAClassOfMeta())


class Logged(nn.Module):
    """A module whose ``__init__`` writes, copied by ``deepcopy`` through ``__new__`` (never its ``__init__``)."""

    def __init__(self) -> None:
        super().__init__()
        with open(LOG, "a") as log:
            log.write("logged\n")


class HoldsAWriter(Stepping):
    """Holds helpers as data: the replay's ``deepcopy`` of the module copies them (``__reduce__``: ``Rebuilt(...)``)."""

    def __init__(self, helper: Any) -> None:
        super().__init__()
        self.helper = helper


def test_what_the_replay_s_own_copy_of_the_module_constructs_is_walked() -> None:
    assert effects(HoldsAWriter(Logged())) == []
    assert writer("Writes.__init__") in effects(HoldsAWriter(Rebuilt(0)))  # its __reduce__ calls Rebuilt


class Unhashable(type):
    """A metaclass whose classes compare by name, and so cannot be hashed."""

    def __eq__(cls, other: object) -> bool:
        return isinstance(other, type) and cls.__name__ == other.__name__

    __hash__ = None  # type: ignore[assignment]


class Opaque(nn.Module, metaclass=Unhashable):
    def __init__(self) -> None:
        super().__init__()
        with open(LOG, "a") as log:
            log.write("opaque\n")


OPAQUE = Opaque.__new__(Opaque)


class HoldsAnOpaque(Stepping):
    def act(self) -> None:
        print(OPAQUE)


class BuildsAnOpaque(Stepping):
    def act(self) -> None:
        Opaque()


def test_a_class_its_metaclass_makes_unhashable_is_walked_by_the_same_rule() -> None:
    assert effects(HoldsAnOpaque()) == []
    assert writer("Opaque.__init__") in effects(BuildsAnOpaque())

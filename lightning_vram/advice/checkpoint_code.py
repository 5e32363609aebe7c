"""The code a checkpointing plan asks the user to write, for the advice's title and detail.

Three idioms, each the one the replay applied to check the plan:

- a transformers model's own switch (``model.activation_checkpointing_enable(...)``): every layer of every stack;
- a ``Checkpointed`` wrapper put in place of each unit of one module (the usual case): the unit runs under
  ``checkpoint`` with every argument its caller gives it (positional and keyword: attention masks, position
  embeddings) and returns what it returns (a tensor, a tuple, a dict), so the caller's code does not change; also for
  a plan over several modules' children (a stem with the stages' blocks) or with selective units, a unit of several
  modules standing at its first (``Checkpointed(first, *then)``), the others ``nn.Identity()``;
- for a unit of several consecutive modules (an inplace op joins the one before it), ``x = ...`` lines in the forward
  that calls them, and for an ``nn.Sequential`` a loop over its segments as ``checkpoint_sequential`` splits them:
  both pass one tensor along;
- for the units of an ``nn.Sequential`` no forward of the user's calls (the model itself, trained by a plain loop or
  Fabric), each unit put in place of its first child as ``Checkpointed(*children)``, the others ``nn.Identity()``.

The code is written for what trains the model (:class:`CodeContext`): a LightningModule's ``__init__`` with ``self.``
paths, or after building the model of a plain loop or a Fabric loop (before ``fabric.setup``) with ``model.`` paths.

Every one of them checkpoints through ``checkpoint_keeping_buffers`` (printed with it): backward's recomputation
runs on copies of the units' buffers as the forward pass found them (kept from forward), so that it computes what
forward did where forward updates a buffer and then uses it (spectral normalisation's power iteration), a train-mode
BatchNorm updates its running statistics once a step, as without checkpointing, and the checkpointed model learns
exactly what the plain one does.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import groupby

from lightning_vram.prediction.replay.buffer_copies import SAVED_OPS
from lightning_vram.records import CheckpointPlan, TrainingLoop
from lightning_vram.records.advice import layer_ranges

CHECKPOINT_LINES = 6
"""Units spelled out one line each in the advice's code; the rest are named."""

KEEPING_BUFFERS = '''import contextlib

from torch.utils.checkpoint import checkpoint


def _buffers_of(modules):
    """Every buffer of `modules` and their submodules: (module, name, buffer) by (id(module), name)."""
    found = {}
    for owner in modules:
        for module in owner.modules():
            for name, buffer in module.named_buffers(recurse=False):
                found[id(module), name] = (module, name, buffer)
    return found


@contextlib.contextmanager
def _buffers_kept(modules, kept):
    """Keeps in `kept` a copy of every buffer of `modules` as the body (the unit's forward) finds them."""
    kept.update({key: (module, name, buffer.clone()) for key, (module, name, buffer) in _buffers_of(modules).items()})
    yield


@contextlib.contextmanager
def _buffers_as_kept(modules, kept):
    """Runs the body (backward's recomputation) on copies of the `kept` buffers, then puts back those of `modules`."""
    current = _buffers_of(modules)
    for module, name, buffer in kept.values():
        setattr(module, name, buffer.clone())
    try:
        yield
    finally:
        for module, name, buffer in current.values():
            setattr(module, name, buffer)


def checkpoint_keeping_buffers(modules, function, *args, **kwargs):
    """`checkpoint(function, *args, **kwargs)` whose recomputation in backward runs on copies of the buffers of
    `modules` as the forward pass found them: it computes what forward did (spectral norm's power iteration, running
    statistics a layer normalises with), and BatchNorm's running statistics change once a step, as without
    checkpointing (pytorch#96136)."""
    modules = list(modules)

    def contexts():
        kept = {}
        return _buffers_kept(modules, kept), _buffers_as_kept(modules, kept)

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)
'''
"""The checkpoint call every printed plan uses (the replay runs the same,
:func:`~lightning_vram.prediction.replay.buffer_copies.checkpoint_keeping_buffers`)."""

CHECKPOINTED_CLASS = '''from torch import nn


class Checkpointed(nn.Module):
    """Runs `block` with every argument it is given, then each of `then` on the result, under activation
    checkpointing; returns what the last returns."""

    def __init__(self, block: nn.Module, *then: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.then = nn.ModuleList(then)

    def forward(self, *args, **kwargs):
        return checkpoint_keeping_buffers([self.block, *self.then], self._run, *args, **kwargs)

    def _run(self, *args, **kwargs):
        output = self.block(*args, **kwargs)
        for module in self.then:
            output = module(output)
        return output

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # a caller reading the block's settings
            if name == "block":
                raise
            return getattr(self.block, name)
'''
"""The wrapper the advice prints (the replay's ``_CheckpointedCall`` does the same: the unit at its first module)."""


_SAVED_OPS_LINES = "".join(f'\n    "{op}",' for op in SAVED_OPS)

SELECTIVE = (
    "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts\n\n"
    f"SAVED_OPS = {{{_SAVED_OPS_LINES}\n}}\n"
    + '''

def _keep_matmuls(context, op, *args, **kwargs):
    saved = str(getattr(op, "overloadpacket", op)) in SAVED_OPS
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_saving_matmuls(modules, function, *args, **kwargs):
    """`checkpoint_keeping_buffers` made selective: the outputs of matrix products, convolutions and attention
    are kept from forward; only the other ops (norms, activations, dropout, additions) are recomputed."""
    modules = list(modules)

    @contextlib.contextmanager
    def both(first, second):
        with first, second:
            yield

    def contexts():
        forward, recompute = create_selective_checkpoint_contexts(_keep_matmuls)
        kept = {}
        return both(forward, _buffers_kept(modules, kept)), both(recompute, _buffers_as_kept(modules, kept))

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


class SelectivelyCheckpointed(Checkpointed):
    """`Checkpointed`, keeping the outputs of matrix products, convolutions and attention."""

    def forward(self, *args, **kwargs):
        return checkpoint_saving_matmuls([self.block, *self.then], self._run, *args, **kwargs)
'''
)
"""Selective checkpointing, printed after :data:`CHECKPOINTED_CLASS` for a plan with ``selective`` units (the
replay runs :func:`~lightning_vram.prediction.replay.buffer_copies.checkpoint_saving_matmuls`)."""


@dataclass(frozen=True)
class CodeContext:
    """What the printed code is written for: what trains the model, and the model's class name (``None``: unknown)."""

    loop: TrainingLoop = TrainingLoop.LIGHTNING
    root_type: str | None = None
    keyed: frozenset[str] = frozenset()
    """The modules (by name) holding their children by key (``TrainingSetup.keyed_containers``: ModuleDicts)."""

    @property
    def model(self) -> str:
        """The model in code that changes it once built: ``self`` in a LightningModule, else ``model``."""
        return "self" if self.loop is TrainingLoop.LIGHTNING else "model"

    def built(self, what: str) -> str:
        """Where lines changing the built model (``what`` in words) go.

        >>> CodeContext(TrainingLoop.FABRIC).built("the model").partition("), ")[2]
        'before `fabric.setup(model, optimizer)`'

        Under Fabric, ``model`` is the module as built, not the wrapper ``fabric.setup`` returns (which
        ``session.start`` also takes, and which does not exist yet where the lines go).

        >>> CodeContext(TrainingLoop.FABRIC).built("the model").partition("), ")[0]
        'after building the model (`model`: your module as built, the one you pass to `fabric.setup`'
        """
        if self.loop is TrainingLoop.LIGHTNING:
            return f"in the LightningModule's __init__, once {what} is built"
        if self.loop is TrainingLoop.FABRIC:
            return (
                "after building the model (`model`: your module as built, the one you pass to `fabric.setup`),"
                " before `fabric.setup(model, optimizer)`"
            )
        return (
            "after building the model (`model`: the module given to `session.start`), before creating its optimizer"
            " and starting the loop"
        )

    @property
    def root_forward(self) -> str:
        """The forward of the trained module, in words."""
        if self.loop is TrainingLoop.LIGHTNING:
            return "the LightningModule's forward (or training_step)"
        return f"the forward of your model's class (`{self.root_type or 'model'}`)"

    def no_forward(self, forward_of: str) -> bool:
        """Whether no code of the user's calls the units: the model is a plain or Fabric loop's ``nn.Sequential``."""
        return not forward_of and self.loop is not TrainingLoop.LIGHTNING and self.root_type == "Sequential"


_KEYED: ContextVar[frozenset[str]] = ContextVar("_KEYED", default=frozenset())
"""The modules holding their children by key (ModuleDicts) while a snippet is written (:func:`_keyed`)."""


@contextmanager
def _keyed(keyed: Collection[str]) -> Iterator[None]:
    """Paths written inside reach a child of each module named in ``keyed`` (an ``nn.ModuleDict``) by its key."""
    token = _KEYED.set(frozenset(keyed))
    try:
        yield
    finally:
        _KEYED.reset(token)


def _code_path(name: str, forward_of: str, root: str = "self") -> str:
    """Module ``name`` as code in the forward of ``forward_of`` (or, from the model, with the model named ``root``).

    >>> _code_path("transformer.h.3", "transformer"), _code_path("network.conv1", ""), _code_path("", "")
    ('self.h[3]', 'self.network.conv1', 'self')
    >>> _code_path("2", "", "model")
    'model[2]'

    A child of a ModuleDict (:func:`_keyed`) by its key, a string: ``[0]`` raised KeyError on a key ``"0"``.

    >>> with _keyed({"net.blocks"}):
    ...     _code_path("net.blocks.0.1", ""), _code_path("net.blocks.a-b", "net")
    ("self.net.blocks['0'][1]", "self.blocks['a-b']")
    """
    relative = name[len(forward_of) + 1 :] if forward_of else name
    if not relative:
        return root
    keyed, path = _KEYED.get(), root
    parts = relative.split(".")
    for index, part in enumerate(parts):
        parent = ".".join([*([forward_of] if forward_of else []), *parts[:index]])
        if parent in keyed:
            path += f"[{part!r}]"
        else:
            path += f"[{part}]" if part.isdigit() else f".{part}"
    return path


def code_path(name: str, forward_of: str, root: str = "self", keyed: Collection[str] = ()) -> str:
    """Module ``name`` as code (:func:`_code_path`), for the rules that print lines changing a module by name.

    A child of a module named in ``keyed`` (an ``nn.ModuleDict``: ``TrainingSetup.keyed_containers``) is reached by
    its key, as a string: ``[0]`` raised KeyError on a ModuleDict's key ``"0"``.

    >>> code_path("features.1", "", "model")
    'model.features[1]'
    >>> code_path("blocks.0.1", "", "model", keyed={"blocks"}), code_path("heads.a-b", "", "model", keyed={"heads"})
    ("model.blocks['0'][1]", "model.heads['a-b']")
    """
    with _keyed(keyed):
        return _code_path(name, forward_of, root)


def _unit_line(unit: tuple[str, ...], forward_of: str) -> str:
    """The line checkpointing one unit: its modules, and the module or a lambda running them in order."""
    paths = [_code_path(name, forward_of) for name in unit]
    call = paths[0]
    if len(unit) > 1:
        call = "t"
        for path in paths:
            call = f"{path}({call})"
        call = f"lambda t: {call}"
    return f"x = checkpoint_keeping_buffers([{', '.join(paths)}], {call}, x)"


def _segments_lines(plan: CheckpointPlan, path: str) -> list[str]:
    r"""A loop over the checkpointed segments of the ``nn.Sequential`` at ``path``, then its last segment.

    >>> plan = CheckpointPlan("features", (("features.0", "features.1"), ("features.2", "features.3")), 3, 0, "")
    >>> print("\n".join(_segments_lines(plan, "self.features")))
    for start, end in ((0, 2), (2, 4)):
        segment = self.features[start:end]
        x = checkpoint_keeping_buffers(segment, segment, x)
    x = self.features[4:](x)
    """
    bounds: list[tuple[int, int]] = []
    for unit in plan.units:
        start = bounds[-1][1] if bounds else 0
        bounds.append((start, start + len(unit)))
    spans = ", ".join(f"({start}, {end})" for start, end in bounds)
    return [
        f"for start, end in ({spans}{',' if len(bounds) == 1 else ''}):",
        f"    segment = {path}[start:end]",
        "    x = checkpoint_keeping_buffers(segment, segment, x)",
        f"x = {path}[{bounds[-1][1]}:](x)",
    ]


def _switch_snippet(plan: CheckpointPlan, context: CodeContext) -> tuple[str, str]:
    """The library's own call, on the model that has it, and the layers it covers."""
    layers = tuple(unit[0] for unit in plan.units)
    model = _code_path(plan.container, "", context.model)
    argument = (plan.switch or "").removesuffix("_enable") + "_kwargs"
    owner = f"`{plan.container}`" if plan.container else "the model"
    what = f"every layer of {owner} ({layer_ranges(layers)}) with its own switch"
    code = (
        f"# {context.built(model)} (it checkpoints while training):\n"
        f"{model}.config.use_cache = False  # a key/value cache is of no use in training and clashes with it\n"
        f'{model}.{plan.switch}({argument}={{"use_reentrant": False}})'
    )
    return what, code


def _wrap_lines(names: list[str], root: str = "self", wrapper: str = "Checkpointed") -> list[str]:
    """Lines putting ``wrapper`` in place of each module ``names`` (children of one parent), once it is built.

    >>> _wrap_lines(["net.h.1", "net.h.2"])
    ['for index in range(1, 3):', '    self.net.h[index] = Checkpointed(self.net.h[index])']
    """
    container = _code_path(names[0].rpartition(".")[0], "", root)
    indices = [name.rpartition(".")[2] for name in names]
    keyed = names[0].rpartition(".")[0] in _KEYED.get()  # a ModuleDict's keys: no range of ints over them
    if len(names) == 1 or keyed or not all(map(str.isdigit, indices)):
        return [f"{_code_path(name, '', root)} = {wrapper}({_code_path(name, '', root)})" for name in names]
    first, last = int(indices[0]), int(indices[-1])
    over = (
        f"range({first}, {last + 1})"
        if list(map(int, indices)) == list(range(first, last + 1))
        else f"({', '.join(indices)})"
    )
    return [f"for index in {over}:", f"    {container}[index] = {wrapper}({container}[index])"]


def _shared_lines(name: str, root: str, wrapper: str, others: bool = False) -> list[str]:
    r"""Lines putting one ``wrapper`` at every place of the model holding block ``name``, run as several layers.

    Every place, not only its list's: a block held by two lists (an encoder's and a decoder's) or by a list and an
    attribute is named once, under its first place, and the replay counts each of its calls; wrapped in one list
    alone, the others' calls went unchecked (3 of 6: the plan was discarded and nothing was advised). With
    ``others`` (the plan has other units, wrapped by the lines before these), but a place inside another unit's
    wrapper: that unit's checkpoint recomputes the block there, and a wrapper inside it nested a checkpoint (a
    decoder layer holding the encoder's last block: the block recomputed twice in backward).

    >>> print("\n".join(_shared_lines("net.layers.0", "self", "Checkpointed")))
    block = self.net.layers[0]
    checkpointed = Checkpointed(block)  # one wrapper, at every place of the model holding the block
    for path, module in list(self.named_modules(remove_duplicate=False)):
        if module is block:
            parent, _, key = path.rpartition(".")
            setattr(self.get_submodule(parent), key, checkpointed)
    >>> print("\n".join(_shared_lines("net.layers.0", "self", "Checkpointed", others=True)[2:6]))
    inside = ()  # the paths under another unit's wrapper, which recomputes the block there
    for path, module in list(self.named_modules(remove_duplicate=False)):
        if isinstance(module, Checkpointed):
            inside += (f"{path}.",)
    """
    places = [
        f"for path, module in list({root}.named_modules(remove_duplicate=False)):",
        "    if module is block:",
        '        parent, _, key = path.rpartition(".")',
        f"        setattr({root}.get_submodule(parent), key, checkpointed)",
    ]
    if others:
        places = [
            "inside = ()  # the paths under another unit's wrapper, which recomputes the block there",
            places[0],
            "    if isinstance(module, Checkpointed):",
            '        inside += (f"{path}.",)',
            "    elif module is block and not path.startswith(inside):",
            *places[2:],
        ]
    return [
        f"block = {_code_path(name, '', root)}",
        f"checkpointed = {wrapper}(block)  # one wrapper, at every place of the model holding the block",
        *places,
    ]


def _unit_wrap_lines(unit: tuple[str, ...], root: str, wrapper: str) -> list[str]:
    r"""Lines putting ``wrapper`` in place of a unit of several consecutive modules: at its first, the others idle.

    >>> print("\n".join(_unit_wrap_lines(("net.conv1", "net.bn1"), "self", "Checkpointed")))
    self.net.conv1 = Checkpointed(self.net.conv1, self.net.bn1)
    self.net.bn1 = nn.Identity()  # it runs in the unit before it now
    """
    paths = [_code_path(name, "", root) for name in unit]
    return [
        f"{paths[0]} = {wrapper}({', '.join(paths)})",
        *(f"{path} = nn.Identity()  # it runs in the unit before it now" for path in paths[1:]),
    ]


def _wrapper_snippet(plan: CheckpointPlan, context: CodeContext) -> str:
    """The ``Checkpointed`` wrapper put in place of each unit (every stack's), once the model is built.

    A unit of several modules stands at its first module, the others replaced by ``nn.Identity()``.
    """
    selective = set(plan.selective)
    lines: list[str] = []
    shared: list[str] = []  # after every other unit's wrapper, so that a place inside one is left to it
    others = len(plan.units) > 1
    for (_, kept, several), group in groupby(
        plan.units, key=lambda unit: (unit[0].rpartition(".")[0], unit[0] in selective, len(unit) > 1)
    ):
        wrapper = "SelectivelyCheckpointed" if kept else "Checkpointed"
        if several:
            lines += [line for unit in group for line in _unit_wrap_lines(unit, context.model, wrapper)]
            continue
        names = [unit[0] for unit in group]
        shared += [
            line
            for name in names
            if name in plan.shared
            for line in _shared_lines(name, context.model, wrapper, others)
        ]
        if own := [name for name in names if name not in plan.shared]:
            lines += _wrap_lines(own, context.model, wrapper)
    lines += shared
    classes = f"{CHECKPOINTED_CLASS}\n\n{SELECTIVE}" if selective else CHECKPOINTED_CLASS
    then = " and `.then`" if any(len(unit) > 1 for unit in plan.units) else ""
    return (
        f"{KEEPING_BUFFERS}\n\n{classes}\n\n"
        f"# {context.built('the model')} (their state_dict keys gain `.block`{then}):\n" + "\n".join(lines)
    )


def _in_place_snippet(plan: CheckpointPlan, bounds: list[tuple[int, int]], context: CodeContext) -> str:
    r"""Each unit of an ``nn.Sequential`` no user forward calls, children ``start`` to ``end - 1``, put in place.

    >>> code = _in_place_snippet(CheckpointPlan("", (), None, 0), [(1, 3), (3, 4)], CodeContext(TrainingLoop.PLAIN))
    >>> print(code.rpartition("\n\n")[2])  # doctest: +ELLIPSIS
    # after building the model (...), before creating its optimizer and starting the loop (...):
    for start, end in ((1, 3), (3, 4)):
        model[start] = Checkpointed(*model[start:end])
        for index in range(start + 1, end):
            model[index] = nn.Identity()  # it runs in the unit before it now
    """
    path = _code_path(plan.container, "", context.model)
    spans = ", ".join(f"({start}, {end})" for start, end in bounds)
    lines = [
        f"for start, end in ({spans}{',' if len(bounds) == 1 else ''}):",
        f"    {path}[start] = Checkpointed(*{path}[start:end])",
        "    for index in range(start + 1, end):",
        f"        {path}[index] = nn.Identity()  # it runs in the unit before it now",
    ]
    return (
        f"{KEEPING_BUFFERS}\n\n{CHECKPOINTED_CLASS}\n\n"
        f"# {context.built('the model')} (each unit of `{path}` runs where its first child was, under checkpointing;"
        " their state_dict keys gain `.block` and `.then`):\n" + "\n".join(lines)
    )


def _segment_bounds(plan: CheckpointPlan) -> list[tuple[int, int]]:
    """The children each checkpointed unit of an ``nn.Sequential`` plan runs, ``(start, end)``."""
    if plan.sequential_segments is not None:
        bounds: list[tuple[int, int]] = []
        for unit in plan.units:
            start = bounds[-1][1] if bounds else 0
            bounds.append((start, start + len(unit)))
        return bounds
    return [(int(unit[0].rpartition(".")[2]), int(unit[-1].rpartition(".")[2]) + 1) for unit in plan.units]


def checkpoint_snippet(plan: CheckpointPlan, context: CodeContext | None = None) -> tuple[str, str]:
    """What the plan checkpoints, in words (for the title), and the code to write (for the detail).

    The code is written for ``context`` (default: a LightningModule).
    """
    context = context or CodeContext()
    with _keyed(context.keyed):
        return _checkpoint_snippet(plan, context)


def _checkpoint_snippet(plan: CheckpointPlan, context: CodeContext) -> tuple[str, str]:
    """:func:`checkpoint_snippet`, its paths reaching a ModuleDict's children by key."""
    if plan.switch is not None:
        return _switch_snippet(plan, context)
    forward_of = plan.forward_of or ""
    where = f"the forward of `{forward_of}`" if forward_of else context.root_forward
    one_module = plan.sequential_segments is None and all(len(unit) == 1 for unit in plan.units)
    if context.no_forward(forward_of) and not one_module:
        what = (
            f"{len(plan.units)} units of {f'`{plan.container}`' if plan.container else 'the model'} (an nn.Sequential)"
        )
        return what, _in_place_snippet(plan, _segment_bounds(plan), context)
    if plan.sequential_segments is not None:
        path = _code_path(plan.container, forward_of)
        what = f"`{plan.container}` (an nn.Sequential) in {plan.sequential_segments} segments"
        code = (
            f"{KEEPING_BUFFERS}\n\n"
            f"# in {where}, instead of {path}(x), its segments as torch's checkpoint_sequential splits them; the last"
            " segment runs without checkpointing:\n" + "\n".join(_segments_lines(plan, path))
        )
        return what, code
    what = plan.span_text("`", ": matrix products and attention kept")
    if one_module or plan.selective or len({unit[0].rpartition(".")[0] for unit in plan.units}) > 1:
        # The wrapper puts each unit in place whoever calls it: units of several modules' children, selective ones.
        return what, _wrapper_snippet(plan, context)
    lines = [_unit_line(unit, forward_of) for unit in plan.units]
    if len(lines) > CHECKPOINT_LINES:
        rest = ", ".join(f"`{unit[0]}`" for unit in plan.units[CHECKPOINT_LINES:])
        lines = [*lines[:CHECKPOINT_LINES], f"# ... and the same for {rest}"]
    merged = [f"`{name}`" for unit in plan.units for name in unit[1:]]
    note = (
        f"# ({', '.join(merged)} run(s) inplace: each stays in the unit before it, which recomputes it)\n"
        if merged
        else ""
    )
    code = (
        f"{KEEPING_BUFFERS}\n\n"
        f"# in {where}, replace the call of each unit by (everything else runs as before):\n{note}" + "\n".join(lines)
    )
    return what, code

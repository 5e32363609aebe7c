"""FSDP2's rank at any world size: torch's own ``fully_shard`` replayed under torch's fake process group.

The replay's fake copy of the module is sharded by ``fully_shard`` over a one-dimensional mesh of a fake process
group of ``world_size`` ranks (``init_process_group("fake", ...)``: every collective returns at once, sends nothing
and waits for no rank), as torchtitan's estimator does; the step then runs through the root module's ``forward``
(under the usual policy, whose root unit is the module; a LightningModule has its ``training_step`` called
directly, as ``ModelParallelStrategy`` calls it, where it shards itself in ``configure_model`` or where the printed
``configure_model`` shards a child of it as the root, ``self.model``: a step that never calls that root fails as it
fails there), so FSDP2's hooks all-gather and free
each unit's parameters, reduce-scatter its gradients, and the optimizer steps on this rank's shards, all on fake
tensors, counted as any replay (sharded parameters, gradients and state at this rank's shard; gathered parameters while
gathered, as parameters; the all-gather and reduce-scatter buffers in ``other``).

The sharding is the module's own where it has one: a LightningModule overriding ``configure_model`` is given the
fake group's mesh as ``device_mesh`` (dimensions ``data_parallel`` of ``world_size`` and ``tensor_parallel`` of 1,
as Lightning's ``ModelParallelStrategy`` builds it) and shards itself; any other module is sharded by the usual
policy (:func:`shard_units`): each entry of every outermost ``nn.ModuleList`` (a transformer's blocks; a list inside
a block is the block's), or without one the outermost siblings of one class (an ``nn.Sequential``'s blocks), then
the root; a plan prints the ``configure_model`` that shards so (:func:`usual_policy_code`).

FSDP2 frees and regrows a gathered parameter by resizing its storage (``untyped_storage().resize_``), which no
dispatch mode sees: the live count of a replay, like the monitor's live count of a CPU step, counts a storage from
the op that made it to its death, at the size it was made (the CPU ground truth agrees to the byte; on CUDA the
allocator sees each resize, which the allocator-side check on a GPU is still to compare).

Under gradient accumulation (``Predictor(accumulate=k)``) the replay runs a window's first micro-batch and a later
one with the step, sharded the same way: Lightning's ``ModelParallelStrategy`` keeps gradient sync on (its
``block_backward_sync`` blocks DDP's alone; it never calls ``set_requires_gradient_sync(False)``), so every
micro-batch gathers and reduce-scatters, adding into the sharded gradients held across the window. A step that turns
sync off itself (``self.network.set_requires_gradient_sync(batch_idx % 2 == 1)``) does so on the replay's copy too:
each replayed micro-batch is given the ``batch_idx`` of its place in the window (0 for the first, ``k - 1`` for the
one with the step: :data:`~lightning_vram.prediction.replay.step.BATCH_INDEX`), and FSDP2's ``post_backward`` then
skips that micro-batch's reduce-scatter as the run does, its gradients left on the unsharded parameters
(``_unsharded_param.grad``, or ``unsharded_accumulated_grad`` under a reduce dtype), none on the sharded ones.

The fake group is the default process group while the replay runs, set up and destroyed around it. A live rank of a
run sharded by ``fully_shard`` (its process group already the default one) is predicted too
(:func:`predict`'s ``live``): its units are read from the live module (:func:`live_units`), the replay's twin is the
module unsharded (:mod:`~lightning_vram.prediction.replay.unsharded`), and each unit is sharded again as the run
sharded it, over fake groups of torch's ``fake`` backend made beside the run's (:func:`side_meshes`: registered for
the replay only, destroyed after it); their collectives send nothing and wait for no rank, and no collective of the
run's own groups runs (:mod:`~lightning_vram.prediction.containment.collectives`).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, overload

import torch
import torch.distributed as dist
from torch import nn

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.step import StepFunction, lightning_training_step
from lightning_vram.prediction.replay.unsharded import fsdp2_units
from lightning_vram.prediction.strategies._shards import first_optimizer, flat_state_bytes, optimizer_like
from lightning_vram.prediction.strategies.ddp import nccl_line
from lightning_vram.records import Phase, PhasePeak, RankLine, RankStep, ReplaySkipped, StepChange, StrategySpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

METHOD = "replayed: torch's fully_shard under a fake process group"
"""How an FSDP2 rank is predicted."""
CHUNKING = "_chunk_with_empty"
"""FSDP2's function splitting a parameter into its ranks' chunks (torch 2.13, imported into ``_fsdp_param``)."""
META_SKIP = (
    "fsdp2 on the meta device: not replayed (torch's fully_shard takes its device, streams and events from the"
    " device mesh's device module, and the meta device has none); a module built on the CPU is replayed"
)
"""Why an FSDP2 rank of a module on the meta device is not predicted (torch 2.13: ``fully_shard`` raised
``AttributeError: 'NoneType' object has no attribute 'current_device'`` there)."""
FSDP_NOTES = ("FSDP", "_fsdp", "_state_ctx", "_comm_ctx")
"""What marks a containment note about FSDP2's own state on the replay's copy (the objects its hooks hold, which
the replay's copy made and changes as FSDP2 does): left out of the rank's notes."""


@contextmanager
def fake_group(world_size: int) -> Iterator[None]:
    """The fake process group of ``world_size`` ranks as the default group, this process rank 0; destroyed after.

    ``RuntimeError`` where a process group is initialized already (it is left as it was). ``init_process_group``
    wraps ``sys.excepthook`` to prefix every line of an uncaught exception's traceback with ``[rank0]:``, and
    ``destroy_process_group`` leaves it wrapped (torch 2.13): the hook is put back as it was, else each replay under a
    fake group wrapped it once more (after a plan, the user's next traceback had every line prefixed 8 times).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is initialized in this process")
    excepthook = sys.excepthook
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()
    finally:
        sys.excepthook = excepthook


class RankChunks(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, count, dim)`` padded with empty tensors to ``count``, each chunk made when it is read.

    The chunk ``torch.chunk`` would give (a view of the same rows, by ``narrow``), or an empty tensor past the rows.
    """

    def __init__(self, tensor: torch.Tensor, count: int, dim: int) -> None:
        self.tensor, self.size, self.dim = tensor, count, dim
        self.rows = -(-tensor.shape[dim] // count) if tensor.shape[dim] else 0  # torch.chunk's chunk size

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(index)
        start = (index % self.size) * self.rows
        length = min(self.rows, self.tensor.shape[self.dim] - start)
        if length <= 0:
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, length)


@contextmanager
def rank_chunks() -> Iterator[None]:
    """FSDP2's chunking made lazy while the replay shards (put back after).

    ``fully_shard`` splits each parameter into ``world_size`` chunks on dim 0, padded with a new empty tensor for
    each chunk past the parameter's rows (torch 2.13, ``_fsdp_common._chunk_with_empty``), and reads only this
    rank's: at 1,024 fake ranks that made a fake op per rank and parameter, most of the replay's time.
    :class:`RankChunks` makes only the chunk read, the same view.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = getattr(_fsdp_param, CHUNKING)
    setattr(_fsdp_param, CHUNKING, RankChunks)
    try:
        yield
    finally:
        setattr(_fsdp_param, CHUNKING, original)


@contextmanager
def gloo_reduce_scatter_copies() -> Iterator[None]:
    """Each reduce-scatter of the replay holding a copy of its whole input while it runs, as gloo's does.

    Gloo has no reduce-scatter of its own: ``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` (what
    ``dist.reduce_scatter_single`` reaches, torch 2.13) clones the whole input on the calling thread, all-reduces the
    clone and copies this rank's chunk out; the fake groups allocate nothing, NCCL reduce-scatters in place. A live
    rank on gloo holds that clone beside FSDP2's reduce-scatter input and output (docs/measurement.md, "Why an FSDP2
    gloo rank's backward peak has more than its replay"): its replay holds one too, freed when the call returns (the
    runs measured freed the rank's on its own thread after the peak, nothing released late).
    """
    reduce_scatter = dist.reduce_scatter_single

    def copying(*args: Any, **kwargs: Any) -> Any:
        source = kwargs["input"] if "input" in kwargs else args[1]
        copy = source.clone()  # gloo's: held while the collective runs
        try:
            return reduce_scatter(*args, **kwargs)
        finally:
            del copy

    dist.reduce_scatter_single = copying
    try:
        yield
    finally:
        dist.reduce_scatter_single = reduce_scatter


TIMEOUT = timedelta(minutes=1)
"""The side groups' timeout (a fake group never waits)."""
SIDE_GROUP = "lightning_vram_fake"
"""How the names of the fake groups made beside a live run's start (each ends with a fresh uuid)."""


@dataclass(frozen=True)
class LiveUnit:
    """One ``fully_shard`` unit of a live run, as the run sharded it.

    ``name``: its name in the module (the root's ``""``). ``reshard``: ``reshard_after_forward`` as given (``None``:
    torch's default, every unit but the root). ``mp_policy``: its mixed-precision policy. ``offload``: whether it
    offloads to the CPU (``CPUOffloadPolicy``; sharded again with :func:`offload_policy`).
    """

    name: str
    reshard: bool | None
    mp_policy: MixedPrecisionPolicy
    offload: bool = False


@dataclass(frozen=True)
class LiveUnits:
    """A live FSDP2 run's units, outermost first, this process's rank in it, and its optimizer.

    ``optimizer``: the run's (its class and first group's settings), for a module without ``configure_optimizers``
    (a Fabric loop's): the replay builds one like it on its copy's shards. ``None``: none known.
    """

    units: tuple[LiveUnit, ...]
    rank: int
    optimizer: torch.optim.Optimizer | None = None

    @property
    def offload(self) -> bool:
        """Whether the run offloads to the CPU (every unit does: :func:`live_units` refuses a mix)."""
        return any(unit.offload for unit in self.units)


def live_units(module: nn.Module, rank: int, optimizer: torch.optim.Optimizer | None = None) -> LiveUnits | str:
    """The units of a live FSDP2 ``module`` as the run sharded them; or why they are not modelled (a reason).

    ``optimizer``: the run's, kept with them (:attr:`LiveUnits.optimizer`). Read from FSDP2's state on each unit
    (torch 2.13: ``FSDPState``, its ``FSDPParamGroup``): nothing is changed.
    """
    units = []
    offloads: set[bool] = set()  # of the units holding parameters
    for name, unit in fsdp2_units(module):
        state = unit._get_fsdp_state()  # type: ignore[operator]
        if len(getattr(state, "_modules", (unit,))) != 1:
            return "fsdp2: a unit of several modules (fully_shard of a list) is not modelled yet"
        reshard: bool | None = None
        offload = False
        for group in getattr(state, "_fsdp_param_groups", ()):
            if type(group.mesh_info).__name__ != "FSDPMeshInfo":
                return "fsdp2: HSDP (a two-dimensional mesh) is not modelled yet"
            policy = type(group.offload_policy).__name__
            if policy not in ("OffloadPolicy", "CPUOffloadPolicy"):
                return f"fsdp2 with the offload policy {policy}: not modelled yet"
            offload = policy == "CPUOffloadPolicy"
            offloads.add(offload)
            after = group.post_forward_mesh_info
            if after is not None and after is not group.mesh_info:
                return "fsdp2: reshard_after_forward to a smaller mesh (an integer) is not modelled yet"
            if not getattr(state, "_auto_reshard_after_forward", False):
                reshard = after is not None
        units.append(LiveUnit(name, reshard, state._mp_policy, offload))
    if len(offloads) > 1:
        return "fsdp2: some units offloaded to the CPU and some not: not modelled yet"
    offload = offloads == {True}  # a unit holding no parameter of its own (the root) as the others
    return LiveUnits(tuple(replace(unit, offload=offload) for unit in units), rank, optimizer)


@contextmanager
def side_meshes(world_size: int, rank: int, device_type: str) -> Iterator[tuple[DeviceMesh, DeviceMesh]]:
    """Meshes over fake groups of ``world_size`` ranks beside a live run's groups, this process ``rank``.

    The flat mesh and Lightning's ``ModelParallelStrategy`` one (as :func:`meshes`). Each group is of torch's
    ``fake`` backend: its collectives send nothing and wait for no rank. They are registered in
    ``torch.distributed``'s tables for the replay only (made locally, no collective: the run's own groups are not
    used), and destroyed after. ``RuntimeError`` where the run's world size is not ``world_size``.
    """
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers the "fake" backend

    if dist.get_world_size() != world_size:
        raise RuntimeError(f"the run has {dist.get_world_size()} ranks, not {world_size}")

    made: list[dist.ProcessGroup] = []
    try:
        for ranks in (list(range(world_size)), [rank]):
            name = c10d.GroupName(f"{SIDE_GROUP}_{uuid.uuid4().hex}")
            group, _store = c10d._new_process_group_helper(
                len(ranks), ranks.index(rank), ranks, "fake", FakeStore(), group_name=name, timeout=TIMEOUT
            )
            assert isinstance(group, dist.ProcessGroup)
            made.append(group)
            c10d._world.pg_group_ranks[group] = {global_rank: index for index, global_rank in enumerate(ranks)}
        data, single = made
        flat = DeviceMesh.from_group(data, device_type)
        grid = torch.arange(world_size).reshape(world_size, 1)
        names = ("data_parallel", "tensor_parallel")
        lightning = DeviceMesh.from_group([data, single], device_type, mesh=grid, mesh_dim_names=names)
        yield flat, lightning
    finally:
        for group in made:
            dist.destroy_process_group(group)


def live_sharder(units: LiveUnits, flat: DeviceMesh, lightning: DeviceMesh) -> Callable[[nn.Module], None]:
    """The function that shards a replay's unsharded twin as the live run sharded its module, over fake meshes.

    A module without ``configure_optimizers`` is given one building an optimizer like the run's on its shards.
    """
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    def shard(module: nn.Module) -> None:
        if "_device_mesh" in vars(module):
            vars(module)["_device_mesh"] = lightning  # as ModelParallelStrategy set it on the live module
        optimizer = units.optimizer
        if optimizer is not None and not callable(getattr(module, "configure_optimizers", None)):
            # an instance attribute of the replay's copy only
            vars(module)["configure_optimizers"] = lambda: optimizer_like(optimizer, module.parameters())
        for unit in reversed(units.units):  # innermost first
            target = module.get_submodule(unit.name)
            policy = offload_policy() if unit.offload else OffloadPolicy()
            fully_shard(
                target, mesh=flat, reshard_after_forward=unit.reshard, mp_policy=unit.mp_policy, offload_policy=policy
            )

    return shard


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The modules the usual policy shards, then the root: a model's blocks, each its own unit.

    The blocks are each entry of every outermost ``nn.ModuleList`` (a transformer's layers). A ``ModuleList`` inside
    an entry belongs to that entry's unit (T5's blocks each hold their layers in one, as a user's ``for block in
    model.encoder.block: fully_shard(block)`` leaves them); a ``ModuleList`` of ``ModuleList`` s is looked into, its
    entries' entries the units (a list has no ``forward`` for FSDP2's hooks). Sharding an outer entry before an entry
    inside it gave ``fully_shard`` parameters already sharded, which it refused ("Invariant encountered: value was
    None").

    A model without a ``ModuleList`` has its blocks found as siblings: the outermost children of one parent that
    share a class and hold parameters, two or more of them (an ``nn.Sequential`` of blocks, a ResNet stage's blocks,
    ``self.block1`` and ``self.block2``), containers (``nn.Sequential``, ``nn.ModuleDict``) looked into, never a
    unit. As Lightning's and torchtitan's ``configure_model`` shard each transformer block, then the model: before,
    such a model was sharded as the root alone, every parameter gathered for the whole step. A ``ModuleList``
    holding no parameter (empty, or of activations) is no model's blocks: it neither shards its entries nor keeps
    the siblings from being found (a model with an empty ``nn.ModuleList()`` of optional layers was sharded as the
    root alone).

    A block or entry sharing a parameter with a module outside it (tied embeddings ``tgt.weight = src.weight``) is
    no unit, its parameters left to the unit above: ``fully_shard`` refuses a parameter two units manage
    ("shared with a parameter already managed by another FSDP group"), which left such a model without FSDP2 rows.

    >>> class Block(nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.layer = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    >>> model = nn.Sequential(nn.ModuleList([Block(), Block()]), nn.Linear(2, 2))
    >>> [name for unit in shard_units(model) for name, child in model.named_modules() if child is unit]
    ['0.0', '0.1', '']
    >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    >>> [name for unit in shard_units(model) for name, child in model.named_modules() if child is unit]
    ['2.0', '2.1', '']
    """
    tied = _tied_modules(module)
    if any(isinstance(child, nn.ModuleList) and _holds_parameters(child) for child in module.modules()):
        return [*_list_entries(module, tied), module]
    return [*_sibling_blocks(module, tied), module]


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _tied_modules(module: nn.Module) -> set[int]:
    """The ids of the modules under ``module`` holding a parameter that a module outside them holds too."""
    holders: dict[int, set[int]] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        for parameter in sub.parameters(recurse=False):
            holders.setdefault(id(parameter), set()).add(id(sub))
    tied: set[int] = set()
    for sub in module.modules():
        inside = {id(inner) for inner in sub.modules()}
        shared = (holders[id(parameter)] for parameter in sub.parameters())
        if any(not holding <= inside for holding in shared):
            tied.add(id(sub))
    return tied


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
"""Modules that hold others and are never a block of the usual policy themselves (looked into)."""


def _list_entries(module: nn.Module, tied: set[int]) -> list[nn.Module]:
    """Each entry of every outermost ``nn.ModuleList`` holding parameters under ``module``, but those in ``tied``.

    Lists of lists are looked into.
    """
    units: list[nn.Module] = []
    seen: set[int] = set()
    visited: set[int] = set()

    def entries(modules: nn.ModuleList) -> None:
        for entry in modules:
            if isinstance(entry, nn.ModuleList):
                entries(entry)
            elif id(entry) not in seen and id(entry) not in tied:
                seen.add(id(entry))
                units.append(entry)

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, nn.ModuleList):
                if _holds_parameters(child):
                    entries(child)
            elif id(child) not in visited:
                visited.add(id(child))
                visit(child)

    visit(module)
    return units


def _sibling_blocks(module: nn.Module, tied: set[int]) -> list[nn.Module]:
    """The outermost siblings of one class holding parameters, two or more, under ``module``, none in ``tied``.

    Containers are looked into.
    """
    units: list[nn.Module] = []
    visited: set[int] = set()

    def visit(parent: nn.Module) -> None:
        children = []
        for child in parent.children():
            if id(child) not in visited:
                visited.add(id(child))
                children.append(child)
        candidates = [
            child
            for child in children
            if not isinstance(child, CONTAINERS) and _holds_parameters(child) and id(child) not in tied
        ]
        counts: dict[type, int] = {}
        for child in candidates:
            counts[type(child)] = counts.get(type(child), 0) + 1
        for child in children:
            if child in candidates and counts[type(child)] >= 2:
                units.append(child)
            else:
                visit(child)

    visit(module)
    return units


def meshes(world_size: int, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The fake group's meshes: one-dimensional, and Lightning's ``ModelParallelStrategy`` one.

    The second has dimensions ``data_parallel`` (``world_size``) and ``tensor_parallel`` (1). Make them with the fake
    group set up, outside any fake mode (a mesh reads its ranks' values).
    """
    from torch.distributed.device_mesh import init_device_mesh

    flat = init_device_mesh(device_type, (world_size,))
    lightning = init_device_mesh(device_type, (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    return flat, lightning


def sharder(
    spec: StrategySpec, flat: DeviceMesh, lightning: DeviceMesh, as_printed: bool = False
) -> Callable[[nn.Module], None]:
    """The function that shards a replay's fake copy under ``spec`` over the fake group's meshes (:func:`meshes`).

    Under the usual policy ``as_printed`` shards the root :func:`usual_policy_code` prints (:func:`usual_root`, a
    LightningModule's ``self.model``) in place of the module itself, for a step run as Lightning runs it.

    With ``spec.offload`` every unit gets ``CPUOffloadPolicy(pin_memory=False)`` (a module sharding itself in
    ``configure_model``: as torch's default offload policy while it runs, :func:`offloading_by_default`).
    """
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy, fully_shard

    reshard = spec.sharding != "SHARD_GRAD_OP"
    policy = offload_policy() if spec.offload else OffloadPolicy()

    def shard(module: nn.Module) -> None:
        if _configures_itself(module):
            vars(module)["_device_mesh"] = lightning  # as ModelParallelStrategy sets it before configure_model
            with offloading_by_default(spec.offload):
                module.configure_model()  # type: ignore[operator]
            if spec.sharding is not None:
                for unit in module.modules():
                    if isinstance(unit, FSDPModule):
                        unit.set_reshard_after_forward(reshard, recurse=False)
            return
        units = shard_units(module)
        if as_printed:
            units[-1] = module.get_submodule(usual_root(module))
        for unit in units:
            fully_shard(unit, mesh=flat, reshard_after_forward=reshard, offload_policy=policy)

    return shard


def offload_policy() -> OffloadPolicy:
    """FSDP2's CPU offload as the replay runs it: unpinned (pinning needs a CUDA device, and fake tensors have none).

    Pinning changes where the host copies live, not their size; unpinned, FSDP2 copies the gradients back to the
    host synchronously (torch 2.13, ``foreach_reduce``), which a replay of one stream does anyway.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=False)


@contextmanager
def offloading_by_default(offload: bool) -> Iterator[None]:
    """``fully_shard``'s default ``offload_policy`` is :func:`offload_policy` while this runs (where ``offload``).

    For a module sharding itself in ``configure_model`` without naming an offload policy: the plan asks how it would
    run with CPU offload, as if it passed ``offload_policy=CPUOffloadPolicy()``. Put back after.
    """
    from torch.distributed.fsdp._fully_shard import _fully_shard

    function = getattr(_fully_shard.fully_shard, "__wrapped__", _fully_shard.fully_shard)
    defaults = function.__kwdefaults__
    if not offload or defaults is None:
        yield
        return
    function.__kwdefaults__ = {**defaults, "offload_policy": offload_policy()}
    try:
        yield
    finally:
        function.__kwdefaults__ = defaults


def _configures_itself(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule whose ``configure_model`` is its own (it shards itself there)."""
    try:
        from lightning.pytorch import LightningModule
    except ImportError:
        return False
    return isinstance(module, LightningModule) and type(module).configure_model is not LightningModule.configure_model


def redirected(step_function: StepFunction) -> StepFunction:
    """``step_function`` run through the root module's ``forward``, so that its FSDP2 hooks run.

    For the usual policy, whose root unit is the module itself (a user's ``configure_model`` shards the model its
    ``training_step`` calls: ``fully_shard(self.model)``, the same parameters), and a live run's twin (Fabric's
    ``_FabricModule`` calls the module's ``forward``). Lightning's ``ModelParallelStrategy`` redirects nothing: its
    model is the LightningModule, whose ``training_step`` it calls directly.
    """

    def step(module: nn.Module, batch: Any) -> Any:
        def forward() -> Any:
            del module.forward  # the class's forward again, should the step call it
            return step_function(module, batch)

        module.forward = forward  # an instance attribute of the replay's copy
        return module()

    return step


def padded_bytes(parameter: torch.Tensor, world_size: int) -> int:
    """A parameter's bytes all-gathered under FSDP2: dim 0 padded to a multiple of the world size.

    >>> padded_bytes(torch.empty(10, 3), 4)
    144
    """
    if parameter.dim() == 0:
        return world_size * parameter.element_size()
    rows = -(-parameter.shape[0] // world_size) * world_size
    return rows * (parameter.numel() // max(parameter.shape[0], 1)) * parameter.element_size()


def unit_bytes(module: nn.Module, world_size: int) -> list[tuple[str, int]]:
    """Each FSDP2 unit of the module sharded ``world_size`` ways, with its parameters' bytes all-gathered (padded).

    A unit's parameters are those under it that no nested unit manages. The root is named ``""``.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [(name, unit) for name, unit in module.named_modules() if isinstance(unit, FSDPModule)]
    claimed: set[int] = set()
    sized = []
    for name, unit in reversed(units):  # innermost first
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        sized.append((name, sum(padded_bytes(p, world_size) for p in own)))
    return sized[::-1]


def predict(
    predictor: Predictor, spec: StrategySpec, change: StepChange | None, live: LiveUnits | None = None
) -> RankStep | ReplaySkipped:
    """One FSDP2 rank of ``spec.world_size``: the predictor's (per-rank) step, sharded by ``fully_shard``.

    ``live``: the units of the live run this process is a rank of (its module unsharded in the twin, sharded again
    as the run sharded it over fake groups beside the run's); ``None``: the module is sharded by its own
    ``configure_model`` or the usual policy, under a fake default group.
    """
    if predictor.device_type == "meta":
        return ReplaySkipped(META_SKIP)
    if live is None and dist.is_initialized():
        return ReplaySkipped(
            "fsdp2: a process group is initialized in this process; the replay's fake group cannot replace it"
        )
    if live is not None and dist.get_world_size() != spec.world_size:
        return ReplaySkipped(f"fsdp2: a live rank is predicted at its run's world size ({dist.get_world_size()})")
    device_type = predictor.device_type
    units: list[tuple[str, int]] = []
    shard: list[Callable[[nn.Module], None]] = []

    # A LightningModule under the usual policy whose printed root is a child (self.model) is sharded as the printed
    # configure_model shards it and its training_step run as Lightning runs it: a step that never calls self.model
    # (its parts called one by one) fails as it fails there ("got mixed torch.Tensor and DTensor"), the root named
    # "" as the module's would be. Where the printed root is the module, the note asks for a training_step calling
    # self(...), and the step is run so (redirected)
    as_printed = (
        live is None
        and not _configures_itself(predictor.module)
        and _lightning_step(predictor)
        and usual_root(predictor.module) != ""
    )

    def shard_and_size(module: nn.Module) -> None:
        shard[0](module)
        root = usual_root(module) if as_printed else ""
        units[:] = [("" if name == root else name, size) for name, size in unit_bytes(module, spec.world_size)]

    if not callable(getattr(predictor.module, "configure_optimizers", None)) and (
        live is None or live.optimizer is None
    ):
        return ReplaySkipped("fsdp2: the module has no configure_optimizers to build its optimizer on its shards")
    sharded = predictor.sharing_walk()  # the same round (its walk, budget), its step sharded and redirected
    sharded.shard = shard_and_size
    # A LightningModule sharding itself runs its step as Lightning runs it under ModelParallelStrategy: its
    # training_step called directly (the strategy's model is the LightningModule, so Lightning redirects nothing),
    # and FSDP2's hooks run only on the units the step calls. A step that calls ``self.model(...)`` after
    # ``fully_shard(self)`` fails there as in the run ("got mixed torch.Tensor and DTensor"), not "fits".
    if live is None and (_configures_itself(predictor.module) or as_printed):
        sharded.step_function = predictor.step_function
    else:
        sharded.step_function = redirected(predictor.step_function)
    # The redirection calls the root module itself: the precision spans the step there, not Fabric's forward alone.
    sharded.fabric_forward = False
    sharded.warm_up = True  # the gradients and optimizer state come as shards from a first step
    sharded.optimizers = None  # built by configure_optimizers on the sharded parameters (as Lightning does)
    if live is None:
        with fake_group(spec.world_size), rank_chunks():
            shard.append(sharder(spec, *meshes(spec.world_size, device_type), as_printed))
            replayed = sharded.replay(change)
    else:
        gloo = dist.get_backend() == "gloo"  # the run's group: its reduce-scatters copy their inputs
        copies = gloo_reduce_scatter_copies() if gloo else nullcontext()
        with side_meshes(spec.world_size, live.rank, device_type) as (flat, lightning), rank_chunks(), copies:
            shard.append(live_sharder(live, flat, lightning))
            replayed = sharded.replay(change)
    if isinstance(replayed, ReplaySkipped):
        if as_printed and MIXED_DTENSOR in replayed.reason:
            root = _path(usual_root(predictor.module))
            return replace(
                replayed,
                reason=f"fsdp2: training_step never calls {root}(...), the root the printed"
                f" configure_model shards, so FSDP2 never gathers its parameters outside the blocks ({MIXED_DTENSOR}"
                f" under ModelParallelStrategy too): call {root}(...) from training_step",
            )
        return replayed
    lines = _lines(units, spec, device_type)
    phases, method = replayed.phases, METHOD
    optimizer = live.optimizer if live is not None and live.optimizer is not None else None
    optimizer = optimizer or first_optimizer(predictor.optimizers)
    if spec.offload:
        phases, host = offloaded(replayed.phases, units, spec.world_size, device_type, optimizer)
        lines, method = (*lines, *host), f"{METHOD}; {OFFLOAD_METHOD}"
    reshard = spec.sharding != "SHARD_GRAD_OP"
    # Lightning's ModelParallelStrategy keeps gradient sync on under accumulation (its block_backward_sync blocks
    # DDP's alone): every micro-batch gathers and reduce-scatters, adding into the sharded gradients it holds.
    sent = _sent(units, spec.world_size, reshard) * predictor.accumulate
    notes = tuple(note for note in replayed.notes if not any(mark in note for mark in FSDP_NOTES))
    window_first = replayed.window_first
    if spec.offload and window_first is not None:
        window_first = offloaded(window_first, units, spec.world_size, device_type, optimizer)[0]
    # offloaded, each all-gather copies the unit's shard to the device and each reduce-scatter its output back
    transfer = _copied(units, spec.world_size, reshard) * predictor.accumulate if spec.offload else 0
    return RankStep(spec, phases, lines, sent, method, notes, replayed, window_first, transfer)


def _copied(units: list[tuple[str, int]], world_size: int, reshard: bool) -> int:
    """Bytes an offloading rank copies between host and device per micro-batch: a shard per gather and per scatter."""
    return sum((2 if reshard and name else 1) * size // world_size + size // world_size for name, size in units)


OFFLOAD_METHOD = (
    "CPUOffloadPolicy(pin_memory=False) replayed: the sharded parameters, their gradients and the optimizer state"
    " on the host (host lines), the gathered units, their copies to the device, the reduce-scatter output and the"
    " activations on the device"
)
"""How an FSDP2 rank with CPU offload is split between the device and the host."""


def offloaded(
    phases: dict[Phase, PhasePeak],
    units: list[tuple[str, int]],
    world_size: int,
    device_type: str,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[dict[Phase, PhasePeak], tuple[RankLine, RankLine, RankLine]]:
    """An offloading rank's replayed ``phases`` on the device, and its host lines (shards, their gradients, state).

    Under ``CPUOffloadPolicy`` FSDP2 keeps each sharded parameter and its sharded gradient on the CPU, and the
    optimizer steps there (torch 2.13: ``FSDPParam._init_sharded_param`` moves the shard with ``.cpu()``,
    ``all_gather_inputs`` copies it to the device for each all-gather, ``foreach_reduce`` copies the reduce-scatter
    output back with ``.to("cpu")``). A replay on a device counts only the device's storages: its phases are the
    device's already (the copies to the device and the reduce-scatter output included), and the host lines are the
    shards' arithmetic (the state: ``optimizer``'s per element over each unit's shard, Adam's without one). On the
    CPU, host and device are one memory and torch's copies are no-ops: every part the host holds (the shards
    counted as parameters, the gradients, the state) is taken out of the phases, so that the device's phases and
    the host lines add up to what the replay counted, and the host lines are the counted parts; the optimizer
    step's temporaries, which a GPU's rank makes on the host, stay in the optimizer phase's ``other`` there.
    """
    shards = sum(size // world_size for _, size in units)  # each unit's padded bytes, one rank's share
    element = 4 if optimizer is None else next(p for g in optimizer.param_groups for p in g["params"]).element_size()
    state = sum(flat_state_bytes(optimizer, size // world_size // element) for _, size in units if size)
    gradients = shards
    device = phases
    if device_type == "cpu":
        stepped = phases[Phase.OPTIMIZER].breakdown
        if stepped is not None:
            gradients, state = stepped.gradients, stepped.optimizer_state
        device = {}
        for phase, peak in phases.items():
            parts = peak.breakdown
            if parts is None:
                device[phase] = peak
                continue
            held = (min(shards, parts.parameters), parts.gradients, parts.optimizer_state)
            kept = replace(parts, parameters=parts.parameters - held[0], gradients=0, optimizer_state=0)
            device[phase] = replace(peak, peak_bytes=peak.peak_bytes - sum(held), breakdown=kept)
    basis = f"{OFFLOAD_METHOD}; one rank's 1/{world_size} of each unit, padded"
    host = (
        RankLine("FSDP2 offloaded sharded parameters (host)", shards, basis, on_host=True),
        RankLine("FSDP2 offloaded sharded gradients (host)", gradients, basis, on_host=True),
        RankLine("FSDP2 offloaded optimizer state (host)", state, basis, on_host=True),
    )
    return device, host


def _lines(units: list[tuple[str, int]], spec: StrategySpec, device_type: str) -> tuple[RankLine, ...]:
    """The strategy's lines: the largest unit's all-gather and reduce-scatter buffers (in the replayed peaks)."""
    if not units:
        return nccl_line(spec.world_size, device_type)
    name, largest = max(units, key=lambda unit: unit[1])
    where = name or "the root"
    return (
        RankLine(
            f"FSDP2 all-gather buffer (largest unit: {where})",
            largest,
            "the unit's parameters, dim 0 padded to the world size, gathered whole for its forward and backward;"
            " replayed, in the parameters of the phases' peaks while gathered",
        ),
        RankLine(
            f"FSDP2 reduce-scatter buffer (largest unit: {where})",
            largest,
            "the unit's unsharded gradients, padded, reduce-scattered in backward; replayed, in the phases' other",
        ),
        *nccl_line(spec.world_size, device_type),
    )


def _sent(units: list[tuple[str, int]], world_size: int, reshard: bool) -> int:
    """Bytes each rank sends per step: ``(N - 1) / N`` of each unit per all-gather and per reduce-scatter.

    Forward all-gathers every unit; backward gathers again each unit resharded after forward (every one but the
    root, which FSDP2 keeps unsharded for backward); backward reduce-scatters every unit's gradients.
    """
    total = 0
    for name, size in units:
        gathers = 2 if reshard and name else 1
        total += (gathers + 1) * (world_size - 1) * size // world_size
    return total


def usual_policy_code(module: nn.Module) -> str | None:
    """The ``configure_model`` that shards ``module`` as its FSDP2 rows do (:func:`shard_units`), as one line of code.

    For a LightningModule trained under Lightning's ``ModelParallelStrategy``; ``None`` where it shards itself (its
    own ``configure_model`` is replayed). Each unit is named by its path (a parent all of whose children are units by
    its children), then the root: the one child holding the module's parameters (the model the ``training_step``
    calls, ``self.model``: under ``ModelParallelStrategy`` a step calling ``self.model(...)`` after
    ``fully_shard(self)`` never gathers the root's parameters), else the module itself.

    >>> class Net(nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    >>> print(usual_policy_code(Net()))  # doctest: +NORMALIZE_WHITESPACE
    def configure_model(self): from torch.distributed.fsdp import fully_shard; mesh = self.device_mesh["data_parallel"];
    [fully_shard(unit, mesh=mesh) for unit in (*self.get_submodule("model.1").children(),)];
    fully_shard(self.model, mesh=mesh)
    """
    if _configures_itself(module):
        return None
    names = {id(child): name for name, child in module.named_modules()}
    by_parent: dict[str, list[str]] = {}
    for unit in shard_units(module)[:-1]:
        name = names[id(unit)]
        by_parent.setdefault(name.rpartition(".")[0], []).append(name)
    listed: list[str] = []
    for parent, members in by_parent.items():
        children = [
            f"{parent}.{child}" if parent else child for child, _ in module.get_submodule(parent).named_children()
        ]
        if members == children:
            listed.append(f"*{_path(parent)}.children()")
        else:
            listed += [_path(member) for member in members]
    root = _path(usual_root(module))
    units = f"[fully_shard(unit, mesh=mesh) for unit in ({', '.join(listed)},)]; " if listed else ""
    return (
        "def configure_model(self): from torch.distributed.fsdp import fully_shard;"
        f' mesh = self.device_mesh["data_parallel"]; {units}fully_shard({root}, mesh=mesh)'
    )


def usual_root(module: nn.Module) -> str:
    """The name of the root :func:`usual_policy_code` shards last: the one child holding the parameters, else ``""``.

    >>> usual_root(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    '1'
    >>> usual_root(nn.Sequential(nn.Linear(2, 2), nn.Linear(4, 4)))
    ''

    """
    holders = [name for name, child in module.named_children() if _holds_parameters(child)]
    own = next(module.parameters(recurse=False), None) is not None
    return holders[0] if len(holders) == 1 and not own else ""


MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"
"""What torch raises where a step uses a parameter FSDP2 left sharded (its unit's forward never ran)."""


def _lightning_step(predictor: Predictor) -> bool:
    """Whether ``predictor`` runs a LightningModule's own ``training_step``, as Lightning does."""
    try:
        from lightning.pytorch import LightningModule
    except ImportError:
        return False
    return isinstance(predictor.module, LightningModule) and predictor.step_function is lightning_training_step


def _path(name: str) -> str:
    """``self``'s submodule ``name`` as code: an attribute where it is one, else ``get_submodule``.

    >>> _path("model"), _path("model.1"), _path("")
    ('self.model', 'self.get_submodule("model.1")', 'self')
    """
    if not name:
        return "self"
    return f"self.{name}" if name.isidentifier() else f'self.get_submodule("{name}")'

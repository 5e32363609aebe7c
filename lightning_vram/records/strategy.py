"""One rank of a multi-GPU plan: the strategy asked about, and what one of its ranks would hold.

A :class:`StrategySpec` names a strategy as a plan enumerates it (the strategy, the world size, its sharding and
offload settings); a :class:`RankStep` is one rank's predicted step under it: the phase peaks with their breakdown,
the lines the strategy holds beyond the module's own tensors (:class:`RankLine`), the bytes each rank sends per
optimizer step, and how the figures were made (the strategy's own code replayed, or its documented arithmetic).
All sizes are integer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_vram.records.measured import Phase, PhasePeak
from lightning_vram.records.simulation import ReplayedStep

STRATEGY_NAMES = (
    "single",
    "ddp",
    "fsdp2",
    "fsdp",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
)
"""The strategies a :class:`StrategySpec` may name: one device, DDP, FSDP2 (``fully_shard``), FSDP1, ZeRO 1-3."""
FSDP1_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
"""FSDP1's ``ShardingStrategy`` names a spec of ``"fsdp"`` may carry."""
FSDP2_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP")
"""FSDP2's ``reshard_after_forward`` as a sharding name: ``True`` is ``FULL_SHARD``, ``False`` ``SHARD_GRAD_OP``."""
MAX_WORLD_SIZE = 1024
"""The largest world size a spec may name."""


@dataclass(frozen=True)
class StrategySpec:
    """A strategy as a plan asks about it; checked at construction (a ``ValueError`` names the field).

    ``name``: one of :data:`STRATEGY_NAMES`. ``world_size``: ranks in all, 1 to :data:`MAX_WORLD_SIZE`.
    ``sharding``: FSDP1's sharding strategy (:data:`FSDP1_SHARDINGS`), or FSDP2's ``reshard_after_forward`` as
    ``"FULL_SHARD"`` (``True``) or ``"SHARD_GRAD_OP"`` (``False``); ``None``: the strategy's default (``FULL_SHARD``);
    only for ``fsdp`` and ``fsdp2``. ``offload``: CPU offload where the strategy has it (FSDP1, FSDP2, ZeRO).
    ``gpus_per_node``: ranks per node (hybrid sharding, the network a collective crosses); ``None``: one node.
    """

    name: str
    world_size: int = 1
    sharding: str | None = None
    offload: bool = False
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.name not in STRATEGY_NAMES:
            raise ValueError(f"name must be one of {', '.join(STRATEGY_NAMES)}; got {self.name!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise ValueError(f"world_size must be an int from 1 to {MAX_WORLD_SIZE}; got {self.world_size!r}")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be from 1 to {MAX_WORLD_SIZE}; got {self.world_size}")
        if self.name == "single" and self.world_size != 1:
            raise ValueError(f"world_size must be 1 for the single-device strategy; got {self.world_size}")
        allowed = {"fsdp": FSDP1_SHARDINGS, "fsdp2": FSDP2_SHARDINGS}.get(self.name, ())
        if self.sharding is not None and self.sharding not in allowed:
            expected = f"one of {', '.join(allowed)} or None" if allowed else "None"
            raise ValueError(f"sharding must be {expected} for {self.name}; got {self.sharding!r}")
        if self.offload and self.name in ("single", "ddp"):
            raise ValueError(f"offload must be False for {self.name} (it has no CPU offload); got True")
        if self.gpus_per_node is not None and not (
            isinstance(self.gpus_per_node, int) and 1 <= self.gpus_per_node <= self.world_size
        ):
            raise ValueError(
                f"gpus_per_node must be None or an int from 1 to world_size ({self.world_size}); got"
                f" {self.gpus_per_node!r}"
            )

    @property
    def label(self) -> str:
        """How a table names it: ``"fsdp2 x8 FULL_SHARD"``, ``"ddp x4"``, ``"deepspeed_stage_3 x16 offload"``."""
        words = [self.name if self.name == "single" else f"{self.name} x{self.world_size}"]
        if self.sharding is not None:
            words.append(self.sharding)
        if self.offload:
            words.append("offload")
        if self.gpus_per_node is not None:
            words.append(f"({self.gpus_per_node} per node)")
        return " ".join(words)


@dataclass(frozen=True)
class RankLine:
    """Something a strategy holds on one rank beyond the module's tensors: DDP's buckets, FSDP's buffers, NCCL's.

    ``bytes``: its size; ``basis``: the arithmetic or the code it came from; ``on_host``: held in host memory (an
    offloaded copy), not on the device; ``outside_allocator``: on the device but outside torch's caching allocator
    (NCCL's own buffers): in no phase's peak, kept free beside the CUDA context when a fit is simulated.
    """

    label: str
    bytes: int
    basis: str
    on_host: bool = False
    outside_allocator: bool = False

    @property
    def beside_allocator_bytes(self) -> int:
        """Device bytes this line takes outside the caching allocator (0 in host memory or inside the allocator)."""
        return self.bytes if self.outside_allocator and not self.on_host else 0


@dataclass(frozen=True)
class RankStep:
    """One rank's predicted training step under a strategy.

    ``phases``: each phase's peak and breakdown for this rank (as :attr:`ReplayedStep.phases`, the strategy's
    device lines included in the peaks). ``lines``: what the strategy holds beyond the module's own tensors, each
    on its own line (host memory with ``on_host``). ``communication_bytes``: what each rank sends per optimizer step.
    ``method``: how the figures were made (``"replayed: ..."`` where the strategy's own code ran, else
    ``"arithmetic on the single-process replay: <the strategy's rule>"``). ``replayed``: the replay underneath.
    Under gradient accumulation (``Predictor(accumulate=k)``, ``k > 1``) ``phases`` are the window's steady
    micro-batch (a later one, with the optimizer step) as the strategy runs it, and ``window_first`` the window's
    first micro-batch (its forward and backward, no optimizer step); ``None`` without accumulation, and where a
    strategy's arithmetic does not predict the first micro-batch (ZeRO, FSDP1: a note says so).
    """

    spec: StrategySpec
    phases: dict[Phase, PhasePeak]
    lines: tuple[RankLine, ...]
    communication_bytes: int
    method: str
    notes: tuple[str, ...] = ()
    replayed: ReplayedStep | None = field(default=None, compare=False, repr=False)
    window_first: dict[Phase, PhasePeak] | None = None
    host_transfer_bytes: int = 0
    """Bytes copied between the host and the device per optimizer step (CPU offload; 0 without it)."""

    @property
    def micro_batch(self) -> str:
        """Which micro-batch ``phases`` are: the step itself, or an accumulation window's steady one."""
        if self.replayed is None or self.replayed.window_first is None:
            return "the step"
        first = "window_first: the first" if self.window_first is not None else "the first not predicted"
        return f"steady: a later micro-batch of the window, with the optimizer step ({first})"

    @property
    def peak(self) -> PhasePeak:
        """The highest phase peak on the device (the first in step order on a tie), the window's first included."""
        first = () if self.window_first is None else tuple(self.window_first.values())
        return max((*self.phases.values(), *first), key=lambda phase: phase.peak_bytes)

    @property
    def host_bytes(self) -> int:
        """The strategy's lines held in host memory, in bytes."""
        return sum(line.bytes for line in self.lines if line.on_host)

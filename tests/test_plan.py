"""``plan()``: the README's quickstart at 1 and 2 GPUs, the micro-batch and accumulation a small card needs, the
global batch split over the ranks, and the table a person reads."""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_vram.measure.ddp import DEFAULT_BUCKET_BYTES, bucket_sizes, reduced_parameters
from lightning_vram.plan import ARITHMETIC_FIT, MANUAL_DDP_NOTE, plan
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.reserved import run_settings
from lightning_vram.prediction.strategies import predict_rank
from lightning_vram.prediction.strategies.fsdp2 import META_SKIP
from lightning_vram.records import RankStep, ReplayedStep, StrategySpec, in_phase_order
from lightning_vram.records.plan import TABLE_ROWS, Plan
from lightning_vram.units import MIB, format_bytes

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from quickstart import SmallCNN

# plan() replays the step under fake tensors.
pytestmark = pytest.mark.replay

BATCH = 64


def images(size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(size, 3, 32, 32), torch.zeros(size, dtype=torch.int64)


QUICKSTART_SETTINGS: dict[str, object] = {
    "gpus": ["T4", "H100 SXM"],
    "world_sizes": (1, 2),
    "strategies": ("ddp",),
    "precisions": ("32-true",),
    "checkpointing": (False,),
}


def quickstart_plan(**options: object) -> Plan:
    return plan(SmallCNN(), images(), **{**QUICKSTART_SETTINGS, **options})  # type: ignore[arg-type]


def test_the_quickstart_at_one_and_two_gpus() -> None:
    module = SmallCNN()
    result = quickstart_plan()
    assert result.fits and result.batch_source == "given" and result.global_batch is None
    configurations = {(row.gpu, row.gpus, row.strategy) for row in result.rows}
    assert configurations == {(gpu, 1, "single") for gpu in ("T4", "H100 SXM")} | {
        (gpu, 2, "ddp") for gpu in ("T4", "H100 SXM")
    }
    assert len(result.rows) == 4
    # The single GPU's rows are the step as predict() replays it for CUDA, allocated per phase.
    step = Predictor(
        module, None, images(), placement=torch.device("cpu"), warm_up=True, allocator=run_settings(), for_cuda=True
    )
    baseline = step.baseline()
    assert isinstance(baseline, ReplayedStep)
    expected = tuple((phase.value, peak.peak_bytes) for phase, peak in in_phase_order(baseline.phases))
    buckets = bucket_sizes(reduced_parameters(module), DEFAULT_BUCKET_BYTES, torch.float32).total_bytes
    assert buckets == sum(parameter.numel() * 4 for parameter in module.parameters())
    for row in result.rows:
        assert row.fits and row.shortfall is None
        assert (row.micro_batch, row.accumulation, row.global_batch) == (BATCH, 1, BATCH * row.gpus)
        assert row.precision == "32-true" and row.checkpointing is False
        held = buckets if row.strategy == "ddp" else 0  # DDP's buckets are held in every phase
        assert row.phases == tuple((phase, peak + held) for phase, peak in expected)
        assert row.peak_bytes == max(peak for _, peak in row.phases)
        assert row.reserved_bytes is not None and row.reserved_bytes >= row.peak_bytes
        assert row.step_seconds is not None and row.step_seconds > 0
        assert row.samples_per_second == pytest.approx(row.global_batch / row.step_seconds)  # type: ignore[operator]
    # Best first: all fit, so by throughput per GPU (1% steps), then fewer GPUs.
    per_gpu = [row.samples_per_second / row.gpus for row in result.rows]  # type: ignore[operator]
    assert all(later <= earlier * 1.01 for earlier, later in itertools.pairwise(per_gpu))
    # What the plan could not predict is said: the sharded strategies were not asked for, so nothing is left out.
    assert result.left_out == ()
    # One replay: the single GPU's, which with DDP's buckets added serves DDP at every world size, and each GPU.
    assert result.replays == 1


def test_ddp_s_replay_serves_every_world_size() -> None:
    result = quickstart_plan(gpus=["H100 SXM"], world_sizes=(1, 2, 4, 8))
    assert result.replays == 1 and [row.gpus for row in result.rows] == [1, 2, 4, 8]  # the most samples/s per GPU first
    rates = [row.samples_per_second for row in result.rows]
    assert all(rate is not None for rate in rates) and rates == sorted(rates)  # the whole run's: the most GPUs the most
    ddp = [row for row in result.rows if row.strategy == "ddp"]
    assert len({(row.peak_bytes, row.phases, row.parts) for row in ddp}) == 1  # a DDP rank's memory: any world size


def test_a_card_too_small_for_the_batch_gets_a_micro_batch_and_accumulation_that_keep_it() -> None:
    whole = quickstart_plan(gpus=[1024 * MIB], world_sizes=(1,)).rows[0]
    assert whole.fits and whole.micro_batch == BATCH
    # A card whose memory is under the whole batch's reserved peak: the largest halving that fits, accumulated.
    capacity = whole.reserved_bytes - 2 * MIB  # type: ignore[operator]
    result = quickstart_plan(gpus=[capacity], world_sizes=(1,), cuda_context_bytes=0)
    (row,) = result.rows
    assert row.fits and row.micro_batch is not None and row.micro_batch < BATCH
    assert row.micro_batch * row.accumulation == BATCH
    assert row.reserved_bytes is not None and row.reserved_bytes <= capacity < whole.reserved_bytes  # type: ignore[operator]
    # Nothing fits a card of 1 MiB: the row is the smallest micro-batch tried, with the request that failed.
    nothing = quickstart_plan(gpus=[MIB], world_sizes=(1,), cuda_context_bytes=0)
    (row,) = nothing.rows
    assert not nothing.fits and not row.fits and (row.micro_batch, row.accumulation) == (1, BATCH)
    assert row.shortfall is not None and "asked for" in row.shortfall
    assert str(nothing).startswith("Plan: none of 1 configurations fits")


def test_a_global_batch_is_split_over_the_ranks() -> None:
    result = quickstart_plan(gpus=["H100 SXM"], world_sizes=(1, 2, 3), global_batch=128)
    shares = {row.gpus: (row.micro_batch, row.accumulation, row.global_batch) for row in result.rows}
    assert shares == {1: (128, 1, 128), 2: (64, 1, 128)}
    assert result.left_out == ("a global batch of 128 does not split over 3 GPUs: ddp x3, 32-true",)


def test_the_table_reads_in_100_columns_and_the_json_has_every_row() -> None:
    result = quickstart_plan(precisions=("32-true", "bf16-mixed"), checkpointing=(False, True))
    text = str(result)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert lines[0].startswith(f"Plan: {len(result.rows)} of {len(result.rows)} configurations fit; best: ")
    header = "GPU mem n strategy precision ckpt micro peak/rank fits step samples/s"
    assert lines[2].split() == header.split()
    best = result.rows[0]
    assert lines[3].split()[:3] == [*best.gpu.split(), f"{best.gpu_bytes / 2**30:.1f}G"]
    # The T4 has no bf16 tensor cores: its bf16 rows are left out, saying so; 12 rows, all printed.
    assert len(result.rows) == 12 and f"({12 - TABLE_ROWS} more" not in text
    assert {(row.gpu, row.precision) for row in result.rows if row.precision == "bf16-mixed"} == {
        ("H100 SXM", "bf16-mixed")
    }
    assert result.left_out == (
        "T4 has no bf16 tensor cores (bf16 runs at its fp32 rate; plan it in 16-mixed): bf16-mixed",
    )
    assert "left out: T4 has no bf16 tensor cores" in text
    sixteen = quickstart_plan(gpus=["T4"], world_sizes=(1,), precisions=("16-mixed",))
    assert [(row.gpu, row.precision) for row in sixteen.rows] == [("T4", "16-mixed")] and sixteen.left_out == ()
    assert any(line.startswith("  fits: the caching allocator model serves the step") for line in lines)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["fits"] is True and len(data["rows"]) == 12
    assert data["rows"][0]["phases"] == dict(best.phases) and data["rows"][0]["global_batch"] == best.global_batch
    assert {row["checkpointing"] for row in data["rows"]} == {False, True}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gpus": ["Z80"]}, "gpus must name one of: RTX 3060"),
        ({"world_sizes": (0,)}, "world_sizes must hold ints from 1 to 1024, got 0"),
        ({"strategies": ("horovod",)}, "strategies must be one of ddp, fsdp2, fsdp"),
        ({"precisions": ("fp8",)}, "precisions must be one of 32-true"),
        ({"global_batch": 0}, "global_batch must be None or an int from 1"),
        ({"nodes": 2, "world_sizes": (1, 2)}, r"world_sizes must be multiples of nodes \(2\), got 1"),
        # No GPU count it splits over: nothing could be planned (a count it does not split over is left out).
        (
            {"global_batch": 10, "world_sizes": (4, 8)},
            r"global_batch must be a multiple of a GPU count planned for \(4, 8\), got 10$",
        ),
        (
            {"global_batch": 8, "batch": torch.zeros(())},
            r"global_batch must be None \(unset\) for a batch with no batch",
        ),
    ],
)
def test_a_bad_argument_fails_naming_it(options: dict[str, object], message: str) -> None:
    batch = options.pop("batch", images())
    with pytest.raises(ValueError, match=message):
        plan(SmallCNN(), batch, **{**QUICKSTART_SETTINGS, **options})  # type: ignore[arg-type]


def test_a_rank_by_a_strategy_s_arithmetic_fits_by_its_peak_with_the_margin() -> None:
    zero = quickstart_plan(gpus=["T4"], world_sizes=(2,), strategies=("deepspeed_stage_2",))
    (row,) = zero.rows
    assert row.strategy == "deepspeed_stage_2" and row.method.startswith("arithmetic on the single-process replay")
    assert row.fits and row.reserved_bytes is None and ARITHMETIC_FIT in zero.notes
    # A card whose 90%, less the context, is just under the peak: it does not fit, at any micro-batch tried.
    capacity = int(row.peak_bytes / 0.9) + 2 * MIB
    larger = quickstart_plan(gpus=[capacity], world_sizes=(2,), strategies=("deepspeed_stage_2",), cuda_context_bytes=0)
    assert larger.rows[0].fits and larger.rows[0].micro_batch == BATCH
    smaller = quickstart_plan(
        gpus=[capacity - 4 * MIB], world_sizes=(2,), strategies=("deepspeed_stage_2",), cuda_context_bytes=0
    )
    assert smaller.rows[0].micro_batch != BATCH or not smaller.rows[0].fits


def test_zero_1_is_planned_as_its_rank_predictor_gives_it() -> None:
    # By default and by name (docs/planning.md lists it): a rank of 4 at the global batch of 2 x 64 samples.
    assert "deepspeed_stage_1" in {row.strategy for row in quickstart_plan(gpus=["H100 SXM"], strategies=None).rows}
    result = quickstart_plan(gpus=["H100 SXM"], world_sizes=(4,), strategies=("deepspeed_stage_1",))
    (row,) = result.rows
    assert (row.gpus, row.strategy, row.micro_batch, row.accumulation) == (4, "deepspeed_stage_1", BATCH, 1)
    step = Predictor(SmallCNN(), None, images(), placement=torch.device("cpu"), warm_up=True, allocator=run_settings())
    rank = predict_rank(step, StrategySpec("deepspeed_stage_1", 4))
    assert isinstance(rank, RankStep) and rank.method == row.method
    assert row.peak_bytes == rank.peak.peak_bytes
    assert row.phases == tuple((phase.value, peak.peak_bytes) for phase, peak in in_phase_order(rank.phases))
    assert row.fits and row.reserved_bytes is None  # ZeRO's arithmetic: fitted by its peak with the margin


class WithExample(SmallCNN):
    """The quickstart's model with an example batch of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = images(8)


class WithLoader(SmallCNN):
    """The quickstart's model with its own training loader."""

    def train_dataloader(self) -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*images(32)), batch_size=16)


@pytest.mark.parametrize(
    ("module", "source", "size"),
    [
        (WithExample(), "the module's example_input_array", 8),
        (WithLoader(), "the module's train_dataloader's first batch", 16),
    ],
)
def test_without_a_batch_the_plan_says_where_its_batch_came_from(module: SmallCNN, source: str, size: int) -> None:
    result = plan(module, gpus=["T4"], world_sizes=(1,), precisions=("32-true",), checkpointing=(False,))
    assert result.batch_source == source
    assert [(row.micro_batch, row.accumulation) for row in result.rows] == [(size, 1)]
    assert f"batch: {source};" in str(result)


class ShuffledByItsOwnGenerator(SmallCNN):
    """The quickstart's model whose loader shuffles with a generator the module holds (the next fit's too)."""

    def __init__(self) -> None:
        super().__init__()
        self.shuffling = torch.Generator().manual_seed(123)

    def train_dataloader(self) -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
        data = torch.utils.data.TensorDataset(*images(32))
        return torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, generator=self.shuffling)


def test_reading_the_loader_s_first_batch_leaves_its_own_generator_as_it_was() -> None:
    """A fit after the plan shuffles as it would have without it (the attack of 2026-11-27: plan() advanced the
    module's generator, and the training after it saw another order: its first loss 0.064 apart)."""
    module = ShuffledByItsOwnGenerator()
    before = module.shuffling.get_state()
    plan(module, gpus=["T4"], world_sizes=(1,), precisions=("32-true",), checkpointing=(False,))
    assert torch.equal(module.shuffling.get_state(), before)


def test_the_peak_column_says_which_rows_are_allocated_peaks() -> None:
    mixed = quickstart_plan(gpus=["T4"], world_sizes=(1, 2), strategies=("ddp", "deepspeed_stage_2"))
    kinds = {row.strategy: (row.shown_kind, row.shown_bytes) for row in mixed.rows}
    single, zero = (next(row for row in mixed.rows if row.strategy == name) for name in ("single", "deepspeed_stage_2"))
    assert kinds["single"] == ("reserved", single.reserved_bytes) and kinds["ddp"][0] == "reserved"
    assert kinds["deepspeed_stage_2"] == ("allocated", zero.peak_bytes)
    cells = {line.split()[3]: line.split()[8] for line in str(mixed).splitlines()[3:6]}  # strategy: its peak's unit
    # ZeRO-2 under Lightning's defaults holds two reduce buckets of 2e8 elements (overlap_comm): its peak is in GiB.
    assert cells == {"single": "MiB", "ddp": "MiB", "zero2": "GiB*"}
    assert "  * allocated peak: a strategy's arithmetic (ZeRO, FSDP1) has no allocation sequence;" in str(mixed)
    data = mixed.to_dict()["rows"]
    assert {row["strategy"]: row["shown_kind"] for row in data} == {
        "single": "reserved",
        "ddp": "reserved",
        "deepspeed_stage_2": "allocated",
    }
    alone = quickstart_plan(gpus=["T4"], world_sizes=(1,))
    assert "*" not in str(alone)  # no allocated peak among the rows: no mark, no legend line


def test_a_line_outside_the_allocator_is_kept_free_whatever_its_label(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_vram.prediction.strategies import ddp

    held = quickstart_plan(gpus=["H100 SXM"], world_sizes=(2,)).rows[0]
    assert held.reserved_bytes is not None and held.micro_batch == BATCH
    capacity = held.reserved_bytes + 1024 * MIB  # with a context of 1 GiB less 8 MiB: 8 MiB to spare
    fits = quickstart_plan(gpus=[capacity], world_sizes=(2,), cuda_context_bytes=1024 * MIB - 8 * MIB).rows[0]
    assert fits.fits and fits.micro_batch == BATCH
    outside = ddp.RankLine("collective buffers", 16 * MIB, "a test's", outside_allocator=True)
    monkeypatch.setattr(ddp, "nccl_line", lambda world_size, device_type: (outside,))
    squeezed = quickstart_plan(gpus=[capacity], world_sizes=(2,), cuda_context_bytes=1024 * MIB - 8 * MIB).rows[0]
    assert squeezed.micro_batch != BATCH or not squeezed.fits  # 16 MiB outside the allocator: 8 MiB short
    assert outside.beside_allocator_bytes == 16 * MIB
    assert ddp.RankLine("NCCL buffers", MIB, "on the device, inside", False).beside_allocator_bytes == 0


def test_once_the_budget_ends_a_kept_replay_still_serves_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules["lightning_vram.plan"]  # lightning_vram.plan is the function
    predict_rank = module._Planner._predict_rank

    def ending(self: Any, *arguments: Any) -> Any:
        rank = predict_rank(self, *arguments)
        self.deadline = 0.0  # the budget ends after the first prediction
        return rank

    monkeypatch.setattr(module._Planner, "_predict_rank", ending)
    result = quickstart_plan(gpus=["T4"], world_sizes=(1, 2), strategies=("fsdp2", "ddp", "deepspeed_stage_2"))
    assert sorted(row.strategy for row in result.rows) == ["ddp", "deepspeed_stage_2", "single"]
    assert result.replays == 1
    assert result.left_out == ("the time budget ran out: fsdp2 x2, 32-true, micro-batch 64",)


def test_fsdp2_of_a_module_on_the_meta_device_is_left_out_saying_why_without_a_replay() -> None:
    with torch.device("meta"):
        module = SmallCNN()
    result = plan(
        module,
        images(8),
        gpus=["H100 SXM"],
        world_sizes=(1, 2, 4),
        strategies=("fsdp2", "ddp"),
        precisions=("32-true",),
        checkpointing=(False,),
    )
    # fully_shard cannot run on the meta device (torch 2.13 raised an AttributeError there): the plan says why, in
    # words, and spends no replay on it; the single GPU's replay serves DDP at both world sizes.
    assert result.left_out == (f"{META_SKIP}: 2 configurations (fsdp2 x2, 32-true, micro-batch 8, ...)",)
    assert {(row.gpus, row.strategy) for row in result.rows} == {(1, "single"), (2, "ddp"), (4, "ddp")}
    assert result.replays == 1


def test_a_card_under_the_context_shows_the_peak_the_step_needs_not_what_was_reserved() -> None:
    # 200 MB of memory under the 512 MiB CUDA context: the allocator model serves nothing (0 B reserved), and the
    # table shows the allocated peak the step needs, marked, where it showed "0 B" beside "NO".
    result = quickstart_plan(gpus=[200_000_000], world_sizes=(1,))
    assert not result.fits
    (row,) = result.rows
    assert row.reserved_bytes == 0 and row.peak_bytes > 0 and row.served_short
    assert (row.shown_bytes, row.shown_kind) == (row.peak_bytes, "allocated")
    assert row.step_seconds is None and row.shortfall is not None and "before the step" in row.shortfall
    text = str(result)
    assert re.search(re.escape(format_bytes(row.peak_bytes)) + r"\*\s+NO\s+-\s+-$", text.splitlines()[3])
    assert "* on a row that does not fit: the allocated peak the step needs" in text
    assert "step, samples/s: - where the step was not timed" in text
    fitting = quickstart_plan(gpus=["H100 SXM"], world_sizes=(1,))
    assert not fitting.rows[0].served_short and fitting.rows[0].shown_kind == "reserved"
    assert "on a row that does not fit" not in str(fitting) and "was not timed" not in str(fitting)


def test_zero3_rows_say_how_to_train_as_they_partition_every_parameter() -> None:
    """A ZeRO-3 row partitions every parameter; Lightning's ``deepspeed_stage_3`` keeps those of at most 100,000
    elements whole on every rank (DeepSpeed's default ``stage3_param_persistence_threshold``): the plan says so and
    how to set it. Applied on 2 gloo ranks, a transformer LM's row said 1,043,920 B of parameters per rank where
    ``deepspeed_stage_3`` held 2,107,760 (every weight but the embedding's and the head's under the threshold); the
    plan said nothing of it before."""
    zero3 = quickstart_plan(strategies=("deepspeed_stage_3",), world_sizes=(2,), device_type="cpu")
    (note,) = (note for note in zero3.notes if "stage3_param_persistence_threshold" in note)
    small = sum(p.numel() for p in SmallCNN().parameters() if p.numel() <= 100_000)
    assert small > 0 and f"({small:,} elements here)" in note
    assert 'strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0' in note
    assert "stage3_param_persistence_threshold" in str(zero3)
    ddp = quickstart_plan(world_sizes=(2,), device_type="cpu")
    assert not any("persistence" in note for note in ddp.notes)


class CountedSGD(SmallCNN):
    """The quickstart under SGD with momentum, counting the calls of its own ``configure_optimizers``."""

    def __init__(self) -> None:
        super().__init__()
        self.configured = 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.configured += 1
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_zero_row_sizes_the_modules_own_optimizer_without_calling_it_on_the_users_module() -> None:
    """ZeRO's arithmetic sizes the state by the optimizer the replay's copy of the module configured: SGD with
    momentum keeps one fp32 buffer per element (Adam two). It reads it from the replay, which ran
    ``configure_optimizers`` on its copy: the user's module is never asked (it is user code, run only contained;
    a first version of this change called it on the module itself, and the count read 1)."""
    module = CountedSGD()
    settings = {**QUICKSTART_SETTINGS, "gpus": ["H100 SXM"], "strategies": ("deepspeed_stage_2",), "world_sizes": (2,)}
    sgd = plan(module, images(), **settings)  # type: ignore[arg-type]
    adam = plan(SmallCNN(), images(), **settings)  # type: ignore[arg-type]
    assert module.configured == 0
    (sgd_row,), (adam_row,) = (result.rows for result in (sgd, adam))
    sgd_state, adam_state = (dict(row.parts)["optimizer_state"] for row in (sgd_row, adam_row))
    numel = sum(p.numel() for p in module.parameters())
    assert adam_state - sgd_state == pytest.approx(4 * numel / 2, rel=0.01)  # one fp32 moment less per element


def test_ddp_rows_under_manual_optimization_say_how_ddp_takes_a_backward_that_leaves_parameters_out() -> None:
    """A GAN's discriminator step leaves the generator without gradients: ``Trainer(strategy="ddp")``, as its row
    named it, raised "parameters that were not used in producing the loss" on 2 gloo ranks; the plan said nothing."""
    from test_setups import Gan

    gan = plan(Gan(), (torch.randn(8, 16),), gpus=["H100 SXM"], world_sizes=(2,), strategies=("ddp",))
    assert gan.rows and MANUAL_DDP_NOTE in gan.notes and "ddp_find_unused_parameters_true" in str(gan)
    assert MANUAL_DDP_NOTE not in quickstart_plan(world_sizes=(2,)).notes

"""Grouped-query attention's FLOPs are counted, and no op's FLOP formula fails a replay.

On an H100 with torch 2.11 an 8-layer Llama with grouped-query attention (``enable_gqa``: 4 key/value heads for 16
query heads) was not replayed at all: torch 2.11's ``sdpa_flop_count`` asserts that key and value have the query's
heads, and its AssertionError failed the step under fake tensors. torch 2.13, this CPU's, counts grouped-query
attention itself: :func:`torch_2_11_attention_formulas` gives torch's two attention formulas back the 2.11 check, so
that what the replay does with torch 2.11's formulas is tested here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.utils.flop_counter as flop_counter
from models import OPTIMIZERS, Classifier, loader, trainer
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor, predict
from lightning_vram.prediction.containment.deadline import ReplayDeadlineError
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.flops import StepFlops
from lightning_vram.records import Phase, ReplayedStep

# Replays: predict(), a Predictor's, a monitor's.
pytestmark = pytest.mark.replay

aten = torch.ops.aten

BATCH, HEADS, KV_HEADS, LENGTH, HEAD_DIM = 2, 8, 2, 16, 8
WIDTH = HEADS * HEAD_DIM
FORWARD_FLOPS = 2 * BATCH * HEADS * LENGTH * LENGTH * (HEAD_DIM + HEAD_DIM)
"""One attention's forward FLOPs by hand, key/value heads broadcast to the query's 8: the scores and the output."""
BACKWARD_FLOPS = 2 * BATCH * HEADS * LENGTH * LENGTH * (3 * HEAD_DIM + 2 * HEAD_DIM)
"""Its backward's: the scores again, the gradients of the scores, value, query and key."""
LINEAR_FLOPS = (
    2 * BATCH * LENGTH * (2 * (WIDTH * WIDTH + WIDTH * 2 * KV_HEADS * HEAD_DIM + WIDTH * WIDTH) + WIDTH * WIDTH)
)
"""The linear layers': forward and weight gradients of all three, the input gradient of the last (the batch's none)."""


def _forward_2_11(query_shape: Any, key_shape: Any, value_shape: Any) -> int:
    """torch 2.11's ``sdpa_flop_count``: key and value must have the query's batch and heads.

    Its code runs with torch's module globals: it names nothing else of this file.
    """
    if not query_shape[:2] == key_shape[:2] == value_shape[:2]:
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    batch, heads, length, head_dim = query_shape
    return int(2 * batch * heads * length * key_shape[2] * (head_dim + value_shape[3]))


def _backward_2_11(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any) -> int:
    """torch 2.11's ``sdpa_backward_flop_count``: the same check."""
    if not grad_out_shape[:2] == query_shape[:2] == key_shape[:2] == value_shape[:2]:
        raise AssertionError("sdpa_backward_flop_count: batch/heads/dimension mismatch among tensors")
    batch, heads, length, head_dim = query_shape
    return int(2 * batch * heads * length * key_shape[2] * (3 * head_dim + 2 * value_shape[3]))


@pytest.fixture
def torch_2_11_attention_formulas(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``sdpa_flop_count`` and ``sdpa_backward_flop_count`` as torch 2.11 had them: equal heads asserted.

    Their code is swapped, not their names: every holder of the functions (torch's registered formulas, a module
    that imported them) runs torch 2.11's check.
    """
    monkeypatch.setattr(flop_counter.sdpa_flop_count, "__code__", _forward_2_11.__code__)
    monkeypatch.setattr(flop_counter.sdpa_backward_flop_count, "__code__", _backward_2_11.__code__)
    with pytest.raises(AssertionError, match="shapes are incompatible"):
        flop_counter.sdpa_flop_count((1, 4, 3, 2), (1, 2, 3, 2), (1, 2, 3, 2))


class GroupedQueryAttention(pl.LightningModule):
    """One causal self-attention of 8 query heads over 2 key/value heads (``enable_gqa``), trained with AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(WIDTH, WIDTH)
        self.key_value = nn.Linear(WIDTH, 2 * KV_HEADS * HEAD_DIM)
        self.out = nn.Linear(WIDTH, WIDTH)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (inputs,) = batch
        batch_size, length, _ = inputs.shape
        query = self.query(inputs).view(batch_size, length, HEADS, HEAD_DIM).transpose(1, 2)
        key, value = self.key_value(inputs).view(batch_size, length, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return self.out(attended.transpose(1, 2).reshape(batch_size, length, WIDTH)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS["adamw"](self.parameters())


def _attention_flops(step: ReplayedStep, phase: Phase) -> list[int]:
    """The FLOPs of each attention op ``step`` ran in ``phase``."""
    assert step.work is not None
    groups = step.work.in_phase(phase).groups
    return [group.flops for group in groups for _ in range(group.count) if "scaled_dot_product" in group.op]


@pytest.mark.usefixtures("torch_2_11_attention_formulas")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_grouped_query_attention_is_replayed_with_its_query_heads_flops(precision: str) -> None:
    torch.manual_seed(0)
    module = GroupedQueryAttention()
    batch = (torch.randn(BATCH, LENGTH, WIDTH),)
    prediction = predict(module, batch, precision=precision, device_type="cpu", fit_table=False)
    assert prediction.skipped is None, prediction.skipped
    step = prediction.step
    assert isinstance(step, ReplayedStep)
    assert set(step.phases) == set(Phase)
    assert all(peak.peak_bytes > 0 for peak in step.phases.values())
    assert step.phases[Phase.OPTIMIZER].breakdown.parameters == 4 * sum(p.numel() for p in module.parameters())
    assert _attention_flops(step, Phase.FORWARD) == [FORWARD_FLOPS]
    assert _attention_flops(step, Phase.BACKWARD) == [BACKWARD_FLOPS]
    assert not any("FLOP formula failed" in note for note in step.notes), step.notes
    assert step.flops == LINEAR_FLOPS + FORWARD_FLOPS + BACKWARD_FLOPS


@pytest.mark.usefixtures("torch_2_11_attention_formulas")
def test_a_run_with_grouped_query_attention_is_replayed_by_its_monitor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    inputs = TensorDataset(torch.randn(8, LENGTH, WIDTH))
    trainer(tmp_path, [monitor], max_steps=3).fit(GroupedQueryAttention(), loader(inputs, batch_size=BATCH))
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation
    assert simulation.match is not None and simulation.match.matches, simulation.match
    assert simulation.baseline is not None
    assert _attention_flops(simulation.baseline, Phase.FORWARD) == [FORWARD_FLOPS]
    assert _attention_flops(simulation.baseline, Phase.BACKWARD) == [BACKWARD_FLOPS]


class FlashGroupedQueryAttention(GroupedQueryAttention):
    """The same attention by CUDA's flash kernel in bf16, the kernel SDPA picks for it on an H100 (called directly:
    without a device, fake CUDA's SDPA has no kernel to pick)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (inputs,) = batch
        batch_size, length, _ = inputs.shape
        query = self.query(inputs).view(batch_size, length, HEADS, HEAD_DIM).transpose(1, 2)
        key, value = self.key_value(inputs).view(batch_size, length, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        halves = (query.bfloat16(), key.bfloat16(), value.bfloat16())
        attended = aten._scaled_dot_product_flash_attention(*halves, 0.0, True)[0].float()
        return self.out(attended.transpose(1, 2).reshape(batch_size, length, WIDTH)).square().mean()


@pytest.mark.fake_cuda
@pytest.mark.skipif(
    not torch.backends.cuda.is_built() or torch.cuda.is_available(),
    reason="needs fake CUDA tensors: a CUDA build of torch without a CUDA device (`make test-fake-cuda`)",
)
@pytest.mark.usefixtures("torch_2_11_attention_formulas")
def test_cuda_flash_attention_with_grouped_query_heads_is_replayed() -> None:
    torch.manual_seed(0)
    prediction = predict(FlashGroupedQueryAttention(), (torch.randn(BATCH, LENGTH, WIDTH),), fit_table=False)
    assert prediction.skipped is None, prediction.skipped
    step = prediction.step
    assert isinstance(step, ReplayedStep) and step.device_type == "cuda"
    assert all(peak.peak_bytes > 0 for peak in step.phases.values())
    assert _attention_flops(step, Phase.FORWARD) == [FORWARD_FLOPS]
    assert _attention_flops(step, Phase.BACKWARD) == [BACKWARD_FLOPS]


class GroupedQueryLlama(pl.LightningModule):
    """transformers' Llama, 2 layers of 8 query heads over 2 key/value heads, its ``sdpa`` attention; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=WIDTH,
            intermediate_size=2 * WIDTH,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            vocab_size=1000,
            max_position_embeddings=256,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (tokens,) = batch
        loss: Tensor = self.model(input_ids=tokens, labels=tokens).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS["adamw"](self.parameters())


@pytest.mark.usefixtures("torch_2_11_attention_formulas")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_grouped_query_llama_is_predicted(precision: str) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    module = GroupedQueryLlama()
    assert module.model.config._attn_implementation == "sdpa"
    tokens = torch.randint(0, 1000, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    prediction = predict(module, (tokens,), precision=precision, device_type="cpu", fit_table=False)
    assert prediction.skipped is None, prediction.skipped
    step = prediction.step
    assert isinstance(step, ReplayedStep)
    assert all(peak.peak_bytes > 0 for peak in step.phases.values())
    assert step.phases[Phase.FORWARD].breakdown.activations > 0
    assert _attention_flops(step, Phase.FORWARD) == [FORWARD_FLOPS] * 2
    assert _attention_flops(step, Phase.BACKWARD) == [BACKWARD_FLOPS] * 2
    assert not any("FLOP formula failed" in note for note in prediction.notes), prediction.notes


FORWARD_KERNELS = [
    name
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(aten, name)
]
BACKWARD_KERNELS = [f"{name}_backward" for name in FORWARD_KERNELS if hasattr(aten, f"{name}_backward")]


def _shaped(*shape: int) -> Tensor:
    return torch.empty(shape, device="meta")


@pytest.mark.usefixtures("torch_2_11_attention_formulas")
@pytest.mark.parametrize("kernel", FORWARD_KERNELS)
def test_every_attention_kernel_counts_the_query_heads(kernel: str) -> None:
    query, key, value = (_shaped(BATCH, heads, LENGTH, HEAD_DIM) for heads in (HEADS, KV_HEADS, KV_HEADS))
    counted = StepFlops()
    counted.count(getattr(aten, kernel).default, (query, key, value), {}, (torch.empty_like(query),))
    assert (counted.get_total_flops(), counted.notes) == (FORWARD_FLOPS, ())


@pytest.mark.usefixtures("torch_2_11_attention_formulas")
@pytest.mark.parametrize("kernel", BACKWARD_KERNELS)
def test_every_attention_backward_kernel_counts_the_query_heads(kernel: str) -> None:
    gradient, query = _shaped(BATCH, HEADS, LENGTH, HEAD_DIM), _shaped(BATCH, HEADS, LENGTH, HEAD_DIM)
    key, value = _shaped(BATCH, KV_HEADS, LENGTH, HEAD_DIM), _shaped(BATCH, KV_HEADS, LENGTH, HEAD_DIM)
    counted = StepFlops()
    output = (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value))
    counted.count(getattr(aten, kernel).default, (gradient, query, key, value), {}, output)
    assert (counted.get_total_flops(), counted.notes) == (BACKWARD_FLOPS, ())


def _replayed_mlp() -> ReplayedStep:
    torch.manual_seed(0)
    module = Classifier(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)), OPTIMIZERS["sgd"])
    predictor = Predictor(
        module, None, (torch.randn(32, 16), torch.randint(0, 4, (32,))), placement=torch.device("cpu"), warm_up=True
    )
    with round_of_replays():
        step = predictor.replay(None, count_flops=True)
    assert isinstance(step, ReplayedStep), step
    return step


def _failing(*args: Any, **kwargs: Any) -> int:
    raise RuntimeError("no formula today")


def test_an_op_whose_formula_fails_is_noted_and_the_replay_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _replayed_mlp()
    monkeypatch.setitem(flop_counter.flop_registry, aten.mm, _failing)
    failed = _replayed_mlp()
    assert failed.phases == counted.phases
    assert failed.timeline == counted.timeline
    # backward's two weight gradients and one input gradient are the step's only mm: 2 x 32 x (4·8 + 8·16 + 4·8)
    assert counted.flops is not None and failed.flops == counted.flops - 2 * 32 * (4 * 8 + 8 * 16 + 4 * 8)
    note = "mm: its FLOP formula failed (RuntimeError: no formula today); its FLOPs are left out of the step's FLOPs"
    assert [line for line in failed.notes if "FLOP formula" in line] == [f"{note} and step time"]
    assert not any("FLOP formula" in line for line in counted.notes)


def test_the_replays_deadline_met_in_a_formula_still_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_time(*args: Any, **kwargs: Any) -> int:
        raise ReplayDeadlineError("the time budget ran out during the replay")

    monkeypatch.setitem(flop_counter.flop_registry, aten.mm, out_of_time)
    with pytest.raises(ReplayDeadlineError):
        StepFlops().count(aten.mm.default, (torch.ones(2, 3), torch.ones(3, 4)), {}, torch.ones(2, 4))

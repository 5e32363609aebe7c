"""A recurrent layer's FLOPs in the replay: counted, in forward, backward and checkpointing's recomputation.

A new user's trial: an LSTM language model (Embedding -> 2-layer ``nn.LSTM`` -> Linear, Adam) on the CPU was told
that checkpointing its LSTM recomputes "memory-bound ops only, +0.0% FLOPs" (+6.8 ms a step; measured, the LSTM's
forward took about 21 ms and checkpointing it added 15-22 ms): torch has no FLOP formula for the fused LSTM kernel
(``mkldnn_rnn_layer`` on the CPU, ``_cudnn_rnn`` on CUDA), so its ``FlopCounterMode``, and the replay's count, which
uses torch's formulas, counted it as 0 FLOPs. The formulas here are checked against FlopCounterMode's count of the
same LSTM written as matrix products, and of the same LSTM in float64 (which torch runs as matrix products).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import loader
from test_checkpointing_same_model import advised, report_of
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.rnn_flops import (
    cudnn_rnn_backward_flops,
    cudnn_rnn_flops,
    recurrent_flops,
)
from lightning_vram.records import CostBasis, Phase, ReplayedStep, StepWork

pytestmark = pytest.mark.replay

VOCAB, WIDTH, HIDDEN, LAYERS = 500, 32, 64, 2
BATCH, LENGTH = 8, 24
GATES = {nn.LSTM: 4, nn.GRU: 3, nn.RNN: 1}
RECURRENT_OPS = frozenset({"mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "_cudnn_rnn", "_cudnn_rnn_backward"})


def formula(kind: type[nn.RNNBase], directions: int = 1) -> int:
    """The forward FLOPs of ``LAYERS`` layers of ``kind`` over the batch: per layer and direction,
    2 · batch · length · gates · hidden · (input + hidden), a layer's input the directions' outputs below it."""
    inputs = [WIDTH] + [directions * HIDDEN] * (LAYERS - 1)
    return sum(directions * 2 * BATCH * LENGTH * GATES[kind] * HIDDEN * (size + HIDDEN) for size in inputs)


class RecurrentLM(pl.LightningModule):
    """Embedding, a ``LAYERS``-layer recurrent stack of ``kind`` (dropout 0.1, batch first), the LM head; Adam."""

    def __init__(self, kind: type[nn.RNNBase] = nn.LSTM) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.recurrent = kind(WIDTH, HIDDEN, num_layers=LAYERS, dropout=0.1, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, targets = batch
        hidden, _ = self.recurrent(self.embedding(tokens))
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def text(samples: int) -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (samples, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def replayed_work(module: pl.LightningModule) -> StepWork:
    batch = next(iter(loader(text(BATCH), BATCH)))
    step = Predictor(module, None, batch, placement=torch.device("cpu")).replay(None, count_flops=True)
    assert isinstance(step, ReplayedStep) and step.work is not None, step
    return step.work


def recurrent(work: StepWork, phase: Phase) -> int:
    """The FLOPs of the fused recurrent kernels among ``work``'s ops of ``phase``."""
    return sum(group.flops * group.count for group in work.in_phase(phase).groups if group.op in RECURRENT_OPS)


def lstm_as_matrix_products(lstm: nn.LSTM, inputs: Tensor) -> Tensor:
    """``lstm``'s forward (batch first, no dropout) written out: two ``addmm`` a step, the gates elementwise."""
    hidden_states = inputs.transpose(0, 1)
    for layer in range(lstm.num_layers):
        names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        w_ih, w_hh, b_ih, b_hh = (getattr(lstm, f"{name}_l{layer}") for name in names)
        h = c = hidden_states.new_zeros(inputs.shape[0], lstm.hidden_size)
        outputs = []
        for x in hidden_states:
            gates = torch.addmm(b_ih, x, w_ih.t()) + torch.addmm(b_hh, h, w_hh.t())
            i, f, g, o = gates.chunk(4, dim=1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
            outputs.append(h)
        hidden_states = torch.stack(outputs)
    return hidden_states.transpose(0, 1)


def counted(run: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def test_an_lstm_s_replayed_forward_and_backward_flops_are_its_matrix_products() -> None:
    torch.manual_seed(0)
    module = RecurrentLM(nn.LSTM)
    work = replayed_work(module)
    forward = recurrent(work, Phase.FORWARD)
    # layer 0: WIDTH + HIDDEN, layer 1: HIDDEN + HIDDEN
    assert forward == formula(nn.LSTM) == 2 * BATCH * LENGTH * 4 * HIDDEN * (WIDTH + 3 * HIDDEN)
    assert recurrent(work, Phase.BACKWARD) == 2 * forward  # as torch's mm: the inputs' and the weights' gradients
    # Independently: torch's own count of the same LSTM written as matrix products, and of the LSTM in float64,
    # which torch runs as matrix products on the CPU (float32 runs the fused kernel: 0 FLOPs to FlopCounterMode).
    lstm = module.recurrent
    assert isinstance(lstm, nn.LSTM)
    inputs = torch.randn(BATCH, LENGTH, WIDTH)
    explicit = counted(lambda: lstm_as_matrix_products(lstm, inputs))
    assert explicit == forward
    assert torch.allclose(lstm_as_matrix_products(lstm.eval(), inputs), lstm(inputs)[0], atol=1e-5)
    double = lstm.double()
    assert counted(lambda: double(inputs.double())) == forward
    # The step's FLOPs: the LSTM's and the head's, forward and backward (the embedding's and Adam's count none).
    head = 2 * BATCH * LENGTH * HIDDEN * VOCAB
    assert work.in_phase(Phase.FORWARD).flops == forward + head
    assert work.flops == 3 * (forward + head)


def test_cudnn_s_whole_stack_is_counted_layer_by_layer_and_direction_by_direction() -> None:
    """``_cudnn_rnn`` takes every layer's weights in one list (a bidirectional LSTM with projections here): each
    matrix times every position; backward adds the weights' gradients only where ``output_mask`` asks."""
    lstm = nn.LSTM(WIDTH, HIDDEN, num_layers=2, bidirectional=True, proj_size=16)
    inputs = torch.empty(LENGTH, BATCH, WIDTH)
    weights = [getattr(lstm, name) for name in lstm._flat_weights_names]
    # layer 0: w_ih (4H, WIDTH), w_hh (4H, 16), w_hr (16, H); layer 1 takes both directions' projections (2·16)
    per_direction = 4 * HIDDEN * (WIDTH + 16) + 16 * HIDDEN + 4 * HIDDEN * (2 * 16 + 16) + 16 * HIDDEN
    forward = 2 * LENGTH * BATCH * 2 * per_direction
    assert cudnn_rnn_flops(inputs, weights, 4) == forward
    rest = [None] * 19
    assert cudnn_rnn_backward_flops(inputs, weights, *rest, [True, True, True, True]) == 2 * forward
    assert cudnn_rnn_backward_flops(inputs, weights, *rest, output_mask=[True, True, True, False]) == forward
    packed = torch.empty(LENGTH * BATCH - 5, WIDTH)  # a packed sequence's rows: one position each
    assert recurrent_flops(packed, weights) == forward // (LENGTH * BATCH) * (LENGTH * BATCH - 5)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_cudnn_s_count_is_torch_s_count_of_the_cpu_s_matrix_products(
    kind: type[nn.RNNBase], bidirectional: bool
) -> None:
    """The formula for CUDA's ``_cudnn_rnn``, against FlopCounterMode's count of the same module run on the CPU in
    float64, as ``addmm``/``mm``: forward, and forward with backward."""
    torch.manual_seed(0)
    module = kind(WIDTH, HIDDEN, num_layers=LAYERS, bidirectional=bidirectional).double()
    inputs = torch.randn(LENGTH, BATCH, WIDTH, dtype=torch.float64, requires_grad=True)
    weights = [getattr(module, name) for name in module._flat_weights_names]
    forward = cudnn_rnn_flops(inputs, weights)
    assert forward == formula(kind, directions=2 if bidirectional else 1)
    assert counted(lambda: module(inputs)) == forward
    backward = cudnn_rnn_backward_flops(inputs, weights, *[None] * 19, [True, True, True, True])
    assert backward == 2 * forward
    # torch's matrix products skip one: the first step's gradient through w_hh to an initial state needing none.
    first_step = LAYERS * (2 if bidirectional else 1) * 2 * BATCH * GATES[kind] * HIDDEN * HIDDEN
    assert counted(lambda: module(inputs)[0].sum().backward()) == forward + backward - first_step


def test_checkpointing_an_lstm_recomputes_its_flops(tmp_path: Path) -> None:
    """The trial's advice: the recomputed forward is the LSTM's matrix products, no longer "+0.0% FLOPs"."""
    torch.manual_seed(0)
    report = report_of(tmp_path, RecurrentLM(nn.LSTM), text(4 * BATCH), BATCH)
    advice, plan, _ = advised(report)
    assert plan.units == (("recurrent",),)
    lstm, head = formula(nn.LSTM), 2 * BATCH * LENGTH * HIDDEN * VOCAB
    step = 3 * (lstm + head)  # forward, and backward twice it (the embedding's and Adam's count none)
    assert advice.cost_basis is CostBasis.RECOMPUTED_FORWARD
    assert advice.flop_ratio == (step + lstm) / step  # +21.4%
    assert advice.estimated_cost_seconds is not None and advice.estimated_cost_seconds > 0
    assert advice.cost_text is not None and "memory-bound ops only" not in advice.cost_text

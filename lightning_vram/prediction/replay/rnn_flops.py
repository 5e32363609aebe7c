"""FLOPs of the fused recurrent kernels (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), which torch's formulas leave out.

torch's ``flop_registry`` has no formula for them, so ``FlopCounterMode`` counts an LSTM's forward as 0 FLOPs. Which
kernels run (torch 2.13 CPU, 2.14.1 CUDA; ``aten/src/ATen/native/RNN.cpp``):

- **CPU**: ``nn.LSTM`` in float32 or bfloat16, without ``proj_size`` or a packed sequence, runs
  ``mkldnn_rnn_layer`` once a layer and direction, and ``mkldnn_rnn_layer_backward`` in backward, on real and on
  fake tensors alike. ``nn.GRU``, ``nn.RNN``, an LSTM in float16 or float64, with ``proj_size`` or on a packed
  sequence, and the cells (``nn.LSTMCell``...) are decomposed into ``mm``/``addmm`` and elementwise ops, which
  torch's formulas count already.
- **CUDA**: the three modules run ``_cudnn_rnn`` for the whole stack (every layer and direction) and
  ``_cudnn_rnn_backward`` (``RNN.cpp``'s cuDNN path; a replay on fake CUDA tensors without a device does not get
  there: torch asks the driver first); where cuDNN is off, the matrix products are ``mm``/``addmm`` (counted) and the
  gates ``_thnn_fused_lstm_cell``/``_thnn_fused_gru_cell`` (elementwise: no FLOPs, as every elementwise op). A replay
  for CUDA on a CPU-only torch runs the CPU's kernels: the same FLOPs.

Counted as torch counts the same recurrence written as ``addmm`` (``h @ w_hh.T + x @ w_ih.T``): each weight matrix
multiplies every position (time step by sample) once, 2 FLOPs a multiply-add: ``2 · positions · rows · columns`` for
each matrix (``w_ih`` is ``gates · hidden`` by the layer's input, ``w_hh`` by ``hidden`` or ``proj_size``, LSTM's
``w_hr`` ``proj_size`` by ``hidden``; gates 4 for LSTM, 3 for GRU, 1 for RNN). The bias adds and the gates'
sigmoid, tanh and products are not counted, as torch's ``addmm`` formula counts its product only and no elementwise
op: counted so, an LSTM's FLOPs are those of the same LSTM written as matrix products. Backward is twice forward, as
for ``mm``: the gradient of the inputs and hidden state (the recurrence goes back through ``w_hh`` whatever is
asked), and the weights' gradients (cuDNN computes them only where its ``output_mask`` asks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def recurrent_flops(input: Tensor, weights: Sequence[Tensor | None]) -> int:
    """FLOPs of one recurrent forward over ``input`` with ``weights``: each 2-D weight times every position, x2.

    ``input``'s last dimension is its features; every other dimension counts positions (time steps by samples, or a
    packed sequence's rows). A 1-D weight (a bias) or ``None`` adds nothing.

    >>> lstm = torch.nn.LSTM(3, 5)  # w_ih (20, 3), w_hh (20, 5)
    >>> recurrent_flops(torch.empty(7, 2, 3), [lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0])
    4480
    >>> 2 * 7 * 2 * 4 * 5 * (3 + 5)  # 2 · time · batch · gates · hidden · (input + hidden)
    4480
    """
    if input.dim() < 2:
        raise ValueError(f"a recurrent input has positions and features, got shape {tuple(input.shape)}")
    features = input.shape[-1]
    positions = input.numel() // features if features else 0
    return 2 * positions * sum(weight.numel() for weight in weights if weight is not None and weight.dim() == 2)


def mkldnn_rnn_layer_flops(input: Tensor, weight0: Tensor, weight1: Tensor, *args: Any, **kwargs: Any) -> int:
    """``mkldnn_rnn_layer``: one layer and direction, ``weight0`` (``w_ih``) and ``weight1`` (``w_hh``)."""
    return recurrent_flops(input, (weight0, weight1))


def mkldnn_rnn_layer_backward_flops(input: Tensor, weight1: Tensor, weight2: Tensor, *args: Any, **kwargs: Any) -> int:
    """``mkldnn_rnn_layer_backward``: the gradients of input, hidden state and both weights, twice the forward."""
    return 2 * recurrent_flops(input, (weight1, weight2))


def cudnn_rnn_flops(input: Tensor, weight: Sequence[Tensor], *args: Any, **kwargs: Any) -> int:
    """``_cudnn_rnn``: every layer and direction of the stack, its weights (and biases) listed in ``weight``."""
    return recurrent_flops(input, weight)


_OUTPUT_MASK = 21
"""``output_mask``'s position among ``_cudnn_rnn_backward``'s arguments (input, weight, ..., reserve, output_mask)."""


def cudnn_rnn_backward_flops(input: Tensor, weight: Sequence[Tensor], *args: Any, **kwargs: Any) -> int:
    """``_cudnn_rnn_backward``: the data gradients, and the weights' where ``output_mask[3]`` asks for them."""
    output_mask = kwargs["output_mask"] if "output_mask" in kwargs else args[_OUTPUT_MASK - 2]
    return (2 if output_mask[3] else 1) * recurrent_flops(input, weight)


def _formulas() -> dict[Any, Callable[..., int]]:
    """Each recurrent kernel this torch has, with its formula (``_cudnn_rnn`` in every build, the CPU's with MKLDNN)."""
    named: dict[str, Callable[..., int]] = {
        "mkldnn_rnn_layer": mkldnn_rnn_layer_flops,
        "mkldnn_rnn_layer_backward": mkldnn_rnn_layer_backward_flops,
        "_cudnn_rnn": cudnn_rnn_flops,
        "_cudnn_rnn_backward": cudnn_rnn_backward_flops,
    }
    return {getattr(torch.ops.aten, name): formula for name, formula in named.items() if hasattr(torch.ops.aten, name)}


RECURRENT_FORMULAS = _formulas()
"""The recurrent kernels' FLOP formulas, by op packet: ``formula(*args, **kwargs)`` as the op was called."""

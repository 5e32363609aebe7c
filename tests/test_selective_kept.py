"""What torch's selective checkpointing keeps from forward counts as activations, not as the live peak's ``other``.

Selective checkpointing (``create_selective_checkpoint_contexts``) keeps the outputs of the ops its policy saves
(convolutions, matrix products, attention) in its forward's dispatch mode until backward's recomputation reads them
back: outside autograd's saving, so outside the saved-tensor hooks. A new user's trial found them in ``other``
(12.2 MiB of a transformer encoder's budget plan). Counted by hand on a ResNet-style block, and on a transformer
encoder layer against the outputs a plain forward of the layer gives those ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from models import FLOAT32
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.prediction.replay.buffer_copies import (
    SAVED_OPS,
    checkpoint_keeping_buffers,
    checkpoint_saving_matmuls,
)
from lightning_vram.records import Attribution, Phase

CPU = torch.device("cpu")
Checkpoint = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Residual(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm and ReLU, and the skip connection."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.bn1(self.conv1(inputs)))
        return torch.relu(inputs + self.bn2(self.conv2(hidden)))


class Stem(nn.Module):
    """A stem convolution, then ``block`` under ``run`` (a checkpoint call), then the mean, summed."""

    def __init__(self, block: nn.Module, run: Checkpoint, stem: nn.Module) -> None:
        super().__init__()
        self.stem = stem
        self.block = block
        self.run = run

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.run(self.block, self.stem(inputs)).mean().sum()  # type: ignore[no-any-return]


def keeping_convolutions(block: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """``block`` under torch's own selective checkpointing, keeping its convolutions' outputs."""
    contexts = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.convolution.default])
    return checkpoint(block, inputs, use_reentrant=False, context_fn=contexts)  # type: ignore[no-any-return]


def whole(block: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return checkpoint_keeping_buffers([block], block, inputs)  # type: ignore[no-any-return]


def saving_matmuls(block: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """``block`` as a budget plan's ``SelectivelyCheckpointed`` runs it."""
    return checkpoint_saving_matmuls([block], block, inputs)  # type: ignore[no-any-return]


def attributed(network: nn.Module, inputs: torch.Tensor) -> Attribution:
    """One step of ``network`` on ``inputs`` (forward, backward), counted by the monitor's attributor."""
    attributor = StepAttributor(0, network, [], CPU)
    attributor.begin_forward()
    loss = network(inputs)
    attributor.before_backward()
    loss.backward()
    return attributor.finish()


def test_kept_convolution_outputs_count_as_activations_by_hand() -> None:
    torch.manual_seed(0)
    network = Stem(Residual(8), keeping_convolutions, nn.Conv2d(3, 8, 3, padding=1, bias=False))
    attribution = attributed(network, torch.randn(4, 3, 16, 16))
    image, feature_map = 4 * 3 * 16 * 16 * FLOAT32, 4 * 8 * 16 * 16 * FLOAT32
    # Autograd saves the stem's input and the checkpoint's input (the stem's output); selective checkpointing keeps
    # the two convolutions' outputs of the block (its BatchNorms and ReLUs are recomputed).
    assert attribution.phases[Phase.FORWARD].activations == image + feature_map + 2 * feature_map
    saved = {profile.name: profile.activation_bytes for profile in attribution.modules}
    assert saved["block"] == 2 * feature_map  # kept inside the checkpointed block, charged to it
    assert attribution.recomputed_units == (("block",),)
    assert attribution.selective_units == ("block",)


class OutputsOf(TorchDispatchMode):
    """Records the outputs of :data:`SAVED_OPS` while ``inside``, kept alive (no address is reused among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.outputs: list[torch.Tensor] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        output = func(*args, **(kwargs or {}))
        if self.inside and str(func.overloadpacket) in SAVED_OPS:
            for tensor in output if isinstance(output, tuple) else (output,):
                if isinstance(tensor, torch.Tensor):
                    self.outputs.append(tensor)
        return output


def kept_by_plain_forward(layer: nn.Module, inputs: torch.Tensor) -> int:
    """The bytes of the outputs :data:`SAVED_OPS` give in a plain forward of ``layer`` (no checkpointing)."""
    with OutputsOf() as recorder:
        recorder.inside = True
        layer(inputs)
        recorder.inside = False
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in recorder.outputs}
    return sum(storages.values())


def test_a_transformer_layer_kept_matmuls_and_attention_count_as_activations() -> None:
    def network(run: Checkpoint) -> Stem:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=128, dropout=0.1, batch_first=True)
        return Stem(layer, run, nn.Linear(16, 32))

    inputs = torch.randn(4, 24, 16)
    selective = attributed(network(saving_matmuls), inputs)
    recomputed_whole = attributed(network(whole), inputs)
    plain = network(whole)
    kept = kept_by_plain_forward(plain.block, plain.stem(inputs).detach())
    assert kept > 0
    # The same step whole saves what is saved outside the layer; selectively, the layer keeps its products as well.
    assert selective.phases[Phase.FORWARD].activations == recomputed_whole.phases[Phase.FORWARD].activations + kept
    assert selective.selective_units == ("block",) and recomputed_whole.selective_units == ()

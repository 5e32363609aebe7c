"""Each simulated rule applied for real on the CPU: its measured saving within 10% of the replayed one.

The applied tests replay on the CPU, where a peak is the sum of the counted parts, as the CPU report measures it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from advice_models import (
    ChunkedLanguageModel,
    LanguageModel,
    TinyGPT,
    activation_mlp,
    apply_plan,
    features,
    printed_callbacks,
    tokens,
)
from models import OPTIMIZERS, REPLAYS_OFF, Classifier, loader, trainer
from replay_models import images, resnet
from simulations import GIB
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

from lightning_vram import Report, VramMonitor
from lightning_vram._lightning import trainer_setup
from lightning_vram.advice.catalogue import FULL_PRECISIONS
from lightning_vram.advice.checkpoint_code import checkpoint_snippet
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.advice.rules.inplace_activations import inplace_candidates
from lightning_vram.advice.rules.registry import advise
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import (
    Advice,
    CheckpointChange,
    DeviceInfo,
    FreeGradientsChange,
    InplaceChange,
    Phase,
    PrecisionChange,
    RunSummary,
    Simulation,
    StepChange,
    TrainingSetup,
)
from lightning_vram.render.diff import diff_text
from lightning_vram.units import format_bytes, format_percent

# Simulated advice applied, against its replayed prediction.
pytestmark = pytest.mark.replay

# ------------------------------------------------------------------------------------- applied on the CPU, for real


@dataclass(frozen=True)
class Run:
    """A monitored CPU run, the replay of its sampled step with every change the rules could advise, the advice."""

    report: Report
    setup: TrainingSetup
    simulation: Simulation
    advice: tuple[Advice, ...]

    @property
    def peak_bytes(self) -> int:
        assert self.report.peak is not None
        return self.report.peak.peak_bytes

    def find(self, advice_id: str) -> Advice | None:
        return next((advice for advice in self.advice if advice.id == advice_id), None)


def candidate_changes(summary: RunSummary, setup: TrainingSetup) -> list[StepChange]:
    """What the session replays: bf16-mixed (on the CPU), the checkpointing candidates, inplace, freed gradients."""
    changes: list[StepChange] = [PrecisionChange("bf16-mixed")] if setup.precision in FULL_PRECISIONS else []
    changes += [CheckpointChange(plan) for plan in checkpoint_candidates(summary.modules)]
    if names := inplace_candidates(summary, setup):
        changes.append(InplaceChange(names))
    return [*changes, FreeGradientsChange()]


def monitored(
    root: Path,
    module: pl.LightningModule,
    data: Dataset[Any],
    batch_size: int,
    on: DeviceInfo | None = None,
    applied: Advice | None = None,
    **options: Any,
) -> Run:
    """Three steps with step 1 counted; its replay; the advice as if on device ``on`` (default: the CPU run's).

    ``applied``: a stale-gradients advice whose printed callbacks the Trainer lists, the monitor in its printed place.

    The replay is this function's own Predictor's, from the run's attribution: the monitor's own replays (in training
    and preflight) are off, as nothing here reads them.
    """
    torch.manual_seed(0)
    monitor = VramMonitor(
        attribution_start_step=1, attribution_every_n_steps=None, console_summary=False, **REPLAYS_OFF
    )
    batches = loader(data, batch_size)
    fit = trainer(root, printed_callbacks(applied, monitor) if applied else [monitor], max_steps=3, **options)
    fit.fit(module, batches)
    report = monitor.report
    assert report is not None
    setup = trainer_setup(fit, module)
    attribution = monitor.session._recorder.tracker.latest_attribution
    changes = candidate_changes(report.summary, setup)
    assert attribution is not None
    forward = attribution.phases[Phase.FORWARD]
    simulation = Predictor(
        module,
        fit.optimizers,
        next(iter(batches)),
        precision=setup.precision,
        gradients_at_forward=forward.gradients > 0,
        calibration=attribution,
    ).simulate(changes)
    assert simulation.skipped is None, simulation.skipped
    summary = report.summary if on is None else replace(report.summary, device=on)
    return Run(report, setup, simulation, advise(summary, setup, simulation))


def snippet(advice: Advice) -> str:
    (code,) = re.findall(r"```python\n(.*?)\n```", advice.detail, re.DOTALL)
    return code


def assert_realised(before: Run, after: Run, advice: Advice) -> None:
    assert advice.saving_basis in ("simulated", "modelled") and advice.estimated_saving_bytes is not None
    assert before.peak_bytes - after.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    if advice.saving_basis == "simulated":
        assert advice.predicted_peak_bytes == pytest.approx(after.peak_bytes, rel=0.1)
    assert after.find(advice.id) is None


def test_checkpointing_applied_on_a_transformer_saves_what_the_replay_said(tmp_path: Path) -> None:
    before = monitored(tmp_path / "before", LanguageModel(TinyGPT()), tokens(32), 16)
    advice = before.find("activation-checkpointing")
    assert advice is not None and advice.saving_basis == "simulated"
    (plan,) = [
        plan
        for plan in checkpoint_candidates(before.report.summary.modules)
        if checkpoint_snippet(plan)[1] in advice.detail
    ]
    module = LanguageModel(TinyGPT())
    apply_plan(module, plan)
    assert_realised(before, monitored(tmp_path / "after", module, tokens(32), 16), advice)


A100 = DeviceInfo("cuda", "NVIDIA A100", 0, 80 * GIB, (8, 0))
"""The CPU runs judged as if on an A100: mixed precision is advised on CUDA only; the replay stays the CPU's."""


def test_mixed_precision_applied_on_a_resnet_saves_what_the_replay_said(tmp_path: Path) -> None:
    def build() -> Classifier:
        return Classifier(resnet(), OPTIMIZERS["sgd_momentum"])

    before = monitored(tmp_path / "before", build(), images(64), 16, on=A100)
    advice = before.find("mixed-precision")
    assert advice is not None and advice.saving_basis == "simulated"
    assert 'Trainer(precision="bf16-mixed")' in advice.detail
    after = monitored(tmp_path / "after", build(), images(64), 16, on=A100, precision="bf16-mixed")
    assert_realised(before, after, advice)


def test_inplace_activations_applied_saves_what_the_replay_said(tmp_path: Path) -> None:
    before = monitored(
        tmp_path / "before", Classifier(activation_mlp(nn.LeakyReLU), OPTIMIZERS["adam"]), features(1024, 256), 512
    )
    advice = before.find("inplace-activations")
    assert advice is not None and advice.saving_basis == "simulated"
    # the modules by name (tests/test_inplace_named_modules.py), each set inplace on the built model
    assert [line for line in snippet(advice).splitlines() if not line.startswith("#")] == [
        "self.network[1].inplace = True",
        "self.network[3].inplace = True",
        "self.network[5].inplace = True",
        "self.network[7].inplace = True",
    ]
    inplace = Classifier(activation_mlp(nn.LeakyReLU), OPTIMIZERS["adam"])
    exec(snippet(advice), {"self": inplace})  # the printed lines, in the LightningModule's __init__
    assert_realised(before, monitored(tmp_path / "after", inplace, features(1024, 256), 512), advice)


@pytest.mark.parametrize(
    ("width", "depth", "optimizer", "samples", "batch_size"),
    [(256, 4, "adam", 1024, 512), (1024, 3, "sgd", 512, 128)],
    ids=["activations-heavy", "parameters-heavy"],
)
def test_stale_gradients_applied_saves_what_the_replay_said(
    tmp_path: Path, width: int, depth: int, optimizer: str, samples: int, batch_size: int
) -> None:
    # Parameters-heavy (a new user's trial's shape): the last step's gradients, alive at the step's start, outweigh
    # the activations the forward pass adds once they are freed.
    def build() -> Classifier:
        return Classifier(activation_mlp(nn.LeakyReLU, depth=depth, width=width), OPTIMIZERS[optimizer])

    data = features(samples, width)
    before = monitored(tmp_path / "before", build(), data, batch_size)
    advice = before.find("stale-gradients")
    assert advice is not None and advice.saving_basis == "simulated"
    after = monitored(tmp_path / "after", build(), data, batch_size, applied=advice)  # the printed callbacks
    # The gradients are freed before the monitor starts the step: its forward row holds neither them nor, as
    # "other", what they were (the monitor started the step first when the LightningModule's hook freed them) ...
    stale = before.report.phases[Phase.FORWARD].breakdown
    forward = after.report.phases[Phase.FORWARD].breakdown
    assert stale is not None and stale.gradients > 0 and forward is not None and forward.gradients == 0
    assert forward.other is not None and stale.other is not None and forward.other <= stale.other
    # ... so the replay, starting from the freed gradients the run's forward saw, reproduces it and is trusted: advice
    # both runs give keeps its simulated saving.
    assert after.simulation.skipped is None and after.simulation.match is not None and after.simulation.match.matches
    for item in after.advice:
        earlier = before.find(item.id)
        assert earlier is None or earlier.saving_basis == item.saving_basis, item.id
    assert_realised(before, after, advice)


def test_chunked_loss_applied_saves_what_it_modelled(tmp_path: Path) -> None:
    # A 4096-token vocabulary: the log-probabilities of 8 x 32 positions are 4 MiB, two thirds of the activations.
    before = monitored(
        tmp_path / "before", LanguageModel(TinyGPT(vocab=4096, layers=2), OPTIMIZERS["adam"]), tokens(64, vocab=4096), 8
    )
    advice = before.find("chunked-loss")
    assert advice is not None and advice.saving_basis == "modelled"
    assert (
        before.simulation.baseline is not None and before.simulation.baseline.loss_activation_bytes == 8 * 32 * 4096 * 4
    )
    namespace: dict[str, Any] = {}
    exec(snippet(advice), namespace)
    module = ChunkedLanguageModel(TinyGPT(vocab=4096, layers=2), namespace["chunked_cross_entropy"], OPTIMIZERS["adam"])
    assert_realised(before, monitored(tmp_path / "after", module, tokens(64, vocab=4096), 8), advice)


class EncoderLM(nn.Module):
    """A causal language model of ``nn.TransformerEncoderLayer``s, each checkpointed (a new user's trial's, with its
    budget plan applied): its backward, recomputing each layer once the loss's tensors are freed, holds more than
    its chunked-loss start does."""

    def __init__(self, vocab: int = 4000, width: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        x = self.embedding(ids)
        for layer in self.encoder.layers:
            x = checkpoint(layer, x, mask, None, True, use_reentrant=False)  # src_mask, no padding mask, causal
        return x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids))  # type: ignore[no-any-return]


class ChunkedEncoderLM(LanguageModel):
    """:class:`EncoderLM` with its loss computed by the chunked-loss advice's printed function."""

    def __init__(self, chunked_cross_entropy: Any) -> None:
        super().__init__(EncoderLM(), OPTIMIZERS["adamw"])
        self.chunked_cross_entropy = chunked_cross_entropy

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        network = self.network
        assert isinstance(network, EncoderLM)
        hidden = network.hidden(ids).flatten(0, 1)
        return self.chunked_cross_entropy(hidden, network.head, targets.flatten())  # type: ignore[no-any-return]


def test_chunked_loss_on_an_encoder_lm_saves_what_it_modelled(tmp_path: Path) -> None:
    """The trial's model: chunked-loss promised 41.0 MiB and saved 34.1 (the rest of backward, unchanged by
    chunking, peaked above the chunked start the saving was modelled on)."""
    data = tokens(32, length=64, vocab=4000)
    before = monitored(tmp_path / "before", LanguageModel(EncoderLM(), OPTIMIZERS["adamw"]), data, 16)
    advice = before.find("chunked-loss")
    assert advice is not None and advice.saving_basis == "modelled" and advice.estimated_saving_bytes is not None
    namespace: dict[str, Any] = {}
    exec(snippet(advice), namespace)
    after = monitored(tmp_path / "after", ChunkedEncoderLM(namespace["chunked_cross_entropy"]), data, 16)
    realised = before.peak_bytes - after.peak_bytes
    print(f"chunked loss: promised {advice.estimated_saving_bytes:,} B, realised {realised:,} B")
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.02)
    assert after.find(advice.id) is None
    # diff knows the loss's chunks for what they are (it said "8 unit(s) ... no prediction to check").
    promised, fell = format_bytes(advice.estimated_saving_bytes), format_bytes(realised)
    assert (
        f"B recomputed network.head 8 times in backward: A's chunked-loss advice applied (8 chunks); it promised about"
        f" {promised} (modelled), the peak fell {fell} ({format_percent(realised / advice.estimated_saving_bytes)}"
        f" of it) (B measured {format_bytes(after.peak_bytes)})"
    ) in diff_text(replace(before.report, advice=before.advice, simulation=before.simulation), after.report)


class CheckpointedLSTM(nn.Module):
    """A recurrent language model whose LSTM is checkpointed (a new user's trial's, with its checkpointing advice
    applied): its backward peaks at the loss's start, with no gradient yet, though the counted parts peak later in
    backward, with the LSTM's recomputation and some gradients."""

    def __init__(self, vocab: int = 4000, width: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        output, _ = checkpoint(self.lstm, self.embedding(ids), use_reentrant=False)
        return output  # type: ignore[no-any-return]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids))  # type: ignore[no-any-return]


class ChunkedLSTM(LanguageModel):
    """:class:`CheckpointedLSTM` with its loss computed by the chunked-loss advice's printed function."""

    def __init__(self, chunked_cross_entropy: Any) -> None:
        super().__init__(CheckpointedLSTM(), OPTIMIZERS["adam"])
        self.chunked_cross_entropy = chunked_cross_entropy

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        network = self.network
        assert isinstance(network, CheckpointedLSTM)
        hidden = network.hidden(ids).flatten(0, 1)
        return self.chunked_cross_entropy(hidden, network.head, targets.flatten())  # type: ignore[no-any-return]


def test_chunked_loss_is_advised_where_backward_peaks_at_the_loss_before_the_counted_parts_do(tmp_path: Path) -> None:
    """A new user's trial: with its LSTM checkpointed, the model was told chunking the loss saves 0 B (its backward
    breakdown, counted where the parts' sum peaked, held gradients), and chunking it saved 46.9 MiB."""
    data = tokens(32, length=64, vocab=4000)
    before = monitored(tmp_path / "before", LanguageModel(CheckpointedLSTM(), OPTIMIZERS["adam"]), data, 16)
    assert before.simulation.baseline is not None
    backward = before.simulation.baseline.phases[Phase.BACKWARD]
    assert backward.breakdown is not None and backward.breakdown.gradients > 0  # the counted parts' own instant
    advice = before.find("chunked-loss")
    assert advice is not None and advice.saving_basis == "modelled" and advice.estimated_saving_bytes is not None
    namespace: dict[str, Any] = {}
    exec(snippet(advice), namespace)
    after = monitored(tmp_path / "after", ChunkedLSTM(namespace["chunked_cross_entropy"]), data, 16)
    realised = before.peak_bytes - after.peak_bytes
    print(f"chunked loss: promised {advice.estimated_saving_bytes:,} B, realised {realised:,} B")
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.02)
    assert after.find(advice.id) is None

"""The checkpointing advice applied as the report prints it, on transformers architectures and a plain torch model.

Each model is built from its config class (random weights, nothing downloaded) and trained with the monitor; the
report's own checkpointing advice (replayed in training) is applied by running the code it prints on a fresh
module, which is trained again: the peak falls by the predicted saving (within 10%, the report's own peak both
times), the advice is gone, backward runs, and ``lightning-vram diff`` finds the plan applied (from the modules the
second run recomputed) and sets the replay's predicted peak beside the measured one.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import loader, trainer
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.advice.checkpoint_code import CodeContext, checkpoint_snippet
from lightning_vram.advice.checkpointing import switch_plan
from lightning_vram.measure.setup import checkpointing_switches
from lightning_vram.records import CheckpointChange, CheckpointPlan, Simulation, TrainingLoop, VariantResult
from lightning_vram.records.advice import layer_ranges
from lightning_vram.records.simulation_json import simulation_from_dict, simulation_to_dict
from lightning_vram.render.diff import prediction_lines
from lightning_vram.units import format_bytes

pytest.importorskip("transformers")


def test_reading_the_switches_imports_nothing_of_transformers() -> None:
    # A process that imported transformers for a tokenizer only: transformers' attributes are lazy, and reading
    # transformers.PreTrainedModel imported its modeling_utils (2.4 s here) for a model that is not one of its own.
    code = (
        "import sys, torch, transformers\n"
        "from lightning_vram.measure.setup import checkpointing_switches\n"
        "print(checkpointing_switches(torch.nn.Linear(2, 2)), 'transformers.modeling_utils' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=False)
    assert run.stdout.strip() == "() False", run.stderr[-2000:]


VOCAB, LENGTH, BATCH = 1000, 128, 8


class Trained(pl.LightningModule):
    """A model trained on batches of keyword arguments: ``keys`` name the dataset's tensors; the loss is its own."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.keys = keys
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**dict(zip(self.keys, batch, strict=True))).loss
        self.steps += 1
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=VOCAB, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=256,
    )  # fmt: skip
    return BertForMaskedLM(config)


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=64,
        patch_size=4, num_labels=10,
    )  # fmt: skip
    return ViTForImageClassification(config)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def _tokens(samples: int) -> TensorDataset:
    ids = torch.randint(1, VOCAB, (samples, LENGTH), generator=torch.Generator().manual_seed(0))
    return TensorDataset(ids, ids.clone())


def _masked_tokens(samples: int) -> TensorDataset:
    """Token ids, an attention mask with the last quarter of every other sequence padded, the labels."""
    ids = torch.randint(1, VOCAB, (samples, LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(samples, LENGTH, dtype=torch.long)
    mask[::2, -LENGTH // 4 :] = 0
    return TensorDataset(ids, mask, ids.clone())


def _images(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 3, 64, 64, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


@dataclass(frozen=True)
class Architecture:
    """A transformers model, its batches' keyword names and data, and the layers its own switch checkpoints."""

    build: Callable[[], nn.Module]
    keys: tuple[str, ...]
    data: Callable[[int], TensorDataset]
    layers: str

    def module(self) -> Trained:
        torch.manual_seed(0)
        return Trained(self.build(), self.keys)


ARCHITECTURES = {
    "llama": Architecture(_llama, ("input_ids", "labels"), _tokens, "model.model.layers.0-1"),
    "qwen2-gqa": Architecture(_qwen2, ("input_ids", "labels"), _tokens, "model.model.layers.0-1"),
    "bert": Architecture(
        _bert, ("input_ids", "attention_mask", "labels"), _masked_tokens, "model.bert.encoder.layer.0-1"
    ),
    "t5": Architecture(_t5, ("input_ids", "labels"), _tokens, "model.encoder.block.0-1 and model.decoder.block.0-1"),
    "vit": Architecture(_vit, ("pixel_values", "labels"), _images, "model.vit.layers.0-1"),
    "gpt2": Architecture(_gpt2, ("input_ids", "labels"), _tokens, "model.transformer.h.0-1"),
}


def _report(root: Path, module: pl.LightningModule, data: TensorDataset) -> Report:
    """Three steps with step 1 counted and replayed in training (the report's own advice)."""
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, loader(data, BATCH))
    assert monitor.report is not None
    return monitor.report


def _code(report: Report) -> tuple[str, Any]:
    """The checkpointing advice's code block, as printed, and the advice."""
    advice = next((advice for advice in report.advice if advice.id == "activation-checkpointing"), None)
    assert advice is not None, [item.id for item in report.advice]
    (code,) = re.findall(r"```python\n(.*?)\n```", advice.detail, re.DOTALL)
    return code, advice


def _assert_realised(before: Report, after: Report, advice: Any) -> None:
    """The saving the advice predicted is what applying it freed (the report's own peak both times)."""
    assert before.peak is not None and after.peak is not None
    assert advice.estimated_saving_bytes is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    if advice.saving_basis == "simulated":
        assert advice.predicted_peak_bytes == pytest.approx(after.peak.peak_bytes, rel=0.1)
    assert all(item.id != "activation-checkpointing" for item in after.advice)
    assert before.recomputed_units == () and after.recomputed_units
    (line,) = prediction_lines(before, after)
    assert line.startswith(f"A's replay predicted {format_bytes(advice.predicted_peak_bytes)} for ")
    assert f", B measured {format_bytes(after.peak.peak_bytes)} (diff " in line


@pytest.mark.replay  # the advice applied as printed is checked against its replayed prediction
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_transformers_checkpointing_advice_applied_as_printed(tmp_path: Path, name: str) -> None:
    architecture = ARCHITECTURES[name]
    trained = architecture.module()
    use_cache = getattr(trained.model.config, "use_cache", None)
    before = _report(tmp_path / "before", trained, architecture.data(4 * BATCH))
    code, advice = _code(before)
    assert advice.saving_basis == "simulated", advice.evidence  # the switch was replayed before it was offered
    # ... on the replay's copy only: the trained model's config and layers are as they were.
    assert getattr(trained.model.config, "use_cache", None) == use_cache
    (switch,) = checkpointing_switches(trained)
    assert not switch.on
    assert switch_plan(before.summary.modules, switch) is not None  # the modelled plan, where the replay cannot run
    assert f"({architecture.layers})" in advice.title  # every stack's layers, one round
    assert ".activation_checkpointing_enable(" in code and '{"use_reentrant": False}' in code
    module = architecture.module()
    exec(code, {"self": module})  # the advice's own lines, in the module's __init__
    assert [switch.on for switch in checkpointing_switches(module)] == [True]
    after = _report(tmp_path / "after", module, architecture.data(4 * BATCH))
    assert module.steps == 3  # backward ran each step
    _assert_realised(before, after, advice)


def test_the_switch_names_every_stack_of_an_encoder_decoder() -> None:
    module = ARCHITECTURES["t5"].module()
    (switch,) = checkpointing_switches(module)
    assert (switch.model, switch.method) == ("model", "activation_checkpointing_enable")
    assert layer_ranges(switch.layers) == "model.encoder.block.0-1 and model.decoder.block.0-1"
    module.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointing_switches(module) == (replace(switch, on=True),)  # on already: nothing more to advise


# ------------------------------------------------------------------------------------- a plain torch model


class MaskedBlock(nn.Module):
    """A residual MLP block taking the hidden states and a mask (by keyword) and returning (hidden, gate)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, hidden: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        gate = torch.sigmoid(self.up(hidden))
        return hidden + self.down(torch.nn.functional.gelu(self.up(hidden)) * gate) * mask, gate


class MaskedStack(pl.LightningModule):
    """Blocks called as ``hidden, _ = block(hidden, mask=mask)``: the old ``checkpoint(block, x)`` raised there."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(MaskedBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        features, mask, labels = batch
        hidden = self.embed(features)
        for block in self.blocks:
            hidden, _ = block(hidden, mask=mask.unsqueeze(-1))
        self.steps += 1
        return nn.functional.cross_entropy(self.head(hidden.mean(1)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _masked_features(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 64, 16, generator=generator),
        (torch.rand(samples, 64, generator=generator) > 0.2).float(),
        torch.randint(0, 10, (samples,), generator=generator),
    )


@pytest.mark.replay  # the advice applied as printed is checked against its replayed prediction
def test_plain_checkpointing_advice_passes_every_argument_and_keeps_tuple_outputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    before = _report(tmp_path / "before", MaskedStack(), _masked_features(4 * BATCH))
    code, advice = _code(before)
    assert advice.saving_basis == "simulated", advice.evidence
    assert "class Checkpointed(nn.Module):" in code and "Checkpointed(self.blocks[index])" in code
    torch.manual_seed(0)
    module = MaskedStack()
    exec(code, {"self": module})
    after = _report(tmp_path / "after", module, _masked_features(4 * BATCH))
    assert module.steps == 3
    # Each wrapper's block re-ran, under the wrapper's name (the advice's `.block`).
    assert after.recomputed_units is not None
    assert all(len(unit) == 1 and re.fullmatch(r"blocks\.\d+\.block", unit[0]) for unit in after.recomputed_units)
    _assert_realised(before, after, advice)


# ------------------------------------------------------------------------------------- the plan in the report's JSON


def test_a_switch_plan_reads_back_and_older_plans_read_without_one() -> None:
    plan = CheckpointPlan(
        "model",
        (("model.encoder.block.0",), ("model.decoder.block.0",)),
        None,
        1024,
        "model",
        "activation_checkpointing_enable",
    )
    simulation = Simulation("cpu", None, None, None, (VariantResult(CheckpointChange(plan), None, "raised"),), 0.0)
    data = simulation_to_dict(simulation)
    assert simulation_from_dict(data) == simulation
    assert data["variants"][0]["change"] == "model.activation_checkpointing_enable() (2 layers)"
    del data["variants"][0]["parameters"]["switch"]  # as 0.9.0 and earlier wrote it
    read = simulation_from_dict(data)
    assert read is not None and read.variants[0].change == CheckpointChange(replace(plan, switch=None))


class CrossBlock(nn.Module):
    """A decoder block reading the encoder's output: ``(hidden, memory) -> (hidden, attention weights)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.query = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, hidden: Tensor, memory: Tensor) -> tuple[Tensor, Tensor]:
        weights = torch.softmax(self.query(hidden) @ memory.transpose(1, 2), dim=-1)
        hidden = hidden + weights @ memory
        return hidden + self.down(torch.nn.functional.gelu(self.up(hidden))), weights


class EncoderDecoder(pl.LightningModule):
    """Two stacks (``encoder``, ``decoder``) of blocks taking two tensors and returning tuples."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.encoder = nn.ModuleList(MaskedBlock(width) for _ in range(depth))
        self.decoder = nn.ModuleList(CrossBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        features, mask, labels = batch
        memory = self.embed(features)
        for block in self.encoder:
            memory, _ = block(memory, mask=mask.unsqueeze(-1))
        hidden = memory.flip(1)
        for layer in self.decoder:
            hidden, _ = layer(hidden, memory)
        self.steps += 1
        return nn.functional.cross_entropy(self.head(hidden.mean(1)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.replay  # the advice applied as printed is checked against its replayed prediction
def test_one_round_of_plain_checkpointing_advice_covers_encoder_and_decoder(tmp_path: Path) -> None:
    torch.manual_seed(0)
    before = _report(tmp_path / "before", EncoderDecoder(), _masked_features(4 * BATCH))
    code, advice = _code(before)
    assert advice.saving_basis == "simulated", advice.evidence
    assert "self.encoder[index] = Checkpointed(self.encoder[index])" in code
    assert "self.decoder[index] = Checkpointed(self.decoder[index])" in code
    torch.manual_seed(0)
    module = EncoderDecoder()
    exec(code, {"self": module})
    after = _report(tmp_path / "after", module, _masked_features(4 * BATCH))
    assert module.steps == 3
    _assert_realised(before, after, advice)


def test_a_switch_plan_on_the_trained_model_itself_names_it_in_words() -> None:
    """A plain or Fabric loop trains the transformers model itself (the plan's container is the root): a trial read
    "every layer of `the model`" and "the model.activation_checkpointing_enable()", words set as code."""
    plan = CheckpointPlan(
        "", (("model.layers.0",), ("model.layers.1",)), None, 1024, "", "gradient_checkpointing_enable"
    )
    assert CheckpointChange(plan).label == "the model's gradient_checkpointing_enable() (2 layers)"
    what, code = checkpoint_snippet(plan, CodeContext(TrainingLoop.PLAIN, "LlamaForCausalLM"))
    assert what == "every layer of the model (model.layers.0-1) with its own switch"
    assert 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})' in code

"""A replay for CUDA where torch has no CUDA device runs CUDA's dropout and attention kernels (replay/cuda_kernels.py).

The reference is a model that calls CUDA's ops itself (``native_dropout``, memory-efficient attention's op) through a
function mode of its own: a replay of the plain model for CUDA must hold what the reference's replay holds, phase by
phase, to the byte. A CPU-only torch replays both on the CPU (before the change the plain one ran the CPU's dropout,
which saves a float noise tensor, and the math attention path, which saves the attention weights); a CUDA build
without a device replays both on fake CUDA; with a GPU, torch picks the same kernels itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from replay_models import counted_step
from torch import Tensor, nn
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

from lightning_vram import predict
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay._fake import FakeTensorMode
from lightning_vram.prediction.replay.cuda_kernels import EFFICIENT_GQA, CudaKernels, cuda_attention
from lightning_vram.records import Phase, ReplayedStep

pytestmark = pytest.mark.replay

BATCH, LENGTH, VOCAB = 4, 128, 1000


class CudaOps(TorchFunctionMode):
    """Tiny GPT-2's dropout and attention calls, made to the ops CUDA runs for them (float32, causal, no mask)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout and kwargs["training"] and kwargs["p"] > 0:
            return torch.native_dropout(args[0], kwargs["p"], True)[0]
        if func is F.scaled_dot_product_attention:
            query, key, value = args
            assert kwargs["attn_mask"] is None and query.dtype == torch.float32
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, None, True, kwargs["dropout_p"], kwargs["is_causal"], scale=kwargs["scale"]
            )[0]
        return func(*args, **kwargs)


class TinyGPT2(pl.LightningModule):
    """GPT-2 from its config (2 layers, 64 wide, dropout 0.1 everywhere), its attention torch's SDPA; with
    ``reference``, its training step calls CUDA's ops itself (:class:`CudaOps`)."""

    def __init__(self, reference: bool = False) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0
        )
        config._attn_implementation = "sdpa"
        self.model = GPT2LMHeadModel(config)
        self.reference = reference

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (tokens,) = batch
        if self.reference:
            with CudaOps():
                loss: Tensor = self.model(input_ids=tokens, labels=tokens).loss
            return loss
        return self.model(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens(samples: int = BATCH) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (samples, LENGTH), generator=torch.Generator().manual_seed(0)))


def test_a_replay_for_cuda_holds_what_cudas_dropout_and_attention_kernels_hold() -> None:
    batch = (tokens().tensors[0],)
    plain = predict(TinyGPT2(), batch, device_type="cuda", fit_table=False)
    reference = predict(TinyGPT2(reference=True), batch, device_type="cuda", fit_table=False)
    assert plain.step is not None and reference.step is not None
    for phase, peak in reference.step.phases.items():
        assert plain.step.phases[phase].peak_bytes == peak.peak_bytes, phase
        assert plain.step.phases[phase].breakdown == peak.breakdown, phase
    if not torch.cuda.is_available():  # torch picks CUDA's kernels itself on a GPU
        kernels = [note for note in plain.notes if note.startswith("replayed with CUDA's kernels")]
        assert len(kernels) == 1 and "memory-efficient attention, native_dropout" in kernels[0]
    # The CPU's kernels save more: per layer, the attention weights and the weights after dropout (4 x 4 x 128 x 128
    # float32: 1 MiB each) and dropout's float noise (1 MiB, where CUDA's bool mask is 256 KiB).
    cpu = predict(TinyGPT2(), batch, device_type="cpu", fit_table=False)
    assert cpu.step is not None and not any("CUDA's kernels" in note for note in cpu.notes)
    cpu_forward, cuda_forward = cpu.step.phases[Phase.FORWARD].breakdown, plain.step.phases[Phase.FORWARD].breakdown
    assert cpu_forward is not None and cuda_forward is not None
    assert cpu_forward.activations - cuda_forward.activations > 2 * 2 * 1024**2


def test_a_prediction_for_the_cpu_still_counts_the_cpus_kernels(tmp_path: Path) -> None:
    module = TinyGPT2()
    prediction = predict(module, (tokens().tensors[0],), device_type="cpu", fit_table=False)
    measured, _ = counted_step(tmp_path, module, tokens(4 * BATCH), BATCH)
    assert prediction.step is not None
    for phase, counted in measured.phases.items():
        predicted = prediction.step.phases[phase].breakdown
        assert predicted is not None and predicted.activations == counted.activations, phase


def test_real_tensors_pass_through_the_mode_untouched() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 8, generator=generator)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        expected = (F.dropout(x, 0.5, True), F.scaled_dot_product_attention(x, x, x, dropout_p=0.5, is_causal=True))
    with torch.random.fork_rng(), CudaKernels() as kernels:
        torch.manual_seed(1)
        got = (F.dropout(x, 0.5, True), F.scaled_dot_product_attention(x, x, x, dropout_p=0.5, is_causal=True))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)) and kernels.kernels == set()


def test_multi_head_attention_inside_an_encoder_layer_runs_cudas_attention() -> None:
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(torch.empty(2, 32, 64))
        with CudaKernels() as kernels:
            output = layer(fake)
    assert output.grad_fn is not None and kernels.kernels == {"memory-efficient attention", "native_dropout"}


@pytest.mark.parametrize(
    ("dtype", "mask", "head_dim", "expected"),
    [
        (torch.float32, False, 64, SDPBackend.EFFICIENT_ATTENTION),
        (torch.bfloat16, False, 64, SDPBackend.FLASH_ATTENTION),
        (torch.float16, True, 64, SDPBackend.EFFICIENT_ATTENTION),  # flash takes no mask
        (torch.bfloat16, False, 320, SDPBackend.EFFICIENT_ATTENTION),  # flash stops at 256
        (torch.float32, False, 30, SDPBackend.MATH),  # float32 head dimensions are multiples of 4
        (torch.float64, False, 64, SDPBackend.MATH),
    ],
)
def test_attention_takes_the_kernel_torch_picks_on_a_gpu(
    dtype: torch.dtype, mask: bool, head_dim: int, expected: SDPBackend
) -> None:
    query = torch.empty(2, 4, 16, head_dim, dtype=dtype)
    attn_mask = torch.ones(16, 16, dtype=torch.bool) if mask else None
    assert cuda_attention(query, query, query, attn_mask) == expected


class OpNames(TorchDispatchMode):  # type: ignore[misc]  # torch ships TorchDispatchMode unannotated
    """The name of every op a replay runs (outside the replay's own modes: it sees them all)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_replay_for_cuda_on_the_cpu_takes_the_optimizer_path_cuda_takes() -> None:
    """On CUDA, AdamW takes the foreach path by default (every parameter's temporaries at once), on the CPU a loop."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    steps: dict[bool, ReplayedStep] = {}
    ops: dict[bool, list[str]] = {}
    for for_cuda in (False, True):
        recorder = OpNames()
        with recorder:
            step = Predictor(
                model,
                [optimizer],
                torch.randn(5, 8),
                step_function=lambda module, batch: module(batch).sum(),
                placement=torch.device("cpu"),
                warm_up=True,
                for_cuda=for_cuda,
            ).replay()
        assert isinstance(step, ReplayedStep), step
        steps[for_cuda], ops[for_cuda] = step, recorder.names
    assert ops[True].count("_foreach_lerp_") == 2 and "lerp_" not in ops[True]  # warm-up and counted step
    assert ops[False].count("lerp_") == 2 * 4 and "_foreach_lerp_" not in ops[False]  # four parameters, one by one
    for phase in (Phase.FORWARD, Phase.BACKWARD):  # no dropout, no attention: only the optimizer's step differs
        assert steps[True].phases[phase] == steps[False].phases[phase]
    assert optimizer.defaults["foreach"] is None  # the user's optimizer is left as it was


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_block_checkpointed_in_a_replay_for_cuda_is_recomputed_with_cudas_kernels(reentrant: bool) -> None:
    """Backward runs with the mode on the stack: the recomputation runs the kernels the block's forward ran.

    Before, torch had taken the mode off its stack to hand it ``Tensor.backward``, and the engine ran without it:
    non-reentrant checkpointing raised ``CheckpointError`` (the CPU's dropout and attention save other tensors than
    CUDA's), reentrant checkpointing recomputed with the CPU's kernels.
    """
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    recorder = OpNames()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(torch.empty(2, 32, 64)).requires_grad_()
        with CudaKernels() as kernels, recorder:
            output = torch.utils.checkpoint.checkpoint(layer, fake, use_reentrant=reentrant)
            output.sum().backward()
    assert kernels.kernels == {"memory-efficient attention", "native_dropout"}
    # Forward, then the recomputation; then the kernel's own backward.
    assert recorder.names.count("_scaled_dot_product_efficient_attention") == 2
    assert recorder.names.count("_scaled_dot_product_efficient_attention_backward") == 1
    assert recorder.names.count("native_dropout") == 2 * 3  # three dropouts in an encoder layer's forward
    assert fake.grad is not None and fake.grad.shape == fake.shape


def test_a_checkpointed_gpt2_with_sdpa_is_replayed_for_cuda_on_the_cpu() -> None:
    """A new user's case: transformers' own checkpointing on a GPT-2 with SDPA, predicted for a GPU on a laptop."""
    module = TinyGPT2()
    module.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    batch = (tokens().tensors[0],)
    checkpointed = predict(module, batch, device_type="cuda", fit_table=False)
    assert checkpointed.step is not None, checkpointed.notes
    whole = predict(TinyGPT2(), batch, device_type="cuda", fit_table=False)
    assert whole.step is not None
    # Each layer's activations are recomputed in backward instead of held from forward.
    assert checkpointed.step.phases[Phase.FORWARD].peak_bytes < whole.step.phases[Phase.FORWARD].peak_bytes - 1024**2


class TinyLlama(pl.LightningModule):
    """Llama from its config (2 layers, 64 wide, 4 query heads over ``key_value_heads``, no dropout), its attention
    torch's SDPA: with fewer key/value heads and no padding mask transformers passes ``enable_gqa=True``."""

    def __init__(self, key_value_heads: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=key_value_heads,
            vocab_size=VOCAB,
            max_position_embeddings=LLAMA_LENGTH,
        )
        config._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


LLAMA_LENGTH = 64


def llama_prediction(key_value_heads: int, precision: str, device_type: str = "cuda") -> tuple[Any, list[str]]:
    """``predict()`` of :class:`TinyLlama` on 4 x 64 tokens, and the ops its replay ran."""
    batch = (tokens().tensors[0][:, :LLAMA_LENGTH],)
    recorder = OpNames()
    with recorder:
        prediction = predict(
            TinyLlama(key_value_heads), batch, device_type=device_type, precision=precision, fit_table=False
        )
    return prediction, recorder.names


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch picks CUDA's kernels itself on a GPU")
def test_a_grouped_query_llama_in_float32_is_replayed_for_cuda_with_the_kernel_a_gpu_runs() -> None:
    """A new user's case: before, the replay ran memory-efficient attention on grouped-query inputs, which torch before
    2.14 rules out (and whose backward's fake kernel gives the key the query's heads): the step failed."""
    grouped, names = llama_prediction(2, "32-true")
    assert grouped.step is not None, grouped.notes
    assert "_scaled_dot_product_flash_attention_for_cpu" not in names  # the CPU's own kernel for these inputs
    kernel = "memory-efficient attention" if EFFICIENT_GQA else "the math path"
    assert any(note.startswith("replayed with CUDA's kernels") and kernel in note for note in grouped.notes)
    if EFFICIENT_GQA:
        assert names.count("_scaled_dot_product_efficient_attention_backward") == 2 * 2
        return
    # Two layers, in the warm-up step and the counted step.
    assert "_scaled_dot_product_efficient_attention" not in names and names.count("_safe_softmax") == 2 * 2
    # The math path holds, per layer, the scaled query, the scaled key and the value repeated to the query's 4 heads
    # (4 x 4 x 64 x 16 float32: 64 KiB each) and the attention weights (4 x 4 x 64 x 64 float32: 256 KiB); the CPU's
    # flash kernel the query, the key and the value of 2 heads, and a float32 log-sum-exp per query row (its output,
    # the output projection's input, is held either way).
    cpu, _ = llama_prediction(2, "32-true", device_type="cpu")
    assert cpu.step is not None
    heads_by_rows = BATCH * 4 * LLAMA_LENGTH
    math_path = 3 * heads_by_rows * 16 * 4 + heads_by_rows * LLAMA_LENGTH * 4
    cpu_flash = heads_by_rows * 16 * 4 + 2 * (heads_by_rows // 2) * 16 * 4 + heads_by_rows * 4
    cuda_forward, cpu_forward = grouped.step.phases[Phase.FORWARD].breakdown, cpu.step.phases[Phase.FORWARD].breakdown
    assert cuda_forward.activations - cpu_forward.activations == 2 * (math_path - cpu_flash)


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch picks CUDA's kernels itself on a GPU")
def test_a_grouped_query_llama_in_bf16_mixed_is_replayed_for_cuda_with_flash_attention() -> None:
    grouped, names = llama_prediction(2, "bf16-mixed")
    assert grouped.step is not None, grouped.notes
    assert names.count("_scaled_dot_product_flash_attention") == 2 * 2  # two layers, in two steps (warm-up, counted)
    assert names.count("_scaled_dot_product_flash_attention_backward") == 2 * 2
    assert "_scaled_dot_product_efficient_attention" not in names and "_safe_softmax" not in names


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch picks CUDA's kernels itself on a GPU")
def test_a_llama_with_as_many_key_value_heads_as_query_heads_keeps_memory_efficient_attention() -> None:
    plain, names = llama_prediction(4, "32-true")
    assert plain.step is not None, plain.notes
    assert names.count("_scaled_dot_product_efficient_attention") == 2 * 2 and "_safe_softmax" not in names


@pytest.mark.parametrize(
    ("dtype", "mask", "expected"),
    [
        (torch.bfloat16, False, SDPBackend.FLASH_ATTENTION),  # flash takes grouped-query inputs
        (torch.float16, True, SDPBackend.EFFICIENT_ATTENTION if EFFICIENT_GQA else SDPBackend.MATH),
        (torch.float32, False, SDPBackend.EFFICIENT_ATTENTION if EFFICIENT_GQA else SDPBackend.MATH),
    ],
)
def test_grouped_query_attention_takes_the_kernel_torch_picks_on_a_gpu(
    dtype: torch.dtype, mask: bool, expected: SDPBackend
) -> None:
    query, key_value = torch.empty(2, 4, 16, 64, dtype=dtype), torch.empty(2, 2, 16, 64, dtype=dtype)
    attn_mask = torch.ones(16, 16, dtype=torch.bool) if mask else None
    assert cuda_attention(query, key_value, key_value, attn_mask, enable_gqa=True) == expected


def test_attention_on_cudas_math_path_runs_the_math_path_where_the_cpu_runs_its_flash_kernel() -> None:
    """A head dimension of 30 in float32 takes no fused kernel on CUDA; the CPU's flash kernel takes it."""
    recorder = OpNames()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        query = mode.from_tensor(torch.empty(2, 4, 16, 30)).requires_grad_()
        with CudaKernels() as kernels, recorder:
            output = F.scaled_dot_product_attention(query, query, query, is_causal=True)
    assert kernels.kernels == {"the math path"} and output.shape == query.shape
    assert "_safe_softmax" in recorder.names and "_scaled_dot_product_flash_attention_for_cpu" not in recorder.names


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch picks CUDA's kernels itself on a GPU")
def test_a_plan_says_once_which_of_cudas_kernels_its_replays_ran() -> None:
    """fp32 replays run memory-efficient attention, bf16-mixed ones flash attention: one note names both.

    Before, a plan printed two notes alike but for the kernel listed (a new user's ViT plan).
    """
    from lightning_vram.plan import plan

    torch.manual_seed(0)
    planned = plan(
        TinyGPT2(),
        (torch.zeros(BATCH, LENGTH, dtype=torch.long),),
        gpus=["H100"],
        world_sizes=(1,),
        precisions=("32-true", "bf16-mixed"),
        checkpointing=(False,),
    )
    kernels = [note for note in planned.notes if note.startswith("replayed with CUDA's kernels")]
    assert len(kernels) == 1, kernels
    assert "flash attention" in kernels[0] and "memory-efficient attention" in kernels[0], kernels

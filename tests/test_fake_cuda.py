"""Replays on fake CUDA tensors on a machine without a GPU (docs/fake-cuda.md).

The tests marked ``fake_cuda`` need a CUDA build of torch and no CUDA device: ``make test-fake-cuda`` builds one
(``.venv-fake-cuda``, torch 2.14.1) and runs them; the default CPU build skips them, saying so. The others check
the replay's backward without autograd's engine (:mod:`lightning_vram.prediction.replay.backward`) against the
engine itself, on the CPU, in every build.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier
from replay_models import CausalLM, mlp, resnet
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_vram.prediction.replay.step as replay_module
from lightning_vram import predict
from lightning_vram.predict import FAKE_CUDA_NOTE
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.backward import graph_backward
from lightning_vram.records import CheckpointChange, Phase, ReplayedStep, ReplaySkipped, StepChange
from lightning_vram.records.advice import CheckpointPlan

CUDA = torch.device("cuda")
WORKSPACES = 2 * 32 * 1024**2 + 1024**2
"""What a step on CUDA with a matmul in forward (a bias epilogue) and in backward holds in library workspaces, bytes:
cuBLAS's 32 MiB for each of the two threads (compute capability 9.0 assumed) and cuBLASLt's 1 MiB."""
FAKE_CUDA_REASON = (
    "needs a CUDA build of torch on a machine without a CUDA device (`make test-fake-cuda` builds .venv-fake-cuda"
    " with torch==2.14.1); this torch is "
    + ("a CPU build" if not torch.backends.cuda.is_built() else "a CUDA build with a CUDA device")
)
on_fake_cuda = pytest.mark.skipif(
    not torch.backends.cuda.is_built() or torch.cuda.is_available(), reason=FAKE_CUDA_REASON
)
"""With ``pytest.mark.fake_cuda``: the test needs fake CUDA tensors without a device."""

UNCOUNTED = frozenset({"device", "detach", "lift_fresh", "_to_copy", "_local_scalar_dense"})
"""Ops that read metadata or a value, or move a constant: no allocation of the step's own."""

Op = tuple[str, tuple[int, ...], tuple[torch.dtype, ...]]
"""An op's name, its tensor outputs' storage bytes and their dtypes."""


class OpRecorder(TorchDispatchMode):  # type: ignore[misc]  # torch ships TorchDispatchMode unannotated
    """Every op a replay runs, with its outputs' storage sizes (outside the replay's own modes: it sees them all)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in UNCOUNTED:
            outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
            sizes = tuple(t.untyped_storage().nbytes() for t in outputs)
            self.ops.append((name, sizes, tuple(t.dtype for t in outputs)))
        return out


def replay(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer] | None,
    batch: Any,
    change: StepChange | None = None,
    **options: Any,
) -> ReplayedStep | ReplaySkipped:
    """One replay of the step with ``change``, by a :class:`Predictor` with ``options``."""
    return Predictor(module, optimizers, batch, **options).replay(change)


def recorded_replay(module: nn.Module, batch: Any, **options: Any) -> tuple[ReplayedStep, list[Op]]:
    recorder = OpRecorder()
    with recorder:
        step = replay(module, None, batch, **options)
    assert isinstance(step, ReplayedStep), step
    return step, recorder.ops


def peaks(step: ReplayedStep) -> dict[str, int]:
    return {phase.value: peak.peak_bytes for phase, peak in step.phases.items()}


def names(ops: list[Op]) -> list[str]:
    return [name for name, _, _ in ops]


def conv_model() -> Classifier:
    torch.manual_seed(0)
    return Classifier(resnet(), OPTIMIZERS["sgd_momentum"])


def conv_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def language_model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM()


def tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0)),)


@contextmanager
def without_engine() -> Iterator[None]:
    """Replays walk backward in Python (as on fake CUDA without a device) whatever the device."""
    saved = replay_module.engine_can_run
    replay_module.engine_can_run = lambda _device: False
    try:
        yield
    finally:
        replay_module.engine_can_run = saved


# -- The backward without autograd's engine, against the engine (any build) ------------------------------------


def test_graph_backward_gives_the_engines_gradients() -> None:
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    images = torch.randn(3, 3, 8, 8)
    network(images).pow(2).mean().backward()  # type: ignore[no-untyped-call]
    expected = [parameter.grad.clone() for parameter in network.parameters() if parameter.grad is not None]
    network.zero_grad()  # gradients kept and added to, as a second backward would
    loss = network(images).pow(2).mean()
    graph_backward(loss)
    assert loss.grad_fn is None  # the loss let go of its graph
    got = [parameter.grad for parameter in network.parameters()]
    assert len(got) == len(expected) == 6
    for want, have in zip(expected, got, strict=True):
        assert have is not None
        torch.testing.assert_close(have, want)
        assert have.stride() == want.stride()  # laid out as the engine lays a leaf's gradient out


class Cube(torch.autograd.Function):
    """A Python autograd node, with a second output that gets no gradient (the engine hands it zeros)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x)
        return x**3, x * 2

    @staticmethod
    def backward(ctx: Any, cubed: torch.Tensor, doubled: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * cubed + 2 * doubled


def test_graph_backward_runs_python_autograd_functions() -> None:
    weight = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
    graph_backward(Cube.apply(weight)[0].sum())
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad, 3 * torch.linspace(-1.0, 1.0, 6) ** 2 + 0.0)
    assert weight.grad[0].item() == pytest.approx(3.0)


@pytest.mark.parametrize("build", [conv_model, lambda: Classifier(mlp(), OPTIMIZERS["adam"])], ids=["conv", "mlp"])
def test_graph_backward_replays_as_the_engine_does(build: Any) -> None:
    """On fake CPU tensors the engine runs: the walk in Python must give the same ops, sizes and peaks."""
    module = build()
    batch = conv_batch() if isinstance(module.network[0], nn.Conv2d) else (torch.randn(16, 64), torch.zeros(16).long())
    engine_step, engine_ops = recorded_replay(module, batch, warm_up=True)
    with without_engine():
        walked_step, walked_ops = recorded_replay(module, batch, warm_up=True)
    assert walked_ops == engine_ops
    assert peaks(walked_step) == peaks(engine_step)
    for phase in Phase:
        assert walked_step.phases[phase].breakdown == engine_step.phases[phase].breakdown


GPT2_BLOCKS = CheckpointPlan(
    "model.transformer.h",
    (("model.transformer.h.0",), ("model.transformer.h.1",)),
    None,
    0,
    "model.transformer",
)


def test_graph_backward_recomputes_and_frees_checkpointed_units_as_the_engine_does() -> None:
    """Non-reentrant checkpointing outside the engine: each unit recomputed once, its frame freed when spent.

    GPT-2's blocks pass a cache of every layer's keys and values: without the walk emptying spent frames, a cycle
    through autograd's C++ kept both frames and 214,144 bytes alive to the end of the step.
    """
    module, batch = language_model(), tokens()
    change = CheckpointChange(GPT2_BLOCKS)
    engine_step, engine_ops = recorded_replay(module, batch, change=change)
    with without_engine():
        walked_step, walked_ops = recorded_replay(module, batch, change=change)
    assert walked_ops == engine_ops
    # 8 in the replay without the plan (run first: what the plan's units must receive and return), 8 in the plan's
    # forward, 8 in the two units' recomputation
    assert names(walked_ops).count("addmm") == 24
    assert peaks(walked_step) == peaks(engine_step) == {"forward": 1580200, "backward": 2349576, "optimizer": 4455024}
    for phase in Phase:
        assert walked_step.phases[phase].breakdown == engine_step.phases[phase].breakdown


# -- Fake CUDA without a device (a CUDA build of torch) -------------------------------------------------------


@functools.cache
def cpu_and_cuda_conv() -> tuple[tuple[ReplayedStep, list[Op]], tuple[ReplayedStep, list[Op]]]:
    module, batch = conv_model(), conv_batch()
    return recorded_replay(module, batch), recorded_replay(module, batch, placement=CUDA)


@pytest.mark.fake_cuda
@on_fake_cuda
def test_conv_batchnorm_step_on_fake_cuda() -> None:
    (cpu_step, cpu_ops), (cuda_step, cuda_ops) = cpu_and_cuda_conv()
    assert cuda_step.device_type == "cuda" and cpu_step.device_type == "cpu"
    # Convolutions and their backward: the same ops, the same sizes, on both devices.
    convolutions = ("convolution", "convolution_backward")
    assert [op for op in cuda_ops if op[0] in convolutions] == [op for op in cpu_ops if op[0] in convolutions]
    assert names(cuda_ops).count("convolution") == 5
    # BatchNorm: cuDNN's kernels on CUDA (with the reserve tensor they return), the native ones on the CPU.
    assert names(cuda_ops).count("cudnn_batch_norm") == names(cpu_ops).count("native_batch_norm") == 5
    assert names(cuda_ops).count("cudnn_batch_norm_backward") == 5
    assert "native_batch_norm" not in names(cuda_ops)
    cuda_norms = [sizes for name, sizes, _ in cuda_ops if name == "cudnn_batch_norm"]
    cpu_norms = [sizes for name, sizes, _ in cpu_ops if name == "native_batch_norm"]
    assert [sizes[:3] for sizes in cuda_norms] == cpu_norms == [(131072, 64, 64)] * 5
    # SGD with momentum: torch's foreach path for CUDA parameters, one add per parameter on the CPU.
    # (a first step: each momentum buffer starts as a clone of its gradient, then one foreach add updates them all)
    assert names(cuda_ops).count("_foreach_add_") == 1 and "_foreach_add_" not in names(cpu_ops)
    # Allocator blocks on CUDA (512-byte multiples), bytes on the CPU.
    # Each phase also holds the library workspaces (cuBLAS's two, cuBLASLt's one: a steady step holds them all).
    assert peaks(cuda_step) == {
        "forward": 1396736 + WORKSPACES,
        "backward": 1658880 + WORKSPACES,
        "optimizer": 169472 + WORKSPACES,
    }
    assert peaks(cpu_step) == {"forward": 1377752, "backward": 1639424, "optimizer": 145056}
    assert all(peak % 512 == 0 for peak in peaks(cuda_step).values())


@functools.cache
def cpu_and_cuda_language_model() -> tuple[tuple[ReplayedStep, list[Op]], tuple[ReplayedStep, list[Op]]]:
    module, batch = language_model(), tokens()
    return recorded_replay(module, batch), recorded_replay(module, batch, placement=CUDA)


MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention", "embedding"})


@pytest.mark.fake_cuda
@on_fake_cuda
def test_gpt2_step_on_fake_cuda() -> None:
    (cpu_step, cpu_ops), (cuda_step, cuda_ops) = cpu_and_cuda_language_model()
    assert cuda_step.device_type == "cuda"
    # The matrix products of forward and backward: the same, with the same sizes, on both devices, but attention's:
    # CUDA runs memory-efficient attention (one op forward, one backward, as on a GPU: replay/cuda_kernels.py) where
    # the CPU's math path runs two bmm forward and four backward, per layer.
    attention = {"bmm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"}
    cuda_products = [op for op in cuda_ops if op[0] in MATMULS and op[0] not in attention]
    assert cuda_products == [op for op in cpu_ops if op[0] in MATMULS and op[0] not in attention]
    assert len(cuda_products) == 29 and names(cpu_ops).count("bmm") == 12 and "bmm" not in names(cuda_ops)
    assert names(cuda_ops).count("_scaled_dot_product_efficient_attention") == 2
    assert names(cuda_ops).count("_scaled_dot_product_efficient_attention_backward") == 2
    # Dropout: CUDA's fused kernel keeps a one-byte mask; the CPU's bernoulli keeps a four-byte float one. The CPU's
    # math attention draws one more per layer, of the attention weights (4 x 2 x 16 x 16 x 4 bytes), which CUDA's
    # attention kernel draws inside.
    cuda_dropouts = [sizes for name, sizes, _ in cuda_ops if name == "native_dropout"]
    cpu_masks = [sizes[0] for name, sizes, _ in cpu_ops if name == "bernoulli_"]
    assert len(cuda_dropouts) == 5 and len(cpu_masks) == 7 and cpu_masks.count(4 * 2 * 16 * 16 * 4) == 2
    assert [mask for _, mask in cuda_dropouts] == [mask // 4 for mask in cpu_masks if mask != 4 * 2 * 16 * 16 * 4]
    assert names(cuda_ops).count("native_dropout_backward") == 5
    # AdamW: the foreach path on CUDA, the for-loop on the CPU.
    assert "_foreach_lerp_" in names(cuda_ops) and "_foreach_lerp_" not in names(cpu_ops)
    assert names(cpu_ops).count("lerp_") == len(list(language_model().parameters())) == 28
    assert peaks(cuda_step) == {
        "forward": 2483712 + WORKSPACES,
        "backward": 2738176 + WORKSPACES,
        "optimizer": 4613632 + WORKSPACES,
    }
    assert peaks(cpu_step) == {"forward": 2548904, "backward": 2771080, "optimizer": 4455024}


@pytest.mark.fake_cuda
@on_fake_cuda
@pytest.mark.parametrize(
    ("options", "expected"),
    [({}, "_foreach_lerp_"), ({"foreach": False}, "lerp_"), ({"fused": True}, "_fused_adamw_")],
    ids=["default", "for-loop", "fused"],
)
def test_optimizer_path_on_fake_cuda(options: dict[str, bool], expected: str) -> None:
    """The path torch takes for real CUDA parameters; a fake parameter alone would take the for-loop."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), **options)  # type: ignore[arg-type]
    batch = torch.randn(5, 8)
    recorder = OpRecorder()
    with recorder:
        step = replay(model, [optimizer], batch, step_function=lambda m, x: m(x).sum(), placement=CUDA, warm_up=True)
    assert isinstance(step, ReplayedStep), step
    steps = [name for name, _, _ in recorder.ops if name in ("_foreach_lerp_", "lerp_", "_fused_adamw_")]
    assert set(steps) == {expected}
    assert len(steps) == (2 if expected != "lerp_" else 8)  # two steps (warm-up, counted); four parameters


@pytest.mark.fake_cuda
@on_fake_cuda
def test_mixed_precision_on_fake_cuda() -> None:
    """``torch.autocast("cuda")`` turns itself off without a device (with a warning): the replay's autocast does not."""
    module, batch = language_model(), tokens()
    step, ops = recorded_replay(module, batch, placement=CUDA, precision="bf16-mixed")
    products = [dtypes for name, _, dtypes in ops if name == "addmm"]
    assert len(products) == 8 and all(dtypes == (torch.bfloat16,) for dtypes in products)
    (_, _), (full_step, _) = cpu_and_cuda_language_model()
    assert peaks(step)["forward"] > peaks(full_step)["forward"]  # bf16 copies of the weights beside them
    assert not torch.is_autocast_enabled("cuda")


@pytest.mark.fake_cuda
@on_fake_cuda
def test_predict_on_fake_cuda() -> None:
    prediction = predict(language_model(), tokens(), device_type="cuda", budget_seconds=120.0)
    assert prediction.skipped is None and prediction.step is not None
    assert prediction.step.device_type == "cuda"
    assert FAKE_CUDA_NOTE in prediction.notes
    assert {phase.value: peak.peak_bytes for phase, peak in prediction.step.phases.items()} == {
        "forward": 5251584 + WORKSPACES,
        "backward": 4583424 + WORKSPACES,
        "optimizer": 4613632 + WORKSPACES,
    }
    assert prediction.fit and all(row.max_batch_size > 4 for row in prediction.fit)


@pytest.mark.fake_cuda
@on_fake_cuda
def test_checkpointed_gpt2_on_fake_cuda() -> None:
    """The replay's checkpointing variant on fake CUDA: recomputed once, with the step's optimizer peak unchanged."""
    predictor = Predictor(language_model(), None, tokens(), placement=CUDA)
    predictor.replay(None)  # the baseline first: what each unit is called with, which a plan is checked against
    recorder = OpRecorder()
    with recorder:
        step = predictor.replay(CheckpointChange(GPT2_BLOCKS))
    assert isinstance(step, ReplayedStep), step
    ops = recorder.ops
    assert names(ops).count("addmm") == 16
    # Recomputing the blocks runs their addmm on autograd's thread, which takes its own cuBLASLt workspace (1 MiB).
    recomputing = WORKSPACES + 1024**2
    assert peaks(step) == {
        "forward": 1574400 + recomputing,
        "backward": 2358784 + recomputing,
        "optimizer": 4613632 + recomputing,
    }
    (_, _), (full_step, _) = cpu_and_cuda_language_model()
    # The tensors alone (this model's saving is under the recomputation's extra workspace):
    assert peaks(step)["forward"] - recomputing < peaks(full_step)["forward"] - WORKSPACES
    assert peaks(step)["optimizer"] - recomputing == peaks(full_step)["optimizer"] - WORKSPACES


@pytest.mark.fake_cuda
@on_fake_cuda
def test_trained_cpu_model_replayed_on_fake_cuda() -> None:
    """A model trained on the CPU, with gradients and AdamW's state, replayed with ``placement=cuda``.

    Before the placement fix a fake parameter moved by ``.data`` still said ``cpu`` and the step failed with
    ``FakeTensorDeviceMismatchError``; its gradients and state follow it now (AdamW's ``step`` stays on the CPU).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(5, 8)
    model(batch).sum().backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    steps = {
        device: replay(model, [optimizer], batch, step_function=lambda m, x: m(x).sum(), placement=device)
        for device in (None, CUDA)
    }
    cpu_step, cuda_step = steps[None], steps[CUDA]
    assert isinstance(cpu_step, ReplayedStep) and isinstance(cuda_step, ReplayedStep)
    cpu_forward, cuda_forward = cpu_step.phases[Phase.FORWARD].breakdown, cuda_step.phases[Phase.FORWARD].breakdown
    assert (
        (cuda_forward.parameters, cuda_forward.gradients)
        == (cpu_forward.parameters, cpu_forward.gradients)
        == (
            848,
            848,
        )
    )
    assert cpu_forward.optimizer_state == 1712 and cuda_forward.optimizer_state == 1712 - 4 * 4  # steps on the CPU
    assert peaks(cuda_step)["forward"] == 10240 + WORKSPACES and peaks(cpu_step)["forward"] == 4208
    state = optimizer.state[model[0].weight]
    assert model[0].weight.device.type == state["exp_avg"].device.type == "cpu"  # the real ones untouched

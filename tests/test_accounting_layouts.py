"""Attribution of unusual tensors: sparse layouts, tensors without storage, lazy parameters, and recomputation under
activation checkpointing. Counts are exact where derivable by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import FLOAT32, Classifier, dataset_for, loader, saved_storage_bytes, trainer
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor, VramSession
from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.measure.storages import StorageBytes, add_storage, tensor_storages
from lightning_vram.records import Phase

INT64 = 8
CPU = torch.device("cpu")


def failed_parts(report: Report) -> list[str]:
    return [note.what for note in report.not_measured if "failed" in note.reason]


# ------------------------------------------------------------------------------------------------ sparse gradients

VOCABULARY, WIDTH, TOKENS = 100, 8, 5


class SparseEmbeddingClassifier(pl.LightningModule):
    """Embedding(100, 8, sparse=True), mean over tokens, Linear(8, 10).

    Manual optimization: SparseAdam on the embedding and Adam on the head, gradients zeroed before backward.
    Automatic optimization: one SGD, which takes sparse gradients.
    """

    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH, sparse=True)
        self.head = nn.Linear(WIDTH, 10)
        self.automatic_optimization = not manual

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(dim=1))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens), targets)
        if self.automatic_optimization:
            return loss
        sparse, dense = self.optimizers()  # type: ignore[misc]
        sparse.zero_grad()
        dense.zero_grad()
        self.manual_backward(loss)
        sparse.step()
        dense.step()
        return None

    def configure_optimizers(self) -> Any:
        if self.automatic_optimization:
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return [torch.optim.SparseAdam(self.embedding.parameters()), torch.optim.Adam(self.head.parameters())]


def token_batches(batch_size: int = 8) -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCABULARY, (4 * batch_size, TOKENS), generator=generator)
    return loader(TensorDataset(tokens, torch.randint(0, 10, (4 * batch_size,), generator=generator)), batch_size)


@pytest.mark.parametrize("manual", [True, False], ids=["manual", "automatic"])
def test_sparse_gradients_count_their_indices_and_values(tmp_path: Path, manual: bool) -> None:
    module = SparseEmbeddingClassifier(manual)
    # From step 0 on: the first sampled step starts without any gradient, as Lightning's defaults do.
    monitor = VramMonitor(attribution_start_step=0, attribution_every_n_steps=1, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(module, token_batches())

    report = monitor.report
    assert report is not None
    assert failed_parts(report) == []
    embedding_bytes, head_bytes = VOCABULARY * WIDTH * FLOAT32, (WIDTH * 10 + 10) * FLOAT32
    # Embedding's sparse gradient keeps one row per looked-up token, uncoalesced: 8 x 5 = 40 rows of 8 values
    # and a 1 x 40 int64 index tensor. The dense head's gradient is the size of the head.
    rows = 8 * TOKENS
    sparse_gradient_bytes = rows * INT64 + rows * WIDTH * FLOAT32
    assert sparse_gradient_bytes == 1600
    optimizer = report.phases[Phase.OPTIMIZER].breakdown
    forward = report.phases[Phase.FORWARD].breakdown
    assert optimizer is not None and forward is not None
    assert optimizer.parameters == embedding_bytes + head_bytes
    assert optimizer.gradients == sparse_gradient_bytes + head_bytes
    # Both modes zero gradients after the forward pass: the last step's sparse gradient is alive through it.
    assert forward.gradients == sparse_gradient_bytes + head_bytes
    # SparseAdam: two dense moments of the embedding (its step is a Python int); Adam: two moments and a step
    # tensor per head tensor. SGD without momentum: none.
    state = 2 * embedding_bytes + 2 * head_bytes + 2 * FLOAT32 if manual else 0
    assert optimizer.optimizer_state == state
    tokens, targets = next(iter(token_batches()))
    expected = saved_storage_bytes(
        lambda: nn.functional.cross_entropy(module(tokens), targets), exclude=list(module.parameters())
    )
    assert forward.activations == expected


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")  # torch's own notice
def test_sparse_layouts_count_every_component_storage_once() -> None:
    # The 4 x 4 matrix [[0, 1, 0, 2], [3, 0, 0, 0], [0, 0, 0, 0], [0, 4, 5, 0]] in each layout, built from its parts.
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    with torch.sparse.check_sparse_tensor_invariants():
        layouts = {
            "coo": (torch.sparse_coo_tensor(torch.tensor([[0, 0, 1, 3, 3], [1, 3, 0, 1, 2]]), values, (4, 4)), 10, 5),
            "csr": (
                torch.sparse_csr_tensor(torch.tensor([0, 2, 3, 3, 5]), torch.tensor([1, 3, 0, 1, 2]), values),
                10,
                5,
            ),
            "csc": (
                torch.sparse_csc_tensor(torch.tensor([0, 1, 3, 4, 5]), torch.tensor([1, 0, 3, 3, 0]), values),
                10,
                5,
            ),
            # 2 x 2 blocks, all four non-zero: 3 row offsets, 4 column indices, 4 blocks of 4 values.
            "bsr": (
                torch.sparse_bsr_tensor(torch.tensor([0, 2, 4]), torch.tensor([0, 1, 0, 1]), torch.ones(4, 2, 2)),
                3 + 4,
                4 * 2 * 2,
            ),
        }
        # Components that share one storage (indices sliced from one buffer) count it once, whole.
        buffer = torch.tensor([0, 2, 3, 3, 5, 1, 3, 0, 1, 2])
        shared = torch.sparse_csr_tensor(buffer[:5], buffer[5:], values, (4, 4))
    for name, (tensor, index_count, value_count) in layouts.items():
        storages = StorageBytes()
        add_storage(storages, tensor, CPU)
        assert (name, sum(storages.values())) == (name, index_count * INT64 + value_count * FLOAT32)
        assert storages.uncounted == set()
    storages = StorageBytes()
    add_storage(storages, shared, CPU)
    assert sum(storages.values()) == 10 * INT64 + 5 * FLOAT32
    assert tensor_storages(nn.parameter.UninitializedParameter()) == []


class GraphConvolution(nn.Module):
    """A graph convolution: features (nodes x 8) through Linear(8, 4), mixed by a sparse adjacency matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4, bias=False)

    def forward(self, features: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adjacency, self.linear(features))


def test_a_sparse_input_saved_for_backward_counts_its_indices_and_values() -> None:
    network = GraphConvolution()
    nodes, edges = 10, 20
    indices = torch.stack([torch.arange(nodes).repeat(2), torch.randint(0, nodes, (edges,))])
    with torch.sparse.check_sparse_tensor_invariants():
        adjacency = torch.sparse_coo_tensor(indices, torch.rand(edges), (nodes, nodes))
    features = torch.randn(nodes, 8)
    attributor = StepAttributor(0, network, [], CPU)
    attributor.begin_forward()
    loss = network(features, adjacency).sum()
    attributor.before_backward()
    loss.backward()
    attribution = attributor.finish()
    assert attributor.error is None
    adjacency_bytes = 2 * edges * INT64 + edges * FLOAT32
    feature_bytes = nodes * 8 * FLOAT32
    # The Linear saves the features; sparse.mm saves the adjacency (its gradient is adjacency^T @ upstream).
    assert attribution.phases[Phase.FORWARD].activations == feature_bytes + adjacency_bytes
    root = attribution.modules[0]
    assert (root.name, root.input_bytes, root.activation_bytes) == (
        "(root)",
        feature_bytes + adjacency_bytes,
        adjacency_bytes,
    )


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no MKL-DNN tensors")
def test_tensors_without_storage_are_skipped_and_the_report_says_which(tmp_path: Path) -> None:
    network = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    parameter = next(network.parameters())
    optimizer.state[parameter]["opaque_buffer"] = torch.zeros(4, 4).to_mkldnn()  # an opaque tensor, no storage
    session = VramSession(log_dir=None, attribution_start_step=0, console_summary=False)
    session.start(network, [optimizer])
    for _ in range(2):
        session.batch_start()
        loss = network(torch.randn(2, 4)).sum()
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        session.batch_end()
    report = session.finish()
    assert report is not None
    assert failed_parts(report) == []
    [note] = [note for note in report.not_measured if "mkldnn" in note.what]
    assert note.what == "Tensor (torch._mkldnn) tensors"
    assert "no storage" in note.reason
    optimizer_phase = report.phases[Phase.OPTIMIZER].breakdown
    assert optimizer_phase is not None
    assert optimizer_phase.parameters == (16 + 4) * FLOAT32
    assert optimizer_phase.optimizer_state == 0  # the opaque buffer is left out, everything else still counted


# ------------------------------------------------------------------------------------------------ lazy parameters


def test_lazy_parameters_count_once_materialised(tmp_path: Path) -> None:
    torch.manual_seed(0)
    network = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 10))
    module = Classifier(network)
    monitor = VramMonitor(attribution_start_step=0, attribution_every_n_steps=2, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(module, loader(dataset_for("linear")))

    report = monitor.report
    assert report is not None
    assert failed_parts(report) == []
    forward = report.phases[Phase.FORWARD]
    assert forward.step == 2
    assert forward.breakdown is not None
    parameter_bytes = (32 * 16 + 16 + 16 * 10 + 10) * FLOAT32
    assert forward.breakdown.parameters == parameter_bytes
    assert forward.breakdown.gradients == parameter_bytes
    inputs, targets = next(iter(loader(dataset_for("linear"))))
    expected = saved_storage_bytes(
        lambda: module.training_step((inputs, targets), 0), exclude=list(module.parameters())
    )
    assert forward.breakdown.activations == expected


def test_a_lazy_layer_materialised_during_a_sampled_step_is_a_parameter_not_an_activation() -> None:
    network = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 10))
    attributor = StepAttributor(0, network, [], CPU)
    attributor.begin_forward()
    loss = network(torch.randn(8, 32)).sum()
    attributor.before_backward()
    loss.backward()
    forward = attributor.finish().phases[Phase.FORWARD]
    assert forward.parameters == (32 * 16 + 16 + 16 * 10 + 10) * FLOAT32
    # The first Linear saves its input (8 x 32) and its weight (a parameter); the ReLU saves its output (8 x 16),
    # which the second Linear saves again: counted once. The sum saves nothing.
    assert forward.activations == (8 * 32 + 8 * 16) * FLOAT32


def test_a_run_failing_before_the_lazy_layer_runs_still_gets_its_report(tmp_path: Path) -> None:
    class FailsFirst(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise KeyError("the user's own error")

    monitor = VramMonitor(attribution_start_step=0, console_summary=False)
    with pytest.raises(KeyError, match="the user's own error"):
        trainer(tmp_path, [monitor]).fit(FailsFirst(nn.Sequential(nn.LazyLinear(10))), loader(dataset_for("linear")))
    assert monitor.report is not None
    assert failed_parts(monitor.report) == []


# ------------------------------------------------------------------------------------------------ recomputation


class ParameterFreeCheckpoint(nn.Module):
    """Linear(16, 16), then Sigmoid and Tanh under checkpointing, summed."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Sigmoid(), nn.Tanh())
        self.reentrant = reentrant

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, self.linear(inputs), use_reentrant=self.reentrant).sum()  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_recomputation_under_checkpointing_counts_in_backward_by_hand(reentrant: bool) -> None:
    network = ParameterFreeCheckpoint(reentrant)
    attributor = StepAttributor(0, network, [], CPU)
    attributor.begin_forward()
    loss = network(torch.randn(64, 16))
    attributor.before_backward()
    loss.backward()
    attribution = attributor.finish()
    phases = attribution.phases
    tensor = 64 * 16 * FLOAT32
    # Forward holds the Linear's input and the checkpoint's input (the Linear's output); the checkpointed
    # sigmoid and tanh save nothing until backward.
    assert phases[Phase.FORWARD].activations == 2 * tensor
    # Backward recomputes the block, which saves the sigmoid's and the tanh's outputs, while both inputs are held;
    # no gradient exists yet (the Linear's come last).
    assert phases[Phase.BACKWARD].activations == 4 * tensor
    assert phases[Phase.BACKWARD].gradients == 0
    # The module table is the forward pass's: what the recomputation saves in backward is not charged to it.
    saved = {profile.name: profile.activation_bytes for profile in attribution.modules}
    assert saved == {"(root)": tensor, "linear": tensor, "block": 0, "block.0": 0, "block.1": 0}
    assert attribution.recomputed_units == (("block",),)  # its children re-ran inside it


class CheckpointedBlocks(nn.Module):
    """Blocks each run under non-reentrant checkpointing, then a Linear head."""

    def __init__(self, blocks: list[nn.Module], width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = checkpoint(block, inputs, use_reentrant=False)
        return self.head(inputs if inputs.dim() == 2 else inputs.mean(dim=1))  # type: ignore[no-any-return]


def checkpointed_run(tmp_path: Path, network: CheckpointedBlocks, inputs: torch.Tensor) -> Report:
    targets = torch.randint(0, 10, (4 * inputs.shape[0],), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(inputs.repeat(4, *([1] * (inputs.dim() - 1))), targets)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=2).fit(Classifier(network), loader(data, inputs.shape[0]))
    assert monitor.report is not None
    return monitor.report


def parameter_bytes(*modules: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for module in modules for p in module.parameters())


def test_recomputed_mlp_blocks_count_in_backward(tmp_path: Path) -> None:
    batch, width, hidden, depth = 256, 16, 64, 3
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)) for _ in range(depth)
    ]
    network = CheckpointedBlocks(blocks, width)
    report = checkpointed_run(tmp_path, network, torch.randn(batch, width))
    backward = report.phases[Phase.BACKWARD].breakdown
    assert backward is not None
    # The peak comes once the last block is recomputed and its second Linear has its gradients: every block's input
    # is held by its checkpoint, and the recomputation holds the ReLU's output (saved by the ReLU and the Linear).
    assert backward.activations == depth * batch * width * FLOAT32 + batch * hidden * FLOAT32
    assert backward.gradients == parameter_bytes(network.head, blocks[-1][2])
    # One recomputation per block, last block first.
    assert report.recomputed_units == (("network.blocks.2",), ("network.blocks.1",), ("network.blocks.0",))


def test_recomputed_transformer_layers_count_in_backward(tmp_path: Path) -> None:
    batch, tokens, width, depth = 16, 6, 16, 3
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        for _ in range(depth)
    ]
    network = CheckpointedBlocks(layers, width)
    inputs = torch.randn(batch, tokens, width)
    report = checkpointed_run(tmp_path, network, inputs)
    backward = report.phases[Phase.BACKWARD].breakdown
    assert backward is not None
    # What one layer saves beyond its input, counted independently on the layer run without checkpointing.
    layer_input = torch.randn(batch, tokens, width, requires_grad=True)
    per_layer = saved_storage_bytes(lambda: layers[0](layer_input), exclude=[layer_input, *layers[0].parameters()])
    assert per_layer > 0
    # The peak comes when the first layer is recomputed: its input is held, the other layers' gradients exist.
    assert backward.activations == batch * tokens * width * FLOAT32 + per_layer
    assert backward.gradients == parameter_bytes(network.head, *layers[1:])

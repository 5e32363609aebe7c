"""FSDP2's usual policy on a model whose blocks hold ``nn.ModuleList`` s of their own (T5: ``block[i].layer``).

A new user's ``lightning-vram plan`` of a T5 model left out every FSDP2 row: "the step failed under fake tensors:
TypeError: Invariant encountered: value was None when it should not be". The policy took each entry of every
``ModuleList`` in ``modules()`` order, so each T5 block was sharded before the layers inside it, and ``fully_shard``
then met parameters already sharded (DTensors) in the inner layers. The units are now the outermost lists' entries
(a list inside a block belongs to the block, as ``for block in model.encoder.block: fully_shard(block)`` has it).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers_models import VOCAB, FineTuned

from lightning_vram.plan import fsdp2_units_note, plan
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import predict_rank
from lightning_vram.prediction.strategies.fsdp2 import shard_units, usual_policy_code
from lightning_vram.records import Phase, RankStep, ReplaySkipped, StrategySpec

LENGTH = 16

# torch warns that a unit returns a view (a T5 block; a Linear on a batch of sequences): an in-place op on it would
# skip FSDP2's pre-backward hook, and these steps make none. A real run warns too; the strict filters here would
# make the warning the replay's failure.
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")


def t5() -> FineTuned:
    torch.manual_seed(0)
    return FineTuned("t5", LENGTH)


def test_the_usual_policy_shards_each_t5_block_whole_then_the_root() -> None:
    module = t5()
    names = {id(child): name for name, child in module.named_modules()}
    units = [names[id(unit)] for unit in shard_units(module)]
    blocks = [f"model.{stack}.block.{index}" for stack in ("encoder", "decoder") for index in (0, 1)]
    assert units == [*blocks, ""]


def test_a_list_of_lists_is_looked_into() -> None:
    inner = [nn.Linear(2, 2), nn.Linear(2, 2)]
    module = nn.Sequential(nn.ModuleList([nn.ModuleList(inner)]))
    assert shard_units(module) == [*inner, module]


@pytest.mark.replay
def test_a_t5_rank_is_predicted_under_fsdp2() -> None:
    module = t5()
    tokens = torch.randint(0, VOCAB, (4, LENGTH))
    predictor = Predictor(module, None, (tokens, torch.ones_like(tokens)))
    rank = predict_rank(predictor, StrategySpec("fsdp2", 2))
    assert isinstance(rank, RankStep), rank  # was ReplaySkipped: "Invariant encountered: value was None"
    whole = sum(parameter.numel() * parameter.element_size() for parameter in module.parameters())
    optimizer = rank.phases[Phase.OPTIMIZER].breakdown
    assert optimizer is not None
    # this rank's shards: half of every parameter, dim 0 padded to 2 (a few rows at most)
    assert whole / 2 <= optimizer.parameters <= whole / 2 + 64 * 4 * 16
    gather = rank.lines[0]
    assert gather.label.startswith("FSDP2 all-gather buffer (largest unit: ")
    assert not dist.is_initialized()


class Wrapped(pl.LightningModule):
    """A model in ``self.model``, trained by calling it from ``training_step`` (as transformers models are)."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root
        self.model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.model[1], mesh=mesh)
        fully_shard(self if self.root == "self" else self.model, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens)
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


@pytest.mark.replay
def test_a_step_that_skips_its_sharded_root_s_forward_fails_as_under_lightning() -> None:
    # Under ModelParallelStrategy Lightning calls training_step directly: after fully_shard(self), a step calling
    # self.model(...) never runs the root's pre-forward hook, and the embedding meets its sharded weight. On 2 gloo
    # ranks: "RuntimeError: aten.embedding.default got mixed torch.Tensor and DTensor". The plan said it fit.
    batch = (torch.randint(0, 64, (4, 8)),)
    broken = predict_rank(Predictor(Wrapped("self"), None, batch), StrategySpec("fsdp2", 2))
    assert isinstance(broken, ReplaySkipped), broken  # was a RankStep: the replay ran the step through forward
    assert "mixed torch.Tensor and DTensor" in broken.reason
    right = predict_rank(Predictor(Wrapped("model"), None, batch), StrategySpec("fsdp2", 2))
    assert isinstance(right, RankStep), right


def unit_names(module: nn.Module) -> list[str]:
    names = {id(child): name for name, child in module.named_modules()}
    return [names[id(unit)] for unit in shard_units(module)]


def test_a_model_without_a_list_of_blocks_shards_its_blocks_then_the_root() -> None:
    # Before, the usual policy found no nn.ModuleList and sharded the root alone: every parameter gathered for the
    # whole step (forward's parameters 813,756 B per rank on 2 gloo ranks, where the blocks sharded hold 404,116).
    from rank_prediction_train import Blocks, ResNet

    assert unit_names(ResNet()) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", ""]
    blocks = ["model.stem", "model.block1", "model.block2", "model.stage.0", "model.stage.1", "model.head"]
    assert unit_names(Blocks()) == [*blocks, ""]
    sequential = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert unit_names(sequential) == ["0", "2", "4", ""]
    assert unit_names(nn.Sequential(nn.Linear(4, 8), nn.ReLU())) == [""]  # no blocks: the root alone


def test_the_printed_code_shards_what_the_rows_shard() -> None:
    from rank_prediction_train import Blocks, QuickstartCNN

    assert usual_policy_code(QuickstartCNN()) is None  # its own configure_model is replayed
    code = usual_policy_code(Blocks())
    assert code == (
        "def configure_model(self): from torch.distributed.fsdp import fully_shard;"
        ' mesh = self.device_mesh["data_parallel"]; [fully_shard(unit, mesh=mesh) for unit in'
        ' (self.get_submodule("model.stem"), self.get_submodule("model.block1"), self.get_submodule("model.block2"),'
        ' self.get_submodule("model.head"), *self.get_submodule("model.stage").children(),)];'
        " fully_shard(self.model, mesh=mesh)"
    )
    sharded: list[str] = []
    namespace: dict[str, object] = {"__builtins__": __builtins__}
    exec(code, namespace)
    module = Blocks()
    vars(module)["_device_mesh"] = {"data_parallel": "mesh"}
    names = {id(child): name for name, child in module.named_modules()}
    with pytest.MonkeyPatch.context() as patch:
        import torch.distributed.fsdp as fsdp

        patch.setattr(fsdp, "fully_shard", lambda unit, mesh: sharded.append(names[id(unit)]))
        namespace["configure_model"](module)  # type: ignore[operator]
    assert sorted(sharded[:-1]) == sorted(name for name in unit_names(module) if name) and sharded[-1] == "model"


class TwoParts(pl.LightningModule):
    """Its parameters in two children: the root the printed code shards is the module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)


def test_a_module_with_parameters_in_several_children_is_its_own_root() -> None:
    code = usual_policy_code(TwoParts())
    assert code is not None
    assert code.endswith("(*self.body.children(),)]; fully_shard(self, mesh=mesh)")
    note = fsdp2_units_note(TwoParts(), code)
    assert note.startswith("fsdp2 rows shard each of 2 blocks, then the root")
    assert note.endswith(
        f"{code}; the root is the module itself: its training_step must call self(...), its forward, for FSDP2 to"
        " gather the parameters outside the blocks (Lightning runs training_step, not forward)"
    )


@pytest.mark.replay
def test_a_plan_with_fsdp2_rows_prints_the_code_that_shards_as_they_do() -> None:
    from rank_prediction_train import Blocks, one_batch

    result = plan(
        Blocks(),
        one_batch("blocks"),
        gpus=["T4"],
        world_sizes=(2,),
        strategies=("fsdp2",),
        precisions=("32-true",),
        checkpointing=(False,),
    )
    assert [row.strategy for row in result.rows] == ["fsdp2"]
    notes = [note for note in result.notes if note.startswith("fsdp2 rows")]
    assert notes == [
        "fsdp2 rows shard each of 6 blocks, then the root (torch's fully_shard under Lightning's"
        f" ModelParallelStrategy). To train as predicted, in your LightningModule: {usual_policy_code(Blocks())}"
    ]


class TiedEmbeddings(pl.LightningModule):
    """Source and target embeddings sharing one weight (``tgt.weight = src.weight``), two blocks after them."""

    def __init__(self) -> None:
        super().__init__()
        self.src, self.tgt = nn.Embedding(64, 16), nn.Embedding(64, 16)
        self.tgt.weight = self.src.weight
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 64)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.src(source) + self.tgt(target)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(*batch)  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def test_siblings_sharing_a_parameter_are_no_units() -> None:
    # Before: ["src", "tgt", "body.0", "body.2", ""], and fully_shard refused tgt.weight ("shared with a parameter
    # already managed by another FSDP group"): no fsdp2 row, and the printed configure_model failed the same way
    assert unit_names(TiedEmbeddings()) == ["body.0", "body.2", ""]
    tied = nn.Linear(4, 4)
    entries = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])
    entries[1].weight = tied.weight  # an entry tied to a module outside the list
    assert unit_names(nn.Sequential(entries, tied)) == ["0.0", "0.2", ""]
    block = nn.Linear(4, 4)
    assert unit_names(nn.Sequential(block, nn.Linear(4, 4), block)) == ["0", "1", ""]  # one module twice: not tied


def test_a_list_holding_no_parameter_hides_no_blocks() -> None:
    # Before: an empty nn.ModuleList (or one of activations) made the policy look for lists only: [""], every
    # parameter in the root (on 2 gloo ranks, the printed code's backward peak 2,049,428 B where its blocks sharded
    # hold 1,572,700)
    layers = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model = nn.Sequential(layers, nn.ModuleList(), nn.ModuleList([nn.ReLU(), nn.GELU()]))
    assert unit_names(model) == ["0.0", "0.1", "0.3", ""]
    with_list = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.ModuleList([nn.ReLU()]))
    assert unit_names(with_list) == ["0.0", "0.1", ""]  # the activations are no units either


@pytest.mark.replay
def test_a_model_with_tied_sibling_embeddings_is_predicted_under_fsdp2() -> None:
    batch = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    rank = predict_rank(Predictor(TiedEmbeddings(), None, batch), StrategySpec("fsdp2", 2))
    assert isinstance(rank, RankStep), rank  # was ReplaySkipped: "... already managed by another FSDP group"


class PartsCalled(pl.LightningModule):
    """Its parameters all in ``self.model``, whose parts ``training_step`` calls one by one (never ``self.model``)."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.whole = whole
        self.model = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 64))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        if self.whole:
            logits = self.model(tokens)
        else:
            logits = self.model[3](self.model[2](self.model[1](self.model[0](tokens))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


@pytest.mark.replay
def test_the_usual_policy_is_replayed_as_the_printed_code_runs_under_lightning() -> None:
    # The printed configure_model shards the two Linears, then self.model; Lightning runs training_step directly, so
    # a step calling self.model's parts never gathers the embedding and the LayerNorm: on 2 gloo ranks "RuntimeError:
    # aten.embedding.default got mixed torch.Tensor and DTensor". The replay ran the step through the module's own
    # forward, the module its root, and predicted a RankStep: the plan said it fit.
    code = usual_policy_code(PartsCalled(whole=False))
    assert code is not None and code.endswith("fully_shard(self.model, mesh=mesh)")
    batch = (torch.randint(0, 64, (4, 8)),)
    broken = predict_rank(Predictor(PartsCalled(whole=False), None, batch), StrategySpec("fsdp2", 2))
    assert isinstance(broken, ReplaySkipped), broken  # was a RankStep
    assert broken.reason == (
        "fsdp2: training_step never calls self.model(...), the root the printed configure_model shards, so FSDP2"
        " never gathers its parameters outside the blocks (got mixed torch.Tensor and DTensor under"
        " ModelParallelStrategy too): call self.model(...) from training_step"
    )
    right = predict_rank(Predictor(PartsCalled(whole=True), None, batch), StrategySpec("fsdp2", 2))
    assert isinstance(right, RankStep), right
    assert right.lines[0].label.startswith("FSDP2 all-gather buffer (largest unit: ")

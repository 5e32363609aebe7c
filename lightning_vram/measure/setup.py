"""The training set-up the advice rules need, read from the model, its optimizers and its DataLoader.

Lightning-free: the callback fills in what its Trainer knows (precision, accumulation, strategy, world size); a
plain loop or a Fabric loop passes what it has, and the rest keeps its single-process default.

Reading the set-up runs none of the user's code: no module is called (a ``Dropout`` would draw from torch's
generator, a user's module may refuse a probe), no property or ``__getattr__`` is run, and a parametrized tensor
(``spectral_norm``, ``weight_norm``) is read through its originals, since reading it runs the parametrization
(spectral norm's power iteration rewrites its ``_u`` and ``_v`` buffers in training mode).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, IterableDataset

from lightning_vram.measure.deepspeed_zero import full_numel, parameter_bytes, wrapped_optimizer
from lightning_vram.measure.observations import stored_attribute
from lightning_vram.measure.storages import local_tensor
from lightning_vram.records import CheckpointSwitch, LinearLayer, TrainingLoop, TrainingSetup

FABRIC_MODULES = ("lightning.fabric.", "lightning_fabric.")
"""Where Fabric's wrappers (``fabric.setup``'s module and optimizers, ``setup_dataloaders``' loaders) are defined."""


def first_dataloader(loaders: Any) -> DataLoader[Any] | None:
    """The first DataLoader inside ``loaders`` (a DataLoader, or dicts, lists and tuples of them), or ``None``.

    Fabric's ``setup_dataloaders`` returns a wrapper that is no DataLoader: the one it wraps is read from it
    (:func:`_fabric_wrapped`), so that ``num_workers`` and ``pin_memory`` are known in a Fabric loop too.
    """
    if isinstance(loaders, DataLoader):
        return loaders
    wrapped = _fabric_wrapped(loaders)
    if wrapped is not None:
        return wrapped
    values = loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) else ()
    for value in values:
        found = first_dataloader(value)
        if found is not None:
            return found
    return None


def _fabric_wrapped(loader: Any) -> DataLoader[Any] | None:
    """The DataLoader inside Fabric's ``_FabricDataLoader`` (``fabric.setup_dataloaders``' result), else ``None``.

    Read from the wrapper's ``__dict__`` (its ``_dataloader``, as Lightning 2.6 keeps it), without running
    its code; a Fabric that keeps it elsewhere leaves the loader unread, as before.
    """
    if not type(loader).__module__.startswith(FABRIC_MODULES):
        return None
    attributes = getattr(loader, "__dict__", None)
    wrapped = attributes.get("_dataloader") if type(attributes) is dict else None
    return wrapped if isinstance(wrapped, DataLoader) else None


def fabric_unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside Fabric's ``_FabricModule`` (``fabric.setup``'s result), else ``model`` itself.

    Read through the wrapper's public ``module`` property (the module as the user built it, not a DDP or compiled
    wrapper around it): the report then names the user's layers (not ``_forward_module.encoder...``) and the replay
    runs the user's module (Fabric's own ``forward`` refuses a backward outside ``fabric.backward``).
    """
    if not type(model).__module__.startswith(FABRIC_MODULES):
        return model
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and inner is not model else model


def longest_sample(loader: DataLoader[Any] | None) -> int | None:
    """The longest sample ``loader`` yields (elements along the batch's length), where it tells; else ``None``.

    Where its sampler lists every sample's length (transformers' ``LengthGroupedSampler`` keeps them in
    ``lengths``), the longest; where its collator pads every batch to its ``max_length``, that one; both: the larger.
    Read from the objects' ``__dict__``, without running their code.
    """
    known = [length for length in (_sampler_longest(loader), collator_max_length(loader)) if length is not None]
    return max(known) if known else None


def _sampler_longest(loader: DataLoader[Any] | None) -> int | None:
    """The longest of the sampler's ``lengths`` (a list of ints), or ``None`` where it has none."""
    attributes = getattr(getattr(loader, "sampler", None), "__dict__", None)
    lengths = attributes.get("lengths") if type(attributes) is dict else None
    if type(lengths) is not list or not lengths or not all(type(length) is int for length in lengths):
        return None
    longest: int = max(lengths)
    return longest


def collator_max_length(loader: DataLoader[Any] | None) -> int | None:
    """The ``max_length`` (tokens) ``loader``'s collator pads every batch to, or ``None`` where it does not.

    transformers' ``DataCollatorWithPadding``, ``DataCollatorForSeq2Seq`` and ``DataCollatorForTokenClassification``
    keep ``max_length`` and ``padding`` as attributes: an int ``max_length`` counts where ``padding`` is
    ``"max_length"`` (a str or transformers' ``PaddingStrategy.MAX_LENGTH``, a str enum); with ``padding=True``
    (``"longest"``) a batch is only as long as its longest sample. Read as stored (``inspect.getattr_static``) and
    compared with str's own comparison, without running the collator's code.
    """
    collator = inspect.getattr_static(loader, "collate_fn", None) if loader is not None else None
    length, padding = stored_attribute(collator, "max_length"), stored_attribute(collator, "padding")
    if type(length) is not int or length < 1 or not isinstance(padding, str):
        return None
    return length if str.__eq__(padding, "max_length") else None


def cpu_cores() -> int:
    """Cores this process may run on (its affinity where the platform tells), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _parameter_key(parameter: Tensor) -> int:
    """What identifies a parameter's memory: its (local shard's) storage address, or the object where it has none.

    A DTensor (FSDP2) is identified by its local shard; ZeRO-3 and uninitialised (lazy) parameters have no storage.
    """
    if is_lazy(parameter):  # uninitialised (a lazy module before its first forward): no storage yet
        return id(parameter)
    address = local_tensor(parameter).untyped_storage().data_ptr()
    return address if address else id(parameter)


def _whole_bytes(parameter: Tensor) -> int:
    if is_lazy(parameter):  # uninitialised: no size yet
        return 0
    return full_numel(parameter) * parameter.element_size()


def tensors_behind(module: nn.Module, name: str) -> list[Tensor]:
    """The parameters holding ``module``'s tensor ``name``, found without computing it.

    Its own parameter; for a parametrized tensor the originals its parametrization computes it from
    (``original``, or ``original0``, ``original1``... where it keeps several), which are what training updates.

    >>> from torch.nn.utils.parametrizations import weight_norm
    >>> [tuple(tensor.shape) for tensor in tensors_behind(weight_norm(nn.Linear(3, 2)), "weight")]  # g, then v
    [(2, 1), (2, 3)]
    """
    if parametrize.is_parametrized(module, name):
        originals = cast(nn.ModuleDict, module.parametrizations)[name]
        return [parameter for _, parameter in originals.named_parameters(recurse=False)]
    own = dict(module.named_parameters(recurse=False)).get(name)
    return [own] if own is not None else []


def linear_layers(module: nn.Module) -> tuple[LinearLayer, ...]:
    """Every ``nn.Linear`` of ``module`` with the bytes of the parameters it owns alone.

    A parameter that another module holds too (a language model's ``lm_head`` tied to its embedding) is not
    the Linear's own: it counts once, with the module it is tied to, and the Linear's own bytes exclude it.
    A parametrized weight counts the bytes of its originals (``tensors_behind``).

    >>> embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    >>> head.weight = embedding.weight
    >>> [(layer.name, layer.weight_bytes) for layer in linear_layers(nn.ModuleDict({"wte": embedding, "head": head}))]
    [('head', 0)]
    """
    owners = Counter(
        _parameter_key(parameter)
        for child in module.modules(remove_duplicate=False)
        for parameter in child.parameters(recurse=False)
    )

    def own_bytes(child: nn.Module, name: str) -> int:
        return sum(
            _whole_bytes(parameter)
            for parameter in tensors_behind(child, name)
            if owners[_parameter_key(parameter)] == 1
        )

    layers = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear):
            continue
        in_features, out_features = stored_attribute(child, "in_features"), stored_attribute(child, "out_features")
        if isinstance(in_features, int) and isinstance(out_features, int):
            weight_bytes = own_bytes(child, "weight")
            total = weight_bytes + own_bytes(child, "bias")
            layers.append(LinearLayer(name, in_features, out_features, total, weight_bytes))
    return tuple(layers)


@dataclass(frozen=True)
class ResultOnly:
    """When a torch activation's inplace variant saves only its result for backward: always, or within one setting.

    ``setting``: the constructor argument it depends on, as the module stores it (``None``: always); the value must
    be above ``bound`` (or equal to it, with ``bound_included``).
    """

    setting: str | None = None
    bound: float = 0.0
    bound_included: bool = True

    def holds(self, module: nn.Module) -> bool:
        """Whether ``module``'s stored setting is in range (``False`` where it stores no plain number)."""
        if self.setting is None:
            return True
        value = stored_attribute(module, self.setting)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        return value >= self.bound if self.bound_included else value > self.bound


RESULT_ONLY_INPLACE: dict[type[nn.Module], ResultOnly] = {
    nn.ReLU: ResultOnly(),
    nn.SELU: ResultOnly(),
    nn.LeakyReLU: ResultOnly("negative_slope"),  # a negative slope: backward refuses the inplace variant
    nn.ELU: ResultOnly("alpha"),  # a negative alpha: backward refuses the inplace variant
    nn.CELU: ResultOnly("alpha", bound_included=False),  # alpha 0 divides by zero
}
"""Torch's activation classes whose inplace variant computes its gradient from its result alone, and when.

Checked against torch by the tests, which run each op on a throwaway tensor and watch what autograd saves. The
others' inplace variants keep a copy of the input they overwrite, or refuse backward (``Hardtanh``, ``ReLU6``,
``SiLU``, ``Mish``, ``Threshold``, ``RReLU``...), and dropout is no activation.
"""


def inplace_keeps_result(module: nn.Module) -> bool:
    """Whether out-of-place activation ``module``'s inplace variant would save only its result for backward.

    Inplace, its input and output then become one saved tensor. Decided from the module's type and the settings
    torch's constructor stored (``RESULT_ONLY_INPLACE``), never by running it: any other class, subclasses of
    these included (their ``forward`` may differ), is unknown and answers ``False`` (nothing to advise).

    >>> [inplace_keeps_result(module) for module in (nn.LeakyReLU(), nn.LeakyReLU(-0.1), nn.SiLU(), nn.Linear(2, 2))]
    [True, False, False, False]
    """
    rule = RESULT_ONLY_INPLACE.get(type(module))
    return rule is not None and stored_attribute(module, "inplace") is False and rule.holds(module)


ATTENTION_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
"""torch's own attention modules; other libraries' name their class ``...Attention``."""
MIN_VOCABULARY = 256
"""The fewest tokens an embedding and head must cover to read as a language model's (a byte-level vocabulary):
fewer look like a classifier's class embedding."""


def language_model(module: nn.Module) -> str | None:
    """Why ``module`` looks like a transformer or a language model, or ``None`` when nothing in it says so.

    Read from classes and sizes only (no module is called): a ``transformers`` model, attention modules, or an
    embedding with a head as wide as its vocabulary.

    >>> language_model(nn.Sequential(nn.Embedding(1000, 8), nn.Linear(8, 1000)))
    'an embedding and a head over its 1000 tokens (1)'
    >>> language_model(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))) is None  # 10 classes
    True
    """
    children = [(name, child) for name, child in module.named_modules()]
    for _, child in children:
        if type(child).__module__.startswith("transformers."):
            return f"a transformers model ({type(child).__name__})"
    for _, child in children:
        if isinstance(child, ATTENTION_MODULES) or type(child).__name__.endswith("Attention"):
            return f"attention modules ({type(child).__name__})"
    vocabularies = {child.num_embeddings for _, child in children if isinstance(child, nn.Embedding)}
    for name, child in children:
        if isinstance(child, nn.Linear) and child.out_features in vocabularies and child.out_features >= MIN_VOCABULARY:
            return f"an embedding and a head over its {child.out_features} tokens ({name})"
    return None


def user_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's optimizer inside the wrappers around it (Fabric's, DeepSpeed's ZeRO optimizer)."""
    inner = wrapped_optimizer(optimizer)
    nested = getattr(inner, "optimizer", None)  # Fabric's wrapper exposes the optimizer it wraps here
    while isinstance(nested, torch.optim.Optimizer) and nested is not inner:
        inner, nested = nested, getattr(nested, "optimizer", None)
    return inner


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The class name of the user's optimizer inside the wrappers around it.

    >>> optimizer_name(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    'SGD'
    """
    return type(user_optimizer(optimizer)).__name__


def _is_a(module: nn.Module, kind: type) -> bool:
    """``isinstance`` as a plain bool (a type known only at run time would narrow ``module`` to ``object``)."""
    return isinstance(module, kind)


def _checkpointing_off(layer: nn.Module) -> bool:
    """Whether a transformers layer has checkpointing off (its flag read as stored, no property run)."""
    try:
        return inspect.getattr_static(layer, "gradient_checkpointing") is False
    except AttributeError:
        return False


def checkpointing_switches(module: nn.Module) -> tuple[CheckpointSwitch, ...]:
    """The outermost transformers models in ``module`` that checkpoint their layers with one call, and whether they do.

    Only where the user's code imported transformers' models (nothing is imported here: ``transformers``' own
    attributes are lazy, and reading ``transformers.PreTrainedModel`` imported ``modeling_utils``, 2.4 s, in a
    process that had imported only a tokenizer) and its layers are its ``GradientCheckpointingLayer``s, which
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` before it) turns on, every stack's at once.
    """
    models_module = sys.modules.get("transformers.modeling_utils")
    layers_module = sys.modules.get("transformers.modeling_layers")
    pretrained = getattr(models_module, "PreTrainedModel", None)
    layer_type = getattr(layers_module, "GradientCheckpointingLayer", None)
    if not isinstance(pretrained, type) or not isinstance(layer_type, type):
        return ()
    switches: list[CheckpointSwitch] = []
    for name, child in module.named_modules():
        inside = any(not switch.model or name.startswith(f"{switch.model}.") for switch in switches)
        if inside or not _is_a(child, pretrained):
            continue
        if inspect.getattr_static(type(child), "supports_gradient_checkpointing", False) is not True:
            continue
        prefix = f"{name}." if name else ""
        layers = [(f"{prefix}{inner}", layer) for inner, layer in child.named_modules() if _is_a(layer, layer_type)]
        if layers:
            method = (
                "activation_checkpointing_enable"
                if hasattr(type(child), "activation_checkpointing_enable")
                else "gradient_checkpointing_enable"
            )
            on = not all(_checkpointing_off(layer) for _, layer in layers)
            switches.append(CheckpointSwitch(name, method, tuple(layer_name for layer_name, _ in layers), on))
    return tuple(switches)


def session_loop(module: nn.Module, optimizers: Iterable[Any], dataloader: Any) -> TrainingLoop:
    """A session's loop: Fabric where the module, an optimizer or the DataLoader is one of Fabric's wrappers.

    Read from the objects' classes only (nothing of Fabric is imported, no user code runs).

    >>> session_loop(nn.Linear(2, 2), [], None)
    <TrainingLoop.PLAIN: 'plain'>
    """
    for candidate in (module, *optimizers, dataloader):
        if type(candidate).__module__.startswith(FABRIC_MODULES):
            return TrainingLoop.FABRIC
    return TrainingLoop.PLAIN


def training_setup(
    module: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    *,
    dataloaders: Any = None,
    precision: str = "32-true",
    automatic_optimization: bool = True,
    accumulate_grad_batches: int = 1,
    devices_per_node: int = 1,
    world_size: int = 1,
    strategy: str = "SingleDeviceStrategy",
    loop: TrainingLoop = TrainingLoop.LIGHTNING,
    own_zero_grad: bool = False,
) -> TrainingSetup:
    """What the rules need to know about how training is set up.

    ``loop``: what trains the model; ``own_zero_grad``: the LightningModule overrides ``optimizer_zero_grad``.
    """
    loader = first_dataloader(dataloaders)
    return TrainingSetup(
        precision=precision,
        automatic_optimization=automatic_optimization,
        accumulate_grad_batches=accumulate_grad_batches,
        optimizers=tuple(optimizer_name(optimizer) for optimizer in optimizers),
        num_workers=loader.num_workers if loader is not None else None,
        pin_memory=loader.pin_memory if loader is not None else None,
        cpu_cores_per_device=max(1, cpu_cores() // max(1, devices_per_node)),
        world_size=world_size,
        strategy=strategy,
        parameter_bytes=parameter_bytes(module),
        linear_layers=linear_layers(module),
        inplace_keeps_result=tuple(name for name, child in module.named_modules() if inplace_keeps_result(child)),
        checkpointing_switches=checkpointing_switches(module),
        visible_devices=torch.cuda.device_count(),
        language_model=language_model(module),
        longest_sample=longest_sample(loader),
        iterable_dataset=loader is not None and isinstance(loader.dataset, IterableDataset),
        loader_batch_size=loader.batch_size if loader is not None else None,
        loop=loop,
        own_zero_grad=own_zero_grad,
        keyed_containers=tuple(name for name, child in module.named_modules() if isinstance(child, nn.ModuleDict)),
    )

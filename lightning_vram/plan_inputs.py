"""What ``lightning-vram plan`` and :func:`lightning_vram.plan.plan` are asked about: the module, its batch, the GPUs.

- a LightningModule by import path: ``package.module:ClassName`` (or ``path/to/file.py:ClassName``), built with no
  arguments or with keyword arguments;
- a batch described by its tensors' dtypes and shapes (:func:`parse_batch`: ``"float32[8,3,32,32] int64[8]"`` for a
  tuple, ``"x=float32[8,3,32,32] y=int64[8]"`` for a dict, one tensor alone for a tensor), made of zeros (a label
  or a token id of 0 is one every model takes); or the module's ``example_input_array``; or the first batch of a
  training loader (the datamodule's, else the module's own ``train_dataloader``): :func:`resolve_batch` says which;
- the GPUs by name from :data:`~lightning_vram.prediction.devices.COMMON_GPUS` (a unique part of the name is
  enough: ``"T4"``, ``"A100 40GB"``) or by memory in bytes (:func:`resolve_gpus`).

Every refusal is a :class:`PlanInputError` (a ``ValueError``) naming the argument, what it must be and what it got,
in one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_vram.plan_syntax import DTYPE_NAMES, batch_items, gpu_bytes, one_tuple
from lightning_vram.plan_syntax import PlanInputError as PlanInputError  # where plan() and the command read it
from lightning_vram.prediction.containment.isolation import generators_kept
from lightning_vram.prediction.devices import COMMON_GPUS
from lightning_vram.prediction.timing import GPU_PEAKS, DevicePeaks, gpu_peaks
from lightning_vram.units import format_bytes

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in DTYPE_NAMES.items()}
"""The dtypes a batch description names (:data:`~lightning_vram.plan_syntax.DTYPE_NAMES`), as torch's dtypes."""


def parse_batch(text: str, argument: str = "batch") -> Any:
    """The batch a description names, as zeros on the CPU: a tensor, a tuple of them, or a dict of them by name.

    A trailing comma makes a tuple of one tensor, as in Python.

    >>> batch = parse_batch("float32[8,3,32,32] int64[8]")
    >>> [(tuple(t.shape), t.dtype) for t in batch]
    [((8, 3, 32, 32), torch.float32), ((8,), torch.int64)]
    >>> sorted(parse_batch("x=bfloat16[2,4] y=int64[2]"))
    ['x', 'y']
    >>> type(parse_batch("int64[2,8]")).__name__, [tuple(t.shape) for t in parse_batch("int64[2,8],")]
    ('Tensor', [(2, 8)])
    >>> parse_batch("float32[8,3")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_vram.plan_syntax.PlanInputError: batch must be dtype[sizes] items ...; got ... no closing ']')
    """
    items = [(name, torch.zeros(shape, dtype=DTYPES[dtype])) for name, dtype, shape in batch_items(text, argument)]
    if items[0][0] is not None:
        return {name: tensor for name, tensor in items}
    tensors = tuple(tensor for _, tensor in items)
    return tensors[0] if len(tensors) == 1 and not one_tuple(text)[1] else tensors


def load_class(path: str, argument: str = "module") -> type:
    """The class ``path`` names: ``package.module:ClassName``, or ``path/to/file.py:ClassName``.

    The current directory is searched first for a dotted module, as ``python -m`` does; a file's neighbours import
    inside :func:`file_directories`.
    """
    module_path, _, name = path.rpartition(":")
    if not module_path or not name.isidentifier():
        raise PlanInputError(f"{argument} must be package.module:ClassName or path/to/file.py:ClassName, got {path!r}")
    try:
        loaded = _import(module_path)
    except (ImportError, OSError, SyntaxError) as error:
        raise PlanInputError(f"{argument} {path!r} cannot be imported: {type(error).__name__}: {error}") from None
    found = getattr(loaded, name, None)
    if not isinstance(found, type):
        raise PlanInputError(f"{argument} {path!r} names no class: {module_path} has no class {name!r}")
    return found


@contextmanager
def file_directories(*paths: str | None) -> Iterator[None]:
    """Inside, each ``path/to/file.py:ClassName``'s directory first on ``sys.path``, as ``python file.py`` puts its own.

    So such a file imports its neighbours (``from common import train``) when imported, when built, and in the steps
    a plan replays; the first path's directory comes first. Each directory put there is taken out on leaving. A
    dotted ``package.module:ClassName`` (or ``None``) adds nothing here: :func:`load_class` searches the current
    directory for it.
    """
    added = [
        str(Path(path.rpartition(":")[0]).resolve().parent)
        for path in reversed(paths)
        if path is not None and path.rpartition(":")[0].endswith(".py")
    ]
    for directory in added:
        sys.path.insert(0, directory)
    try:
        yield
    finally:
        for directory in added:
            if directory in sys.path:  # the user's code may have taken it out
                sys.path.remove(directory)


def _import(module_path: str) -> Any:
    """The module at a dotted path or a ``.py`` file."""
    if module_path.endswith(".py"):
        file = Path(module_path)
        if not file.is_file():
            raise ImportError(f"no file {module_path}")
        name = f"_lightning_vram_plan_{file.stem}"
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"{module_path} is not a Python module")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # dataclasses and pickling look their module up by name
        spec.loader.exec_module(loaded)
        return loaded
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    return importlib.import_module(module_path)


def build_module(cls: type, init_kwargs: str | None, argument: str = "module") -> nn.Module:
    """An instance of ``cls`` built with no arguments or with ``init_kwargs`` (a JSON object); it must be a module.

    A TypeError or ValueError its constructor raises (an argument it needs, or one it refuses) is a
    :class:`PlanInputError`; its other errors are its own and propagate.
    """
    kwargs: Any = {}
    if init_kwargs is not None:
        try:
            kwargs = json.loads(init_kwargs)
        except json.JSONDecodeError as error:
            raise PlanInputError(f"--init-kwargs must be a JSON object, got {init_kwargs!r} ({error.msg})") from None
        if not isinstance(kwargs, dict):
            raise PlanInputError(f"--init-kwargs must be a JSON object, got {init_kwargs!r}")
    try:
        built = cls(**kwargs)
    except (TypeError, ValueError) as error:  # arguments it needs, or refuses; its other errors are its own
        raise PlanInputError(
            f"{argument} {cls.__name__}(**{kwargs!r}) raised {type(error).__name__}: {error}"
        ) from None
    if not isinstance(built, nn.Module):
        raise PlanInputError(f"{argument} must name a LightningModule class, got {cls.__name__}")
    return built


def resolve_batch(module: nn.Module, batch: Any, datamodule: Any = None) -> tuple[Any, str]:
    """The batch to plan for and where it came from: given, the module's ``example_input_array``, or a loader's.

    The loader is the datamodule's ``train_dataloader`` (after its ``prepare_data`` and ``setup("fit")``), else the
    module's own where it overrides Lightning's; the generators they draw from are put back as they were.
    """
    if batch is not None:
        return batch, "given"
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return example, "the module's example_input_array"
    # A loader draws from the generators (a shuffled order, a dataset's augmentation): the user's runs after the plan
    # start from the states they would have without it.
    if datamodule is not None:
        with generators_kept():
            datamodule.prepare_data()
            datamodule.setup("fit")
            first = _first(datamodule.train_dataloader(), "datamodule")
        return first, "the datamodule's first training batch"
    own = getattr(type(module), "train_dataloader", None)
    hooks = sys.modules.get("lightning.pytorch.core.hooks")
    default = getattr(getattr(hooks, "DataHooks", None), "train_dataloader", None)
    if own is not None and own is not default:
        with generators_kept():
            first = _first(module.train_dataloader(), "module")  # type: ignore[operator]
        return first, "the module's train_dataloader's first batch"
    raise PlanInputError(
        "batch must be given (a description such as 'float32[8,3,32,32] int64[8]'), or the module must have an"
        " example_input_array or a train_dataloader, or a datamodule be given; got none of them"
    )


def _first(loader: Iterable[Any], argument: str) -> Any:
    """The loader's first batch; the loader's own generators (its shuffling's) put back as they were.

    A DataLoader given ``generator=`` draws its base seed and its sampler's order from it, not from the global
    generators; the user's module may hold that generator and build its next loader on it (the fit after the plan).
    """
    kept = [(generator, generator.get_state()) for generator in _loader_generators(loader)]
    try:
        for batch in loader:
            return batch
    finally:
        for generator, state in kept:
            generator.set_state(state)
    raise PlanInputError(f"{argument}'s train_dataloader must yield a batch, got an empty loader")


def _loader_generators(loader: object) -> list[torch.Generator]:
    """The distinct ``torch.Generator`` objects a DataLoader draws from: its own, its sampler's, its batch sampler's."""
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (loader, sampler, batch_sampler, getattr(batch_sampler, "sampler", None))
    found: list[torch.Generator] = []
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not seen for seen in found):
            found.append(generator)
    return found


@dataclass(frozen=True)
class PlanGpu:
    """A GPU a plan asks about: its name, the memory CUDA can use on it (bytes), its peak rates (``None``: unknown).

    Without peaks (a GPU given by its memory, or a row of the memory table alone) no step time is predicted.
    """

    name: str
    capacity_bytes: int
    peaks: DevicePeaks | None = field(compare=False)
    """Not compared: a GPU is its name and memory (the peaks hold a dict, which does not hash)."""


def common_gpus() -> tuple[PlanGpu, ...]:
    """Every card of :data:`~lightning_vram.prediction.timing.GPU_PEAKS`, with its row's memory in COMMON_GPUS."""
    memory = dict(COMMON_GPUS)
    return tuple(
        PlanGpu(name, memory[peaks.memory_row], peaks)
        for name, peaks in GPU_PEAKS.items()
        if peaks.memory_row in memory
    )


def resolve_gpus(gpus: Sequence[str | int] | None, argument: str = "gpus") -> tuple[PlanGpu, ...]:
    """The GPUs asked for: every common card by default (:func:`common_gpus`).

    A name is a card's (``"H100 SXM"``), words of one (``"h100"``, ``"A100 80GB"``: the card with all of them, as
    :func:`~lightning_vram.prediction.timing.gpu_peaks` reads a device's name), or a unique part of a row of
    :data:`COMMON_GPUS` (memory only, no step time); bytes name a card of that memory (``"80000000000"`` from the
    command line too).

    >>> [(gpu.name, gpu.capacity_bytes) for gpu in resolve_gpus(["t4", "A100 80GB", 24 * 2**30])]
    [('T4', 15843721216), ('A100 80GB SXM', 84447068160), ('24.00 GiB', 25769803776)]
    """
    if gpus is None:
        return common_gpus()
    if isinstance(gpus, (str, int)) or not gpus:
        raise PlanInputError(f"{argument} must be a non-empty list of GPU names or byte counts, got {gpus!r}")
    return tuple(dict.fromkeys(_gpu(gpu, argument) for gpu in gpus))


def _gpu(gpu: str | int, argument: str) -> PlanGpu:
    if (memory := gpu_bytes(gpu, argument)) is not None:
        return PlanGpu(format_bytes(memory), memory, None)
    if not isinstance(gpu, str):
        raise PlanInputError(f"{argument} must hold GPU names or byte counts, got {gpu!r} ({type(gpu).__name__})")
    cards = {card.name.lower(): card for card in common_gpus()}
    peaks = gpu_peaks(gpu) if gpu.strip() else None
    card = cards.get(gpu.strip().lower()) or (cards.get(peaks.name.lower()) if peaks is not None else None)
    if card is not None:
        return card
    found = [row for row in COMMON_GPUS if _words(gpu) <= _words(row[0]) and gpu.strip()]
    if len(found) != 1:
        names = ", ".join(cards[name].name for name in cards)
        why = "matches several" if found else "is not one"
        raise PlanInputError(f"{argument} must name one of: {names} (or give bytes); {gpu!r} {why}")
    return PlanGpu(found[0][0], found[0][1], None)


def _words(name: str) -> set[str]:
    """A GPU name's words, lower case, without punctuation (``"A100 80GB / H100 80GB"``: a100, 80gb, h100)."""
    return set(re.findall(r"[a-z0-9]+", name.lower()))

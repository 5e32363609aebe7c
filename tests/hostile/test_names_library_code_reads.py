"""Methods and properties reached by names that only library code reads: each must still be walked.

The walk takes a user class's method only when its name is in reach (``method_reach.py``). Library code reads
attributes by names the user's code never reads itself: ``str.format`` reads ``{0.line}`` from its format string,
``print(..., file=sink)`` calls the sink's ``write``, ``contextlib.closing`` calls ``close``, a Logger calls its
filters' ``filter``, ``{**mapping}`` calls ``keys``, and ``methodcaller`` imported by name calls whatever name
it is given. A replay running them must leave training exactly as it was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from operator import methodcaller
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader
from torch.utils.data import DataLoader


def cnn_loader() -> DataLoader[Any]:
    return loader(dataset_for("cnn"), batch_size=8)


class Progress:
    """A progress line the step renders through ``str.format``; how many lines were rendered, class-wide."""

    rendered = 0

    @property
    def line(self) -> str:
        Progress.rendered += 1
        return f"line {Progress.rendered}"


class Rendering(Classifier):
    def __init__(self) -> None:
        super().__init__(cnn_net())
        self.progress = Progress()
        self.lines: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.lines.append("step {0.line}".format(self.progress))  # noqa: UP030, UP032 -- str.format reads ``line``
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_a_property_read_by_a_format_field(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        Progress.rendered = 0
        module = Rendering()
        return Case(module, cnn_loader(), observe=lambda: (Progress.rendered, list(module.lines)))

    assert_untouched(build, tmp_path, path)


class Sink:
    """A file-like log the step prints to: ``print`` calls its ``write`` and ``flush``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, text: str) -> int:
        with open(self.path, "a") as log:
            return log.write(text)

    def flush(self) -> None:
        pass


class Printing(Classifier):
    def __init__(self, sink: Sink) -> None:
        super().__init__(cnn_net())
        self.sink = sink

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        print("step", batch_idx, file=self.sink)  # print calls ``write``
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_a_file_like_object_print_writes_to(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        log = tmp_path / f"log-{len(list(tmp_path.glob('log-*')))}.txt"
        return Case(Printing(Sink(log)), cnn_loader(), observe=lambda: log.read_text())

    assert_untouched(build, tmp_path, path)


class Resource:
    """A resource the step closes with ``contextlib.closing``; how many were closed, class-wide."""

    closed = 0

    def close(self) -> None:
        Resource.closed += 1


class Closing(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with contextlib.closing(Resource()):  # contextlib calls ``close``
            return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_a_close_contextlib_calls(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        Resource.closed = 0
        return Case(Closing(cnn_net()), cnn_loader(), observe=lambda: Resource.closed)

    assert_untouched(build, tmp_path, path)


class Configured(Classifier):
    """Runs the extras its configuration names (from a YAML file, a command line), through ``methodcaller``."""

    counted = 0

    def __init__(self, extras: list[str]) -> None:
        super().__init__(cnn_net())
        self.extras = extras

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        for name in self.extras:
            methodcaller(name)(self)  # imported by name: not an attribute read
        return super().training_step(batch, batch_idx)

    def count_parameters(self) -> None:
        Configured.counted += 1


@pytest.mark.parametrize("path", PATHS)
def test_a_method_methodcaller_calls_by_a_configured_name(tmp_path: Path, path: str) -> None:
    configured = ["_".join(("count", "parameters"))]  # as read from a configuration: no constant in the step

    def build() -> Case:
        Configured.counted = 0
        return Case(Configured(configured), cnn_loader(), observe=lambda: Configured.counted)

    assert_untouched(build, tmp_path, path)


class CallsItsExtras(Classifier):
    """Runs the extras it was handed, each a ``methodcaller`` built from a configured name."""

    counted = 0

    def __init__(self, extras: list[Callable[[Any], object]]) -> None:
        super().__init__(cnn_net())
        self.extras = extras

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        for extra in self.extras:
            extra(self)
        return super().training_step(batch, batch_idx)

    def count_parameters(self) -> None:
        CallsItsExtras.counted += 1


@pytest.mark.parametrize("path", PATHS)
def test_a_method_a_held_methodcaller_calls(tmp_path: Path, path: str) -> None:
    configured = "_".join(("count", "parameters"))

    def build() -> Case:
        CallsItsExtras.counted = 0
        module = CallsItsExtras([methodcaller(configured)])
        return Case(module, cnn_loader(), observe=lambda: CallsItsExtras.counted)

    assert_untouched(build, tmp_path, path)


class CountingFilter:
    """A logging filter by duck typing (no ``logging.Filter`` base): the Logger calls its ``filter``."""

    seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        CountingFilter.seen += 1
        return False


LOG = logging.Logger("hostile.filtered", logging.INFO)
"""A logger no handler with a stream reaches (a script's, whose root logger has none; under pytest the root's capture
handlers hold streams, which a replay cannot put back)."""
LOG.addFilter(CountingFilter())


class Logging(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        LOG.info("step %d", batch_idx)  # the Logger calls ``filter``
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_a_filter_a_logger_calls(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        CountingFilter.seen = 0
        return Case(Logging(cnn_net()), cnn_loader(), observe=lambda: CountingFilter.seen)

    assert_untouched(build, tmp_path, path)


class Settings:
    """A mapping by duck typing: ``{**settings}`` calls its ``keys``; how many times, class-wide."""

    listed = 0

    def keys(self) -> list[str]:
        Settings.listed += 1
        return ["scale"]

    def __getitem__(self, key: str) -> float:
        return 1.0


class Unpacking(Classifier):
    def __init__(self) -> None:
        super().__init__(cnn_net())
        self.settings = Settings()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        options = {"scale": 2.0, **self.settings}  # Python calls ``keys``
        return super().training_step(batch, batch_idx) * options["scale"]


@pytest.mark.parametrize("path", PATHS)
def test_keys_mapping_unpacking_calls(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        Settings.listed = 0
        return Case(Unpacking(), cnn_loader(), observe=lambda: Settings.listed)

    assert_untouched(build, tmp_path, path)

"""Arguments checked where they are given: the constructors' settings, types and ranges, and ``VramSession.start``'s."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from models import Classifier, dataset_for, linear_net, loader
from sessions import new_session, train_steps

from lightning_vram import VramMonitor, VramSession
from lightning_vram.config import PRECISION_ALIASES, PRECISIONS
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

# ---------------------------------------------------------------------------------------- the constructors' settings


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"log_every_n_steps": 0}, ValueError, "log_every_n_steps must be >= 1, got 0"),
        ({"log_every_n_steps": True}, TypeError, "log_every_n_steps must be an int >= 1 or None, got True"),
        ({"attribution_start_step": -1}, ValueError, "attribution_start_step must be >= 0, got -1"),
        (
            {"attribution_every_n_steps": 2.5},
            TypeError,
            "attribution_every_n_steps must be an int >= 1 or None, got 2.5",
        ),
        ({"reset_peak_stats": "yes"}, TypeError, "reset_peak_stats must be True or False, got 'yes'"),
        ({"utilization_interval_seconds": 0}, ValueError, "utilization_interval_seconds must be a positive number"),
        ({"utilization_interval_seconds": "1s"}, TypeError, "utilization_interval_seconds must be a positive number"),
        ({"top_modules": 0}, ValueError, "top_modules must be >= 1, got 0"),
        ({"recent_steps": None}, TypeError, "recent_steps must be an int >= 1, got None"),
        ({"console_summary": 1}, TypeError, "console_summary must be True or False, got 1"),
        ({"probe": object()}, TypeError, "probe must implement lightning_vram.measure.probes.Probe, got object"),
        ({"log_every": 5}, TypeError, "unexpected keyword argument 'log_every'"),
    ],
)
def test_bad_arguments_fail_at_construction(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        VramMonitor(**options)


def test_session_arguments_fail_at_construction_naming_the_argument() -> None:
    with pytest.raises(TypeError, match="log_dir must be a path"):
        VramSession(log_dir=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_modules must be >= 1, got 0"):
        VramSession(top_modules=0)
    with pytest.raises(ValueError, match="log_dir must be a directory path or None, got an empty path"):
        VramSession(log_dir="")


@pytest.mark.parametrize("build", [VramMonitor, VramSession], ids=["VramMonitor", "VramSession"])
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("recent_steps", 10**30, f"recent_steps must be <= 1000000, got {10**30}"),
        ("history_max_entries", 10**8, "history_max_entries must be <= 10000000, got 100000000"),
        ("top_modules", 10**5, "top_modules must be <= 10000, got 100000"),
        ("log_every_n_steps", 10**13, "log_every_n_steps must be <= 1000000000000, got 10000000000000"),
        ("attribution_start_step", 10**13, "attribution_start_step must be <= 1000000000000, got 10000000000000"),
        ("attribution_every_n_steps", 2**64, "attribution_every_n_steps must be <= 1000000000000, got 1844"),
        ("utilization_interval_seconds", math.inf, "must be a positive number of seconds from 0.01 to 60.0, got inf"),
        ("utilization_interval_seconds", 61, "must be a positive number of seconds from 0.01 to 60.0, got 61"),
        ("utilization_interval_seconds", 1e-4, "must be a positive number of seconds from 0.01 to 60.0, got 0.0001"),
        ("utilization_interval_seconds", math.nan, "must be a positive number of seconds from 0.01 to 60.0, got nan"),
        ("utilization_interval_seconds", -math.inf, "must be a positive number of seconds from 0.01 to 60.0, got -inf"),
    ],
)
def test_out_of_range_settings_fail_at_construction_naming_the_argument(
    build: Any, name: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        build(**{name: value})
    assert str(raised.value).startswith(name)


@pytest.mark.parametrize("build", [VramMonitor, VramSession], ids=["VramMonitor", "VramSession"])
def test_the_largest_settings_allowed_are_accepted(build: Any) -> None:
    built = build(
        recent_steps=10**6,
        history_max_entries=10**7,
        top_modules=10**4,
        log_every_n_steps=10**12,
        attribution_start_step=10**12,
        attribution_every_n_steps=10**12,
        utilization_interval_seconds=60,
    )
    assert built.config.recent_steps == 10**6
    assert build(utilization_interval_seconds=0.01).config.utilization_interval_seconds == 0.01


@pytest.mark.parametrize("value", [True, "1s"])
def test_a_number_of_seconds_of_another_type_is_refused_with_its_range(value: object) -> None:
    with pytest.raises(TypeError) as raised:
        VramMonitor(utilization_interval_seconds=value)
    assert str(raised.value) == (
        "utilization_interval_seconds must be a positive number of seconds from 0.01 to 60.0, got"
        f" {value!r} ({type(value).__name__})"
    )


MAX_SHAPE_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"max_shape": (3, 0, 8)}, ValueError, "max_shape must be a tuple of ints >= 1 (a size per dimension past the"),
    ({"max_shape": (3, -1)}, ValueError, "max_shape must be a tuple of ints >= 1 (a size per dimension past the"),
    ({"max_shape": ()}, ValueError, "batch's), got ()"),
    ({"max_shape": tuple(range(1, 66))}, ValueError, "max_shape must be a tuple of ints >= 1"),
    ({"max_shape": (3, 10**10)}, ValueError, "max_shape must have sizes <= 1000000000, got (3, 10000000000)"),
    ({"max_shape": [3, 8, 8]}, TypeError, "max_shape must be a tuple of ints >= 1 (a size per"),
    ({"max_shape": 512}, TypeError, "batch's) or None, got 512 (int)"),
    ({"max_shape": "3x8x8"}, TypeError, "batch's) or None, got '3x8x8' (str)"),
    ({"max_shape": (3, 8.0)}, TypeError, "batch's) or None, got (3, 8.0) (tuple)"),
    ({"max_shape": (3, True)}, TypeError, "batch's) or None, got (3, True) (tuple)"),
    (
        {"max_shape": (3, 8, 8), "max_length": 8},
        ValueError,
        "max_length and max_shape are mutually exclusive: give one, got max_length=8 and max_shape=(3, 8, 8)",
    ),
]


@pytest.mark.parametrize("build", [VramMonitor, VramSession], ids=["VramMonitor", "VramSession"])
@pytest.mark.parametrize(
    ("options", "error", "message"), MAX_SHAPE_ERRORS, ids=[str(case[0])[:40] for case in MAX_SHAPE_ERRORS]
)
def test_a_bad_max_shape_fails_at_construction_naming_it(
    build: Any, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)) as raised:
        build(**options)
    assert "max_shape" in str(raised.value)


def test_max_shape_is_accepted_and_kept() -> None:
    assert VramMonitor(max_shape=(3, 512, 384)).config.max_shape == (3, 512, 384)
    assert VramSession(max_shape=torch.Size([2048])).config.max_shape == (2048,)
    assert VramMonitor(max_length=2048).config.max_shape is None


def test_a_clock_that_is_not_callable_fails_at_construction() -> None:
    with pytest.raises(TypeError, match=re.escape("clock must be a callable returning seconds, got float")):
        VramSession(clock=1.5)  # type: ignore[arg-type]


def test_a_probe_class_instead_of_a_probe_fails_at_construction() -> None:
    with pytest.raises(TypeError, match=re.escape("probe must be a probe such as ScriptedProbe([...]), got the class")):
        VramMonitor(probe=ScriptedProbe)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- start's arguments


class NotAWriter:
    """Has none of SummaryWriter's methods."""


PRECISIONS_LISTED = (
    "'32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true', '64-true', 'transformer-engine',"
    " 'transformer-engine-float16', '64', '32', '16', 'bf16', 64, 32, 16"
)
"""What a bad ``precision`` is told it may be: Lightning's names, then its older ones (strings and ints)."""

START_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"model": None}, TypeError, "model must be a torch.nn.Module, got None"),
    ({"model": "net"}, TypeError, "model must be a torch.nn.Module, got 'net' (str)"),
    ({"default_log_every_n_steps": 0}, ValueError, "default_log_every_n_steps must be >= 1, got 0"),
    ({"default_log_every_n_steps": 2.5}, TypeError, "default_log_every_n_steps must be an int >= 1 or None, got 2.5"),
    (
        {"optimizers": "sgd"},
        TypeError,
        "optimizers must be a list of optimizers or a callable returning them, got 'sgd'",
    ),
    ({"optimizers": ["sgd"]}, TypeError, "optimizers[0] must be an optimizer (with param_groups), got 'sgd' (str)"),
    ({"precision": 8}, ValueError, f"precision must be one of Lightning's precisions ({PRECISIONS_LISTED}), got 8"),
    ({"precision": ""}, ValueError, f"precision must be one of Lightning's precisions ({PRECISIONS_LISTED}), got ''"),
    ({"precision": "garbage"}, ValueError, "precision must be one of Lightning's precisions ('32-true', "),
    ({"precision": "fp16"}, ValueError, "got 'fp16'"),  # a trial's typo for "16-mixed", taken before
    ({"precision": True}, TypeError, "precision must be one of Lightning's precisions ('32-true', "),
    ({"precision": 16.0}, TypeError, "got 16.0 (float)"),
    (
        {"device": "cpu:abc"},
        ValueError,
        "device must be a torch.device or a device string such as 'cuda:1', got 'cpu:abc'",
    ),
    ({"device": 0}, TypeError, "device must be a torch.device or a device string such as 'cuda:1', got 0 (int)"),
    ({"setup": 3}, TypeError, "setup must be a callable or None, got 3 (int)"),
    ({"rank": -1}, ValueError, "rank must be >= 0, got -1"),
    ({"rank": True}, TypeError, "rank must be an int >= 0, got True (bool)"),
    ({"world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
    ({"rank": 2, "world_size": 2}, ValueError, "rank must be < world_size (2), got 2"),
    ({"gather": "all"}, TypeError, "gather must be a callable or None, got 'all' (str)"),
    ({"tensorboard": NotAWriter()}, TypeError, "tensorboard must be a list of SummaryWriters, got NotAWriter"),
    (
        {"tensorboard": [NotAWriter()]},
        TypeError,
        "tensorboard[0] must be a SummaryWriter (with add_text, add_custom_scalars, add_image, get_logdir, flush,"
        " close), got NotAWriter",
    ),
    (
        {"publishers": [NotAWriter()]},
        TypeError,
        "publishers[0] must be a lightning_vram.Publisher (lightning_vram.publisher_for(logger) makes one of a"
        " Lightning logger), got <",
    ),
    ({"step_function": 3}, TypeError, "step_function must be a callable or None, got 3 (int)"),
    ({"wrapper": "ddp"}, TypeError, "wrapper must be a callable or None, got 'ddp' (str)"),
]


# Test ids without objects' addresses: pytest-xdist's workers must each collect the same ids.
START_IDS = [re.sub(r" object at 0x[0-9a-f]+", "", str(case[0])) for case in START_ERRORS]


@pytest.mark.parametrize(("arguments", "error", "message"), START_ERRORS, ids=START_IDS)
def test_bad_start_arguments_fail_at_start_naming_the_argument(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    model = Classifier(linear_net())
    call: dict[str, Any] = {"model": model, "optimizers": [torch.optim.SGD(model.parameters(), lr=0.1)], **arguments}
    session = new_session()
    with pytest.raises(error, match=re.escape(message)):
        session.start(call.pop("model"), call.pop("optimizers"), **call)
    assert session.finish() is None  # nothing started


def test_a_device_string_is_a_device() -> None:
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)])
    session = VramSession(probe=probe, console_summary=False, replay_budget_seconds=0)
    session.start(model, [optimizer], device="cuda:1")
    assert probe.opened_with == torch.device("cuda", 1)
    session.close()


def test_the_precisions_are_lightnings_own() -> None:
    from typing import get_args

    from lightning.fabric.plugins.precision import precision as lightning_precision

    assert set(PRECISIONS) == set(get_args(lightning_precision._PRECISION_INPUT_STR))
    aliases = {name: full for name, full in PRECISION_ALIASES.items() if isinstance(name, str)}
    assert aliases == lightning_precision._PRECISION_INPUT_STR_ALIAS_CONVERSION
    assert {name for name in PRECISION_ALIASES if isinstance(name, int)} == set(
        get_args(lightning_precision._PRECISION_INPUT_INT)
    )


@pytest.mark.parametrize(("given", "taken"), [("bf16", "bf16-mixed"), (16, "16-mixed"), ("32", "32-true")])
def test_lightnings_older_precision_names_are_taken_as_lightning_takes_them(given: str | int, taken: str) -> None:
    """A trial's session started with ``precision="bf16"`` (which Fabric takes for "bf16-mixed") reported "precision
    'bf16' cannot be replayed" after training, its advice modelled."""
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = new_session()
    session.start(model, [optimizer], precision=given)
    train_steps(session, model, optimizer, loader(dataset_for("linear")), 2)
    report = session.finish()
    assert report is not None and report.precision == taken

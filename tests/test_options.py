"""One list of options: MonitorOptions (documented), MonitorConfig (defaults, checks), taken by both front ends."""

from __future__ import annotations

from dataclasses import fields

import pytest

from lightning_vram import VramMonitor, VramSession
from lightning_vram.config import MonitorConfig, MonitorOptions


def test_the_options_and_the_config_list_the_same_names() -> None:
    assert list(MonitorOptions.__annotations__) == [field.name for field in fields(MonitorConfig)]
    documented = MonitorOptions.__doc__ or ""
    assert all(f"        {name}: " in documented for name in MonitorOptions.__annotations__)


@pytest.mark.replay  # the library's own defaults, replay options included (the tests' default turns replays off)
@pytest.mark.parametrize("build", [VramMonitor, VramSession], ids=["VramMonitor", "VramSession"])
def test_both_front_ends_take_every_option_with_its_default(build: type[VramMonitor] | type[VramSession]) -> None:
    assert build().config == MonitorConfig()
    assert build(top_modules=3, preflight=False).config == MonitorConfig(top_modules=3, preflight=False)


def test_the_callback_takes_no_log_dir() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'log_dir'"):
        VramMonitor(log_dir="runs")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("build", "misspelled", "message"),
    [
        (
            VramMonitor,
            "log_every_n_step",
            "VramMonitor got an unexpected keyword argument 'log_every_n_step'; did you mean 'log_every_n_steps'?",
        ),
        (VramSession, "logdir", "VramSession got an unexpected keyword argument 'logdir'; did you mean 'log_dir'?"),
        (
            VramSession,
            "zzz",
            "VramSession got an unexpected keyword argument 'zzz'; its options are attribution_every_n_steps, ",
        ),
    ],
)
def test_a_name_that_is_no_option_is_refused_naming_the_closest(
    build: type[VramMonitor] | type[VramSession], misspelled: str, message: str
) -> None:
    with pytest.raises(TypeError) as refused:
        build(**{misspelled: 1})  # type: ignore[arg-type]
    assert str(refused.value).startswith(message)

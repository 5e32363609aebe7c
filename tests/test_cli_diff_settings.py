"""``lightning-vram diff``'s settings: the strategy only where a report names it.

A new user's trial read "strategy: not recorded" on every diff: the report has no strategy field. The line now
names a sharded run's strategy, as its replay's sharding or offload trial names it, and is left out where neither
report names one.
"""

from __future__ import annotations

from dataclasses import replace

from advice_summaries import healthy_summary
from test_offload_optimizer import OFFLOAD
from test_sharding_stage import TRIAL as SHARDING
from test_sharding_stage import simulation_with

from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.records import Report, Simulation
from lightning_vram.render.diff import diff_text


def report(simulation: Simulation | None) -> Report:
    """A healthy run's report carrying ``simulation``, as its JSON reads back."""
    summary = healthy_summary()
    written = Report(summary, "bf16-mixed", (), (), (), (), simulation=simulation)
    return report_from_dict(report_to_dict(written))


def settings(before: Report, after: Report) -> list[str]:
    lines = diff_text(before, after).splitlines()
    start = lines.index("run:")
    return [line for line in lines[start + 1 :] if line.startswith("  ") and ":" in line][:5]


def test_no_strategy_line_where_neither_report_names_one() -> None:
    lines = settings(report(None), report(simulation_with(None)))
    assert [line.split(":")[0] for line in lines] == [
        "  precision",
        "  batch size",
        "  world size",
        "  device",
        "  step time (median)",
    ]


def test_a_sharded_run_s_strategy_is_named() -> None:
    zero2 = report(simulation_with(SHARDING))
    assert "  strategy: deepspeed_stage_2 in both runs" in settings(zero2, zero2)
    assert "  strategy: not recorded -> deepspeed_stage_2" in settings(report(None), zero2)
    offloading = report(replace(simulation_with(None), offload=replace(OFFLOAD, strategy="fsdp2")))
    assert "  strategy: deepspeed_stage_2 -> fsdp2" in settings(zero2, offloading)


def test_a_ddp_and_an_fsdp2_run_are_named_from_the_replay_s_strategy() -> None:
    # A new user's diff of a DDP run against its FSDP2 run said nothing of the strategy: neither had a sharding
    # trial (FSDP2 has no stronger sharding) nor an offload one (CUDA near capacity only), and the report kept no
    # other trace of it. The simulation now names the strategy its rank was replayed under, through the JSON.
    ddp = report(replace(simulation_with(None), strategy_name="ddp"))
    fsdp2 = report(replace(simulation_with(None), strategy_name="fsdp2"))
    assert (ddp.simulation and ddp.simulation.strategy_name, fsdp2.simulation and fsdp2.simulation.strategy_name) == (
        "ddp",
        "fsdp2",
    )
    assert "  strategy: ddp -> fsdp2" in settings(ddp, fsdp2)
    assert "  strategy: not recorded -> fsdp2" in settings(report(None), fsdp2)

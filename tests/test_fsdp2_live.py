"""A live FSDP2 run's advice, replayed rank by rank (issue 26: simulated where 0.11.0 said "skipped").

Two gloo ranks train under Lightning's ``ModelParallelStrategy`` (tests/fsdp2_live_train.py), and under Fabric's
in a plain loop driving ``VramSession`` (tests/fsdp2_fabric_train.py). Each rank's replay
copies its ``fully_shard``-ed module unsharded (plain fake parameters of each DTensor's global shape, the original
classes, no FSDP hook or state), shards the copy again as the run did over fake groups made beside the run's, and
replays its step: no collective of the run's, no real DTensor or FSDP state touched. Its per-rank peaks must be
within 5% of the rank's measured ones per phase, its advice simulated, training the same as without the monitor,
and preflight must carry both ranks' FSDP2 predictions into the ranks' agreement.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import live_ranks
import pytest
from fsdp2_live_train import BATCH, WIDTH
from live_ranks import check_inplace_advice, check_preflight_agreed, run, trained_apart
from replay_records import peak_error

pytestmark = [pytest.mark.distributed, pytest.mark.replay]

SCRIPT, FABRIC = "fsdp2_live_train.py", "fsdp2_fabric_train.py"
"""The Lightning and the Fabric runs' scripts."""
TOLERANCE = 0.05
"""The per-rank model's bound on each phase's peak (issue 26)."""
NOTE = "fsdp2 x2: replayed: torch's fully_shard under a fake process group"
"""The rank prediction's note on each rank's replayed step."""
TIGHT = 1_100_000
"""Free bytes on each rank's scripted device at preflight: each rank's first step is predicted at 1,174,728 B."""


def monitored(out: Path) -> list[dict[str, Any]]:
    """Each rank's record of a monitored run made in ``out``."""
    return live_ranks.monitored(SCRIPT, out)


def trusted(out: Path, measure: Callable[[Path], list[dict[str, Any]]]) -> tuple[Path, list[dict[str, Any]]]:
    """A monitored run (its directory and each rank's record) whose every rank's replay matched its sampled step.

    Measured once more where one did not: gloo's worker thread now and then frees a collective's tensors late, and the
    replay is held to a peak with and without them (docs/measurement.md), unless the thread frees them after the
    replay has read what it released. The second run is returned as it is.
    """
    ranks = measure(out)
    if all(record["skipped"] is None for record in ranks) and not misses(ranks):
        return out, ranks
    again = out.parent / f"{out.name}-again"
    return again, measure(again)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The monitored run (its directory and each rank's record), made once for the module."""
    return trusted(tmp_path_factory.mktemp("fsdp2-live"), monitored)


def misses(ranks: list[dict[str, Any]]) -> list[tuple[int, str, int, int]]:
    """Each replayed rank's phases whose replayed peak is past 5% of the measured one; the table printed.

    A replayed peak between the measured one with and without what gloo's thread released late is on it.
    """
    found = []
    for rank, record in enumerate(ranks):
        if record["skipped"] is not None:
            continue
        replayed, late = record["replayed_peaks"], record["released_late"]
        assert replayed.keys() == record["measured_peaks"].keys() == {"forward", "backward", "optimizer"}
        for phase, measured in record["measured_peaks"].items():
            error = peak_error(phase, measured, replayed[phase], late)
            released = f" (released late {late[phase]})" if phase in late else ""
            print(f"rank {rank} {phase:9} measured {measured:>9}{released} replayed {replayed[phase]:>9} {error:8.4%}")
            if error > TOLERANCE:
                found.append((rank, phase, measured, replayed[phase]))
    return found


def test_each_fsdp2_rank_replays_its_own_step_within_5_percent_of_its_measured_peaks(
    runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    ranks = runs[1]
    for rank, record in enumerate(ranks):
        assert record["skipped"] is None, (rank, record["skipped"])
        assert record["notes"][-1] == NOTE
        parts = {(phase, part): (measured, replayed) for phase, part, measured, replayed in record["match"]}
        for (phase, part), (measured, replayed) in parts.items():
            if part != "live peak":  # the shards the rank holds, counted by the replay as by the run
                assert replayed == measured, (rank, phase, part)
    assert misses(ranks) == []


def test_each_fsdp2_rank_gets_simulated_advice_with_its_saving(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    check_inplace_advice(runs[1], BATCH, WIDTH)


def test_fsdp2_ranks_train_the_same_with_and_without_the_monitor(
    runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    out = runs[0]
    run(SCRIPT, tmp_path, "no-monitor")
    assert trained_apart(out, tmp_path) == []


def test_fsdp2_ranks_agree_on_their_own_preflight_predictions(tmp_path: Path) -> None:
    run(SCRIPT, tmp_path, f"preflight={TIGHT}")
    check_preflight_agreed(tmp_path, NOTE, TIGHT, "VramMonitor")


def test_a_fabric_fsdp2_loop_s_ranks_replay_their_steps_and_train_the_same(tmp_path: Path) -> None:
    # Fabric's ModelParallelStrategy, the MLP sharded in its parallelize_fn, no configure_optimizers: each rank's
    # replay builds an Adam like the run's on its copy's shards.
    bare = tmp_path / "bare"
    bare.mkdir()
    run(FABRIC, bare, "no-monitor")
    monitored_out, ranks = trusted(tmp_path / "monitored", fabric_ranks)
    for rank, record in enumerate(ranks):
        assert record["skipped"] is None, (rank, record["skipped"])
        assert record["notes"][-1] == NOTE
        advice = {entry[0]: entry[1:] for entry in record["advice"]}
        assert advice["inplace-activations"][0] == "simulated" and advice["inplace-activations"][1] > 0
    assert misses(ranks) == []
    assert trained_apart(monitored_out, bare) == []


def fabric_ranks(out: Path) -> list[dict[str, Any]]:
    """Each rank's record of a monitored Fabric run made in ``out``."""
    return live_ranks.monitored(FABRIC, out)


def test_each_fsdp2_rank_offloading_to_the_cpu_replays_its_step_within_5_percent(tmp_path: Path) -> None:
    """Each unit sharded with CPUOffloadPolicy(pin_memory=False) on 2 gloo ranks: each rank's replay shards its
    copy offloading too. On the CPU everything is host memory: the rank's predicted device phases plus its host
    lines (its shards, their gradients and the optimizer state; one memory, the baseline's phases) must equal the
    rank's measured counts part by part and its live peaks within 5% per phase, as without offload; and the ranks
    train bit-identically with and without the monitor."""
    out, ranks = trusted(tmp_path / "offload", offloading)
    bare = tmp_path / "bare"
    bare.mkdir()
    run(SCRIPT, bare, "offload", "no-monitor")
    assert trained_apart(out, bare) == []
    for rank, record in enumerate(ranks):
        assert record["skipped"] is None, (rank, record["skipped"])  # before: "fsdp2 with CPU offload: not modelled"
        assert record["notes"][-1].startswith(f"{NOTE.replace('x2', 'x2 offload')}; CPUOffloadPolicy(pin_memory=False)")
        for phase, part, measured, replayed in record["match"]:
            if part != "live peak":
                assert replayed == measured, (rank, phase, part)
    assert misses(ranks) == []


def offloading(out: Path) -> list[dict[str, Any]]:
    """Each rank's record of a monitored run offloading to the CPU, made in ``out``."""
    return live_ranks.monitored(SCRIPT, out, "offload")


def test_each_fsdp2_rank_whose_root_unit_is_the_lightning_module_replays_its_step(tmp_path: Path) -> None:
    """``fully_shard(self)`` (the plan's printed ``configure_model`` for a step calling ``self``) on 2 gloo ranks:
    each rank's replay copies the root unit unsharded without its Trainer. Before, every rank skipped: "the step
    failed under fake tensors at copy.py:161 (deepcopy): TypeError: cannot pickle '_thread.RLock' object"."""
    _, ranks = trusted(tmp_path / "root-self", lambda out: live_ranks.monitored(SCRIPT, out, "root-self"))
    for rank, record in enumerate(ranks):
        assert record["skipped"] is None, (rank, record["skipped"])
        assert record["notes"][-1] == NOTE
        for phase, part, measured, replayed in record["match"]:
            if part != "live peak":
                assert replayed == measured, (rank, phase, part)
    assert misses(ranks) == []


def test_each_fsdp2_rank_on_gloo_replays_gloo_s_copy_of_the_reduce_scatter_input_at_its_peak(tmp_path: Path) -> None:
    """A wide head left in the root unit (tests/rank_prediction_train.py's ``WideHead``, the printed configure_model):
    its reduce-scatter, the last of backward, falls at backward's peak, where gloo holds a copy of the whole input
    (270,336 bytes). Each rank's replay holds one too (the run's group is gloo's). Before, every rank's baseline was
    refused: "backward live peak replayed 1436480 bytes, measured 1579844 (more than 5% apart)"."""
    _, ranks = trusted(tmp_path / "wide-head", lambda out: live_ranks.monitored(SCRIPT, out, "wide-head"))
    for rank, record in enumerate(ranks):
        assert record["skipped"] is None, (rank, record["skipped"])
        for phase, part, measured, replayed in record["match"]:
            if part != "live peak":
                assert replayed == measured, (rank, phase, part)
    assert misses(ranks) == []

"""A live FSDP1 run's advice, replayed rank by rank (issue 26: simulated where 0.11.0 said "skipped").

Two gloo ranks train an MLP wrapped in torch's ``FullyShardedDataParallel`` (each linear layer a unit, the root the
rest, ``FULL_SHARD``) in a plain loop driving ``VramSession`` (tests/fsdp1_live_train.py). Each rank's replay copies
its module unsharded (each wrapper's place a shell around its inner module, each original parameter a fake one of
its whole shape rebuilt from the flat parameter's shapes, no FSDP1 hook or state) and replays its step, which FSDP1's
per-rank arithmetic sizes by the run's own flat parameters: no collective of the run's, nothing of FSDP1's touched.
Its per-rank peaks must be within 5% of the rank's measured ones per phase, its advice simulated, training the same
as without the monitor, and preflight must carry both ranks' FSDP1 predictions into the ranks' agreement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import live_ranks
import pytest
from fsdp2_live_train import BATCH, WIDTH, WORLD_SIZE
from live_ranks import check_inplace_advice, check_preflight_agreed, read, run, trained_apart
from measured_again import measured_again_where_missed
from replay_records import peak_error

pytestmark = [pytest.mark.distributed, pytest.mark.replay]

SCRIPT = "fsdp1_live_train.py"
"""The run's script."""
TOLERANCE = 0.05
"""The per-rank model's bound on each phase's peak (issue 26)."""
NOTE = (
    "fsdp x2 FULL_SHARD: arithmetic on the single-process replay: FSDP1's flat parameters per wrapped unit, padded to"
    " N and sharded; FSDP1 runs under the fake process group, the replay does not wrap it yet (FULL_SHARD)"
)
"""The rank prediction's note on each rank's replayed step."""
TIGHT = 1_000_000
"""Free bytes on each rank's scripted device at preflight: each rank's first step is predicted at 1,208,764 B."""
SHARD = 4 * (4 * (WIDTH * WIDTH + WIDTH) + WIDTH * 10 + 10) // WORLD_SIZE
"""Bytes of one rank's shards of the five units' flat parameters (float32; 16,512 and 1,290 elements, even): 134,676."""


def monitored(out: Path, *mode: str) -> list[dict[str, Any]]:
    """Each rank's record of a monitored run made in ``out``."""
    return live_ranks.monitored(SCRIPT, out, *mode)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The monitored run (its directory and each rank's record), made once for the module."""
    out = tmp_path_factory.mktemp("fsdp1-live")
    return out, monitored(out)


def misses(ranks: list[dict[str, Any]]) -> list[tuple[int, str, int, int]]:
    """Each rank's phases whose replayed peak is past 5% of the measured one, and each rank not trusted; printed.

    A replayed peak between the measured one with and without what gloo's worker thread released late is on it.
    """
    found = []
    for rank, record in enumerate(ranks):
        if record["skipped"] is not None:
            print(f"rank {rank} not trusted: {record['skipped']}")
            found.append((rank, "skipped", 0, 0))
        replayed, late = record["replayed_peaks"], record["released_late"]
        assert replayed.keys() == record["measured_peaks"].keys() == {"forward", "backward", "optimizer"}
        for phase, measured in record["measured_peaks"].items():
            error = peak_error(phase, measured, replayed[phase], late)
            released = f" (released late {late[phase]})" if phase in late else ""
            print(f"rank {rank} {phase:9} measured {measured:>9}{released} replayed {replayed[phase]:>9} {error:8.4%}")
            if error > TOLERANCE:
                found.append((rank, phase, measured, replayed[phase]))
    return found


def test_each_fsdp1_rank_replays_its_own_step_within_5_percent_of_its_measured_peaks(
    runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, ranks = runs
    for rank, record in enumerate(ranks):
        assert record["notes"][-1] == NOTE
        parts = {(phase, part): (measured, replayed) for phase, part, measured, replayed in record["match"]}
        # The activations compared too: the count leaves FSDP1's gathered flat parameters out of them (autograd saves
        # views of them, FSDP1 frees them after forward), where it split them between activations and other from run
        # to run by the addresses the allocator reused (366,636 to 498,732 B here, the peak the same).
        assert {part for _phase, part in parts} == {
            "parameters",
            "gradients",
            "optimizer_state",
            "activations",
            "live peak",
        }
        assert parts["forward", "parameters"] == (SHARD, SHARD)
        assert parts["optimizer", "gradients"] == (SHARD, SHARD)
        for (phase, part), (measured, replayed) in parts.items():
            print(f"rank {rank} {phase:9} {part:15} measured {measured:>9} replayed {replayed:>9}")
            if part != "live peak":  # the shards the rank holds, counted by the replay as by the run
                assert replayed == measured, (rank, phase, part)
    measure = lambda path: ranks if path == out else monitored(path)  # noqa: E731  # the module's run first
    assert measured_again_where_missed(out, measure, misses, lambda miss: miss[:2]) == []


def unsimulated(ranks: list[dict[str, Any]]) -> list[tuple[int, str | None]]:
    """Each rank whose inplace-activations advice is not simulated, with why its baseline was not trusted.

    A rank's live peak now and then holds a tensor gloo's worker thread frees late (tests/measured_again.py): its
    baseline is not trusted that run (Fabric's FSDP2 loop: the optimizer's live peak 973,220 B for 907,168 once).
    """
    found = []
    for rank, record in enumerate(ranks):
        advice = {entry[0]: entry[1:] for entry in record["advice"]}
        if advice["inplace-activations"][0] != "simulated":
            found.append((rank, record["skipped"]))
    return found


def test_each_fsdp1_rank_gets_simulated_advice_with_its_saving(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    out, first = runs
    (out / "advice").mkdir()
    measure = lambda path: first if path == out / "advice" else monitored(path)  # noqa: E731  # the module's run first
    assert measured_again_where_missed(out / "advice", measure, unsimulated, lambda miss: miss[0]) == []
    again = out / "advice" / "again"
    ranks = [read(again / f"rank{rank}.json") for rank in range(WORLD_SIZE)] if again.exists() else first
    for rank, record in enumerate(ranks):
        assert [discarded for _change, discarded in record["variants"]] == [None] * len(record["variants"]), rank
    check_inplace_advice(ranks, BATCH, WIDTH)


def test_fsdp1_ranks_train_the_same_with_and_without_the_monitor(
    runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    out = runs[0]
    run(SCRIPT, tmp_path, "no-monitor")
    assert trained_apart(out, tmp_path) == []


def test_fsdp1_ranks_agree_on_their_own_preflight_predictions(tmp_path: Path) -> None:
    run(SCRIPT, tmp_path, f"preflight={TIGHT}")
    check_preflight_agreed(tmp_path, NOTE, TIGHT, "VramSession")


def test_fsdp1_ranks_with_their_original_parameters_replay_and_train_the_same(tmp_path: Path) -> None:
    # use_orig_params=True: the original parameters stay registered, each a view of the rank's flat shard; the
    # replay's copy holds each whole, and the optimizer steps them.
    monitored_out, bare = tmp_path / "monitored", tmp_path / "bare"
    ranks = monitored(monitored_out, "orig")
    for record in ranks:
        assert record["notes"][-1] == NOTE
        advice = {entry[0]: entry[1:] for entry in record["advice"]}
        assert advice["inplace-activations"][1] > 0
    measure = lambda path: ranks if path == monitored_out else monitored(path, "orig")  # noqa: E731
    assert measured_again_where_missed(monitored_out, measure, misses, lambda miss: miss[:2]) == []
    (simulated := monitored_out / "advice").mkdir()
    measure = lambda path: ranks if path == simulated else monitored(path, "orig")  # noqa: E731
    assert measured_again_where_missed(simulated, measure, unsimulated, lambda miss: miss[0]) == []
    bare.mkdir()
    run(SCRIPT, bare, "no-monitor", "orig")
    assert trained_apart(monitored_out, bare) == []

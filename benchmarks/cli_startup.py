"""How long the ``lightning-vram`` command takes to answer ``--help`` and ``--version``, beside ``python -c pass``.

Each command runs in a fresh interpreter (``sys.executable -m lightning_vram.cli ...``), as a person's shell starts
it; the commands are interleaved round by round so that a load on the machine falls on each alike. Printed: the
median wall time over the rounds, with the range, in seconds, and each command's time over the bare interpreter's.
Printed, not asserted: ``tests/test_cli_startup.py`` checks what the command imports.

    python benchmarks/cli_startup.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "lightning-vram --help": [sys.executable, "-m", "lightning_vram.cli", "--help"],
    "lightning-vram --version": [sys.executable, "-m", "lightning_vram.cli", "--version"],
    "lightning-vram diff --help": [sys.executable, "-m", "lightning_vram.cli", "diff", "--help"],
}
"""What is timed, by the name printed."""


def wall_seconds(command: list[str]) -> float:
    """The wall time of one run of ``command``, which must succeed."""
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    """Time each command over the rounds and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10, help="runs of each command (default 10)")
    rounds = parser.parse_args().rounds
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, command in COMMANDS.items():
            times[name].append(wall_seconds(command))
    bare = statistics.median(times["python -c pass"])
    print(f"median wall time over {rounds} runs each ({sys.executable})")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(
            f"  {name:<28} {median:.3f} s  (range {min(seconds):.3f}-{max(seconds):.3f} s;"
            f" {median - bare:+.3f} s over python -c pass)"
        )


if __name__ == "__main__":
    main()

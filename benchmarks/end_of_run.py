"""The end of a run's cost: a report's figures for one TensorBoard writer and its three files, from a report file.

Runs what the monitor runs once training ends (``Sinks.publish``: each figure drawn, sent to the writer, the JSON,
Markdown and HTML files written), on reports read back from JSON: by default the CUDA fixture of the last release;
pass the ``vram_report.json`` of a run of yours (the quickstart's, a GPT-2's). Prints seconds, median over rounds.

    python benchmarks/end_of_run.py [REPORT.json ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from lightning_vram._guard import Guard
from lightning_vram.codec import report_from_dict
from lightning_vram.render.files import as_location
from lightning_vram.render.publishers.tensorboard import TensorBoardPublisher
from lightning_vram.session.sinks import Sinks

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "data" / "reports" / "0.10.0" / "cuda.json"


def publish_seconds(path: Path) -> float:
    """Seconds to publish the report in ``path`` to a fresh TensorBoard writer and folder."""
    report = report_from_dict(json.loads(path.read_text()))
    with tempfile.TemporaryDirectory() as root:
        writer = SummaryWriter(root)
        sinks = Sinks(Guard(), [TensorBoardPublisher(writer=writer)], console_summary=False)
        start = time.perf_counter()
        sinks.publish(report, as_location(Path(root)), lambda: (), 1)
        seconds = time.perf_counter() - start
        writer.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="*", type=Path, default=[FIXTURE])
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    publish_seconds(arguments.reports[0])  # warm-up: matplotlib's import and font cache
    for path in arguments.reports:
        seconds = [publish_seconds(path) for _ in range(arguments.rounds)]
        print(f"{path}: {statistics.median(seconds):.2f} s [{min(seconds):.2f} - {max(seconds):.2f}]")


if __name__ == "__main__":
    main()

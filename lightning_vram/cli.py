"""``lightning-vram``: show, render or compare the reports a VramMonitor wrote.

    lightning-vram show PATH [--json]   the summary of a report (PATH: vram_report.json or the log dir holding it;
                                        see :func:`find_report`), or its JSON in today's schema
    lightning-vram html PATH -o FILE    the report as a standalone HTML page (``-o -``: on standard output)
    lightning-vram diff A B             what changed from run A to run B: peak and its parts, settings, timing,
                                        advice, and A's predictions for the changes B applied
    lightning-vram allocator SNAPSHOT [--capacity SIZE] [--json]
                                        a memory snapshot torch wrote, replayed through the caching allocator
                                        model: the recorded and the simulated reserved peak, and what other
                                        allocator settings would have held; with --capacity (bytes, or 40GiB,
                                        80GB), whether the run and each setting would have fit in that much;
                                        exits 1 when, at the memory judged, no setting serves the run
    lightning-vram plan MODULE [--batch DESCRIPTION] [--gpu NAME|BYTES ...] [--gpus N ...] [--nodes N]
                       [--strategy NAME ...] [--precision NAME ...] [--global-batch N] [--json]
                                        which GPUs, how many, which strategy and settings fit a LightningModule's
                                        step, and how fast, predicted without training: a table, best first;
                                        exits 0 when a configuration fits, 1 when none does,
                                        3 when none could be predicted
    lightning-vram --version

The command starts without importing torch, Lightning or matplotlib, nor the records: each command imports what it
needs (the HTML page alone needs matplotlib), so that ``--help`` and ``--version`` answer at once.

Every report written under schema ``lightning_vram.report/1`` reads, from 0.1.0 on: a field added by a later release
takes its default where a file lacks it (listed in :func:`lightning_vram.codec.report_from_dict`).
``plan`` exits 1 when no configuration fits, so that ``lightning-vram plan ... && sbatch train.sh`` runs only a job
that fits, and 3 when none could be predicted (the step failed under fake tensors, or reads a tensor's value: its
first line says why); a module that cannot be imported or built, a batch description or a GPU that is not one,
prints one line on stderr and exits with status 2.
A missing path, or a file that is not a report (not a regular file, too large, not UTF-8 JSON, or a field missing,
of the wrong type or out of range), prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from lightning_vram._version import __version__
from lightning_vram.render.json_text import indented_json
from lightning_vram.render.markup import printable
from lightning_vram.units import format_bytes, parse_size

if TYPE_CHECKING:
    from lightning_vram.records import Report

STARTED = time.perf_counter()
"""When the command started (the module's import): ``plan``'s budget counts from it."""
USAGE_ERROR = 2
NOTHING_FITS = 1
"""``plan``'s status when no configuration fits."""
NOTHING_PREDICTED = 3
"""``plan``'s status when no configuration could be predicted (the step failed under fake tensors, or reads a
tensor's value): nothing was weighed, so neither "fits" nor "none fits" is known."""
COMMAND_BUDGET_SECONDS = 45.0
"""``plan``'s default budget for the whole command, seconds: it prints within a minute on two loaded cores."""
MIN_PLAN_SECONDS = 5.0
"""The least ``plan()`` is given where imports and the module's construction took the command's budget."""
STANDARD_OUTPUT = Path("-")
"""The output path that means standard output."""
MAX_REPORT_BYTES = 128 * 1024**2
"""Above the largest report the monitor writes (its ``recent_steps`` <= 10**6 recent peaks take at most 80 MiB, the
rest a few MiB); a larger file is not one, and is not read into memory."""
SEARCH_DEPTH = 4
"""How many directory levels below a given directory are searched for a report (Lightning writes it two down:
``lightning_logs/version_N``)."""
SEARCH_DIRECTORIES = 10_000
"""How many directories are searched at most, so that ``show ~`` answers in a moment."""
MAX_MESSAGE_CHARACTERS = 1000
MAX_INTEGER_DIGITS = 19
"""No field holds more (integers are int64); longer ones are refused before Python converts them."""
MIN_CAPACITY_BYTES = 2**20
MAX_CAPACITY_BYTES = 2**50
"""``allocator --capacity``'s range, bytes: 1 MiB to 1 PiB, as ``plan --gpu`` takes a GPU's memory in bytes."""


class CommandError(Exception):
    """A problem with the user's input, reported in one line."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _parse_int(text: str) -> int:
    if len(text) > MAX_INTEGER_DIGITS and len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _read_text(path: Path) -> str:
    """The file's text: a regular file of at most :data:`MAX_REPORT_BYTES`, in UTF-8.

    Opened without blocking and checked on the open file, so a FIFO or a device is refused, never waited on.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(descriptor, "rb") as file:
            status = os.fstat(file.fileno())
            if not stat.S_ISREG(status.st_mode):
                raise CommandError(f"{path}: not a regular file")
            if status.st_size > MAX_REPORT_BYTES:
                raise CommandError(f"{path}: {format_bytes(status.st_size)} is too large for a report")
            data = file.read(MAX_REPORT_BYTES + 1)
    except FileNotFoundError as error:
        raise CommandError(f"{path}: no such file or directory") from error
    except OSError as error:
        raise CommandError(f"{path}: {error.strerror or error}") from error
    if len(data) > MAX_REPORT_BYTES:
        raise CommandError(f"{path}: too large for a report")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CommandError(f"{path}: not UTF-8 text (byte {error.start})") from error


VERSION_PREFIX = "version_"
"""Lightning's loggers write run ``N`` of a logger to ``<save_dir>/<name>/version_N``, the monitor's report with it."""


@dataclass(frozen=True)
class _Found:
    """A report found below the directory given: its path, the ``N`` of its ``version_N`` folder (-1: none), mtime."""

    path: Path
    version: int
    mtime: float

    @property
    def key(self) -> tuple[int, float, str]:
        """The order the reports are chosen in: the highest version, then the newest, then the path."""
        return (self.version, self.mtime, str(self.path))


def _version(folder: str) -> int:
    """The ``N`` of a folder named ``version_N`` (Lightning's numbering of a logger's runs); -1 for any other name.

    >>> _version("version_12"), _version("version_x"), _version("run-a")
    (12, -1, -1)
    """
    number = folder.removeprefix(VERSION_PREFIX)
    return int(number) if folder.startswith(VERSION_PREFIX) and number.isdigit() else -1


def _nearest_reports(directory: Path) -> tuple[list[_Found], int]:
    """The reports in the directories nearest below ``directory`` that hold any, and how many levels down they are.

    Level by level, up to :data:`SEARCH_DEPTH` levels and :data:`SEARCH_DIRECTORIES` directories; links to
    directories are not followed (no loops), unreadable directories are skipped, a dangling link is no report (a
    FIFO is one, refused when read).
    """
    from lightning_vram.render.files import JSON_FILENAME

    level, searched = [directory], 0
    for depth in range(SEARCH_DEPTH + 1):
        found: list[_Found] = []
        below: list[Path] = []
        for folder in level:
            searched += 1
            with contextlib.suppress(OSError), os.scandir(folder) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):  # a file gone since, or not readable: not a report
                        if entry.name == JSON_FILENAME and not entry.is_dir():
                            found.append(_Found(Path(entry.path), _version(folder.name), entry.stat().st_mtime))
                        elif entry.is_dir(follow_symlinks=False):
                            below.append(Path(entry.path))
            if searched >= SEARCH_DIRECTORIES:
                return found, depth
        if found:
            return found, depth
        level = sorted(below)
    return [], SEARCH_DEPTH


def find_report(directory: Path, notices: list[str] | None = None) -> Path:
    """The report a directory stands for: its own ``vram_report.json``, else the one run below it.

    Without one of its own, the reports nearest below it (fewest levels down: a run's report beats a run nested
    inside it) are taken, up to :data:`SEARCH_DEPTH` levels; of several, the one in the highest ``version_N`` folder
    (Lightning's latest run of a logger), then the newest by modification time. The file taken is printed on
    stderr, or added to ``notices`` for the caller to print once every argument has been read (bad input then prints
    its one line, and nothing else).
    """
    from lightning_vram.render.files import JSON_FILENAME

    own = directory / JSON_FILENAME
    if os.path.exists(own) and not os.path.isdir(own):  # a dangling link is none; a FIFO is, refused when read
        return own
    found, depth = _nearest_reports(directory)
    if not found:
        raise CommandError(f"{directory}: no {JSON_FILENAME} in this directory or {SEARCH_DEPTH} levels below it")
    ranked = sorted(found, key=lambda report: report.key, reverse=True)
    chosen = ranked[0].path
    why = ""
    if len(ranked) > 1:
        rule = "highest version_N" if ranked[0].version > ranked[1].version else "newest"
        levels = f"{depth} level{'s' if depth > 1 else ''}"
        why = f" (the {rule} of {len(ranked)} reports {levels} below {directory})"
    notice = one_line(f"lightning-vram: reading {chosen}{why}")
    if notices is None:
        _print(notice, sys.stderr)  # on stderr, so that the output stays the report's
    else:
        notices.append(notice)
    return chosen


def _not_json(text: str, error: json.JSONDecodeError) -> str:
    """Why ``text`` is not JSON, in words: empty, truncated (it ends inside a value), or where it is wrong.

    >>> _not_json('{"steps": 3, "ph', json.JSONDecodeError("Unterminated string starting at", '{"steps": 3, "ph', 13))
    'the file ends early: truncated (16 bytes)'
    """
    if not text.strip():
        return "not JSON (the file is empty)"
    if error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string"):
        return f"the file ends early: truncated ({len(text.encode()):,} bytes)"
    return f"not JSON ({error.msg} at line {error.lineno})"


def load_report(path: Path, notices: list[str] | None = None) -> Report:
    """The report at ``path``: a ``vram_report.json`` or a directory standing for one (:func:`find_report`).

    ``notices``: as :func:`find_report` takes them.
    """
    from lightning_vram.codec import FormatError, report_from_dict

    if path.is_dir():
        path = find_report(path, notices)
    text = _read_text(path)
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_int=_parse_int)
    except json.JSONDecodeError as error:
        raise CommandError(f"{path}: {_not_json(text, error)}") from error
    except RecursionError as error:
        raise CommandError(f"{path}: not a report (nested too deeply)") from error
    except ValueError as error:  # Infinity/NaN, or an integer too long
        raise CommandError(f"{path}: not a report ({error})") from error
    try:
        return report_from_dict(data)
    except FormatError as error:
        raise CommandError(f"{path}: {error}") from error


def one_line(message: str, limit: int = MAX_MESSAGE_CHARACTERS) -> str:
    r"""``message`` as one printable line: control characters escaped, at most ``limit`` characters.

    >>> print(one_line("a\nb\x1b[31m"))
    a\nb\x1b[31m
    """
    text = printable(message)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _print(text: str, stream: TextIO, end: str = "\n") -> None:
    """Print ``text``; characters the stream's encoding lacks are written as escapes, never an error."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    print(text.encode(encoding, errors="backslashreplace").decode(encoding), file=stream, end=end)


def _path(text: str) -> Path:
    """A path argument; an empty one (``""``, which ``Path`` reads as the current directory) is refused."""
    if not text:
        raise argparse.ArgumentTypeError("must be a file or directory, got an empty path ('')")
    return Path(text)


def _parser() -> argparse.ArgumentParser:
    """The command line: ``show``, ``html``, ``diff``, ``allocator``, each with its arguments' help; ``--version``."""
    parser = argparse.ArgumentParser(prog="lightning-vram", description="Show, render or compare VRAM reports.")
    parser.add_argument("--version", action="version", version=f"lightning-vram {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print the summary of a report", description="Print a report's summary.")
    show.add_argument("path", type=_path, help="vram_report.json, or a log dir holding one")
    show.add_argument("--json", action="store_true", help="print the report's JSON instead, in today's schema")
    page = commands.add_parser(
        "html", help="render a report as a standalone HTML page", description="Render a report as an HTML page."
    )
    page.add_argument("path", type=_path, help="vram_report.json, or a log dir holding one")
    page.add_argument("-o", "--output", type=_path, required=True, help="the HTML file to write ('-': standard output)")
    diff = commands.add_parser(
        "diff",
        help="compare two runs' reports",
        description="What changed from run A to run B: peak and its parts, settings, timing, advice, and the peak"
        " A's replay predicted for a change B applied.",
    )
    diff.add_argument("before", type=_path, metavar="A", help="run A's vram_report.json, or a log dir holding one")
    diff.add_argument("after", type=_path, metavar="B", help="run B's vram_report.json, or a log dir holding one")
    allocator = commands.add_parser(
        "allocator",
        help="replay a memory snapshot through the caching allocator model",
        description="Replay a memory snapshot torch wrote (torch.cuda.memory._dump_snapshot(), or the monitor's"
        " vram_oom_snapshot.pickle) through a model of PyTorch's CUDA caching allocator: the reserved peak it"
        " recorded and the one simulated, and what expandable_segments:True and max_split_size_mb would have held"
        " (with no memory limit: the snapshot holds none); for a run that ran out of memory (judged at its last oom"
        " event: torch caught the earlier ones, as cuDNN's workspace trials, and the run went on), whether each would"
        " have served the failed request in the memory the run had, or in --capacity's. Exits 1 when, at that"
        " memory, neither the run's settings nor any other would have served it.",
    )
    allocator.add_argument("snapshot", type=_path, metavar="SNAPSHOT", help="a pickled memory snapshot with a trace")
    allocator.add_argument(
        "--capacity",
        metavar="SIZE",
        help="judge at this much device memory: would the run, and each setting, have fit on a smaller or larger"
        " card (fits, or out of memory at which request)? Bytes, or a number with a unit: 40GiB, 80GB, 1.5TiB"
        " (GB = 10^9 B, GiB = 2^30 B); from 1 MiB to 1 PiB. The allocator's share, as torch.cuda.mem_get_info()'s"
        " free memory at the start: a card's total less what the CUDA context and other processes hold. Default:"
        " the memory the run had, where it ran out",
    )
    allocator.add_argument("--json", action="store_true", help="print the figures as JSON")
    _plan_parser(commands)
    return parser


def _plan_parser(commands: Any) -> None:
    """``plan``'s arguments."""
    plan = commands.add_parser(
        "plan",
        help="which GPUs, how many and which strategy fit a LightningModule, and how fast",
        description="Replay a LightningModule's training step under fake tensors for every configuration (GPU x"
        " count x strategy x precision x checkpointing x micro-batch x accumulation) and print each rank's predicted"
        " peak, whether it fits, the step time and throughput, best first. Exits 0 when a configuration fits, 1 when"
        " none does, 3 when none could be predicted (the step failed under fake tensors), 2 on bad input.",
    )
    plan.add_argument("module", metavar="MODULE", help="package.module:ClassName or path/to/file.py:ClassName")
    plan.add_argument(
        "--init-kwargs", metavar="JSON", help="keyword arguments to build the module with (a JSON object)"
    )
    plan.add_argument(
        "--batch",
        metavar="DESCRIPTION",
        help="the batch as dtype[sizes] items: 'float32[64,3,32,32] int64[64]' (a tuple), 'x=float32[8,16] y=int64[8]'"
        " (a dict), one item (a tensor), one item and a comma (a tuple of one); default: the module's"
        " example_input_array, else --datamodule's (or the module's own) first training batch",
    )
    plan.add_argument("--datamodule", metavar="CLASS", help="a LightningDataModule (package.module:ClassName)")
    plan.add_argument(
        "--gpu",
        action="append",
        metavar="NAME|BYTES",
        help="a GPU (repeat for several): a common GPU's name or part"
        " of it ('T4', 'A100 80GB', 'H200') or its memory in bytes; default: every common GPU",
    )
    plan.add_argument(
        "--gpus", action="append", type=int, metavar="N", help="GPUs in all (repeat for several); default: 1 2 4 8"
    )
    plan.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    plan.add_argument("--strategy", action="append", metavar="NAME", help="a multi-GPU strategy (repeat); default: all")
    plan.add_argument("--precision", action="append", metavar="NAME", help="default: 32-true and bf16-mixed")
    plan.add_argument(
        "--checkpointing", choices=("both", "on", "off"), default="both", help="activation checkpointing (default both)"
    )
    plan.add_argument("--global-batch", type=int, metavar="N", help="samples per optimizer step over every GPU")
    plan.add_argument(
        "--budget",
        type=float,
        default=COMMAND_BUDGET_SECONDS,
        metavar="SECONDS",
        help="host seconds for the whole command, imports and building the module included (default 45): the"
        " configurations not reached are listed as left out",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def _show(arguments: argparse.Namespace) -> None:
    """``show``: the report's summary, or with ``--json`` its JSON as read back and written again."""
    path = find_report(arguments.path) if arguments.path.is_dir() else arguments.path
    report = load_report(path)
    if arguments.json:
        from lightning_vram.codec import report_to_dict

        _print(indented_json(report_to_dict(report)), sys.stdout)
        return
    from lightning_vram.render.files import MARKDOWN_FILENAME
    from lightning_vram.render.text import DETAILS, summary_text

    beside = path.with_name(MARKDOWN_FILENAME)
    _print(summary_text(report, details=str(beside) if beside.is_file() else DETAILS), sys.stdout)


def _html(arguments: argparse.Namespace) -> None:
    """``html``: the report's page, written to the output file (``-``: standard output)."""
    from lightning_vram.render.html import render_html

    page = render_html(load_report(arguments.path))
    if arguments.output == STANDARD_OUTPUT:
        _print(page, sys.stdout, end="")
        return
    try:
        arguments.output.write_bytes(page.encode("utf-8", errors="backslashreplace"))
    except OSError as error:
        raise CommandError(f"{arguments.output}: {error.strerror or error}") from error
    _print(f"wrote {arguments.output}", sys.stdout)


def _diff(arguments: argparse.Namespace) -> None:
    """``diff``: what changed from run A to run B."""
    from lightning_vram.render.diff import diff_text

    notices: list[str] = []
    before, after = load_report(arguments.before, notices), load_report(arguments.after, notices)
    for notice in notices:
        _print(notice, sys.stderr)
    _print(diff_text(before, after), sys.stdout)


def _allocator(arguments: argparse.Namespace) -> int:
    """``allocator``: a snapshot's trace replayed through the allocator model, with other settings beside it.

    Returns 0, or :data:`NOTHING_FITS` where a capacity is judged at (``--capacity``, or the memory of a run that ran
    out) and neither the run's settings nor any other serves the whole trace there.
    """
    from lightning_vram.prediction.allocator.snapshot import SnapshotError, read_snapshot, trace_from_snapshot
    from lightning_vram.prediction.allocator.what_if import what_if
    from lightning_vram.render.allocator import allocator_dict, allocator_text

    capacity = _capacity(arguments.capacity)
    try:
        trace = trace_from_snapshot(read_snapshot(arguments.snapshot))
    except SnapshotError as error:
        message = str(error)
        prefix = "" if message.startswith(str(arguments.snapshot)) else f"{arguments.snapshot}: "
        raise CommandError(prefix + message) from error
    result = what_if(trace, capacity)
    if arguments.json:
        _print(json.dumps(allocator_dict(result), indent=2), sys.stdout)
    else:
        _print(allocator_text(result), sys.stdout)
    verdicts = [result.simulated_fits, *(alternative.fits for alternative in result.alternatives)]
    return NOTHING_FITS if result.capacity_bytes is not None and not any(verdicts) else 0


def _capacity(text: str | None) -> int | None:
    """``--capacity``: bytes, or a number with a unit (``40GiB``, ``80GB``); None where not given.

    >>> _capacity("40GiB"), _capacity("80GB"), _capacity(None)
    (42949672960, 80000000000, None)
    """
    if text is None:
        return None
    found = parse_size(text)
    if found is None or not MIN_CAPACITY_BYTES <= found <= MAX_CAPACITY_BYTES:
        raise CommandError(
            "--capacity must be the device memory to judge at: bytes from 1 MiB to 1 PiB, as an integer or a number"
            f" with a unit (40GiB, 80GB), got {text!r}"
        )
    return found


def _plan(arguments: argparse.Namespace) -> int:
    """``plan``: the configurations' table (or JSON); 0 when one fits, :data:`NOTHING_FITS` when none does.

    The arguments' syntax is checked first, before torch and the module are imported (many seconds).
    """
    _check_plan_syntax(arguments)
    from lightning_vram.plan_inputs import file_directories

    checkpointing = {"both": (False, True), "on": (True,), "off": (False,)}[arguments.checkpointing]
    # A file's directory stays on sys.path while the plan replays its steps: they may import a neighbour too.
    with file_directories(arguments.module, arguments.datamodule):
        return _planned(arguments, checkpointing)


def _planned(arguments: argparse.Namespace, checkpointing: tuple[bool, ...]) -> int:
    """``plan`` once the arguments' syntax is checked: build the module and batch, plan, print; the exit status."""
    from lightning_vram.plan import DEFAULT_WORLD_SIZES, plan
    from lightning_vram.plan_inputs import PlanInputError, build_module, load_class, parse_batch

    try:
        module = build_module(load_class(arguments.module, "MODULE"), arguments.init_kwargs, "MODULE")
        batch = None if arguments.batch is None else parse_batch(arguments.batch, "--batch")
        datamodule = None
        if arguments.datamodule is not None:
            datamodule = _build_datamodule(load_class(arguments.datamodule, "--datamodule"))
        result = plan(
            module,
            batch,
            datamodule=datamodule,
            gpus=arguments.gpu,
            world_sizes=arguments.gpus or DEFAULT_WORLD_SIZES,
            nodes=arguments.nodes,
            strategies=arguments.strategy,
            precisions=arguments.precision or ("32-true", "bf16-mixed"),
            checkpointing=checkpointing,
            global_batch=arguments.global_batch,
            budget_seconds=max(arguments.budget - (time.perf_counter() - STARTED), MIN_PLAN_SECONDS),
        )
    except PlanInputError as error:
        raise CommandError(_named(error)) from error
    _print(json.dumps(result.to_dict(), indent=2) if arguments.json else str(result), sys.stdout)
    if not result.rows:
        return NOTHING_PREDICTED
    return 0 if result.fits else NOTHING_FITS


def _check_plan_syntax(arguments: argparse.Namespace) -> None:
    """What can be refused without torch: the batch's syntax, GPUs given in bytes, the counts, the budget."""
    from lightning_vram.plan_syntax import PlanInputError, batch_items, check_count, check_split, gpu_bytes
    from lightning_vram.records.strategy import MAX_WORLD_SIZE

    try:
        if arguments.batch is not None:
            batch_items(arguments.batch, "--batch")
        for gpu in arguments.gpu or ():
            gpu_bytes(gpu, "--gpu")
        for count in arguments.gpus or ():
            check_count(count, "--gpus", MAX_WORLD_SIZE, "hold ints")
        check_count(arguments.nodes, "--nodes", MAX_WORLD_SIZE)
        check_count(arguments.global_batch, "--global-batch", 10**9)
        check_split(arguments.global_batch, arguments.gpus or (), "--global-batch")
        if not 0 < arguments.budget < 86_400:  # NaN fails too
            raise PlanInputError(f"--budget must be a number of seconds > 0 and under a day, got {arguments.budget!r}")
    except PlanInputError as error:
        raise CommandError(str(error)) from error


def _build_datamodule(cls: type) -> Any:
    """An instance of a datamodule class, built with no arguments; a TypeError or ValueError is a bad argument."""
    from lightning_vram.plan_inputs import PlanInputError

    try:
        return cls()
    except (TypeError, ValueError) as error:  # arguments it needs, or refuses; its other errors are its own
        raise PlanInputError(f"--datamodule {cls.__name__}() raised {type(error).__name__}: {error}") from None


_OPTIONS = {
    "gpus": "--gpu",
    "world_sizes": "--gpus",
    "nodes": "--nodes",
    "strategies": "--strategy",
    "precisions": "--precision",
    "global_batch": "--global-batch",
    "budget_seconds": "--budget",
    "batch": "--batch",
}
"""plan()'s argument names as the command line spells them, for its error messages."""


def _named(error: Exception) -> str:
    """``plan()``'s message with its argument named as the command line names it."""
    message = str(error)
    first, _, rest = message.partition(" ")
    return f"{_OPTIONS[first]} {rest}" if first in _OPTIONS else message


COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {
    "show": _show,
    "html": _html,
    "diff": _diff,
    "allocator": _allocator,
    "plan": _plan,
}
"""Each command and the function that runs it (``None`` returned: status 0)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status.

    0; 1 from ``plan`` and ``allocator``: none fits; 3 from ``plan``: none predicted; 2: bad input.
    """
    arguments = _parser().parse_args(argv)
    status = 0
    try:
        status = COMMANDS[arguments.command](arguments) or 0
        # Into a pipe, standard output is block-buffered unless PYTHONUNBUFFERED is set (it is not under `env -i` or
        # cron): flushed here, a reader gone away is met below, not in Python's flush at exit.
        sys.stdout.flush()
    except CommandError as error:
        _print(one_line(f"lightning-vram: error: {error}"), sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say, and no traceback at exit
        _silence_stdout()
    return status


def _silence_stdout() -> None:
    """Point standard output at the null device, so that Python's flush at exit does not fail on the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())

"""Writes the report's files (``vram_report.json``, ``.md``, ``.html``) and the OOM diagnosis's files.

Each file is rendered and written on its own, so that one that fails (a figure that cannot be drawn, a full disk)
does not stop the others; :class:`FilesNotWritten` then names what failed and what was written. Each file appears
whole or not at all: on a local disk it is written to a temporary file in the same directory and renamed over the
target; on a remote filesystem (``s3://``, ``gs://``, ``memory://``: any URL fsspec knows, as Lightning's loggers
take them) it is uploaded in one piece, which object stores make visible only once complete.

A local directory is a :class:`~pathlib.Path`; a remote one stays the URL string it was given (pathlib would turn
``s3://bucket/runs`` into the local relative path ``s3:/bucket/runs``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeAlias

from lightning_vram.records import OomDiagnosis, Report
from lightning_vram.render.json_text import indented_json
from lightning_vram.render.text import markdown, oom_markdown

JSON_FILENAME = "vram_report.json"
MARKDOWN_FILENAME = "vram_report.md"
HTML_FILENAME = "vram_report.html"
OOM_STEM = "vram_oom_report"
SNAPSHOT_STEM = "vram_oom_snapshot"

Location: TypeAlias = "Path | str"
"""A local path, or the URL of a file or directory on a remote filesystem."""
Render = Callable[[], bytes]
"""Renders one file's content (called only when that file is written)."""

_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]+)://")
_LOCAL_PROTOCOLS = ("file", "local")


def as_location(path: str | os.PathLike[str]) -> Location:
    """A local path as a :class:`~pathlib.Path`; the URL of another filesystem kept as the string it is.

    >>> as_location("runs/x"), as_location("s3://bucket/runs"), as_location("file:///tmp/runs")
    (PosixPath('runs/x'), 's3://bucket/runs', PosixPath('/tmp/runs'))
    """
    text = os.fspath(path)
    match = _URL.match(text)
    if match is None:
        return Path(text)
    if match.group("protocol").lower() in _LOCAL_PROTOCOLS:
        return Path(text[match.end() :])
    return text


def join(directory: Location, name: str) -> Location:
    """The location of ``name`` in ``directory``.

    >>> join("memory://runs/", "vram_report.json"), join(Path("runs"), "vram_report.json")
    ('memory://runs/vram_report.json', PosixPath('runs/vram_report.json'))
    """
    if isinstance(directory, Path):
        return directory / name
    return f"{directory.rstrip('/')}/{name}"


class FilesNotWritten(Exception):
    """Some files could not be written; the others were. ``json_path``: the JSON file's location, if written."""

    def __init__(self, directory: Location, failed: Sequence[tuple[str, BaseException]], written: Sequence[str]):
        self.directory = directory
        self.failed = tuple(failed)
        self.written = tuple(written)
        self.json_path: Location | None = next(
            (join(directory, name) for name in self.written if name.endswith(".json")), None
        )
        reasons = "; ".join(f"{name}: {_reason(error)}" for name, error in self.failed)
        wrote = f" ({', '.join(self.written)} written)" if self.written else ""
        super().__init__(f"not written to {directory}: {reasons}{wrote}")


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return " ".join(f"{type(error).__name__}: {error}".split())


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to the local file ``path``: whole or not at all, even when the disk fills up part-way.

    The bytes go to a temporary file beside ``path`` (same directory, so the same filesystem), are flushed to disk,
    and the temporary file is renamed over ``path``; on any error it is removed and ``path`` is left as it was.
    """
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            _flush_to_disk(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):  # already gone, or the directory refuses even that
            os.unlink(temporary)
        raise


def _flush_to_disk(descriptor: int) -> None:
    """``fsync``: an error the filesystem reports late (a full disk on NFS) surfaces before the rename."""
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # a filesystem without fsync: nothing to flush
            raise


def _write_remote(url: str, data: bytes) -> None:
    """Upload ``data`` to ``url`` in one piece, through the fsspec filesystem Lightning's loggers write with."""
    from lightning.fabric.utilities.cloud_io import get_filesystem  # imported only for remote log dirs

    get_filesystem(url).pipe_file(url, data)


def _make_directory(directory: Location) -> None:
    if isinstance(directory, Path):
        directory.mkdir(parents=True, exist_ok=True)
        return
    from lightning.fabric.utilities.cloud_io import get_filesystem

    get_filesystem(directory).makedirs(directory, exist_ok=True)


def write_file(path: Location, data: bytes) -> None:
    """Write one file whole: atomically on a local disk, in one upload on a remote filesystem."""
    if isinstance(path, Path):
        write_atomically(path, data)
    else:
        _write_remote(path, data)


def write_files(directory: Location, files: Sequence[tuple[str, Render]]) -> None:
    """Render and write each ``(name, render)`` into ``directory`` (created if needed), each on its own.

    Raises:
        FilesNotWritten: after trying every file, when any could not be rendered or written (or the directory
            could not be created); it names each failure and the files that were written.
    """
    try:
        _make_directory(directory)
    except Exception as error:  # a file in the way, no permission, fsspec without the protocol's package
        raise FilesNotWritten(directory, [(", ".join(name for name, _ in files), error)], []) from error
    failed: list[tuple[str, BaseException]] = []
    written: list[str] = []
    for name, render in files:
        try:
            write_file(join(directory, name), render())
        except Exception as error:  # noqa: BLE001 -- one file's failure must not stop the others; all are reported
            failed.append((name, error))
        else:
            written.append(name)
    if failed:
        raise FilesNotWritten(directory, failed, written) from failed[0][1]


def _text(render: Callable[[], str]) -> Render:
    # A user's string can hold lone surrogates (they have no UTF-8 form): written as escapes, not refused.
    return lambda: render().encode("utf-8", errors="backslashreplace")


def _html(report: Report, pngs: Mapping[str, bytes] | None) -> str:
    """The report's HTML page; the renderer (matplotlib) is imported here, so that reading a report needs none."""
    from lightning_vram.render.html import render_html

    return render_html(report, pngs)


def write_report_files(report: Report, directory: Location, pngs: Mapping[str, bytes] | None = None) -> Location:
    """Write the JSON, Markdown and HTML forms into ``directory`` (created if needed); returns the JSON's location.

    ``pngs``: the report's figures drawn already, by tag (:func:`~lightning_vram.render.figure_set.report_pngs`);
    by default the HTML page draws them.

    Raises:
        FilesNotWritten: some could not be written (its ``json_path`` says whether the JSON was).
    """
    write_files(
        directory,
        [
            (JSON_FILENAME, _text(lambda: indented_json(report.to_dict()) + "\n")),
            (MARKDOWN_FILENAME, _text(lambda: markdown(report))),
            (HTML_FILENAME, _text(lambda: _html(report, pngs))),
        ],
    )
    return join(directory, JSON_FILENAME)


def report_stem(stem: str, rank: int, world_size: int) -> str:
    """File stem for this rank: plain for one process, ``.rankN`` under distributed training.

    >>> report_stem("vram_oom_report", 1, 4), report_stem("vram_oom_report", 0, 1)
    ('vram_oom_report.rank1', 'vram_oom_report')
    """
    return f"{stem}.rank{rank}" if world_size > 1 else stem


def write_diagnosis(diagnosis: OomDiagnosis, directory: Location, world_size: int) -> Location:
    """Write ``vram_oom_report[.rankN].json`` and ``.md`` into ``directory``; returns the JSON's location.

    Raises:
        FilesNotWritten: as :func:`write_report_files`.
    """
    stem = report_stem(OOM_STEM, diagnosis.rank, world_size)
    data = diagnosis.to_dict()
    write_files(
        directory,
        [
            (f"{stem}.json", _text(lambda: indented_json(data) + "\n")),
            (f"{stem}.md", _text(lambda: oom_markdown(diagnosis))),
        ],
    )
    return join(directory, f"{stem}.json")

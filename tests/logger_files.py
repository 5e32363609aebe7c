"""Readers of what the loggers wrote, for the tests: W&B's transaction log, Comet's offline archive, CSV rows."""

from __future__ import annotations

import csv
import json
import struct
import zipfile
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

_BLOCK = 32768
_HEADER = 7  # a record's checksum (4 bytes), length (2) and type (1); the file starts with one 7-byte header too
_WHOLE, _LAST = 1, 4


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a run's ``run-<id>.wandb`` file, parsed with wandb's own protobuf classes.

    The file is a LevelDB-style log (wandb 0.31 reads it in its Go core, with no Python reader left): 32 KiB
    blocks of chunks, each with a 7-byte header; a record spans chunks FIRST, MIDDLE..., LAST, or is one FULL chunk.
    """
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending, records = _HEADER, b"", []
    while position + _HEADER <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        if kind == 0:
            break
        pending += data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        if kind in (_WHOLE, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records: list[wandb_internal_pb2.Record]) -> list[dict[str, Any]]:
    """Every history row (one ``log`` call) as ``{key: value}``; nested keys joined with ``/``."""
    return [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]


def comet_messages(directory: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages (one JSON object a line) and ``experiment.json`` of the one offline archive in ``directory``."""
    (archive,) = directory.glob("*.zip")
    with zipfile.ZipFile(archive) as opened:
        messages = [json.loads(line) for line in opened.read("messages.json").decode().splitlines() if line]
        return messages, json.loads(opened.read("experiment.json"))


def csv_rows(path: Path) -> list[dict[str, str]]:
    """``metrics.csv`` as dicts (an empty string where a row has no value)."""
    with path.open(newline="") as opened:
        return list(csv.DictReader(opened))

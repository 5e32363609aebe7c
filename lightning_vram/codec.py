"""The monitor's files read and written as plain data: the report (``vram_report.json``) and the OOM diagnosis.

This is the entry point for a reader of those files (the ``lightning-vram`` command, a user's script):
``report_from_dict(json.load(file))`` gives back the :class:`~lightning_vram.records.Report`, or a
:class:`FormatError` naming the field that is wrong. Each record's JSON form lives beside it in
:mod:`lightning_vram.records`; nothing inside the package below the command imports this module.
"""

from lightning_vram.records.json_reader import FormatError
from lightning_vram.records.oom import OOM_SCHEMA
from lightning_vram.records.report import SCHEMA, report_from_dict, report_to_dict

__all__ = ["OOM_SCHEMA", "SCHEMA", "FormatError", "report_from_dict", "report_to_dict"]

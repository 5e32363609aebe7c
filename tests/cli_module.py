"""``python tests/cli_module.py ARGS`` runs as ``python -m lightning_vram.cli ARGS`` does (``runpy``, as ``-m``):
for tests/preloaded_python.py's ``run_script``, which starts a script, not a module."""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("lightning_vram.cli", run_name="__main__", alter_sys=True)

"""Running a test's Python script as ``subprocess.run([sys.executable, script, ...])`` would, without its imports.

A new interpreter spends about 5.5 CPU seconds here importing torch, Lightning and DeepSpeed (4.8 s wall, idle)
before a small gloo run does anything: on an idle machine a 4-rank ZeRO run of tests/zero_fsdp1_ranks.py took 12.1 s
started so and 9.9 s forked from the server. :func:`run_script`
starts the script in a process forked from a server (Python's ``forkserver``) that imported them once, at its start,
in a fresh interpreter of its own: no test has run in it and no tensor op (so no thread pool of torch's exists to be
copied half-made). The child then looks to the script as a new interpreter would: its ``sys.argv``, its directory
first on ``sys.path`` with the ``PYTHONPATH`` it is given, the environment it is given, ``__main__`` its own module
(``multiprocessing``'s spawn start method finds the script there), its output in files read back, its exit status
from ``sys.exit`` or an uncaught exception, and ``atexit`` run at its end.

What it cannot reset: whatever torch, Lightning or DeepSpeed read from the environment while they were imported (the
server imports them with ``DS_ACCELERATOR=cpu``, as every DeepSpeed script of the tests sets it) and the warning
filters they installed then. A test of how the package itself starts (tests/test_cli_startup.py) starts a real
interpreter.

Python 3.11's forkserver is handed the parent's ``sys.path`` but does not apply it: it imports its preload from its
own working directory, and a module it cannot import is skipped without a word. Started from the repository's root
(as ``make test`` runs), it found no ``preloaded_imports``, so every run imported torch, Lightning and DeepSpeed
itself after all. :func:`run_script` starts the server with this directory on its ``PYTHONPATH``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import Mapping
from multiprocessing import forkserver
from pathlib import Path

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["preloaded_imports"])  # tests/preloaded_imports.py, from this directory


def run_script(
    script: Path,
    *arguments: str,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([sys.executable, script, *arguments], capture_output=True, text=True, ...)`` returns.

    ``env``: the whole environment (``os.environ`` where ``None``); ``cwd``: the working directory (this process's
    where ``None``); ``timeout``: seconds before the run is killed and :class:`subprocess.TimeoutExpired` raised.
    """
    if script.suffix != ".py" or not script.is_file():
        raise ValueError(f"script must be a Python file; got {script}")
    environment = dict(os.environ if env is None else env)
    _start_server()
    with tempfile.TemporaryDirectory(prefix="preloaded-run-") as directory:
        out, err = Path(directory) / "stdout", Path(directory) / "stderr"
        process = _context.Process(
            target=_as_interpreter,
            args=(str(script.resolve()), list(arguments), environment, str(cwd or Path.cwd()), str(out), str(err)),
        )
        process.start()
        process.join(timeout)
        command = [sys.executable, str(script), *arguments]
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(command, process.exitcode, out.read_text(), err.read_text())


def _start_server() -> None:
    """Start the forkserver (once) with this directory on its ``PYTHONPATH``, so that it imports its preload."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), before]))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _as_interpreter(
    script: str, arguments: list[str], environment: dict[str, str], cwd: str, out: str, err: str
) -> None:
    """In the forked child: run ``script`` as ``python script arguments`` would, then exit as it would."""
    for descriptor, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), descriptor)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    python_path = [entry for entry in environment.get("PYTHONPATH", "").split(os.pathsep) if entry]
    installed = [entry for entry in sys.path if entry.startswith((sys.prefix, sys.base_prefix, "__editable__"))]
    sys.path[:] = [os.path.dirname(script), *python_path, *installed]
    sys.argv = [script, *arguments]
    options = [option for option in environment.get("PYTHONWARNINGS", "").split(",") if option]
    warnings._processoptions(options)  # type: ignore[attr-defined]  # as the interpreter reads PYTHONWARNINGS
    main = types.ModuleType("__main__")
    main.__file__ = script
    sys.modules["__main__"] = main
    try:
        code = compile(Path(script).read_text(), script, "exec")
        exec(code, main.__dict__)
    finally:
        atexit._run_exitfuncs()

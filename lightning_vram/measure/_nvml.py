"""NVML sampling on a background timer: GPU utilization and this process's device memory.

NVML reports utilization as the percent of time one or more kernels ran over its own sample window
(1/6 s to 1 s), so it is sampled on a timer and averaged per interval, never read per step.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from dataclasses import dataclass
from types import ModuleType

from lightning_vram.records import UtilizationReading


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used here: no library, no driver, or the device was not found."""


def _load_pynvml() -> ModuleType:
    try:
        module: ModuleType = importlib.import_module("pynvml")
    except ImportError as error:
        raise NvmlUnavailableError(
            f"the NVML bindings are not installed ({error}); pip install nvidia-ml-py"
        ) from error
    except Exception as error:  # bindings that fail on import: NVML is unavailable, training goes on
        raise NvmlUnavailableError(f"the NVML bindings failed to load: {_describe(error)}") from error
    return module


def _describe(error: BaseException) -> str:
    """``error`` as one line naming its type, for a warning and the report's ``not_measured``.

    >>> _describe(OSError("libnvidia-ml.so.1: cannot open shared object file"))
    'OSError: libnvidia-ml.so.1: cannot open shared object file'
    """
    return f"{type(error).__name__}: {error}"


def normalise_uuid(uuid: str) -> str:
    """A device UUID without NVML's ``GPU-``/``MIG-`` prefix, lower case, for comparison.

    >>> normalise_uuid("GPU-ABCD-01")
    'abcd-01'
    """
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


@dataclass
class _Accumulator:
    utilization_sum: float = 0.0
    utilization_count: int = 0
    process_memory_bytes: int | None = None

    def mean(self) -> float | None:
        return self.utilization_sum / self.utilization_count if self.utilization_count else None


class NvmlSampler:
    """Samples one GPU through NVML every ``interval_seconds`` on a daemon thread.

    The device is found by UUID, so the mapping is right under ``CUDA_VISIBLE_DEVICES``
    (the NVML index is not the CUDA index there).
    """

    def __init__(self, device_uuid: str, interval_seconds: float) -> None:
        self._device_uuid = device_uuid
        self._interval_seconds = interval_seconds
        self._lock = threading.Lock()
        self._interval = _Accumulator()
        self._run = _Accumulator()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pynvml: ModuleType | None = None
        self._handle: object | None = None
        self.error: str | None = None

    def start(self) -> None:
        """Initialise NVML once, find the device, take a first sample and start sampling.

        Any failure of the bindings (``NVMLError`` or anything else they raise) leaves NVML released.

        Raises:
            NvmlUnavailableError: the bindings, the driver or the device are missing, or the first sample failed.
        """
        pynvml = _load_pynvml()
        try:
            pynvml.nvmlInit()
        except Exception as error:  # whatever the bindings raise, NVML is unavailable
            raise NvmlUnavailableError(f"NVML could not start: {_describe(error)}") from error
        self._pynvml = pynvml
        try:
            self._handle = self._find_handle(pynvml)
        except Exception as error:  # whatever the bindings raise, NVML is unavailable
            self._shutdown()
            raise NvmlUnavailableError(f"NVML could not list devices: {_describe(error)}") from error
        if self._handle is None:
            self._shutdown()
            raise NvmlUnavailableError(f"NVML has no device with UUID {self._device_uuid}")
        if not self._sample(before_run=True):
            self._shutdown()
            raise NvmlUnavailableError(self.error or "NVML sampling failed")
        self._thread = threading.Thread(target=self._loop, name="lightning-vram-nvml", daemon=True)
        self._thread.start()

    def _find_handle(self, pynvml: ModuleType) -> object | None:
        wanted = normalise_uuid(self._device_uuid)
        for nvml_index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            if normalise_uuid(uuid.decode() if isinstance(uuid, bytes) else uuid) == wanted:
                found: object = handle
                return found
        return None

    def _loop(self) -> None:
        """The thread: sample until stopped or until a sample fails (``error`` then says why). Never raises."""
        try:
            while not self._stop.wait(self._interval_seconds):
                if not self._sample():
                    return
        except Exception as error:  # noqa: BLE001 -- a dying sampler thread would print a traceback into training
            self.error = f"NVML sampling stopped: {_describe(error)}"

    def _sample(self, before_run: bool = False) -> bool:
        """Add one sample; ``False`` (with ``error`` set) when the bindings raised anything at all.

        ``before_run``: the sample :meth:`start` takes to check NVML. NVML's utilization covers its own last sample
        window (1/6 s to 1 s), the time before training there: it is read and not averaged (a run shorter than the
        sampling interval has no utilization, rather than the idle GPU's 0%); the process memory is kept.
        """
        pynvml = self._pynvml
        if pynvml is None:
            return False  # stopped meanwhile
        try:
            utilization = float(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            process_bytes = self._process_memory(pynvml)
        except Exception as error:  # noqa: BLE001 -- a dying sampler thread would print a traceback into training
            self.error = f"NVML sampling failed: {_describe(error)}"
            return False
        with self._lock:
            for accumulator in (self._interval, self._run):
                if not before_run:
                    accumulator.utilization_sum += utilization
                    accumulator.utilization_count += 1
                accumulator.process_memory_bytes = process_bytes
        return True

    def _process_memory(self, pynvml: ModuleType) -> int | None:
        pid = os.getpid()
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
            if process.pid == pid:
                used = process.usedGpuMemory
                return int(used) if used is not None else None
        return None  # another PID namespace (containers): NVML cannot tell which process is ours

    def take(self) -> UtilizationReading:
        """The mean utilization since the last ``take`` and the latest process memory."""
        with self._lock:
            reading = UtilizationReading(self._interval.mean(), self._interval.process_memory_bytes)
            self._interval = _Accumulator(process_memory_bytes=self._interval.process_memory_bytes)
        return reading

    def run_mean_percent(self) -> float | None:
        """Mean utilization over every sample since ``start``, in percent (``None`` before the first one)."""
        with self._lock:
            return self._run.mean()

    def stop(self) -> None:
        """Stop the thread and release NVML. Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._interval_seconds + 1)
            self._thread = None
        self._shutdown()

    def _shutdown(self) -> None:
        pynvml, self._pynvml = self._pynvml, None
        if pynvml is not None:
            # Already shut down elsewhere, or bindings failing at the end: nothing is left to measure or release.
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()

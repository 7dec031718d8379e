"""GPU figures from NVML (nvidia-ml-py, imported as pynvml).

NVML calls block, some for tens of milliseconds, so start() and sample() are meant to run
in a worker thread (asyncio.to_thread), never on the event loop. Neither raises on an NVML
fault: without a driver or a GPU the collector is off and samples nothing; a GPU whose
calls start failing is reported unhealthy while the others carry on, and is retried on
every sample, so it comes back by itself if the fault was transient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from loadmesh.gossip.snapshot import MAX_MIB, GpuLoad

_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuInfo:
    """A GPU's identity; it stays on this host (see gossip.snapshot on why)."""

    index: int
    uuid: str
    name: str


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes for strings.
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def unhealthy(index: int) -> GpuLoad:
    return GpuLoad(index, 0, 0, 0, 0, 0, 0, 0, 0, healthy=False)


class GpuCollector:
    """Reads every GPU NVML sees.

    nvml_module is the seam for tests: pynvml or any object with the same functions,
    constants and NVMLError class. None means pynvml, imported on start().
    """

    def __init__(self, nvml_module: Any | None = None) -> None:
        self._nvml: Any = nvml_module
        self._handles: list[Any | None] = []
        self._devices: list[GpuInfo] = []
        self._initialised = False
        self._health = ("off", "not started")

    @property
    def health(self) -> tuple[str, str]:
        """(state, reason): state "ok", "degraded" (some GPU failing) or "off"."""
        return self._health

    @property
    def devices(self) -> tuple[GpuInfo, ...]:
        """Identity of each GPU; uuid and name are empty until NVML could open it."""
        return tuple(self._devices)

    def start(self) -> None:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as e:
                self._health = ("off", f"nvidia-ml-py is not installed: {e}")
                return
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            self._health = ("off", f"NVML init failed: {e}")
            return
        self._initialised = True
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as e:
            self.close()
            self._health = ("off", f"cannot count GPUs: {e}")
            return
        if count == 0:
            self._health = ("off", "no GPU found")
            return
        self._handles = [None] * count
        self._devices = [GpuInfo(i, "", "") for i in range(count)]
        failures = []
        for i in range(count):
            try:
                self._open(i)
            except nvml.NVMLError as e:
                failures.append(f"gpu {i}: {e}")
        self._set_health(failures)

    def sample(self) -> list[GpuLoad]:
        """One GpuLoad per GPU, by index; empty when the collector is off."""
        nvml = self._nvml
        loads = []
        failures = []
        for i, handle in enumerate(self._handles):
            try:
                loads.append(self._read(i, handle if handle is not None else self._open(i)))
            except nvml.NVMLError as e:
                loads.append(unhealthy(i))
                failures.append(f"gpu {i}: {e}")
        if self._handles:
            self._set_health(failures)
        return loads

    def close(self) -> None:
        if not self._initialised:
            return
        self._initialised = False
        self._handles = []
        self._health = ("off", "stopped")
        # Shutting down anyway: an error here leaves nothing to do.
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()

    def _set_health(self, failures: list[str]) -> None:
        if failures:
            self._health = ("degraded", "; ".join(failures))
        else:
            self._health = ("ok", f"{len(self._handles)} GPU(s)")

    def _open(self, index: int) -> Any:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        name = _text(nvml.nvmlDeviceGetName(handle))
        self._handles[index] = handle
        self._devices[index] = GpuInfo(index, uuid, name)
        return handle

    def _optional(self, call: Any, *args: Any, default: Any) -> Any:
        """call(*args), or default where this GPU or driver cannot report the figure.

        Not-supported, missing-function and no-permission answers describe what the GPU
        or container offers (MIG slices, consumer boards, old drivers), not a fault; any
        other NVMLError propagates and marks the GPU unhealthy.
        """
        nvml = self._nvml
        try:
            return call(*args)
        except nvml.NVMLError as e:
            unavailable = (
                nvml.NVML_ERROR_NOT_SUPPORTED,
                nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                nvml.NVML_ERROR_NO_PERMISSION,
            )
            if e.value in unavailable:
                return default
            raise

    def _read(self, index: int, handle: Any) -> GpuLoad:
        nvml = self._nvml
        opt = self._optional
        rates = opt(nvml.nvmlDeviceGetUtilizationRates, handle, default=None)
        memory = opt(nvml.nvmlDeviceGetMemoryInfo, handle, default=None)
        temp = opt(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU, default=0)
        power_mw = opt(nvml.nvmlDeviceGetPowerUsage, handle, default=0)
        limit_mw = opt(nvml.nvmlDeviceGetEnforcedPowerLimit, handle, default=0)
        reasons = opt(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle, default=0)
        processes = opt(nvml.nvmlDeviceGetComputeRunningProcesses, handle, default=[])
        # Clamped to what the snapshot can carry, so that an odd reading from a driver
        # never becomes an exception on the sampling path.
        return GpuLoad(
            index=index,
            util_pct=min(rates.gpu, 100) if rates else 0,
            mem_used_mib=min(memory.used // _MIB, MAX_MIB) if memory else 0,
            mem_total_mib=min(memory.total // _MIB, MAX_MIB) if memory else 0,
            temp_c=min(temp, 255),
            power_w=min(round(power_mw / 1000), 65535),
            power_limit_w=min(round(limit_mw / 1000), 65535),
            throttle_reasons=reasons & (2**64 - 1),
            processes=min(len(processes), 65535),
            healthy=True,
        )

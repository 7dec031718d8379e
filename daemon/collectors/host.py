"""Host figures from psutil and /proc: CPU over a sliding window, memory, load, CPU PSI."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil

from loadmesh.gossip.snapshot import MAX_LOAD_AVERAGE, MAX_MIB, HostLoad

_MIB = 1024 * 1024


def cpu_busy_total() -> tuple[float, float]:
    """(busy, total) CPU seconds since boot, all CPUs together, as psutil counts them."""
    t = psutil.cpu_times()
    # On Linux guest time is already inside user and nice; adding it would count it twice.
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


def read_cpu_pressure(path: Path) -> float | None:
    """PSI "some avg10" for the CPU in percent, or None where the kernel has no PSI."""
    try:
        text = path.read_text()
    except OSError:  # absent file, or EOPNOTSUPP when the kernel booted with psi=0
        return None
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind != "some":
            continue
        for item in rest.split():
            key, _, value = item.partition("=")
            if key == "avg10":
                try:
                    pct = float(value)
                except ValueError:
                    return None
                return min(max(pct, 0.0), 100.0)
    return None


class HostCollector:
    """Samples the host; each sample() reads a few /proc files, so it is cheap enough to
    call on the event loop.

    CPU utilisation is the busy share of CPU time between the oldest kept sample and now:
    the collector keeps the samples of the last `window_s` seconds plus the newest one
    before them, so the figure spans the whole window however often sample() runs.
    """

    def __init__(
        self,
        window_s: float = 10.0,
        pressure_path: Path = Path("/proc/pressure/cpu"),
        cpu_times: Callable[[], tuple[float, float]] = cpu_busy_total,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.pressure_path = pressure_path
        self._cpu_times = cpu_times
        self._clock = clock
        # Primed here so the first sample() already has an interval to measure over.
        self._cpu: deque[tuple[float, float, float]] = deque([(clock(), *cpu_times())])

    def cpu_util(self) -> float:
        now = self._clock()
        busy, total = self._cpu_times()
        self._cpu.append((now, busy, total))
        while len(self._cpu) > 1 and self._cpu[1][0] <= now - self.window_s:
            self._cpu.popleft()
        _, busy0, total0 = self._cpu[0]
        elapsed = total - total0
        if elapsed <= 0:
            return 0.0
        return min(max((busy - busy0) / elapsed, 0.0), 1.0)

    def sample(self) -> HostLoad:
        mem = psutil.virtual_memory()
        # total - available rather than psutil's "used": available is the kernel's own
        # estimate of what can be had without swapping, page cache and reclaimable slab
        # included, which is what memory pressure means to a serving host.
        return HostLoad(
            cpu_util=self.cpu_util(),
            mem_used_mib=min((mem.total - mem.available) // _MIB, MAX_MIB),
            mem_total_mib=min(mem.total // _MIB, MAX_MIB),
            load1=min(os.getloadavg()[0], MAX_LOAD_AVERAGE),
            cpu_pressure_pct=read_cpu_pressure(self.pressure_path),
        )

"""The `gpu` component: NVML through the GPU collector, always off the event loop."""

from __future__ import annotations

import asyncio

from loadmesh.daemon import logs
from loadmesh.daemon.collectors.gpu import GpuCollector, GpuInfo, unhealthy
from loadmesh.daemon.health import Health, HealthState
from loadmesh.gossip.snapshot import GpuLoad

log = logs.get("gpu")

# An NVML call on a GPU that fell off the bus can block for minutes, or for good, and a
# thread cannot be interrupted: the snapshot tick waits this long for a sample, and no
# second call starts while one is stuck. Meanwhile every GPU is reported unhealthy: the
# last figures were healthy ones, and peers would keep sending work on them.
SAMPLE_TIMEOUT_S = 2.0


class GpuComponent:
    name = "gpu"

    def __init__(self, collector: GpuCollector | None = None) -> None:
        self.collector = collector or GpuCollector()
        self._pending: asyncio.Future[list[GpuLoad]] | None = None
        self._stuck = False

    async def start(self) -> None:
        await asyncio.to_thread(self.collector.start)
        health = self.health()
        if health.state is HealthState.OK:
            log.info("%d GPU(s): %s", len(self.collector.devices),
                     ", ".join(d.name for d in self.collector.devices))
        else:
            log.warning("%s", health)

    async def stop(self) -> None:
        await asyncio.to_thread(self.collector.close)

    def health(self) -> Health:
        if self._stuck:
            return Health(HealthState.DEGRADED, f"an NVML call has not returned within "
                          f"{SAMPLE_TIMEOUT_S:g} s (a GPU off the bus?): every GPU reported "
                          f"unhealthy until it does")
        state, reason = self.collector.health
        return Health(HealthState(state), reason)

    @property
    def devices(self) -> tuple[GpuInfo, ...]:
        return self.collector.devices

    async def sample(self) -> list[GpuLoad]:
        devices = self.collector.devices
        if not devices:
            return []
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(asyncio.to_thread(self.collector.sample))
            try:
                loads = await asyncio.wait_for(asyncio.shield(self._pending), SAMPLE_TIMEOUT_S)
            except TimeoutError:
                pass
            else:
                if self._stuck:
                    log.warning("NVML answers again")
                    self._stuck = False
                return loads
        if not self._stuck:
            self._stuck = True
            log.error("%s", self.health().reason)
        return [unhealthy(d.index) for d in devices]

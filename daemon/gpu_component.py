"""The `gpu` component: NVML through the GPU collector, always off the event loop."""

from __future__ import annotations

import asyncio

from daemon import logs
from daemon.collectors.gpu import GpuCollector, GpuInfo
from daemon.health import Health, State
from gossip.snapshot import GpuLoad

log = logs.get("gpu")


class GpuComponent:
    name = "gpu"

    def __init__(self, collector: GpuCollector | None = None) -> None:
        self.collector = collector or GpuCollector()

    async def start(self) -> None:
        await asyncio.to_thread(self.collector.start)
        health = self.health()
        if health.state is State.OK:
            log.info("%d GPU(s): %s", len(self.collector.devices),
                     ", ".join(d.name for d in self.collector.devices))
        else:
            log.warning("%s", health)

    async def stop(self) -> None:
        await asyncio.to_thread(self.collector.close)

    def health(self) -> Health:
        state, reason = self.collector.health
        return Health(State(state), reason)

    @property
    def devices(self) -> tuple[GpuInfo, ...]:
        return self.collector.devices

    async def sample(self) -> list[GpuLoad]:
        if not self.collector.devices:
            return []
        return await asyncio.to_thread(self.collector.sample)

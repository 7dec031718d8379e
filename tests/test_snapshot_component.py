"""The snapshot tick against the probes' reads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from daemon.api_server import Router
from daemon.config import Config, LoadConfig
from daemon.snapshot_component import SnapshotComponent


class Probes:
    def __init__(self) -> None:
        self.read_ms: int | None = None
        self._on_read: list[Callable[[], None]] = []

    def on_read(self, callback: Callable[[], None]) -> None:
        self._on_read.append(callback)

    def read(self) -> None:
        self.read_ms = time.monotonic_ns() // 1_000_000
        for callback in self._on_read:
            callback()

    def model_figures(self) -> tuple[()]:
        return ()


class Gpu:
    async def sample(self) -> list[object]:
        return []


async def _tick_follows_a_read(tmp_path: Path) -> None:
    config = Config(node_id="n0", advertise="10.0.0.1", state_dir=str(tmp_path),
                    load=LoadConfig(tick_ms=1000, list_models_s=0))
    probes = Probes()
    component = SnapshotComponent(config, probes, Gpu(), Router())  # type: ignore[arg-type]
    probes.read()
    await component.start()
    try:
        assert component.confirmed_ms == probes.read_ms
        # A read most of a tick after the last one ticks at once. The timer, the fallback
        # where reads stop, would come a tick and a poll (1.25 s) after the start.
        await asyncio.sleep(0.9)
        probes.read()
        deadline = time.monotonic() + 0.3
        while component.confirmed_ms != probes.read_ms:
            assert time.monotonic() < deadline, "the read did not tick"
            await asyncio.sleep(0.01)
    finally:
        await component.stop()


def test_the_tick_follows_the_probes_read(tmp_path: Path) -> None:
    asyncio.run(_tick_follows_a_read(tmp_path))

"""The snapshot tick against the probes' reads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from loadmesh.daemon import snapshot_component
from loadmesh.daemon.config import Config, LoadConfig
from loadmesh.daemon.health import HealthState
from loadmesh.daemon.snapshot_component import SnapshotComponent
from loadmesh.daemon.versioning import VersionStore


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
    component = SnapshotComponent(config, probes, Gpu())  # type: ignore[arg-type]
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


class StuckGpu:
    """A sample that never returns: what the tick waits for is stuck."""

    def __init__(self) -> None:
        self.stuck = False

    async def sample(self) -> list[object]:
        if self.stuck:
            await asyncio.Event().wait()
        return []


async def _a_stuck_tick_degrades(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_component, "STALLED_MIN_S", 0.5)
    monkeypatch.setattr(snapshot_component, "STOP_WAIT_S", 0.2)
    config = Config(node_id="n0", advertise="10.0.0.1", state_dir=str(tmp_path),
                    load=LoadConfig(tick_ms=100, list_models_s=0))
    gpu = StuckGpu()
    component = SnapshotComponent(config, Probes(), gpu)  # type: ignore[arg-type]
    await component.start()
    try:
        # Three ticks built, each one a chance to be taken for a stall.
        ticks: set[int] = set()
        deadline = time.monotonic() + 5
        while len(ticks) < 3:
            assert time.monotonic() < deadline, "the ticks did not run"
            if component.confirmed_ms is not None:
                ticks.add(component.confirmed_ms)
            await asyncio.sleep(0.02)
        assert component.stalled_s == 0 and component.health().state is HealthState.OK
        gpu.stuck = True
        deadline = time.monotonic() + 5
        while not component.stalled_s:
            assert time.monotonic() < deadline, "the stuck tick was not noticed"
            await asyncio.sleep(0.05)
        health = component.health()
        assert health.state is HealthState.DEGRADED and "no snapshot built for" in health.reason
    finally:
        await component.stop()


def test_a_stuck_tick_degrades_the_component(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_a_stuck_tick_degrades(tmp_path, monkeypatch))


class Store(VersionStore):
    """Records on which thread each save (its fsyncs) ran."""

    saved_on: list[int] = []

    def save(self, version: int) -> None:
        self.saved_on.append(threading.get_ident())
        super().save(version)


async def _saves_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_component, "VersionStore", Store)
    config = Config(node_id="n0", advertise="10.0.0.1", state_dir=str(tmp_path),
                    load=LoadConfig(tick_ms=100, list_models_s=0))
    component = SnapshotComponent(config, Probes(), Gpu())  # type: ignore[arg-type]
    await component.start()  # the first tick takes the first version: a save
    await component.stop()
    assert Store.saved_on and threading.get_ident() not in Store.saved_on


def test_the_version_file_is_written_off_the_event_loop(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_saves_off_the_loop(tmp_path, monkeypatch))


class FailingStore(VersionStore):
    """A version file on a full disk, until `failing` is cleared."""

    failing = True

    def save(self, version: int) -> None:
        if self.failing:
            raise OSError(28, "No space left on device")
        super().save(version)


async def _a_failing_version_file_degrades(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_component, "VersionStore", FailingStore)
    monkeypatch.setattr(FailingStore, "failing", True)
    config = Config(node_id="n0", advertise="10.0.0.1", state_dir=str(tmp_path),
                    load=LoadConfig(tick_ms=100, list_models_s=0))
    component = SnapshotComponent(config, Probes(), Gpu())  # type: ignore[arg-type]
    await component.start()
    try:
        # Still publishing, and saying why a restart might not be safe.
        assert component.current is not None
        health = component.health()
        assert health.state is HealthState.DEGRADED
        assert str(tmp_path / "version") in health.reason and "No space left" in health.reason
        monkeypatch.setattr(FailingStore, "failing", False)
        deadline = time.monotonic() + 5
        while component.health().state is not HealthState.OK:
            assert time.monotonic() < deadline, "the retried write was not noticed"
            await asyncio.sleep(0.05)
        assert int((tmp_path / "version").read_text()) >= component.current.version
    finally:
        await component.stop()


def test_a_version_file_that_cannot_be_written_degrades_until_it_can(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_a_failing_version_file_degrades(tmp_path, monkeypatch))

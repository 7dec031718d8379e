from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadmesh.daemon.state_files import BadStateFile
from loadmesh.daemon.versioning import ChangeDetector, Deadband, Deadbands, VersionClock, VersionStore
from loadmesh.gossip.snapshot import Endpoint, GpuLoad, HostLoad, LoadSnapshot, ModelLoad, NodeState

NOW = 1_764_500_000_000


class CountingStore(VersionStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.saves = 0

    def save(self, version: int) -> None:
        self.saves += 1
        super().save(version)


# --- VersionClock ----------------------------------------------------------------------

def test_seeds_from_the_clock_without_state() -> None:
    clock = VersionClock(None, now_ms=lambda: NOW)
    assert [clock.take(), clock.take(), clock.peek()] == [NOW, NOW + 1, NOW + 2]


def test_restart_with_clock_stepped_back_continues_past_stored(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "version")
    first = VersionClock(store, now_ms=lambda: NOW)
    last = [first.take() for _ in range(5)][-1]
    again = VersionClock(VersionStore(tmp_path / "version"), now_ms=lambda: NOW - 3_600_000)
    assert again.take() > last


def test_restart_within_the_same_millisecond_does_not_repeat(tmp_path: Path) -> None:
    first = VersionClock(VersionStore(tmp_path / "version"), now_ms=lambda: NOW)
    last = first.take()
    assert VersionClock(VersionStore(tmp_path / "version"), now_ms=lambda: NOW).take() > last


def test_restart_after_clock_moved_on_seeds_from_clock(tmp_path: Path) -> None:
    VersionClock(VersionStore(tmp_path / "version"), now_ms=lambda: NOW).take()
    later = NOW + 60_000
    assert VersionClock(VersionStore(tmp_path / "version"), now_ms=lambda: later).take() == later


@given(st.lists(st.tuples(st.integers(0, 2**40), st.integers(1, 30)), min_size=1, max_size=8), st.integers(1, 10))
def test_versions_strictly_increase_across_restarts(runs: list[tuple[int, int]], reserve: int) -> None:
    # Each run: a start at an arbitrary wall time (forward or back), then some takes.
    store = _MemoryStore()
    seen: list[int] = []
    for start_ms, takes in runs:
        clock = VersionClock(store, now_ms=lambda at=start_ms: at, reserve=reserve)
        for _ in range(takes):
            seen.append(clock.take())
            assert store.value >= seen[-1], "a version was handed out before it was stored"
    assert seen == sorted(set(seen))


class _MemoryStore(VersionStore):
    def __init__(self) -> None:
        super().__init__(Path("/nonexistent"))
        self.value = 0

    def load(self) -> int:
        return self.value

    def save(self, version: int) -> None:
        self.value = version


def test_store_is_written_once_per_reservation(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "version")
    clock = VersionClock(store, now_ms=lambda: NOW, reserve=100)
    for _ in range(250):
        clock.take()
    assert store.saves == 3
    assert int((tmp_path / "version").read_text()) == NOW + 299
    assert not (tmp_path / "version.tmp").exists()


@pytest.mark.parametrize("content", ["", "garbage\n", "\xff\xfe", "-1\n", f"{2**63 - 1}\n",
                                     f"{2**64}\n", "1" * 80])
def test_a_version_file_no_agent_wrote_is_refused_by_name(tmp_path: Path, content: str) -> None:
    # 2**63 - 1 would make every version after it too big for the wire: a snapshot
    # failure on every tick. Refused, the agent stops with the file named instead.
    (tmp_path / "version").write_bytes(content.encode("latin-1"))
    with pytest.raises(BadStateFile, match=str(tmp_path / "version")):
        VersionStore(tmp_path / "version").load()


def test_the_version_files_are_never_followed_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "version").symlink_to(victim)
    with pytest.raises(BadStateFile, match="symbolic link"):
        VersionStore(tmp_path / "version").load()
    # A link at the temporary name is removed, not written through.
    (tmp_path / "version").unlink()
    (tmp_path / "version.tmp").symlink_to(victim)
    VersionStore(tmp_path / "version").save(42)
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "version").read_text() == "42\n" and not (tmp_path / "version").is_symlink()


def test_failing_store_does_not_stop_versions(tmp_path: Path) -> None:
    clock = VersionClock(VersionStore(tmp_path / "missing-dir" / "version"), now_ms=lambda: NOW)
    assert [clock.take(), clock.take()] == [NOW, NOW + 1]


def test_stored_ahead_the_takes_write_nothing(tmp_path: Path) -> None:
    # The agent writes the file in a thread before a build that may take a version, so
    # that take(), on the event loop, never syncs a file.
    store = CountingStore(tmp_path / "version")
    clock = VersionClock(store, now_ms=lambda: NOW, reserve=100)
    assert clock.must_store()
    clock.store_ahead()
    assert store.saves == 1 and not clock.must_store()
    assert [clock.take() for _ in range(100)][-1] == NOW + 99
    assert store.saves == 1 and clock.must_store()
    # Peers hold a version far ahead: the reservation must cover the jump past it.
    outrun = NOW + 5000
    assert clock.must_store(outrun)
    clock.store_ahead(outrun)
    assert not clock.must_store(outrun)
    clock.skip_past(outrun)
    assert clock.take() == outrun + 1
    assert store.saves == 2 and int((tmp_path / "version").read_text()) == outrun + 100


def test_a_failing_store_is_said_once_and_retried_ahead(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "state"
    clock = VersionClock(VersionStore(directory / "version"), now_ms=lambda: NOW, reserve=10)
    with caplog.at_level("WARNING"):
        clock.store_ahead()
        clock.take()
        clock.store_ahead()
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and said[0].startswith(f"cannot store version {NOW + 9} in {directory}")
        assert clock.must_store() and str(directory / "version") in clock.failure
        directory.mkdir()
        clock.store_ahead()
        assert "versions stored in" in caplog.records[-1].getMessage()
    assert not clock.must_store() and clock.failure == ""
    assert int((directory / "version").read_text()) == NOW + 10


# --- Deadband ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "band, old, new, exceeded",
    [
        (Deadband(abs=0.1), 0.5, 0.6, False),  # on the edge stays inside
        (Deadband(abs=0.1), 0.5, 0.61, True),
        (Deadband(abs=0.1), 0.5, 0.39, True),
        (Deadband(rel=0.2), 100, 119, False),
        (Deadband(rel=0.2), 100, 121, True),
        (Deadband(abs=1.0, rel=0.2), 2, 2.9, False),  # the floor governs small values
        (Deadband(abs=1.0, rel=0.2), 100, 110, False),  # the relative band governs large ones
        (Deadband(abs=1.0, rel=0.2), 100, 125, True),
        (Deadband(), 3, 3, False),
        (Deadband(), 3, 4, True),
    ],
)
def test_deadband(band: Deadband, old: float, new: float, exceeded: bool) -> None:
    assert band.exceeded(old, new) is exceeded


# --- ChangeDetector ---------------------------------------------------------------------

def snap(**changes: object) -> LoadSnapshot:
    base = LoadSnapshot(
        node_id="n1",
        endpoints=(Endpoint("10.0.0.1", 8000),),
        version=1,
        timestamp_ms=NOW,
        state=NodeState.OK,
        score=0.4,
        host=HostLoad(0.3, 1000, 64000, 2.0, 5.0),
        gpus=tuple(GpuLoad(i, 50, 40000, 80000, 60, 300, 700, 0, 1, True) for i in range(2)),
        models=(ModelLoad(7, 8000, 100.0, 0.01, 50.0, 200.0, 10),),
    )
    return replace(base, **changes)


def gpu0(**changes: object) -> tuple[GpuLoad, ...]:
    g = snap().gpus
    return (replace(g[0], **changes), g[1])


def model(**changes: object) -> tuple[ModelLoad, ...]:
    return (replace(snap().models[0], **changes),)


detector = ChangeDetector()


def test_first_snapshot_is_urgent() -> None:
    change = detector.compare(None, snap())
    assert change.material and change.urgent


WOBBLES = {
    "score": dict(score=0.44),
    "cpu": dict(host=HostLoad(0.38, 1000, 64000, 2.0, 5.0)),
    "host memory": dict(host=HostLoad(0.3, 4000, 64000, 2.0, 5.0)),
    "load": dict(host=HostLoad(0.3, 1000, 64000, 2.4, 5.0)),
    "pressure": dict(host=HostLoad(0.3, 1000, 64000, 2.0, 14.0)),
    "gpu util": dict(gpus=gpu0(util_pct=59)),
    "gpu memory": dict(gpus=gpu0(mem_used_mib=43000)),
    "gpu temp": dict(gpus=gpu0(temp_c=64)),
    "gpu power": dict(gpus=gpu0(power_w=690)),
    "throttle bits": dict(gpus=gpu0(throttle_reasons=0x4)),
    "rps": dict(models=model(rps=115.0)),
    "error ratio": dict(models=model(error_ratio=0.012)),
    "p50": dict(models=model(p50_ms=58.0)),
    "p99": dict(models=model(p99_ms=235.0)),
    "timestamp": dict(timestamp_ms=NOW + 4999),
}


@pytest.mark.parametrize("changes", WOBBLES.values(), ids=WOBBLES.keys())
def test_wobble_inside_deadband_is_no_change(changes: dict) -> None:
    assert not detector.compare(snap(), snap(**changes)).material


MOVES = {
    "score": dict(score=0.46),
    "cpu": dict(host=HostLoad(0.41, 1000, 64000, 2.0, 5.0)),
    "host memory": dict(host=HostLoad(0.3, 5000, 64000, 2.0, 5.0)),
    "load": dict(host=HostLoad(0.3, 1000, 64000, 2.6, 5.0)),
    "pressure": dict(host=HostLoad(0.3, 1000, 64000, 2.0, 16.0)),
    "pressure vanished": dict(host=HostLoad(0.3, 1000, 64000, 2.0, None)),
    "gpu util": dict(gpus=gpu0(util_pct=61)),
    "gpu memory": dict(gpus=gpu0(mem_used_mib=44100)),
    "gpu temp": dict(gpus=gpu0(temp_c=66)),
    "gpu processes": dict(gpus=gpu0(processes=2)),
    "rps": dict(models=model(rps=121.0)),
    "error ratio": dict(models=model(error_ratio=0.016)),
    "p50": dict(models=model(p50_ms=61.0)),
    "p99": dict(models=model(p99_ms=241.0)),
    # the queue: any request that joins or leaves it
    "in flight": dict(models=model(in_flight=11)),
    "waiting": dict(models=model(waiting=1)),
    "running": dict(models=model(running=1)),
}


@pytest.mark.parametrize("changes", MOVES.values(), ids=MOVES.keys())
def test_real_change_is_material_not_urgent(changes: dict) -> None:
    change = detector.compare(snap(), snap(**changes))
    assert change.material and not change.urgent


URGENT = {
    "state": dict(state=NodeState.DEGRADED),
    "draining": dict(state=NodeState.DRAINING),
    "model added": dict(models=(*model(), ModelLoad(8, 8001, 0.0, 0.0, 0.0, 0.0, 0))),
    "model removed": dict(models=()),
    "model moved port": dict(models=model(port=8001)),
    "gpu failed": dict(gpus=gpu0(healthy=False)),
    "gpu gone": dict(gpus=gpu0()[1:]),
    "endpoints": dict(endpoints=(Endpoint("10.0.0.2", 8000),)),
}


@pytest.mark.parametrize("changes", URGENT.values(), ids=URGENT.keys())
def test_urgent_changes(changes: dict) -> None:
    change = detector.compare(snap(), snap(**changes))
    assert change.material and change.urgent


def test_heartbeat_moves_version_without_change() -> None:
    change = detector.compare(snap(), snap(timestamp_ms=NOW + 5000))
    assert change.material and not change.urgent and change.reason == "heartbeat"


def test_wall_clock_stepping_back_publishes() -> None:
    assert detector.compare(snap(), snap(timestamp_ms=NOW - 1)).material


def test_queue_deadband_widens_the_queue_figures_alone() -> None:
    wide = ChangeDetector(Deadbands().with_queue(2.0))
    for figure in ("in_flight", "waiting", "running"):
        was = getattr(snap().models[0], figure)
        assert not wide.compare(snap(), snap(models=model(**{figure: was + 2}))).material
        assert wide.compare(snap(), snap(models=model(**{figure: was + 3}))).material
    # the other figures keep their bands
    assert wide.compare(snap(), snap(models=model(rps=121.0))).material
    assert not wide.compare(snap(), snap(models=model(rps=115.0))).material


def test_deadbands_are_configurable() -> None:
    tight = ChangeDetector(Deadbands(gpu_power_w=Deadband(abs=5.0), score=None), heartbeat_ms=60_000)
    assert tight.compare(snap(), snap(gpus=gpu0(power_w=306))).material
    assert not tight.compare(snap(), snap(score=0.9)).material
    assert not tight.compare(snap(), snap(timestamp_ms=NOW + 59_999)).material

"""When a node's snapshot gets a new version, and whether peers must hear of it at once.

Peers keep the snapshot with the greatest (version, timestamp), so the version must never
go backwards, restarts and wall-clock steps included. It moves only on a material change
(a figure leaving its deadband, a state or membership change) or as a heartbeat; between
those the node keeps publishing the same version with the same content.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from loadmesh.daemon.state_files import BadStateFile, read_state_file, write_state_file
from loadmesh.gossip.snapshot import MAX_CLOCK, LoadSnapshot

log = logging.getLogger(__name__)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


# Far beyond any clock in milliseconds (2**62 ms is 146 million years), far below where
# versions stop fitting the wire (MAX_CLOCK): a stored value above it was not written by
# an agent, and handing out versions from it would fail on every tick.
MAX_STORED = MAX_CLOCK // 2


class VersionStore:
    """The highest version this node may have handed out, kept in one small file.

    Replaced whole on each save (write_state_file), so a crash leaves either the old
    number or the new one, never a torn file: a file that holds anything but such a
    number was not written by an agent, and load() refuses it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> int:
        """The stored version, 0 when there is none or it cannot be read. BadStateFile
        when it holds anything but a number from 0 to MAX_STORED, or is a link."""
        try:
            text = read_state_file(self.path)
        except OSError as e:
            log.warning("cannot read version file %s (%s); seeding from the clock", self.path, e)
            return 0
        if text is None:
            return 0
        value = text.strip()
        if not value.isdigit() or int(value) > MAX_STORED:
            raise BadStateFile(f"{self.path}: holds {value[:24]!r}, not a version from 0 to "
                               f"{MAX_STORED}: remove it to seed versions from the clock")
        return int(value)

    def save(self, version: int) -> None:
        write_state_file(self.path, f"{version}\n")


class VersionClock:
    """Hands out strictly increasing versions that survive restarts.

    The first version is max(stored + 1, now_ms): the clock alone protects a node that
    lost its state directory, the stored value protects one whose wall clock stepped
    back. Rather than writing the file on every version, the clock reserves `reserve`
    versions at a time and stores the top of the reservation before handing any of them
    out, so the file is written about once every `reserve` changes and a crash can only
    make the next start skip ahead, never repeat.
    """

    def __init__(
        self,
        store: VersionStore | None,
        now_ms: Callable[[], int] = wall_ms,
        reserve: int = 1000,
    ) -> None:
        if reserve < 1:
            raise ValueError("reserve must be at least 1")
        self._store = store
        self._reserve = reserve
        self._reserved = store.load() if store else 0
        # Why the last write failed ("" if it did not): take() leaves the retry to store_ahead().
        self._failure = ""
        self._next = max(self._reserved + 1, now_ms())

    def peek(self) -> int:
        """The version the next take() returns."""
        return self._next

    def skip_past(self, version: int) -> None:
        """Hand out only versions above `version` from now on (peers hold it)."""
        self._next = max(self._next, version + 1)

    @property
    def failure(self) -> str:
        """Why the versions are not stored, while they are not; "" once they are."""
        return self._failure

    def must_store(self, outrun: int = 0) -> bool:
        """Whether the next take(), after skip_past(outrun), would write the store."""
        return self._store is not None and max(self._next, outrun + 1) > self._reserved

    def store_ahead(self, outrun: int = 0) -> None:
        """Write now the reservation that the next take() would write (a file's write and
        fsyncs: the agent calls this in a thread when must_store(), and builds on the
        event loop)."""
        self._store_from(max(self._next, outrun + 1))

    def take(self) -> int:
        version = self._next
        if version > self._reserved and not self._failure:
            self._store_from(version)
        self._next = version + 1
        return version

    def _store_from(self, version: int) -> None:
        if self._store is None:
            return
        top = version + self._reserve - 1
        try:
            self._store.save(top)
        except OSError as e:
            # Keep running: seeding from the clock still protects the next start unless
            # the wall clock also steps back. store_ahead() retries; said once, not at
            # every attempt, and the agent's health says it meanwhile.
            if not self._failure:
                log.warning("cannot store version %d in %s: %s (retried at every tick)", top,
                            self._store.path, e)
            self._failure = (f"versions not stored in {self._store.path} ({e}): a restart with "
                             "the wall clock stepped back would repeat them")
            return
        if self._failure:
            log.warning("versions stored in %s again", self._store.path)
        self._failure = ""
        self._reserved = top


@dataclass(frozen=True)
class Deadband:
    """A figure's change is material when |new - old| > max(abs, rel * |old|).

    abs alone suits bounded figures (utilisation); rel alone suits figures without a
    natural scale (requests per second); both together give a relative band with a floor,
    so that noise around small values does not count as change.
    """

    abs: float = 0.0
    rel: float = 0.0

    def exceeded(self, old: float, new: float) -> bool:
        return abs(new - old) > max(self.abs, self.rel * abs(old))


@dataclass(frozen=True)
class Deadbands:
    """One band per figure; None means the figure never moves the version by itself and
    travels with the next version that moves for another reason (or the heartbeat).

    Each name matches the figure in LoadSnapshot; host_mem and gpu_mem compare
    used / total, so the band is in fractions of the whole.
    """

    score: Deadband | None = Deadband(abs=0.05)
    cpu_util: Deadband | None = Deadband(abs=0.10)
    host_mem: Deadband | None = Deadband(abs=0.05)
    load1: Deadband | None = Deadband(abs=0.5, rel=0.25)
    cpu_pressure_pct: Deadband | None = Deadband(abs=10.0)
    gpu_util_pct: Deadband | None = Deadband(abs=10.0)
    gpu_mem: Deadband | None = Deadband(abs=0.05)
    gpu_temp_c: Deadband | None = Deadband(abs=5.0)
    # Power draw swings with every batch, and the power-cap throttle bit flips many times
    # a second under load: as change triggers they would move the version on every tick.
    gpu_power_w: Deadband | None = None
    gpu_throttle_reasons: Deadband | None = None
    gpu_processes: Deadband | None = Deadband()
    rps: Deadband | None = Deadband(abs=1.0, rel=0.20)
    error_ratio: Deadband | None = Deadband(abs=0.005, rel=0.25)
    p50_ms: Deadband | None = Deadband(abs=5.0, rel=0.20)
    p99_ms: Deadband | None = Deadband(abs=10.0, rel=0.20)
    # The queue is what routing compares hosts by: every request that joins or leaves it
    # moves the version (load.queue_deadband widens the band; docs/snapshot.md says
    # what each setting measured).
    in_flight: Deadband | None = Deadband()
    waiting: Deadband | None = Deadband()
    running: Deadband | None = Deadband()
    ttft_p99_ms: Deadband | None = Deadband(abs=10.0, rel=0.20)
    itl_p99_ms: Deadband | None = Deadband(abs=2.0, rel=0.20)
    pace_ms: Deadband | None = Deadband(abs=2.0, rel=0.20)
    tokens_per_s: Deadband | None = Deadband(abs=5.0, rel=0.20)

    def with_queue(self, requests: float) -> Deadbands:
        """These bands, with in_flight, waiting and running moving the version only when
        they change by more than `requests`."""
        band = Deadband(abs=requests)
        return replace(self, in_flight=band, waiting=band, running=band)


_MODEL_FIGURES = ("rps", "error_ratio", "p50_ms", "p99_ms", "in_flight", "waiting", "running",
                  "ttft_p99_ms", "itl_p99_ms", "tokens_per_s", "pace_ms")


@dataclass(frozen=True)
class Change:
    material: bool
    urgent: bool
    reason: str


_NO_CHANGE = Change(False, False, "")


def _fraction(used: int, total: int) -> float:
    return used / total if total else 0.0


def _figures(s: LoadSnapshot) -> dict[tuple[object, ...], float]:
    """Every deadbanded figure, keyed by (figure name, which GPU or model)."""
    out: dict[tuple[object, ...], float] = {
        ("score",): s.score,
        ("cpu_util",): s.host.cpu_util,
        ("host_mem",): _fraction(s.host.mem_used_mib, s.host.mem_total_mib),
        ("load1",): s.host.load1,
    }
    if s.host.cpu_pressure_pct is not None:
        out[("cpu_pressure_pct",)] = s.host.cpu_pressure_pct
    for g in s.gpus:
        out[("gpu_util_pct", g.index)] = g.util_pct
        out[("gpu_mem", g.index)] = _fraction(g.mem_used_mib, g.mem_total_mib)
        out[("gpu_temp_c", g.index)] = g.temp_c
        out[("gpu_power_w", g.index)] = g.power_w
        out[("gpu_throttle_reasons", g.index)] = g.throttle_reasons
        out[("gpu_processes", g.index)] = g.processes
    for m in s.models:
        for name in _MODEL_FIGURES:
            out[(name, *m.key)] = getattr(m, name)
    return out


class ChangeDetector:
    """Decides whether a freshly built snapshot deserves a new version.

    Urgent (relay at once): the first snapshot, a state change, a model or GPU appearing
    or disappearing, a GPU turning unhealthy or healthy again, new endpoints, a band of
    passed-on sessions moving. Material only: a figure outside its deadband, PSI appearing
    or vanishing, the heartbeat. Figures are compared with the last *published* snapshot,
    not the previous tick, so a slow drift still moves the version once it adds up to a
    band.
    """

    def __init__(self, deadbands: Deadbands = Deadbands(), heartbeat_ms: int = 5000) -> None:
        if heartbeat_ms <= 0:
            raise ValueError("heartbeat_ms must be positive")
        self.deadbands = deadbands
        self.heartbeat_ms = heartbeat_ms

    def compare(self, published: LoadSnapshot | None, candidate: LoadSnapshot) -> Change:
        if published is None:
            return Change(True, True, "first snapshot")
        urgent = self._urgent(published, candidate)
        if urgent:
            return Change(True, True, urgent)
        old, new = _figures(published), _figures(candidate)
        if old.keys() != new.keys():
            changed = sorted(str(k) for k in old.keys() ^ new.keys())
            return Change(True, False, f"figures appeared or vanished: {', '.join(changed)}")
        for key, value in new.items():
            band = getattr(self.deadbands, str(key[0]))
            if band is not None and band.exceeded(old[key], value):
                return Change(True, False, f"{key}: {old[key]} -> {value}")
        elapsed = candidate.timestamp_ms - published.timestamp_ms
        # A negative elapsed time means the wall clock stepped back: publish, so the
        # timestamp peers hold does not stay in the future.
        if elapsed >= self.heartbeat_ms or elapsed < 0:
            return Change(True, False, "heartbeat")
        return _NO_CHANGE

    @staticmethod
    def _urgent(old: LoadSnapshot, new: LoadSnapshot) -> str:
        """Why the change is urgent, or "" when it is not."""
        if old.state != new.state:
            return f"state {old.state.value} -> {new.state.value}"
        if old.endpoints != new.endpoints:
            return "endpoints changed"
        if {m.key for m in old.models} != {m.key for m in new.models}:
            return "models added or removed"
        if {g.index: g.healthy for g in old.gpus} != {g.index: g.healthy for g in new.gpus}:
            return "GPU set or GPU health changed"
        # Hosts agree on a session's peer only once they all hold the same bands.
        if {m.key: (m.shed_start, m.shed_width) for m in old.models} \
                != {m.key: (m.shed_start, m.shed_width) for m in new.models}:
            return "a model's band of passed-on sessions moved"
        return ""

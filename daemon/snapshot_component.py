"""The `snapshot` component: every tick, host + GPU + probe figures become this node's
LoadSnapshot, which is handed to the mesh whenever its version moves.

It also holds the operator's drain switch. Draining is kept in the state directory, so a
node drained for maintenance stays drained across an agent restart until undrained.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from pathlib import Path

import psutil

from loadmesh.daemon import logs
from loadmesh.daemon.collectors.host import HostCollector
from loadmesh.daemon.config import Config, split_host_port
from loadmesh.daemon.gpu_component import GpuComponent
from loadmesh.daemon.health import OK, Health, HealthState, StartupError
from loadmesh.daemon.http import Request, Response
from loadmesh.daemon.model_list import ModelLister
from loadmesh.daemon.probes_component import POLL_S, ProbesComponent
from loadmesh.daemon.snapshot_builder import SnapshotBuilder
from loadmesh.daemon.snapshot_view import snapshot_json
from loadmesh.daemon.state_files import BadStateFile, flag_set, set_flag
from loadmesh.daemon.versioning import ChangeDetector, Deadbands, VersionClock, VersionStore
from loadmesh.gossip.snapshot import Endpoint, LoadSnapshot, SessionRates

log = logs.get("snapshot")

# A snapshot is built every load.tick_ms (250 ms by default, a minute at most); after
# this many ticks' time without one, and at least STALLED_MIN_S, the component is
# degraded and the agent stops petting systemd's watchdog.
STALLED_TICKS = 4
STALLED_MIN_S = 10.0
# How long stop() lets a tick in progress finish (a GPU sample waits 2 s at most).
STOP_WAIT_S = 3.0

Publish = Callable[[LoadSnapshot, bool], None]


def advertise_host(config: Config) -> str:
    """The host peers should send inference requests to."""
    if config.advertise:
        return config.advertise
    bind_host, _ = split_host_port(config.gossip.bind, allow_any_port=True)
    if bind_host not in ("0.0.0.0", "::"):
        return bind_host
    # The first global address of an interface that is up: a host with one fabric NIC
    # gets it right, and one with several should set `advertise`.
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        for addr in addrs:
            try:
                ip = ipaddress.ip_address(addr.address.split("%")[0])
            except ValueError:
                continue
            if not (ip.is_loopback or ip.is_link_local or ip.is_multicast):
                return str(ip)
    return "127.0.0.1"


class SnapshotComponent:
    name = "snapshot"

    def __init__(self, config: Config, probes: ProbesComponent, gpu: GpuComponent) -> None:
        self.config = config
        self.probes = probes
        self.gpu = gpu
        self._state_dir = Path(config.state_dir)
        self._drain_flag = self._state_dir / "draining"
        self._host = HostCollector()
        self._builder: SnapshotBuilder | None = None
        self._versions: VersionClock | None = None
        self._subscribers: list[Publish] = []
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._health = OK
        self._draining = False
        self._host_name = ""
        self._lister: ModelLister | None = None
        self._listing: asyncio.Task[None] | None = None
        self._bands: Callable[[int], tuple[float, float]] | None = None
        self._sessions: Callable[[], Sequence[SessionRates]] | None = None
        self._outrun: Callable[[], int] = lambda: 0
        self._confirmed_ms: int | None = None
        self._ticked = 0.0
        self._built: float | None = None  # when the last tick built a snapshot (monotonic)
        self._drain_error = ""  # why the last drain or undrain could not be kept on disk
        probes.on_read(self._read)

    def subscribe(self, publish: Publish) -> None:
        """Call `publish(snapshot, urgent)` each time the snapshot gets a new version."""
        self._subscribers.append(publish)

    def publish_bands(self, bands: Callable[[int], tuple[float, float]]) -> None:
        """Put `bands(model_id)`, this node's band of passed-on sessions for the model
        (daemon/routing/shed.py), in each snapshot."""
        self._bands = bands

    def publish_sessions(self, sessions: Callable[[], Sequence[SessionRates]]) -> None:
        """Put `sessions()`, the busiest sessions routed at this node per model, in each
        snapshot."""
        self._sessions = sessions

    def outrun(self, newest_seen: Callable[[], int]) -> None:
        """`newest_seen()`: the highest version of this node that peers hold; each
        tick publishes above it when it is not below this node's next version."""
        self._outrun = newest_seen

    @property
    def current(self) -> LoadSnapshot | None:
        return None if self._builder is None else self._builder.published

    @property
    def confirmed_ms(self) -> int | None:
        """When the figures that last confirmed `current` were measured (time.monotonic,
        in ms): a tick that keeps the version says its figures are still within their
        deadbands of what the probes read then. This node's router counts its own sends
        after that moment on top of `current`, as it does for a peer's last heartbeat."""
        return self._confirmed_ms

    @property
    def draining(self) -> bool:
        return self._draining

    async def start(self) -> None:
        try:
            self._state_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        except OSError as exc:
            # Versions then restart from the clock: still never backwards, just less tidy.
            self._health = Health(HealthState.DEGRADED,
                                  f"state directory {self._state_dir}: {exc.strerror}")
            log.warning("%s", self._health.reason)
        try:
            self._draining = flag_set(self._drain_flag)
            self._versions = VersionClock(VersionStore(self._state_dir / "version"))
        except BadStateFile as exc:
            raise StartupError(str(exc), config=True) from None
        if self._draining:
            log.warning("starting drained (%s exists): `loadmesh undrain` ends it", self._drain_flag)
        self._host_name = advertise_host(self.config)
        self._builder = SnapshotBuilder(
            self.config.node_id, self._endpoints(), self._versions,
            ChangeDetector(Deadbands().with_queue(self.config.load.queue_deadband),
                           heartbeat_ms=self.config.load.heartbeat_ms),
            self.config.load)
        self._lister = ModelLister(self._host_name, self.config.probes.ports,
                                   self.config.load.list_models_s)
        if self._lister.interval_s > 0:
            # Bounded (a timeout per port): the first snapshot already names what is served.
            await self._lister.refresh()
        self._listing = asyncio.create_task(self._lister.run(), name="model-list")
        await self._tick()  # so the API has a snapshot from the first moment
        self._task = asyncio.create_task(self._run(), name="snapshot-tick")
        snap = self.current
        assert snap is not None
        log.info("publishing as %s, version %d, endpoints %s", snap.node_id, snap.version,
                 ", ".join(f"{e.host}:{e.port}" for e in snap.endpoints))

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            # A tick in progress finishes, unless it is stuck: then it is cancelled, and
            # SIGTERM still stops the agent.
            _, pending = await asyncio.wait({self._task}, timeout=STOP_WAIT_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._listing is not None:
            self._listing.cancel()
            await asyncio.gather(self._listing, return_exceptions=True)
            self._listing = None

    def health(self) -> Health:
        stalled = self.stalled_s
        if stalled:
            return Health(HealthState.DEGRADED, f"no snapshot built for {stalled:.0f} s: peers "
                                          f"see this node's last one")
        if self._drain_error:
            return Health(HealthState.DEGRADED, self._drain_error)
        if self._versions is not None and self._versions.failure:
            return Health(HealthState.DEGRADED, self._versions.failure)
        return self._health

    @property
    def stalled_s(self) -> float:
        """Seconds since the last snapshot was built, once past the stall mark (something
        the tick waits for is stuck, or every build fails); 0 while they come."""
        if self._built is None:
            return 0.0
        age = time.monotonic() - self._built
        mark = max(STALLED_MIN_S, STALLED_TICKS * self.config.load.tick_ms / 1000)
        return age if age > mark else 0.0

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded configuration's serving ports and score settings. The host
        peers are sent to stays: `advertise` needs a restart. Peers hear of new endpoints
        at once (an urgent change), of score settings as the score moves."""
        self.config = config
        if self._builder is not None:
            self._builder.endpoints = self._endpoints()
            self._builder.score_config = config.load
        if self._lister is not None:
            self._lister.ports = tuple(config.probes.ports)
            self._lister.interval_s = config.load.list_models_s
            self._lister.wake.set()
        self._wake.set()

    def _endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(Endpoint(self._host_name, port) for port in self.config.probes.ports)

    def _read(self) -> None:
        # A tick right after a read of the probe maps publishes figures a few milliseconds
        # old rather than up to a poll old; the first read past most of a period ticks.
        if time.monotonic() - self._ticked >= self.config.load.tick_ms / 1000 - POLL_S / 2:
            self._wake.set()

    async def _run(self) -> None:
        while not self._stopping:
            period = self.config.load.tick_ms / 1000
            # With probes the reads tick, and the timer is the fallback where they stop.
            slack = 0.0 if self.probes.read_ms is None else POLL_S
            try:
                await asyncio.wait_for(self._wake.wait(), period + slack)
            except TimeoutError:
                pass
            self._wake.clear()
            if self._stopping:
                return
            try:
                await self._tick()
            except Exception:
                log.exception("building the snapshot failed")

    async def _tick(self) -> None:
        self._ticked = time.monotonic()
        gpus = await self.gpu.sample()
        read_ms = self.probes.read_ms
        figures = self.probes.model_figures()
        listed = self._lister.listed() if self._lister is not None else None
        outrun = self._outrun()
        assert self._builder is not None and self._versions is not None
        if self._versions.must_store(outrun):
            # The version file's write and fsyncs, once a reserve of versions is used up.
            await asyncio.to_thread(self._versions.store_ahead, outrun)
        # The build runs on the loop: the host's figures are a few /proc reads (43 us), less
        # than a worker thread's hand-off four times a second would cost (docs/gossip.md,
        # "The snapshot's build on the loop").
        snap, changed, urgent = self._builder.build(self._host.sample(), gpus, figures, self.draining,
                                                    listed, self._bands, outrun,
                                                    self._sessions() if self._sessions else ())
        self._confirmed_ms = read_ms if read_ms is not None else int(self._ticked * 1000)
        self._built = time.monotonic()
        if changed:
            for publish in self._subscribers:
                publish(snap, urgent)

    def serve_drain(self, _: Request) -> Response:
        return self._set_draining(True)

    def serve_undrain(self, _: Request) -> Response:
        return self._set_draining(False)

    def _set_draining(self, draining: bool) -> Response:
        self._draining = draining
        try:
            set_flag(self._drain_flag, draining)
            self._drain_error = ""
        except (OSError, BadStateFile) as exc:
            # In force all the same (peers hear of it now), but a restart would forget it:
            # the operator must hear that too, from the answer and from the health.
            self._drain_error = f"drain state not kept ({exc}): it lasts until a restart"
            log.error("%s", self._drain_error)
        log.warning("node %s by the operator", "drained" if draining else "undrained")
        self._wake.set()  # peers must hear of it now, not at the next tick
        return Response.json({"draining": draining, "kept": not self._drain_error})

    def model_names(self) -> dict[int, str]:
        """model_id -> name, for the models the probes have seen or the servers list."""
        names = self.probes.model_names()
        if self._lister is not None:
            for listed in self._lister.listed().values():
                names.update(listed)
        return names

    def serve_snapshot(self, _: Request) -> Response:
        snap = self.current
        if snap is None:
            return Response.error(HTTPStatus.SERVICE_UNAVAILABLE, "no snapshot yet")
        inputs = None if self._builder is None else self._builder.inputs
        return Response.json(snapshot_json(snap, self.gpu.devices, self.model_names(), inputs))

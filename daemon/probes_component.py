"""The `probes` component: loads the eBPF fingerprint probes and polls their maps.

Compiling and attaching (about two seconds of clang) and reading the maps both block, so
they run in worker threads; the event loop only reads the reader's latest report. Probes
that cannot load leave the agent running without them, degraded with the reason, unless the
operator said they are required.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from loadmesh.daemon import logs
from loadmesh.daemon.config import ProbesConfig
from loadmesh.daemon.health import OK, Health, HealthState, StartupError
from loadmesh.daemon.http import Request, Response
from loadmesh.daemon.snapshot_builder import ModelFigures
from loadmesh.model_id import NO_MODEL

if TYPE_CHECKING:
    from loadmesh.probes.reader import LatencyCounts

log = logs.get("probes")

POLL_S = 0.25


class ProbesComponent:
    name = "probes"

    def __init__(self, config: ProbesConfig) -> None:
        self.config = config
        self._health = Health(HealthState.OFF, "not started")
        self._probes: Any = None
        self._reader: Any = None
        self._poller: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._read_ms: int | None = None
        self._on_read: list[Callable[[], None]] = []

    async def start(self) -> None:
        if not self.config.interfaces:
            self._health = Health(HealthState.OFF, "no interfaces configured")
            log.info("off: no interfaces configured")
            return
        # Imported here so that an agent without bcc still starts, degraded.
        try:
            from loadmesh.probes.loader import MapSizes, ProbeSet, ProbeUnavailable
            from loadmesh.probes.reader import FingerprintReader
        except ImportError as exc:
            self._unavailable(f"cannot import the probes: {exc}")
            return
        c = self.config
        sizes = MapSizes(inflight=c.max_connections, fingerprints=c.max_fingerprints,
                         rows=c.max_model_rows, models=c.max_models)
        probes = ProbeSet(c.interfaces, c.ports, sizes, scan_limit=c.scan_limit)
        try:
            await asyncio.to_thread(probes.start)
        except ProbeUnavailable as exc:
            self._unavailable(str(exc))
            return
        self._probes = probes
        self._reader = FingerprintReader(probes, window_s=self.config.window_s)
        self._poller = asyncio.create_task(self._poll(), name="probes-poll")
        self._health = OK
        log.info("attached to %s (%s), ports %s", ", ".join(self.config.interfaces),
                 probes.attached_as, ", ".join(map(str, self.config.ports)))

    def _unavailable(self, reason: str) -> None:
        if self.config.required:
            # Exit 78: a restart meets the same interface, kernel and privileges (the
            # unit would restart into it forever); the operator must change one of them.
            raise StartupError(f"probes are required (probes.required = true): {reason}",
                               config=True)
        self._health = Health(HealthState.DEGRADED, reason)
        log.warning("running without probes: %s", reason)

    def on_read(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (on the event loop) after each read of the maps."""
        self._on_read.append(callback)

    async def _poll(self) -> None:
        # The agent's view of its own queue and latencies is never older than this.
        period = POLL_S
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await asyncio.to_thread(self._reader.poll, started)
                self._read_ms = int(started * 1000)
            except Exception:
                # A failed read loses one poll's figures, not the agent's probes.
                log.exception("reading the probe maps failed")
            else:
                for callback in self._on_read:
                    callback()
            delay = max(0.0, period - (time.monotonic() - started))
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
            except TimeoutError:
                pass

    async def stop(self) -> None:
        self._stopping.set()
        if self._poller is not None:
            # Waited for, not cancelled: a read still running in its thread must finish
            # before the maps it reads are torn down.
            await self._poller
            self._poller = None
        if self._probes is not None:
            await asyncio.to_thread(self._probes.stop)
            self._probes = None
            log.info("detached")

    def health(self) -> Health:
        return self._health

    def model_figures(self) -> Sequence[ModelFigures]:
        """This tick's figures per (model, serving port), for the snapshot."""
        return () if self._reader is None else self._reader.model_stats()

    @property
    def read_ms(self) -> int | None:
        """When the maps behind model_figures() began to be read (time.monotonic, in ms);
        None before the first read. Requests sent before then are in the figures."""
        return self._read_ms

    def model_names(self) -> dict[int, str]:
        names = {} if self._reader is None else dict(self._reader.model_names())
        names[NO_MODEL] = "-"
        return names

    def summary(self) -> dict[str, Any] | None:
        """The fingerprint report without its flows (cheap: the event loop may call it)."""
        return None if self._reader is None else self._reader.summary()

    def latency_counts(self, kind: str, bounds_s: Sequence[float]) -> Sequence[LatencyCounts]:
        """Per model and endpoint, histograms of one latency kind ("ttfb", "ttft", "itl",
        "e2e") at bounds_s, since the probes started."""
        return () if self._reader is None else self._reader.latency_counts(kind, bounds_s)

    async def set_ports(self, ports: Sequence[int]) -> None:
        """Follow new serving ports without reloading the probes (a configuration reload);
        ValueError when the probes cannot watch that many."""
        if self._probes is not None:
            await asyncio.to_thread(self._probes.set_ports, ports)
        self.config = dataclasses.replace(self.config, ports=tuple(ports))

    def serve_fingerprints(self, _: Request) -> Response | Awaitable[Response]:
        if self._reader is None:
            return Response.error(HTTPStatus.SERVICE_UNAVAILABLE,
                                  f"probes are not running: {self._health}")
        # a row per flow: a few hundred milliseconds of work with 10,000 connections
        reader = self._reader
        return asyncio.to_thread(lambda: Response(HTTPStatus.OK, (*reader.report_json(), b"\n")))

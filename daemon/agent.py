"""The agent process: starts its components in order, serves until SIGTERM or SIGINT, and
stops them in reverse order so each releases what it holds (sockets, attached probes).
SIGHUP rereads the configuration file (daemon/reload.py). Under systemd it tells the
service manager when it is ready, reloading and stopping, and pets the watchdog from the
event loop, so a stuck loop gets the agent restarted."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from http import HTTPStatus
from importlib import metadata
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from loadmesh.daemon import logs
from loadmesh.daemon.api_server import ApiServer, RouteTable
from loadmesh.daemon.config import EXIT_CONFIG, Config, open_mesh_refusal
from loadmesh.daemon.endpoints import endpoints
from loadmesh.daemon.health import Component, HealthState, StartupError
from loadmesh.daemon.http import Request, Response
from loadmesh.daemon.gossip_component import GossipComponent
from loadmesh.daemon.gpu_component import GpuComponent
from loadmesh.daemon.metrics import AgentCollector
from loadmesh.daemon.metrics_server import MetricsServer
from loadmesh.daemon.probes_component import ProbesComponent
from loadmesh.daemon.reload import Reloader
from loadmesh.daemon.routing_component import RoutingComponent
from loadmesh.daemon.sd_notify import Notifier
from loadmesh.daemon.snapshot_component import SnapshotComponent

log = logs.get("agent")


def software_version() -> str:
    try:
        return metadata.version("loadmesh")
    except metadata.PackageNotFoundError:
        return "unknown"


class Agent:
    def __init__(self, config: Config, config_path: str | None = None) -> None:
        """config_path: the file config came from, reread on SIGHUP (None: defaults)."""
        self.config = config
        self.version = software_version()
        self.probes = ProbesComponent(config.probes)
        self.gpu = GpuComponent()
        self.snapshot = SnapshotComponent(config, self.probes, self.gpu)
        self.gossip = GossipComponent(config.node_id, config.gossip, config.advertise or None,
                                      self.snapshot)
        self.routing = RoutingComponent(config.node_id, config.routing, self.gossip,
                                        self.snapshot)
        self.reloader = Reloader(config_path, self.probes, self.snapshot, self.gossip, self.routing)
        registry = CollectorRegistry()
        registry.register(AgentCollector(self, config.metrics.model_labels))
        ProcessCollector(registry=registry)
        # The API comes first: claiming its socket is what stops a second agent on the same
        # host before it attaches probes a second time.
        self.components: list[Component] = [
            ApiServer(config.api.socket, RouteTable(endpoints(self))), self.probes, self.gpu,
            self.snapshot, self.gossip, self.routing, MetricsServer(config.metrics.listen, registry)]
        self.notifier = Notifier()
        self._started_wall = time.time()
        self._started_mono = time.monotonic()
        self._running = False  # every component started

    @property
    def node_id(self) -> str:
        return self.config.node_id

    async def run(self) -> int:
        """Run until a signal; return the process exit code."""
        refusal = open_mesh_refusal(self.config.gossip)
        if refusal:
            log.error("%s", refusal)
            return EXIT_CONFIG
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        reload_wanted = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig, stop)
        # Before the components start: a SIGHUP meanwhile (which would otherwise end the
        # process) is kept, and served once everything runs.
        loop.add_signal_handler(signal.SIGHUP, reload_wanted.set)
        started: list[Component] = []
        tasks: list[asyncio.Task[None]] = []
        code = 0
        try:
            for component in self.components:
                if stop.is_set():
                    break
                self.notifier.status(f"starting {component.name}")
                try:
                    await component.start()
                except StartupError as exc:
                    log.error("cannot start %s: %s", component.name, exc)
                    code = EXIT_CONFIG if exc.config else 1
                    break
                started.append(component)
            else:
                # What start-up made (modules, BCC, pyroute2: tens of thousands of objects)
                # lives as long as the agent: out of the collector's sight, full collections
                # walk only what the agent makes as it runs, and hold the GIL that much less.
                gc.freeze()
                self._running = True
                log.info("node %s ready: %s", self.config.node_id, self._summary())
                self.notifier.ready(self._status_line())
                tasks.append(asyncio.create_task(self._reloads(reload_wanted), name="reload"))
                interval = self.notifier.watchdog_interval_s
                if interval is not None:
                    tasks.append(asyncio.create_task(self._watchdog(interval), name="watchdog"))
                await stop.wait()
        finally:
            self.notifier.stopping()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for component in reversed(started):
                try:
                    await component.stop()
                except Exception:
                    log.exception("stopping %s failed", component.name)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        log.info("stopped")
        return code

    async def _reloads(self, wanted: asyncio.Event) -> None:
        while True:
            await wanted.wait()
            wanted.clear()
            log.info("SIGHUP received, reloading %s", self.reloader.path or "(no file)")
            self.notifier.reloading()
            try:
                self.config = await self.reloader.reload(self.config)
            except Exception:
                # A bug, not a bad file (the reloader reports those itself): the agent
                # keeps serving, and the next SIGHUP tries again.
                log.exception("reloading the configuration failed")
            self.notifier.ready(self._status_line())

    async def _watchdog(self, interval_s: float) -> None:
        # On the event loop on purpose: a loop stuck in a blocking call stops the pings,
        # and systemd restarts the agent after WatchdogSec. So does a stuck snapshot tick:
        # a loop that answers while the node's snapshot no longer moves is not alive.
        while True:
            if not self.snapshot.stalled_s:
                self.notifier.watchdog()
            await asyncio.sleep(interval_s)

    def _status_line(self) -> str:
        line = f"{self._overall()}: {self._summary()}"
        if not self.reloader.last_ok:
            line += "; last reload failed (see the log)"
        return line

    @staticmethod
    def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
        log.info("%s received, stopping", sig.name)
        stop.set()

    def _components_json(self) -> dict[str, dict[str, str]]:
        return {c.name: c.health().as_json() for c in self.components}

    def _overall(self) -> HealthState:
        # "off" is a component this host does not have (no GPU, no interfaces): that is
        # how the host is, not something wrong with the agent.
        degraded = any(c.health().state is HealthState.DEGRADED for c in self.components)
        return HealthState.DEGRADED if degraded else HealthState.OK

    def _summary(self) -> str:
        return ", ".join(f"{c.name} {c.health()}" for c in self.components)

    def _state(self) -> str:
        return str(self._overall()) if self._running else "starting"

    def serve_healthz(self, _: Request) -> Response:
        # 200 while the agent serves at all: a degraded agent still routes and gossips, and
        # a supervisor that restarted it for a missing GPU would only make things worse.
        # 503 until every component has started: the API answers first (its socket is
        # what keeps a second agent out), seconds before the probes are attached.
        return Response.json({"status": self._state(), "components": self._components_json()},
                             HTTPStatus.OK if self._running else HTTPStatus.SERVICE_UNAVAILABLE)

    def serve_status(self, _: Request) -> Response:
        body: dict[str, Any] = {
            "node_id": self.config.node_id,
            "version": self.version,
            "pid": os.getpid(),
            "started_at": round(self._started_wall, 3),
            "uptime_s": round(time.monotonic() - self._started_mono, 3),
            "status": self._state(),
            "components": self._components_json(),
        }
        return Response.json(body)

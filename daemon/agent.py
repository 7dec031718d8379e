"""The agent process: starts its components in order, serves until SIGTERM or SIGINT, and
stops them in reverse order so each releases what it holds (sockets, attached probes)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from http import HTTPStatus
from importlib import metadata
from typing import Any

from daemon import logs
from daemon.api_server import ApiServer, Router
from daemon.config import Config
from daemon.health import Component, State, StartupError
from daemon.http import Request, Response
from daemon.gossip_component import GossipComponent
from daemon.gpu_component import GpuComponent
from daemon.probes_component import ProbesComponent
from daemon.routing_component import RoutingComponent, routing_config
from daemon.snapshot_component import SnapshotComponent

log = logs.get("agent")


def software_version() -> str:
    try:
        return metadata.version("loadmesh")
    except metadata.PackageNotFoundError:
        return "unknown"


class Agent:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.router = Router()
        # The API comes first: claiming its socket is what stops a second agent on the same
        # host before it attaches probes a second time.
        self.probes = ProbesComponent(config.probes, self.router)
        self.gpu = GpuComponent()
        self.snapshot = SnapshotComponent(config, self.probes, self.gpu, self.router)
        self.gossip = GossipComponent(config.node_id, config.gossip, config.advertise or None,
                                      self.snapshot, self.router)
        self.routing = RoutingComponent(
            config.node_id,
            routing_config(config.routing, config.load.degraded_at, config.load.overloaded_at),
            self.gossip, self.snapshot, self.router)
        self.components: list[Component] = [
            ApiServer(config.api.socket, self.router), self.probes, self.gpu, self.snapshot,
            self.gossip, self.routing]
        self._started_wall = time.time()
        self._started_mono = time.monotonic()
        self.router.add("GET", "/healthz", self._healthz)
        self.router.add("GET", "/v1/status", self._status)

    async def run(self) -> int:
        """Run until a signal; return the process exit code."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig, stop)
        started: list[Component] = []
        code = 0
        try:
            for component in self.components:
                if stop.is_set():
                    break
                try:
                    await component.start()
                except StartupError as exc:
                    log.error("cannot start %s: %s", component.name, exc)
                    code = 1
                    break
                started.append(component)
            else:
                log.info("node %s ready: %s", self.config.node_id, self._summary())
                await stop.wait()
        finally:
            for component in reversed(started):
                try:
                    await component.stop()
                except Exception:
                    log.exception("stopping %s failed", component.name)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        log.info("stopped")
        return code

    @staticmethod
    def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
        log.info("%s received, stopping", sig.name)
        stop.set()

    def _components_json(self) -> dict[str, dict[str, str]]:
        return {c.name: c.health().as_json() for c in self.components}

    def _overall(self) -> State:
        # "off" is a component this host does not have (no GPU, no interfaces): that is
        # how the host is, not something wrong with the agent.
        degraded = any(c.health().state is State.DEGRADED for c in self.components)
        return State.DEGRADED if degraded else State.OK

    def _summary(self) -> str:
        return ", ".join(f"{c.name} {c.health()}" for c in self.components)

    def _healthz(self, _: Request) -> Response:
        # 200 while the agent serves at all: a degraded agent still routes and gossips, and
        # a supervisor that restarted it for a missing GPU would only make things worse.
        return Response.json({"status": str(self._overall()),
                              "components": self._components_json()}, HTTPStatus.OK)

    def _status(self, _: Request) -> Response:
        body: dict[str, Any] = {
            "node_id": self.config.node_id,
            "version": software_version(),
            "pid": os.getpid(),
            "started_at": round(self._started_wall, 3),
            "uptime_s": round(time.monotonic() - self._started_mono, 3),
            "status": str(self._overall()),
            "components": self._components_json(),
        }
        return Response.json(body)

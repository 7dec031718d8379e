"""The `metrics` component: Prometheus's GET /metrics over HTTP on metrics.listen.

Served from the event loop, not from prometheus_client's server thread: the state the
collector reads (gossip counters, routing counts, the peer table) changes on the loop,
and a scrape from another thread could find a dict changing size under it. A scrape is
about a millisecond of loop time. The HTTP side reuses the local API's request parser,
with the same bounds on what a client can make the agent hold.

A taken port leaves the agent running without its exporter (degraded, with the reason):
routing does not depend on it, and Prometheus shows the target down.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from loadmesh.daemon import logs
from loadmesh.daemon.config import split_host_port
from loadmesh.daemon.health import OK, Health, HealthState
from loadmesh.daemon.http import MAX_HEAD_BYTES, Request, Response
from loadmesh.daemon.http_server import Connections

log = logs.get("metrics")

# The text format generate_latest() writes (prometheus_client's newer default content
# type announces 1.0.0, which Prometheus before 3.0 does not know).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Prometheus keeps one connection per target and scrapes every 15-60 s; a few more allow
# for a second Prometheus and someone with curl.
MAX_CONNECTIONS = 16
IDLE_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 5.0


class MetricsServer:
    name = "metrics"

    def __init__(self, listen: str, registry: CollectorRegistry) -> None:
        """listen: "host:port", or "" for no exporter."""
        self.listen = listen
        self.registry = registry
        self._server: asyncio.Server | None = None
        self._connections = Connections(self._answer, MAX_CONNECTIONS, IDLE_TIMEOUT_S,
                                        REQUEST_TIMEOUT_S)
        self._health = Health(HealthState.OFF, "not started")

    async def start(self) -> None:
        if not self.listen:
            self._health = Health(HealthState.OFF, "metrics.listen is empty")
            return
        host, port = split_host_port(self.listen)
        try:
            self._server = await asyncio.start_server(
                self._connections.handle, host, port, limit=MAX_HEAD_BYTES, reuse_address=True)
        except OSError as exc:
            self._health = Health(HealthState.DEGRADED,
                                  f"cannot listen on {self.listen}: {exc.strerror or exc}")
            log.warning("running without the exporter: %s", self._health.reason)
            return
        self._health = OK
        log.info("serving http://%s/metrics", self.listen)

    async def stop(self) -> None:
        if self._server is None:
            return
        await self._connections.shut_down(self._server)
        self._server = None

    def health(self) -> Health:
        return self._health

    def _answer(self, request: Request) -> Response:
        if request.path != "/metrics":
            return Response.error(HTTPStatus.NOT_FOUND, "the metrics are at /metrics")
        if request.method != "GET":
            response = Response.error(HTTPStatus.METHOD_NOT_ALLOWED, "only GET /metrics")
            response.headers["Allow"] = "GET"
            return response
        try:
            body = generate_latest(self.registry)
        except Exception:
            log.exception("collecting the metrics failed")
            return Response.error(HTTPStatus.INTERNAL_SERVER_ERROR, "collecting the metrics failed")
        return Response(HTTPStatus.OK, body, CONTENT_TYPE)

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

from daemon import logs
from daemon.config import split_host_port
from daemon.health import OK, Health, State
from daemon.http import MAX_HEAD_BYTES, HttpError, Request, Response, parse_head

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
        self._connections: set[asyncio.Task[None]] = set()
        self._health = Health(State.OFF, "not started")

    async def start(self) -> None:
        if not self.listen:
            self._health = Health(State.OFF, "metrics.listen is empty")
            return
        host, port = split_host_port(self.listen)
        try:
            self._server = await asyncio.start_server(
                self._on_connection, host, port, limit=MAX_HEAD_BYTES, reuse_address=True)
        except OSError as exc:
            self._health = Health(State.DEGRADED,
                                  f"cannot listen on {self.listen}: {exc.strerror or exc}")
            log.warning("running without the exporter: %s", self._health.reason)
            return
        self._health = OK
        log.info("serving http://%s/metrics", self.listen)

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    def health(self) -> Health:
        return self._health

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) > MAX_CONNECTIONS:
                await self._send(writer, Response.error(HTTPStatus.SERVICE_UNAVAILABLE,
                                                        "too many connections"), False)
                return
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is over."""
        try:
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                first = await reader.read(1)
            if not first:
                return False
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                request = parse_head(first + await reader.readuntil(b"\r\n\r\n"))
                await reader.readexactly(request.content_length)
        except (TimeoutError, asyncio.IncompleteReadError):
            return False
        except asyncio.LimitOverrunError:
            await self._send(writer, Response.error(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large"), False)
            return False
        except HttpError as exc:
            await self._send(writer, Response.error(exc.status, exc.message), False)
            return False
        await self._send(writer, self._answer(request), request.keep_alive)
        return request.keep_alive

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

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, response: Response, keep_alive: bool) -> None:
        writer.write(response.encode(keep_alive))
        await writer.drain()

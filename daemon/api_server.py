"""The local API's server: HTTP/1.1 with JSON over a Unix socket, keep-alive, one route
table (its endpoints are listed in daemon/endpoints.py).

Handlers are plain functions that read the agent's in-memory state and return a Response;
they run on the event loop and so must never block (anything slow is computed elsewhere,
off the loop, and only read here). That keeps a `best peer` answer to microseconds of work.
The rare handler whose answer takes real work (an operator's dump of every flow) returns
an awaitable instead, one that does the work in a thread.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus

from loadmesh.daemon import logs, unix_socket
from loadmesh.daemon.health import OK, Health, StartupError
from loadmesh.daemon.http import MAX_HEAD_BYTES, HttpError, Request, Response
from loadmesh.daemon.http_server import Connections

Handler = Callable[[Request], Response | Awaitable[Response]]

log = logs.get("api")

# Idle keep-alive connections are closed after this; a router holds one open and sends
# many requests a second, so only abandoned connections ever reach it.
IDLE_TIMEOUT_S = 60.0
# A client that starts a request must finish it quickly: the socket is local.
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 256


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    answers: str  # what a client gets back, status codes included: the API's reference


class RouteTable:
    def __init__(self, routes: Iterable[Route]) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}
        for route in routes:
            methods = self._routes.setdefault(route.path, {})
            if route.method in methods:
                raise ValueError(f"route {route.method} {route.path} registered twice")
            methods[route.method] = route.handler

    def dispatch(self, request: Request) -> Response | Awaitable[Response]:
        methods = self._routes.get(request.path)
        if methods is None:
            return Response.error(HTTPStatus.NOT_FOUND, f"no such endpoint: {request.path}")
        handler = methods.get(request.method)
        if handler is None:
            response = Response.error(HTTPStatus.METHOD_NOT_ALLOWED,
                                      f"{request.method} not allowed on {request.path}")
            response.headers["Allow"] = ", ".join(sorted(methods))
            return response
        try:
            response = handler(request)
        except Exception as exc:
            return _failed(request, exc)
        return _finish(request, response) if inspect.isawaitable(response) else response


async def _finish(request: Request, pending: Awaitable[Response]) -> Response:
    try:
        return await pending
    except Exception as exc:
        return _failed(request, exc)


def _failed(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HttpError):
        return Response.error(exc.status, exc.message)
    log.error("handler for %s %s failed", request.method, request.path, exc_info=exc)
    return Response.error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")


class ApiServer:
    """The `api` component: owns the socket path from start() to stop()."""

    name = "api"

    def __init__(self, path: str, routes: RouteTable) -> None:
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._inode = 0
        self._connections = Connections(routes.dispatch, MAX_CONNECTIONS, IDLE_TIMEOUT_S,
                                        REQUEST_TIMEOUT_S)

    async def start(self) -> None:
        try:
            sock, self._inode = unix_socket.claim(self.path)
        except (unix_socket.SocketInUse, OSError) as exc:
            raise StartupError(str(exc)) from None
        self._server = await asyncio.start_unix_server(
            self._connections.handle, sock=sock, limit=MAX_HEAD_BYTES)
        log.info("listening on %s", self.path)

    async def stop(self) -> None:
        if self._server is None:
            return
        await self._connections.shut_down(self._server)
        self._server = None
        unix_socket.release(self.path, self._inode)
        log.info("closed %s", self.path)

    def health(self) -> Health:
        return OK

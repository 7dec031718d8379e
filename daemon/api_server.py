"""The local API: HTTP/1.1 with JSON over a Unix socket, keep-alive, one route table.

Handlers are plain functions that read the agent's in-memory state and return a Response;
they run on the event loop and so must never block (anything slow is computed elsewhere,
off the loop, and only read here). That keeps a `best peer` answer to microseconds of work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus

from daemon import logs, unix_socket
from daemon.health import OK, Health, StartupError
from daemon.http import MAX_HEAD_BYTES, HttpError, Request, Response, parse_head

Handler = Callable[[Request], Response]

log = logs.get("api")

# Idle keep-alive connections are closed after this; a router holds one open and sends
# many requests a second, so only abandoned connections ever reach it.
IDLE_TIMEOUT_S = 60.0
# A client that starts a request must finish it quickly: the socket is local.
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 256


class Router:
    def __init__(self) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        methods = self._routes.setdefault(path, {})
        if method in methods:
            raise ValueError(f"route {method} {path} registered twice")
        methods[method] = handler

    def dispatch(self, request: Request) -> Response:
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
            return handler(request)
        except HttpError as exc:
            return Response.error(exc.status, exc.message)
        except Exception:
            log.exception("handler for %s %s failed", request.method, request.path)
            return Response.error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")


class ApiServer:
    """The `api` component: owns the socket path from start() to stop()."""

    name = "api"

    def __init__(self, path: str, router: Router) -> None:
        self.path = path
        self.router = router
        self._server: asyncio.AbstractServer | None = None
        self._inode = 0
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        try:
            sock, self._inode = unix_socket.claim(self.path)
        except (unix_socket.SocketInUse, OSError) as exc:
            raise StartupError(str(exc)) from None
        self._server = await asyncio.start_unix_server(
            self._on_connection, sock=sock, limit=MAX_HEAD_BYTES)
        log.info("listening on %s", self.path)

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
        unix_socket.release(self.path, self._inode)
        log.info("closed %s", self.path)

    def health(self) -> Health:
        return OK

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) > MAX_CONNECTIONS:
                writer.write(Response.error(HTTPStatus.SERVICE_UNAVAILABLE,
                                            "too many connections").encode(keep_alive=False))
                await writer.drain()
                return
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                async with asyncio.timeout(IDLE_TIMEOUT_S):
                    first = await reader.read(1)
                if not first:
                    return  # the client closed between requests: the normal end
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    head = first + await reader.readuntil(b"\r\n\r\n")
                    request = parse_head(head)
                    if request.content_length:
                        request.body = await reader.readexactly(request.content_length)
            except TimeoutError:
                return
            except asyncio.IncompleteReadError:
                return  # closed mid-request: nobody is left to answer
            except asyncio.LimitOverrunError:
                await self._refuse(writer, HttpError(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large"))
                return
            except HttpError as exc:
                await self._refuse(writer, exc)
                return
            writer.write(self.router.dispatch(request).encode(request.keep_alive))
            await writer.drain()
            if not request.keep_alive:
                return

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, error: HttpError) -> None:
        writer.write(Response.error(error.status, error.message).encode(keep_alive=False))
        await writer.drain()


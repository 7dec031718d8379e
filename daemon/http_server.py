"""Serving HTTP/1.1 connections on asyncio streams, for any listener the agent opens (the
local API's Unix socket, the Prometheus exporter's TCP port).

One request at a time per connection, keep-alive, answered by a dispatch function (which
returns the response, or an awaitable of it when the answer takes work). What a client can
make the agent hold is bounded: the number of connections, the head size (the stream
limit), the time to finish a request, the idle time.

A full table does not turn a new client away while others only wait: the connection that
has waited longest for its client's bytes (idle between requests, or trickling a head) is
closed for it. Refusing instead, 300 idle connections on the Unix socket kept real clients
out for the idle timeout (60 s), and 16 on the exporter's port every scrape for 300 s. A
connection whose request is being answered is never closed for another; a closed idle
one costs its client a reconnect.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from loadmesh.daemon.http import HttpError, Request, Response, parse_head

Dispatch = Callable[[Request], Response | Awaitable[Response]]


class Connections:
    def __init__(self, dispatch: Dispatch, max_connections: int, idle_timeout_s: float,
                 request_timeout_s: float = 5.0) -> None:
        self.dispatch = dispatch
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.request_timeout_s = request_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        # The connections waiting for their client, since when (monotonic).
        self._waiting: dict[asyncio.Task[None], float] = {}

    async def shut_down(self, server: asyncio.AbstractServer) -> None:
        """Stops the listener, then ends the connections it accepted: wait_closed() waits
        for them, so they go first."""
        server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The stream server's callback: serves one connection until it ends."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if len(self._tasks) > self.max_connections and not self._evict():
                await _send(writer, Response.error(HTTPStatus.SERVICE_UNAVAILABLE,
                                                   "too many connections"), keep_alive=False)
                return
            await self._serve(reader, writer, task)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            self._waiting.pop(task, None)
            writer.close()

    def _evict(self) -> bool:
        """Closes the connection that has waited longest for its client; False if none
        waits (every one is being answered)."""
        if not self._waiting:
            return False
        oldest = min(self._waiting, key=self._waiting.__getitem__)
        del self._waiting[oldest]
        oldest.cancel()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     task: asyncio.Task[None]) -> None:
        while True:
            self._waiting[task] = time.monotonic()
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    first = await reader.read(1)
                if not first:
                    return  # the client closed between requests: the normal end
                async with asyncio.timeout(self.request_timeout_s):
                    request = parse_head(first + await reader.readuntil(b"\r\n\r\n"))
                    if request.content_length:
                        request.body = await reader.readexactly(request.content_length)
            except (TimeoutError, asyncio.IncompleteReadError):
                return  # idle too long, or closed mid-request: nobody is left to answer
            except asyncio.LimitOverrunError:
                await _send(writer, Response.error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                                   "request head too large"), keep_alive=False)
                return
            except HttpError as exc:
                await _send(writer, Response.error(exc.status, exc.message), keep_alive=False)
                return
            self._waiting.pop(task, None)
            response = self.dispatch(request)
            if inspect.isawaitable(response):
                response = await response
            await _send(writer, response, request.keep_alive)
            if not request.keep_alive:
                return


async def _send(writer: asyncio.StreamWriter, response: Response, keep_alive: bool) -> None:
    for part in response.encode(keep_alive):
        writer.write(part)
        await writer.drain()

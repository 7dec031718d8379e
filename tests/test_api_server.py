"""The local API server on a real Unix socket: keep-alive, errors, hostile clients."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import threading
from collections.abc import Awaitable, Iterator
from http import HTTPStatus
from pathlib import Path

import pytest

from loadmesh.daemon.api_server import ApiServer, Route, RouteTable
from loadmesh.daemon.client import AgentUnavailable, ApiError, Client
from loadmesh.daemon.health import StartupError
from loadmesh.daemon.http import HttpError, Request, Response


def _echo(req: Request) -> Response:
    return Response.json({"query": req.query, "body": req.json() if req.body else None})


def _parts(_: Request) -> Response:
    return Response(HTTPStatus.OK, tuple(b"%d," % i * 1000 for i in range(50)) + (b"end",))


def _boom(_: Request) -> Response:
    raise RuntimeError("handler bug")


_release_slow = threading.Event()


def _slow(req: Request) -> Awaitable[Response]:
    """A handler that does its work in a thread, as the fingerprint dump does; the work
    ends when the test releases it."""
    def work() -> Response:
        if "fail" in req.query:
            raise RuntimeError("worker bug")
        if "refuse" in req.query:
            raise HttpError(HTTPStatus.CONFLICT, "refused")
        _release_slow.wait(10)
        return Response.json({"slow": True})
    return asyncio.to_thread(work)


class ServerThread:
    """An ApiServer on its own event loop in a thread, as the agent runs it."""

    def __init__(self, path: str) -> None:
        self.server = ApiServer(path, RouteTable([
            Route("GET", "/echo", _echo, "the request"),
            Route("POST", "/echo", _echo, "the request"),
            Route("GET", "/boom", _boom, "500"),
            Route("GET", "/parts", _parts, "a body in parts"),
            Route("GET", "/slow", _slow, "an answer from a thread")]))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def __enter__(self) -> ServerThread:
        self.thread.start()
        self.call(self.server.start())
        return self

    def __exit__(self, *_: object) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def server(run_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(str(run_dir / "sub" / "api.sock")) as s:
        yield s


class Conn:
    """A raw client connection that reads responses one at a time, pipelining included."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.file = self.sock.makefile("rb")

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status_line = self.file.readline()
        assert status_line, "connection closed before a response"
        headers = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        return int(status_line.split()[1]), headers, self.file.read(int(headers["content-length"]))

    def closed_by_peer(self) -> bool:
        return self.file.read(1) == b""


def test_socket_is_created_with_its_directory_and_mode_0660(server: ServerThread) -> None:
    st = os.stat(server.server.path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_hundred_requests_on_one_keep_alive_connection(server: ServerThread) -> None:
    with Conn(server.server.path) as s:
        for i in range(100):
            s.send(f"GET /echo?i={i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            status, headers, body = s.response()
            assert status == 200 and headers["connection"] == "keep-alive"
            assert json.loads(body)["query"] == {"i": str(i)}


def test_a_body_in_parts_is_one_body_and_the_connection_goes_on(server: ServerThread) -> None:
    with Conn(server.server.path) as c:
        c.send(b"GET /parts HTTP/1.1\r\n\r\nGET /echo?a=1 HTTP/1.1\r\n\r\n")
        status, headers, body = c.response()
        assert status == 200 and body == b"".join(b"%d," % i * 1000 for i in range(50)) + b"end"
        assert int(headers["content-length"]) == len(body)
        assert json.loads(c.response()[2])["query"] == {"a": "1"}


def test_pipelined_requests_are_answered_in_order(server: ServerThread) -> None:
    with Conn(server.server.path) as s:
        s.send(b"".join(f"GET /echo?i={i} HTTP/1.1\r\n\r\n".encode() for i in range(5)))
        for i in range(5):
            assert json.loads(s.response()[2])["query"] == {"i": str(i)}


def test_post_body_in_a_later_write(server: ServerThread) -> None:
    body = b'{"outcome": "ok"}'
    with Conn(server.server.path) as s:
        s.send(b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
        s.send(body)
        status, _, answer = s.response()
        assert status == 200 and json.loads(answer)["body"] == {"outcome": "ok"}


def test_a_handler_working_in_a_thread_does_not_hold_up_other_connections(
        server: ServerThread) -> None:
    _release_slow.clear()
    with Conn(server.server.path) as slow, Conn(server.server.path) as quick:
        slow.send(b"GET /slow HTTP/1.1\r\n\r\n")
        quick.send(b"GET /echo HTTP/1.1\r\n\r\n")
        assert quick.response()[0] == 200  # while the slow one is still at work
        _release_slow.set()
        assert json.loads(slow.response()[2]) == {"slow": True}


@pytest.mark.parametrize("request_bytes, status, allow", [
    (b"GET /nope HTTP/1.1\r\n\r\n", 404, None),
    (b"DELETE /echo HTTP/1.1\r\n\r\n", 405, "GET, POST"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\n{x}", 400, None),
    (b"GET /boom HTTP/1.1\r\n\r\n", 500, None),
    (b"GET /slow?fail=1 HTTP/1.1\r\n\r\n", 500, None),
    (b"GET /slow?refuse=1 HTTP/1.1\r\n\r\n", 409, None),
])
def test_errors_are_json_and_keep_the_connection(server: ServerThread, request_bytes: bytes,
                                                 status: int, allow: str | None) -> None:
    with Conn(server.server.path) as s:
        s.send(request_bytes)
        got, headers, body = s.response()
        assert got == status and json.loads(body)["status"] == status
        assert headers.get("allow") == allow
        s.send(b"GET /echo HTTP/1.1\r\n\r\n")
        assert s.response()[0] == 200


@pytest.mark.parametrize("garbage, status", [
    (b"\x00\x01\x02 garbage\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\n\r\n", 505),
    (b"GET /echo HTTP/1.1\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"POST /echo HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n", 413),
])
def test_garbage_is_answered_then_the_connection_closes(server: ServerThread, garbage: bytes,
                                                        status: int) -> None:
    with Conn(server.server.path) as s:
        s.send(garbage)
        assert s.response()[0] == status
        assert s.closed_by_peer()
    with Client(server.server.path) as client:  # and the server still serves others
        assert client.get("/echo", a="1")["query"] == {"a": "1"}


def test_half_closed_client_still_gets_its_answer(server: ServerThread) -> None:
    with Conn(server.server.path) as s:
        s.send(b"GET /echo?x=1 HTTP/1.1\r\n\r\n")
        s.sock.shutdown(socket.SHUT_WR)
        assert s.response()[0] == 200
        assert s.closed_by_peer()


def test_client_vanishing_mid_request_does_not_hurt(server: ServerThread) -> None:
    for partial in (b"GET /ec", b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\n{"):
        s = Conn(server.server.path)
        s.send(partial)
        s.close()
    with Client(server.server.path) as client:
        assert client.get("/echo")["query"] == {}


def test_client_errors(server: ServerThread, run_dir: Path) -> None:
    with Client(server.server.path) as client:
        with pytest.raises(ApiError) as info:
            client.get("/nope")
        assert info.value.status == 404
    with pytest.raises(AgentUnavailable, match="does not exist"):
        Client(str(run_dir / "absent.sock")).get("/echo")


def test_a_client_that_found_no_agent_reaches_it_once_it_is_up(run_dir: Path) -> None:
    path = str(run_dir / "later.sock")
    with Client(path) as client:
        for _ in range(2):
            with pytest.raises(AgentUnavailable, match="does not exist"):
                client.get("/echo")
        with ServerThread(path):
            assert client.get("/echo", b="2")["query"] == {"b": "2"}


def test_second_server_on_a_live_socket_refuses(server: ServerThread) -> None:
    other = ApiServer(server.server.path, RouteTable([]))
    with pytest.raises(StartupError, match="another agent is serving"):
        asyncio.run(other.start())
    with Client(server.server.path) as client:
        assert client.get("/echo")["query"] == {}


def test_stale_socket_is_replaced_and_removed_on_stop(run_dir: Path) -> None:
    path = str(run_dir / "api.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, as a crashed agent leaves it
    with ServerThread(path):
        with Client(path) as client:
            assert client.get("/echo")["query"] == {}
    assert not os.path.exists(path)


def test_a_regular_file_at_the_socket_path_is_never_deleted(run_dir: Path) -> None:
    path = run_dir / "api.sock"
    path.write_text("precious")
    server = ApiServer(str(path), RouteTable([]))
    with pytest.raises(StartupError, match="not a socket"):
        asyncio.run(server.start())
    assert path.read_text() == "precious"

"""A small synchronous client for the local API that keeps one connection open.

For the CLI and for routers written in Python: a router asks the agent for a peer before
each request, so reusing one keep-alive connection matters more than anything else here.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any
from urllib.parse import urlencode

from loadmesh.daemon.config import ApiConfig

DEFAULT_SOCKET = ApiConfig().socket


class AgentUnavailable(Exception):
    """No agent answers on the socket; str() says why in operator terms."""


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class Client:
    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 2.0) -> None:
        self.socket_path = socket_path
        self._conn = _UnixConnection(socket_path, timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def get(self, path: str, **query: str) -> Any:
        target = f"{path}?{urlencode(query)}" if query else path
        return self._request("GET", target, None)

    def post(self, path: str, payload: Any) -> Any:
        return self._request("POST", path, json.dumps(payload).encode())

    def _unavailable(self, error: OSError) -> str:
        if isinstance(error, FileNotFoundError):
            return f"no agent is running: {self.socket_path} does not exist"
        if isinstance(error, ConnectionRefusedError):
            return f"no agent is running: nothing listens on {self.socket_path}"
        if isinstance(error, PermissionError):
            return (f"permission denied on {self.socket_path}: run as root or in the socket's "
                    "group")
        return f"the agent on {self.socket_path} did not answer in time"

    def _request(self, method: str, target: str, body: bytes | None) -> Any:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        # One retry on a fresh connection: the agent closes idle keep-alive connections,
        # and a restarted agent drops them all.
        for attempt in (1, 2):
            try:
                self._conn.request(method, target, body=body, headers=headers)
                response = self._conn.getresponse()
                data = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._conn.close()
                if attempt == 2:
                    raise AgentUnavailable(f"the agent on {self.socket_path} closed the connection")
            except (FileNotFoundError, ConnectionRefusedError, PermissionError,
                    TimeoutError) as e:
                # http.client keeps a failed request's state: without a close, this
                # client's next request would raise CannotSendRequest, agent back or not.
                self._conn.close()
                raise AgentUnavailable(self._unavailable(e)) from None
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            raise ApiError(response.status, "the agent's answer is not JSON") from None
        if response.status >= 400:
            message = payload.get("error", "") if isinstance(payload, dict) else ""
            raise ApiError(response.status, message or response.reason)
        return payload

"""HTTP/1.1 messages for the local API: parsing request heads and encoding JSON responses.

Only what a local JSON API needs: a request line, headers, and a body sized by
Content-Length. Anything else (chunked uploads, HTTP/2, absurd sizes) is answered with the
status code that names the problem and the connection is closed, so a confused client
learns what went wrong and cannot make the agent hold memory for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
MAX_HEADERS = 64


class HttpError(Exception):
    """A request the server will not serve; the connection closes after the answer."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    keep_alive: bool
    content_length: int
    body: bytes = b""

    def json(self) -> Any:
        """The body as JSON; a body that is not JSON is the client's error (400)."""
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from None
        except RecursionError:
            # 64 KiB of "[" nest deeper than the interpreter's stack allows.
            raise HttpError(HTTPStatus.BAD_REQUEST, "body is nested too deep") from None


@dataclass
class Response:
    status: HTTPStatus
    # A tuple is written part by part, the event loop free between parts: a dump of
    # 100,000 flows is 16 MB, and one copy of it holds the interpreter for 5-10 ms.
    body: bytes | tuple[bytes, ...]
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, payload: Any, status: HTTPStatus = HTTPStatus.OK) -> Response:
        return cls(status, json.dumps(payload, separators=(",", ":")).encode() + b"\n")

    @classmethod
    def error(cls, status: HTTPStatus, message: str) -> Response:
        return cls.json({"error": message, "status": status.value}, status)

    def encode(self, keep_alive: bool) -> list[bytes]:
        """The response's bytes in the parts to write: one for a bytes body."""
        parts = (self.body,) if isinstance(self.body, bytes) else self.body
        lines = [
            f"HTTP/1.1 {self.status.value} {self.status.phrase}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {sum(map(len, parts))}",
            "Connection: keep-alive" if keep_alive else "Connection: close",
        ]
        lines.extend(f"{k}: {v}" for k, v in self.headers.items())
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if isinstance(self.body, bytes):
            return [head + self.body]
        return [head, *parts]


_METHOD_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SINGLE = frozenset({"content-length", "transfer-encoding", "host"})


def parse_head(head: bytes) -> Request:
    """Parse a request head (request line and headers, ending in a blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0]) <= _METHOD_CHARS:
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        if version.startswith("HTTP/"):
            raise HttpError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"{version} is not supported")
        raise HttpError(HTTPStatus.BAD_REQUEST, "malformed request line")
    if not target.startswith("/"):
        raise HttpError(HTTPStatus.BAD_REQUEST, "request target must be an absolute path")

    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(HTTPStatus.BAD_REQUEST, "malformed header line")
        if len(headers) >= MAX_HEADERS:
            raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "too many headers")
        key = name.lower()
        # Two lengths are how a request is smuggled past a proxy that reads the other one
        # (RFC 9112, 6.3): refused, never one of them picked.
        if key in _SINGLE and key in headers:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"repeated {name} header")
        headers[key] = value.strip()

    if "transfer-encoding" in headers:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "chunked request bodies are not supported")
    length_text = headers.get("content-length", "0")
    # ASCII digits only: str.isdigit() also takes "²", which int() then refuses.
    if not (length_text.isascii() and length_text.isdigit()):
        raise HttpError(HTTPStatus.BAD_REQUEST, "bad Content-Length")
    length = int(length_text)
    if length > MAX_BODY_BYTES:
        raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"body over {MAX_BODY_BYTES} bytes")

    connection = headers.get("connection", "").lower()
    if version == "HTTP/1.1":
        keep_alive = "close" not in connection
    else:
        keep_alive = "keep-alive" in connection

    split = urlsplit(target)
    query = dict(parse_qsl(split.query, keep_blank_values=True))
    return Request(method, unquote(split.path), query, headers, keep_alive, length)

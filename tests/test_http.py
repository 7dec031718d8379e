"""HTTP/1.1 request heads and responses of the local API."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from loadmesh.daemon.http import MAX_BODY_BYTES, HttpError, Response, parse_head


def test_request_line_headers_and_query() -> None:
    req = parse_head(b"GET /v1/best?model=llama%203&session=s1 HTTP/1.1\r\n"
                     b"Host: x\r\nX-Thing:  padded  \r\n\r\n")
    assert (req.method, req.path) == ("GET", "/v1/best")
    assert req.query == {"model": "llama 3", "session": "s1"}
    assert req.headers["x-thing"] == "padded"
    assert req.keep_alive and req.content_length == 0


@pytest.mark.parametrize("head, keep_alive", [
    (b"GET / HTTP/1.1\r\n\r\n", True),
    (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", False),
    (b"GET / HTTP/1.0\r\n\r\n", False),
    (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),
])
def test_keep_alive_follows_the_version_and_connection_header(head: bytes, keep_alive: bool) -> None:
    assert parse_head(head).keep_alive is keep_alive


@pytest.mark.parametrize("head, status", [
    (b"\x16\x03\x01\x00\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"GET /\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"get / HTTP/1.1\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"GET http://x/ HTTP/1.1\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"PRI * HTTP/2.0\r\n\r\n", HTTPStatus.HTTP_VERSION_NOT_SUPPORTED),
    (b"GET / HTTP/2.0\r\n\r\n", HTTPStatus.HTTP_VERSION_NOT_SUPPORTED),
    (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"GET / HTTP/1.1\r\n : empty name\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"POST / HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"POST / HTTP/1.1\r\nContent-Length: 1\r\ncontent-length: 1\r\n\r\n",
     HTTPStatus.BAD_REQUEST),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", HTTPStatus.BAD_REQUEST),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", HTTPStatus.NOT_IMPLEMENTED),
    (f"POST / HTTP/1.1\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode(),
     HTTPStatus.REQUEST_ENTITY_TOO_LARGE),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(100)) + b"\r\n",
     HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE),
])
def test_bad_heads_get_the_status_that_names_the_problem(head: bytes, status: HTTPStatus) -> None:
    with pytest.raises(HttpError) as info:
        parse_head(head)
    assert info.value.status == status


def test_response_encoding() -> None:
    (raw,) = Response.json({"a": 1}).encode(keep_alive=True)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: %d" % len(body) in head
    assert b"Connection: keep-alive" in head
    assert body == b'{"a":1}\n'
    assert b"Connection: close" in Response.error(HTTPStatus.NOT_FOUND, "x").encode(False)[0]


def test_a_body_in_parts_is_written_in_those_parts_after_one_head() -> None:
    head, *parts = Response(HTTPStatus.OK, (b'{"a":[1,', b"2]}")).encode(keep_alive=False)
    assert parts == [b'{"a":[1,', b"2]}"]
    assert head.endswith(b"\r\n\r\n") and b"Content-Length: 11\r\n" in head

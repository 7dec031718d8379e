"""HTTP/1.1 server for probe tests, told by request headers how to answer, so a test knows
each response's status, latency and shape without any shared state:

    X-Delay-Ms: 40        wait 40 ms before the first byte of the response
    X-Status: 503         status code (default 200)
    X-Mode: json          json (Content-Length), chunked, sse (chunked text/event-stream),
                          close (no length: the body ends with the connection)
    X-Events: 5           chunks / SSE events after the first (default 3)
    X-Event-Ms: 10        pause between them (default 5)
    X-Hold: 1             keep this response (for chunked and sse: its last chunk) and send
                          it with the next response in one write: pipelined responses
                          sharing a segment

It answers requests on a connection in order (keep-alive and pipelining), answers
`Expect: 100-continue` with an interim 100, and HEAD without a body. The JSON body echoes
the request's "model". Run inside a namespace:

    python3 tests/probe_servers.py --port 8000     # prints "ready" once listening
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

REASONS = {100: "Continue", 200: "OK", 204: "No Content", 400: "Bad Request",
           404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
           503: "Service Unavailable"}


class Request:
    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes):
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body

    def header_int(self, name: str, default: int) -> int:
        return int(self.headers.get(name.lower(), default))

    def model(self) -> str | None:
        try:
            return json.loads(self.body).get("model")
        except (ValueError, AttributeError):
            return None


async def read_request(reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await reader.readexactly(int(headers.get("content-length", 0)))
    return Request(method, path, headers, body)


def _head(status: int, fields: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def respond(req: Request, writer: asyncio.StreamWriter, held: list[bytes]) -> bool:
    """Writes the response; returns False when the connection must close after it."""
    await asyncio.sleep(req.header_int("x-delay-ms", 0) / 1000)
    status = req.header_int("x-status", 200)
    mode = req.headers.get("x-mode", "json")
    events = req.header_int("x-events", 3)
    pause = req.header_int("x-event-ms", 5) / 1000
    body = json.dumps({"model": req.model(), "status": status}).encode()
    if req.method == "HEAD" or status in (204, 304):
        out = _head(status, {"Content-Length": str(len(body))} if status != 204 else {})
        return _send(writer, held, out, req)
    if mode == "json":
        return _send(writer, held, _head(status, {"Content-Type": "application/json",
                                                  "Content-Length": str(len(body))}) + body, req)
    if mode == "close":
        writer.write(b"".join(held) + _head(status, {"Connection": "close"}) + body)
        held.clear()
        return False
    sse = mode == "sse"
    fields = {"Content-Type": "text/event-stream" if sse else "application/json",
              "Transfer-Encoding": "chunked"}
    piece = (lambda i: f"data: {{\"token\": {i}}}\n\n".encode()) if sse else (
        lambda i: f"{{\"part\": {i}}}\n".encode())
    writer.write(b"".join(held) + _head(status, fields) + _chunk(piece(0)))
    held.clear()
    await writer.drain()
    for i in range(1, events + 1):
        await asyncio.sleep(pause)
        writer.write(_chunk(piece(i)))
        await writer.drain()
    last = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n" if sse else b"0\r\n\r\n"
    if req.headers.get("x-hold") == "1":
        held.append(last)
    else:
        writer.write(last)
        await writer.drain()
    return True


def _send(writer: asyncio.StreamWriter, held: list[bytes], data: bytes, req: Request) -> bool:
    held.append(data)
    if req.headers.get("x-hold") != "1":
        writer.write(b"".join(held))
        held.clear()
    return req.headers.get("connection", "").lower() != "close"


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    held: list[bytes] = []
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            req = await read_request(reader, writer)
            if req is None or not await respond(req, writer, held):
                break
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        if held:
            writer.write(b"".join(held))
        writer.close()


async def serve(port: int) -> None:
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 arrives mapped
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("::", port))
    server = await asyncio.start_server(handle, sock=sock, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()

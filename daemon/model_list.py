"""What the local inference servers say they serve: each serving port's OpenAI-style
`GET /v1/models` (vLLM, SGLang and TGI all answer it), asked at start and then every
`load.list_models_s` (every RETRY_S while a server does not answer).

The probes learn a model only from its traffic, so a host that has not had a request for
M yet shows no M, and no peer would send it one: with a listing, its snapshot carries M
(with no traffic) from the start, and no `routing.static_models` is needed. A server that
does not answer, or answers something else, is logged once and its port keeps what it
listed last; the probes still see its traffic.

The answer comes from a local server but is still bounded: at most MAX_BODY bytes, at
most MAX_MODELS names of at most MAX_NAME bytes each, within TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from loadmesh.daemon import logs
from loadmesh.gossip.snapshot import MAX_MODELS
from loadmesh.model_id import model_id

log = logs.get("models")

MAX_BODY = 256 * 1024
MAX_NAME = 256
TIMEOUT_S = 2.0
RETRY_S = 5.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class ListingError(Exception):
    pass


def parse_models(body: bytes) -> list[str]:
    """The model ids of an OpenAI `/v1/models` answer: {"data": [{"id": ...}, ...]}."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ListingError(f"not JSON ({exc.__class__.__name__})") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ListingError('no "data" list')
    names: list[str] = []
    for entry in data:
        name = entry.get("id") if isinstance(entry, dict) else None
        if isinstance(name, str) and 0 < len(name.encode()) <= MAX_NAME and name not in names:
            names.append(name)
            if len(names) == MAX_MODELS:
                break
    return names


def _body(answer: bytes) -> bytes:
    """The body of a complete HTTP/1.1 answer read to its close: 200 only, plain or
    chunked."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        raise ListingError("no complete answer head")
    lines = head.split(b"\r\n")
    status = lines[0].split(b" ", 2)
    if len(status) < 2 or status[1] != b"200":
        raise ListingError(f"answered {lines[0][:64].decode(errors='replace')!r}")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        out = bytearray()
        while True:
            size_line, sep, body = body.partition(b"\r\n")
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError:
                raise ListingError("bad chunk size") from None
            if not sep or size < 0 or len(body) < size:
                raise ListingError("truncated chunked body")
            if size == 0:
                return bytes(out)
            out += body[:size]
            body = body[size + 2:]
    return body


async def fetch_models(host: str, port: int) -> list[str]:
    """GET /v1/models from host:port, within TIMEOUT_S."""
    async def get() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: {authority}\r\n"
                         "Accept: application/json\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            chunks, size = [], 0
            while chunk := await reader.read(65536):
                size += len(chunk)
                if size > MAX_BODY + 4096:  # the head's allowance on top of the body's
                    raise ListingError(f"answer over {MAX_BODY} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            writer.close()
    try:
        answer = await asyncio.wait_for(get(), TIMEOUT_S)
    except TimeoutError:
        raise ListingError(f"no answer within {TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise ListingError(exc.strerror or str(exc)) from None
    return parse_models(_body(answer))


class ModelLister:
    """The last listing of each serving port, refreshed by run()."""

    def __init__(self, host: str, ports: Sequence[int], interval_s: float) -> None:
        self.host = host
        self.ports = tuple(ports)
        self.interval_s = interval_s
        self._listed: dict[int, dict[int, str]] = {}  # port -> model_id -> name
        self._failing: set[int] = set()
        self.wake = asyncio.Event()

    def listed(self) -> dict[int, dict[int, str]]:
        """port -> model_id -> name of the models its server listed last (ports no longer
        served left out)."""
        return {p: names for p, names in self._listed.items() if p in self.ports}

    async def _fetch(self, port: int) -> list[str]:
        """From the address peers are sent to, else from loopback: a server may listen on
        either alone."""
        try:
            return await fetch_models(self.host, port)
        except ListingError:
            if self.host in LOOPBACK:
                raise
            return await fetch_models(LOOPBACK[0], port)

    async def refresh(self) -> None:
        for port in self.ports:
            try:
                names = {model_id(name): name for name in await self._fetch(port)}
            except ListingError as exc:
                if port not in self._failing:
                    log.warning("port %d: GET /v1/models: %s; routing learns its models from "
                                "traffic only", port, exc)
                    self._failing.add(port)
                continue
            if port in self._failing or self._listed.get(port) != names:
                log.info("port %d serves %s", port, ", ".join(names.values()) or "no model")
            self._failing.discard(port)
            self._listed[port] = names

    async def run(self) -> None:
        """Lists every interval_s, after a first wait (the caller lists once at start);
        set `wake` after changing ports or interval_s (0: no listing)."""
        while True:
            # A server still loading its model (minutes, for a large one) is asked again
            # soon: its first requests may come from peers only once it is listed.
            wait = min(self.interval_s, RETRY_S) if self._failing else self.interval_s
            try:
                await asyncio.wait_for(self.wake.wait(), wait or None)
            except TimeoutError:
                pass
            self.wake.clear()
            if self.interval_s > 0:
                await self.refresh()

"""The probes against real HTTP traffic: a server with known latencies, status codes and
models (tests/probe_servers.py) in a namespace behind a veth pair, the probes on the host
end, clients on raw sockets so each test controls how requests fall into segments.

Every test uses its own model names, so its counts are exact whatever ran before it in
the module. No timing is asserted; latencies are compared with what the client measured.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import nettopo
from llm_clients import nearest_rank
from metrics_helpers import wait_for
from loadmesh.probes import FingerprintReader, MapSizes, ProbeSet, abi, buckets
from loadmesh.model_id import model_id
from loadmesh.probes.maps import MapSnapshot, format_ip

pytestmark = pytest.mark.root
ROOT = Path(__file__).resolve().parent.parent
SERVER = [sys.executable, str(ROOT / "tests" / "probe_servers.py")]
# The TCP figures come from tracepoints, which see every namespace of the host: a port no
# other test serves on, so that their connections (tests run side by side) are not counted.
PORT = 8150


# One probe set serves the whole module, whose tests between them make more rows of model
# figures (models x endpoints x statuses) than the default 64.
ROWS = MapSizes(rows=512)

@dataclass
class Env:
    topo: nettopo.VethTopo
    probes: ProbeSet


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with nettopo.veth_netns() as topo, \
            topo.ns.popen(SERVER + ["--port", str(PORT)], ready="ready"), \
            nettopo.probes_on(topo.host_if, [PORT], ROWS) as probes:
        yield Env(topo, probes)


# ---- a raw HTTP/1.1 client ----

def request(model: str | None, *, delay_ms: int = 0, status: int = 200, mode: str = "json",
            method: str = "POST", extra: dict[str, str] | None = None,
            body: bytes | None = None) -> tuple[bytes, bytes]:
    """(head, body) of a request that tells the test server how to answer."""
    if body is None:
        payload = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
        body = json.dumps(payload).encode() if model is not None else b""
    fields = {"Host": "probe-test", "Content-Type": "application/json", "X-Delay-Ms": delay_ms,
              "X-Status": status, "X-Mode": mode, **(extra or {})}
    if body or method == "POST":
        fields["Content-Length"] = len(body)
    head = f"{method} /v1/chat/completions HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode(), body


class Client:
    def __init__(self, host: str, port: int = PORT) -> None:
        self.sock = socket.create_connection((host, port), timeout=20)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    def close(self, reset: bool = False) -> None:
        if reset:  # RST instead of FIN
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.file.close()
        self.sock.close()

    def send(self, *parts: bytes, gap: float = 0.0) -> float:
        """Sends parts as separate segments when gap > 0; returns when the first left."""
        start = time.perf_counter()
        for i, part in enumerate(parts):
            if i and gap:
                time.sleep(gap)
            self.sock.sendall(part)
        return start

    def response(self, head_request: bool = False) -> tuple[int, float]:
        """(status, time of its first byte); skips interim 1xx responses."""
        while True:
            self.file.peek(1)  # waits for the first byte (or finds it already buffered)
            first = time.perf_counter()
            status = int(self.file.readline().split()[1])
            fields = {}
            while (line := self.file.readline()) not in (b"\r\n", b""):
                k, v = line.decode().split(":", 1)
                fields[k.strip().lower()] = v.strip()
            if 100 <= status < 200:
                continue
            if head_request:
                pass
            elif fields.get("transfer-encoding") == "chunked":
                while (size := int(self.file.readline().strip(), 16)) != 0:
                    self.file.read(size + 2)
                self.file.readline()
            elif "content-length" in fields:
                self.file.read(int(fields["content-length"]))
            else:
                self.file.read()
            return status, first

    def call(self, model: str | None, **kw: object) -> tuple[int, float]:
        """One request, head and body in one segment; (status, time to first byte)."""
        start = self.send(b"".join(request(model, **kw)))  # type: ignore[arg-type]
        status, first = self.response(head_request=kw.get("method") == "HEAD")
        return status, first - start


# ---- reading the probes ----

TTFB, E2E = abi.const("LM_HK_TTFB"), abi.const("LM_HK_E2E")
CHAT = abi.const("LM_EP_CHAT")


def by_model(snap: MapSnapshot, kind: int = TTFB) -> dict[tuple[int, int], int]:
    """Samples of one kind per (model, status): with ttfb, answers."""
    out: dict[tuple[int, int], int] = {}
    for (mid, _port, _ep, k, status, _bucket), n in snap.histograms.items():
        if k == kind:
            out[mid, status] = out.get((mid, status), 0) + n
    return out


def read(reader: FingerprintReader, model: str) -> int:
    """The answers to model that a fresh poll of the reader counts."""
    reader.poll(time.monotonic())
    return sum(m.requests for m in reader.model_stats() if m.model == model)


class Counts:
    """Responses the probes recorded since construction, per (model, status)."""

    def __init__(self, probes: ProbeSet) -> None:
        self.probes = probes
        self.before = probes.read_maps()

    def after(self, expected: dict[tuple[str, int], int] | None = None
              ) -> tuple[dict[tuple[str, int], int], MapSnapshot]:
        """The counts now, or once they are `expected` (for at most 5 s: what a client saw
        passed the hook before it, but a server's close or reset after an answer need not
        have when the client returns)."""
        deadline = time.monotonic() + 5
        while True:
            got, snap = self._since()
            if expected is None or got == expected or time.monotonic() > deadline:
                return got, snap
            time.sleep(0.02)

    def _since(self) -> tuple[dict[tuple[str, int], int], MapSnapshot]:
        snap = self.probes.read_maps()
        b0, b1 = by_model(self.before), by_model(snap)
        names = dict(snap.models)
        out = {}
        for key, n in b1.items():
            d = n - b0.get(key, 0)
            if d:
                out[names.get(key[0], "-" if key[0] == 0 else hex(key[0])), key[1]] = d
        return out, snap

    def errors(self, snap: MapSnapshot) -> dict[str, int]:
        return {k: v - self.before.errors[k] for k, v in snap.errors.items()
                if v != self.before.errors[k]}


# ---- tests ----

def test_counts_per_model_and_status_are_exact(env: Env) -> None:
    plan = [("count-a", 200), ("count-a", 429), ("count-b", 200), ("count-b", 503),
            ("count-a", 404), ("count-b", 200)]
    expected: dict[tuple[str, int], int] = {}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        client = Client(env.topo.ns_v4)
        for i in range(30):
            model, status = rng.choice(plan)
            got, _ = client.call(model, status=status, delay_ms=rng.randrange(3))
            with lock:
                expected[model, got] = expected.get((model, got), 0) + 1
            if i % 10 == 9:  # some new connections too
                client.close()
                client = Client(env.topo.ns_v4)
        client.close()

    counts = Counts(env.probes)
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got, snap = counts.after(expected)
    assert got == expected
    # per flow too: the rows of these models add up to the same counts
    rows: dict[tuple[str, int], int] = {}
    for (_c, _cp, _s, _sp, mid, status), stats in snap.flows.items():
        name = snap.models.get(mid)
        if name in ("count-a", "count-b"):
            rows[name, status] = rows.get((name, status), 0) + stats[0]
    assert rows == expected
    assert (model_id("count-a"), PORT, CHAT) not in snap.inflight
    # every answer also ended where its framing said: one e2e sample each
    e2e = by_model(snap, E2E)
    b0 = by_model(counts.before, E2E)
    names = dict(snap.models)
    assert {(names[m], s): n - b0.get((m, s), 0) for (m, s), n in e2e.items()
            if names.get(m) in ("count-a", "count-b")} == expected
    assert counts.errors(snap) == {}


def test_requests_in_flight_are_counted_per_model_until_answered(env: Env) -> None:
    """Slow requests on open connections, two of them pipelined on one: the in-flight
    counts per model are exact while they wait, and zero once they are answered."""
    slow, other = Client(env.topo.ns_v4), Client(env.topo.ns_v4)
    try:
        slow.send(b"".join(request("inflight-a", delay_ms=1500)) +
                  b"".join(request("inflight-a", delay_ms=0)))
        other.send(b"".join(request("inflight-b", delay_ms=1500)))
        a, b = (model_id("inflight-a"), PORT, CHAT), (model_id("inflight-b"), PORT, CHAT)

        def counted() -> dict[tuple[int, int, int], tuple[int, int]]:
            return {k: v for k, v in env.probes.read_maps().inflight.items() if k in (a, b)}

        # Exact from when the requests have passed the hook until they are answered (1.5 s).
        wait_for(lambda: counted() == {a: (2, 0), b: (1, 0)}, 1.0, "2 + 1 requests in flight")
        assert [slow.response()[0], slow.response()[0], other.response()[0]] == [200] * 3
        wait_for(lambda: counted() == {}, 5, "none in flight once answered")
    finally:
        slow.close()
        other.close()


def test_the_request_left_waiting_after_an_answer_counts_under_its_model(env: Env) -> None:
    """Two requests pipelined, the first answered: the one left is counted from the
    fields the kernel fills for the oldest request outstanding (maps.inflight)."""
    client = Client(env.topo.ns_v4)
    try:
        client.send(b"".join(request("left-a", delay_ms=50)) +
                    b"".join(request("left-b", delay_ms=1500, mode="sse")))
        assert client.response()[0] == 200
        inflight = env.probes.read_maps().inflight
        assert inflight.get((model_id("left-b"), PORT, CHAT)) == (1, 0)
        assert (model_id("left-a"), PORT, CHAT) not in inflight
        assert client.response()[0] == 200
    finally:
        client.close()


def test_p99_within_5_percent_of_the_client(env: Env) -> None:
    """Answers of 100-300 ms: a client thread on this 2-CPU machine, beside the other test
    workers, can read its clock milliseconds late (seen: 5 ms at a 70 ms median)."""
    model = "p99-model"
    ttfb: list[float] = []
    lock = threading.Lock()
    reader = FingerprintReader(env.probes, window_s=300)
    reader.poll(time.monotonic())

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        client = Client(env.topo.ns_v4)
        for _ in range(25):
            status, t = client.call(model, delay_ms=rng.randrange(100, 300))
            assert status == 200
            with lock:
                ttfb.append(t)
        client.close()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_for(lambda: read(reader, model) >= len(ttfb), 5, "every answer read")
    (stats,) = [m for m in reader.model_stats() if m.model == model]
    assert stats.requests == len(ttfb) == 200
    client_p99_ms = nearest_rank(ttfb, 0.99) * 1000
    assert stats.p99_ms == pytest.approx(client_p99_ms, rel=0.05)
    assert stats.p50_ms == pytest.approx(nearest_rank(ttfb, 0.5) * 1000, rel=0.05)


def test_kernel_buckets_are_the_python_buckets(env: Env) -> None:
    for i, delay in enumerate((0, 7, 33, 151)):
        model = f"bucket-check-{i}"
        client = Client(env.topo.ns_v4)
        client.call(model, delay_ms=delay)
        client.close()
        snap = env.probes.read_maps()
        mid = model_id(model)
        (lat_max,) = [v[2] for k, v in snap.flows.items() if k[4] == mid]
        (bucket,) = [b for (m, port, _ep, k, _s, b) in snap.histograms
                     if m == mid and port == PORT and k == TTFB]
        assert bucket == buckets.index(lat_max)
        assert lat_max >= delay * 1_000_000


def test_head_and_body_in_separate_segments(env: Env) -> None:
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    for _ in range(3):
        head, body = request("split-raw")
        client.send(head, body, gap=0.05)  # NODELAY and a pause: two segments
        assert client.response()[0] == 200
    client.close()
    # and a stock client: http.client writes the head and the body separately
    for _ in range(2):
        req = urllib.request.Request(
            f"http://{env.topo.ns_v4}:{PORT}/v1/chat/completions",
            data=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                             "model": "split-urllib"}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as resp:
            assert resp.status == 200
    expected = {("split-raw", 200): 3, ("split-urllib", 200): 2}
    got, _ = counts.after(expected)
    assert got == expected


def test_keep_alive_100_requests_on_one_connection(env: Env) -> None:
    """The flow's rows are exact while the connection lives (the latest run of like
    answers is still in its state, lm_flow_state.fp_*) and once it has ended."""
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    port = client.sock.getsockname()[1]
    expected: dict[tuple[str, int], int] = {}
    for i in range(100):
        # runs of like answers, a change of model or status now and then
        model, status = ("keepalive-x", 200) if i % 7 else ("keepalive-y", 429)
        assert client.call(model, status=status)[0] == status
        expected[model, status] = expected.get((model, status), 0) + 1

    def rows() -> dict[tuple[str, int], int]:
        snap = env.probes.read_maps()
        return {(snap.models[k[4]], k[5]): v[0] for k, v in snap.flows.items() if k[1] == port}

    assert rows() == expected
    client.close()
    got, _ = counts.after(expected)
    assert got == expected
    # the server's FIN ends the connection's state, which adds what it held to the map
    states = env.probes._bpf[b"inflight"]  # noqa: SLF001 (whether the state is gone)
    wait_for(lambda: all(k.client_port != port for k in states.keys()), 5, "state gone")
    assert rows() == expected


def test_a_dump_of_recent_rows_counts_a_row_whole(env: Env) -> None:
    """A row whose answers are partly in the map (an earlier run of the model, answered
    before the dump's window) and partly in the connection's state (the run now) is shown
    whole, with the later time: the window is applied to the row, not to each part."""
    client = Client(env.topo.ns_v4)
    port = client.sock.getsockname()[1]
    try:
        for model in ("recent-x", "recent-x", "recent-y"):  # the y answer moves x's run
            assert client.call(model)[0] == 200
        time.sleep(0.6)  # the map's x row falls out of a 0.5 s window
        assert client.call("recent-x")[0] == 200  # y's run moves, x runs again

        def rows(idle_s: float) -> dict[tuple[str, int], int]:
            _, flows = env.probes.read_flows(idle_s)
            names = env.probes.read_maps(with_flows=False).models
            return {(names[k[4]], k[5]): v[0] for k, v in flows.items() if k[1] == port}

        assert rows(0.5) == {("recent-x", 200): 3}
        assert rows(60) == {("recent-x", 200): 3, ("recent-y", 200): 1}
    finally:
        client.close()


def test_pipelined_requests_each_counted_once(env: Env) -> None:
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    # five requests in one write; the server answers them in one write too
    models = [f"pipe-{i}" for i in range(5)]
    parts = [b"".join(request(m, extra={"X-Hold": "1"} if i < 4 else {}))
             for i, m in enumerate(models)]
    client.send(b"".join(parts))
    assert [client.response()[0] for _ in models] == [200] * 5
    # a HEAD (its response has a Content-Length but no body) pipelined with a POST
    client.send(b"".join(request(None, method="HEAD", extra={"X-Hold": "1"})) +
                b"".join(request("pipe-after-head")))
    assert client.response(head_request=True)[0] == 200
    assert client.response()[0] == 200
    # a chunked answer followed in its own last segment by the next one: the probe follows
    # the chunks to find where the second answer starts
    client.send(b"".join(request("pipe-chunked", mode="chunked", extra={
        "X-Events": "6", "X-Event-Ms": "2", "X-Hold": "1"})) +
        b"".join(request("pipe-after-chunked", status=203)))
    assert client.response()[0] == 200
    assert client.response()[0] == 203
    client.close()
    expected = {**{(m, 200): 1 for m in models}, ("pipe-after-head", 200): 1,
                ("-", 200): 1, ("pipe-chunked", 200): 1, ("pipe-after-chunked", 203): 1}
    got, snap = counts.after(expected)
    assert got == expected
    assert counts.errors(snap) == {}


def test_request_pipelined_into_a_streaming_response(env: Env) -> None:
    """The second request leaves while the first (SSE) answer still streams, and the
    server sends the stream's end and the second answer in one write."""
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    client.send(b"".join(request("stream-first", mode="sse", extra={
        "X-Events": "4", "X-Event-Ms": "30", "X-Hold": "1"})))
    client.file.peek(1)  # the stream has begun
    client.send(b"".join(request("stream-second", status=201)))
    assert client.response()[0] == 200
    assert client.response()[0] == 201
    client.close()
    expected = {("stream-first", 200): 1, ("stream-second", 201): 1}
    got, snap = counts.after(expected)
    assert got == expected
    assert counts.errors(snap) == {}


def test_pipelining_deeper_than_the_ring(env: Env) -> None:
    depth = abi.const("LM_PIPE_DEPTH")
    n = depth + 4
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    client.send(b"".join(b"".join(request(f"deep-{i}")) for i in range(n)))
    assert [client.response()[0] for _ in range(n)] == [200] * n
    client.close()
    got, snap = counts.after()
    # counted once each; beyond the ring a request keeps no model (docs/probes.md)
    assert got == {**{(f"deep-{i}", 200): 1 for i in range(depth)}, ("-", 200): 4}
    assert counts.errors(snap) == {"pipe_overflow": 4}


def test_chunked_and_sse_latency_is_time_to_first_byte(env: Env) -> None:
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    port = client.sock.getsockname()[1]
    for mode in ("chunked", "sse"):
        start = client.send(b"".join(request(f"ttfb-{mode}", delay_ms=40, mode=mode,
                                             extra={"X-Events": "5", "X-Event-Ms": "40"})))
        status, _ = client.response()
        assert status == 200 and time.perf_counter() - start > 0.2  # a 240 ms answer
    assert client.call("ttfb-after", status=200)[0] == 200  # framing found its way out
    client.close()
    expected = {("ttfb-chunked", 200): 1, ("ttfb-sse", 200): 1, ("ttfb-after", 200): 1}
    got, snap = counts.after(expected)
    assert got == expected
    for mode in ("chunked", "sse"):
        (lat,) = [v[2] for k, v in snap.flows.items()
                  if k[1] == port and snap.models.get(k[4]) == f"ttfb-{mode}"]
        assert 40e6 <= lat < 150e6  # the first byte came after 40 ms, the last after 240


def test_ipv6(env: Env) -> None:
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v6)
    local = client.sock.getsockname()
    for status in (200, 200, 500):
        assert client.call("v6-model", status=status)[0] == status
    client.close()
    expected = {("v6-model", 200): 2, ("v6-model", 500): 1}
    got, snap = counts.after(expected)
    assert got == expected
    (key,) = {k for k in snap.flows if snap.models.get(k[4]) == "v6-model" and k[5] == 500}
    assert (format_ip(key[0]), key[1]) == (env.topo.host_v6, local[1])
    assert (format_ip(key[2]), key[3]) == (env.topo.ns_v6, PORT)


def openai_python_body(model: str, prompt_bytes: int, **after: object) -> bytes:
    """A body in openai-python's key order: "messages" first, "model" after them."""
    return json.dumps({"messages": [{"role": "user", "content": "p" * prompt_bytes}],
                       "model": model, **after}).encode()


def test_model_key_or_value_cut_by_a_segment_end(env: Env) -> None:
    """The body split at every byte from before "model" to after its value: the key, the
    colon, the space, the quotes or the name cut by the end of a segment."""
    model = "cut-model/Llama-3.1-8B"
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": model,
                       "stream": False}).encode()
    key = body.index(b'"model"')
    end = body.index(model.encode()) + len(model) + 1
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    assert client.call(model)[0] == 200  # the name, from a request not cut
    for cut in range(key - 1, end + 2):
        head, _ = request(None, body=body)
        client.send(head + body[:cut], body[cut:], gap=0.03)
        assert client.response()[0] == 200
    # a value cut while the first window of the segment still had room, in a new connection
    client.close()
    client = Client(env.topo.ns_v4)
    for cut in (key + 12, end - 1):
        head, _ = request(None, body=body)
        client.send(head, body[:cut], body[cut:], gap=0.03)
        assert client.response()[0] == 200
    client.close()
    expected = {(model, 200): 1 + (end + 2 - (key - 1)) + 2}
    got, snap = counts.after(expected)
    assert got == expected
    assert counts.errors(snap) == {}


def test_model_after_long_messages_is_found_in_the_body_tail(env: Env) -> None:
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    limit = env.probes.scan_limit
    # one segment (the veth carries up to 64 KiB at once)
    assert client.call(None, body=openai_python_body("tail-a", 20_000, temperature=0.2))[0] == 200
    # the body in pieces: the tail starts in one segment, "model" comes in the next
    body = openai_python_body("tail-b", 30_000, max_tokens=64, stream=False)
    at = body.index(b'"model"')
    head, _ = request(None, body=body)
    client.send(head, body[:at - limit // 2], body[at - limit // 2:at - 10], body[at - 10:],
                gap=0.05)
    assert client.response()[0] == 200
    # a body only a little longer than the limit: the tail overlaps what the head scan read
    assert client.call(None, body=openai_python_body("tail-c", limit))[0] == 200
    # two long ones pipelined in one write: the first's tail scan ends at the second's head
    client.send(b"".join(request(None, body=openai_python_body(m, 9_000))[0]
                         + openai_python_body(m, 9_000) for m in ("tail-d", "tail-e")))
    assert [client.response()[0] for _ in range(2)] == [200, 200]
    # "model" in the middle of a long body: openai-python 1.x with tools
    middle = openai_python_body("middle", 5_000, tools=[{"description": "t" * 5_000}])
    assert client.call(None, body=middle)[0] == 200
    # ... and beyond both ends' limits: no model, counted as such
    beyond = openai_python_body("beyond", limit + 500, tools=[{"description": "t" * limit}])
    assert client.call(None, body=beyond)[0] == 200
    assert client.call("after-the-tails")[0] == 200  # the connection's state recovered
    client.close()
    expected = {("tail-a", 200): 1, ("tail-b", 200): 1, ("tail-c", 200): 1, ("tail-d", 200): 1,
                ("tail-e", 200): 1, ("middle", 200): 1, ("-", 200): 1,
                ("after-the-tails", 200): 1}
    got, snap = counts.after(expected)
    assert got == expected
    assert counts.errors(snap) == {"scan_gave_up": 1}


def openai_python_head(body: bytes) -> bytes:
    """The head openai-python (httpx) sends: about 650 bytes, more than one window."""
    fields = {"Host": "probe-test:8000", "Accept-Encoding": "gzip, deflate",
              "Connection": "keep-alive", "Accept": "application/json",
              "Content-Type": "application/json", "User-Agent": "OpenAI/Python 1.54.0",
              "X-Stainless-Lang": "python", "X-Stainless-Package-Version": "1.54.0",
              "X-Stainless-OS": "Linux", "X-Stainless-Arch": "x64",
              "X-Stainless-Runtime": "CPython", "X-Stainless-Runtime-Version": "3.11.2",
              "Authorization": "Bearer sk-proj-" + "k" * 150, "X-Stainless-Async": "false",
              "x-stainless-retry-count": "0", "x-stainless-read-timeout": "600",
              "Content-Length": str(len(body))}
    return ("POST /v1/chat/completions HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n").encode()


def test_heads_longer_than_a_window(env: Env) -> None:
    """openai-python's ~650-byte heads: framed (so the body's tail is searched, and
    pipelined requests are followed), whether the body comes with the head or after it."""
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    for i in range(3):
        body = openai_python_body(f"long-head-{i}", 5_000 * i, temperature=0.2)
        head = openai_python_head(body)
        assert len(head) > 600
        if i == 1:
            client.send(head, body, gap=0.03)
        else:
            client.send(head + body)
        assert client.response()[0] == 200
    pipelined = [openai_python_body(f"long-head-p{i}", 3_000) for i in range(2)]
    client.send(b"".join(openai_python_head(b) + b for b in pipelined))
    assert [client.response()[0] for _ in range(2)] == [200, 200]
    client.close()
    expected = {("long-head-0", 200): 1, ("long-head-1", 200): 1, ("long-head-2", 200): 1,
                ("long-head-p0", 200): 1, ("long-head-p1", 200): 1}
    got, snap = counts.after(expected)
    assert got == expected
    assert counts.errors(snap) == {}


def test_model_beyond_the_limits_counts_as_no_model(env: Env) -> None:
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    long_name = "x" * (env.probes.scan_limit + 100)  # longer than the scan limit itself
    assert client.call(long_name)[0] == 200
    # "model" beyond the limit in a chunked body, whose end the probe cannot know
    late = openai_python_body("too-late", env.probes.scan_limit + 500)
    head, _ = request(None, body=late, extra={"Transfer-Encoding": "chunked"})
    head = head.replace(b"Content-Length: %d\r\n" % len(late), b"")
    client.send(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(late), late))
    assert client.response()[0] == 200
    # "model" after the messages, within the limit, in the body's own segment
    head, body = request(None, body=json.dumps(
        {"messages": [{"role": "user", "content": "z" * 400}], "model": "after-messages"}
    ).encode())
    client.send(head, body, gap=0.05)
    assert client.response()[0] == 200
    assert client.call("after-the-long-ones")[0] == 200  # the connection's state recovered
    # the longest name kept, on a connection whose heads taught the probe a short window
    longest = "m" * abi.const("LM_NAME_MAX")
    assert client.call(longest)[0] == 200
    client.close()
    expected = {("-", 200): 2, ("after-messages", 200): 1, ("after-the-long-ones", 200): 1,
                (longest, 200): 1}
    got, snap = counts.after(expected)
    assert got == expected
    errors = counts.errors(snap)
    assert errors == {"model_too_long": 1, "scan_gave_up": 1}
    assert long_name not in snap.models.values()


def test_expect_100_continue_counts_the_final_answer(env: Env) -> None:
    counts = Counts(env.probes)
    client = Client(env.topo.ns_v4)
    head, body = request("continue-model", status=202, extra={"Expect": "100-continue"})
    client.send(head)
    assert client.file.readline().split()[1] == b"100"
    client.file.readline()
    client.send(body)
    assert client.response()[0] == 202
    client.close()
    expected = {("continue-model", 202): 1}
    got, _ = counts.after(expected)
    assert got == expected


def test_abandoned_requests_and_tcp_events(env: Env) -> None:
    counts = Counts(env.probes)
    for reset in (True, True, False):
        client = Client(env.topo.ns_v4)
        client.send(b"".join(request("abandoned", delay_ms=300)))
        time.sleep(0.05)
        client.close(reset=reset)  # the client gives up: RST (or FIN) with a request out

    def resets() -> int:
        before, after = counts.before.ports.get(PORT), env.probes.read_maps().ports[PORT]
        return after.resets_received - (before.resets_received if before else 0)

    # The last reset is the FIN client's kernel refusing the answer written 300 ms on:
    # every answer the server tried has passed the hooks by then.
    wait_for(lambda: resets() == 3, 5, "3 resets received")
    expected = {}
    got, snap = counts.after(expected)
    assert got == expected
    assert counts.errors(snap) == {}
    # counted under their model, as aborted: no answer began before the client left
    key = (model_id("abandoned"), PORT, CHAT)
    ended = snap.requests[key]._replace(aborted=snap.requests[key].aborted - (
        counts.before.requests[key].aborted if key in counts.before.requests else 0))
    assert (ended.complete, ended.aborted, ended.unanswered) == (0, 3, 0)
    before, after = counts.before.ports.get(PORT), snap.ports[PORT]
    accepted = after.conns_accepted - (before.conns_accepted if before else 0)
    assert accepted == 3 and resets() == 3


RETRANSMIT_SCRIPT = """
import json, subprocess, sys
sys.path.insert(0, {tests!r})
subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], check=True)
from loadmesh.probes import ProbeSet
from test_probes_traffic import Client, request
probes = ProbeSet([{ifname!r}], [{port}])
probes.start()
try:
    before = probes.read_maps()
    # responses dropped here after the probe saw them arrive: the server sends them again
    nft = ["add table inet lmdrop",
           "add chain inet lmdrop in {{ type filter hook input priority 0; }}",
           "add rule inet lmdrop in tcp sport {port} tcp flags & (syn | fin | rst) == 0 "
           "numgen random mod 3 == 0 drop"]
    for rule in nft:
        subprocess.run(["nft", rule], check=True)
    client = Client({server!r}, {port})
    for _ in range(8):
        head, body = request("retransmitted")
        client.send(head, body, gap=0.01)
        assert client.response()[0] == 200
    client.close()
    subprocess.run(["nft", "delete table inet lmdrop"], check=True)
    after = probes.read_maps()
    counted = sum(n - before.histograms.get(k, 0) for k, n in after.histograms.items()
                  if k[3] == 0)  # time to first byte: one sample per answer
    print(json.dumps({{"counted": counted,
                       "errors": {{k: v for k, v in after.errors.items() if v}},
                       "retransmits": after.ports[{port}].retransmits}}))
finally:
    probes.stop()
"""


def test_retransmissions_are_not_counted_twice() -> None:
    """Client and probes in one namespace, the server in another: requests are dropped on
    arrival at the server and responses on arrival at the client, each after the probe saw
    it, so both directions carry retransmitted copies of bytes already parsed."""
    with nettopo.bridge_mesh(2) as (client, server), \
            server.ns.popen(SERVER + ["--port", str(PORT)], ready="ready"):
        server.ns.run(["nft", "add table inet lmdrop"])
        server.ns.run(["nft", "add chain inet lmdrop in { type filter hook input priority 0; }"])
        server.ns.run(["nft", f"add rule inet lmdrop in tcp dport {PORT} tcp flags & (syn | "
                       "fin | rst) == 0 numgen random mod 3 == 0 drop"])
        script = RETRANSMIT_SCRIPT.format(tests=str(ROOT / "tests"),
                                          ifname=client.ifname, port=PORT, server=server.v4)
        out = client.ns.run([sys.executable, "-c", script], timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["counted"] == 8
    assert result["errors"] == {}
    assert result["retransmits"] > 0


LOOPBACK_SCRIPT = """
import json, socket, subprocess, sys, threading, time
sys.path.insert(0, {tests!r})
# ip netns exec gives a private mount namespace with a fresh /sys: no tracefs in it
subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], check=True)
import probe_servers, asyncio
from loadmesh.probes import ProbeSet
from loadmesh.model_id import model_id
threading.Thread(target=lambda: asyncio.run(probe_servers.serve(9000)), daemon=True).start()
time.sleep(0.5)
probes = ProbeSet(["lo"], [9000])
probes.start()
try:
    s = socket.create_connection(("127.0.0.1", 9000))
    f = s.makefile("rb")
    for i in range(20):
        body = b'{{"model": "loop", "messages": []}}'
        s.sendall(b"POST / HTTP/1.1\\r\\nHost: l\\r\\nContent-Length: %d\\r\\n\\r\\n%s" % (len(body), body))
        f.readline()
        while f.readline() != b"\\r\\n":
            pass
        f.read(len(b'{{"model": "loop", "status": 200}}'))
    s.close()
    time.sleep(0.05)
    snap = probes.read_maps()
    n = sum(v for (m, _p, _e, k, _s, _b), v in snap.histograms.items()
            if m == model_id("loop") and k == 0)
    print(json.dumps({{"counted": n, "filters": len(probes.attachments)}}))
finally:
    probes.stop()
"""


def test_loopback_is_probed_in_one_direction_and_counts_once(env: Env) -> None:
    with nettopo.netns() as ns:
        script = LOOPBACK_SCRIPT.format(tests=str(ROOT / "tests"))
        out = ns.run([sys.executable, "-c", script], timeout=120)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result == {"counted": 20, "filters": 1}
        assert nettopo.attached("lo", ns) == []


def test_report_shows_the_traffic(env: Env) -> None:
    reader = FingerprintReader(env.probes)
    client = Client(env.topo.ns_v4)
    client.call("report-model", status=200)
    client.call("report-model", status=503)
    port = client.sock.getsockname()[1]
    client.close()
    wait_for(lambda: read(reader, "report-model") >= 2, 5, "both answers read")
    report = json.loads(b"".join(reader.report_json()))
    (m,) = [m for m in report["models"] if m["model"] == "report-model"]
    assert m["requests"] == 2 and m["status"] == {"200": 1, "503": 1}
    rows = [r for r in report["flows"] if r["src"] == f"{env.topo.host_v4}:{port}"]
    assert sorted((r["model"], r["status"], r["count"]) for r in rows) == [
        ("report-model", 200, 1), ("report-model", 503, 1)]
    assert all(r["dst"] == f"{env.topo.ns_v4}:{PORT}" for r in rows)


def test_crafted_segments_run_one_by_one_are_counted_exactly() -> None:
    """scripts/bench_probe_steps.py hands the entry program crafted frames through
    BPF_PROG_TEST_RUN (keep-alive requests, one-segment JSON answers, streams of chunked
    SSE events): its figures are of probes that counted every answer and event it sent."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_probe_steps.py"),
                          "--rounds", "25", "--conns", "3", "--events", "5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "maps after the runs: ok: 150 answers (sent 150), 300 inter-token gaps (sent 300), " \
           "errors none" in out.stdout

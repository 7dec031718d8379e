"""The probes against LLM traffic as vLLM serves it: tests/llm_server.py (uvicorn with
httptools and uvloop, Starlette's StreamingResponse, which sends a stream's head before any
token) in a namespace behind a veth pair, the probes on the host end, driven by the real
clients, openai-python and httpx, streamed and not.

What the probes say is held against what the clients measured (time to first token, the
gaps between tokens, to the last byte, within 5% + 0.5 ms), against the server's own count
of waiting and running requests at a quiet moment, and against the exact counts the test
knows (per model, status and outcome; tokens from usage objects). Every test uses its own
model names, so its counts are exact whatever ran before it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

import nettopo
from llm_clients import nearest_rank
from loadmesh.probes import MapSizes, ProbeSet, abi, buckets
from loadmesh.probes.maps import MapSnapshot
from loadmesh.model_id import model_id

pytestmark = pytest.mark.root
SERVER = [sys.executable, str(Path(__file__).with_name("llm_server.py"))]
CLIENTS = [sys.executable, str(Path(__file__).with_name("llm_clients.py"))]
CLIENT_NICE = -10  # about nine times the CPU share of a process at the default 0
PORT = 8000  # step 20 ms: latencies
SLOW_PORT = 8001  # step 250 ms, 8 slots, 12 waiting at most: queues to sample between steps
TTFB, TTFT, ITL, E2E = (abi.const(f"LM_HK_{k}") for k in ("TTFB", "TTFT", "ITL", "E2E"))
ENDPOINTS = abi.endpoint_names()
OUTCOMES = abi.outcome_names()


# One probe set serves the whole module, whose tests between them make more rows of model
# figures (models x endpoints x statuses) than the default 64.
ROWS = MapSizes(rows=512)

@dataclass
class Env:
    topo: nettopo.VethTopo
    probes: ProbeSet

    def url(self, port: int = PORT) -> str:
        return f"http://{self.topo.ns_v4}:{port}"


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with nettopo.veth_netns() as topo, \
            topo.ns.popen(SERVER + ["--port", str(PORT), "--step-ms", "20",
                                    "--prefill-ms", "30", "--slots", "64"], ready="ready"), \
            topo.ns.popen(SERVER + ["--port", str(SLOW_PORT), "--step-ms", "250",
                                    "--slots", "8", "--max-waiting", "12"], ready="ready"), \
            nettopo.probes_on(topo.host_if, [PORT, SLOW_PORT], ROWS) as probes:
        yield Env(topo, probes)


# ---- what the clients measure ----

@dataclass
class Timing:
    """One request as its client saw it, in perf_counter seconds."""

    sent: float = 0.0
    events: list[float] = field(default_factory=list)  # each SSE event (chunk) received
    done: float = 0.0

    @property
    def ttft(self) -> float:
        return self.events[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:])]

    @property
    def e2e(self) -> float:
        return self.done - self.sent


def stamping_client(timings: list[Timing], **kw: object) -> httpx.Client:
    """An httpx client that stamps each request as it leaves (openai-python takes it as its
    transport, so the stamp is the last thing before the bytes go out)."""
    def on_request(_: httpx.Request) -> None:
        timings.append(Timing(sent=time.perf_counter()))

    return httpx.Client(event_hooks={"request": [on_request]}, **kw)


def openai_client(env: Env, timings: list[Timing], port: int = PORT,
                  **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{env.url(port)}/v1", api_key="sk-test", max_retries=0,
                         http_client=stamping_client(timings, **kw))


# ---- what the probes say ----

class Probed:
    """The probes' maps since construction, for the models of one test."""

    def __init__(self, probes: ProbeSet) -> None:
        self.probes = probes
        self.before = probes.read_maps(with_flows=False)

    def after(self) -> MapSnapshot:
        # No wait: every segment a client has seen, or sent, passed the hook before it
        # reached the client or left the host (tests that judge a close wait for it).
        return self.probes.read_maps(with_flows=False)

    def hist(self, snap: MapSnapshot, model: str, kind: int) -> dict[int, int]:
        mid = model_id(model)
        out: dict[int, int] = {}
        for key, n in snap.histograms.items():
            m, _port, _ep, k, _status, bucket = key
            if m == mid and k == kind:
                d = n - self.before.histograms.get(key, 0)
                if d:
                    out[bucket] = out.get(bucket, 0) + d
        return out

    def percentile_ms(self, snap: MapSnapshot, model: str, kind: int, q: float) -> float:
        ns = buckets.percentile(self.hist(snap, model, kind), q)
        assert ns is not None, f"no {kind} samples for {model}"
        return ns / 1e6

    def answers(self, snap: MapSnapshot, model: str) -> dict[tuple[str, int], int]:
        """Answers by (endpoint, status): time-to-first-byte samples."""
        mid = model_id(model)
        out: dict[tuple[str, int], int] = {}
        for key, n in snap.histograms.items():
            m, _port, ep, k, status, _bucket = key
            d = n - self.before.histograms.get(key, 0)
            if m == mid and k == TTFB and d:
                out[ENDPOINTS[ep], status] = out.get((ENDPOINTS[ep], status), 0) + d
        return out

    def _requests(self, snap: MapSnapshot, model: str) -> dict[str, int]:
        mid = model_id(model)
        total: dict[str, int] = {}
        for key, stats in snap.requests.items():
            if key[0] != mid:
                continue
            old = self.before.requests.get(key)
            for name, v in stats._asdict().items():
                d = v - (getattr(old, name) if old else 0)
                if d:
                    total[name] = total.get(name, 0) + d
        return total

    def ended(self, snap: MapSnapshot, model: str) -> dict[str, int]:
        """Ended requests by outcome, and the usage tokens, over every endpoint and port."""
        return {k: v for k, v in self._requests(snap, model).items()
                if k not in ("e2e_ns", "e2e_tokens")}

    def timed(self, snap: MapSnapshot, model: str) -> tuple[int, float]:
        """Of the answers whose end was seen: their output tokens, and their summed
        first-byte-to-last-byte seconds."""
        total = self._requests(snap, model)
        return total.get("e2e_tokens", 0), total.get("e2e_ns", 0) / 1e9

    def events(self, snap: MapSnapshot, model: str) -> int:
        return sum(self.hist(snap, model, TTFT).values()) + sum(self.hist(snap, model, ITL).values())

    def errors(self, snap: MapSnapshot) -> dict[str, int]:
        return {k: v - self.before.errors[k] for k, v in snap.errors.items()
                if v != self.before.errors[k]}


def assert_close(probe_ms: float, client_s: float, what: str) -> None:
    client_ms = client_s * 1000
    assert abs(probe_ms - client_ms) <= 0.05 * client_ms + 0.5, (
        f"{what}: probes {probe_ms:.2f} ms, client {client_ms:.2f} ms")


def assert_time_in_server(timed: tuple[int, float], tokens: int, e2es: list[float]) -> None:
    """The queue's rate: the answers' tokens, exactly, and their summed times in the server
    as their clients measured them."""
    probe_tokens, probe_s = timed
    assert probe_tokens == tokens
    assert abs(probe_s - sum(e2es)) <= 0.05 * sum(e2es), (
        f"time in server: probes {probe_s:.4f} s, clients {sum(e2es):.4f} s")


def run_threads(n: int, work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# ---- tests ----

def run_clients(env: Env, model: str, requests: int, max_tokens: tuple[int, ...],
                **options: object) -> list[Timing]:
    """One client process per max_tokens value, side by side (tests/llm_clients.py): each
    sends `requests` requests one after another and reports how it saw them. All start
    measuring once all are warm."""
    procs = []
    for n in max_tokens:
        argv = [*CLIENTS, "--url", env.url(), "--model", model, "--requests", str(requests),
                "--max-tokens", str(n), "--barrier"]
        for key, value in options.items():
            if value is True:
                argv.append(f"--{key.replace('_', '-')}")
            elif value is not False:
                argv += [f"--{key.replace('_', '-')}", str(value)]
        # The clients' stopwatches are what the probes are held to: ahead of whatever else
        # runs (make test runs modules side by side), so that their own wake-up delays on a
        # busy machine are not counted against the probes.
        procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      preexec_fn=lambda: os.nice(CLIENT_NICE)))
    try:
        for proc in procs:
            line = proc.stderr.readline()
            assert line == "warm\n", f"client did not warm up: {line!r}{proc.stderr.read()}"
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        timings = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            timings += [Timing(r["sent"], r["events"], r["done"]) for r in json.loads(out)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return timings


@pytest.mark.parametrize("client", ["openai", "httpx"])
def test_streamed_latencies_match_the_clients(env: Env, client: str) -> None:
    """Time to first token (not to the head uvicorn sends first), the gaps between tokens
    and the time to the last byte, against the clients' own stopwatches."""
    model = f"stream-timing-{client}"
    probed = Probed(env.probes)
    timings = run_clients(env, model, 16, (8, 12, 16), stream=True, client=client)
    snap = probed.after()
    assert len(timings) == 48
    assert probed.answers(snap, model) == {("chat", 200): 48}
    assert probed.ended(snap, model) == {"complete": 48}
    ttfts = [t.ttft for t in timings]
    gaps = [g for t in timings for g in t.gaps]
    e2es = [t.e2e for t in timings]
    for q in (0.5, 0.99):
        for kind, values, name in ((TTFT, ttfts, "ttft"), (ITL, gaps, "itl"),
                                   (E2E, e2es, "e2e")):
            assert_close(probed.percentile_ms(snap, model, kind, q), nearest_rank(values, q),
                         f"{name} p{q * 100:g}")
    # the head went out before any token: time to first byte is far below it
    assert probed.percentile_ms(snap, model, TTFB, 0.99) < nearest_rank(ttfts, 0.01) * 1000 / 2
    # one event per chunk the client took (the role chunk included)
    assert probed.events(snap, model) == sum(len(t.events) for t in timings)
    assert_time_in_server(probed.timed(snap, model), sum(len(t.events) for t in timings), e2es)
    assert probed.errors(snap) == {}


def test_non_streamed_latency_is_the_whole_answer(env: Env) -> None:
    model = "whole-timing"
    probed = Probed(env.probes)
    timings = run_clients(env, model, 10, (5, 9, 13), stream=False)
    snap = probed.after()
    assert probed.answers(snap, model) == {("chat", 200): 30}
    e2es = [t.e2e for t in timings]
    for q in (0.5, 0.99):
        assert_close(probed.percentile_ms(snap, model, E2E, q), nearest_rank(e2es, q),
                     f"e2e p{q * 100:g}")
    assert probed.hist(snap, model, TTFT) == {}  # not a stream: no time to first token
    # tokens from the usage objects, exactly (the fake engine gives every token asked for)
    ended = probed.ended(snap, model)
    assert ended["output_tokens"] == 10 * (5 + 9 + 13) and ended["usage_answers"] == 30
    assert ended["prompt_tokens"] > 0 and ended["complete"] == 30
    assert_time_in_server(probed.timed(snap, model), 10 * (5 + 9 + 13), e2es)


def test_usage_is_read_from_short_and_long_answers_alike(env: Env) -> None:
    """A short JSON answer's usage is read from the copy of its head (the flow's copy
    widens to hold the whole answer); one longer than that copy can be (100 tokens: about
    650 bytes of body) has its last bytes copied for it. Both exact."""
    model = "usage-lengths"
    probed = Probed(env.probes)
    run_clients(env, model, 3, (2, 100), stream=False)
    snap = probed.after()
    ended = probed.ended(snap, model)
    assert ended["output_tokens"] == 3 * (2 + 100) and ended["usage_answers"] == 6
    assert probed.errors(snap) == {}


def test_usage_gives_the_exact_tokens_of_a_stream(env: Env) -> None:
    """With stream_options.include_usage the usage event's completion_tokens replace the
    stream's events (role and usage events are no tokens); without, events count."""
    probed = Probed(env.probes)
    timings: list[Timing] = []
    client = openai_client(env, timings)
    exact = 0
    for n in (3, 17, 40):
        stream = client.chat.completions.create(
            model="usage-exact", messages=[{"role": "user", "content": "x"}], max_tokens=n,
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage:
                exact += chunk.usage.completion_tokens
        stream = client.completions.create(model="events-only", prompt="x", max_tokens=n,
                                           stream=True)
        for _ in stream:
            pass
    client.close()
    snap = probed.after()
    ended = probed.ended(snap, "usage-exact")
    assert exact == 60
    assert ended["output_tokens"] == exact and ended["usage_answers"] == 3
    # the reader's figure: events, less those of the answers whose usage replaced them
    tokens = probed.events(snap, "usage-exact") + ended["output_tokens"] - ended["usage_events"]
    assert tokens == 60
    # /v1/completions streams one event per token and no role: exact without usage too
    assert probed.events(snap, "events-only") == 60
    assert probed.answers(snap, "events-only") == {("completions", 200): 3}


def test_httpx_streams_and_answers_are_counted_per_model_endpoint_and_status(env: Env) -> None:
    probed = Probed(env.probes)
    with httpx.Client(base_url=env.url(), timeout=20) as client:
        for i in range(4):
            body = {"model": "httpx-chat", "messages": [{"role": "user", "content": "q"}],
                    "max_tokens": 4, "stream": i % 2 == 0}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                for _ in r.iter_lines():
                    pass
        assert client.post("/v1/embeddings", json={"model": "httpx-embed",
                                                    "input": "abc"}).status_code == 200
        for path in ("/metrics", "/health", "/v1/models"):
            assert client.get(path).status_code == 200
    snap = probed.after()
    assert probed.answers(snap, "httpx-chat") == {("chat", 200): 4}
    assert probed.answers(snap, "httpx-embed") == {("embeddings", 200): 1}
    assert probed.ended(snap, "httpx-embed") == {"complete": 1, "prompt_tokens": 1}
    # the scrape, the health check and the model listing: endpoint "other", no model
    no_model: dict[tuple[str, int], int] = {}
    for key, n in snap.histograms.items():
        m, _p, ep, k, status, _b = key
        d = n - probed.before.histograms.get(key, 0)
        if m == 0 and k == TTFB and d:
            no_model[ENDPOINTS[ep], status] = no_model.get((ENDPOINTS[ep], status), 0) + d
    assert no_model == {("other", 200): 3}


def test_aborts_errors_and_rejections_are_counted_under_their_model(env: Env) -> None:
    probed = Probed(env.probes)
    timings: list[Timing] = []
    client = openai_client(env, timings)
    # a stream the client stops reading after three chunks and closes
    for _ in range(2):
        stream = client.chat.completions.create(
            model="abort-stream", messages=[{"role": "user", "content": "long"}],
            max_tokens=200, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
    # a non-streamed request the client gives up on before any answer
    impatient = openai_client(env, timings, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="abort-wait", max_tokens=100,
                                          messages=[{"role": "user", "content": "slow"}])
    impatient.close()
    # an error event inside a 200 stream, as vLLM sends one
    with httpx.Client(base_url=env.url(), timeout=20) as raw:
        body = {"model": "error-stream", "messages": [], "max_tokens": 9, "stream": True,
                "fail_after": 3}
        with raw.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-2].startswith('data: {"error"') and lines[-1] == "data: [DONE]"
    client.close()

    def settled() -> MapSnapshot:
        deadline = time.monotonic() + 5
        while True:
            snap = probed.after()
            if (probed.ended(snap, "abort-wait").get("aborted") == 1
                    and probed.ended(snap, "abort-stream").get("aborted") == 2
                    or time.monotonic() > deadline):
                return snap

    snap = settled()
    assert probed.ended(snap, "abort-stream") == {"aborted": 2}
    assert probed.ended(snap, "abort-wait") == {"aborted": 1}
    assert probed.answers(snap, "abort-wait") == {}  # no answer began
    assert probed.ended(snap, "error-stream") == {"error": 1}
    assert probed.events(snap, "error-stream") == 4  # the role and three tokens
    assert probed.errors(snap) == {}


def test_a_saturated_servers_429s_are_counted_by_status(env: Env) -> None:
    """24 at once on 8 slots and a queue of 12: the ones past the queue get 429 at once."""
    probed = Probed(env.probes)
    statuses: list[int] = []
    lock = threading.Lock()

    def worker(_: int) -> None:
        with httpx.Client(base_url=env.url(SLOW_PORT), timeout=30) as client:
            status = client.post("/v1/chat/completions", json={
                "model": "rejected", "messages": [], "max_tokens": 2}).status_code
        with lock:
            statuses.append(status)

    run_threads(24, worker)
    snap = probed.after()
    assert 429 in statuses
    assert probed.answers(snap, "rejected") == {("chat", s): statuses.count(s)
                                                for s in set(statuses)}
    assert probed.ended(snap, "rejected")["complete"] == 24


def _stats(client: httpx.Client) -> dict[str, float]:
    return client.get("/stats").json()


def _quiet_sample(env: Env, client: httpx.Client) -> tuple[dict[str, float], MapSnapshot]:
    """The server's counts and the probes' maps at one moment between two engine steps:
    the probes read in the middle of a step, and the server said the same step before and
    after."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        before = _stats(client)
        if not 80 < before["next_step_ms"] < 200:
            time.sleep((before["next_step_ms"] - 140) % 250 / 1000)  # to mid-step
            continue
        snap = env.probes.read_maps(with_flows=False)
        after = _stats(client)
        if after["steps"] == before["steps"]:
            return before, snap
    raise AssertionError("no quiet moment between engine steps")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_waiting_and_running_are_the_servers_own_count(env: Env, stream: bool) -> None:
    """12 requests on 8 slots: the server runs 8 and queues 4. Streamed, the probes say the
    same; not streamed, no answer has begun: all 12 wait."""
    model = f"queue-{'streamed' if stream else 'whole'}"
    key = (model_id(model), SLOW_PORT, ENDPOINTS.index("chat"))
    done = threading.Event()

    def worker(i: int) -> None:
        timings: list[Timing] = []
        client = openai_client(env, timings, port=SLOW_PORT)
        args = dict(model=model, max_tokens=16, messages=[{"role": "user", "content": "q"}])
        if stream:
            for _ in client.chat.completions.create(stream=True, **args):
                pass
        else:
            client.chat.completions.create(**args)
        client.close()

    runner = threading.Thread(target=lambda: (run_threads(12, worker), done.set()))
    runner.start()
    try:
        with httpx.Client(base_url=env.url(SLOW_PORT), timeout=10) as client:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # the first 8 admitted, given a token
                s = _stats(client)
                # all arrived, the first 8 each with a token out
                if (s["running"], s["waiting"], s["started"]) == (8, 4, 8):
                    break
                time.sleep(0.05)
            server, snap = _quiet_sample(env, client)
        assert (server["running"], server["waiting"], server["started"]) == (8, 4, 8)
        got = snap.inflight.get(key)
        if stream:
            assert got == (4, 8)  # (waiting, running)
        else:
            assert got == (12, 0)
    finally:
        runner.join(60)
    assert done.is_set()
    assert key not in env.probes.read_maps(with_flows=False).inflight


def _body(layout: str, size: int, model: str) -> bytes:
    """A JSON body of `size` bytes (or the smallest one, for a smaller size) with "model"
    first, in the middle (after long messages, before long tools: openai-python 1.x with
    tools), or last."""
    def build(fill: int) -> bytes:
        text = [{"role": "user", "content": "m" * (fill - fill // 2 if layout == "middle"
                                                     else fill)}]
        tools = [{"type": "function", "function": {"name": "t", "description": "d" * (fill // 2)}}]
        if layout == "first":
            obj = {"model": model, "messages": text, "max_tokens": 1}
        elif layout == "middle":
            obj = {"messages": text, "model": model, "tools": tools, "max_tokens": 1}
        else:
            obj = {"messages": text, "max_tokens": 1, "model": model}
        return json.dumps(obj).encode()

    small = json.dumps({"model": model}).encode()
    if size <= len(build(0)):
        return small if size < len(build(0)) else build(0)
    return build(size - len(build(0)))


def test_model_is_found_at_every_position_of_bodies_up_to_64k(env: Env) -> None:
    probed = Probed(env.probes)
    sizes = (13, 200, 1_000, 4_100, 10_700, 33_000, 65_536)
    sent: dict[str, int] = {}
    with httpx.Client(base_url=env.url(), timeout=20,
                      headers={"Content-Type": "application/json"}) as client:
        for layout in ("first", "middle", "last"):
            for size in sizes:
                model = f"pos-{layout}-{size}"
                body = _body(layout, size, model)
                assert len(body) == size or size < 100
                r = client.post("/v1/chat/completions", content=body)
                assert r.status_code == 200, r.text
                sent[model] = len(body)
    snap = probed.after()
    found = {m: probed.answers(snap, m) for m in sent}
    assert found == {m: {("chat", 200): 1} for m in sent}
    assert max(sent.values()) == 65_536 and min(sent.values()) < 30
    assert probed.errors(snap) == {}

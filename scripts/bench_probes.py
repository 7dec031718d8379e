#!/usr/bin/env python3
"""Cost of the loadmesh probes under real HTTP load, with and without them, in one run.

nginx (Debian's nginx-light) answers OpenAI-style JSON POSTs inside a network namespace
this script creates; wrk sends them (three models in turn) from the host side of a veth
pair, so every request and response crosses the probed interface once.

  (a) probe kernel time per request: run time of the probe programs from the kernel's BPF
      statistics (kernel.bpf_stats_enabled=1; tail-called steps run inside their entry
      program) over wrk's request count. Goal <= 1 us. Beside it, the timing's own floor:
      an empty TC program on the same interface, timed the same way on the same packets.
      Its run time is what the statistics add to every run (two clock reads around it),
      which the probes do not cost when nobody times them; the net figure leaves it out.
      Then the same with streaming:
      openai-python clients stream chat completions from a uvicorn + Starlette server
      (tests/llm_server.py, on a second port): kernel time per request and per SSE event.
  (b) requests/s with probes over without: one unbroken wrk run during which the probes
      are detached and re-attached every few seconds (ProbeSet.pause/resume, no recompile);
      the rate of each phase comes from the veth's packet counters, and the ratio is the
      median of each "on" phase over the mean of the "off" phases around it, which cancels
      the slow drifts of a shared machine. BPF statistics are off meanwhile. Goal >= 0.97.
  (c) the probes' P99 (from their histograms, time to first byte on the wire) against
      wrk's P99 (to the last byte, measured in wrk's event loop).
  (d) the stack vLLM serves on (uvicorn + Starlette, an OpenAI-style JSON handler): wrk
      runs with the probes off and on in turn, rate and P99 of each on-run against the
      off-runs around it; the same by CPU time, which resolves what a shared machine's
      rates cannot: the CPU a request costs (wrk and the server, kernel included) against
      what the probes' programs add to it (net of the timing's floor, as in (a)); and with
      one connection, where nothing queues, the P99 the probes add. Goals >= 0.99 and
      <= 20 us.

Then the reader: wrk keeps 10,000 connections busy while an asyncio loop measures how
late its 1 ms sleeps wake up, first without the fingerprint reader, then with it polling
every 0.25 s in a worker thread (as the daemon runs it), then with a dump of every flow
(`loadmesh dump`) every second on top.

Needs root, nginx and wrk (`bash scripts/setup.sh --bench`). All traffic stays inside the
namespace and veth pair this script creates; both are removed on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import nettopo  # noqa: E402  (tests/nettopo.py: namespaces that always get cleaned up)

from loadmesh.daemon.probes_component import POLL_S  # noqa: E402
from loadmesh.probes import FingerprintReader, MapSizes, ProbeSet, abi, buckets, tcx  # noqa: E402
from loadmesh.probes.loader import run_stats  # noqa: E402
from loadmesh.probes.maps import MapSnapshot  # noqa: E402
from loadmesh.model_id import model_id  # noqa: E402

PORT = 8080
SSE_PORT = 8081  # tests/llm_server.py: streamed answers for the cost per event
UVICORN_PORT = 8082  # (d)
# wrk's connections, and ten thousand live ones for the reader, with room to spare
SIZES = MapSizes(inflight=32768, fingerprints=65536)
TTFB = abi.const("LM_HK_TTFB")
MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "mistralai/Mistral-7B-Instruct-v0.3",
          "Qwen/Qwen2.5-14B-Instruct")
STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")
# -1 is TC_ACT_UNSPEC: the packet goes on as if the program were not there
FLOOR_TEXT = b"int lm_floor(struct __sk_buff *skb) { return -1; }"


class Floor:
    """The timing's floor: an empty TC program, attached beside the probes only while
    kernel time is measured (attached throughout, its untimed cost would weigh on (b) and
    (d) as well)."""

    def __init__(self, ifname: str) -> None:
        import bcc  # Debian's python3-bpfcc, as the probes' loader uses it

        self._bpf = bcc.BPF(text=FLOOR_TEXT)
        self.fd = self._bpf.load_func("lm_floor", bcc.BPF.SCHED_CLS).fd
        self._ifname = ifname
        self._ifindex = socket.if_nametoindex(ifname)

    @contextmanager
    def attached(self) -> Iterator[None]:
        links = [tcx.attach(self._ifname, self._ifindex, ingress, self.fd)
                 for ingress in (False, True)]
        try:
            yield
        finally:
            for link in links:
                tcx.detach(link)

    def stats(self) -> tuple[int, int]:
        """(run_time_ns, run_cnt), as ProbeSet.prog_stats reads its programs'."""
        return run_stats(self.fd)


NGINX_CONF = """
worker_processes 1;
worker_rlimit_nofile 30000;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 20000; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen {port} backlog=16384;
        listen [::]:{port} backlog=16384;
        default_type application/json;
        location / {{
            return 200 '{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"Paris."}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":23,"completion_tokens":2,"total_tokens":25}}}}';
        }}
    }}
}}
"""

WRK_LUA = """
local bodies = {{}}
local models = {{ {models} }}
for i, m in ipairs(models) do
  bodies[i] = '{{"model": "' .. m .. '", "messages": [{{"role": "system", "content": "You are a helpful assistant."}}, {{"role": "user", "content": "What is the capital of France? Answer in one word."}}], "max_tokens": 128, "temperature": 0.2, "stream": false}}'
end
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/v1/chat/completions",
    {{["Content-Type"] = "application/json", ["Authorization"] = "Bearer sk-bench"}},
    bodies[(n % #bodies) + 1])
end
"""


def run_wrk(url: str, lua: Path, conns: int, seconds: float, threads: int = 1) -> dict:
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds:.0f}s", "--timeout", "10s",
         "--latency", "-s", str(lua), url],
        check=True, capture_output=True, text=True).stdout
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)\b", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: (.*)", out)
    return {
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p99_ms": float(p99.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[p99.group(2)],
        "non2xx": int(errors.group(1)) if errors else 0,
        "socket_errors": sock.group(1).strip() if sock else "none",
    }


def packets(ifname: str) -> int:
    stats = Path(f"/sys/class/net/{ifname}/statistics")
    return int((stats / "tx_packets").read_text()) + int((stats / "rx_packets").read_text())


def ratio_phase(probes: ProbeSet, ifname: str, url: str, lua: Path, conns: int,
                phases: int, phase_s: float) -> dict:
    """(b): probes off and on in alternate phases of one wrk run."""
    result: dict = {}
    wrk = threading.Thread(target=lambda: result.update(
        run_wrk(url, lua, conns, phases * phase_s + 3)))
    wrk.start()
    time.sleep(1.5)  # wrk connected and warm
    rates: list[tuple[bool, float]] = []
    try:
        for i in range(phases):
            on = i % 2 == 1
            probes.resume() if on else probes.pause()
            time.sleep(0.2)  # leave the switch itself out of the phase
            p0, t0 = packets(ifname), time.perf_counter()
            time.sleep(phase_s - 0.2)
            rates.append((on, (packets(ifname) - p0) / (time.perf_counter() - t0)))
    finally:
        probes.resume()
        wrk.join()
    pairs = [rates[i][1] / ((rates[i - 1][1] + rates[i + 1][1]) / 2)
             for i in range(1, len(rates) - 1) if rates[i][0]]
    return {"ratio": statistics.median(pairs), "pairs": pairs,
            "on": [r for on, r in rates if on], "off": [r for on, r in rates if not on],
            "wrk": result}


# (d): the stack vLLM serves on (uvicorn with httptools and uvloop, Starlette), its handler
# reading the request's JSON and writing an OpenAI-style answer at once: what a request
# costs an inference server besides the model.
UVICORN_APP = """
import contextlib

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

async def chat(request):
    body = await request.json()
    return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 23, "completion_tokens": 2, "total_tokens": 25}})

@contextlib.asynccontextmanager
async def lifespan(app):
    print("ready", flush=True)
    yield

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan)
"""


def children_cpu_s() -> float:
    """CPU time of this script's children that have ended (wrk, once run_wrk returns)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def alternating_wrk(probes: ProbeSet, url: str, lua: Path, conns: int, runs: int, run_s: float,
                    server_pid: int) -> list[tuple[bool, dict]]:
    """wrk runs with the probes off and on in turn; each run's result has the CPU time per
    request of wrk and the server together."""
    results: list[tuple[bool, dict]] = []
    try:
        for i in range(runs):
            on = i % 2 == 1
            probes.resume() if on else probes.pause()
            c0, s0 = children_cpu_s(), nettopo.cpu_s(server_pid)
            r = run_wrk(url, lua, conns, run_s)
            r["cpu_us_per_req"] = ((children_cpu_s() - c0) + (nettopo.cpu_s(server_pid) - s0)) \
                / r["requests"] * 1e6
            results.append((on, r))
    finally:
        probes.resume()
    return results


def against_neighbours(results: list[tuple[bool, dict]], key: str,
                       compare: Callable[[float, float], float]) -> list[float]:
    """Each on-run's figure compared with the mean of the off-runs on either side of it,
    which cancels the slow drifts of a shared machine."""
    out = []
    for i in range(1, len(results) - 1):
        on, r = results[i]
        if on:
            around = (results[i - 1][1][key] + results[i + 1][1][key]) / 2
            out.append(compare(r[key], around))
    return out


def uvicorn_phase(probes: ProbeSet, url: str, lua: Path, conns: int, runs: int,
                  run_s: float, server_pid: int, floor: Floor) -> dict:
    """(d): saturating wrk runs against uvicorn, probes off and on in turn (each on-run's
    rate and P99 against the off-runs around it); the CPU a request costs without the
    probes against what the probes' programs add to it (BPF statistics, a run of its own:
    the statistics cost time themselves, and the timing's floor is taken off); then one
    connection, off and on in turn, for the latency the probes add where nothing queues."""
    results = alternating_wrk(probes, url, lua, conns, runs, run_s, server_pid)
    with kernel_time(probes, floor) as k:
        timed = run_wrk(url, lua, conns, run_s)
    single = alternating_wrk(probes, url, lua, 1, runs, run_s, server_pid)
    off_cpu = statistics.median(r["cpu_us_per_req"] for on, r in results if not on)
    probe_us = (k.run_ns - k.floor_ns) / timed["requests"] / 1000
    runs_per_req = k.runs / timed["requests"]
    return {"ratios": against_neighbours(results, "rps", lambda a, b: a / b),
            "added": against_neighbours(results, "p99_ms", lambda a, b: a - b),
            "rps": statistics.median(r["rps"] for _, r in results),
            "p99_ms": statistics.median(r["p99_ms"] for _, r in results),
            "off_cpu_us": off_cpu,
            "on_cpu_us": statistics.median(r["cpu_us_per_req"] for on, r in results if on),
            "probe_us": probe_us, "floor_us": k.floor_ns / timed["requests"] / 1000,
            "runs_per_req": runs_per_req,
            "cpu_ratio": off_cpu / (off_cpu + probe_us),
            "single_added": against_neighbours(single, "p99_ms", lambda a, b: a - b),
            "single_p99_ms": statistics.median(r["p99_ms"] for on, r in single if not on),
            "single_rps": statistics.median(r["rps"] for on, r in single if not on)}


def answers(histograms: dict) -> int:
    """Answers the probes counted: one time-to-first-byte sample each."""
    return sum(n for key, n in histograms.items() if key[3] == TTFB)


def probe_p99_ms(before: dict, after: dict) -> float | None:
    ids = {model_id(m) for m in MODELS}
    delta: dict[int, int] = {}
    for key, n in after.items():
        mid, _port, _ep, kind, _status, bucket = key
        d = n - before.get(key, 0)
        if mid in ids and kind == TTFB and d:
            delta[bucket] = delta.get(bucket, 0) + d
    p = buckets.percentile(delta, 0.99)
    return None if p is None else p / 1e6


@dataclass
class KernelTime:
    """What the probes did during a measured block: the run time of all their programs
    (tail-called steps run inside their entry program), the entry programs' runs, and
    their maps before and after."""

    run_ns: int = 0
    runs: int = 0
    floor_ns: int = 0  # the floor program's run time and runs (Floor)
    floor_runs: int = 0
    before: MapSnapshot | None = None
    after: MapSnapshot | None = None

    def counted(self) -> int:
        assert self.before is not None and self.after is not None
        return answers(self.after.histograms) - answers(self.before.histograms)

    def errors(self) -> dict[str, int]:
        assert self.before is not None and self.after is not None
        old = self.before.errors
        return {k: v - old[k] for k, v in self.after.errors.items() if v > old[k]}


@contextmanager
def kernel_time(probes: ProbeSet, floor: Floor) -> Iterator[KernelTime]:
    """BPF statistics on (kernel.bpf_stats_enabled) and the floor program attached around
    the block; the result is filled in when it ends."""
    out = KernelTime()
    stats_before = STATS_SYSCTL.read_text().strip()
    STATS_SYSCTL.write_text("1")
    try:
        with floor.attached():
            out.before = probes.read_maps(with_flows=False)
            f0 = floor.stats()
            s0 = probes.prog_stats()
            yield out
            s1 = probes.prog_stats()
            f1 = floor.stats()
            out.after = probes.read_maps(with_flows=False)
    finally:
        STATS_SYSCTL.write_text(stats_before)
    out.floor_ns, out.floor_runs = f1[0] - f0[0], f1[1] - f0[1]
    out.run_ns = sum(s1[k][0] - s0.get(k, (0, 0))[0] for k in s1)
    out.runs = sum(s1[k][1] - s0.get(k, (0, 0))[1] for k in s1 if k.startswith("lm_tc_"))


def cost_phase(probes: ProbeSet, url: str, lua: Path, conns: int, seconds: float,
               floor: Floor) -> dict:
    """(a) and (c): one wrk run with the probes attached and BPF statistics on."""
    with kernel_time(probes, floor) as k:
        res = run_wrk(url, lua, conns, seconds)
    res["ns_per_req"] = k.run_ns / res["requests"]
    res["floor_ns_per_req"] = k.floor_ns / res["requests"]
    res["floor_ns_per_run"] = k.floor_ns / max(k.floor_runs, 1)
    res["floor_runs"], res["runs"] = k.floor_runs, k.runs
    res["ns_per_run"] = k.run_ns / max(k.runs, 1)
    res["runs_per_req"] = k.runs / res["requests"]
    assert k.before is not None and k.after is not None
    res["probe_p99_ms"] = probe_p99_ms(k.before.histograms, k.after.histograms)
    res["counted"] = k.counted()
    res["errors"] = k.errors()
    return res


def stream_phase(probes: ProbeSet, url: str, clients: int, seconds: float,
                 max_tokens: int, floor: Floor) -> dict:
    """(a) with streaming: openai-python clients (tests/llm_clients.py, one process each)
    stream chat completions from the uvicorn + Starlette server (tests/llm_server.py), BPF
    statistics on: kernel time per request and per SSE event."""
    argv = [sys.executable, str(ROOT / "tests" / "llm_clients.py"), "--url", url,
            "--model", "bench-stream", "--requests", "1000000", "--seconds", str(seconds),
            "--max-tokens", str(max_tokens), "--stream"]
    with kernel_time(probes, floor) as k:
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
                 for _ in range(clients)]
        timings = []
        for proc in procs:
            out, _ = proc.communicate(timeout=seconds + 120)
            timings += json.loads(out)
    requests = len(timings) + clients  # and each client's warm-up
    events = sum(len(t["events"]) for t in timings)
    return {"requests": requests, "events": events, "ns_per_req": k.run_ns / requests,
            "ns_per_event": k.run_ns / max(events, 1), "runs_per_req": k.runs / requests,
            "floor_ns_per_req": k.floor_ns / requests,
            "net_ns_per_event": (k.run_ns - k.floor_ns) / max(events, 1),
            "counted": k.counted(), "errors": k.errors()}


def reader_phase(probes: ProbeSet, url: str, lua: Path, conns: int, seconds: float) -> dict:
    """wrk keeps `conns` connections busy; an asyncio loop measures how late its 1 ms sleeps
    wake up: first without the reader, then with it polling every 0.25 s in a worker thread
    (as the daemon runs it: the flow table is not read), then also with a full dump
    (`loadmesh dump`: a row per flow, built in another worker thread) every second."""
    reader = FingerprintReader(probes)
    polls: list[float] = []
    dumps: list[float] = []
    rows: list[int] = []
    inflight: list[int] = []
    stop_polls, stop_dumps = threading.Event(), threading.Event()

    def poller() -> None:
        while not stop_polls.wait(POLL_S):
            t = time.perf_counter()
            reader.poll(time.monotonic())
            polls.append(time.perf_counter() - t)
            summary = reader.summary()
            inflight.append(sum(m["inflight"] for m in summary["models"]))

    def dumper() -> None:
        while not stop_dumps.wait(1.0):
            t = time.perf_counter()
            report = reader.report_json()
            dumps.append(time.perf_counter() - t)
            # Not json.loads: parsing megabytes here would hold the GIL for the loop measured.
            rows.append(int(re.search(rb'"flow_count":(\d+)', report[0]).group(1)))

    async def worst_delay(duration: float) -> float:
        worst = 0.0
        end = time.monotonic() + duration
        while time.monotonic() < end:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - t - 0.001)
            reader.summary()  # what the daemon's loop reads (the snapshot, metrics)
            reader.model_stats()
        return worst

    gc.freeze()  # as the daemon does once started
    sys.setswitchinterval(0.001)  # as the agent runs (daemon/cli.py)
    result: dict = {}
    wrk = threading.Thread(target=lambda: result.update(
        run_wrk(url, lua, conns, seconds * 3 + 4, threads=2)))
    wrk.start()
    time.sleep(3)  # connections opened
    lag_without = asyncio.run(worst_delay(seconds))
    threads = [threading.Thread(target=poller), threading.Thread(target=dumper)]
    threads[0].start()
    lag_with = asyncio.run(worst_delay(seconds))
    threads[1].start()
    lag_dumps = asyncio.run(worst_delay(seconds))
    stop_dumps.set()
    stop_polls.set()
    for thread in threads:
        thread.join()
    wrk.join()
    return {"polls": sorted(polls), "dumps": sorted(dumps), "rows": max(rows, default=0),
            "lag_without": lag_without, "lag_with": lag_with, "lag_dumps": lag_dumps,
            "wrk": result, "inflight": max(inflight, default=0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=32, help="wrk connections (a, b, c)")
    ap.add_argument("--phases", type=int, default=41, help="on/off phases for (b)")
    ap.add_argument("--phase-seconds", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=10, help="wrk run for (a) and (c)")
    ap.add_argument("--reader-conns", type=int, default=10000)
    ap.add_argument("--stream-clients", type=int, default=8, help="streaming clients for (a)")
    ap.add_argument("--stream-tokens", type=int, default=32, help="tokens per streamed answer")
    ap.add_argument("--uvicorn-runs", type=int, default=21, help="wrk runs for (d), off and on in turn")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_probes: run as root", file=sys.stderr)
        return 2
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            print(f"bench_probes: no {tool}: run `bash scripts/setup.sh --bench`",
                  file=sys.stderr)
            return 2
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    models = ", ".join(f"'{m}'" for m in MODELS)
    # 10,000 connections x 3 models of fingerprint rows
    with tempfile.TemporaryDirectory(prefix="lm-bench-") as tmp, \
            nettopo.veth_netns("lmk") as topo:
        d = Path(tmp)
        (d / "nginx.conf").write_text(NGINX_CONF.format(dir=d, port=PORT))
        (d / "bench_app.py").write_text(UVICORN_APP)
        uvicorn_server = [sys.executable, "-m", "uvicorn", "--app-dir", str(d), "--host", "0.0.0.0",
                          "--port", str(UVICORN_PORT), "--no-access-log", "--log-level", "warning",
                          "bench_app:app"]
        lua = d / "post.lua"
        lua.write_text(WRK_LUA.format(models=models))
        url = f"http://{topo.ns_v4}:{PORT}/v1/chat/completions"
        topo.ns.run(["sysctl", "-qw", "net.core.somaxconn=16384",
                     "net.ipv4.tcp_max_syn_backlog=16384"])
        sse_server = [sys.executable, str(ROOT / "tests" / "llm_server.py"), "--port",
                      str(SSE_PORT), "--step-ms", "10", "--slots", "64"]
        with topo.ns.popen(["nginx", "-c", str(d / "nginx.conf"), "-g", "daemon off;"]), \
                topo.ns.popen(sse_server, ready="ready"), \
                topo.ns.popen(uvicorn_server, ready="ready") as uvicorn_proc:
            time.sleep(1)
            run_wrk(url, lua, args.conns, 2)  # warm-up
            uvicorn_url = f"http://{topo.ns_v4}:{UVICORN_PORT}/v1/chat/completions"
            run_wrk(uvicorn_url, lua, args.conns, 2)  # warm-up, and up by now
            probes = ProbeSet([topo.host_if], [PORT, SSE_PORT, UVICORN_PORT], SIZES)
            floor = Floor(topo.host_if)
            t = time.perf_counter()
            probes.start()
            start_s = time.perf_counter() - t
            try:
                ratio = ratio_phase(probes, topo.host_if, url, lua, args.conns, args.phases,
                                    args.phase_seconds)
                cost = cost_phase(probes, url, lua, args.conns, args.seconds, floor)
                stream = stream_phase(probes, f"http://{topo.ns_v4}:{SSE_PORT}",
                                      args.stream_clients, args.seconds, args.stream_tokens,
                                      floor)
                uvicorn = uvicorn_phase(probes, uvicorn_url, lua, args.conns, args.uvicorn_runs,
                                        args.phase_seconds, uvicorn_proc.pid, floor)
                reader = reader_phase(probes, url, lua, args.reader_conns, args.seconds)
            finally:
                probes.stop()
    print(f"loadmesh probe bench: nginx {PORT} in a netns, wrk -t1 -c{args.conns} over a "
          f"veth, {os.cpu_count()} CPUs, kernel {os.uname().release}; probes compiled and "
          f"attached in {start_s:.1f} s")
    print(f"(a) probe kernel time per request: {cost['ns_per_req'] / 1000:.3f} us "
          f"({cost['runs_per_req']:.2f} program runs per request, {cost['ns_per_run']:.0f} ns "
          f"each), of which the timing's floor {cost['floor_ns_per_req'] / 1000:.3f} us (an "
          f"empty TC program timed on the same packets: {cost['floor_runs']} runs against "
          f"the probes' {cost['runs']}, {cost['floor_ns_per_run']:.0f} ns a run); net "
          f"{(cost['ns_per_req'] - cost['floor_ns_per_req']) / 1000:.3f} us (goal <= 1 us)")
    print(f"(a) streamed: {stream['ns_per_req'] / 1000:.3f} us per request (net of the "
          f"floor {(stream['ns_per_req'] - stream['floor_ns_per_req']) / 1000:.3f} us), "
          f"{stream['ns_per_event']:.0f} ns per SSE event (net {stream['net_ns_per_event']:.0f} "
          f"ns; {stream['requests']} requests of "
          f"{args.stream_tokens} tokens from {args.stream_clients} openai-python clients, "
          f"uvicorn + Starlette; {stream['events']} events, "
          f"{stream['runs_per_req']:.1f} program runs per request; the probes counted "
          f"{stream['counted']} answers; errors {stream['errors'] or 'none'})")
    q1, _, q3 = statistics.quantiles(ratio["pairs"], n=4)
    print(f"(b) requests/s with/without probes: {ratio['ratio']:.3f} (median of "
          f"{len(ratio['pairs'])} {args.phase_seconds:.0f} s on-phases, each against the "
          f"off-phases around it; quartiles {q1:.3f}..{q3:.3f}; goal >= 0.97)")
    q1, _, q3 = statistics.quantiles(uvicorn["ratios"], n=4)
    a1, _, a3 = statistics.quantiles(uvicorn["added"], n=4)
    print(f"(d) uvicorn + Starlette (the stack vLLM serves on), an OpenAI-style JSON handler, "
          f"{uvicorn['rps']:.0f} req/s, P99 {uvicorn['p99_ms']:.2f} ms: requests/s with/without "
          f"probes {statistics.median(uvicorn['ratios']):.3f} (median of "
          f"{len(uvicorn['ratios'])} on-runs against the off-runs around each; quartiles "
          f"{q1:.3f}..{q3:.3f}; goal >= 0.99); P99 added "
          f"{statistics.median(uvicorn['added']) * 1000:+.0f} us (quartiles {a1 * 1000:+.0f}.."
          f"{a3 * 1000:+.0f} us; goal <= 20 us)")
    print(f"(d) by CPU time: a request costs {uvicorn['off_cpu_us']:.1f} us of CPU without the "
          f"probes (wrk and uvicorn, kernel included; {uvicorn['on_cpu_us']:.1f} us in the "
          f"on-runs), the probes' programs {uvicorn['probe_us']:.2f} us of it (BPF "
          f"statistics, {uvicorn['runs_per_req']:.2f} runs per request, net of the timing's "
          f"floor of {uvicorn['floor_us']:.2f} us): the rate they leave a "
          f"saturated server is {uvicorn['cpu_ratio']:.4f} of it (goal >= 0.99)")
    s1, _, s3 = statistics.quantiles(uvicorn["single_added"], n=4)
    print(f"(d) one connection (nothing queues; {uvicorn['single_rps']:.0f} req/s, P99 "
          f"{uvicorn['single_p99_ms'] * 1000:.0f} us without the probes): P99 added "
          f"{statistics.median(uvicorn['single_added']) * 1000:+.1f} us (median of "
          f"{len(uvicorn['single_added'])} on-runs against the off-runs around each; quartiles "
          f"{s1 * 1000:+.1f}..{s3 * 1000:+.1f} us; goal <= 20 us)")
    print(f"(c) P99: probes {cost['probe_p99_ms']:.3f} ms (first byte, on the wire), wrk "
          f"{cost['p99_ms']:.3f} ms (last byte, in wrk) at {cost['rps']:.0f} req/s; the probes "
          f"counted {cost['counted']} responses, wrk {cost['requests']} (wrk leaves out the "
          f"up to {args.conns} still in flight when it stops)")
    polls = reader["polls"]
    print(f"reader, {args.reader_conns} live connections at {reader['wrk'].get('rps', 0):.0f} "
          f"req/s ({reader['rows']} flow rows, up to {reader['inflight']} requests in flight): "
          f"poll median {statistics.median(polls) * 1e3:.0f} ms, max {polls[-1] * 1e3:.0f} ms "
          f"({len(polls)} polls); a dump of every flow: median "
          f"{statistics.median(reader['dumps']) * 1e3:.0f} ms; worst asyncio delay "
          f"{reader['lag_without'] * 1e3:.1f} ms without the reader, "
          f"{reader['lag_with'] * 1e3:.1f} ms with it polling, "
          f"{reader['lag_dumps'] * 1e3:.1f} ms with a dump every second too")
    print(f"probe error counters during (a): {cost['errors'] or 'all zero'}; wrk socket "
          f"errors: {cost['socket_errors']} (a), {reader['wrk'].get('socket_errors', '?')} "
          f"(reader)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

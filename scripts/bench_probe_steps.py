#!/usr/bin/env python3
"""Kernel time of the probes per kind of TCP segment, by BPF_PROG_TEST_RUN.

bench_probes.py measures the probes under real traffic, where the figure moves with all
else the machine does (on a shared 2-vCPU VM, by 30% from one run to the next). This one
hands the real entry program, with its real maps and tail-called steps, crafted Ethernet
frames one at a time (BPF_PROG_TEST_RUN) and takes the kernel's own duration of each
run: no network stack and hot caches, so it tells what each kind of segment costs the
probes' own code, steadily enough to weigh a change to it. The frames are those of
bench_probes: wrk's request and nginx's JSON answer (one segment each), and a stream as
uvicorn + Starlette sends it (a head, then each SSE event in a chunk of its own, then the
last chunk), on keep-alive connections whose TCP sequence numbers follow on.

The first line, an empty TC program run the same way, is the share of each figure that is
the test run's own (its clock reads and the program call). After the runs the maps must
hold exactly the answers and events sent, with every error counter at zero: the figures
are of code that did its job.

Needs root. The probes attach to the host end of a veth pair into a namespace that this
script creates and removes; no packet crosses it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import nettopo  # noqa: E402  (tests/nettopo.py: namespaces that always get cleaned up)
from crafted import CLIENT, SERVER, Connection, frame, test_run  # noqa: E402

from loadmesh.probes import abi  # noqa: E402
from loadmesh.probes.maps import MapSnapshot  # noqa: E402

PORT = 8080

BODY = (b'{"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [{"role": "system", '
        b'"content": "You are a helpful assistant."}, {"role": "user", "content": "What is '
        b'the capital of France? Answer in one word."}], "max_tokens": 128, '
        b'"temperature": 0.2, "stream": false}')
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 10.9.0.2:8080\r\n"
           b"Content-Type: application/json\r\nAuthorization: Bearer sk-bench\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
ANSWER_BODY = (b'{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,'
               b'"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}],'
               b'"usage":{"prompt_tokens":23,"completion_tokens":2,"total_tokens":25}}')
ANSWER = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Wed, 02 Dec 2026 06:00:00 GMT\r\n"
          b"Content-Type: application/json\r\nContent-Length: %d\r\n"
          b"Connection: keep-alive\r\n\r\n" % len(ANSWER_BODY)) + ANSWER_BODY
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 06:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
LAST_CHUNK = b"0\r\n\r\n"


def sse_event(i: int) -> bytes:
    data = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
            b'"model":"m","choices":[{"index":0,"delta":{"content":"tok%d"},'
            b'"finish_reason":null}]}\n\n' % i)
    return b"%x\r\n" % len(data) + data + b"\r\n"


KINDS = ("other port", "ACK", "request", "JSON answer", "SSE head", "SSE event", "SSE end")


def measure(fd: int, rounds: int, events: int, conns: int) -> dict[str, list[int]]:
    """Per round, on each connection: a request and its JSON answer, an ACK, a frame to a
    port that is not served, then a streamed request: its head, `events` events, its end."""
    times: dict[str, list[int]] = {k: [] for k in KINDS}
    pool = [Connection(40000 + i, PORT) for i in range(conns)]
    other = frame(CLIENT, SERVER, 5555, 9999, 1, b"x" * 100)

    def timed(kind: str, f: bytes) -> None:
        times[kind].append(test_run(fd, f))

    for _ in range(rounds):
        for c in pool:
            timed("request", c.request(REQUEST))
            timed("JSON answer", c.answer(ANSWER))
            timed("ACK", c.ack())
            timed("other port", other)
            test_run(fd, c.request(REQUEST))
            timed("SSE head", c.answer(SSE_HEAD))
            for i in range(events):
                timed("SSE event", c.answer(sse_event(i)))
            timed("SSE end", c.answer(LAST_CHUNK))
    return times


def empty_program_ns(runs: int) -> list[int]:
    """The test run's own share: an empty TC program run the same way."""
    from bcc import BPF  # Debian's python3-bpfcc, as the loader uses

    b = BPF(text=b"int empty(struct __sk_buff *skb) { return -1; }")
    try:
        fd = b.load_func(b"empty", BPF.SCHED_CLS).fd
        f = frame(CLIENT, SERVER, 5555, 9999, 1, b"x" * 100)
        return [test_run(fd, f) for _ in range(runs)]
    finally:
        b.cleanup()


def check_counts(read: Callable[..., MapSnapshot], rounds: int, events: int, conns: int) -> str:
    """What the maps say was seen, against what was sent."""
    snap = read(with_flows=False)
    ttfb, itl = abi.const("LM_HK_TTFB"), abi.const("LM_HK_ITL")
    answers = sum(n for k, n in snap.histograms.items() if k[3] == ttfb)
    gaps = sum(n for k, n in snap.histograms.items() if k[3] == itl)
    want_answers = 2 * rounds * conns
    want_gaps = rounds * conns * (events - 1)
    errors = {k: v for k, v in snap.errors.items() if v}
    ok = answers == want_answers and gaps == want_gaps and not errors
    return (f"{'ok' if ok else 'WRONG'}: {answers} answers (sent {want_answers}), {gaps} "
            f"inter-token gaps (sent {want_gaps}), errors {errors or 'none'}")


def quantile(ns: list[int], q: float) -> int:
    return sorted(ns)[int(len(ns) * q)]


def row(name: str, ns: list[int], base: float) -> str:
    p10, p50, p90 = (quantile(ns, q) for q in (0.1, 0.5, 0.9))
    return (f"  {name:12s} median {p50:5d} ns (p10 {p10:5d}, p90 {p90:5d}); "
            f"less the test run's own: {p50 - base:5.0f} ns")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--conns", type=int, default=4, help="keep-alive connections")
    ap.add_argument("--events", type=int, default=8, help="SSE events per stream")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_probe_steps: run as root", file=sys.stderr)
        return 2
    base = statistics.median(empty_program_ns(args.rounds * args.conns))
    with nettopo.veth_netns("lmq") as topo, nettopo.probes_on(topo.host_if, [PORT]) as probes:
        times = measure(probes.program_fd("lm_tc_eth"), args.rounds, args.events, args.conns)
        counts = check_counts(probes.read_maps, args.rounds, args.events, args.conns)
    print(f"loadmesh probe steps: BPF_PROG_TEST_RUN of lm_tc_eth, {args.rounds} rounds on "
          f"{args.conns} keep-alive connections, {args.events} SSE events per stream; "
          f"kernel {os.uname().release}, {os.cpu_count()} CPUs")
    print(f"  {'empty prog':12s} median {base:5.0f} ns: the test run's own share of each figure")
    for kind in KINDS:
        print(row(kind, times[kind], base))
    med = {k: quantile(v, 0.5) - base for k, v in times.items()}
    stream = med["request"] + med["SSE head"] + args.events * med["SSE event"] + med["SSE end"]
    print(f"  a non-streamed request (request + JSON answer): "
          f"{med['request'] + med['JSON answer']:.0f} ns; a stream of {args.events} events: "
          f"{stream:.0f} ns")
    print(f"  maps after the runs: {counts}")
    return 0 if counts.startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Local API throughput: `GET /v1/best` answers per second and their latency on one
keep-alive connection, against a real agent whose table holds 100 peers.

The 99 other peers are real GossipService instances in a process of their own (an open
mesh), each on its own loopback address (127.0.1.x) as on its own host, each serving the benchmark's model, so the agent learns them through the real
gossip path. The client is a raw socket sending one request at a time, as a router does,
and the same client asks for an unknown path on the same connection (a 404): the floor that
the HTTP transport alone costs. The ratio of the two rates is what the routing decision adds.

    .venv/bin/python scripts/bench_api.py [--peers 100] [--seconds 5]

Goal (issue 6): >= 5000 answers/s, P99 <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadmesh.gossip.config import GossipParams
from loadmesh.gossip.snapshot import Endpoint, HostLoad, LoadSnapshot, ModelLoad, NodeState
from loadmesh.gossip.transport import GossipService
from loadmesh.model_id import model_id

MODEL = "bench-llama-70b"
LOADMESH = str(Path(sys.executable).with_name("loadmesh"))


def peer_snapshot(node: str, version: int, rng: random.Random) -> LoadSnapshot:
    return LoadSnapshot(
        node_id=node, endpoints=(Endpoint("127.0.0.1", 8000),), version=version,
        timestamp_ms=time.time_ns() // 1_000_000, state=NodeState.OK, score=round(rng.uniform(0.1, 0.6), 4),
        host=HostLoad(0.3, 1000, 2000, 1.0, None), gpus=(),
        models=(ModelLoad(model_id(MODEL), 8000, rng.uniform(5, 50), 0.0, 300.0, 900.0, rng.randint(0, 40)),))


async def _run_peers(count: int, seed: str, stop: multiprocessing.synchronize.Event) -> None:
    rng = random.Random(1)
    services = []
    for i in range(count):
        # Its own address: the agent's allowance is per source address, as for hosts.
        svc = GossipService(f"peer-{i:03d}", (f"127.0.{1 + i // 250}.{1 + i % 250}", 0), [seed], GossipParams(), None)
        await svc.start()
        svc.publish(peer_snapshot(svc.node_id, 1000, rng), urgent=True)
        services.append(svc)
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for svc in services:
        await svc.stop()


def _peers_process(count: int, seed: str, stop: multiprocessing.synchronize.Event) -> None:
    logging.basicConfig(level=logging.ERROR)  # 99 "open mesh" warnings say nothing new
    asyncio.run(_run_peers(count, seed, stop))


class FakePeers:
    """The other peers of the mesh, real gossip nodes in a process of their own, so that
    their work does not hold the measuring client's interpreter."""

    def __init__(self, count: int, seed: str) -> None:
        self.stop = multiprocessing.Event()
        self.process = multiprocessing.Process(target=_peers_process, args=(count, seed, self.stop))

    def __enter__(self) -> FakePeers:
        self.process.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def measure(sock_path: str, target: str, seconds: float,
            expect: bytes = b"HTTP/1.1 200") -> tuple[float, list[float], int]:
    """(answers/s, latencies in ms, unexpected answers) of back-to-back requests."""
    request = f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    latencies: list[float] = []
    failures = 0
    buf = b""
    clock = time.perf_counter
    end = clock() + seconds
    try:
        while clock() < end:
            t0 = clock()
            s.sendall(request)
            while True:
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0:
                    start = buf.find(b"Content-Length: ", 0, head_end) + 16
                    length = int(buf[start:buf.find(b"\r\n", start)])
                    if len(buf) >= head_end + 4 + length:
                        break
                buf += s.recv(65536)
            latencies.append((clock() - t0) * 1000)
            failures += not buf.startswith(expect)
            buf = buf[head_end + 4 + length:]
    finally:
        s.close()
    return len(latencies) / seconds, latencies, failures


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=100, help="nodes in the table, the agent included")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="lm-bench-") as tmp:
        sock = f"{tmp}/api.sock"
        config = Path(tmp, "agent.toml")
        config.write_text(f'node_id = "bench-agent"\nstate_dir = "{tmp}/state"\n'
                          f'[routing]\nstatic_models = {{ bench-agent = ["{MODEL}"] }}\n'
                          f'[api]\nsocket = "{sock}"\n[probes]\ninterfaces = []\n'
                          f'[gossip]\nbind = "127.0.0.1:17946"\n')
        agent = subprocess.Popen([LOADMESH, "agent", "--config", str(config)],
                                 stderr=open(f"{tmp}/agent.log", "w"), start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(sock) and time.monotonic() < deadline:
                time.sleep(0.1)
            with FakePeers(args.peers - 1, "127.0.0.1:17946"):
                from loadmesh.daemon.client import Client
                with Client(sock) as client:
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        alive = sum(p["state"] == "alive" for p in client.get("/v1/peers"))
                        if alive >= args.peers:
                            break
                        time.sleep(0.5)
                    print(f"table: {alive} alive peers serving {MODEL} (goal {args.peers})")
                    time.sleep(0.5)  # the routing table follows within 100 ms
                base_rate, base_lat, _ = measure(sock, "/v1/none", args.seconds, b"HTTP/1.1 404")
                rate, lat, failures = measure(sock, f"/v1/best?model={MODEL}", args.seconds)
                session_rate, session_lat, _ = measure(
                    sock, f"/v1/best?model={MODEL}&session=user-1234", args.seconds)
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(15)

    print(f"{'endpoint':<34}{'answers/s':>10}{'p50 ms':>9}{'p99 ms':>9}")
    for name, r, lats in (("GET /v1/none: 404, transport floor", base_rate, base_lat),
                          ("GET /v1/best", rate, lat),
                          ("GET /v1/best with a session", session_rate, session_lat)):
        print(f"{name:<34}{r:>10.0f}{statistics.median(lats):>9.3f}{p99(lats):>9.3f}")
    print(f"best / transport floor rate ratio: {rate / base_rate:.3f}; non-200 answers: {failures}")
    ok = rate >= 5000 and p99(lat) <= 2.0 and failures == 0
    print(f"goal (>= 5000/s, P99 <= 2 ms): {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

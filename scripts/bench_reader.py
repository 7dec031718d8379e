#!/usr/bin/env python3
"""The probe reader's cost at the size of a GPU host (issue 16): its poll time and the
event loop's worst delay while it runs, at 10,000 and 100,000 live flows (flow rows, and
as many connections with requests outstanding), on this machine's CPUs and at 64, 224
and 256.

    sudo .venv/bin/python scripts/bench_reader.py [--seconds 10]

Measured: real probes on a veth (nothing else attached), their `fingerprints` map filled
with that many flow rows and `inflight` with as many busy connections (a request waiting,
a stream running, an answer begun; one in a hundred with a second request behind), written
from user space; the agent's FingerprintReader polling every 0.25 s in a worker thread (as
the daemon runs it) while an asyncio loop in the main thread measures how late its 1 ms
sleeps wake; then the same with a dump (`loadmesh dump`) every second in a second thread.

Synthetic (64, 224, 256 CPUs): a map's per-CPU values are sized by the kernel's possible
CPUs, which this machine cannot have. A poll's per-CPU reads are the small counter maps
(`errors`, `port_stats`; the flow table is shared since #16): the reader runs on what this
machine's probes hold, with those counters given one value per CPU of the synthetic count.
For comparison, the flow read of the design before #16 (a per-CPU flow table read one poll
in four) is timed on synthetic per-CPU values of the same rows.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import nettopo  # noqa: E402
from loadmesh.probes import FingerprintReader, MapSizes, ProbeSet, abi  # noqa: E402
from loadmesh.probes.maps import MapSnapshot, PortStats  # noqa: E402

POLL_S = 0.25
PORT = 8000
# answers per flow row in the map, and per connection in its state (fill, fill_inflight)
ROW_COUNT, PENDING = 5, 2


def _write(table: Any, n_rows: int, set_row: Callable[[int, Any, Any], int]) -> int:
    """n_rows rows written in batches, set_row(i, key, value) filling each; returns the sum
    of what set_row returned."""
    chunk, total = 8192, 0
    for start in range(0, n_rows, chunk):
        n = min(chunk, n_rows - start)
        keys, values = (table.Key * n)(), (table.Leaf * n)()
        total += sum(set_row(start + j, keys[j], values[j]) for j in range(n))
        table.items_update_batch(keys, values)
    return total


def _connection(flow: Any, i: int) -> None:
    """Connection i: a client of its own (port and address) to the serving port."""
    flow.client[10] = flow.client[11] = flow.server[10] = flow.server[11] = 0xFF
    flow.client[12:16] = list((10 << 24 | i >> 8).to_bytes(4, "big"))
    flow.server[12:16] = [10, 0, 0, 1]
    flow.client_port = 1024 + i % 60000
    flow.server_port = PORT
    flow.proto = 6


def fill(probes: ProbeSet, rows: int) -> None:
    """`rows` flow rows answered just now, written as the probes would (the bench's only
    use of the loader's private handle). (The map is an LRU hash: made twice that size,
    so that none is evicted.)"""
    now = time.monotonic_ns()

    def row(i: int, k: Any, v: Any) -> int:
        _connection(k.flow, i)
        k.model_id = 1 + i % 3
        k.status = 200
        v.count, v.lat_sum_ns, v.lat_max_ns, v.last_ns = ROW_COUNT, 5_000_000, 2_000_000, now
        return 1

    _write(probes._bpf[b"fingerprints"], rows, row)  # noqa: SLF001


def fill_inflight(probes: ProbeSet, conns: int) -> int:
    """`conns` connections with requests outstanding, as the probes keep them: by thirds a
    request waiting for its answer, a stream sending tokens, a non-streamed answer begun;
    one in a hundred with a second request pipelined behind. Each holds a run of two
    answers not yet in `fingerprints` (lm_flow_state.fp_*) of the same key as fill()'s row
    i, which a dump adds to it: the dump's most work. Returns the requests. (The map is an
    LRU hash: made twice that size, so that none is evicted.)"""
    now = time.monotonic_ns()
    active, sse, first = (abi.const(f"LM_A_{k}") for k in ("ACTIVE", "SSE", "FIRST"))
    depth = abi.const("LM_PIPE_DEPTH")
    chat = abi.endpoint_names().index("chat")

    def row(i: int, k: Any, v: Any) -> int:
        _connection(k, i)
        v.head = 7 * i
        v.tail = v.head + (2 if i % 100 == 0 else 1)
        for pos in range(v.head, v.tail):
            v.ring[pos % depth].model_id = 1 + i % 3
            v.ep[pos % depth] = chat
        v.ans_model, v.ans_ep = 1 + i % 3, chat
        v.aflags = (0, active | sse | first, active)[i % 3]
        v.fp_model, v.fp_status, v.fp_count = 1 + i % 3, 200, PENDING
        v.fp_lat_sum, v.fp_lat_max, v.fp_last = 2_000_000, 1_000_000, now
        return v.tail - v.head

    return _write(probes._bpf[b"inflight"], conns, row)  # noqa: SLF001


class PerCpuCounters:
    """A MapSource: what `inner` read, with its per-CPU counters read as `ncpu` values
    each and summed as MapReader sums them."""

    def __init__(self, inner: ProbeSet, ncpu: int) -> None:
        self._inner = inner
        self._ncpu = ncpu

    def read_maps(self, with_flows: bool = True) -> MapSnapshot:
        snap = self._inner.read_maps(with_flows)
        per_cpu = [[v // self._ncpu] * self._ncpu for v in snap.errors.values()]
        errors = {name: sum(values) for name, values in zip(snap.errors, per_cpu)}
        ports = {}
        for port, stats in snap.ports.items():
            cpus = [PortStats(*(v // self._ncpu for v in stats)) for _ in range(self._ncpu)]
            ports[port] = PortStats(*(sum(getattr(c, f) for c in cpus) for f in PortStats._fields))
        return replace(snap, errors=errors, ports=ports)

    def read_flows(self, idle_s: float):  # type: ignore[no-untyped-def]
        return self._inner.read_flows(idle_s)


def measure(source, seconds: float, dump: bool) -> dict[str, float]:  # type: ignore[no-untyped-def]
    reader = FingerprintReader(source)
    polls: list[float] = []
    dumps: list[float] = []
    stop = threading.Event()

    def poller() -> None:
        while not stop.wait(POLL_S):
            t = time.thread_time()
            reader.poll(time.monotonic())
            polls.append(time.thread_time() - t)

    def dumper() -> None:
        while not stop.wait(1.0):
            t = time.perf_counter()
            reader.report_json()
            dumps.append(time.perf_counter() - t)

    async def worst_delay() -> float:
        worst = 0.0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - t - 0.001)
            reader.summary()
        return worst

    threads = [threading.Thread(target=poller)] + ([threading.Thread(target=dumper)] if dump else [])
    for th in threads:
        th.start()
    try:
        lag = asyncio.run(worst_delay())
    finally:
        stop.set()
        for th in threads:
            th.join()
    return {"poll_ms": statistics.median(polls) * 1000, "poll_max_ms": max(polls) * 1000,
            "lag_ms": lag * 1000, "dump_s": statistics.median(dumps) if dumps else 0.0}


def old_flow_read_ms(rows: int, ncpu: int) -> float:
    """The design before #16: a per-CPU flow table's values summed over the CPUs (the
    C loops MapReader ran), one poll in four; the CPU time of one such read."""
    width = 4
    words = memoryview(bytearray(rows * ncpu * width * 8)).cast("Q")
    t = time.thread_time()
    columns = []
    for first, combine in ((0, sum), (1, sum), (2, max), (3, max)):
        per_cpu = [words[first + cpu * width::width * ncpu] for cpu in range(ncpu)]
        columns.append(list(map(combine, zip(*per_cpu))))
    return (time.thread_time() - t) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    here = os.cpu_count() or 1
    print(f"reader bench: poll every {POLL_S} s for {args.seconds:g} s; this machine has {here} CPUs")
    print(f"{'rows':>7} {'CPUs':>5} {'how':10} {'poll ms':>8} {'max':>6} {'loop lag ms':>11} "
          f"{'+dump: lag ms':>13} {'dump s':>6} {'pre-#16 flow read ms':>20}")
    gc.freeze()
    sys.setswitchinterval(0.001)  # as the agent runs (daemon/cli.py)
    for rows in (10_000, 100_000):
        with nettopo.veth_netns() as topo:
            probes = ProbeSet([topo.host_if], [PORT], MapSizes(fingerprints=2 * rows, inflight=2 * rows))
            probes.start()
            try:
                fill(probes, rows)
                requests = fill_inflight(probes, rows)
                counted = sum(sum(f) for f in probes.read_maps(with_flows=False).inflight.values())
                if counted != requests:
                    raise SystemExit(f"in flight: the reader counted {counted} of {requests}")
                answers = sum(stats[0] for stats in probes.read_flows(60)[1].values())
                if answers != rows * (ROW_COUNT + PENDING):
                    raise SystemExit(f"a dump counted {answers} answers of {rows * (ROW_COUNT + PENDING)}")
                for ncpu in (here, 64, 224, 256):
                    source = probes if ncpu == here else PerCpuCounters(probes, ncpu)
                    quiet = measure(source, args.seconds, dump=False)
                    busy = measure(source, args.seconds, dump=True)
                    old = old_flow_read_ms(rows, ncpu) if rows * ncpu <= 10_000 * 256 else float("nan")
                    how = "measured" if ncpu == here else "synthetic"
                    print(f"{rows:7} {ncpu:5} {how:10} {quiet['poll_ms']:8.2f} {quiet['poll_max_ms']:6.2f} "
                          f"{quiet['lag_ms']:11.2f} {busy['lag_ms']:13.2f} {busy['dump_s']:6.2f} {old:20.1f}",
                          flush=True)
            finally:
                probes.stop()


if __name__ == "__main__":
    main()

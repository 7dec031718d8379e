#!/usr/bin/env python3
"""The probe reader's cost at the size of a GPU host (issue 16): its poll time and the
event loop's worst delay while it runs, at 10,000 and 100,000 live flow rows, on this
machine's CPUs and at 64, 224 and 256.

    sudo .venv/bin/python scripts/bench_reader.py [--seconds 10]

Measured: real probes on a veth (nothing else attached), their `fingerprints` map filled
with that many flow rows written from user space, the agent's FingerprintReader polling
every 0.25 s in a worker thread (as the daemon runs it) while an asyncio loop in the main
thread measures how late its 1 ms sleeps wake; then the same with a dump (`loadmesh dump`)
every second in a second thread.

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
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import nettopo  # noqa: E402
from probes import FingerprintReader, MapSizes, ProbeSet  # noqa: E402
from probes.maps import MapSnapshot, PortStats  # noqa: E402

POLL_S = 0.25
PORT = 8000


def fill(probes: ProbeSet, rows: int) -> None:
    """`rows` flow rows answered just now, written as the probes would (the bench's only
    use of the loader's private handle)."""
    table = probes._bpf[b"fingerprints"]  # noqa: SLF001
    now = time.monotonic_ns()
    chunk = 8192
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        keys = (table.Key * n)()
        values = (table.Leaf * n)()
        for j in range(n):
            i = start + j
            k = keys[j]
            k.flow.client[10] = k.flow.client[11] = 0xFF
            k.flow.client[12:16] = list((10 << 24 | i >> 8).to_bytes(4, "big"))
            k.flow.server[10] = k.flow.server[11] = 0xFF
            k.flow.server[12:16] = [10, 0, 0, 1]
            k.flow.client_port = 1024 + i % 60000
            k.flow.server_port = PORT
            k.flow.proto = 6
            k.model_id = 1 + i % 3
            k.status = 200
            v = values[j]
            v.count, v.lat_sum_ns, v.lat_max_ns, v.last_ns = 5, 5_000_000, 2_000_000, now
        table.items_update_batch(keys, values)


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
            probes = ProbeSet([topo.host_if], [PORT], MapSizes(fingerprints=rows))
            probes.start()
            try:
                fill(probes, rows)
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

"""The simulator's reference workload: what each simulated node publishes, and when.

Each node is a mid-size inference host, 4 GPUs and 2 models (its snapshot encodes to
about 220 bytes, a version's delta to about 49: `encoded_sizes`). Every second (the agent
rebuilds every load.tick_ms, 250 ms, and publishes past its deadbands) it rebuilds its
snapshot from a load figure L in [0, 1] that moves like a random walk with jumps:

- each second L moves by a normal step of standard deviation STEP, reflected into
  [0, 1]; with probability JUMP it jumps to a uniform random value instead (a burst of
  traffic arriving or leaving);
- every figure of the snapshot that follows load follows L (score, CPU, memory, load
  average, PSI, each GPU's utilisation, memory, temperature and power, each model's
  rate, latencies and requests in flight);
- a new version is published when L has moved more than DEADBAND since the last
  published version (the agent's score deadband), which with these constants happens
  every 5 s on average (measured over 10**6 steps: 5.0 s);
- 1% of those changes are urgent: the node's state flips between ok and overloaded.

There is no periodic heartbeat version here (the agent's load.heartbeat_ms): liveness
comes from the probes, and a version a node missed waits for the owner's next one.
"""

from __future__ import annotations

import random

from loadmesh.gossip import delta
from loadmesh.gossip.snapshot import Endpoint, GpuLoad, HostLoad, LoadSnapshot, ModelLoad, NodeState, encode

TICK_MS = 1000
STEP = 0.031
JUMP = 0.02
DEADBAND = 0.05
URGENT_RATIO = 0.01
GPUS = 4
MODELS = 2
_MODEL_IDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_GPU_MEM_MIB = 81_559
_HOST_MEM_MIB = 524_288
# 2025-11-24 in ms since the epoch: clocks and versions as wide as a real agent's.
WALL_EPOCH_MS = 1_764_000_000_000


class NodeLoad:
    """One simulated node's load and the snapshots it publishes."""

    def __init__(self, node_id: str, host: str, rng: random.Random, first_version: int) -> None:
        self.node_id = node_id
        self.endpoint = Endpoint(host, 8000)
        self.rng = rng
        self.load = rng.uniform(0.1, 0.9)
        self.published = self.load
        self.state = NodeState.OK
        self.version = first_version

    def tick(self) -> tuple[bool, bool]:
        """Advance one second: (whether to publish a new version, whether it is urgent)."""
        rng = self.rng
        if rng.random() < JUMP:
            self.load = rng.random()
        else:
            load = self.load + rng.gauss(0.0, STEP)
            self.load = -load if load < 0 else 2 - load if load > 1 else load
        if abs(self.load - self.published) <= DEADBAND:
            return False, False
        self.published = self.load
        self.version += 1
        if rng.random() < URGENT_RATIO:
            self.state = NodeState.OVERLOADED if self.state is NodeState.OK else NodeState.OK
            return True, True
        return True, False

    def snapshot(self, timestamp_ms: int) -> LoadSnapshot:
        x = self.published
        return LoadSnapshot(
            node_id=self.node_id,
            endpoints=(self.endpoint,),
            version=self.version,
            timestamp_ms=timestamp_ms,
            state=self.state,
            score=x,
            host=HostLoad(cpu_util=0.05 + 0.5 * x, mem_used_mib=int(_HOST_MEM_MIB * (0.3 + 0.2 * x)),
                          mem_total_mib=_HOST_MEM_MIB, load1=1 + 40 * x, cpu_pressure_pct=30 * x),
            gpus=tuple(
                GpuLoad(index=i, util_pct=min(100, round(100 * x) + 3 * i),
                        mem_used_mib=int(_GPU_MEM_MIB * (0.55 + 0.4 * x)), mem_total_mib=_GPU_MEM_MIB,
                        temp_c=round(38 + 40 * x), power_w=round(90 + 560 * x), power_limit_w=700,
                        throttle_reasons=0, processes=1, healthy=True)
                for i in range(GPUS)
            ),
            models=tuple(
                ModelLoad(model_id=_MODEL_IDS[j], port=8000, rps=(5 + 30 * x) * (1.0, 0.4)[j],
                          error_ratio=0.001, p50_ms=90 + 300 * x, p99_ms=250 + 1800 * x,
                          in_flight=round(48 * x))
                for j in range(MODELS)
            ),
        )


def encoded_sizes(versions: int, seed: int) -> tuple[list[int], list[int]]:
    """The bytes of one reference node's first `versions` versions after its first, each
    encoded in full and as a delta from the version before it (no shape ever changes)."""
    load = NodeLoad("node-0001", "10.0.0.1", random.Random(seed), first_version=WALL_EPOCH_MS)
    now_ms = WALL_EPOCH_MS
    previous = delta.flatten(encode(load.snapshot(now_ms)))
    fulls: list[int] = []
    deltas: list[int] = []
    while len(fulls) < versions:
        now_ms += TICK_MS
        if not load.tick()[0]:
            continue
        data = encode(load.snapshot(now_ms))
        flat = delta.flatten(data)
        change = delta.diff(previous, flat)
        assert change is not None, "the reference workload keeps its shape"
        fulls.append(len(data))
        deltas.append(len(change))
        previous = flat
    return fulls, deltas

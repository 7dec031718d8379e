"""A discrete-event simulation of the mesh that runs the real protocol core.

Every simulated node is a GossipCore, driven exactly as the agent drives it (datagrams,
clock ticks at the core's own deadlines, publishes), over a simulated network with
loss and latency, and with the reference workload (gossip/workload.py) as its load.
What the figures mean:

- convergence: for each version published in the measurement window (after the
  warm-up, and long enough before the end), the time until 99% of the live nodes
  (the owner included) hold it or a newer one. A version that never gets there counts
  with the time it had (so a lost version shows, as a large value).
- bytes_per_node_per_s: UDP payload sent (headers and tags included, IP and UDP
  headers not) over the measurement window, per live node and second.
- content_floor_bytes_per_node_per_s: the changes themselves, as the mesh encodes them
  (the delta of each version from the one before, the full snapshot on a change of
  shape), published per second by the other nodes over the same window: what each node
  must receive at the very least, before any header, tag, announcement or resend. The
  ratio of the two is what the protocol spends per byte of news.
- false_dead: live nodes that any live node ever held as dead, over the whole run.
- detect_dead: with kill=K, K random nodes stop at once (a third into the window); for
  each, the time until every live node holds it as dead (or has forgotten it); p99 over
  the K nodes. None when some node never got there.

The network delivers each datagram after latency_ms * U(0.5, 1.5) or loses it with
probability `loss`, independently. Everything random comes from `seed`, so a run is
reproducible.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter

from loadmesh.gossip.codec import ContentCodec
from loadmesh.gossip.config import GossipParams
from loadmesh.gossip.keyring import Keyring
from loadmesh.gossip.membership import Addr, Peer, PeerState
from loadmesh.gossip.protocol import GossipCore, Outgoing, node_key
from loadmesh.gossip.snapshot import encode
from loadmesh.gossip.wire import FLAG_WANTS, FLAGS_AT, HEADER, KIND_AT, WANTS_HEAD, Kind
from loadmesh.gossip.workload import TICK_MS, WALL_EPOCH_MS, NodeLoad

_START, _TICK, _DELIVER, _LOAD, _KILL = range(5)
_SEEDS = 3
_START_SPREAD_MS = 1000
_COOLDOWN_MS = 5000
# Nodes whose gossip core's CPU time is measured with time_cores (perf_counter around
# each of its calls after the warm-up): a sample, so that the timing costs next to nothing.
_TIMED_NODES = 10
# The mesh's HMAC key (simulated datagrams are signed with it: tag bytes count).
KEY = bytes(range(32))
# What a tap sees of each datagram the network delivers: (time in ms, receiving node,
# sender's address, datagram).
Tap = Callable[[float, int, Addr, bytes], None]
# What each kind of datagram is for, in the bytes split.
_PURPOSES = {"liveness": (Kind.PING, Kind.ACK, Kind.PING_REQ), "announcements": (Kind.GOSSIP,),
             "content": (Kind.CONTENT,), "pulls": (Kind.PULL,), "syncs": (Kind.SYNC, Kind.COOKIE)}


def node_addr(i: int) -> Addr:
    """Simulated node i's gossip address."""
    return (f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 7946)


@dataclass(slots=True)
class _Version:
    published_at: float
    urgent: bool
    holders: int = 1
    done_at: float | None = None


@dataclass
class _Metrics:
    live: int = 0
    # owner index -> first tracked version, and the tracked versions in order
    first: dict[int, int] = field(default_factory=dict)
    versions: dict[int, list[_Version]] = field(default_factory=dict)
    false_dead: set[int] = field(default_factory=set)
    # killed owner -> live nodes that still hold it as not dead
    undetected: dict[int, int] = field(default_factory=dict)
    detected_at: dict[int, float] = field(default_factory=dict)


class _Observer:
    """Feeds one node's table changes into the run's metrics."""

    __slots__ = ("sim", "me")

    def __init__(self, sim: _Simulation, me: int) -> None:
        self.sim, self.me = sim, me

    def content(self, key: int, old_version: int, new_version: int, now_ms: int) -> None:
        sim = self.sim
        owner = sim.owner_of[key]
        tracked = sim.metrics.versions.get(owner)
        if not tracked:
            return
        first = sim.metrics.first[owner]
        need = sim.needed()
        for v in range(max(old_version + 1, first), min(new_version, first + len(tracked) - 1) + 1):
            rec = tracked[v - first]
            rec.holders += 1
            if rec.done_at is None and rec.holders >= need:
                rec.done_at = sim.now

    def state(self, peer: Peer, old: PeerState | None, new: PeerState | None, now_ms: int) -> None:
        sim = self.sim
        owner = sim.owner_of.get(peer.key)
        if owner is None or sim.dead[self.me]:
            return
        if not sim.dead[owner]:
            if new is PeerState.DEAD:
                sim.metrics.false_dead.add(owner)
            return
        m = sim.metrics
        if owner not in m.undetected:
            return
        was_alive = old is not None and old is not PeerState.DEAD
        is_alive = new is not None and new is not PeerState.DEAD
        if was_alive != is_alive:
            m.undetected[owner] += 1 if is_alive else -1
            if m.undetected[owner] == 0 and owner not in m.detected_at:
                m.detected_at[owner] = sim.now


class _Simulation:
    def __init__(self, nodes: int, seconds: float, loss: float, latency_ms: float, kill: int, seed: int,
                 params: GossipParams, keyed: bool, warmup_s: float | None, time_cores: bool = False,
                 tap: Tap | None = None) -> None:
        if nodes < 2:
            raise ValueError("nodes: at least 2")
        if not 0 <= loss < 1:
            raise ValueError("loss: must be in [0, 1)")
        if not 0 <= kill < nodes:
            raise ValueError("kill: must be in [0, nodes)")
        if latency_ms < 0 or seconds <= 0:
            raise ValueError("latency_ms and seconds must be positive")
        self.n = nodes
        self.end = seconds * 1000.0
        self.warmup = (warmup_s if warmup_s is not None else min(5.0 + nodes / 200, seconds / 3)) * 1000.0
        self.loss = loss
        self.latency = latency_ms
        self.kill = kill
        self.rng = random.Random(seed)
        self.net_rng = random.Random(self.rng.getrandbits(64))
        self.params = params
        self.now = 0.0
        self.seq = 0
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.metrics = _Metrics()
        self.dead = [False] * nodes
        self.started = [False] * nodes
        self.addrs = [node_addr(i) for i in range(nodes)]
        self.index = {addr: i for i, addr in enumerate(self.addrs)}
        self.ids = [f"node-{i:04d}" for i in range(nodes)]
        self.owner_of = {node_key(node_id): i for i, node_id in enumerate(self.ids)}
        self.tick_at = [math.inf] * nodes
        self.sent = [0] * nodes
        self.window_bytes = 0
        self.window_by_kind = [0] * 256  # bytes by the header's kind byte
        self.window_news = 0
        self.last_content: list[bytes | None] = [None] * nodes
        self.max_datagram = 0
        self.codec = codec = ContentCodec(capacity=max(4096, nodes * 16), shared=True)
        keyring = Keyring([KEY]) if keyed else None
        self.cores = [
            GossipCore(self.ids[i], self.addrs[i], params, keyring, rng=random.Random(self.rng.getrandbits(64)),
                       codec=codec, observer=_Observer(self, i), wall_offset_ms=WALL_EPOCH_MS)
            for i in range(nodes)
        ]
        self.loads = [NodeLoad(self.ids[i], self.addrs[i][0], random.Random(self.rng.getrandbits(64)),
                               WALL_EPOCH_MS + i) for i in range(nodes)]
        self.kill_at = self.warmup + (self.end - self.warmup) / 3
        self.measure_until = self.end - _COOLDOWN_MS
        self.timed = min(_TIMED_NODES, nodes) if time_cores else 0
        self.core_seconds = [0.0] * self.timed  # after the warm-up
        self.tap = tap

    # --- events -----------------------------------------------------------------------

    def push(self, t: float, kind: int, node: int, payload: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, node, payload))

    def needed(self) -> int:
        return math.ceil(0.99 * self.metrics.live)

    def send(self, src: int, out: Outgoing) -> None:
        now = self.now
        in_window = now >= self.warmup
        for addr, data in out:
            size = len(data)
            if size > self.max_datagram:
                self.max_datagram = size
            if in_window:
                self.window_bytes += size
                kind = data[KIND_AT]
                if kind == Kind.GOSSIP and data[FLAGS_AT] & FLAG_WANTS:
                    # the pulls that ride in a push-pull reply count as pulls
                    asked = WANTS_HEAD.size + WANTS_HEAD.unpack_from(data, HEADER.size)[0]
                    self.window_by_kind[Kind.PULL] += asked
                    size -= asked
                self.window_by_kind[kind] += size
            dst = self.index.get(addr)
            if dst is None or self.dead[dst]:
                continue
            if self.loss and self.net_rng.random() < self.loss:
                continue
            self.push(now + self.latency * self.net_rng.uniform(0.5, 1.5), _DELIVER, dst, (self.addrs[src], data))

    def reschedule(self, i: int) -> None:
        t = float(self.cores[i].next_deadline())
        if t < self.now:
            t = self.now
        if t < self.tick_at[i]:
            self.tick_at[i] = t
            self.push(t, _TICK, i)

    def publish(self, i: int, urgent: bool) -> None:
        load = self.loads[i]
        now_ms = int(self.now)
        snap = load.snapshot(WALL_EPOCH_MS + now_ms)
        if self.warmup <= self.now <= self.measure_until and not self.dead[i]:
            m = self.metrics
            tracked = m.versions.setdefault(i, [])
            if not tracked:
                m.first[i] = snap.version
            tracked.append(_Version(self.now, urgent))
        self.send(i, self.run_core(i, self.cores[i].publish, snap, urgent, now_ms))
        self.count_news(i, encode(snap))

    def run_core(self, i: int, call: Callable[..., Outgoing], *args: object) -> Outgoing:
        """Node i's core doing `call`, timed where it is one of the timed nodes."""
        if i >= self.timed or self.now < self.warmup:
            return call(*args)
        t0 = perf_counter()
        out = call(*args)
        self.core_seconds[i] += perf_counter() - t0
        return out

    def count_news(self, i: int, content: bytes) -> None:
        # The shared codec already holds this delta: the core's publish just made it.
        base, self.last_content[i] = self.last_content[i], content
        if self.now >= self.warmup:
            change = self.codec.diff(base, content) if base is not None else None
            self.window_news += len(content) if change is None else len(change)

    def run(self) -> dict[str, object]:
        rng = self.rng
        for i in range(self.n):
            self.push(rng.uniform(0, _START_SPREAD_MS), _START, i)
        if self.kill:
            self.push(self.kill_at, _KILL, -1)
        seeds = self.addrs[:_SEEDS]
        heap, cores, dead = self.heap, self.cores, self.dead
        pop = heapq.heappop
        while heap:
            t, _, kind, i, payload = pop(heap)
            if t > self.end:
                break
            self.now = t
            if kind == _KILL:
                self.do_kill()
                continue
            if dead[i]:
                continue
            core = cores[i]
            if kind == _DELIVER:
                src, data = payload  # type: ignore[misc]
                if self.tap is not None:
                    self.tap(t, i, src, data)
                self.send(i, self.run_core(i, core.on_datagram, data, src, int(t)))
            elif kind == _TICK:
                if t != self.tick_at[i]:
                    continue  # superseded by an earlier deadline
                self.tick_at[i] = math.inf
                self.send(i, self.run_core(i, core.on_tick, int(t)))
            elif kind == _LOAD:
                changed, urgent = self.loads[i].tick()
                if changed:
                    self.publish(i, urgent)
                self.push(t + TICK_MS, _LOAD, i)
            else:  # _START
                self.started[i] = True
                self.metrics.live += 1
                # The agent's first snapshot is urgent, but a whole fleet starting in the
                # same second is not the reference workload: it starts as ordinary news.
                self.publish(i, False)
                self.send(i, core.join([s for s in seeds if s != self.addrs[i]], int(t)))
                self.push(t + rng.uniform(0, TICK_MS), _LOAD, i)
            self.reschedule(i)
        return self.report()

    def do_kill(self) -> None:
        victims = self.rng.sample(range(self.n), self.kill)
        m = self.metrics
        for v in victims:
            self.dead[v] = True
            m.live -= 1
            # Versions in flight no longer count their killed holders.
            for owner, tracked in m.versions.items():
                peer = self.cores[v].table.get(self.cores[owner].key)
                held = peer.snapshot.version if peer is not None else 0
                first = m.first[owner]
                for rec in tracked[: max(0, held - first + 1)]:
                    if rec.done_at is None:
                        rec.holders -= 1
        for v in victims:
            m.versions.pop(v, None)
            key = self.cores[v].key
            m.undetected[v] = sum(
                1 for j in range(self.n)
                if not self.dead[j] and (p := self.cores[j].table.get(key)) is not None and p.state is not PeerState.DEAD
            )
            if m.undetected[v] == 0:
                m.detected_at[v] = self.now
        need = self.needed()
        for tracked in m.versions.values():
            for rec in tracked:
                if rec.done_at is None and rec.holders >= need:
                    rec.done_at = self.now

    # --- results ----------------------------------------------------------------------

    def report(self) -> dict[str, object]:
        m = self.metrics
        end = self.end
        times, urgent_times, unconverged = [], [], 0
        for tracked in m.versions.values():
            for rec in tracked:
                if rec.done_at is None:
                    unconverged += 1
                took = ((rec.done_at if rec.done_at is not None else end) - rec.published_at) / 1000.0
                times.append(took)
                if rec.urgent:
                    urgent_times.append(took)
        detect: float | None = None
        if self.kill:
            waits = [m.detected_at.get(v) for v in m.undetected]
            if all(w is not None for w in waits):
                detect = _percentile([(w - self.kill_at) / 1000.0 for w in waits if w is not None], 0.99)
        window_s = (end - self.warmup) / 1000.0
        live_seconds = (self.n - self.kill) * window_s + self.kill * max(0.0, self.kill_at - self.warmup) / 1000.0
        versions = sum(len(t) for t in m.versions.values())
        live = self.n - self.kill
        cpu: dict[str, float | None] = {}
        if self.timed:
            timed = [spent for i, spent in enumerate(self.core_seconds) if not self.dead[i]]
            cpu["core_cpu_pct"] = _round(100 * statistics.mean(timed) / window_s, 2) if timed else None
        return {
            "nodes": self.n,
            "convergence_p50_s": _round(_percentile(times, 0.50)),
            "convergence_p99_s": _round(_percentile(times, 0.99)),
            "urgent_p99_s": _round(_percentile(urgent_times, 0.99)),
            "bytes_per_node_per_s": round(self.window_bytes / live_seconds) if live_seconds > 0 else None,
            "bytes_by_purpose": {purpose: round(sum(self.window_by_kind[k] for k in kinds) / live_seconds)
                                 for purpose, kinds in _PURPOSES.items()} if live_seconds > 0 else None,
            "content_floor_bytes_per_node_per_s": round(self.window_news * (live - 1) / live / window_s),
            "max_datagram_bytes": self.max_datagram,
            "false_dead": len(m.false_dead),
            "detect_dead_p99_s": _round(detect),
            "seconds": end / 1000.0,
            "loss": self.loss,
            "latency_ms": self.latency,
            "kill": self.kill,
            "warmup_s": self.warmup / 1000.0,
            "versions": versions,
            "urgent_versions": len(urgent_times),
            # At 30 nodes the p99 is the slowest node of all: one that missed every copy
            # of a version waits for the owner's next one, so it is a matter of chance;
            # the p95 is not.
            "convergence_p95_s": _round(_percentile(times, 0.95)),
            "unconverged": unconverged,
            "versions_per_node_per_s": _round(versions / ((self.n - self.kill) * max(window_s - _COOLDOWN_MS / 1000, 1e-9)), 3),
            "snapshot_bytes": len(encode(self.loads[0].snapshot(WALL_EPOCH_MS))),
        } | cpu


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def simulate(nodes: int, seconds: float, loss: float = 0.0, latency_ms: float = 2.0, kill: int = 0,
             seed: int = 0, *, params: GossipParams | None = None, keyed: bool = True,
             warmup_s: float | None = None, time_cores: bool = False,
             tap: Tap | None = None) -> dict[str, object]:
    """Run the mesh of `nodes` for `seconds` of simulated time; the figures as a dict.

    The keys nodes, convergence_p50_s, convergence_p99_s, urgent_p99_s,
    bytes_per_node_per_s, max_datagram_bytes, false_dead and detect_dead_p99_s are
    fixed (`loadmesh simulate gossip --json`); the others describe the run. Datagrams
    are signed (keyed=True) so that the byte counts include the tags, as in a keyed mesh.
    The warm-up (default 5 s + N/200 s, at most a third of the run) lets the nodes join
    before anything is measured. time_cores adds core_cpu_pct: the CPU a node's gossip
    core takes on this machine, in % of a core (what the agent spends on gossip less its
    socket calls and event loop), a timing, so the report is no longer repeatable. tap, if
    given, sees every datagram as it is delivered (scripts/bench_agent_cpu.py replays
    what one node received to a real agent).
    """
    sim = _Simulation(nodes, seconds, loss, latency_ms, kill, seed, params or GossipParams(), keyed, warmup_s,
                      time_cores, tap)
    # Millions of long-lived objects (a table per node) and no reference cycles made per
    # event: the cyclic collector would rescan them all, for a third of the run time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return sim.run()
    finally:
        if collecting:
            gc.enable()

"""The routing table: per-peer state that outlives snapshots, and per-model candidate
sets built from the peer table whenever it changes, so that a request only draws.

A peer serves model M when M is in its snapshot's models (seen in its traffic by the
probes) or when RoutingConfig.static_models lists M for it (a server that has not had a
request yet shows no model, and would otherwise never get its first one). A candidate for
M is a peer serving M that the membership holds alive, that is not draining and that has
an endpoint. Everything that changes between two table updates (circuits, slow start,
freshness, the request's exclusions) is checked per request.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from daemon.routing.breaker import Breaker
from daemon.routing.p2c import WeightedTable
from daemon.routing.slow_start import ramp
from gossip.snapshot import LoadSnapshot, ModelLoad, State
from probes.model_id import model_id

# Per snapshot, the share of a rise of the P50 that the service time estimate takes.
_SERVICE_RISE = 0.05


@dataclass(frozen=True)
class RoutingConfig:
    choices: int = 2                   # d of the d choices
    alternatives: int = 2              # retry targets returned with each answer
    epsilon: float = 0.25              # bounded-load slack: a peer takes <= (1+eps) x its share
    vnodes: int = 160                  # ring points per peer
    slow_start_s: float = 30.0         # ramp of a joined or recovered peer's weight
    slow_start_floor: float = 0.1      # the ramp's starting fraction
    breaker_failures: int = 3          # consecutive errors or timeouts that open a circuit
    breaker_cooldown_s: float = 10.0   # open time before the half-open trial
    error_ratio_threshold: float = 0.05  # a model's error ratio above this: degraded
    degraded_at: float = 0.7           # score watermarks, as the snapshot builder uses them
    overloaded_at: float = 0.9
    degraded_weight: float = 0.75      # capacity factor of a degraded peer
    # A snapshot older than this no longer says anything about the peer's load: such
    # peers are used only when no peer with a fresh one is left. Three heartbeats.
    freshness_s: float = 15.0
    # Scaling of this node's own traffic since a snapshot to the fleet's (p2c.OwnShare).
    own_share_half_life_s: float = 10.0
    own_share_cap: float = 32.0
    # node_id -> model names it serves before any traffic shows them.
    static_models: Mapping[str, frozenset[str]] = field(default_factory=dict)
    seed: int | None = None            # for reproducible draws (tests, simulator)

    def __post_init__(self) -> None:
        if self.choices < 1 or self.alternatives < 0:
            raise ValueError("need choices >= 1 and alternatives >= 0")
        if not self.epsilon > 0:
            raise ValueError("epsilon must be positive")
        if self.vnodes < 100:
            raise ValueError("vnodes must be at least 100 for an even spread")
        if self.slow_start_s < 0 or self.breaker_cooldown_s < 0 or not self.freshness_s > 0:
            raise ValueError("slow_start_s and breaker_cooldown_s >= 0, freshness_s > 0")
        if not self.own_share_half_life_s > 0 or not self.own_share_cap >= 1:
            raise ValueError("own_share_half_life_s must be positive, own_share_cap >= 1")
        if self.breaker_failures < 1:
            raise ValueError("breaker_failures must be at least 1")
        if not 0 < self.slow_start_floor <= 1 or not 0 < self.degraded_weight <= 1:
            raise ValueError("slow_start_floor and degraded_weight must be in (0, 1]")
        if not 0 < self.degraded_at < self.overloaded_at <= 1:
            raise ValueError("need 0 < degraded_at < overloaded_at <= 1")
        if not 0 <= self.error_ratio_threshold <= 1:
            raise ValueError("error_ratio_threshold must be in [0, 1]")


@dataclass(frozen=True)
class PeerInput:
    """One row of the membership table, as the router needs it.

    alive: False once the failure detector declares the peer dead (a suspect peer is
    still alive: suspicion is usually a late ack, and the circuit breaker catches peers
    that really fail).

    age_ms: how old the figures are at the update: now minus the last moment the peer
    vouched for them (a heartbeat that keeps a version says its figures are still within
    their deadbands; the membership's receive time of the latest one), or minus the
    snapshot's timestamp when nothing newer is known. Own traffic before that moment
    counts as part of the figures.

    since_ms: when the peer joined or last recovered, on the now_ms clock; None for peers
    already there when this node started, so that a restart does not slow-start the
    whole fleet. is_self: this node (never stale to itself).
    """

    node_id: str
    snapshot: LoadSnapshot
    alive: bool
    age_ms: int
    since_ms: int | None
    is_self: bool = False


class PeerState:
    """What the router knows of one peer: the latest snapshot's figures and, surviving
    snapshots, its circuit and this node's own traffic to it since that snapshot."""

    __slots__ = ("node_id", "breaker", "sends", "dones", "service_ms", "snapshot", "taken_ms",
                 "since_ms", "alive", "is_self", "in_flight", "capacity", "overloaded")

    def __init__(self, row: PeerInput, now_ms: int, config: RoutingConfig) -> None:
        self.node_id = row.node_id
        self.breaker = Breaker(config.breaker_failures, round(config.breaker_cooldown_s * 1000))
        # When this node sent it a request, and when clients reported one back, since the
        # snapshot was taken: the snapshot cannot include them.
        self.sends: deque[int] = deque()
        self.dones: deque[int] = deque()
        # Per model_id: the peer's time for one request without queueing.
        self.service_ms: dict[int, float] = {}
        self.snapshot = row.snapshot
        self._learn_service(row.snapshot)
        self.refresh(row, now_ms, config)

    def refresh(self, row: PeerInput, now_ms: int, config: RoutingConfig) -> None:
        snap = row.snapshot
        # A version names one content: learn from each content once.
        if (snap.version, snap.timestamp_ms) != (self.snapshot.version, self.snapshot.timestamp_ms):
            self._learn_service(snap)
        self.snapshot = snap
        self.taken_ms: int = now_ms - row.age_ms
        self.since_ms: int | None = row.since_ms
        self.alive: bool = row.alive
        self.is_self: bool = row.is_self
        self.in_flight: int = sum(m.in_flight for m in snap.models)
        # GPUs are what serves requests; a host without GPUs (CPU inference) counts as one.
        self.capacity: int = max(1, sum(g.healthy for g in snap.gpus))
        self.overloaded: bool = snap.state is State.OVERLOADED or snap.score >= config.overloaded_at
        self.forget_before(self.taken_ms)

    def _learn_service(self, snap: LoadSnapshot) -> None:
        """Tracks the low envelope of each model's P50: it follows a drop at once and a
        rise slowly. The P50 itself includes the queueing the in-flight count already
        accounts for; counted twice, a peer that had a queue looks slow long after the
        queue is gone (the P50 window is 10 s) and sits idle while others queue."""
        for m in snap.models:
            if m.rps > 0 and m.p50_ms > 0:
                old = self.service_ms.get(m.model_id)
                self.service_ms[m.model_id] = (
                    m.p50_ms if old is None or m.p50_ms < old else old + _SERVICE_RISE * (m.p50_ms - old))

    def forget_before(self, at_ms: int) -> None:
        """Drops own traffic at or before at_ms: the snapshot taken then includes it."""
        for events in (self.sends, self.dones):
            while events and events[0] <= at_ms:
                events.popleft()

    def load(self, own_share: float) -> float:
        """In flight on the peer now, as well as this node can tell: the snapshot's count
        plus what this node sent since, minus what its clients saw complete since, both
        scaled by own_share, the fleet's requests per request of this node (p2c.OwnShare),
        to stand for the other hosts' traffic that no snapshot shows yet."""
        return max(0.0, self.in_flight + own_share * (len(self.sends) - len(self.dones)))

    def fresh(self, now_ms: int, freshness_ms: int) -> bool:
        return self.is_self or now_ms - self.taken_ms <= freshness_ms

    def ramp(self, now_ms: int, window_ms: int, floor: float) -> float:
        return 1.0 if self.since_ms is None else ramp(now_ms, self.since_ms, window_ms, floor)


class Candidate:
    """A peer as a candidate for one model."""

    __slots__ = ("peer", "endpoint", "service_ms", "itl_ms", "weight")

    def __init__(self, peer: PeerState, endpoint: str, service_ms: float, itl_ms: float,
                 weight: float) -> None:
        self.peer = peer
        self.endpoint = endpoint
        # The peer's pace on this model, to weigh a queued request on a slow peer above one
        # on a fast peer: build() sets it to the inter-token latency where streams show it
        # (the decode speed every request on the peer gets, whatever its length; a P99,
        # so a slowdown shows within a few tokens), else the time of one request without
        # queueing (the P50 envelope).
        self.service_ms = service_ms
        self.itl_ms = itl_ms
        # Capacity times health: the sampling weight before slow start.
        self.weight = weight


@dataclass
class ModelCandidates:
    """Everything one model's requests need, rebuilt on each table update."""

    model_id: int
    candidates: list[Candidate]
    table: WeightedTable[Candidate]
    by_node: dict[str, Candidate]
    # Every peer known to serve the model, candidate or not: to say why none is usable.
    known: list[PeerState]


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _serving_entry(loads: Sequence[ModelLoad]) -> ModelLoad:
    # A model served on several ports of one host: the port taking most of its traffic.
    return max(loads, key=lambda m: (m.rps, -m.port))


def _candidate(peer: PeerState, loads: Sequence[ModelLoad], config: RoutingConfig) -> Candidate:
    snap = peer.snapshot
    service = itl = 0.0
    errors = False
    if loads:
        entry = _serving_entry(loads)
        hosts = [e.host for e in snap.endpoints if e.port == entry.port]
        endpoint = _host_port(hosts[0] if hosts else snap.endpoints[0].host, entry.port)
        service = peer.service_ms.get(entry.model_id, 0.0)
        itl = entry.itl_p99_ms
        if entry.rps > 0:
            errors = entry.error_ratio > config.error_ratio_threshold
    else:
        endpoint = _host_port(snap.endpoints[0].host, snap.endpoints[0].port)
    degraded = (errors or snap.state is State.DEGRADED or snap.score >= config.degraded_at)
    weight = peer.capacity * (config.degraded_weight if degraded else 1.0)
    return Candidate(peer, endpoint, service, itl, weight)


def build(peers: Sequence[PeerState], config: RoutingConfig,
          static_ids: Mapping[str, frozenset[int]]) -> dict[int, ModelCandidates]:
    """Per model_id, its candidates and the table to draw them from."""
    loads: dict[int, dict[str, list[ModelLoad]]] = {}
    known: dict[int, list[PeerState]] = {}
    for peer in peers:
        served: dict[int, list[ModelLoad]] = {mid: [] for mid in static_ids.get(peer.node_id, ())}
        for m in peer.snapshot.models:
            served.setdefault(m.model_id, []).append(m)
        for mid, entries in served.items():
            known.setdefault(mid, []).append(peer)
            if peer.alive and peer.snapshot.state is not State.DRAINING and peer.snapshot.endpoints:
                loads.setdefault(mid, {})[peer.node_id] = entries
    by_id = {p.node_id: p for p in peers}
    out: dict[int, ModelCandidates] = {}
    for mid, peers_known in known.items():
        cands = [_candidate(by_id[n], entries, config) for n, entries in loads.get(mid, {}).items()]
        # One measure of pace for all of a model's candidates, so that they compare: the
        # inter-token latency once any streams, the request time while none does. A peer
        # without the figure is taken as typical of the others.
        if any(c.itl_ms > 0 for c in cands):
            for c in cands:
                c.service_ms = c.itl_ms
        measured = [c.service_ms for c in cands if c.service_ms > 0]
        typical = statistics.median(measured) if measured else 1.0
        for c in cands:
            if c.service_ms <= 0:
                c.service_ms = typical
        out[mid] = ModelCandidates(
            model_id=mid,
            candidates=cands,
            table=WeightedTable(cands, [c.weight for c in cands]),
            by_node={c.peer.node_id: c for c in cands},
            known=peers_known,
        )
    return out


def static_model_ids(config: RoutingConfig) -> dict[str, frozenset[int]]:
    return {node: frozenset(model_id(name) for name in names)
            for node, names in config.static_models.items()}

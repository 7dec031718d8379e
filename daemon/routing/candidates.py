"""The routing table: per-peer state that outlives snapshots, and per-model candidate
sets built from the peer table whenever it changes, so that a request only draws.

A peer serves model M when M is in its snapshot's models (seen in its traffic by the
probes) or when RoutingConfig.static_models (daemon/config.py) lists M for it (a server
that has not had a request yet shows no model, and would otherwise never get its first
one). A candidate for M is a peer serving M that the membership holds alive, that is not
draining and that has an endpoint. Everything that changes between two table updates
(circuits, slow start, freshness, the request's exclusions) is checked per request.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

from loadmesh.daemon.config import RoutingConfig
from loadmesh.daemon.routing.breaker import Breaker
from loadmesh.daemon.routing.p2c import WeightedTable
from loadmesh.daemon.routing.pooling import pooling_factor
from loadmesh.daemon.routing.ring import stepped
from loadmesh.daemon.routing.slow_start import ramp
from loadmesh.gossip.snapshot import LoadSnapshot, ModelLoad, NodeState
from loadmesh.model_id import model_id

# Per snapshot, the share of a rise of the P50 that the service time estimate takes.
_SERVICE_RISE = 0.05
# Bounds the cost of a peer failing everything to four times its price. Its failures count
# for 3 s after it has recovered (probes' FAILED_S): priced out for good, it would get no
# traffic to show it; at four times, it is tried as soon as the others hold a few
# requests each, and the circuit breaker stops what it still fails.
_MIN_SUCCESS = 0.25
# A time to first token this many times the peer's lowest, with requests waiting: queued.
_QUEUED = 4.0
# How long a peer's last decode pace stands for it while it streams nothing: the probes'
# window.
_PACE_MEMORY_MS = 10_000
# The steady pace is the median of the last _STEADY_VERSIONS versions' paces. A second in
# which a busy server wrote a stream's events in bursts shows gaps near 0: in the fleet
# bench, as 300 sessions began at once, an average over versions (0.2 of each new pace)
# took the slow host from 41 to 12 ms within 0.6 s (versions showing 3.5 ms or less,
# where it decodes at 40); its ring weight doubled, came back in three steps, and each
# step moved sessions. Bounding each version's pace to a doubling of the average instead
# kept a first pace caught in such a burst for some 20 versions: the slow host weighed as
# a fast one and took the busiest session.
_STEADY_VERSIONS = 9
# The sessions' ring weighs a peer by what it serves, capacity over steady pace, in steps
# of sqrt(2) below the model's largest peer (a weight moves a session only when it changes
# a step), and at least 1/8 of it.
RING_STEPS_PER_DOUBLING = 2
_RING_LEAST = 1 / 8
# A model's candidates are paced by the recent median of token gaps or the window's P99
# of them (indexes 0 and 1 of Candidate.paces), else by the request time: _BY_REQUEST.
_BY_REQUEST = 2


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


class PeerRecord:
    """What the router knows of one peer: the latest snapshot's figures and, surviving
    snapshots, its circuit, what it has shown it can run at once, and this node's own
    traffic to it since that snapshot."""

    __slots__ = ("node_id", "breaker", "sends", "dones", "service_ms", "paces", "recent", "steady",
                 "slots", "queued", "ttft_floor_ms", "snapshot", "taken_ms", "since_ms", "alive",
                 "is_self", "in_flight", "overloaded", "shape", "gpus", "healthy", "_endpoints")

    def __init__(self, row: PeerInput, now_ms: int, config: RoutingConfig) -> None:
        self.node_id = row.node_id
        self.breaker = Breaker(config.breaker_failures, round(config.breaker_cooldown_s * 1000))
        # When this node sent it a request, and when clients reported one back, since the
        # snapshot was taken: the snapshot cannot include them.
        self.sends: deque[int] = deque()
        self.dones: deque[int] = deque()
        # Per model_id: the peer's time for one request without queueing.
        self.service_ms: dict[int, float] = {}
        # Per model_id: the last decode pace its snapshots showed, and when (now_ms).
        self.paces: dict[int, tuple[float, int]] = {}
        # Per model_id: log2 of its decode pace in its last versions, whose median is its
        # steady pace: the sessions' ring weighs peers by it, and must not change with
        # every second's jitter. Per version, not per second, so that every host holding
        # the same versions computes the same figure.
        self.recent: dict[int, deque[float]] = {}
        # Per model_id: the median of `recent`, kept as it changes (ring_points reads it at
        # every build, for every peer).
        self.steady: dict[int, float] = {}
        # The most streams seen running at once; whether the peer has been seen queueing
        # (then slots is its batch); the lowest time to first token it has shown.
        self.slots = 0
        self.queued = False
        self.ttft_floor_ms = 0.0
        self.snapshot = row.snapshot
        self.since_ms: int | None = row.since_ms
        self._learn(row.snapshot, now_ms, config)
        self._take(row, now_ms, config)

    def refresh(self, row: PeerInput, now_ms: int, config: RoutingConfig) -> None:
        if row.snapshot is self.snapshot and (row.alive, row.since_ms, row.is_self) == (
                self.alive, self.since_ms, self.is_self):
            # The same figures vouched for again (a beat, a datagram of the peer's own),
            # most rows of a large table's updates: only their age moves.
            self.taken_ms = now_ms - row.age_ms
            self.forget_before(self.taken_ms)
            return
        self._take(row, now_ms, config)

    def _take(self, row: PeerInput, now_ms: int, config: RoutingConfig) -> None:
        snap = row.snapshot
        if row.since_ms != self.since_ms:
            # Rejoined or recovered: perhaps restarted with another batch size.
            self.slots, self.queued, self.ttft_floor_ms = 0, False, 0.0
        # A version names one content: learn from each content once.
        if (snap.version, snap.timestamp_ms) != (self.snapshot.version, self.snapshot.timestamp_ms):
            self._learn(snap, now_ms, config)
        self.snapshot = snap
        self.taken_ms: int = now_ms - row.age_ms
        self.since_ms = row.since_ms
        self.alive: bool = row.alive
        self.is_self: bool = row.is_self
        self.in_flight: int = sum(m.in_flight for m in snap.models)
        # Its GPUs and the healthy ones among them, for _capacity() at each build; where it
        # serves each port (endpoint()).
        self.gpus: int = len(snap.gpus)
        self.healthy: int = sum(g.healthy for g in snap.gpus)
        self._endpoints: dict[int, str] = {}
        self.overloaded: bool = (snap.state is NodeState.OVERLOADED
                                 or snap.score >= config.score.overloaded_at)
        # What puts the peer in a model's candidates (build()): only a change of it needs
        # the candidates built again at once.
        self.shape: tuple[bool, tuple[int, ...]] = (
            row.alive and snap.state is not NodeState.DRAINING and bool(snap.endpoints),
            tuple(sorted({m.model_id for m in snap.models})))
        self.forget_before(self.taken_ms)

    def _learn(self, snap: LoadSnapshot, now_ms: int, config: RoutingConfig) -> None:
        """What the peer has shown it can run at once, and its pace.

        A continuously batching server runs up to its batch and queues the rest, so the
        most streams seen running together is its batch once it has queued, and only a
        lower bound before (it may never have had more to run): build() reads it so.
        Queueing shows as the time to first token rising far above the lowest the peer
        has shown with requests waiting, its own baseline: no absolute figure fits both a
        50 ms and a 5 s prefill.

        The pace of a model not streamed: the low envelope of its P50, which follows a
        drop at once and a rise slowly. The P50 itself includes the queueing the
        in-flight count already accounts for; counted twice, a peer that had a queue looks
        slow long after the queue is gone (the P50 window is 10 s) and sits idle while
        others queue. A window of failing answers teaches nothing: 429s are fast."""
        self.slots = max(self.slots, sum(m.running for m in snap.models))
        ttft = max((m.ttft_p99_ms for m in snap.models), default=0.0)
        if ttft > 0:
            if self.ttft_floor_ms and ttft >= _QUEUED * self.ttft_floor_ms \
                    and any(m.waiting for m in snap.models):
                self.queued = True
            self.ttft_floor_ms = min(self.ttft_floor_ms or ttft, ttft)
        for m in snap.models:
            if m.pace_ms > 0:
                self.paces[m.model_id] = (m.pace_ms, now_ms)
                recent = self.recent.setdefault(m.model_id, deque(maxlen=_STEADY_VERSIONS))
                recent.append(math.log2(m.pace_ms))
                self.steady[m.model_id] = statistics.median(recent)
            if m.rps > 0 and m.p50_ms > 0 and m.error_ratio <= config.error_ratio_threshold:
                old = self.service_ms.get(m.model_id)
                self.service_ms[m.model_id] = (
                    m.p50_ms if old is None or m.p50_ms < old else old + _SERVICE_RISE * (m.p50_ms - old))

    def endpoint(self, port: int) -> str:
        """Where requests to the port go: the snapshot's host for it (its first host
        without one), kept until the next snapshot, as every build asks again."""
        found = self._endpoints.get(port)
        if found is None:
            endpoints = self.snapshot.endpoints
            host = next((e.host for e in endpoints if e.port == port), endpoints[0].host)
            found = self._endpoints[port] = _host_port(host, port)
        return found

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


def _capacity(peer: PeerRecord, reference: int, ring: bool = False) -> float:
    """How many requests the peer serves at once: its batch where it has queued; where it
    has not, at least the largest batch another candidate has shown (a peer that never
    queued while others did is not the smaller one; taken at what it has run so far, the
    first peers to get traffic would look bigger and bigger to every host, and the others
    would never get the chance to show more). At least its healthy GPUs (no stream seen
    yet), and scaled down by the share of its GPUs that failed since.

    For the ring, a batch within one of its steps of the largest counts as the largest. A
    full host counts its non-streamed requests among its waiting (no byte of their answer
    yet), so the most streams it has run at once reaches its batch only some time after
    it first queues: with one request in five not streamed, an 8-slot host shows all 8
    running in one snapshot of six. In the fleet bench, hosts of 8 slots were seen
    queueing at 6, then showed 7 and 8, and each step of their ring weight moved sessions.
    A batch of half the largest is still the step below."""
    near = ring and peer.slots * 2 ** (1 / RING_STEPS_PER_DOUBLING) >= reference
    slots = peer.slots if peer.queued and not near else max(peer.slots, reference)
    if not peer.gpus:
        return float(max(1, slots))
    return max(slots * peer.healthy / peer.gpus, peer.healthy, 0.1)


class Candidate:
    """A peer as a candidate for one model."""

    __slots__ = ("peer", "endpoint", "service_ms", "paces", "capacity", "weight", "rate",
                 "success", "band")

    def fill(self, peer: PeerRecord, endpoint: str, service_ms: float,
             paces: tuple[float, float], capacity: float, weight: float,
             success: float, band: tuple[float, float]) -> None:
        """Every field, as made or refigured in place (refigure())."""
        self.peer = peer
        self.endpoint = endpoint
        # The peer's pace on this model, to weigh a queued request on a slow peer above one
        # on a fast peer: build() sets it to the gap between a stream's tokens where streams
        # show it (the decode speed every request on the peer gets, whatever its length),
        # else the time of one request without queueing (the P50 envelope).
        self.service_ms = service_ms
        # The token gaps the snapshot has: (the median over the last second, the window's
        # P99); 0 where it has none (no stream in the last second, or in the window).
        self.paces = paces
        self.capacity = capacity
        # Capacity times health: the cost's divisor before slow start.
        self.weight = weight
        # Weight over pace, what the peer serves per unit of time: the sampling weight
        # before slow start (build() sets it once the paces compare). Drawn by capacity
        # alone, a peer at half the speed is one of the d choices as often as a full-speed
        # one with its batch, and it wins whenever its partner is busier: in the fleet
        # bench it held 6.3-6.4 requests on its 8 slots when one was sent to it, where the
        # oracle kept 4.1-4.2, a cost 1.5 times the others'.
        self.rate = weight
        # The share of its answers to the model that succeed: a request sent to a peer
        # rejecting half of them costs two sends.
        self.success = success
        # The coins of the sessions it passes on, (start, width), as its snapshot says.
        self.band = band

    __init__ = fill


_RATE = attrgetter("rate")


@dataclass
class ModelCandidates:
    """Everything one model's requests need, built from the whole table (build()); a
    candidate whose peer has a new snapshot in between is refigured in place (refigure()),
    and the draw's table is reweighed before its next draw where a rate moved."""

    model_id: int
    candidates: list[Candidate]
    table: WeightedTable[Candidate]
    by_node: dict[str, Candidate]
    # Every peer known to serve the model, candidate or not: to say why none is usable.
    known: list[PeerRecord]
    # The sessions' ring: its points per known peer (ring_points()).
    ring: dict[str, int]
    # The smallest known peer's share of the ring's weight before the pooling factor
    # (ring_points()): the measure of a heavy session (heavy.py).
    least_share: float
    # What the candidates were measured against: the largest batch shown, which measure
    # of pace they share (0, 1 or _BY_REQUEST), and the pace of one without the figure.
    reference: int = 0
    paced_by: int = 0
    typical: float = 1.0
    # A refigured candidate's rate moved since the table was made.
    rates_moved: bool = False

    def weights(self) -> WeightedTable[Candidate]:
        """The draw's table, made again from the candidates' rates where one moved: a pass
        over a list of floats (1000 candidates: about 60 us, against 8 ms for build()),
        made when a request needs it, not at every update that refigured a candidate."""
        if self.rates_moved:
            self.table = WeightedTable(self.candidates, list(map(_RATE, self.candidates)))
            self.rates_moved = False
        return self.table


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _serving_entry(loads: Sequence[ModelLoad]) -> ModelLoad:
    # A model served on several ports of one host: the port taking most of its traffic.
    return loads[0] if len(loads) == 1 else max(loads, key=lambda m: (m.rps, -m.port))


def _candidate(peer: PeerRecord, loads: Sequence[ModelLoad], config: RoutingConfig,
               reference: int, now_ms: int) -> Candidate:
    c: Candidate = Candidate.__new__(Candidate)
    _figure(c, peer, loads, config, reference, now_ms)
    return c


def _figure(c: Candidate, peer: PeerRecord, loads: Sequence[ModelLoad], config: RoutingConfig,
            reference: int, now_ms: int) -> None:
    """Sets every field of the peer's candidate c (refigure() reuses the one the draw's
    table and the model's lists hold: made anew and copied over field by field, it took a
    quarter of the refiguring among 1000 peers, in py-spy's samples)."""
    snap = peer.snapshot
    service = 0.0
    paces = (0.0, 0.0)
    failing = 0.0
    band = (0.0, 0.0)
    if loads:
        entry = _serving_entry(loads)
        band = (entry.shed_start, entry.shed_width)
        endpoint = peer.endpoint(entry.port)
        # A second without a stream says nothing of the pace: the one shown last holds
        # for a window (a slow peer between two bursts is still slow), then it is old
        # news and the peer is taken as typical, so that one slow once is tried again.
        pace, at = peer.paces.get(entry.model_id, (0.0, 0))
        paces = (entry.pace_ms or (pace if now_ms - at <= _PACE_MEMORY_MS else 0.0),
                 entry.itl_p99_ms)
        if entry.rps > 0:  # likewise the P50 envelope, without traffic in the window
            service = peer.service_ms.get(entry.model_id, 0.0)
            failing = entry.error_ratio
    else:
        endpoint = peer.endpoint(snap.endpoints[0].port)
    if peer.overloaded:
        health = config.overloaded_weight
    elif (failing > config.error_ratio_threshold or snap.state is NodeState.DEGRADED
          or snap.score >= config.score.degraded_at):
        health = config.degraded_weight
    else:
        health = 1.0
    capacity = _capacity(peer, reference)
    c.fill(peer, endpoint, service, paces, capacity, capacity * health,
           max(_MIN_SUCCESS, 1.0 - failing), band)


def pace_expiry(peers: Iterable[PeerRecord], now_ms: int) -> int:
    """When a pace remembered now is forgotten (_PACE_MEMORY_MS), and build() would
    give a candidate another: the candidates built now hold until then, unless a
    snapshot changes."""
    return min((at + _PACE_MEMORY_MS + 1 for p in peers for _, at in p.paces.values()
                if now_ms - at <= _PACE_MEMORY_MS), default=now_ms + _PACE_MEMORY_MS)


def build(peers: Sequence[PeerRecord], config: RoutingConfig,
          static_ids: Mapping[str, frozenset[int]], now_ms: int) -> dict[int, ModelCandidates]:
    """Per model_id, its candidates and the table to draw them from."""
    loads: dict[int, dict[str, list[ModelLoad]]] = {}
    known: dict[int, list[PeerRecord]] = {}
    for peer in peers:
        served: dict[int, list[ModelLoad]] = {mid: [] for mid in static_ids.get(peer.node_id, ())}
        for m in peer.snapshot.models:
            served.setdefault(m.model_id, []).append(m)
        for mid, entries in served.items():
            known.setdefault(mid, []).append(peer)
            if (peer.alive and peer.snapshot.state is not NodeState.DRAINING
                    and peer.snapshot.endpoints):
                loads.setdefault(mid, {})[peer.node_id] = entries
    by_id = {p.node_id: p for p in peers}
    out: dict[int, ModelCandidates] = {}
    for mid, peers_known in known.items():
        serving = loads.get(mid, {})
        reference = max((by_id[n].slots for n in serving), default=0)
        cands = [_candidate(by_id[n], entries, config, reference, now_ms)
                 for n, entries in serving.items()]
        # One measure of pace for all of a model's candidates, so that they compare: the
        # token gap once any streams (the recent median where any peer has one, else the
        # window's P99), the request time while none does. A peer without the
        # figure (idle, or not streaming) is taken as typical of the others.
        paced_by = next((i for i in (0, 1) if any(c.paces[i] > 0 for c in cands)), _BY_REQUEST)
        measured = [m for m in (_pace(c, paced_by) for c in cands) if m > 0]
        typical = statistics.median(measured) if measured else 1.0
        for c in cands:
            _set_pace(c, paced_by, typical)
        ring, least_share = ring_points(mid, peers_known, reference, config.vnodes)
        out[mid] = ModelCandidates(
            model_id=mid,
            candidates=cands,
            table=WeightedTable(cands, list(map(_RATE, cands))),
            by_node={c.peer.node_id: c for c in cands},
            known=peers_known,
            ring=ring,
            least_share=least_share,
            reference=reference,
            paced_by=paced_by,
            typical=typical,
        )
    return out


def refigure(entry: ModelCandidates, peer: PeerRecord, config: RoutingConfig, now_ms: int) -> None:
    """The peer's candidate for the model, refigured in place from the peer's latest
    snapshot (its health, pace, batch, success and band; its load is read from the peer
    at each request anyway), measured against what the model's last build() measured
    the others against. Where its rate, its weight in the draw, moved, the draw's table is
    made again before the next draw (ModelCandidates.weights())."""
    old = entry.by_node.get(peer.node_id)
    if old is None:
        return
    loads = [m for m in peer.snapshot.models if m.model_id == entry.model_id]
    rate = old.rate
    _figure(old, peer, loads, config, entry.reference, now_ms)
    _set_pace(old, entry.paced_by, entry.typical)
    entry.rates_moved = entry.rates_moved or old.rate != rate


def _pace(c: Candidate, paced_by: int) -> float:
    return c.paces[paced_by] if paced_by != _BY_REQUEST else c.service_ms


def _set_pace(c: Candidate, paced_by: int, typical: float) -> None:
    c.service_ms = _pace(c, paced_by)
    if c.service_ms <= 0:
        c.service_ms = typical
    c.rate = c.weight / c.service_ms


def ring_points(model_id: int, peers: Sequence[PeerRecord], reference: int,
                vnodes: int) -> tuple[dict[str, int], float]:
    """Each peer's points on the model's sessions' ring: vnodes times what it serves (its
    capacity over its steady pace) over what the largest serves, in steps (_RING_*), times
    what a smaller batch leaves of that to queue alike (pooling.py). So a peer holds
    sessions in proportion to its token rate: a peer at half the speed holds half as many,
    and one with half the batch a little less than half. Dead and draining peers keep
    theirs, so that their sessions stay guests where they went (shed.py). Only what the
    snapshots say enters, so every host builds the same ring.

    With the points, the smallest peer's share of the weights before the pooling factor:
    what a session is measured against to be heavy (heavy.py). Taken of the points, the
    factor's 10% less for the small host let a sixth session of the fleet bench (seed 7,
    3.8% of the requests) over the mark, which then moved between h5 and h1, and two agents
    agreed on a session's host 95.6-96.6% of the time where they had 99.5%."""
    paces = {p.node_id: p.steady[model_id] for p in peers if model_id in p.steady}
    typical = statistics.median(paces.values()) if paces else 0.0
    capacities = {p.node_id: _capacity(p, reference, ring=True) for p in peers}
    rates = {p.node_id: capacities[p.node_id] / 2 ** paces.get(p.node_id, typical) for p in peers}
    top = max(rates.values(), default=0.0)
    weights = {node_id: stepped(max(rate / top, _RING_LEAST), RING_STEPS_PER_DOUBLING)
               for node_id, rate in rates.items()}
    out = {}
    for node_id, weight in weights.items():
        # After the step: the factor (0.905 for half the batch) is finer than a step. Of
        # the batch in the ring's steps, so that it moves only where the weight or the
        # largest batch does (on the bench, as the largest shown went from 7 to 8 in the
        # first seconds, the small host's points went 74, 72).
        batch = (round(reference * stepped(capacities[node_id] / reference, RING_STEPS_PER_DOUBLING))
                 if reference > 0 else 0)
        out[node_id] = max(1, round(vnodes * weight * pooling_factor(batch, reference)))
    least = min(weights.values()) / sum(weights.values()) if weights else 0.0
    return out, least


def static_model_ids(config: RoutingConfig) -> dict[str, frozenset[int]]:
    return {node: frozenset(model_id(name) for name in names)
            for node, names in config.static_models.items()}

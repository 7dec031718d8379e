"""The routing decision: which peer should serve a request for model M (session S).

    update(peers, now_ms, complete)   when the membership table changes (every peer, or
                               those that changed): refreshes their records and, within
                               a CPU budget, rebuilds the per-model candidate sets
    tick(now_ms)               time passing with the table unchanged: this node's bands
                               step, and candidates whose remembered pace expires are rebuilt
    best(model, session, exclude, now_ms) -> Decision | NoCandidate
    feedback(node_id, outcome, latency_ms, now_ms)   a client's report on a request

The choice (docs/routing.md has the reasoning and the measurements):

1. Candidates for M: alive, serving M, not draining, with an endpoint (candidates.py);
   per request, not excluded and circuit not open.
2. Peers with a fresh snapshot; failing those, peers with a stale one. Overload is no
   filter: a filter that leaves one peer takes everything from every host at once.
3. With a session: a heavy session's placed peer (heavy.py); any other, its peer on the
   consistent-hash ring, weighted by what each peer serves (candidates.ring_points) less
   what its heavy sessions take of it (_place_light), walking clockwise past peers that are unusable
   or that pass the session on: each host publishes which of its sessions it passes on
   while it carries more than its share (shed.py), so that every host makes the same
   walk; where every usable peer passes it on, spill(). Where the peer so found queues
   well above the fleet (overflow.py: from the snapshots' figures, alike at every host),
   a light session's request (neither heavy nor middling) goes to the next usable one
   along the ring that does not, and the session stays where it is.
4. Otherwise (or when no ring peer is usable): d peers drawn with probability
   proportional to their effective rate (their effective capacity over their pace), and
   the one with the lowest cost wins; the effective capacity is what the peer has shown
   it runs at once, times degraded_weight or overloaded_weight, times the slow-start ramp:

       cost = (load + 1) * pace / (effective capacity * success)

   load is the snapshot's in-flight count corrected by this node's own sends and
   completions since the snapshot was taken, scaled to the fleet (p2c.OwnShare); the pace
   is the median gap between a stream's tokens over the last second where the model
   streams, else the low envelope of its P50
   (candidates.py); success is the share of the peer's answers that do not fail.

A Router is not thread-safe: the agent calls it from its event loop only.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from loadmesh.daemon import logs
from loadmesh.daemon.routing.candidates import (
    Candidate,
    ModelCandidates,
    PeerInput,
    PeerRecord,
    RING_STEPS_PER_DOUBLING,
    RoutingConfig,
    build,
    pace_expiry,
    refigure,
    static_model_ids,
)
from loadmesh.daemon.routing.heavy import HeavySessions
from loadmesh.daemon.routing.overflow import Overflow
from loadmesh.daemon.routing.p2c import OwnShare, draw_exact, order
from loadmesh.daemon.routing.reasons import Reason
from loadmesh.daemon.routing.ring import HashRing, hash64, stepped
from loadmesh.daemon.routing.shed import Seat, Shedding, passes_on
from loadmesh.gossip.snapshot import MAX_SESSION_MODELS, MAX_SESSIONS, SESSION_KEY_BITS, NodeState, SessionRates
from loadmesh.model_id import model_id

Outcome = Literal["ok", "error", "timeout"]
OUTCOMES: frozenset[str] = frozenset({"ok", "error", "timeout"})

log = logs.get("routing")

# Draws per wanted candidate before the fast path gives up and filters exactly.
_TRIES_PER_PICK = 8
# The weight in spill() of a peer that passes every session on, as a share of its slots.
_SPILL_FLOOR = 0.1
# Bounds the name -> model_id cache against clients sending arbitrary names.
_MAX_CACHED_NAMES = 4096
# A build of the candidates costs about _BUILD_MS_PER_PEER per peer and model (in an agent
# among 999 peers of 2 models, 12-28 ms, median 16, on the development machine,
# 2026-12-05). One estimated above _BUILD_FREE_MS is followed by the next no sooner than its
# cost x _BUILD_SPACING later when a candidate was gained, x _FIGURES_SPACING when only
# figures changed: each changed candidate is refigured in place and its model's draw
# reweighed before the next draw, so what waits for a build is only what is made of all
# the candidates together (the largest batch, the typical pace, the sessions' ring), which
# one peer's version barely moves. Up to 125 peers of one model every update builds; at
# 1000 peers of 2 models a gained candidate is drawn within 1.6 s and the aggregates
# follow within 8 s (docs/routing.md, Interface). Estimated, not timed: a simulation or a
# test of the router gives the same answers on any machine, under any load.
_BUILD_MS_PER_PEER = 0.008
_BUILD_FREE_MS = 1.0
_BUILD_SPACING = 99
_FIGURES_SPACING = 499
# How often this node's bands take in the loads (_shed): this node's own figures change
# once a snapshot tick (load.tick_ms, 250 ms) and its peers' once a gossip round, so
# sampling them at every update (100 ms) learnt nothing more, and at 1000 peers the list
# of their loads cost 0.54 ms an update where sessions are routed (0.5% of a core).
_SHED_EVERY_MS = 250
# How often the heavy sessions are placed again (heavy.py): a session is heavy for many
# seconds, and a placed host that stops being usable is skipped at once, per request. At
# 1000 peers each publishing 8 sessions, summing their rates takes milliseconds.
_PLACE_EVERY_MS = 1000
# A peer's light sessions' ring keeps at least this part of its points, whatever heavy
# sessions it holds (heavy.ROOM keeps them to half its share; only a placement on the
# roomiest peer, where none fits, goes beyond).
_LIGHT_FLOOR = 0.25
# A session's key on the wire: the high bits of its point on the ring.
_KEY_SHIFT = 64 - SESSION_KEY_BITS

# A peer's cause of being unusable (NoCandidate.counts), and the answer's reason when
# every peer has that one.
_ALL = {
    "dead": Reason.ALL_DEAD,
    "draining": Reason.ALL_DRAINING,
    "no endpoint": Reason.NO_ENDPOINT,
    "excluded": Reason.ALL_EXCLUDED,
    "circuit open": Reason.ALL_CIRCUITS_OPEN,
}
_Usable = Callable[[Candidate], bool]
_TIER_REASONS = (Reason.POWER_OF_D, Reason.STALE_VIEW)
# The sessions' answers whose peer may send this request past (overflow.py): a peer that
# keeps a session, of those neither heavy nor middling (checked apart). Passed on by every
# peer, it goes where the bands' weights say; a heavy session stays on its placed peer
# (overflow.py says why).
_OVERFLOWING = (Reason.SESSION, Reason.SESSION_MOVED)


@dataclass(frozen=True)
class Alternative:
    node_id: str
    endpoint: str
    score: float


@dataclass(frozen=True)
class Decision:
    node_id: str
    endpoint: str            # host:port to send the request to
    score: float             # the peer's score in the snapshot used
    age_ms: int              # how old that snapshot is
    reason: Reason
    alternatives: tuple[Alternative, ...]  # next choices, best first, for retries


@dataclass(frozen=True)
class NoCandidate:
    model: str
    # UNKNOWN_MODEL, one of the ALL_* reasons, or NO_USABLE_PEER when causes are mixed
    # (see counts).
    reason: Reason
    counts: Mapping[str, int]  # peers serving the model, by why each is unusable


def _log_ring_change(mid: int, old: Mapping[str, int], new: Mapping[str, int],
                     which: str = "sessions'") -> None:
    """A change of the sessions' ring moves the sessions of the points that moved, each a
    prefill of its whole context on its new host: worth a line, with what changed."""
    moved = sorted(n for n in old.keys() | new.keys() if old.get(n) != new.get(n))
    log.info("%s ring of model %016x changed: %s", which, mid,
             ", ".join(f"{n!r} {old.get(n, 0)} -> {new.get(n, 0)} points" for n in moved[:8])
             + (f" and {len(moved) - 8} more" if len(moved) > 8 else ""))


def _light_points(ring: Mapping[str, int], held: Mapping[str, float]) -> dict[str, int]:
    """Each peer's points for the light sessions: its points for its share less the part of
    it that its heavy sessions take, in steps of sqrt(2) as the ring's weights are. The
    light sessions spread by these points, and each host's light share and heavy sessions
    together come to about its share. In steps: the heavy sessions' shares climb for a
    minute as their counts fill, and taken as they were, each agent changed the light
    ring 12-16 times in the fleet bench's 90 s, each change a move of some sessions; a
    heavy session of a few percent of a large host's share now changes nothing."""
    total = sum(ring.values())
    return {n: max(1, round(k * stepped(max(_LIGHT_FLOOR, 1 - held.get(n, 0.0) * total / k),
                                        RING_STEPS_PER_DOUBLING)))
            for n, k in ring.items()}


def _log_placements(mid: int, old: Mapping[int, str], new: Mapping[int, str]) -> None:
    """A heavy session placed elsewhere moves, as a change of the ring does: worth a line.
    One that becomes heavy where it was, or light, may not move at all: counted only."""
    moved = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    came, went = len(new.keys() - old.keys()), len(old.keys() - new.keys())
    if moved or came or went:
        log.info("heavy sessions of model %016x: %d placed, %d new, %d no longer heavy%s", mid, len(new),
                 came, went, "".join(f", {k:08x} {old[k]!r} -> {new[k]!r}" for k in moved[:8]))


def spill(peers: Sequence[Candidate], session: str) -> Candidate:
    """Where a session goes that every usable peer passes on: a draw weighted by the share
    of the coins each peer keeps (1 less its band's width) times its slots (weighted
    rendezvous hashing: the lowest -ln(u) / weight, u the session's coin on the peer).
    The bands change at most every 2 s and every host reads the same ones, so hosts
    agree, and the overflow goes mostly to the peers that pass least on. Weighted by the
    free slots in the peers' snapshots, which move with every version and reach hosts at
    different times, two agents asked about a session within a second named the same
    peer 88-94% of the time in tests/test_fleet_sessions.py (six runs), against 96-98%
    (eight runs). By load as each host sees it (d choices), two hosts asked at the same
    moment named different peers; all to the first peer, the fleet's overflow landed on
    one host. Every peer weighs at least _SPILL_FLOOR of its slots: when all pass
    everything on, by size."""
    def score(c: Candidate) -> float:
        keeps = max((1.0 - c.band[1]) * c.capacity, _SPILL_FLOOR * c.capacity, 1e-9)
        u = (hash64(f"{c.peer.node_id}\x1f{session}\x1fspill") + 1) / (2**64 + 1)
        return -math.log(u) / keeps
    return min(peers, key=score)


class Router:
    def __init__(self, config: RoutingConfig | None = None,
                 shedding: Shedding | None = None) -> None:
        """shedding: the bands of a router this one replaces (a reload), so that the
        sessions passed on stay where they went."""
        self.config = config or RoutingConfig()
        c = self.config
        self.shedding = shedding or Shedding(c.epsilon)
        self.shedding.epsilon = c.epsilon
        self._rng = random.Random(c.seed)
        self._freshness_ms = round(c.freshness_s * 1000)
        self._ramp_ms = round(c.slow_start_s * 1000)
        # Drawn per request: the d choices, and more when the alternatives need them.
        self._draw = max(c.choices, 1 + c.alternatives)
        self._static_ids = static_model_ids(c)
        self._peers: dict[str, PeerRecord] = {}
        self._models: dict[int, ModelCandidates] = {}
        # Until when the candidates hold with the table unchanged (a pace remembered
        # expires); whether a candidate was gained, or only figures changed, since they
        # were built; and when the budget allows the next build for each (_BUILD_SPACING,
        # _FIGURES_SPACING).
        self._rebuild_by = 0
        self._gained = False
        self._stale = False
        self._next_build = 0
        self._next_figures = 0
        self._self_id: str | None = None
        self._rings: dict[int, HashRing] = {}
        # Per model, the ring of its light sessions (_light_points) and the ring's points
        # it was made from; absent where no peer holds a heavy session.
        self._light: dict[int, tuple[Mapping[str, int], HashRing]] = {}
        self._ids: dict[str, int] = {}
        self._share = OwnShare(round(c.own_share_half_life_s * 1000), c.own_share_cap)
        self._fleet_rps = 0.0
        self._shed_ms: int | None = None  # when the bands last took in the loads
        self.heavy = HeavySessions()
        self._placed_ms: int | None = None  # when the heavy sessions were last placed
        self.overflow = Overflow()

    def update(self, peers: Sequence[PeerInput], now_ms: int, complete: bool = True) -> None:
        """Take the table's rows: all of them (complete: a peer not among them is gone),
        or those that changed since the last update.

        A peer's load and age are read from its record at each request, so they count at
        once. What is built from the whole table (which peers are candidates, their
        capacities against the largest batch, the pace they share, the draw's weights, the
        sessions' ring) is built again at once when a candidate is lost (a peer gone, dead,
        draining, or no longer serving a model); when a candidate is gained or only
        figures changed, at once if the budget allows (a build takes milliseconds per
        hundred peers: at 1000 peers, built at every update it took most of an agent's
        CPU, scripts/bench_agent_cpu.py). Otherwise a changed candidate is refigured in
        place, its model's draw reweighed before the next draw where its rate moved, and
        the build follows within the budget."""
        lost = gained = False
        if complete:
            current = {row.node_id for row in peers}
            for gone in self._peers.keys() - current:
                del self._peers[gone]
                lost = True
        refigured: list[PeerRecord] = []
        for row in peers:
            if row.is_self:
                self._self_id = row.node_id
            peer = self._peers.get(row.node_id)
            if peer is None:
                self._peers[row.node_id] = PeerRecord(row, now_ms, self.config)
                gained = True
                continue
            (could, served_before), same = peer.shape, (
                (peer.snapshot.version, peer.snapshot.timestamp_ms, peer.alive, peer.since_ms)
                == (row.snapshot.version, row.snapshot.timestamp_ms, row.alive, row.since_ms))
            peer.refresh(row, now_ms, self.config)
            can, served = peer.shape
            if (could, served_before) != (can, served):
                lost = lost or (could and not can) or not set(served_before) <= set(served)
                gained = True
            elif not same:
                refigured.append(peer)
        self._gained = self._gained or gained
        self._stale = self._stale or bool(refigured)
        if lost or self._due(now_ms):
            self._build(now_ms)
        else:
            for peer in refigured:
                for entry in self._models.values():
                    refigure(entry, peer, self.config, now_ms)
        self.tick(now_ms)

    def tick(self, now_ms: int) -> None:
        # Freshness needs no rebuild: each request checks it against the time the figures
        # were vouched for.
        if self._due(now_ms):
            self._build(now_ms)
        if self._shed_ms is None or now_ms - self._shed_ms >= _SHED_EVERY_MS:
            self._shed_ms = now_ms
            self._shed(now_ms)

    def _due(self, now_ms: int) -> bool:
        """Whether a build is owed (a candidate gained, figures changed, a remembered pace
        expired) and its budget allows it now."""
        return ((self._gained and now_ms >= self._next_build)
                or ((self._stale or now_ms >= self._rebuild_by) and now_ms >= self._next_figures))

    def _build(self, now_ms: int) -> None:
        self._rebuild_by = pace_expiry(self._peers.values(), now_ms)
        before = self._models
        self._models = build(list(self._peers.values()), self.config, self._static_ids, now_ms)
        for mid, entry in self._models.items():
            old = before.get(mid)
            if old is not None and old.ring != entry.ring:
                _log_ring_change(mid, old.ring, entry.ring)
        self._fleet_rps = sum(m.rps for p in self._peers.values() if p.alive for m in p.snapshot.models)
        # A ring holds every peer known to serve its model, dead and draining ones too
        # until they are reaped, so that their sessions stay guests where they went
        # (shed.py); it stays valid while those peers and their weights are the same, and
        # the peers that are not candidates, or not usable for one request, are skipped.
        self._rings = {mid: ring for mid, ring in self._rings.items()
                       if mid in self._models and ring.vnodes == self._models[mid].ring}
        # A light ring follows its model's ring at once: dropped until the next placement,
        # its light sessions would walk the ring's points for that while, and move twice.
        self._light = {mid: light for mid, light in self._light.items() if mid in self._models}
        self.overflow.forget_except(set(self._models))
        for mid, (base, _) in list(self._light.items()):
            if base != self._models[mid].ring:
                self._place_light(self._models[mid])
        self._gained = self._stale = False
        cost_ms = _BUILD_MS_PER_PEER * sum(len(entry.known) for entry in self._models.values())
        charged = cost_ms > _BUILD_FREE_MS
        self._next_build = now_ms + (round(cost_ms * _BUILD_SPACING) if charged else 0)
        self._next_figures = now_ms + (round(cost_ms * _FIGURES_SPACING) if charged else 0)

    def band(self, model_id: int) -> tuple[float, float]:
        """This node's band of passed-on sessions for the model, (start, width)."""
        return self.shedding.band(model_id)

    def best(self, model: str, session: str | None, exclude: Collection[str],
             now_ms: int, dry_run: bool = False) -> Decision | NoCandidate:
        """The peer for one request. dry_run: the same answer, counted nowhere (no send in
        the in-flight correction, no session request in the rates, no circuit trial
        claimed), for whoever asks where a request would go without sending one."""
        entry = self._models.get(self._model_id(model))
        if entry is None:
            return NoCandidate(model, Reason.UNKNOWN_MODEL, {})
        excluded = exclude if isinstance(exclude, (set, frozenset)) else frozenset(exclude)
        share = self._share.multiplier(self._fleet_rps, now_ms)

        def usable(c: Candidate) -> bool:
            p = c.peer
            return (p.node_id not in excluded and p.fresh(now_ms, self._freshness_ms)
                    and p.breaker.allows(now_ms))

        if session is None:
            if not dry_run:
                self.shedding.saw(entry.model_id, None, now_ms)
        else:
            point = hash64(session)
            key = point >> _KEY_SHIFT
            if not dry_run:
                self.shedding.saw(entry.model_id, key, now_ms)
            by_ring = self._by_session(entry, session, point, usable) if entry.candidates else None
            if by_ring is not None:
                ordered, reason = by_ring
                if (reason in _OVERFLOWING and not self.heavy.weighs(entry.model_id, key)
                        and (spare := self.overflow.spare(entry, ordered, now_ms)) is not None):
                    ordered, reason = [spare, *(c for c in ordered if c is not spare)], Reason.SESSION_OVERFLOW
                return self._decide(ordered, reason, now_ms, dry_run)

        def accept(c: Candidate) -> bool:
            if not usable(c):
                return False
            # Slow start on the fast path: a ramping peer is kept with probability equal
            # to its ramp, which scales its sampling weight by it.
            ramp = self._ramp(c, now_ms)
            return ramp >= 1.0 or self._rng.random() < ramp

        drawn = entry.weights().draw(self._rng, self._draw, accept, self._draw * _TRIES_PER_PICK)
        reason = Reason.POWER_OF_D
        if drawn is None:
            filtered = self._draw_filtered(entry, excluded, now_ms)
            if filtered is None:
                return self._nothing(model, entry, excluded)
            drawn, reason = filtered
        return self._decide(order(drawn, self.config.choices, lambda c: self._cost(c, share, now_ms)),
                            reason, now_ms, dry_run)

    def feedback(self, node_id: str, outcome: Outcome, latency_ms: float, now_ms: int) -> bool:
        """Records a client's outcome; False when the peer is not in the table.

        The outcome feeds the peer's circuit and, as a completion, the in-flight
        correction. latency_ms is checked but does not steer: a peer's pace comes from
        its snapshot's P50, measured on all its traffic rather than this node's share."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {sorted(OUTCOMES)}, not {outcome!r}")
        if not (math.isfinite(latency_ms) and latency_ms >= 0):
            raise ValueError(f"latency_ms must be a non-negative number, not {latency_ms!r}")
        peer = self._peers.get(node_id)
        if peer is None:
            return False
        peer.dones.append(now_ms)
        peer.breaker.record(outcome != "ok", now_ms)
        return True

    def _model_id(self, name: str) -> int:
        mid = self._ids.get(name)
        if mid is None:
            if len(self._ids) >= _MAX_CACHED_NAMES:
                self._ids.clear()
            mid = self._ids[name] = model_id(name)
        return mid

    def _ramp(self, c: Candidate, now_ms: int) -> float:
        return c.peer.ramp(now_ms, self._ramp_ms, self.config.slow_start_floor)

    def _effective_capacity(self, c: Candidate, now_ms: int) -> float:
        return c.weight * self._ramp(c, now_ms)

    def _cost(self, c: Candidate, share: float, now_ms: int) -> float:
        return ((c.peer.load(share) + 1) * c.service_ms
                / (self._effective_capacity(c, now_ms) * c.success))

    def _shed(self, now_ms: int) -> None:
        """Steps this node's bands: its load per slot against each of its models' fleets.
        The loads are the snapshots' in-flight counts, this node's included, as every host
        sees them."""
        served: set[int] = set()
        fresh_from = now_ms - self._freshness_ms
        for mid, entry in self._models.items():
            own = entry.by_node.get(self._self_id) if self._self_id is not None else None
            if own is None:
                continue
            served.add(mid)
            if not self.shedding.watching(mid, now_ms):
                self.shedding.step(mid, own.peer.in_flight, own.capacity, (), now_ms)
                continue
            # PeerRecord.fresh() inlined: at 1000 peers this list is most of a tick.
            others = [(c.peer.in_flight, c.capacity) for c in entry.candidates
                      if c is not own and c.peer.taken_ms >= fresh_from]
            # Orphans come from a peer gone (known, on the ring, but no candidate), guests
            # from a peer that passes sessions on.
            self.shedding.step(mid, own.peer.in_flight, own.capacity, others, now_ms,
                               gone=len(entry.known) - len(entry.candidates),
                               guests=any(c.band[1] > 0 for c in entry.candidates if c is not own))
        self.shedding.forget_except(served)
        if self._placed_ms is None or now_ms - self._placed_ms >= _PLACE_EVERY_MS:
            self._placed_ms = now_ms
            self._place_heavy()

    def _place_heavy(self) -> None:
        """Places each model's heavy sessions (heavy.py) from the rates its peers publish,
        a session's share of the model taken of the requests they say they routed
        (session_counts.py). A peer's last figures count until it is forgotten, dead or
        alive, as its points on the ring do: the shares then hold through its loss, which
        moves its own sessions and no other's. Counted among the live only, the model's
        requests fell by the lost host's at once while the sessions' counts decay over a
        minute: shares rose, sessions became heavy, and each agent of the fleet bench
        moved heavy sessions 22-29 times in the 30 s after the kill (8-9 with the figures
        kept). Where a peer publishes no routed rate (an older writer), the servers' rates
        stand for the whole."""
        rates: dict[int, dict[int, float]] = {}
        routed: dict[int, float] = {}
        older: set[int] = set()
        for peer in self._peers.values():
            for model in peer.snapshot.sessions:
                summed = rates.setdefault(model.model_id, {})
                for key, rps in model.sessions:
                    summed[key] = summed.get(key, 0.0) + rps
                routed[model.model_id] = routed.get(model.model_id, 0.0) + model.routed_rps
                if not model.routed_rps:
                    older.add(model.model_id)
        self.heavy.forget_except(set(rates))
        self._light = {mid: light for mid, light in self._light.items() if mid in rates}
        self.shedding.counts.forget_except(set(self._models))
        for mid, summed in rates.items():
            entry = self._models.get(mid)
            if entry is None:
                continue
            total = sum(entry.ring.values())
            rps = (routed[mid] if mid not in older else
                   sum(m.rps for p in entry.known for m in p.snapshot.models if m.model_id == mid))
            ring = self._ring(entry)
            before = dict(self.heavy.placed(mid))
            self.heavy.place(mid, summed, rps, {n: k / total for n, k in entry.ring.items()},
                             entry.least_share, entry.by_node.keys(), lambda key: ring.walk_from(key << _KEY_SHIFT))
            _log_placements(mid, before, self.heavy.placed(mid))
            self._place_light(entry)

    def light_points(self, model_id: int) -> Mapping[str, int]:
        """Each peer's points on the model's light sessions' ring (_place_light)."""
        entry = self._models.get(model_id)
        return self._light_ring(entry).vnodes if entry is not None else {}

    def _light_ring(self, entry: ModelCandidates) -> HashRing:
        """The ring the model's light sessions walk: its own where a peer holds heavy
        sessions, else the ring's."""
        light = self._light.get(entry.model_id)
        return light[1] if light is not None else self._ring(entry)

    def _place_light(self, entry: ModelCandidates) -> None:
        """The light sessions' ring of the model, from the heavy sessions' placement as if
        every known peer were a candidate (heavy.held): a loss changes neither, and moves
        only the lost host's sessions. Placed on the ring's points, the host of the busiest
        session (16% of the requests in the fleet bench, where its share is 25%) also held
        its share of the light ones, carried 1.3 times its share, and its band passed a
        third of its sessions on to the next hosts, whose bands grew in turn."""
        mid = entry.model_id
        held = self.heavy.held(mid)
        points = _light_points(entry.ring, held) if held else entry.ring
        old = self._light.get(mid)
        before = old[1].vnodes if old is not None else entry.ring
        if points != before:
            _log_ring_change(mid, before, points, "light sessions'")
        if points == entry.ring:
            self._light.pop(mid, None)
        else:
            ring = old[1] if old is not None and points == before else HashRing(points)
            self._light[mid] = (dict(entry.ring), ring)

    def busiest(self, now_ms: int) -> tuple[SessionRates, ...]:
        """The busiest sessions routed here, per model, for this node's snapshot."""
        counts = self.shedding.counts
        return tuple(SessionRates(mid, top, counts.routed_rps(mid, now_ms)) for mid, top in
                     counts.busiest(MAX_SESSIONS, MAX_SESSION_MODELS, now_ms).items())

    def _ring(self, entry: ModelCandidates) -> HashRing:
        ring = self._rings.get(entry.model_id)
        if ring is None:
            ring = self._rings[entry.model_id] = HashRing(entry.ring)
        return ring

    def _by_session(self, entry: ModelCandidates, session: str, point: int,
                    usable: _Usable) -> tuple[list[Candidate], Reason] | None:
        """A heavy session's host (heavy.py) where it is usable; else the first usable
        peer along the ring that keeps the session, with the next usable ones as
        alternatives; when every one passes it on, spill()'s; None when none is usable.
        Only what the snapshots publish decides (the peers, their bands and loads, the
        sessions' rates), so every host holding the same snapshots makes the same choice.
        The light sessions walk their own ring (_place_light), the heavy ones' alternatives
        too."""
        ring = self._light_ring(entry)
        want = self.config.alternatives
        key = point >> _KEY_SHIFT
        placed = self.heavy.host(entry.model_id, key)
        if placed is not None and (host := entry.by_node.get(placed)) is not None and usable(host):
            walk = (entry.by_node.get(n) for n in ring.walk_from(point))
            rest = itertools.islice((c for c in walk if c is not None and c is not host and usable(c)), want)
            return [host, *rest], Reason.SESSION_HEAVY
        chosen: Candidate | None = None
        passed: list[Candidate] = []
        alternatives: list[Candidate] = []
        owner: str | None = None
        # An orphan stays one all along the ring: passed on by the first peer after its
        # lost owner, it is no guest of the next, whose guests' part would otherwise mix
        # a lost host's sessions with those a live peer passed on long before (and moved
        # both when it grew over them).
        orphan = False
        own = Seat.OWN_LAST if self.heavy.weighs(entry.model_id, key) else Seat.OWN
        for node_id in ring.walk_from(point):
            owner = owner or node_id
            c = entry.by_node.get(node_id)
            if c is None or not usable(c):
                orphan = orphan or node_id == owner
                continue
            if chosen is not None:
                alternatives.append(c)
                if len(alternatives) == want:
                    break
            elif passes_on(*c.band, node_id, session, own if node_id == owner
                           else Seat.ORPHAN if orphan else Seat.GUEST):
                passed.append(c)
            else:
                chosen = c
                if not want:
                    break
        if chosen is None:
            if not passed:
                return None
            chosen = spill(passed, session)
            rest = [c for c in passed if c is not chosen]
            return [chosen, *rest[:want]], Reason.SESSION_PASSED_ON
        alternatives += passed[:want - len(alternatives)]
        moved = chosen.peer.node_id != owner
        return [chosen, *alternatives], Reason.SESSION_MOVED if moved else Reason.SESSION

    def _draw_filtered(self, entry: ModelCandidates, excluded: Collection[str],
                       now_ms: int) -> tuple[list[Candidate], Reason] | None:
        tiers: tuple[list[Candidate], ...] = ([], [])
        for c in entry.candidates:
            p = c.peer
            if p.node_id in excluded or not p.breaker.allows(now_ms):
                continue
            tiers[0 if p.fresh(now_ms, self._freshness_ms) else 1].append(c)
        for tier, reason in zip(tiers, _TIER_REASONS, strict=True):
            if tier:
                weights = [c.rate * self._ramp(c, now_ms) for c in tier]
                return draw_exact(self._rng, tier, weights, self._draw), reason
        return None

    def _decide(self, ordered: list[Candidate], reason: Reason, now_ms: int, dry_run: bool) -> Decision:
        winner = ordered[0]
        peer = winner.peer
        if not dry_run:
            peer.sends.append(now_ms)
            self._share.sent(now_ms)
            # Own traffic older than a fresh snapshot can be is no longer worth correcting
            # for; dropping it bounds the queues of a peer whose snapshots stopped coming.
            peer.forget_before(now_ms - self._freshness_ms)
            peer.breaker.claim(now_ms)
        return Decision(
            node_id=peer.node_id,
            endpoint=winner.endpoint,
            score=peer.snapshot.score,
            age_ms=now_ms - peer.taken_ms,
            reason=reason,
            alternatives=tuple(Alternative(c.peer.node_id, c.endpoint, c.peer.snapshot.score)
                               for c in ordered[1:1 + self.config.alternatives]),
        )

    def _nothing(self, model: str, entry: ModelCandidates, excluded: Collection[str]) -> NoCandidate:
        counts: Counter[str] = Counter()
        for p in entry.known:
            if not p.alive:
                counts["dead"] += 1
            elif p.snapshot.state is NodeState.DRAINING:
                counts["draining"] += 1
            elif not p.snapshot.endpoints:
                counts["no endpoint"] += 1
            elif p.node_id in excluded:
                counts["excluded"] += 1
            else:
                counts["circuit open"] += 1
        reason = _ALL[next(iter(counts))] if len(counts) == 1 else Reason.NO_USABLE_PEER
        return NoCandidate(model, reason, dict(counts))

"""The gossip protocol core, without I/O: datagrams and clock readings in, datagrams out.

Nothing here opens a socket or reads a clock. The agent drives it with a UDP socket and
the monotonic clock (gossip/transport.py); the simulator drives the very same code with
a simulated network and clock (gossip/simulator.py). Every entry point takes `now_ms`
and returns the datagrams to send as (address, bytes).

How news travels (docs/gossip.md has the figures):

1. publish: the owner pushes its new version at once to `fanout` peers (to
   `urgent_fanout` for an urgent one), as a delta when it has a previous version, and
   queues an announcement: 8 bytes (node key, the version's low bits), 14 with status and
   incarnation for liveness news (wire.py, broadcasts.py).
2. rounds: every interval_ms, to `fanout` random live peers, compound datagrams of queued
   announcements, the node's own first, then least-sent first; each is sent at most
   RetransmitMult * ceil(log10(N + 1)) times by each node that has the content. A peer
   contacted by a round answers with its own queued announcements (push-pull rumour
   mongering), which spreads news twice as fast for the same number of sends.
3. pull: a node hearing of a version newer than the one it holds asks the announcer for
   it (then the others that announced it, in turn, while unanswered: pulls.py), giving
   the version it has; the answer is a delta from that version when the
   announcer can make one, else the full snapshot. So content crosses each link about
   once, and only announcements are repeated.
4. urgent versions are relayed on first receipt, not at the next round.
5. push-pull: now and then a node sends a random live peer its whole table as
   announcements and gets the peer's in return (the same on join with the seeds, and now
   and then with a dead peer, which heals partitions).

Liveness is SWIM's (gossip/probes.py): each period a node pings one peer, asks others to
ping it when it does not answer, and suspects it when no one got an answer. Suspicions
travel in the announcements (a status beside the version) and time out into deaths
(gossip/suspicion.py) unless the suspect refutes them: it hears of them from the gossip
and from the pings of those who suspect it, and answers with an incarnation only it can
make (gossip/membership.py). A node stalled itself (a tick far later than asked
for) pushes its own timers back instead of judging peers by time it did not see.

Against a hostile network (docs/gossip.md, Security): a datagram is acted on only when
its source address is proven (gossip/cookies.py) and its seq is fresh and new
(gossip/replay.py); anything else gets at most a cookie no larger than itself. Versions
beyond what a clock could have produced are refused; a version announced but never
served is forgotten when its pulls give up; a node's own datagrams keep it alive whatever
key its peers hold for it; and a node that hears of a version of itself above its own
asks its owner (the daemon) to publish above it.
"""

from __future__ import annotations

import functools
import os
import random
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import filterfalse
from typing import Protocol

from loadmesh.gossip import wire
from loadmesh.gossip.broadcasts import BroadcastQueue
from loadmesh.gossip.codec import ContentCodec
from loadmesh.gossip.config import GossipParams
from loadmesh.gossip.cookies import AddressCookies, PeerTokens
from loadmesh.gossip.deadlines import Deadlines
from loadmesh.gossip.delta import DeltaError
from loadmesh.gossip.keyring import Keyring
from loadmesh.gossip.membership import Addr, Peer, PeerState, PeerTable
from loadmesh.gossip.pulls import PullTracker
from loadmesh.gossip.ratelimit import SourceLimiter, TokenBucket, source_key
from loadmesh.gossip.replay import ReplayGuard
from loadmesh.gossip.snapshot import LoadSnapshot, SnapshotError, encode
from loadmesh.gossip.probes import Delivery, LocalHealth, Probe, ProbeOrder, Relay, Relays
from loadmesh.gossip.suspicion import Suspicions
from loadmesh.gossip.wire import DeltaRecord, FullRecord, Kind, WireError

Outgoing = list[tuple[Addr, bytes]]

# Keys of node ids seen: the same few thousand ids arrive again and again.
node_key = functools.lru_cache(maxsize=65_536)(wire.node_key)

# The bytes sent, by what they are for, by the kind byte of the header: the bench
# splits the bytes so.
_SENT_BY_KIND = {int(kind): "bytes_sent_" + purpose for kind, purpose in (
    (Kind.GOSSIP, "announcements"), (Kind.SYNC, "syncs"), (Kind.PULL, "pulls"),
    (Kind.CONTENT, "content"), (Kind.COOKIE, "cookies"), (Kind.PING, "liveness"),
    (Kind.ACK, "liveness"), (Kind.PING_REQ, "liveness"))}
# Counters that exist from the start, so that a scrape sees zeros rather than gaps.
_BASE_COUNTERS = (
    "datagrams_sent", "bytes_sent", "datagrams_received", "bytes_received", "records_stored",
    "pulls_sent", "urgent_relays", "syncs_sent", "cookies_sent", "resent", "pings_sent",
    "acks_sent", "ping_reqs_sent", "nacks_sent", "suspicions", "refutations", "deaths_declared",
    "stalls", *_SENT_BY_KIND.values(),
)
# A status as an announcement's last field carries it, above the incarnation.
_SUSPECT, _ACCUSED, _DEAD = (status << wire.STATUS_SHIFT for status in (
    wire.STATUS_SUSPECT, wire.STATUS_ACCUSED, wire.STATUS_DEAD))
# Deaths and refutations are sent this many times the retransmit limit: a node that
# misses a death holds the dead node as a suspect until its own suspicion runs out, up to
# suspicion_max_mult times longer, and one that misses a refutation may declare a live
# node dead. Both are rare (refutations are a lossy network's), so the bytes are little.
_VERDICT_REPEATS = 3
# The node key of a short announcement (wire.short_code), as a C-level callable for map().
_SHORT_KEY = wire.SHORT_BITS.__rrshift__
# How many nodes, of all those that hear of a suspicion, probe the suspect at once.
_CHECKERS = 4
# How many times a node that only heard of a suspicion probes the suspect itself before
# it may declare it dead: each probe (straight and through indirect_checks others) fails
# with p = 0.07 at 20% loss each way, three with 3e-4.
_CHECKS = 3
# The accuser of a suspicion heard second hand (node keys are hashes: none is 0).
_SOMEONE = 0
# At most this many datagrams kept to send again when a new address answers with a
# cookie: first contacts only, so a few per peer joining at once.
_MAX_PENDING = 256


class Observer(Protocol):
    """What the simulator (or a curious caller) hears about the table as it changes."""

    def content(self, key: int, old_version: int, new_version: int, now_ms: int) -> None: ...

    def state(self, peer: Peer, old: PeerState | None, new: PeerState | None, now_ms: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PeerView:
    snapshot: LoadSnapshot
    state: PeerState
    age_ms: int
    # When the node started, or last refuted a suspicion of itself (its incarnation), in
    # ms of its wall clock; 0 where not known.
    started_ms: int = 0


@dataclass(frozen=True, slots=True)
class TableMark:
    """Where a reader of the table stands (GossipCore.snapshots_since)."""

    changes: int
    removals: int
    own: int


@dataclass(frozen=True, slots=True)
class PeerRow:
    """A node as peers() lists it: the newest version it is known to have published,
    how long since this node last had news of it (age_ms), and where datagrams to it go.
    Data, not text: the daemon's API and the CLI format it."""

    node_id: str
    state: PeerState
    version: int
    age_ms: int
    addr: Addr


class GossipCore:
    def __init__(
        self,
        node_id: str,
        advertise: Addr,
        params: GossipParams,
        keyring: Keyring | None = None,
        *,
        rng: random.Random | None = None,
        codec: ContentCodec | None = None,
        observer: Observer | None = None,
        wall_offset_ms: int = 0,
    ) -> None:
        self.node_id = node_id
        self.key = node_key(node_id)
        self.advertise = advertise
        self.params = params
        self.keyring = keyring
        self.rng = rng or random.Random()
        # Cookie secrets must be unguessable; a seeded rng (simulator, tests) keeps runs
        # repeatable instead.
        secret = rng.randbytes if rng is not None else os.urandom
        self.codec = codec or ContentCodec()
        self.observer = observer
        # Wall clock = monotonic now + this; the driver keeps it current. Used for what
        # peers' clocks stamp: seqs, snapshot times, and the versions they may publish.
        self.wall_offset_ms = wall_offset_ms
        self.table = PeerTable(params.max_peers, self._on_state, params.max_table_bytes, params.anchors_per_source)
        self.queue = BroadcastQueue()
        self.limiter = SourceLimiter(params.rate_per_source, params.rate_burst, params.max_sources)
        self.cookies = AddressCookies(secret, params.cookie_epoch_ms, params.max_sources)
        self.tokens = PeerTokens(params.cookie_epoch_ms, params.max_sources, _MAX_PENDING)
        self.replay = ReplayGuard(params.max_clock_skew_ms * 1000, params.max_sources)
        self._seq = 0
        # The highest version of this node that peers hold (0: none above its own): the
        # daemon publishes above it (a previous incarnation's, or a forged one).
        self.newest_own_seen = 0
        self._relay_budget = TokenBucket(params.urgent_relays_per_s, 2 * params.urgent_relays_per_s)
        self._limit_for = -1
        self._limit = 0  # retransmit limit of an announcement, for the mesh's size and loss
        self._known_limit = 0  # contacts that hold an announced version before it stops (known_limit)
        self.counts: Counter[str] = Counter({name: 0 for name in _BASE_COUNTERS})
        self.pulls = PullTracker(params.pull_timeout_ms, params.pull_retries, params.max_peers)
        # SWIM: this period's probe, the order of the next ones, pings made for others,
        # suspicions running, and how far this node trusts its own verdicts.
        self.probe: Probe | None = None
        self._probe_order = ProbeOrder(self.rng)
        self._probe_seq = 0
        self._next_probe = 0
        self.relays = Relays()
        self.suspicions = Suspicions()
        self.health = LocalHealth(params.health_max)
        self.delivery = Delivery()  # the probes' round trips: more copies of news under loss
        # Suspects this node accused: when it probes each again (saying it is suspected,
        # directly and through others) while the suspicion runs, and the seq of the last
        # such probe. A refutation lost on the way back to an accuser would otherwise let
        # it declare a live node dead.
        self._rechecks: Deadlines[int] = Deadlines()
        self._recheck_seq: dict[int, int] = {}  # suspect -> seq of its last recheck
        self._recheck_of: dict[int, int] = {}  # and back
        self._refuted_at = -params.probe_interval_ms
        # The deadline last given to the driver: a call much later means this node stalled.
        self._due: int | None = None
        self._seeds: list[Addr] = []
        self._entry_cap = wire.entry_capacity(params.max_datagram)
        self._entry_room = wire.entry_room(params.max_datagram)
        # This node's own snapshot, and the one before it (for deltas).
        self._own: LoadSnapshot | None = None
        self._own_content = b""
        self._own_urgent = False
        self._own_prev_version = -1
        self._own_delta: bytes | None = None
        self._own_inc = 0
        self._own_changes = 0
        self._own_moved_at = 0
        self._now: int | None = None
        self._next_round = self._next_push_pull = self._next_dead_sync = self._next_join = 0

    # --- clock and timers --------------------------------------------------------------------

    def _clock(self, now: int) -> int:
        if self._now is None:
            p = self.params
            # A random phase, so that nodes started together do not gossip in step.
            self._next_round = now + int(self.rng.uniform(0, p.interval_ms))
            self._next_probe = now + int(self.rng.uniform(0, p.probe_interval_ms))
            self._next_push_pull = now + int(p.push_pull_interval_ms * self.rng.uniform(0.5, 1.5))
            self._next_dead_sync = now + p.dead_sync_interval_ms
            self._next_join = now + p.join_retry_ms
        elif now < self._now:
            now = self._now  # a driver's clock must not go back; the table relies on it
        elif self._due is not None and now > self._due + self.params.stall_ms:
            self._stalled(now - self._due)
        self._due = None
        self._now = now
        return now

    def _stalled(self, ms: int) -> None:
        """This node was not run for `ms` when it had something to do (a stalled event
        loop, a starved process). Answers to its probes and refutations of its suspicions
        may be waiting unread in its socket: its own timers move on by the stall, rather
        than count time it did not see against its peers, and it trusts itself less."""
        self.counts["stalls"] += 1
        self.health.change(1)
        self.suspicions.postpone(ms)
        self.relays.postpone(ms)
        self._rechecks.shift(ms)
        self._next_probe += ms
        probe = self.probe
        if probe is not None:
            probe.indirect_at += ms
            probe.ends_at += ms

    def next_deadline(self) -> int:
        """When on_tick next has something to do (ms, the driver's clock)."""
        t = min(self._next_round, self._next_push_pull, self._next_dead_sync)
        probe = self.probe
        if probe is None:
            t = min(t, self._next_probe)
        else:
            t = min(t, probe.ends_at if probe.acked or probe.helpers else probe.indirect_at)
        for other in (self.table.next_deadline(self.params.reap_after_ms), self.pulls.next_deadline(),
                      self.suspicions.next_deadline(), self.relays.next_deadline(), self._rechecks.next()):
            if other is not None and other < t:
                t = other
        if self._seeds and self._next_join < t and self.table.live_count == 0:
            t = self._next_join
        self._due = t
        return t

    def on_tick(self, now_ms: int) -> Outgoing:
        now = self._clock(now_ms)
        p = self.params
        self.table.sweep(now, p.reap_after_ms)
        out: Outgoing = []
        again: dict[Addr, list[wire.Want]] = {}
        due, abandoned = self.pulls.due(now)
        for addr, key, have, version in due:
            again.setdefault(addr, []).append((key, have, version))
        for key in abandoned:
            # Nobody served the version announced: forget it, so that the key does not
            # stand above every real version (one datagram could otherwise wedge a node)
            # and the next announcement of it starts a pull again.
            peer = self.table.get(key)
            if peer is not None and self.table.rewind_version(peer):
                self.counts["keys_rewound"] += 1
        for addr, wants in again.items():
            self.counts["pull_retries"] += len(wants)
            out += self._pull(addr, wants)
        out += self._probing(now)
        for key in self._rechecks.due(now):
            peer = self.table.get(key)
            if peer is not None and peer.state is PeerState.SUSPECT:
                out += self._recheck(peer, now)
        for relay in self.relays.due(now):
            out += self._nack(relay.requester, relay.seq)
        for key, accusers in self.suspicions.due(now):
            out += self._suspicion_ran_out(key, accusers, now)
        if now >= self._next_round:
            self._next_round = now + int(p.interval_ms * self.rng.uniform(1 - p.jitter, 1 + p.jitter))
            out += self._round()
        if now >= self._next_push_pull:
            self._next_push_pull = now + p.push_pull_ms(self.table.live_count + 1)
            targets = self.table.sample_live(1, self.rng)
            if targets:
                out += self._digest(targets[0].gossip_addr, reply=True)
        if now >= self._next_dead_sync:
            self._next_dead_sync = now + p.dead_sync_interval_ms
            peer = self.table.random_dead(self.rng)
            if peer is not None:
                out += self._digest(peer.gossip_addr, reply=True)
        if self._seeds and self.table.live_count == 0 and now >= self._next_join:
            out += self._join_seeds(now)
        return out

    # --- SWIM: probing, suspicion, refutation --------------------------------------------

    def _probing(self, now: int) -> Outgoing:
        """This period's probe: ask helpers when the target is slow, judge it at the
        period's end, then start the next period's."""
        out: Outgoing = []
        probe = self.probe
        if probe is not None:
            if not probe.acked and not probe.helpers and now >= probe.indirect_at:
                probe.helpers, asked = self._ask_helpers(probe.target, probe.seq)
                out += asked
                if not probe.helpers:
                    probe.indirect_at = probe.ends_at  # nobody to ask: wait for the verdict
            if now >= probe.ends_at:
                self.probe = None
                out += self._verdict(probe, now)
        if self.probe is None and now >= self._next_probe:
            out += self._start_probe(now)
        return out

    def _start_probe(self, now: int) -> Outgoing:
        p, health = self.params, self.health
        self._next_probe = now + health.scale(p.probe_interval_ms)
        get = self.table.get
        key = self._probe_order.next(self.table.live_keys,
                                     lambda k: (peer := get(k)) is not None and peer.state is not PeerState.DEAD)
        if key is None:
            return []
        peer = get(key)
        assert peer is not None
        seq = self._new_probe_seq()
        self.probe = Probe(key, seq, now, now + health.scale(p.probe_timeout_ms), self._next_probe)
        return self._ping(peer, seq)

    def _new_probe_seq(self) -> int:
        self._probe_seq = (self._probe_seq + 1) & wire.MAX_U32
        return self._probe_seq

    def _ping(self, peer: Peer, seq: int) -> Outgoing:
        """A ping; one to a peer this node suspects says so (Lifeguard's buddy system), so
        that a live suspect learns of it at once and refutes."""
        flags = wire.FLAG_SUSPECTED if peer.state is PeerState.SUSPECT else 0
        self.counts["pings_sent"] += 1
        addr = peer.gossip_addr
        return self._count_sent([(addr, self._seal(Kind.PING, addr, wire.pack_ping(seq), flags))])

    def _ask_helpers(self, target: int, seq: int) -> tuple[int, Outgoing]:
        """Ping-reqs about `target` to up to indirect_checks live peers: how many, and
        the datagrams."""
        helpers = [peer for peer in self.table.sample_live(self.params.indirect_checks + 1, self.rng)
                   if peer.key != target][:self.params.indirect_checks]
        body = wire.pack_ping_req(seq, target)
        self.counts["ping_reqs_sent"] += len(helpers)
        return len(helpers), self._count_sent([(peer.gossip_addr, self._seal(Kind.PING_REQ, peer.gossip_addr, body))
                                               for peer in helpers])

    def _verdict(self, probe: Probe, now: int) -> Outgoing:
        health = self.health
        if probe.acked:
            health.change(-1)
            self.delivery.add(probe.direct)
            if self._limit_for > 0:
                self._set_limit(self._limit_for)
            return []
        # Helpers that did not even nack: this node's own network or CPU is the likelier
        # culprit (Lifeguard); with no helper to ask, the failure counts once.
        health.change(probe.helpers - probe.nacks if probe.helpers else 1)
        peer = self.table.get(probe.target)
        if peer is None or peer.state is PeerState.DEAD:
            return []
        return self._accuse(peer, now)

    def _accuse(self, peer: Peer, now: int) -> Outgoing:
        """This node could not reach `peer`, directly or through others: it suspects it
        (or corroborates a suspicion already running), says so in its announcements, and
        tells the suspect itself, which may be alive and able to refute."""
        if self.table.suspect(peer, now):
            self._start_suspicion(peer.key, self.key, now)
        else:
            # Corroborating a suspicion heard of may shorten it to nothing: this node still
            # probes the suspect itself twice before it may declare it dead, so that one
            # failed probe and a stale rumour cannot together kill a live node.
            if self.suspicions.confirm(peer.key, self.key):
                self.suspicions.hold(peer.key, now + 2 * self.health.scale(self.params.probe_interval_ms) + 1)
        self._rechecks.set(peer.key, now + self.health.scale(self.params.probe_interval_ms))
        entry = (peer.key, peer.version, peer.incarnation | _ACCUSED)
        self._announce(*entry)
        return self._entry_to([peer.gossip_addr], entry)

    def _start_suspicion(self, key: int, accuser: int, now: int) -> None:
        self.counts["suspicions"] += 1
        shortest, longest, expected = self.params.suspicion_ms(self.table.live_count + 1)
        self.suspicions.start(key, accuser, now, shortest, longest, expected)

    def _suspicion_ran_out(self, key: int, accusers: set[int], now: int) -> Outgoing:
        """Only a node that failed to reach the suspect itself declares it dead: the
        suspect refutes to whoever tells it of a suspicion, first of all its accusers,
        while a suspicion only heard of may outrun the refutation on a lossy network. A
        node that only heard of it probes the suspect itself (saying it is suspected,
        straight and through others) _CHECKS times, a period apart; no answer makes it an
        accuser."""
        peer = self.table.get(key)
        if peer is None or peer.state is not PeerState.SUSPECT:
            return []
        if self.key in accusers:
            return self._declare_dead(key, now)
        wait = _CHECKS * self.health.scale(self.params.probe_interval_ms) + 1
        self.suspicions.start(key, self.key, now, wait, wait, 0)
        return self._recheck(peer, now)

    def _recheck(self, peer: Peer, now: int) -> Outgoing:
        """Probe a suspect again, straight and through `indirect_checks` others at once,
        saying it is suspected; due again a period later while it stays suspect."""
        self._recheck_of.pop(self._recheck_seq.get(peer.key, 0), None)
        seq = self._new_probe_seq()
        self._rechecks.set(peer.key, now + self.health.scale(self.params.probe_interval_ms))
        self._recheck_seq[peer.key] = seq
        self._recheck_of[seq] = peer.key
        return self._ping(peer, seq) + self._ask_helpers(peer.key, seq)[1]

    def _declare_dead(self, key: int, now: int) -> Outgoing:
        """A suspicion ran out unrefuted: dead, and the news pushed at once."""
        peer = self.table.get(key)
        if peer is None or not self.table.bury(peer, now):
            return []
        self.counts["deaths_declared"] += 1
        entry = (key, peer.version, peer.incarnation | _DEAD)
        self._announce(*entry, _VERDICT_REPEATS)
        return self._push_entry(entry, self.params.urgent_fanout)

    def _hear_status(self, peer: Peer, status: int, sender: int, now: int, out: Outgoing) -> None:
        """A peer's status as another node holds it, under the incarnation this node
        holds. A death is relayed on first receipt, like an urgent version: routing
        must stop sending to the dead node everywhere at once."""
        if status == wire.STATUS_DEAD:
            if self.table.bury(peer, now):
                entry = (peer.key, peer.version, peer.incarnation | _DEAD)
                self._announce(*entry, _VERDICT_REPEATS)
                if self._relay_budget.take(now):
                    out += self._push_entry(entry, self.params.urgent_fanout)
            return
        if self.table.suspect(peer, now):
            # A relayed suspicion names no accuser, but someone other than this node
            # made it: it counts as one, so that this node's own failed probe corroborates it.
            self._start_suspicion(peer.key, sender if status == wire.STATUS_ACCUSED else _SOMEONE, now)
            # A few of the nodes that hear of it check for themselves at once: a death is
            # corroborated within a period, a live suspect hears of it from their pings.
            # Not all of them: every suspicion would push back every node's round.
            if self.rng.random() * (self.table.live_count + 1) < _CHECKERS:
                self._probe_order.next_up(peer.key)
            self._announce(peer.key, peer.version, peer.incarnation | _SUSPECT)
        elif status == wire.STATUS_ACCUSED and peer.state is PeerState.SUSPECT:
            self.suspicions.confirm(peer.key, sender)

    def _incarnation_now(self, now: int) -> int:
        return (now + self.wall_offset_ms - wire.INCARNATION_EPOCH_MS) // 1000

    def _refute(self, accused: int, teller: Addr, now: int) -> Outgoing:
        """`teller` holds this node suspect or dead under incarnation `accused`: a greater
        one, announced, pushed at once to urgent_fanout peers and to the teller (at most
        once a probe period: one refutation answers every suspicion of the incarnation
        it replaces; a teller still behind it gets the current one alone)."""
        own = self._own
        if own is None:
            return []
        if accused >= self._own_inc and now - self._refuted_at >= self.params.probe_interval_ms:
            self._refuted_at = now
            self.counts["refutations"] += 1
            self.health.change(1)
            self._own_inc = min(max(accused + 1, self._incarnation_now(now)), wire.INCARNATION_MAX)
            self._own_moved_at = now
            entry = (self.key, own.version, self._own_inc)
            self._announce(*entry, _VERDICT_REPEATS, full=True)
            out = self._push_entry(entry, self.params.urgent_fanout)
        else:
            entry, out = (self.key, own.version, self._own_inc), []
        if all(addr != teller for addr, _ in out):
            out += self._entry_to([teller], entry)
        return out

    def _push_entry(self, entry: tuple[int, int, int], fanout: int) -> Outgoing:
        return self._entry_to([peer.gossip_addr for peer in self.table.sample_live(fanout, self.rng)], entry)

    def _entry_to(self, addrs: list[Addr], entry: tuple[int, int, int]) -> Outgoing:
        """One announcement, alone in a gossip datagram to each of `addrs`, now."""
        body = wire.pack_entries([entry])
        return self._count_sent([(addr, self._seal(Kind.GOSSIP, addr, body)) for addr in addrs])

    def _on_ping(self, dg: wire.Datagram, addr: Addr, now: int) -> Outgoing:
        own = self._own
        if own is None:
            return []  # nothing published yet: no peer holds this node to probe it
        # The ack below carries the refuting incarnation to the pinger.
        out = self._refute(self._own_inc, addr, now) if dg.flags & wire.FLAG_SUSPECTED else []
        self.counts["acks_sent"] += 1
        body = wire.pack_ack(wire.unpack_ping(dg.body), (self.key, own.version, self._own_inc))
        return out + self._count_sent([(addr, self._seal(Kind.ACK, addr, body))])

    def _on_ping_req(self, dg: wire.Datagram, addr: Addr, now: int) -> Outgoing:
        """Ping `target` for the sender; its ack goes back to the sender, or a nack when
        none comes within a probe timeout."""
        seq, target = wire.unpack_ping_req(dg.body)
        peer = self.table.get(target)
        if peer is None or peer.state is PeerState.DEAD:
            return self._nack(addr, seq)
        mine = self._new_probe_seq()
        if not self.relays.add(mine, Relay(addr, seq, target, now + self.params.probe_timeout_ms)):
            return self._drop("relays_full")
        return self._ping(peer, mine)

    def _nack(self, requester: Addr, seq: int) -> Outgoing:
        """The answer to a ping-req whose target did not answer (or is not held here)."""
        self.counts["nacks_sent"] += 1
        return self._count_sent([(requester, self._seal(Kind.ACK, requester, wire.pack_ack(seq, None),
                                                        wire.FLAG_NACK))])

    def _on_ack(self, dg: wire.Datagram, addr: Addr, now: int) -> Outgoing:
        seq, entry = wire.unpack_ack(dg.body)
        probe = self.probe
        if probe is not None and seq == probe.seq:
            if entry is None:
                if dg.flags & wire.FLAG_NACK:
                    probe.nacks += 1
                return []
            if entry[0] != probe.target:
                return self._drop("unexpected_ack")
            if dg.sender == probe.target and now < probe.indirect_at:
                probe.direct = True
            probe.acked = True
            return self._heard_from_probe(entry, dg.sender, addr, now)
        suspect = self._recheck_of.get(seq)
        if suspect is not None:
            if entry is None or entry[0] != suspect:
                return []  # a helper's nack: the next recheck may do better
            return self._heard_from_probe(entry, dg.sender, addr, now)
        relay = self.relays.take(seq) if entry is not None else None
        if relay is None or entry is None or entry[0] != relay.target or dg.sender != relay.target:
            if relay is not None:
                self.relays.add(seq, relay)  # not the target's answer: keep waiting for it
            return self._drop("unexpected_ack")
        # The target answered the ping made for another node: pass its answer on.
        self.counts["acks_sent"] += 1
        out = self._count_sent([(relay.requester, self._seal(
            Kind.ACK, relay.requester, wire.pack_ack(relay.seq, entry)))])
        return out + self._heard_from_probe(entry, dg.sender, addr, now)

    def _heard_from_probe(self, entry: tuple[int, int, int], sender: int, addr: Addr, now: int) -> Outgoing:
        """A probed node's own announcement, straight from it or through a helper: alive
        now, and a version to pull if it is ahead."""
        key, version, raw = entry
        peer = self.table.get(key)
        out: Outgoing = []
        # A version it is ahead by is pulled from it, not from a helper that relayed it.
        src = peer.gossip_addr if peer is not None else addr
        wants = self._absorb(([(key, version, raw & wire.INCARNATION_MAX)], ()), sender, src, now, out)
        if peer is not None and peer.state is not PeerState.ALIVE:
            self.table.touch(peer, now)
        return self._pull(src, wants) + out

    # --- what the owner does ---------------------------------------------------------------

    def publish(self, snapshot: LoadSnapshot, urgent: bool, now_ms: int) -> Outgoing:
        """Make `snapshot` this node's own; the datagrams that push it at once.

        The version must not go back. The same version again, with the same content,
        changes nothing."""
        now = self._clock(now_ms)
        if snapshot.node_id != self.node_id:
            raise ValueError(f"snapshot of {snapshot.node_id!r} published by {self.node_id!r}")
        if snapshot.version == 0:
            # On the wire a pull for version 0 means "I hold nothing".
            raise ValueError("versions start at 1")
        own = self._own
        if own is not None and snapshot.version <= own.version:
            if snapshot.version < own.version:
                raise ValueError(f"version went back: {own.version} -> {snapshot.version}")
            if replace(snapshot, timestamp_ms=own.timestamp_ms) != own or snapshot.timestamp_ms < own.timestamp_ms:
                raise ValueError(f"version {own.version} published twice with different content")
            return []
        content = encode(snapshot)
        if own is not None:
            self._own_prev_version = own.version
            self._own_delta = self.codec.diff(self._own_content, content)
        self._own, self._own_content, self._own_urgent = snapshot, content, urgent
        self._own_changes += 1
        if self._own_inc == 0:
            # Above any incarnation of a previous run of this node (the clock moved on).
            self._own_inc = min(self._incarnation_now(now), wire.INCARNATION_MAX)
        self._own_moved_at = now
        self._announce(self.key, snapshot.version, self._own_inc)
        fanout = self.params.urgent_fanout if urgent else self.params.fanout
        targets = [peer.gossip_addr for peer in self.table.sample_live(fanout, self.rng)]
        record = self._own_record(self._own_prev_version)
        return self._content_to(targets, [record]) if record else []

    def _announce(self, key: int, version: int, tail: int, repeats: int = 1, full: bool = False) -> None:
        """Queue (key, version, status << 30 | incarnation) for the rounds, to be sent
        `retransmit_limit` times (`repeats` times that): in full when it is liveness news
        (a status, or `full`: a new incarnation), else short (broadcasts.py)."""
        n = self.table.live_count + 1
        if n != self._limit_for:
            self._set_limit(n)
        self.queue.put(key, version, tail, self._limit * repeats, full or tail >> wire.STATUS_SHIFT != 0)

    def _set_limit(self, nodes: int) -> None:
        """The retransmit limit for a mesh of `nodes`, at the loss the probes measure now."""
        self._limit_for = nodes
        self._limit = self.params.retransmit_limit(nodes, self.delivery.ratio)
        self._known_limit = self.params.known_limit(self.delivery.ratio)

    def _own_record(self, have: int) -> bytes | None:
        own = self._own
        if own is None or own.version <= have:
            return None
        flags = wire.RECORD_URGENT if self._own_urgent else 0
        if have == self._own_prev_version and self._own_delta is not None:
            delta = wire.pack_delta(flags, self.key, have, own.version, self._own_inc,
                                    zlib.crc32(self._own_content), self._own_delta)
            if delta is not None:
                return delta
        return wire.pack_full(flags, self._own_inc, self.advertise, self._own_content)

    # --- joining -------------------------------------------------------------------------

    def join(self, seeds: Sequence[Addr], now_ms: int, remember: bool = True) -> Outgoing:
        """Exchange full state with `seeds` now. Remembered seeds are tried again every
        join_retry_ms for as long as no peer is alive."""
        self._clock(now_ms)  # starts the timers on a first call
        if remember:
            self._seeds += [s for s in seeds if s not in self._seeds]
        return self._sync_all(seeds)

    def set_seeds(self, seeds: Sequence[Addr]) -> None:
        """The seeds to retry (after a new resolution of their names), without joining now."""
        self._seeds = list(seeds)

    def _join_seeds(self, now: int) -> Outgoing:
        self._next_join = now + self.params.join_retry_ms
        return self._sync_all(self._seeds)

    def _sync_all(self, addrs: Sequence[Addr]) -> Outgoing:
        out: Outgoing = []
        for addr in addrs:
            if addr != self.advertise:
                out += self._digest(addr, reply=True)
        return out

    # --- receiving -----------------------------------------------------------------------

    def on_datagram(self, data: bytes, addr: Addr, now_ms: int) -> Outgoing:
        now = self._clock(now_ms)
        counts = self.counts
        counts["datagrams_received"] += 1
        counts["bytes_received"] += len(data)
        if not self.limiter.allow(source_key(addr), now):
            return self._drop("rate_limited")
        try:
            dg = wire.open_datagram(data, self.keyring, self.params.max_datagram)
            if dg.sender == self.key:
                # Our own key from elsewhere: a looped datagram or a second node with our id.
                return self._drop("own_node_id")
            now_us = (now + self.wall_offset_ms) * 1000
            seq = wire.unserial_seq(dg.seq, now_us)
            if self.replay.stale(seq, now_us):
                return self._drop("stale")
            proven = self.cookies.valid(addr, dg.echo, now)
            self.tokens.learn(addr, dg.token, proven, now)
            if not proven:
                # Never answer a cookie with a cookie: two nodes would bounce them forever.
                return self._drop("unproven_cookie") if dg.kind is Kind.COOKIE else self._cookie(addr, len(data))
            if not self.replay.first_time((dg.sender, addr), seq):
                return self._drop("replayed")
            if dg.kind is Kind.COOKIE:
                return self._resend(addr)
            peer = self.table.get(dg.sender)
            if peer is not None:
                # A proven, fresh datagram from the node itself: it is alive and
                # receives here, whatever key its peers hold for it; and it answers
                # this period's probe of it, whatever kind it is.
                peer.observed = addr
                self.table.touch(peer, now)
                self.table.anchor(peer, source_key(addr))
                if self.probe is not None and self.probe.target == dg.sender:
                    self.probe.acked = True
            kind = dg.kind
            if kind is Kind.GOSSIP:
                return self._on_gossip(dg, addr, now)
            if kind is Kind.SYNC:
                return self._on_sync(dg, addr, now)
            if kind is Kind.PULL:
                return self._serve(dg.body, addr)
            if kind is Kind.PING:
                return self._on_ping(dg, addr, now)
            if kind is Kind.ACK:
                return self._on_ack(dg, addr, now)
            if kind is Kind.PING_REQ:
                return self._on_ping_req(dg, addr, now)
            return self._on_content(dg, len(data), addr, now)
        except WireError as e:
            return self._drop(e.reason)

    def _cookie(self, addr: Addr, size: int) -> Outgoing:
        """The answer to a datagram from an address not proven: a token to echo, no
        larger than the datagram itself, and nothing else."""
        self.counts["unproven_source"] += 1
        cookie = self._seal(Kind.COOKIE, addr, b"")
        if len(cookie) > size:
            return []
        self.counts["cookies_sent"] += 1
        return self._count_sent([(addr, cookie)])

    def _resend(self, addr: Addr) -> Outgoing:
        """`addr` proved itself with a cookie: what it refused goes again, now echoing."""
        pending = self.tokens.take_pending(addr)
        self.counts["resent"] += len(pending)
        return self._count_sent([(addr, self._seal(Kind(kind), addr, body, flags)) for kind, flags, body in pending])

    def _drop(self, reason: str) -> Outgoing:
        self.counts["drop_" + reason] += 1
        return []

    def _held(self, key: int) -> tuple[int, int] | None:
        """The version and incarnation of `key` this node holds (its own too); None for
        a node unknown."""
        if key == self.key:
            return (self._own.version, self._own_inc) if self._own is not None else None
        peer = self.table.get(key)
        return (peer.version, peer.incarnation) if peer is not None else None

    def _on_gossip(self, dg: wire.Datagram, addr: Addr, now: int) -> Outgoing:
        body, asked = wire.split_gossip(dg.body, dg.flags)
        entries = wire.unpack_entries(body)
        out: Outgoing = self._serve(asked, addr) if asked else []
        wants = self._absorb(entries, dg.sender, addr, now, out)
        if not dg.flags & wire.FLAG_REPLY:
            return self._pull(addr, wants) + out
        # Push-pull rumour mongering: answer a round's contact with this node's own queued
        # news, less what the contact just sent. Each entry still goes out at most `limit`
        # times, only sooner, so the news spreads about twice as fast for the same bytes,
        # and the last nodes to hear it are found by pull rather than by chance. What this
        # node pulls of the contact's news rides in the reply: 46% of all pulls at 100
        # nodes, each a datagram's header and tag less.
        size = sum(map(wire.want_size, wants))
        room = self._entry_room - wire.WANTS_HEAD.size - size
        if size > self._entry_room // 4:
            out = self._pull(addr, wants) + out
            wants, room = [], self._entry_room
        known = self._known_to_sender(entries)
        # This node's own news goes its whole limit: it is where the news starts.
        self.queue.heard_known(known - {self.key}, self._known_limit)
        reply = self.queue.take(room, first=self.key, skip=known)
        if not reply:
            return self._pull(addr, wants) + out
        body, flags = wire.pack_gossip(wire.pack_entries(reply), wire.pack_wants(wants) if wants else b"")
        if wants:
            self.counts["pulls_sent"] += 1
        return self._count_sent([(addr, self._seal(Kind.GOSSIP, addr, body, flags))]) + out

    def _known_to_sender(self, entries: wire.Entries) -> set[int]:
        """Of the nodes this node has news of queued, those whose latest news the sender of
        `entries` already has (a short announcement says nothing of the incarnation: its
        version is enough). Only queued ones matter to the reply, and a gossip datagram at
        1000 nodes names ten times as many nodes as the queue holds."""
        held, mask, unserial, queued = self._held, wire.INCARNATION_MAX, wire.unserial, self.queue.keys()
        full, short = entries
        known = {k for k, s, i in full
                 if k in queued and (h := held(k)) is not None and unserial(s, h[0]) >= h[0] and i & mask >= h[1]}
        if short and queued:
            # The sender's version is the one held, content and all, for nearly all: those
            # are found in C (at 300 nodes, a per-entry look here took 5% of a simulation).
            settled = self.table.settled
            known.update(queued & map(_SHORT_KEY, settled.intersection(short)))
            known.update(k for x in filterfalse(settled.__contains__, short)
                         if (k := x >> wire.SHORT_BITS) in queued and (h := held(k)) is not None
                         and wire.unserial_short(x & 0xFFFF, h[0]) >= h[0])
        return known

    def _absorb(self, entries: wire.Entries, sender: int, addr: Addr, now: int,
                out: Outgoing) -> list[wire.Want]:
        """Take the news in announcements from `sender` (their versions as low bits, read
        against the versions held); the (key, version held, version announced) to pull. A
        refutation of a suspicion of this node goes into `out`."""
        full, short = entries
        wants = self._absorb_short(short, sender, addr, now) if short else []
        table, get, own_key, unserial = self.table, self.table.get, self.key, wire.unserial
        ceiling = self._ceiling(now)
        mask, shift = wire.INCARNATION_MAX, wire.STATUS_SHIFT
        inc_ceiling = self._incarnation_ceiling(now)
        for k, s, raw in full:
            inc, status = raw & mask, raw >> shift
            peer = get(k)
            if peer is not None:
                v = unserial(s, peer.version)
            elif k == own_key and self._own is not None:
                v = unserial(s, self._own.version)
            else:
                v = 0  # a node not held: its version comes with its content
            if v > ceiling or inc > inc_ceiling:
                self.counts["drop_implausible"] += 1
                continue
            if peer is not None:
                held = peer.snapshot.version
                if v <= peer.version and inc <= peer.incarnation:
                    # Old news, by far the most common case. Under a version that ran
                    # ahead of the content (announced, never served), a version above
                    # the content is still worth a pull.
                    if v > held and self.pulls.want(k, v, held, addr, now):
                        wants.append((k, held, v))
                    if status and inc == peer.incarnation:
                        self._hear_status(peer, status, sender, now, out)
                    continue
                was, was_inc = peer.state, peer.incarnation
                table.merge_key(peer, v, inc, now, k == sender)
                if v > held and self.pulls.want(k, v, held, addr, now):
                    wants.append((k, held, v))
                if status:
                    if inc == peer.incarnation:
                        self._hear_status(peer, status, sender, now, out)
                elif was is not PeerState.ALIVE and peer.state is PeerState.ALIVE:
                    # A refutation: spread it, or the rest of the mesh times it out.
                    self._announce(k, peer.version, peer.incarnation, _VERDICT_REPEATS, full=True)
                elif peer.incarnation > was_inc:
                    # A refutation heard of where the node was not suspect: it is liveness
                    # news still, which short announcements of the versions that follow do
                    # not carry. Untold, a node that missed it could declare the node dead
                    # under the incarnation it replaced, and be overruled by it later.
                    self._announce(k, held, peer.incarnation, full=True)
            elif k == own_key:
                self._own_seen(v)
                if status:
                    out += self._refute(inc, addr, now)
                elif inc > self._own_inc:
                    self._own_inc = inc  # a previous run's, in the same second: go on from it
            elif (self._room_for_new(source_key(addr) if k == sender else None)
                  and self.pulls.want(k, 1, 0, addr, now)):
                wants.append((k, 0, 0))
        return wants

    def _absorb_short(self, short: Sequence[int], sender: int, addr: Addr,
                      now: int) -> list[wire.Want]:
        """_absorb for short announcements: versions only, the incarnations held stay.
        Those of a version held with its content, nearly all, are left in one C call."""
        wants: list[wire.Want] = []
        table, get, own_key, unserial = self.table, self.table.get, self.key, wire.unserial_short
        ceiling = self._ceiling(now)
        want = self.pulls.want
        for x in filterfalse(table.settled.__contains__, short):
            k, s = x >> wire.SHORT_BITS, x & 0xFFFF
            peer = get(k)
            if peer is not None:
                pv = peer.version
                if s == pv & 0xFFFF:
                    # The version held: old news, by far the most common case (the pull
                    # is for a version announced whose content has not come).
                    held = peer.snapshot.version
                    if held < pv and want(k, pv, held, addr, now):
                        wants.append((k, held, pv))
                    continue
                v = unserial(s, pv)
                if v > ceiling:
                    self.counts["drop_implausible"] += 1
                    continue
                held = peer.snapshot.version
                if v > pv:
                    table.merge_key(peer, v, peer.incarnation, now, k == sender)
                if v > held and want(k, v, held, addr, now):
                    wants.append((k, held, v))
            elif k == own_key and self._own is not None:
                v = unserial(s, self._own.version)
                if v > ceiling:
                    self.counts["drop_implausible"] += 1
                else:
                    self._own_seen(v)
            elif self._room_for_new(source_key(addr) if k == sender else None) and want(k, 1, 0, addr, now):
                wants.append((k, 0, 0))
        return wants

    def _ceiling(self, now: int) -> int:
        """The highest wall-clock time in ms, and so the highest version (versions start
        at their owner's clock and move by one a change), that a peer whose clock agrees
        with this node's within max_clock_skew_ms could have produced by now."""
        return now + self.wall_offset_ms + self.params.max_clock_skew_ms

    def _incarnation_ceiling(self, now: int) -> int:
        """The highest incarnation (seconds of a clock) a peer whose clock agrees with
        this node's within max_clock_skew_ms could have made by now."""
        return self._incarnation_now(now) + self.params.max_clock_skew_ms // 1000

    def _own_seen(self, version: int) -> None:
        """A peer holds `version` of this node. Above this node's own (a previous
        incarnation whose clock ran ahead, or a forgery), its real versions would lose
        to it everywhere: the owner must publish above it. Implausible versions never
        get here."""
        own = self._own
        if own is not None and version > own.version:
            self.counts["own_newer_seen"] += 1
            self.newest_own_seen = max(self.newest_own_seen, version)

    def _room_for_new(self, anchor: str | None) -> bool:
        """Whether a node not in the table could get in (membership.py: bounds);
        `anchor`: the source of the node's own datagram, if that is what named it."""
        if self.table.may_make_room(anchor):
            return True
        self.counts["drop_table_full"] += 1
        return False

    def _pull(self, addr: Addr, wants: list[wire.Want]) -> Outgoing:
        out: Outgoing = []
        chunk: list[wire.Want] = []
        used = 0
        for want in wants:
            size = wire.want_size(want)
            if used + size > self._entry_room:
                out.append((addr, self._seal(Kind.PULL, addr, wire.pack_wants(chunk))))
                chunk, used = [], 0
            chunk.append(want)
            used += size
        if chunk:
            out.append((addr, self._seal(Kind.PULL, addr, wire.pack_wants(chunk))))
        self.counts["pulls_sent"] += len(out)
        return self._count_sent(out)

    def _serve(self, asked: bytes, addr: Addr) -> Outgoing:
        """The content that answers packed wants (a pull's, or those in a gossip reply)."""
        self.counts["pulls_served"] += 1
        full, short = wire.unpack_wants(asked)
        records = [r for key, have in full if (r := self._record_for(key, have))]
        held, unserial = self._held, wire.unserial_short
        records += [r for key, s in short
                    if (h := held(key)) is not None and (r := self._record_for(key, unserial(s, h[0])))]
        return self._content_to([addr], records)

    def _on_sync(self, dg: wire.Datagram, addr: Addr, now: int) -> Outgoing:
        entries = wire.unpack_entries(dg.body)
        out: Outgoing = []
        # What the sender is behind on, among the nodes it listed (read before the
        # absorb below moves the versions held).
        full, short = entries
        behind = [(k, wire.unserial(s, h[0])) for k, s, _ in full if (h := self._held(k)) is not None]
        behind += [(k, wire.unserial_short(x & 0xFFFF, h[0])) for x in short
                   if (h := self._held(k := x >> wire.SHORT_BITS)) is not None]
        out = self._pull(addr, self._absorb(entries, dg.sender, addr, now, out)) + out
        records = [r for k, v in behind if (r := self._record_for(k, v))]
        out += self._content_to([addr], records)
        if dg.flags & wire.FLAG_REPLY:
            out += self._digest(addr, reply=False)
        return out

    def _on_content(self, dg: wire.Datagram, size: int, addr: Addr, now: int) -> Outgoing:
        records, bad = wire.unpack_content(dg.body)
        if size > self.params.max_datagram and len(records) + len(bad) != 1:
            return self._drop("oversized")
        for reason in bad:
            self.counts["drop_" + reason] += 1
        wants: list[wire.Want] = []
        out: Outgoing = []
        for rec in records:
            if isinstance(rec, FullRecord):
                out += self._absorb_full(rec, dg.sender, addr, now, wants)
            else:
                out += self._absorb_delta(rec, dg.sender, addr, now, wants)
        return self._pull(addr, wants) + out

    def _absorb_full(self, rec: FullRecord, sender: int, addr: Addr, now: int,
                     wants: list[wire.Want]) -> Outgoing:
        try:
            snap = self.codec.snapshot(rec.content)
        except SnapshotError:
            return self._drop("bad_snapshot")
        if snap.version > self._ceiling(now):
            return self._drop("implausible")
        key = node_key(snap.node_id)
        if key == self.key:
            if snap.node_id != self.node_id:
                return self._drop("key_collision")
            self._own_seen(snap.version)
            return []
        peer = self.table.get(key)
        if peer is not None and peer.node_id != snap.node_id:
            return self._drop("key_collision")
        return self._store(key, snap, rec.content, rec.incarnation, rec.addr, rec.flags, None, key == sender, addr, now,
                           wants)

    def _absorb_delta(self, rec: DeltaRecord, sender: int, addr: Addr, now: int,
                      wants: list[wire.Want]) -> Outgoing:
        peer = self.table.get(rec.key)
        if peer is None:
            # No base, and no version to read its low bits against: fetch it in full.
            self.counts["delta_without_base"] += 1
            if (self._room_for_new(source_key(addr) if rec.key == sender else None)
                    and self.pulls.want(rec.key, 1, 0, addr, now)):
                wants.append((rec.key, 0, 0))
            return []
        held = peer.snapshot.version
        version = wire.unserial(rec.serial, held)
        if version <= held:
            return []
        if version > self._ceiling(now):
            return self._drop("implausible")
        if held != version - rec.back:
            # Not applicable here: fetch the version from the sender instead.
            self.counts["delta_without_base"] += 1
            if self.pulls.want(rec.key, version, held, addr, now):
                wants.append((rec.key, held, version))
            return []
        try:
            content = self.codec.apply(peer.content, rec.changes, rec.crc)
            snap = self.codec.snapshot(content)
        except (DeltaError, SnapshotError):
            snap = None
        if snap is None or snap.node_id != peer.node_id or snap.version != version:
            if self.pulls.want(rec.key, version, held, addr, now):
                wants.append((rec.key, held, version))
            return self._drop("bad_delta")
        return self._store(rec.key, snap, content, rec.incarnation, peer.addr, rec.flags, rec.changes, rec.key == sender,
                           addr, now, wants)

    def _store(self, key: int, snap: LoadSnapshot, content: bytes, incarnation: int, owner_addr: Addr,
               flags: int, delta: bytes | None, direct: bool, src: Addr, now: int,
               wants: list[wire.Want]) -> Outgoing:
        ceiling = self._ceiling(now)
        if snap.timestamp_ms > ceiling:
            return self._drop("future")
        if incarnation > self._incarnation_ceiling(now):
            return self._drop("implausible")
        before = self.table.get(key)
        held = before.snapshot.version if before is not None else 0
        inc_before = before.incarnation if before is not None else 0
        anchor = source_key(src) if direct else None
        if before is None and not self._room_for_new(anchor):
            return []
        urgent = bool(flags & wire.RECORD_URGENT)
        peer = self.table.merge_content(key, snap, content, incarnation, owner_addr, urgent, now, delta, direct, anchor)
        if peer is None:
            return []
        self.counts["records_stored"] += 1
        self.pulls.done(key, snap.version)
        if peer.version == snap.version:
            # in full when the record brought a new incarnation: a refutation, for those
            # that hold the node suspect
            self._announce(key, snap.version, peer.incarnation, full=before is not None and peer.incarnation > inc_before)
        elif self.pulls.want(key, peer.version, snap.version, src, now):
            wants.append((key, snap.version, peer.version))
        if self.observer is not None:
            self.observer.content(key, held, snap.version, now)
        if not urgent or not self._relay_budget.take(now):
            return []
        # First receipt of an urgent version: relay it now rather than at the next round.
        self.counts["urgent_relays"] += 1
        record = self._peer_record(peer, held)
        targets = [p.gossip_addr for p in self.table.sample_live(self.params.urgent_fanout + 1, self.rng)
                   if p.key != key and p.gossip_addr != src][:self.params.urgent_fanout]
        return self._content_to(targets, [record])

    # --- answering -----------------------------------------------------------------------

    def _record_for(self, key: int, have: int) -> bytes | None:
        """The record that brings a node holding version `have` of `key` up to date."""
        if key == self.key:
            return self._own_record(have)
        peer = self.table.get(key)
        if peer is None or peer.snapshot.version <= have:
            return None
        return self._peer_record(peer, have)

    def _peer_record(self, peer: Peer, have: int) -> bytes:
        flags = wire.RECORD_URGENT if peer.urgent else 0
        if have == peer.prev_version and have > 0:
            changes = peer.delta or self.codec.diff(peer.prev_content, peer.content)
            if changes is not None:
                delta = wire.pack_delta(flags, peer.key, have, peer.snapshot.version, peer.incarnation,
                                        zlib.crc32(peer.content), changes)
                if delta is not None:
                    return delta
        return wire.pack_full(flags, peer.incarnation, peer.addr, peer.content)

    def _content_to(self, targets: Sequence[Addr], records: list[bytes]) -> Outgoing:
        if not records or not targets:
            return []
        bodies = wire.pack_content(records, self.params.max_datagram)
        return self._count_sent([(addr, self._seal(Kind.CONTENT, addr, body)) for addr in targets for body in bodies])

    def _digest(self, addr: Addr, reply: bool) -> Outgoing:
        """This node's whole table as announcements of what it can serve (sync)."""
        entries = []
        if self._own is not None:
            entries.append((self.key, self._own.version, self._own_inc))
        for peer in self.table:
            if peer.state is not PeerState.DEAD:
                status = _SUSPECT if peer.state is PeerState.SUSPECT else 0
                entries.append((peer.key, peer.snapshot.version, peer.incarnation | status))
        flags = wire.FLAG_REPLY if reply else 0
        cap = self._entry_cap
        # An empty table still sends one (empty) sync: it asks for the peer's digest.
        out = [(addr, self._seal(Kind.SYNC, addr, wire.pack_entries(entries[i:i + cap]), flags))
               for i in range(0, max(len(entries), 1), cap)]
        self.counts["syncs_sent"] += 1
        return self._count_sent(out)

    def _round(self) -> Outgoing:
        out: Outgoing = []
        for peer in self.table.sample_live(self.params.fanout, self.rng):
            flags = wire.FLAG_REPLY
            sent: set[int] = set()  # a peer gets each entry once a round, however many datagrams
            for _ in range(self.params.max_datagrams_per_peer):
                entries = self.queue.take(self._entry_room, first=self.key, skip=sent)
                if not entries:
                    break
                body = wire.pack_entries(entries)
                out.append((peer.gossip_addr, self._seal(Kind.GOSSIP, peer.gossip_addr, body, flags)))
                flags = 0
                if len(body) - wire.ENTRIES_HEAD.size + wire.ENTRY.size <= self._entry_room:
                    break  # not full: the queue had no more
                sent.update(k for k, _, _ in entries)
        return self._count_sent(out)

    def _seal(self, kind: Kind, addr: Addr, body: bytes, flags: int = 0) -> bytes:
        """The datagram for `addr`: a fresh seq, this node's token for that address, and
        the echo of the address's token for this node. A datagram to an address that may
        not know this node yet is kept, to send again if a cookie comes back."""
        assert self._now is not None
        now = self._now
        self._seq = max(self._seq + 1, (now + self.wall_offset_ms) * 1000)
        tokens = self.tokens
        if kind is not Kind.COOKIE and tokens.may_be_refused(addr, now):
            tokens.keep(addr, kind, flags, body)
        return wire.seal(kind, self.key, body, self.keyring, flags, seq=self._seq,
                         token=self.cookies.token(addr, now), echo=tokens.echo(addr))

    def _count_sent(self, out: Outgoing) -> Outgoing:
        counts = self.counts
        counts["datagrams_sent"] += len(out)
        for _, d in out:
            counts["bytes_sent"] += len(d)
            counts[_SENT_BY_KIND[d[wire.KIND_AT]]] += len(d)
        return out

    def _on_state(self, peer: Peer, old: PeerState | None, new: PeerState | None, now: int) -> None:
        if new is not None:
            self.counts["became_" + new.value] += 1
        if old is None:
            self.codec.keep_flats(2 * len(self.table))
        if old is None and len(self.table) == 1:
            # The first peer: this node has just joined. Nodes started with it may not
            # have reached their seeds when the seed answered; one more full exchange,
            # a join retry later, finds them (rather than the push-pull interval).
            self._next_push_pull = min(self._next_push_pull, now + self.params.join_retry_ms)
        if new is None:
            self.pulls.forget(peer.key)
        if new is not PeerState.SUSPECT:
            self.suspicions.clear(peer.key)
            self._rechecks.discard(peer.key)
            self._recheck_of.pop(self._recheck_seq.pop(peer.key, 0), None)
        if new is PeerState.ALIVE and old in (None, PeerState.DEAD):
            self._probe_order.add(peer.key)
        if self.observer is not None:
            self.observer.state(peer, old, new, now)

    # --- reading -------------------------------------------------------------------------

    def set_keyring(self, keyring: Keyring | None) -> None:
        self.keyring = keyring

    def peers(self, now_ms: int) -> list[PeerRow]:
        """Every node this one knows, itself first."""
        now = max(now_ms, self._now or now_ms)
        out: list[PeerRow] = []
        if self._own is not None:
            out.append(PeerRow(self.node_id, PeerState.ALIVE, self._own.version, now - self._own_moved_at,
                               self.advertise))
        out.extend(PeerRow(peer.node_id, peer.state, peer.version, now - peer.fresh_at, peer.gossip_addr)
                   for peer in self.table)
        return out

    def snapshots(self, now_ms: int) -> dict[str, PeerView]:
        """Every snapshot held, this node's own included (always alive, age 0)."""
        return self._views(self.table, True, now_ms)

    def snapshots_since(self, mark: TableMark | None, now_ms: int) -> tuple[TableMark, dict[str, PeerView], bool]:
        """What changed since `mark` (an earlier call's; None: never read): the table's
        mark now, the views of the peers changed since, this node's own among them when
        it changed, and whether those are every view (after a peer was forgotten, which
        no view can say: the reader drops what it holds beyond them)."""
        now_mark = TableMark(self.table.changes, self.table.removals, self._own_changes)
        if mark is None or mark.removals != now_mark.removals:
            return now_mark, self.snapshots(now_ms), True
        peers = self.table.changed_since(mark.changes) if mark.changes != now_mark.changes else []
        return now_mark, self._views(peers, mark.own != now_mark.own, now_ms), False

    def _views(self, peers: Iterable[Peer], own: bool, now_ms: int) -> dict[str, PeerView]:
        now = max(now_ms, self._now or now_ms)
        epoch = wire.INCARNATION_EPOCH_MS
        out = {peer.node_id: PeerView(peer.snapshot, peer.state, now - peer.fresh_at, epoch + peer.incarnation * 1000)
               for peer in peers}
        if own and self._own is not None:
            out[self.node_id] = PeerView(self._own, PeerState.ALIVE, 0, epoch + self._own_inc * 1000)
        return out

    def counters(self) -> dict[str, int]:
        counts = dict(self.counts)
        counts["drop_pulls_full"] = self.pulls.refused
        counts["drop_table_full"] = counts.get("drop_table_full", 0) + self.table.refused
        return counts

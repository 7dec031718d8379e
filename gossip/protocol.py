"""The gossip protocol core, without I/O: datagrams and clock readings in, datagrams out.

Nothing here opens a socket or reads a clock. The agent drives it with a UDP socket and
the monotonic clock (gossip/transport.py); the simulator drives the very same code with
a simulated network and clock (gossip/simulator.py). Every entry point takes `now_ms`
and returns the datagrams to send as (address, bytes).

How news travels (docs/gossip.md has the figures):

1. publish: the owner pushes its new version at once to `fanout` peers (to
   `urgent_fanout` for an urgent one), as a delta when it has a previous version, and
   queues an announcement (node key, version, beat) of 20 bytes.
2. rounds: every interval_ms, to `fanout` random live peers, compound datagrams of queued
   announcements, the node's own first, then least-sent first; each is sent at most
   RetransmitMult * ceil(log10(N + 1)) times by each node that has the content. A peer
   contacted by a round answers with its own queued announcements (push-pull rumour
   mongering), which spreads news twice as fast for the same number of sends.
3. pull: a node hearing of a version newer than the one it holds asks the announcer for
   it, giving the version it has; the answer is a delta from that version when the
   announcer can make one, else the full snapshot. So content crosses each link about
   once, and only announcements are repeated.
4. urgent versions are relayed on first receipt, not at the next round.
5. push-pull: now and then a node sends a random live peer its whole table as
   announcements and gets the peer's in return (the same on join with the seeds, and now
   and then with a dead peer, which heals partitions).

Every node sends each live peer a beat directly, once per beat_interval: its version,
vouched for as of now. Peers judge liveness only by when they received a newer version,
or any datagram from the node itself, by their own clock (a beat relayed by a third node
says nothing about now); a peer that turns suspect is asked directly for a fresh beat
(gossip/suspicion.py), so lost beats do not kill a live node.

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
from typing import Protocol

from loadmesh.gossip import wire
from loadmesh.gossip.broadcasts import BroadcastQueue
from loadmesh.gossip.codec import ContentCodec
from loadmesh.gossip.config import GossipParams
from loadmesh.gossip.cookies import AddressCookies, PeerTokens
from loadmesh.gossip.delta import DeltaError
from loadmesh.gossip.keyring import Keyring
from loadmesh.gossip.membership import Addr, Peer, PeerState, PeerTable
from loadmesh.gossip.pulls import PullTracker
from loadmesh.gossip.ratelimit import SourceLimiter, TokenBucket, source_key
from loadmesh.gossip.replay import ReplayGuard
from loadmesh.gossip.snapshot import LoadSnapshot, SnapshotError, encode
from loadmesh.gossip.suspicion import Prober
from loadmesh.gossip.wire import DeltaRecord, FullRecord, Kind, WireError

Outgoing = list[tuple[Addr, bytes]]

# Keys of node ids seen: the same few thousand ids arrive again and again.
node_key = functools.lru_cache(maxsize=65_536)(wire.node_key)

# Counters that exist from the start, so that a scrape sees zeros rather than gaps.
_BASE_COUNTERS = (
    "datagrams_sent", "bytes_sent", "datagrams_received", "bytes_received", "records_stored",
    "pulls_sent", "urgent_relays", "syncs_sent", "beats_sent", "cookies_sent", "resent",
)
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
        self._timers_for = self._limit_for = -1
        self._limit = 0  # retransmit limit of an announcement, for the mesh's size
        self._timer_values = (0, 0, 0, 0)
        self.counts: Counter[str] = Counter({name: 0 for name in _BASE_COUNTERS})
        self.pulls = PullTracker(params.pull_timeout_ms, params.pull_retries, params.max_peers)
        self.prober = Prober(params.probe_interval_ms)
        self._seeds: list[Addr] = []
        self._entry_cap = wire.entry_capacity(params.max_datagram)
        self._want_cap = wire.want_capacity(params.max_datagram)
        # This node's own snapshot, and the one before it (for deltas).
        self._own: LoadSnapshot | None = None
        self._own_content = b""
        self._own_urgent = False
        self._own_prev_version = -1
        self._own_delta: bytes | None = None
        self._own_beat = 0
        self._own_changes = 0
        self._published_at = 0
        self._own_moved_at = 0
        # Live peers in the order they get direct beats, and the next one's index.
        self._beat_order: list[int] = []
        self._beat_next = 0
        self._beat_credit = 0.0  # beats owed since the last round, fraction included
        self._beats_at = 0
        self._now: int | None = None
        self._next_round = self._next_push_pull = self._next_dead_sync = self._next_join = 0

    # --- clock and timers --------------------------------------------------------------------

    def _clock(self, now: int) -> int:
        if self._now is None:
            p = self.params
            # A random phase, so that nodes started together do not gossip in step.
            self._next_round = now + int(self.rng.uniform(0, p.interval_ms))
            self._next_push_pull = now + int(p.push_pull_interval_ms * self.rng.uniform(0.5, 1.5))
            self._next_dead_sync = now + p.dead_sync_interval_ms
            self._next_join = now + p.join_retry_ms
            self._beats_at = now
        elif now < self._now:
            now = self._now  # a driver's clock must not go back; the table relies on it
        self._now = now
        return now

    def _timers(self) -> tuple[int, int, int, int]:
        """beat, suspect, dead, reap: scaled with the mesh (GossipParams.beat_scale and
        timer_scale)."""
        n = self.table.live_count + 1
        if n != self._timers_for:
            p = self.params
            s = p.timer_scale(n)
            self._timers_for = n
            self._timer_values = (int(p.beat_interval_ms * p.beat_scale(n)), int(p.suspect_after_ms * s),
                                  int(p.dead_after_ms * s), p.reap_after_ms)
        return self._timer_values

    def next_deadline(self) -> int:
        """When on_tick next has something to do (ms, the driver's clock)."""
        _, suspect, dead, reap = self._timers()
        t = min(self._next_round, self._next_push_pull, self._next_dead_sync)
        sweep = self.table.next_deadline(suspect, dead, reap)
        if sweep is not None and sweep < t:
            t = sweep
        for other in (self.pulls.next_deadline(), self.prober.next_deadline()):
            if other is not None and other < t:
                t = other
        if self._seeds and self._next_join < t and self.table.live_count == 0:
            t = self._next_join
        return t

    def on_tick(self, now_ms: int) -> Outgoing:
        now = self._clock(now_ms)
        p = self.params
        beat, suspect, dead, reap = self._timers()
        self.table.sweep(now, suspect, dead, reap)
        out: Outgoing = []
        again: dict[Addr, list[tuple[int, int]]] = {}
        due, abandoned = self.pulls.due(now)
        for addr, key, have in due:
            again.setdefault(addr, []).append((key, have))
        for key in abandoned:
            # Nobody served the version announced: forget it, so that the key does not
            # stand above every real version (one datagram could otherwise wedge a node)
            # and the next announcement of it starts a pull again.
            peer = self.table.get(key)
            if peer is not None and self.table.rewind_key(peer):
                self.counts["keys_rewound"] += 1
        for addr, wants in again.items():
            self.counts["pull_retries"] += len(wants)
            out += self._pull(addr, wants)
        for key in self.prober.due(now):
            peer = self.table.get(key)
            if peer is not None and peer.state is PeerState.SUSPECT:
                self.counts["probes_sent"] += 1
                out += self._pull(peer.gossip_addr, [(key, peer.snapshot.version)])
        if now >= self._next_round:
            self._next_round = now + int(p.interval_ms * self.rng.uniform(1 - p.jitter, 1 + p.jitter))
            out += self._round()
            out += self._beats(now, beat)
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

    # --- what the owner does ---------------------------------------------------------------

    def publish(self, snapshot: LoadSnapshot, urgent: bool, now_ms: int) -> Outgoing:
        """Make `snapshot` this node's own; the datagrams that push it at once.

        The version must not go back. The same version again, with the same content,
        changes nothing: beats go out on their own timer."""
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
        self._own_beat = 0
        self._published_at = self._own_moved_at = now
        self._announce(self.key, snapshot.version, 0)
        fanout = self.params.urgent_fanout if urgent else self.params.fanout
        targets = [peer.gossip_addr for peer in self.table.sample_live(fanout, self.rng)]
        record = self._own_record(self._own_prev_version)
        return self._content_to(targets, [record]) if record else []

    def _vouch(self, now: int) -> None:
        """This node's version, vouched for as of now: the beat that goes out next."""
        assert self._own is not None
        self._own_beat = max(self._own_beat, min(now - self._published_at, wire.MAX_U32))
        self._own_moved_at = now

    def _beats(self, now: int, beat: int) -> Outgoing:
        """Beats, sent by the owner straight to each live peer, once per beat interval.

        Each round takes the next share of a fixed order of the live peers (new peers
        join its end): live / beat per ms since the last round, the fraction carried
        over, so a peer hears a beat every beat interval, steadily. A beat
        relayed by gossip would reach each node about R times over; sent directly it
        reaches it once, costs one small datagram, and stops at once when this node
        dies, which is what failure detection waits for. Beats go on while a new
        version spreads: they also tell a node that missed its announcements.
        """
        elapsed, self._beats_at = now - self._beats_at, now
        live = self.table.live_count
        if self._own is None or live == 0:
            self._beat_credit = 0.0
            return []
        self._beat_credit = min(self._beat_credit + live * elapsed / beat, live)
        share = int(self._beat_credit)
        if share == 0:
            return []
        self._beat_credit -= share
        self._vouch(now)
        body = wire.pack_entries([(self.key, self._own.version, self._own_beat)])
        out: Outgoing = []
        refilled = False
        while len(out) < share:
            if self._beat_next >= len(self._beat_order):
                if refilled:
                    break  # fewer live peers than the share: each got its beat
                self._refill_beat_order()
                refilled = True
                continue
            peer = self.table.get(self._beat_order[self._beat_next])
            self._beat_next += 1
            if peer is not None and peer.state is not PeerState.DEAD:
                out.append((peer.gossip_addr, self._seal(Kind.GOSSIP, peer.gossip_addr, body)))
        self.counts["beats_sent"] += len(out)
        return self._count_sent(out)

    def _refill_beat_order(self) -> None:
        """The next pass: the same order for the peers still there, new live ones after
        them in random order, so each peer's beats stay one interval apart."""
        kept = [k for k in self._beat_order if (p := self.table.get(k)) is not None and p.state is not PeerState.DEAD]
        have = set(kept)
        new = [p.key for p in self.table.sample_live(self.table.live_count, self.rng) if p.key not in have]
        self._beat_order = kept + new
        self._beat_next = 0

    def _announce(self, key: int, version: int, beat: int) -> None:
        """Queue (key, version, beat) for the rounds, to be sent `retransmit_limit` times."""
        n = self.table.live_count + 1
        if n != self._limit_for:
            self._limit_for = n
            self._limit = self.params.retransmit_limit(n)
        self.queue.put(key, version, beat, self._limit)

    def _own_record(self, have: int) -> bytes | None:
        own = self._own
        if own is None or own.version <= have:
            return None
        flags = wire.RECORD_URGENT if self._own_urgent else 0
        if have == self._own_prev_version and self._own_delta is not None:
            return wire.pack_delta(flags, self.key, have, own.version, self._own_beat,
                                   zlib.crc32(self._own_content), self._own_delta)
        return wire.pack_full(flags, self._own_beat, self.advertise, self._own_content)

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
            if self.replay.stale(dg.seq, (now + self.wall_offset_ms) * 1000):
                return self._drop("stale")
            proven = self.cookies.valid(addr, dg.echo, now)
            self.tokens.learn(addr, dg.token, proven, now)
            if not proven:
                # Never answer a cookie with a cookie: two nodes would bounce them forever.
                return self._drop("unproven_cookie") if dg.kind is Kind.COOKIE else self._cookie(addr, len(data))
            if not self.replay.first_time((dg.sender, addr), dg.seq):
                return self._drop("replayed")
            if dg.kind is Kind.COOKIE:
                return self._resend(addr)
            peer = self.table.get(dg.sender)
            if peer is not None:
                # A proven, fresh datagram from the node itself: it is alive and
                # receives here, whatever key its peers hold for it.
                peer.observed = addr
                self.table.touch(peer, now)
                self.table.anchor(peer, source_key(addr))
            if dg.kind is Kind.GOSSIP:
                return self._on_gossip(dg, addr, now)
            if dg.kind is Kind.SYNC:
                return self._on_sync(dg, addr, now)
            if dg.kind is Kind.PULL:
                return self._on_pull(dg, addr, now)
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

    def _on_gossip(self, dg: wire.Datagram, addr: Addr, now: int) -> Outgoing:
        entries = list(wire.unpack_entries(dg.body))
        out = self._pull(addr, self._absorb(entries, dg.sender, addr, now))
        if dg.flags & wire.FLAG_REPLY:
            # Push-pull rumour mongering: answer a round's contact with this node's own
            # queued news, less what the contact just sent. Each entry still goes out at
            # most `limit` times, only sooner, so the news spreads about twice as fast
            # for the same bytes, and the last nodes to hear it are found by pull rather
            # than by chance.
            reply = self.queue.take(self._entry_cap, first=self.key, skip=self._known_to_sender(entries))
            if reply:
                out += self._count_sent([(addr, self._seal(Kind.GOSSIP, addr, wire.pack_entries(reply)))])
        return out

    def _known_to_sender(self, entries: list[tuple[int, int, int]]) -> set[int]:
        """The nodes whose latest news the sender of `entries` already has."""
        get, own_key = self.table.get, self.key
        known = set()
        for k, v, b in entries:
            if k == own_key:
                if self._own is not None and (v, b) >= (self._own.version, self._own_beat):
                    known.add(k)
            elif (peer := get(k)) is not None and (v, b) >= (peer.version, peer.beat):
                known.add(k)
        return known

    def _absorb(self, entries: Iterable[tuple[int, int, int]], sender: int, addr: Addr,
                now: int) -> list[tuple[int, int]]:
        """Take the news in announcements from `sender`; the (key, version held) to pull."""
        wants: list[tuple[int, int]] = []
        table, get, own_key = self.table, self.table.get, self.key
        ceiling = self._ceiling(now)
        for k, v, b in entries:
            peer = get(k)
            if peer is not None:
                known = peer.version
                held = peer.snapshot.version
                if v < known or (v == known and b <= peer.beat):
                    # Old news, by far the most common case. Under a key that ran ahead
                    # of the content (announced, never served), a version above the
                    # content is still worth a pull.
                    if v > held and self.pulls.want(k, v, held, addr, now):
                        wants.append((k, held))
                    continue
                if v > ceiling or (v == held and peer.snapshot.timestamp_ms + b > ceiling):
                    self.counts["drop_implausible"] += 1
                    continue
                table.merge_key(peer, v, b, now, k == sender)
                if v > held and self.pulls.want(k, v, held, addr, now):
                    wants.append((k, held))
            elif v > ceiling:
                self.counts["drop_implausible"] += 1
            elif k == own_key:
                self._own_seen(v)
            elif (self._room_for_new(source_key(addr) if k == sender else None)
                  and self.pulls.want(k, v, 0, addr, now)):
                wants.append((k, 0))
        return wants

    def _ceiling(self, now: int) -> int:
        """The highest wall-clock time in ms, and so the highest version (versions start
        at their owner's clock and move by one a change), that a peer whose clock agrees
        with this node's within max_clock_skew_ms could have produced by now."""
        return now + self.wall_offset_ms + self.params.max_clock_skew_ms

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

    def _pull(self, addr: Addr, wants: list[tuple[int, int]]) -> Outgoing:
        out: Outgoing = []
        cap = self._want_cap
        for i in range(0, len(wants), cap):
            out.append((addr, self._seal(Kind.PULL, addr, wire.pack_wants(wants[i:i + cap]))))
        self.counts["pulls_sent"] += len(out)
        return self._count_sent(out)

    def _on_pull(self, dg: wire.Datagram, addr: Addr, now: int) -> Outgoing:
        self.counts["pulls_served"] += 1
        records = []
        probed = False
        for key, have in wire.unpack_wants(dg.body):
            if key == self.key and self._own is not None:
                # Vouch for this node's version as of now, in whatever answers.
                self._vouch(now)
                # A probe: the asker holds the latest version and suspects this node.
                probed = have >= self._own.version
            record = self._record_for(key, have)
            if record is not None:
                records.append(record)
        out = self._content_to([addr], records)
        if probed and self._own is not None:
            entry = wire.pack_entries([(self.key, self._own.version, self._own_beat)])
            out += self._count_sent([(addr, self._seal(Kind.GOSSIP, addr, entry))])
        return out

    def _on_sync(self, dg: wire.Datagram, addr: Addr, now: int) -> Outgoing:
        entries = list(wire.unpack_entries(dg.body))
        out = self._pull(addr, self._absorb(entries, dg.sender, addr, now))
        # What the sender is behind on, among the nodes it listed.
        records = [r for k, v, _ in entries if (r := self._record_for(k, v))]
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
        wants: list[tuple[int, int]] = []
        out: Outgoing = []
        for rec in records:
            if isinstance(rec, FullRecord):
                out += self._absorb_full(rec, dg.sender, addr, now, wants)
            else:
                out += self._absorb_delta(rec, dg.sender, addr, now, wants)
        return self._pull(addr, wants) + out

    def _absorb_full(self, rec: FullRecord, sender: int, addr: Addr, now: int,
                     wants: list[tuple[int, int]]) -> Outgoing:
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
        return self._store(key, snap, rec.content, rec.beat, rec.addr, rec.flags, None, key == sender, addr, now,
                           wants)

    def _absorb_delta(self, rec: DeltaRecord, sender: int, addr: Addr, now: int,
                      wants: list[tuple[int, int]]) -> Outgoing:
        peer = self.table.get(rec.key)
        held = peer.snapshot.version if peer is not None else 0
        if rec.version <= held:
            return []
        if rec.version > self._ceiling(now):
            return self._drop("implausible")
        if peer is None or held != rec.base_version:
            # Not applicable here: fetch the version from the sender instead.
            self.counts["delta_without_base"] += 1
            if ((peer is not None or self._room_for_new(source_key(addr) if rec.key == sender else None))
                    and self.pulls.want(rec.key, rec.version, held, addr, now)):
                wants.append((rec.key, held))
            return []
        try:
            content = self.codec.apply(peer.content, rec.changes, rec.crc)
            snap = self.codec.snapshot(content)
        except (DeltaError, SnapshotError):
            snap = None
        if snap is None or snap.node_id != peer.node_id or snap.version != rec.version:
            if self.pulls.want(rec.key, rec.version, held, addr, now):
                wants.append((rec.key, held))
            return self._drop("bad_delta")
        return self._store(rec.key, snap, content, rec.beat, peer.addr, rec.flags, rec.changes, rec.key == sender,
                           addr, now, wants)

    def _store(self, key: int, snap: LoadSnapshot, content: bytes, beat: int, owner_addr: Addr,
               flags: int, delta: bytes | None, direct: bool, src: Addr, now: int,
               wants: list[tuple[int, int]]) -> Outgoing:
        ceiling = self._ceiling(now)
        if snap.timestamp_ms > ceiling:
            return self._drop("future")
        if snap.timestamp_ms + beat > ceiling:
            return self._drop("implausible")
        before = self.table.get(key)
        held = before.snapshot.version if before is not None else 0
        anchor = source_key(src) if direct else None
        if before is None and not self._room_for_new(anchor):
            return []
        urgent = bool(flags & wire.RECORD_URGENT)
        peer = self.table.merge_content(key, snap, content, beat, owner_addr, urgent, now, delta, direct, anchor)
        if peer is None:
            return []
        self.counts["records_stored"] += 1
        self.pulls.done(key, snap.version)
        if peer.version == snap.version:
            self._announce(key, snap.version, peer.beat)
        elif self.pulls.want(key, peer.version, snap.version, src, now):
            wants.append((key, snap.version))
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
        beat = peer.beat if peer.version == peer.snapshot.version else 0
        if have == peer.prev_version and have > 0:
            changes = peer.delta or self.codec.diff(peer.prev_content, peer.content)
            if changes is not None:
                return wire.pack_delta(flags, peer.key, have, peer.snapshot.version, beat,
                                       zlib.crc32(peer.content), changes)
        return wire.pack_full(flags, beat, peer.addr, peer.content)

    def _content_to(self, targets: Sequence[Addr], records: list[bytes]) -> Outgoing:
        if not records or not targets:
            return []
        bodies = wire.pack_content(records, self.params.max_datagram)
        return self._count_sent([(addr, self._seal(Kind.CONTENT, addr, body)) for addr in targets for body in bodies])

    def _digest(self, addr: Addr, reply: bool) -> Outgoing:
        """This node's whole table as announcements of what it can serve (sync)."""
        entries = []
        if self._own is not None:
            entries.append((self.key, self._own.version, self._own_beat))
        for peer in self.table:
            if peer.state is not PeerState.DEAD:
                beat = peer.beat if peer.version == peer.snapshot.version else 0
                entries.append((peer.key, peer.snapshot.version, beat))
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
                entries = self.queue.take(self._entry_cap, first=self.key, skip=sent)
                if not entries:
                    break
                out.append((peer.gossip_addr, self._seal(Kind.GOSSIP, peer.gossip_addr, wire.pack_entries(entries),
                                                         flags)))
                flags = 0
                if len(entries) < self._entry_cap:
                    break
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
        counts["bytes_sent"] += sum(len(d) for _, d in out)
        return out

    def _on_state(self, peer: Peer, old: PeerState | None, new: PeerState | None, now: int) -> None:
        if new is not None:
            self.counts["became_" + new.value] += 1
        if old is None and len(self.table) == 1:
            # The first peer: this node has just joined. Nodes started with it may not
            # have reached their seeds when the seed answered; one more full exchange,
            # a join retry later, finds them (rather than the push-pull interval).
            self._next_push_pull = min(self._next_push_pull, now + self.params.join_retry_ms)
        if new is None:
            self.pulls.forget(peer.key)
        if new is PeerState.SUSPECT:
            self.prober.suspect(peer.key, now)
        else:
            self.prober.clear(peer.key)
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

    @property
    def generation(self) -> int:
        """Moves whenever snapshots() holds something new, beyond the ages growing: a
        reader that saw this value can skip the table until it moves."""
        return self.table.changes + self._own_changes

    def snapshots(self, now_ms: int) -> dict[str, PeerView]:
        """Every snapshot held, this node's own included (always alive, age 0)."""
        now = max(now_ms, self._now or now_ms)
        out = {peer.node_id: PeerView(peer.snapshot, peer.state, now - peer.fresh_at) for peer in self.table}
        if self._own is not None:
            out[self.node_id] = PeerView(self._own, PeerState.ALIVE, 0)
        return out

    def counters(self) -> dict[str, int]:
        counts = dict(self.counts)
        counts["drop_pulls_full"] = self.pulls.refused
        counts["drop_table_full"] = counts.get("drop_table_full", 0) + self.table.refused
        return counts

"""The peer table: what this node holds about every other node, and how it merges news.

Two orders, both "never go back":

- the version orders what a node has said about its load, and the incarnation what it
  has said about its liveness (SWIM's): the owner raises it, and only the owner, to
  refute a suspicion of itself, so an incarnation above the one a peer was accused
  under proves it alive after the accusation. A version, however new, proves nothing of
  the kind: it may have been published just before a death and arrive late.
- content orders by (version, timestamp_ms), then by the encoded bytes: a sole writer
  never publishes two contents under one version and timestamp, but if a broken one
  does, every node still keeps the same one, whatever the order of arrival.

A peer's version may run ahead of its content (a version heard of, not yet fetched); the
content never goes past it.

States follow SWIM (gossip/probes.py, gossip/suspicion.py): a peer is alive until a
failed probe or a suspicion heard makes it suspect under the incarnation held
(`accused`); dead when the suspicion times out or a death under that incarnation is
heard; alive again on any proven datagram of its own or a greater incarnation.
`fresh_at` is when this node last had news from the node: a newer version, or a
datagram of its own; routing ages snapshots by it. Dead peers are forgotten reap_after
after their death.

Bounds: at most max_peers peers and max_bytes of snapshot encodings (each peer's and the
one before it, kept to answer pulls with deltas). When full, a newcomer takes a dead
peer's place; failing that, a newcomer *anchored* by its own datagrams (proven to come
from its address) takes the place of the stalest peer nobody has heard from directly.
An address anchors at most anchors_per_source nodes, so ids forged by one host cannot
anchor themselves past that, and cannot keep a real node out however many they are.
"""

from __future__ import annotations

import enum
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from loadmesh.gossip.snapshot import LoadSnapshot
from loadmesh.gossip.wire import short_code

Addr = tuple[str, int]


class PeerState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass(slots=True, eq=False)
class Peer:
    node_id: str
    key: int
    version: int
    incarnation: int
    fresh_at: int
    state: PeerState
    snapshot: LoadSnapshot
    content: bytes
    urgent: bool
    addr: Addr
    # What this node held before `snapshot`, so it can answer a pull from that version
    # with a delta; `delta` is the one it received, when it came as one.
    prev_version: int = -1
    prev_content: bytes = b""
    delta: bytes | None = None
    observed: Addr | None = None
    # The source (gossip.ratelimit.source_key) whose proven datagrams carried this node's
    # own word; None while it is known only from others.
    anchor: str | None = None
    # The incarnation it is suspect or dead under; when the state last changed.
    accused: int = 0
    state_at: int = 0
    # The table's `changes` at this peer's last change: a reader that saw the table at
    # changes = g reads again only the peers changed above g (PeerTable.changed_since).
    changed: int = 0
    # Its code in PeerTable.settled, -1 while it is not there.
    settled: int = -1

    @property
    def size(self) -> int:
        return len(self.content) + len(self.prev_content)

    @property
    def gossip_addr(self) -> Addr:
        """Where to send: the address datagrams came from wins over the advertised one, which
        a node bound to 0.0.0.0 may have guessed wrong."""
        return self.observed or self.addr


def content_order(snap: LoadSnapshot, content: bytes) -> tuple[int, int, bytes]:
    return (snap.version, snap.timestamp_ms, content)


StateHook = Callable[[Peer, "PeerState | None", "PeerState | None", int], None]


class PeerTable:
    def __init__(self, max_peers: int, on_state: StateHook | None = None, max_bytes: int = 1 << 62,
                 anchors_per_source: int = 8) -> None:
        self.max_peers = max_peers
        self.max_bytes = max_bytes
        self.anchors_per_source = anchors_per_source
        self.bytes = 0
        self.refused = 0  # contents that did not fit, room made or not
        # Moves with every change a reader of the table sees (a peer added, forgotten,
        # made fresh, given a new state or content), so that one can skip an unchanged table;
        # `removals` moves with each peer forgotten, which changed_since cannot list.
        self.changes = 0
        self.removals = 0
        self._on_state = on_state
        self._anchors: Counter[str] = Counter()
        self._anchored = 0
        self._peers: dict[int, Peer] = {}
        # The peers in the order of their last change, so that changed_since reads only
        # the changed ones from the end.
        self._recent: dict[int, Peer] = {}
        self._by_state: dict[PeerState, dict[int, None]] = {s: {} for s in PeerState}
        self._alive, self._suspect, self._dead = self._by_state.values()
        # The peer of a key, or None; bound to the dict itself, as it is on every hot path.
        self.get: Callable[[int], Peer | None] = self._peers.get
        # Alive and suspect peers in a list, for O(1) random sampling of gossip targets.
        self._live: list[int] = []
        self._live_at: dict[int, int] = {}
        # The short announcement (wire.short_code) of each peer whose content is of the
        # latest version heard of: an announcement found here is old news with nothing to
        # pull, and a datagram's are filtered against it in one C call (at 1000 nodes,
        # some 4,000 a second, nearly all old news).
        self.settled: set[int] = set()

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[Peer]:
        return iter(self._peers.values())


    @property
    def live_count(self) -> int:
        return len(self._live)

    def count(self, state: PeerState) -> int:
        return len(self._by_state[state])

    # --- merge -----------------------------------------------------------------------------

    def merge_key(self, peer: Peer, version: int, incarnation: int, now: int, direct: bool = False) -> bool:
        """Take a version and an incarnation heard of; True when either was news.

        A newer version makes the peer fresh (routing ages snapshots by it), anything from
        the peer itself (`direct`) makes it fresh and alive, and an incarnation above the
        one it was accused under makes a suspect or dead peer alive.
        """
        news = False
        if version > peer.version:
            peer.version = version
            self._settle(peer)
            news = True
            if not direct:
                self.refresh(peer, now)
        if incarnation > peer.incarnation:
            peer.incarnation = incarnation
            news = True
            if peer.state is not PeerState.ALIVE and incarnation > peer.accused and not direct:
                self._set_state(peer, PeerState.ALIVE, now)
        if direct:
            self.touch(peer, now)
        return news

    def refresh(self, peer: Peer, now: int) -> None:
        """A newer version of the peer's figures: fresh as of now, whatever its state."""
        peer.fresh_at = now
        self._changed(peer)

    def changed_since(self, changes: int) -> list[Peer]:
        """The peers changed since the table's `changes` was that value, in the order of
        their last change (not the ones forgotten since: see `removals`). Read back from
        the newest change: the router reads the table ten times a second, and at 1000
        peers a scan of every peer for the few changed took a tenth of its time
        (scripts/bench_agent_cpu.py)."""
        found = []
        for peer in reversed(self._recent.values()):
            if peer.changed <= changes:
                break
            found.append(peer)
        found.reverse()
        return found

    def _changed(self, peer: Peer) -> None:
        self.changes += 1
        peer.changed = self.changes
        recent = self._recent
        recent.pop(peer.key, None)
        recent[peer.key] = peer

    def touch(self, peer: Peer, now: int) -> None:
        """The peer's own datagram, as of now: fresh and alive."""
        self.refresh(peer, now)
        if peer.state is PeerState.ALIVE:
            # To the end of its state's order: the stalest are first (see room_for).
            alive = self._alive
            del alive[peer.key]
            alive[peer.key] = None
        else:
            self._set_state(peer, PeerState.ALIVE, now)

    def suspect(self, peer: Peer, now: int) -> bool:
        """Suspect the peer under the incarnation held; False when it already was, or is
        dead."""
        if peer.state is not PeerState.ALIVE:
            return False
        peer.accused = peer.incarnation
        self._set_state(peer, PeerState.SUSPECT, now)
        return True

    def bury(self, peer: Peer, now: int) -> bool:
        """Declare the peer dead under the incarnation held; False when it already was."""
        if peer.state is PeerState.DEAD:
            return False
        peer.accused = peer.incarnation
        self._set_state(peer, PeerState.DEAD, now)
        return True

    def _set_state(self, peer: Peer, state: PeerState, now: int) -> None:
        old = peer.state
        del self._by_state[old][peer.key]
        self._by_state[state][peer.key] = None
        peer.state, peer.state_at = state, now
        if old is PeerState.DEAD:
            self._add_live(peer.key)
        elif state is PeerState.DEAD:
            self._drop_live(peer.key)
        self._notify(peer, old, state, now)

    # --- bounds ------------------------------------------------------------------------------

    def anchor(self, peer: Peer, source: str) -> None:
        """The node's own proven datagram came from `source`: anchor it there, unless
        that source already anchors anchors_per_source others."""
        if peer.anchor == source or self._anchors[source] >= self.anchors_per_source:
            return
        self._release(peer)
        peer.anchor = source
        self._anchors[source] += 1
        self._anchored += 1

    def _release(self, peer: Peer) -> None:
        if peer.anchor is not None:
            self._anchors[peer.anchor] -= 1
            if not self._anchors[peer.anchor]:
                del self._anchors[peer.anchor]
            self._anchored -= 1
            peer.anchor = None

    def full(self, extra_bytes: int = 0, entries: int = 0) -> bool:
        return len(self._peers) + entries > self.max_peers or self.bytes + extra_bytes > self.max_bytes

    def _may_anchor(self, anchor: str | None) -> bool:
        return anchor is not None and self._anchors[anchor] < self.anchors_per_source

    def may_make_room(self, anchor: str | None) -> bool:
        """Whether a newcomer could get in: room, a dead peer to replace, or, for one
        that its own datagram from `anchor` would anchor, a peer never heard directly."""
        if not self.full(entries=1) or self._dead:
            return True
        return self._may_anchor(anchor) and self._anchored < len(self._peers)

    def room_for(self, extra_bytes: int, anchored: bool, now: int, entries: int = 0,
                 keep: int | None = None) -> bool:
        """Make room for `extra_bytes` more (and `entries` more peers), evicting dead
        peers first, then, for an `anchored` claimant, the stalest unanchored ones (never
        `keep`); False when that is not enough."""
        while self.full(extra_bytes, entries):
            victim = next((k for k in self._dead if k != keep), None)
            if victim is None and anchored:
                victim = next((k for bucket in (self._suspect, self._alive) for k in bucket
                               if k != keep and self._peers[k].anchor is None), None)
            if victim is None:
                return False
            self._remove(self._peers[victim], now)
        return True

    def rewind_version(self, peer: Peer) -> bool:
        """Bring a version that ran ahead of the content back to the content's; False
        when it had not."""
        if peer.version <= peer.snapshot.version:
            return False
        peer.version = peer.snapshot.version
        self._settle(peer)
        return True

    def merge_content(self, key: int, snap: LoadSnapshot, content: bytes, incarnation: int, addr: Addr,
                      urgent: bool, now: int, delta: bytes | None = None, direct: bool = False,
                      anchor: str | None = None) -> Peer | None:
        """Store the content if it is newer than the one held; the peer when it was.

        A node not yet in the table is added if there is room or room can be made (see
        the module's doc; `anchor`: the source of the node's own datagram carrying it);
        None when not, or when a newer content does not fit (the caller counts it)."""
        peer = self._peers.get(key)
        if peer is None:
            if not self.room_for(len(content), self._may_anchor(anchor), now, entries=1):
                self.refused += 1
                return None
            peer = Peer(snap.node_id, key, snap.version, incarnation, now, PeerState.ALIVE, snap,
                        content, urgent, addr, state_at=now)
            self._peers[key] = peer
            self.bytes += peer.size
            self._by_state[PeerState.ALIVE][key] = None
            self._add_live(key)
            self._settle(peer)
            if anchor is not None:
                self.anchor(peer, anchor)
            self._notify(peer, None, PeerState.ALIVE, now)
            return peer
        stored = content_order(snap, content) > content_order(peer.snapshot, peer.content)
        if stored:
            mine = peer.anchor is not None
            # The content before is kept to answer pulls with deltas, when there is room
            # without pushing anyone out: it is only a saving of bytes on the wire.
            prev = b"" if self.full(len(content) + len(peer.content) - peer.size) else peer.content
            if not prev and not self.room_for(len(content) - peer.size, mine, now, keep=key):
                self.refused += 1
                return None
            self.bytes += len(content) + len(prev) - peer.size
            peer.prev_version, peer.prev_content = (peer.snapshot.version, prev) if prev else (-1, b"")
            peer.snapshot, peer.content, peer.urgent, peer.delta = snap, content, urgent, delta
            peer.addr = addr
            self._changed(peer)
        # Even old content may come with an incarnation that is news.
        self.merge_key(peer, snap.version, incarnation, now, direct)
        if stored:
            self._settle(peer)
        return peer if stored else None

    # --- forgetting -------------------------------------------------------------------------

    def sweep(self, now: int, reap_after: int) -> None:
        """Forget the peers dead for reap_after (the dead are kept in the order they died)."""
        dead = self._dead
        while dead:
            peer = self._peers[next(iter(dead))]
            if peer.state_at > now - reap_after:
                break
            self._remove(peer, now)

    def next_deadline(self, reap_after: int) -> int | None:
        """When the next sweep has something to do; None with no dead peer."""
        dead = self._dead
        return self._peers[next(iter(dead))].state_at + reap_after if dead else None

    # --- targets ---------------------------------------------------------------------------

    def live_keys(self) -> list[int]:
        """The alive and suspect peers' keys (a copy)."""
        return list(self._live)

    def sample_live(self, k: int, rng: random.Random) -> list[Peer]:
        live = self._live
        if len(live) <= k:
            return [self._peers[key] for key in live]
        return [self._peers[live[i]] for i in rng.sample(range(len(live)), k)]

    def random_dead(self, rng: random.Random) -> Peer | None:
        dead = self._by_state[PeerState.DEAD]
        if not dead:
            return None
        return self._peers[rng.choice(list(dead))]

    # --- internals -------------------------------------------------------------------------

    def _add_live(self, key: int) -> None:
        self._live_at[key] = len(self._live)
        self._live.append(key)

    def _drop_live(self, key: int) -> None:
        i = self._live_at.pop(key)
        last = self._live.pop()
        if last != key:
            self._live[i] = last
            self._live_at[last] = i

    def _settle(self, peer: Peer) -> None:
        """Keeps the peer's code in `settled` true to its versions."""
        code = short_code(peer.key, peer.version) if peer.version == peer.snapshot.version else -1
        if code != peer.settled:
            self.settled.discard(peer.settled)
            if code >= 0:
                self.settled.add(code)
            peer.settled = code

    def _remove(self, peer: Peer, now: int) -> None:
        del self._peers[peer.key]
        self.settled.discard(peer.settled)
        self.removals += 1
        self.bytes -= peer.size
        self._release(peer)
        del self._by_state[peer.state][peer.key]
        if peer.state is not PeerState.DEAD:
            self._drop_live(peer.key)
        self._notify(peer, peer.state, None, now)
        del self._recent[peer.key]

    def _notify(self, peer: Peer, old: PeerState | None, new: PeerState | None, now: int) -> None:
        self._changed(peer)
        if self._on_state is not None:
            self._on_state(peer, old, new, now)

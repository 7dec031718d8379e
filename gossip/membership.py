"""The peer table: what this node holds about every other node, and how it merges news.

Two orders, both "never go back":

- the key (version, beat) orders what a node has said about itself. The beat counts the
  milliseconds the owner has vouched for a version since publishing it, so within one
  version it orders exactly as the owner's timestamp would. A strictly greater key is
  news: the peer is alive as of the local receive time (`fresh_at`), whatever the peer's
  clock says.
- content orders by (version, timestamp_ms), then by the encoded bytes: a sole writer
  never publishes two contents under one version and timestamp, but if a broken one
  does, every node still keeps the same one, whatever the order of arrival.

A peer may hold a key ahead of its content (it heard of a version it has not fetched
yet); the content never goes past the key.

States follow `fresh_at`: alive, suspect after suspect_after without news, dead after
dead_after (out of routing and of the gossip targets), forgotten after reap_after. The
table keeps one insertion-ordered dict per state, ordered by fresh_at, so each sweep
only looks at the peers whose deadline has come.

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
    beat: int
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

    @property
    def size(self) -> int:
        return len(self.content) + len(self.prev_content)

    @property
    def gossip_addr(self) -> Addr:
        """Where to send: the address datagrams came from beats the advertised one, which
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
        # made fresh, given a new state or content), so that one can skip an unchanged table.
        self.changes = 0
        self._on_state = on_state
        self._anchors: Counter[str] = Counter()
        self._anchored = 0
        self._peers: dict[int, Peer] = {}
        self._by_state: dict[PeerState, dict[int, None]] = {s: {} for s in PeerState}
        self._alive, self._suspect, self._dead = self._by_state.values()
        # The peer of a key, or None; bound to the dict itself, as it is on every hot path.
        self.get: Callable[[int], Peer | None] = self._peers.get
        # Alive and suspect peers in a list, for O(1) random sampling of gossip targets.
        self._live: list[int] = []
        self._live_at: dict[int, int] = {}

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

    def merge_key(self, peer: Peer, version: int, beat: int, now: int, direct: bool = False) -> bool:
        """Take (version, beat) if it is news; True when it was.

        Only a newer version, or a beat from the peer itself (`direct`), makes the peer
        fresh. A later beat relayed by a third node is kept, for ordering, but says
        nothing about now: the peer may have died since that node heard it, and taking
        it as fresh would let relays keep a dead node alive.
        """
        if version < peer.version or (version == peer.version and beat <= peer.beat):
            return False
        fresh = direct or version > peer.version
        peer.version, peer.beat = version, beat
        if fresh:
            self.touch(peer, now)
        return True

    def touch(self, peer: Peer, now: int) -> None:
        """The peer is alive as of now."""
        peer.fresh_at = now
        self.changes += 1
        old = peer.state
        del self._by_state[old][peer.key]
        self._by_state[PeerState.ALIVE][peer.key] = None
        if old is not PeerState.ALIVE:
            peer.state = PeerState.ALIVE
            if old is PeerState.DEAD:
                self._add_live(peer.key)
            self._notify(peer, old, PeerState.ALIVE, now)

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

    def rewind_key(self, peer: Peer) -> bool:
        """Bring a key that ran ahead of the content back to the content's version;
        False when it had not."""
        if peer.version <= peer.snapshot.version:
            return False
        peer.version, peer.beat = peer.snapshot.version, 0
        return True

    def merge_content(self, key: int, snap: LoadSnapshot, content: bytes, beat: int, addr: Addr,
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
            peer = Peer(snap.node_id, key, snap.version, beat, now, PeerState.ALIVE, snap,
                        content, urgent, addr)
            self._peers[key] = peer
            self.bytes += peer.size
            self._by_state[PeerState.ALIVE][key] = None
            self._add_live(key)
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
            self.changes += 1
        # Even old content may come with a beat that is news.
        self.merge_key(peer, snap.version, beat, now, direct)
        return peer if stored else None

    # --- failure detection -----------------------------------------------------------------

    def sweep(self, now: int, suspect_after: int, dead_after: int, reap_after: int) -> None:
        """Move every peer whose deadline has come to its next state, or forget it."""
        dead = self._dead
        self._advance(self._alive, self._suspect, PeerState.SUSPECT, now - suspect_after, now)
        self._advance(self._suspect, dead, PeerState.DEAD, now - dead_after, now)
        while dead:
            key = next(iter(dead))
            peer = self._peers[key]
            if peer.fresh_at > now - reap_after:
                break
            self._remove(peer, now)

    def _advance(self, src: dict[int, None], dst: dict[int, None], state: PeerState,
                 older_than: int, now: int) -> None:
        # Both dicts stay ordered by fresh_at: peers leave src in that order and any
        # peer with news goes to the end of the alive dict.
        while src:
            key = next(iter(src))
            peer = self._peers[key]
            if peer.fresh_at > older_than:
                break
            del src[key]
            dst[key] = None
            old, peer.state = peer.state, state
            if state is PeerState.DEAD:
                self._drop_live(key)
            self._notify(peer, old, state, now)

    def next_deadline(self, suspect_after: int, dead_after: int, reap_after: int) -> int | None:
        """When the next sweep has something to do; None with no peer."""
        best = None
        peers = self._peers
        for bucket, after in ((self._alive, suspect_after), (self._suspect, dead_after), (self._dead, reap_after)):
            if bucket:
                t = peers[next(iter(bucket))].fresh_at + after
                if best is None or t < best:
                    best = t
        return best

    # --- targets ---------------------------------------------------------------------------

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

    def _remove(self, peer: Peer, now: int) -> None:
        del self._peers[peer.key]
        self.bytes -= peer.size
        self._release(peer)
        del self._by_state[peer.state][peer.key]
        if peer.state is not PeerState.DEAD:
            self._drop_live(peer.key)
        self._notify(peer, peer.state, None, now)

    def _notify(self, peer: Peer, old: PeerState | None, new: PeerState | None, now: int) -> None:
        self.changes += 1
        if self._on_state is not None:
            self._on_state(peer, old, new, now)

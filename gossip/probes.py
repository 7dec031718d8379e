"""SWIM's failure detector, without I/O: whom to probe, when to ask for help, what the
answers say, and how much this node trusts its own judgement (Lifeguard).

Each protocol period (probe_interval_ms, stretched by local health) a node probes one
peer, the next of a shuffled round-robin order of its live peers, so that every peer is
probed by someone about once a period and by this node at least once every N periods:

1. a ping, straight to the peer; an ack from it (or any of its own datagrams) within
   probe_timeout_ms settles the probe;
2. otherwise a ping-req to `indirect_checks` other peers, which ping it in turn and relay
   its ack, or answer with a nack when they heard nothing either;
3. at the end of the period, a peer that answered no one is suspect (gossip/suspicion.py).

Liveness thus costs a ping and an ack per node and period whatever the size of the mesh,
where beats sent to every peer cost N datagrams.

Local health (Lifeguard's awareness, memberlist's awareness.go): a score from 0 to
`health_max`, up one for each expected nack that did not come (this node's own network
or CPU is the likelier culprit when even its helpers' answers are lost), for each
suspicion of itself it had to refute, and for each stall of its own clock; down one for
each probe answered. Probe timeouts and periods are multiplied by score + 1, so a slow
node probes less eagerly instead of accusing healthy peers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from loadmesh.gossip.deadlines import Deadlines
from loadmesh.gossip.membership import Addr

# Relayed probes kept at once: ping-reqs come from peers' failed probes, a few a period
# even at 20% loss; beyond this many, more are refused (counted by the core).
MAX_RELAYS = 256


@dataclass(slots=True)
class Probe:
    """This node's probe of the current period."""

    target: int
    seq: int
    started: int
    indirect_at: int   # no answer by then: ask helpers
    ends_at: int       # the verdict
    acked: bool = False
    direct: bool = False  # the target's own ack came within the direct phase
    helpers: int = 0   # ping-reqs sent, so nacks expected
    nacks: int = 0


@dataclass(slots=True)
class Relay:
    """A ping sent for another node's probe: whom to answer, under which seq."""

    requester: Addr
    seq: int
    target: int
    nack_at: int


class LocalHealth:
    def __init__(self, most: int) -> None:
        self.most = most
        self.score = 0

    def change(self, delta: int) -> None:
        self.score = min(self.most, max(0, self.score + delta))

    def scale(self, ms: int) -> int:
        return ms * (self.score + 1)


class Delivery:
    """How often a ping and its ack both arrive: (1 - loss)**2 on a network that loses a
    share `loss` of datagrams each way. Counted over the probes of peers found alive
    (answered straight within probe_timeout_ms, or only later or through helpers), so
    that a dead peer's silence is not taken for loss; a moving average of about the last
    16 of them (8 s at the default period), from 1 (no loss)."""

    WEIGHT = 1 / 16

    def __init__(self) -> None:
        self.ratio = 1.0

    def add(self, straight: bool) -> None:
        self.ratio += ((1.0 if straight else 0.0) - self.ratio) * self.WEIGHT


class ProbeOrder:
    """The peers to probe, each once per pass in a random order; the order is drawn again
    at each pass, so that probes of one peer by different nodes do not fall in step. A
    peer that joins (or comes back) mid-pass takes a random place in the rest of it, as
    in memberlist: at the end of the pass it could wait N periods for its first probe."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._order: list[int] = []
        self._next = 0

    def add(self, key: int) -> None:
        at = self.rng.randint(self._next, len(self._order))
        self._order.insert(at, key)

    def next_up(self, key: int) -> None:
        """Probe `key` next (a suspicion of it was heard): it corroborates a death at
        once, and brings a live suspect the news through the ping that says it is
        suspected."""
        self._order.insert(self._next, key)

    def next(self, live: Callable[[], list[int]], usable: Callable[[int], bool]) -> int | None:
        for _ in range(2):
            while self._next < len(self._order):
                key = self._order[self._next]
                self._next += 1
                if usable(key):
                    return key
            self._order = live()
            self.rng.shuffle(self._order)
            self._next = 0
        return None


class Relays:
    """Pings sent on behalf of other nodes, until answered or given up."""

    def __init__(self, limit: int = MAX_RELAYS) -> None:
        self.limit = limit
        self._by_seq: dict[int, Relay] = {}
        self._nacks: Deadlines[int] = Deadlines()

    def __len__(self) -> int:
        return len(self._by_seq)

    def add(self, seq: int, relay: Relay) -> bool:
        if len(self._by_seq) >= self.limit:
            return False
        self._by_seq[seq] = relay
        self._nacks.set(seq, relay.nack_at)
        return True

    def take(self, seq: int) -> Relay | None:
        self._nacks.discard(seq)
        return self._by_seq.pop(seq, None)

    def due(self, now: int) -> list[Relay]:
        """Relays unanswered by their nack time: each gets a nack, then is forgotten."""
        return [self._by_seq.pop(seq) for seq in self._nacks.due(now)]

    def next_deadline(self) -> int | None:
        return self._nacks.next()

    def postpone(self, ms: int) -> None:
        for relay in self._by_seq.values():
            relay.nack_at += ms
        self._nacks.shift(ms)

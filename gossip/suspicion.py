"""Suspicions: how long a suspect has to refute before this node declares it dead.

Lifeguard's dynamic suspicion (as memberlist's suspicion.go): a suspicion starts with the
longest timeout, `max_ms`, and each independent accuser heard beyond the first shortens
it, down to `min_ms` once `expected` of them have spoken:

    timeout = max(min_ms, max_ms - (max_ms - min_ms) * log(c + 1) / log(expected + 1))

One node's failed probe may be its own fault (a lossy link, a stalled process); several
nodes failing independently rarely are. So a lone accusation leaves the suspect time to
hear of it and refute, and a corroborated one is acted on quickly. An accuser counts once
however often it repeats itself; only a node that failed its own probe is an accuser
(gossip/protocol.py, wire.STATUS_ACCUSED), never one that relays another's suspicion.

Deadlines are kept in a heap (gossip/deadlines.py), so a tick costs nothing while no
suspicion is due. The number of suspicions is bounded by the peer table (one per peer at
most).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loadmesh.gossip.deadlines import Deadlines


@dataclass(slots=True)
class _Suspicion:
    started: int
    min_ms: int
    max_ms: int
    expected: int
    accusers: set[int] = field(default_factory=set)


class Suspicions:
    def __init__(self) -> None:
        self._by_key: dict[int, _Suspicion] = {}
        self._deadlines: Deadlines[int] = Deadlines()

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: int) -> bool:
        return key in self._by_key

    def start(self, key: int, accuser: int | None, now: int, min_ms: int, max_ms: int,
              expected: int) -> None:
        """Suspect `key` from now; `accuser`: who failed to reach it (None: a relayed
        suspicion, which no one has corroborated here yet)."""
        s = _Suspicion(now, min_ms, max(min_ms, max_ms), expected)
        if accuser is not None:
            s.accusers.add(accuser)
        self._by_key[key] = s
        self._deadlines.set(key, self._deadline(s))

    def confirm(self, key: int, accuser: int) -> bool:
        """`accuser` failed to reach `key` too; True when that was news (a new accuser of
        a current suspicion), and the deadline came closer."""
        s = self._by_key.get(key)
        if s is None or accuser in s.accusers:
            return False
        s.accusers.add(accuser)
        deadline = self._deadline(s)
        current = self._deadlines.get(key)
        if current is None or deadline < current:
            self._deadlines.set(key, deadline)
        return True

    def hold(self, key: int, until: int) -> None:
        """No verdict on `key` before `until` (a new accuser's time to check for itself)."""
        current = self._deadlines.get(key)
        if key in self._by_key and (current is None or current < until):
            self._deadlines.set(key, until)

    @staticmethod
    def _deadline(s: _Suspicion) -> int:
        confirmations = len(s.accusers) - 1
        if s.expected < 1:
            shrink = 1.0  # too few nodes to expect any confirmation: the shortest at once
        elif confirmations <= 0:
            shrink = 0.0
        else:
            shrink = min(1.0, math.log(confirmations + 1) / math.log(s.expected + 1))
        return s.started + max(s.min_ms, int(s.max_ms - (s.max_ms - s.min_ms) * shrink))

    def clear(self, key: int) -> None:
        self._by_key.pop(key, None)
        self._deadlines.discard(key)

    def due(self, now: int) -> list[tuple[int, set[int]]]:
        """The suspects whose time to refute is up, with their accusers; they are no
        longer tracked."""
        return [(key, self._by_key.pop(key).accusers) for key in self._deadlines.due(now)]

    def next_deadline(self) -> int | None:
        return self._deadlines.next()

    def postpone(self, ms: int) -> None:
        """This node was stalled for `ms`: refutations may be waiting, unread, in its
        socket. Every suspect gets that much longer."""
        for s in self._by_key.values():
            s.started += ms
        self._deadlines.shift(ms)

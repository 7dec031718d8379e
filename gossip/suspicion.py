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

Deadlines are kept in a heap (an entry whose deadline has moved is skipped when it
surfaces), so a tick costs nothing while no suspicion is due. The number of suspicions is
bounded by the peer table (one per peer at most).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Suspicion:
    started: int
    min_ms: int
    max_ms: int
    expected: int
    deadline: int
    accusers: set[int] = field(default_factory=set)


class Suspicions:
    def __init__(self) -> None:
        self._by_key: dict[int, _Suspicion] = {}
        self._heap: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: int) -> bool:
        return key in self._by_key

    def start(self, key: int, accuser: int | None, now: int, min_ms: int, max_ms: int,
              expected: int) -> None:
        """Suspect `key` from now; `accuser`: who failed to reach it (None: a relayed
        suspicion, which no one has corroborated here yet)."""
        s = _Suspicion(now, min_ms, max(min_ms, max_ms), expected, 0)
        if accuser is not None:
            s.accusers.add(accuser)
        s.deadline = self._deadline(s)
        self._by_key[key] = s
        heapq.heappush(self._heap, (s.deadline, key))

    def confirm(self, key: int, accuser: int) -> bool:
        """`accuser` failed to reach `key` too; True when that was news (a new accuser of
        a current suspicion), and the deadline came closer."""
        s = self._by_key.get(key)
        if s is None or accuser in s.accusers:
            return False
        s.accusers.add(accuser)
        deadline = self._deadline(s)
        if deadline < s.deadline:
            s.deadline = deadline
            heapq.heappush(self._heap, (deadline, key))
        return True

    def hold(self, key: int, until: int) -> None:
        """No verdict on `key` before `until` (a new accuser's time to check for itself)."""
        s = self._by_key.get(key)
        if s is not None and s.deadline < until:
            s.deadline = until
            heapq.heappush(self._heap, (until, key))

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

    def due(self, now: int) -> list[tuple[int, set[int]]]:
        """The suspects whose time to refute is up, with their accusers; they are no
        longer tracked."""
        out = []
        heap, by_key = self._heap, self._by_key
        while heap and heap[0][0] <= now:
            at, key = heapq.heappop(heap)
            s = by_key.get(key)
            if s is not None and s.deadline == at:
                del by_key[key]
                out.append((key, s.accusers))
        return out

    def next_deadline(self) -> int | None:
        heap, by_key = self._heap, self._by_key
        while heap and ((s := by_key.get(heap[0][1])) is None or s.deadline != heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def postpone(self, ms: int) -> None:
        """This node was stalled for `ms`: refutations may be waiting, unread, in its
        socket. Every suspect gets that much longer."""
        for s in self._by_key.values():
            s.started += ms
            s.deadline += ms
        self._heap = [(s.deadline, k) for k, s in self._by_key.items()]
        heapq.heapify(self._heap)

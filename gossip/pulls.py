"""Pulls in flight: which node's content this node has asked for, from whom, and when
to ask again.

One pull per node at a time: announcements of a version already asked for do not cause
a second pull while the first may still answer, but their senders are kept (up to
MAX_SOURCES in all), since each holds the version. A pull unanswered after `timeout_ms`
is sent again, to the next of those sources in turn: `retries` times, and once more for
each source beyond the first. Then it is given up (the core then forgets the version
announced) and the next announcement starts a new one. Under 20% loss a pull and its
answer both arrive 64% of the time: three tries to one peer left 4% of the pulls
unanswered, each a node without the version until its owner's next one (docs/gossip.md).
Entries are bounded by `max_entries`, like the peer table.
"""

from __future__ import annotations

import heapq
from loadmesh.gossip.membership import Addr

# A pull in flight: (version asked, version held, asked from, answer due by, tries so far,
# the sources that announced the version, in the order they are asked).
_Pull = tuple[int, int, Addr, int, int, tuple[Addr, ...]]
# Each source is one more try: a third source adds little that a second does not, and
# the sources held bound what one announcer's lies can make this node send.
MAX_SOURCES = 3


class PullTracker:
    def __init__(self, timeout_ms: int, retries: int, max_entries: int) -> None:
        self.timeout_ms = timeout_ms
        self.retries = retries
        self.max_entries = max_entries
        self.refused = 0
        self._inflight: dict[int, _Pull] = {}
        # (deadline, key); an entry whose pull has moved on is skipped when it surfaces.
        self._deadlines: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self._inflight)

    def want(self, key: int, version: int, have: int, addr: Addr, now: int) -> bool:
        """Record a pull of `version` of `key` from `addr`; False when one in flight covers
        it, or when the tracker is full."""
        pull = self._inflight.get(key)
        if pull is not None and pull[0] >= version and pull[3] > now:
            sources = pull[5]
            if len(sources) < MAX_SOURCES and addr not in sources:
                self._inflight[key] = pull[:5] + (sources + (addr,),)
            return False
        if pull is None and len(self._inflight) >= self.max_entries:
            self._expire(now)
            if len(self._inflight) >= self.max_entries:
                self.refused += 1
                return False
        deadline = now + self.timeout_ms
        self._inflight[key] = (version, have, addr, deadline, 0, (addr,))
        heapq.heappush(self._deadlines, (deadline, key))
        return True

    def done(self, key: int, version: int) -> None:
        """`version` of `key` arrived: the pull is over if it asked for no more."""
        pull = self._inflight.get(key)
        if pull is not None and pull[0] <= version:
            del self._inflight[key]

    def forget(self, key: int) -> None:
        self._inflight.pop(key, None)

    def due(self, now: int) -> tuple[list[tuple[Addr, int, int, int]], list[int]]:
        """The pulls to send again now, as (addr, key, version held, version asked); and
        the keys whose pulls were given up."""
        again: list[tuple[Addr, int, int, int]] = []
        abandoned: list[int] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            pull = self._inflight.get(key)
            if pull is None or pull[3] != deadline:
                continue
            version, have, _, _, tries, sources = pull
            if tries >= self.retries + len(sources) - 1:
                del self._inflight[key]
                abandoned.append(key)
                continue
            tries += 1
            addr = sources[tries % len(sources)]
            deadline = now + self.timeout_ms
            self._inflight[key] = (version, have, addr, deadline, tries, sources)
            heapq.heappush(heap, (deadline, key))
            again.append((addr, key, have, version))
        return again, abandoned

    def next_deadline(self) -> int | None:
        heap = self._deadlines
        while heap:
            deadline, key = heap[0]
            pull = self._inflight.get(key)
            if pull is not None and pull[3] == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def _expire(self, now: int) -> None:
        # Late pulls go first: they are the least likely to be answered.
        for key in [k for k, p in self._inflight.items() if p[3] <= now]:
            del self._inflight[key]

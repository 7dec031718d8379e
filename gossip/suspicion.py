"""Suspects and their probes.

A peer without news for suspect_after is suspect. Rather than let it die in silence, this
node asks it directly, every probe_interval_ms until it is alive again or dead, for a
fresh beat (a pull about itself, which a live node answers with its current version and
beat). The answer comes from the peer itself, so it is fresh news: a live peer whose
beats were lost is not declared dead, while a dead one is found dead exactly at
dead_after. Probes never delay the verdict, they only prevent wrong ones.
"""

from __future__ import annotations

import heapq


class Prober:
    def __init__(self, interval_ms: int) -> None:
        self.interval_ms = interval_ms
        self._next: dict[int, int] = {}  # suspect key -> next probe time
        self._heap: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self._next)

    def suspect(self, key: int, now: int) -> None:
        self._next[key] = now
        heapq.heappush(self._heap, (now, key))

    def clear(self, key: int) -> None:
        self._next.pop(key, None)

    def due(self, now: int) -> list[int]:
        """The suspects to probe now; each is due again interval_ms later."""
        keys = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, key = heapq.heappop(heap)
            if self._next.get(key) != at:
                continue
            keys.append(key)
            self._next[key] = now + self.interval_ms
            heapq.heappush(heap, (now + self.interval_ms, key))
        return keys

    def next_deadline(self) -> int | None:
        heap = self._heap
        while heap and self._next.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

"""Deadlines by key: the earliest first, each key at most once.

A heap with lazy deletion: moving or dropping a key's deadline leaves its old heap entry
behind, skipped when it surfaces (the dict holds the one that counts). Suspicions, relayed
probes and their kin keep their data in a dict of their own and their timing here.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    def __init__(self) -> None:
        self._at: dict[K, int] = {}
        self._heap: list[tuple[int, int, K]] = []
        self._n = 0  # ties broken by insertion: keys need not be ordered

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def get(self, key: K) -> int | None:
        return self._at.get(key)

    def set(self, key: K, at: int) -> None:
        self._at[key] = at
        self._n += 1
        heapq.heappush(self._heap, (at, self._n, key))

    def discard(self, key: K) -> None:
        self._at.pop(key, None)

    def due(self, now: int) -> list[K]:
        """The keys whose deadline is at or before now, earliest first; no longer held."""
        out = []
        heap, at_of = self._heap, self._at
        while heap and heap[0][0] <= now:
            at, _, key = heapq.heappop(heap)
            if at_of.get(key) == at:
                del at_of[key]
                out.append(key)
        return out

    def next(self) -> int | None:
        heap, at_of = self._heap, self._at
        while heap and at_of.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def shift(self, ms: int) -> None:
        """Every deadline `ms` later."""
        self._at = {key: at + ms for key, at in self._at.items()}
        self._heap = [(at, i, key) for i, (key, at) in enumerate(self._at.items())]
        heapq.heapify(self._heap)
        self._n = len(self._heap)

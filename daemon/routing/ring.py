"""Consistent hashing for sessions.

Each peer owns `vnodes` points on a 64-bit ring; a session belongs to the first point at
or after its own hash. Removing a peer removes only its points, so only its sessions move,
each to the next peer clockwise, and skipping a peer during the walk is the same as
removing it. The hash is BLAKE2b rather than Python's hash(), which is salted per process:
every host must map a session to the same peer. A peer that passes a session on
(shed.py) is skipped the same way, so the session goes where it would if that peer were
gone.

A peer's number of points is its weight: a peer that serves half as much holds half as
many sessions. Its points are the first of one fixed sequence, so a peer whose weight
falls keeps the sessions of the points it keeps, and only the others move.
"""

from __future__ import annotations

import functools
import hashlib
import math
from bisect import bisect_left
from collections.abc import Iterator, Mapping


def stepped(value: float, per_doubling: int) -> float:
    """value rounded to the nearest of the steps 2**(1/per_doubling) apart (0 stays 0): a
    figure's noise moves what is derived from it only where it crosses a step, as the
    ring's weights (candidates.ring_points) and the heavy sessions' shares (heavy.py)."""
    if value <= 0:
        return 0.0
    return 2.0 ** (round(math.log2(value) * per_doubling) / per_doubling)


def hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=4096)
def _points(node_id: str, vnodes: int) -> tuple[int, ...]:
    # Cached: a ring is rebuilt for each change of a model's peers or their weights, the
    # points of a peer never change.
    return tuple(hash64(f"{node_id}#{i}") for i in range(vnodes))


class HashRing:
    def __init__(self, vnodes: Mapping[str, int]) -> None:
        """vnodes: each node's number of points, its weight."""
        if any(n < 1 for n in vnodes.values()):
            raise ValueError("every node needs at least one point")
        self.vnodes = dict(vnodes)
        # Ties between equal points (2**-64 odds) break on node_id, so every host agrees.
        points = sorted((h, n) for n, k in self.vnodes.items() for h in _points(n, k))
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]

    def walk(self, key: str) -> Iterator[str]:
        """Every node once, clockwise from the key's point: its owner first, then where
        the key goes if that one cannot take it, and so on."""
        return self.walk_from(hash64(key))

    def walk_from(self, point: int) -> Iterator[str]:
        """walk() from a point of the ring."""
        size = len(self._hashes)
        if not size:
            return
        start = bisect_left(self._hashes, point)
        seen: set[str] = set()
        for i in range(start, start + size):
            owner = self._owners[i % size]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.vnodes):
                    return

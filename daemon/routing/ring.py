"""Consistent hashing for sessions, with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads", 2018; HAProxy's hash-balance-factor).

Each peer owns `vnodes` points on a 64-bit ring; a session belongs to the first point at
or after its own hash. Removing a peer removes only its points, so only its sessions move,
each to the next peer clockwise, and skipping a peer during the walk is the same as
removing it. The hash is BLAKE2b rather than Python's hash(), which is salted per process:
every host must map a session to the same peer.

The bound: a peer may take a session only while its load, counting the new request,
stays within ceil((1 + epsilon) * (total load + 1) * its share of the capacity). The
bounds add up to more than the total load, so one of the peers the totals are taken over
always fits (unless the others cannot be used at all); a peer over its bound passes the
session to the next one on the ring, which is where it would go if the peer were gone.
"""

from __future__ import annotations

import functools
import hashlib
import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator


def hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=4096)
def _points(node_id: str, vnodes: int) -> tuple[int, ...]:
    # Cached: a ring is rebuilt for each change of a model's peer set, the points of a
    # peer never change.
    return tuple(hash64(f"{node_id}#{i}") for i in range(vnodes))


class HashRing:
    def __init__(self, node_ids: Iterable[str], vnodes: int) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        self.nodes = frozenset(node_ids)
        # Ties between equal points (2**-64 odds) break on node_id, so every host agrees.
        points = sorted((h, n) for n in self.nodes for h in _points(n, vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]

    def walk(self, key: str) -> Iterator[str]:
        """Every node once, clockwise from the key's point: its owner first, then where
        the key goes if that one cannot take it, and so on."""
        size = len(self._hashes)
        if not size:
            return
        start = bisect_left(self._hashes, hash64(key))
        seen: set[str] = set()
        for i in range(start, start + size):
            owner = self._owners[i % size]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.nodes):
                    return


def within_bound(load: float, capacity: float, total_load: float, total_capacity: float,
                 epsilon: float) -> bool:
    """Whether a peer with `load` requests in flight may take one more. capacity and
    total_capacity weigh the fair share, so a peer twice as big may hold twice as much."""
    bound = math.ceil((1 + epsilon) * (total_load + 1) * capacity / total_capacity)
    return load + 1 <= bound

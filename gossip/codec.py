"""Snapshot decoding and deltas, memoized.

Every node decodes each version of each peer once, and byte-identical inputs give equal
results, so the work is a pure function of the bytes. A node remembers the flat form of
each peer's latest encoding (the base of its next delta) and the deltas it serves; what a
delta makes, and its decoding, it does not: a version it already holds is dropped before
either (protocol.py), so a memo of them was only work, three memo puts a version where
one is needed (3.7% of the agent's CPU among 1000 peers, scripts/bench_agent_cpu.py).
The simulator shares one codec among all its nodes (`shared`): there each version is
applied and decoded once for the whole fleet, which is what lets it run a thousand nodes
on one core.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from loadmesh.gossip import delta
from loadmesh.gossip.snapshot import LoadSnapshot, decode


class _Memo:
    """A dict that forgets its oldest entries beyond `capacity`. An OrderedDict: a plain
    dict's first key, after many deleted from the front, is found by skipping their empty
    slots one by one (0.4 us a put at capacity 512, against 0.2)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any) -> Any:
        return self.data.get(key)

    def put(self, key: Any, value: Any) -> None:
        if len(self.data) >= self.capacity:
            self.data.popitem(last=False)
        self.data[key] = value


class ContentCodec:
    def __init__(self, capacity: int = 512, shared: bool = False) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.shared = shared
        self._snapshots = _Memo(capacity)
        self._flat = _Memo(capacity)
        self._applied = _Memo(capacity)
        self._diffs = _Memo(capacity)

    def keep_flats(self, count: int) -> None:
        """Hold the flat forms of at least `count` encodings: one a peer, each the base of
        that peer's next delta, which arrives after every other peer's version (at 1000
        peers a memo of 512 had forgotten it, and each delta flattened its base again)."""
        self._flat.capacity = max(self._flat.capacity, count)

    def snapshot(self, content: bytes) -> LoadSnapshot:
        """decode(content), remembered where shared; SnapshotError is not remembered."""
        if not self.shared:
            return decode(content)
        snap = self._snapshots.get(content)
        if snap is None:
            snap = decode(content)
            self._snapshots.put(content, snap)
        return snap

    def _flatten(self, content: bytes) -> delta.Flat:
        flat = self._flat.get(content)
        if flat is None:
            flat = delta.flatten(content)
            self._flat.put(content, flat)
        return flat

    def diff(self, base: bytes, new: bytes) -> bytes | None:
        """The delta from base to new, or None when they differ in shape."""
        key = (base, new)
        found = self._diffs.get(key)
        if found is None:
            found = delta.diff(self._flatten(base), self._flatten(new)) or b""
            self._diffs.put(key, found)
        return found or None

    def apply(self, base: bytes, changes: bytes, crc: int) -> bytes:
        """The encoding a delta makes of base; DeltaError when it does not apply."""
        key = (base, changes, crc)
        result = self._applied.get(key) if self.shared else None
        if result is None:
            result, flat = delta.apply(self._flatten(base), changes, crc)
            if self.shared:
                self._applied.put(key, result)
            self._flat.put(result, flat)  # the base of the peer's next delta
        return result

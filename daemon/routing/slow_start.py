"""Slow start: a peer that just joined or recovered takes a ramping share of traffic.

A fresh peer reports an empty queue, so every router would find it the least loaded at
once and bury it before its first snapshot under load comes back; a recovering server
also runs cold (CUDA graphs, KV cache, page cache) for a while. Like Envoy's slow start,
the peer's weight grows linearly over the window from a floor, so it is never starved
entirely (the floor) and reaches its full share only once it has proven itself.
"""

from __future__ import annotations


def ramp(now_ms: int, since_ms: int, window_ms: int, floor: float) -> float:
    """The fraction of its full weight a peer gets now, in [floor, 1]."""
    elapsed = now_ms - since_ms
    if window_ms <= 0 or elapsed >= window_ms:
        return 1.0
    return max(floor, elapsed / window_ms)

"""Token buckets: per source, so that no single address can make a node spend without
bound (HMAC checks, decoding) however fast it sends; and single ones for what a node
does on its own initiative in bursts (urgent relays).

Sources are keyed by address (source_key), not port. The set of sources is itself
bounded: beyond max_sources the least recently seen is forgotten, which only ever gives a
source a fresh, full bucket.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Hashable


class SourceLimiter:
    def __init__(self, rate_per_s: float, burst: float, max_sources: int) -> None:
        self.rate_per_ms = rate_per_s / 1000.0
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: dict[Hashable, tuple[float, int]] = {}

    def allow(self, source: Hashable, now_ms: int) -> bool:
        state = self._buckets.pop(source, None)
        if state is None:
            tokens = self.burst
            if len(self._buckets) >= self.max_sources:
                del self._buckets[next(iter(self._buckets))]
        else:
            tokens, last = state
            tokens = min(self.burst, tokens + (now_ms - last) * self.rate_per_ms)
        # Re-inserted at the end: the dict stays ordered by last use.
        if tokens < 1.0:
            self._buckets[source] = (tokens, now_ms)
            return False
        self._buckets[source] = (tokens - 1.0, now_ms)
        return True

    def __len__(self) -> int:
        return len(self._buckets)


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float) -> None:
        self.rate_per_ms = rate_per_s / 1000.0
        self.burst = burst
        self._tokens = burst
        self._last: int | None = None

    def take(self, now_ms: int) -> bool:
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now_ms - self._last) * self.rate_per_ms)
        self._last = now_ms
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


@functools.lru_cache(maxsize=65_536)
def _prefix(host: str) -> str:
    try:
        return str(ipaddress.IPv6Network((host.split("%")[0], 64), strict=False))
    except ValueError:
        return host


def source_key(addr: tuple[str, int]) -> str:
    """What a source's allowance is keyed by: its IPv4 address, or its IPv6 /64.

    Not the port: any host can send from 64,000 ports, and one IPv6 host holds a whole
    /64. Peers sharing an address (several agents on one host) share its allowance."""
    host = addr[0]
    return _prefix(host) if ":" in host else host

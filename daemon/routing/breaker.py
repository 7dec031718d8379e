"""Circuit breaker per peer, driven by what clients report back (POST /v1/feedback).

Snapshots say how loaded a peer is; they cannot say that requests to it fail from here
(a broken route, a wedged server that still gossips). Client feedback can:

    closed     requests flow; `failures` consecutive errors or timeouts open it
    open       no requests for `cooldown_ms`
    half-open  one trial request is let through; its outcome closes the breaker or opens
               it for another cool-down. A trial whose outcome never comes back is given
               up after one more cool-down, so a lost feedback cannot wedge the peer.

Feedback cannot name the request it is about, so in half-open the first outcome that
arrives decides, whichever request it belongs to. Outcomes arriving while open belong to
requests sent before the breaker opened: they say nothing new and are ignored.
"""

from __future__ import annotations

import enum


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class Breaker:
    __slots__ = ("failures", "cooldown_ms", "_consecutive", "_open_until", "_trial_until")

    def __init__(self, failures: int, cooldown_ms: int) -> None:
        if failures < 1:
            raise ValueError("failures must be at least 1")
        if cooldown_ms < 0:
            raise ValueError("cooldown_ms must not be negative")
        self.failures = failures
        self.cooldown_ms = cooldown_ms
        self._consecutive = 0
        # None while closed; otherwise open until then, half-open after.
        self._open_until: int | None = None
        # While half-open, the trial in flight blocks others until this time.
        self._trial_until = 0

    def state(self, now_ms: int) -> BreakerState:
        if self._open_until is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now_ms < self._open_until else BreakerState.HALF_OPEN

    def allows(self, now_ms: int) -> bool:
        """Whether a request may be sent now. Pure: picking the peer is claim()."""
        if self._open_until is None:
            return True
        return now_ms >= self._open_until and now_ms >= self._trial_until

    def claim(self, now_ms: int) -> None:
        """A request was routed to the peer: in half-open, it is the one trial."""
        if self._open_until is not None and now_ms >= self._open_until:
            self._trial_until = now_ms + self.cooldown_ms

    def record(self, failed: bool, now_ms: int) -> None:
        state = self.state(now_ms)
        if state is BreakerState.OPEN:
            return
        if state is BreakerState.HALF_OPEN:
            if failed:
                self._open(now_ms)
            else:
                self._open_until = None
                self._consecutive = 0
            return
        if not failed:
            self._consecutive = 0
            return
        self._consecutive += 1
        if self._consecutive >= self.failures:
            self._open(now_ms)

    def _open(self, now_ms: int) -> None:
        self._open_until = now_ms + self.cooldown_ms
        self._trial_until = 0
        self._consecutive = 0

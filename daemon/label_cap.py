"""A bound on how many values one metric label takes: the exporter's series stay bounded
whatever the traffic names.

Model names come from request bodies on the serving port, so a client chooses them: 9000
requests with distinct "model" values grew one host's exporter from 64 series to 221,248
(17.5 MB a scrape). The first `limit` values seen keep their own series for the agent's
life; every later one is counted under OTHER. Admitted once, never evicted: a counter
that moved from OTHER to a series of its own and back would go down, which Prometheus
reads as a reset.
"""

from __future__ import annotations

# Parenthesised: a model name is a client's string and may be "other"; this one is not a
# name the probes report (theirs are "-" for unknown, or what the body said).
OTHER = "(other)"


class LabelCap:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self._admitted: set[str] = set()

    def __call__(self, value: str) -> str:
        """value itself if admitted (or there is room to admit it), else OTHER."""
        if value in self._admitted:
            return value
        if len(self._admitted) < self.limit:
            self._admitted.add(value)
            return value
        return OTHER

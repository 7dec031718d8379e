"""The request rate of each session routed at this node, per model, for the few busiest
to be published (gossip/snapshot.SessionRates) and summed fleet-wide (heavy.py), with the
rate of all the model's requests routed here, sessions or not: the sum of what every node
publishes is what a session's share is taken of. Counted alike, the two move together: with
the rates the servers measure (each host's requests a second over 10 s) as the whole, a
host lost kept its last figure while the survivors served its sessions, then its clients'
requests left the survivors' windows; the whole went 20.6, 22.2, 18.2 requests a second in
20 s while the sessions' decayed counts barely moved, and in the fleet bench a session of
5.4% of the requests crossed a step of its share, went from h1 to h5 and came back 26 s
later (seed 2).

Each request adds 1 to its session's count, and counts decay with a half-life of
HALF_LIFE_MS: the rate is the count over the decay's time constant (87 s). 60 s: the fleet
bench's busiest session, 3.4 requests a second, is counted from about 300 requests, within
6% (its square root), and the fifth busiest, at 0.6 a second, from about 50, within 14%.
At 30 s, the rates' noise crossed the steps the placement compares them in (heavy.py),
and each agent logged 22-26 placements that moved a heavy session in a 90 s run.

Memory is bounded: at most max_models models (those the router knows, MAX_MODELS at
most), and per model, past MAX_TRACKED sessions, the least counted half is dropped. A
session dropped was at most the median count, far below any that is heavy;
counted again from its next request, it is back among the top within a few requests if
it is busy. Each agent sees the sessions entering through it, so a client naming a fresh
session per request (or an attacker) costs this node a dict of MAX_TRACKED entries per
model and nothing else.
"""

from __future__ import annotations

import heapq
import math
from operator import itemgetter

HALF_LIFE_MS = 60_000
_TAU_MS = HALF_LIFE_MS / math.log(2)
MAX_TRACKED = 1024
# Counts are kept scaled by exp(t / tau) from an origin, so that a request adds one term
# and nothing decays in place; the origin moves on before the scale overflows a float.
_REBASE_AFTER_MS = 200 * _TAU_MS
# Counted for less than this, the rate is taken over this long: low, rather than a
# session with 2 requests in its first second taken for 2 a second (in the fleet bench,
# 24-29 sessions were heavy in the first seconds, each placed and moved as the counts
# settled).
_MIN_COUNTED_MS = 20_000
# The model's rate is over the time counted itself, past a second's first requests.
_MIN_RATE_MS = 1_000
_COUNT = itemgetter(1)


class SessionCounts:
    def __init__(self, max_models: int) -> None:
        self._max_models = max_models
        self._counts: dict[int, dict[int, float]] = {}
        self._totals: dict[int, float] = {}
        self._origin_ms: int | None = None
        self._first_ms = 0

    def saw(self, model_id: int, session: int | None, now_ms: int) -> None:
        """A request for the model was routed here: of `session` (its key), or of none."""
        if self._origin_ms is None:
            self._origin_ms = self._first_ms = now_ms
        elif now_ms - self._origin_ms > _REBASE_AFTER_MS:
            self._rebase(now_ms)
        if model_id not in self._totals:
            if len(self._totals) >= self._max_models:
                return
            self._totals[model_id] = 0.0
            self._counts[model_id] = {}
        weight = math.exp((now_ms - self._origin_ms) / _TAU_MS)
        self._totals[model_id] += weight
        if session is None:
            return
        counts = self._counts[model_id]
        counts[session] = counts.get(session, 0.0) + weight
        if len(counts) > MAX_TRACKED:
            self._counts[model_id] = dict(heapq.nlargest(MAX_TRACKED // 2, counts.items(), key=_COUNT))

    def busiest(self, k: int, models: int, now_ms: int) -> dict[int, list[tuple[int, float]]]:
        """The k sessions of the highest rate (requests per second) of each of the
        `models` models with the most session requests."""
        if self._origin_ms is None:
            return {}
        # Over at least _MIN_COUNTED_MS: a young count weighs little in a share.
        to_rate = self._to_rate(now_ms, _MIN_COUNTED_MS)
        # Every snapshot tick: the top k of each model, not a sort of its 1024 sessions.
        chosen = heapq.nlargest(models, self._counts, key=lambda mid: sum(self._counts[mid].values()))
        return {mid: [(s, c * to_rate) for s, c in heapq.nlargest(k, self._counts[mid].items(), key=_COUNT)]
                for mid in chosen if self._counts[mid]}

    def routed_rps(self, model_id: int, now_ms: int) -> float:
        """All the model's requests routed here, per second. Over the time counted itself:
        against it, a young session's rate is as low as it was against the servers'."""
        if self._origin_ms is None or model_id not in self._totals:
            return 0.0
        return self._totals[model_id] * self._to_rate(now_ms, _MIN_RATE_MS)

    def _to_rate(self, now_ms: int, floor_ms: int) -> float:
        """What turns a count into requests a second: over the time counted so far, not the
        decay's whole memory (in its first half-life a steady rate would otherwise count
        at a fraction of itself), and at least floor_ms."""
        assert self._origin_ms is not None
        counted_ms = max(floor_ms, now_ms - self._first_ms)
        return (1000.0 / _TAU_MS * math.exp(-(now_ms - self._origin_ms) / _TAU_MS)
                / -math.expm1(-counted_ms / _TAU_MS))

    def forget_except(self, model_ids: set[int]) -> None:
        for gone in self._totals.keys() - model_ids:
            del self._totals[gone]
            del self._counts[gone]

    def _rebase(self, now_ms: int) -> None:
        assert self._origin_ms is not None
        scale = math.exp(-(now_ms - self._origin_ms) / _TAU_MS)
        floor = 1e-3  # a request ten half-lives ago counts for less
        self._totals = {mid: total * scale for mid, total in self._totals.items() if total * scale > floor}
        self._counts = {mid: {s: c * scale for s, c in self._counts[mid].items() if c * scale > floor}
                        for mid in self._totals}
        self._origin_ms = now_ms

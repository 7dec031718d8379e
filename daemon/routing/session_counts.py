"""The request rate of each session routed at this node, per model, for the few busiest
to be published (gossip/snapshot.SessionRates) and summed fleet-wide (heavy.py), and of
all the model's requests routed here, which the sessions' rates are a share of.

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
_COUNT = itemgetter(1)


class SessionCounts:
    def __init__(self, max_models: int) -> None:
        self._max_models = max_models
        self._counts: dict[int, dict[int, float]] = {}
        self._routed: dict[int, float] = {}
        self._origin_ms: int | None = None
        # When each kind of count began: a rate is taken over the time it has counted (below).
        self._sessions_from_ms: int | None = None
        self._routed_from_ms: int | None = None

    def saw(self, model_id: int, session: int, now_ms: int) -> None:
        """A request of `session` (its key) for the model was routed here."""
        weight = self._weight(now_ms)
        if self._sessions_from_ms is None:
            self._sessions_from_ms = now_ms
        counts = self._counts.get(model_id)
        if counts is None:
            if len(self._counts) >= self._max_models:
                return
            counts = self._counts[model_id] = {}
        counts[session] = counts.get(session, 0.0) + weight
        if len(counts) > MAX_TRACKED:
            self._counts[model_id] = dict(heapq.nlargest(MAX_TRACKED // 2, counts.items(), key=_COUNT))

    def routed(self, model_id: int, now_ms: int) -> None:
        """A request for the model, of a session or not, was routed here: the fleet's sum
        of these is what a session's rate is a share of (heavy.py), counted alike."""
        weight = self._weight(now_ms)
        if self._routed_from_ms is None:
            self._routed_from_ms = now_ms
        if model_id in self._routed or len(self._routed) < self._max_models:
            self._routed[model_id] = self._routed.get(model_id, 0.0) + weight

    def _weight(self, now_ms: int) -> float:
        if self._origin_ms is None:
            self._origin_ms = now_ms
        elif now_ms - self._origin_ms > _REBASE_AFTER_MS:
            self._rebase(now_ms)
        return math.exp((now_ms - self._origin_ms) / _TAU_MS)

    def _to_rate(self, from_ms: int, now_ms: int) -> float:
        """What turns a count begun at from_ms into requests per second, at now_ms."""
        assert self._origin_ms is not None
        # Over the time counted so far, not the decay's whole memory: in its first half-life
        # a steady session would otherwise count at a fraction of its rate. Each kind over
        # its own: taken over the time the requests before the first session were counted,
        # the sessions' rates came out low (in the fleet bench, whose agents route 20 s of
        # requests without sessions first, 33% low 30 s after the sessions began, 10% at
        # 90 s), and fewer sessions were heavy.
        counted_ms = max(_MIN_COUNTED_MS, now_ms - from_ms)
        return (1000.0 / _TAU_MS * math.exp(-(now_ms - self._origin_ms) / _TAU_MS)
                / -math.expm1(-counted_ms / _TAU_MS))

    def busiest(self, k: int, models: int, now_ms: int) -> dict[int, list[tuple[int, float]]]:
        """The k sessions of the highest rate (requests per second) of each of the
        `models` models with the most session requests."""
        if self._sessions_from_ms is None:
            return {}
        to_rate = self._to_rate(self._sessions_from_ms, now_ms)
        # Every snapshot tick: the top k of each model, not a sort of its 1024 sessions.
        chosen = heapq.nlargest(models, self._counts, key=lambda mid: sum(self._counts[mid].values()))
        return {mid: [(s, c * to_rate) for s, c in heapq.nlargest(k, self._counts[mid].items(), key=_COUNT)]
                for mid in chosen if self._counts[mid]}

    def routed_rates(self, now_ms: int) -> dict[int, float]:
        """Each model's requests per second routed here, sessions or not."""
        if self._routed_from_ms is None:
            return {}
        to_rate = self._to_rate(self._routed_from_ms, now_ms)
        return {mid: count * to_rate for mid, count in self._routed.items()}

    def forget_except(self, model_ids: set[int]) -> None:
        for gone in self._counts.keys() - model_ids:
            del self._counts[gone]
        for gone in self._routed.keys() - model_ids:
            del self._routed[gone]

    def _rebase(self, now_ms: int) -> None:
        assert self._origin_ms is not None
        scale = math.exp(-(now_ms - self._origin_ms) / _TAU_MS)
        floor = 1e-3  # a request ten half-lives ago counts for less
        self._counts = {mid: kept for mid, counts in self._counts.items()
                        if (kept := {s: c * scale for s, c in counts.items() if c * scale > floor})}
        self._routed = {mid: c * scale for mid, c in self._routed.items() if c * scale > floor}
        self._origin_ms = now_ms

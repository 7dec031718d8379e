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
HALF_LIFE_MS: the rate is the count over the decay's time constant (87 s), or over the
session's own time here where that is shorter (its first request counted, at least
_MIN_COUNTED_MS): a session that began a minute ago has not had the decay's whole memory
to fill. Over the node's time counted instead (until 2026-12-07), a session begun after
the node's first requests counts low until the decay's memory is full of it: by the
decay's arithmetic, the fleet bench's sessions, begun 20 s after the agents' first
requests, at 46% of their rate after 14 s, 62% after 24 s and 83% after 60 s, and after
the bench's other runs (minutes of requests) at 29% after 30 s; in a fleet up for hours,
every new session so. Heavy sessions were judged late and placed at shares below theirs,
and on seed 2 a fifth session became heavy two minutes in, its placement moving two
others. 60 s: the fleet
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
# A session counted for less than this has its rate taken over this long: low, rather than
# a session with 2 requests in its first second taken for 2 a second (in the fleet bench,
# 24-29 sessions were heavy in the first seconds, each placed and moved as the counts
# settled).
_MIN_COUNTED_MS = 20_000
# The model's rate is over the time counted itself, past a second's first requests.
_MIN_RATE_MS = 1_000
_VALUE = itemgetter(1)  # of a (session, count) or (session, rate)


def _filled(counted_ms: float) -> float:
    """The part of the decay's memory that counted_ms of a steady rate fill: a rate over
    the time counted so far rather than the whole memory (in its first half-life a steady
    rate would otherwise count at a fraction of itself) is the rate over tau divided by it."""
    return -math.expm1(-counted_ms / _TAU_MS)


class SessionCounts:
    def __init__(self, max_models: int) -> None:
        self._max_models = max_models
        self._counts: dict[int, dict[int, float]] = {}
        # Per model, when each session counted was first seen here (ms): its rate's time.
        self._firsts: dict[int, dict[int, int]] = {}
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
            self._firsts[model_id] = {}
        weight = math.exp((now_ms - self._origin_ms) / _TAU_MS)
        self._totals[model_id] += weight
        if session is None:
            return
        counts, firsts = self._counts[model_id], self._firsts[model_id]
        count = counts.get(session)
        if count is None:
            count = 0.0
            firsts[session] = now_ms
        counts[session] = count + weight
        if len(counts) > MAX_TRACKED:
            kept = self._counts[model_id] = dict(heapq.nlargest(MAX_TRACKED // 2, counts.items(), key=_VALUE))
            self._firsts[model_id] = {key: firsts[key] for key in kept}

    def busiest(self, k: int, models: int, now_ms: int) -> dict[int, list[tuple[int, float]]]:
        """The k sessions of the highest rate (requests per second) of each of the
        `models` models with the most session requests."""
        if self._origin_ms is None:
            return {}
        scale = self._per_tau(now_ms)
        chosen = heapq.nlargest(models, self._counts, key=lambda mid: sum(self._counts[mid].values()))
        out: dict[int, list[tuple[int, float]]] = {}
        for mid in chosen:
            firsts = self._firsts[mid]
            # Each over its own time here, at least _MIN_COUNTED_MS (a young count weighs
            # little in a share); every snapshot tick, the top k, not a sort of 1024.
            rates = ((s, c * scale / _filled(max(_MIN_COUNTED_MS, now_ms - firsts[s])))
                     for s, c in self._counts[mid].items())
            if top := heapq.nlargest(k, rates, key=_VALUE):
                out[mid] = top
        return out

    def routed_rps(self, model_id: int, now_ms: int) -> float:
        """All the model's requests routed here, per second. Over the time counted itself:
        against it, a young session's rate is as low as it was against the servers'."""
        if self._origin_ms is None or model_id not in self._totals:
            return 0.0
        return (self._totals[model_id] * self._per_tau(now_ms)
                / _filled(max(_MIN_RATE_MS, now_ms - self._first_ms)))

    def _per_tau(self, now_ms: int) -> float:
        """What turns a count (scaled from the origin) into requests a second over the
        decay's whole memory."""
        assert self._origin_ms is not None
        return 1000.0 / _TAU_MS * math.exp(-(now_ms - self._origin_ms) / _TAU_MS)

    def forget_except(self, model_ids: set[int]) -> None:
        for gone in self._totals.keys() - model_ids:
            del self._totals[gone]
            del self._counts[gone]
            del self._firsts[gone]

    def _rebase(self, now_ms: int) -> None:
        assert self._origin_ms is not None
        scale = math.exp(-(now_ms - self._origin_ms) / _TAU_MS)
        floor = 1e-3  # a request ten half-lives ago counts for less
        self._totals = {mid: total * scale for mid, total in self._totals.items() if total * scale > floor}
        self._counts = {mid: {s: c * scale for s, c in self._counts[mid].items() if c * scale > floor}
                        for mid in self._totals}
        self._firsts = {mid: {s: self._firsts[mid][s] for s in counts} for mid, counts in self._counts.items()}
        self._origin_ms = now_ms

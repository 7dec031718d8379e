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
HALF_LIFE_MS: a rate is a count over the time it was counted in, that time weighted by
the same decay. The model's time counts while the model is served here: a gap between
two of its requests long past the usual (IDLE_MS, _SPELL usual gaps) counts, once the
later one comes, as one usual gap at the rate served before it (until then all of it, so
that a model no longer routed here falls out of the fleet's sums). A session's time is
the model's since the session's first request here, at least _MIN_COUNTED_MS: a session
that began a minute ago has not had the decay's whole memory to fill, and a session's
share of the model's requests is taken over one time. Over the node's time counted
instead (until 2026-12-07), a session begun after the node's first requests counted low
until the decay's memory was full of it: by the decay's arithmetic, the fleet bench's
sessions, begun 20 s after the agents' first requests, at 46% of their rate after 14 s,
62% after 24 s and 83% after 60 s; heavy sessions were judged late and placed at shares
below theirs, and on seed 2 a fifth session became heavy two minutes in, its placement
moving two others. With idle time counted as the model's (until 2026-12-08), the model
after minutes without requests counted low the same way: in the full fleet bench, whose
agents route nothing while the other policies run, the sessions' shares read 1.7-2.3
times theirs 20-60 s after the sessions began, sessions were heavy that were not (7
placed where 3-5 are; 662-744 requests answered as heavy sessions' where 510-538 are),
and 84-88% of a session's requests stayed on its host where 90-94% do. 60 s: the fleet
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
# Times counted are kept alike: the integral of the same scale over the time.
_REBASE_AFTER_MS = 200 * _TAU_MS
# A gap between two of a model's requests here longer than IDLE_MS and than _SPELL usual
# gaps, once the later one came, was not time the model was served here (the fleet bench's
# agents between runs, a fleet at night), and its rate is taken over the time it was.
# Requests arriving at random at any steady rate leave such a gap at most once in 22,000
# (e^-10, at a second or more apart; at 4 a second e^-40); gaps of 10 s only, a model at
# one request in 5 s read 1.4 times its rate (tests/test_routing_heavy.py).
IDLE_MS = 10_000
_SPELL = 10
# A session counted for less than this has its rate taken over this long: low, rather than
# a session with 2 requests in its first second taken for 2 a second (in the fleet bench,
# 24-29 sessions were heavy in the first seconds, each placed and moved as the counts
# settled).
_MIN_COUNTED_MS = 20_000
# The model's rate is over the time counted itself, past a second's first requests.
_MIN_RATE_MS = 1_000
_VALUE = itemgetter(1)  # of a (session, count) or (session, rate)


class _Model:
    """One model's counts, scaled from the origin: all its requests, each session's, the
    time counted up to its last request, and the time counted when each session began."""

    __slots__ = ("total", "counts", "began", "counted", "last_ms")

    def __init__(self, now_ms: int) -> None:
        self.total = 0.0
        self.counts: dict[int, float] = {}
        self.began: dict[int, float] = {}
        self.counted = 0.0
        self.last_ms = now_ms

    def scaled(self, scale: float, floor: float) -> None:
        """Everything times scale, less the sessions whose count falls to floor."""
        self.total *= scale
        self.counted *= scale
        self.counts = {s: c * scale for s, c in self.counts.items() if c * scale > floor}
        self.began = {s: self.began[s] * scale for s in self.counts}


class SessionCounts:
    def __init__(self, max_models: int) -> None:
        self._max_models = max_models
        self._models: dict[int, _Model] = {}
        self._origin_ms: int | None = None

    def saw(self, model_id: int, session: int | None, now_ms: int) -> None:
        """A request for the model was routed here: of `session` (its key), or of none."""
        if self._origin_ms is None:
            self._origin_ms = now_ms
        elif now_ms - self._origin_ms > _REBASE_AFTER_MS:
            self._rebase(now_ms)
        model = self._models.get(model_id)
        if model is None:
            if len(self._models) >= self._max_models:
                return
            model = self._models[model_id] = _Model(now_ms)
        gap = now_ms - model.last_ms
        usual = model.counted / model.total if model.counted > 0 else IDLE_MS
        if gap > max(IDLE_MS, _SPELL * usual):
            # The spell counts as one usual gap at the rate served before it. Counted as
            # IDLE_MS, ten seconds without a request read a model resumed at 4 a second
            # after five idle minutes at 2.9 a second 20 s on, 3.2 30 s on (3.96 and 3.97
            # as one gap).
            gap = usual
        model.counted += self._span(now_ms - gap, now_ms)
        model.last_ms = now_ms
        weight = math.exp((now_ms - self._origin_ms) / _TAU_MS)
        model.total += weight
        if session is None:
            return
        count = model.counts.get(session)
        if count is None:
            count = 0.0
            model.began[session] = model.counted
        model.counts[session] = count + weight
        if len(model.counts) > MAX_TRACKED:
            model.counts = dict(heapq.nlargest(MAX_TRACKED // 2, model.counts.items(), key=_VALUE))
            model.began = {key: model.began[key] for key in model.counts}

    def busiest(self, k: int, models: int, now_ms: int) -> dict[int, list[tuple[int, float]]]:
        """The k sessions of the highest rate (requests per second) of each of the
        `models` models with the most session requests."""
        if self._origin_ms is None:
            return {}
        chosen = heapq.nlargest(models, self._models, key=lambda mid: sum(self._models[mid].counts.values()))
        least = self._span(now_ms - _MIN_COUNTED_MS, now_ms)
        out: dict[int, list[tuple[int, float]]] = {}
        for mid in chosen:
            model = self._models[mid]
            counted = self._counted(model, now_ms)
            # Each over the model's time since it began here, at least _MIN_COUNTED_MS (a
            # young count weighs little in a share); every snapshot tick, the top k, not a
            # sort of 1024.
            rates = ((s, 1000.0 * c / max(least, counted - model.began[s])) for s, c in model.counts.items())
            if top := heapq.nlargest(k, rates, key=_VALUE):
                out[mid] = top
        return out

    def routed_rps(self, model_id: int, now_ms: int) -> float:
        """All the model's requests routed here, per second, over the time counted."""
        model = self._models.get(model_id)
        if model is None:
            return 0.0
        counted = max(self._span(now_ms - _MIN_RATE_MS, now_ms), self._counted(model, now_ms))
        return 1000.0 * model.total / counted

    def _counted(self, model: _Model, now_ms: int) -> float:
        """The model's time counted until now, all of it since its last request: the rates
        of a model no longer routed here fall as its count decays, and the fleet's sums
        (router._place_heavy) hold what this node routes now."""
        return model.counted + self._span(model.last_ms, now_ms)

    def _span(self, start_ms: float, end_ms: float) -> float:
        """The time from start_ms to end_ms, weighted as a count made in it is (scaled from
        the origin): a steady rate's count over it is the rate times it."""
        assert self._origin_ms is not None
        if end_ms <= start_ms:
            return 0.0
        return (_TAU_MS * math.exp((start_ms - self._origin_ms) / _TAU_MS)
                * math.expm1((end_ms - start_ms) / _TAU_MS))

    def forget_except(self, model_ids: set[int]) -> None:
        for gone in self._models.keys() - model_ids:
            del self._models[gone]

    def _rebase(self, now_ms: int) -> None:
        assert self._origin_ms is not None
        scale = math.exp(-(now_ms - self._origin_ms) / _TAU_MS)
        floor = 1e-3  # a request ten half-lives ago counts for less
        for mid in [mid for mid, model in self._models.items() if model.total * scale <= floor]:
            del self._models[mid]
        for model in self._models.values():
            model.scaled(scale, floor)
        self._origin_ms = now_ms

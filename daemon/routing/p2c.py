"""Weighted d-choices: draw d distinct candidates with probability proportional to their
weight, send to the one with the lowest cost.

Why not the arg-min: every host's view of the fleet is 0.5 to a few seconds old, and all
hosts see nearly the same one, so the arg-min sends the whole fleet's traffic to the same
peer until the next snapshot shows it buried; then all move to the next one (Mitzenmacher,
"How useful is old information?", 2000). Two random choices keep most of the benefit of
knowing the loads while spreading each host's traffic, and each host draws differently.

Two paths, so that the common case costs a few draws rather than a pass over the peers:
`draw` samples from a weight table built when the peer table changes and rejects what the
request cannot use (excluded, circuit open, stale, a slow-start coin toss); when
rejections pile up it gives up and the caller filters exactly and uses `draw_exact`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class WeightedTable(Generic[T]):
    """Items with fixed positive weights, drawn with replacement in O(log n)."""

    __slots__ = ("items", "_cumulative", "_total")

    def __init__(self, items: Sequence[T], weights: Sequence[float]) -> None:
        # (0.0).__lt__ is False for NaN as for 0 and below; mapped, the test runs in C:
        # a model whose candidates' rates moved makes its table again before each draw
        # that follows an update (ModelCandidates.weights).
        if len(items) != len(weights) or not all(map((0.0).__lt__, weights)):
            raise ValueError("need one positive weight per item")
        self.items = list(items)
        self._cumulative = list(itertools.accumulate(weights))
        self._total = self._cumulative[-1] if self._cumulative else 0.0

    def draw(self, rng: random.Random, count: int, accept: Callable[[T], bool],
             tries: int) -> list[T] | None:
        """`count` distinct accepted items, or None when `tries` draws did not find them
        (too few acceptable items, or bad luck): the caller then filters exactly."""
        if not self.items:
            return None
        found: list[T] = []
        for _ in range(tries):
            # min(): random() * total can round up to total itself.
            i = min(bisect_right(self._cumulative, rng.random() * self._total), len(self.items) - 1)
            item = self.items[i]
            if item in found or not accept(item):
                continue
            found.append(item)
            if len(found) == count:
                return found
        return None


def draw_exact(rng: random.Random, items: Sequence[T], weights: Sequence[float], count: int) -> list[T]:
    """`count` distinct items (all of them if fewer), drawn without replacement with
    probability proportional to weight (Efraimidis and Spirakis: the largest
    u ** (1 / w)). All of them still come in a drawn order: the first two are the d
    choices, and a tie between them goes to the first."""
    keyed = ((rng.random() ** (1.0 / w), i) for i, w in enumerate(weights))
    return [items[i] for _, i in heapq.nlargest(count, keyed)]


def order(drawn: Sequence[T], choices: int, cost: Callable[[T], float]) -> list[T]:
    """The drawn items as [winner, *alternatives]: the winner is the cheapest of the first
    `choices` drawn (the d choices proper); the others follow cheapest first, as retry
    targets. Ties keep the draw order, which is random."""
    compared = sorted(drawn[:choices], key=cost)
    return [compared[0], *sorted([*compared[1:], *drawn[choices:]], key=cost)]


class OwnShare:
    """How many requests the whole fleet sends for each one this node sends.

    This node sees its own requests the moment it routes them; the other hosts' reach it
    only with the next snapshot, a second or more later. But every host runs the same
    decision on nearly the same view, so what this node sends to a peer since its
    snapshot is a sample of what all hosts send it: scaled by the ratio of the fleet's
    request rate (the sum of the peers' rps in their snapshots) to this node's own rate,
    it estimates everyone's. That is what stops the herd: when a peer looks idle in a
    stale view, this node's own sends to it, scaled, make it look as busy as the whole
    fleet is making it. The ratio is capped, because one send then counts that many times
    and the estimate gets noisy; it is at least 1, since this node's sends are known.

    The own rate is an exponentially decaying count of decisions: with a steady rate r,
    the count settles at r * half_life / ln 2.
    """

    __slots__ = ("half_life_ms", "cap", "_count", "_at")

    def __init__(self, half_life_ms: int, cap: float) -> None:
        if half_life_ms <= 0 or cap < 1:
            raise ValueError("need half_life_ms > 0 and cap >= 1")
        self.half_life_ms = half_life_ms
        self.cap = cap
        self._count = 0.0
        self._at = 0

    def _decayed(self, now_ms: int) -> float:
        # A clock that went back adds no time rather than growing the count.
        return self._count * math.exp2(-max(0, now_ms - self._at) / self.half_life_ms)

    def sent(self, now_ms: int) -> None:
        self._count = self._decayed(now_ms) + 1.0
        self._at = max(self._at, now_ms)

    def multiplier(self, fleet_rps: float, now_ms: int) -> float:
        own_rps = self._decayed(now_ms) * math.log(2) * 1000 / self.half_life_ms
        if own_rps <= 0:
            return self.cap
        return min(self.cap, max(1.0, fleet_rps / own_rps))

"""A smaller batch's share of the sessions' ring (daemon/routing/pooling.py)."""

from __future__ import annotations

import heapq
import math
import random

from dataclasses import replace

import pytest

from loadmesh.daemon.routing import PeerInput
from loadmesh.daemon.routing.heavy import ENTER
from loadmesh.daemon.routing.pooling import DESIGN_LOAD, pooling_factor
from loadmesh.daemon.routing.ring import hash64
from loadmesh.gossip.snapshot import SessionRates
from loadmesh.model_id import model_id
from test_routing_router import MODEL, NOW, figures, router


def in_flight_per_slot(slots: int, utilization: float, sigma: float, seed: int) -> float:
    """Requests in service and waiting per slot of a FIFO queue of `slots` servers,
    Poisson arrivals, lognormal service of mean 1 (Little's law over 200,000 requests)."""
    rng = random.Random(seed)
    mu = -sigma ** 2 / 2
    free = [0.0] * slots
    t = held = 0.0
    n = 200_000
    for _ in range(n):
        t += rng.expovariate(slots * utilization)
        done = max(t, heapq.heappop(free)) + rng.lognormvariate(mu, sigma)
        heapq.heappush(free, done)
        held += done - t
    return held / t / slots


# The fleet bench's tokens (a coefficient of variation near 1, as exponential service has),
# and a heavier tail (1.3).
@pytest.mark.parametrize("sigma", [0.8, 1.0])
def test_at_the_factor_a_half_batch_queues_as_the_full_one(sigma: float) -> None:
    factor = pooling_factor(4, 8)
    full = in_flight_per_slot(8, DESIGN_LOAD, sigma, seed=1)
    assert in_flight_per_slot(4, DESIGN_LOAD * factor, sigma, seed=2) == pytest.approx(full, rel=0.06)
    assert in_flight_per_slot(4, DESIGN_LOAD, sigma, seed=2) > 1.2 * full  # at its plain share


def test_the_factor_is_one_for_the_largest_and_near_one_for_large_pools() -> None:
    assert pooling_factor(8, 8) == pooling_factor(16, 8) == 1.0
    assert pooling_factor(4, 8) == pytest.approx(0.905, abs=0.005)
    assert pooling_factor(2, 8) < pooling_factor(4, 8) < pooling_factor(6, 8) < 1
    assert pooling_factor(128, 256) == 1.0  # 64 slots and more: within a point of 1
    assert pooling_factor(63, 128) > 0.99


def test_a_peer_publishing_a_huge_batch_costs_a_bounded_factor() -> None:
    # A snapshot's running count is a u32: the factor must not walk 4 billion servers.
    assert pooling_factor(4, 2**32 - 1) == pooling_factor(4, 1024) < pooling_factor(4, 8)


def half_batch_fleet(version: int, queueing: bool, sessions: tuple[SessionRates, ...] = ()) -> list[PeerInput]:
    """A full peer, one at half its pace and one with half its batch ("half" queues at 4
    streams once `queueing`); "a" publishes `sessions`."""
    a = figures("a", version=version, in_flight=8, running=8, ttft_p99_ms=50, pace_ms=20)
    return [replace(a, snapshot=replace(a.snapshot, sessions=sessions)),
            figures("slow", version=version, in_flight=8, running=8, ttft_p99_ms=50, pace_ms=40),
            figures("half", version=version, in_flight=4 + 5 * queueing, running=4,
                    waiting=5 * queueing, ttft_p99_ms=1000 if queueing else 50, pace_ms=20)]


def test_a_half_batch_holds_less_than_half_the_points_a_half_pace_exactly_half() -> None:
    r = router(half_batch_fleet(1, False))
    r.update(half_batch_fleet(2, True), NOW)
    points = r.light_points(model_id(MODEL))
    assert points == {"a": 160, "slow": 80, "half": math.floor(80 * pooling_factor(4, 8) + 0.5)}


def test_a_session_is_heavy_by_the_smallest_share_before_the_pooling_factor() -> None:
    # "half" holds a quarter of the weights before the factor (80 of 320) and 72 of 312
    # points after it: the mark is ENTER of the quarter, 8.3 of the 100 requests a second,
    # not of the 23%, 7.7. A session of 8 is heavy only by the latter.
    mid = model_id(MODEL)
    heavy, near = (hash64(s) >> 32 for s in ("heavy", "near"))
    rates = (SessionRates(mid, tuple(sorted([(heavy, 9.0), (near, 8.0)])), routed_rps=100.0),)
    # Published before "half" showed its batch, 8 would be heavy already (and stay so).
    r = router(half_batch_fleet(1, False))
    r.update(half_batch_fleet(2, True, rates), NOW + 1000)  # placed once a second
    assert ENTER * 80 / 320 * 100 > 8.0 > ENTER * 72 / 312 * 100
    assert r.heavy.host(mid, heavy) is not None
    assert r.heavy.host(mid, near) is None and r.heavy.weighs(mid, near)

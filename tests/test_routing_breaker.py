"""The per-peer circuit breaker: closed, open, half-open, closed again."""

from __future__ import annotations

import pytest

from loadmesh.daemon.routing.breaker import Breaker, BreakerState

COOLDOWN = 10_000


def opened(at: int = 0) -> Breaker:
    b = Breaker(failures=3, cooldown_ms=COOLDOWN)
    for _ in range(3):
        b.record(True, at)
    return b


def test_opens_after_three_consecutive_failures_only() -> None:
    b = Breaker(failures=3, cooldown_ms=COOLDOWN)
    b.record(True, 0)
    b.record(True, 1)
    assert b.state(2) is BreakerState.CLOSED and b.allows(2)
    b.record(True, 2)
    assert b.state(3) is BreakerState.OPEN
    assert not b.allows(3)


def test_a_success_resets_the_count() -> None:
    b = Breaker(failures=3, cooldown_ms=COOLDOWN)
    for outcome in (True, True, False, True, True):
        b.record(outcome, 0)
    assert b.state(0) is BreakerState.CLOSED


def test_half_open_after_cooldown_lets_one_trial_through() -> None:
    b = opened()
    assert not b.allows(COOLDOWN - 1)
    assert b.state(COOLDOWN) is BreakerState.HALF_OPEN
    assert b.allows(COOLDOWN)
    b.claim(COOLDOWN)
    assert not b.allows(COOLDOWN + 1)  # the trial is out: nobody else


def test_successful_trial_closes() -> None:
    b = opened()
    b.claim(COOLDOWN)
    b.record(False, COOLDOWN + 50)
    assert b.state(COOLDOWN + 51) is BreakerState.CLOSED
    assert b.allows(COOLDOWN + 51)
    # Closed again means counting from zero: two failures do not reopen it.
    b.record(True, COOLDOWN + 60)
    b.record(True, COOLDOWN + 61)
    assert b.state(COOLDOWN + 62) is BreakerState.CLOSED


def test_failed_trial_reopens_for_a_new_cooldown() -> None:
    b = opened()
    b.claim(COOLDOWN)
    b.record(True, COOLDOWN + 50)
    assert b.state(COOLDOWN + 51) is BreakerState.OPEN
    assert not b.allows(2 * COOLDOWN + 49)
    assert b.allows(2 * COOLDOWN + 50)


def test_lost_trial_is_given_up_after_another_cooldown() -> None:
    b = opened()
    b.claim(COOLDOWN)
    assert not b.allows(2 * COOLDOWN - 1)
    assert b.allows(2 * COOLDOWN)


def test_outcomes_while_open_are_ignored() -> None:
    b = opened()
    b.record(False, 100)  # a request sent before it opened
    assert b.state(101) is BreakerState.OPEN


@pytest.mark.parametrize("failures, cooldown", [(0, 1), (1, -1)])
def test_rejects_bad_settings(failures: int, cooldown: int) -> None:
    with pytest.raises(ValueError):
        Breaker(failures, cooldown)

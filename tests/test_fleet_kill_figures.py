"""The fleet bench's figures of sessions (scripts/bench_fleet.py): what moved after a kill,
and, over an equal window before it, what the bands moved anyway; how often a second
agent, asked at the same moment, named the same peer."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from script_modules import script


def bench_fleet() -> ModuleType:
    return script("bench_fleet")


def row(t: float, session: str, host: str) -> dict[str, Any]:
    return {"t": t, "session": session, "host": host, "entry": "h1", "reason": "session"}


def test_churn_counts_equal_windows_on_either_side_of_the_kill() -> None:
    # Sessions from t=30, the kill at 60, the run to 90: windows of 16 s, [44, 60) with
    # homes from [30, 40), and [64, 80) with homes from [50, 60).
    rows = [row(t, "s1", "h1") for t in range(30, 90)]
    rows += [row(t, "s2", "h2" if t < 50 else "h4") for t in range(30, 90)]  # moved before
    rows += [row(t, "s3", "h3") for t in range(30, 60)]  # on the killed host: not counted
    rows += [row(t, "s4", "h4" if t < 70 else "h5") for t in range(30, 90)]  # moved after
    window, after, before = bench_fleet().churn(rows, 60.0, "h3", 30.0)
    assert window == 16
    # Before: s1 and s4 at home, s2 away from 50 (10 of its 16); after: s1 and s2 (now
    # at home on h4) stay, s4 away from 70 (10 of 16).
    assert before == 10 / 48
    assert after == 10 / 48


def test_a_request_sent_past_a_queueing_host_moves_no_session() -> None:
    # s1 at home on h1 but for two requests sent past it after the kill; s2 moved to h4.
    rows = [row(t, "s1", "h1") for t in range(30, 90)]
    rows += [row(t, "s2", "h2" if t < 70 else "h4") for t in range(30, 90)]
    for r in rows:
        if r["session"] == "s1" and r["t"] in (66, 75):
            r["host"], r["reason"] = "h2", "session's peer queueing: the next along its ring"
    fleet = bench_fleet()
    assert fleet.churn(rows, 60.0, "h3", 30.0)[1] == 12 / 32
    assert fleet.churn(fleet.homed(rows), 60.0, "h3", 30.0)[1] == 10 / 30


def test_churn_has_no_windows_without_room_before_the_kill() -> None:
    rows = [row(t, "s1", "h1") for t in range(30, 90)]
    assert bench_fleet().churn(rows, 40.0, "h3", 30.0) == (0.0, None, None)


def test_agreement_is_of_the_requests_whose_second_agent_answered() -> None:
    rows = [{**row(t, "s1", "h1"), "twin": "h2", "twin_node": "h1" if t % 4 else "h2"}
            for t in range(30, 50)]
    rows += [{**row(t, "s2", "h3"), "twin": "h3", "twin_node": ""} for t in range(30, 50)]  # killed
    rows += [row(t, "s3", "h1") for t in range(30, 50)]  # no second agent asked
    # Of s1's 20 requests in [30, 50), those at t divisible by 4 were answered otherwise.
    assert bench_fleet().agreement(rows, 30.0, 50.0) == (15 / 20, 20)
    assert bench_fleet().agreement(rows, 50.0, 60.0) == (None, 0)

"""The routing-quality simulator, on a short run: shape of the report, determinism, and
the ordering any sound model must show."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loadmesh.daemon.routing.simulator import POLICIES, SimConfig, goal_checks, simulate

SHORT = SimConfig(duration_s=90.0, warmup_s=15.0)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return simulate(loads=(0.85,), seed=3, config=SHORT)


def test_report_has_the_fixed_keys(report: dict[str, Any]) -> None:
    json.dumps(report)  # JSON-ready as is
    assert [r["policy"] for r in report["results"]] == list(POLICIES)
    for r in report["results"]:
        assert set(r) == {"policy", "load", "p50_ms", "p99_ms", "wait_p99_ms"}
        assert r["load"] == 0.85 and 0 < r["p50_ms"] <= r["p99_ms"]
        assert 0 <= r["wait_p99_ms"] < r["p99_ms"]
    assert {h["policy"] for h in report["herding"]} == set(POLICIES)
    ages = report["view_age_ms"][0]
    # The routers decide on views as old as gossip makes them: half a second and more.
    assert 500 <= ages["p50"] <= ages["p99"]


def test_policies_rank_as_information_allows(report: dict[str, Any]) -> None:
    p99 = {r["policy"]: r["p99_ms"] for r in report["results"]}
    swing = {h["policy"]: h["swing_p95"] for h in report["herding"]}
    assert p99["jsq_oracle"] <= p99["loadmesh"] < p99["p2c"] < p99["round_robin"]
    # The queue oracle is the one that knows the queues: nothing waits less for a slot.
    wait = {r["policy"]: r["wait_p99_ms"] for r in report["results"]}
    assert wait["jsq_queue"] == min(wait.values())
    # The arg-min of stale scores herds: it swings servers far more than anything else.
    assert swing["least_loaded"] > 3 * max(v for k, v in swing.items() if k != "least_loaded")
    checks = goal_checks(report)
    assert checks["round_robin_vs_p99_ok"] and checks["no_herding_ok"]


def test_same_seed_same_result() -> None:
    config = SimConfig(duration_s=20.0, warmup_s=5.0)
    runs = [simulate(loads=(0.7,), policies=("loadmesh", "p2c"), seed=5, config=config) for _ in range(2)]
    assert runs[0] == runs[1]
    other = simulate(loads=(0.7,), policies=("loadmesh", "p2c"), seed=6, config=config)
    assert other["results"] != runs[0]["results"]


def test_rejects_unknown_policy_and_bad_load() -> None:
    with pytest.raises(ValueError):
        simulate(policies=("nope",), config=SHORT)
    with pytest.raises(ValueError):
        simulate(loads=(0.0,), config=SHORT)

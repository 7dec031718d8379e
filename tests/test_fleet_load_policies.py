"""The load-blind baselines of scripts/fleet_load.py that the fleet bench measures the
sessions' occupancy against: capacity (each request) and capacity_sessions (each session,
for good), both in proportion to each server's capacity."""

from __future__ import annotations

from collections import Counter
from types import ModuleType
from typing import Any

import pytest
from script_modules import script

HOSTS = {"h1": 8 / 20, "h2": 8 / 20, "h4": 8 / 40, "h5": 4 / 20}  # slots over step_ms


def fleet_load() -> ModuleType:
    return script("fleet_load")


def policy(kind: str, seed: int = 1) -> Any:
    p = fleet_load().Policy({"hosts": [{"name": n, "url": ""} for n in HOSTS], "policy": kind,
                             "seed": seed})
    p.speed = dict(HOSTS)
    return p


def shares(counts: Counter[str]) -> dict[str, float]:
    return {n: counts[n] / sum(counts.values()) for n in HOSTS}


def test_capacity_sends_each_request_in_proportion_to_capacity() -> None:
    p = policy("capacity")
    got = shares(Counter(p.pick(f"session-{i % 3}") for i in range(20_000)))
    total = sum(HOSTS.values())
    assert got == pytest.approx({n: c / total for n, c in HOSTS.items()}, abs=0.015)


def test_capacity_sessions_keeps_each_session_on_one_host_in_every_run() -> None:
    first, second = policy("capacity_sessions", seed=1), policy("capacity_sessions", seed=2)
    sessions = [f"session-{i}" for i in range(4000)]
    hosts = {s: first.pick(s) for s in sessions}
    assert all(first.pick(s) == hosts[s] == second.pick(s) for s in sessions[:500])
    total = sum(HOSTS.values())
    assert shares(Counter(hosts.values())) == pytest.approx(
        {n: c / total for n, c in HOSTS.items()}, abs=0.025)

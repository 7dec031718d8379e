"""Routing a real fleet: three hosts in namespaces, each an LLM server on vLLM's stack with
a continuously batching engine and a real agent (probes on its interface, gossip over the
bridge); one client process asks the entry host's agent for every request, sends it
there and reports back. One run of open-loop arrivals, with events along it:

    0 s   three equal hosts             no host takes more than 60% of any 2 s bin
                                        (of 20 requests or more)
    15 s  host c decodes 4x slower      within 5 s it gets less than its fair share
    25 s  c back to speed; b answers    b gets less than its fair share within 5 s; c,
          429 to everything             idle now, is chosen again within 10 s
    35 s  b accepts again               b, idle, is chosen again within 10 s

The agents run shipped defaults: no static_models, so every agent names every host
before the first request only because each learnt its server's model from /v1/models.
The same arrivals and the shares are what scripts/bench_fleet.py measures on five hosts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet import Host, arrivals, capacity_rps, fleet, share, worst_bin
from nettopo import leftovers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

HOSTS = (Host("a", 8, 20), Host("b", 8, 20), Host("c", 8, 20))
SLOW_AT, REJECT_AT, BACK_AT, END = 15.0, 25.0, 35.0, 45.0
LOAD = 0.6
SEED = 11


@pytest.fixture(scope="module")
def run() -> Iterator[list[dict[str, Any]]]:
    plan = arrivals(LOAD * capacity_rps(HOSTS, SEED), END, SEED, len(HOSTS))
    events = [
        {"t": SLOW_AT, "host": 2, "engine": {"step_ms": 80}},
        {"t": REJECT_AT, "host": 2, "engine": {"step_ms": 20}},
        {"t": REJECT_AT, "host": 1, "engine": {"max_waiting": 0}},
        {"t": BACK_AT, "host": 1, "engine": {"max_waiting": 64}},
    ]
    with tempfile.TemporaryDirectory(prefix="lm-fleet-test-") as tmp:
        with fleet(HOSTS, Path(tmp), prefix="lmq") as f:
            load, _ = f.start_load({"policy": "loadmesh", "arrivals": plan, "seed": SEED,
                                    "events": events})
            rows = f.result(load, END + 120)
    assert leftovers("lmq") == []
    yield rows


def served(rows: list[dict[str, Any]], host: str, start_s: float, end_s: float) -> int:
    return sum(r["host"] == host for r in rows if start_s <= r["t"] < end_s)


def test_every_request_is_routed_and_answered_while_the_fleet_is_healthy(run: list[dict[str, Any]]) -> None:
    # Sent a second before "b" stops queueing: a row's t is when its client asked
    # /v1/best, and one asked at 24.96 s, sent to b, failed in a CI run: it reached b
    # after the change.
    before = [r for r in run if r["t"] < REJECT_AT - 1.0]
    assert before and all(r["status"] == 200 for r in before), \
        [r for r in before if r["status"] != 200][:3]


def test_equal_hosts_no_host_takes_more_than_60_percent_of_a_2s_bin(run: list[dict[str, Any]]) -> None:
    # Bins of at least 20 requests: at this load some bins hold 15, and 10 of 15 on one
    # host is chance, not herding (2.6% of such bins by uniform choice; after the opening
    # burst even the JSQ oracle puts 7 of the 2-4 s bin's 15 on one host). Herding puts
    # a whole snapshot interval's requests on one host, in every bin.
    assert worst_bin(run, 0.0, SLOW_AT, least=20) <= 0.6
    assert all(share(run, h.name, 0.0, SLOW_AT) > 0.2 for h in HOSTS)


def test_a_host_slowed_4x_gets_less_than_its_share_within_5s(run: list[dict[str, Any]]) -> None:
    assert share(run, "c", SLOW_AT + 5, REJECT_AT) < 1 / 3 * 0.75


def test_a_host_answering_429_gets_less_than_its_share_within_5s(run: list[dict[str, Any]]) -> None:
    assert share(run, "b", REJECT_AT + 5, BACK_AT) < 1 / 3 * 0.5


def test_an_idle_host_is_chosen_again_within_10s(run: list[dict[str, Any]]) -> None:
    assert served(run, "c", REJECT_AT, REJECT_AT + 10) > 0
    assert served(run, "b", BACK_AT, BACK_AT + 10) > 0
    # Chosen for real, not once: a share of the last seconds' traffic.
    assert share(run, "c", REJECT_AT + 5, BACK_AT) > 0.25
    assert share(run, "b", BACK_AT + 5, END) > 0.1

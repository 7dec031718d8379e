"""Consistent hashing with bounded loads."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from daemon.routing.ring import HashRing, hash64, within_bound

PEERS = [f"gpu-{i:02d}" for i in range(10)]
SESSIONS = [f"session-{i}" for i in range(20_000)]


def owners(ring: HashRing) -> dict[str, str]:
    return {s: next(ring.walk(s)) for s in SESSIONS}


def test_hash_is_stable_across_processes() -> None:
    # Every host must put a session on the same peer: no per-process salt.
    assert hash64("session-1") == 0xAE49BD2CD463E7AC


def test_walk_visits_every_peer_once() -> None:
    ring = HashRing(PEERS, 160)
    walk = list(ring.walk("x"))
    assert sorted(walk) == sorted(PEERS)
    assert list(HashRing([], 160).walk("x")) == []


def test_removing_a_peer_moves_only_its_sessions_to_the_next_on_the_ring() -> None:
    full = HashRing(PEERS, 160)
    before = owners(full)
    after = owners(HashRing([p for p in PEERS if p != "gpu-03"], 160))
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == "gpu-03"}
    for s in moved:
        assert after[s] == list(full.walk(s))[1]


def test_adding_a_peer_takes_sessions_only_for_itself() -> None:
    before = owners(HashRing(PEERS, 160))
    after = owners(HashRing([*PEERS, "gpu-new"], 160))
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert moved and all(after[s] == "gpu-new" for s in moved)
    assert len(moved) < 2 * len(SESSIONS) / (len(PEERS) + 1)


def test_vnodes_spread_sessions_evenly() -> None:
    counts = Counter(owners(HashRing(PEERS, 160)).values())
    fair = len(SESSIONS) / len(PEERS)
    assert all(0.7 * fair < c < 1.3 * fair for c in counts.values()), counts


@pytest.mark.parametrize("epsilon", [0.1, 0.25, 1.0])
def test_bounded_loads_cap_every_peer(epsilon: float) -> None:
    ring = HashRing(PEERS, 160)
    load = dict.fromkeys(PEERS, 0)
    for i, s in enumerate(SESSIONS[:5000]):
        peer = next(p for p in ring.walk(s) if within_bound(load[p], 1.0, i, len(PEERS), epsilon))
        load[peer] += 1
    assert sum(load.values()) == 5000
    assert max(load.values()) <= math.ceil((1 + epsilon) * 5000 / len(PEERS))


def test_bound_scales_with_capacity() -> None:
    # 10 in flight over a total capacity of 4, epsilon 0.25: a peer of capacity 1 may
    # hold ceil(1.25 * 11 / 4) = 4 with the new request, one of capacity 3 ceil(10.3) = 11.
    assert within_bound(3, 1.0, 10, 4.0, 0.25)
    assert not within_bound(4, 1.0, 10, 4.0, 0.25)
    assert within_bound(10, 3.0, 10, 4.0, 0.25)
    assert not within_bound(11, 3.0, 10, 4.0, 0.25)

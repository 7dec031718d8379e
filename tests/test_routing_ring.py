"""Consistent hashing for sessions."""

from __future__ import annotations

from collections import Counter

from loadmesh.daemon.routing.ring import HashRing, hash64

PEERS = [f"gpu-{i:02d}" for i in range(10)]
SESSIONS = [f"session-{i}" for i in range(20_000)]


def owners(ring: HashRing) -> dict[str, str]:
    return {s: next(ring.walk(s)) for s in SESSIONS}


def test_hash_is_stable_across_processes() -> None:
    # Every host must put a session on the same peer: no per-process salt.
    assert hash64("session-1") == 0xAE49BD2CD463E7AC


def test_walk_visits_every_peer_once() -> None:
    ring = HashRing(dict.fromkeys(PEERS, 160))
    walk = list(ring.walk("x"))
    assert sorted(walk) == sorted(PEERS)
    assert list(HashRing({}).walk("x")) == []


def test_removing_a_peer_moves_only_its_sessions_to_the_next_on_the_ring() -> None:
    full = HashRing(dict.fromkeys(PEERS, 160))
    before = owners(full)
    after = owners(HashRing({p: 160 for p in PEERS if p != "gpu-03"}))
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == "gpu-03"}
    for s in moved:
        assert after[s] == list(full.walk(s))[1]


def test_adding_a_peer_takes_sessions_only_for_itself() -> None:
    before = owners(HashRing(dict.fromkeys(PEERS, 160)))
    after = owners(HashRing(dict.fromkeys([*PEERS, "gpu-new"], 160)))
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert moved and all(after[s] == "gpu-new" for s in moved)
    assert len(moved) < 2 * len(SESSIONS) / (len(PEERS) + 1)


def test_vnodes_spread_sessions_evenly() -> None:
    counts = Counter(owners(HashRing(dict.fromkeys(PEERS, 160))).values())
    fair = len(SESSIONS) / len(PEERS)
    assert all(0.7 * fair < c < 1.3 * fair for c in counts.values()), counts



def test_a_peer_holds_sessions_in_proportion_to_its_points() -> None:
    weights = {p: 160 if i % 2 else 80 for i, p in enumerate(PEERS)}
    counts = Counter(owners(HashRing(weights)).values())
    fair = len(SESSIONS) / sum(weights.values())
    assert all(0.75 * fair * weights[p] < counts[p] < 1.25 * fair * weights[p] for p in PEERS), counts


def test_a_peer_whose_weight_falls_loses_only_the_sessions_of_the_points_it_drops() -> None:
    before = owners(HashRing(dict.fromkeys(PEERS, 160)))
    after = owners(HashRing({**dict.fromkeys(PEERS, 160), "gpu-03": 80}))
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved and all(before[s] == "gpu-03" for s in moved)
    kept = sum(after[s] == "gpu-03" for s in SESSIONS)
    assert 0.35 < len(moved) / (len(moved) + kept) < 0.65

"""A session's request sent past its host while that host queues far above the fleet
(daemon/routing/overflow.py)."""

from __future__ import annotations

from dataclasses import replace

from loadmesh.daemon.routing import Decision, PeerInput, Reason
from loadmesh.daemon.routing.overflow import OVERFLOW
from loadmesh.daemon.routing.ring import hash64
from loadmesh.gossip.snapshot import SessionRates
from loadmesh.model_id import model_id
from test_routing_router import MODEL, NOW, SESSION_PEERS, figures, router

SESSIONS = [f"user-{i}" for i in range(400)]


def loaded(node: str, in_flight: int) -> PeerInput:
    """A peer of 8 slots with in_flight requests, those past 8 waiting."""
    return figures(node, in_flight=in_flight, running=min(in_flight, 8), waiting=max(0, in_flight - 8))


def fleet(**in_flight: int) -> list[PeerInput]:
    """Eight peers of 8 slots, each with 6 requests in flight unless given."""
    return [loaded(p, in_flight.get(p, 6)) for p in SESSION_PEERS]


def answers(rows: list[PeerInput], exclude: tuple[str, ...] = ()) -> dict[str, Decision]:
    r = router(rows)
    out = {}
    for s in SESSIONS:
        d = r.best(MODEL, s, exclude, NOW)
        assert isinstance(d, Decision)
        out[s] = d
    return out


def test_a_queueing_hosts_sessions_go_to_their_next_peer_the_others_stay() -> None:
    # s0 holds 24 on 8 slots where the fleet holds about 6 a host: 3 per slot against a
    # level of 1.03, past OVERFLOW times it.
    assert 24 > OVERFLOW * (7 * 6 + 24) / 64 * 8
    calm = answers(fleet())
    hot = answers(fleet(s0=24))
    without = answers(fleet(s0=24), exclude=("s0",))
    home = [s for s in SESSIONS if calm[s].node_id == "s0"]
    assert 20 < len(home) < 100
    for s in SESSIONS:
        if s in home:
            assert (hot[s].node_id, hot[s].reason) == (without[s].node_id, Reason.SESSION_OVERFLOW)
            assert hot[s].alternatives[0].node_id == "s0"  # its host is the first retry
        else:
            assert (hot[s].node_id, hot[s].reason) == (calm[s].node_id, calm[s].reason)


def test_a_surge_that_queues_every_host_moves_no_request() -> None:
    calm = answers(fleet())
    surge = answers(fleet(**dict.fromkeys(SESSION_PEERS, 24)))
    assert {s: d.node_id for s, d in surge.items()} == {s: d.node_id for s, d in calm.items()}
    assert Reason.SESSION_OVERFLOW not in {d.reason for d in surge.values()}


def test_a_host_far_above_the_fleet_but_within_its_batch_keeps_its_requests() -> None:
    # 8 in flight on 8 slots, the others idle: nothing waits there.
    idle = answers(fleet(**dict.fromkeys(SESSION_PEERS, 0)))
    busy = answers(fleet(**{**dict.fromkeys(SESSION_PEERS, 0), "s0": 8}))
    assert {s: d.node_id for s, d in busy.items()} == {s: d.node_id for s, d in idle.items()}


def test_where_every_next_peer_queues_too_the_session_stays_home() -> None:
    # Three peers, one excluded by the request: the other two queue far above the level
    # that the idle third keeps low, and neither is the spare of the other.
    r = router([loaded("a", 24), loaded("b", 24), loaded("c", 0)])
    for s in SESSIONS[:100]:
        d = r.best(MODEL, s, ("c",), NOW)
        assert isinstance(d, Decision)
        assert d.reason in (Reason.SESSION, Reason.SESSION_MOVED)


def with_session(session: str, rps: float, **in_flight: int) -> list[PeerInput]:
    """fleet(**in_flight), every peer publishing the session at rps of the model's 100
    requests a second."""
    rates = (SessionRates(model_id(MODEL), ((hash64(session) >> 32, rps),), routed_rps=100.0),)
    return [replace(x, snapshot=replace(x.snapshot, sessions=rates)) for x in fleet(**in_flight)]


def test_a_heavy_session_stays_on_its_placed_peer_queueing_or_not() -> None:
    # Its own bursts are most of what its host queues with: sent past by turns, it went
    # back and forth every second or so.
    r = router(with_session("busiest", 10.0))
    r.update(with_session("busiest", 10.0), NOW + 1000)  # placed once a second
    placed = r.heavy.host(model_id(MODEL), hash64("busiest") >> 32)
    assert placed is not None
    r.update(with_session("busiest", 10.0, **{placed: 24}), NOW + 1100)
    d = r.best(MODEL, "busiest", (), NOW + 1100)
    assert isinstance(d, Decision) and (d.node_id, d.reason) == (placed, Reason.SESSION_HEAVY)


def test_a_middling_session_stays_on_its_queueing_peer() -> None:
    # 2% of the requests: below heavy (a third of the smallest share, 1/8), above middling
    # (1/16 of it). A session that busy keeps its prefix in its host's cache; the requests
    # sent past are the rare sessions', whose prefixes a busy host has mostly evicted.
    key = hash64("regular") >> 32
    r = router(with_session("regular", 2.0))
    r.update(with_session("regular", 2.0), NOW + 1000)
    assert r.heavy.weighs(model_id(MODEL), key) and r.heavy.host(model_id(MODEL), key) is None
    home = r.best(MODEL, "regular", (), NOW + 1000)
    assert isinstance(home, Decision) and home.reason is Reason.SESSION
    r.update(with_session("regular", 2.0, **{home.node_id: 24}), NOW + 1100)
    d = r.best(MODEL, "regular", (), NOW + 1100)
    assert isinstance(d, Decision) and (d.node_id, d.reason) == (home.node_id, Reason.SESSION)

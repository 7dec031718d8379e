"""Heavy sessions: the rates each node counts, their placement, and the router's use of
both (daemon/routing/session_counts.py, heavy.py)."""

from __future__ import annotations

import random
from dataclasses import replace
from collections.abc import Iterable

import pytest

from loadmesh.daemon.routing import Decision, PeerInput, Router, RoutingConfig
from loadmesh.daemon.routing.heavy import (ALONE, ENTER, LEAVE, MAX_HEAVY, MAX_WALK, MIDDLING, MIDDLING_LEAVE,
                                           ROOM, HeavySessions, quantized, quantized_from)
from loadmesh.daemon.routing.ring import HashRing, hash64, stepped
from loadmesh.daemon.routing.shed import LAST
from loadmesh.daemon.routing.session_counts import HALF_LIFE_MS, MAX_TRACKED, SessionCounts
from loadmesh.gossip.snapshot import SessionRates
from loadmesh.model_id import model_id
from test_routing_router import MODEL, NOW, snapshot

MID = model_id(MODEL)


# --- counts ------------------------------------------------------------------------------

def test_a_steady_session_counts_at_its_rate() -> None:
    counts = SessionCounts(max_models=4)
    rng = random.Random(1)
    t = 0.0
    while t < 10 * HALF_LIFE_MS:
        t += rng.expovariate(2.0 / 1000)  # 2 requests a second
        counts.saw(MID, 7, round(t))
    (key, rate), = counts.busiest(8, 8, round(t))[MID]
    assert key == 7 and rate == pytest.approx(2.0, rel=0.3)


def test_a_session_that_stops_decays_by_its_half_life() -> None:
    counts = SessionCounts(max_models=4)
    end = 10 * HALF_LIFE_MS
    for ms in range(0, end, 250):
        counts.saw(MID, 1, ms)
    before = counts.busiest(1, 8, end)[MID][0][1]
    after = counts.busiest(1, 8, end + HALF_LIFE_MS)[MID][0][1]
    assert after == pytest.approx(before / 2, rel=1e-3)


def test_the_busiest_come_first_and_memory_is_bounded() -> None:
    counts = SessionCounts(max_models=1)
    for ms in range(20_000):
        counts.saw(MID, 1 if ms % 3 == 0 else 2 if ms % 7 == 0 else 1000 + ms, ms)  # one-off sessions
    assert len(counts._models[MID].counts) <= MAX_TRACKED
    top = counts.busiest(2, 8, 20_000)[MID]
    assert [key for key, _ in top] == [1, 2]
    counts.saw(MID + 1, 1, 20_000)  # a model past max_models is not counted
    assert MID + 1 not in counts.busiest(2, 8, 20_000)


def test_only_the_models_with_the_most_session_requests_are_published() -> None:
    counts = SessionCounts(max_models=4)
    for ms in range(1000):
        for mid in range(4):
            if ms % (4 - mid) == 0:
                counts.saw(mid, 1, ms)
    assert set(counts.busiest(1, 2, 1000)) == {2, 3}


def test_the_model_counts_every_request_routed_with_a_session_or_not() -> None:
    counts = SessionCounts(max_models=4)
    rng = random.Random(2)
    t = 0.0
    while t < 5 * HALF_LIFE_MS:
        t += rng.expovariate(4.0 / 1000)  # 4 requests a second, one in four of session 7
        counts.saw(MID, 7 if rng.random() < 0.25 else None, round(t))
    (key, rate), = counts.busiest(8, 8, round(t))[MID]
    assert key == 7 and rate == pytest.approx(1.0, rel=0.3)
    assert counts.routed_rps(MID, round(t)) == pytest.approx(4.0, rel=0.15)
    assert counts.routed_rps(MID + 1, round(t)) == 0.0


def test_a_young_sessions_share_of_the_routed_requests_is_low() -> None:
    # 5 of the first 10 requests, in 2 s: not yet taken for half the model's.
    counts = SessionCounts(max_models=1)
    for i in range(10):
        counts.saw(MID, 3 if i % 2 else None, 200 * i)
    share = counts.busiest(1, 1, 2_000)[MID][0][1] / counts.routed_rps(MID, 2_000)
    assert share < 0.1
    for i in range(10, 200):  # 40 s on: the share is the session's half
        counts.saw(MID, 3 if i % 2 else None, 200 * i)
    assert counts.busiest(1, 1, 40_000)[MID][0][1] / counts.routed_rps(MID, 40_000) == pytest.approx(0.5, rel=0.02)


def test_a_session_begun_late_counts_at_its_rate_once_past_the_floor() -> None:
    # The node has counted the model's requests for five minutes; the session begins then.
    counts = SessionCounts(max_models=1)
    for ms in range(0, 300_000, 250):
        counts.saw(MID, None, ms)
    for ms in range(300_000, 330_000, 500):  # 30 s at 2 a second
        counts.saw(MID, 9, ms)
    assert counts.busiest(1, 1, 330_000)[MID][0][1] == pytest.approx(2.0, rel=0.05)


def test_a_share_after_an_idle_spell_is_taken_over_the_time_served() -> None:
    # The full fleet bench: minutes of requests, minutes of none (the other policies' runs),
    # then sessions: a session of a quarter of the requests, 30 s in, is a quarter. Over
    # the idle time too, the model's rate read 31% of itself and the session's share 0.79.
    counts = SessionCounts(max_models=1)
    for ms in range(0, 300_000, 250):
        counts.saw(MID, None, ms)
    assert counts.routed_rps(MID, 300_000) == pytest.approx(4.0, rel=0.01)
    assert counts.routed_rps(MID, 600_000) < 0.2  # not routed here: out of the fleet's sums
    for i, ms in enumerate(range(600_000, 630_000, 250)):
        counts.saw(MID, 7 if i % 4 == 0 else None, ms)
    share = counts.busiest(1, 1, 630_000)[MID][0][1] / counts.routed_rps(MID, 630_000)
    assert share == pytest.approx(0.25, rel=0.02)


def test_a_sparse_models_gaps_are_its_time() -> None:
    # One request in 5 s: one gap in 7 is longer than IDLE_MS and is the model's time all
    # the same (taken for an idle spell, the rate read 1.4 times high).
    counts = SessionCounts(max_models=1)
    rng = random.Random(3)
    t, read = 0.0, []
    while t < 60 * HALF_LIFE_MS:
        t += rng.expovariate(0.2 / 1000)
        counts.saw(MID, None, round(t))
        read.append(counts.routed_rps(MID, round(t + rng.uniform(0, 5000))))
    assert sum(read) / len(read) == pytest.approx(0.2, rel=0.1)


def test_the_busiest_are_ranked_by_rate_not_by_count() -> None:
    counts = SessionCounts(max_models=1)
    for ms in range(0, 200_000, 1000):  # a session of 1 a second for 200 s
        counts.saw(MID, 1, ms)
    for ms in range(170_000, 200_000, 500):  # one of 2 a second begun 30 s ago: fewer counted
        counts.saw(MID, 2, ms)
    assert counts._models[MID].counts[2] < counts._models[MID].counts[1]
    assert [key for key, _ in counts.busiest(2, 1, 200_000)[MID]] == [2, 1]


def test_counts_outlive_the_rebase_of_their_scale() -> None:
    counts = SessionCounts(max_models=1)
    hours = 3 * 3_600_000
    for ms in range(0, hours, 500):
        counts.saw(MID, 5, ms)
    assert counts.busiest(1, 8, hours)[MID][0][1] == pytest.approx(2.0, rel=0.05)
    assert counts.routed_rps(MID, hours) == pytest.approx(2.0, rel=0.05)


# --- placement ---------------------------------------------------------------------------

def test_quantized_steps() -> None:
    assert quantized(0) == 0
    assert quantized(0.5) == 0.5
    assert quantized(0.52) == 0.5  # within half a step
    assert quantized(0.55) == pytest.approx(2 ** -0.75)


def test_a_step_holds_until_the_share_is_a_whole_step_from_it() -> None:
    step, low = 2 ** 0.25, 2 ** -4.25  # low: a step, 5.3%
    mid = low * step ** 0.5  # rounding's midpoint between it and the next step up
    assert quantized(mid * 1.01) != quantized(mid * 0.99)  # rounding alone: noise flips it
    held = quantized_from(mid * 0.99, None)
    assert held == pytest.approx(low)
    for wobble in (1.01, 0.99, 1.05, 0.95, 1.09):
        assert quantized_from(mid * wobble, held) == held
    assert quantized_from(low * step * 1.01, held) == quantized(low * step)  # a whole step on
    assert quantized_from(low / step / 1.01, held) == quantized(low / step)  # or back


SHARES = {"big1": 0.25, "big2": 0.25, "big3": 0.25, "small": 0.125, "slow": 0.125}


def ring_of(shares: dict[str, float]) -> HashRing:
    return HashRing({node: round(160 * s / max(shares.values())) for node, s in shares.items()})


def place(heavy: HeavySessions, rates: dict[int, float], usable: Iterable[str] = SHARES,
          ring: HashRing | None = None) -> dict[int, str]:
    ring = ring or ring_of(SHARES)
    heavy.place(MID, rates, 100.0, SHARES, min(SHARES.values()), set(usable), lambda key: ring.walk_from(key << 32))
    return dict(heavy.placed(MID))


def keys_owned_by(ring: HashRing, node: str, n: int) -> Iterable[int]:
    found = 0
    for i in range(100_000):
        key = hash64(f"s{i}") >> 32
        if next(ring.walk_from(key << 32)) == node:
            found += 1
            yield key
            if found == n:
                return


def test_the_busiest_session_goes_to_a_large_host_whoever_owns_it() -> None:
    # 17 requests in 100 on a host whose share is 12.5: most of its load alone.
    ring = ring_of(SHARES)
    key = next(iter(keys_owned_by(ring, "small", 1)))
    assert place(HeavySessions(), {key: 17.0}, ring=ring)[key].startswith("big")


def test_a_heavy_session_that_fits_stays_with_its_ring_owner() -> None:
    # A small host's share is too small for a session to enter heavy and fit it at once
    # (ENTER of the smallest share is ALONE of it): one heavy before, down by a step since,
    # fits it.
    ring = ring_of(SHARES)
    enter = 100 * ENTER * min(SHARES.values()) * 1.01
    for node in SHARES:
        key = next(iter(keys_owned_by(ring, node, 1)))
        rate = 100 * ALONE * SHARES[node] * 0.85
        heavy = HeavySessions()
        place(heavy, {key: max(rate, enter)}, ring=ring)
        assert place(heavy, {key: rate}, ring=ring) == {key: node}


def test_a_session_that_alone_would_fill_a_host_past_a_third_goes_on_along_its_ring() -> None:
    # Within the small host's room for heavy sessions (half its share), but 0.45 of its
    # share in one session: the first host along the ring of which it is at most a third
    # takes it.
    ring = ring_of(SHARES)
    key = next(iter(keys_owned_by(ring, "small", 1)))
    rate = 100 * 0.45 * SHARES["small"]
    assert ALONE * SHARES["small"] < quantized(rate / 100) <= ROOM * SHARES["small"]
    fits = next(n for n in ring.walk_from(key << 32) if quantized(rate / 100) <= ALONE * SHARES[n])
    assert place(HeavySessions(), {key: rate}, ring=ring) == {key: fits}
    assert fits.startswith("big")


def test_heavy_from_enter_until_below_leave() -> None:
    heavy = HeavySessions()
    smallest = min(SHARES.values())
    mark = 100 * smallest
    assert place(heavy, {1: 0.9 * ENTER * mark}) == {}
    assert set(place(heavy, {1: 1.1 * ENTER * mark})) == {1}
    assert set(place(heavy, {1: 1.1 * LEAVE * mark})) == {1}  # between the two: stays
    assert place(heavy, {1: 0.9 * LEAVE * mark}) == {}


def test_a_lost_host_moves_its_heavy_sessions_only() -> None:
    # The fleet bench's Zipf shares over 300 sessions: the five busiest are heavy.
    rng = random.Random(3)
    zipf = [100 / k / sum(1 / j for j in range(1, 301)) for k in range(1, 9)]
    moved_others = 0
    for _ in range(50):
        rates = {rng.getrandbits(32): r for r in zipf}
        heavy = HeavySessions()
        before = place(heavy, rates)
        after = place(heavy, rates, [n for n in SHARES if n != "big3"])
        assert after.keys() == before.keys()
        assert all(after[k] != "big3" for k in after)
        moved_others += sum(1 for k, node in before.items() if node != "big3" and after[k] != node)
    assert moved_others == 0


def test_a_session_weighs_from_a_sixteenth_of_the_smallest_share_until_below_its_leave() -> None:
    key = 7
    mark = 100 * min(SHARES.values())  # requests a second of the smallest share
    heavy = HeavySessions()

    def weighs(rate: float) -> bool:
        place(heavy, {key: rate})
        return heavy.weighs(MID, key)

    assert not weighs(0.9 * MIDDLING * mark)
    assert weighs(1.1 * MIDDLING * mark) and heavy.host(MID, key) is None
    assert weighs(1.1 * MIDDLING_LEAVE * mark)  # between the marks: it still weighs
    assert not weighs(0.9 * MIDDLING_LEAVE * mark)
    assert weighs(1.1 * ENTER * mark) and heavy.host(MID, key) is not None  # heavy weighs too
    place(heavy, {})
    assert not heavy.weighs(MID, key)


# --- the router --------------------------------------------------------------------------

def rows_with(sessions: dict[str, list[tuple[int, float]]], **bands: tuple[float, float]) -> list[PeerInput]:
    """Five peers of the fleet bench's shape (three of 4 GPUs, two of 2), each publishing
    the session rates it routed."""
    out = []
    for node, gpus in (("big1", 4), ("big2", 4), ("big3", 4), ("small", 2), ("slow", 2)):
        snap = snapshot(node, gpus=gpus, rps=20.0, band=bands.get(node, (0.0, 0.0)))
        if node in sessions:
            snap = type(snap)(**{**snap.__dict__, "sessions": (SessionRates(MID, sessions[node]),)})
        out.append(PeerInput(node, snap, True, 500, None))
    return out


def routers_agree_on(rows: list[PeerInput], session: str) -> str:
    hosts = set()
    for seed in (1, 2, 3):
        r = Router(RoutingConfig(seed=seed))
        r.update(rows, NOW)
        d = r.best(MODEL, session, (), NOW)
        assert isinstance(d, Decision), d
        hosts.add(d.node_id)
    assert len(hosts) == 1
    return hosts.pop()


def test_every_router_sends_a_heavy_session_to_its_placed_host_band_or_not() -> None:
    session = "busiest"
    key = hash64(session) >> 32
    # 4 rps of the fleet's 100 at each of the five entries: 20%, heavy.
    rates = {node: [(key, 4.0)] for node in ("big1", "big2", "big3", "small", "slow")}
    placed = routers_agree_on(rows_with(rates), session)
    r = Router(RoutingConfig(seed=1))
    r.update(rows_with(rates), NOW)
    assert r.heavy.host(MID, key) == placed
    # Its host's band covers every coin: a light session would be passed on, it is not.
    assert routers_agree_on(rows_with(rates, **{placed: (0.0, 1.0)}), session) == placed


def test_a_session_that_weighs_is_passed_on_only_by_a_band_over_its_owners_last_coins() -> None:
    session = "middling"
    key = hash64(session) >> 32
    # 0.3 rps of the fleet's 100 at each entry: 1.5%, an eighth of the smallest share.
    rates = {node: [(key, 0.3)] for node in ("big1", "big2", "big3", "small", "slow")}
    owner = routers_agree_on(rows_with({}), session)
    r = Router(RoutingConfig(seed=1))
    r.update(rows_with(rates), NOW)
    assert r.heavy.weighs(MID, key) and r.heavy.host(MID, key) is None
    # A band over every light coin of its owner, guests and orphans included: kept.
    assert routers_agree_on(rows_with(rates, **{owner: (0.0, LAST)}), session) == owner
    assert routers_agree_on(rows_with({}, **{owner: (0.0, LAST)}), session) != owner
    # A band over the last coins too: passed on like any.
    assert routers_agree_on(rows_with(rates, **{owner: (0.0, 1.0)}), session) != owner


def test_a_lost_peers_figures_hold_the_placement_through_its_loss() -> None:
    # A session just under heavy (2.8 of the model's 100 requests a second, the mark at
    # ENTER of the smallest share, 12.5: 3.125) and a heavy one; then a peer that routed
    # none of them is lost. Summed over the live peers only, the model's requests fell by
    # the lost one's 20 at once, the first session's share rose to 3.5%, and it became
    # heavy and was placed: a move that the loss did not call for.
    near, busy = (hash64(s) >> 32 for s in ("near", "busy"))
    rates = {"big1": [(near, 2.8), (busy, 10.0)]}
    r = Router(RoutingConfig(seed=1))
    r.update(rows_with(rates), NOW)
    placed = dict(r.heavy.placed(MID))
    assert set(placed) == {busy} and placed[busy] != "slow"
    lost = [row if row.node_id != "slow" else PeerInput("slow", row.snapshot, False, 500, None)
            for row in rows_with(rates)]
    r.update(lost, NOW + 2000)
    assert dict(r.heavy.placed(MID)) == placed


def test_the_light_sessions_spread_by_what_the_heavy_ones_leave_of_each_share() -> None:
    # The busiest session, 16 of the model's 100 requests a second, on a large host (its
    # share 25): of the light sessions it keeps the points of what is left of its share,
    # and only its light sessions move, each to the next peer on its ring.
    busy = hash64("busy") >> 32
    rates = {"big1": [(busy, 16.0)]}
    sessions = [f"light-{i}" for i in range(3000)]

    def spread(rows: list[PeerInput], now: int) -> tuple[Router, dict[str, str]]:
        router = Router(RoutingConfig(seed=1))
        router.update(rows, now)
        out = {}
        for s in sessions:
            d = router.best(MODEL, s, (), now)
            assert isinstance(d, Decision)
            out[s] = d.node_id
        return router, out

    _, plain = spread(rows_with({}), NOW)
    r, light = spread(rows_with(rates), NOW)
    host = r.heavy.host(MID, busy)
    assert host in ("big1", "big2", "big3")
    moved = [s for s in sessions if light[s] != plain[s]]
    assert moved and all(plain[s] == host for s in moved)
    # Its points: 160 for its share, of which the heavy session takes 0.149 of 0.25, in
    # steps of sqrt(2): 57. Its sessions are those of the points it kept.
    assert r.light_points(MID)[host] == round(160 * stepped(1 - quantized(0.16) / 0.25, 2)) == 57
    kept = sum(1 for h in light.values() if h == host) / sum(1 for h in plain.values() if h == host)
    assert 0.25 < kept < 0.6
    # A peer lost moves its own light sessions only: the placement that makes the ring
    # counts the lost peer's heavy sessions where they were.
    lost = [row if row.node_id != "slow" else PeerInput("slow", row.snapshot, False, 500, None)
            for row in rows_with(rates)]
    r.update(lost, NOW + 2000)
    for s, h in light.items():
        d = r.best(MODEL, s, (), NOW + 2000)
        assert isinstance(d, Decision)
        assert d.node_id == h or h == "slow"


def test_the_light_ring_follows_a_change_of_the_ring_at_once() -> None:
    # A peer joins between two placements: the ring's points change at the build, and the
    # light ring with them, not a placement later (the light sessions of the heavy
    # session's host would walk the ring's points meanwhile, and move twice).
    busy = hash64("busy") >> 32
    rates = {"big1": [(busy, 16.0)]}
    r = Router(RoutingConfig(seed=1))
    r.update(rows_with(rates), NOW)
    host = r.heavy.host(MID, busy)
    assert host is not None and r.light_points(MID)[host] == 57
    joined = [*rows_with(rates), PeerInput("big4", snapshot("big4", gpus=4, rps=20.0), True, 500, None)]
    r.update(joined, NOW + 200)
    points = r.light_points(MID)
    assert points["big4"] == 160 and points[host] < 57


def test_a_sessions_share_is_of_the_requests_routed_whatever_the_servers_measure() -> None:
    # Through a loss the servers' rates swing: the lost host's last figure stays while the
    # survivors serve its sessions, then its clients' requests leave their windows (in the
    # fleet bench, 20.6, 22.2 and 18.2 requests a second over 20 s). A session's share is
    # of the requests the entries routed, counted as its own are: it does not swing.
    keys = [hash64(f"s{i}") >> 32 for i in range(20)]
    rates = {node: [(key, 0.5 + 0.3 * i) for i, key in enumerate(keys) if i % 5 == n]
             for n, node in enumerate(("big1", "big2", "big3", "small", "slow"))}

    def placed(served: float, routed: float) -> dict[int, str]:
        rows = []
        for row in rows_with({}):
            snap = replace(row.snapshot, models=[replace(m, rps=served) for m in row.snapshot.models],
                           sessions=[SessionRates(MID, rates[row.node_id], routed)])
            rows.append(replace(row, snapshot=snap))
        r = Router(RoutingConfig(seed=1))
        r.update(rows, NOW)
        return dict(r.heavy.placed(MID))

    swings = [placed(served, 20.0) for served in (20.0, 25.0, 16.0)]
    assert swings[0] and swings[0] == swings[1] == swings[2]
    # Taken of the servers' rates (an older writer publishes no routed rate), they move.
    older = [placed(served, 0.0) for served in (20.0, 25.0, 16.0)]
    assert older[0] == swings[0] and older[1] != older[0] != older[2]


def test_the_router_publishes_the_sessions_it_routed() -> None:
    r = Router(RoutingConfig(seed=1))
    r.update(rows_with({}), NOW)
    for i in range(40):
        r.best(MODEL, "chatty", (), NOW + 100 * i)
    r.best(MODEL, "quiet", (), NOW + 4000)
    for i in range(10):
        r.best(MODEL, None, (), NOW + 4000)
    (published,) = r.busiest(NOW + 4000)
    assert published.model_id == MID
    keys = dict(published.sessions)
    assert keys[hash64("chatty") >> 32] > keys[hash64("quiet") >> 32] > 0
    # 51 requests in 4 s, 10 of them without a session.
    assert published.routed_rps == pytest.approx(51 / 4, rel=0.1)


def test_a_new_session_counts_at_its_rate_before_a_half_life_and_low_before_that() -> None:
    counts = SessionCounts(max_models=1)
    for ms in range(0, 25_000, 500):
        counts.saw(MID, 3, ms)
        if ms == 2_000:  # 5 requests in 2 s: not yet taken for 2.5 a second
            assert counts.busiest(1, 1, ms)[MID][0][1] < 0.5
    assert counts.busiest(1, 1, 25_000)[MID][0][1] == pytest.approx(2.0, rel=0.1)


def test_what_peers_publish_bounds_the_placements_work() -> None:
    # A peer (or an attacker on the gossip port) publishing thousands of sessions at
    # absurd rates: the busiest MAX_HEAVY are placed, each looking at MAX_WALK peers.
    nodes = {f"n{i}": 1 / 100 for i in range(100)}
    ring = ring_of(nodes)
    looked = 0

    def walk(key: int) -> Iterable[str]:
        nonlocal looked
        for node in ring.walk_from(key << 32):
            looked += 1
            yield node

    heavy = HeavySessions()
    heavy.place(MID, {k: 1e7 for k in range(5000)}, 100.0, nodes, min(nodes.values()), set(nodes), walk)
    assert len(heavy.placed(MID)) == MAX_HEAVY
    assert looked <= 2 * MAX_HEAVY * MAX_WALK


def test_a_heavy_session_placed_elsewhere_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    session = "busiest"
    key = hash64(session) >> 32
    rates = {node: [(key, 4.0)] for node in ("big1", "big2", "big3", "small", "slow")}
    r = Router(RoutingConfig(seed=1))
    caplog.set_level("INFO", logger="loadmesh.routing")
    r.update(rows_with(rates), NOW)
    placed = r.heavy.host(MID, key)
    assert [m for m in caplog.messages if "heavy" in m] == [
        f"heavy sessions of model {MID:016x}: 1 placed, 1 new, 0 no longer heavy"]
    # Its host lost: it moves, and the line says from where to where.
    rows = [row if row.node_id != placed else PeerInput(placed, row.snapshot, False, 500, None)
            for row in rows_with(rates)]
    r.update(rows, NOW + 2000)
    now = r.heavy.host(MID, key)
    assert now not in (None, placed)
    assert caplog.messages[-1] == (f"heavy sessions of model {MID:016x}: 1 placed, 0 new, 0 no longer heavy, "
                                   f"{key:08x} {placed!r} -> {now!r}")

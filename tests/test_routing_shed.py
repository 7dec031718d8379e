"""The sessions' load bound: coins, bands, and how a host's band follows its load."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadmesh.daemon.routing.shed import GUESTS, LAST, ORPHANS, Seat, Shedding, coin, passes_on

SESSIONS = [f"session-{i}" for i in range(4000)]
MID = 1
T0 = 1_000_000


def test_coin_is_stable_across_processes_and_spreads() -> None:
    # Every host must draw the same coin: no per-process salt.
    draw = 0xF038CA0B841509F9 / 2**64  # BLAKE2b-64 of "gpu-a\x1fsession-1"
    assert coin("gpu-a", "session-1", Seat.OWN) == pytest.approx(GUESTS + draw * (LAST - GUESTS))
    assert coin("gpu-a", "session-1", Seat.OWN_LAST) == pytest.approx(LAST + draw * (1 - LAST))
    assert coin("gpu-a", "session-1", Seat.GUEST) == pytest.approx(
        ORPHANS + draw * (GUESTS - ORPHANS))
    assert coin("gpu-a", "session-1", Seat.ORPHAN) == pytest.approx(draw * ORPHANS)
    own = [coin("gpu-a", s, Seat.OWN) for s in SESSIONS]
    guest = [coin("gpu-a", s, Seat.GUEST) for s in SESSIONS]
    orphan = [coin("gpu-a", s, Seat.ORPHAN) for s in SESSIONS]
    last = [coin("gpu-a", s, Seat.OWN_LAST) for s in SESSIONS]
    # A band growing from 0 reaches a lost peer's sessions first, then the guests that
    # live peers pass on, then the peer's own, those that weigh last.
    half = (LAST + GUESTS) / 2
    assert all(0 <= c < ORPHANS for c in orphan) and all(ORPHANS <= c < GUESTS for c in guest)
    assert all(GUESTS <= c < LAST for c in own) and all(LAST <= c < 1 for c in last)
    assert 0.45 < sum(c < half for c in own) / len(own) < 0.55
    # Independent per peer: a session passed on by one peer is not passed on by all.
    other = [coin("gpu-b", s, Seat.OWN) for s in SESSIONS]
    both = sum(a < half and b < half for a, b in zip(own, other, strict=True)) / len(SESSIONS)
    assert 0.2 < both < 0.3


def test_band_wraps_around_the_circle_and_reaches_guests_first() -> None:
    low = next(s for s in SESSIONS if coin("n", s, Seat.GUEST) < 0.07)
    high = next(s for s in SESSIONS if coin("n", s, Seat.OWN_LAST) > 0.95)
    middle = next(s for s in SESSIONS if 0.4 < coin("n", s, Seat.OWN) < 0.8)
    assert passes_on(0.9, 0.2, "n", low, Seat.GUEST) and passes_on(0.9, 0.2, "n", high, Seat.OWN_LAST)
    assert not passes_on(0.9, 0.2, "n", middle, Seat.OWN)
    assert not passes_on(0.3, 0.0, "n", middle, Seat.OWN)
    assert all(passes_on(0.3, 1.0, "n", s, Seat.OWN) for s in SESSIONS[:200])
    some = SESSIONS[:200]
    assert all(passes_on(0.0, GUESTS, "n", s, Seat.GUEST) for s in some)
    assert not any(passes_on(0.0, GUESTS, "n", s, Seat.OWN) for s in some)
    # The orphans' part alone: a lost peer's sessions go, the live peers' guests stay.
    assert all(passes_on(0.0, ORPHANS, "n", s, Seat.ORPHAN) for s in some)
    assert not any(passes_on(0.0, ORPHANS, "n", s, Seat.GUEST) for s in some)


def passed(band: tuple[float, float]) -> set[tuple[str, Seat]]:
    """The sessions, in every seat, that a peer "n" with the band passes on."""
    return {(s, seat) for s in SESSIONS for seat in Seat if passes_on(*band, "n", s, seat)}


def even(load: float, capacity: float, peers: int = 4) -> list[tuple[float, float]]:
    """The other candidates, sharing load and slots evenly."""
    return [(load / peers, capacity / peers)] * peers


def run(shed: Shedding, seconds: float, own: float, capacity: float = 8.0, fleet: float = 40.0,
        fleet_capacity: float = 80.0, start: int = T0,
        others: list[tuple[float, float]] | None = None, gone: int = 0,
        guests: bool = True) -> int:
    """Steps every 100 ms, as the router's update does; returns the time reached.
    gone, guests: how many peers are gone, whether another passes sessions on."""
    if others is None:
        others = even(fleet - own, fleet_capacity - capacity)
    now = start
    for _ in range(round(seconds * 10)):
        now += 100
        shed.saw(MID, 0, now)
        shed.step(MID, own, capacity, others, now, gone, guests)
    return now


def test_an_overloaded_host_passes_sessions_on_in_steps() -> None:
    # 7 in flight on 8 slots while the others hold 0.46 per slot: nearly twice its share of
    # 3.7. The load does not fall (the test holds it), so the band keeps growing, step by
    # step, once the excess has lasted long enough not to be chance.
    shed = Shedding(0.15)
    run(shed, 5.0, own=7, fleet=40, gone=1)
    assert shed.band(MID) == (0.0, 0.0)
    # A growth spends all the evidence: at 1.9 times its share, the next one comes 8 s on.
    widths = []
    now = T0 + 5000
    for _ in range(5):
        now = run(shed, 8.0, own=7, fleet=40, start=now, gone=1)
        widths.append(shed.band(MID)[1])
    assert widths == sorted(set(widths)) and widths[-1] < 1
    # The first steps stop at the orphans, then at the guests: what they carried leaves
    # before its own sessions, a lost peer's first.
    assert widths[:2] == [ORPHANS, GUESTS]
    # At the part it may hold only: no peer is gone, or none passes any on.
    for held, first in (({}, GUESTS), ({"gone": 1, "guests": False}, ORPHANS)):
        shed = Shedding(0.15)
        run(shed, 9.0, own=7, fleet=40, **held)
        assert shed.band(MID)[1] == first
    alone = Shedding(0.15)
    run(alone, 9.0, own=7, fleet=40, guests=False)
    assert alone.band(MID)[1] > GUESTS
    # Growing the band moves only the sessions at its end.
    assert passed((0.0, widths[1])) <= passed((0.0, widths[2]))


def test_a_band_grows_by_a_share_of_what_it_keeps_and_never_passes_everything_on() -> None:
    # 20 in flight on 8 slots, the others at 0.42 a slot, held there for a minute: every
    # step is as large as steps get, and each passes on at most 0.2 of the coins the
    # band left. Grown by 0.35 of the whole circle, it reached 1.00 in three steps, and a
    # host holding the busiest session passed on every session it had (docs/routing.md).
    shed = Shedding(0.15)
    widths, now = [0.0], T0
    for _ in range(30):
        now = run(shed, 2.0, own=20, fleet=50, start=now, guests=False)
        widths.append(shed.band(MID)[1])
    steps = [(a, b) for a, b in itertools.pairwise(widths) if b > a]
    assert len(steps) >= 5
    assert all(b - a <= 0.2 * (1 - a) + 1e-9 for a, b in steps), steps
    assert widths[-1] < 1


def test_a_host_at_twice_its_share_passes_half_its_sessions_on_within_20_s() -> None:
    # From a cold start, 8 in flight on 8 slots where the others hold 0.44 a slot: 2.2
    # times its share. A fifth goes at the second step (4 s), half by 18 s. Steps of up to
    # 0.35, each spending half the evidence, passed half on in 6 s; in the fleet bench
    # every host's band then climbed to 0.4-0.9 and stayed there, and 10-30% of the
    # others' requests moved in 16 s with no host lost (docs/routing.md, the steps).
    shed = Shedding(0.15)
    now = run(shed, 5.0, own=8, fleet=40, guests=False)
    assert shed.band(MID)[1] == pytest.approx(0.2)
    run(shed, 15.0, own=8, fleet=40, start=now, guests=False)
    assert shed.band(MID)[1] >= 0.5


def random_load(shed: Shedding, seconds: float, mean: float, seed: int) -> int:
    """The host's in-flight count as requests come and go at random (Poisson arrivals,
    lognormal service times of 2.5 s on average), next to others at 0.6 a slot: a share
    of 4.8 on its 8 slots. Returns how many times the band grew."""
    rng = random.Random(seed)
    service_s, sigma = 2.5, 0.8
    ends: list[float] = []
    arrival = rng.expovariate(mean / service_s)
    now_ms, grown = T0, 0
    for tick in range(round(seconds * 10)):
        t = tick / 10
        while arrival < t:
            heapq.heappush(ends, arrival + rng.lognormvariate(
                math.log(service_s) - sigma**2 / 2, sigma))
            arrival += rng.expovariate(mean / service_s)
        while ends and ends[0] < t:
            heapq.heappop(ends)
        now_ms += 100
        width = shed.band(MID)[1]
        shed.saw(MID, 0, now_ms)
        shed.step(MID, len(ends), 8, even(0.6 * 32, 32), now_ms)
        grown += shed.band(MID)[1] > width
    return grown


@pytest.mark.parametrize("seed", range(3))
def test_chance_seldom_grows_a_band_but_a_lasting_excess_does(seed: int) -> None:
    # Ten minutes at its share: the count reaches twice it, for seconds on end, a few
    # times. (The rule before the evidence grew these bands 1, 4 and 5 times.)
    assert random_load(Shedding(0.15), 600, 4.8, seed) <= 5
    # 1.7 times its share, held there: the band grows within a minute.
    over = Shedding(0.15)
    assert random_load(over, 60, 1.7 * 4.8, seed) > 0
    assert over.band(MID)[1] >= GUESTS


def test_a_draining_host_stops_growing_its_band() -> None:
    # Above its share, but its in-flight count is falling fast: the sessions passed on
    # are working, what is left is the queue.
    shed = Shedding(0.15)
    now, own = T0, 40.0
    for _ in range(100):
        now += 100
        shed.saw(MID, 0, now)
        shed.step(MID, own, 8, even(32, 72), now)
        own *= 0.985
    assert shed.band(MID)[1] <= 0.1


def test_a_host_within_its_share_holds_its_band() -> None:
    shed = Shedding(0.15)
    run(shed, 10, own=4.5, fleet=40)
    assert shed.band(MID) == (0.0, 0.0)
    # 6 where its share is 4: within what chance gives a count of that size.
    run(shed, 20, own=6, fleet=40, start=T0 + 10_000)
    assert shed.band(MID) == (0.0, 0.0)
    # 60 where its share is 40 is not chance.
    big = Shedding(0.15)
    run(big, 10, own=60, capacity=80, fleet=400, fleet_capacity=800)
    assert big.band(MID)[1] > 0
    # Too little in flight to compare (fewer than one request per candidate): hold.
    run(shed, 10, own=3, fleet=3, start=T0 + 30_000)
    assert shed.band(MID) == (0.0, 0.0)


def test_a_host_with_room_takes_a_lost_peers_sessions_whatever_it_passed_on_before() -> None:
    # A band grown for an overload, its start at 0: the host passes on every orphan. Once
    # below its share, with no peer gone, the band holds (it is given back only after a
    # long quiet); at the loss of a peer, the orphans' part goes, the rest stays.
    shed = Shedding(0.15)
    now = run(shed, 20.0, own=7, fleet=40, guests=False)
    start, width = shed.band(MID)
    assert start == 0 and width > GUESTS
    now = run(shed, 4.0, own=2, fleet=40, start=now, guests=False)
    assert shed.band(MID) == (0.0, width)
    run(shed, 2.1, own=2, fleet=40, start=now, gone=1)
    assert shed.band(MID) == pytest.approx((ORPHANS, width - ORPHANS))
    # Above its share at the loss, it keeps passing them on.
    busy = Shedding(0.15)
    now = run(busy, 20.0, own=7, fleet=40, guests=False)
    run(busy, 4.0, own=7, fleet=40, start=now, gone=1)
    assert busy.band(MID)[0] == 0
    # A band grown after the loss passed the orphans on first: it does not take them
    # back when it falls below the mean, it waits for the long quiet like any other.
    after = Shedding(0.15)
    now = run(after, 20.0, own=7, fleet=40, gone=1, guests=False)
    grown = after.band(MID)
    assert grown[0] == 0 and grown[1] > ORPHANS
    run(after, 4.0, own=2, fleet=40, start=now, gone=1, guests=False)
    assert after.band(MID) == grown


def test_a_host_passes_on_only_its_guests_while_its_peers_are_full() -> None:
    # The other peers hold 32 in flight on 32 slots: they queue too. Even at 4 times the
    # fleet's load per slot, the band stops at the guests.
    shed = Shedding(0.15)
    run(shed, 20, own=32, fleet=64, fleet_capacity=40)
    assert shed.band(MID) == (0.0, GUESTS)
    # 1.7 times over, with room on the others: sessions move.
    room = Shedding(0.15)
    run(room, 5, own=16, fleet=32, fleet_capacity=40)
    assert room.band(MID)[1] > 0
    # Room counts per peer: two peers queueing do not hide two idle ones.
    uneven = Shedding(0.15)
    run(uneven, 5, own=16, fleet=48, fleet_capacity=40,
        others=[(15, 8), (15, 8), (1, 8), (1, 8)])
    assert uneven.band(MID)[1] > 0


def test_after_a_loss_a_full_fleet_moves_only_the_lost_hosts_sessions() -> None:
    # A peer gone and the others full: only the orphans go on, the guests stay where they
    # are, whatever this host holds.
    shed = Shedding(0.15)
    run(shed, 20, own=32, fleet=64, fleet_capacity=40, gone=1)
    assert shed.band(MID) == (0.0, ORPHANS)
    # A band grown before the loss keeps what it passed on, and grows no further.
    before = Shedding(0.15)
    now = run(before, 20, own=32, fleet=64, fleet_capacity=40)
    run(before, 20, own=32, fleet=64, fleet_capacity=40, start=now, gone=1)
    assert before.band(MID) == (0.0, GUESTS)
    # With room on the others, the bound works as ever.
    room = Shedding(0.15)
    run(room, 20, own=16, fleet=32, fleet_capacity=40, gone=1)
    assert room.band(MID)[1] > GUESTS


def test_a_peers_long_queue_does_not_hide_this_hosts_overload() -> None:
    # 2 per slot here, two peers at 0.25 and one with 60 queued on 4 slots: by the
    # fleet's mean (2.9 per slot) this host would look idle.
    shed = Shedding(0.15)
    run(shed, 5, own=16, others=[(60, 4), (2, 8), (2, 8)])
    assert shed.band(MID)[1] > 0


def test_sessions_come_back_first_in_first_out_after_a_long_quiet() -> None:
    shed = Shedding(0.15)
    now = run(shed, 12, own=24, fleet=56)
    # The smoothed load takes a moment to fall; then a short quiet changes nothing, and a
    # long one brings back the sessions passed on first (the start of the band) while the
    # last ones passed on stay away.
    now = run(shed, 3, own=1, fleet=40, start=now)
    start, width = shed.band(MID)
    assert start == 0.0 and width > 0.2
    now = run(shed, 5, own=1, fleet=40, start=now)
    assert shed.band(MID) == (start, width)
    now = run(shed, 20, own=1, fleet=40, start=now)
    later_start, later_width = shed.band(MID)
    assert later_start > start and later_width < width
    assert later_start + later_width == pytest.approx(start + width)
    assert passed((later_start, later_width)) < passed((start, width))


def test_a_band_taken_back_in_part_grows_at_its_start_first() -> None:
    shed = Shedding(0.15)
    now = run(shed, 12, own=24, fleet=56)
    now = run(shed, 24, own=1, fleet=40, start=now)
    start, width = shed.band(MID)
    assert GUESTS < start and width > 0
    # Overloaded again: the guests and the sessions taken back last go first.
    for _ in range(20):
        if shed.band(MID)[1] > width:
            break
        now = run(shed, 1, own=24, fleet=56, start=now)
    later_start, later_width = shed.band(MID)
    assert later_start < start
    assert later_start + later_width == pytest.approx(start + width)


def test_an_idle_host_takes_its_sessions_back_sooner_than_a_quiet_one() -> None:
    idle, quiet = Shedding(0.15), Shedding(0.15)
    now = run(idle, 12, own=24, fleet=56)
    run(quiet, 12, own=24, fleet=56)
    width = idle.band(MID)[1]
    assert quiet.band(MID)[1] == width > 0.2
    # A tenth of the fleet's load per slot, against 0.6 of it: both below _LOW.
    run(idle, 24, own=0.4, fleet=40, start=now)
    run(quiet, 24, own=2.5, fleet=40, start=now)
    assert idle.band(MID)[1] < quiet.band(MID)[1] < width


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 500), st.floats(0, 64),
                          st.lists(st.tuples(st.floats(0, 500), st.floats(0, 64)), max_size=8),
                          st.integers(0, 5000), st.booleans()),
                max_size=60))
def test_band_stays_on_the_circle(
        steps: list[tuple[float, float, list[tuple[float, float]], int, bool]]) -> None:
    shed = Shedding(0.15)
    now = T0
    for own, capacity, others, dt, sessions in steps:
        now += dt
        if sessions:
            shed.saw(MID, 0, now)
        shed.step(MID, own, capacity, others, now)
        start, width = shed.band(MID)
        assert 0 <= start < 1 and 0 <= width <= 1


def test_without_sessions_a_band_neither_grows_nor_stays() -> None:
    # Traffic without sessions (none answered here for _QUIET_MS): passing sessions on
    # cannot lower the load, so a band grown now would only be waiting, too wide, for
    # the sessions to come back.
    shed = Shedding(0.15)
    now = T0
    for _ in range(200):
        now += 100
        shed.step(MID, 24, 8, even(32, 72), now)
    assert shed.band(MID) == (0.0, 0.0)
    # A band grown while sessions came is given back once they stop, first in first out.
    now = run(shed, 12, own=24, fleet=56, start=now)
    assert shed.band(MID)[1] > 0.2
    starts = []
    for _ in range(320):
        now += 100
        shed.step(MID, 24, 8, even(32, 72), now)
        starts.append(shed.band(MID)[0])
    assert shed.band(MID) == (0.0, 0.0)
    assert max(starts) > 0.2


def test_bands_of_models_no_longer_served_are_forgotten() -> None:
    shed = Shedding(0.15)
    run(shed, 6, own=24, fleet=56)
    assert shed.band(MID)[1] > 0
    shed.forget_except(set())
    assert shed.band(MID) == (0.0, 0.0)

"""The routing decision: candidates, d choices, in-flight correction, sessions, slow
start, circuits, answers without a candidate."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadmesh.daemon.routing import Decision, NoCandidate, PeerInput, Reason, Router, RoutingConfig
from loadmesh.daemon.routing.p2c import OwnShare
from loadmesh.daemon.routing.shed import GUESTS, ORPHANS, Seat, passes_on
from loadmesh.daemon.score import ScoreConfig
from loadmesh.gossip.snapshot import Endpoint, GpuLoad, HostLoad, LoadSnapshot, ModelLoad, NodeState
from loadmesh.model_id import model_id

MODEL = "llama-3-8b"
NOW = 1_000_000


def snapshot(node: str, *, score: float = 0.3, state: NodeState = NodeState.OK, in_flight: int = 0,
             p50_ms: float = 100.0, gpus: int = 1, models: tuple[str, ...] = (MODEL,),
             error_ratio: float = 0.0, rps: float = 10.0, port: int = 8000,
             endpoints: tuple[Endpoint, ...] | None = None, version: int = 1,
             band: tuple[float, float] = (0.0, 0.0)) -> LoadSnapshot:
    return LoadSnapshot(
        node_id=node,
        endpoints=endpoints if endpoints is not None else (Endpoint(f"{node}.lan", 9000),),
        version=version, timestamp_ms=NOW, state=state, score=score,
        host=HostLoad(0.1, 1000, 4000, 0.5, None),
        gpus=tuple(GpuLoad(i, 50, 1, 2, 50, 100, 300, 0, 1, True) for i in range(gpus)),
        models=tuple(ModelLoad(model_id(m), port, rps, error_ratio, p50_ms, 2 * p50_ms, in_flight,
                               shed_start=band[0], shed_width=band[1])
                     for m in models),
    )


def row(node: str, *, alive: bool = True, age_ms: int = 500, since_ms: int | None = None,
        **snap: object) -> PeerInput:
    return PeerInput(node, snapshot(node, **snap), alive, age_ms, since_ms)  # type: ignore[arg-type]


def router(rows: list[PeerInput], **config: object) -> Router:
    # own_share_cap=1: this node's sends count once, so the tests can count them.
    r = Router(RoutingConfig(**{"seed": 7, "own_share_cap": 1.0, **config}))  # type: ignore[arg-type]
    r.update(rows, NOW)
    return r


def picks(r: Router, n: int, *, session: str | None = None, exclude: tuple[str, ...] = (),
          complete: bool = True, now: int = NOW) -> Counter[str]:
    """n decisions; with complete, each request finishes (feedback ok) before the next,
    so the load figures stay those of the snapshots."""
    counts: Counter[str] = Counter()
    for _ in range(n):
        d = r.best(MODEL, session, exclude, now)
        assert isinstance(d, Decision), d
        counts[d.node_id] += 1
        if complete:
            r.feedback(d.node_id, "ok", 10.0, now)
    return counts


def open_circuit(r: Router, node: str, now: int = NOW) -> None:
    for _ in range(3):
        r.feedback(node, "error", 5.0, now)


# --- candidates -----------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
                min_size=1, max_size=12))
def test_never_picks_dead_draining_open_or_excluded(flags: list[tuple[bool, bool, bool, bool]]) -> None:
    rows = [row(f"n{i}", alive=alive, state=NodeState.DRAINING if draining else NodeState.OK)
            for i, (alive, draining, _, _) in enumerate(flags)]
    r = router(rows)
    for i, (_, _, is_open, _) in enumerate(flags):
        if is_open:
            open_circuit(r, f"n{i}")
    excluded = tuple(f"n{i}" for i, f in enumerate(flags) if f[3])
    usable = {f"n{i}" for i, (alive, draining, is_open, excl) in enumerate(flags)
              if alive and not draining and not is_open and not excl}
    for _ in range(30):
        d = r.best(MODEL, None, excluded, NOW)
        if not usable:
            assert isinstance(d, NoCandidate)
            break
        assert isinstance(d, Decision) and d.node_id in usable
        assert {a.node_id for a in d.alternatives} <= usable - {d.node_id}


def test_equal_peers_split_evenly_when_fewer_than_the_draw() -> None:
    # Two candidates, three wanted (the d choices and the alternatives): the exact draw
    # must still come in a random order, or every tie goes to the first in the table.
    counts = picks(router([row("a", in_flight=4), row("b", in_flight=4)]), 400)
    assert min(counts["a"], counts["b"]) > 150


def test_overloaded_peers_get_less_traffic_but_are_not_filtered() -> None:
    rows = [row(f"ok{i}", in_flight=4) for i in range(3)] + [row("hot", in_flight=4, score=0.95,
                                                              state=NodeState.OVERLOADED)]
    counts = picks(router(rows), 300, complete=False)  # each send raises its peer's load
    assert 0 < counts["hot"] < 0.5 * min(counts[f"ok{i}"] for i in range(3))
    # Idle, it is still the cheapest place for a request: its queue is what its score says.
    r = router([row("hot", score=0.95, state=NodeState.OVERLOADED), row("busy", score=0.6, in_flight=40)])
    d = r.best(MODEL, None, (), NOW)
    assert isinstance(d, Decision) and d.node_id == "hot" and d.reason == "power of d choices"


def test_one_peer_below_the_watermark_does_not_take_everything() -> None:
    """The herd of the old overload tier: every host sent everything to the one peer not
    overloaded. Its own sends now raise its cost like anyone's."""
    rows = [row("cool", in_flight=4)] + [row(f"hot{i}", in_flight=4, score=0.95,
                                              state=NodeState.OVERLOADED) for i in range(4)]
    counts = picks(router(rows), 200, complete=False)
    assert counts["cool"] < 0.6 * 200
    assert all(counts[f"hot{i}"] > 0 for i in range(4))


def test_score_at_watermark_counts_as_overloaded_whatever_the_state() -> None:
    r = router([row("a", score=0.9, in_flight=4), row("b", score=0.5, in_flight=4)])
    assert picks(r, 100) == {"b": 100}


def test_degraded_peers_get_less_traffic() -> None:
    rows = [row(f"ok{i}") for i in range(3)] + [row("deg", score=0.8, state=NodeState.DEGRADED)]
    counts = picks(router(rows), 4000)
    assert counts["deg"] < 0.7 * min(counts[f"ok{i}"] for i in range(3))


def test_error_ratio_above_threshold_counts_as_degraded() -> None:
    rows = [row(f"ok{i}") for i in range(3)] + [row("errs", error_ratio=0.2)]
    counts = picks(router(rows), 4000)
    assert counts["errs"] < 0.7 * min(counts[f"ok{i}"] for i in range(3))


def test_capacity_weighs_the_share() -> None:
    # Same figures, but one host has four GPUs.
    counts = picks(router([row("small", in_flight=4), row("big", in_flight=4, gpus=4)]), 1000)
    assert counts["big"] > 0.9 * 1000


def test_slow_peer_weighs_more_per_request() -> None:
    # Equal in-flight counts; one peer takes 4x as long per request (its P50).
    counts = picks(router([row("fast", in_flight=4, p50_ms=100),
                           row("slow", in_flight=4, p50_ms=400)]), 500)
    assert counts == {"fast": 500}


def figures(node: str, *, in_flight: int = 4, version: int = 1, **model: float) -> PeerInput:
    """A peer whose model entry carries the given ModelLoad figures."""
    base = row(node, in_flight=in_flight, version=version)
    models = tuple(replace(m, **model) for m in base.snapshot.models)
    return replace(base, snapshot=replace(base.snapshot, models=models))


def test_streams_pace_a_peer_by_its_inter_token_latency() -> None:
    # Streamed answers' time to first byte is their head's (uvicorn sends it before any
    # token), so the P50 says nothing of speed: a peer decoding at half speed, with the
    # same P50 and queue, must lose every comparison.
    counts = picks(router([figures("fast", itl_p99_ms=20), figures("slow", itl_p99_ms=40)]), 500)
    assert counts == {"fast": 500}


def test_a_peer_not_streaming_yet_is_paced_as_the_typical_streaming_peer() -> None:
    # Its P50 (a whole answer's time) is not comparable with the others' per-token pace.
    counts = picks(router([figures("a", itl_p99_ms=20), figures("b", itl_p99_ms=20),
                           row("quiet", in_flight=4, p50_ms=5000)]), 600)
    assert counts["quiet"] > 100


def test_the_recent_pace_ranks_before_the_window_p99() -> None:
    # Same P99 (the tail of a window that began before "slowed" slowed down), but it
    # decodes at 80 ms a token now.
    counts = picks(router([figures("a", pace_ms=20, itl_p99_ms=90),
                           figures("slowed", pace_ms=80, itl_p99_ms=90)]), 300)
    assert counts == {"a": 300}


def test_a_slower_peer_is_one_of_the_choices_as_often_as_its_rate_says() -> None:
    # Four busy peers and an idle one at half their speed, which wins whenever it is
    # drawn: its share is how often it is one of the three choices. Drawn by its rate
    # (half a full one's), 1 - (4/4.5)(3/3.5)(2/2.5) = 0.39; by its batch alone it would
    # be 0.6, and a slow peer would fill up whenever its partners are busier.
    busy = [figures(f"fast{i}", in_flight=8, pace_ms=20) for i in range(4)]
    counts = picks(router([*busy, figures("slow", in_flight=0, pace_ms=40)]), 3000)
    assert 0.36 < counts["slow"] / 3000 < 0.42


def test_a_pause_between_bursts_keeps_a_peer_slow_for_a_window_only() -> None:
    # A second without streams has no pace: the last one shown holds for the probes'
    # window (10 s), then the peer is taken as typical again.
    r = router([figures("fast", pace_ms=20), figures("slow", pace_ms=80)])
    later = NOW + 2_000
    r.update([figures("fast", pace_ms=20, version=2), figures("slow", pace_ms=0, version=2)], later)
    assert picks(r, 200, now=later) == {"fast": 200}
    later = NOW + 12_000
    r.update([figures("fast", pace_ms=20, version=3), figures("slow", pace_ms=0, version=3)], later)
    assert picks(r, 400, now=later)["slow"] > 100


def test_a_peer_seen_queueing_is_sized_by_its_batch_the_others_by_the_largest_seen() -> None:
    """"small" ran 4 streams, then its first tokens came 20x later with requests waiting:
    4 is its batch. "new" has run only 2 without ever queueing: it is not taken as
    smaller than "big", or the first peers to get traffic would keep growing."""
    def rows(version: int, ttft_small: float, waiting_small: int) -> list[PeerInput]:
        return [figures("small", version=version, in_flight=6, running=4, waiting=waiting_small,
                        ttft_p99_ms=ttft_small, pace_ms=20),
                figures("big", version=version, in_flight=6, running=6, ttft_p99_ms=50, pace_ms=20),
                figures("new", version=version, in_flight=6, running=2, ttft_p99_ms=50, pace_ms=20)]
    r = router(rows(1, 50, 0))
    r.update(rows(2, 1000, 5), NOW)
    counts = picks(r, 600)
    assert counts["small"] == 0
    assert abs(counts["big"] - counts["new"]) < 120


def test_fast_failures_neither_lower_the_pace_nor_hide_the_host() -> None:
    # "rej" answers 429 to half its requests within a millisecond: its P50 drops, but a
    # failing window teaches no pace, and its failures price it.
    r = router([row("ok", in_flight=4), row("rej", in_flight=4)])
    r.update([row("ok", in_flight=4, version=2),
              row("rej", in_flight=4, p50_ms=1, error_ratio=0.5, version=2)], NOW)
    assert picks(r, 300) == {"ok": 300}


def test_a_peer_once_slow_is_tried_again_once_its_window_is_quiet() -> None:
    # While it was slow, its pace rose; once no traffic is left in its window, the pace
    # learnt then is old news: it is taken as typical, and idle, it wins.
    rows = [row("a", in_flight=4), row("b", in_flight=4)]
    r = router([*rows, row("was_slow", p50_ms=3000)])
    assert "was_slow" not in picks(r, 200)
    r.update([*rows, row("was_slow", p50_ms=3000, rps=0, version=2)], NOW)
    assert picks(r, 200)["was_slow"] > 100


def test_static_models_make_a_peer_a_candidate_before_any_traffic() -> None:
    rows = [row("fresh", models=())]
    assert isinstance(router(rows).best(MODEL, None, (), NOW), NoCandidate)
    d = router(rows, static_models={"fresh": frozenset({MODEL})}).best(MODEL, None, (), NOW)
    assert isinstance(d, Decision) and d.endpoint == "fresh.lan:9000"


def test_endpoint_is_the_port_the_model_was_seen_on() -> None:
    # "a" serves on 8001 at b.lan, where its model traffic was seen, and has another
    # endpoint listed first; "b" has no endpoint on its model's port: its first host with
    # that port (IPv6 in brackets).
    r = router([PeerInput("a", snapshot("a", port=8001, endpoints=(Endpoint("a.lan", 9000),
                                                                   Endpoint("b.lan", 8001))),
                          True, 0, None),
                PeerInput("b", snapshot("b", port=8002, endpoints=(Endpoint("fd00::2", 9000),)),
                          True, 0, None)])
    only_a, only_b = r.best(MODEL, None, ("b",), NOW), r.best(MODEL, None, ("a",), NOW)
    assert isinstance(only_a, Decision) and isinstance(only_b, Decision)
    assert (only_a.endpoint, only_b.endpoint) == ("b.lan:8001", "[fd00::2]:8002")


def test_stale_snapshots_only_when_nothing_fresh() -> None:
    r = router([row("old", age_ms=60_000), row("new", in_flight=50)])
    assert picks(r, 100) == {"new": 100}
    d = r.best(MODEL, None, ("new",), NOW)
    assert isinstance(d, Decision) and d.node_id == "old" and d.reason.startswith("stale view")
    assert d.age_ms == 60_000


# --- the in-flight correction -----------------------------------------------------------

def test_own_sends_since_the_snapshot_count_as_load() -> None:
    # idle has 0 in flight, busy 10; both always drawn (two candidates, d = 2).
    r = router([row("idle"), row("busy", in_flight=10)])
    # Until 10 of its own are in flight there, idle is the better one; then they tie and
    # alternate, each send making the other one better.
    assert picks(r, 10, complete=False) == {"idle": 10}
    assert picks(r, 40, complete=False) == {"idle": 20, "busy": 20}


def test_completions_reported_back_lift_the_correction() -> None:
    r = router([row("idle"), row("busy", in_flight=10)])
    picks(r, 30, complete=False)
    for _ in range(30):
        r.feedback("idle", "ok", 5.0, NOW)
    assert picks(r, 5, complete=False) == {"idle": 5}


def test_a_new_snapshot_replaces_the_correction() -> None:
    r = router([row("idle"), row("busy", in_flight=10)])
    picks(r, 10, complete=False, now=NOW)
    # idle's next snapshot, taken after those 10 sends, shows them: counted twice, idle
    # would look twice as busy and get nothing in the next 10.
    r.update([row("idle", in_flight=10, version=2, age_ms=0), row("busy", in_flight=10)], NOW + 100)
    assert picks(r, 10, complete=False, now=NOW + 100) == {"idle": 5, "busy": 5}


def test_own_sends_scaled_to_the_fleet() -> None:
    # The peers' snapshots show 1000 requests per second; this node has sent none
    # recently, so each of its sends stands for many of the fleet's (capped at 32).
    rows = [row("a", rps=500), row("b", rps=500, in_flight=20)]
    r = router(rows, own_share_cap=32.0)
    assert [picks(r, 1, complete=False).most_common(1)[0][0] for _ in range(2)] == ["a", "b"]


def test_own_share_follows_this_nodes_rate() -> None:
    share = OwnShare(half_life_ms=10_000, cap=32.0)
    assert share.multiplier(50.0, 0) == 32.0  # nothing sent yet: the cap
    for t in range(0, 60_000, 100):  # 10 requests a second for a minute
        share.sent(t)
    assert share.multiplier(50.0, 60_000) == pytest.approx(5.0, rel=0.1)
    assert share.multiplier(5.0, 60_000) == 1.0  # never below this node's own
    assert share.multiplier(5000.0, 60_000) == 32.0
    # Quiet for two half-lives: the rate estimate has fallen to a quarter.
    assert share.multiplier(50.0, 80_000) == pytest.approx(20.0, rel=0.1)


def test_at_the_fleets_own_rate_a_send_counts_once() -> None:
    # The peers complete 10 requests a second between them, and this node has been
    # sending them 10 a second: it is the whole fleet, its sends are all there is.
    r = router([row("a", rps=5), row("b", rps=5, in_flight=3)], own_share_cap=32.0, freshness_s=3600.0)
    for i in range(600):
        picks(r, 1, now=NOW + 100 * i)
    # a is idle, b has 3 in flight: a takes the next 3 (at 32 per send it would take 1).
    assert picks(r, 3, complete=False, now=NOW + 60_000) == {"a": 3}


# --- sessions -----------------------------------------------------------------------------

SESSION_PEERS = [f"s{i}" for i in range(8)]


def session_owners(r: Router, sessions: list[str]) -> dict[str, str]:
    """Each session's peer: for a request sent past a queueing one (overflow.py, tested
    apart), the peer it was sent past, its first retry."""
    out = {}
    for s in sessions:
        d = r.best(MODEL, s, (), NOW)
        assert isinstance(d, Decision)
        out[s] = d.alternatives[0].node_id if d.reason is Reason.SESSION_OVERFLOW else d.node_id
        r.feedback(d.node_id, "ok", 1.0, NOW)
    return out


def test_session_sticks_to_its_peer() -> None:
    r = router([row(p, in_flight=5) for p in SESSION_PEERS])
    first = session_owners(r, [f"user-{i}" for i in range(200)])
    assert session_owners(r, [f"user-{i}" for i in range(200)]) == first
    assert len(set(first.values())) == len(SESSION_PEERS)
    d = r.best(MODEL, "user-1", (), NOW)
    assert isinstance(d, Decision) and d.reason == "session"


def test_only_the_sessions_of_a_gone_peer_move_and_none_of_an_overloaded_one() -> None:
    sessions = [f"user-{i}" for i in range(400)]
    rows = [row(p, in_flight=5) for p in SESSION_PEERS]
    before = session_owners(router(rows), sessions)
    gone = session_owners(router([x for x in rows if x.node_id != "s3"]), sessions)
    assert {s for s in sessions if gone[s] != before[s]} == {s for s in sessions if before[s] == "s3"}
    # Overloaded by its score with its share of the load: affinity holds.
    hot = router([row(p, in_flight=5, score=0.95 if p == "s3" else 0.3) for p in SESSION_PEERS])
    assert session_owners(hot, sessions) == before
    d = hot.best(MODEL, next(s for s in sessions if before[s] == "s3"), ("s3",), NOW)
    assert isinstance(d, Decision) and d.reason == "session moved along the ring"


def test_a_slower_peer_holds_fewer_sessions_and_jitter_moves_none() -> None:
    # "slow" decodes at half the speed of the others: it serves half as much, so it holds
    # about half as many sessions. Its pace jittering within a step moves no session.
    sessions = [f"user-{i}" for i in range(2000)]
    peers = ["a", "b", "slow"]

    def ring_owners(paces: dict[str, float], versions: int) -> dict[str, str]:
        r = router([figures(p, pace_ms=paces[p]) for p in peers])
        for v in range(2, versions + 2):
            r.update([figures(p, pace_ms=paces[p], version=v) for p in peers], NOW)
        return session_owners(r, sessions)

    even = Counter(ring_owners({"a": 20, "b": 20, "slow": 20}, 1).values())
    owners = ring_owners({"a": 20, "b": 20, "slow": 40}, 1)
    held = Counter(owners.values())
    assert 0.35 < held["slow"] / held["a"] < 0.7, held
    assert 0.8 < even["slow"] / even["a"] < 1.25, even
    assert ring_owners({"a": 22, "b": 19, "slow": 37}, 5) == owners


def test_a_change_of_the_sessions_ring_is_logged_with_the_points_that_moved(
        caplog: pytest.LogCaptureFixture) -> None:
    # A ring change moves sessions, each a prefill of its context on its new host: the
    # operator sees it, and which peer's points moved. Jitter within a step logs nothing.
    paces = {"a": 20.0, "b": 20.0, "c": 20.0}
    r = router([figures(p, pace_ms=paces[p]) for p in paces])
    caplog.set_level("INFO", logger="loadmesh.routing")
    for v in range(2, 4):
        r.update([figures(p, pace_ms=paces[p] + v % 2, version=v) for p in paces], NOW)
    assert not [m for m in caplog.messages if "ring" in m]
    for v in range(4, 14):
        r.update([figures(p, pace_ms=40.0 if p == "c" else paces[p], version=v) for p in paces], NOW)
    # Its steady pace is a median over versions: it crosses the step between in two.
    changes = [m for m in caplog.messages if "ring" in m]
    assert changes == [f"sessions' ring of model {model_id(MODEL):016x} changed: 'c' {a} -> {b} points"
                       for a, b in ((160, 113), (113, 80))], changes


def test_versions_with_a_pace_near_zero_move_no_session() -> None:
    # A busy server writing a stream's events in bursts shows token gaps near 0: "slow" at
    # 40 ms showing 0.1 ms for two versions must not look as fast as the others on the ring.
    sessions = [f"user-{i}" for i in range(2000)]
    paces = {"a": 20.0, "b": 20.0, "slow": 40.0}
    r = router([figures(p, pace_ms=paces[p]) for p in paces])
    for v in range(2, 6):
        r.update([figures(p, pace_ms=paces[p], version=v) for p in paces], NOW)
    before = session_owners(r, sessions)
    for v in range(6, 8):
        r.update([figures(p, pace_ms=0.1 if p == "slow" else paces[p], version=v) for p in paces],
                 NOW)
        assert session_owners(r, sessions) == before


def test_on_the_ring_a_batch_within_a_step_of_the_largest_counts_as_the_largest() -> None:
    # "c" queues having run 6 streams at most: a full 8-slot host whose batch holds
    # non-streamed requests shows as much, and no session moves for it. "half" queues at 4
    # of 8: it is the smaller host, and holds about half as many sessions.
    sessions = [f"user-{i}" for i in range(2000)]

    def rows(version: int, queueing: bool) -> list[PeerInput]:
        out = [figures(p, version=version, in_flight=8, running=8, ttft_p99_ms=50, pace_ms=20)
               for p in ("a", "b")]
        for p, running in (("c", 6), ("half", 4)):
            out.append(figures(p, version=version, in_flight=running + 5 * queueing,
                               running=running, waiting=5 * queueing,
                               ttft_p99_ms=1000 if queueing else 50, pace_ms=20))
        return out

    r = router(rows(1, False))
    even = session_owners(r, sessions)
    r.update(rows(2, True), NOW)
    after = session_owners(r, sessions)
    assert {s for s in sessions if after[s] != even[s]} == {s for s in sessions if even[s] == "half"
                                                             and after[s] != "half"}
    held = Counter(after.values())
    assert 0.35 < held["half"] / held["a"] < 0.7, held


def test_a_peer_passes_on_the_sessions_in_its_band_and_every_host_agrees() -> None:
    sessions = [f"user-{i}" for i in range(400)]
    rows = [row(p, in_flight=5) for p in SESSION_PEERS]
    home = session_owners(router(rows), sessions)
    banded = [replace(x, snapshot=snapshot("s0", in_flight=5, band=(0.8, 0.5)))
              if x.node_id == "s0" else x for x in rows]
    owners = session_owners(router(banded), sessions)
    mine = [s for s in sessions if home[s] == "s0"]
    gone = {s for s in mine if passes_on(0.8, 0.5, "s0", s, Seat.OWN)}
    assert 0 < len(gone) < len(mine)
    # Only s0's sessions in its band move, each to the next peer of its ring.
    assert {s for s in sessions if owners[s] != home[s]} == gone
    without = session_owners(router([x for x in rows if x.node_id != "s0"]), sessions)
    assert all(owners[s] == without[s] for s in gone)
    # The choice rests on what the snapshots publish: a host that is itself one of the
    # peers, or that sent them its own traffic, makes the same one.
    as_s3 = router([replace(x, is_self=x.node_id == "s3") for x in banded])
    for _ in range(50):
        as_s3.best(MODEL, None, (), NOW)
    assert session_owners(as_s3, sessions) == owners


def test_a_session_every_peer_passes_on_spills_by_what_each_keeps_and_hosts_agree() -> None:
    # Every peer but s5 passes on every session; s5's band is a third of the coins, every
    # guest's among them (shed.Seat), so it keeps only some of its own sessions. The
    # others spill, half of them onto s5, whatever the peers' loads (which differ from
    # one host's view to another's): every host names the same peer.
    sessions = [f"user-{i}" for i in range(1200)]
    rows = [figures(p, in_flight=8 if p == "s5" else 1, running=8 if p == "s5" else 1,
                    shed_width=1 / 3 if p == "s5" else 1.0) for p in SESSION_PEERS]
    owners = session_owners(router(rows), sessions)
    asked = router(rows)
    spilled = [s for s in sessions
               if asked.best(MODEL, s, (), NOW).reason == "session passed on by every peer"]
    assert 0.8 * len(sessions) < len(spilled) < 0.95 * len(sessions)
    held = Counter(owners[s] for s in spilled)
    # 0.67 of s5's slots against 0.1 of each other's: 0.67 / (0.67 + 7 x 0.1) = 0.49.
    assert 0.4 * len(spilled) < held["s5"] < 0.6 * len(spilled), held
    assert len(held) == len(SESSION_PEERS), held
    as_s3 = router([replace(x, is_self=x.node_id == "s3") for x in rows])
    for _ in range(50):
        as_s3.best(MODEL, None, (), NOW)
    assert session_owners(as_s3, sessions) == owners
    # Other loads, as another host may see them, name the same peers.
    busy = [replace(x, snapshot=replace(x.snapshot, models=tuple(
        replace(m, in_flight=8 - (x.node_id == "s5") * 7) for m in x.snapshot.models)))
        for x in rows]
    assert session_owners(router(busy), spilled) == {s: owners[s] for s in spilled}


def test_a_dead_peers_sessions_go_to_the_next_one_and_the_answer_says_so() -> None:
    home = session_owners(router([row(p, in_flight=5) for p in SESSION_PEERS]), ["user-1"])
    dead = [replace(x, alive=x.node_id != home["user-1"]) for x in
            (row(p, in_flight=5) for p in SESSION_PEERS)]
    d = router(dead).best(MODEL, "user-1", (), NOW)
    assert isinstance(d, Decision) and d.node_id != home["user-1"]
    assert d.reason == "session moved along the ring"


def test_a_peer_passes_on_its_guests_before_its_own_sessions() -> None:
    # s3 dead: its sessions are guests on the peers after it. Peers passing on the band
    # of the guests' coins keep every session of their own.
    sessions = [f"user-{i}" for i in range(400)]
    rows = [row(p, in_flight=5) for p in SESSION_PEERS]
    home = session_owners(router(rows), sessions)
    lost = [replace(x, alive=False) if x.node_id == "s3" else
            replace(x, snapshot=snapshot(x.node_id, in_flight=5, band=(0.0, GUESTS))) for x in rows]
    owners = session_owners(router(lost), sessions)
    assert all(owners[s] == home[s] for s in sessions if home[s] != "s3")
    orphans = [s for s in sessions if home[s] == "s3"]
    assert orphans and all(owners[s] != "s3" for s in orphans)


def test_a_peer_passes_on_a_lost_peers_sessions_before_the_guests_of_live_ones() -> None:
    # s3 dead, s1 passing on some of its own sessions: the others' bands over the
    # orphans' part move on s3's sessions and keep the guests s1 passed on to them.
    sessions = [f"user-{i}" for i in range(400)]
    rows = [row(p, in_flight=5) for p in SESSION_PEERS]
    home = session_owners(router(rows), sessions)

    def band(x: PeerInput) -> tuple[float, float]:
        return (GUESTS, 0.45) if x.node_id == "s1" else (0.0, ORPHANS)

    lost = [replace(x, alive=False) if x.node_id == "s3" else
            replace(x, snapshot=snapshot(x.node_id, in_flight=5, band=(GUESTS, 0.45)))
            if x.node_id == "s1" else x for x in rows]
    before = session_owners(router(lost), sessions)
    banded = session_owners(router([replace(x, snapshot=snapshot(x.node_id, in_flight=5,
                                                                  band=band(x)))
                                    if x.alive else x for x in lost]), sessions)
    guests = [s for s in sessions if home[s] == "s1" and before[s] != "s1"]
    assert guests and all(banded[s] == before[s] for s in guests)
    assert all(banded[s] == home[s] for s in sessions if home[s] not in ("s1", "s3"))
    orphans = [s for s in sessions if home[s] == "s3" and before[s] != "s1"]
    assert orphans and all(banded[s] != before[s] for s in orphans)


def test_an_orphan_passed_on_stays_an_orphan_all_along_the_ring() -> None:
    # s3 dead; s2 passes on the orphans it would hold; every other live peer passes on
    # its guests only. The sessions s2 passes on are s3's, not guests of a live peer: the
    # next peer keeps them (taken for guests, they would go round the ring and spill).
    sessions = [f"user-{i}" for i in range(400)]
    rows = [row(p, in_flight=5) for p in SESSION_PEERS]
    lost = [replace(x, alive=False) if x.node_id == "s3" else x for x in rows]
    before = session_owners(router(lost), sessions)
    home = session_owners(router(rows), sessions)
    banded = router([x if not x.alive else replace(x, snapshot=snapshot(
        x.node_id, in_flight=5, band=(0.0, ORPHANS) if x.node_id == "s2" else (ORPHANS, GUESTS - ORPHANS)))
        for x in lost])
    moved = [s for s in sessions if home[s] == "s3" and before[s] == "s2"]
    assert moved
    for s in moved:
        d = banded.best(MODEL, s, (), NOW)
        assert isinstance(d, Decision) and d.node_id not in ("s2", "s3")
        assert d.reason == "session moved along the ring"
    # Nobody else's session moved.
    assert all(session_owners(banded, [s])[s] == home[s] for s in sessions if home[s] != "s3")


def test_this_node_passes_sessions_on_while_it_carries_more_than_its_share() -> None:
    # s0 (this node) holds 40 in flight, the other seven 5 each, all with 8 slots.
    rows = [figures(p, in_flight=40 if p == "s0" else 5, running=8 if p == "s0" else 5)
            for p in SESSION_PEERS]
    rows = [replace(x, is_self=x.node_id == "s0") for x in rows]
    r = router(rows)
    for t in range(1, 61):  # 6 s of updates: steps of the band, past its guests
        r.update(rows, NOW + 100 * t)
    # Until this node has answered a session, it has no sign of any to pass on.
    assert r.band(model_id(MODEL)) == (0.0, 0.0)
    for t in range(61, 101):  # 4 s: a step past the guests, and not yet every session
        assert isinstance(r.best(MODEL, f"user-{t}", (), NOW + 100 * t), Decision)
        r.update(rows, NOW + 100 * t)
    start, width = r.band(model_id(MODEL))
    assert GUESTS + 0.1 < width < 1
    # Its peers know only once its snapshot says so.
    banded = [replace(x, snapshot=snapshot("s0", in_flight=40, band=(start, width)))
              if x.node_id == "s0" else x for x in rows]
    sessions = [f"user-{i}" for i in range(400)]
    assert sum(o == "s0" for o in session_owners(router(banded), sessions).values()) \
        < sum(o == "s0" for o in session_owners(router(rows), sessions).values())


# --- slow start ---------------------------------------------------------------------------

def test_slow_start_ramps_a_new_peers_share() -> None:
    joined = NOW - 1_000
    # The new peer is idle, the others busy: without slow start it would win every time
    # it is drawn, half of all requests.
    rows = [row(f"old{i}", in_flight=8) for i in range(3)] + [row("new", since_ms=joined)]
    r = router(rows, slow_start_s=30.0)
    shares = [picks(r, 2000, now=joined + s * 1000)["new"] / 2000 for s in (1, 10, 20, 40)]
    assert shares[0] < 0.05
    assert shares[0] < shares[1] < shares[2] < shares[3]
    assert shares[3] > 0.4


# --- circuits -------------------------------------------------------------------------------

def test_open_circuit_then_one_trial_then_closed() -> None:
    r = router([row("flaky"), row("steady", in_flight=20)], breaker_cooldown_s=10.0)
    open_circuit(r, "flaky")
    assert picks(r, 50, now=NOW + 1) == {"steady": 50}
    trial = r.best(MODEL, None, (), NOW + 10_000)
    assert isinstance(trial, Decision) and trial.node_id == "flaky"
    # While the trial is out, nothing else goes there.
    assert picks(r, 20, complete=False, now=NOW + 10_001) == {"steady": 20}
    r.feedback("flaky", "ok", 30.0, NOW + 10_100)
    assert picks(r, 20, now=NOW + 10_200)["flaky"] > 0


def test_failed_trial_keeps_the_circuit_open() -> None:
    r = router([row("flaky"), row("steady", in_flight=20)], breaker_cooldown_s=10.0)
    open_circuit(r, "flaky")
    assert r.best(MODEL, None, (), NOW + 10_000).node_id == "flaky"  # type: ignore[union-attr]
    r.feedback("flaky", "timeout", 30_000.0, NOW + 10_050)
    assert picks(r, 50, now=NOW + 19_000) == {"steady": 50}


def test_feedback_checks_its_input() -> None:
    r = router([row("a")])
    assert r.feedback("nobody", "ok", 1.0, NOW) is False
    with pytest.raises(ValueError):
        r.feedback("a", "maybe", 1.0, NOW)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        r.feedback("a", "ok", -1.0, NOW)


# --- no candidate -------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, exclude, opened, reason", [
    ([], (), (), "unknown model"),
    ([row("a", models=("other-model",))], (), (), "unknown model"),
    ([row("a", alive=False), row("b", alive=False)], (), (), "all dead"),
    ([row("a", state=NodeState.DRAINING)], (), (), "all draining"),
    ([row("a", endpoints=())], (), (), "no endpoint"),
    ([row("a"), row("b")], ("a", "b"), (), "all excluded"),
    ([row("a"), row("b")], (), ("a", "b"), "all circuits open"),
    ([row("a", alive=False), row("b")], (), ("b",), "no usable peer"),
])
def test_no_candidate_says_why(rows: list[PeerInput], exclude: tuple[str, ...],
                               opened: tuple[str, ...], reason: str) -> None:
    r = router(rows)
    for node in opened:
        open_circuit(r, node)
    answer = r.best(MODEL, "some-session", exclude, NOW)
    assert isinstance(answer, NoCandidate)
    assert answer.reason == reason and answer.model == MODEL
    if reason == "no usable peer":
        assert answer.counts == {"dead": 1, "circuit open": 1}


def test_alternatives_are_distinct_retry_targets() -> None:
    r = router([row(f"n{i}", in_flight=i) for i in range(10)], alternatives=3)
    for _ in range(100):
        d = r.best(MODEL, None, (), NOW)
        assert isinstance(d, Decision)
        ids = [d.node_id, *(a.node_id for a in d.alternatives)]
        assert len(ids) == 4 and len(set(ids)) == 4
        r.feedback(d.node_id, "ok", 1.0, NOW)


def test_decision_reports_the_snapshot_used() -> None:
    d = router([row("a", score=0.42, age_ms=1500)]).best(MODEL, None, (), NOW + 200)
    assert isinstance(d, Decision)
    assert (d.node_id, d.endpoint, d.score, d.age_ms) == ("a", "a.lan:8000", 0.42, 1700)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        RoutingConfig(vnodes=50)
    with pytest.raises(ValueError):
        RoutingConfig(score=ScoreConfig(degraded_at=0.95))
    assert replace(RoutingConfig(), choices=2).choices == 2


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per build of the candidates."""
    import loadmesh.daemon.routing.router as router_module
    made: list[int] = []
    real = router_module.build

    def counting(*args: object, **kwargs: object) -> object:
        made.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(router_module, "build", counting)
    return made


def test_candidates_are_rebuilt_only_when_what_they_are_built_from_changes(builds: list[int]) -> None:
    rows = [row("a"), row("b")]
    r = router(rows)
    for step in range(1, 20):  # two seconds of updates, nothing new: no rebuild
        r.update(rows, NOW + 100 * step)
    assert len(builds) == 1
    r.update([row("a", version=2, in_flight=3), row("b")], NOW + 2000)  # a new version
    r.update([row("a", version=2, in_flight=3), row("b", alive=False)], NOW + 2100)  # b dead
    assert len(builds) == 3
    assert picks(r, 5, now=NOW + 2100) == {"a": 5}
    # A pace remembered is forgotten after its memory: rebuilt then, without a new version.
    paced = [PeerInput("a", replace(snapshot("a"), models=(ModelLoad(model_id(MODEL), 8000, 10.0, 0.0, 100.0,
                                                                      200.0, 0, pace_ms=20.0),)), True, 500, None)]
    r.update(paced, NOW + 3000)
    quiet = [PeerInput("a", replace(snapshot("a", version=3)), True, 500, None)]
    r.update(quiet, NOW + 3100)
    before = len(builds)
    r.update(quiet, NOW + 3000 + 10_000)
    assert len(builds) == before
    r.update(quiet, NOW + 3000 + 10_001)
    assert len(builds) == before + 1


def test_over_its_cpu_budget_a_changed_peer_is_refigured_in_place_and_a_lost_one_rebuilds(
        builds: list[int]) -> None:
    import loadmesh.daemon.routing.router as router_module
    # 303 peers (300 of another model): a build is estimated at 2.4 ms, so the next waits
    # 240 ms for a gained candidate, 1.2 s for figures alone.
    r = router([row(f"p{i}", models=("other-model",)) for i in range(300)] + [row("a"), row("b"), row("c")])
    cost = router_module._BUILD_MS_PER_PEER * 303
    wait, figures_wait = round(cost * router_module._BUILD_SPACING), round(cost * router_module._FIGURES_SPACING)
    assert len(builds) == 1 and 100 < wait < figures_wait
    # a is overloaded: its weight halves at once, in place, and so does its share of the draw.
    entry = r._models[model_id(MODEL)]
    before = entry.weights()
    r.update([row("a", version=2, state=NodeState.OVERLOADED, in_flight=4)], NOW + 100, complete=False)
    assert len(builds) == 1 and r._models[model_id(MODEL)] is entry and entry.weights() is not before
    a = entry.by_node["a"]
    assert a.weight == r.config.overloaded_weight * a.capacity and a.peer.in_flight == 4
    assert entry.weights()._total == pytest.approx(sum(c.rate for c in entry.candidates))
    assert a.rate == pytest.approx(r.config.overloaded_weight * entry.by_node["b"].rate)
    # b's queue moved, not its rate: its load counts at the next request, the draw stands.
    reweighed = entry.weights()
    r.update([row("b", version=2, in_flight=6)], NOW + 200, complete=False)
    assert entry.weights() is reweighed and entry.by_node["b"].peer.in_flight == 6
    r.tick(NOW + figures_wait - 1)
    assert len(builds) == 1
    r.tick(NOW + figures_wait)
    assert len(builds) == 2
    # b dies: built again at once, over the budget; a new peer waits for the gained
    # candidate's budget, shorter than the figures'.
    now = NOW + figures_wait + 100
    r.update([row("b", alive=False)], now, complete=False)
    assert len(builds) == 3
    assert "b" not in picks(r, 100, now=now)
    r.update([row("d")], now + 1, complete=False)
    assert len(builds) == 3 and "d" not in picks(r, 100, now=now + 1)
    r.tick(now + wait - 1)
    assert len(builds) == 3
    r.tick(now + wait)
    assert len(builds) == 4 and "d" in picks(r, 100, now=now + wait)


def test_importing_the_router_loads_no_probe_code() -> None:
    # The probes package imports its loader and pyroute2: most of the router's import
    # time when the model-id hash lived there.
    code = ("import sys, loadmesh.daemon.routing.router; "
            "print(sorted(m for m in sys.modules if m.startswith(('loadmesh.probes', 'pyroute2', 'bcc'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_each_reason_has_its_own_text_and_metric_label() -> None:
    assert len({r.label for r in Reason}) == len({str(r) for r in Reason}) == len(Reason)
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", r.label) for r in Reason)



def test_a_dry_run_answers_alike_and_counts_nothing() -> None:
    r = router([row("idle"), row("busy", in_flight=10)])
    for _ in range(10):
        dry = r.best(MODEL, None, (), NOW, dry_run=True)
        assert isinstance(dry, Decision) and dry.node_id == "idle"
    # Counted, those 10 would have put idle level with busy.
    assert picks(r, 10, complete=False) == {"idle": 10}
    assert r.best(MODEL, "user-1", (), NOW, dry_run=True) == r.best(MODEL, "user-1", (), NOW)
    rates = r.shedding.counts
    before = rates.routed_rps(model_id(MODEL), NOW + 1000)
    for _ in range(20):
        r.best(MODEL, "user-2", (), NOW + 500, dry_run=True)
    assert rates.routed_rps(model_id(MODEL), NOW + 1000) == before
    r.best(MODEL, "user-2", (), NOW + 500)
    assert rates.routed_rps(model_id(MODEL), NOW + 1000) > before

"""Sessions on a real fleet: three hosts in namespaces (tests/fleet.py), one with half the
batch of the others, three agents on shipped defaults, 80% load in sessions of Zipf
popularity entering at every host, after a warm-up without sessions (as the fleet bench's).

    two agents asked about one session within a second name the same peer; sessions
    stay on their peer; the busiest session, a fifth of the requests, stays on one host
    with room for it; no host holds more of the requests in flight than its share of
    the slots allows (by the bands' own margin of chance), where without the bands the
    host holding the busiest sessions holds twice its share.

scripts/bench_fleet.py --sessions measures the same on five hosts, with a host killed.
"""

from __future__ import annotations

import math
import os
from collections import Counter
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet import Host, affinity, agreement, arrivals, capacity_rps, fleet, get_json
from nettopo import leftovers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

HOSTS = (Host("a", 8, 20), Host("b", 8, 20), Host("c", 4, 20))
# Traffic without sessions first, so that the agents have learnt each host's batch (c's
# is half the others') before the first session: until then the ring gives c a third of
# the sessions, and the ring's change when it learns moves a sixth of them. Without it, in
# seven runs, 69-78% of a session's requests stayed on its host and c held 0.65-1.28
# times its share.
WARMUP = 15.0
END = WARMUP + 40.0
SETTLED = WARMUP + 10.0
LOAD = 0.8
SESSIONS = 100
SEED = 5


@pytest.fixture(scope="module")
def run() -> Iterator[tuple[list[dict[str, Any]], list[list[int]]]]:
    rate = LOAD * capacity_rps(HOSTS, SEED)
    plan = arrivals(rate, WARMUP, SEED + 3, len(HOSTS)) + [
        {**a, "t": a["t"] + WARMUP}
        for a in arrivals(rate, END - WARMUP, SEED, len(HOSTS), SESSIONS)]
    samples: list[tuple[float, list[int]]] = []
    with tempfile.TemporaryDirectory(prefix="lm-sessions-test-") as tmp:
        with fleet(HOSTS, Path(tmp), prefix="lms") as f:
            stop = threading.Event()

            def poll() -> None:
                # Each server's waiting + running, from its own engine.
                while not stop.wait(0.25):
                    try:
                        stats = [get_json(u + "/stats") for u in f.urls]
                    except OSError:
                        continue
                    samples.append((time.monotonic(), [s["waiting"] + s["running"] for s in stats]))

            load, start = f.start_load({"policy": "loadmesh", "arrivals": plan, "seed": SEED})
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            try:
                rows = f.result(load, END + 120)
            finally:
                stop.set()
                poller.join()
    assert leftovers("lms") == []
    yield rows, [held for t, held in samples if start + SETTLED <= t <= start + END]


def test_agents_agree_on_a_sessions_peer_and_it_keeps_it(
        run: tuple[list[dict[str, Any]], list[list[int]]]) -> None:
    rows, _ = run
    assert all(r["status"] == 200 for r in rows), [r for r in rows if r["status"] != 200][:3]
    _, sticky, agree, pairs = affinity(rows, WARMUP, END)
    assert pairs > 20
    # Measured with sessions that every peer passes on sent by load, as each agent saw
    # it: agreement 0.75-0.94, 0.76 on its peer (the small host passes on some 40% of its
    # sessions in the first seconds). A bound each agent evaluated on its own view agreed
    # 0.59 of the time on five hosts. Spilled by the snapshots' free slots, after the
    # warm-up, in six runs: agreement 0.88-0.94, 0.79-0.83 on its peer (0.84-0.91 and
    # 0.69-0.78 in seven runs without the warm-up); by the bands, which every agent reads
    # alike, in eight runs: 0.96-0.98, 0.73-0.86. With a light session's request sent
    # past a host queueing far above the fleet (routing/overflow.py), in three runs:
    # 0.94-0.96, 0.82-0.85 (with heavy sessions sent past too, 0.89-0.94); at a mark of
    # 1.25 with middling sessions kept home, 0.94-0.98, 0.82-0.84. Sent by load
    # alone (no sessions), a request would stay on its session's host about a third of
    # the time.
    assert agree is not None and agree >= 0.9
    assert sticky >= 0.65
    # Those pairs part where a request was sent past its peer, though both agents would
    # have sent it there at that moment; each request's second agent, asked at the same
    # moment, is the measure: 0.968 of 525 in two runs, where the pairs said
    # 0.92 and 0.94; with the overflow's mark at 1.25 and middling sessions kept home,
    # 0.952, 0.971, 0.964 (pairs 0.94-0.98). Bound below those: the fleet bench measures
    # the goal of 0.95 on five hosts.
    now, asked = agreement(rows, WARMUP, END)
    assert asked > 100 and now is not None and now >= 0.93, (now, asked)


def test_the_busiest_session_is_placed_on_one_large_host(
        run: tuple[list[dict[str, Any]], list[list[int]]]) -> None:
    rows, _ = run
    settled = [r for r in rows if r["session"] and r["t"] >= SETTLED]
    busiest, _ = Counter(r["session"] for r in settled).most_common(1)[0]
    hosts = Counter(r["host"] for r in settled if r["session"] == busiest)
    host, n = hosts.most_common(1)[0]
    # A fifth of the requests (Zipf over 100 sessions), as much as c's whole share: heavy,
    # placed by every agent alike on a host with room for it (routing/heavy.py), and kept
    # there whatever the bands do. Passed on by the bands instead, it went round the ring.
    assert host != "c" and n >= 0.95 * sum(hosts.values()), hosts
    assert any(r["reason"] == "heavy session on its placed peer" for r in settled)


def test_no_host_carries_much_more_than_its_share_of_the_slots(
        run: tuple[list[dict[str, Any]], list[list[int]]]) -> None:
    _, samples = run
    held = [sum(col) for col in zip(*samples, strict=True)]
    slots = sum(h.slots for h in HOSTS)
    occupancy = [n / sum(held) / (h.slots / slots) for n, h in zip(held, HOSTS, strict=True)]
    # A band grows once a host stands above 1 + epsilon times its share by more than
    # chance explains (routing/shed.py): a host whose share is n in flight may hold
    # 1.15 + 0.5 / sqrt(n) times it for good, 1.35 for a or b (8 slots at 80%: 6.4),
    # 1.43 for c (3.2). Measured after the warm-up, in eight runs: the worst host at
    # 1.02-1.42, c at 0.94-1.42 (spilling by free slots, in six runs, 1.17-1.25 and
    # 1.13-1.25). With the bands held at 0, in two runs, b held 1.94 times its share and
    # c 0.38. With heavy sessions placed (routing/heavy.py), in five runs, a at
    # 1.01-1.21, b 0.53-0.86, c 1.00-1.55: c can hold the third busiest session (6% of
    # the requests, a third of its share), placed, which its band cannot pass on. Later c
    # held the second (half its share) at 1.35-1.40 in four runs, once 1.63; with no heavy
    # session alone above a third of its host's share (heavy.ALONE), in ten runs, c at
    # 0.89-1.26, a at 1.06-1.24, b 0.67-0.92. With a light session's request sent past a
    # host queueing far above the fleet (routing/overflow.py), in three runs, the worst
    # host at 1.05-1.15, c at 0.95-0.97. What a
    # 30 s window of a host holds by chance shrinks as its share grows, like the band's
    # margin: 0.3 / sqrt(n) more (0.12 for a or b, 0.17 for c).
    bounds = [1.15 + 0.8 / math.sqrt(LOAD * h.slots) for h in HOSTS]
    assert all(o <= b for o, b in zip(occupancy, bounds, strict=True)), (occupancy, bounds)

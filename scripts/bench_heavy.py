#!/usr/bin/env python3
"""How often the heavy sessions' placement moves a session while the sessions' rates hold
steady, and how evenly it leaves the hosts: placed afresh from the rates each second, as
shares of the requests served (the tree before 2026-12-07), and kept where the hosts say
they hold them, as shares of the requests served or of those routed (daemon/routing/heavy.py).

The fleet bench's sessions (scripts/bench_fleet.py --sessions 300: session-0..299 of Zipf
popularity, 20 requests a second, each entering at one of five hosts at random) are
counted by five real SessionCounts, as the agents count them; each second every host's
busiest 8 are summed at the wire's two digits and placed on the bench's ring (three hosts
of 160 points, two of 80) by the real HeavySessions, against the model's requests a
second as the probes count them (served: over their 10 s window) or as the entries
count them (routed: like the sessions' rates, each entry's at two digits). Reported per run, from t = 60 s (the
counts settled): the placements that moved a session placed before, and the heaviest
host's expected load over its share (its heavy sessions plus the light sessions its ring
points own, at their true rates): what the bands are left to correct. The same arrivals
for both ways in a run.

    .venv/bin/python scripts/bench_heavy.py [--seeds 1 2 3 4] [--seconds 200]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
from collections.abc import Mapping

from loadmesh.daemon.routing.heavy import HeavySessions
from loadmesh.daemon.routing.ring import HashRing, hash64
from loadmesh.daemon.routing.session_counts import SessionCounts
from loadmesh.gossip.snapshot import MAX_SESSIONS, SESSION_KEY_BITS

HOSTS = {"h1": 160, "h2": 160, "h3": 160, "h4": 80, "h5": 80}
SESSIONS = 300
RATE = 20.0
SETTLED_S = 60
WINDOW_S = 10.0  # the probes' (probes/reader.py)
MODEL = 1
SHIFT = 64 - SESSION_KEY_BITS
RING = HashRing(HOSTS)
SHARES = {n: p / sum(HOSTS.values()) for n, p in HOSTS.items()}
KEYS = [hash64(f"session-{i}") >> SHIFT for i in range(SESSIONS)]
WEIGHTS = [1 / (i + 1) for i in range(SESSIONS)]
TRUE = {k: w / sum(WEIGHTS) for k, w in zip(KEYS, WEIGHTS, strict=True)}


def two_digits(rate: float) -> float:
    return float(f"{rate:.2g}")


def worst_load(placed: Mapping[int, str]) -> float:
    load = dict.fromkeys(SHARES, 0.0)
    for key, rate in TRUE.items():
        load[placed.get(key) or next(RING.walk_from(key << SHIFT))] += rate
    return max(load[n] / SHARES[n] for n in SHARES)


def run(seed: int, seconds: float) -> dict[str, tuple[int, int, float]]:
    rng = random.Random(seed)
    counts = {h: SessionCounts(1) for h in HOSTS}
    ways = {"afresh, served": HeavySessions(), "held, served": HeavySessions(),
            "held, routed": HeavySessions()}
    before: dict[str, dict[int, str]] = {way: {} for way in ways}
    moved = dict.fromkeys(ways, 0)
    worst: dict[str, list[float]] = {way: [] for way in ways}
    placements, t, next_s = 0, 0.0, 1.0
    window: collections.deque[float] = collections.deque()
    while t < seconds:
        t += rng.expovariate(RATE)
        session = rng.choices(KEYS, WEIGHTS)[0]
        entry = counts[rng.choice(list(HOSTS))]
        entry.saw(MODEL, session, round(t * 1000))
        entry.routed(MODEL, round(t * 1000))
        window.append(t)
        if t < next_s:
            continue
        next_s += 1.0
        while window[0] <= t - WINDOW_S:
            window.popleft()
        served = len(window) / min(t, WINDOW_S)
        routed = sum(two_digits(c.routed_rates(round(t * 1000))[MODEL]) for c in counts.values())
        summed: dict[int, float] = {}
        for host in counts.values():
            for key, rate in host.busiest(MAX_SESSIONS, 1, round(t * 1000)).get(MODEL, ()):
                summed[key] = summed.get(key, 0.0) + two_digits(rate)
        settled = t >= SETTLED_S
        placements += settled
        for way, heavy in ways.items():
            held = {k: [n] for k, n in before[way].items()} if way.startswith("held") else None
            heavy.place(MODEL, summed, routed if way.endswith("routed") else served, SHARES, SHARES.keys(),
                        lambda key: RING.walk_from(key << SHIFT), held)
            placed = dict(heavy.placed(MODEL))
            if settled:
                moved[way] += any(before[way].get(k, n) != n for k, n in placed.items())
                worst[way].append(worst_load(placed))
            before[way] = placed
    return {way: (moved[way], placements, statistics.fmean(worst[way])) for way in ways}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--seconds", type=float, default=200)
    args = parser.parse_args()
    print(f"heavy sessions: {SESSIONS} Zipf sessions at {RATE:g} requests/s over five entries, "
          f"placed each second; from t = {SETTLED_S} s of {args.seconds:g} s")
    print(f"  no session placed (the ring alone): heaviest host {worst_load({}):.3f} of its share")
    for seed in args.seeds:
        result = run(seed, args.seconds)
        print(f"  seed {seed}:")
        for way, (moved, n, worst) in result.items():
            print(f"    {way}: {moved} of {n} placements moved a session, heaviest host {worst:.3f} of its share")


if __name__ == "__main__":
    main()

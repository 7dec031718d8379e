#!/usr/bin/env python3
"""How often chance grows a sessions' band on the fleet bench's queues, and how soon a
real excess is told from chance at all.

The bands (daemon/routing/shed.py) grow on evidence that a host holds more requests in
flight than its share. Their evidence is counted in standard deviations of a Poisson
count, which is what an in-flight count is where nothing queues (tests/test_routing_shed.py:
once in 460 s at the share). The bench's hosts queue: each is simulated here as its engine
runs (scripts/sim_occupancy.py's model: B slots, a request held for its tokens times the
step, FIFO), given exactly its capacity's share of Poisson arrivals, and each steps a real
`Shedding` every 100 ms with every host's in-flight count, as its router would. Nothing
is moved (no feedback): every growth at the balanced load is chance. Then one host is given
more than its share, to time the first growth.

The second part is the floor for any rule: Page's CUSUM on a host's own arrivals (which
are Poisson whatever queues), tuned to the excess and to chance once in 600 s, at the
bench's 12 requests a second.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_occupancy import HOSTS, MEAN_TOKENS, SIGMA  # noqa: E402

from loadmesh.daemon.routing.shed import Shedding  # noqa: E402

MODEL = 1
TICK_MS = 100
BENCH_RPS = 12.0


def growths(seed: int, seconds: float, load: float, over: tuple[int, float] | None = None
            ) -> list[tuple[int, float | None]]:
    """Per host: how many times its band grew, and when first (s)."""
    rng = random.Random(seed)
    mu = math.log(MEAN_TOKENS) - SIGMA**2 / 2
    hosts = []
    for i, (slots, step_s) in enumerate(HOSTS):
        rate = load * slots / step_s / MEAN_TOKENS * (over[1] if over and over[0] == i else 1.0)
        hosts.append({"slots": slots, "step": step_s, "rate": rate, "next": rng.expovariate(rate),
                      "ends": [], "queue": [], "shed": Shedding(0.15), "grown": 0, "first": None})
    now_ms = 1_000_000
    for tick in range(round(seconds * 1000 / TICK_MS)):
        t = tick * TICK_MS / 1000
        for h in hosts:
            while h["next"] < t:
                tokens = max(1, min(1024, round(rng.lognormvariate(mu, SIGMA))))
                h["queue"].append(tokens * h["step"])
                h["next"] += rng.expovariate(h["rate"])
            while h["ends"] and h["ends"][0] <= t:
                heapq.heappop(h["ends"])
            while h["queue"] and len(h["ends"]) < h["slots"]:
                heapq.heappush(h["ends"], t + h["queue"].pop(0))
        now_ms += TICK_MS
        flight = [(len(h["ends"]) + len(h["queue"]), h["slots"]) for h in hosts]
        for i, h in enumerate(hosts):
            before = h["shed"].band(MODEL)[1]
            h["shed"].saw(MODEL, 0, now_ms)
            h["shed"].step(MODEL, flight[i][0], h["slots"], flight[:i] + flight[i + 1:], now_ms,
                           guests=False)
            if h["shed"].band(MODEL)[1] > before:
                h["grown"] += 1
                h["first"] = t if h["first"] is None else h["first"]
    return [(h["grown"], h["first"]) for h in hosts]


def page_alarm(lam: float, true: float, alt: float, threshold: float, rng: random.Random,
               limit: float = 3600.0) -> float:
    """Seconds until Page's CUSUM for rate alt * lam against lam crosses the threshold,
    on Poisson arrivals at true * lam."""
    s, t = 0.0, 0.0
    while t < limit:
        dt = rng.expovariate(true * lam)
        t += dt
        s = max(0.0, s - (alt - 1) * lam * dt) + math.log(alt)
        if s >= threshold:
            return t
    return limit


def page_threshold(lam: float, alt: float, mean_s: float, runs: int) -> float:
    """The threshold at which chance raises the alarm once in mean_s on average."""
    lo, hi = 0.5, 40.0
    for _ in range(24):
        mid = (lo + hi) / 2
        rng = random.Random(1)
        if statistics.fmean(page_alarm(lam, 1.0, alt, mid, rng) for _ in range(runs)) < mean_s:
            lo = mid
        else:
            hi = mid
    return hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--load", type=float, default=0.8)
    args = ap.parse_args()
    names = [f"h{i + 1}" for i in range(len(HOSTS))]
    print(f"{len(HOSTS)} hosts ({', '.join(f'{s}x{t * 1000:g}ms' for s, t in HOSTS)}), each "
          f"given its capacity's share at {args.load:.0%} load; {args.seeds} seeds x "
          f"{args.seconds:g} s")
    total = [0] * len(HOSTS)
    for seed in range(args.seeds):
        for i, (grown, _) in enumerate(growths(seed, args.seconds, args.load)):
            total[i] += grown
    span = args.seeds * args.seconds
    print("  bands grown by chance: "
          + " ".join(f"{n} {g} (one in {span / g:.0f} s)" if g else f"{n} 0"
                     for n, g in zip(names, total, strict=True)))
    for factor in (1.25, 1.5):
        firsts = [growths(seed, 120.0, args.load, (0, factor))[0][1] for seed in range(args.seeds)]
        shown = ", ".join("-" if f is None else f"{f:.0f}" for f in firsts)
        print(f"  h1 given {factor:g} times its share: its band first grew after {shown} s")
    print(f"the floor, from arrivals alone (Page's CUSUM, chance once in 600 s; the bench's "
          f"{BENCH_RPS:g} requests a second):")
    for share, who in ((0.125, "a small host (12.5%)"), (0.25, "a large host (25%)")):
        lam = BENCH_RPS * share
        for factor in (1.25, 1.5):
            threshold = page_threshold(lam, factor, 600.0, 200)
            rng = random.Random(2)
            times = sorted(page_alarm(lam, factor, factor, threshold, rng) for _ in range(400))
            q = statistics.quantiles(times, n=4)
            print(f"  {who}, {lam:g} a second, {factor:g} times its share: told after a median "
                  f"of {q[1]:.0f} s (quartiles {q[0]:.0f}, {q[2]:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

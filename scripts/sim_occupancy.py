#!/usr/bin/env python3
"""What the fleet bench's occupancy figure holds under an ideal load-blind split.

Each host of scripts/bench_fleet.py is simulated as its engine runs (tests/llm_server.py:
B sequences decode together, one token a step, the rest wait FIFO), which is B servers
each serving a request for its tokens times the step. Each host is given exactly its
capacity's share of Poisson arrivals (times --small for the host with the smallest batch),
tokens lognormal with the bench's mean and sigma. The figure is the bench's: a host's
share of the requests in flight, averaged over a window, over its share of the slots; the
worst host's, over many seeds. No routing can do better than the queues' own wander
without sending each request by the queues (docs/routing.md, "What occupancy any
assignment can be held to"); scripts/bench_fleet.py --sessions runs the same split on the
real fleet (`capacity`) beside loadmesh.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics

HOSTS = ((8, 0.020), (8, 0.020), (8, 0.020), (8, 0.040), (4, 0.020))  # slots, s a token
MEAN_TOKENS, SIGMA = 64, 0.8


def occupancy(seed: int, load: float, warm_s: float, window_s: float,
              small: float) -> list[float]:
    rng = random.Random(seed)
    mu = math.log(MEAN_TOKENS) - SIGMA**2 / 2
    smallest = min(slots for slots, _ in HOSTS)
    held = []
    for slots, step_s in HOSTS:
        rate = load * slots / step_s / MEAN_TOKENS * (small if slots == smallest else 1.0)
        free = [0.0] * slots
        area, t = 0.0, rng.expovariate(rate)
        while t < warm_s + window_s:
            tokens = max(1, min(1024, round(rng.lognormvariate(mu, SIGMA))))
            start = max(t, heapq.heappop(free))
            end = start + tokens * step_s
            heapq.heappush(free, end)
            area += max(0.0, min(end, warm_s + window_s) - max(t, warm_s))
            t += rng.expovariate(rate)
        held.append(area / window_s)
    slots_all = sum(slots for slots, _ in HOSTS)
    return [h / sum(held) / (slots / slots_all) for h, (slots, _) in zip(held, HOSTS, strict=True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--warm", type=float, default=30.0, help="seconds before the window")
    ap.add_argument("--windows", default="30,60,300", help="window lengths, seconds")
    ap.add_argument("--small", type=float, default=1.0,
                    help="the smallest host's arrivals as a share of its capacity's")
    args = ap.parse_args()
    print(f"{len(HOSTS)} hosts ({', '.join(f'{s}x{t * 1000:g}ms' for s, t in HOSTS)}), "
          f"{args.load:.0%} load, the smallest given {args.small:g} of its share; "
          f"{args.seeds} seeds")
    for window in (float(w) for w in args.windows.split(",")):
        runs = [occupancy(seed, args.load, args.warm, window, args.small) for seed in range(args.seeds)]
        worst = sorted(max(r) for r in runs)
        q = statistics.quantiles(worst, n=4)
        each = " ".join(f"{statistics.fmean(r[i] for r in runs):.2f}" for i in range(len(HOSTS)))
        print(f"  {window:g} s window: worst host median {q[1]:.2f} (quartiles {q[0]:.2f}, "
              f"{q[2]:.2f}), at most 1.25 in {sum(w <= 1.25 for w in worst) / len(worst):.0%}; "
              f"each host's mean {each}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

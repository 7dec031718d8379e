#!/usr/bin/env python3
"""Runs the default routing-quality simulation and prints, per policy and load, the
latency percentiles and the herding swing, then the issue's goals at 85 % load.

    .venv/bin/python scripts/bench_routing.py [--seed N] [--duration S] [--fleet-bench]

Exits 1 when a goal is missed. About a minute and a half on two cores. With --fleet-bench,
the fleet of scripts/bench_fleet.py instead (five hosts: three of 8 slots, one of 8 at half
speed, one of 4; plain Poisson arrivals, answers of 64 tokens at 20 ms on average, views
0.1-0.5 s old, one router per host) at 50, 80 and 95 %, to set beside that benchmark's
end-to-end P99s: the simulator knows no streams, so what compares is the answers' end.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from loadmesh.daemon.routing.simulator import LOADS, ServerKind, SimConfig, goal_checks, simulate

BENCH_FLEET = SimConfig(
    fleet=(ServerKind("h1-h3", 3, 2, 1.0), ServerKind("h4", 1, 2, 0.5), ServerKind("h5", 1, 1, 1.0)),
    slots_per_gpu=4, mean_service_s=1.28, service_sigma=0.8, routers=5, burst=0.0,
    gossip_delay_s=(0.1, 0.5), duration_s=300.0, tick_s=0.25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, default=SimConfig().duration_s,
                        help="simulated seconds measured per run, after the warm-up")
    parser.add_argument("--fleet-bench", action="store_true",
                        help="scripts/bench_fleet.py's five hosts, beside its end-to-end figures")
    args = parser.parse_args()
    if args.fleet_bench:
        return fleet_bench(args.seed)

    config = replace(SimConfig(), duration_s=args.duration)
    fleet = ", ".join(f"{k.count}x {k.name} ({k.gpus} GPU, speed {k.speed:g})" for k in config.fleet)
    print(f"fleet: {fleet}; {config.slots_per_gpu} slots per GPU; {config.routers} routers; "
          f"gossip delay {config.gossip_delay_s[0]:g}-{config.gossip_delay_s[1]:g} s; "
          f"{config.duration_s:g} s per run; seed {args.seed}")
    started = time.monotonic()
    report = simulate(seed=args.seed, config=config)
    elapsed = time.monotonic() - started

    swing = {(h["policy"], h["load"]): h["swing_p95"] for h in report["herding"]}
    print(f"\n{'policy':<14}{'load':>6}{'p50 ms':>10}{'p99 ms':>10}{'swing p95':>11}")
    for r in report["results"]:
        print(f"{r['policy']:<14}{r['load']:>6.2f}{r['p50_ms']:>10.0f}{r['p99_ms']:>10.0f}"
              f"{swing[(r['policy'], r['load'])]:>11.2f}")
    ages = ", ".join(f"{a['load']:.2f}: p50 {a['p50']} / p99 {a['p99']}" for a in report["view_age_ms"])
    print(f"\nage of the snapshot behind each loadmesh decision (ms) at {ages}")

    checks = goal_checks(report, 0.85)
    print("\ngoals at 85% load:")
    print(f"  loadmesh P99 / jsq_oracle P99  = {checks['p99_vs_oracle']:.3f}  (<= 1.3)  "
          f"{'ok' if checks['p99_vs_oracle_ok'] else 'MISSED'}")
    print(f"  round_robin P99 / loadmesh P99 = {checks['round_robin_vs_p99']:.3f}  (>= 2)  "
          f"{'ok' if checks['round_robin_vs_p99_ok'] else 'MISSED'}")
    print(f"  loadmesh swing / oracle swing  = {checks['swing_vs_oracle']:.3f}  (<= 2, no herding)  "
          f"{'ok' if checks['no_herding_ok'] else 'MISSED'}")
    for load in LOADS:
        if load != 0.85:
            other = goal_checks(report, load)
            print(f"  (at {load:.0%}: P99 vs oracle {other['p99_vs_oracle']:.3f}, "
                  f"round robin vs P99 {other['round_robin_vs_p99']:.3f}, "
                  f"swing vs oracle {other['swing_vs_oracle']:.3f})")
    print(f"\n{len(report['results'])} runs in {elapsed:.0f} s")
    return 0 if all(checks[k] for k in ("p99_vs_oracle_ok", "round_robin_vs_p99_ok", "no_herding_ok")) else 1


def fleet_bench(seed: int) -> int:
    loads = (0.5, 0.8, 0.95)
    report = simulate(loads=loads, policies=("loadmesh", "round_robin", "jsq_oracle"),
                      seed=seed, config=BENCH_FLEET)
    p99 = {(r["policy"], r["load"]): r["p99_ms"] for r in report["results"]}
    print(f"bench_fleet's fleet, simulated {BENCH_FLEET.duration_s:g} s per run, seed {seed}: "
          "P99 of the time to an answer's end (s)")
    print(f"{'load':>6}{'loadmesh':>10}{'round robin':>13}{'oracle':>8}{'loadmesh/oracle':>17}")
    for load in loads:
        lm, rr, oracle = (p99[(p, load)] / 1000 for p in ("loadmesh", "round_robin", "jsq_oracle"))
        print(f"{load:>6.0%}{lm:>10.2f}{rr:>13.2f}{oracle:>8.2f}{lm / oracle:>17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

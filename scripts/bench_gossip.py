#!/usr/bin/env python3
"""Run the gossip simulator on the goal scenarios of the mesh and print each goal next to
the measured figure, with a pass/fail mark.

    .venv/bin/python scripts/bench_gossip.py            # the full runs (several minutes)
    .venv/bin/python scripts/bench_gossip.py --quick    # shorter runs, rougher figures
    .venv/bin/python scripts/bench_gossip.py --json     # the raw simulator dicts

Scenarios run in parallel, one per CPU. The 1000-node runs dominate: the simulator runs
the real protocol core for every node, and at 1000 nodes that is about 200,000 snapshot
deliveries and 2 million announcements per simulated second.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from loadmesh.gossip.simulator import simulate


@dataclass(frozen=True)
class Goal:
    key: str
    limit: float
    compare: Callable[[float, float], bool] = operator.le
    text: str = "<="


@dataclass(frozen=True)
class Scenario:
    name: str
    args: dict[str, object]
    quick_seconds: float
    goals: tuple[Goal, ...]


SCENARIOS = (
    Scenario("100 nodes, no loss", {"nodes": 100, "seconds": 40}, 20, (
        Goal("convergence_p99_s", 1.5), Goal("urgent_p99_s", 0.2), Goal("bytes_per_node_per_s", 4700),
        Goal("x_floor", 2.0), Goal("liveness_bytes", 300))),
    Scenario("100 nodes, kill 5", {"nodes": 100, "seconds": 40, "kill": 5}, 25, (
        Goal("detect_dead_p99_s", 5.0), Goal("convergence_p99_s", 1.5))),
    Scenario("100 nodes, 20% loss", {"nodes": 100, "seconds": 40, "loss": 0.2}, 20, (
        Goal("false_dead", 0, operator.eq, "=="),)),
    Scenario("300 nodes, no loss", {"nodes": 300, "seconds": 20}, 14, (
        Goal("convergence_p99_s", 1.5), Goal("x_floor", 2.0), Goal("liveness_bytes", 300))),
    Scenario("1000 nodes, no loss", {"nodes": 1000, "seconds": 20}, 14, (
        Goal("convergence_p99_s", 1.5), Goal("urgent_p99_s", 0.2), Goal("x_floor", 2.0),
        Goal("liveness_bytes", 300))),
    Scenario("1000 nodes, kill 5", {"nodes": 1000, "seconds": 24, "kill": 5}, 20, (
        Goal("detect_dead_p99_s", 8.0),)),
    Scenario("1000 nodes, 20% loss", {"nodes": 1000, "seconds": 24, "loss": 0.2}, 16, (
        Goal("false_dead", 0, operator.eq, "=="),)),
)


def _run(args: dict[str, object]) -> tuple[dict[str, object], float]:
    start = time.monotonic()
    result = simulate(**args, time_cores=True)  # type: ignore[arg-type]
    return result, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--json", action="store_true", help="print the simulator's dicts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, nargs="*", help="only the scenarios of these sizes")
    opts = parser.parse_args()
    scenarios = [s for s in SCENARIOS if not opts.nodes or s.args["nodes"] in opts.nodes]
    runs = []
    for scenario in scenarios:
        args = dict(scenario.args, seed=opts.seed)
        if opts.quick:
            args["seconds"] = scenario.quick_seconds
        runs.append(args)
    # The longest first, so that the pool finishes together.
    order = sorted(range(len(runs)), key=lambda i: -int(runs[i]["nodes"]) * float(runs[i]["seconds"]))
    with ProcessPoolExecutor(max_workers=min(len(runs), os.cpu_count() or 1)) as pool:
        futures = {i: pool.submit(_run, runs[i]) for i in order}
        results = {i: f.result() for i, f in futures.items()}
    if opts.json:
        print(json.dumps([results[i][0] for i in range(len(runs))], indent=2))
        return 0
    failed = 0
    rows = [("scenario", "figure", "goal", "measured", "")]
    for i, scenario in enumerate(scenarios):
        result, wall = results[i]
        # Derived figures: bytes per byte of news, and liveness's share of the bytes.
        split = result["bytes_by_purpose"] or {}
        result["x_floor"] = round(result["bytes_per_node_per_s"] / result["content_floor_bytes_per_node_per_s"], 2)
        result["liveness_bytes"] = split.get("liveness")
        for goal in scenario.goals:
            value = result[goal.key]
            ok = value is not None and goal.compare(value, goal.limit)  # type: ignore[arg-type]
            failed += not ok
            rows.append((scenario.name, goal.key, f"{goal.text} {goal.limit:g}",
                         "none" if value is None else f"{value:g}", "PASS" if ok else "FAIL"))
        rows.append(("", f"({result['seconds']:g} s simulated, {result['versions']} versions, "
                     f"p50 {result['convergence_p50_s']} s, {result['bytes_per_node_per_s']} B/s "
                     f"for a content floor of {result['content_floor_bytes_per_node_per_s']} B/s "
                     f"(x{result['x_floor']:.1f}), {wall:.0f} s to run; a node's gossip core "
                     f"{result['core_cpu_pct']}% of a core)", "", "", ""))
        rows.append(("", "(bytes/s per node: " + ", ".join(f"{k} {v}" for k, v in split.items()) + ")",
                     "", "", ""))
    widths = [max(len(r[c]) for r in rows if r[1][:1] != "(") for c in range(5)]
    for row in rows:
        if row[1].startswith("("):
            print(f"{'':{widths[0]}}  {row[1]}")
        else:
            print("  ".join(f"{cell:{w}}" for cell, w in zip(row, widths)).rstrip())
    print(f"\n{failed} of {sum(len(s.goals) for s in scenarios)} goals missed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

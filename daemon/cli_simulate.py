"""`loadmesh simulate`: the simulators that run the real protocol and decision code."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from loadmesh.daemon import render


def _routing(args: argparse.Namespace) -> int:
    from loadmesh.daemon.routing.simulator import SimConfig, simulate

    config = SimConfig() if args.duration is None else replace(SimConfig(), duration_s=args.duration)
    report = simulate(loads=args.loads, seed=args.seed, config=config)
    print(json.dumps(report, indent=2) if args.json else _routing_table(report))
    return 0


def _routing_table(report: dict[str, Any]) -> str:
    swing = {(h["policy"], h["load"]): h["swing_p95"] for h in report["herding"]}
    rows = [(r["policy"], f"{r['load']:.2f}", f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}",
             f"{swing[(r['policy'], r['load'])]:.2f}") for r in report["results"]]
    return render.table(("POLICY", "LOAD", "P50_MS", "P99_MS", "SWING_P95"), rows)


def _gossip(args: argparse.Namespace) -> int:
    from loadmesh.gossip.simulator import simulate

    report = simulate(args.nodes, args.seconds, loss=args.loss, latency_ms=args.latency_ms,
                      kill=args.kill, seed=args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        width = max(map(len, report))
        print("\n".join(f"{key:<{width}} {value}" for key, value in report.items()))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a loss is a probability in [0, 1): {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 2:
        raise argparse.ArgumentTypeError(f"a load is a fraction of capacity, like 0.85: {text}")
    return value


def add_parser(commands: Any) -> None:
    simulate = commands.add_parser("simulate", help="run a simulator on the real code")
    kinds = simulate.add_subparsers(dest="simulation", required=True, metavar="WHAT")

    gossip = kinds.add_parser(
        "gossip", help="the real gossip core on a simulated network, with the reference workload")
    gossip.add_argument("--nodes", type=_positive_int, default=100)
    gossip.add_argument("--seconds", type=float, default=60.0, help="simulated time")
    gossip.add_argument("--loss", type=_probability, default=0.0, metavar="P",
                        help="probability that a datagram is lost")
    gossip.add_argument("--latency-ms", type=float, default=2.0, metavar="L",
                        help="one-way network latency")
    gossip.add_argument("--kill", type=int, default=0, metavar="K",
                        help="nodes killed half-way through, for failure detection")
    gossip.add_argument("--seed", type=int, default=0)
    gossip.add_argument("--json", action="store_true")
    gossip.set_defaults(func=_gossip)

    routing = kinds.add_parser(
        "routing", help="routing quality on a simulated GPU fleet, against other policies")
    routing.add_argument("--loads", type=_fraction, nargs="+", default=[0.7, 0.85, 0.95],
                         metavar="LOAD", help="offered loads as fractions of capacity")
    routing.add_argument("--seed", type=int, default=0)
    routing.add_argument("--duration", type=float, metavar="S",
                         help="simulated seconds per run (default: the simulator's)")
    routing.add_argument("--json", action="store_true")
    routing.set_defaults(func=_routing)

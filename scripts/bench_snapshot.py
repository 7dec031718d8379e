#!/usr/bin/env python3
"""The reference workload's snapshot bytes: the mean full encoding and the mean delta of
one node's versions (gossip/workload.py), the figures docs/snapshot.md quotes.

    .venv/bin/python scripts/bench_snapshot.py [--versions N] [--seeds 1 2 3]
"""

from __future__ import annotations

import argparse
import statistics

from loadmesh.gossip.workload import encoded_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    for seed in args.seeds:
        fulls, deltas = encoded_sizes(args.versions, seed)
        print(f"seed {seed}: {args.versions} versions, full {statistics.mean(fulls):.1f} bytes, "
              f"delta {statistics.mean(deltas):.1f} bytes (max {max(deltas)})")


if __name__ == "__main__":
    main()

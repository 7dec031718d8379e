#!/usr/bin/env python3
"""Print what loadmesh's GPU collector reads from NVML on this machine.

Run it on a GPU host to check the driver, the figures and the collector's health before
starting the agent: `.venv/bin/python scripts/check_nvml.py [--samples N]`.
Exits 1 when NVML or a GPU is unavailable, 2 when some GPU is failing.
"""

from __future__ import annotations

import argparse
import sys
import time

from loadmesh.daemon.collectors.gpu import GpuCollector


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2, help="samples to print, one second apart")
    args = parser.parse_args()

    collector = GpuCollector()
    collector.start()
    state, reason = collector.health
    if state == "off":
        print(f"gpu: off: {reason}", file=sys.stderr)
        print("No usable NVML: is the NVIDIA driver installed and a GPU visible here?", file=sys.stderr)
        return 1
    try:
        for d in collector.devices:
            print(f"gpu {d.index}: {d.name or '?'} {d.uuid or '?'}")
        for n in range(args.samples):
            if n:
                time.sleep(1)
            for g in collector.sample():
                print(
                    f"gpu {g.index}: {'healthy' if g.healthy else 'UNHEALTHY'} util={g.util_pct}% "
                    f"mem={g.mem_used_mib}/{g.mem_total_mib} MiB temp={g.temp_c}C "
                    f"power={g.power_w}/{g.power_limit_w} W throttle=0x{g.throttle_reasons:x} "
                    f"processes={g.processes}"
                )
        state, reason = collector.health
        print(f"gpu: {state}: {reason}")
        return 2 if state == "degraded" else 0
    finally:
        collector.close()


if __name__ == "__main__":
    sys.exit(main())

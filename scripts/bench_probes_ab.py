#!/usr/bin/env python3
"""The probes' kernel time per request, this tree's against another's, side by side.

bench_probes.py (a) in turns: this machine's runs of the same probes differ by up to 40%
from one minute to the next (quiet and busy spells of the shared host), which hides any
change of less than that between two separate runs. So both probe sets are compiled once
and attached in turn (ProbeSet.pause/resume, no recompile) under the same wrk load,
`--seconds` each, each side first in every other round; the figure is the median over the
rounds of B/A, each round's two phases a few seconds apart.

    sudo .venv/bin/python scripts/bench_probes_ab.py --baseline REV [--rounds 12] [--one-model]

A is the baseline: probes/ at git revision REV, its loader and map reader with its C
parts, so its maps may be laid out otherwise than this tree's (or a directory of C parts,
compiled by this tree's loader: their maps must keep this tree's layout). B is this tree.
Kernel time is net of the timing's floor, as in bench_probes.py (a). --one-model sends
one model on every connection, as clients of a vLLM or SGLang server do, where
bench_probes.py's wrk turns three on each.

Needs root, nginx and wrk (`bash scripts/setup.sh --bench`); the namespace is removed on
exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

from bench_probes import MODELS, NGINX_CONF, PORT, SIZES, WRK_LUA, Floor, cost_phase, run_wrk

import nettopo  # tests/nettopo.py, on the path that bench_probes sets

from loadmesh.probes import MapSizes, ProbeSet
from loadmesh.probes.loader import ProbeUnavailable

ROOT = Path(__file__).resolve().parent.parent
BASELINE_PACKAGE = "loadmesh_baseline_probes"


def baseline_probes(rev: str, into: Path) -> Callable[..., Any]:
    """A ProbeSet factory for the baseline: a directory of C parts is compiled by this
    tree's loader (its maps must keep this tree's layout); a git revision brings its whole
    probes/ package, loader and map reader too, imported under a name of its own, so its
    maps may be laid out otherwise."""
    if Path(rev).is_dir():
        return partial(ProbeSet, sources=Path(rev))
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:probes"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".c", ".h", ".py")):
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:probes/{name}"],
                                  check=True, capture_output=True, text=True).stdout
            (into / name).write_text(text)
    spec = importlib.util.spec_from_file_location(
        BASELINE_PACKAGE, into / "__init__.py", submodule_search_locations=[str(into)])
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE_PACKAGE] = package
    spec.loader.exec_module(package)

    def make(interfaces: list[str], ports: list[int], sizes: MapSizes) -> Any:
        """The baseline's ProbeSet, with the sizes of the maps both layouts have."""
        theirs = {f.name for f in fields(package.MapSizes)}
        return package.ProbeSet(interfaces, ports, package.MapSizes(
            **{f.name: getattr(sizes, f.name) for f in fields(sizes) if f.name in theirs}))
    return make


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision, or a directory of C parts")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seconds", type=int, default=2, help="wrk run per phase")
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--one-model", action="store_true")
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    models = ", ".join(f"'{m}'" for m in (MODELS[:1] if args.one_model else MODELS))
    net: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="lm-ab-") as tmp, nettopo.veth_netns("lmab") as topo:
        d = Path(tmp)
        (d / "baseline").mkdir()
        make = {"A": baseline_probes(args.baseline, d / "baseline"), "B": ProbeSet}
        (d / "nginx.conf").write_text(NGINX_CONF.format(dir=d, port=PORT))
        lua = d / "post.lua"
        lua.write_text(WRK_LUA.format(models=models))
        url = f"http://{topo.ns_v4}:{PORT}/v1/chat/completions"
        with topo.ns.popen(["nginx", "-c", str(d / "nginx.conf"), "-g", "daemon off;"]):
            time.sleep(1)
            run_wrk(url, lua, args.conns, 2)  # warm-up
            floor = Floor(topo.host_if)
            sets: dict[str, ProbeSet] = {}
            try:
                for side in ("A", "B"):
                    sets[side] = make[side]([topo.host_if], [PORT], SIZES)
                    try:
                        sets[side].start()
                    except ProbeUnavailable as exc:
                        name = args.baseline if side == "A" else "this tree"
                        raise SystemExit(f"{side} ({name}): {exc}") from exc
                    sets[side].pause()
                for r in range(args.rounds):
                    for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                        probes = sets[side]
                        probes.resume()
                        try:
                            run_wrk(url, lua, args.conns, 1)
                            c = cost_phase(probes, url, lua, args.conns, args.seconds, floor)
                        finally:
                            probes.pause()
                        net[side].append(c["ns_per_req"] - c["floor_ns_per_req"])
                        print(f"round {r + 1} {side}: {net[side][-1]:.0f} ns a request net "
                              f"at {c['rps']:.0f} req/s, errors {c['errors'] or 'none'}",
                              flush=True)
            finally:
                for probes in sets.values():
                    probes.stop()
    ratios = [b / a for a, b in zip(net["A"], net["B"])]
    print(f"A ({args.baseline}): median {statistics.median(net['A']):.0f} ns; "
          f"B (this tree): median {statistics.median(net['B']):.0f} ns; "
          f"B/A median {statistics.median(ratios):.3f} over {len(ratios)} rounds, "
          f"B lower in {sum(x < 1 for x in ratios)}")


if __name__ == "__main__":
    main()

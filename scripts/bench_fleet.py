#!/usr/bin/env python3
"""loadmesh routing a real fleet, against round robin, random, an oracle and sglang-router.

Five network namespaces on a bridge are five "GPU hosts". Each runs an OpenAI-compatible
server on vLLM's HTTP stack with an engine that batches continuously (tests/llm_server.py:
B sequences decode together, one token each per step, the rest wait in FIFO order, 429
past 64 waiting) and a real `loadmesh agent` (probes on the host's interface, gossip over
the bridge). The fleet is uneven on purpose: h4 decodes at half speed, h5 has half the
batch. A sixth namespace holds the clients (scripts/fleet_load.py: one asyncio process,
openai-style requests over httpx, 80% streamed, max_tokens lognormal with mean 64,
prompts of 400-4000 characters) and, for its turn, sglang-router (PyPI, its own venv).

The same Poisson arrivals (seeded) are sent by every policy, at each load (a fraction of
the fleet's capacity: its token rate over the mean answer length), one policy after the
other, the servers drained in between:

  loadmesh     each request asks its entry host's agent (/v1/best), goes there, and
               reports back (/v1/feedback): a gateway on every host
  round_robin, random
  oracle       join the shortest queue, knowing every queue exactly and each server's speed
  sglang       sglang-router --policy cache_aware in front of the same servers

Reported per policy: P50/P99 of time to first token (streamed requests) and end to end
(all), the 429 rate, each host's share, and the worst 2 s bin (the largest share one host
took of a bin). With --slowdown, one more run per policy in which h1's decode slows to half
speed at half time: seconds until its share (2 s bins) falls below the midpoint of its
share before and its capacity share after.

Needs root. `make bench-fleet` runs it; the first run installs sglang-router into
/var/tmp/loadmesh-sglang. Everything is stopped and the namespaces removed on every exit.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import nettopo  # noqa: E402  (tests/nettopo.py: namespaces that always get cleaned up)
from llm_clients import nearest_rank  # noqa: E402
from metrics_helpers import wait_for  # noqa: E402

from daemon.client import AgentUnavailable, ApiError, Client  # noqa: E402

PORT = 8000
GOSSIP_PORT = 7946
ROUTER_PORT = 30000
MODEL = "fleet-model"
LOADMESH = str(Path(sys.executable).with_name("loadmesh"))
SGLANG_VENV = Path("/var/tmp/loadmesh-sglang")
SGLANG_VERSION = "0.3.2"
MEAN_TOKENS = 64
STREAMED = 0.8
BIN_S = 2.0
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    step_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.slots * 1000 / self.step_ms


HOSTS = (Host("h1", 8, 20), Host("h2", 8, 20), Host("h3", 8, 20), Host("h4", 8, 40),
         Host("h5", 4, 20))


def arrivals(rate: float, seconds: float, seed: int, hosts: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    sigma = 0.8
    mu = math.log(MEAN_TOKENS) - sigma * sigma / 2
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append({"t": round(t, 4), "entry": rng.randrange(hosts),
                    "max_tokens": max(1, min(1024, round(rng.lognormvariate(mu, sigma)))),
                    "prompt": rng.randint(400, 4000), "stream": rng.random() < STREAMED,
                    "session": None})
        t += rng.expovariate(rate)
    return out


def capacity_rps(hosts: tuple[Host, ...], plan: list[dict[str, Any]]) -> float:
    mean = statistics.fmean(a["max_tokens"] for a in plan) if plan else MEAN_TOKENS
    return sum(h.tokens_per_s for h in hosts) / mean


def post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def ensure_sglang() -> Path | None:
    python = SGLANG_VENV / "bin" / "python"
    if not python.exists():
        print(f"bench_fleet: installing sglang-router {SGLANG_VERSION} into {SGLANG_VENV}",
              file=sys.stderr)
        subprocess.run(["python3.11", "-m", "venv", str(SGLANG_VENV)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q",
                               f"sglang-router=={SGLANG_VERSION}"])
        if done.returncode != 0:
            print("bench_fleet: sglang-router did not install; its column is left out",
                  file=sys.stderr)
            return None
    return python


def agent_config(host: Host, node: nettopo.MeshNode, seed: str, work: Path) -> Path:
    static = ", ".join(f'{h.name} = ["{MODEL}"]' for h in HOSTS)
    path = work / f"{host.name}.toml"
    path.write_text(
        f'node_id = "{host.name}"\nstate_dir = "{work / ("state-" + host.name)}"\n'
        f'advertise = "{node.v4}"\n'
        f'[api]\nsocket = "{work / (host.name + ".sock")}"\n'
        f'[probes]\ninterfaces = ["{node.ifname}"]\nports = [{PORT}]\nrequired = true\n'
        f'[gossip]\nbind = "{node.v4}:{GOSSIP_PORT}"\nseeds = ["{seed}:{GOSSIP_PORT}"]\n'
        f'[metrics]\nlisten = ""\n'
        f'[routing]\nstatic_models = {{ {static} }}\n')
    return path


@contextlib.contextmanager
def started(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield proc
    finally:
        nettopo.stop_process(proc)  # type: ignore[arg-type]


def in_ns(ns: nettopo.Netns, argv: list[str]) -> list[str]:
    # nsenter keeps this mount namespace's /sys (and tracefs); `ip netns exec` would not
    return ["nsenter", f"--net=/run/netns/{ns.name}", "--", *argv]


@contextlib.contextmanager
def inside(ns: nettopo.Netns) -> Iterator[None]:
    """This process in ns (the clients' namespace), where the servers and the router can be
    reached over the bridge; back in its own before the namespaces are removed, since the
    removal ends every process left inside."""
    libc = ctypes.CDLL(None, use_errno=True)

    def enter(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {path}")
        finally:
            os.close(fd)

    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        enter(f"/run/netns/{ns.name}")
        try:
            yield
        finally:
            enter(f"/proc/self/fd/{home}")
    finally:
        os.close(home)


def candidates(sock: str) -> int:
    try:
        with Client(sock) as c:
            best = c.get("/v1/best", model=MODEL)
            health = c.get("/healthz")
    except (AgentUnavailable, ApiError, OSError):
        return 0
    if health["components"]["probes"]["state"] != "ok":
        return 0
    return 1 + len(best.get("alternatives", ()))


def drained(urls: list[str]) -> bool:
    try:
        stats = [get_json(u + "/stats") for u in urls]
    except OSError:
        return False
    return all(st["waiting"] + st["running"] == 0 for st in stats)


def pctl(values: list[float], q: float) -> float | None:
    return nearest_rank(values, q) if values else None


def host_bins(rows: list[dict[str, Any]], start_s: float = 0.0) -> dict[int, Counter[str]]:
    """Requests per host in each BIN_S bin from start_s, by the bin's index."""
    bins: dict[int, Counter[str]] = {}
    for r in rows:
        if r["host"] and r["t"] >= start_s:
            bins.setdefault(int((r["t"] - start_s) // BIN_S), Counter())[r["host"]] += 1
    return bins


def summarize(rows: list[dict[str, Any]], hosts: tuple[Host, ...]) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == 200]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    share = Counter(r["host"] for r in rows if r["host"])
    sent = sum(share.values()) or 1
    worst = max((max(c.values()) / sum(c.values()) for c in host_bins(rows).values()
                 if sum(c.values()) >= 10), default=0.0)
    return {"requests": len(rows), "ok": len(ok),
            "ttft_p50": pctl(ttft, 0.5), "ttft_p99": pctl(ttft, 0.99),
            "e2e_p50": pctl(e2e, 0.5), "e2e_p99": pctl(e2e, 0.99),
            "rate_429": sum(r["status"] == 429 for r in rows) / max(len(rows), 1),
            "failed": sum(r["status"] not in (200, 429) for r in rows),
            "share": {h.name: share[h.name] / sent for h in hosts}, "worst_bin": worst,
            "reasons": Counter(r["reason"] for r in rows if r["reason"]).most_common(3)}


def shift_s(rows: list[dict[str, Any]], host: str, at_s: float, before: float,
            after: float) -> float | None:
    """Seconds from at_s until host's share of a 2 s bin first falls below the midpoint
    of `before` and `after` and stays there for the rest of the run."""
    mid = (before + after) / 2
    bins = host_bins(rows, at_s)
    shares = [bins[i][host] / sum(bins[i].values()) if i in bins else 0.0
              for i in range(max(bins, default=-1) + 1)]
    for i in range(len(shares)):
        if all(s < mid for s in shares[i:]):
            return (i + 1) * BIN_S
    return None


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--loads", default="0.5,0.8,0.95")
    ap.add_argument("--policies", default="loadmesh,round_robin,random,oracle,sglang")
    ap.add_argument("--slowdown", action="store_true", help="also the slowdown event at 80%%")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_fleet: run as root", file=sys.stderr)
        return 2
    policies = args.policies.split(",")
    sglang = ensure_sglang() if "sglang" in policies else None
    if sglang is None and "sglang" in policies:
        policies.remove("sglang")
    loads = [float(x) for x in args.loads.split(",")]
    out: dict[str, Any] = {"hosts": [h.__dict__ for h in HOSTS], "runs": []}
    with tempfile.TemporaryDirectory(prefix="lm-fleet-") as tmp, \
            nettopo.bridge_mesh(len(HOSTS) + 1, "lmf") as nodes, contextlib.ExitStack() as stack:
        work = Path(tmp)
        client_node, host_nodes = nodes[0], nodes[1:]
        stack.enter_context(inside(client_node.ns))
        urls = [f"http://{n.v4}:{PORT}" for n in host_nodes]
        for host, node in zip(HOSTS, host_nodes):
            stack.enter_context(started(node.ns.argv([
                sys.executable, str(ROOT / "tests" / "llm_server.py"), "--port", str(PORT),
                "--slots", str(host.slots), "--step-ms", str(host.step_ms),
                "--max-waiting", "64", "--name", host.name]), work / f"{host.name}-server.log"))
        for host, node in zip(HOSTS, host_nodes):
            conf = agent_config(host, node, host_nodes[0].v4, work)
            stack.enter_context(started(in_ns(node.ns, [LOADMESH, "agent", "--config", str(conf)]),
                                        work / f"{host.name}-agent.log"))
        socks = [str(work / f"{h.name}.sock") for h in HOSTS]
        wait_for(lambda: all(candidates(s) >= min(len(HOSTS), 3) for s in socks), 60)
        hosts_plan = [{"name": h.name, "url": u, "socket": s}
                      for h, u, s in zip(HOSTS, urls, socks)]
        if sglang is not None:
            stack.enter_context(started([
                str(sglang), "-m", "sglang_router.launch_router", "--host", client_node.v4,
                "--port", str(ROUTER_PORT), "--policy", "cache_aware", "--worker-urls", *urls,
                "--disable-retries", "--log-level", "warn"], work / "sglang.log"))
            wait_for(lambda: _answers(f"http://{client_node.v4}:{ROUTER_PORT}/health"), 60)

        def run(policy: str, plan: list[dict[str, Any]], slow_at: float | None) -> list[dict]:
            wait_for(lambda: drained(urls), 120)
            for host, url in zip(HOSTS, urls):
                post_json(url + "/speed", {"step_ms": host.step_ms})
            spec = {"policy": "router" if policy == "sglang" else policy, "model": MODEL,
                    "hosts": hosts_plan, "arrivals": plan, "seed": args.seed,
                    "router_url": f"http://{client_node.v4}:{ROUTER_PORT}"}
            plan_path, result = work / "plan.json", work / "result.json"
            plan_path.write_text(json.dumps(spec))
            load = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "fleet_load.py"),
                                     str(plan_path), str(result)])
            if slow_at is not None:
                time.sleep(slow_at)
                post_json(urls[0] + "/speed", {"step_ms": HOSTS[0].step_ms * 2})
            if load.wait(timeout=args.seconds + 600) != 0:
                raise RuntimeError(f"fleet_load.py failed for {policy}")
            return json.loads(result.read_text())

        total = sum(h.tokens_per_s for h in HOSTS)
        print(f"loadmesh fleet bench: {len(HOSTS)} hosts "
              f"({', '.join(f'{h.name} {h.slots}x{h.step_ms:g}ms' for h in HOSTS)}; "
              f"{total:.0f} tokens/s in all), {args.seconds:g} s per run, "
              f"{STREAMED:.0%} streamed, {os.cpu_count()} CPUs")
        # the capacity in requests/s, from the mean answer length of a long draw
        capacity = capacity_rps(HOSTS, arrivals(1.0, 1000, args.seed, len(HOSTS)))
        for load in loads:
            rate = load * capacity
            plan = arrivals(rate, args.seconds, args.seed, len(HOSTS))
            print(f"\nload {load:.0%}: {rate:.1f} requests/s, {len(plan)} arrivals")
            print(f"  {'policy':12} {'ttft p50':>8} {'p99':>7} {'e2e p50':>8} {'p99':>7} "
                  f"{'429':>6} {'worst 2s':>8}  shares")
            for policy in policies:
                rows = run(policy, plan, None)
                s = summarize(rows, HOSTS)
                out["runs"].append({"load": load, "policy": policy, "summary": s, "rows": rows})
                shares = " ".join(f"{k} {v:.0%}" for k, v in s["share"].items())
                print(f"  {policy:12} {fmt_s(s['ttft_p50']):>8} {fmt_s(s['ttft_p99']):>7} "
                      f"{fmt_s(s['e2e_p50']):>8} {fmt_s(s['e2e_p99']):>7} "
                      f"{s['rate_429']:>6.1%} {s['worst_bin']:>8.0%}  {shares}"
                      + (f"  (failed {s['failed']})" if s["failed"] else "")
                      + (f"  {s['reasons']}" if s["reasons"] else ""), flush=True)
        if args.slowdown:
            rate = 0.8 * capacity
            plan = arrivals(rate, args.seconds, args.seed + 1, len(HOSTS))
            at = args.seconds / 2
            before = HOSTS[0].tokens_per_s / total
            after = HOSTS[0].tokens_per_s / 2 / (total - HOSTS[0].tokens_per_s / 2)
            print(f"\nslowdown: h1 at half speed from t={at:g} s, 80% load; its capacity share "
                  f"{before:.0%} -> {after:.0%}")
            for policy in policies:
                if policy in ("round_robin", "random"):
                    continue
                rows = run(policy, plan, at)
                s = summarize([r for r in rows if r["t"] >= at], HOSTS)
                shift = shift_s(rows, "h1", at, before, after)
                out["runs"].append({"slowdown": at, "policy": policy, "summary": s,
                                    "rows": rows, "shift_s": shift})
                print(f"  {policy:12} shift {fmt_s(shift)} s; after it: h1 share "
                      f"{s['share']['h1']:.0%}, ttft p99 {fmt_s(s['ttft_p99'])} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())

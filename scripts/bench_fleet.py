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
took of a bin), and for loadmesh the round trip of its /v1/best as the client saw it. With
--slowdown, one more run per policy in which h1's decode slows to half speed at half time:
seconds until its share (2 s bins) falls below the midpoint of its share before and its
capacity share after. With --sessions N, last, a loadmesh run at 80% whose requests belong
to N sessions of Zipf popularity, h3 killed (server and agent, SIGKILL) at half time: the
share of each session's requests on its most common host, how often two agents asked at
the same moment named the same peer, how often two requests of one session entering at
different hosts within a second went to the same host, each host's
share of the requests in flight (time-averaged) over its share of the fleet's batch slots
(equal when every host is equally busy: a slot is one stream, so a host at half the speed
holds each request twice as long and, equally busy, takes half as many), and after the kill,
how much of the other hosts' sessions moved and when h3 was last named, with the same count
over an equal window before the kill beside it: what the bands move with no kill. The
sessions run follows --warmup seconds of loadmesh without sessions, so that the agents
know each host's batch and pace as it is then (after the slowdown runs, h1 at its own
speed again); with
--session-warmup S, the same sessions' traffic runs S seconds more before it, in the same
load, and the figures are of what follows (a fleet that has carried its sessions a while,
as one in service has, rather than one whose sessions all begin at once): 30 s by default,
the figures of those first 30 s printed apart (--session-warmup 0 measures from the
sessions' start). Two agents' agreement is asked directly: each session request's
question goes at the same moment to a second agent, drawn, as a dry run
(scripts/fleet_load.py). Beside it, on
the same arrivals up to the kill (--session-baselines, run first): `capacity`, each
request to a host drawn in proportion to its capacity, what any load-blind split at best
achieves, `capacity_sessions`, each session on one host drawn so (an ideal static
consistent hash), and `oracle`, each request to the shortest queue (sessions ignored): at
80% load a host's queue wanders by itself, and these say how much of a host's occupancy
no assignment of sessions can remove, and what sending each request by the queues does
instead. The
agents run the shipped defaults; --agent-toml appends TOML to each one's configuration, to
measure a setting on the same fleet and arrivals (docs/routing.md: the snapshot tick).

Needs root. `make bench-fleet` runs it; the first run installs sglang-router into
/var/tmp/loadmesh-sglang. Everything is stopped and the namespaces removed on every exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from loadmesh.daemon.client import AgentUnavailable, ApiError, Client  # noqa: E402
from loadmesh.daemon.routing.reasons import Reason  # noqa: E402
from fleet import (BIN_S, STREAMED, Host, affinity, agreement, answers, arrivals, capacity_rps,  # noqa: E402
                   fleet, get_json, host_bins, started, worst_bin)
from llm_clients import nearest_rank  # noqa: E402
from metrics_helpers import wait_for  # noqa: E402

ROUTER_PORT = 30000
SGLANG_VENV = Path("/var/tmp/loadmesh-sglang")
SGLANG_VERSION = "0.3.2"
HOSTS = (Host("h1", 8, 20), Host("h2", 8, 20), Host("h3", 8, 20), Host("h4", 8, 40),
         Host("h5", 4, 20))
HOST_NAMES = [h.name for h in HOSTS]
# The sessions' first seconds, reported apart from the measured run that follows them.
COLD_S = 30.0


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


def pctl(values: list[float], q: float) -> float | None:
    return nearest_rank(values, q) if values else None


def summarize(rows: list[dict[str, Any]], hosts: tuple[Host, ...]) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == 200]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    share = Counter(r["host"] for r in rows if r["host"])
    sent = sum(share.values()) or 1
    worst = worst_bin(rows)
    best = [r["best_ms"] for r in rows if r["best_ms"] is not None]
    return {"requests": len(rows), "ok": len(ok),
            "ttft_p50": pctl(ttft, 0.5), "ttft_p99": pctl(ttft, 0.99),
            "e2e_p50": pctl(e2e, 0.5), "e2e_p99": pctl(e2e, 0.99),
            "rate_429": sum(r["status"] == 429 for r in rows) / max(len(rows), 1),
            "failed": sum(r["status"] not in (200, 429) for r in rows),
            "share": {h.name: share[h.name] / sent for h in hosts}, "worst_bin": worst,
            "reasons": Counter(r["reason"] for r in rows if r["reason"]).most_common(3),
            "best_ms": {"p50": pctl(best, 0.5), "p99": pctl(best, 0.99),
                        "max": max(best, default=None)}}


def shift_s(rows: list[dict[str, Any]], host: str, at_s: float, before: float,
            after: float) -> tuple[float | None, float | None]:
    """Seconds from at_s until host's share of a 2 s bin first falls below the midpoint
    of `before` and `after`, and until it falls below it for good (for the rest of the
    run: a bin of some 40 requests above the midpoint by chance moves this one)."""
    mid = (before + after) / 2
    bins = host_bins(rows, at_s)
    shares = [bins[i][host] / sum(bins[i].values()) if i in bins else 0.0
              for i in range(max(bins, default=-1) + 1)]
    first = next((i for i, s in enumerate(shares) if s < mid), None)
    settled = next((i for i in range(len(shares)) if all(s < mid for s in shares[i:])), None)

    def end_of(i: int | None) -> float | None:
        return None if i is None else (i + 1) * BIN_S
    return end_of(first), end_of(settled)


def moved(rows: list[dict[str, Any]], home: dict[str, str], killed: str,
          from_s: float, to_s: float = math.inf) -> tuple[float, int]:
    """Of the requests from from_s to to_s of the sessions whose home is not the killed
    host, the share sent elsewhere than their home, and how many there were."""
    after = [r for r in rows if r["host"] and from_s <= r["t"] < to_s and home.get(r["session"])
             not in (None, killed)]
    return sum(r["host"] != home[r["session"]] for r in after) / max(1, len(after)), len(after)


def churn(rows: list[dict[str, Any]], kill_at: float, killed: str,
          from_s: float) -> tuple[float, float | None, float | None]:
    """The same count as moved_after over equal windows, one from kill_at + 4 s and one as
    far before the kill, with no kill in it (its home from the 10 s before it): what the
    bands move anyway, which a kill need not have caused. (window, after, before)."""
    end = max((r["t"] for r in rows), default=kill_at)
    window = min(end - kill_at - 4, kill_at - from_s - 14)
    if window <= 0:
        return 0.0, None, None
    ref = kill_at - 4 - window
    before = moved(rows, affinity(rows, ref - 10, ref)[0], killed, ref + 4, kill_at)[0]
    after = moved(rows, affinity(rows, kill_at - 10, kill_at)[0], killed, kill_at + 4,
                  kill_at + 4 + window)[0]
    return window, after, before


def homed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows less the requests sent past a queueing host (overflow.py): one request
    elsewhere, its session's host unchanged, which a move of sessions does not count."""
    return [r for r in rows if r["reason"] != Reason.SESSION_OVERFLOW]


def session_figures(rows: list[dict[str, Any]], kill_at: float, killed: str,
                    from_s: float = 0.0) -> dict[str, Any]:
    """Affinity from from_s to the kill (request-weighted share of each session's requests on its
    most common host; pairs of one session's requests entering at different hosts within
    a second of each other that went to the same host; the requests whose second agent,
    asked at the same moment, named the same peer), and after it: the sessions of the
    other hosts sent elsewhere from kill_at + 4 s, their home the host they were on in the
    last 10 s before the kill (where the kill found them) and, for comparison, their most
    common host before it (which also counts a session passed on at t = 12 s as moved by
    the kill at 30 s); and the killed host's last answer."""
    home, sticky, agree, pairs = affinity(rows, from_s, kill_at)
    agree_now, asked = agreement(rows, from_s, kill_at)
    last_home = affinity(rows, kill_at - 10, kill_at)[0]
    moved_after, after = moved(rows, last_home, killed, kill_at + 4)
    named = [r["t"] - kill_at for r in rows if r["host"] == killed and r["t"] >= kill_at]
    return {"sticky": sticky, "agree": agree, "pairs": pairs, "agree_now": agree_now, "asked": asked,
            "moved_after": moved_after, "after": after,
            "moved_after_by_first_half": moved(rows, home, killed, kill_at + 4)[0],
            "churn": churn(rows, kill_at, killed, from_s),
            "churn_homed": churn(homed(rows), kill_at, killed, from_s),
            "killed_last_s": max(named, default=0.0),
            "reasons": Counter(r["reason"] for r in rows if r["reason"]).most_common(4)}


def cold_start(rows: list[dict[str, Any]], flight: InFlight, start: float,
               end_s: float) -> dict[str, Any] | None:
    """The sessions' first end_s seconds, where the measured run comes after them: every
    session begun at once and unknown to the agents, whose counts of them fill from
    nothing (a fleet's first minute, or a fleet-wide change of its clients)."""
    if end_s <= 0:
        return None
    occupancy = dict(zip(HOST_NAMES, flight.occupancy(start, end_s), strict=True))
    return {"s": end_s, "sticky": affinity(rows, 0.0, end_s)[1],
            "agree_now": agreement(rows, 0.0, end_s)[0], "occupancy": occupancy}


class InFlight:
    """Each server's waiting + running, polled from a thread until stopped: the
    time-averaged occupancy that the sessions' bound is about. A host dropped (killed)
    counts no slots from then on."""

    def __init__(self, urls: list[str], slots: list[int]) -> None:
        self.urls = urls
        self.slots = slots
        self.alive = [True] * len(urls)
        self.samples: list[tuple[float, list[int | None]]] = []
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def drop(self, i: int) -> None:
        self.alive[i] = False

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            alive = list(self.alive)
            try:
                stats = [get_json(u + "/stats") if up else None
                         for u, up in zip(self.urls, alive, strict=True)]
            except OSError:
                continue
            self.samples.append((time.monotonic() - self._start,
                                 [None if st is None else st["waiting"] + st["running"]
                                  for st in stats]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def occupancy(self, start: float, end_s: float, from_s: float = 0.0) -> list[float]:
        """Each host's share of the fleet's requests in flight over its share of the
        slots, averaged over time, from from_s to end_s seconds after monotonic `start`."""
        return self._occupancy([c for t, c in self.samples
                                if from_s <= t + self._start - start < end_s])

    def _occupancy(self, samples: list[list[int | None]]) -> list[float]:
        flight = [sum(c[i] or 0 for c in samples) for i in range(len(self.urls))]
        slots = [sum(self.slots[i] for c in samples if c[i] is not None)
                 for i in range(len(self.urls))]
        return [f / max(1, sum(flight)) / (n / sum(slots)) if n else 0.0
                for f, n in zip(flight, slots, strict=True)]

    def timeline(self, start: float, every_s: float = 5.0) -> str:
        """The occupancy per every_s seconds of the run that began at monotonic `start`
        (by the clock: a round of polls takes longer than its 0.25 s pause on 2 busy
        CPUs); "-" where the host was down."""
        bins: dict[int, list[list[int | None]]] = {}
        for t, counts in self.samples:
            bins.setdefault(max(0, int((t + self._start - start) // every_s)), []).append(counts)
        shares = [self._occupancy(bins[i]) for i in sorted(bins)]
        down = [[all(c[h] is None for c in bins[i]) for h in range(len(self.urls))]
                for i in sorted(bins)]
        return "\n".join(f"    {name}: " + " ".join("-" if d[h] else f"{o[h]:.2f}"
                                                   for o, d in zip(shares, down, strict=True))
                         for h, name in enumerate(HOST_NAMES))


class Bands:
    """Each agent's published share of its sessions passed on, polled every second from
    a thread until stopped: what moved the sessions, and when."""

    def __init__(self, sockets: list[str]) -> None:
        self.sockets = sockets
        self.samples: list[tuple[float, list[float | None]]] = []
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _width(self, sock: str) -> float | None:
        try:
            with Client(sock, timeout=1.0) as c:
                models = c.get("/v1/snapshot")["models"]
        except (AgentUnavailable, ApiError, KeyError):
            return None
        return max((m["sessions_passed_on"]["width"] for m in models), default=0.0)

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append((time.monotonic() - self._start,
                                 [self._width(s) for s in self.sockets]))

    def stop(self, start: float, every_s: float = 5.0) -> str:
        """The widths every every_s seconds of the run that began at monotonic `start`."""
        self._stop.set()
        self._thread.join()
        offset = start - self._start
        lines = []
        for i, name in enumerate(HOST_NAMES):
            marks, due = [], 0.0
            for t, widths in self.samples:
                if t - offset >= due:
                    w = widths[i]
                    marks.append("-" if w is None else f"{w:.2f}")
                    due += every_s
            lines.append(f"    {name}: {' '.join(marks)}")
        return "\n".join(lines)


def row_text(s: dict[str, Any]) -> str:
    shares = " ".join(f"{k} {v:.0%}" for k, v in s["share"].items())
    text = (f"{fmt_s(s['ttft_p50']):>8} {fmt_s(s['ttft_p99']):>7} {fmt_s(s['e2e_p50']):>8} "
            f"{fmt_s(s['e2e_p99']):>7} {s['rate_429']:>6.1%} {s['worst_bin']:>8.0%}  {shares}")
    if s["failed"]:
        text += f"  (failed {s['failed']})"
    best = s["best_ms"]
    if best["p50"] is not None:
        text += f"  /v1/best ms p50 {best['p50']:.1f} p99 {best['p99']:.1f} max {best['max']:.0f}"
    if len(s["reasons"]) > 1:
        text += f"  {dict(s['reasons'])}"
    return text


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--loads", default="0.5,0.8,0.95")
    ap.add_argument("--policies", default="loadmesh,round_robin,random,oracle,sglang")
    ap.add_argument("--slowdown", action="store_true", help="also the slowdown event at 80%%")
    ap.add_argument("--sessions", type=int, default=0, metavar="N",
                    help="last, loadmesh with N sessions at 80%% load, h3 killed at half time")
    ap.add_argument("--warmup", type=float, default=20, metavar="S",
                    help="with --sessions, S seconds of loadmesh at 80%% without sessions first")
    ap.add_argument("--session-warmup", type=float, default=COLD_S, metavar="S",
                    help="with --sessions, the same sessions' traffic for S seconds before the "
                         "measured run, in one load: the kill and the figures come after it "
                         "(those of the first %(default)g s printed apart)")
    ap.add_argument("--session-baselines", default="capacity,capacity_sessions,oracle",
                    metavar="P,P", help="with --sessions, these policies first, on the same "
                    "arrivals up to the kill (no kill): the occupancy a load-blind split gets, "
                    "and the queues' oracle")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--agent-toml", default="", metavar="TOML",
                    help="appended to every agent's configuration, to try a setting against "
                         "the shipped defaults (e.g. $'[load]\\ntick_ms = 250')")
    ap.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_fleet: run as root", file=sys.stderr)
        return 2
    # A SIGTERM (a timeout, kill) unwinds like ^C, so that the fleet is torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    policies = args.policies.split(",")
    sglang = ensure_sglang() if "sglang" in policies else None
    if sglang is None and "sglang" in policies:
        policies.remove("sglang")
    loads = [float(x) for x in args.loads.split(",") if x]
    out: dict[str, Any] = {"hosts": [h.__dict__ for h in HOSTS], "agent_toml": args.agent_toml,
                           "runs": []}
    with tempfile.TemporaryDirectory(prefix="lm-fleet-") as tmp, \
            fleet(HOSTS, Path(tmp), extra_toml=args.agent_toml) as f, \
            contextlib.ExitStack() as stack:
        if sglang is not None:
            stack.enter_context(started([
                str(sglang), "-m", "sglang_router.launch_router", "--host", f.client.v4,
                "--port", str(ROUTER_PORT), "--policy", "cache_aware", "--worker-urls", *f.urls,
                "--disable-retries", "--log-level", "warn"], f.work / "sglang.log"))
            wait_for(lambda: answers(f"http://{f.client.v4}:{ROUTER_PORT}/health"), 60)

        def run(policy: str, plan: list[dict[str, Any]], slow_at: float | None) -> list[dict]:
            f.reset()
            slow = [{"t": slow_at, "host": 0, "engine": {"step_ms": HOSTS[0].step_ms * 2}}]
            load, _ = f.start_load({"policy": "router" if policy == "sglang" else policy,
                                    "arrivals": plan, "seed": args.seed,
                                    "events": slow if slow_at is not None else [],
                                    "router_url": f"http://{f.client.v4}:{ROUTER_PORT}"})
            return f.result(load, args.seconds + 600)

        total = sum(h.tokens_per_s for h in HOSTS)
        print(f"loadmesh fleet bench: {len(HOSTS)} hosts "
              f"({', '.join(f'{h.name} {h.slots}x{h.step_ms:g}ms' for h in HOSTS)}; "
              f"{total:.0f} tokens/s in all), {args.seconds:g} s per run, "
              f"{STREAMED:.0%} streamed, {os.cpu_count()} CPUs")
        if args.agent_toml:
            print("agents' configuration beyond the defaults: " + " ".join(args.agent_toml.split()))
        capacity = capacity_rps(HOSTS, args.seed)
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
                print(f"  {policy:12} {row_text(s)}", flush=True)
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
                print(f"  {policy:12} shift {fmt_s(shift[0])} s (for good: {fmt_s(shift[1])} s); "
                      f"after it: h1 share "
                      f"{s['share']['h1']:.0%}, ttft p99 {fmt_s(s['ttft_p99'])} s", flush=True)
        if args.sessions and "loadmesh" in policies:
            warm = args.session_warmup
            plan = arrivals(0.8 * capacity, warm + args.seconds, args.seed + 2, len(HOSTS),
                            args.sessions)
            kill_at, killed = warm + args.seconds / 2, 2
            baselines = []
            for policy in filter(None, args.session_baselines.split(",")):
                f.reset()
                flight = InFlight(f.urls, [h.slots for h in HOSTS])
                load, start = f.start_load({"policy": policy, "seed": args.seed,
                                            "arrivals": [a for a in plan if a["t"] < kill_at]})
                rows = f.result(load, kill_at + 600)
                flight.stop()
                occupancy = dict(zip(HOST_NAMES, flight.occupancy(start, kill_at, warm),
                                     strict=True))
                sticky = affinity(rows, warm, kill_at)[1]
                baselines.append((policy, sticky, occupancy))
                out["runs"].append({"sessions": args.sessions, "policy": policy, "rows": rows,
                                    "occupancy": occupancy, "sticky": sticky})
            if args.warmup > 0:
                # Agents that know each host as it is now: its batch and pace learnt. Cold,
                # the small host holds the two busiest sessions (a quarter of the requests)
                # until it shows it queues; after the slowdown runs above, the agents last
                # saw h1 at half speed. (The agents route nothing while the baselines run:
                # the model's rate is counted over the time it was served, or the sessions'
                # shares read twice theirs; daemon/routing/session_counts.py.)
                print(f"\nwarm-up: {args.warmup:g} s of loadmesh at 80%, no sessions", flush=True)
                run("loadmesh", arrivals(0.8 * capacity, args.warmup, args.seed + 3, len(HOSTS)),
                    None)
            f.reset()
            flight = InFlight(f.urls, [h.slots for h in HOSTS])
            bands = Bands(f.sockets)
            load, start = f.start_load({"policy": "loadmesh", "arrivals": plan, "seed": args.seed})
            time.sleep(max(0.0, start + kill_at - time.monotonic()))
            flight.drop(killed)
            f.kill(killed)
            rows = f.result(load, warm + args.seconds + 600)
            flight.stop()
            widths = bands.stop(start)
            fig = session_figures(rows, kill_at, HOSTS[killed].name, warm)
            over = dict(zip(HOST_NAMES, flight.occupancy(start, kill_at, warm), strict=True))
            cold = cold_start(rows, flight, start, min(warm, COLD_S))
            out["runs"].append({"sessions": args.sessions, "kill_at": kill_at, "rows": rows,
                                "figures": fig, "occupancy": over, "session_warmup": warm,
                                "cold_start": cold})
            print(f"\nsessions: {args.sessions} (Zipf), 80% load, loadmesh; {HOSTS[killed].name} "
                  f"killed at t={kill_at:g} s"
                  + (f" (the figures from t={warm:g} s, after the same sessions' warm-up)"
                     if warm else "") + "\n"
                  f"  requests on their session's host {fig['sticky']:.1%}; two agents asked at "
                  f"the same moment agree {fmt_pct(fig['agree_now'])} ({fig['asked']} requests); "
                  f"a session's requests entering at two hosts within 1 s on one host "
                  f"{fmt_pct(fig['agree'])} ({fig['pairs']} pairs)\n"
                  f"  share of the requests in flight / share of the slots, before the kill: "
                  + " ".join(f"{k} {v:.2f}" for k, v in over.items())
                  + f"\n  after the kill: other hosts' sessions moved {fig['moved_after']:.1%} "
                  f"of {fig['after']} requests (home where they were in the last 10 s; by "
                  f"their most common host before the kill "
                  f"{fig['moved_after_by_first_half']:.1%}); {HOSTS[killed].name} last named "
                  f"{fig['killed_last_s']:.1f} s after; {dict(fig['reasons'])}\n"
                  f"  over {fig['churn'][0]:g} s windows, moved after the kill "
                  f"{fmt_pct(fig['churn'][1])}, before it (no kill: the bands' churn) "
                  f"{fmt_pct(fig['churn'][2])}; less the requests sent past a queueing host "
                  f"{fmt_pct(fig['churn_homed'][1])} and {fmt_pct(fig['churn_homed'][2])}\n"
                  f"  share of its sessions each host passed on, every 5 s:\n{widths}\n"
                  f"  share of the requests in flight / share of the slots (of the hosts "
                  f"up), every 5 s:\n{flight.timeline(start)}", flush=True)
            if cold:
                print(f"  the sessions' first {cold['s']:g} s (all begun at t=0, unknown to the "
                      f"agents): requests on their session's host {cold['sticky']:.1%}; two "
                      f"agents asked at the same moment agree {fmt_pct(cold['agree_now'])}; "
                      f"occupancy " + " ".join(f"{k} {v:.2f}" for k, v in cold["occupancy"].items()),
                      flush=True)
            if baselines:
                print(f"  beside it, the same arrivals up to the kill (t={warm:g}-{kill_at:g} s):")
                for policy, sticky, occupancy in [("loadmesh", fig["sticky"], over), *baselines]:
                    worst = max(occupancy, key=occupancy.__getitem__)
                    print(f"    {policy:17} requests on their session's host {sticky:5.1%}; "
                          f"worst occupancy {worst} {occupancy[worst]:.2f} ("
                          + " ".join(f"{k} {v:.2f}" for k, v in occupancy.items()) + ")",
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

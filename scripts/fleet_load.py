#!/usr/bin/env python3
"""The open-loop load generator of scripts/bench_fleet.py: one process, one asyncio loop,
sending a fixed list of arrivals by one routing policy, and writing what each request got.

    fleet_load.py PLAN.json RESULT.json

PLAN holds the arrivals (time, entry host, max_tokens, prompt length, streamed or not,
session), the moment time 0 is (start_at, on time.monotonic(), the same clock in every
process: optional, else now), the hosts (server URL, agent socket, name), events (at time
t, POST `engine` to host number `host`'s /engine: a slowdown, a server that starts
rejecting) and the policy:

  loadmesh    ask the entry host's agent (GET /v1/best on its Unix socket), send there,
              report the outcome (POST /v1/feedback), as a gateway on that host would
  round_robin the hosts in turn
  random      a host drawn uniformly
  oracle      join the shortest queue: this process is the only client, so its own count
              of requests outstanding on each host is that host's exact queue; weighted by
              each server's real speed (its /stats, polled every 0.5 s)
  capacity    a host drawn in proportion to its capacity (each server's slots over its
              step, from /stats): what any load-blind split at most achieves, every host
              getting its capacity's share of the arrivals
  capacity_sessions
              each session on one host for good, drawn in proportion to capacity by
              weighted rendezvous hashing on its name (arrivals without one: as
              capacity): an ideal static consistent hash, with no load feedback
  router      everything to `router_url` (sglang-router in front of the same servers); the
              answering server is read from the answer's id ("chatcmpl-NAME-...")

Arrivals are sent at their time whatever happened before (open loop), so a slow policy
does not get an easier load. Each result: t (s since start, as sent), entry, host, status
(HTTP, or 0 for a transport error or timeout), ttft_s (streamed: to the first data:
event), e2e_s, tokens, reason (loadmesh's), best_ms (loadmesh's /v1/best round trip); for a
session's request under loadmesh, twin (another host, drawn) and twin_node (what its agent
answered, asked at the same moment with dry_run=1 so that the asking counts nowhere; ""
when it gave no answer): whether two agents agree on a session's peer at one moment.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import sys
import time
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 120.0
# The policies that weigh hosts by each server's real speed, read from its /stats.
BY_SPEED = ("oracle", "capacity", "capacity_sessions")


class Policy:
    def __init__(self, plan: dict[str, Any]) -> None:
        self.hosts: list[dict[str, Any]] = plan["hosts"]
        self.by_name = {h["name"]: h for h in self.hosts}
        self.kind: str = plan["policy"]
        self.rng = random.Random(plan.get("seed", 1))
        self.turn = 0
        self.outstanding = {h["name"]: 0 for h in self.hosts}
        self.speed = {h["name"]: 1.0 for h in self.hosts}  # requests per ms of capacity
        # Its own draws, so that asking a second agent leaves the policies' draws as they were.
        self.twins = random.Random(plan.get("seed", 1) + 1)

    def twin(self, entry: str) -> str:
        """Another host whose agent is asked the same question at the same moment."""
        return self.twins.choice([h["name"] for h in self.hosts if h["name"] != entry and h.get("socket")])

    def pick(self, session: str | None) -> str:
        if self.kind == "capacity_sessions" and session:
            return min(self.speed, key=lambda n: -math.log(_uniform(session, n)) / self.speed[n])
        if self.kind in ("capacity", "capacity_sessions"):
            names = list(self.speed)
            return self.rng.choices(names, weights=[self.speed[n] for n in names])[0]
        if self.kind == "round_robin":
            self.turn += 1
            return self.hosts[self.turn % len(self.hosts)]["name"]
        if self.kind == "random":
            return self.rng.choice(self.hosts)["name"]
        if self.kind == "oracle":
            names = list(self.outstanding)
            self.rng.shuffle(names)  # ties: not always the first host
            return min(names, key=lambda n: (self.outstanding[n] + 1) / self.speed[n])
        raise ValueError(self.kind)


def _uniform(session: str, host: str) -> float:
    """A draw in (0, 1) per session and host, the same in every run."""
    digest = hashlib.blake2b(f"{session}\x1f{host}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2**64


async def ask(agent: httpx.AsyncClient, params: dict[str, str]) -> dict[str, Any]:
    """An agent's /v1/best answer; {} where it gave none (an agent killed)."""
    try:
        answer = (await agent.get("/v1/best", params=params)).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return answer if isinstance(answer, dict) else {}


async def poll_speeds(policy: Policy, client: httpx.AsyncClient) -> None:
    for h in policy.hosts:
        try:
            s = (await client.get(h["url"] + "/stats", timeout=2)).json()
            policy.speed[h["name"]] = s["slots"] / s["step_ms"]
        except (httpx.HTTPError, ValueError, KeyError):
            pass


async def poll_speed(policy: Policy, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await poll_speeds(policy, client)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


def prompt_text(arrival: dict[str, Any]) -> str:
    """Words drawn per arrival: distinct prompts, as a real fleet gets, so that a
    prefix-cache-aware router has no common prefix to pile them onto."""
    rng = random.Random(arrival["t"])
    words: list[str] = []
    size = 0
    while size < arrival["prompt"]:
        words.append(rng.choice(_WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)


_WORDS = ("the", "model", "token", "cache", "batch", "queue", "router", "fleet", "kernel",
          "stream", "latency", "prompt", "answer", "summarize", "explain", "translate",
          "python", "function", "error", "network", "request", "server", "memory", "graph")


def _host_of(answer_id: str, names: set[str]) -> str:
    parts = answer_id.split("-")
    return parts[1] if len(parts) > 2 and parts[1] in names else ""


async def send(client: httpx.AsyncClient, url: str, arrival: dict[str, Any], model: str,
               names: set[str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": arrival["max_tokens"], "stream": arrival["stream"],
        "messages": [{"role": "user", "content": prompt_text(arrival)}]}
    t0 = time.perf_counter()
    out: dict[str, Any] = {"status": 0, "ttft_s": None, "e2e_s": None, "tokens": 0, "served_by": ""}
    try:
        if arrival["stream"]:
            async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                     timeout=REQUEST_TIMEOUT_S) as r:
                out["status"] = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                        out["served_by"] = _host_of(json.loads(line[6:]).get("id", ""), names)
                    out["tokens"] += 1
        else:
            r = await client.post(url + "/v1/chat/completions", json=body,
                                  timeout=REQUEST_TIMEOUT_S)
            out["status"] = r.status_code
            if r.status_code == 200:
                answer = r.json()
                out["tokens"] = answer["usage"]["completion_tokens"]
                out["served_by"] = _host_of(answer.get("id", ""), names)
    except (httpx.HTTPError, ValueError, KeyError):
        out["status"] = 0
    out["e2e_s"] = time.perf_counter() - t0
    return out


async def events(plan: dict[str, Any], client: httpx.AsyncClient, start: float) -> None:
    for event in sorted(plan.get("events", ()), key=lambda e: e["t"]):
        delay = event["t"] - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        r = await client.post(plan["hosts"][event["host"]]["url"] + "/engine",
                              json=event["engine"], timeout=5)
        r.raise_for_status()


async def run(plan: dict[str, Any]) -> list[dict[str, Any]]:
    policy = Policy(plan)
    names = set(policy.by_name)
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=4000)
    servers = httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S)
    agents = {h["name"]: httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=h["socket"]),
                                           base_url="http://loadmesh", timeout=10)
              for h in policy.hosts if h.get("socket")}
    stop = asyncio.Event()
    poller = None
    if policy.kind in BY_SPEED:
        await poll_speeds(policy, servers)  # before the first arrival: no pick on a default
        poller = asyncio.create_task(poll_speed(policy, servers, stop))
    results: list[dict[str, Any]] = []
    start = plan.get("start_at", time.monotonic())
    if start > time.monotonic():
        await asyncio.sleep(start - time.monotonic())
    changes = asyncio.create_task(events(plan, servers, start))

    async def one(arrival: dict[str, Any]) -> None:
        row: dict[str, Any] = {"t": time.monotonic() - start, "entry": arrival["entry"],
                               "host": "", "reason": "", "best_ms": None,
                               "session": arrival.get("session")}
        entry = policy.hosts[arrival["entry"]]["name"]
        node = ""
        if policy.kind == "loadmesh":
            agent = agents[entry]
            params = {"model": plan["model"]}
            if arrival.get("session"):
                params["session"] = arrival["session"]

            async def routed() -> dict[str, Any]:
                t = time.perf_counter()
                answer = await ask(agent, params)
                row["best_ms"] = (time.perf_counter() - t) * 1000
                return answer

            if arrival.get("session"):
                row["twin"] = policy.twin(entry)
                best, twin = await asyncio.gather(
                    routed(), ask(agents[row["twin"]], {**params, "dry_run": "1"}))
                row["twin_node"] = twin.get("node_id", "")
            else:
                best = await routed()
            node, row["reason"] = best.get("node_id", ""), best.get("reason", "")
            if not node:
                row.update(status=-1, ttft_s=None, e2e_s=None, tokens=0)
                results.append(row)
                return
            url = "http://" + best["endpoint"]
        elif policy.kind == "router":
            url = plan["router_url"]
        else:
            node = policy.pick(arrival.get("session"))
            url = policy.by_name[node]["url"]
        if node:
            policy.outstanding[node] += 1
        try:
            got = await send(servers, url, arrival, plan["model"], names)
        finally:
            if node:
                policy.outstanding[node] -= 1
        served_by = got.pop("served_by")
        row.update(got)
        row["host"] = node or served_by
        if policy.kind == "loadmesh":
            outcome = "ok" if got["status"] == 200 else "timeout" if got["status"] == 0 else "error"
            try:
                await agents[entry].post("/v1/feedback", json={
                    "node_id": node, "outcome": outcome, "latency_ms": got["e2e_s"] * 1000})
            except httpx.HTTPError:
                pass
        results.append(row)

    tasks = []
    for arrival in plan["arrivals"]:
        delay = arrival["t"] - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(arrival)))
    await asyncio.gather(*tasks, changes)
    stop.set()
    if poller is not None:
        await poller
    await servers.aclose()
    for a in agents.values():
        await a.aclose()
    return sorted(results, key=lambda r: r["t"])


def main() -> int:
    plan = json.loads(open(sys.argv[1]).read())
    results = asyncio.run(run(plan))
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

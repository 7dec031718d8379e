"""A fleet of "GPU hosts" in network namespaces on a bridge, for scripts/bench_fleet.py and
tests/test_fleet_routing.py: each host runs tests/llm_server.py (vLLM's HTTP stack, an
engine that batches continuously) and a real `loadmesh agent` (probes on the host's
interface, gossip over the bridge); one more namespace holds the clients.

    with fleet(hosts, work) as f:     # everything up, every agent seeing every server
        rows = f.load(spec)           # scripts/fleet_load.py run from the clients' namespace

While the context is open this process is inside the clients' namespace, where the servers
can be reached; everything is stopped and the namespaces removed on every exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import math
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nettopo
from metrics_helpers import wait_for

from loadmesh.daemon.client import AgentUnavailable, ApiError, Client

ROOT = Path(__file__).resolve().parent.parent
PORT = 8000
GOSSIP_PORT = 7946
MODEL = "fleet-model"
LOADMESH = str(Path(sys.executable).with_name("loadmesh"))
BIN_S = 2.0
MAX_WAITING = 64
# Time for fleet_load.py to start (imports) before its time 0.
LOAD_START_S = 1.5
MEAN_TOKENS = 64
STREAMED = 0.8
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    step_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.slots * 1000 / self.step_ms


def arrivals(rate: float, seconds: float, seed: int, hosts: int,
             sessions: int = 0) -> list[dict[str, Any]]:
    """Poisson arrivals, each at a random entry host, STREAMED of them streamed,
    max_tokens lognormal with mean MEAN_TOKENS, prompts of 400-4000 characters; with
    sessions, each of one of that many sessions, drawn by Zipf popularity (the k-th most
    popular with weight 1/k: a few busy conversations, a long tail)."""
    rng = random.Random(seed)
    sigma = 0.8
    mu = math.log(MEAN_TOKENS) - sigma * sigma / 2
    popularity = list(itertools.accumulate(1 / k for k in range(1, sessions + 1)))
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        arrival = {"t": round(t, 4), "entry": rng.randrange(hosts),
                   "max_tokens": max(1, min(1024, round(rng.lognormvariate(mu, sigma)))),
                   "prompt": rng.randint(400, 4000), "stream": rng.random() < STREAMED,
                   "session": None}
        if sessions:
            k = rng.choices(range(sessions), cum_weights=popularity)[0]
            arrival["session"] = f"session-{k}"
        out.append(arrival)
        t += rng.expovariate(rate)
    return out


def capacity_rps(hosts: Sequence[Host], seed: int) -> float:
    """The fleet's capacity in requests per second: its token rate over the mean answer
    length of a long draw of arrivals."""
    plan = arrivals(1.0, 1000, seed, len(hosts))
    return sum(h.tokens_per_s for h in hosts) / statistics.fmean(a["max_tokens"] for a in plan)


def post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def host_bins(rows: list[dict[str, Any]], start_s: float = 0.0,
              end_s: float = float("inf")) -> dict[int, Counter[str]]:
    """Requests per host in each BIN_S bin of [start_s, end_s), by the bin's index."""
    bins: dict[int, Counter[str]] = {}
    for r in rows:
        if r["host"] and start_s <= r["t"] < end_s:
            bins.setdefault(int((r["t"] - start_s) // BIN_S), Counter())[r["host"]] += 1
    return bins


def worst_bin(rows: list[dict[str, Any]], start_s: float = 0.0, end_s: float = float("inf"),
              least: int = 10) -> float:
    """The largest share one host took of a bin holding at least `least` requests."""
    return max((max(c.values()) / sum(c.values()) for c in host_bins(rows, start_s, end_s).values()
                if sum(c.values()) >= least), default=0.0)


def affinity(rows: list[dict[str, Any]], start_s: float,
             end_s: float) -> tuple[dict[str, str], float, float | None, int]:
    """Of the session requests served in [start_s, end_s): each session's most common
    host; the share of the requests on it (request-weighted); and of the pairs of one
    session's consecutive requests entering at different hosts within a second, the share
    that went to the same host, and how many pairs there were (a request sent past its
    session's peer, overflow.py, parts from both its neighbours here, where two agents
    asked at one moment agree: agreement() counts that)."""
    served = [r for r in rows if r["host"] and r["session"] and start_s <= r["t"] < end_s]
    hosts: dict[str, Counter[str]] = {}
    by_session: dict[str, list[dict[str, Any]]] = {}
    for r in served:
        hosts.setdefault(r["session"], Counter())[r["host"]] += 1
        by_session.setdefault(r["session"], []).append(r)
    home = {s: c.most_common(1)[0][0] for s, c in hosts.items()}
    sticky = sum(c.most_common(1)[0][1] for c in hosts.values()) / max(1, len(served))
    pairs = same = 0
    for reqs in by_session.values():
        for a, b in zip(reqs, reqs[1:]):
            if a["entry"] != b["entry"] and b["t"] - a["t"] <= 1.0:
                pairs += 1
                same += a["host"] == b["host"]
    return home, sticky, same / pairs if pairs else None, pairs


def agreement(rows: list[dict[str, Any]], start_s: float, end_s: float) -> tuple[float | None, int]:
    """Of the session requests sent in [start_s, end_s) whose second agent answered (asked
    the same question at the same moment, scripts/fleet_load.py's twin), the share where
    it named the peer the entry's agent did, and how many there were."""
    asked = [r for r in rows if r.get("twin_node") and r["host"] and start_s <= r["t"] < end_s]
    same = sum(r["twin_node"] == r["host"] for r in asked)
    return (same / len(asked) if asked else None), len(asked)


def share(rows: list[dict[str, Any]], host: str, start_s: float, end_s: float) -> float:
    sent = [r for r in rows if r["host"] and start_s <= r["t"] < end_s]
    return sum(r["host"] == host for r in sent) / max(1, len(sent))


@contextlib.contextmanager
def started(argv: list[str], log: Path,
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
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
    """This process in ns, back in its own before the namespaces are removed (the removal
    ends every process left inside)."""
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


def agent_config(host: Host, node: nettopo.MeshNode, seed: str, work: Path,
                 extra_toml: str = "") -> Path:
    """Shipped defaults but for the addresses: no static_models (each agent learns its
    server's models from its /v1/models), no tuning but extra_toml (tables other than the
    ones written here), appended as is."""
    path = work / f"{host.name}.toml"
    key = work / "gossip.key"  # one key for the fleet, as an operator would give it
    if not key.exists():
        key.write_text(secrets.token_hex(32) + "\n")
        key.chmod(0o600)
    path.write_text(
        f'node_id = "{host.name}"\nstate_dir = "{work / ("state-" + host.name)}"\n'
        f'advertise = "{node.v4}"\n'
        f'[api]\nsocket = "{work / (host.name + ".sock")}"\n'
        f'[probes]\ninterfaces = ["{node.ifname}"]\nports = [{PORT}]\nrequired = true\n'
        f'[gossip]\nbind = "{node.v4}:{GOSSIP_PORT}"\nseeds = ["{seed}:{GOSSIP_PORT}"]\n'
        f'key_file = "{key}"\n'
        f'[metrics]\nlisten = ""\n' + extra_toml)
    return path


def candidates(sock: str) -> int:
    """How many hosts the agent would name for the model: the answer and its alternatives,
    once its probes are attached."""
    try:
        with Client(sock) as c:
            best = c.get("/v1/best", model=MODEL)
            health = c.get("/healthz")
    except (AgentUnavailable, ApiError, OSError):
        return 0
    if health["components"]["probes"]["state"] != "ok":
        return 0
    return 1 + len(best.get("alternatives", ()))


@dataclass
class Fleet:
    hosts: tuple[Host, ...]
    client: nettopo.MeshNode
    nodes: list[nettopo.MeshNode]
    urls: list[str]
    sockets: list[str]
    work: Path
    servers: list[subprocess.Popen[bytes]]
    agents: list[subprocess.Popen[bytes]]

    def plan_hosts(self) -> list[dict[str, str]]:
        return [{"name": h.name, "url": u, "socket": s}
                for h, u, s in zip(self.hosts, self.urls, self.sockets)]

    def tune(self, i: int, **engine: float) -> None:
        """Changes host i's engine from its next step: step_ms, max_waiting."""
        post_json(self.urls[i] + "/engine", engine)

    def reset(self) -> None:
        """Every engine back to its own speed and queue, once every queue has drained."""
        wait_for(self.drained, 120, "the servers to drain")
        for i, h in enumerate(self.hosts):
            self.tune(i, step_ms=h.step_ms, max_waiting=MAX_WAITING)

    def drained(self) -> bool:
        try:
            stats = [get_json(u + "/stats") for u in self.urls]
        except OSError:
            return False
        return all(st["waiting"] + st["running"] == 0 for st in stats)

    def kill(self, i: int) -> None:
        """Host i dies: its server and its agent, at once (SIGKILL, no goodbye)."""
        for proc in (self.servers[i], self.agents[i]):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def start_load(self, spec: dict[str, Any]) -> tuple[subprocess.Popen[bytes], float]:
        """scripts/fleet_load.py on spec (its hosts filled in), from this namespace; and
        its time 0 on time.monotonic(), for events the caller times itself."""
        plan = self.work / "plan.json"
        start_at = time.monotonic() + LOAD_START_S
        plan.write_text(json.dumps({"model": MODEL, "hosts": self.plan_hosts(),
                                    "start_at": start_at, **spec}))
        load = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "fleet_load.py"),
                                 str(plan), str(self.work / "result.json")])
        return load, start_at

    def result(self, load: subprocess.Popen[bytes], timeout: float) -> list[dict[str, Any]]:
        try:
            code = load.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            load.kill()
            load.wait()
            raise
        if code != 0:
            raise RuntimeError(f"fleet_load.py exited {code}")
        return json.loads((self.work / "result.json").read_text())


@contextlib.contextmanager
def fleet(hosts: Sequence[Host], work: Path, prefix: str = "lmf",
          extra_toml: str = "") -> Iterator[Fleet]:
    hosts = tuple(hosts)
    with nettopo.bridge_mesh(len(hosts) + 1, prefix) as nodes, contextlib.ExitStack() as stack:
        client, host_nodes = nodes[0], nodes[1:]
        stack.enter_context(inside(client.ns))
        urls = [f"http://{n.v4}:{PORT}" for n in host_nodes]
        servers, agents = [], []
        for host, node in zip(hosts, host_nodes):
            servers.append(stack.enter_context(started(node.ns.argv([
                sys.executable, str(ROOT / "tests" / "llm_server.py"), "--port", str(PORT),
                "--slots", str(host.slots), "--step-ms", str(host.step_ms),
                "--max-waiting", str(MAX_WAITING), "--name", host.name, "--model", MODEL]),
                work / f"{host.name}-server.log")))
        wait_for(lambda: all(answers(u + "/health") for u in urls), 30, "the servers")
        for host, node in zip(hosts, host_nodes):
            conf = agent_config(host, node, host_nodes[0].v4, work, extra_toml)
            agents.append(stack.enter_context(started(
                in_ns(node.ns, [LOADMESH, "agent", "--config", str(conf)]),
                work / f"{host.name}-agent.log")))
        sockets = [str(work / f"{h.name}.sock") for h in hosts]
        wait_for(lambda: all(candidates(s) >= min(len(hosts), 3) for s in sockets), 60,
                 "every agent to see the fleet")
        yield Fleet(hosts, client, host_nodes, urls, sockets, work, servers, agents)

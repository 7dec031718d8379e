"""Several real agents, each in its own network namespace on a bridge: they find each other
from one seed, converge, keep an agent stalled for 2 s alive, see a killed agent go dead,
heal after an nftables partition, and refuse a peer that signs with the wrong key."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import LOADMESH, agent_config
from loadmesh.daemon.client import AgentUnavailable, Client
from nettopo import MeshNode, bridge_mesh, leftovers, stop_process

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

GOSSIP_PORT = 7946


class MeshAgent:
    def __init__(self, node: MeshNode, name: str, run_dir: Path, seed: str, key_file: Path) -> None:
        self.node = node
        self.name = name
        self.socket = str(run_dir / f"{name}.sock")
        self.config = run_dir / f"{name}.toml"
        # Every node serves "llama" from the start, so routing has candidates without traffic.
        static = ", ".join(f'n{i} = ["llama"]' for i in range(5))
        self.config.write_text(agent_config(
            self.socket, node_id=name, extra=f"[routing]\nstatic_models = {{ {static} }}\n",
            gossip=f'bind = "{node.v4}:{GOSSIP_PORT}"\nseeds = ["{seed}:{GOSSIP_PORT}"]\n'
                   f'key_file = "{key_file}"'))
        self.log = run_dir / f"{name}.log"
        self.proc: subprocess.Popen[str] | None = None
        # One keep-alive connection for the many reads of a check (a CLI process per read
        # cost more than the checks themselves); it reconnects after a restart.
        self.client = Client(self.socket)

    def start(self) -> None:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                self.node.ns.argv([LOADMESH, "agent", "--config", str(self.config)]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                start_new_session=True)

    def get(self, path: str, **query: str) -> Any:
        return self.client.get(path, **query)

    def peers(self) -> dict[str, dict]:
        return {p["node_id"]: p for p in self.get("/v1/peers")}

    def best(self, model: str) -> dict:
        return self.get("/v1/best", model=model)

    def stats(self) -> dict[str, int]:
        return self.get("/v1/gossip")["counters"]

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None:
            stop_process(self.proc)


def wait_for(what: str, check: Callable[[], bool], timeout: float, agents: list[MeshAgent]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except AgentUnavailable:
            pass  # an agent not listening yet is not there yet
        time.sleep(0.05)
    logs = "\n".join(f"--- {a.name}\n{a.log.read_text()[-1500:]}" for a in agents)
    raise AssertionError(f"not within {timeout}s: {what}\n{logs}")


def states(agent: MeshAgent) -> dict[str, str]:
    return {n: p["state"] for n, p in agent.peers().items()}


@contextlib.contextmanager
def mesh(n: int, run_dir: Path) -> Iterator[list[MeshAgent]]:
    key = run_dir / "gossip.key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    with bridge_mesh(n, prefix="lmm") as nodes:
        agents = [MeshAgent(node, f"n{i}", run_dir, nodes[0].v4, key) for i, node in enumerate(nodes)]
        try:
            for agent in agents:
                agent.start()
            yield agents
        finally:
            for agent in agents:
                agent.stop()
    assert leftovers("lmm") == []


def nft(agent: MeshAgent, script: str) -> None:
    subprocess.run(agent.node.ns.argv(["nft", "-f", "-"]), input=script, text=True,
                   check=True, capture_output=True)


def test_mesh_join_converge_kill_partition_heal_and_wrong_key(run_dir: Path) -> None:
    with mesh(5, run_dir) as agents:
        a0, a1, a2, a3, intruder = agents
        # The fifth node signs with a key of its own: the mesh must never take it in.
        intruder.config.write_text(intruder.config.read_text().replace(
            str(run_dir / "gossip.key"), str(run_dir / "other.key")))
        (run_dir / "other.key").write_text(secrets.token_hex(32) + "\n")
        intruder.stop()
        intruder.start()
        honest = [a0, a1, a2, a3]
        names = {a.name for a in honest}

        wait_for("four agents see each other alive from one seed",
                 lambda: all(states(a) == dict.fromkeys(names, "alive") for a in honest),
                 30, agents)
        # A version published just before this read may still be on its way to the others.
        versions = {a.name: a.peers()[a.name]["version"] for a in honest}
        wait_for("every agent holds at least each node's version of that moment",
                 lambda: all(a.peers().get(name, {}).get("version", -1) >= version
                             for a in honest for name, version in versions.items()),
                 10, agents)
        assert "n4" not in a0.peers()
        # The intruder restarted with its key at the test's start, and tries its seed again
        # every join_retry_ms: on a quick join, its first try may still be to come.
        wait_for("the intruder counted as dropped", lambda: a0.stats().get("drop_bad_signature", 0) > 0,
                 10, agents)
        assert set(states(intruder)) == {"n4"}, "and it learns nothing of the mesh"

        # The router reads the gossip's table every 100 ms: the versions just seen may not
        # be in it yet (on a quick join, 40 picks in the same tenth of a second all named
        # the entry agent).
        picked: list[set[str]] = []

        def spread() -> bool:
            picked.append({a0.best("llama")["node_id"] for _ in range(40)})
            return len(picked[-1]) > 1

        wait_for("a0 spreads its picks over the mesh", spread, 5, agents)
        assert set().union(*picked) <= names, "never the intruder"
        cli = subprocess.run([LOADMESH, "best", "llama", "--socket", a0.socket, "--json"],
                             capture_output=True, text=True, timeout=10, check=True)
        assert json.loads(cli.stdout)["node_id"] in names, "the CLI answers as the API does"

        # Stall one agent's event loop for 2 s (the whole process, as a GIL-bound pause or
        # a starved host would): it answers no probe meanwhile, and may be suspected, but
        # it refutes when it runs again, and nobody declares it dead.
        deaths = {a.name: a.stats().get("became_dead", 0) for a in (a0, a2, a3)}
        os.kill(a1.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(2.0)  # the stall itself, not a wait for a condition
        finally:
            os.kill(a1.proc.pid, signal.SIGCONT)
        wait_for("the stalled agent counts its own stall",
                 lambda: a1.stats().get("stalls", 0) >= 1, 10, agents)
        wait_for("everyone holds it alive again",
                 lambda: all(states(a).get("n1") == "alive" for a in (a0, a2, a3)), 10, agents)
        assert {a.name: a.stats().get("became_dead", 0) for a in (a0, a2, a3)} == deaths, \
            "a stalled agent was declared dead"

        # Kill one agent: the others see it dead, and stop routing to it.
        a3.proc.kill()
        wait_for("n3 dead everywhere",
                 lambda: all(states(a).get("n3") == "dead" for a in (a0, a1, a2)), 20, agents)
        # the routing table follows the gossip table every 100 ms (later on a loaded machine)
        wait_for("no more routing to n3",
                 lambda: "n3" not in {a0.best("llama")["node_id"] for _ in range(40)}, 5, agents)

        # Partition {n0, n1} | {n2} with nftables inside n2's namespace, both ways.
        nft(a2, f"""table inet lmpart {{
            chain input {{ type filter hook input priority 0; ip saddr {{ {a0.node.v4}, {a1.node.v4} }} drop; }}
            chain output {{ type filter hook output priority 0; ip daddr {{ {a0.node.v4}, {a1.node.v4} }} drop; }}
        }}""")
        # n2 is alone on its side: a lone accuser, whom nobody corroborates, waits the
        # longest suspicion (6 x 2.5 s) in case it is the one cut off.
        wait_for("the two sides see each other dead",
                 lambda: states(a0).get("n2") == "dead" and states(a2).get("n0") == "dead", 30, agents)
        nft(a2, "delete table inet lmpart")
        wait_for("the partition heals by itself",
                 lambda: all(states(a).get(other) == "alive"
                             for a in (a0, a1, a2) for other in ("n0", "n1", "n2")), 40, agents)

        # A restarted node comes back with a higher version.
        before = a0.peers()["n3"]["version"]
        a3.start()
        wait_for("n3 rejoins with a newer version",
                 lambda: a0.peers().get("n3", {}).get("state") == "alive"
                 and a0.peers()["n3"]["version"] > before, 30, agents)

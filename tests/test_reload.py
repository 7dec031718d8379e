"""SIGHUP rereads the configuration: safe changes take effect in the running agent, the
others are named as needing a restart, and a bad file changes nothing."""

from __future__ import annotations

import secrets
import signal
import socket
from pathlib import Path

import pytest

from conftest import AgentProcess, agent_config
from loadmesh.daemon.client import ApiError, Client
from loadmesh.gossip import wire
from loadmesh.gossip.wire import Kind
from metrics_helpers import free_port, metrics_config, samples, scrape, value, wait_for


def reload(agent: AgentProcess, text: str, outcome: str) -> None:
    """Write the agent's file, SIGHUP it, wait for the reload's log line."""
    before = agent.logs().count(outcome)
    agent.config_path.write_text(text)
    agent.signal(signal.SIGHUP)
    wait_for(lambda: agent.logs().count(outcome) > before, what=f"{outcome!r} in the log")


def reload_ok(port: int) -> float | None:
    return value(samples(scrape(port)), "loadmesh_config_last_reload_successful")


def test_safe_changes_apply_and_the_others_wait_for_a_restart(make_agent, run_dir: Path) -> None:
    sock = str(run_dir / "loadmesh.sock")
    port = free_port()
    agent = make_agent(agent_config(sock, metrics=metrics_config(port))).start()
    agent.wait_ready(sock)
    with Client(sock) as client:
        with pytest.raises(ApiError):
            client.get("/v1/best", model="m1")
        gossip_address = client.get("/v1/gossip")["address"]

    changed = agent_config(
        sock, extra='log_level = "debug"\n[routing]\nstatic_models = { test-node = ["m1"] }\n',
        probes="interfaces = []\nports = [8000, 8001]",
        gossip='bind = "127.0.0.1:0"\nfanout = 5', metrics=metrics_config(port))
    reload(agent, changed, "applied")
    logs = agent.logs()
    assert "applied log_level, probes.ports, routing.static_models" in logs
    assert "need a restart, not in effect: gossip.fanout (running 3, file 5)" in logs
    with Client(sock) as client:
        assert client.get("/v1/best", model="m1")["node_id"] == "test-node"
        ports = {e.rpartition(":")[2] for e in client.get("/v1/snapshot")["endpoints"]}
        assert ports == {"8000", "8001"}
        assert client.get("/v1/gossip")["address"] == gossip_address
    assert "debug" in agent.logs().split("applied")[-1]  # the new level, from then on
    assert reload_ok(port) == 1

    # Nothing new in the file: the pending restart is named again.
    reload(agent, changed, "no change to apply")
    assert agent.logs().count("gossip.fanout (running 3, file 5)") == 2


def test_a_bad_file_changes_nothing(make_agent, run_dir: Path) -> None:
    sock = str(run_dir / "loadmesh.sock")
    port = free_port()
    good = agent_config(sock, metrics=metrics_config(port))
    agent = make_agent(good).start()
    agent.wait_ready(sock)

    reload(agent, good.replace('bind = "127.0.0.1:0"', 'fanout = "three"'), "failed")
    assert (f"failed, keeping the running configuration: {agent.config_path}: gossip.fanout: "
            "expected an integer, got a string") in agent.logs()
    assert reload_ok(port) == 0

    missing_key = good.replace('bind = "127.0.0.1:0"',
                               f'bind = "127.0.0.1:0"\nkey_file = "{run_dir}/no-such.key"')
    reload(agent, missing_key, "failed")
    assert f"{agent.config_path}: gossip.key_file: {run_dir}/no-such.key" in agent.logs()

    # Right as a file, wrong as it would run: the heartbeat waits for a restart, and the
    # freshness window that would apply now is below the running heartbeat's.
    shorter = agent_config(sock, extra="[routing]\nfreshness_s = 4.0\n[load]\nheartbeat_ms = 1000\n",
                           metrics=metrics_config(port))
    reload(agent, shorter, "failed")
    assert (f"{agent.config_path}: routing.freshness_s: 4 s is shorter than a quiet peer's "
            "snapshot gets") in agent.logs()
    assert "load.heartbeat_ms = 5000" in agent.logs() and "as it would run" in agent.logs()

    reload(agent, good, "no change to apply")
    assert reload_ok(port) == 1
    assert agent.proc.poll() is None


def test_a_reloaded_key_and_seed_join_a_lone_node_to_the_mesh(make_agent, run_dir: Path) -> None:
    keys = {name: run_dir / f"{name}.key" for name in ("a", "b")}
    for path in keys.values():
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)
    socks = {name: str(run_dir / f"{name}.sock") for name in ("a", "b")}

    def config(name: str, seeds: str = "") -> str:
        gossip = f'bind = "127.0.0.1:0"\nkey_file = "{keys[name]}"\n{seeds}'
        return agent_config(socks[name], node_id=name, gossip=gossip)

    a = make_agent(config("a")).start()
    a.wait_ready(socks["a"])
    with Client(socks["a"]) as client:
        a_address = client.get("/v1/gossip")["address"]
    b = make_agent(config("b")).start()
    b.wait_ready(socks["b"])

    # B takes A's key (the file changes, not its name) and A as its seed.
    keys["b"].write_text(keys["a"].read_text())
    reload(b, config("b", f'seeds = ["{a_address}"]'), "applied")
    assert "applied gossip.seeds" in b.logs()

    def peers(name: str) -> dict[str, str]:
        with Client(socks[name]) as client:
            return {p["node_id"]: p["state"] for p in client.get("/v1/peers")}

    wait_for(lambda: peers("b").get("a") == "alive" and peers("a").get("b") == "alive",
             what="a and b to see each other")


def test_a_reload_never_opens_a_keyed_mesh(make_agent, run_dir: Path) -> None:
    key = run_dir / "mesh.key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    sock = str(run_dir / "loadmesh.sock")
    keyed = agent_config(sock, gossip=f'bind = "127.0.0.1:0"\nkey_file = "{key}"')
    agent = make_agent(keyed).start()
    agent.wait_ready(sock)
    # The key file's line lost in an edit: refused, the running configuration kept.
    reload(agent, agent_config(sock), "failed")
    assert (f"{agent.config_path}: gossip.key_file: empty where the running mesh is keyed"
            in agent.logs())
    # Still keyed: an unsigned datagram is dropped as such.
    with Client(sock) as client:
        host, _, port = client.get("/v1/gossip")["address"].rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker:
        attacker.sendto(wire.seal(Kind.GOSSIP, 1, b"", None), (host, int(port)))

    def dropped() -> bool:
        with Client(sock) as client:
            return client.get("/v1/gossip")["counters"].get("drop_unsigned", 0) >= 1
    wait_for(dropped, what="the unsigned datagram dropped")

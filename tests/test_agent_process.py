"""The agent as a real process: start, answer, stop on signals, refuse what it must."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import LOADMESH, AgentProcess, agent_config

EXIT_CONFIG = 78


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LOADMESH, *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def running(make_agent, run_dir: Path) -> tuple[AgentProcess, str]:
    sock = str(run_dir / "run" / "loadmesh.sock")
    agent = make_agent(agent_config(sock)).start()
    agent.wait_ready(sock)
    return agent, sock


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_removes_the_socket(running, sig: signal.Signals) -> None:
    agent, sock = running
    assert os.path.exists(sock)
    agent.signal(sig)
    assert agent.wait_exit() == 0
    assert not os.path.exists(sock)
    assert f"{sig.name} received" in agent.logs()


def test_healthz_answers_curl(running) -> None:
    _, sock = running
    curl = shutil.which("curl")
    assert curl, "curl is installed by scripts/setup.sh"
    out = subprocess.run([curl, "-sf", "--unix-socket", sock, "http://x/healthz"],
                         capture_output=True, text=True, timeout=10, check=True)
    body = json.loads(out.stdout)
    assert body["status"] in ("ok", "degraded")
    assert body["components"]["api"] == {"state": "ok", "reason": ""}


def test_status_command_prints_the_agent(running) -> None:
    agent, sock = running
    human = cli("status", "--socket", sock)
    assert human.returncode == 0, human.stderr
    assert "test-node" in human.stdout and "api" in human.stdout
    machine = cli("status", "--socket", sock, "--json")
    body = json.loads(machine.stdout)
    assert body["node_id"] == "test-node"
    assert body["pid"] == agent.proc.pid
    assert body["uptime_s"] >= 0 and body["version"]
    assert body["components"]["api"]["state"] == "ok"
    by_config = cli("status", "--config", str(agent.config_path), "--json")
    assert json.loads(by_config.stdout)["node_id"] == "test-node"


def test_second_agent_on_the_same_socket_refuses(running, make_agent) -> None:
    first, sock = running
    second = make_agent(agent_config(sock, node_id="intruder")).start()
    assert second.wait_exit() == 1
    assert "another agent is serving on" in second.logs()
    assert json.loads(cli("status", "--socket", sock, "--json").stdout)["node_id"] == "test-node"
    assert first.proc.poll() is None


def test_stale_socket_from_a_dead_agent_is_replaced(make_agent, run_dir: Path) -> None:
    sock = str(run_dir / "loadmesh.sock")
    dead = make_agent(agent_config(sock, node_id="dead")).start()
    dead.wait_ready(sock)
    dead.proc.kill()  # SIGKILL: nothing gets to clean up
    dead.wait_exit()
    assert os.path.exists(sock)
    heir = make_agent(agent_config(sock, node_id="heir")).start()
    heir.wait_ready(sock)
    assert json.loads(cli("status", "--socket", sock, "--json").stdout)["node_id"] == "heir"


def test_bad_config_names_key_and_file_and_does_not_start(make_agent, run_dir: Path) -> None:
    sock = run_dir / "loadmesh.sock"
    agent = make_agent(agent_config(sock, gossip='fanout = "three"')).start()
    assert agent.wait_exit() == EXIT_CONFIG
    assert f"{agent.config_path}: gossip.fanout: expected an integer, got a string" in agent.logs()
    assert not sock.exists()

    unknown = make_agent(agent_config(sock, gossip="fanuot = 3")).start()
    assert unknown.wait_exit() == EXIT_CONFIG
    assert f"{unknown.config_path}: gossip.fanuot: unknown key" in unknown.logs()


def test_status_without_an_agent_exits_1(run_dir: Path) -> None:
    absent = cli("status", "--socket", str(run_dir / "none.sock"))
    assert absent.returncode == 1
    assert "no agent is running" in absent.stderr and absent.stdout == ""

    stale = run_dir / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    refused = cli("status", "--socket", str(stale))
    assert refused.returncode == 1 and "nothing listens on" in refused.stderr


def test_config_check_and_defaults(tmp_path: Path) -> None:
    defaults = cli("config", "defaults").stdout
    # The defaults alone are an open mesh on every address: refused, naming the way out.
    open_mesh = tmp_path / "open.toml"
    open_mesh.write_text(defaults)
    refused = cli("config", "check", str(open_mesh))
    assert refused.returncode == EXIT_CONFIG and "gossip.insecure = true" in refused.stderr
    good = tmp_path / "good.toml"
    good.write_text(defaults.replace('key_file = ""', f'key_file = "{tmp_path}/gossip.key"'))
    assert cli("config", "check", str(good)).returncode == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[probes]\nports = [0]\n")
    checked = cli("config", "check", str(bad))
    assert checked.returncode == EXIT_CONFIG and f"{bad}: probes.ports" in checked.stderr

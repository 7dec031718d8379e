"""The agent's own LoadSnapshot through the API and CLI: units, drain, restarts."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from conftest import LOADMESH, agent_config


def cli_json(*args: str) -> dict:
    out = subprocess.run([LOADMESH, *args, "--json"], capture_output=True, text=True,
                         timeout=30, check=True)
    return json.loads(out.stdout)


def test_snapshot_drain_and_restart(make_agent, run_dir: Path) -> None:
    sock = str(run_dir / "loadmesh.sock")
    config = agent_config(sock, extra='advertise = "10.1.2.3"')
    agent = make_agent(config).start()
    agent.wait_ready(sock)

    snap = cli_json("snapshot", "--socket", sock)
    assert snap["node_id"] == "test-node" and snap["state"] == "ok"
    assert snap["endpoints"] == ["10.1.2.3:8000"]
    assert 0 <= snap["score"] <= 1
    assert snap["host"]["mem_total_mib"] > 0 and 0 <= snap["host"]["cpu_util_ratio"] <= 1
    assert snap["gpus"] == [] and snap["models"] == []  # no GPU and no probes here
    # why the score is what it is: no GPU and no traffic leave the host's figures alone
    inputs = snap["score_inputs"]
    assert inputs["components"]["gpu_util"] is None and inputs["queue"] == []
    assert 0 <= inputs["components"]["cpu"] <= 1 and 0 <= inputs["instant_score"] <= 1
    shown = subprocess.run([LOADMESH, "snapshot", "--socket", sock], capture_output=True,
                           text=True, timeout=30, check=True).stdout
    assert "score from gpu_util -" in shown and "unsmoothed" in shown
    health = cli_json("status", "--socket", sock)["components"]
    assert health["gpu"]["state"] == "off" and health["gpu"]["reason"]
    assert health["snapshot"]["state"] == "ok"

    assert cli_json("drain", "--socket", sock) == {"draining": True, "kept": True}
    drained = cli_json("snapshot", "--socket", sock)
    assert drained["state"] == "draining"
    assert drained["version"] > snap["version"]

    agent.signal(signal.SIGTERM)
    assert agent.wait_exit() == 0

    # A restart keeps the drain and never reuses a version.
    again = make_agent(config).start()
    again.wait_ready(sock)
    restarted = cli_json("snapshot", "--socket", sock)
    assert restarted["state"] == "draining"
    assert restarted["version"] > drained["version"]
    assert "starting drained" in again.logs()

    assert cli_json("undrain", "--socket", sock) == {"draining": False, "kept": True}
    assert cli_json("snapshot", "--socket", sock)["state"] == "ok"

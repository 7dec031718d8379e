"""The agent with its eBPF probes: real traffic in, fingerprints, snapshot and routing out;
probes that cannot load degrade the agent, or stop it when they are required."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import nettopo
from conftest import LOADMESH, agent_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for BPF and netns")
SERVER = [sys.executable, str(Path(__file__).with_name("probe_servers.py"))]
PORT = 8000


def cli_json(*args: str) -> dict:
    out = subprocess.run([LOADMESH, *args, "--json"], capture_output=True, text=True,
                         timeout=30, check=True)
    return json.loads(out.stdout)


def post(url: str, model: str, status: int) -> int:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", "X-Status": str(status)})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def test_agent_fingerprints_real_traffic(make_agent, run_dir: Path) -> None:
    with nettopo.veth_netns() as topo, topo.ns.popen(SERVER + ["--port", str(PORT)], ready="ready"):
        sock = str(run_dir / "loadmesh.sock")
        agent = make_agent(agent_config(sock, extra=f'advertise = "{topo.host_v4}"',
                                        probes=f'interfaces = ["{topo.host_if}"]\nports = [{PORT}]\nrequired = true'))
        agent.start()
        agent.wait_ready(sock)
        assert cli_json("status", "--socket", sock)["components"]["probes"]["state"] == "ok"

        url = f"http://{topo.ns_v4}:{PORT}/v1/chat/completions"
        sent = {"e2e-llama": [200] * 7 + [429], "e2e-qwen": [200] * 3 + [500] * 2}
        for model, statuses in sent.items():
            for status in statuses:
                assert post(url, model, status) == status

        def seen() -> tuple[dict[str, dict], list[dict]]:
            report = cli_json("dump", "--socket", sock)
            return {m["model"]: m for m in report["models"]}, report["flows"]

        # the model rows follow every poll (0.25 s), the flow table one poll in four
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            models, flows = seen()
            if (all(models.get(m, {}).get("requests") == len(s) for m, s in sent.items())
                    and {f["model"] for f in flows} >= set(sent)):
                break
            time.sleep(0.3)
        models, flows = seen()
        assert models["e2e-llama"]["status"] == {"200": 7, "429": 1}
        assert models["e2e-qwen"]["status"] == {"200": 3, "500": 2}
        assert {f["model"] for f in flows} >= {"e2e-llama", "e2e-qwen"}
        assert all(f["dst"].endswith(f":{PORT}") for f in flows if f["model"].startswith("e2e-"))
        human = subprocess.run([LOADMESH, "dump", "--socket", sock], capture_output=True,
                               text=True, timeout=10, check=True).stdout
        assert "e2e-llama" in human and "429:1" in human

        # The models seen in traffic reach the snapshot and make this node a candidate.
        snap_models = {m["model"]: m for m in cli_json("snapshot", "--socket", sock)["models"]}
        assert snap_models["e2e-qwen"]["port"] == PORT
        best = cli_json("best", "e2e-llama", "--socket", sock)
        assert best["node_id"] == "test-node" and best["endpoint"] == f"{topo.host_v4}:{PORT}"

        agent.signal(signal.SIGTERM)
        assert agent.wait_exit() == 0
        assert nettopo.attached(topo.host_if) == []


def test_probes_that_cannot_load_degrade_or_stop_the_agent(make_agent, run_dir: Path) -> None:
    sock = str(run_dir / "loadmesh.sock")
    missing = 'interfaces = ["lm-no-such0"]'
    agent = make_agent(agent_config(sock, probes=missing)).start()
    agent.wait_ready(sock)
    probes = cli_json("status", "--socket", sock)["components"]["probes"]
    assert probes["state"] == "degraded" and "lm-no-such0" in probes["reason"]
    assert sum("running without probes" in line for line in agent.logs().splitlines()) == 1
    agent.signal(signal.SIGTERM)
    assert agent.wait_exit() == 0

    required = make_agent(agent_config(sock, probes=missing + "\nrequired = true")).start()
    assert required.wait_exit() == 78  # EX_CONFIG: systemd does not restart into it
    assert "probes are required" in required.logs() and "lm-no-such0" in required.logs()
    assert not os.path.exists(sock)

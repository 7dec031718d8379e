"""`best` and `feedback` through a real agent's API and CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import LOADMESH, agent_config
from loadmesh.daemon.client import ApiError, Client


def test_best_feedback_and_no_candidate(make_agent, run_dir: Path) -> None:
    sock = str(run_dir / "loadmesh.sock")
    extra = 'advertise = "10.9.8.7"\n[routing]\nstatic_models = { test-node = ["llama-3-8b"] }\n'
    agent = make_agent(agent_config(sock, extra=extra)).start()
    agent.wait_ready(sock)

    with Client(sock) as client:
        best = client.get("/v1/best", model="llama-3-8b", session="user-42")
        assert best["node_id"] == "test-node" and best["endpoint"] == "10.9.8.7:8000"
        assert set(best) >= {"node_id", "endpoint", "score", "age_ms", "reason", "alternatives"}
        assert client.post("/v1/feedback", {"node_id": "test-node", "outcome": "ok",
                                            "latency_ms": 12.5}) == {"node_id": "test-node", "known": True}
        for bad in ({"node_id": "test-node", "outcome": "meh"}, ["x"],
                    {"node_id": "test-node", "outcome": "ok", "latency_ms": "slow"}):
            try:
                client.post("/v1/feedback", bad)
                raise AssertionError(f"accepted {bad}")
            except ApiError as exc:
                assert exc.status == 400
        dry = client.get("/v1/best", model="llama-3-8b", session="user-42", dry_run="1")
        assert dry["node_id"] == "test-node" and dry["reason"] == best["reason"]
        try:
            client.get("/v1/best", model="llama-3-8b", dry_run="yes")
            raise AssertionError("dry_run=yes accepted")
        except ApiError as exc:
            assert exc.status == 400 and "dry_run" in exc.message
        try:
            client.get("/v1/best", model="mistral")
            raise AssertionError("an unknown model got an answer")
        except ApiError as exc:
            assert exc.status == 503 and "unknown model" in exc.message

    human = subprocess.run([LOADMESH, "best", "llama-3-8b", "--dry-run", "--socket", sock],
                           capture_output=True, text=True, timeout=10)
    assert human.returncode == 0 and "10.9.8.7:8000" in human.stdout
    missing = subprocess.run([LOADMESH, "best", "mistral", "--socket", sock, "--json"],
                             capture_output=True, text=True, timeout=10)
    assert missing.returncode == 1 and "unknown model" in missing.stderr
    peers = json.loads(subprocess.run([LOADMESH, "peers", "--socket", sock, "--json"],
                                      capture_output=True, text=True, timeout=10).stdout)
    assert [p["node_id"] for p in peers] == ["test-node"]
    assert set(peers[0]) == {"node_id", "state", "version", "age_ms", "addr"}

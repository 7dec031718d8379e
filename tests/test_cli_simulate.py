"""`loadmesh simulate`: the fixed JSON keys of both simulators, through the real command."""

from __future__ import annotations

import json
import subprocess

from conftest import LOADMESH


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LOADMESH, "simulate", *args], capture_output=True, text=True, timeout=300)


def test_simulate_gossip_json_keys() -> None:
    out = run("gossip", "--nodes", "20", "--seconds", "15", "--kill", "1", "--seed", "3", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["nodes"] == 20
    for key in ("convergence_p50_s", "convergence_p99_s", "urgent_p99_s", "bytes_per_node_per_s",
                "max_datagram_bytes", "false_dead", "detect_dead_p99_s"):
        assert key in report, key
    assert 0 < report["convergence_p50_s"] <= report["convergence_p99_s"]
    assert 0 < report["max_datagram_bytes"] <= 1400
    assert report["false_dead"] == 0 and report["detect_dead_p99_s"] > 0
    assert run("gossip", "--nodes", "20", "--seconds", "15", "--kill", "1", "--seed", "3",
               "--json").stdout == out.stdout, "a seed makes the run repeatable"


def test_simulate_routing_json_keys() -> None:
    out = run("routing", "--loads", "0.85", "--duration", "30", "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)["results"]
    policies = {r["policy"] for r in results}
    assert {"loadmesh", "jsq_oracle", "round_robin"} <= policies
    for r in results:
        assert r["load"] == 0.85 and 0 < r["p50_ms"] <= r["p99_ms"]


def test_simulate_rejects_bad_arguments() -> None:
    assert run("gossip", "--loss", "1.5").returncode == 2
    assert run("routing", "--loads", "0").returncode == 2

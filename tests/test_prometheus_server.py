"""A real Prometheus server scrapes a real agent: a series comes back by query, and every
query of the Grafana dashboard evaluates on it."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import agent_config
from metrics_helpers import free_port, metrics_config, wait_for
from test_dashboard import DASHBOARD, queries

# What Grafana would put in place of the dashboard's variables.
VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}


@contextlib.contextmanager
def prometheus(workdir: Path, target: str) -> Iterator[str]:
    """Prometheus on a free loopback port with its own storage under workdir, scraping
    target every second; stopped however the block ends. Yields its base URL."""
    binary = shutil.which("prometheus")
    assert binary, "the prometheus server comes with Debian's prometheus package (scripts/setup.sh)"
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: loadmesh\n    static_configs:\n"
        f"      - targets: ['{target}']\n")
    address = f"127.0.0.1:{free_port()}"
    log = workdir / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={address}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield f"http://{address}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def query(base: str, expr: str) -> dict[str, Any]:
    """The answer of /api/v1/query: {"status": ..., "data" or "error": ...}."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        # 400 for a query that does not parse (a JSON error); a plain-text 503 while
        # Prometheus is still starting.
        try:
            return json.load(exc)
        except json.JSONDecodeError:
            return {"status": f"http {exc.code}"}
    except (urllib.error.URLError, ConnectionError):
        return {"status": "unreachable"}


def test_prometheus_scrapes_the_agent_and_runs_the_dashboard(make_agent, run_dir: Path,
                                                             tmp_path: Path) -> None:
    port = free_port()
    sock = str(run_dir / "loadmesh.sock")
    make_agent(agent_config(sock, metrics=metrics_config(port))).start().wait_ready(sock)
    with prometheus(tmp_path, f"127.0.0.1:{port}") as base:
        def node_info() -> list[dict[str, Any]]:
            answer = query(base, 'loadmesh_node_info{job="loadmesh"}')
            return answer["data"]["result"] if answer["status"] == "success" else []

        wait_for(lambda: bool(node_info()), timeout=60, what="Prometheus to scrape the agent")
        (series,) = node_info()
        assert series["metric"]["node_id"] == "test-node"
        assert series["value"][1] == "1"
        (up,) = query(base, 'up{job="loadmesh"}')["data"]["result"]
        assert up["value"][1] == "1"

        for expr in queries(json.loads(DASHBOARD.read_text())):
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            answer = query(base, expr)
            assert answer["status"] == "success", f"{expr!r}: {answer.get('error')}"

"""The Grafana dashboard asks only for series the exporter declares, checked against a real
agent's scrape (tests/test_prometheus_server.py runs each query on a real Prometheus)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from conftest import agent_config
from metrics_helpers import declared, free_port, metrics_config, scrape

DASHBOARD = Path(__file__).parents[1] / "docs" / "grafana" / "loadmesh.json"

# What PromQL spells with identifiers besides metric names (functions are followed by "(").
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "bool", "offset", "inf", "nan"}


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and templating queries."""
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", var["query"]["query"]))
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers left once strings, label matchers,
    ranges, grouping label lists and function names are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[m.end():].lstrip()
        if not rest.startswith("(") and m.group().lower() not in _KEYWORDS:
            names.add(m.group())
    return names


def test_the_name_extraction_finds_names_and_only_names() -> None:
    expr = ('histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{instance=~"$i",'
            'code=~"5.."}[$__rate_interval]))) / on(instance) group_left(node_id) b_info == bool 1')
    assert metric_names(expr) == {"a_bucket", "b_info"}


def test_every_query_uses_exported_names_only(make_agent, run_dir) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    port = free_port()
    sock = str(run_dir / "loadmesh.sock")
    make_agent(agent_config(sock, metrics=metrics_config(port))).start().wait_ready(sock)
    exported = declared(scrape(port))
    used: set[str] = set()
    for expr in queries(dashboard):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{sorted(names - exported)} not exported, in {expr!r}"
        used |= names
    # The fleet view the issue asks for, at least.
    assert used >= {"loadmesh_node_load_score", "loadmesh_requests_total",
                    "loadmesh_time_to_first_byte_seconds_bucket", "loadmesh_gpu_utilization_ratio",
                    "loadmesh_peers", "loadmesh_gossip_sent_bytes_total",
                    "loadmesh_gossip_received_bytes_total"}


def test_the_dashboard_imports_cleanly() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and all(t["refId"] and t["expr"] for t in panel["targets"])
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24

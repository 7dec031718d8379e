"""Human-readable output for the CLI: durations, component health, aligned tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n] or ["0s"]
    return " ".join(shown[:2])


def health_line(health: Mapping[str, str]) -> str:
    return f"{health['state']}: {health['reason']}" if health.get("reason") else health["state"]


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def status(body: Mapping[str, Any]) -> str:
    lines = [
        f"node     {body['node_id']}",
        f"agent    loadmesh {body['version']}, pid {body['pid']}, up {duration(body['uptime_s'])}",
        f"status   {body['status']}",
    ]
    components = body["components"]
    width = max((len(name) for name in components), default=0)
    lines.extend(f"  {name.ljust(width)}  {health_line(h)}" for name, h in components.items())
    return "\n".join(lines)

"""Human-readable output for the CLI: durations, component health, aligned tables."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# C0 and C1 controls, DEL, and the marks and overrides that reorder text on screen.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any) -> Any:
    """`value` with every string in it, keys too, safe for a terminal: controls and
    bidirectional marks as escapes (\\x1b, \\u202e). Model names come from request bodies on
    the serving port and node ids from gossip: printed raw, one could clear the screen,
    retitle the terminal, or make one row read as another."""
    if isinstance(value, str):
        return _UNSAFE.sub(_escape, value)
    if isinstance(value, Mapping):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable(v) for v in value]
    return value


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


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pair(latency: Mapping[str, Any]) -> str:
    """P50/P99 of one latency kind, in ms."""
    return f"{_ms(latency['p50'])}/{_ms(latency['p99'])}"


def fingerprints(body: Mapping[str, Any]) -> str:
    window = f"{body['window_s']:g} s"
    model_rows = [
        (m["model"], m["endpoint"], m["requests"], f"{m['rps']:.1f}",
         " ".join(f"{code}:{n}" for code, n in sorted(m["status"].items())) or "-",
         m["waiting"], m["running"], m["aborted"], f"{m['tokens_per_s']:.1f}",
         *(_pair(m["latency"][kind]) for kind in ("ttfb", "ttft", "itl", "e2e")))
        for m in body["models"]
    ]
    flow_rows = [
        (f["src"], f["dst"], f["model"], f["status"], f["count"],
         _ms(f.get("mean_ms")), _ms(f.get("max_ms")))
        for f in body["flows"]
    ]
    parts = [
        f"models: REQUESTS, STATUS and ABORTED since the probes started; RPS, TOK/S and the "
        f"latencies over the last {window}; WAIT (no first token yet; a non-streamed request: "
        f"no answer yet) and RUN (streaming) now. Latencies are P50/P99 in ms from the "
        f"request's first byte on the wire: TTFB to the answer's first byte, TTFT to a "
        f"stream's first data: event, ITL between a stream's events, E2E to the answer's "
        f"last byte; - where the window holds none.",
        table(("MODEL", "ENDPOINT", "REQUESTS", "RPS", "STATUS", "WAIT", "RUN", "ABORTED",
               "TOK/S", "TTFB", "TTFT", "ITL", "E2E"), model_rows),
    ]
    errors = {k: v for k, v in body["errors"].items() if v}
    if errors:
        parts.append("probe errors (docs/probes.md): "
                     + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())))
    parts += ["flows: one row per connection, model and status; MEAN_MS and MAX_MS of the "
              "time to first byte",
              table(("SRC", "DST", "MODEL", "STATUS", "COUNT", "MEAN_MS", "MAX_MS"), flow_rows)]
    return "\n\n".join(parts)


def snapshot(body: Mapping[str, Any]) -> str:
    host = body["host"]
    pressure = host["cpu_pressure_pct"]
    lines = [
        f"node       {body['node_id']}",
        f"version    {body['version']} (at {body['timestamp_ms']} ms)",
        f"state      {body['state']}, load score {body['score']:.4f} (0..1)",
        f"endpoints  {', '.join(body['endpoints']) or '-'}",
        f"host       cpu {host['cpu_util_ratio'] * 100:.1f} %, "
        f"memory {host['mem_used_mib']} / {host['mem_total_mib']} MiB, "
        f"load1 {host['load1']:.2f}, cpu pressure "
        + ("-" if pressure is None else f"{pressure:.2f} %"),
        "",
    ]
    gpu_rows = [
        (g["index"], g["name"] or "-", "yes" if g["healthy"] else "NO", g["util_pct"],
         f"{g['mem_used_mib']}/{g['mem_total_mib']}", g["temp_c"],
         f"{g['power_w']}/{g['power_limit_w']}", g["throttle_reasons"], g["processes"])
        for g in body["gpus"]
    ]
    lines.append(table(("GPU", "NAME", "HEALTHY", "UTIL_%", "MEM_MIB", "TEMP_C", "POWER_W",
                        "THROTTLE", "PROCS"), gpu_rows) if gpu_rows else "gpus       none")
    model_rows = [
        (m["model"], m["port"], f"{m['rps']:.2f}", f"{m['error_ratio']:.4f}",
         _ms(m["p50_ms"]), _ms(m["p99_ms"]), m["waiting"], m["running"],
         _ms(m["ttft_p99_ms"]), _ms(m["itl_p99_ms"]), f"{m['tokens_per_s']:.1f}")
        for m in body["models"]
    ]
    lines += ["", table(("MODEL", "PORT", "RPS", "ERROR_RATIO", "TTFB_P50_MS", "TTFB_P99_MS",
                         "WAITING", "RUNNING", "TTFT_P99_MS", "ITL_P99_MS", "TOKENS_PER_S"),
                        model_rows) if model_rows else "models     none seen yet"]
    if "score_inputs" in body:
        lines += ["", *_score_inputs(body["score_inputs"])]
    return "\n".join(lines)


def _figure(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _score_inputs(inputs: Mapping[str, Any]) -> list[str]:
    """The last tick's components (docs/snapshot.md, "The load score") and each model's
    queue figure: why the score is what it is."""
    parts = ", ".join(f"{name} {_figure(v)}" for name, v in inputs["components"].items())
    lines = [f"score from {parts} (-: no data); unsmoothed {inputs['instant_score']:.3f}"]
    rows = [(q["model"], q["port"], _figure(q["rate_tokens_per_s"], 1),
             _figure(q["best_tokens_per_s"], 1), _figure(q["queue"]))
            for q in inputs["queue"]]
    if rows:
        lines += ["queue: output tokens/s per request in the server now, against the best "
                  "this node has served the model at",
                  table(("MODEL", "PORT", "RATE", "BEST", "QUEUE"), rows)]
    return lines


def peers(body: Sequence[Mapping[str, Any]]) -> str:
    rows = [(p["node_id"], p["state"], p["version"], p["age_ms"], p["addr"]) for p in body]
    return table(("NODE", "STATE", "VERSION", "AGE_MS", "ADDR"), rows)


def best(body: Mapping[str, Any]) -> str:
    lines = [f"{body['node_id']}  {body['endpoint']}  score {body['score']:.4f}  "
             f"snapshot {body['age_ms']} ms old  ({body['reason']})"]
    lines += [f"  then {a['node_id']}  {a['endpoint']}  score {a['score']:.4f}"
              for a in body["alternatives"]]
    return "\n".join(lines)

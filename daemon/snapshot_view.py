"""The snapshot as operators read it: every figure named with its unit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from loadmesh.daemon.collectors.gpu import GpuInfo
from loadmesh.daemon.snapshot_builder import ScoreInputs
from loadmesh.gossip.snapshot import LoadSnapshot


def _model_name(model_names: Mapping[int, str], model_id: int) -> str:
    return model_names.get(model_id, f"{model_id:016x}")


def score_inputs_json(inputs: ScoreInputs, model_names: Mapping[int, str]) -> dict[str, Any]:
    """Why the score is what it is: the components in [0, 1] (null: no data, left out of
    the blend), the score before smoothing, and each model's queue, its rate against the
    best this node has served it at."""
    return {
        "components": asdict(inputs.components),
        "instant_score": inputs.instant,
        "queue": [
            {"model": _model_name(model_names, model_id), "port": port,
             "rate_tokens_per_s": q.rate, "best_tokens_per_s": q.best, "queue": q.queue}
            for (model_id, port), q in sorted(inputs.queue.items())
        ],
    }


def snapshot_json(snap: LoadSnapshot, devices: Sequence[GpuInfo],
                  model_names: Mapping[int, str],
                  inputs: ScoreInputs | None) -> dict[str, Any]:
    identity = {d.index: d for d in devices}
    host = snap.host
    out = {
        "node_id": snap.node_id,
        "version": snap.version,
        "timestamp_ms": snap.timestamp_ms,
        "state": snap.state.value,
        "score": snap.score,
        "endpoints": [f"[{e.host}]:{e.port}" if ":" in e.host else f"{e.host}:{e.port}"
                      for e in snap.endpoints],
        "host": {
            "cpu_util_ratio": host.cpu_util,
            "mem_used_mib": host.mem_used_mib,
            "mem_total_mib": host.mem_total_mib,
            "load1": host.load1,
            "cpu_pressure_pct": host.cpu_pressure_pct,
        },
        "gpus": [
            {
                "index": g.index,
                "uuid": identity[g.index].uuid if g.index in identity else "",
                "name": identity[g.index].name if g.index in identity else "",
                "healthy": g.healthy,
                "util_pct": g.util_pct,
                "mem_used_mib": g.mem_used_mib,
                "mem_total_mib": g.mem_total_mib,
                "temp_c": g.temp_c,
                "power_w": g.power_w,
                "power_limit_w": g.power_limit_w,
                "throttle_reasons": f"{g.throttle_reasons:#x}",
                "processes": g.processes,
            }
            for g in snap.gpus
        ],
        "models": [
            {
                "model": _model_name(model_names, m.model_id),
                "model_id": f"{m.model_id:016x}",
                "port": m.port,
                "rps": m.rps,
                "error_ratio": m.error_ratio,
                "p50_ms": m.p50_ms,
                "p99_ms": m.p99_ms,
                "in_flight": m.in_flight,
                "waiting": m.waiting,
                "running": m.running,
                "ttft_p99_ms": m.ttft_p99_ms,
                "itl_p99_ms": m.itl_p99_ms,
                "tokens_per_s": m.tokens_per_s,
                "pace_ms": m.pace_ms,
                "sessions_passed_on": {"start": m.shed_start, "width": m.shed_width},
            }
            for m in snap.models
        ],
        "busiest_sessions": [
            {
                "model": _model_name(model_names, k.model_id),
                "model_id": f"{k.model_id:016x}",
                "routed_rps": k.routed_rps,
                "sessions": [{"key": f"{key:08x}", "rps": rps} for key, rps in k.sessions],
            }
            for k in snap.sessions
        ],
    }
    if inputs is not None:
        out["score_inputs"] = score_inputs_json(inputs, model_names)
    return out

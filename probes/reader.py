"""Turning the probe maps into per-model load figures and the fingerprint report.

poll() (a worker thread, once a second) reads the maps, turns the kernel's cumulative
counters into per-interval deltas, keeps the intervals of the sliding window, and builds a
new immutable state that it publishes by swapping one reference. summary(), model_stats()
and the other readers (the event loop) only return parts of that state: they never touch a
map and never wait for poll(). report_json(), the whole report with a row per flow, is
built from the state on first use (a few hundred milliseconds with 10,000 connections):
call it from a worker thread. It writes the rows as JSON text, not as dicts: tens of
thousands of dicts would bring on full collections, which stall every thread.

Per model and serving port (model_stats(), for the load snapshot): requests and status
counts since the probes started come from the latency histograms (every recorded response
is in exactly one bucket), rates, error and 429 ratios and percentiles from the window's
deltas, requests in flight from the connection state map. The report has a row per model,
its ports together, and a row per flow from the fingerprints map; flows idle for
flow_idle_s are deleted from that map so it holds recent flows only.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from . import buckets
from .maps import FlowKey, FlowTable, MapSnapshot, PortStats, format_endpoint
from .model_id import NO_MODEL

_EMPTY: Mapping[int, int] = MappingProxyType({})
_NAN = float("nan")

Endpoint = tuple[int, int]  # (model_id, serving port)


class MapSource(Protocol):
    """What the reader needs from a ProbeSet (tests pass fakes)."""

    def read_maps(self) -> MapSnapshot: ...

    def expire_flows(self, keys: list[FlowKey]) -> None: ...


@dataclass(frozen=True)
class ModelStats:
    """One model's figures on one serving port (the load snapshot has an entry per
    (model_id, port)); ratios and percentiles over the reader's window."""

    model: str
    model_id: int
    port: int
    requests: int  # responses recorded since the probes started
    status: Mapping[int, int]  # since the probes started
    rps: float
    error_ratio: float  # 5xx share
    ratio_429: float
    p50_ms: float  # NaN: no response in the window
    p95_ms: float
    p99_ms: float
    in_flight: int


@dataclass(frozen=True)
class LatencyCounts:
    """One model's time-to-first-byte histogram since the probes started, all serving
    ports and statuses together, at the bounds latency_counts() was asked for."""

    model: str
    cumulative: tuple[int, ...]  # responses under each bound's nearest bucket edge
    count: int
    sum_s: float  # from bucket midpoints: within 1/32 of the true sum


@dataclass(frozen=True)
class _Interval:
    """Deltas between two polls."""

    start: float
    end: float
    status: Mapping[Endpoint, Mapping[int, int]]  # -> status -> responses
    buckets: Mapping[Endpoint, Mapping[int, int]]  # -> bucket -> responses
    ports: Mapping[int, PortStats]


@dataclass
class _State:
    summary: dict[str, Any]  # the report without its flows
    models: tuple[ModelStats, ...]
    names: Mapping[int, str]
    histograms: Mapping[tuple[int, int, int, int], int]  # the kernel's, since the start
    flows: FlowTable
    wall_at_mono: float  # time.time() - time.monotonic() when the maps were read
    report: bytes | None = None  # summary and flows as JSON, built on first use


def model_name(model_id: int, names: Mapping[int, str]) -> str:
    if model_id == NO_MODEL:
        return "-"
    # a name missing means the models map was full (counted in errors.models_full)
    return names.get(model_id, f"#{model_id:016x}")


def nearest_edge_ns(bound_ns: float) -> int:
    """The bucket edge nearest to bound_ns. Buckets cannot be split, so "at most
    bound_ns" can only be answered as "below this edge", which is at most half a bucket,
    1/32 (3.1%) of the bound, away from it."""
    v = min(max(round(bound_ns), 0), buckets.MAX_VALUE)
    lo, hi = buckets.bounds(buckets.index(v))
    return lo if v - lo <= hi - v else hi


def _delta(cur: int, prev: int) -> int:
    """Counter delta; a smaller value means the entry was re-created from zero."""
    return cur - prev if cur >= prev else cur


def _ms(ns: float | None) -> float:
    return _NAN if ns is None else round(ns / 1e6, 3)


def _json_ms(ms: float) -> float | None:
    return None if math.isnan(ms) else ms


class FingerprintReader:
    def __init__(self, probes: MapSource, window_s: float = 10.0, *,
                 flow_idle_s: float = 30.0) -> None:
        if window_s <= 0 or flow_idle_s <= 0:
            raise ValueError("window_s and flow_idle_s must be positive")
        self._probes = probes
        self.window_s = window_s
        self.flow_idle_s = flow_idle_s
        self._last_poll = time.monotonic()
        self._prev_hist: dict[tuple[int, int, int, int], int] = {}
        self._prev_ports: dict[int, PortStats] = {}
        self._totals: dict[Endpoint, dict[int, int]] = {}  # -> status -> since start
        self._window: deque[_Interval] = deque()
        empty = MapSnapshot(mono_ns=time.monotonic_ns())
        self._state = _State(self._summary(empty, (), {}), (), MappingProxyType({}),
                             MappingProxyType({}), empty.flows, 0.0)

    def poll(self, now: float) -> None:
        """Reads the maps and publishes new figures. now: time.monotonic() seconds.
        Blocking (map reads); call it from one worker thread at a time."""
        snap = self._probes.read_maps()
        interval = self._absorb(snap, now)
        self._window.append(interval)
        while self._window and self._window[0].end <= now - self.window_s:
            self._window.popleft()
        models = self._model_stats(snap)
        self._state = _State(self._summary(snap, models, self._port_rates()), models,
                             MappingProxyType(dict(snap.models)),
                             MappingProxyType(snap.histograms), snap.flows,
                             time.time() - snap.mono_ns / 1e9)
        idle = snap.flows.idle(snap.mono_ns - int(self.flow_idle_s * 1e9))
        if idle:
            self._probes.expire_flows(idle)

    def summary(self) -> dict[str, Any]:
        """The fingerprint report without its flows (JSON-ready, cheap). Shared: callers must
        not modify it."""
        return self._state.summary

    def report_json(self) -> bytes:
        """The whole fingerprint report as JSON: the summary and a row per flow. Built on
        the first call after a poll, in the caller's thread: not on the event loop."""
        state = self._state
        if state.report is None:
            summary = json.dumps(state.summary, separators=(",", ":"))
            state.report = f'{summary[:-1]},"flows":[{",".join(_flow_rows(state))}]}}'.encode()
        return state.report

    def model_stats(self) -> tuple[ModelStats, ...]:
        """Figures per (model, serving port), for the load snapshot."""
        return self._state.models

    def model_names(self) -> Mapping[int, str]:
        """model_id -> name of every model the probes have seen."""
        return self._state.names

    def latency_counts(self, bounds_s: Sequence[float]) -> tuple[LatencyCounts, ...]:
        """Per model, by name, since the probes started: how many responses came within
        each of bounds_s (ascending, in seconds), each bound taken at its nearest bucket
        edge (nearest_edge_ns). For a Prometheus histogram; cheap enough to call from the
        event loop on each scrape (one pass over the histogram entries in use)."""
        state = self._state
        edges = [nearest_edge_ns(b * 1e9) for b in bounds_s]
        per_bound: dict[int, list[int]] = {}  # model_id -> responses first counted at bound i
        sums: dict[int, float] = {}
        for (model, _port, _status, bucket), n in state.histograms.items():
            # A bucket is under an edge when its last value is: the first such bound is
            # where it starts to count; the final slot holds buckets above every bound.
            first = bisect_left(edges, buckets.bounds(bucket)[1])
            slots = per_bound.setdefault(model, [0] * (len(edges) + 1))
            slots[first] += n
            sums[model] = sums.get(model, 0.0) + buckets.midpoint(bucket) * n
        out = []
        for model, slots in per_bound.items():
            running, cumulative = 0, []
            for n in slots[:-1]:
                running += n
                cumulative.append(running)
            out.append(LatencyCounts(model_name(model, state.names), tuple(cumulative),
                                     running + slots[-1], sums[model] / 1e9))
        return tuple(sorted(out, key=lambda c: c.model))

    # ---- inside poll ----

    def _absorb(self, snap: MapSnapshot, now: float) -> _Interval:
        status: dict[Endpoint, dict[int, int]] = {}
        hist: dict[Endpoint, dict[int, int]] = {}
        prev = self._prev_hist
        for key, count in snap.histograms.items():
            d = _delta(count, prev.get(key, 0))
            if d <= 0:
                continue
            model, port, code, bucket = key
            ep = (model, port)
            s = status.setdefault(ep, {})
            s[code] = s.get(code, 0) + d
            b = hist.setdefault(ep, {})
            b[bucket] = b.get(bucket, 0) + d
            t = self._totals.setdefault(ep, {})
            t[code] = t.get(code, 0) + d
        self._prev_hist = dict(snap.histograms)
        ports = {}
        for port, stats in snap.ports.items():
            old = self._prev_ports.get(port, PortStats(0, 0, 0, 0, 0))
            ports[port] = PortStats(*(_delta(c, p) for c, p in zip(stats, old)))
        self._prev_ports = dict(snap.ports)
        start, self._last_poll = self._last_poll, now
        return _Interval(start, now, status, hist, ports)

    def _span(self) -> float:
        """Seconds the window's intervals cover."""
        return max(self._window[-1].end - self._window[0].start, 1e-3) if self._window else 0

    def _model_stats(self, snap: MapSnapshot) -> tuple[ModelStats, ...]:
        status: dict[Endpoint, dict[int, int]] = {}
        hist: dict[Endpoint, dict[int, int]] = {}
        for iv in self._window:
            for ep, counts in iv.status.items():
                buckets.add_into(status.setdefault(ep, {}), counts)
            for ep, counts in iv.buckets.items():
                buckets.add_into(hist.setdefault(ep, {}), counts)
        span = self._span()
        seen = set(self._totals) | {ep for ep, n in snap.inflight.items() if n}
        out = []
        for ep in sorted(seen, key=lambda ep: (model_name(ep[0], snap.models), ep[1])):
            model, port = ep
            win = status.get(ep, {})
            n = sum(win.values())
            h = hist.get(ep, _EMPTY)
            totals = self._totals.get(ep, {})
            out.append(ModelStats(
                model=model_name(model, snap.models),
                model_id=model,
                port=port,
                requests=sum(totals.values()),
                status=MappingProxyType(dict(totals)),
                rps=n / span if span else 0.0,
                error_ratio=sum(c for s, c in win.items() if 500 <= s <= 599) / n if n else 0.0,
                ratio_429=win.get(429, 0) / n if n else 0.0,
                p50_ms=_ms(buckets.percentile(h, 0.50)),
                p95_ms=_ms(buckets.percentile(h, 0.95)),
                p99_ms=_ms(buckets.percentile(h, 0.99)),
                in_flight=snap.inflight.get(ep, 0),
            ))
        return tuple(out)

    def _per_model(self, models: tuple[ModelStats, ...]) -> list[dict[str, Any]]:
        """The report's rows: one per model, its serving ports together."""
        window: dict[int, dict[int, int]] = {}
        for iv in self._window:
            for (model, _port), counts in iv.buckets.items():
                buckets.add_into(window.setdefault(model, {}), counts)
        rows: dict[int, dict[str, Any]] = {}
        for m in models:
            row = rows.get(m.model_id)
            if row is None:
                row = rows[m.model_id] = {"model": m.model, "requests": 0, "status": {},
                                          "rps": 0.0, "inflight": 0, "ports": [],
                                          "_errors": 0.0, "_429": 0.0}
            row["requests"] += m.requests
            for code, n in m.status.items():
                row["status"][str(code)] = row["status"].get(str(code), 0) + n
            row["rps"] += m.rps
            row["inflight"] += m.in_flight
            row["ports"].append(m.port)
            row["_errors"] += m.error_ratio * m.rps
            row["_429"] += m.ratio_429 * m.rps
        out = []
        for model, row in rows.items():
            h = window.get(model, _EMPTY)
            rps = row.pop("rps")
            errors, r429 = row.pop("_errors"), row.pop("_429")
            out.append({
                **row,
                "status": dict(sorted(row["status"].items())),
                "rps": round(rps, 3),
                "p50_ms": _json_ms(_ms(buckets.percentile(h, 0.50))),
                "p95_ms": _json_ms(_ms(buckets.percentile(h, 0.95))),
                "p99_ms": _json_ms(_ms(buckets.percentile(h, 0.99))),
                "error_ratio": round(errors / rps, 4) if rps else 0.0,
                "ratio_429": round(r429 / rps, 4) if rps else 0.0,
            })
        return out

    def _port_rates(self) -> dict[int, dict[str, float]]:
        if not self._window:
            return {}
        span = max(self._window[-1].end - self._window[0].start, 1e-3)
        sums: dict[int, list[int]] = {}
        for iv in self._window:
            for port, d in iv.ports.items():
                acc = sums.setdefault(port, [0] * len(PortStats._fields))
                for i, v in enumerate(d):
                    acc[i] += v
        return {port: {f"{f}_per_s": round(v / span, 3) for f, v in zip(PortStats._fields, acc)}
                for port, acc in sums.items()}

    def _summary(self, snap: MapSnapshot, models: tuple[ModelStats, ...],
                 port_rates: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "models": self._per_model(models),
            "flow_count": len(snap.flows),
            "errors": dict(snap.errors),
            "tcp": {str(port): {**stats._asdict(), **port_rates.get(port, {})}
                    for port, stats in sorted(snap.ports.items())},
        }


def _flow_rows(state: _State) -> Iterator[str]:
    """One JSON object per flow (addresses and numbers need no escaping, names do)."""
    names: dict[int, str] = {}
    for key, count, lat_sum, lat_max, last in state.flows.rows():
        client, client_port, server, server_port, model_id, status = key
        name = names.get(model_id)
        if name is None:
            name = names[model_id] = json.dumps(model_name(model_id, state.names))
        mean = repr(lat_sum / count / 1e6) if count else "null"
        yield (f'{{"src":"{format_endpoint(client, client_port)}",'
               f'"dst":"{format_endpoint(server, server_port)}","model":{name},'
               f'"status":{status},"count":{count},"mean_ms":{mean},'
               f'"max_ms":{lat_max / 1e6!r},"last_seen":{state.wall_at_mono + last / 1e9!r}}}')

"""The probes' maps as figures: per model, serving port and endpoint, over a sliding window.

FingerprintReader.poll() runs in a worker thread four times a second (the agent's view of
its queue and latencies is never more than 250 ms old): it reads the maps, turns their
cumulative counters into the deltas of one interval, keeps the intervals of the window
(default 10 s) and their running sums, and publishes an immutable summary by swapping one
reference. Readers on the event loop (summary(), model_stats(), latency_counts()) never
touch a map. The flow table, the one map whose read grows with connections times CPUs, is
read one poll in four, for the flows' expiry and the operator's dump.

What the figures are (docs/probes.md has the wire side):
- latencies per kind, from the request's first byte on the wire: ttfb (to the answer's
  first byte), ttft (to a stream's first data: event; streams only), itl (between a
  stream's events), e2e (to the answer's last byte); P50/P95/P99 over the window's
  histograms, nearest rank, as bucket midpoints (within 3.1% of every value in the bucket);
- requests and status counts since the probes started (from the ttfb histograms: every
  answer has one), rps and error ratios over the window;
- outcomes (complete, error, aborted, truncated, unanswered) since the start;
- output tokens: a stream's data: events as they pass, replaced at the answer's end by its
  usage object's count when one passed; tokens/s over the window;
- waiting and running, from the connections' state at the last poll; requests in flight
  on average over the window;
- over the answers that ended in the window with their end seen: their output tokens and
  summed first-byte-to-last-byte times, a request's rate in the server whether it
  streamed or not (the load score's queue learns its best from it).
"""

from __future__ import annotations

import json
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from loadmesh.model_id import NO_MODEL

from . import abi, buckets
from .maps import (
    EndpointKey,
    FlowTable,
    HistKey,
    InFlight,
    MapSnapshot,
    PortStats,
    RequestStats,
    YIELD_EVERY,
    format_endpoint,
)

_NAN = float("nan")
KINDS = abi.names("LM_HK_", "LM_HK_COUNT")  # ("ttfb", "ttft", "itl", "e2e")
ENDPOINTS = abi.endpoint_names()  # ("other", "chat", ...)
OUTCOMES = abi.outcome_names()  # ("complete", "error", "aborted", ...)
OUT_COMPLETE, OUT_ERROR = (OUTCOMES.index(o) for o in ("complete", "error"))
PACE_S = 1.0
# The failed ratio's span. Shorter than the window: a host that has stopped failing gets
# next to no traffic while its failures count, so they would keep it priced out for the
# whole window. Over the last FAILED_S it is tried again soon after it recovers.
FAILED_S = 3.0
TTFB, TTFT, ITL, E2E = (KINDS.index(k) for k in ("ttfb", "ttft", "itl", "e2e"))
EP_OTHER = ENDPOINTS.index("other")
EP_EMBEDDINGS = ENDPOINTS.index("embeddings")
QUANTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))


class MapSource(Protocol):
    """What the reader needs from a ProbeSet (tests pass fakes)."""

    def read_maps(self, with_flows: bool = True) -> MapSnapshot: ...

    def read_flows(self, idle_s: float) -> tuple[int, FlowTable]: ...


@dataclass(frozen=True)
class Percentiles:
    """P50/P95/P99 in ms over the window; NaN when the window holds no sample."""

    p50: float = _NAN
    p95: float = _NAN
    p99: float = _NAN

    def json(self) -> dict[str, float | None]:
        return {name: _json_ms(getattr(self, name)) for name, _ in QUANTILES}


_NONE = Percentiles()


@dataclass(frozen=True)
class ModelStats:
    """One model's figures on one serving port, its inference endpoints together (the
    load snapshot has an entry per (model_id, port)); window figures over the reader's
    window, counts since the probes started."""

    model: str
    model_id: int
    port: int
    requests: int  # answers since the probes started
    status: Mapping[int, int]  # since the probes started
    rps: float
    error_ratio: float  # 5xx answers and streams that carried an error event
    ratio_429: float
    # What counts against the host: 5xx, 429, streams that carried an error event, and
    # requests aborted, cut short or never answered, over the requests that ended, in the
    # last FAILED_S.
    failed_ratio: float
    p50_ms: float  # time to first byte; NaN: no answer in the window
    p95_ms: float
    p99_ms: float
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    # The median gap between a stream's tokens over the last PACE_S: the decode pace now.
    # The window's percentiles lag a change: its P50 moves once half the window's tokens
    # come at the new pace, and a slowed server yields fewer of them.
    pace_ms: float
    waiting: int
    running: int
    tokens_per_s: float
    output_tokens: int  # since the probes started
    window_tokens: int  # output tokens in the window
    mean_in_flight: float  # requests in flight on average over the window, embeddings aside
    # Over the answers that ended in the window, their end seen: output tokens and time in
    # the server (first byte to last), summed; embeddings aside.
    e2e_tokens: int
    e2e_s: float

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running

    @property
    def ttft_p99_ms(self) -> float:
        return self.ttft.p99

    @property
    def itl_p99_ms(self) -> float:
        return self.itl.p99


@dataclass(frozen=True)
class LatencyCounts:
    """One model's and endpoint's histogram of one kind since the probes started, all
    serving ports and statuses together, at the bounds latency_counts() was asked for."""

    model: str
    endpoint: str
    cumulative: tuple[int, ...]  # samples under each bound's nearest bucket edge
    count: int
    sum_s: float  # from bucket midpoints: within 1/32 of the true sum


@dataclass(frozen=True)
class _Interval:
    """Deltas between two polls."""

    start: float
    end: float
    hist: Mapping[HistKey, int]
    requests: Mapping[EndpointKey, RequestStats]
    ports: Mapping[int, PortStats]
    flight: Mapping[tuple[int, int], int]  # (model, port) -> in flight at the end, sampled
    # (model, port) -> [5xx and 429 answers, answers, ends not complete, ends], over the
    # endpoints that count toward the load: summed once here, read by every poll of the
    # next FAILED_S.
    outcomes: Mapping[tuple[int, int], list[int]]


@dataclass
class _State:
    summary: dict[str, Any]  # the report without its flows
    models: tuple[ModelStats, ...]
    names: Mapping[int, str]
    histograms: Mapping[HistKey, int]  # the kernel's, since the start
    report: tuple[bytes, ...] | None = None  # summary and flows as JSON, built on first use


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


def _percentiles(counts: Mapping[int, int]) -> Percentiles:
    if not counts:
        return _NONE
    return Percentiles(*(_ms(buckets.percentile(counts, q)) for _, q in QUANTILES))


def _add(target: dict[Any, int], key: Any, n: int) -> None:
    v = target.get(key, 0) + n
    if v:
        target[key] = v
    else:
        target.pop(key, None)


def counts_toward_load(key: EndpointKey) -> bool:
    """Whether a (model, port, endpoint)'s requests are inference, part of the node's
    load: the OpenAI endpoints and TGI's, and any other path whose body named a model.
    Requests of neither kind (a scrape of the server's /metrics, a health check, a model
    listing) never wait on a GPU."""
    model, _port, endpoint = key
    return endpoint != EP_OTHER or model != NO_MODEL


class _Figures:
    """Per (model, port, endpoint): the window's sums and the totals since the start."""

    def __init__(self) -> None:
        self.status: dict[int, int] = {}  # since the start
        self.outcomes = [0] * len(OUTCOMES)  # since the start
        self.events = 0  # data: events since the start
        self.usage = RequestStats()  # since the start
        self.window_status: dict[int, int] = {}
        self.window_hist: list[dict[int, int]] = [{} for _ in KINDS]  # kind -> bucket -> n
        self.window_outcomes = [0] * len(OUTCOMES)  # "error": a stream that carried one
        self.window_tokens = 0
        self.window_e2e_tokens = 0  # of the answers that ended in the window, timed
        self.window_e2e_ns = 0

    @property
    def output_tokens(self) -> int:
        return self.events + self.usage.output_tokens - self.usage.usage_events


def _tokens_of(stats: RequestStats) -> int:
    return stats.output_tokens - stats.usage_events


class FingerprintReader:
    def __init__(self, probes: MapSource, window_s: float = 10.0, *,
                 flow_idle_s: float = 30.0) -> None:
        if window_s <= 0 or flow_idle_s <= 0:
            raise ValueError("window_s and flow_idle_s must be positive")
        self._probes = probes
        self.window_s = window_s
        self.flow_idle_s = flow_idle_s
        self._last_poll = time.monotonic()
        self._prev_hist: dict[HistKey, int] = {}
        self._prev_requests: dict[EndpointKey, RequestStats] = {}
        self._prev_ports: dict[int, PortStats] = {}
        self._figures: dict[EndpointKey, _Figures] = {}
        self._window: deque[_Interval] = deque()
        self._window_ports: dict[int, list[int]] = {}
        self._window_flight: dict[tuple[int, int], float] = {}  # (model, port) -> sum n dt
        empty = MapSnapshot(mono_ns=time.monotonic_ns())
        self._state = _State(self._summary(empty, (), []), (), MappingProxyType({}),
                             MappingProxyType({}))

    def poll(self, now: float) -> None:
        """Reads the maps and publishes new figures. now: time.monotonic() seconds.
        Blocking (map reads); call it from one worker thread at a time. The flow table is
        not read: its rows are for a dump only, and the kernel expires them (LRU)."""
        snap = self._probes.read_maps(with_flows=False)
        self._push(self._absorb(snap, now))
        while self._window and self._window[0].end <= now - self.window_s:
            self._pop()
        models = self._model_stats(snap)
        self._state = _State(self._summary(snap, models, self._rows(snap)), models,
                             MappingProxyType(dict(snap.models)),
                             MappingProxyType(snap.histograms))

    def summary(self) -> dict[str, Any]:
        """The fingerprint report without its flows (JSON-ready, cheap). Shared: callers must
        not modify it."""
        return self._state.summary

    def report_json(self) -> tuple[bytes, ...]:
        """The whole fingerprint report as JSON, in parts to be written one after another:
        the summary and a row per flow answered in the last flow_idle_s. Built on the
        first call after a poll, in the caller's thread (not on the event loop): the flow
        table is read then, and only then."""
        state = self._state
        if state.report is None:
            mono_ns, flows = self._probes.read_flows(self.flow_idle_s)
            wall_at_mono = time.time() - mono_ns / 1e9
            summary = json.dumps({**state.summary, "flow_count": len(flows)}, separators=(",", ":"))
            # Rows joined a thousand at a time (150 KB) and never into one: with a hundred
            # thousand rows (16 MB) one join, or one copy, holds the GIL for 5-10 ms, where
            # the event loop must not wait more than 5.
            parts = [f'{summary[:-1]},"flows":['.encode()]
            batch: list[str] = []
            for row in _flow_rows(flows, state.names, wall_at_mono):
                batch.append(row)
                if len(batch) == YIELD_EVERY:
                    parts.append(",".join(batch).encode() + b",")
                    batch = []
            if batch:
                parts.append(",".join(batch).encode())
            elif len(parts) > 1:
                parts[-1] = parts[-1][:-1]  # the last batch's comma
            parts.append(b"]}")
            state.report = tuple(parts)
        return state.report

    def model_stats(self) -> tuple[ModelStats, ...]:
        """Figures per (model, serving port), for the load snapshot."""
        return self._state.models

    def model_names(self) -> Mapping[int, str]:
        """model_id -> name of every model the probes have seen."""
        return self._state.names

    def latency_counts(self, kind: str,
                       bounds_s: Sequence[float]) -> tuple[LatencyCounts, ...]:
        """Per model and endpoint, by name, since the probes started: how many samples of
        one kind ("ttfb", "ttft", "itl", "e2e") came within each of bounds_s (ascending,
        in seconds), each bound taken at its nearest bucket edge (nearest_edge_ns). For a
        Prometheus histogram; cheap enough to call from the event loop on each scrape
        (one pass over the histogram entries in use)."""
        state = self._state
        k = KINDS.index(kind)
        edges = [nearest_edge_ns(b * 1e9) for b in bounds_s]
        per_bound: dict[tuple[int, int], list[int]] = {}  # -> samples first counted at bound i
        sums: dict[tuple[int, int], float] = {}
        for (model, _port, endpoint, hk, _status, bucket), n in state.histograms.items():
            if hk != k:
                continue
            # A bucket is under an edge when its last value is: the first such bound is
            # where it starts to count; the final slot holds buckets above every bound.
            first = bisect_left(edges, buckets.bounds(bucket)[1])
            key = (model, endpoint)
            slots = per_bound.setdefault(key, [0] * (len(edges) + 1))
            slots[first] += n
            sums[key] = sums.get(key, 0.0) + buckets.midpoint(bucket) * n
        out = []
        for key, slots in per_bound.items():
            running, cumulative = 0, []
            for n in slots[:-1]:
                running += n
                cumulative.append(running)
            out.append(LatencyCounts(model_name(key[0], state.names), ENDPOINTS[key[1]],
                                     tuple(cumulative), running + slots[-1], sums[key] / 1e9))
        return tuple(sorted(out, key=lambda c: (c.model, c.endpoint)))

    # ---- inside poll ----

    def _absorb(self, snap: MapSnapshot, now: float) -> _Interval:
        hist: dict[HistKey, int] = {}
        prev = self._prev_hist
        for key, count in snap.histograms.items():
            d = _delta(count, prev.get(key, 0))
            if d > 0:
                hist[key] = d
        self._prev_hist = dict(snap.histograms)
        requests: dict[EndpointKey, RequestStats] = {}
        for key, stats in snap.requests.items():
            old = self._prev_requests.get(key, RequestStats())
            d = RequestStats(*(_delta(c, p) for c, p in zip(stats, old)))
            if any(d):
                requests[key] = d
        self._prev_requests = dict(snap.requests)
        ports = {}
        for port, stats in snap.ports.items():
            old = self._prev_ports.get(port, PortStats(0, 0, 0, 0, 0))
            ports[port] = PortStats(*(_delta(c, p) for c, p in zip(stats, old)))
        self._prev_ports = dict(snap.ports)
        flight: dict[tuple[int, int], int] = {}
        for key, f in snap.inflight.items():
            if counts_toward_load(key) and key[2] != EP_EMBEDDINGS:
                flight[key[:2]] = flight.get(key[:2], 0) + f.waiting + f.running
        outcomes: dict[tuple[int, int], list[int]] = {}
        for (model, port, endpoint, kind, status, _bucket), n in hist.items():
            if kind == TTFB and counts_toward_load((model, port, endpoint)):
                acc = outcomes.setdefault((model, port), [0, 0, 0, 0])
                acc[0] += n if status == 429 or 500 <= status <= 599 else 0
                acc[1] += n
        for key, d in requests.items():
            if counts_toward_load(key):
                acc = outcomes.setdefault(key[:2], [0, 0, 0, 0])
                ended = sum(d[:len(OUTCOMES)])
                acc[2] += ended - d[OUT_COMPLETE]
                acc[3] += ended
        start, self._last_poll = self._last_poll, now
        return _Interval(start, now, hist, requests, ports, flight, outcomes)

    def _fig(self, key: EndpointKey) -> _Figures:
        fig = self._figures.get(key)
        if fig is None:
            fig = self._figures[key] = _Figures()
        return fig

    def _apply(self, iv: _Interval, sign: int) -> None:
        """Adds an interval to the window's sums (sign 1) or takes it out (-1); adding
        also counts it in the totals since the start."""
        for (model, port, endpoint, kind, status, bucket), n in iv.hist.items():
            fig = self._fig((model, port, endpoint))
            _add(fig.window_hist[kind], bucket, sign * n)
            if kind == TTFB:
                _add(fig.window_status, status, sign * n)
                if sign > 0:
                    fig.status[status] = fig.status.get(status, 0) + n
            elif kind in (TTFT, ITL):
                fig.window_tokens += sign * n
                if sign > 0:
                    fig.events += n
        for key, d in iv.requests.items():
            fig = self._fig(key)
            fig.window_tokens += sign * _tokens_of(d)
            fig.window_e2e_tokens += sign * d.e2e_tokens
            fig.window_e2e_ns += sign * d.e2e_ns
            for i, n in enumerate(d[:len(OUTCOMES)]):
                fig.window_outcomes[i] += sign * n
                if sign > 0:
                    fig.outcomes[i] += n
            if sign > 0:
                fig.usage = RequestStats(*(a + b for a, b in zip(fig.usage, d)))
        for port, d in iv.ports.items():
            acc = self._window_ports.setdefault(port, [0] * len(PortStats._fields))
            for i, v in enumerate(d):
                acc[i] += sign * v
        dt = iv.end - iv.start
        for key, n in iv.flight.items():
            v = self._window_flight.get(key, 0.0) + sign * n * dt
            if v > 1e-9:
                self._window_flight[key] = v
            else:
                self._window_flight.pop(key, None)

    def _push(self, iv: _Interval) -> None:
        self._window.append(iv)
        self._apply(iv, 1)

    def _pop(self) -> None:
        self._apply(self._window.popleft(), -1)

    def _span(self) -> float:
        """Seconds the window's intervals cover."""
        return max(self._window[-1].end - self._window[0].start, 1e-3) if self._window else 0

    def _recent(self) -> tuple[dict[tuple[int, int], dict[int, int]],
                               dict[tuple[int, int], float]]:
        """Per (model, port), over the endpoints that count toward the load: the
        inter-token gaps of the intervals ending in the last PACE_S, by bucket; and the
        failed ratio of those ending in the last FAILED_S."""
        itl: dict[tuple[int, int], dict[int, int]] = {}
        sums: dict[tuple[int, int], list[int]] = {}
        last = self._window[-1].end if self._window else 0.0
        for iv in reversed(self._window):
            if iv.end <= last - max(PACE_S, FAILED_S):
                break
            for key, counts in iv.outcomes.items() if iv.end > last - FAILED_S else ():
                acc = sums.setdefault(key, [0, 0, 0, 0])
                for i, n in enumerate(counts):
                    acc[i] += n
            for (model, port, endpoint, kind, _status, bucket), n in (
                    iv.hist.items() if iv.end > last - PACE_S else ()):
                if kind == ITL and counts_toward_load((model, port, endpoint)):
                    gaps = itl.setdefault((model, port), {})
                    gaps[bucket] = gaps.get(bucket, 0) + n
        failed = {}
        for key, (bad, answers, unfinished, ended) in sums.items():
            # An answer's status counts at its first byte, its outcome at its end: either
            # can be ahead, and a request never answered has no status at all.
            failed[key] = min(1.0, (bad + unfinished) / max(answers, ended)) if bad + unfinished else 0.0
        return itl, failed

    def _model_stats(self, snap: MapSnapshot) -> tuple[ModelStats, ...]:
        """Per (model, port): the endpoints that count toward the load, together."""
        groups: dict[tuple[int, int], list[EndpointKey]] = {}
        for key in set(self._figures) | set(snap.inflight):
            if counts_toward_load(key):
                groups.setdefault(key[:2], []).append(key)
        span = self._span()
        pace, recent_failed = self._recent()
        out = []
        for (model, port), keys in sorted(groups.items(), key=lambda kv: (
                model_name(kv[0][0], snap.models), kv[0][1])):
            keyed = [(k, self._figures[k]) for k in keys if k in self._figures]
            figs = [f for _, f in keyed]
            timed = [f for k, f in keyed if k[2] != EP_EMBEDDINGS]  # they decode no tokens
            status: dict[int, int] = {}
            window: dict[int, int] = {}
            hist: list[dict[int, int]] = [{} for _ in KINDS]
            errors = tokens = 0
            for f in figs:
                buckets.add_into(status, f.status)
                buckets.add_into(window, f.window_status)
                for kind, counts in enumerate(f.window_hist):
                    buckets.add_into(hist[kind], counts)
                errors += f.window_outcomes[OUT_ERROR]
                tokens += f.window_tokens
            n = sum(window.values())
            fives = sum(c for s, c in window.items() if 500 <= s <= 599)
            flight = [snap.inflight.get(k, InFlight(0, 0)) for k in keys]
            ttfb = _percentiles(hist[TTFB])
            out.append(ModelStats(
                model=model_name(model, snap.models),
                model_id=model,
                port=port,
                requests=sum(status.values()),
                status=MappingProxyType(status),
                rps=n / span if span else 0.0,
                error_ratio=min(1.0, (fives + errors) / n) if n else 0.0,
                ratio_429=window.get(429, 0) / n if n else 0.0,
                failed_ratio=recent_failed.get((model, port), 0.0),
                p50_ms=ttfb.p50,
                p95_ms=ttfb.p95,
                p99_ms=ttfb.p99,
                ttft=_percentiles(hist[TTFT]),
                itl=_percentiles(hist[ITL]),
                e2e=_percentiles(hist[E2E]),
                pace_ms=_percentiles(pace.get((model, port), {})).p50,
                waiting=sum(f.waiting for f in flight),
                running=sum(f.running for f in flight),
                tokens_per_s=max(0.0, tokens / span) if span else 0.0,
                output_tokens=sum(f.output_tokens for f in figs),
                window_tokens=max(0, tokens),
                mean_in_flight=self._window_flight.get((model, port), 0.0) / span if span else 0.0,
                e2e_tokens=max(0, sum(f.window_e2e_tokens for f in timed)),
                e2e_s=max(0, sum(f.window_e2e_ns for f in timed)) / 1e9,
            ))
        return tuple(out)

    def _rows(self, snap: MapSnapshot) -> list[dict[str, Any]]:
        """The report's rows: one per model and endpoint, its serving ports together."""
        groups: dict[tuple[int, int], list[EndpointKey]] = {}
        for key in set(self._figures) | set(snap.inflight):
            groups.setdefault((key[0], key[2]), []).append(key)
        span = self._span()
        rows = []
        for (model, endpoint), keys in groups.items():
            figs = [self._figures[k] for k in keys if k in self._figures]
            status: dict[int, int] = {}
            window: dict[int, int] = {}
            hist: list[dict[int, int]] = [{} for _ in KINDS]
            outcomes = [0] * len(OUTCOMES)
            errors = tokens = 0
            for f in figs:
                buckets.add_into(status, f.status)
                buckets.add_into(window, f.window_status)
                for kind, counts in enumerate(f.window_hist):
                    buckets.add_into(hist[kind], counts)
                outcomes = [a + b for a, b in zip(outcomes, f.outcomes)]
                errors += f.window_outcomes[OUT_ERROR]
                tokens += f.window_tokens
            flight = [snap.inflight.get(k, InFlight(0, 0)) for k in keys]
            waiting = sum(f.waiting for f in flight)
            running = sum(f.running for f in flight)
            n = sum(window.values())
            fives = sum(c for s, c in window.items() if 500 <= s <= 599)
            latency = {kind: _percentiles(hist[i]) for i, kind in enumerate(KINDS)}
            ttfb = latency["ttfb"].json()
            rows.append({
                "model": model_name(model, snap.models),
                "endpoint": ENDPOINTS[endpoint],
                "ports": sorted(k[1] for k in keys),
                "requests": sum(status.values()),
                "status": {str(s): c for s, c in sorted(status.items())},
                "outcomes": dict(zip(OUTCOMES, outcomes)),
                "rps": round(n / span, 3) if span else 0.0,
                "p50_ms": ttfb["p50"],
                "p95_ms": ttfb["p95"],
                "p99_ms": ttfb["p99"],
                "latency": {kind: p.json() for kind, p in latency.items()},
                "error_ratio": round(min(1.0, (fives + errors) / n), 4) if n else 0.0,
                "ratio_429": round(window.get(429, 0) / n, 4) if n else 0.0,
                "inflight": waiting + running,
                "waiting": waiting,
                "running": running,
                "aborted": outcomes[OUTCOMES.index("aborted")],
                "output_tokens": sum(f.output_tokens for f in figs),
                "prompt_tokens": sum(f.usage.prompt_tokens for f in figs),
                "tokens_per_s": round(max(0.0, tokens / span), 3) if span else 0.0,
            })
        return sorted(rows, key=lambda r: (r["model"], r["endpoint"]))

    def _port_rates(self) -> dict[int, dict[str, float]]:
        span = self._span()
        if not span:
            return {}
        return {port: {f"{f}_per_s": round(v / span, 3) for f, v in zip(PortStats._fields, acc)}
                for port, acc in self._window_ports.items()}

    def _summary(self, snap: MapSnapshot, models: tuple[ModelStats, ...],
                 rows: list[dict[str, Any]]) -> dict[str, Any]:
        rates = self._port_rates()
        return {
            "window_s": self.window_s,
            "models": rows,
            "errors": dict(snap.errors),
            "tcp": {str(port): {**stats._asdict(), **rates.get(port, {})}
                    for port, stats in sorted(snap.ports.items())},
        }


def _flow_rows(flows: FlowTable, model_names: Mapping[int, str], wall_at_mono: float) -> Iterator[str]:
    """One JSON object per flow (addresses and numbers need no escaping, names do)."""
    names: dict[int, str] = {}
    for key, count, lat_sum, lat_max, last in flows.rows():
        client, client_port, server, server_port, model_id, status = key
        name = names.get(model_id)
        if name is None:
            name = names[model_id] = json.dumps(model_name(model_id, model_names))
        mean = repr(lat_sum / count / 1e6) if count else "null"
        yield (f'{{"src":"{format_endpoint(client, client_port)}",'
               f'"dst":"{format_endpoint(server, server_port)}","model":{name},'
               f'"status":{status},"count":{count},"mean_ms":{mean},'
               f'"max_ms":{lat_max / 1e6!r},"last_seen":{wall_at_mono + last / 1e9!r}}}')

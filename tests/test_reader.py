"""FingerprintReader logic on fake map snapshots: deltas, window, ratios, percentiles,
report format, flow expiry, snapshot consistency."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest

from loadmesh.probes import FingerprintReader, abi, buckets
from loadmesh.probes.maps import (YIELD_EVERY, FlowKey, FlowTable, InFlight, MapSnapshot, PortStats,
                         RequestStats, ip_bytes)
from loadmesh.model_id import model_id
from loadmesh.probes.reader import FAILED_S

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-7B"
L, Q = model_id(LLAMA), model_id(QWEN)
MS = 1_000_000
TTFB, TTFT, ITL, E2E = (abi.const(f"LM_HK_{k}") for k in ("TTFB", "TTFT", "ITL", "E2E"))
CHAT, EMBEDDINGS, OTHER = (abi.const(f"LM_EP_{k}") for k in ("CHAT", "EMBEDDINGS", "OTHER"))


class FakeProbes:
    """A MapSource whose maps the test sets directly."""

    def __init__(self) -> None:
        self.mono_ns = 10**12
        self.hist: dict[tuple[int, int, int, int, int, int], int] = {}
        self.requests: dict[tuple[int, int, int], RequestStats] = {}
        self.flows: dict[FlowKey, tuple[int, int, int, int]] = {}
        self.models = {L: LLAMA, Q: QWEN}
        self.errors = {"fp_full": 0, "scan_gave_up": 0}
        self.ports: dict[int, PortStats] = {}
        self.inflight: dict[tuple[int, int, int], InFlight] = {}

    def add(self, model: int, status: int, latency_ms: float, n: int = 1,
            port: int = 8000, kind: int = TTFB, endpoint: int = CHAT) -> None:
        key = (model, port, endpoint, kind, status, buckets.index(int(latency_ms * MS)))
        self.hist[key] = self.hist.get(key, 0) + n

    def ended(self, model: int, port: int = 8000, endpoint: int = CHAT, **counts: int) -> None:
        key = (model, port, endpoint)
        old = self.requests.get(key, RequestStats())
        self.requests[key] = old._replace(**{k: getattr(old, k) + v for k, v in counts.items()})

    def read_maps(self, with_flows: bool = True) -> MapSnapshot:
        return MapSnapshot(mono_ns=self.mono_ns,
                           flows=FlowTable.of(self.flows) if with_flows else None,
                           histograms=dict(self.hist), requests=dict(self.requests),
                           models=dict(self.models), errors=dict(self.errors),
                           ports=dict(self.ports), inflight=dict(self.inflight))

    def read_flows(self, idle_s: float) -> tuple[int, FlowTable]:
        since = self.mono_ns - int(idle_s * 1e9)
        return self.mono_ns, FlowTable.of({k: v for k, v in self.flows.items() if v[3] >= since})


def report(r: FingerprintReader) -> dict[str, Any]:
    return json.loads(b"".join(r.report_json()))


def model(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in report["models"] if m["model"] == name)


@pytest.fixture
def fake() -> FakeProbes:
    return FakeProbes()


def test_first_poll_counts_everything_since_the_probes_started(fake: FakeProbes) -> None:
    fake.add(L, 200, 40, n=7)
    fake.add(L, 503, 10, n=3)
    r = FingerprintReader(fake)
    r.poll(time.monotonic())
    m = model(report(r), LLAMA)
    assert m["requests"] == 10
    assert m["status"] == {"200": 7, "503": 3}


def test_polls_turn_cumulative_counters_into_deltas(fake: FakeProbes) -> None:
    r = FingerprintReader(fake, window_s=10)
    t = time.monotonic()
    fake.add(L, 200, 40, n=5)
    r.poll(t)
    fake.add(L, 200, 40, n=20)
    fake.add(L, 429, 1, n=5)
    r.poll(t + 1)
    (stats,) = r.model_stats()
    assert stats.requests == 30
    assert dict(stats.status) == {200: 25, 429: 5}
    assert stats.ratio_429 == pytest.approx(5 / 30)
    assert stats.error_ratio == 0


def test_rates_and_ratios_cover_the_window_only(fake: FakeProbes) -> None:
    r = FingerprintReader(fake, window_s=10)
    t0 = time.monotonic()
    r.poll(t0)  # baseline: nothing yet
    fake.add(L, 500, 30, n=50)  # errors, long ago
    r.poll(t0 + 1)
    for i in range(2, 30):
        fake.add(L, 200, 30, n=10)
        r.poll(t0 + i)
    (stats,) = r.model_stats()
    assert stats.requests == 50 + 28 * 10
    assert stats.error_ratio == 0  # the 5xx interval left the window
    assert stats.rps == pytest.approx(10.0, rel=0.01)
    assert dict(stats.status)[500] == 50  # totals keep them


def test_percentiles_come_from_the_window_histograms(fake: FakeProbes) -> None:
    r = FingerprintReader(fake, window_s=10)
    t = time.monotonic()
    r.poll(t)
    for ms in range(1, 101):  # 1..100 ms, one each
        fake.add(Q, 200, ms)
    r.poll(t + 1)
    m = model(report(r), QWEN)
    assert m["p50_ms"] == pytest.approx(50, rel=1 / 32)
    assert m["p95_ms"] == pytest.approx(95, rel=1 / 32)
    assert m["p99_ms"] == pytest.approx(99, rel=1 / 32)


def test_no_responses_in_the_window_means_no_percentiles(fake: FakeProbes) -> None:
    r = FingerprintReader(fake, window_s=5)
    t = time.monotonic()
    fake.add(L, 200, 20)
    r.poll(t)
    r.poll(t + 10)
    r.poll(t + 20)
    m = model(report(r), LLAMA)
    assert m["p99_ms"] is None and m["rps"] == 0 and m["requests"] == 1
    (stats,) = r.model_stats()
    assert math.isnan(stats.p99_ms) and stats.rps == 0


def test_a_model_on_two_ports(fake: FakeProbes) -> None:
    r = FingerprintReader(fake, window_s=10)
    t = time.monotonic()
    r.poll(t)
    fake.add(L, 200, 10, n=90, port=8000)
    fake.add(L, 503, 200, n=10, port=8001)
    fake.inflight = {(L, 8000, CHAT): InFlight(1, 2), (L, 8001, CHAT): InFlight(1, 0)}
    r.poll(t + 1)
    by_port = {m.port: m for m in r.model_stats()}
    assert (by_port[8000].requests, by_port[8001].requests) == (90, 10)
    assert (by_port[8000].error_ratio, by_port[8001].error_ratio) == (0, 1)
    assert by_port[8001].p50_ms == pytest.approx(200, rel=1 / 32)
    assert (by_port[8000].in_flight, by_port[8001].in_flight) == (3, 1)
    row = model(report(r), LLAMA)
    assert row["ports"] == [8000, 8001] and row["inflight"] == 4
    assert row["requests"] == 100 and row["status"] == {"200": 90, "503": 10}
    assert row["error_ratio"] == pytest.approx(0.1)
    assert row["p50_ms"] == pytest.approx(10, rel=1 / 32)  # both ports' latencies merged
    assert row["p99_ms"] == pytest.approx(200, rel=1 / 32)
    assert r.model_names()[L] == LLAMA


def test_inflight_and_unnamed_models(fake: FakeProbes) -> None:
    unknown = model_id("not-in-the-map")
    fake.inflight = {(L, 8000, CHAT): InFlight(4, 0), (0, 8000, CHAT): InFlight(2, 0),
                     (unknown, 8000, CHAT): InFlight(0, 1)}
    r = FingerprintReader(fake)
    r.poll(time.monotonic())
    rep = report(r)
    assert model(rep, LLAMA)["inflight"] == 4
    assert model(rep, "-")["inflight"] == 2
    assert model(rep, f"#{unknown:016x}")["inflight"] == 1


def test_counter_reset_counts_the_new_value(fake: FakeProbes) -> None:
    r = FingerprintReader(fake)
    t = time.monotonic()
    fake.add(L, 200, 5, n=10)
    r.poll(t)
    fake.hist = {}
    fake.add(L, 200, 5, n=3)  # the entry was re-created from zero
    r.poll(t + 1)
    assert r.model_stats()[0].requests == 13


def test_report_keys_and_json(fake: FakeProbes) -> None:
    client, server = ip_bytes("10.0.0.1"), ip_bytes("fd00::2")
    fake.flows = {
        (client, 40000, ip_bytes("10.0.0.2"), 8000, L, 200): (4, 400 * MS, 150 * MS,
                                                              fake.mono_ns),
        (ip_bytes("fd00::1"), 40001, server, 8000, 0, 404): (1, 2 * MS, 2 * MS, fake.mono_ns),
    }
    fake.add(L, 200, 100, n=4)
    fake.ports = {8000: PortStats(3, 0, 1, 0, 2)}
    fake.errors["scan_gave_up"] = 2
    r = FingerprintReader(fake)
    r.poll(time.monotonic())
    rep = report(r)
    m = model(rep, LLAMA)
    assert {"model", "requests", "status", "rps", "p50_ms", "p95_ms", "p99_ms",
            "inflight", "endpoint", "waiting", "running", "aborted", "output_tokens",
            "tokens_per_s", "latency"} <= set(m)
    assert set(m["latency"]) == {"ttfb", "ttft", "itl", "e2e"}
    assert m["latency"]["ttfb"] == {"p50": m["p50_ms"], "p95": m["p95_ms"], "p99": m["p99_ms"]}
    assert m["latency"]["ttft"] == {"p50": None, "p95": None, "p99": None}
    rows = {row["src"]: row for row in rep["flows"]}
    v4 = rows["10.0.0.1:40000"]
    assert (v4["dst"], v4["model"], v4["status"], v4["count"]) == ("10.0.0.2:8000", LLAMA,
                                                                  200, 4)
    assert v4["mean_ms"] == pytest.approx(100) and v4["max_ms"] == pytest.approx(150)
    v6 = rows["[fd00::1]:40001"]
    assert (v6["dst"], v6["model"], v6["status"]) == ("[fd00::2]:8000", "-", 404)
    assert rep["errors"]["scan_gave_up"] == 2
    assert rep["tcp"]["8000"]["conns_accepted"] == 3
    assert rep["tcp"]["8000"]["resets_received"] == 2


def test_idle_flows_leave_the_report_and_polls_never_read_the_flows(fake: FakeProbes) -> None:
    old = (ip_bytes("10.0.0.1"), 1, ip_bytes("10.0.0.2"), 80, L, 200)
    new = (ip_bytes("10.0.0.1"), 2, ip_bytes("10.0.0.2"), 80, L, 200)
    fake.flows = {old: (1, MS, MS, fake.mono_ns - 31 * 10**9),
                  new: (1, MS, MS, fake.mono_ns - 1 * 10**9)}
    reads: list[bool] = []
    read_maps = fake.read_maps
    fake.read_maps = lambda with_flows=True: reads.append(with_flows) or read_maps(with_flows)  # type: ignore[method-assign]
    r = FingerprintReader(fake, flow_idle_s=30)
    for _ in range(8):
        r.poll(time.monotonic())
    assert reads == [False] * 8  # the kernel expires rows (LRU); a poll costs no flow
    rep = report(r)
    assert [row["src"] for row in rep["flows"]] == ["10.0.0.1:2"] and rep["flow_count"] == 1


@pytest.mark.parametrize("flows", [0, 1, YIELD_EVERY, 2 * YIELD_EVERY + 1])
def test_a_report_of_many_flows_is_whole_json_in_parts_of_a_thousand_rows(
        fake: FakeProbes, flows: int) -> None:
    fake.flows = {(ip_bytes("10.0.0.1"), 1024 + i, ip_bytes("10.0.0.2"), 8000, L, 200):
                  (1, MS, MS, fake.mono_ns) for i in range(flows)}
    r = FingerprintReader(fake)
    r.poll(time.monotonic())
    parts = r.report_json()
    assert len(parts) == 2 + -(-flows // YIELD_EVERY)  # head, row batches, closing
    rep = json.loads(b"".join(parts))
    assert rep["flow_count"] == flows
    assert sorted(row["src"] for row in rep["flows"]) == sorted(
        f"10.0.0.1:{1024 + i}" for i in range(flows))


def test_report_is_an_immutable_snapshot_swapped_by_poll(fake: FakeProbes) -> None:
    r = FingerprintReader(fake)
    t = time.monotonic()
    fake.add(L, 200, 5, n=1)
    r.poll(t)
    summary, before = r.summary(), r.report_json()
    summary_json = json.dumps(summary, sort_keys=True)
    assert r.report_json() is before  # built once per poll
    fake.add(L, 200, 5, n=1)
    r.poll(t + 1)
    assert r.summary() is not summary
    assert json.dumps(summary, sort_keys=True) == summary_json  # the old state is intact
    assert model(json.loads(b"".join(before)), LLAMA)["requests"] == 1
    assert model(report(r), LLAMA)["requests"] == 2


def test_flow_rows_escape_model_names_and_survive_odd_figures(fake: FakeProbes) -> None:
    odd = 'we"ird\\name\n'
    fake.models[model_id(odd)] = odd
    flow = (ip_bytes("fd00::1"), 40000, ip_bytes("fd00::2"), 8000, model_id(odd), 200)
    never = (ip_bytes("10.0.0.1"), 1, ip_bytes("10.0.0.2"), 8000, 0, 0)
    fake.flows = {flow: (3, 3 * MS, 2 * MS, fake.mono_ns), never: (0, 0, 0, fake.mono_ns)}
    r = FingerprintReader(fake)
    r.poll(time.monotonic())
    rows = {row["src"]: row for row in report(r)["flows"]}
    assert rows["[fd00::1]:40000"]["model"] == odd
    assert rows["[fd00::1]:40000"]["mean_ms"] == 1.0
    assert rows["10.0.0.1:1"]["mean_ms"] is None and rows["10.0.0.1:1"]["model"] == "-"
    assert report(r)["flow_count"] == 2


def test_report_before_the_first_poll_is_empty_but_well_formed(fake: FakeProbes) -> None:
    rep = report(FingerprintReader(fake))
    assert rep["models"] == [] and rep["flows"] == []


def test_rejects_a_non_positive_window(fake: FakeProbes) -> None:
    with pytest.raises(ValueError):
        FingerprintReader(fake, window_s=0)


def test_latencies_of_each_kind_and_tokens_from_events_and_usage(fake: FakeProbes) -> None:
    r = FingerprintReader(fake, window_s=10)
    t = time.monotonic()
    r.poll(t)
    # two streams: time to first byte 5 ms (their heads), first token 300 ms, 9 events
    # each after it 20 ms apart; the first stream's usage said 12 tokens, not 10
    fake.add(L, 200, 5, n=2)
    fake.add(L, 200, 300, n=2, kind=TTFT)
    fake.add(L, 200, 20, n=18, kind=ITL)
    fake.add(L, 200, 500, n=2, kind=E2E)
    fake.ended(L, complete=2, usage_answers=1, usage_events=10, output_tokens=12)
    r.poll(t + 1)
    (stats,) = r.model_stats()
    assert stats.p99_ms == pytest.approx(5, rel=1 / 32)
    assert stats.ttft.p99 == pytest.approx(300, rel=1 / 32)
    assert stats.itl.p50 == pytest.approx(20, rel=1 / 32)
    assert stats.e2e.p99 == pytest.approx(500, rel=1 / 32)
    assert stats.output_tokens == 22 and stats.window_tokens == 22
    assert stats.tokens_per_s == pytest.approx(22.0, rel=1e-3)
    row = model(report(r), LLAMA)
    assert row["output_tokens"] == 22 and row["outcomes"]["complete"] == 2


def test_waiting_running_and_their_mean_over_the_window(fake: FakeProbes) -> None:
    r = FingerprintReader(fake, window_s=10)
    t = time.monotonic()
    r.poll(t)
    fake.inflight = {(L, 8000, CHAT): InFlight(6, 8), (L, 8000, EMBEDDINGS): InFlight(3, 0)}
    r.poll(t + 1)
    fake.inflight = {(L, 8000, CHAT): InFlight(0, 2)}
    r.poll(t + 2)
    (stats,) = r.model_stats()
    assert (stats.waiting, stats.running, stats.in_flight) == (0, 2, 2)
    # 14 generating for a second, then 2 (embeddings queue no tokens: left out)
    assert stats.mean_in_flight == pytest.approx(8.0, rel=1e-3)
    rows = {row["endpoint"]: row for row in report(r)["models"]}
    assert (rows["chat"]["waiting"], rows["chat"]["running"]) == (0, 2)
    assert "embeddings" not in rows  # no answer yet, nothing in flight now


def test_scrapes_and_health_checks_stay_out_of_the_load(fake: FakeProbes) -> None:
    """GETs of the server's /metrics or /health: endpoint "other", no model."""
    r = FingerprintReader(fake)
    fake.add(0, 200, 3, n=40, endpoint=OTHER)
    fake.add(L, 200, 100, n=2)
    fake.add(Q, 200, 50, n=1, endpoint=OTHER)  # an unknown path whose body named a model
    r.poll(time.monotonic())
    assert sorted(m.model for m in r.model_stats()) == sorted([LLAMA, QWEN])
    rows = {(row["model"], row["endpoint"]) for row in report(r)["models"]}
    assert rows == {("-", "other"), (LLAMA, "chat"), (QWEN, "other")}


def test_outcomes_and_aborts_are_counted_under_their_model(fake: FakeProbes) -> None:
    r = FingerprintReader(fake)
    fake.add(L, 200, 10, n=3)
    fake.ended(L, complete=1, error=1, aborted=1)
    fake.ended(L, aborted=2)  # timed out before any answer: no latency sample
    r.poll(time.monotonic())
    row = model(report(r), LLAMA)
    assert row["aborted"] == 3
    assert row["outcomes"] == {"complete": 1, "error": 1, "aborted": 3, "truncated": 0,
                               "unanswered": 0}
    assert row["error_ratio"] == pytest.approx(1 / 3, abs=1e-4)  # a stream error of 3 answers


def test_failed_ratio_counts_429s_aborts_and_the_unanswered_against_the_host(fake: FakeProbes) -> None:
    """What the snapshot gossips as the model's error ratio: fast 429s and requests the
    host did not see through count, so a rejecting host never looks quick and healthy."""
    r = FingerprintReader(fake, window_s=10)
    t = time.monotonic()
    r.poll(t)
    fake.add(L, 200, 40, n=6)
    fake.add(L, 429, 1, n=2)
    fake.add(L, 503, 1, n=1)
    fake.ended(L, complete=9)
    fake.ended(L, aborted=1, unanswered=1, truncated=1)  # no status line for two of them
    r.poll(t + 1)
    (stats,) = r.model_stats()
    assert stats.error_ratio == pytest.approx(1 / 9)  # 5xx and stream errors only
    assert stats.ratio_429 == pytest.approx(2 / 9)
    assert stats.failed_ratio == pytest.approx(6 / 12)
    for i in range(2, 13):
        fake.add(L, 200, 40, n=10)
        fake.ended(L, complete=10)
        r.poll(t + i)
    (stats,) = r.model_stats()
    assert stats.failed_ratio == 0  # the failures left the window


def test_a_host_that_stopped_failing_is_clear_after_a_few_seconds_without_traffic(
        fake: FakeProbes) -> None:
    """Priced by its failures, a recovered host gets next to no traffic, so a ratio over
    the whole window would keep it priced out until the window turns: the failed ratio
    covers the last FAILED_S, while the window's 429s still show in the status counts."""
    r = FingerprintReader(fake, window_s=10)
    t = time.monotonic()
    r.poll(t)
    for i in range(1, 5):
        fake.add(L, 429, 1, n=10)
        fake.ended(L, complete=10)
        r.poll(t + i * 0.5)
    assert r.model_stats()[0].failed_ratio == 1.0
    fake.add(L, 200, 40, n=1)
    fake.ended(L, complete=1)
    r.poll(t + 2.5)
    assert r.model_stats()[0].failed_ratio == pytest.approx(40 / 41)
    for i in range(6, 6 + round(FAILED_S / 0.5)):
        r.poll(t + i * 0.5)
    (stats,) = r.model_stats()
    assert stats.failed_ratio == 0
    assert stats.ratio_429 > 0.9  # still in the window


def test_pace_is_the_median_token_gap_of_the_last_second(fake: FakeProbes) -> None:
    """The window's percentiles hold 10 s of a fast past; the pace follows a slowdown
    within a second, even though a slowed server yields fewer tokens."""
    r = FingerprintReader(fake, window_s=10)
    t = time.monotonic()
    r.poll(t)
    for i in range(1, 9):
        fake.add(L, 200, 20, n=400, kind=ITL)
        r.poll(t + i * 0.25)
    (stats,) = r.model_stats()
    assert stats.pace_ms == pytest.approx(20, rel=0.04)
    for i in range(9, 13):
        fake.add(L, 200, 80, n=100, kind=ITL)  # a quarter of the tokens, at 4x the gap
        r.poll(t + i * 0.25)
    (stats,) = r.model_stats()
    assert stats.pace_ms == pytest.approx(80, rel=0.04)
    assert stats.itl.p50 == pytest.approx(20, rel=0.04)  # the window still says fast
    for i in range(13, 18):
        r.poll(t + i * 0.25)  # a second without a stream: no pace
    assert math.isnan(r.model_stats()[0].pace_ms)


def test_time_in_the_server_of_the_answers_that_ended_in_the_window(fake: FakeProbes) -> None:
    """The queue's rate: the ended answers' tokens over their summed first-to-last-byte
    times, per (model, port), embeddings left out, and gone with the window."""
    r = FingerprintReader(fake, window_s=2)
    t = time.monotonic()
    r.poll(t)
    fake.ended(L, complete=3, e2e_ns=3 * 1_500 * MS, e2e_tokens=192)
    fake.ended(L, endpoint=EMBEDDINGS, complete=5, e2e_ns=5 * 40 * MS)
    r.poll(t + 1)
    (stats,) = r.model_stats()
    assert (stats.e2e_tokens, stats.e2e_s) == (192, pytest.approx(4.5))
    for i in range(2, 5):
        r.poll(t + i)
    (stats,) = r.model_stats()
    assert (stats.e2e_tokens, stats.e2e_s) == (0, 0.0)

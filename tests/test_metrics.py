"""The Prometheus exporter: histogram bounds from the eBPF buckets, every family from the
agent's own state with the right units, promtool on real scrapes, the HTTP side."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

import nettopo
from conftest import agent_config
from loadmesh.daemon.client import ApiError, Client
from loadmesh.daemon.collectors.gpu import GpuInfo
from loadmesh.daemon.health import Health, HealthState
from loadmesh.daemon.metrics import E2E_BUCKETS_S, ITL_BUCKETS_S, TTFT_BUCKETS_S, AgentCollector
from loadmesh.gossip.membership import PeerState
from loadmesh.gossip.protocol import PeerRow
from loadmesh.gossip.snapshot import Endpoint, GpuLoad, HostLoad, LoadSnapshot, ModelLoad, NodeState
from metrics_helpers import free_port, metrics_config, samples, scrape, value, wait_for
from loadmesh.probes import abi, buckets
from loadmesh.probes.maps import FlowTable, MapSnapshot
from loadmesh.model_id import model_id
from loadmesh.probes.reader import FingerprintReader, nearest_edge_ns

MS = 1_000_000
TTFB, E2E = abi.const("LM_HK_TTFB"), abi.const("LM_HK_E2E")
CHAT = abi.const("LM_EP_CHAT")
LES = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75",
       "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0"]


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package (scripts/setup.sh)"
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


class Maps:
    """A MapSource holding given histogram counts (model, port, endpoint, kind, status,
    bucket) -> n."""

    def __init__(self, hist: dict[tuple[int, int, int, int, int, int], int],
                 names: dict[int, str]) -> None:
        self.hist, self.names = hist, names

    def read_maps(self, with_flows: bool = True) -> MapSnapshot:
        return MapSnapshot(mono_ns=time.monotonic_ns(), histograms=dict(self.hist),
                           models=dict(self.names))

    def read_flows(self, idle_s: float) -> tuple[int, FlowTable]:
        return time.monotonic_ns(), FlowTable.of({})


def test_each_bound_moves_to_the_nearest_bucket_edge_at_most_1_in_32_away() -> None:
    for bound_ns in [*range(1, 5000, 7), *range(10**6, 10**12, 10**9 + 12345)]:
        edge = nearest_edge_ns(bound_ns)
        assert abs(edge - bound_ns) <= bound_ns / 32
        assert edge == buckets.bounds(buckets.index(edge))[0]  # a real edge
    assert nearest_edge_ns(0.001e9) == 1_015_808  # 1 ms sits in a bucket 983,040..1,015,807
    assert nearest_edge_ns(2560e9) == 1 << buckets.MAX_EXP  # beyond the range: everything


def test_latency_counts_are_cumulative_per_model_at_the_edges() -> None:
    llama, qwen = model_id("llama"), model_id("qwen")

    hist: dict[tuple[int, int, int, int, int, int], int] = {}

    def at(model: int, ns: int, n: int, port: int = 8000, status: int = 200,
           kind: int = TTFB) -> None:
        key = (model, port, CHAT, kind, status, buckets.index(ns))
        hist[key] = hist.get(key, 0) + n

    at(llama, 990_000, 2)               # 0.99 ms: under 1 ms
    at(llama, 1_010_000, 1)             # 1.01 ms: above 1 ms, but under its edge (same bucket)
    at(llama, 1_020_000, 1, port=8001)  # 1.02 ms, another port: above the edge
    at(llama, 300 * MS, 3, status=503)
    at(llama, 3000 * 10**9, 1)          # past 2**40 ns: clamped, counted under 2560 s only
    at(qwen, 30 * MS, 5)
    at(qwen, 30 * MS, 9, kind=E2E)  # another kind: another histogram
    reader = FingerprintReader(Maps(hist, {llama: "llama", qwen: "qwen"}))
    reader.poll(time.monotonic())
    got = {c.model: c for c in reader.latency_counts("ttfb", TTFT_BUCKETS_S)}
    assert {c.endpoint for c in got.values()} == {"chat"}
    assert set(got) == {"llama", "qwen"}
    by_le = dict(zip(TTFT_BUCKETS_S, got["llama"].cumulative, strict=True))
    assert by_le[0.001] == 3 and by_le[0.005] == 4
    assert by_le[0.25] == 4 and by_le[0.5] == 7 and by_le[640.0] == 7 and by_le[2560.0] == 8
    assert got["llama"].count == 8
    true_sum = (2 * 0.99e-3 + 1.01e-3 + 1.02e-3 + 3 * 0.3 + ((1 << 40) - 1) / 1e9)
    assert got["llama"].sum_s == pytest.approx(true_sum, rel=1 / 32)
    qwen_le = dict(zip(TTFT_BUCKETS_S, got["qwen"].cumulative, strict=True))
    assert qwen_le[0.02] == 0 and qwen_le[0.04] == 5 and got["qwen"].count == 5
    (e2e,) = reader.latency_counts("e2e", E2E_BUCKETS_S)
    assert (e2e.model, e2e.count) == ("qwen", 9)


def _agent_view() -> SimpleNamespace:
    """An agent as the exporter sees it, every figure known in advance."""
    snap = LoadSnapshot(
        node_id="n1", endpoints=(Endpoint("10.0.0.1", 8000),), version=7, timestamp_ms=1,
        state=NodeState.DEGRADED, score=0.75,
        host=HostLoad(cpu_util=0.5, mem_used_mib=1000, mem_total_mib=4000, load1=1.5,
                      cpu_pressure_pct=12.0),
        gpus=(GpuLoad(0, 97, 2000, 81900, 70, 300, 700, 0, 2, True),
              GpuLoad(1, 0, 0, 0, 0, 0, 0, 0, 0, False)),
        models=(ModelLoad(model_id("llama"), 8000, 5.0, 0.0, 20.0, 40.0, 3,
                          shed_start=0.5, shed_width=0.25),))
    report = {"models": [{"model": "llama", "endpoint": "chat", "status": {"200": 7, "503": 2},
                          "outcomes": {"complete": 8, "aborted": 1}, "output_tokens": 640,
                          "prompt_tokens": 90, "waiting": 2, "running": 1, "inflight": 3}],
              "errors": {"rows_full": 1, "event_cut": 0}}
    bounds = {len(TTFT_BUCKETS_S): "ttft", len(ITL_BUCKETS_S): "itl", len(E2E_BUCKETS_S): "e2e"}

    def latency_counts(kind: str, edges: tuple[float, ...]) -> list[SimpleNamespace]:
        assert bounds[len(edges)] in (kind, "ttft")  # ttfb takes the ttft buckets
        n = {"ttfb": 30, "ttft": 20, "itl": 600, "e2e": 25}[kind]
        return [SimpleNamespace(model="llama", endpoint="chat",
                                cumulative=tuple(range(1, len(edges) + 1)), count=n, sum_s=4.5)]

    peers = [PeerRow("n1", PeerState.ALIVE, 3, 0, ("10.0.0.1", 7946)),
             PeerRow("n2", PeerState.ALIVE, 4, 200, ("10.0.0.2", 7946)),
             PeerRow("n3", PeerState.SUSPECT, 5, 3000, ("10.0.0.3", 7946))]
    counters = {"datagrams_sent": 10, "bytes_sent": 1400, "datagrams_received": 9,
                "bytes_received": 1300, "drop_bad_tag": 4, "pulls_sent": 2,
                "bytes_sent_liveness": 236, "bytes_sent_content": 900}
    component = SimpleNamespace(name="probes", health=lambda: Health(HealthState.DEGRADED, "x"))
    return SimpleNamespace(
        node_id="n1", version="0.1.0", components=[component],
        probes=SimpleNamespace(summary=lambda: report, latency_counts=latency_counts),
        gpu=SimpleNamespace(devices=(GpuInfo(0, "GPU-aaa", "H100"), GpuInfo(1, "GPU-bbb", "H100"))),
        snapshot=SimpleNamespace(current=snap, model_names=lambda: {model_id("llama"): "llama"}),
        gossip=SimpleNamespace(service=SimpleNamespace(peers=lambda: peers, counters=lambda: counters,
                                                       table_bytes=lambda: 4321, probe_delivery=lambda: 0.64)),
        routing=SimpleNamespace(decisions={("routed", "session"): 5, ("no_peer", "unknown_model"): 1},
                                feedback={"ok": 4}, node_id="n1",
                                router=SimpleNamespace(heavy=SimpleNamespace(models=lambda: {
                                    model_id("llama"): {1: "n1", 2: "n2", 3: "n3"}}))),
        reloader=SimpleNamespace(last_ok=False, last_success_s=1700000000.0))


def test_every_family_reads_the_agents_state_in_base_units() -> None:
    registry = CollectorRegistry()
    registry.register(AgentCollector(_agent_view(), 64))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    promtool_check(text)
    s = samples(text)
    assert value(s, "loadmesh_node_info", node_id="n1", version="0.1.0") == 1
    assert value(s, "loadmesh_component_state", component="probes", state="degraded") == 1
    assert value(s, "loadmesh_component_state", component="probes", state="ok") == 0
    assert value(s, "loadmesh_node_load_score") == 0.75
    assert value(s, "loadmesh_node_state", state="degraded") == 1
    assert value(s, "loadmesh_node_state", state="ok") == 0
    assert value(s, "loadmesh_host_cpu_utilization_ratio") == 0.5
    assert value(s, "loadmesh_host_memory_used_bytes") == 1000 * 2**20
    assert value(s, "loadmesh_host_memory_total_bytes") == 4000 * 2**20
    assert value(s, "loadmesh_host_cpu_pressure_ratio") == 0.12
    gpu0 = {"gpu": "0", "uuid": "GPU-aaa"}
    assert value(s, "loadmesh_gpu_info", name="H100", **gpu0) == 1
    assert value(s, "loadmesh_gpu_utilization_ratio", **gpu0) == 0.97
    assert value(s, "loadmesh_gpu_memory_used_bytes", **gpu0) == 2000 * 2**20
    assert value(s, "loadmesh_gpu_memory_total_bytes", **gpu0) == 81900 * 2**20
    assert value(s, "loadmesh_gpu_temperature_celsius", **gpu0) == 70
    assert value(s, "loadmesh_gpu_power_watts", **gpu0) == 300
    assert value(s, "loadmesh_gpu_power_limit_watts", **gpu0) == 700
    # An unhealthy GPU says so, and nothing else: its zeros are not measurements.
    assert value(s, "loadmesh_gpu_healthy", gpu="1", uuid="GPU-bbb") == 0
    assert value(s, "loadmesh_gpu_temperature_celsius", gpu="1", uuid="GPU-bbb") is None
    llama = {"model": "llama", "endpoint": "chat"}
    assert value(s, "loadmesh_requests_total", code="503", **llama) == 2
    assert value(s, "loadmesh_request_outcomes_total", outcome="aborted", **llama) == 1
    assert value(s, "loadmesh_output_tokens_total", **llama) == 640
    assert value(s, "loadmesh_prompt_tokens_total", **llama) == 90
    assert value(s, "loadmesh_requests_waiting", **llama) == 2
    assert value(s, "loadmesh_requests_running", **llama) == 1
    assert value(s, "loadmesh_requests_in_flight", **llama) == 3
    buckets_seen = {dict(labels)["le"]: v for (name, labels), v in s.items()
                    if name == "loadmesh_time_to_first_byte_seconds_bucket"}
    assert buckets_seen == {**dict(zip(LES, range(1, 23), strict=True)), "+Inf": 30}
    assert value(s, "loadmesh_time_to_first_byte_seconds_count", **llama) == 30
    assert value(s, "loadmesh_time_to_first_byte_seconds_sum", **llama) == 4.5
    for family, n, edges in (("time_to_first_token", 20, TTFT_BUCKETS_S),
                             ("inter_token_latency", 600, ITL_BUCKETS_S),
                             ("request_duration", 25, E2E_BUCKETS_S)):
        assert value(s, f"loadmesh_{family}_seconds_count", **llama) == n
        les = {dict(labels)["le"] for (name, labels), _ in s.items()
               if name == f"loadmesh_{family}_seconds_bucket"}
        assert les == {*(str(float(b)) for b in edges), "+Inf"}
    assert value(s, "loadmesh_probe_errors_total", reason="rows_full") == 1
    # Peers are the other nodes: this one is not its own peer.
    assert value(s, "loadmesh_peers", state="alive") == 1
    assert value(s, "loadmesh_peers", state="suspect") == 1
    assert value(s, "loadmesh_peers", state="dead") == 0
    assert value(s, "loadmesh_gossip_table_bytes") == 4321
    assert value(s, "loadmesh_gossip_probe_delivery_ratio") == 0.64
    assert value(s, "loadmesh_gossip_sent_bytes_total") == 1400
    assert value(s, "loadmesh_gossip_datagrams_received_total") == 9
    assert value(s, "loadmesh_gossip_dropped_total", reason="bad_tag") == 4
    assert value(s, "loadmesh_gossip_events_total", event="pulls_sent") == 2
    assert value(s, "loadmesh_gossip_events_total", event="bytes_sent") is None
    assert value(s, "loadmesh_gossip_sent_purpose_bytes_total", purpose="liveness") == 236
    assert value(s, "loadmesh_gossip_events_total", event="bytes_sent_liveness") is None
    assert value(s, "loadmesh_route_decisions_total", outcome="routed", reason="session") == 5
    assert value(s, "loadmesh_route_decisions_total", outcome="no_peer",
                 reason="unknown_model") == 1
    assert value(s, "loadmesh_route_feedback_total", outcome="ok") == 4
    assert value(s, "loadmesh_sessions_passed_on", model="llama") == 0.25
    assert value(s, "loadmesh_heavy_sessions", model="llama", on="self") == 1
    assert value(s, "loadmesh_heavy_sessions", model="llama", on="peers") == 2
    assert value(s, "loadmesh_config_last_reload_successful") == 0


def test_the_documented_bucket_table_matches_the_code() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    for bound in sorted({*TTFT_BUCKETS_S, *ITL_BUCKETS_S, *E2E_BUCKETS_S}):
        edge_s = nearest_edge_ns(bound * 1e9) / 1e9
        assert f"| {bound:g} | {edge_s:.6g} |" in doc, f"docs/operations.md: bound {bound:g}"


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for BPF and netns")
SERVER = [sys.executable, str(Path(__file__).with_name("probe_servers.py"))]


def _post(url: str, model: str, status: int, delay_ms: int) -> None:
    body = json.dumps({"model": model, "messages": []}).encode()
    req = urllib.request.Request(url, body, {"X-Status": str(status), "X-Delay-Ms": str(delay_ms)})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        exc.read()


@needs_root
def test_a_real_scrape_passes_promtool_and_counts_real_traffic(make_agent, run_dir: Path) -> None:
    port = free_port()
    with nettopo.veth_netns() as topo, topo.ns.popen(SERVER + ["--port", "8000"], ready="ready"):
        sock = str(run_dir / "loadmesh.sock")
        probes = f'interfaces = ["{topo.host_if}"]\nports = [8000]\nrequired = true'
        agent = make_agent(agent_config(sock, probes=probes, extra=f'advertise = "{topo.host_v4}"',
                                        metrics=metrics_config(port)))
        agent.start().wait_ready(sock)
        url = f"http://{topo.ns_v4}:8000/v1/completions"
        fast = {"model": "m-fast", "endpoint": "completions"}
        slow = {"model": "m-slow", "endpoint": "completions"}
        for status in [200] * 5 + [503] * 2:
            _post(url, "m-fast", status, 0)
        for _ in range(3):
            _post(url, "m-slow", 200, 300)

        def counted() -> bool:
            s = samples(scrape(port))
            return (value(s, "loadmesh_time_to_first_byte_seconds_count", **fast) == 7
                    and value(s, "loadmesh_time_to_first_byte_seconds_count", **slow) == 3)

        wait_for(counted, what="the probes to count 10 responses")
        with Client(sock) as client:
            assert client.get("/v1/best", model="m-fast")["node_id"] == "test-node"
            with pytest.raises(ApiError):
                client.get("/v1/best", model="m-none")
        text = scrape(port)
        promtool_check(text)
        s = samples(text)
        assert value(s, "loadmesh_requests_total", code="200", **fast) == 5
        assert value(s, "loadmesh_requests_total", code="503", **fast) == 2
        assert value(s, "loadmesh_requests_total", code="200", **slow) == 3
        assert value(s, "loadmesh_request_outcomes_total", outcome="complete", **slow) == 3
        slow_le = {le: value(s, "loadmesh_time_to_first_byte_seconds_bucket", le=le, **slow)
                   for le in ("0.25", "0.5", "+Inf")}
        assert slow_le == {"0.25": 0, "0.5": 3, "+Inf": 3}  # 300 ms: between 0.2517 and 0.5033
        assert value(s, "loadmesh_time_to_first_byte_seconds_bucket", le="0.25", **fast) == 7
        assert value(s, "loadmesh_request_duration_seconds_count", **slow) == 3
        # Three times 300 ms and a little, each taken at its bucket's midpoint (1/32 off at most).
        slow_sum = value(s, "loadmesh_time_to_first_byte_seconds_sum", **slow)
        assert slow_sum is not None and 0.9 * 31 / 32 <= slow_sum < 1.5
        assert value(s, "loadmesh_component_state", component="probes", state="ok") == 1
        assert value(s, "loadmesh_route_decisions_total", outcome="routed",
                     reason="power_of_d_choices") == 1
        assert value(s, "loadmesh_route_decisions_total", outcome="no_peer",
                     reason="unknown_model") == 1
        agent.signal(signal.SIGTERM)
        assert agent.wait_exit() == 0


def test_http_side_keep_alive_errors_off_and_a_taken_port(make_agent, run_dir: Path) -> None:
    port = free_port()
    sock = str(run_dir / "a.sock")
    agent = make_agent(agent_config(sock, metrics=metrics_config(port))).start()
    agent.wait_ready(sock)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for _ in range(2):  # Prometheus keeps its connection: both on one socket
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200 and b"loadmesh_node_info" in resp.read()
        conn.request("GET", "/")
        resp = conn.getresponse()
        assert resp.status == 404 and b"/metrics" in resp.read()
        conn.request("POST", "/metrics", body=b"")
        resp = conn.getresponse()
        assert resp.status == 405 and resp.getheader("Allow") == "GET"
        resp.read()
    finally:
        conn.close()

    # The port is taken (by the first agent): the second runs, without its exporter.
    taken_sock = str(run_dir / "b.sock")
    second = make_agent(agent_config(taken_sock, node_id="second", metrics=metrics_config(port)))
    second.start().wait_ready(taken_sock)
    with Client(taken_sock) as client:
        metrics = client.get("/v1/status")["components"]["metrics"]
    assert metrics["state"] == "degraded" and f"127.0.0.1:{port}" in metrics["reason"]
    serving = {dict(labels)["node_id"] for (name, labels) in samples(scrape(port))
               if name == "loadmesh_node_info"}
    assert serving == {"test-node"}

    off_sock = str(run_dir / "c.sock")
    off = make_agent(agent_config(off_sock, node_id="off", metrics='listen = ""'))
    off.start().wait_ready(off_sock)
    with Client(off_sock) as client:
        assert client.get("/v1/status")["components"]["metrics"] == {
            "state": "off", "reason": "metrics.listen is empty"}

"""The agent in Prometheus terms, read from the components at scrape time.

Nothing here counts on its own: each scrape reads what the components already hold (the
probe reader's latest report and histograms, the published LoadSnapshot, the gossip
core's counters, the routing component's answer counts), so /metrics can never disagree
with the local API. collect() runs on the event loop, the one thread that changes that
state (daemon/metrics_server.py calls it there), so it takes no locks and sees no dict
change size under it.

Names follow the Prometheus conventions: base units (seconds, bytes, ratios of 0..1),
`_total` on counters, prefix loadmesh_. docs/operations.md lists every family.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from loadmesh.daemon.gossip_component import GossipComponent
from loadmesh.daemon.gpu_component import GpuComponent
from loadmesh.daemon.health import Component, HealthState
from loadmesh.daemon.label_cap import OTHER, LabelCap
from loadmesh.daemon.probes_component import ProbesComponent
from loadmesh.daemon.reload import Reloader
from loadmesh.daemon.routing_component import RoutingComponent
from loadmesh.daemon.snapshot_component import SnapshotComponent
from loadmesh.gossip.membership import PeerState
from loadmesh.gossip.snapshot import LoadSnapshot, NodeState

# vLLM's buckets for the same figures (vllm:time_to_first_token_seconds,
# vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds), so that a server's
# own histograms and the wire's can be put side by side bucket for bucket. Time to first
# byte has no vLLM twin: it takes the time-to-first-token buckets.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0)
E2E_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0)

# The latency histograms: kind, family, help, buckets.
_LATENCY = (
    ("ttfb", "loadmesh_time_to_first_byte_seconds",
     "Time from a request's first byte to its answer's first byte on the wire (for a "
     "stream, its head, which vLLM and other Starlette servers send before any token)",
     TTFT_BUCKETS_S),
    ("ttft", "loadmesh_time_to_first_token_seconds",
     "Time from a request's first byte to its stream's first SSE data: event on the wire "
     "(streamed answers only)", TTFT_BUCKETS_S),
    ("itl", "loadmesh_inter_token_latency_seconds",
     "Time between consecutive SSE data: events of a stream on the wire (0 for events "
     "that came in one segment)", ITL_BUCKETS_S),
    ("e2e", "loadmesh_request_duration_seconds",
     "Time from a request's first byte to its answer's last byte on the wire (end of the "
     "chunked body, of Content-Length, or the connection's close)", E2E_BUCKETS_S),
)
_LATENCY_NOTE = (", since the agent started, per model and endpoint. Buckets are vLLM's "
                 "for the same figure; each counts up to the eBPF bucket edge nearest to it, "
                 "at most 1/32 (3.1%) of the bound away; the sum comes from bucket "
                 "midpoints, within 3.1%.")

MIB = 1 << 20

# Gossip core counters with a family of their own; every other counter (pulls, syncs,
# state changes, socket errors) goes to loadmesh_gossip_events_total by name.
_GOSSIP_TRAFFIC = {
    "datagrams_sent": "loadmesh_gossip_datagrams_sent",
    "datagrams_received": "loadmesh_gossip_datagrams_received",
    "bytes_sent": "loadmesh_gossip_sent_bytes",
    "bytes_received": "loadmesh_gossip_received_bytes",
}
_DROP = "drop_"
_SENT_FOR = "bytes_sent_"


class AgentView(Protocol):
    """What the exporter reads from the agent."""

    @property
    def node_id(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def components(self) -> Sequence[Component]: ...
    @property
    def probes(self) -> ProbesComponent: ...
    @property
    def gpu(self) -> GpuComponent: ...
    @property
    def snapshot(self) -> SnapshotComponent: ...
    @property
    def gossip(self) -> GossipComponent: ...
    @property
    def routing(self) -> RoutingComponent: ...
    @property
    def reloader(self) -> Reloader: ...


class AgentCollector(Collector):
    def __init__(self, agent: AgentView, model_labels: int) -> None:
        """model_labels: how many models get series of their own (label_cap.py)."""
        self.agent = agent
        self._model = LabelCap(model_labels)

    def collect(self) -> Iterable[Metric]:
        yield from self._node()
        snap = self.agent.snapshot.current
        yield from self._host(snap)
        yield from self._gpus(snap)
        yield from self._requests()
        yield from self._mesh()
        yield from self._routing()

    def _node(self) -> Iterator[Metric]:
        a = self.agent
        info = GaugeMetricFamily("loadmesh_node_info", "This agent: its node id in the mesh "
                                 "and its software version (always 1).",
                                 labels=["node_id", "version"])
        info.add_metric([a.node_id, a.version], 1)
        yield info
        components = GaugeMetricFamily(
            "loadmesh_component_state", "Each component's state (1 for the current one): ok, "
            "degraded (running without something, see /healthz), off (absent on this host).",
            labels=["component", "state"])
        for c in a.components:
            current = c.health().state
            for state in HealthState:
                components.add_metric([c.name, state.value], float(state is current))
        yield components
        yield GaugeMetricFamily("loadmesh_config_last_reload_successful",
                                "Whether the last configuration reload (SIGHUP) succeeded.",
                                value=float(a.reloader.last_ok))
        yield GaugeMetricFamily("loadmesh_config_last_reload_success_timestamp_seconds",
                                "When the configuration was last loaded (start or reload), "
                                "Unix time.", value=a.reloader.last_success_s)

    def _host(self, snap: LoadSnapshot | None) -> Iterator[Metric]:
        score = GaugeMetricFamily("loadmesh_node_load_score", "This node's load score as "
                                  "published to peers: 0 idle .. 1 saturated (docs/snapshot.md).")
        state = GaugeMetricFamily("loadmesh_node_state", "This node's published state "
                                  "(1 for the current one).", labels=["state"])
        cpu = GaugeMetricFamily("loadmesh_host_cpu_utilization_ratio",
                                "Host CPU busy share, 0..1, as published.")
        mem_used = GaugeMetricFamily("loadmesh_host_memory_used_bytes",
                                     "Host memory in use, as published (3 significant digits of MiB).")
        mem_total = GaugeMetricFamily("loadmesh_host_memory_total_bytes", "Host memory.")
        load1 = GaugeMetricFamily("loadmesh_host_load1", "Host 1-minute load average.")
        pressure = GaugeMetricFamily("loadmesh_host_cpu_pressure_ratio", "CPU pressure (PSI "
                                     "some avg10), 0..1; absent without PSI.")
        if snap is not None:
            score.add_metric([], snap.score)
            for s in NodeState:
                state.add_metric([s.value], float(s is snap.state))
            h = snap.host
            cpu.add_metric([], h.cpu_util)
            mem_used.add_metric([], h.mem_used_mib * MIB)
            mem_total.add_metric([], h.mem_total_mib * MIB)
            load1.add_metric([], h.load1)
            if h.cpu_pressure_pct is not None:
                pressure.add_metric([], h.cpu_pressure_pct / 100)
        yield from (score, state, cpu, mem_used, mem_total, load1, pressure)

    def _gpus(self, snap: LoadSnapshot | None) -> Iterator[Metric]:
        ids = ["gpu", "uuid"]
        info = GaugeMetricFamily("loadmesh_gpu_info", "Each GPU NVML shows (always 1).",
                                 labels=[*ids, "name"])
        healthy = GaugeMetricFamily("loadmesh_gpu_healthy", "1 while NVML answers for the GPU; "
                                    "0 and no other figure while it fails.", labels=ids)
        util = GaugeMetricFamily("loadmesh_gpu_utilization_ratio", "Share of the last sample "
                                 "period a kernel ran on the GPU, 0..1.", labels=ids)
        used = GaugeMetricFamily("loadmesh_gpu_memory_used_bytes", "GPU memory in use "
                                 "(3 significant digits of MiB).", labels=ids)
        total = GaugeMetricFamily("loadmesh_gpu_memory_total_bytes", "GPU memory.", labels=ids)
        temp = GaugeMetricFamily("loadmesh_gpu_temperature_celsius", "GPU core temperature.",
                                 labels=ids)
        power = GaugeMetricFamily("loadmesh_gpu_power_watts", "GPU power draw.", labels=ids)
        limit = GaugeMetricFamily("loadmesh_gpu_power_limit_watts", "GPU power limit.",
                                  labels=ids)
        devices = {d.index: d for d in self.agent.gpu.devices}
        for d in devices.values():
            info.add_metric([str(d.index), d.uuid, d.name], 1)
        for g in () if snap is None else snap.gpus:
            labels = [str(g.index), devices[g.index].uuid if g.index in devices else ""]
            healthy.add_metric(labels, float(g.healthy))
            if not g.healthy:
                continue  # its figures are zeros, not measurements
            util.add_metric(labels, g.util_pct / 100)
            used.add_metric(labels, g.mem_used_mib * MIB)
            total.add_metric(labels, g.mem_total_mib * MIB)
            temp.add_metric(labels, g.temp_c)
            power.add_metric(labels, g.power_w)
            limit.add_metric(labels, g.power_limit_w)
        yield from (info, healthy, util, used, total, temp, power, limit)

    def _requests(self) -> Iterator[Metric]:
        labels = ["model", "endpoint"]
        requests = CounterMetricFamily(
            "loadmesh_requests", "HTTP answers of the inference servers on this host, seen "
            "by the eBPF probes since the agent started, by model, endpoint and status code.",
            labels=[*labels, "code"])
        outcomes = CounterMetricFamily(
            "loadmesh_request_outcomes", "How requests ended since the agent started: "
            "complete, error (an error event inside a 200 stream), aborted (the client left "
            "first), truncated (the server closed mid-answer), unanswered.",
            labels=[*labels, "outcome"])
        tokens = CounterMetricFamily(
            "loadmesh_output_tokens", "Output tokens since the agent started: a stream's "
            "data: events, replaced by its usage object's completion_tokens when one passed "
            "(exact then, as for every non-streamed answer with usage).", labels=labels)
        prompt = CounterMetricFamily(
            "loadmesh_prompt_tokens", "Prompt tokens from the answers' usage objects, since "
            "the agent started.", labels=labels)
        waiting = GaugeMetricFamily(
            "loadmesh_requests_waiting", "Requests sent and not yet given a first token (a "
            "non-streamed one: not yet answered).", labels=labels)
        running = GaugeMetricFamily(
            "loadmesh_requests_running", "Requests whose answer streams tokens and has not "
            "ended.", labels=labels)
        in_flight = GaugeMetricFamily("loadmesh_requests_in_flight", "Requests sent to this "
                                      "host's inference servers and not answered in full "
                                      "yet: waiting + running.", labels=labels)
        errors = CounterMetricFamily("loadmesh_probe_errors", "Probe events that lost or "
                                     "misfiled a request, by reason (docs/probes.md).",
                                     labels=["reason"])
        folded_models = GaugeMetricFamily(
            "loadmesh_metrics_models_folded", "Models counted under model=\"(other)\" "
            "because metrics.model_labels others came first (clients name models).")
        probes = self.agent.probes
        report = probes.summary()
        folded: set[str] = set()
        if report is not None:
            for (model, endpoint), row in self._fold_rows(report["models"], folded).items():
                ids = [model, endpoint]
                for code, n in row["status"].items():
                    requests.add_metric([*ids, code], n)
                for outcome, n in row["outcomes"].items():
                    outcomes.add_metric([*ids, outcome], n)
                tokens.add_metric(ids, row["output_tokens"])
                prompt.add_metric(ids, row["prompt_tokens"])
                waiting.add_metric(ids, row["waiting"])
                running.add_metric(ids, row["running"])
                in_flight.add_metric(ids, row["inflight"])
            for reason, n in sorted(report["errors"].items()):
                errors.add_metric([reason], n)
        folded_models.add_metric([], len(folded))
        yield from (requests, outcomes, tokens, prompt, waiting, running, in_flight, errors,
                    folded_models)
        for kind, name, help_text, bounds in _LATENCY:
            family = HistogramMetricFamily(name, help_text + _LATENCY_NOTE, labels=labels)
            # Spelled as vLLM's client library spells them, so le="1.0" is the same bucket.
            les = [floatToGoString(b) for b in bounds]
            histograms: dict[tuple[str, str], tuple[list[int], int, float]] = {}
            for h in probes.latency_counts(kind, bounds):
                key = (self._model(h.model), h.endpoint)
                cumulative, count, sum_s = histograms.get(key, ([0] * len(bounds), 0, 0.0))
                histograms[key] = ([a + b for a, b in zip(cumulative, h.cumulative, strict=True)],
                                   count + h.count, sum_s + h.sum_s)
            for (model, endpoint), (cumulative, count, sum_s) in histograms.items():
                family.add_metric([model, endpoint],
                                  [*zip(les, cumulative, strict=True), ("+Inf", count)], sum_s)
            yield family

    def _fold_rows(self, rows: Iterable[dict[str, Any]],
                   folded: set[str]) -> dict[tuple[str, str], dict[str, Any]]:
        """The report's model rows by (model label, endpoint): the models past the cap
        summed under OTHER, their names added to `folded`."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for row in rows:
            model = self._model(row["model"])
            if model == OTHER:
                folded.add(row["model"])
            acc = out.get((model, row["endpoint"]))
            if acc is None:
                out[model, row["endpoint"]] = {**row, "status": dict(row["status"]),
                                               "outcomes": dict(row["outcomes"])}
                continue
            for figure in ("output_tokens", "prompt_tokens", "waiting", "running", "inflight"):
                acc[figure] += row[figure]
            for table in ("status", "outcomes"):
                for key, n in row[table].items():
                    acc[table][key] = acc[table].get(key, 0) + n
        return out

    def _mesh(self) -> Iterator[Metric]:
        peers = GaugeMetricFamily("loadmesh_peers", "Other nodes in this node's table, by "
                                  "state (dead ones are kept until reaped).", labels=["state"])
        traffic = {key: CounterMetricFamily(name, f"Gossip {key.replace('_', ' ')}.")
                   for key, name in _GOSSIP_TRAFFIC.items()}
        dropped = CounterMetricFamily("loadmesh_gossip_dropped", "Gossip datagrams, or records "
                                      "inside one, dropped, by reason.", labels=["reason"])
        events = CounterMetricFamily("loadmesh_gossip_events", "Other gossip protocol events "
                                     "(pulls, syncs, peer state changes, socket errors).",
                                     labels=["event"])
        purposes = CounterMetricFamily("loadmesh_gossip_sent_purpose_bytes", "Gossip bytes sent, by "
                                       "what they carry: liveness (pings, acks, ping-reqs), "
                                       "announcements, content, pulls, syncs, cookies.",
                                       labels=["purpose"])
        table = GaugeMetricFamily("loadmesh_gossip_table_bytes", "Bytes of peers' snapshot "
                                  "encodings held (bounded by gossip.max_table_bytes).")
        delivery = GaugeMetricFamily("loadmesh_gossip_probe_delivery_ratio", "Share of this node's "
                                     "pings to live peers that their own ack answered within the "
                                     "probe timeout: (1 - loss)^2 (moving average of ~16 probes).")
        service = self.agent.gossip.service
        if service is not None:
            table.add_metric([], service.table_bytes())
            delivery.add_metric([], service.probe_delivery())
            by_state = dict.fromkeys((s.value for s in PeerState), 0)
            for peer in service.peers():
                if peer.node_id != self.agent.node_id:
                    by_state[peer.state.value] += 1
            for state, n in by_state.items():
                peers.add_metric([state], n)
            counts = service.counters()
            for key, family in traffic.items():
                family.add_metric([], counts.get(key, 0))
            for key, n in sorted(counts.items()):
                if key.startswith(_DROP):
                    dropped.add_metric([key.removeprefix(_DROP)], n)
                elif key.startswith(_SENT_FOR):
                    purposes.add_metric([key.removeprefix(_SENT_FOR)], n)
                elif key not in _GOSSIP_TRAFFIC:
                    events.add_metric([key], n)
        yield from (peers, table, delivery, *traffic.values(), purposes, dropped, events)

    def _routing(self) -> Iterator[Metric]:
        routing = self.agent.routing
        decisions = CounterMetricFamily(
            "loadmesh_route_decisions", "Answers to `best peer` requests: outcome routed or "
            "no_peer, and the router's reason.", labels=["outcome", "reason"])
        for (outcome, reason), n in sorted(routing.decisions.items()):
            decisions.add_metric([outcome, reason], n)
        feedback = CounterMetricFamily("loadmesh_route_feedback", "Clients' reports on routed "
                                       "requests, by outcome.", labels=["outcome"])
        for outcome, n in sorted(routing.feedback.items()):
            feedback.add_metric([outcome], n)
        passed = GaugeMetricFamily(
            "loadmesh_sessions_passed_on", "The share of this node's sessions of a model that "
            "it passes on to the next peer of their ring, as its snapshot publishes it "
            "(docs/routing.md).", labels=["model"])
        snap = self.agent.snapshot.current
        if snap is not None:
            names = self.agent.snapshot.model_names()
            widths = {m.model_id: m.shed_width for m in snap.models}
            for mid, width in sorted(widths.items()):
                model = self._model(names.get(mid, f"{mid:016x}"))
                if model != OTHER:  # a share of one model's sessions: not summed
                    passed.add_metric([model], width)
        heavy = GaugeMetricFamily(
            "loadmesh_heavy_sessions", "Heavy sessions of a model as this node places them "
            "(docs/routing.md), on this node (self) or on its peers.", labels=["model", "on"])
        names = self.agent.snapshot.model_names()
        counts: Counter[tuple[str, str]] = Counter()
        for mid, hosts in routing.router.heavy.models().items():
            model = self._model(names.get(mid, f"{mid:016x}"))
            for host in hosts.values():
                counts[model, "self" if host == routing.node_id else "peers"] += 1
        for (model, on), n in sorted(counts.items()):
            heavy.add_metric([model, on], n)
        yield from (decisions, feedback, passed, heavy)

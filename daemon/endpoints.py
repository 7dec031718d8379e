"""The local API: every endpoint the agent answers on its Unix socket, in one table.

The components hold the handlers (their serve_* methods); this is the one place that says
which method and path reach which, and what each answers. README's "The local API"
describes the same endpoints for users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loadmesh.daemon.api_server import Route

if TYPE_CHECKING:
    from loadmesh.daemon.agent import Agent


def endpoints(agent: Agent) -> tuple[Route, ...]:
    routing, gossip, snapshot, probes = agent.routing, agent.gossip, agent.snapshot, agent.probes
    return (
        Route("GET", "/healthz", agent.serve_healthz,
              "the agent's status and each component's health; 503 until every component "
              "has started"),
        Route("GET", "/v1/status", agent.serve_status,
              "node id, software version, pid, start time, uptime, components' health"),
        Route("GET", "/v1/fingerprints", probes.serve_fingerprints,
              "the probes' report: per model and endpoint, and per flow (built in a "
              "thread); 503 while the probes are not running"),
        Route("GET", "/v1/snapshot", snapshot.serve_snapshot,
              "this node's LoadSnapshot with units, and score_inputs: what the last tick's "
              "score was made of; 503 before the first one"),
        Route("POST", "/v1/drain", snapshot.serve_drain,
              "drains this node: draining, and whether the state directory kept it"),
        Route("POST", "/v1/undrain", snapshot.serve_undrain,
              "ends a drain: draining, and whether the state directory kept it"),
        Route("GET", "/v1/peers", gossip.serve_peers,
              "every node known, this one first: node_id, state, version, age_ms, addr"),
        Route("GET", "/v1/gossip", gossip.serve_gossip,
              "the gossip address, table bytes and counters"),
        Route("GET", "/v1/best", routing.serve_best,
              "?model=M[&session=S][&exclude=a,b]: the chosen peer, its alternatives and "
              "the reason; 400 without a model or with too many exclusions; 503 with the "
              "reason and counts when no peer can take it"),
        Route("POST", "/v1/feedback", routing.serve_feedback,
              '{"node_id", "outcome", "latency_ms"}: whether the peer is known; 400 on a '
              "malformed body"),
    )

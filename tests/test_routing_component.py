"""The routing component's view of the table: this node's own row, the peers of its start."""

from __future__ import annotations

from collections import Counter
from typing import Any

from loadmesh.daemon.api_server import Router as ApiRouter
from loadmesh.daemon.routing import Decision, RoutingConfig
from loadmesh.daemon.routing_component import DISCOVERY_MS, RoutingComponent, now_ms
from loadmesh.gossip.membership import PeerState
from loadmesh.gossip.protocol import PeerView
from tests.test_routing_router import MODEL, snapshot


class Gossip:
    def __init__(self, views: dict[str, PeerView]) -> None:
        self._views = views

    def views(self) -> dict[str, PeerView]:
        return self._views


class Snapshot:
    def __init__(self, current: Any, confirmed_ms: int) -> None:
        self.current = current
        self.confirmed_ms = confirmed_ms

    def publish_bands(self, _: Any) -> None:
        pass


def component(views: dict[str, PeerView], confirmed_ms: int) -> RoutingComponent:
    own = views["n0"].snapshot
    return RoutingComponent("n0", RoutingConfig(seed=3), Gossip(views),  # type: ignore[arg-type]
                            Snapshot(own, confirmed_ms), ApiRouter())  # type: ignore[arg-type]


def picks(routing: RoutingComponent, n: int) -> Counter[str]:
    """n answers, each request done (feedback ok) before the next."""
    counts: Counter[str] = Counter()
    for _ in range(n):
        answer = routing.router.best(MODEL, None, (), now_ms())
        assert isinstance(answer, Decision), answer
        counts[answer.node_id] += 1
        routing.router.feedback(answer.node_id, "ok", 10.0, now_ms())
    return counts


def test_peers_found_as_the_gossip_joins_are_not_slow_started() -> None:
    # The table is this node alone at the start; the join's sync brings the peers a
    # moment later. Slow-started, they would weigh a tenth of this node for seconds.
    views = {"n0": PeerView(snapshot("n0"), PeerState.ALIVE, 0)}
    routing = component(views, now_ms())
    routing._started_ms = now_ms()  # as start() does
    routing._update()
    routing._started_ms -= 1000  # a second later
    views["n1"] = PeerView(snapshot("n1"), PeerState.ALIVE, 300)
    routing._update()
    assert picks(routing, 400)["n1"] > 140
    # One that joins once the table has filled is slow-started.
    routing._started_ms -= DISCOVERY_MS
    views["n2"] = PeerView(snapshot("n2"), PeerState.ALIVE, 300)
    routing._update()
    assert picks(routing, 400)["n2"] < 40


def test_own_sends_since_the_confirming_read_count_against_this_node() -> None:
    # The table gives this node's snapshot at age 0; its figures are those of the last
    # probe read. Updates every 100 ms must not forget what this node sent itself since,
    # or it takes every request of a burst while its published in-flight stands still.
    routing = component({"n0": PeerView(snapshot("n0"), PeerState.ALIVE, 0),
                         "n1": PeerView(snapshot("n1"), PeerState.ALIVE, 300)}, now_ms() - 200)
    routing._update()
    counts: Counter[str] = Counter()
    for _ in range(40):
        answer = routing.router.best(MODEL, None, (), now_ms())
        assert isinstance(answer, Decision), answer
        counts[answer.node_id] += 1
        routing._update()
    assert max(counts.values()) <= 26, counts

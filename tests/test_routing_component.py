"""The routing component's view of the table: this node's own row, the peers of its start."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from loadmesh.daemon import routing_component
from loadmesh.daemon.routing import Decision, Reason, RoutingConfig
from loadmesh.daemon.routing import router as router_module
from loadmesh.daemon.routing_component import DISCOVERY_MS, RoutingComponent, now_ms, wall_ms
from loadmesh.gossip.membership import PeerState
from loadmesh.gossip.protocol import PeerView
from tests.test_routing_router import MODEL, snapshot


class Gossip:
    """The gossip component's table: the views changed since a mark, as the protocol
    answers them (GossipCore.snapshots_since); reads counts the answers holding any."""

    def __init__(self, views: dict[str, PeerView]) -> None:
        self._views = views
        self._generation = 1
        self._changed = dict.fromkeys(views, 1)
        self.reads = 0

    def put(self, node_id: str, view: PeerView) -> None:
        self._generation += 1
        self._views[node_id] = view
        self._changed[node_id] = self._generation

    def views_since(self, mark: int | None) -> tuple[int, dict[str, PeerView], bool]:
        if mark is None:
            out, complete = dict(self._views), True
        else:
            out = {n: v for n, v in self._views.items() if self._changed[n] > mark}
            complete = False
        self.reads += bool(out)
        return self._generation, out, complete


class Snapshot:
    def __init__(self, current: Any, confirmed_ms: int) -> None:
        self.current = current
        self.confirmed_ms = confirmed_ms

    def publish_bands(self, _: Any) -> None:
        pass

    def publish_sessions(self, _: Any) -> None:
        pass


def component(views: dict[str, PeerView], confirmed_ms: int, **config: Any) -> RoutingComponent:
    own = views["n0"].snapshot
    return RoutingComponent("n0", RoutingConfig(seed=3, **config), Gossip(views),  # type: ignore[arg-type]
                            Snapshot(own, confirmed_ms))  # type: ignore[arg-type]


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
    # moment later, or, on a busy machine, many seconds later. Slow-started, they would
    # weigh a tenth of this node for seconds.
    routing = component({"n0": PeerView(snapshot("n0"), PeerState.ALIVE, 0)}, now_ms())
    start = wall_ms()
    routing._started_wall_ms = start  # as start() does
    routing._update()
    # started 2 s after this agent: not new, however late the join brings it
    routing.gossip.put("n1", PeerView(snapshot("n1"), PeerState.ALIVE, 300, start + 2000))
    routing._update()
    assert routing._since["n1"] is None
    assert picks(routing, 400)["n1"] > 140
    # One that starts once this agent has run a while is slow-started, from its start.
    routing._started_wall_ms = start - DISCOVERY_MS - 5000
    routing.gossip.put("n2", PeerView(snapshot("n2"), PeerState.ALIVE, 300, start - 1000))
    routing._update()
    since = routing._since["n2"]
    assert since is not None and 900 <= now_ms() - since <= 1500
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


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The routing component's now_ms, moved by the test."""
    now = [1_000_000]
    monkeypatch.setattr(routing_component, "now_ms", lambda: now[0])
    return now


def test_an_unchanged_table_is_neither_read_nor_rebuilt(clock: list[int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[int] = []
    real_build = router_module.build
    monkeypatch.setattr(router_module, "build", lambda *a: builds.append(clock[0]) or real_build(*a))
    routing = component({"n0": PeerView(snapshot("n0"), PeerState.ALIVE, 0),
                         "n1": PeerView(snapshot("n1"), PeerState.ALIVE, 300)}, clock[0])
    gossip = routing.gossip
    routing._update()
    assert (gossip.reads, len(builds)) == (1, 1)
    for _ in range(20):
        clock[0] += 100
        routing._update()
    assert (gossip.reads, len(builds)) == (1, 1)
    # A beat: the figures are vouched for as of now. Read, but the same figures.
    gossip.put("n1", PeerView(snapshot("n1"), PeerState.ALIVE, 0))
    routing._update()
    assert (gossip.reads, len(builds)) == (2, 1)
    # New figures: one read, one rebuild.
    gossip.put("n1", PeerView(snapshot("n1", version=2, in_flight=3), PeerState.ALIVE, 0))
    routing._update()
    routing._update()
    assert (gossip.reads, len(builds)) == (3, 2)
    # This node's own figures confirmed by a later probe read: its row is fed again, from
    # the table as last read.
    clock[0] += 100
    routing.snapshot.confirmed_ms = clock[0]
    routing._update()
    assert gossip.reads == 3 and routing.router._peers["n0"].taken_ms == clock[0]


def test_a_peer_goes_stale_on_time_while_the_table_stands_still(clock: list[int]) -> None:
    # This node serves another model: n1 is the only candidate, and its figures were
    # vouched for 300 ms before the first update.
    own = snapshot("n0", models=("other-model",))
    routing = component({"n0": PeerView(own, PeerState.ALIVE, 0),
                         "n1": PeerView(snapshot("n1"), PeerState.ALIVE, 300)}, clock[0],
                        freshness_s=1.0)
    routing._update()

    def reason() -> Reason:
        answer = routing.router.best(MODEL, None, (), clock[0])
        assert isinstance(answer, Decision) and answer.node_id == "n1", answer
        return answer.reason

    assert reason() is Reason.POWER_OF_D
    clock[0] += 700  # 1000 ms old: fresh still
    routing._update()
    assert reason() is Reason.POWER_OF_D
    clock[0] += 1
    routing._update()
    assert reason() is Reason.STALE_VIEW
    assert routing.gossip.reads == 1
    # A beat makes it fresh again.
    routing.gossip.put("n1", PeerView(snapshot("n1"), PeerState.ALIVE, 0))
    routing._update()
    assert reason() is Reason.POWER_OF_D

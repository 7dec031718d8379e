"""The `routing` component: the best peer for a model, from the gossip table.

The router follows the table a few times a second, off the request path, so a `best`
answer is a few microseconds of work on the event loop. It reads only what changed since
its last read (the peers whose snapshot, state or freshness moved, and this node's own
row when its snapshot or the read confirming it moved); time passing alone (freshness,
remembered paces, this node's bands) needs no read of the table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from http import HTTPStatus
from typing import Any

from loadmesh.daemon import logs
from loadmesh.daemon.gossip_component import GossipComponent
from loadmesh.daemon.health import OK, Health
from loadmesh.daemon.http import HttpError, Request, Response
from loadmesh.daemon.routing import OUTCOMES, Decision, PeerInput, Router, RoutingConfig
from loadmesh.daemon.snapshot_component import SnapshotComponent
from loadmesh.gossip.membership import PeerState
from loadmesh.gossip.protocol import PeerView, TableMark
from loadmesh.gossip.snapshot import LoadSnapshot

log = logs.get("routing")

# How often the router follows the table: fast next to the 500 ms gossip rounds, and cheap
# since only what changed is read (docs/routing.md, Interface).
UPDATE_PERIOD_S = 0.1
# Peers that started within this long after this agent (a fleet starting together, a
# rolling start's neighbours) are not slow-started: the gossip fills the table over the
# first seconds, and later under load.
DISCOVERY_MS = 10_000
MAX_EXCLUDE = 64


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def wall_ms() -> int:
    """The clock incarnations count on: peers' starts are compared with this agent's."""
    return time.time_ns() // 1_000_000


class RoutingComponent:
    name = "routing"

    def __init__(self, node_id: str, config: RoutingConfig, gossip: GossipComponent,
                 snapshot: SnapshotComponent) -> None:
        self.node_id = node_id
        self.router = Router(config)
        self.gossip = gossip
        self.snapshot = snapshot
        # Peers present at our start are not slow-started: a restart of this agent must not
        # throttle the whole fleet. Joins and recoveries after that are. The table fills
        # only as the gossip joins, so whether a peer is new is told by its own start (its
        # incarnation), not by when this agent first heard of it: slow-started from the
        # first update, the peers of a fresh agent sat at a tenth of their weight and it
        # named itself for 40 /v1/best answers of 40 in tests/test_mesh.py; with "first
        # heard of within 10 s of the start" it still did, where a busy machine took
        # longer than that to join.
        self._since: dict[str, int | None] = {}
        self._alive: dict[str, bool] = {}
        self._started_wall_ms: int | None = None
        # The table as last read (node_id -> view), where the gossip stood then, and this
        # node's snapshot and when its figures were confirmed; None: read it all next time.
        self._views: dict[str, PeerView] = {}
        self._mark: TableMark | None = None
        self._own_read: tuple[LoadSnapshot | None, int | None] | None = None
        self._task: asyncio.Task[None] | None = None
        # Answers given, for the exporter: (outcome "routed" or "no_peer", reason label),
        # and clients' feedback by outcome. Counted here, on the request path, because
        # the router keeps no history of its answers.
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.feedback: Counter[str] = Counter()
        # The router decides this node's bands of passed-on sessions; the snapshot carries
        # them to every host. Through self.router: a reload replaces it.
        snapshot.publish_bands(lambda model_id: self.router.band(model_id))
        # And the busiest sessions routed here, which every host sums to find the heavy
        # ones (daemon/routing/heavy.py).
        snapshot.publish_sessions(lambda: self.router.busiest(now_ms()))

    async def start(self) -> None:
        self._started_wall_ms = wall_ms()
        self._update()
        self._task = asyncio.create_task(self._follow(), name="routing-update")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def health(self) -> Health:
        return OK

    def reconfigure(self, config: RoutingConfig) -> None:
        """Take reloaded routing settings. The router is rebuilt, so open circuits and
        this node's own-send corrections start afresh; the candidates are back at once,
        and the sessions this node passes on stay passed on."""
        self.router = Router(config, self.router.shedding)
        self._mark = self._own_read = None
        self._update()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(UPDATE_PERIOD_S)
            try:
                self._update()
            except Exception:
                log.exception("updating the routing table failed")

    def _update(self) -> None:
        now = now_ms()
        own_read = (self.snapshot.current, self.snapshot.confirmed_ms)
        mark, changed, complete = self.gossip.views_since(self._mark)
        if not complete and not changed and own_read == self._own_read:
            self.router.tick(now)
            return
        if complete:
            self._views = changed
        else:
            self._views.update(changed)
        self._mark = mark
        peers = [self._input(node_id, view, now) for node_id, view in changed.items()
                 if node_id != self.node_id]
        if complete or self.node_id in changed or own_read != self._own_read:
            own = self._own_input(own_read, now)
            if own is not None:
                peers.append(own)
        self._own_read = own_read
        if complete:
            known = self._views.keys() | {self.node_id}
            for gone in self._since.keys() - known:
                del self._since[gone]
                self._alive.pop(gone, None)
        self.router.update(peers, now, complete=complete)

    def _input(self, node_id: str, view: PeerView, now: int) -> PeerInput:
        alive = view.state is not PeerState.DEAD
        if node_id not in self._since:
            self._since[node_id] = self._joined(view.started_ms, now)
        elif alive and not self._alive.get(node_id, True):
            self._since[node_id] = now  # recovered: ramp up again
        self._alive[node_id] = alive
        return PeerInput(node_id, view.snapshot, alive, view.age_ms, self._since[node_id])

    def _own_input(self, own_read: tuple[LoadSnapshot | None, int | None], now: int) -> PeerInput | None:
        """This node's row: the table holds its snapshot at age 0, but its figures are as
        old as the probe read that last confirmed them: counted from now, this node's
        sends since would be forgotten on every update and it would take more than its
        share. Before the gossip service runs (or without one), this node still routes to
        itself, from the snapshot it would publish."""
        own, confirmed = own_read
        age = 0 if confirmed is None else max(0, now - confirmed)
        view = self._views.get(self.node_id)
        if view is not None:
            self._since.setdefault(self.node_id, None)
            return PeerInput(self.node_id, view.snapshot, True, age, self._since[self.node_id], is_self=True)
        if own is None:
            return None
        return PeerInput(self.node_id, own, True, age, None, is_self=True)

    def _joined(self, started_ms: int, now: int) -> int | None:
        """When a peer first seen now joined, on now_ms's clock, if it started after this
        agent had (it is new: ramp it up from its start); None for the peers that were
        there before."""
        if self._started_wall_ms is None or started_ms <= self._started_wall_ms + DISCOVERY_MS:
            return None
        return now - max(0, wall_ms() - started_ms)

    def serve_best(self, request: Request) -> Response:
        model = request.query.get("model", "")
        if not model:
            raise HttpError(HTTPStatus.BAD_REQUEST, "the model parameter is required")
        exclude = [n for n in request.query.get("exclude", "").split(",") if n]
        if len(exclude) > MAX_EXCLUDE:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"at most {MAX_EXCLUDE} excluded peers")
        dry_run = request.query.get("dry_run", "0")
        if dry_run not in ("0", "1"):
            raise HttpError(HTTPStatus.BAD_REQUEST, f"dry_run must be 0 or 1, not {dry_run!r}")
        answer = self.router.best(model, request.query.get("session") or None, exclude, now_ms(),
                                  dry_run=dry_run == "1")
        # A dry run routes nothing: the decisions counted are the requests routed.
        counted = dry_run == "0"
        if isinstance(answer, Decision):
            if counted:
                self.decisions["routed", answer.reason.label] += 1
            return Response.json(dataclasses.asdict(answer))
        if counted:
            self.decisions["no_peer", answer.reason.label] += 1
        body: dict[str, Any] = dataclasses.asdict(answer)
        body["error"] = f"no peer for model {model!r}: {answer.reason}"
        return Response.json(body, HTTPStatus.SERVICE_UNAVAILABLE)

    def serve_feedback(self, request: Request) -> Response:
        body = request.json()
        if not isinstance(body, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, "expected a JSON object")
        node_id, outcome = body.get("node_id"), body.get("outcome")
        latency = body.get("latency_ms", 0.0)
        if not isinstance(node_id, str) or outcome not in OUTCOMES:
            raise HttpError(HTTPStatus.BAD_REQUEST,
                            'expected {"node_id": str, "outcome": "ok"|"error"|"timeout", '
                            '"latency_ms": number}')
        if isinstance(latency, bool) or not isinstance(latency, (int, float)):
            raise HttpError(HTTPStatus.BAD_REQUEST, "latency_ms must be a number")
        try:
            known = self.router.feedback(node_id, outcome, float(latency), now_ms())
        except ValueError as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        self.feedback[outcome] += 1
        return Response.json({"node_id": node_id, "known": known})

"""Turns one tick's collector and probe figures into the snapshot this node publishes."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from loadmesh.daemon.score import (
    Components,
    ModelRates,
    QueueFigure,
    QueueGauge,
    ScoreConfig,
    ScoreSmoother,
    components,
    instant_score,
    state_for,
)
from loadmesh.daemon.versioning import Change, ChangeDetector, VersionClock, wall_ms
from loadmesh.gossip.snapshot import (
    MAX_GPUS,
    MAX_IN_FLIGHT,
    MAX_LATENCY_MS,
    MAX_MODELS,
    MAX_RPS,
    MAX_TOKENS_PER_S,
    Endpoint,
    GpuLoad,
    HostLoad,
    LoadSnapshot,
    ModelLoad,
    SessionRates,
    wire_score,
)

log = logging.getLogger(__name__)


class ModelFigures(ModelRates, Protocol):
    """What the probes reader reports per (model, serving port) each tick: the queue's
    rates and the figures the snapshot carries."""

    @property
    def rps(self) -> float: ...
    @property
    def failed_ratio(self) -> float: ...
    @property
    def p50_ms(self) -> float: ...
    @property
    def p99_ms(self) -> float: ...
    @property
    def waiting(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def ttft_p99_ms(self) -> float: ...
    @property
    def itl_p99_ms(self) -> float: ...
    @property
    def pace_ms(self) -> float: ...


@dataclass(frozen=True)
class ScoreInputs:
    """What the last build's score was made of (docs/snapshot.md, "The load score"):
    the components, the unsmoothed score, and each model's queue figure. Local only: the
    wire carries the score."""

    components: Components
    instant: float
    queue: Mapping[tuple[int, int], QueueFigure]


def _bounded(value: float, hi: float) -> float:
    # A window without requests may give NaN percentiles: no data reads as zero.
    return min(max(value, 0.0), hi) if math.isfinite(value) else 0.0


def _count(n: int) -> int:
    return min(max(n, 0), MAX_IN_FLIGHT)


def _model_load(m: ModelFigures) -> ModelLoad:
    waiting, running = _count(m.waiting), _count(m.running)
    return ModelLoad(
        model_id=m.model_id,
        port=m.port,
        rps=_bounded(m.rps, MAX_RPS),
        # On the wire, everything that counts against the host: 5xx and 429 answers,
        # stream errors, aborted, cut and unanswered requests (a 429 is fast, and would
        # otherwise make a rejecting host look quick and healthy).
        error_ratio=_bounded(m.failed_ratio, 1.0),
        p50_ms=_bounded(m.p50_ms, MAX_LATENCY_MS),
        p99_ms=_bounded(m.p99_ms, MAX_LATENCY_MS),
        in_flight=_count(waiting + running),
        waiting=waiting,
        running=running,
        ttft_p99_ms=_bounded(m.ttft_p99_ms, MAX_LATENCY_MS),
        itl_p99_ms=_bounded(m.itl_p99_ms, MAX_LATENCY_MS),
        tokens_per_s=_bounded(m.tokens_per_s, MAX_TOKENS_PER_S),
        pace_ms=_bounded(m.pace_ms, MAX_LATENCY_MS),
    )


def _banded(m: ModelLoad, start: float, width: float) -> ModelLoad:
    if (start, width) == (m.shed_start, m.shed_width):
        return m
    return replace(m, shed_start=min(max(start, 0.0), 1.0), shed_width=min(max(width, 0.0), 1.0))


class SnapshotBuilder:
    """Builds the next snapshot each tick and decides whether it is a new version.

    While nothing material changes, build() returns the snapshot published last, same
    version and same content: a version always names one content.
    """

    def __init__(
        self,
        node_id: str,
        endpoints: Sequence[Endpoint],
        versions: VersionClock,
        detector: ChangeDetector,
        score_config: ScoreConfig,
        now_ms: Callable[[], int] = wall_ms,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.endpoints = tuple(endpoints)
        self.score_config = score_config
        self._versions = versions
        self._detector = detector
        self._smoother = ScoreSmoother(score_config.half_life_s)
        self._queue = QueueGauge()
        self._now_ms = now_ms
        self._monotonic = monotonic
        self._published: LoadSnapshot | None = None
        self._inputs: ScoreInputs | None = None

    @property
    def published(self) -> LoadSnapshot | None:
        return self._published

    @property
    def inputs(self) -> ScoreInputs | None:
        """The last build's, published or not (a score that moved within its deadband
        leaves the published snapshot as it was)."""
        return self._inputs

    def build(
        self,
        host: HostLoad,
        gpus: Sequence[GpuLoad],
        models: Sequence[ModelFigures],
        draining: bool = False,
        listed: Mapping[int, Collection[int]] | None = None,
        bands: Callable[[int], tuple[float, float]] | None = None,
        outrun: int = 0,
        sessions: Sequence[SessionRates] = (),
    ) -> tuple[LoadSnapshot, bool, bool]:
        """(snapshot to publish, whether its version is new, whether peers need it now).
        listed: port -> the model_ids its server lists (daemon/model_list.py); those
        without traffic yet get an entry with none, so that peers know this node serves
        them. bands: model_id -> this node's band of passed-on sessions, (start, width)
        (daemon/routing/shed.py). outrun: the highest version of this node that peers
        hold; at or above this node's next one, the next version goes above it at once.
        sessions: the busiest sessions routed here per model (daemon/routing/heavy.py);
        they ride with the versions that other figures make (a heartbeat at the least):
        a session is heavy for many seconds, and a version per change of a rate would
        cost every peer a datagram."""
        loads = [_model_load(m) for m in models]
        seen = {m.key for m in loads}
        for port, ids in (listed or {}).items():
            for mid in ids:
                if (mid, port) not in seen:
                    loads.append(ModelLoad(mid, port, 0.0, 0.0, 0.0, 0.0, 0))
        if len(loads) > MAX_MODELS:
            # The wire carries at most MAX_MODELS: keep the ones carrying the most traffic.
            loads = sorted(loads, key=lambda m: (m.in_flight, m.rps), reverse=True)[:MAX_MODELS]
        if bands is not None:
            loads = [_banded(m, *bands(m.model_id)) for m in loads]
        gpus = sorted(gpus, key=lambda g: g.index)[:MAX_GPUS]
        queue = self._queue.update(models)
        parts = components(host, gpus, loads, self.score_config, queue)
        instant = instant_score(parts, self.score_config.weights)
        self._inputs = ScoreInputs(parts, instant, self._queue.figures())
        smoothed = self._smoother.update(instant, self._monotonic())
        # Rounding inside the smoother can overshoot 1.0 by an ulp.
        score = wire_score(min(max(smoothed, 0.0), 1.0))
        candidate = LoadSnapshot(
            node_id=self.node_id,
            endpoints=self.endpoints,
            version=self._versions.peek(),
            timestamp_ms=self._now_ms(),
            state=state_for(score, draining, self.score_config),
            score=score,
            host=host,
            gpus=tuple(gpus),
            models=tuple(loads),
            sessions=tuple(sessions),
        )
        change = self._detector.compare(self._published, candidate)
        if outrun >= candidate.version:
            # Peers hold a version of this node above its own (a previous incarnation's
            # clock ran ahead, or someone forged it): until this node publishes above
            # it, they ignore its real versions.
            self._versions.skip_past(outrun)
            change = Change(True, True, f"peers hold version {outrun} of this node")
        if not change.material and self._published is not None:
            return self._published, False, False
        self._published = replace(candidate, version=self._versions.take())
        log.debug("version %d%s: %s", self._published.version, " (urgent)" if change.urgent else "", change.reason)
        return self._published, True, change.urgent

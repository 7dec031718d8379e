"""The load score: one number in [0, 1] that peers compare when they pick where to send a
request, and the node state derived from it.

Components, each in [0, 1] (docs/snapshot.md explains the defaults):

    gpu_util    mean GPU utilisation; a GPU NVML cannot read counts as fully busy
    gpu_memory  fullest GPU's used/total, ramped from memory_knee (0) to 1.0 (1)
    queue       the busiest model's 1 - rate / best rate: its output tokens per second per
                request in flight, against the best this node has served it at
    errors      request-weighted error ratio / error_ratio_ceiling, capped at 1
    in_flight   requests in flight / (in_flight_per_gpu * max(1, GPUs)), capped at 1
    cpu         max(CPU utilisation, CPU pressure (PSI some avg10) / 100)
    gpu_failed  share of GPUs that NVML cannot read

    blend = sum(w_k * c_k) / sum(w_k)      over the weighted components that have data
    score = max(blend, queue, errors, gpu_failed)

The queue is what loads an LLM server: requests that wait, because the batch is full, get
no tokens. A request's time in the server and its output tokens are the same figures
whether the client streams or not (both ends are on the wire either way), so the score
follows the server's load, not the clients' mode. No latency target enters it: a
normal answer takes 50 ms or 50 s.

A component without data (no GPUs, no model with traffic) leaves the blend, so the rest
keep their relative weight. queue, errors and gpu_failed also floor the score: a queue,
failing requests or dead GPUs each make a node unattractive on their own, however idle the
rest of it looks. The instant score is then smoothed by exponential decay (ScoreSmoother)
before it becomes the snapshot's score and state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from typing import Protocol

from loadmesh.gossip.snapshot import GpuLoad, HostLoad, ModelLoad, NodeState
from loadmesh.settings import check_settings, in_range, section, setting


@dataclass(frozen=True)
class ScoreWeights:
    # Checked together in __post_init__ (the operator hears of the whole table).
    # docs/snapshot.md explains each component and its default weight.
    gpu_util: float = setting(0.35, doc="weight of the mean GPU utilisation")
    gpu_memory: float = setting(0.10, doc="weight of the fullest GPU's memory in use")
    queue: float = setting(0.25, doc="weight of the busiest model's queue")
    errors: float = setting(0.10, doc="weight of the error ratio")
    in_flight: float = setting(0.15, doc="weight of the requests in flight per GPU")
    cpu: float = setting(0.05, doc="weight of the CPU utilisation or pressure")

    def __post_init__(self) -> None:
        values = [getattr(self, f.name) for f in fields(self)]
        if any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
            raise ValueError(f"score weights must be finite, non-negative and not all zero: {self}")


@dataclass(frozen=True)
class ScoreConfig:
    """The score's settings, the agent's `[load]` keys (daemon/config.py's LoadConfig adds
    the snapshot's timing), and its internal tuning."""

    weights: ScoreWeights = section(ScoreWeights, "the components' weights in the blend "
                                    "(relative: only their ratios matter)")
    error_ratio_ceiling: float = 0.05
    memory_knee: float = 0.95
    in_flight_per_gpu: int = 64
    half_life_s: float = setting(3.0, in_range(0.1, 600),
                                 "score smoothing: a sample's weight halves in this time")
    degraded_at: float = setting(0.7, in_range(0.01, 1), "score from which the node is degraded")
    overloaded_at: float = setting(0.9, in_range(0.01, 1),
                                   "score from which the node is overloaded")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.degraded_at >= self.overloaded_at:
            raise ValueError(f"degraded_at ({self.degraded_at:g}) must be below "
                             f"overloaded_at ({self.overloaded_at:g})")
        if not 0 < self.error_ratio_ceiling <= 1:
            raise ValueError("error_ratio_ceiling must be in (0, 1]")
        if not 0 <= self.memory_knee < 1:
            raise ValueError("memory_knee must be in [0, 1)")
        if self.in_flight_per_gpu < 1:
            raise ValueError("in_flight_per_gpu must be at least 1")


@dataclass(frozen=True)
class Components:
    """Score inputs, each in [0, 1]; None where there is nothing to measure."""

    gpu_util: float | None
    gpu_memory: float | None
    queue: float | None
    errors: float | None
    in_flight: float
    cpu: float
    gpu_failed: float | None


def _cap(x: float) -> float:
    return min(1.0, max(0.0, x))


def _memory_fraction(g: GpuLoad) -> float:
    if not g.healthy:
        return 1.0
    # A total of 0 means NVML could not report memory on this GPU (some MIG and vGPU
    # setups): unknown, so it adds no pressure.
    return g.mem_used_mib / g.mem_total_mib if g.mem_total_mib else 0.0


def components(
    host: HostLoad,
    gpus: Sequence[GpuLoad],
    models: Sequence[ModelLoad],
    config: ScoreConfig,
    queue: float | None = None,
) -> Components:
    """queue: QueueGauge.update()'s figure for this tick (it needs history the snapshot
    does not carry)."""
    gpu_util: float | None = None
    gpu_memory: float | None = None
    gpu_failed: float | None = None
    if gpus:
        gpu_util = sum(g.util_pct / 100 if g.healthy else 1.0 for g in gpus) / len(gpus)
        fullest = max(_memory_fraction(g) for g in gpus)
        gpu_memory = _cap((fullest - config.memory_knee) / (1 - config.memory_knee))
        gpu_failed = sum(not g.healthy for g in gpus) / len(gpus)

    # A model without requests in the window has no meaningful error ratio.
    serving = [m for m in models if m.rps > 0]
    errors: float | None = None
    if serving:
        total_rps = sum(m.rps for m in serving)
        error_ratio = sum(m.error_ratio * m.rps for m in serving) / total_rps
        errors = _cap(error_ratio / config.error_ratio_ceiling)

    capacity = config.in_flight_per_gpu * max(1, len(gpus))
    in_flight = _cap(sum(m.in_flight for m in models) / capacity)
    pressure = (host.cpu_pressure_pct or 0.0) / 100
    cpu = _cap(max(host.cpu_util, pressure))
    return Components(gpu_util, gpu_memory, None if queue is None else _cap(queue), errors,
                      in_flight, cpu, gpu_failed)


def instant_score(c: Components, weights: ScoreWeights) -> float:
    weighted = [
        (weights.gpu_util, c.gpu_util),
        (weights.gpu_memory, c.gpu_memory),
        (weights.queue, c.queue),
        (weights.errors, c.errors),
        (weights.in_flight, c.in_flight),
        (weights.cpu, c.cpu),
    ]
    present = [(w, v) for w, v in weighted if v is not None]
    total_weight = sum(w for w, _ in present)
    blend = sum(w * v for w, v in present) / total_weight if total_weight else 0.0
    floors = [v for v in (c.queue, c.errors, c.gpu_failed) if v is not None]
    return _cap(max([blend, *floors]))


class ModelRates(Protocol):
    """What QueueGauge reads of each model's figures (the probes reader's ModelStats)."""

    @property
    def model_id(self) -> int: ...
    @property
    def port(self) -> int: ...
    @property
    def tokens_per_s(self) -> float: ...
    @property
    def window_tokens(self) -> int: ...
    @property
    def mean_in_flight(self) -> float: ...
    @property
    def e2e_tokens(self) -> int: ...
    @property
    def e2e_s(self) -> float: ...


@dataclass(frozen=True)
class QueueFigure:
    """One (model, port)'s queue figure and its inputs, in output tokens per second per
    request in the server. rate: the window's; None where the window said nothing new
    (nothing in flight, too few tokens, no best yet). best: None until one is learnt."""

    rate: float | None
    best: float | None
    queue: float


# A window with fewer output tokens, or less than this many requests in flight on average,
# says too little about a model's rate to learn from.
MIN_TOKENS = 50
MIN_IN_FLIGHT = 0.5


class QueueGauge:
    """The queue component, per (model, port): the output tokens a request gets per second
    it spends in the server, against the best rate seen for that model on this node. A
    server with room decodes every request at about its best rate; once its batch is full,
    the requests behind it wait and get nothing meanwhile, so the rate falls: 1 - rate /
    best is the share of a request's time lost to load (queueing, and the slower steps of
    a fuller batch).

    The rate now is the window's output tokens per second over its mean requests in
    flight: it moves the moment requests pile up, before any of them ends. The best is
    learnt from the answers that ended in a window, their tokens over their summed times in
    the server (first byte to last, on the wire): the same figure per request whether it
    streamed or came in one piece, where the rate from tokens as they pass is lumpy for
    the latter (all of an answer's tokens at its end), and a maximum over lumpy windows
    would take their luckiest. By Little's law the two agree in a steady state. The best is
    kept across ticks: what this hardware does for this model's requests, learnt in the
    node's first quiet moment. Until a model has one, it has no queue figure.

    A window with requests in flight but too few tokens to tell a rate (one long answer not
    streamed, whose tokens all come at its end) keeps the model's last figure: it says
    nothing new about the queue."""

    def __init__(self) -> None:
        self._best: dict[tuple[int, int], float] = {}
        self._last: dict[tuple[int, int], QueueFigure] = {}

    def update(self, models: Sequence[ModelRates]) -> float | None:
        """The busiest model's queue figure, in [0, 1]; None before any is known."""
        out: float | None = None
        for m in models:
            key = (m.model_id, m.port)
            if m.e2e_tokens >= MIN_TOKENS and m.e2e_s > 0:
                self._best[key] = max(self._best.get(key, 0.0), m.e2e_tokens / m.e2e_s)
            best = self._best.get(key)
            rate = None
            if m.mean_in_flight < MIN_IN_FLIGHT:
                busy = 0.0
            elif best and m.window_tokens >= MIN_TOKENS:
                rate = m.tokens_per_s / m.mean_in_flight
                busy = _cap(1 - rate / best)
            else:
                last = self._last.get(key)
                busy = last.queue if last else 0.0
            self._last[key] = QueueFigure(rate, best, busy)
            if best:
                out = busy if out is None else max(out, busy)
        return out

    def figures(self) -> dict[tuple[int, int], QueueFigure]:
        """Per (model_id, port), the last update's figure and what it was made of: what an
        operator reads to see why a node scores as it does."""
        return dict(self._last)


class ScoreSmoother:
    """Exponentially decaying average over irregularly spaced samples.

    A sample dt seconds after the previous one gets weight 1 - 2**(-dt / half_life): a
    sample's influence halves every half_life seconds, whatever the tick rate, so two
    ticks of one second give the same result as one tick of two seconds with the same
    input. The first sample is taken as is.
    """

    def __init__(self, half_life_s: float) -> None:
        if not half_life_s > 0:
            raise ValueError("half_life_s must be positive")
        self.half_life_s = half_life_s
        self._value: float | None = None
        self._at = 0.0

    def update(self, value: float, now_s: float) -> float:
        if self._value is None:
            self._value = value
        else:
            # A clock that went back adds no time, rather than a negative weight.
            dt = max(0.0, now_s - self._at)
            weight = 1.0 - 2.0 ** (-dt / self.half_life_s)
            self._value += weight * (value - self._value)
        self._at = now_s
        return self._value


def state_for(score: float, draining: bool, config: ScoreConfig) -> NodeState:
    """Watermarks: below degraded_at ok, below overloaded_at degraded, else overloaded;
    an operator's drain overrides them all."""
    if draining:
        return NodeState.DRAINING
    if score >= config.overloaded_at:
        return NodeState.OVERLOADED
    if score >= config.degraded_at:
        return NodeState.DEGRADED
    return NodeState.OK

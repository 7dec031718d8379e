from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadmesh.daemon.score import (
    MIN_TOKENS,
    Components,
    QueueFigure,
    QueueGauge,
    ScoreConfig,
    ScoreSmoother,
    ScoreWeights,
    components,
    instant_score,
    state_for,
)
from loadmesh.gossip.snapshot import GpuLoad, HostLoad, ModelLoad, NodeState

CONFIG = ScoreConfig()


def gpu(index: int, util: int, used: int, total: int = 1000, healthy: bool = True) -> GpuLoad:
    return GpuLoad(index, util, used, total, 60, 300, 700, 0, 1, healthy)


def model(model_id: int, rps: float, error_ratio: float, p99_ms: float, in_flight: int) -> ModelLoad:
    return ModelLoad(model_id, 8000, rps, error_ratio, p99_ms / 2, p99_ms, in_flight)


HOST = HostLoad(cpu_util=0.2, mem_used_mib=1, mem_total_mib=2, load1=1.0, cpu_pressure_pct=30.0)
GPUS = [gpu(0, 60, 960), gpu(1, 80, 500)]
MODELS = [model(1, 10.0, 0.02, 600.0, 32), model(2, 30.0, 0.0, 150.0, 32)]


def test_components_follow_the_documented_definitions() -> None:
    c = components(HOST, GPUS, MODELS, CONFIG, queue=0.3)
    assert c.gpu_util == pytest.approx(0.7)  # mean of 60 % and 80 %
    assert c.gpu_memory == pytest.approx(0.2)  # fullest is 0.96: (0.96 - 0.95) / 0.05
    assert c.queue == pytest.approx(0.3)  # QueueGauge's figure, as given
    assert c.errors == pytest.approx(0.1)  # (0.02 * 10 + 0 * 30) / 40 = 0.005, / 0.05
    assert c.in_flight == pytest.approx(0.5)  # 64 / (64 per GPU * 2 GPUs)
    assert c.cpu == pytest.approx(0.3)  # PSI 30 % beats 20 % utilisation
    assert c.gpu_failed == 0


def test_score_is_the_weighted_blend() -> None:
    c = components(HOST, GPUS, MODELS, CONFIG, queue=0.3)
    # 0.35*0.7 + 0.10*0.2 + 0.25*0.3 + 0.10*0.1 + 0.15*0.5 + 0.05*0.3, weights sum to 1
    assert instant_score(c, CONFIG.weights) == pytest.approx(0.44)


def test_custom_weights_change_the_blend() -> None:
    c = components(HOST, GPUS, MODELS, CONFIG, queue=0.3)
    only_gpu = ScoreWeights(gpu_util=1, gpu_memory=0, queue=0, errors=0, in_flight=0, cpu=0)
    assert instant_score(c, only_gpu) == pytest.approx(0.7)


def test_missing_components_leave_the_blend() -> None:
    c = components(HostLoad(0.4, 1, 2, 1.0, None), [], [], CONFIG)
    assert (c.gpu_util, c.gpu_memory, c.queue, c.errors, c.gpu_failed) == (None,) * 5
    # Only in_flight (0) and cpu (0.4) remain: (0.15*0 + 0.05*0.4) / 0.20
    assert instant_score(c, CONFIG.weights) == pytest.approx(0.1)


def test_models_without_traffic_have_no_error_ratio() -> None:
    c = components(HOST, GPUS, [model(1, 0.0, 1.0, 60_000.0, 0)], CONFIG)
    assert c.queue is None and c.errors is None


@pytest.mark.parametrize(
    "c, floor",
    [
        (Components(0.1, 0.0, 0.95, 0.0, 0.0, 0.0, 0.0), 0.95),  # a long queue
        (Components(0.1, 0.0, 0.1, 1.0, 0.0, 0.0, 0.0), 1.0),  # errors at the ceiling
        (Components(0.1, 0.0, None, None, 0.0, 0.0, 0.5), 0.5),  # half the GPUs failed
    ],
)
def test_queue_errors_and_failed_gpus_floor_the_score(c: Components, floor: float) -> None:
    assert instant_score(c, CONFIG.weights) == pytest.approx(floor)


def test_failed_gpu_counts_as_busy_and_full() -> None:
    c = components(HOST, [gpu(0, 0, 0), gpu(1, 0, 0, healthy=False)], [], CONFIG)
    assert (c.gpu_util, c.gpu_memory, c.gpu_failed) == (0.5, 1.0, 0.5)


def test_unknown_gpu_memory_adds_no_pressure() -> None:
    assert components(HOST, [gpu(0, 10, 0, total=0)], [], CONFIG).gpu_memory == 0.0


def test_everything_saturated_scores_one() -> None:
    host = HostLoad(1.0, 2, 2, 99.0, 100.0)
    c = components(host, [gpu(0, 100, 1000)], [model(1, 5.0, 1.0, 60_000.0, 10_000)], CONFIG,
                   queue=1.0)
    assert instant_score(c, CONFIG.weights) == 1.0


@pytest.mark.parametrize(
    "score, state",
    [
        (0.0, NodeState.OK),
        (0.6999, NodeState.OK),
        (0.7, NodeState.DEGRADED),
        (0.8999, NodeState.DEGRADED),
        (0.9, NodeState.OVERLOADED),
        (1.0, NodeState.OVERLOADED),
    ],
)
def test_watermarks(score: float, state: NodeState) -> None:
    assert state_for(score, False, CONFIG) is state


@pytest.mark.parametrize("score", [0.0, 0.8, 1.0])
def test_draining_overrides_watermarks(score: float) -> None:
    assert state_for(score, True, CONFIG) is NodeState.DRAINING


def test_watermarks_are_configurable() -> None:
    config = ScoreConfig(degraded_at=0.5, overloaded_at=0.6)
    assert [state_for(s, False, config) for s in (0.49, 0.5, 0.6)] == [NodeState.OK, NodeState.DEGRADED, NodeState.OVERLOADED]


def test_smoother_takes_first_sample_then_halves_per_half_life() -> None:
    s = ScoreSmoother(half_life_s=3.0)
    assert s.update(0.0, now_s=100.0) == 0.0
    assert s.update(1.0, now_s=103.0) == pytest.approx(0.5)
    assert s.update(1.0, now_s=106.0) == pytest.approx(0.75)


def test_recent_samples_weigh_most() -> None:
    s = ScoreSmoother(half_life_s=3.0)
    for t, v in enumerate([1.0] * 10 + [0.0] * 5):
        value = s.update(v, now_s=float(t))
    assert value < 0.5


@given(
    st.floats(0, 1),
    st.floats(0, 1),
    st.floats(0, 30),
    st.floats(0, 30),
)
def test_smoothing_is_independent_of_tick_spacing(start: float, x: float, dt1: float, dt2: float) -> None:
    one_step = ScoreSmoother(3.0)
    one_step.update(start, 0.0)
    two_steps = ScoreSmoother(3.0)
    two_steps.update(start, 0.0)
    two_steps.update(x, dt1)
    assert two_steps.update(x, dt1 + dt2) == pytest.approx(one_step.update(x, dt1 + dt2), abs=1e-12)


def test_clock_going_back_adds_no_weight() -> None:
    s = ScoreSmoother(3.0)
    s.update(0.2, now_s=10.0)
    assert s.update(1.0, now_s=5.0) == 0.2


@pytest.mark.parametrize(
    "make",
    [
        lambda: ScoreWeights(gpu_util=-0.1),
        lambda: ScoreWeights(0, 0, 0, 0, 0, 0),
        lambda: ScoreWeights(gpu_util=float("nan")),
        lambda: ScoreConfig(degraded_at=0.9, overloaded_at=0.9),
        lambda: ScoreConfig(memory_knee=1.0),
        lambda: ScoreConfig(half_life_s=0),
        lambda: ScoreConfig(error_ratio_ceiling=0),
        lambda: ScoreConfig(in_flight_per_gpu=0),
    ],
)
def test_bad_config_is_refused(make) -> None:
    with pytest.raises(ValueError):
        make()


@dataclass(frozen=True)
class Rates:
    """A window: output tokens per second, requests in flight on average and, of the
    answers that ended in it, their tokens and summed seconds in the server."""

    tokens_per_s: float
    mean_in_flight: float
    e2e_tokens: int = 0
    e2e_s: float = 0.0
    window_tokens: int = 10 * MIN_TOKENS
    model_id: int = 1
    port: int = 8000


def quiet(rate: float = 50.0, **kw: int) -> Rates:
    """One request at a time at `rate` tokens/s: ten answers of 64 tokens ended."""
    return Rates(rate, 1.0, e2e_tokens=640, e2e_s=640 / rate, **kw)


def test_queue_is_the_share_of_the_best_rate_per_request_that_is_lost() -> None:
    gauge = QueueGauge()
    assert gauge.update([Rates(0.0, 0.0)]) is None  # nothing known yet
    assert gauge.update([quiet()]) == 0.0  # one request, 50 tokens/s: the best
    assert gauge.update([Rates(400.0, 8.0)]) == 0.0  # a full batch of 8 at that rate
    # 16 in flight for the same 400 tokens/s: half of them wait
    assert gauge.update([Rates(400.0, 16.0)]) == pytest.approx(0.5)
    assert gauge.figures() == {(1, 8000): QueueFigure(rate=25.0, best=50.0, queue=0.5)}
    assert gauge.update([Rates(400.0, 32.0)]) == pytest.approx(0.75)
    assert gauge.update([Rates(0.0, 0.0)]) == 0.0  # idle again: no queue
    assert gauge.figures() == {(1, 8000): QueueFigure(rate=None, best=50.0, queue=0.0)}


def test_the_best_comes_from_ended_answers_not_from_lumpy_windows() -> None:
    """Answers not streamed: a window that caught more of their ends than its share shows
    a rate above the truth; the ended answers' own times do not."""
    gauge = QueueGauge()
    gauge.update([Rates(64.0, 1.0, e2e_tokens=640, e2e_s=12.8)])  # lucky: 64 tokens/s
    assert gauge.figures()[1, 8000].best == 50.0
    assert gauge.update([Rates(400.0, 16.0)]) == pytest.approx(0.5)


def test_no_queue_figure_before_a_best() -> None:
    gauge = QueueGauge()
    assert gauge.update([Rates(400.0, 16.0)]) is None  # loaded from the start: no best yet
    assert gauge.update([Rates(400.0, 16.0, e2e_tokens=640, e2e_s=25.6)]) == 0.0


def test_queue_is_the_busiest_models_and_each_model_has_its_own_best() -> None:
    gauge = QueueGauge()
    gauge.update([quiet(100.0, model_id=1), quiet(10.0, model_id=2)])
    assert gauge.update([Rates(400.0, 8.0, model_id=1),
                         Rates(10.0, 4.0, model_id=2)]) == pytest.approx(0.75)


def test_a_window_with_too_few_tokens_keeps_the_last_figure() -> None:
    """One long answer not streamed: its tokens come at its end, the window holds none."""
    gauge = QueueGauge()
    gauge.update([quiet()])
    assert gauge.update([Rates(100.0, 4.0)]) == pytest.approx(0.5)
    assert gauge.update([Rates(0.0, 3.0, window_tokens=0)]) == pytest.approx(0.5)
    assert gauge.figures()[1, 8000] == QueueFigure(rate=None, best=50.0, queue=0.5)


@given(st.floats(1, 1e4), st.floats(0.5, 1e3), st.floats(0, 1e4), st.floats(0.5, 1e3),
       st.integers(0, 10**6), st.floats(0, 1e4))
def test_queue_stays_in_0_1(t1: float, n1: float, t2: float, n2: float, tokens: int,
                            seconds: float) -> None:
    gauge = QueueGauge()
    for rates in (Rates(t1, n1, tokens, seconds), Rates(t2, n2, tokens, seconds)):
        q = gauge.update([rates])
        assert q is None or 0.0 <= q <= 1.0

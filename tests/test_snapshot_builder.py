import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadmesh.daemon import render
from loadmesh.daemon.score import ScoreConfig, ScoreWeights
from loadmesh.daemon.snapshot_builder import SnapshotBuilder
from loadmesh.daemon.snapshot_view import snapshot_json
from loadmesh.daemon.versioning import ChangeDetector, VersionClock, VersionStore
from loadmesh.gossip.snapshot import MAX_MODELS, Endpoint, GpuLoad, HostLoad, ModelLoad, NodeState, decode, encode
from loadmesh.model_id import model_id

START_MS = 1_764_500_000_000


@dataclass
class Figures:
    """What a probes reader hands over: ModelLoad-like, not a ModelLoad."""

    model_id: int
    port: int = 8000
    rps: float = 50.0
    failed_ratio: float = 0.0
    p50_ms: float = 100.0
    p99_ms: float = 400.0
    waiting: int = 8
    running: int = 0
    ttft_p99_ms: float = math.nan
    itl_p99_ms: float = math.nan
    tokens_per_s: float = 0.0
    pace_ms: float = math.nan
    window_tokens: int = 0
    mean_in_flight: float = 0.0
    e2e_tokens: int = 0
    e2e_s: float = 0.0


class Clocks:
    def __init__(self) -> None:
        self.ms = START_MS

    def wall_ms(self) -> int:
        return self.ms

    def monotonic(self) -> float:
        return self.ms / 1000

    def tick(self, ms: int = 1000) -> None:
        self.ms += ms


def host(cpu: float = 0.2) -> HostLoad:
    return HostLoad(cpu, 10_000, 64_000, 1.0, None)


def gpus(util: int = 40, healthy: bool = True) -> list[GpuLoad]:
    return [GpuLoad(i, util, 30_000, 80_000, 60, 300, 700, 0, 1, healthy) for i in range(2)]


def builder(clocks: Clocks, state_dir: Path | None = None, **config: object) -> SnapshotBuilder:
    store = VersionStore(state_dir / "version") if state_dir else None
    return SnapshotBuilder(
        node_id="node-a",
        endpoints=[Endpoint("10.0.0.1", 8000)],
        versions=VersionClock(store, now_ms=clocks.wall_ms),
        detector=ChangeDetector(heartbeat_ms=5000),
        score_config=ScoreConfig(**config),
        now_ms=clocks.wall_ms,
        monotonic=clocks.monotonic,
    )


def test_first_build_publishes_urgently_with_seeded_version() -> None:
    clocks = Clocks()
    snap, changed, urgent = builder(clocks).build(host(), gpus(), [Figures(1)])
    assert (changed, urgent) == (True, True)
    assert snap.version == START_MS and snap.timestamp_ms == START_MS
    assert snap.models == (ModelLoad(1, 8000, 50.0, 0.0, 100.0, 400.0, 8, waiting=8),)
    assert decode(encode(snap)) == snap


def test_wobbling_figures_hold_the_version() -> None:
    clocks = Clocks()
    b = builder(clocks)
    first, _, _ = b.build(host(), gpus(40), [Figures(1)])
    for i in range(4):
        clocks.tick()
        wobble = (-1) ** i
        models = [Figures(1, rps=50.0 + 5 * wobble)]
        snap, changed, urgent = b.build(host(0.2 + 0.03 * wobble), gpus(40 + 4 * wobble), models)
        assert (snap, changed, urgent) == (first, False, False)


def test_real_change_moves_the_version_without_urgency() -> None:
    clocks = Clocks()
    b = builder(clocks)
    first, _, _ = b.build(host(), gpus(), [Figures(1)])
    clocks.tick()
    snap, changed, urgent = b.build(host(), gpus(), [Figures(1, rps=200.0)])
    assert (changed, urgent) == (True, False)
    assert snap.version == first.version + 1
    assert snap.models[0].rps == 200.0


def test_slow_drift_moves_the_version_once_it_adds_up() -> None:
    clocks = Clocks()
    b = builder(clocks)
    first, _, _ = b.build(host(), gpus(40), [])
    versions = []
    for util in range(41, 52):  # one point a tick: each step is inside the 10-point band
        clocks.tick(100)
        versions.append(b.build(host(), gpus(util), [])[0].version)
    assert versions[:10] == [first.version] * 10
    assert versions[10] == first.version + 1


def test_heartbeat_moves_the_version() -> None:
    clocks = Clocks()
    b = builder(clocks)
    first, _, _ = b.build(host(), gpus(), [Figures(1)])
    clocks.tick(4999)
    assert b.build(host(), gpus(), [Figures(1)])[1] is False
    clocks.tick(1)
    snap, changed, urgent = b.build(host(), gpus(), [Figures(1)])
    assert (changed, urgent) == (True, False)
    assert snap.version == first.version + 1 and snap.timestamp_ms == START_MS + 5000


@pytest.mark.parametrize(
    "inputs",
    [
        dict(draining=True),
        dict(models=[Figures(1), Figures(2)]),
        dict(models=[]),
        dict(gpus=gpus(healthy=False)[:1] + gpus()[1:]),
    ],
    ids=["draining", "model added", "model removed", "gpu failed"],
)
def test_urgent_changes(inputs: dict) -> None:
    clocks = Clocks()
    b = builder(clocks)
    b.build(host(), gpus(), [Figures(1)])
    clocks.tick()
    args = dict(host=host(), gpus=gpus(), models=[Figures(1)], draining=False) | inputs
    snap, changed, urgent = b.build(**args)
    assert (changed, urgent) == (True, True)
    if inputs.get("draining"):
        assert snap.state is NodeState.DRAINING


def test_score_is_smoothed_and_drives_the_state() -> None:
    clocks = Clocks()
    b = builder(clocks, half_life_s=1.0)
    idle, _, _ = b.build(host(0.0), gpus(0), [])
    assert idle.state is NodeState.OK and idle.score == 0.0
    clocks.tick(0)
    quiet = Figures(1, waiting=0, running=1, tokens_per_s=50.0, window_tokens=500,
                    mean_in_flight=1.0, e2e_tokens=500, e2e_s=10.0)
    b.build(host(0.0), gpus(0), [quiet])  # the model's best rate per request: 50 tokens/s
    # then 128 in flight for next to no tokens: nearly all of them wait
    hot = dict(host=host(1.0), gpus=gpus(100),
               models=[Figures(1, waiting=64, running=64, tokens_per_s=0.001,
                               window_tokens=500, mean_in_flight=128.0)])
    clocks.tick(1000)
    halfway, _, _ = b.build(**hot)
    assert halfway.score == pytest.approx(0.5, abs=1e-4)  # one half-life towards 1.0
    assert halfway.state is NodeState.OK
    clocks.tick(5000)
    saturated, _, urgent = b.build(**hot)
    assert saturated.score >= 0.9 and saturated.state is NodeState.OVERLOADED and urgent


def test_version_survives_restart_with_clock_stepped_back(tmp_path: Path) -> None:
    clocks = Clocks()
    b = builder(clocks, tmp_path)
    for util in (10, 50, 90):
        clocks.tick()
        last, _, _ = b.build(host(), gpus(util), [])
    clocks.ms = START_MS - 3_600_000
    restarted, _, _ = builder(clocks, tmp_path).build(host(), gpus(), [])
    assert restarted.version > last.version


def test_bad_probe_figures_are_bounded() -> None:
    clocks = Clocks()
    snap, _, _ = builder(clocks).build(
        host(), gpus(), [Figures(1, rps=math.nan, failed_ratio=2.0, p50_ms=-1.0, p99_ms=math.inf,
                                 waiting=-3, running=-1, tokens_per_s=math.inf)]
    )
    assert snap.models == (ModelLoad(1, 8000, 0.0, 1.0, 0.0, 0.0, 0),)


def test_too_many_models_keeps_the_busiest() -> None:
    clocks = Clocks()
    figures = [Figures(i, rps=float(i), waiting=0) for i in range(MAX_MODELS + 10)]
    snap, _, _ = builder(clocks).build(host(), gpus(), figures)
    assert sorted(m.model_id for m in snap.models) == list(range(10, MAX_MODELS + 10))


def test_state_follows_the_score_peers_see() -> None:
    # cpu 0.6999 and in_flight 45/64 blend to 0.69996: "ok" as computed, but it travels
    # as 0.7000, and the state must agree with the score on the wire.
    clocks = Clocks()
    weights = ScoreWeights(gpu_util=0, gpu_memory=0, queue=0, errors=0, in_flight=0.019, cpu=1)
    idle_model = Figures(1, rps=0.0, waiting=45)
    snap, _, _ = builder(clocks, weights=weights).build(HostLoad(0.6999, 1, 2, 0.0, None), [], [idle_model])
    assert (snap.score, snap.state) == (0.7, NodeState.DEGRADED)


def test_models_the_server_lists_are_published_before_their_first_request() -> None:
    """GET /v1/models names what the server serves: peers can route it here at once."""
    clocks = Clocks()
    listed = {8000: {model_id("llama"): "llama", model_id("qwen"): "qwen"},
              8001: {model_id("llama"): "llama"}}
    snap, _, _ = builder(clocks).build(host(), gpus(), [Figures(model_id("llama"))], listed=listed)
    keys = {m.key: m for m in snap.models}
    assert set(keys) == {(model_id("llama"), 8000), (model_id("qwen"), 8000), (model_id("llama"), 8001)}
    assert keys[(model_id("llama"), 8000)].rps == 50.0  # its traffic, not a second entry
    assert keys[(model_id("qwen"), 8000)] == ModelLoad(model_id("qwen"), 8000, 0.0, 0.0, 0.0, 0.0, 0)


def test_the_score_inputs_say_why_the_score_is_what_it_is() -> None:
    clocks = Clocks()
    b = builder(clocks)
    assert b.inputs is None
    quiet = Figures(1, waiting=0, running=1, tokens_per_s=50.0, window_tokens=500,
                    mean_in_flight=1.0, e2e_tokens=500, e2e_s=10.0)
    b.build(host(0.1), [], [quiet])
    clocks.tick()
    loaded = Figures(1, waiting=8, running=8, tokens_per_s=200.0, window_tokens=500,
                     mean_in_flight=16.0)
    b.build(host(0.3), [], [loaded])
    inputs = b.inputs
    assert inputs is not None
    # no GPU: its components are left out of the blend, and the queue floors the score
    assert inputs.components.gpu_util is None and inputs.components.cpu == pytest.approx(0.3)
    assert inputs.components.queue == pytest.approx(0.75)  # 12.5 tokens/s against 50
    assert inputs.instant == pytest.approx(0.75)
    assert inputs.queue[1, 8000].rate == pytest.approx(12.5)
    assert inputs.queue[1, 8000].best == pytest.approx(50.0)

    view = snapshot_json(b.published, [], {1: "llama"}, inputs)
    assert view["score_inputs"]["queue"] == [
        {"model": "llama", "port": 8000, "rate_tokens_per_s": pytest.approx(12.5),
         "best_tokens_per_s": pytest.approx(50.0), "queue": pytest.approx(0.75)}]
    assert view["score_inputs"]["components"]["gpu_memory"] is None
    shown = render.snapshot(view)
    assert "queue 0.750" in shown and "unsmoothed 0.750" in shown
    assert "llama" in shown.split("BEST")[1] and "12.5" in shown and "50.0" in shown

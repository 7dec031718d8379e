import asyncio
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadmesh.daemon import gpu_component
from loadmesh.daemon.collectors.gpu import GpuCollector, GpuInfo
from loadmesh.daemon.collectors.host import HostCollector, read_cpu_pressure
from loadmesh.daemon.gpu_component import GpuComponent
from loadmesh.daemon.health import HealthState
from loadmesh.gossip.snapshot import HostLoad

# --- host --------------------------------------------------------------------------------


class FakeCpu:
    """CPU counters that advance by hand: (busy, total) seconds, and a clock."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0.0
        self.total = 0.0

    def run(self, seconds: float, busy_share: float) -> None:
        self.t += seconds
        self.total += seconds
        self.busy += seconds * busy_share

    def times(self) -> tuple[float, float]:
        return self.busy, self.total


def host_collector(cpu: FakeCpu, tmp_path: Path) -> HostCollector:
    return HostCollector(window_s=10.0, pressure_path=tmp_path / "cpu", cpu_times=cpu.times, clock=lambda: cpu.t)


def test_cpu_util_covers_the_sliding_window(tmp_path: Path) -> None:
    cpu = FakeCpu()
    host = host_collector(cpu, tmp_path)
    for _ in range(10):
        cpu.run(1.0, busy_share=1.0)
        host.cpu_util()
    # Five idle seconds: the window now holds 5 busy and 5 idle ones.
    for _ in range(5):
        cpu.run(1.0, busy_share=0.0)
        value = host.cpu_util()
    assert value == pytest.approx(0.5)
    for _ in range(5):
        cpu.run(1.0, busy_share=0.0)
        value = host.cpu_util()
    assert value == pytest.approx(0.0)


def test_cpu_util_spans_the_window_when_sampled_rarely(tmp_path: Path) -> None:
    cpu = FakeCpu()
    host = host_collector(cpu, tmp_path)
    cpu.run(7.0, busy_share=1.0)
    host.cpu_util()
    cpu.run(7.0, busy_share=0.0)
    # No sample is exactly 10 s old: the window reaches back to the newest older one
    # (t=0), so it spans 14 s, half of them busy.
    assert host.cpu_util() == pytest.approx(0.5)


def test_cpu_util_without_elapsed_time_is_zero(tmp_path: Path) -> None:
    cpu = FakeCpu()
    assert host_collector(cpu, tmp_path).cpu_util() == 0.0


PSI = "some avg10=12.34 avg60=1.00 avg300=0.50 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


@pytest.mark.parametrize(
    "content, expected",
    [
        (PSI, 12.34),
        ("full avg10=3.00 avg60=0 avg300=0 total=0\n", None),
        ("some avg10=abc avg60=0\n", None),
        ("", None),
    ],
    ids=["present", "no some line", "malformed", "empty"],
)
def test_cpu_pressure_parse(tmp_path: Path, content: str, expected: float | None) -> None:
    (tmp_path / "cpu").write_text(content)
    assert read_cpu_pressure(tmp_path / "cpu") == expected


def test_cpu_pressure_absent(tmp_path: Path) -> None:
    assert read_cpu_pressure(tmp_path / "nope") is None
    assert read_cpu_pressure(tmp_path) is None  # unreadable, as with psi=0


def test_host_sample_reads_this_host(tmp_path: Path) -> None:
    (tmp_path / "cpu").write_text(PSI)
    sample = HostCollector(pressure_path=tmp_path / "cpu").sample()
    assert isinstance(sample, HostLoad)
    assert 0 < sample.mem_used_mib <= sample.mem_total_mib
    assert 0.0 <= sample.cpu_util <= 1.0
    assert sample.cpu_pressure_pct == 12.0  # held to the whole percent the wire carries


# --- GPU ---------------------------------------------------------------------------------

MIB = 1024 * 1024


class FakeNvml:
    """The slice of pynvml the collector uses, with faults to order: faults maps
    (function name, GPU index) to the NVML error code that call raises."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, count: int = 2, init_error: int | None = None) -> None:
        self.count = count
        self.init_error = init_error
        self.faults: dict[tuple[str, int], int] = {}
        self.shutdowns = 0

    def _maybe_fail(self, name: str, index: int) -> None:
        if (name, index) in self.faults:
            raise pynvml.NVMLError(self.faults[(name, index)])

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._maybe_fail("nvmlDeviceGetHandleByIndex", i)
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        self._maybe_fail("nvmlDeviceGetUUID", h)
        return f"GPU-{h:08x}-0000-0000-0000-000000000000"

    def nvmlDeviceGetName(self, h: int) -> bytes:
        self._maybe_fail("nvmlDeviceGetName", h)
        return b"NVIDIA H100 80GB HBM3"  # older bindings return bytes

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        self._maybe_fail("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=50 + h, memory=20)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        self._maybe_fail("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(used=40_000 * MIB + 123, total=81_559 * MIB, free=0)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        self._maybe_fail("nvmlDeviceGetTemperature", h)
        return 60 + h

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self._maybe_fail("nvmlDeviceGetPowerUsage", h)
        return 350_600  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        self._maybe_fail("nvmlDeviceGetEnforcedPowerLimit", h)
        return 700_000

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        self._maybe_fail("nvmlDeviceGetCurrentClocksEventReasons", h)
        return 0x4

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[object]:
        self._maybe_fail("nvmlDeviceGetComputeRunningProcesses", h)
        return [object(), object()]


SAMPLE_CALLS = [
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetComputeRunningProcesses",
]
UNAVAILABLE = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NO_PERMISSION}


def started(fake: FakeNvml) -> GpuCollector:
    collector = GpuCollector(nvml_module=fake)
    collector.start()
    return collector


def test_reads_every_gpu() -> None:
    collector = started(FakeNvml(count=2))
    assert collector.health == ("ok", "2 GPU(s)")
    assert collector.devices == (
        GpuInfo(0, "GPU-00000000-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3"),
        GpuInfo(1, "GPU-00000001-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3"),
    )
    g0, g1 = collector.sample()
    # Memory is held to three significant digits (docs/snapshot.md).
    assert (g0.index, g0.util_pct, g0.mem_used_mib, g0.mem_total_mib, g0.temp_c) == (0, 50, 40_000, 81_600, 60)
    assert (g0.power_w, g0.power_limit_w, g0.throttle_reasons, g0.processes, g0.healthy) == (351, 700, 0x4, 2, True)
    assert (g1.index, g1.util_pct, g1.temp_c) == (1, 51, 61)


@pytest.mark.parametrize(
    "code, reason",
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
    ],
)
def test_init_failure_turns_collector_off(code: int, reason: str) -> None:
    collector = started(FakeNvml(init_error=code))
    state, why = collector.health
    assert state == "off" and reason in why
    assert collector.sample() == []
    collector.close()


def test_no_gpu_turns_collector_off() -> None:
    fake = FakeNvml(count=0)
    collector = started(fake)
    assert collector.health == ("off", "no GPU found")
    assert collector.sample() == []
    collector.close()
    assert fake.shutdowns == 1


def test_missing_pynvml_turns_collector_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    collector = GpuCollector()
    collector.start()
    assert collector.health[0] == "off"
    assert collector.sample() == []


def test_the_real_nvml_never_raises() -> None:
    # On this machine: off without a driver; on a GPU host: real figures.
    collector = GpuCollector()
    collector.start()
    loads = collector.sample()
    assert collector.health[0] in ("ok", "degraded", "off")
    assert len(loads) == len(collector.devices)
    collector.close()


def test_gpu_failing_mid_run_is_marked_unhealthy_and_recovers() -> None:
    fake = FakeNvml(count=3)
    collector = started(fake)
    fake.faults[("nvmlDeviceGetMemoryInfo", 1)] = pynvml.NVML_ERROR_GPU_IS_LOST
    loads = collector.sample()
    assert [g.healthy for g in loads] == [True, False, True]
    assert loads[1].util_pct == 0 and loads[1].index == 1
    assert collector.health == ("degraded", "gpu 1: GPU is lost")
    fake.faults.clear()
    assert all(g.healthy for g in collector.sample())
    assert collector.health[0] == "ok"


@given(st.sampled_from(SAMPLE_CALLS), st.integers(0, 2), st.sampled_from(sorted(pynvml.NVMLError._errcode_to_string)))
def test_any_nvml_error_on_any_call_stays_inside(call: str, index: int, code: int) -> None:
    fake = FakeNvml(count=3)
    collector = started(fake)
    fake.faults[(call, index)] = code
    loads = collector.sample()
    expected = [True, True, True]
    expected[index] = code in UNAVAILABLE
    assert [g.healthy for g in loads] == expected
    assert collector.health[0] == ("ok" if code in UNAVAILABLE else "degraded")


@pytest.mark.parametrize("call", SAMPLE_CALLS)
def test_unsupported_figure_reads_zero_and_gpu_stays_healthy(call: str) -> None:
    fake = FakeNvml(count=1)
    collector = started(fake)
    healthy = collector.sample()[0]
    fake.faults[(call, 0)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    (degraded,) = collector.sample()
    assert degraded.healthy
    changed = {k for k, v in vars(degraded).items() if v != vars(healthy)[k]}
    assert changed and all(getattr(degraded, k) == 0 for k in changed)


def test_gpu_that_cannot_be_opened_is_retried() -> None:
    fake = FakeNvml(count=2)
    fake.faults[("nvmlDeviceGetHandleByIndex", 0)] = pynvml.NVML_ERROR_UNKNOWN
    collector = started(fake)
    assert collector.health[0] == "degraded"
    assert collector.devices[0] == GpuInfo(0, "", "")
    assert [g.healthy for g in collector.sample()] == [False, True]
    fake.faults.clear()
    assert [g.healthy for g in collector.sample()] == [True, True]
    assert collector.devices[0].uuid.startswith("GPU-00000000")


def test_close_shuts_nvml_down_once() -> None:
    fake = FakeNvml()
    collector = started(fake)
    collector.close()
    collector.close()
    assert fake.shutdowns == 1
    assert collector.health[0] == "off"
    assert collector.sample() == []


class HangingNvml(FakeNvml):
    """NVML whose utilisation call blocks until released: a GPU off the bus."""

    def __init__(self) -> None:
        super().__init__(count=2)
        self.release = threading.Event()
        self.hang = False

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if self.hang:
            self.release.wait(30)
        return super().nvmlDeviceGetUtilizationRates(h)


def test_a_hung_nvml_call_costs_the_tick_a_bounded_wait_and_marks_every_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_component, "SAMPLE_TIMEOUT_S", 0.2)
    fake = HangingNvml()
    gpus = GpuComponent(started(fake))

    async def scenario() -> None:
        assert all(g.healthy for g in await gpus.sample())
        fake.hang = True
        began = time.monotonic()
        loads = await gpus.sample()
        assert [g.healthy for g in loads] == [False, False]
        assert gpus.health().state is HealthState.DEGRADED and "NVML" in gpus.health().reason
        # While the call is stuck, the next ticks do not wait for it, nor start another.
        assert [g.healthy for g in await gpus.sample()] == [False, False]
        assert time.monotonic() - began < 1.0
        fake.hang = False
        fake.release.set()
        for _ in range(50):
            if all(g.healthy for g in await gpus.sample()):
                break
            await asyncio.sleep(0.02)
        assert gpus.health().state is HealthState.OK

    asyncio.run(scenario())

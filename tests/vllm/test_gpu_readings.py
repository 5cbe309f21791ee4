"""Telemetry per profile block as the worker takes it: the GPU readings (fake NVML), the
cool-downs and settles between blocks, and the capture's reading points.

The table's schema 1.2 telemetry metadata and the typed record: tests/core/test_telemetry.py."""

from __future__ import annotations

import sys
import types

import pytest

import tests.vllm.test_capture as tc
from tests.vllm.test_capture import clean, make_manager, start_capture, vllm_sequence  # noqa: F401 - autouse fixture
from dspark_calib.telemetry import Reading, Telemetry
from dspark_calib.vllm import gpu_readings
from dspark_calib.vllm.capture import CaptureDir, Plan
from dspark_calib.vllm.gpu_state import POLL_S, SETTLE_MIN_S, Cooldown, Settle
from dspark_calib.vllm.gpu_readings import GpuReader


def fake_pynvml(log: list, *, fail_init: bool = False, throttle: int = 0) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU = 1, 2, 0

    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")
    m.nvmlInit = init
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    m.nvmlDeviceGetClockInfo = lambda h, c: log.append(("clock", c)) or (1980 if c == 1 else 3201)
    m.nvmlDeviceGetTemperature = lambda h, s: 41 + len(log) % 3
    m.nvmlDeviceGetPowerUsage = lambda h: 312_500
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: throttle
    return m


def test_readings_from_nvml(monkeypatch):
    log: list = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(log, throttle=0x1 | 0x20 | 0x4))
    r = GpuReader(0)
    got = r.read()
    assert r.source == "nvml" and r.note == ""
    assert (got.sm_mhz, got.mem_mhz, got.power_w) == (1980.0, 3201.0, 312.5)
    assert got.throttle == ("hw_slowdown", "sw_thermal")  # 0x1 (idle) is not throttling
    assert got.load1 is not None and got.cpu_s > 0 and got.read_ms >= 0


def test_nvml_failing_falls_back_to_nvidia_smi_or_host_only_and_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], fail_init=True))
    host = GpuReader(0, which=lambda name: None)
    assert host.source == "host" and "Driver Not Loaded" in host.note and "host load only" in host.note
    assert host.read().sm_mhz is None and host.read().load1 is not None

    def smi(cmd, **kw):
        assert cmd[0] == "/bin/nvidia-smi" and cmd[1].startswith("--query-gpu=clocks.sm,clocks.mem")
        return types.SimpleNamespace(stdout="1755, 2619, 55, 401.20, 0x0000000000000020\n")
    monkeypatch.setattr(gpu_readings.subprocess, "run", smi)
    r = GpuReader(0, which=lambda name: "/bin/nvidia-smi")
    got = r.read()
    assert r.source == "nvidia-smi" and (got.sm_mhz, got.temp_c, got.power_w, got.throttle) == (1755, 55, 401.2, ("sw_thermal",))


def test_vllms_own_pynvml_is_used_when_nvidia_ml_py_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    import vllm.third_party

    monkeypatch.setitem(sys.modules, "vllm.third_party.pynvml", fake_pynvml([]))
    monkeypatch.setattr(vllm.third_party, "pynvml", sys.modules["vllm.third_party.pynvml"], raising=False)
    r = GpuReader(0, which=lambda name: None)
    assert r.source == "nvml" and r.note == ""


def test_missing_pynvml_is_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    import vllm.third_party

    monkeypatch.setitem(sys.modules, "vllm.third_party.pynvml", None)  # and vLLM's copy too
    monkeypatch.delattr(vllm.third_party, "pynvml", raising=False)
    r = GpuReader(0, which=lambda name: None)
    assert r.source == "host" and "ModuleNotFoundError" in r.note
    assert r.read().cpu_s is not None


def test_a_failing_reading_loses_the_reading_not_the_profile(monkeypatch):
    mod = fake_pynvml([])
    mod.nvmlDeviceGetPowerUsage = lambda h: (_ for _ in ()).throw(RuntimeError("GPU is lost"))
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    r = GpuReader(0)
    assert r.read().sm_mhz is None and "GPU is lost" in r.note


def test_capture_reads_telemetry_at_block_boundaries_only(monkeypatch, tmp_path):
    """Two readings per block (start, end), taken when the generator resumes between
    yields: never between a yield and the step vLLM times for it."""
    log: list = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(log))
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024, 4096), replays=10, warmup=5))
    seq = vllm_sequence()
    m = make_manager()
    gen = m.batches_to_profile(list(tc.SIZES))
    batches, reads_before = [], []
    for b in gen:
        reads_before.append(len(log) // 2)  # NVML reads two clocks per reading
        batches.append(b)
    per_ctx_blocks = len(batches) // len(seq) // 2
    new_reading = [i for i in range(1, len(batches)) if reads_before[i] != reads_before[i - 1]]
    assert new_reading == list(range(len(seq), len(batches), len(seq)))  # only at a block's first batch
    m.set_initial_cost_curves(tc.random_samples(batches))
    payload = CaptureDir(tmp_path).read_samples(0)
    t = Telemetry.from_json(payload["telemetry"])
    # two per block, and one per cool-down: the fake GPU is cool at once (same power, no throttle)
    assert t.source == "nvml" and len(log) // 2 == 2 * len(t.blocks) + len(t.blocks) - 1
    assert [(b.context_len, b.block) for b in t.blocks] == [
        (ctx, blk) for ctx in (1024, 4096) for blk in range(-payload["schedule"]["warmup_blocks"],
                                                            payload["schedule"]["timed_blocks"])]
    assert len(t.blocks) == 2 * per_ctx_blocks and t.blocks[0].sm_range == (1980.0, 1980.0)


# -- the cool-down: adaptive on NVML readings ---------------------------------------------------------
class Readings:
    """A GpuReader stand-in handing out readings in order."""

    def __init__(self, *readings, source="nvml"):
        self.source, self.left, self.reads = source, list(readings), 0

    def read(self) -> Reading:
        self.reads += 1
        return self.left.pop(0)


def hot(power_w, *throttle):
    return Reading(power_w=power_w, throttle=throttle)


def test_cooldown_ends_at_the_first_reading_under_the_threshold_without_throttle(fake_clock):
    """Baseline 160 W: cool is <= 240 W with none of hw_slowdown, sw_power_cap, hw_power_brake."""
    reader = Readings(hot(600, "hw_slowdown"), hot(200, "sw_power_cap"), hot(200, "hw_power_brake"), hot(250),
                      hot(230, "sw_thermal"), hot(100))
    c = Cooldown(2.0, reader)
    c.baseline(hot(160))
    c.pause()
    assert reader.reads == 5 and len(reader.left) == 1  # stopped at the 5th: other reasons do not hold it
    assert fake_clock.sleeps == pytest.approx([0.25, 0.05, 0.05, 0.05, 0.05])  # 0.25 s before the first poll
    assert c.to_json() == {"seconds": 2.0, "total_s": 0.45, "pauses": 1, "early_exits": 1}


def test_cooldown_never_longer_than_asked_and_short_ones_poll_nothing(fake_clock):
    always_hot = Readings(*[hot(690, "hw_slowdown")] * 100)
    c = Cooldown(0.5, always_hot)
    c.baseline(hot(160))
    c.pause()
    assert sum(fake_clock.sleeps) == pytest.approx(0.5) and max(fake_clock.sleeps) <= 0.25
    assert c.to_json()["early_exits"] == 0 and c.to_json()["total_s"] == 0.5
    fake_clock.sleeps.clear()
    short = Readings(hot(100))
    c = Cooldown(0.2, short)
    c.baseline(hot(160))
    c.pause()
    assert fake_clock.sleeps == [0.2] and short.reads == 0  # under min(0.25 s, cooldown): the fixed sleep


@pytest.mark.parametrize("source,baseline", [("nvidia-smi", hot(160)), ("host", hot(160)), ("nvml", hot(None))])
def test_cooldown_without_nvml_power_is_the_fixed_sleep(fake_clock, source, baseline):
    reader = Readings(hot(100), source=source)
    c = Cooldown(1.5, reader)
    c.baseline(baseline)
    c.pause()
    assert fake_clock.sleeps == [1.5] and reader.reads == 0 and c.to_json()["early_exits"] == 0


@pytest.mark.parametrize("throttle,early", [(0, True), (0x4, False)])
def test_capture_cools_down_on_nvml_readings(monkeypatch, tmp_path, fake_clock, throttle, early):
    """Through the worker: a GPU at its first block's power exits after 0.25 s; one held in
    hw_slowdown waits the whole cool-down. The block's start reading is taken after it."""
    log: list = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(log, throttle=throttle))
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=10, warmup=5, cooldown_s=0.6))
    m = make_manager()
    batches = list(m.batches_to_profile(list(tc.SIZES)))
    m.set_initial_cost_curves(tc.random_samples(batches))
    payload = CaptureDir(tmp_path).read_samples(0)
    pauses = len(Telemetry.from_json(payload["telemetry"]).blocks) - 1
    assert pauses == 2 and sum(fake_clock.sleeps) == pytest.approx(pauses * (0.25 if early else 0.6))
    assert payload["cooldown"] == {"seconds": 0.6, "total_s": round(pauses * (0.25 if early else 0.6), 3),
                                   "pauses": pauses, "early_exits": pauses if early else 0}


def test_nvml_index_follows_the_workers_own_device(monkeypatch):
    """NVML ignores CUDA_VISIBLE_DEVICES: the worker's current CUDA device, mapped by vLLM's own
    platform code, names the GPU (a dense DP replica on visible device 1 is not device 0)."""
    import torch
    from vllm.platforms import current_platform

    from dspark_calib.vllm.gpu_readings import nvml_index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(type(current_platform), "visible_device_id_to_physical_device_id",
                        classmethod(lambda cls, i: [3, 5][i]), raising=False)
    assert nvml_index() == 5

    def no_cuda():
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,7")
    assert nvml_index() == 2


# -- the settle (serving state): load until the readings are steady ----------------------------------
class Drawn:
    """A GpuReader stand-in whose k-th reading is reading(k)."""

    def __init__(self, reading, source="nvml"):
        self.source, self.reading, self.reads = source, reading, 0

    def read(self) -> Reading:
        self.reads += 1
        return self.reading(self.reads - 1)


def settle_steps(settle, clock, step_s):
    """The settle steps one block gets, each taking step_s of the fake clock (the GPU's work)."""
    settle.begin()
    steps = 0
    while settle.more():
        steps += 1
        clock.t += step_s
    return steps


def test_settle_ends_once_clock_and_power_hold_still_never_before_the_minimum(fake_clock):
    """Constant readings are steady at once, but the load runs SETTLE_MIN_S first; readings are
    taken at most every POLL_S however short the steps."""
    reader = Drawn(lambda k: Reading(sm_mhz=1530.0, power_w=699.0))
    s = Settle(5.0, reader)
    steps = settle_steps(s, fake_clock, 0.02)
    assert fake_clock.t == pytest.approx(SETTLE_MIN_S, abs=0.03) and steps == pytest.approx(SETTLE_MIN_S / 0.02, abs=2)
    assert reader.reads <= fake_clock.t / POLL_S + 1 < steps
    assert s.to_json() == {"seconds": 5.0, "total_s": round(s.settles[0].seconds, 3), "settles": 1, "steps": steps,
                           "early_exits": 1}
    assert fake_clock.sleeps == []  # load, never a pause


@pytest.mark.parametrize("reading", [
    lambda k: Reading(sm_mhz=1500.0 + 45 * (k % 2), power_w=699.0),  # the clock still hunting
    lambda k: Reading(sm_mhz=1980.0 - min(k, 400), power_w=400.0 + 10 * k),  # still heating up
    lambda k: Reading(sm_mhz=None, power_w=None),  # NVML said nothing
])
def test_settle_runs_its_whole_time_while_readings_move(fake_clock, reading):
    s = Settle(2.0, Drawn(reading))
    steps = settle_steps(s, fake_clock, 0.125)
    assert steps == 16 and fake_clock.t == 2.0 and s.to_json()["early_exits"] == 0


@pytest.mark.parametrize("source", ["nvidia-smi", "host"])
def test_settle_without_nvml_is_the_full_time_and_reads_nothing(fake_clock, source):
    reader = Drawn(lambda k: Reading(sm_mhz=1530.0, power_w=699.0), source=source)
    s = Settle(1.5, reader)
    assert settle_steps(s, fake_clock, 0.125) == 12 and reader.reads == 0


def test_settle_0_runs_no_step_and_every_rank_follows_rank_0(fake_clock):
    assert settle_steps(Settle(0.0, Drawn(lambda k: Reading())), fake_clock, 0.125) == 0
    said = []  # rank 0's decisions, as the TP broadcast hands them on
    rank0 = Settle(0.5, Drawn(lambda k: Reading()), agree=lambda d: said.append(d) or d)
    heard = iter([True, True, False])
    other = Settle(0.5, None, agree=lambda d: next(heard))
    assert settle_steps(rank0, fake_clock, 0.125) == 4 and said == [True] * 4 + [False]
    assert settle_steps(other, fake_clock, 0.125) == 2 and other.settles == []  # only rank 0 records


def test_settle_range_is_one_value_error():
    with pytest.raises(ValueError, match=r"^settle_s must be between 0 and 120 seconds, got 121$"):
        Settle(121, None)

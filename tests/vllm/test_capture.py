"""Capture mode against the installed vLLM's own classes (no GPU): the capture
directory contract, the schedule vLLM-shaped block by block, the fit checked
against vLLM's own set_initial_cost_curves, the sample/batch pairing, and the
tp 4 path with stubbed group calls."""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from vllm.distributed import parallel_state
from vllm.v1.worker.gpu import model_runner
from vllm.v1.worker.gpu.async_utils import StepTimingSample

from dspark_calib.vllm import capture, plugin
from dspark_calib.vllm import runtime
from dspark_calib.vllm.capture import CaptureDir, CaptureError, Plan
from dspark_calib.vllm.gpu_state import DEFAULT_COOLDOWN_S
from tests.helpers import DRAFT, MODEL, REPO

ROOT = str(REPO)
SIZES = [1, 2, 4, 8, 16, 24, 32, 64, 128, 256, 512]  # captured graph sizes; tail 768..8192 follows
VLLM_ORIGINAL = {name: getattr(av.AdaptiveVerificationManager, name)
                 for name in ("batches_to_profile", "set_initial_cost_curves")}


class Group:
    """A TP group of `world` ranks: rank 0 records what it broadcasts, others replay it."""

    def __init__(self, rank=0, world=1, bus=None):
        self.rank_in_group, self.world_size = rank, world
        self.bus = [] if bus is None else bus
        self.calls = 0

    def broadcast_object(self, obj, src=0):
        assert src == 0
        if self.rank_in_group == 0:
            self.bus.append(obj)
            return obj
        self.calls += 1
        return self.bus[self.calls - 1]


def use_group(monkeypatch, group):
    monkeypatch.setattr(av, "get_tp_group", lambda: group)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for key in list(os.environ):
        if key.startswith("DSPARK_CALIB_") or key.startswith("VLLM_RAY_EXTRA_"):
            monkeypatch.delenv(key)
    monkeypatch.delenv("VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN", raising=False)
    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setattr(plugin, "_announced", set())
    use_group(monkeypatch, Group())
    yield
    plugin.unpatch(av.AdaptiveVerificationManager, model_runner)
    for key in list(os.environ):  # register() announces our variables in os.environ itself
        if key.startswith(("DSPARK_CALIB_", "VLLM_RAY_EXTRA_")):
            del os.environ[key]
    for path in list(capture._HELD):
        os.close(capture._HELD.pop(path))


def config():
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(dtype="bfloat16", quantization=None, model=MODEL),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        speculative_config=SimpleNamespace(model=DRAFT))


def make_manager(cls=av.AdaptiveVerificationManager, max_num_reqs=256, max_tokens=8192):
    m = object.__new__(cls)
    m.req_states = SimpleNamespace(max_num_reqs=max_num_reqs, max_num_batched_tokens=max_tokens)
    m.num_speculative_steps = 7
    m._cudagraph_limit = 0
    m.cost_tables = None
    runtime.state_of(m).vllm_config = config()
    return m


def vllm_sequence(sizes=SIZES):
    """What the installed vLLM's own, unpatched batches_to_profile yields."""
    return list(VLLM_ORIGINAL["batches_to_profile"](make_manager(), list(sizes)))


def random_samples(batches, seed=0, warm=None):
    """One sample per batch, noise that never repeats with the batch period; warm-up
    batches (warm[i] true) much slower, so any leak moves a median."""
    rng = np.random.default_rng(seed)
    out = []
    for i, b in enumerate(batches):
        n = b["num_tokens"]
        slow = 50.0 if warm is not None and warm[i] else 0.0
        out.append(StepTimingSample(forward_ms=0.01 * n + b["context_len"] / 1000 + rng.uniform(0, 3) + slow,
                                    drafter_ms=1 + 0.002 * min(n, 256) + rng.uniform(0, 1) + slow,
                                    num_target_tokens=n, num_reqs=min(n, 256), full_cudagraph=n <= SIZES[-1]))
    return out


def start_capture(monkeypatch, directory, plan=None):
    if plan is not None:
        CaptureDir(directory).write_plan(plan)
    monkeypatch.setenv("DSPARK_CALIB_CAPTURE", str(directory))
    plugin.register()
    assert plugin.is_patched(av.AdaptiveVerificationManager)


def run_capture(manager, samples_for=random_samples, sizes=SIZES):
    batches = list(manager.batches_to_profile(list(sizes)))
    samples = samples_for(batches)
    manager.set_initial_cost_curves(samples)
    return batches, samples


def vllm_fit(samples):
    """vLLM's own rule on these samples, through a real manager's set_cost_curves (dense tables)."""
    m = make_manager()
    m._cudagraph_limit = SIZES[-1]
    VLLM_ORIGINAL["set_initial_cost_curves"](m, samples)
    return m.cost_tables


# -- the directory contract ------------------------------------------------------------
def test_capture_dir_round_trips_and_names_its_files(tmp_path):
    d = CaptureDir(tmp_path)
    d.write_plan(Plan(context_lens=(1024, 8192), replays=7, warmup=1))
    assert d.read_plan() == Plan(context_lens=(1024, 8192), replays=7, warmup=1)
    assert d.samples_path(2) == str(tmp_path / "samples-rank2.json")
    assert d.read_samples(0) is None and d.read_refusal() is None and d.read_progress() is None
    assert d.write_refusal("vLLM said no") and d.read_refusal() == "vLLM said no"
    d.write_progress(3, 10, 1024)
    assert d.read_progress() == {"done": 3, "total": 10, "context_len": 1024}


def test_bad_plan_is_one_line(tmp_path):
    (tmp_path / "plan.json").write_text('{"context_lens": [0], "replays": 1, "warmup": 0}')
    with pytest.raises(CaptureError) as err:
        CaptureDir(tmp_path).read_plan()
    assert str(tmp_path) in str(err.value) and "plan.json" in str(err.value) and "\n" not in str(err.value)


def _hold_lock_elsewhere(directory):
    code = ("import sys; from dspark_calib.vllm.capture import CaptureDir; CaptureDir(sys.argv[1]).lock();"
            "print('locked', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _can_lock_elsewhere(directory) -> bool:
    code = ("import sys; from dspark_calib.vllm.capture import CaptureDir, CaptureError\n"
            "try:\n    CaptureDir(sys.argv[1]).lock()\nexcept CaptureError:\n    sys.exit(3)")
    res = subprocess.run([sys.executable, "-c", code, str(directory)], env={**os.environ, "PYTHONPATH": ROOT})
    return res.returncode == 0


def test_second_engine_capturing_into_the_same_directory_fails_at_once(monkeypatch, tmp_path):
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=1, warmup=0))
    other = _hold_lock_elsewhere(tmp_path)
    try:
        with pytest.raises(CaptureError) as err:
            run_capture(make_manager())
        line = str(err.value)
        assert "\n" not in line and str(tmp_path) in line and "another engine" in line
        assert f"pid {other.pid}" in line
        assert sorted(os.listdir(tmp_path)) == [".lock", "plan.json"]  # nothing written
        assert not CaptureDir(tmp_path).write_refusal("late refusal")  # not into another engine's capture
    finally:
        other.stdin.close()
        other.wait()


def test_capture_holds_the_lock_until_its_samples_are_written(monkeypatch, tmp_path):
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=1, warmup=0))
    m = make_manager()
    gen = m.batches_to_profile(list(SIZES))
    batches = [next(gen)]
    assert not _can_lock_elsewhere(tmp_path)
    batches += list(gen)
    m.set_initial_cost_curves(random_samples(batches))
    assert CaptureDir(tmp_path).read_samples(0) is not None
    assert _can_lock_elsewhere(tmp_path)


# -- the schedule: vLLM's own sequence, block by block -------------------------------------
@pytest.mark.parametrize("replays,warmup,blocks", [(5, 0, (0, 1)), (7, 3, (1, 2)), (20, 2, (1, 4)), (1, 6, (2, 1))])
def test_every_block_is_vllms_own_sequence(monkeypatch, tmp_path, replays, warmup, blocks):
    contexts = (1024, 4096)
    start_capture(monkeypatch, tmp_path, Plan(context_lens=contexts, replays=replays, warmup=warmup))
    seq = vllm_sequence()
    m = make_manager()
    batches, samples = run_capture(m)
    warm, timed = blocks
    assert len(batches) == len(contexts) * (warm + timed) * len(seq)
    for i in range(0, len(batches), len(seq)):
        ctx = contexts[i // (len(seq) * (warm + timed))]
        assert batches[i:i + len(seq)] == [{**b, "context_len": ctx} for b in seq]  # order, grouping, keys
    payload = CaptureDir(tmp_path).read_samples(0)
    assert payload["schedule"] == {"vllm_replays_per_block": av._PROFILE_REPLAYS, "warmup_blocks": warm,
                                   "timed_blocks": timed, "timed_replays_per_size": timed * av._PROFILE_REPLAYS}
    per_size = {}
    for s in payload["samples"]:
        per_size.setdefault((s["context_len"], s["num_target_tokens"]), []).append(s["replay"])
    assert len(per_size) == len(contexts) * len(set(b["num_tokens"] for b in seq))
    assert all(r == list(range(timed * av._PROFILE_REPLAYS)) for r in per_size.values())
    # the samples kept are exactly the timed blocks', in batch order
    timed_idx = [i for i in range(len(batches)) if (i // len(seq)) % (warm + timed) >= warm]
    assert [s["forward_ms"] for s in payload["samples"]] == [samples[i].forward_ms for i in timed_idx]


def test_new_keys_in_vllms_batches_survive(monkeypatch, tmp_path):
    """vLLM main adds `timing_enabled` to its batches: capture passes its dicts through."""

    class Newer(av.AdaptiveVerificationManager):
        def batches_to_profile(self, capture_sizes):
            for batch in VLLM_ORIGINAL["batches_to_profile"](self, capture_sizes):  # vLLM's, unpatched
                yield {**batch, "timing_enabled": True}

    start_capture(monkeypatch, tmp_path, Plan(context_lens=(2048,), replays=5, warmup=5))
    plugin.unpatch(av.AdaptiveVerificationManager)  # Newer stands in for vLLM's class: patch it alone
    plugin.patch(Newer)
    try:
        batches, _ = run_capture(make_manager(Newer))
    finally:
        plugin.unpatch(Newer)
    assert batches and all(b["timing_enabled"] is True and b["context_len"] == 2048 for b in batches)


# -- curves: vLLM's own fit on the timed samples only -------------------------------------
def test_curves_handed_to_vllm_are_its_own_fit_of_the_timed_samples(monkeypatch, tmp_path):
    contexts = (1024, 8192)
    start_capture(monkeypatch, tmp_path, Plan(context_lens=contexts, replays=10, warmup=5))
    seq_len = len(vllm_sequence())
    m = make_manager()
    batches, samples = run_capture(m, samples_for=lambda b: random_samples(
        b, seed=7, warm=[(i // seq_len) % 3 == 0 for i in range(len(b))]))
    timed = {ctx: [s for i, (s, b) in enumerate(zip(samples, batches))
                   if b["context_len"] == ctx and (i // seq_len) % 3 != 0] for ctx in contexts}
    assert all(len(v) == 2 * seq_len for v in timed.values())
    # vLLM (context 8192, its default) got exactly its own fit of the timed samples: both tables
    want_draft, want_verify = vllm_fit(timed[8192])
    assert np.array_equal(m.cost_tables[0], want_draft) and np.array_equal(m.cost_tables[1], want_verify)
    leaked_draft, leaked_verify = vllm_fit([s for s, b in zip(samples, batches) if b["context_len"] == 8192])
    assert not np.array_equal(leaked_draft, want_draft) and not np.array_equal(leaked_verify, want_verify)
    # and the payload carries vLLM's own curves for every context
    payload = CaptureDir(tmp_path).read_samples(0)
    from dspark_calib.vllm.capture import vllm_curves

    for ctx in contexts:
        draft, verify = vllm_curves(VLLM_ORIGINAL["set_initial_cost_curves"], timed[ctx])
        assert payload["vllm_curves"][str(ctx)] == {"draft": [list(p) for p in draft],
                                                    "verify": [list(p) for p in verify]}


def test_fit_disagreeing_with_vllm_is_one_loud_line_and_no_samples(monkeypatch, tmp_path):
    import dspark_calib.fit as fit

    real = fit.fit_pair

    def off_by_a_bit(samples):
        pair = real(samples)
        cost = np.array(pair.verify.cost_ms)
        cost[3] *= 1.001
        return fit.CurvePair(draft=pair.draft, verify=fit.Curve(**{**{k: getattr(pair.verify, k) for k in (
            "size", "n", "min_ms", "p25_ms", "p75_ms", "max_ms", "mad_ms")}, "cost_ms": cost}))

    monkeypatch.setattr(fit, "fit_pair", off_by_a_bit)
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=5, warmup=0))
    m = make_manager()
    with pytest.raises(CaptureError) as err:
        run_capture(m)
    line = str(err.value)
    assert "\n" not in line and "disagree" in line and "context 1024" in line and "verify size 8" in line
    assert CaptureDir(tmp_path).read_samples(0) is None and m.cost_tables is None
    assert CaptureDir(tmp_path).read_refusal() == line  # what `profile` shows when the engine core is a child process


# -- pairing ------------------------------------------------------------------------------
@pytest.mark.parametrize("disorder", ["reversed", "swap-two", "one-missing"])
def test_samples_out_of_batch_order_are_refused(monkeypatch, tmp_path, disorder):
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=5, warmup=5))

    def shuffled(batches):
        s = random_samples(batches)
        if disorder == "reversed":
            return s[::-1]
        if disorder == "swap-two":  # one size-1 and one size-2 step trade places, late in the run
            i = len(s) - len(vllm_sequence()) + 4
            s[i], s[i + 1] = s[i + 1], s[i]
            return s
        return s[:-1]

    m = make_manager()
    with pytest.raises(CaptureError, match="out of batch order|cannot attribute"):
        run_capture(m, samples_for=shuffled)
    assert CaptureDir(tmp_path).read_samples(0) is None and m.cost_tables is None


def test_a_draft_model_batch_clamped_by_vllm_is_still_its_batch(monkeypatch, tmp_path):
    """vLLM's _dummy_run clamps a batch to max_num_batched_tokens - num_reqs x the speculator's
    extra query slots (a draft model has one: the 8192-token batch runs 7936 tokens on an H200).
    The capture attributes it to its batch and fits what vLLM fits; any other count is refused."""
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=5, warmup=0))

    def clamped(batches):
        out = random_samples(batches)
        return [dataclasses.replace(smp, num_target_tokens=8192 - 256) if b["num_tokens"] == 8192 else smp
                for smp, b in zip(out, batches)]

    m = make_manager()
    _, samples = run_capture(m, samples_for=clamped)
    assert m.cost_tables is not None
    assert all(np.array_equal(a, b) for a, b in zip(m.cost_tables, vllm_fit(samples)))  # vLLM's own fit
    assert 7936 in {int(smp.num_target_tokens) for smp in samples}

    (tmp_path / "other").mkdir()
    start_capture(monkeypatch, tmp_path / "other", Plan(context_lens=(1024,), replays=5, warmup=0))

    def off_by_one(batches):
        out = random_samples(batches)
        return [dataclasses.replace(smp, num_target_tokens=8191) if b["num_tokens"] == 8192 else smp
                for smp, b in zip(out, batches)]

    with pytest.raises(CaptureError, match="reports 8191 tokens for a 8192-token profile batch"):
        run_capture(make_manager(), samples_for=off_by_one)


# -- tensor parallel 4, stubbed group calls -------------------------------------------------
def run_tp4(monkeypatch, tmp_path, plan, run_rank):
    """Four TP ranks one after the other (rank 0's broadcasts replayed to the others): rank 0 in
    the directory holding the plan, the others in their node's view of it (no plan.json there:
    they must not read one). run_rank(manager, rank) runs one rank's capture.
    Returns (rank 0's directory, the others', the broadcasts, each rank's result)."""
    rank0_dir, other_dir = tmp_path / "rank0", tmp_path / "node"
    rank0_dir.mkdir()
    other_dir.mkdir()
    CaptureDir(rank0_dir).write_plan(plan)
    bus: list = []
    runs = []
    for rank in range(4):
        use_group(monkeypatch, Group(rank, 4, bus))
        monkeypatch.setenv("DSPARK_CALIB_CAPTURE", str(rank0_dir if rank == 0 else other_dir))
        plugin.register()
        runs.append(run_rank(make_manager(), rank))
    return rank0_dir, other_dir, bus, runs


def test_tp4_rank0_plan_to_every_rank_same_batches(monkeypatch, tmp_path):
    def run_rank(m, rank):
        return run_capture(m, samples_for=lambda b: random_samples(b, seed=rank))[0], m

    rank0_dir, other_dir, bus, runs = run_tp4(monkeypatch, tmp_path, Plan(context_lens=(1024, 4096), replays=6,
                                                                          warmup=2), run_rank)
    assert isinstance(bus[0], Plan) and bus[0].context_lens == (1024, 4096)
    assert all(batches == runs[0][0] for batches, _ in runs)
    assert len(runs[0][0]) == 2 * (1 + 2) * len(vllm_sequence())
    # vLLM's curve broadcast: every rank installed rank 0's curves
    assert all(np.array_equal(m.cost_tables[1], runs[0][1].cost_tables[1]) for _, m in runs)
    rank0 = CaptureDir(rank0_dir).read_samples(0)
    assert rank0["rank"] == 0 and rank0["tp_size"] == 4
    assert sorted(os.listdir(rank0_dir)) == [".lock", "plan.json", "progress.json", "samples-rank0.json"]
    assert sorted(os.listdir(other_dir)) == ["samples-rank1.json", "samples-rank2.json", "samples-rank3.json"]
    # what `profile` reads is rank 0's samples: its own timings, not another rank's
    first = random_samples(runs[0][0], seed=0)
    timed0 = [s for i, s in enumerate(first) if (i // len(vllm_sequence())) % 3 != 0]
    assert [s["forward_ms"] for s in rank0["samples"]] == [s.forward_ms for s in timed0]


def test_tp4_rank0_refusal_reaches_every_rank(monkeypatch, tmp_path):
    bus: list = []
    for rank in range(4):
        use_group(monkeypatch, Group(rank, 4, bus))
        monkeypatch.setenv("DSPARK_CALIB_CAPTURE", str(tmp_path))  # no plan.json: rank 0 refuses
        plugin.register()
        with pytest.raises(CaptureError, match="plan.json"):
            run_capture(make_manager())
    assert isinstance(bus[0], str) and "plan.json" in bus[0]
    assert _can_lock_elsewhere(tmp_path)  # the refusal released rank 0's lock
    # the engine core is a child process: its one line waits in the directory for `profile`
    assert CaptureDir(str(tmp_path)).read_refusal() == bus[0]


def test_capture_payload_is_json(monkeypatch, tmp_path):
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=5, warmup=0))
    m = make_manager()
    run_capture(m)
    assert {k for k in vars(m) if "dspark" in k} == {runtime.STATE_ATTR}  # one state object, nothing scattered
    payload = json.loads((tmp_path / "samples-rank0.json").read_text())
    assert payload["num_batches"] == len(vllm_sequence()) and payload["cudagraph_limit"] == SIZES[-1]
    assert payload["engine"]["max_num_seqs"] == 256


# -- the cool-down between blocks ------------------------------------------------------------
def no_nvml(monkeypatch):
    """Neither nvidia-ml-py nor vLLM's copy: the reader is nvidia-smi or host-only, never NVML."""
    import vllm.third_party

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "vllm.third_party.pynvml", None)
    monkeypatch.delattr(vllm.third_party, "pynvml", raising=False)


def sleeps_before_each_batch(manager, clock):
    """Every batch, and how many sleeps had happened when the generator handed it out."""
    batches, before = [], []
    for batch in manager.batches_to_profile(list(SIZES)):
        before.append(len(clock.sleeps))
        batches.append(batch)
    return batches, before


@pytest.mark.parametrize("cooldown", [DEFAULT_COOLDOWN_S, 0.4])
def test_fixed_cooldown_before_every_block_but_the_captures_first(monkeypatch, tmp_path, fake_clock, cooldown):
    no_nvml(monkeypatch)
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024, 4096), replays=10, warmup=5, cooldown_s=cooldown))
    m = make_manager()
    batches, before = sleeps_before_each_batch(m, fake_clock)
    block_starts = list(range(0, len(batches), len(vllm_sequence())))
    assert len(block_starts) == 2 * 3  # per context: 1 warm-up + 2 timed blocks
    # a sleep only between a block's last step and the next block's first, the next context's included
    assert before[0] == 0 and [i for i in range(1, len(batches)) if before[i] != before[i - 1]] == block_starts[1:]
    assert fake_clock.sleeps == [cooldown] * 5  # no NVML: one fixed sleep each
    m.set_initial_cost_curves(random_samples(batches))
    payload = CaptureDir(tmp_path).read_samples(0)
    assert payload["plan"]["cooldown_s"] == cooldown
    assert payload["cooldown"] == {"seconds": cooldown, "total_s": round(5 * cooldown, 3), "pauses": 5,
                                   "early_exits": 0}


def test_cooldown_0_never_sleeps(monkeypatch, tmp_path, fake_clock):
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024, 4096), replays=10, warmup=5, cooldown_s=0))
    run_capture(make_manager())
    assert fake_clock.sleeps == []
    assert CaptureDir(tmp_path).read_samples(0)["cooldown"] == {"seconds": 0.0, "total_s": 0.0, "pauses": 0,
                                                                "early_exits": 0}


@pytest.mark.parametrize("bad", [-0.5, 60.01, float("nan"), float("inf")])
def test_plan_cooldown_out_of_range_is_one_value_error(bad):
    with pytest.raises(ValueError) as err:
        Plan(context_lens=(1024,), cooldown_s=bad)
    assert str(err.value).startswith("cooldown_s must be between 0 and 60 seconds") and "\n" not in str(err.value)
    assert Plan((1024,), cooldown_s=0).cooldown_s == 0.0 and Plan((1024,), cooldown_s=60).cooldown_s == 60.0


def test_plan_json_carries_the_cooldown_and_an_older_one_reads_as_the_default(tmp_path):
    d = CaptureDir(tmp_path)
    d.write_plan(Plan(context_lens=(1024,), replays=5, warmup=0, cooldown_s=2.5))
    assert json.loads((tmp_path / "plan.json").read_text())["cooldown_s"] == 2.5
    assert d.read_plan() == Plan(context_lens=(1024,), replays=5, warmup=0, cooldown_s=2.5)
    (tmp_path / "plan.json").write_text(json.dumps({"context_lens": [1024], "replays": 20, "warmup": 2}))
    assert d.read_plan().cooldown_s == DEFAULT_COOLDOWN_S == 1.0  # written by a dspark-calib before the field
    (tmp_path / "plan.json").write_text(json.dumps({"context_lens": [1024], "replays": 20, "warmup": 2,
                                                    "cooldown_s": 600}))
    with pytest.raises(CaptureError) as err:
        d.read_plan()
    assert "cooldown_s must be between 0 and 60" in str(err.value) and "\n" not in str(err.value)


# -- the serving state: settle steps before every block -----------------------------------------------
def steps_taking(manager, clock, step_s=0.125):
    """Every batch handed out, each moving the fake clock step_s (the GPU's work)."""
    batches = []
    for batch in manager.batches_to_profile(list(SIZES)):
        clock.t += step_s
        batches.append(batch)
    return batches


SERVING = Plan(context_lens=(1024, 4096), replays=10, warmup=5, gpu_state="serving", settle_s=0.5)


def test_serving_state_settles_under_the_heaviest_step_before_every_block(monkeypatch, tmp_path, fake_clock):
    """Before each block, the first included: the largest batch of vLLM's sequence at the block's
    context, back to back for the settle time (no NVML: the whole of it), never a pause. vLLM
    times those steps too; none of them is a sample, and vLLM's fallback fit sees timed ones only."""
    no_nvml(monkeypatch)
    start_capture(monkeypatch, tmp_path, SERVING)
    m = make_manager()
    batches = steps_taking(m, fake_clock)
    seq = vllm_sequence()
    heaviest = max(b["num_tokens"] for b in seq)
    expected = [b for ctx in (1024, 4096) for _ in range(3)
                for b in [{"num_tokens": heaviest, "context_len": ctx}] * 4 + [{**x, "context_len": ctx} for x in seq]]
    assert batches == expected and fake_clock.sleeps == []
    samples = random_samples(batches)
    m.set_initial_cost_curves(samples)
    payload = CaptureDir(tmp_path).read_samples(0)
    assert payload["plan"]["gpu_state"] == "serving" and "cooldown" not in payload
    assert payload["settle"] == {"seconds": 0.5, "total_s": 3.0, "settles": 6, "steps": 24, "early_exits": 0}
    unit = 4 + len(seq)  # a block's settle steps, then the block (1 warm-up and 2 timed blocks per context)
    timed = [i for i in range(len(batches)) if i % unit >= 4 and (i // unit) % 3 != 0]
    assert [s["forward_ms"] for s in payload["samples"]] == [samples[i].forward_ms for i in timed]
    at_4096 = [samples[i] for i in timed if batches[i]["context_len"] == 4096]
    assert all(np.array_equal(a, b) for a, b in zip(m.cost_tables, vllm_fit(at_4096)))
    assert payload["num_batches"] == len(batches)


def test_serving_state_tp4_every_rank_runs_rank_0s_settle_steps(monkeypatch, tmp_path, fake_clock):
    def run_rank(m, rank):
        batches = steps_taking(m, fake_clock, 0.125 if rank == 0 else 1.0)  # only rank 0's clock decides
        m.set_initial_cost_curves(random_samples(batches, seed=rank))
        return batches

    no_nvml(monkeypatch)
    rank0_dir, other_dir, bus, runs = run_tp4(monkeypatch, tmp_path, SERVING, run_rank)
    assert all(r == runs[0] for r in runs) and len(runs[0]) == 6 * (4 + len(vllm_sequence()))
    decisions = ([True] * 4 + [False]) * 6
    assert bus[1:1 + len(decisions)] == decisions  # the plan, each settle step's decision, then vLLM's curves
    assert "settle" in CaptureDir(rank0_dir).read_samples(0)
    assert "settle" not in CaptureDir(other_dir).read_samples(1)


def test_plan_json_carries_the_gpu_state(tmp_path):
    d = CaptureDir(tmp_path)
    d.write_plan(SERVING)
    assert d.read_plan() == SERVING
    with pytest.raises(ValueError, match="^gpu_state must be one of startup, serving, got 'idle'$"):
        Plan(context_lens=(1024,), gpu_state="idle")


def test_no_batch_from_vllm_is_left_for_profile_in_the_capture_dir(monkeypatch, tmp_path):
    """The engine core is a child process: 'yielded no batch' must reach `profile` via refusal.txt."""
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=5, warmup=0))
    with pytest.raises(CaptureError, match="yielded no batch") as err:
        run_capture(make_manager(), sizes=[])
    assert CaptureDir(tmp_path).read_refusal() == str(err.value)


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "fifo"])
def test_a_lock_file_that_is_not_a_regular_file_is_one_line(tmp_path, kind):
    """The lock never follows a symlink (its target would be truncated) and never opens a FIFO
    (ftruncate fails on it): a CaptureError naming the directory, the target left as it was."""
    target = tmp_path / "precious.txt"
    if kind == "fifo":
        os.mkfifo(tmp_path / ".lock")
    else:
        if kind == "symlink":
            target.write_text("keep me")
        os.symlink(target, tmp_path / ".lock")
    with pytest.raises(CaptureError) as err:
        CaptureDir(tmp_path).lock()
    line = str(err.value)
    assert "\n" not in line and str(tmp_path) in line and ".lock" in line
    assert ("symlink" in line) if kind != "fifo" else ("FIFO" in line)
    assert not CaptureDir(tmp_path).locked
    if kind == "symlink":
        assert target.read_text() == "keep me"
    if kind == "dangling symlink":
        assert not target.exists()


# -- shape blocks: the uniform-decode verify shape, kept apart -------------------------------
def shaped_samples(batches, seed=3):
    """random_samples, with vLLM's uniform-decode request count (size / (k + 1)) for shape batches
    and a much slower step, so any leak into a curve or vLLM's fit moves a median."""
    out = random_samples(batches, seed=seed)
    return [dataclasses.replace(s, num_reqs=b["num_tokens"] // 8, forward_ms=s.forward_ms + 100.0)
            if b.get("uniform_decode") else s for s, b in zip(out, batches)]


def test_shape_blocks_time_the_uniform_decode_shape_after_each_context_and_stay_out_of_the_curves(
        monkeypatch, tmp_path):
    contexts = (1024, 4096)
    start_capture(monkeypatch, tmp_path, Plan(context_lens=contexts, replays=5, warmup=0, shape_replays=3))
    seq = vllm_sequence()
    m = make_manager()  # k = 7: a uniform-decode request is 8 tokens, at most 256 of them
    batches, samples = run_capture(m, samples_for=shaped_samples)
    # above the 512 capture limit, fewer requests than the profile's min(N, 256): 768 and 1024 (2048 is
    # 256 requests of 8 tokens either way)
    sizes = [n for n in dict.fromkeys(b["num_tokens"] for b in seq) if n > 512 and n % 8 == 0 and n // 8 < min(n, 256)]
    assert sizes == [768, 1024]
    shape = [{**next(b for b in seq if b["num_tokens"] == n), "uniform_decode": True} for n in sizes for _ in range(3)]
    assert batches == [{**b, "context_len": ctx} for ctx in contexts for b in seq + shape]
    payload = CaptureDir(tmp_path).read_samples(0)
    assert payload["num_batches"] == len(batches) and payload["plan"]["shape_replays"] == 3
    regular = [i for i, b in enumerate(batches) if not b.get("uniform_decode")]
    assert [s["forward_ms"] for s in payload["samples"]] == [samples[i].forward_ms for i in regular]
    kept = payload["shape_samples"]
    assert len(kept) == len(contexts) * len(sizes) * 3
    assert (payload["shape_query_len"], payload["shape_other_batches"]) == (8, 0)
    assert all(s["num_reqs"] == s["num_target_tokens"] // 8 for s in kept)
    assert [s["replay"] for s in kept[:3]] == [0, 1, 2] and {s["context_len"] for s in kept} == set(contexts)
    # vLLM's own fit (context 4096, nearest its 8192) saw the regular timed samples only
    at_4096 = [samples[i] for i in regular if batches[i]["context_len"] == 4096]
    assert all(np.array_equal(a, b) for a, b in zip(m.cost_tables, vllm_fit(at_4096)))


def test_a_shape_step_vllm_ran_as_another_batch_is_kept_out_and_counted(monkeypatch, tmp_path):
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=5, warmup=0, shape_replays=2))
    m = make_manager()

    def one_other(batches):  # the first shape step recorded at the profile's request count
        out = shaped_samples(batches)
        i = next(i for i, b in enumerate(batches) if b.get("uniform_decode"))
        out[i] = dataclasses.replace(out[i], num_reqs=256)
        return out

    run_capture(m, samples_for=one_other)
    payload = CaptureDir(tmp_path).read_samples(0)
    assert payload["shape_other_batches"] == 1 and len(payload["shape_samples"]) == 2 * 2 - 1
    assert all(s["num_reqs"] * 8 == s["num_target_tokens"] for s in payload["shape_samples"])


def test_no_shape_block_without_shape_replays_and_the_plan_reads_an_older_file_as_none(monkeypatch, tmp_path):
    start_capture(monkeypatch, tmp_path, Plan(context_lens=(1024,), replays=5, warmup=0))
    batches, _ = run_capture(make_manager())
    assert not any(b.get("uniform_decode") for b in batches)
    assert "shape_samples" not in CaptureDir(tmp_path).read_samples(0)
    older = tmp_path / "older"
    older.mkdir()
    (older / "plan.json").write_text(json.dumps({"context_lens": [1024], "replays": 5, "warmup": 0}))
    assert CaptureDir(older).read_plan().shape_replays == 0
    with pytest.raises(ValueError, match="shape replays"):
        Plan(context_lens=(1024,), shape_replays=-1)

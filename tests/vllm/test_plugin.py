"""The vLLM plugin against the real installed vLLM classes (no GPU needed).

A manager is built with object.__new__ and the attributes the profiling path
reads; the TP group is stubbed as a single rank.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from vllm.v1.worker.gpu import model_runner
from vllm.v1.worker.gpu.async_utils import StepTimingSample

from dspark_calib.fingerprint import config_hash
from dspark_calib.reference import table_from_startup_json
from dspark_calib.table.file import write_table
from dspark_calib.vllm import plugin, shape
from dspark_calib.vllm import runtime
from dspark_calib.vllm.capture import CaptureDir, Plan
from tests.helpers import DRAFT, MODEL, REPO
from dspark_calib.vllm.profile.plan import ProfileOptions
from dspark_calib.vllm.profile.table import table_from_capture

ROOT = str(REPO)
FIXTURES = sorted(glob.glob(os.path.join(ROOT, "tests", "data", "*.json")))
ENV_KEYS = ("DSPARK_CALIB_TABLE", "DSPARK_CALIB_CAPTURE", "DSPARK_CALIB_POLICY", "DSPARK_CALIB_CONTEXT_LEN",
            "DSPARK_CALIB_ALLOW_REFERENCE", "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN")


def is_context_aware_line(msg: str) -> bool:
    """Context-aware mode's own line after a load of a multi-context table (test_context_aware tests it)."""
    return msg.startswith("dspark-calib: context-aware costs")


class SingleRank:
    rank_in_group = 0
    world_size = 1

    def broadcast_object(self, obj, src=0):
        return obj


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(av, "get_tp_group", lambda: SingleRank())
    yield
    plugin.unpatch(av.AdaptiveVerificationManager, model_runner)
    for key in ("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"):
        os.environ.pop(key, None)  # register() announces DSPARK_CALIB_* there for Ray workers


@pytest.fixture(scope="module")
def recorded():
    return [json.load(open(p)) for p in FIXTURES]


@pytest.fixture(scope="module")
def reference_table():
    return table_from_startup_json(FIXTURES, model=MODEL, draft=DRAFT, gpu_name="NVIDIA H200",
                                   vllm_version="0.33.0", num_speculative_tokens=7)


def fake_config(dtype="bfloat16", tp=1, model=MODEL, draft=DRAFT):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(dtype=dtype, quantization=None, model=model),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        speculative_config=SimpleNamespace(model=draft),
    )


def make_manager(max_num_reqs=256, max_tokens=8192, steps=7, config=None):
    m = object.__new__(av.AdaptiveVerificationManager)
    m.req_states = SimpleNamespace(max_num_reqs=max_num_reqs, max_num_batched_tokens=max_tokens)
    m.num_speculative_steps = steps
    m._cudagraph_limit = 0
    m.cost_tables = None
    runtime.state_of(m).vllm_config = fake_config() if config is None else config  # as the factory wrapper does
    return m


def fake_samples(batches, max_num_reqs=256, limit=512):
    """One StepTimingSample per batch, as vLLM's collector would produce in batch order."""
    out = []
    for i, b in enumerate(batches):
        n, ctx = b["num_tokens"], b["context_len"]
        out.append(StepTimingSample(forward_ms=0.01 * n + ctx / 1000 + (i % 7) * 1e-3,
                                    drafter_ms=1 + 0.002 * min(n, max_num_reqs) + (i % 3) * 1e-3,
                                    num_target_tokens=n, num_reqs=min(n, max_num_reqs), full_cudagraph=n <= limit))
    return out


def register_with(monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    plugin.register()


# -- patching -------------------------------------------------------------------------
def test_register_without_env_patches_and_vllm_profiles_exactly_as_its_own(caplog):
    """Without any DSPARK_CALIB_* the patch is there (a data-parallel replica must still vote), but
    vLLM's own batches run and its own curves are installed, and nothing is logged."""
    stock = make_manager()
    sizes = [1, 2, 4, 8]
    vllm_batches = list(stock.batches_to_profile(sizes))
    av.AdaptiveVerificationManager.set_initial_cost_curves(stock, fake_samples(vllm_batches))
    with caplog.at_level(logging.DEBUG, logger="vllm.dspark_calib"):
        plugin.register()
        assert plugin.is_patched(av.AdaptiveVerificationManager)
        m = make_manager()
        batches = _run_profile_path(m, sizes)
    assert batches == vllm_batches
    assert all(np.array_equal(a, b) for a, b in zip(m.cost_tables, stock.cost_tables))
    assert [r for r in caplog.records if r.name == "vllm.dspark_calib"] == []


def test_without_env_an_unknown_api_shape_is_left_without_a_word(monkeypatch, caplog):
    monkeypatch.setattr(shape, "detect", lambda: shape.ApiShape(None, "consume_step_timing exists", "0.99.0"))
    monkeypatch.setattr(runtime, "_logged", set())
    before = av.AdaptiveVerificationManager.batches_to_profile
    with caplog.at_level(logging.DEBUG, logger="vllm.dspark_calib"):
        plugin.register()
    assert av.AdaptiveVerificationManager.batches_to_profile is before
    assert [r for r in caplog.records if r.name == "vllm.dspark_calib"] == []


def test_register_is_idempotent(monkeypatch, tmp_path):
    register_with(monkeypatch, DSPARK_CALIB_TABLE=tmp_path)
    first = (av.AdaptiveVerificationManager.batches_to_profile, av.AdaptiveVerificationManager.set_initial_cost_curves,
             model_runner.maybe_create_adaptive_verification_manager)
    plugin.register()
    plugin.register()
    assert plugin.is_patched(av.AdaptiveVerificationManager)
    assert (av.AdaptiveVerificationManager.batches_to_profile, av.AdaptiveVerificationManager.set_initial_cost_curves,
            model_runner.maybe_create_adaptive_verification_manager) == first
    # one wrapper deep: the original behind it is vLLM's own function
    inner = getattr(av.AdaptiveVerificationManager.batches_to_profile, runtime.MARK)
    assert not hasattr(inner, runtime.MARK)
    factory = getattr(model_runner.maybe_create_adaptive_verification_manager, runtime.MARK)
    assert factory is av.maybe_create_adaptive_verification_manager


def test_factory_hands_manager_the_engine_config(monkeypatch, tmp_path):
    register_with(monkeypatch, DSPARK_CALIB_TABLE=tmp_path)
    config = fake_config()
    made = model_runner.maybe_create_adaptive_verification_manager(
        enable_adaptive_verification=False, attn_groups=[], req_states=None, query_start_loc=None,
        num_bonus_tokens=1, max_total_logits=1, vllm_config=config)
    assert made is None  # disabled: vLLM's own factory returns nothing, and we add nothing


def test_capture_mode_records_vllms_refusal(monkeypatch, tmp_path):
    def refusing(*args, vllm_config=None, **kwargs):
        raise ValueError("Adaptive verification replays decode cudagraphs whose per-request query lengths vary")

    monkeypatch.setattr(model_runner, "maybe_create_adaptive_verification_manager", refusing)
    register_with(monkeypatch, DSPARK_CALIB_CAPTURE=tmp_path)
    with pytest.raises(ValueError):
        model_runner.maybe_create_adaptive_verification_manager(vllm_config=None)
    assert (tmp_path / "refusal.txt").read_text().startswith("Adaptive verification replays")


@pytest.mark.slow
def test_register_patches_only_when_the_model_runner_is_imported(tmp_path):
    """In a process that has not imported vLLM's model runner (the API server), register()
    imports nothing heavy; the patch lands when the worker imports the runner."""
    code = (
        "import sys; from dspark_calib.vllm import plugin; plugin.register();"
        "assert plugin.MODEL_RUNNER not in sys.modules;"
        "from vllm.v1.worker.gpu import model_runner;"
        "from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av;"
        "assert plugin.is_patched(av.AdaptiveVerificationManager);"
        "from dspark_calib.vllm import runtime;"
        "assert hasattr(model_runner.maybe_create_adaptive_verification_manager, runtime.MARK);"
        "print('ok')"
    )
    env = {**os.environ, "DSPARK_CALIB_TABLE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok")


def test_unknown_api_shape_leaves_vllm_untouched(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(shape, "detect", lambda: shape.ApiShape(None, "consume_step_timing exists", "0.99.0"))
    monkeypatch.setattr(runtime, "_logged", set())
    before = av.AdaptiveVerificationManager.batches_to_profile
    with caplog.at_level(logging.WARNING, logger="vllm.dspark_calib"):
        register_with(monkeypatch, DSPARK_CALIB_TABLE=tmp_path)
    assert av.AdaptiveVerificationManager.batches_to_profile is before
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.dspark_calib" and not is_context_aware_line(r.getMessage())]
    assert len(lines) == 1 and "leaving vLLM untouched" in lines[0] and "0.99.0" in lines[0]


def test_detect_real_vllm_is_supported():
    assert shape.detect().supported


def test_detect_refuses_streaming_shape():
    class NewManager(av.AdaptiveVerificationManager):
        def consume_step_timing(self, sample):  # vLLM main's shape
            pass

        def set_initial_cost_curves(self):  # noqa: D401 - no argument on main
            pass

    fake_av = SimpleNamespace(AdaptiveVerificationManager=NewManager, build_cost_tables_from_curves=lambda *a: None)
    result = shape.detect(av=fake_av)
    assert not result.supported and "consume_step_timing" in result.reason
    del NewManager.consume_step_timing
    result = shape.detect(av=fake_av)
    assert not result.supported and "set_initial_cost_curves" in result.reason


# -- load mode ------------------------------------------------------------------------
def _write(table, directory, name=None):
    return write_table(table, os.path.join(str(directory), name) if name else str(directory))


def _run_profile_path(manager, capture_sizes, samples_for=None):
    batches = list(manager.batches_to_profile(capture_sizes))
    samples = fake_samples(batches) if samples_for is None else samples_for(batches)
    manager.set_initial_cost_curves(samples)
    return batches


def vllm_tables_from_samples(table, context_len, capture_sizes):
    """What stock vLLM builds when its start-up profile yields the table's own samples."""
    m = make_manager()
    m._cudagraph_limit = capture_sizes[-1]
    ctx_samples = table.samples.select(context_len=context_len).to_frame()
    av.AdaptiveVerificationManager.set_initial_cost_curves(m, [
        StepTimingSample(r.forward_ms, r.drafter_ms, int(r.num_target_tokens), int(r.num_reqs), bool(r.full_cudagraph))
        for r in ctx_samples.itertuples()])
    return m.cost_tables


def test_matching_table_replaces_profiling(monkeypatch, tmp_path, reference_table, recorded, caplog):
    path = _write(reference_table, tmp_path)
    register_with(monkeypatch, DSPARK_CALIB_TABLE=path, DSPARK_CALIB_ALLOW_REFERENCE=1)
    capture_sizes = recorded[0]["capture_sizes"]
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches = _run_profile_path(m, capture_sizes)
    # exactly one warm-up run per size above the capture limit, nothing else
    assert [b["num_tokens"] for b in batches] == [768, 1024, 2048, 4096, 8192]
    assert m._cudagraph_limit == 512
    want_draft, want_verify = vllm_tables_from_samples(reference_table, 8192, capture_sizes)
    assert np.array_equal(m.cost_tables[0], want_draft) and np.array_equal(m.cost_tables[1], want_verify)
    loaded = [r.getMessage() for r in caplog.records if "loaded cost table" in r.getMessage()]
    assert len(loaded) == 1 and reference_table.short_hash in loaded[0] and path in loaded[0]


@pytest.mark.parametrize("env_ctx,vllm_ctx,expect", [(None, "1024", 1024), (None, "16000", 16384), ("8000", "1024", 8192)])
def test_context_len_picks_curve_set(monkeypatch, tmp_path, reference_table, recorded, env_ctx, vllm_ctx, expect):
    path = _write(reference_table, tmp_path)
    monkeypatch.setenv("VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN", vllm_ctx)
    extra = {"DSPARK_CALIB_CONTEXT_LEN": env_ctx} if env_ctx else {}
    register_with(monkeypatch, DSPARK_CALIB_TABLE=path, DSPARK_CALIB_ALLOW_REFERENCE=1, **extra)
    m = make_manager()
    _run_profile_path(m, recorded[0]["capture_sizes"])
    want = vllm_tables_from_samples(reference_table, expect, recorded[0]["capture_sizes"])
    assert np.array_equal(m.cost_tables[1], want[1])


def test_reference_table_needs_permission(monkeypatch, tmp_path, reference_table, recorded, caplog):
    path = _write(reference_table, tmp_path)
    register_with(monkeypatch, DSPARK_CALIB_TABLE=path)
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches = _run_profile_path(m, recorded[0]["capture_sizes"])
    assert len(batches) == 280  # profiled as stock vLLM does
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "backend" in msg and "DSPARK_CALIB_ALLOW_REFERENCE" in msg and "policy fallback" in msg


MISMATCHES = [
    ("num_speculative_tokens", dict(steps=5), "5"),
    ("max_num_seqs", dict(max_num_reqs=512), "512"),
    ("max_num_batched_tokens", dict(max_tokens=16384), "16384"),
    ("dtype", dict(config=fake_config(dtype="float16")), "float16"),
    ("tensor_parallel_size", dict(config=fake_config(tp=2)), "2"),
    ("draft_config_hash", dict(config=fake_config(draft=MODEL)), config_hash(MODEL)),
    ("cudagraph_capture_sizes", dict(capture_sizes=[1, 2, 4, 8]), "[1, 2, 4, 8]"),
]


@pytest.mark.parametrize("key,engine,engine_value", MISMATCHES, ids=[m[0] for m in MISMATCHES])
@pytest.mark.parametrize("policy", ["fallback", "strict", "warn"])
def test_policies_on_each_mismatch(monkeypatch, tmp_path, reference_table, recorded, caplog, key, engine,
                                   engine_value, policy):
    path = _write(reference_table, tmp_path)
    # no StepTimingCollector block here: the probe (test_probe.py) is off
    register_with(monkeypatch, DSPARK_CALIB_TABLE=path, DSPARK_CALIB_ALLOW_REFERENCE=1, DSPARK_CALIB_POLICY=policy,
                  DSPARK_CALIB_PROBE="0")
    engine = dict(engine)
    capture_sizes = engine.pop("capture_sizes", recorded[0]["capture_sizes"])
    m = make_manager(**engine)
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        if policy == "strict":
            with pytest.raises(RuntimeError) as err:
                _run_profile_path(m, capture_sizes)
            assert key in str(err.value) and engine_value in str(err.value)
            assert m.cost_tables is None
            return
        batches = _run_profile_path(m, capture_sizes)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.dspark_calib" and not is_context_aware_line(r.getMessage())]
    assert any(key in line and engine_value in line for line in lines), lines
    if policy == "fallback":
        assert len(lines) == 1 and "profiling at start-up as usual" in lines[0]
        stock = list(av.AdaptiveVerificationManager.batches_to_profile.__wrapped__(make_manager(**engine), capture_sizes))
        assert batches == stock
    else:  # warn: loads anyway, one line per mismatch, then the load line
        assert "loaded cost table" in lines[-1]
        limit = capture_sizes[-1]
        assert all(b["num_tokens"] > limit for b in batches)
        draft, verify = reference_table.curves[8192].as_vllm()
        want = av.build_cost_tables_from_curves(draft, verify, m.req_states.max_num_reqs,
                                                m.req_states.max_num_batched_tokens, limit)
        assert np.array_equal(m.cost_tables[1], want[1])


def test_directory_picks_newest_fitting_table(monkeypatch, tmp_path, reference_table, recorded, caplog):
    from dataclasses import replace

    old = replace(reference_table, created_at="2026-01-01T00:00:00Z")
    newer_wrong_gpu = replace(reference_table, created_at="2026-12-01T00:00:00Z",
                              fingerprint=reference_table.fingerprint.replace(gpu_name="NVIDIA H100"))
    newest = replace(reference_table, created_at="2026-11-01T00:00:00Z",
                     fingerprint=reference_table.fingerprint.replace(extra={"run": "b"}, replays=6))
    for t in (old, newer_wrong_gpu, newest):
        _write(t, tmp_path)
    (tmp_path / "junk.parquet").write_bytes(b"not a table")
    monkeypatch.setattr("dspark_calib.vllm.engine_info.gpu_name", lambda: "NVIDIA H200")
    register_with(monkeypatch, DSPARK_CALIB_TABLE=tmp_path, DSPARK_CALIB_ALLOW_REFERENCE=1)
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        _run_profile_path(m, recorded[0]["capture_sizes"])
    lines = [r.getMessage() for r in caplog.records if "loaded cost table" in r.getMessage()]
    assert len(lines) == 1 and newest.short_hash in lines[0]


def test_missing_table_path(monkeypatch, tmp_path, recorded, caplog):
    register_with(monkeypatch, DSPARK_CALIB_TABLE=tmp_path / "nope")
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches = _run_profile_path(m, recorded[0]["capture_sizes"])
    assert len(batches) == 280
    assert any("no such file" in r.getMessage() for r in caplog.records)


# -- capture mode ---------------------------------------------------------------------
def test_capture_round_trips_samples(monkeypatch, tmp_path, recorded):
    CaptureDir(str(tmp_path)).write_plan(Plan(context_lens=(1024, 8192), replays=3, warmup=1))
    register_with(monkeypatch, DSPARK_CALIB_CAPTURE=tmp_path)
    capture_sizes = recorded[0]["capture_sizes"]
    m = make_manager()
    batches = _run_profile_path(m, capture_sizes)
    sizes = list(dict.fromkeys(b["num_tokens"] for b in recorded[0]["batches"]))
    block = 5 * len(sizes)  # vLLM's own sequence: each size 5 times; 3 replays / 1 warm-up round up to 1 block each
    assert len(batches) == 2 * (1 + 1) * block
    assert {b["context_len"] for b in batches} == {1024, 8192}
    capture = json.load(open(CaptureDir(str(tmp_path)).samples_path(0)))
    assert len(capture["samples"]) == 2 * block  # warm-up replays dropped
    assert capture["engine"]["max_num_seqs"] == 256 and capture["cudagraph_limit"] == 512
    assert capture["engine"]["cudagraph_capture_sizes"] == capture_sizes
    # samples come back tagged with the batch that produced them
    all_samples = fake_samples(batches)
    timed = [s for s, i in zip(all_samples, range(len(batches))) if (i // block) % 2 != 0]
    got = capture["samples"]
    assert [g["forward_ms"] for g in got] == [s.forward_ms for s in timed]
    assert sorted({g["replay"] for g in got}) == [0, 1, 2, 3, 4]
    table = table_from_capture(ProfileOptions(model=MODEL, draft=DRAFT, context_lens=(1024, 8192), replays=3,
                                              warmup=1, max_model_len=32768, num_speculative_tokens=7), capture)
    assert table.context_lens() == [1024, 8192]
    assert all(len(table.curves[c].verify) == len(sizes) for c in (1024, 8192))
    assert int(table.curves[1024].verify.n[0]) == 5
    # conditions per block reach the table (no GPU here: NVML fails, the note says so, host load stays)
    t = table.telemetry
    assert [(b.context_len, b.block) for b in t.blocks] == [(1024, -1), (1024, 0), (8192, -1), (8192, 0)]
    assert t.blocks[0].start.cpu_s is not None and (t.source == "nvml" or t.note)
    assert table.fingerprint.extra["vllm_replays_per_block"] == 5
    # vLLM itself got curves (from the context nearest its own, 8192) and finished "starting"
    assert m.cost_tables is not None
    want = av.build_cost_tables_from_curves(*table.curves[8192].as_vllm(), 256, 8192, 512)
    assert np.array_equal(m.cost_tables[1], want[1])


def test_capture_refuses_unpaired_samples(monkeypatch, tmp_path, recorded):
    CaptureDir(str(tmp_path)).write_plan(Plan(context_lens=(8192,), replays=1, warmup=0))
    register_with(monkeypatch, DSPARK_CALIB_CAPTURE=tmp_path)
    m = make_manager()
    with pytest.raises(RuntimeError, match="cannot attribute"):
        _run_profile_path(m, recorded[0]["capture_sizes"], samples_for=lambda b: fake_samples(b)[:-1])
    assert not os.path.exists(CaptureDir(str(tmp_path)).samples_path(0))


TABLE_SIDE = [
    ("vllm_version", dict(vllm_version="0.32.0"), "'0.32.0'"),
    ("gpu_name", dict(gpu_name="NVIDIA H100 80GB HBM3"), "NVIDIA H100"),
    ("kv_cache_dtype", dict(kv_cache_dtype="fp8"), "'fp8'"),
    ("target_config_hash", dict(target_config_hash="sha256:0000000000000000"), "sha256:0000"),
]


@pytest.mark.parametrize("key,change,shown", TABLE_SIDE, ids=[t[0] for t in TABLE_SIDE])
@pytest.mark.parametrize("policy", ["fallback", "strict", "warn"])
def test_policies_on_table_side_mismatch(monkeypatch, tmp_path, reference_table, recorded, caplog, key, change,
                                         shown, policy):
    from dataclasses import replace

    other = replace(reference_table, fingerprint=reference_table.fingerprint.replace(**change))
    path = _write(other, tmp_path)
    monkeypatch.setattr("dspark_calib.vllm.engine_info.gpu_name", lambda: "NVIDIA H200")
    register_with(monkeypatch, DSPARK_CALIB_TABLE=path, DSPARK_CALIB_ALLOW_REFERENCE=1, DSPARK_CALIB_POLICY=policy)
    m = make_manager()
    capture_sizes = recorded[0]["capture_sizes"]
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        if policy == "strict":
            with pytest.raises(RuntimeError, match=key):
                _run_profile_path(m, capture_sizes)
            return
        batches = _run_profile_path(m, capture_sizes)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.dspark_calib" and not is_context_aware_line(r.getMessage())]
    assert any(key in line and shown in line for line in lines), lines
    assert len(batches) == (280 if policy == "fallback" else 5)


def test_table_from_uri(monkeypatch, tmp_path, reference_table, recorded, caplog):
    """DSPARK_CALIB_TABLE also takes URIs, opened through pyarrow.fs (file:// here, s3:// in production)."""
    _write(reference_table, tmp_path)
    register_with(monkeypatch, DSPARK_CALIB_TABLE=f"file://{tmp_path}", DSPARK_CALIB_ALLOW_REFERENCE=1)
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches = _run_profile_path(m, recorded[0]["capture_sizes"])
    assert len(batches) == 5
    assert any("loaded cost table" in r.getMessage() and reference_table.short_hash in r.getMessage()
               for r in caplog.records)


def test_bad_policy_refuses_to_start(monkeypatch, tmp_path, reference_table, recorded):
    register_with(monkeypatch, DSPARK_CALIB_TABLE=_write(reference_table, tmp_path), DSPARK_CALIB_POLICY="lenient")
    with pytest.raises(RuntimeError, match="DSPARK_CALIB_POLICY"):
        _run_profile_path(make_manager(), recorded[0]["capture_sizes"])


class OtherRank:
    """TP rank 1 of 2: broadcast_object returns what rank 0 sent, and records the calls."""

    rank_in_group = 1
    world_size = 2

    def __init__(self, from_rank0):
        self.from_rank0, self.calls = from_rank0, 0

    def broadcast_object(self, obj, src=0):
        assert src == 0 and obj in (None, "", (None, None))  # a non-zero rank sends nothing of its own
        self.calls += 1
        return self.from_rank0


def test_nonzero_rank_follows_rank0_load_decision(monkeypatch, tmp_path, reference_table, recorded):
    from vllm.distributed import parallel_state

    from dspark_calib.selection import decide

    capture_sizes = recorded[0]["capture_sizes"]
    engine = {"cudagraph_capture_sizes": capture_sizes, "max_num_seqs": 256, "max_num_batched_tokens": 8192}
    rank0 = decide(_write(reference_table, tmp_path), engine, allow_reference=True)
    assert rank0.load
    group = OtherRank((rank0, None))  # the decision and rank 0's probe plan (no probe without the step timer)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    # rank 1's own env points nowhere: it must not look, only follow rank 0
    register_with(monkeypatch, DSPARK_CALIB_TABLE=tmp_path / "missing-on-this-node")
    m = make_manager()
    batches = _run_profile_path(m, capture_sizes)
    assert group.calls == 1  # the decision and the plan (vLLM's own curve broadcast goes through av's stub)
    assert [b["num_tokens"] for b in batches] == [768, 1024, 2048, 4096, 8192]
    want = vllm_tables_from_samples(reference_table, 8192, capture_sizes)
    assert np.array_equal(m.cost_tables[1], want[1])


def test_nonzero_rank_uses_rank0_capture_plan(monkeypatch, tmp_path, recorded):
    from vllm.distributed import parallel_state

    group = OtherRank(Plan(context_lens=(1024, 4096), replays=2, warmup=0))
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    register_with(monkeypatch, DSPARK_CALIB_CAPTURE=tmp_path)  # no plan.json on this node
    batches = _run_profile_path(make_manager(), recorded[0]["capture_sizes"])
    assert {b["context_len"] for b in batches} == {1024, 4096} and len(batches) == 2 * 280  # 2 replays: one vLLM block
    capture = json.load(open(CaptureDir(str(tmp_path)).samples_path(1)))
    assert capture["rank"] == 1 and capture["tp_size"] == 2


def test_capture_without_plan_refuses(monkeypatch, tmp_path, recorded):
    register_with(monkeypatch, DSPARK_CALIB_CAPTURE=tmp_path)
    with pytest.raises(RuntimeError, match="plan.json"):
        _run_profile_path(make_manager(), recorded[0]["capture_sizes"])


def _decide_here(monkeypatch, caplog, recorded, **env):
    register_with(monkeypatch, **env)
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches = _run_profile_path(m, recorded[0]["capture_sizes"])
    return batches, [r.getMessage() for r in caplog.records if r.name == "vllm.dspark_calib" and not is_context_aware_line(r.getMessage())]


def test_unexpected_source_error_falls_back_in_one_line(monkeypatch, caplog, recorded):
    batches, lines = _decide_here(monkeypatch, caplog, recorded, DSPARK_CALIB_TABLE="nosuchscheme://bucket/tables/")
    assert len(batches) == 280
    assert len(lines) == 1 and "profiling at start-up as usual" in lines[0] and "\n" not in lines[0]


def test_policy_is_normalised(monkeypatch, caplog, recorded):
    with pytest.raises(RuntimeError):
        _decide_here(monkeypatch, caplog, recorded, DSPARK_CALIB_TABLE="nosuchscheme://x", DSPARK_CALIB_POLICY=" STRICT ")


def test_damaged_newest_table_does_not_hide_an_older_one(monkeypatch, tmp_path, reference_table, recorded, caplog):
    from dataclasses import replace

    older = _write(replace(reference_table, created_at="2026-01-01T00:00:00Z"), tmp_path)
    newer = _write(replace(reference_table, created_at="2026-06-01T00:00:00Z",
                           fingerprint=reference_table.fingerprint.replace(replays=6)), tmp_path)
    data = bytearray(open(newer, "rb").read())
    data[100:140] = bytes(40)  # inside the first data page: footer (metadata) still reads
    open(newer, "wb").write(bytes(data))
    batches, lines = _decide_here(monkeypatch, caplog, recorded, DSPARK_CALIB_TABLE=tmp_path,
                                  DSPARK_CALIB_ALLOW_REFERENCE="True", DSPARK_CALIB_PROBE="0")
    assert len(batches) == 5
    assert any("skipping" in l and newer in l for l in lines)
    assert "loaded cost table" in lines[-1] and older in lines[-1]


def test_unknown_backend_is_refused(monkeypatch, tmp_path, reference_table, recorded, caplog):
    from dataclasses import replace

    path = _write(replace(reference_table, fingerprint=reference_table.fingerprint.replace(backend="sglang")), tmp_path)
    batches, lines = _decide_here(monkeypatch, caplog, recorded, DSPARK_CALIB_TABLE=path, DSPARK_CALIB_ALLOW_REFERENCE=1)
    assert len(batches) == 280 and "backend" in lines[0] and "sglang" in lines[0]


# -- review findings 4 and 9 ------------------------------------------------------------------
class _SyntheticManager:
    def batches_to_profile(self, capture_sizes):
        yield {"num_tokens": 1}

    def set_initial_cost_curves(self, samples):
        pass


def test_unknown_shape_without_batches_to_profile_never_raises_in_the_import_hook(monkeypatch, caplog):
    """Finding 4: a manager class with no batches_to_profile (an unknown vLLM) -> one line, no exception."""
    class Renamed:  # a future vLLM: the method renamed
        def profile_batches(self, sizes):
            pass

    assert not plugin.is_patched(Renamed)
    fake = SimpleNamespace(AdaptiveVerificationManager=Renamed)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.spec_decode.adaptive_verification", fake)
    monkeypatch.setattr(shape, "detect", lambda: shape.ApiShape(None, "no batches_to_profile", "0.99.0"))
    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setenv("DSPARK_CALIB_TABLE", "/tables")  # asked: the line is said
    with caplog.at_level(logging.WARNING, logger="vllm.dspark_calib"):
        plugin._patch_installed_vllm()  # must not raise
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.dspark_calib"]
    assert len(lines) == 1 and "leaving vLLM untouched" in lines[0]
    assert not hasattr(Renamed, "batches_to_profile")


def test_second_engine_start_in_one_process_logs_again(monkeypatch, caplog):
    """Finding 9: log_once is per engine start, not per process."""
    monkeypatch.setattr(runtime, "_logged", set())

    def mode():
        runtime.log_once(logging.WARNING, "dspark-calib: the same line at every start")
        return None

    monkeypatch.setattr(plugin, "active_mode", mode)
    runner = SimpleNamespace(maybe_create_adaptive_verification_manager=lambda *a, **k: _SyntheticManager())
    plugin.patch(_SyntheticManager, runner)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.dspark_calib"):
            for _ in range(2):  # two engine starts, each building its manager through vLLM's factory
                manager = runner.maybe_create_adaptive_verification_manager(vllm_config=None)
                assert list(manager.batches_to_profile([1])) == [{"num_tokens": 1}]
                list(manager.batches_to_profile([1]))  # a second look in the same engine: still one line
    finally:
        plugin.unpatch(_SyntheticManager, runner)
    lines = [r.getMessage() for r in caplog.records if "the same line" in r.getMessage()]
    assert len(lines) == 2

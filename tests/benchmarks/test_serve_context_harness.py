"""The H200 serving harness's pure parts (benchmarks/serving/serve_context.py), on CPU.

Workload sizing against KV capacity, metrics from timestamps, observe-file segmentation,
budget distributions, prediction errors, compaction + validate round trip, the arms'
environments, the report, and the whole drive loop on the harness's fake engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dspark_calib.observe.step import ObservedStep
from dspark_calib.observe.file import ObservedWriter, read_observed

REPO = Path(__file__).resolve().parents[2]
SCHEMA10 = REPO / "benchmarks" / "results" / "h200" / "2026-11-30-morning" / "qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__ad4ef3d97317.parquet"


# -- sizing -----------------------------------------------------------------------------------
def test_kv_arithmetic_matches_the_h200_log(sc):
    assert sc.kv_bytes_per_token() == 41 * 2 * 8 * 128 * 2 == 167_936
    # the arithmetic lands within 0.1 % of what vLLM reported on the H200
    assert abs(sc.kv_capacity_tokens() - 625_680) / 625_680 < 1e-3
    assert sc.tokens_per_request(16384) == 16_656 and sc.tokens_per_request(1024) == 1_296


def test_plan_is_pinned_and_never_preempts(sc):
    plan = {w.name: w for w in sc.plan_workloads()}
    assert {n: (w.concurrency, w.num_requests) for n, w in plan.items()} == {
        "ctx1k": (256, 512), "ctx8k": (64, 128), "ctx16k": (32, 64), "mix": (32, 66), "skewed": (64, 128),
        "ctx1k-c32": (32, 64), "ctx4k-c32": (32, 64), "ctx3k": (128, 256), "ctx12k": (40, 80),
        "mix-2-4-12k": (32, 66), "ctx16k-c16": (16, 32), "mix-c16": (16, 33)}
    for w in plan.values():
        assert w.worst_case_tokens <= 0.9 * sc.KV_TOKENS_MEASURED, w
        if len(set(w.prompt_lens)) == 1:  # one prompt length: every in-flight request at it
            assert w.worst_case_tokens == w.concurrency * sc.tokens_per_request(w.longest, w.output_len)
        assert w.concurrency % 8 == 0 and w.output_len == 256
    mix = plan["mix"]
    lens = [mix.prompt_len(i) for i in range(mix.num_requests)]
    assert {L: lens.count(L) for L in set(lens)} == {1024: 22, 8192: 22, 16384: 22}
    # 16k prompts cannot run 256 at once
    assert sc.fit_concurrency(256, sc.KV_TOKENS_MEASURED, 16384) == 32
    # one 30k request among 63 of 1k: two long ones in 128 requests, counted as such, not 64 x 30k
    skewed = plan["skewed"]
    assert [skewed.prompt_len(i) for i in range(skewed.num_requests)].count(30000) == 2
    assert skewed.worst_case_tokens == 2 * sc.tokens_per_request(30000) + 62 * sc.tokens_per_request(1024)
    assert skewed.prompts_label == "30000+63x1024"


def test_a_skewed_workload_shrinks_until_its_largest_requests_fit(sc):
    lens = (30000,) + (1024,) * 63
    assert sc.fit_skewed(lens, 64, sc.KV_TOKENS_MEASURED, waves=2) == 64
    c = sc.fit_skewed(lens, 64, 60_000, waves=2)  # 2 x 30,272 alone exceed 90 % of 60k
    assert c < 64 and c % 8 == 0

def test_fit_concurrency_edges(sc):
    assert sc.fit_concurrency(256, 10**9, 1024) == 256  # max_num_seqs caps
    assert sc.fit_concurrency(64, 20_000, 16384) == 1  # not even one fits in 90 %: still one request
    assert sc.fit_concurrency(5, 10**9, 1024) == 5  # small wanted values are kept as they are
    caps = [sc.fit_concurrency(256, kv, 8192) for kv in range(50_000, 700_000, 25_000)]
    assert caps == sorted(caps)


def test_refit_shrinks_only_what_no_longer_fits(sc):
    plan = sc.plan_workloads()
    same = sc.refit(plan, sc.KV_TOKENS_MEASURED)
    assert same == plan
    small = {w.name: w for w in sc.refit(plan, 400_000)}
    assert small["ctx1k"] == plan[0]  # 256 x 1,296 still fits in 90 % of 400k
    assert small["ctx16k"].shrunk and small["ctx16k"].concurrency == 16 and small["ctx16k"].num_requests == 32
    assert small["mix"].num_requests % 3 == 0
    for w in small.values():
        assert w.worst_case_tokens <= 0.9 * 400_000


def test_estimates_fit_one_call(sc):
    total = sum(sc.estimate_seconds(w) for w in sc.plan_workloads())
    # every workload of arms.json in one arm (the default; the proofs pass --workloads): ~313 s
    # estimated, so such an arm fits one 570 s call after a warm engine start, not a cold one
    assert 60 < total < 340
    w = sc.plan_workloads()
    by = {x.name: x for x in w}
    assert sc.estimate_seconds(by["ctx16k"]) > sc.estimate_seconds(by["mix"])  # all long > a third long


def test_prompts_are_deterministic_and_unique(sc):
    a, b = sc.make_prompt("ctx8k", 3, 8192), sc.make_prompt("ctx8k", 3, 8192)
    assert a == b and len(a) == 8192 and min(a) >= 1000 and max(a) < 150_000
    assert sc.make_prompt("ctx8k", 4, 8192)[:16] != a[:16]  # no shared prefix block between requests
    assert sc.make_prompt("mix", 3, 8192)[:16] != a[:16]


# -- metrics from timestamps --------------------------------------------------------------------
def test_tpot_prefers_engine_timestamps(sc):
    rec = {"n": 11, "engine_first": 100.0, "engine_last": 100.5, "client_first": 5.0, "client_last": 6.0}
    assert sc.request_tpot_s(rec) == (pytest.approx(0.05), "engine")
    rec.update(engine_first=None)
    assert sc.request_tpot_s(rec) == (pytest.approx(0.1), "client")
    assert sc.request_tpot_s({"n": 1, "engine_first": 1.0, "engine_last": 1.0}) == (None, "none")


def test_summarize_requests(sc):
    recs = [{"n": 101, "max_tokens": 101, "engine_first": 0.0 + i, "engine_last": 1.0 + i + i * 0.1, "chunks": 25,
             "ttft": 0.01 * (i + 1), "mean_acceptance_length": 4.0} for i in range(10)]
    recs[0]["engine_first"] = None  # one falls back to the client clock
    recs[0].update(client_first=0.0, client_last=2.0)
    s = sc.summarize_requests(recs, wall_s=4.0)
    tpots = [20.0] + [(1.0 + i * 0.1) / 100 * 1000 for i in range(1, 10)]
    assert s["output_tokens"] == 1010 and s["output_tok_s"] == pytest.approx(252.5)
    assert s["tpot_p50_ms"] == pytest.approx(np.percentile(tpots, 50), abs=1e-3)
    assert s["tpot_p90_ms"] == pytest.approx(np.percentile(tpots, 90), abs=1e-3)
    assert s["tpot_clock"] == "client+engine" and s["tokens_per_step_mean"] == pytest.approx(4.04)
    assert s["ttft_p50_ms"] == pytest.approx(55.0) and s["short_requests"] == 0
    assert sc.percentile([], 50) is None


# -- observe files --------------------------------------------------------------------------------
def _step(i, reqs, ctxs, *, budget=None, sched=None, pred=1.0, meas=1.0, full=True, bs=None, ba=None):
    ctxs = list(ctxs)
    sched = 7 * reqs if sched is None else sched
    budget = 3 * reqs if budget is None else budget
    return ObservedStep(step=i, forward_ms=meas, drafter_ms=meas / 4, num_target_tokens=reqs + budget,
                        num_reqs=reqs, full_cudagraph=full, context_mean=sum(ctxs) / reqs,
                        context_max=max(ctxs), context_sum=sum(ctxs), scheduled_drafts=sched, draft_budget=budget,
                        priced_context=8192, predicted_draft_ms=pred / 4, predicted_verify_ms=pred,
                        budget_static=bs, budget_context_aware=ba)


def _stream(workloads, *, final_marker=True, trailing=0):
    """warm-up, then (marker, workload) per entry, then a final marker; steps numbered in order."""
    rows, i = [], 0

    def add(s):
        nonlocal i
        rows.append(s(i))
        i += 1

    for _ in range(5):
        add(lambda j: _step(j, 8, [1024 + j] * 8))  # warm-up
    for n, reqs, ctx in workloads:
        for m in range(10):
            add(lambda j, m=m: _step(j, 3, [17 + 4 * m] * 3))  # marker
        add(lambda j, reqs=reqs: _step(j, 1, [0], budget=0, sched=0))  # a workload's first prefill step
        for _ in range(n - 1):
            add(lambda j, reqs=reqs, ctx=ctx: _step(j, reqs, [ctx] * reqs))
    if final_marker:
        for m in range(10):
            add(lambda j, m=m: _step(j, min(3, 1 + m % 3), [20 + 4 * m]))
    for _ in range(trailing):
        add(lambda j: _step(j, 4, [16384] * 4))
    return rows


def _write(dirpath, rows, per_file=7, shuffle=False):
    if shuffle:
        rows = [rows[i] for i in np.random.default_rng(1).permutation(len(rows))]
    with ObservedWriter(dirpath, rows_per_file=per_file, metadata={"mode": "context_aware", "max_num_reqs": 256,
                                                                   "max_num_batched_tokens": 8192}) as w:
        for r in rows:
            w.append(r)


def _cols(sc, d):
    return sc.sorted_columns(dict(read_observed([d]).columns))


def test_segmentation_by_markers(sc, tmp_path):
    _write(tmp_path, _stream([(40, 64, 8300), (25, 32, 16500), (30, 16, 2000)]), shuffle=True)
    cols = _cols(sc, tmp_path)
    segs, why = sc.segment_steps(cols, 3)
    assert why == "ok"
    # the workload's first step (1 request, context 0) looks like a marker and stays with it
    assert [len(s) for s in segs] == [39, 24, 29]
    assert set(cols["context_max"][segs[1]]) == {16500}
    assert sc.segment_steps(cols, 2)[0] is None and "found 4 marker runs" in sc.segment_steps(cols, 2)[1]


def test_segmentation_after_a_kill(sc, tmp_path):
    # the third workload was killed: its marker ran, no final marker, its rows trail
    _write(tmp_path, _stream([(40, 64, 8300), (25, 32, 16500), (30, 16, 2000)], final_marker=False, trailing=5))
    segs, why = sc.segment_steps(_cols(sc, tmp_path), 2)
    assert why == "ok" and [len(s) for s in segs] == [39, 24]


def test_budget_distribution(sc, tmp_path):
    rows = [_step(0, 4, [9000] * 4, budget=28, bs=20, ba=28),  # full: 7 per request
            _step(1, 4, [9000] * 4, budget=0, bs=0, ba=0),  # zero
            _step(2, 4, [9000] * 4, budget=12, bs=12, ba=12),
            _step(3, 2, [9000] * 2, budget=6, bs=None, ba=6),
            _step(4, 2, [0, 0], budget=0, sched=0)]  # no drafts: not a budget choice
    _write(tmp_path, rows)
    b = sc.budget_distribution(_cols(sc, tmp_path))
    assert b["steps"] == 4 and b["share_full"] == 0.25 and b["share_zero"] == 0.25
    assert b["per_request_mean"] == pytest.approx(46 / 14, abs=1e-3)
    assert b["per_request_hist"] == [1, 0, 0, 2, 0, 0, 0, 1]
    assert b["verified_share"] == pytest.approx(46 / 98, abs=1e-4)
    assert b["pricings_compared"] == 3 and b["pricings_disagree_share"] == pytest.approx(1 / 3, abs=1e-4)
    sub = sc.budget_distribution(_cols(sc, tmp_path), np.array([1, 2]))
    assert sub["steps"] == 2 and sub["share_zero"] == 0.5


def test_own_prediction_errors_by_context(sc, tmp_path):
    rows = ([_step(i, 4, [1500] * 4, pred=1.1, meas=1.0) for i in range(10)]
            + [_step(10 + i, 4, [17000] * 4, pred=0.5, meas=1.0, full=i % 2 == 0) for i in range(10)])
    _write(tmp_path, rows)
    errs = {(e["kind"], e["context_bucket"]): e for e in sc.own_prediction_errors(_cols(sc, tmp_path))}
    assert errs[("verify", "1024-2047")]["median_pct"] == pytest.approx(10.0)
    assert errs[("verify", "1024-2047")]["median_signed_pct"] == pytest.approx(10.0)
    assert errs[("verify", "16384-32767")]["median_pct"] == pytest.approx(50.0)
    assert errs[("draft", "16384-32767")]["n"] == 5  # draft: full-graph steps only
    assert errs[("verify", "all")]["n"] == 20


def test_compaction_round_trips_through_validate(sc, tmp_path, monkeypatch):
    import itertools

    import dspark_calib.observe.file as observe

    # each file a different second, as on a real engine: still one engine's metadata
    tick = itertools.count()
    monkeypatch.setattr(observe, "utc_now", lambda: f"2026-12-01T00:00:{next(tick) % 60:02d}Z")
    src = tmp_path / "obs"
    rows = _stream([(40, 64, 8300), (25, 32, 16500)])
    _write(src, rows, per_file=9)
    assert len(list(src.glob("observed-*.parquet"))) > 3
    dst = tmp_path / "compact.parquet"
    info = sc.compact_observed(str(src), str(dst))
    assert info["rows"] == len(rows) and info["files"] == -(-len(rows) // 9) and info["metadata_variants"] == 1
    back = read_observed([dst])
    assert back.metadata[0].raw["mode"] == "context_aware" and sorted(back["step"]) == list(range(len(rows)))
    out = sc.run_validate(str(SCHEMA10), str(dst))
    assert out["rc"] == 0 and out["doc"]["num_steps"] == len(rows)
    flat = sc.validate_by_context(out["doc"])
    assert {r["kind"] for r in flat} == {"draft", "verify"}
    assert all("context_aware_median_pct" in r and "single_context_p90_pct" in r for r in flat)


def test_compaction_of_nothing_is_an_error(sc, tmp_path):
    from dspark_calib.errors import CalibError

    with pytest.raises(CalibError):
        sc.compact_observed(str(tmp_path), str(tmp_path / "x.parquet"))


# -- arms and vLLM's config ------------------------------------------------------------------------
def test_arm_envs(sc):
    base = {"PATH": "/bin", "DSPARK_CALIB_TABLE": "/stale", "DSPARK_CALIB_PROBE": "0",
            "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "1024"}
    stock = sc.arm_env("stock", "/t.parquet", "/o", base=base)
    assert "DSPARK_CALIB_TABLE" not in stock and "DSPARK_CALIB_PROBE" not in stock and stock["PATH"] == "/bin"
    assert stock["VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN"] == "8192"
    static = sc.arm_env("static", "/t.parquet", "/o", base=base)
    aware = sc.arm_env("aware", "/t.parquet", "/o", every=4, base=base)
    assert static["DSPARK_CALIB_CONTEXT_AWARE"] == "0" and static["DSPARK_CALIB_CONTEXT_LEN"] == "8192"
    assert aware["DSPARK_CALIB_CONTEXT_AWARE"] == "1" and "DSPARK_CALIB_CONTEXT_LEN" not in aware
    for env in (stock, static, aware):
        assert env["DSPARK_CALIB_OBSERVE"] == "/o" and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert aware["DSPARK_CALIB_OBSERVE_EVERY"] == "4" and static["DSPARK_CALIB_POLICY"] == "warn"
    fixed = sc.arm_env("fixed", None, "/o", base=base)  # adaptive verification off: no table, nothing priced
    assert "DSPARK_CALIB_TABLE" not in fixed and fixed["PYTHONPATH"].split(os.pathsep)[0] == sc.HERE
    with pytest.raises(ValueError):
        sc.arm_env("fast", None, "/o", base={})
    with pytest.raises(ValueError):
        sc.arm_env("aware", None, "/o", base={})


def test_arm_policy(sc):
    """--policy strict reaches the plugin wherever a table or a seed is given; nothing else changes."""
    strict = sc.arm_env("aware", "/t.parquet", "/o", tail=0.2, chunks=True, base={}, policy="strict")
    assert strict["DSPARK_CALIB_POLICY"] == "strict" and strict["DSPARK_CALIB_TABLE"] == "/t.parquet"
    warn = sc.arm_env("aware", "/t.parquet", "/o", tail=0.2, chunks=True, base={})
    assert {k: v for k, v in strict.items() if k != "DSPARK_CALIB_POLICY"} == \
        {k: v for k, v in warn.items() if k != "DSPARK_CALIB_POLICY"}
    assert sc.arm_env("stock", None, "/o", base={}, seed="/s.json", policy="strict")["DSPARK_CALIB_POLICY"] == "strict"
    assert "DSPARK_CALIB_POLICY" not in sc.arm_env("stock", None, "/o", base={}, policy="strict")
    with pytest.raises(ValueError):
        sc.arm_env("aware", "/t.parquet", "/o", base={}, policy="lenient")


def test_vllm_accepts_the_engine_config(sc):
    pytest.importorskip("vllm")
    import dataclasses

    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    spec = sc.speculative_config()
    assert spec["rejection_sample_method"] == "synthetic" and spec["synthetic_acceptance_length"] == 4.0
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert set(spec) <= fields, set(spec) - fields
    # vLLM's own resolution: 3 of 7 accepted, deterministically
    assert SpeculativeConfig._resolve_synthetic_acceptance_rates(7, None, 4.0) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    rates = sc.speculative_config(acceptance_rates=[0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0])
    assert "synthetic_acceptance_length" not in rates
    kwargs = sc.engine_kwargs(spec)
    assert set(kwargs) <= {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    AsyncEngineArgs(**kwargs)  # constructs (the engine config itself needs a GPU)
    # the draft-model arms: vLLM's own method, the Qwen3-0.6B drafter, adaptive on or off (fixed K)
    for adaptive in (True, False):
        draft = sc.speculative_config(acceptance_rates=sc.CONFIG["schedules"]["decaying"], speculator="draft",
                                      adaptive=adaptive)
        assert draft["method"] == "draft_model" and draft["enable_adaptive_verification"] is adaptive
        assert os.path.isfile(os.path.join(draft["model"], "config.json"))
        AsyncEngineArgs(**sc.engine_kwargs(draft))


def test_the_full_batch_warm_up_makes_vllms_draft_budget_bind(sc):
    """The compiled budget allocation runs only on steps whose budget binds: the full-batch warm-up
    schedules more verify logits than vLLM's rejection sampler takes in one chunk (its cap), so the
    first compile happens there, not inside a timed workload; its contexts are no marker's."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import get_max_chunk_logits

    with open(os.path.join(sc.TARGET, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    full = sc.FULL_BATCH_WARMUP
    assert full["requests"] == sc.MAX_NUM_SEQS and full["requests"] * (sc.K + 1) > get_max_chunk_logits(vocab)
    # every request decodes at once: admitting them all takes fewer steps than the fastest request
    # (every draft accepted: K + 1 tokens a step) needs to finish
    admission_steps = math.ceil(full["requests"] * full["prompt"] / sc.MAX_BATCHED)
    assert full["tokens"] / (sc.K + 1) > admission_steps + 1
    assert full["prompt"] > sc.MARKER_MAX_CTX


def test_the_named_schedules_are_what_vllm_accepts(sc):
    pytest.importorskip("vllm")
    from vllm.config.speculative import SpeculativeConfig

    for name, rates in sc.CONFIG["schedules"].items():
        assert len(rates) == sc.K and rates == sorted(rates, reverse=True), name
        assert SpeculativeConfig._resolve_synthetic_acceptance_rates(sc.K, rates, None) == rates


def test_draft_model_arms_are_named_by_their_speculator(sc):
    assert sc.arm_label("fixed", 4, speculator="draft") == "draft-fixed"
    assert sc.arm_label("aware", 4, 0.2, True, speculator="draft") == "draft-aware-tail20-chunks"
    assert sc.arm_label("stock", 4, rerun=True) == "stock-rerun"  # DSpark arms keep their names
    for arm in sc.CONFIG["comparisons"]["draft-goodput"]:
        assert sc.CONFIG["arms"][arm]["speculator"] == "draft"


# -- the step timer ------------------------------------------------------------------------------------
@pytest.fixture()
def step_timer(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "serving"))  # as the worker imports it (arm_env's PYTHONPATH)
    import step_timer

    return step_timer


class _Runner:
    """execute_model as vLLM's V2 runner takes it (dummy runs by keyword)."""

    def __init__(self):
        self.calls = []

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False, **kwargs):
        self.calls.append(dummy_run)
        return "out"


def _sched(tokens, reqs):
    from types import SimpleNamespace

    return SimpleNamespace(total_num_scheduled_tokens=tokens, num_scheduled_tokens={f"r{i}": 1 for i in range(reqs)})


def test_the_step_timer_records_serving_calls_only_and_is_bounded(step_timer):
    ticks = iter([10.0, 10.5, 11.0, 11.25, 12.0, 12.5, 20.0, 20.5])
    timer = step_timer.StepTimer(cap=2, clock=lambda: next(ticks))
    runner = _Runner()
    timer.install(runner)
    timer.install(runner)  # installed once: one clock pair per call
    assert runner.execute_model(_sched(8, 2)) == "out"
    assert runner.execute_model(_sched(0, 0), dummy_run=True) == "out"  # vLLM's dummy run: passed through, untimed
    runner.execute_model(_sched(16, 3), None)
    runner.execute_model(_sched(4, 1))  # past the cap: counted, not kept
    assert runner.calls == [False, True, False, False]
    got = timer.take()
    cpu = got.pop("cpu")
    assert set(cpu) == {"affinity", "last_cpu", "loadavg", "last_cpu_mhz"}
    assert got == {"start_s": [10.0, 11.0], "end_s": [10.5, 11.25], "num_tokens": [8, 16], "num_reqs": [2, 3],
                   "dropped": 1, "target_ms": [None, None], "drafter_ms": [None, None],  # no GPU: no events
                   "forward_tokens": [None, None]}  # the stand-in runner has no step_timing
    json.dumps(got)
    json.dumps(cpu)
    empty = timer.take()
    empty.pop("cpu")
    assert empty == {"start_s": [], "end_s": [], "num_tokens": [], "num_reqs": [], "dropped": 0,
                     "target_ms": [], "drafter_ms": [], "forward_tokens": []}
    runner.execute_model(_sched(1, 1))
    assert timer.take()["start_s"] == [20.0]


class _Event:
    """A CUDA event on a fake GPU clock: record() reads it, elapsed_time is in ms as torch's."""

    def __init__(self, clock, synced):
        self.clock, self.synced = clock, synced

    def record(self):
        self.t = next(self.clock)

    def elapsed_time(self, other):
        assert self.synced, "read before the one sync"
        return (other.t - self.t) * 1e3

    def synchronize(self):
        self.synced.append(1)


def test_the_worker_cpu_clock_from_cpuinfo(step_timer, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu MHz\t\t: 2100.000\n\nprocessor\t: 1\ncpu MHz\t\t: 3499.6\n\n")
    assert step_timer._cpuinfo_mhz(1, str(info)) == 3500 and step_timer._cpuinfo_mhz(0, str(info)) == 2100
    assert step_timer._cpuinfo_mhz(7, str(info)) is None and step_timer._cpuinfo_mhz(0, str(tmp_path / "x")) is None


def test_the_step_timer_records_the_tokens_each_forward_ran(step_timer):
    """vLLM's execute_model hands its step-timing collector the input batch after the draft
    budget: the timer keeps that count per step (the scheduler's is before the budget)."""
    from types import SimpleNamespace

    seen = []
    runner = _Runner()
    runner.step_timing = SimpleNamespace(record_batch=lambda batch, full_cudagraph: seen.append(full_cudagraph))
    inner = runner.execute_model

    def execute_model(scheduler_output, *args, forward=None, **kwargs):
        if forward is not None:
            runner.step_timing.record_batch(SimpleNamespace(num_tokens=forward), True)
        return inner(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model
    timer = step_timer.StepTimer()
    timer.install(runner)
    runner.execute_model(_sched(64, 8), forward=40)  # the budget trimmed 24 drafts
    runner.execute_model(_sched(8, 1))  # no batch recorded (a call that ran no forward)
    runner.execute_model(_sched(64, 8), forward=48)
    assert seen == [True, True]  # vLLM's collector still called
    assert timer.take()["forward_tokens"] == [40, None, 48]


def test_the_step_timer_times_target_and_drafter_on_the_gpu_in_every_arm(step_timer):
    """Three events a step: execute_model's start, the drafter's start and end (propose runs in
    the step's sample_tokens, after its execute_model); resolved in take behind one sync; a step
    whose drafter did not run (a call that scheduled nothing), a dummy propose (vLLM's _dummy_run
    after its unrecorded dummy execute_model) and steps past the event cap have none."""
    gpu = iter([0.000, 0.040, 0.110,  # step 1: target 40 ms, drafter 70 ms
                0.200, 0.250, 0.360,  # step 2: target 50, drafter 110
                0.400])  # step 3: no drafter
    synced = []
    timer = step_timer.StepTimer(clock=iter(range(100)).__next__, event=lambda: _Event(gpu, synced), event_cap=3)
    runner = _Runner()
    drafts = []
    runner.speculator = type("Spec", (), {"propose": lambda self, **kw: drafts.append(kw) or "drafts"})()
    timer.install(runner)
    runner.execute_model(_sched(8, 1))
    assert runner.speculator.propose(dummy_run=False) == "drafts"
    runner.execute_model(_sched(8, 1))
    runner.speculator.propose()
    runner.execute_model(_sched(8192, 1))
    runner.execute_model(_sched(8, 1))  # past the event cap: host times only
    runner.speculator.propose()
    assert len(drafts) == 3
    got = timer.take()
    assert synced == [1]
    assert [round(x, 6) if x is not None else None for x in got["target_ms"]] == [40.0, 50.0, None, None]
    assert [round(x, 6) if x is not None else None for x in got["drafter_ms"]] == [70.0, 110.0, None, None]
    assert len(got["start_s"]) == 4
    # a dummy propose takes no events: the step's own drafter does (the dummy here lasts 1 s)
    clock = SimpleNamespace(t=0.0)

    class Ev(_Event):
        def record(self):
            self.t = clock.t

    def propose(self, dummy_run=False, **kw):
        clock.t += 1.0 if dummy_run else 0.07

    synced = []
    timer = step_timer.StepTimer(clock=iter(range(100)).__next__, event=lambda: Ev(None, synced))
    runner = _Runner()
    runner.speculator = type("Spec", (), {"propose": propose})()
    timer.install(runner)
    runner.execute_model(_sched(8, 1))
    runner.speculator.propose(dummy_run=True)
    runner.speculator.propose()
    assert [round(x, 6) for x in timer.take()["drafter_ms"]] == [70.0]
    # a call past the cap keeps nothing, and its propose does not join the last kept call
    timer = step_timer.StepTimer(cap=1, clock=iter(range(100)).__next__, event=lambda: _Event(gpu2, synced))
    gpu2, synced = iter([0.0, 0.5, 0.6, 0.7]), []
    fresh = _Runner()
    fresh.speculator = type("Spec", (), {"propose": lambda self, **kw: None})()
    timer.install(fresh)
    fresh.execute_model(_sched(8, 1))  # kept: one event; its drafter never runs
    fresh.execute_model(_sched(8, 1))  # past the cap
    fresh.speculator.propose()
    got = timer.take()
    assert got["drafter_ms"] == [None] and got["dropped"] == 1


def test_the_step_timer_rpcs_run_on_tp_rank_0_only(step_timer, monkeypatch):
    class Worker(step_timer.StepTimerProbe):
        rank = 0

        def _step_timer_tp_rank(self):
            return self.rank

        def __init__(self):
            self.model_runner = _Runner()

    w = Worker()
    assert w.step_timer_take() is None  # not started
    w.rank = 1
    assert w.step_timer_start() is False and w.step_timer_take() is None
    w.rank = 0
    assert w.step_timer_start() is True
    w.model_runner.execute_model(_sched(8, 1))
    assert w.step_timer_start() is True  # again: cleared, not wrapped twice
    w.model_runner.execute_model(_sched(8, 1))
    assert len(w.step_timer_take()["start_s"]) == 1


def test_the_worker_extension_fits_vllms_worker_and_runner(step_timer, monkeypatch):
    """vLLM refuses an extension attribute its worker already has; the timer keys dummy runs on
    the keyword vLLM's own dummy runs pass; the TP rank comes from vLLM's process groups."""
    import inspect

    import estimator_probe
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    names = [a for a in dir(estimator_probe.EstimatorProbe) if not a.startswith("__")]
    assert {"step_timer_start", "step_timer_take", "estimator_state"} <= set(names)
    assert not [a for a in names if hasattr(Worker, a)]
    params = inspect.signature(GPUModelRunner.execute_model).parameters
    assert list(params)[:2] == ["self", "scheduler_output"] and "dummy_run" in params
    assert "dummy_run=True" in inspect.getsource(GPUModelRunner._dummy_run)
    # the drafter: the runner's speculator, proposing in sample_tokens (after execute_model), dummy runs by
    # keyword (the speculators a draft model and DSpark get)
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    for speculator in (StandaloneARSpeculator, DSparkSpeculator):
        assert "dummy_run" in inspect.signature(speculator.propose).parameters, speculator
    assert "self.speculator.propose(" in inspect.getsource(GPUModelRunner.sample_tokens)
    import vllm.distributed

    calls = []
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: calls.append(1) or 3)
    probe = estimator_probe.EstimatorProbe()
    assert probe.step_timer_start() is False and calls == [1]


def test_the_step_timer_summary_by_hand(sc):
    """Intervals 100, 100, 3000, 100 ms (one 3 s stall before the 4th step), host 1-5 ms."""
    raw = {"start_s": [0.0, 0.1, 0.2, 3.2, 3.3], "num_tokens": [0, 8, 8, 0, 8], "num_reqs": [0, 1, 1, 0, 1],
           "dropped": 0}
    raw["end_s"] = [t + (i + 1) / 1e3 for i, t in enumerate(raw["start_s"])]
    raw["target_ms"] = [50.0, 40.0, None, 60.0, 45.0]  # step 3 without a drafter: no GPU figures
    raw["drafter_ms"] = [110.0, 70.0, None, 80.0, 75.0]
    raw["cpu"] = {"affinity": [0, 1], "last_cpu": 1, "loadavg": [1.0, 1.0, 1.0]}
    got = sc.step_timer_summary(raw)
    # the drafter's share: the calls with a drafter and a successor (steps 100, 100, 100 ms; drafters 110, 70, 80)
    assert got == {"steps": 5, "dropped": 0, "steps_with_tokens": 3, "drafter_share_steps": 3,
                   "step_mean_ms": 100.0, "drafter_mean_ms": 86.667, "rest_mean_ms": 13.333, "intervals": 4,
                   "interval_p50_ms": 100.0, "interval_p90_ms": 2130.0, "interval_p99_ms": 2913.0,
                   "interval_max_ms": 3000.0, "stall_ms": 1000.0, "stalls": [{"step": 3, "ms": 3000.0}],
                   "host_p50_ms": 3.0, "host_p90_ms": 4.6, "host_max_ms": 5.0,
                   "target_steps": 4, "target_p50_ms": 47.5, "target_p90_ms": 57.0, "target_max_ms": 60.0,
                   "drafter_steps": 4, "drafter_p50_ms": 77.5, "drafter_p90_ms": 101.0, "drafter_max_ms": 110.0,
                   "decode_steps": 0, "forward_tokens_mean": None, "verified_drafts_per_request": None,
                   "cpu": raw["cpu"]}
    times = sc.step_times(raw)
    assert times["interval_ms"] == [None, 100.0, 100.0, 3000.0, 100.0]
    assert times["drafter_ms"] == [110.0, 70.0, None, 80.0, 75.0] and times["target_ms"][2] is None
    del raw["target_ms"], raw["drafter_ms"]  # a window from a timer without events
    assert sc.step_times(raw)["drafter_ms"] == [None] * 5
    assert sc.step_timer_summary(raw)["drafter_steps"] == 0
    assert sc.step_timer_summary(None) is None and sc.step_timer_summary({"error": "x"}) == {"error": "x"}
    one = sc.step_timer_summary({"start_s": [1.0], "end_s": [1.5], "num_tokens": [1], "num_reqs": [1]})
    assert one["steps"] == 1 and one["interval_max_ms"] is None and one["stalls"] == []

    def arm(timer):
        return {"workloads": {"ctx1k": {"workload": {"concurrency": 256}, "requests": 512, "output_tok_s": 1.0,
                                        "tpot_p50_ms": 1.0, "tpot_p90_ms": 1.0, "step_timer": timer}}}

    md = sc.markdown(sc.build_report({"fixed": arm(got), "stock": arm(None)}))
    assert "| arm | workload | steps | interval p50 / p90 / max ms | stalls > 1 s | largest stall ms | host ms p50 |" in md
    assert "| fixed | ctx1k | 5 | 100.00 / 2130.00 / 3000.0 | 1 | 3000.0 | 3.000 |" in md
    assert "| stock | ctx1k | 5 |" not in md  # an arm without a timer has no row
    assert "stalls >" not in sc.markdown(sc.build_report({"stock": arm(None)}))


# -- the drive loop on the fake engine, and the report ------------------------------------------------
def test_drive_skips_what_cannot_finish_and_segments(sc, tmp_path):
    obs = tmp_path / "obs"
    eng = sc.FakeEngine(str(obs), 1, str(SCHEMA10), "aware")
    plan = [sc.Workload("a", (512,), 8, 16, 32), sc.Workload("big", (16384,), 32, 64),
            sc.Workload("b", (2048, 4096), 4, 8, 24)]
    events = []
    import time

    est = sc.estimate_seconds(plan[1])
    asyncio.run(sc.drive(eng, plan, events.append, deadline=time.time() + est))  # "big" cannot make it
    eng.shutdown()
    kinds = [e["event"] for e in events]
    assert kinds == ["warmup", "step_timer", "step_timer", "start", "workload", "skipped", "step_timer", "start",
                     "workload", "markers"]
    assert events[0]["full_batch_requests"] == sc.MAX_NUM_SEQS  # the budget-binding warm-up ran
    assert events[-1]["count"] == 3 and events[5]["workload"] == "big"
    assert events[1] == {"event": "step_timer", "started": True}  # after the warm-up: its steps untimed
    assert [e["before"] for e in events if e["event"] == "step_timer" and "before" in e] == ["a", "b"]
    assert events[2]["summary"]["steps"] > 0  # the marker's steps, taken apart from the workload's
    done = [e for e in events if e["event"] == "workload"]
    assert [d["summary"]["output_tokens"] for d in done] == [16 * 32, 8 * 24]
    for d in done:  # every workload's own steps, one fake step one execute_model call
        t, times = d["step_timer"], d["step_times"]
        assert t["steps"] == len(times["host_ms"]) == t["intervals"] + 1 > 0 and t["dropped"] == 0
        assert t["steps_with_tokens"] == t["steps"] and times["interval_ms"][0] is None
        assert max(times["num_reqs"]) == d["workload"]["concurrency"]
    # the steps timed are the fake's steps after the warm-up, every one in a window
    timed = sum(e["summary"]["steps"] for e in events if e["event"] == "step_timer" and "before" in e)
    assert timed + sum(d["step_timer"]["steps"] for d in done) < eng.step_no
    assert all(r["n"] == r["max_tokens"] for d in done for r in d["requests"])
    cols = _cols(sc, obs)
    segs, why = sc.segment_steps(cols, 2)
    assert why == "ok"
    assert cols["context_max"][segs[1]].max() >= 4096 > cols["context_max"][segs[0]].max()


def test_post_process_without_observe_files(sc, tmp_path):
    (tmp_path / "obs").mkdir()
    events = [{"event": "engine", "start_s": 50.0, "kv_tokens": 625_680, "plan": []},
              {"event": "workload", "workload": {"name": "w", "concurrency": 2}, "estimate_s": 1.0,
               "summary": sc.summarize_requests([{"n": 3, "engine_first": 0.0, "engine_last": 1.0}], 1.0),
               "requests": [{"i": 0, "n": 3, "engine_first": 0.0, "engine_last": 1.0}]}]
    s = sc.post_process("stock", events, str(tmp_path / "obs"), None, str(tmp_path),
                        log_text="x\nINFO dspark-calib: observe on\nTraceback (most recent call last):\n")
    assert s["observed"]["rows"] == 0 and "no observed" in s["observed"]["error"]
    assert s["dspark_log"] == ["INFO dspark-calib: observe on"] and len(s["errors"]) == 1
    reqs = json.loads((tmp_path / "context-stock-requests.json").read_text())
    assert reqs["w"][0]["tpot_ms"] == 500.0


def test_report(sc, tmp_path):
    def arm(tok_s, err):
        return {"workloads": {"ctx1k": {"workload": {"concurrency": 256}, "requests": 512, "output_tok_s": tok_s,
                                        "tpot_p50_ms": 10.0, "tpot_p90_ms": 12.0,
                                        "budgets": {"per_request_mean": 3.1},
                                        "own_error": [{"kind": "verify", "context_bucket": "1024-2047",
                                                       "median_pct": err}]}},
                "validate_by_context": [{"kind": "verify", "context_bucket": "1024-2047", "single_context_n": 9,
                                         "single_context_median_pct": 300.0, "single_context_p90_pct": 310.0,
                                         "context_aware_n": 9, "context_aware_median_pct": 1.0,
                                         "context_aware_p90_pct": 2.0}]}

    for name, doc in {"stock": arm(1000.0, 300.0), "aware": arm(1100.0, 1.0)}.items():
        (tmp_path / f"context-{name}.json").write_text(json.dumps(doc))
    (tmp_path / "context-stock-requests.json").write_text("{}")  # not an arm
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving" / "serve_context.py"), "report",
                        "--results", str(tmp_path), "--json", str(js), "--md", str(md)],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr
    rep = json.loads(js.read_text())
    assert [(r["arm"], r["vs_stock"]) for r in rep["rows"]] == [("stock", 1.0), ("aware", 1.1)]
    text = md.read_text()
    assert "| aware | ctx1k | 256 | 1100 | 1.100 |" in text and "| stock | verify | 1024-2047 | 300.00 / 310.00" in text


def test_gpu_readings_are_joined_to_workloads_by_wall_clock(sc):
    samples = [{"t": t, "sm_mhz": mhz, "power_w": w, "temp_c": 50.0, "throttle": th}
               for t, mhz, w, th in [(9.0, 1980, 100, []), (10.5, 1900, 600, []), (11.0, 1700, 690, ["hw_slowdown"]),
                                     (12.5, 1800, 650, []), (20.0, 1980, 120, [])]]
    events = [{"event": "start", "workload": "ctx1k", "t": 10.0},
              {"event": "workload", "workload": {"name": "ctx1k"}, "t": 13.0},
              {"event": "start", "workload": "ctx16k", "t": 30.0},
              {"event": "workload", "workload": {"name": "ctx16k"}, "t": 31.0}]
    g = sc.gpu_by_workload(samples, events, "nvml", "")
    w = g["by_workload"]["ctx1k"]
    assert w["readings"] == 3 and w["sm_mhz_p50"] == 1800 and w["sm_mhz_min"] == 1700
    assert w["power_w_max"] == 690 and w["throttled_share"] == pytest.approx(1 / 3, abs=1e-3) and w["reasons"] == ["hw_slowdown"]
    assert g["by_workload"]["ctx16k"]["readings"] == 0 and g["by_workload"]["ctx16k"]["sm_mhz_p50"] is None


def test_observe_every_zero_is_an_engine_without_observe(sc):
    env = sc.arm_env("stock", None, "/tmp/obs", every=0, base={"DSPARK_CALIB_OBSERVE": "/stale", "PATH": "/bin"})
    assert not any(k.startswith("DSPARK_CALIB_") for k in env) and env["PATH"] == "/bin"
    on = sc.arm_env("aware", "/t.parquet", "/tmp/obs", every=4, base={})
    assert on["DSPARK_CALIB_OBSERVE"] == "/tmp/obs" and on["DSPARK_CALIB_OBSERVE_EVERY"] == "4"


def test_gpu_sampler_device_index_and_a_failing_reader(sc, monkeypatch):
    import dspark_calib.vllm.gpu_readings as gr

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234-abcd")
    index, note = gr.first_visible_index()
    assert index == 0 and "not an index" in note
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gr.first_visible_index() == (3, "")
    sampler = sc.GpuSampler(0.01)
    sampler.stop()  # before start: nothing to join

    class Broken:
        source, note = "nvml", ""

        def read(self):
            raise RuntimeError("NVML went away")

    monkeypatch.setattr(gr, "GpuReader", lambda index: Broken())
    sampler = sc.GpuSampler(0.01)
    sampler.start()
    sampler._thread.join(timeout=5)
    assert not sampler._thread.is_alive() and sampler.samples == [] and "reading failed: RuntimeError" in sampler.note


def test_report_sets_an_arm_without_observe_beside_stock(sc, tmp_path):
    import argparse
    import shutil

    src = REPO / "benchmarks" / "results" / "h200" / "2026-12-01-0438-context" / "context-stock.json"
    shutil.copy(src, tmp_path / "context-stock.json")
    noobs = json.loads(src.read_text())
    noobs.update(arm="stock-noobs", observe_every=0, observed={"rows": 0, "off": True})
    (tmp_path / "context-stock-noobs.json").write_text(json.dumps(noobs))
    args = argparse.Namespace(results=[str(tmp_path)], json=str(tmp_path / "r.json"), md=str(tmp_path / "r.md"))
    assert sc.run_report(args) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["arms"] == ["stock", "stock-noobs"]
    rows = {(r["arm"], r["workload"]): r for r in rep["rows"]}
    assert rows[("stock-noobs", "ctx8k")]["vs_stock"] == 1.0  # the same numbers: ratio to stock


def test_report_prices_observe_mode_against_its_noobs_arm_with_a_rerun_beside(sc, tmp_path):
    """The observe-cost section: each observing arm (and its -rerun) over ARM-noobs, per workload."""
    import argparse
    import shutil

    src = REPO / "benchmarks" / "results" / "h200" / "2026-12-01-0438-context" / "context-stock.json"
    shutil.copy(src, tmp_path / "context-stock.json")
    on = json.loads(src.read_text())
    noobs = json.loads(src.read_text())
    noobs.update(arm="stock-noobs", observe_every=0)
    for w in noobs["workloads"].values():
        w["tpot_p50_ms"] = w["tpot_p50_ms"] / 1.25  # observing 25 % slower
    (tmp_path / "context-stock-noobs.json").write_text(json.dumps(noobs))
    (tmp_path / "context-stock-rerun.json").write_text(json.dumps(on))
    (tmp_path / "context-stock-requests.json").write_text("{}")  # not an arm
    args = argparse.Namespace(results=[str(tmp_path)], json=str(tmp_path / "r.json"), md=str(tmp_path / "r.md"))
    assert sc.run_report(args) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["arms"] == ["stock", "stock-noobs", "stock-rerun"]
    cost = {(c["workload"], c["observed"]): c for c in rep["observe_cost"]}
    assert set(cost) == {(w, a) for w in on["workloads"] for a in ("stock", "stock-rerun")}
    assert all(c["baseline"] == "stock-noobs" and c["tpot_p50_ratio"] == 1.25 and c["output_tok_s_ratio"] == 1.0
               for c in cost.values())
    assert "Observe mode's own cost" in (tmp_path / "r.md").read_text()
    assert sc.arm_label("stock", 4, rerun=True) == "stock-rerun" and sc.arm_label("stock", 0) == "stock-noobs"


def test_an_aware_arm_with_a_context_tail(sc, tmp_path):
    import argparse
    import shutil

    env = sc.arm_env("aware", "/t.parquet", "/o", tail=0.2, base={})
    assert env["DSPARK_CALIB_CONTEXT_TAIL"] == "0.2" and env["DSPARK_CALIB_CONTEXT_AWARE"] == "1"
    plain = sc.arm_env("aware", "/t.parquet", "/o", base={})  # the plugin's defaults are not the label's
    assert plain["DSPARK_CALIB_CONTEXT_TAIL"] == "0" and plain["DSPARK_CALIB_CONTEXT_CHUNKS"] == "0"
    with pytest.raises(ValueError, match="arm aware or ab"):
        sc.arm_env("stock", None, "/o", tail=0.2, base={})
    assert sc.arm_label("aware", 4, 0.2) == "aware-tail20" and sc.arm_label("stock", 0) == "stock-noobs"
    chunks = sc.arm_env("aware", "/t.parquet", "/o", tail=0.2, chunks=True, base={})
    assert chunks["DSPARK_CALIB_CONTEXT_CHUNKS"] == "1" and chunks["DSPARK_CALIB_CONTEXT_TAIL"] == "0.2"
    assert env["DSPARK_CALIB_CONTEXT_CHUNKS"] == "0"
    with pytest.raises(ValueError, match="arm aware or ab"):
        sc.arm_env("static", "/t.parquet", "/o", chunks=True, base={})
    assert sc.arm_label("aware", 4, 0.2, True) == "aware-tail20-chunks"
    src = REPO / "benchmarks" / "results" / "h200" / "2026-12-01-0438-context"
    shutil.copy(src / "context-stock.json", tmp_path / "context-stock.json")
    tail = json.loads((src / "context-aware.json").read_text())
    tail.update(arm="aware-tail20")
    (tmp_path / "context-aware-tail20.json").write_text(json.dumps(tail))
    (tmp_path / "context-aware-chunks.json").write_text(json.dumps({**tail, "arm": "aware-chunks"}))
    args = argparse.Namespace(results=[str(tmp_path)], json=str(tmp_path / "r.json"), md=str(tmp_path / "r.md"))
    assert sc.run_report(args) == 0
    assert sorted(json.loads((tmp_path / "r.json").read_text())["arms"]) == ["aware-chunks", "aware-tail20", "stock"]


def test_revalidate_adds_the_chunk_pricing_row_when_chunks_are_recorded(sc, tmp_path):
    import dataclasses

    rows = _stream([(40, 64, 8300), (25, 32, 16500)])
    # every fifth workload step also carries a 2000-token chunk at context 0 (observe schema 1.1)
    rows = [dataclasses.replace(r, num_target_tokens=r.num_target_tokens + 2000, prefill_tokens=2000,
                                prefill_context_sum=0, prefill_pairs=2000 * 2000)
            if r.step % 5 == 0 and r.num_reqs > 8 else r for r in rows]
    _write(tmp_path / "obs", rows, per_file=1000)
    dst = str(tmp_path / "compact.parquet")
    sc.compact_observed(str(tmp_path / "obs"), dst)
    out = sc.revalidate(str(SCHEMA10), dst, ["ctx8k", "ctx16k"])
    # stock-mode files: context-aware pricing as the plugin's default (pairs), the KV sum beside it
    assert not [r for r in out if r["kind"] == "verify_prefill, chunks by pairs"]
    chunk = [r for r in out if r["kind"] == "verify_prefill, chunks by KV sum"]
    assert {r["workload"] for r in chunk} == {"all", "ctx8k", "ctx16k"}
    (prefill_all,) = [r for r in out if r["kind"] == "verify_prefill" and r["workload"] == "all"]
    assert chunk[0]["steps"] == prefill_all["steps"] > 0
    # a chunk's KV sum prices the step lower than its pairs do (measured 1.0 ms here: both far off)
    assert chunk[0]["context_aware_median_signed_pct"] < prefill_all["context_aware_median_signed_pct"]


@pytest.mark.slow
def test_a_dry_run_aware_arm_records_the_tail_and_chunks_it_ran_with(sc, tmp_path):
    """The summary's env is the child's as run, not one rebuilt without the arm's options."""
    args = ["arm", "aware", "--table", str(SCHEMA10), "--out", str(tmp_path), "--work", str(tmp_path / "w"),
            "--dry-run", "--workloads", "ctx8k", "--context-tail", "0.2", "--context-chunks"]
    assert sc.main(args) == 0
    env = json.loads((tmp_path / "context-aware-tail20-chunks.json").read_text())["env"]
    assert env["DSPARK_CALIB_CONTEXT_TAIL"] == "0.2" and env["DSPARK_CALIB_CONTEXT_CHUNKS"] == "1"
    assert sc.main(args[:-3] + ["--rerun"]) == 0
    env = json.loads((tmp_path / "context-aware-rerun.json").read_text())["env"]
    assert env["DSPARK_CALIB_CONTEXT_TAIL"] == "0" and env["DSPARK_CALIB_CONTEXT_CHUNKS"] == "0"


# -- the estimator seed's arm --------------------------------------------------------------------------
def test_a_seeded_arm_is_named_and_served_with_its_seed(sc):
    assert sc.arm_label("stock", 4, speculator="draft", seed=True) == "draft-stock-seed"
    assert sc.arm_label("stock", 4, speculator="draft", seed=True, rerun=True) == "draft-stock-seed-rerun"
    arm = sc.CONFIG["arms"]["draft-stock-seed"]
    assert arm["seed"] and arm["seed_from"] == "draft-stock"
    runs = sc.CONFIG["comparisons"]["draft-cold"]
    assert runs.index(arm["seed_from"]) < runs.index("draft-stock-seed")  # its seed's observe file comes first
    env = sc.arm_env("stock", None, "/o", base={}, seed="/s/seed.json")
    assert env["DSPARK_CALIB_ESTIMATOR_SEED"] == "/s/seed.json" and env["DSPARK_CALIB_POLICY"] == "warn"
    assert "DSPARK_CALIB_ESTIMATOR_SEED" not in sc.arm_env("stock", None, "/o", base={"DSPARK_CALIB_ESTIMATOR_SEED": "x"})
    assert sc.ARM_FILE.fullmatch("context-draft-stock-seed.json").group(1) == "draft-stock-seed"
    assert sc.ARM_FILE.fullmatch("context-stock-requests.json") is None
    everything = sc.arm_label("aware", 0, 0.2, True, True, speculator="draft", seed=True, estimator="pinned")
    assert everything == "draft-aware-tail20-chunks-noobs-seed-pinned-rerun"
    assert sc.ARM_FILE.fullmatch(f"context-{everything}.json").group(1) == everything  # read back by the same list


def test_a_seeded_arm_without_a_seed_source_is_refused(sc, tmp_path):
    bad = json.loads((REPO / "benchmarks" / "serving" / "arms.json").read_text())
    bad["arms"]["draft-stock-seed"].pop("seed_from")
    path = tmp_path / "arms.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="seed_from"):
        sc.load_config(str(path))
    with pytest.raises(ValueError, match="give --seed-file"):
        sc.arm_seed(None, None, str(tmp_path))


@pytest.mark.slow
def test_the_cold_comparison_dry_runs_and_seeds_from_the_first_arm(sc, tmp_path):
    """draft-stock (observe records the fake estimator), then draft-stock-seed: its seed is made from the
    first arm's observe file and the engine child starts from it; the report has the cold phases."""
    common = ["--table", str(SCHEMA10), "--out", str(tmp_path), "--work", str(tmp_path / "w"), "--dry-run",
              "--workloads", "ctx8k", "--acceptance-rates", "decaying"]
    assert sc.main(["arm", "draft-stock", *common]) == 0
    assert sc.main(["arm", "draft-stock-seed", *common]) == 0
    seed = json.loads((tmp_path / "draft-stock-estimator-seed.json").read_text())
    summary = json.loads((tmp_path / "context-draft-stock-seed.json").read_text())
    assert summary["env"]["DSPARK_CALIB_ESTIMATOR_SEED"] == str(tmp_path / "draft-stock-estimator-seed.json")
    assert summary["seed"]["refits"] == seed["refits"] >= 1 and summary["cold"]["summary"]["requests"] == 128
    first = read_observed([tmp_path / "context-draft-stock-seed-observed.parquet"])
    assert first["estimator_slope"][first["estimator_refits"] == 0].tolist() == [seed["slope"]]  # started there
    assert sc.main(["report", "--results", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve_context.json").read_text())
    assert [(c["arm"], c["seeded"]) for c in report["cold"]] == [("draft-stock", False), ("draft-stock-seed", True)]


# -- the pinned estimator's arms -------------------------------------------------------------------------
def test_a_pinned_estimator_predicts_the_enforced_conditional_rates(sc):
    """vLLM's synthetic rates are unconditional; the estimator predicts each position given the ones
    before. Pinned at slope 0, sigmoid(intercept) is that conditional rate whatever the feature."""
    rates = sc.CONFIG["schedules"]["decaying"]
    cond = sc.conditional_rates(rates)
    assert cond[0] == rates[0] and cond[3] == pytest.approx(0.55 / 0.7)
    assert np.cumprod(cond) == pytest.approx(rates)
    b = np.array(sc.pinned_intercepts(rates))
    assert 1 / (1 + np.exp(-b)) == pytest.approx(cond)
    assert sc.conditional_rates([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]
    assert np.isfinite(sc.pinned_intercepts([1.0, 0.0, 0.0])).all()  # kept off 0 and 1
    assert sc.arm_label("aware", 4, 0.2, True, speculator="draft", estimator="pinned") == \
        "draft-aware-tail20-chunks-pinned"
    assert sc.arm_label("stock", 4, speculator="draft", estimator="pinned", rerun=True) == "draft-stock-pinned-rerun"
    runs = sc.CONFIG["comparisons"]["draft-goodput-pinned"]
    assert runs[0] == "draft-stock-pinned" and runs[-1] == "draft-stock-pinned-rerun" and "draft-fixed" in runs
    for arm in runs:  # the report finds every arm's files
        assert sc.ARM_FILE.fullmatch(f"context-{arm}.json").group(1) == arm


@pytest.mark.parametrize("change", [{"speculator": "dspark"}, {"pricing": "fixed"}, {"estimator": "oracle"}])
def test_a_pinned_estimator_needs_one_to_pin(sc, tmp_path, change):
    """DSpark's confidence head has no estimator, fixed K verifies everything: neither can be pinned."""
    cfg = json.loads((REPO / "benchmarks" / "serving" / "arms.json").read_text())
    cfg["arms"]["draft-stock-pinned"].update(change)
    path = tmp_path / "arms.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="estimator|label"):
        sc.load_config(str(path))


def test_a_pinned_arm_needs_the_rates_it_pins(sc, tmp_path, capsys):
    assert sc.main(["arm", "draft-stock-pinned", "--table", str(SCHEMA10), "--out", str(tmp_path), "--dry-run",
                    "--workloads", "ctx8k"]) == 2
    assert "give --acceptance-rates" in capsys.readouterr().err


@pytest.mark.slow
def test_a_pinned_arm_dry_runs_pinned_from_the_start(sc, tmp_path):
    """The engine child pins before the warm-up: no cold phase, the fake estimator never refits,
    the pin's state is recorded."""
    assert sc.main(["arm", "draft-stock-pinned", "--table", str(SCHEMA10), "--out", str(tmp_path), "--work",
                    str(tmp_path / "w"), "--dry-run", "--workloads", "ctx8k", "--acceptance-rates", "decaying"]) == 0
    summary = json.loads((tmp_path / "context-draft-stock-pinned.json").read_text())
    pin = next(e for e in summary["estimator"] if e["after"] == "pin")
    assert pin["slope"] == 0.0 and pin["pinned"] and pin["intercepts"] == sc.pinned_intercepts(
        sc.CONFIG["schedules"]["decaying"])
    assert summary.get("cold") is None
    seen = read_observed([tmp_path / "context-draft-stock-pinned-observed.parquet"])
    refits = np.asarray(seen["estimator_refits"], dtype=float)
    assert set(refits[refits >= 0]) == {0}  # written once (negative: absent, no new refit)


# -- advise's prediction beside the arms ----------------------------------------------------------
def test_the_enforced_schedule_is_the_rates_or_vllms_minimum_variance_schedule(sc):
    spec = {"rejection_sample_method": "synthetic", "num_speculative_tokens": 7}
    assert sc.enforced_schedule({**spec, "synthetic_acceptance_rates": [0.9, 0.5] + [0.1] * 5}) == [0.9, 0.5] + [0.1] * 5
    assert sc.enforced_schedule({**spec, "synthetic_acceptance_length": 4.0}) == [1.0] * 3 + [0.0] * 4
    assert sc.enforced_schedule({**spec, "synthetic_acceptance_length": 3.5}) == [1.0, 1.0, 0.5] + [0.0] * 4
    assert sc.enforced_schedule({**spec, "synthetic_acceptance_length": 8.0}) == [1.0] * 7
    assert sc.enforced_schedule({"rejection_sample_method": "standard", "num_speculative_tokens": 7}) is None


@pytest.mark.parametrize("length", [1.0, 2.25, 4.0, 5.5, 8.0])
def test_the_minimum_variance_schedule_is_vllms_own(sc, length):
    config = pytest.importorskip("vllm.config.speculative")
    spec = {"rejection_sample_method": "synthetic", "num_speculative_tokens": 7, "synthetic_acceptance_length": length}
    assert sc.enforced_schedule(spec) == config.SpeculativeConfig._acceptance_length_to_rates(length, 7)


def test_a_ranking_groups_values_within_the_tie_and_agrees_on_the_pairs_it_orders(sc):
    assert sc.ranking({"a": 1.0, "b": 1.2, "c": 1.005}, 0.01) == [["b"], ["c", "a"]]
    assert sc.ranking({"a": 1.0, "b": 1.2, "c": 1.005}) == [["b"], ["c"], ["a"]]
    predicted = {"a": 1.0, "b": 1.2, "c": 1.005}
    # b above a and c by more than the tie: measured so -> agrees, whichever of a and c is ahead
    assert sc.rank_agrees(predicted, {"a": 1.01, "b": 1.1, "c": 1.0}, 0.01, None)
    assert not sc.rank_agrees(predicted, {"a": 1.2, "b": 1.1, "c": 1.0}, 0.01, None)
    # a and c predicted equal: measured 3 % apart is a tie within a 4 % noise, not within a 2 % one
    assert sc.rank_agrees(predicted, {"a": 1.03, "b": 1.1, "c": 1.0}, 0.01, 0.04)
    assert not sc.rank_agrees(predicted, {"a": 1.03, "b": 1.1, "c": 1.0}, 0.01, 0.02)
    assert sc.rank_agrees(predicted, {"a": 1.03, "b": 1.1, "c": 1.0}, 0.01, None)  # no rerun: no noise known
    # nothing to check: every pair predicted equal and no noise known, or one arm
    assert sc.rank_agrees({"a": 1.0, "c": 1.005}, {"a": 1.2, "c": 1.0}, 0.01, None) is None
    assert sc.rank_agrees({"a": 1.0, "c": 1.005}, {"a": 1.2, "c": 1.0}, 0.01, 0.05) is False
    assert sc.rank_agrees({"a": 1.0}, {"a": 1.2}, 0.01, 0.05) is None


def _summary(arm, pricing, tok_s, k=7):
    """tok/s per workload; TPOT p50 1 ms per 1000 tok/s (its ratio to stock's is the tok/s ratio)."""
    return {"arm": arm, "pricing": pricing, "engine": {"speculative_config": {"num_speculative_tokens": k}},
            "workloads": {w: {"output_tok_s": v, "tpot_p50_ms": 1000.0 / v} for w, v in tok_s.items()}}


def _mix(goodputs, requests=10):
    return {"requests": requests, "acceptance": {"rates": [0.5]},
            "options": [{"name": n, "goodput_per_ms": g, "drafts": 7.0 * requests} for n, g in goodputs.items()]}


def test_the_prediction_beside_the_arms_by_hand(sc):
    """stock's decode steps took 300 ms, its other steps 100: fixed K=7 modelled 1.10 x stock's decode
    goodput -> 400 / (100 + 300 / 1.1) = 1.0732 for the workload, measured 1.10 (within 5 %); aware 1.05 ->
    1.0370, measured 1.05. On w2 aware is measured below stock: the ranking disagrees."""
    arms = {"draft-stock": _summary("draft-stock", "stock", {"w": 1000.0, "w2": 1000.0}),
            "draft-stock-rerun": _summary("draft-stock-rerun", "stock", {"w": 1020.0, "w2": 990.0}),
            "draft-fixed": _summary("draft-fixed", "fixed", {"w": 1100.0, "w2": 1100.0}),
            "draft-aware-tail20-chunks": _summary("draft-aware-tail20-chunks", "aware", {"w": 1050.0, "w2": 900.0}),
            "stock": _summary("stock", "stock", {"w": 5.0})}  # another speculator's arm: not in this comparison
    mix = _mix({"K=7": 1.1, "adaptive": 1.05, "adaptive@8192": 1.0})
    work = {"decode_steps": 30, "other_steps": 10, "decode_ms": 300.0, "other_ms": 100.0, "mix": {"schedule": mix}}
    advice = {"one_context": 8192, "workloads": {"w": work, "w2": work}}
    rows = sc.compare_advice(arms, "draft-stock", advice)
    assert [(r["workload"], r["acceptance"]) for r in rows] == [("w", "schedule"), ("w2", "schedule")]
    w, w2 = rows
    got = {a["arm"]: a for a in w["arms"]}
    assert list(got) == ["draft-stock", "draft-aware-tail20-chunks", "draft-fixed"]
    assert [got[a]["option"] for a in got] == ["adaptive@8192", "adaptive", "K=7"]
    fixed, aware = got["draft-fixed"], got["draft-aware-tail20-chunks"]
    assert fixed["predicted_decode_ratio"] == 1.1 and fixed["predicted_ratio"] == pytest.approx(400 / (100 + 300 / 1.1), abs=1e-4)
    assert fixed["measured_ratio"] == 1.1 and fixed["measured_ratio_stock_mean"] == pytest.approx(1100 / 1010, abs=1e-4)
    assert fixed["predicted_tok_s"] == 1100.0 and fixed["predicted_drafts_per_request"] == 7.0
    # the decode ratio against the steady decode: 1.10 against 1.10, 1.05 against 1.05
    assert fixed["measured_tpot_ratio"] == 1.1 and fixed["within_tpot"] and got["draft-aware-tail20-chunks"]["within_tpot"]
    assert aware["predicted_ratio"] == pytest.approx(400 / (100 + 300 / 1.05), abs=1e-4) and aware["within"]
    assert fixed["within"] and got["draft-stock"]["predicted_ratio"] == 1.0 and got["draft-stock"]["within"]
    assert w["rank_predicted"] == [["draft-fixed"], ["draft-aware-tail20-chunks"], ["draft-stock"]]
    assert w["rank_agrees"] and w["all_within"] and w["noise"] == 1.02 and w["other_time_share"] == 0.25
    assert w2["rank_measured"] == [["draft-fixed"], ["draft-stock"], ["draft-aware-tail20-chunks"]]
    assert w2["rank_agrees"] is False and w2["all_within"] is False and w2["noise"] == 0.99
    assert not {a["arm"]: a for a in w2["arms"]}["draft-aware-tail20-chunks"]["within"]  # 1.037 vs 0.9


def test_advise_workloads_models_each_workloads_decode_steps(sc, tmp_path):
    """The stock arm's observe file, segmented by markers: each workload's decode steps (not the one
    carrying a prefill chunk, whose time is the workload's other time) go to advise.predict_steps, once per
    acceptance; files without an engine give no observed acceptance (a note, the schedule still predicts)."""
    from dspark_calib.advise import Acceptance, predict_steps
    from dspark_calib.table.file import read_table
    from tests.helpers import SHIPPED

    import dataclasses

    rows = _stream([(40, 64, 8300), (25, 32, 1000)])
    rows[21] = dataclasses.replace(rows[21], num_target_tokens=rows[21].num_target_tokens + 500)  # a prefill chunk
    _write(tmp_path / "obs", rows)
    dst = str(tmp_path / "context-stock-observed.parquet")
    sc.compact_observed(str(tmp_path / "obs"), dst)
    spec = {"rejection_sample_method": "synthetic", "num_speculative_tokens": 7, "synthetic_acceptance_length": 4.0}
    out = sc.advise_workloads(str(SHIPPED), dst, ["a", "b"], spec, one_context=8192, acceptance_files=[dst])
    assert out["segmented"] == "ok" and list(out["workloads"]) == ["a", "b"] and out["vocab_size"] == 151936
    assert "records no engine fingerprint" in out["notes"][0] and list(out["acceptance"]) == ["schedule"]
    a = out["workloads"]["a"]
    assert (a["decode_steps"], a["other_steps"]) == (38, 1)
    assert a["decode_ms"] == pytest.approx(38 * 1.25) and a["other_ms"] == pytest.approx(1.25)
    want = predict_steps(read_table(SHIPPED, samples=False), Acceptance((1.0,) * 3 + (0.0,) * 4, "given"),
                         [64] * 38, [8300.0] * 38, one_context=8192, vocab_size=151936).to_dict()
    assert a["mix"]["schedule"] == want and out["workloads"]["b"]["mix"]["schedule"]["requests"] == 24 * 32


@pytest.mark.slow
def test_the_report_puts_advises_prediction_beside_the_dry_run_arms(sc, tmp_path):
    """draft-stock and draft-fixed on the fake engine, then the report: advise models ctx8k's decode steps
    from draft-stock's observe file at the enforced schedule and at the acceptance both arms' files graded
    (the fixed arm verifies every draft: 3 accepted, the 4th graded and rejected)."""
    table = REPO / "benchmarks" / "results" / "h200" / "2026-12-01-2035-draft-model" / \
        "qwen3-8b__qwen3-0.6b__tp1__nvidia-h200__bdfb1efec4b8.parquet"
    common = ["--table", str(tmp_path / table.name), "--out", str(tmp_path), "--work", str(tmp_path / "w"),
              "--dry-run", "--workloads", "ctx8k", "--waves", "1", "--acceptance-rates", "decaying"]
    (tmp_path / table.name).write_bytes(table.read_bytes())  # run.sh's copy beside the results
    assert sc.main(["arm", "draft-stock", *common]) == 0 and sc.main(["arm", "draft-fixed", *common]) == 0
    assert json.loads((tmp_path / "context-draft-fixed.json").read_text())["budgets"]["share_full"] == 1.0
    assert sc.main(["report", "--results", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve_context.json").read_text())
    assert [(r["arm"], r["vs_stock"] is not None) for r in report["rows"]] == [("draft-fixed", True),
                                                                              ("draft-stock", True)]
    (group,) = report["advice"]["groups"]
    assert group["stock"] == "draft-stock" and group["arms"] == ["draft-stock", "draft-fixed"]
    assert group["acceptance"]["schedule"]["rates"] == [0.9, 0.8, 0.7, 0.55, 0.4, 0.3, 0.2]
    assert group["acceptance"]["observed"]["rates"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert len(group["acceptance"]["observed"]["files"]) == 2 and group["notes"] == []
    rows = report["advice"]["rows"]
    assert [(r["workload"], r["acceptance"]) for r in rows] == [("ctx8k", "schedule"), ("ctx8k", "observed")]
    for r in rows:
        assert r["decode_steps"] > 0 and [a["option"] for a in r["arms"]] == ["adaptive@8192", "K=7"]
        assert all(a["predicted_ratio"] and a["measured_ratio"] and a["within"] is not None for a in r["arms"])
        assert sorted(sum(r["rank_predicted"], [])) == sorted(sum(r["rank_measured"], [])) == ["draft-fixed",
                                                                                               "draft-stock"]
        assert r["noise"] is None  # no rerun
    md = (tmp_path / "serve_context.md").read_text()
    assert "`dspark-calib advise`'s model beside the arms" in md and "| ctx8k | observed | draft-fixed | K=7 |" in md
    for arm in ("draft-fixed", "draft-stock"):  # one step timer in every arm, adaptive verification or not
        summary = json.loads((tmp_path / f"context-{arm}.json").read_text())
        timer = summary["workloads"]["ctx8k"]["step_timer"]
        assert summary["step_timer"]["started"] is True and timer["steps"] > 0 and timer["stalls"] == []
        steps = json.loads((tmp_path / f"context-{arm}-steps.json").read_text())["ctx8k"]
        assert len(steps["interval_ms"]) == timer["steps"]
        assert f"| {arm} | ctx8k | {timer['steps']} | " in md


def test_each_speculators_arms_are_read_against_its_own_stock_arm(sc):
    def arm(tok_s):
        return {"workloads": {"w": {"workload": {"concurrency": 8}, "requests": 16, "output_tok_s": tok_s,
                                    "tpot_p50_ms": 1.0, "tpot_p90_ms": 1.0}}}

    rows = sc.build_report({"stock": arm(100.0), "aware": arm(110.0), "draft-stock": arm(50.0),
                            "draft-fixed": arm(60.0)})["rows"]
    assert {r["arm"]: r["vs_stock"] for r in rows} == {"stock": 1.0, "aware": 1.1, "draft-stock": 1.0,
                                                       "draft-fixed": 1.2}

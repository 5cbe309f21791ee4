"""The load-time probe and data-parallel agreement, on the real vLLM classes (CPU).

The engine is simulated as vLLM's capture_model runs it: the real (hooked)
StepTimingCollector.collect() block around the patched batches_to_profile of a real
AdaptiveVerificationManager, one timed entry per dummy step (events whose
elapsed_time returns chosen times), then set_initial_cost_curves(timings).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from vllm.v1.worker.gpu import model_runner
from vllm.v1.worker.gpu.async_utils import StepTimingCollector

from dspark_calib.table.file import write_table
from dspark_calib.vllm import dp_agreement, load as loader, plugin
from dspark_calib.vllm import runtime
from dspark_calib.vllm import probe as P
from tests.helpers import DRAFT, MODEL, REPO
from dspark_calib.selection import decide

ROOT = str(REPO)
POLICIES = ("fallback", "strict", "warn")
LIMIT = 512
WARMUPS = 5  # one per tail size: 768, 1024, 2048, 4096, 8192
PROBES = 6  # the capture limit and the largest tail size at each of the 3 contexts
OURS = WARMUPS + PROBES


def is_context_aware_line(msg: str) -> bool:
    """Context-aware mode's own line after a load of a multi-context table (test_context_aware tests it)."""
    return msg.startswith("dspark-calib: context-aware costs")


class SingleRank:
    rank_in_group, world_size = 0, 1

    def broadcast_object(self, obj, src=0):
        return obj


@pytest.fixture(autouse=True)
def patched(monkeypatch):
    for key in list(os.environ):
        if key.startswith("DSPARK_CALIB_") or key == "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN":
            monkeypatch.delenv(key)
    monkeypatch.setattr(av, "get_tp_group", lambda: SingleRank())
    plugin.patch(av.AdaptiveVerificationManager, model_runner)
    loader.install_hooks()  # what plugin.py will call next to _wrap_factory
    yield
    loader.remove_hooks()
    plugin.unpatch(av.AdaptiveVerificationManager, model_runner)


def make_manager():
    m = object.__new__(av.AdaptiveVerificationManager)
    m.req_states = SimpleNamespace(max_num_reqs=256, max_num_batched_tokens=8192)
    m.num_speculative_steps, m._cudagraph_limit, m.cost_tables = 7, 0, None
    runtime.state_of(m).vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(dtype="bfloat16", quantization=None, model=MODEL, max_model_len=32768),
        cache_config=SimpleNamespace(cache_dtype="auto"), speculative_config=SimpleNamespace(model=DRAFT))
    return m


class Event:
    def __init__(self, ms=0.0):
        self.ms, self.synced = ms, 0

    def elapsed_time(self, end):
        return end.ms

    def synchronize(self):
        self.synced += 1


def point(curve, size):
    return float(curve.cost_ms[list(curve.size).index(size)]) if size in list(curve.size) else 1.0


def run_engine(manager, capture_sizes, table, ratio=1.0):
    """capture_model's loop; probe steps (context = the table's) cost `ratio` x the table's medians."""
    collector = StepTimingCollector()
    batches = []
    with collector.collect() as timings:
        assert P.active_collector() is collector
        for batch in manager.batches_to_profile(capture_sizes):
            batches.append(batch)
            n = batch["num_tokens"]
            r, full = min(n, 256), n <= LIMIT
            pair = table.curves[table.nearest_context(batch["context_len"])]
            scale = ratio if len(batches) > 5 else 1.0  # warm-ups are never judged
            events = SimpleNamespace(forward_start=Event(), forward_end=Event(point(pair.verify, n) * scale),
                                     drafter_start=Event(), drafter_end=Event(point(pair.draft, r) * scale))
            collector._timed.append((events, (full, n, r)))
    manager.set_initial_cost_curves(timings)
    return batches, timings


def load_env(monkeypatch, source, policy, **env):
    """The env of an engine started with a table (reference tables allowed) under a policy."""
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(source))
    monkeypatch.setenv("DSPARK_CALIB_ALLOW_REFERENCE", "1")
    monkeypatch.setenv("DSPARK_CALIB_POLICY", policy)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def start(monkeypatch, caplog, tmp_path, table, recorded_sizes, policy, ratio, **env):
    load_env(monkeypatch, write_table(table, tmp_path), policy, **env)
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches, timings = run_engine(m, recorded_sizes, table, ratio)
    return m, batches, timings, [r for r in caplog.records if r.name == "vllm.dspark_calib" and not is_context_aware_line(r.getMessage())]


@pytest.fixture(scope="module")
def sizes(reference_table):
    return list(reference_table.fingerprint.cudagraph_capture_sizes)


def test_matching_costs_load_with_the_worst_ratio_at_info(monkeypatch, caplog, tmp_path, reference_table, sizes):
    m, batches, _, records = start(monkeypatch, caplog, tmp_path, reference_table, sizes, "strict", 1.0)
    assert [b["num_tokens"] for b in batches] == [768, 1024, 2048, 4096, 8192] + [LIMIT, 8192] * 3
    assert [b["context_len"] for b in batches[WARMUPS:]] == [1024] * 2 + [8192] * 2 + [16384] * 2
    probe_line = records[-1]
    assert probe_line.levelno == logging.INFO and "worst" in probe_line.getMessage()
    for ctx in (8192, 16384):  # the probe reads the installed table (running max: 0.99x at 1024, 512)
        assert f"context {ctx}: verify@512 1.00x, draft@256 1.00x, verify@8192 1.00x" in probe_line.getMessage()
    assert "6 steps in" in probe_line.getMessage() and "SM clock not read" in probe_line.getMessage()
    draft, verify = reference_table.curves[8192].as_vllm()
    want = av.build_cost_tables_from_curves(draft, verify, 256, 8192, LIMIT)
    assert np.array_equal(m.cost_tables[1], want[1]) and np.array_equal(m.cost_tables[0], want[0])


@pytest.mark.parametrize("ratio", [1.3, 0.7])
@pytest.mark.parametrize("policy", POLICIES)
def test_costs_off_by_more_than_the_tolerance(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, ratio):
    if policy == "strict":
        with pytest.raises(RuntimeError) as err:
            start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, ratio)
        assert f"{ratio:.2f}x" in str(err.value) and "policy strict" in str(err.value)
        return
    m, batches, timings, records = start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, ratio)
    line = records[-1].getMessage()
    assert records[-1].levelno == logging.WARNING and f"verify@512 {ratio:.2f}x" in line
    assert f"draft@256 {ratio:.2f}x" in line and f"verify@8192 {ratio:.2f}x" in line
    if policy == "warn":
        assert len(batches) == OURS and "loading it anyway" in line
        draft, verify = reference_table.curves[8192].as_vllm()
        assert np.array_equal(m.cost_tables[1], av.build_cost_tables_from_curves(draft, verify, 256, 8192, LIMIT)[1])
        return
    # fallback: vLLM's full profile ran in the same generator; vLLM saw only its own samples
    stock = list(av.AdaptiveVerificationManager.batches_to_profile.__wrapped__(make_manager(), sizes))
    assert batches[OURS:] == stock and "profiling at start-up as usual" in line
    reference = make_manager()
    reference._cudagraph_limit = LIMIT
    av.AdaptiveVerificationManager.set_initial_cost_curves.__wrapped__(reference, timings[OURS:])
    assert np.array_equal(m.cost_tables[1], reference.cost_tables[1])
    assert np.array_equal(m.cost_tables[0], reference.cost_tables[0])


def test_probe_can_be_disabled(monkeypatch, caplog, tmp_path, reference_table, sizes):
    _, batches, _, _ = start(monkeypatch, caplog, tmp_path, reference_table, sizes, "strict", 1.3,
                             DSPARK_CALIB_PROBE="0")
    assert len(batches) == 5


def installed_at(table, *contexts):
    from dspark_calib.pricing.costs import ContextCosts

    costs = ContextCosts({c: table.curves[c] for c in contexts}, 256, 8192, LIMIT)
    return {c: costs.tables[c] for c in contexts}


def test_judge_tolerance_uses_the_tables_spread(reference_table):
    installed, pairs = installed_at(reference_table, 8192), reference_table.curves
    median = float(installed[8192][1][8192])
    step = [P.Step(8192, 8192)]
    assert P.judge(installed, pairs, [P.Measured(median * 1.04, 0.0, 8192, 256, False)], step).ok
    assert not P.judge(installed, pairs, [P.Measured(median * 1.06, 0.0, 8192, 256, False)], step).ok
    missed = P.judge(installed, pairs, [], [P.Step(8192, 512), P.Step(8192, 8192)])
    assert not missed.ok and "0 of 2" in missed.summary()
    unknown = P.judge(installed, pairs, [P.Measured(1.0, 1.0, 3, 3, True)], [P.Step(8192, 3)])
    assert not unknown.ok and "no table point" in unknown.summary()  # no point at the probed size: a failure


# -- data parallel ------------------------------------------------------------------------
def stub_dp(monkeypatch, size, rank, others):
    """others(call, mine) -> the other replicas' votes in this exchange (load.dp_votes, whose store
    exchange test_dp_gloo runs over real gloo processes)."""
    calls = []

    def dp_votes(what, mine, rank0, parallel):
        values = others(len(calls), mine)
        calls.append(mine)
        return dp_agreement.Votes(values[:rank] + [mine] + values[rank:])

    monkeypatch.setattr(dp_agreement, "dp_votes", dp_votes)
    return calls


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_dp_replicas_that_agree_load(monkeypatch, caplog, tmp_path, reference_table, sizes, size, policy):
    calls = stub_dp(monkeypatch, size, 1, lambda call, mine: [mine] * (size - 1))
    m, batches, _, _ = start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, 1.0)
    assert len(batches) == OURS and len(calls) == 2  # the table, then the probe verdict
    assert calls[0][5] == PROBES  # the probe's step count is agreed before any probe step runs
    assert calls[0][1] == reference_table.content_hash


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stage", ["table", "probe"])
def test_dp_replicas_that_disagree_all_take_the_same_path(monkeypatch, caplog, tmp_path, reference_table, sizes,
                                                          size, policy, stage):
    def others(call, mine):
        if (stage == "table" and call == 0) or (stage == "probe" and call == 1):
            other = (False, "", False, False) if call == 0 else (False,)  # a replica fell back / failed its probe
            return [mine] * (size - 2) + [other]
        return [mine] * (size - 1)

    stub_dp(monkeypatch, size, 0, others)
    if policy == "strict":
        with pytest.raises(RuntimeError, match="data-parallel replicas|probe"):
            start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, 1.0)
        return
    m, batches, _, records = start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, 1.0)
    line = records[-1].getMessage()
    assert "data-parallel replicas decided differently" in line and f"replica {size - 1}: False" in line
    assert "profiling at start-up as usual" in line
    n_ours = 0 if stage == "table" else OURS
    assert len(batches) == n_ours + 280  # the full profile, as on the replica that fell back


def test_dp_replicas_reach_the_same_step_count(monkeypatch, caplog, tmp_path, reference_table, sizes):
    """Replica 0 finds the table, replica 1 does not: both must end in vLLM's full profile."""
    good = write_table(reference_table, tmp_path)
    views = {0: (True, reference_table.content_hash, False, True), 1: (False, "", False, False)}
    counts = []
    for rank, table_env in ((0, good), (1, str(tmp_path / "missing"))):
        stub_dp(monkeypatch, 2, rank, lambda call, mine, r=rank: [views[1 - r]] if call == 0 else [mine])
        monkeypatch.setenv("DSPARK_CALIB_TABLE", table_env)
        monkeypatch.setenv("DSPARK_CALIB_ALLOW_REFERENCE", "1")
        batches, _ = run_engine(make_manager(), sizes, reference_table)
        counts.append(len(batches))
    assert counts == [280, 280]


def test_failed_dp_collective_is_a_disagreement(monkeypatch, caplog, tmp_path, reference_table, sizes):
    def broken(call, mine):
        raise RuntimeError("gloo timeout")

    stub_dp(monkeypatch, 2, 0, broken)
    with pytest.raises(RuntimeError, match="could not agree"):
        start(monkeypatch, caplog, tmp_path, reference_table, sizes, "strict", 1.0)


def test_one_refusing_replica_makes_all_refuse(monkeypatch, caplog, tmp_path, reference_table, sizes):
    stub_dp(monkeypatch, 2, 0, lambda call, mine: [(False, "", True, False)])  # e.g. a bad policy value there
    with pytest.raises(RuntimeError, match="data-parallel replicas decided differently"):
        start(monkeypatch, caplog, tmp_path, reference_table, sizes, "fallback", 1.0)


# -- the env path end to end (decision_from_env inside the patched generator) ----------------
@pytest.mark.parametrize("policy", POLICIES)
def test_silent_store_through_the_plugin_ends_in_the_policy(monkeypatch, caplog, sizes, reference_table, policy):
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # accepts into the backlog, never answers
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_EC2_METADATA_DISABLED": "true",
                 "DSPARK_CALIB_POLICY": policy, "DSPARK_CALIB_LOAD_TIMEOUT": "1",
                 "DSPARK_CALIB_TABLE": f"s3://b/t?endpoint_override=127.0.0.1:{server.getsockname()[1]}&scheme=http"}.items():
        monkeypatch.setenv(k, v)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
            if policy == "strict":
                with pytest.raises(RuntimeError, match="policy strict"):
                    run_engine(make_manager(), sizes, reference_table)
                return
            batches, _ = run_engine(make_manager(), sizes, reference_table)
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.dspark_calib" and not is_context_aware_line(r.getMessage())]
    assert len(batches) == 280 and len(lines) == 1 and "profiling at start-up as usual" in lines[0]


@pytest.mark.parametrize("name,value", [("DSPARK_CALIB_TABLE_SHA256", "abc"), ("DSPARK_CALIB_LOAD_TIMEOUT", "soon"),
                                        ("DSPARK_CALIB_PROBE", "maybe"), ("DSPARK_CALIB_CONTEXT_LEN", "8k")])
@pytest.mark.parametrize("policy", POLICIES)
def test_bad_env_value_is_one_line_and_the_policy(monkeypatch, caplog, tmp_path, reference_table, sizes, policy,
                                                  name, value):
    monkeypatch.setenv(name, value)
    if policy == "strict":
        with pytest.raises(RuntimeError, match=name):
            start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, 1.0)
        return
    _, batches, _, records = start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, 1.0)
    assert len(batches) == 280 and len(records) == 1 and name in records[0].getMessage()


# -- review finding 1: a forged huge spread must not widen the probe's tolerance ----------
def _forged_spread(table):
    """forge.py: costs x1.3, p25 = min = 0, p75 = max = 2 x the forged cost (relative IQR 2.0)."""
    import dataclasses
    from dspark_calib.fit import Curve, CurvePair

    def forge(c):
        cols = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
        cols["cost_ms"] = c.cost_ms * 1.3
        cols["min_ms"] = cols["p25_ms"] = c.cost_ms * 0.0
        cols["p75_ms"] = cols["max_ms"] = c.cost_ms * 2.6
        return Curve.from_columns(cols)

    return dataclasses.replace(table, curves={k: CurvePair(draft=forge(p.draft), verify=forge(p.verify))
                                              for k, p in table.curves.items()})


def test_probe_tolerance_is_capped_whatever_the_tables_spread(reference_table):
    real, forged_table = reference_table.curves[8192], _forged_spread(reference_table)
    i, j = list(real.verify.size).index(512), list(real.draft.size).index(256)
    gpu = [P.Measured(float(real.verify.cost_ms[i]), float(real.draft.cost_ms[j]), 512, 256, True)]
    verdict = P.judge(installed_at(forged_table, 8192), forged_table.curves, gpu, [P.Step(8192, 512)])
    assert not verdict.ok and all(c.tolerance <= P.MAX_TOLERANCE for c in verdict.checks)


@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_forged_spread_table_is_refused_at_read_time(monkeypatch, tmp_path, reference_table, policy):
    path = write_table(_forged_spread(reference_table), tmp_path / "forged.parquet")
    d = decide(str(path), {}, policy=policy, allow_reference=True)
    assert not d.load
    assert ("IQR" in d.refuse) if policy == "strict" else (not d.refuse and "profiling" in d.lines[0])


# -- review finding 7: a probe that cannot run is never a silent unprobed load ----------------
@pytest.mark.parametrize("policy", POLICIES)
def test_probe_that_cannot_run_refuses_under_strict_else_warns(monkeypatch, caplog, tmp_path, reference_table, sizes,
                                                               policy):
    monkeypatch.setattr(P, "timed_count", lambda collector: None)  # the step timer is not reachable
    if policy == "strict":
        with pytest.raises(RuntimeError, match="probe could not run.*policy strict"):
            start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, 1.0)
        return
    m, batches, _, records = start(monkeypatch, caplog, tmp_path, reference_table, sizes, policy, 1.0)
    probe_lines = [r for r in records if "probe could not run" in r.getMessage()]
    assert len(probe_lines) == 1 and probe_lines[0].levelno == logging.WARNING
    assert "loading it unprobed" in probe_lines[0].getMessage() and len(batches) == 5


def test_plugin_installs_the_timing_hook_before_patching_the_class(monkeypatch):
    class Manager:
        def batches_to_profile(self, capture_sizes):
            yield from ()

        def set_initial_cost_curves(self, samples):
            pass

    def broken():
        raise AttributeError("StepTimingCollector has no collect")

    monkeypatch.setattr(loader, "install_hooks", broken)
    with pytest.raises(AttributeError):
        plugin.patch(Manager)
    assert not plugin.is_patched(Manager)  # vLLM untouched, never patched without its probe


# -- review finding 8: replicas with different policies disagree ------------------------------
@pytest.mark.parametrize("mine, theirs", [("fallback", "warn"), ("fallback", "strict"), ("warn", "fallback")])
def test_dp_replicas_with_different_policies_disagree(monkeypatch, caplog, tmp_path, reference_table, sizes,
                                                      mine, theirs):
    stub_dp(monkeypatch, 2, 0, lambda call, obj: [obj[:4] + (theirs,)] if call == 0 else [obj])
    if "strict" in (mine, theirs):
        with pytest.raises(RuntimeError, match="data-parallel replicas decided differently"):
            start(monkeypatch, caplog, tmp_path, reference_table, sizes, mine, 1.0)
        return
    m, batches, _, records = start(monkeypatch, caplog, tmp_path, reference_table, sizes, mine, 1.0)
    line = records[-1].getMessage()
    assert "data-parallel replicas decided differently" in line and "profiling at start-up as usual" in line
    assert len(batches) == 280  # vLLM's full profile, as every replica runs


def test_judge_refuses_fewer_timed_steps_than_planned_even_when_those_agree(reference_table):
    """Two steps planned, one timed and matching the table: not a pass (a probe that lost a step
    judged on what was left would vouch for sizes it never timed)."""
    installed, pairs = installed_at(reference_table, 8192), reference_table.curves
    median = float(installed[8192][1][8192])
    good = P.Measured(median, 0.0, 8192, 256, False)
    steps = [P.Step(8192, 8192), P.Step(8192, 8192)]
    assert P.judge(installed, pairs, [good, good], steps).ok
    short = P.judge(installed, pairs, [good], steps)
    assert not short.ok and "1 of 2 probe steps were timed" in short.summary()

"""Observe mode in the engine (CPU): vLLM's real AdaptiveVerificationManager and StepTimingCollector
behind a runner stand-in that calls them in vLLM 0.33's order; CUDA events stubbed.

FakeRunner mirrors model_runner.py: execute_model calls get_num_tokens only when drafts are scheduled
(gather_batch_req_state), then step_timing.record_batch and .forward_start, then the forward;
sample_tokens calls speculator.propose; _dummy_run times through vLLM's collector exactly as vLLM's.
Each step's fake GPU durations encode the step, so a misaligned join shows as a wrong number.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from vllm.distributed import parallel_state
from vllm.v1.worker.gpu import model_runner
from vllm.v1.worker.gpu.async_utils import StepTimingCollector

from dspark_calib.cli.app import app
from dspark_calib.observe.step import ABSENT
from dspark_calib.observe.file import read_observed
from dspark_calib.vllm import context_aware as ca
from dspark_calib.vllm import observer as om
from dspark_calib.vllm import plugin
from dspark_calib.vllm import runtime
from dspark_calib.vllm.shape import observe_problem
from tests.vllm.test_context_aware import SingleRank, grid_3ctx, make_manager, schedule  # noqa: F401 - fixture reused
from tests.helpers import aware


class Clock:
    """The fake device: events take the time of the work enqueued before them; done on demand."""

    def __init__(self):
        self.t, self.done_upto = 0.0, float("inf")
        self.syncs = 0  # host syncs: vLLM's collect() makes one; observe none
        self.host = 0.0  # the host's clock (seconds): what observe's timer reads


class Event:
    def __init__(self, clock):
        self.clock, self.t = clock, None

    def record(self):
        self.t = self.clock.t

    def query(self):
        return self.t is not None and self.t <= self.clock.done_upto

    def synchronize(self):
        self.clock.syncs += 1

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time on an unfinished event would synchronise"
        return end.t - self.t


def events_factory(clock):
    return lambda: SimpleNamespace(**{f: Event(clock) for f in ("forward_start", "forward_end",
                                                                 "drafter_start", "drafter_end")})


class Speculator:
    """vLLM's propose parameters up to the rejection sampler's counts (speculator.py)."""

    def __init__(self, runner):
        self.runner = runner

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, *args, dummy_run=False, **kwargs):
        self.runner.clock.t += self.runner.drafter_ms
        return None


class FakeRunner:
    """vLLM's call order (model_runner.py ~1351, ~2045, ~2290, _dummy_run ~945)."""

    def __init__(self, manager, clock):
        self.adaptive_verification, self.clock = manager, clock
        self.step_timing = StepTimingCollector()
        self.speculator = Speculator(self)
        self.max_model_len, self.dp_rank = 32768, 0
        self.forward_ms = self.drafter_ms = 0.0
        self.issue_s = 0.0  # host time an execute_model call takes
        self.shut = False

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False, **kw):
        num_tokens, drafts, full = scheduler_output
        total = sum(num_tokens.values())
        if drafts and not dummy_run:
            total = self.adaptive_verification.get_num_tokens(num_tokens, drafts)
        batch = SimpleNamespace(num_tokens=total, num_reqs=len(num_tokens))
        self.budget = total - len(num_tokens) if drafts and not dummy_run else 0
        self.step_timing.record_batch(batch, full)
        self.step_timing.forward_start()
        self.clock.t += self.forward_ms
        self.clock.host += self.issue_s
        self.batch = batch

    def sample_tokens(self, grammar_output=None):
        self.clock.t += 0.25  # the sampler: between forward end and drafter start, in neither span
        self.verdict = verdict(self.batch.num_reqs, self.budget)
        self.speculator.propose(self.batch, None, None, None, None, *self.verdict)

    def _dummy_run(self, num_tokens):
        self.execute_model(({f"d{i}": 1 for i in range(num_tokens)}, {}, True), dummy_run=True)
        self.step_timing.forward_end()
        self.step_timing.drafter_start()
        self.speculator.propose(self.batch, None, None, None, None, *verdict(num_tokens, 0), dummy_run=True)
        self.step_timing.drafter_end()

    def shutdown(self):
        self.shut = True


def verdict(num_reqs, budget):
    """The rejection sampler's (num_sampled, num_rejected), as tensors: the budget spread as vLLM's
    compact_batch spreads it, request i accepting i % 3 of its drafts (at most all); a padded row past
    num_reqs (vLLM's tensors may be longer) that must not count."""
    import torch

    drafts = np.full(num_reqs, budget // num_reqs)
    drafts[:budget % num_reqs] += 1
    accepted = np.minimum(np.arange(num_reqs) % 3, drafts)
    return (torch.tensor([*(accepted + 1), 5], dtype=torch.int32),
            torch.tensor([*(drafts - accepted), 0], dtype=torch.int32))


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for key in list(os.environ):
        if key.startswith("DSPARK_CALIB_"):
            monkeypatch.delenv(key)
    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setattr(av, "get_tp_group", SingleRank)
    monkeypatch.setattr(parallel_state, "get_tp_group", SingleRank)


def lines(caplog):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "vllm.dspark_calib"]


@pytest.fixture
def engine(monkeypatch, tmp_path, reference_table_8192):
    """A stock engine (vLLM's tables at 8192) observing every 2nd priced step into tmp/obs."""
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE_EVERY", "2")
    clock = Clock()
    runner = FakeRunner(make_manager(reference_table_8192.dense_tables(8192)), clock)
    yield runner, clock
    om.detach(runner)


def start(runner, clock, **writer_kwargs):
    return om.maybe_observe(runner, None, event_factory=events_factory(clock), writer_kwargs=writer_kwargs or None,
                            timer=lambda: clock.host)


def step(runner, num_reqs, *, drafts=3, context=1000, drafter=True, full=True, rng=None):
    """One serving step; its forward lasts 10 + num_reqs ms, its drafter 1 + num_reqs / 100 ms."""
    rng = rng or np.random.default_rng(num_reqs)
    m = runner.adaptive_verification
    num_tokens, draft_tokens = schedule(m, np.full(num_reqs, context, np.int32), [drafts] * num_reqs, rng)
    if not drafts:
        draft_tokens = {}  # prefill / first decode: vLLM never calls get_num_tokens
    runner.forward_ms, runner.drafter_ms = 10.0 + num_reqs, 1.0 + num_reqs / 100
    runner.execute_model((num_tokens, draft_tokens, full))
    if drafter:
        runner.sample_tokens()


def test_sampled_steps_join_their_own_timings(engine):
    runner, clock = engine
    obs = start(runner, clock)
    assert obs is not None and observe_problem(runner) == ""
    for n in range(1, 21):
        step(runner, n)
    runner.shutdown()  # vLLM synchronises there: every event done, everything written
    rows = read_observed([obs.directory])
    assert list(rows["step"]) == list(range(2, 21, 2))  # every 2nd priced step
    assert list(rows["num_reqs"]) == list(range(2, 21, 2))
    np.testing.assert_allclose(rows["forward_ms"], 10.0 + rows["num_reqs"])
    np.testing.assert_allclose(rows["drafter_ms"], 1.0 + rows["num_reqs"] / 100)
    assert (rows["num_target_tokens"] == rows["num_reqs"] + rows["draft_budget"]).all()
    assert (rows["context_mean"] == 1000).all() and (rows["priced_context"] == 8192).all()
    assert (rows["scheduled_drafts"] == 3 * rows["num_reqs"]).all()
    assert (rows["budget_static"] == rows["draft_budget"]).all() and (rows["budget_context_aware"] == ABSENT).all()
    tables = runner.adaptive_verification.cost_tables
    np.testing.assert_allclose(rows["predicted_draft_ms"], tables[0][rows["num_reqs"]])
    np.testing.assert_allclose(rows["predicted_verify_ms"], tables[1][rows["num_target_tokens"]])
    meta = read_observed([obs.directory]).metadata[0]
    assert meta.mode == "stock" and meta.sample_every == 2 and meta.max_num_reqs == 256
    assert meta.raw["engine"]["num_speculative_tokens"] == 7  # the manager's (describe_engine)
    assert meta.raw["host"] == socket.gethostname()  # calibrate's provenance
    assert all(n.startswith(f"observed-dp0-{os.getpid()}-e") for n in os.listdir(obs.directory))


def test_sampled_steps_record_their_own_acceptance(engine):
    """Each row's per-position counts come from its own step's num_sampled / num_rejected (a padded
    row past num_reqs ignored), read after drafter_end without a sync."""
    from dspark_calib.vllm.step_capture import acceptance_counts

    runner, clock = engine
    obs = start(runner, clock)
    want = {}
    for n in range(1, 21):
        step(runner, n)
        if n % 2 == 0:
            ns, nr = runner.verdict
            want[n] = acceptance_counts(ns.numpy()[:n], nr.numpy()[:n], 7)
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert clock.syncs == 0
    got = {int(n): (tuple(g), tuple(a)) for n, g, a in zip(rows["num_reqs"], rows["position_graded"].tolist(),
                                                            rows["position_accepted"].tolist())}
    assert got == want
    assert got[20] != got[18] and sum(got[20][0]) > 0
    assert (rows["position_graded"].sum(axis=1) <= rows["draft_budget"]).all()


def test_untimed_steps_never_misalign_the_join(engine, monkeypatch):
    """Prefill steps (no get_num_tokens), sampled steps without a drafter run, dummy runs inside and
    outside vLLM's collect() window: the rows still carry their own step's timings."""
    from vllm.v1.worker.gpu import async_utils

    runner, clock = engine
    obs = start(runner, clock)
    monkeypatch.setattr(async_utils, "StepTimingEvents", events_factory(clock))  # vLLM's own collector's
    with runner.step_timing.collect() as profile:  # vLLM's start-up profile: untouched by observe
        for n in (4, 8):
            runner.forward_ms, runner.drafter_ms = 2.0 * n, 0.5
            runner._dummy_run(n)
    assert [(s.num_reqs, s.forward_ms, s.drafter_ms, s.full_cudagraph) for s in profile] == [
        (4, 8.0, 0.5, True), (8, 16.0, 0.5, True)]
    assert clock.syncs == 1 and len(obs.pending) == 0
    plan = [(1, {}), (2, {}), (3, {"drafts": 0}), (4, {"drafter": False}), (5, {}), (6, {}), (7, {"drafts": 0}),
            (8, {}), (9, {"drafter": False}), (10, {}), (11, {}), (12, {})]
    for n, kw in plan:
        step(runner, n, **kw)
        if n == 6:
            runner._dummy_run(16)  # e.g. a DP padding step between serving steps
    runner.shutdown()
    rows = read_observed([obs.directory])
    # priced: 1 2 4 5 6 8 9 10 11 12 (3 and 7 had no drafts); sampled every 2nd: 2 5 8 10 12 ->
    # 2 (timed), 5 (timed), 8 (timed), 10 (timed), 12 (timed); 4 and 9 were priced 3rd and 7th
    assert list(rows["num_reqs"]) == [2, 5, 8, 10, 12]
    np.testing.assert_allclose(rows["forward_ms"], 10.0 + rows["num_reqs"])
    np.testing.assert_allclose(rows["drafter_ms"], 1.0 + rows["num_reqs"] / 100)
    assert obs.untimed == 0 and obs.pending.dropped == 0
    # a sampled step whose drafter never ran is dropped at the next step, not joined to it
    obs.priced = 1  # the next priced step is sampled
    step(runner, 30, drafter=False)
    step(runner, 31)
    obs.priced = 1
    step(runner, 32)
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert clock.syncs == 1  # observe never synchronised
    assert obs.untimed == 1 and list(rows["num_reqs"])[-1:] == [32]
    np.testing.assert_allclose(rows["forward_ms"], 10.0 + rows["num_reqs"])


def test_pending_events_that_never_complete_are_bounded(engine):
    runner, clock = engine
    obs = start(runner, clock)
    obs.pending.max_pending = 3
    clock.done_upto = -1.0  # the device never finishes
    for n in range(1, 21):
        step(runner, n)
    assert len(obs.pending) == 3 and obs.pending.dropped == 7 and obs.writer is None
    clock.done_upto = float("inf")
    obs.close()
    assert list(read_observed([obs.directory])["num_reqs"]) == [2, 4, 6]


@pytest.mark.parametrize("observe_first", [True, False])
def test_context_aware_and_observe_compose_in_either_order(monkeypatch, tmp_path, reference_table, grid_3ctx,
                                                            observe_first):
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE_EVERY", "1")
    clock = Clock()
    static = reference_table.dense_tables(8192)
    runner = FakeRunner(make_manager(static), clock)
    m = runner.adaptive_verification
    if observe_first:  # the engine's order: observe at initialize_kv_cache, the table later
        obs = start(runner, clock)
        ca.install(m, grid_3ctx)
    else:
        ca.install(m, grid_3ctx)
        obs = start(runner, clock)
    runtime.state_of(m).run = SimpleNamespace(decision=SimpleNamespace(load=True, context_len=8192,
                                                                      content_hash="ab" * 32))
    for ctx in (1024, 3000, 16384):
        for n in (8, 64, 200):
            step(runner, n, drafts=7, context=ctx, rng=np.random.default_rng(ctx + n))
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert len(rows) == 9 and rows.metadata[0].raw["mode"] == "context-aware"
    assert rows.metadata[0].raw["table_hash"] == "ab" * 32
    assert list(rows["priced_context"]) == [1024] * 3 + [3000] * 3 + [16384] * 3
    draft, verify = grid_3ctx.price(rows["context_sum"], rows["num_reqs"], rows["num_target_tokens"])
    assert np.array_equal(rows["predicted_draft_ms"], draft) and np.array_equal(rows["predicted_verify_ms"], verify)
    assert (rows["budget_context_aware"] == rows["draft_budget"]).all()
    assert (rows["budget_static"] != ABSENT).all()
    assert (rows["budget_static"] != rows["draft_budget"]).any()  # the H200 curves flip some budgets
    for undo in ((lambda: ca.uninstall(m)), (lambda: om.detach(runner)))[::1 if observe_first else -1]:
        undo()  # last in, first out: nothing of either is left
    assert "get_num_tokens" not in m.__dict__ and m.cost_tables is static


def test_only_tp_rank_0_observes(engine, monkeypatch):
    runner, clock = engine
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(rank_in_group=1, world_size=2))
    assert start(runner, clock) is None
    assert "execute_model" not in runner.__dict__ and "get_num_tokens" not in runner.adaptive_verification.__dict__
    for n in range(1, 5):
        step(runner, n)
    assert not os.path.exists(os.environ["DSPARK_CALIB_OBSERVE"])


@pytest.mark.parametrize("where,why", [("missing-parent/obs", "parent directory does not exist"),
                                       ("a-file", "is not a directory")])
def test_a_bad_directory_is_one_warning_and_the_engine_runs(engine, monkeypatch, tmp_path, caplog, where, why):
    runner, clock = engine
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / where))
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        assert start(runner, clock) is None
        for n in range(1, 5):
            step(runner, n)
    (got,) = lines(caplog)
    assert got[0] == logging.WARNING and "observe off" in got[1] and why in got[1]
    assert not (tmp_path / "missing-parent").exists()


def test_a_write_failure_turns_observe_off_with_one_warning(engine, caplog, monkeypatch):
    runner, clock = engine
    obs = start(runner, clock, rows_per_file=2)

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("dspark_calib.observe.file._write", disk_full)
    with caplog.at_level(logging.WARNING, logger="vllm.dspark_calib"):
        for n in range(1, 30):
            step(runner, n)  # serving goes on
    assert not obs.on
    (got,) = lines(caplog)
    assert "observe off" in got[1] and "No space left on device" in got[1]


def test_a_bad_every_is_one_warning(engine, monkeypatch, caplog):
    runner, clock = engine
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE_EVERY", "0")
    with caplog.at_level(logging.WARNING, logger="vllm.dspark_calib"):
        assert start(runner, clock) is None
    (got,) = lines(caplog)
    assert "DSPARK_CALIB_OBSERVE_EVERY=0 must be between 1" in got[1]


def test_an_unknown_runner_shape_is_one_warning(engine, caplog):
    runner, clock = engine
    runner.speculator = SimpleNamespace(propose=lambda *a: None)  # no dummy_run parameter
    with caplog.at_level(logging.WARNING, logger="vllm.dspark_calib"):
        assert start(runner, clock) is None
    (got,) = lines(caplog)
    assert "observe off: this vLLM's step API differs" in got[1] and "speculator.propose" in got[1]


def test_hook_starts_observe_after_initialize_kv_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    seen = []
    fake_module = SimpleNamespace(GPUModelRunner=type("R", (), {"initialize_kv_cache": lambda self, c: seen.append(c)}))
    monkeypatch.setattr(om, "maybe_observe", lambda runner, estimator: seen.append("observe"))
    om.hook_runner(fake_module)
    om.hook_runner(fake_module)  # idempotent
    fake_module.GPUModelRunner().initialize_kv_cache("cfg")
    assert seen == ["cfg", "observe"]
    om.unhook_runner(fake_module)
    fake_module.GPUModelRunner().initialize_kv_cache("cfg2")
    assert seen == ["cfg", "observe", "cfg2"]


@pytest.mark.parametrize("positional", [False, True])
def test_the_serving_manager_is_observed_not_the_graph_memory_profilings(monkeypatch, tmp_path, reference_table_8192,
                                                                          positional):
    """vLLM 0.33 with CUDA graphs on: profile_cudagraph_memory calls initialize_kv_cache(minimal,
    is_profiling=True), which builds a throwaway manager, then the real call builds the serving
    one (model_runner.py:703). Every priced step of the serving manager must be seen."""
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE_EVERY", "1")
    clock = Clock()
    tables = reference_table_8192.dense_tables(8192)

    class Runner(FakeRunner):
        def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
            self.adaptive_verification = make_manager(tables)

    module = SimpleNamespace(GPUModelRunner=Runner)
    real = om.maybe_observe
    monkeypatch.setattr(om, "maybe_observe",
                        lambda runner, estimator: real(runner, estimator, event_factory=events_factory(clock)))
    om.hook_runner(module)
    try:
        r = Runner(make_manager(tables), clock)
        if positional:
            r.initialize_kv_cache("minimal", True)
        else:
            r.initialize_kv_cache("minimal", is_profiling=True)
        assert om.observer_of(r) is None  # nothing attached to the throwaway manager
        r.initialize_kv_cache("real")
        obs = om.observer_of(r)
        assert obs.manager is r.adaptive_verification
        for n in range(1, 11):
            step(r, n)
        r.shutdown()
        assert obs.priced == 10 and len(read_observed([tmp_path / "obs"])) == 10
        # a later rebuild (another initialize_kv_cache) moves the observer to the new manager
        r.initialize_kv_cache("again")
        assert obs.manager is r.adaptive_verification and obs.pricing is None
    finally:
        om.detach(r)
        om.unhook_runner(module)


def test_dense_dp_replicas_name_their_files_by_data_parallel_index(engine, monkeypatch):
    runner, clock = engine
    # vLLM resets data_parallel_rank to 0 on independent dense replicas; the index stays
    runner.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=1, data_parallel_rank=0))
    obs = start(runner, clock)
    assert obs.metadata["dp_rank"] == 1 and obs.name.startswith("dp1-")


def test_plugin_patch_hooks_the_real_runner(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    plugin.patch(av.AdaptiveVerificationManager, model_runner)
    try:
        assert hasattr(model_runner.GPUModelRunner.initialize_kv_cache, runtime.MARK)
    finally:
        plugin.unpatch(av.AdaptiveVerificationManager, model_runner)
    assert not hasattr(model_runner.GPUModelRunner.initialize_kv_cache, runtime.MARK)


def test_files_round_trip_through_validate(engine, table_files):
    runner, clock = engine
    obs = start(runner, clock, rows_per_file=5)
    for n in range(1, 41):
        step(runner, n * 5, drafts=4, context=1024 * (1 + n % 3))
    runner.shutdown()
    assert len(os.listdir(obs.directory)) == 4  # 20 rows, 5 per file
    r = CliRunner().invoke(app, ["validate", table_files["all"], obs.directory, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["num_steps"] == 20 and len(d["files"]) == 4
    groups = d["groups"]  # kind x size bucket x context bucket
    assert {g["kind"] for g in groups} == {"draft", "verify"}
    assert {g["context_bucket"] for g in groups} == {"1024-2047", "2048-4095"}
    assert all(g["context_aware"]["n"] > 0 and g["context_aware"]["median_pct"] is not None for g in groups)
    assert d["budget_change"]["compared"] == 0  # a stock engine records no alternative budget


def test_exit_flushes_buffered_rows_and_a_late_exit_hook_is_harmless(engine):
    import gc
    import weakref

    runner, clock = engine
    obs = start(runner, clock)
    for n in range(1, 7):
        step(runner, n)
    assert not os.path.exists(obs.directory) or not os.listdir(obs.directory)  # buffered, pending
    obs.at_exit()  # what atexit runs (the events are done: resolved with query())
    assert list(read_observed([obs.directory])["num_reqs"]) == [2, 4, 6]
    ref, at_exit = weakref.ref(obs), obs.at_exit
    om.detach(runner)
    del obs, runner
    gc.collect()
    assert ref() is None
    at_exit()  # a late exit hook is a no-op


def observed_aware_engine(table, grid, policy):
    """A runner whose manager loaded `table` at context 8192 and prices context-aware with `policy`
    on `grid`, observed every step (DSPARK_CALIB_OBSERVE set by the caller)."""
    clock = Clock()
    runner = FakeRunner(make_manager(table.dense_tables(8192)), clock)
    m = runner.adaptive_verification
    obs = start(runner, clock)
    ca.install(m, grid, policy)
    runtime.state_of(m).run = SimpleNamespace(decision=SimpleNamespace(load=True, context_len=8192,
                                                                      content_hash="ab" * 32))
    return runner, obs


def test_observe_files_record_the_tail_that_validate_then_prices_with(monkeypatch, tmp_path, reference_table,
                                                                      grid_3ctx):
    from dspark_calib.pricing.policy import CHUNK_RULE
    from dspark_calib.validate import recorded_chunk_rule, recorded_chunks, recorded_tail, validate

    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE_EVERY", "1")
    runner, obs = observed_aware_engine(reference_table, grid_3ctx, aware(250, True))
    for n in (8, 64):
        step(runner, n, drafts=7, context=4000, rng=np.random.default_rng(n))
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert rows.metadata[0].raw["context_tail_milli"] == 250 and recorded_tail(rows) == 250
    assert rows.metadata[0].raw["context_chunks"] is True and recorded_chunks(rows)
    assert rows.metadata[0].raw["context_chunk_rule"] == CHUNK_RULE == recorded_chunk_rule(rows)  # this engine's pair price
    result = validate(reference_table, rows)
    assert result.tail_fit.tail == 0.25 and result.prefill.steps == 0  # decode steps only: no chunk to price
    # validate prices as the engine did, to the bit: the line that says its column is what served
    assert result.engine.compared == 2 and result.engine.verify_equal == result.engine.draft_equal == 2
    other = validate(reference_table, rows, tail_milli=0)  # priced otherwise: not compared
    assert other.engine.compared == 0
    assert list(rows["prefill_tokens"]) == [0, 0]  # decode steps: recorded, no chunk


def test_steps_above_the_longest_context_are_priced_on_the_line_and_validate_agrees(monkeypatch, tmp_path,
                                                                                     reference_table):
    """An engine with max_model_len 32768 on the 1024..16384 table prices a 24k-context step on the
    line through 8192 and 16384 (not at 16384's costs); its files record how far (context_extrapolate_to)
    and validate re-prices the steps exactly as the engine did."""
    from dataclasses import replace

    from dspark_calib.validate import validate

    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE_EVERY", "1")
    grid = ca.grid_for_manager(make_manager(), reference_table.curves, extrapolate_to=32768)
    assert grid.points[-1] == 32768 and grid.costs.extrapolates_above
    runner, obs = observed_aware_engine(reference_table, grid, replace(aware(), extrapolate_to=32768))
    for n in (8, 32):
        step(runner, n, drafts=7, context=24000, rng=np.random.default_rng(n))
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert rows.metadata[0].raw["context_extrapolate_to"] == 32768
    flat = reference_table.dense_tables(16384)
    # drafts are priced at the batch's mean context, 24000: above 16384's costs, on the line
    assert all(rows["priced_context"] == 24000) and all(rows["predicted_draft_ms"] > flat[0][rows["num_reqs"]])
    result = validate(reference_table, rows)
    assert result.engine.compared == 2 and result.engine.verify_equal == result.engine.draft_equal == 2


def test_acceptance_counts_by_hand():
    """a = num_sampled - 1 accepted of d = a + num_rejected verified; graded where a >= i < d, accepted where a > i.
    Request 0: 2 of 4 accepted; 1: no draft verified; 2: mid-prefill (samples nothing); 3: all 7 accepted."""
    from dspark_calib.vllm.step_capture import acceptance_counts

    assert acceptance_counts([3, 1, 0, 8], [2, 0, 0, 0], 4) == ((2, 2, 2, 1), (2, 2, 1, 1))
    assert acceptance_counts([1, 1], [1, 3], 3) == ((2, 0, 0), (0, 0, 0))  # both rejected their first draft


# -- the GPU's SM clock and power per row, sampled off the step's path -----------------------------
class Sampled:
    """gpu_readings.ClockSampler's stand-in: the test sets `latest`; a step only ever reads it."""

    def __init__(self):
        self.latest, self.stopped = (None, None), False

    def stop(self):
        self.stopped = True


def test_each_row_carries_the_clock_last_sampled_when_its_step_was(engine, monkeypatch):
    from dspark_calib.vllm import gpu_readings

    sampler = Sampled()
    monkeypatch.setattr(gpu_readings, "clock_sampler", lambda: sampler)
    runner, clock = engine
    obs = start(runner, clock)
    for n in range(1, 9):
        sampler.latest = (None, None) if n <= 2 else (1500.0 + n, 650.0 + n)  # none before the first reading
        step(runner, n)
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert list(rows["num_reqs"]) == [2, 4, 6, 8] and sampler.stopped
    assert np.isnan(rows["gpu_sm_mhz"][0]) and np.isnan(rows["gpu_power_w"][0])
    assert rows["gpu_sm_mhz"][1:].tolist() == [1504.0, 1506.0, 1508.0]
    assert rows["gpu_power_w"][1:].tolist() == [654.0, 656.0, 658.0]


def test_the_sampler_reads_nvml_on_its_own_thread_and_without_nvml_there_is_none(monkeypatch):
    import sys
    import threading

    from dspark_calib.telemetry import Reading
    from dspark_calib.vllm import gpu_readings

    read_on = []

    class Reader:
        source = "nvml"

        def read(self):
            read_on.append(threading.current_thread().name)
            return Reading(sm_mhz=1530.0, power_w=699.0)

    sampler = gpu_readings.ClockSampler(Reader(), period_s=0.01).start()
    try:
        for _ in range(500):  # the thread's first reading; no timing asserted
            if sampler.latest != (None, None):
                break
            threading.Event().wait(0.01)
        assert sampler.latest == (1530.0, 699.0)
        assert set(read_on) == {"dspark-calib-gpu-clock"}
    finally:
        sampler.stop()
    sampler._thread.join(5)
    assert not sampler._thread.is_alive()
    import vllm.third_party

    monkeypatch.setitem(sys.modules, "pynvml", None)  # neither nvidia-ml-py nor vLLM's copy
    monkeypatch.setitem(sys.modules, "vllm.third_party.pynvml", None)
    monkeypatch.delattr(vllm.third_party, "pynvml", raising=False)
    assert gpu_readings.clock_sampler() is None


# -- the host's time around each step --------------------------------------------------------------
def test_rows_record_the_host_interval_since_the_previous_call_and_their_own_call(engine):
    """step_interval_ms: the previous execute_model call's start to this one's (None for the first call
    observe sees and after a dummy run or a warm-up step); host_ms: this call's start to its return."""
    runner, clock = engine
    obs = start(runner, clock)
    obs.priced = 1  # the first priced step is sampled: the first call observe sees is a row
    for n in range(1, 11):
        runner.issue_s = n / 1000  # execute_model of step n takes n ms of host time
        step(runner, n)
        clock.host += n / 10  # then sample_tokens, the scheduler...: 100 n ms
        if n == 4:
            runner._dummy_run(8)  # e.g. a DP padding step: row 5 has no interval
        if n == 6:  # vLLM's kernel warm-up runs its steps with the manager set aside: row 7 has none
            manager, runner.adaptive_verification = runner.adaptive_verification, None
            runner.execute_model(({"w0": 1}, {}, True))
            runner.adaptive_verification = manager
        if n == 8:
            clock.host += 3.0  # a stall: row 9's interval has it
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert list(rows["num_reqs"]) == [1, 3, 5, 7, 9]
    np.testing.assert_allclose(rows["step_interval_ms"], [np.nan, 2 + 200, np.nan, np.nan, 8 + 800 + 3000])
    np.testing.assert_allclose(rows["host_ms"], [1, 3, 5, 7, 9])
    assert clock.syncs == 0
    assert obs.stalls == [pytest.approx(8 + 800 + 3000)]


def test_every_stall_before_a_priced_step_is_said_sampled_or_not(engine, caplog, monkeypatch):
    """One stall lands in a row only when the step after it is sampled: the line names each one
    (every priced step compares its interval), later ones are counted and said once at close."""
    monkeypatch.setattr(om, "STALL_LINES", 2)
    runner, clock = engine
    obs = start(runner, clock)  # 1 in 4 sampled
    with caplog.at_level(logging.WARNING):
        for n in range(1, 9):
            step(runner, n)
            clock.host += 0.1 if n % 2 else 1.5  # after steps 2, 4, 6, 8: a stall before the next
        runner.shutdown()
        runner.shutdown()  # close runs at shutdown and again at exit: the count is said once
    said = [r.getMessage() for r in caplog.records if "stall" in r.getMessage() or "between the starts" in r.getMessage()]
    assert said == ["dspark-calib: observe: 1.50 s between the starts of two serving steps (before priced step 3): "
                    "host time outside every step's GPU timing",
                    "dspark-calib: observe: 1.50 s between the starts of two serving steps (before priced step 5): "
                    "host time outside every step's GPU timing; further stalls are counted",
                    "dspark-calib: observe: 3 stalls over 1 s before priced steps, the longest 1.50 s"]


def test_vllms_kernel_warm_up_steps_are_not_serving(engine, monkeypatch):
    """vLLM's warmup_kernels runs real execute_model calls with the runner's manager set aside; the
    first serving step after it has no interval (it would span the rest of engine start)."""
    from vllm.v1.worker.gpu import warmup

    runner, clock = engine
    runner.rejection_sampler = runner.speculative_config = None
    obs = start(runner, clock)
    obs.priced = 1
    warmed = []

    def warmup_steps(model_runner, execute_model, sample_tokens, greedy=False):
        warmed.append(model_runner.adaptive_verification)
        execute_model(({"w0": 1, "w1": 1}, {}, True))

    monkeypatch.setattr(warmup, "_warmup_kernels", warmup_steps)
    warmup.warmup_kernels(runner, runner.execute_model, runner.sample_tokens)  # vLLM's, around the steps
    assert warmed == [None]
    clock.host += 30.0  # the rest of engine start, then the first request
    step(runner, 4)
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert list(rows["num_reqs"]) == [4] and np.isnan(rows["step_interval_ms"][0])

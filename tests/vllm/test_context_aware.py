"""Context-aware mode against the installed vLLM's own AdaptiveVerificationManager (CPU).

The manager is built with object.__new__ and the attributes get_num_tokens reads
(as tests/test_fit_vllm.py does); its get_num_tokens is vLLM's real method.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av

from dspark_calib.pricing.costs import ContextCosts
from dspark_calib.pricing.grid import ContextGrid
from dspark_calib.pricing.rules import ceil_mean, profile_requests, tail_context_sum, verify_context
from dspark_calib.fit import choose_draft_budget
from dspark_calib.vllm import context_aware as ca

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.function_scoped_fixture])
MAX_REQS, MAX_TOKENS, STEPS = 256, 8192, 7
from tests.helpers import aware





class SingleRank:
    rank_in_group = 0
    world_size = 1

    def __init__(self):
        self.calls = 0

    def broadcast_object(self, obj, src=0):
        self.calls += 1
        return obj


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    rank = SingleRank()
    monkeypatch.setattr(av, "get_tp_group", lambda: rank)
    return rank


def make_manager(cost_tables=None, *, rng=None, cudagraph_limit=512):
    """vLLM's manager with a request-state buffer of MAX_REQS slots (confidences, contexts)."""
    rng = rng or np.random.default_rng(0)
    m = object.__new__(av.AdaptiveVerificationManager)
    m.req_states = SimpleNamespace(
        req_id_to_index={}, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32),
        prefill_len=SimpleNamespace(np=np.ones(MAX_REQS, np.int32)), max_num_reqs=MAX_REQS,
        max_num_batched_tokens=MAX_TOKENS, num_speculative_steps=STEPS)
    stale = SimpleNamespace(np=rng.uniform(0.2, 1.0, (MAX_REQS, STEPS)).astype(np.float32))
    m._stale_confidences = [stale, stale]
    m._stale_idx = 0
    m.num_speculative_steps = STEPS
    m.num_bonus_tokens = 1
    m._max_total_logits = 1 << 30
    m._cudagraph_limit = cudagraph_limit
    m.cost_tables = cost_tables
    m._batch_budget = None
    return m


def schedule(m, contexts, drafts, rng):
    """Put a batch into the manager's req_states; returns get_num_tokens' two dicts."""
    n = len(contexts)
    slots = rng.permutation(MAX_REQS)[:n]
    req_ids = [f"req-{i}" for i in range(n)]
    m.req_states.req_id_to_index = dict(zip(req_ids, slots.tolist()))
    m.req_states.num_computed_tokens_np[slots] = contexts
    m.req_states.prefill_len.np[slots] = np.minimum(contexts, 1)  # decoding: every request samples
    num_tokens = {r: 1 + d for r, d in zip(req_ids, drafts)}
    draft_tokens = {r: list(range(d)) for r, d in zip(req_ids, drafts)}
    return num_tokens, draft_tokens


@pytest.fixture(scope="module")
def grid_3ctx(reference_table):
    with mock.patch.object(av, "get_tp_group", SingleRank):  # module scope: before the autouse fixture
        return ca.grid_for_manager(make_manager(), reference_table.curves)


def vllm_with_tables(tables, m, num_tokens, draft_tokens):
    """vLLM's own get_num_tokens on a twin manager whose cost_tables were set by hand."""
    twin = object.__new__(av.AdaptiveVerificationManager)
    twin.__dict__.update({k: v for k, v in m.__dict__.items() if not k.startswith("_dspark") and k != "get_num_tokens"})
    twin.cost_tables = tables
    total = av.AdaptiveVerificationManager.get_num_tokens(twin, num_tokens, draft_tokens)
    return total, twin._batch_budget


batches = st.tuples(
    st.integers(1, 256),  # requests
    st.sampled_from([0, 500, 1024, 3000, 8192, 12000, 16384, 30000]),  # centre context
    st.integers(0, 2**31 - 1),  # seed
)


@SETTINGS
@given(batch=batches)
def test_choice_equals_vllm_on_the_interpolated_tables(grid_3ctx, reference_table, batch):
    num_reqs, centre, seed = batch
    rng = np.random.default_rng(seed)
    m = make_manager(reference_table.dense_tables(8192), rng=rng)
    contexts = np.maximum(0, centre + rng.integers(-400, 400, num_reqs)).astype(np.int32)
    drafts = rng.integers(0, STEPS + 1, num_reqs)
    num_tokens, draft_tokens = schedule(m, contexts, drafts, rng)
    ca.install(m, grid_3ctx)
    got = m.get_num_tokens(num_tokens, draft_tokens)
    total = int(contexts.sum())
    assert ca.installed_state(m).last_context == ceil_mean(total, num_reqs)
    want_tables = tuple(np.array(a) for a in m.cost_tables)  # the step's own (the verify buffer is reused)
    # ...are the grid's pricing of this batch at every size vLLM can read (price(): another code path)
    sizes = np.arange(num_reqs, MAX_TOKENS + 1)
    draft, verify = grid_3ctx.price(np.full(len(sizes), total), np.full(len(sizes), num_reqs), sizes)
    assert want_tables[0][num_reqs] == draft[0] and np.array_equal(want_tables[1][sizes], verify)
    want, want_budget = vllm_with_tables(want_tables, m, num_tokens, draft_tokens)
    assert got == want and m._batch_budget == want_budget
    # and it is the budget rule on those tables (dspark's copy agrees too)
    slots = [m.req_states.req_id_to_index[r] for r in num_tokens]
    assert m._batch_budget[2] == choose_draft_budget(*want_tables, m._stale_confidences[0].np[slots], drafts,
                                                      [1] * num_reqs)


@SETTINGS
@given(num_reqs=st.integers(1, 256), tail=st.sampled_from([0, 1, 200, 650, 1000]), seed=st.integers(0, 2**31 - 1))
def test_tail_prices_mixed_batches_at_the_raised_sum_and_keeps_vllms_rule(grid_3ctx, reference_table, num_reqs,
                                                                            tail, seed):
    """With a tail, every path (a few ids, many ids) prices the batch at tail_context_sum of its true
    sum and max, and the choice is still vLLM's rule on those tables."""
    rng = np.random.default_rng(seed)
    m = make_manager(reference_table.dense_tables(8192), rng=rng)
    contexts = rng.choice([300, 1100, 8000, 16500], num_reqs).astype(np.int32)  # a mix
    drafts = rng.integers(0, STEPS + 1, num_reqs)
    num_tokens, draft_tokens = schedule(m, contexts, drafts, rng)
    ca.install(m, grid_3ctx, aware(tail))
    got = m.get_num_tokens(num_tokens, draft_tokens)
    raised = tail_context_sum(int(contexts.sum()), int(contexts.max()), num_reqs, tail)
    assert int(contexts.sum()) <= raised <= int(contexts.max()) * num_reqs
    assert ca.installed_state(m).last_context == ceil_mean(raised, num_reqs)
    tables = tuple(np.array(a) for a in m.cost_tables)
    sizes = np.arange(num_reqs, MAX_TOKENS + 1)
    draft, verify = grid_3ctx.price(np.full(len(sizes), raised), np.full(len(sizes), num_reqs), sizes)
    assert tables[0][num_reqs] == draft[0] and np.array_equal(tables[1][sizes], verify)
    assert got == vllm_with_tables(tables, m, num_tokens, draft_tokens)[0]


@SETTINGS
@given(num_reqs=st.integers(2, 256), chunks=st.integers(0, 6), tail=st.sampled_from([0, 250]),
       seed=st.integers(0, 2**31 - 1))
def test_chunk_pricing_prices_verify_by_pairs_and_keeps_vllms_rule(grid_3ctx, reference_table, num_reqs, chunks,
                                                                    tail, seed):
    """With chunk pricing, a step whose requests without drafts run prefill chunks has its verify
    priced at S_tail - S_chunks + ceil(R P / N_max) (P: the chunks' q (c + q); R / N_max: a pair as
    the profile's largest step prices it, context.CHUNK_RULE), written out here; drafts stay at the
    (tailed) mean; the choice is vLLM's rule on those tables."""
    rng = np.random.default_rng(seed)
    m = make_manager(reference_table.dense_tables(8192), rng=rng)
    contexts = rng.choice([0, 900, 4000, 8000, 16500], num_reqs).astype(np.int32)
    drafts = rng.integers(1, STEPS + 1, num_reqs)
    num_tokens, draft_tokens = schedule(m, contexts, drafts, rng)
    ids = list(num_tokens)
    chunk_ids = ids[:min(chunks, num_reqs - 1)]  # at least one request keeps its drafts (vLLM's call needs one)
    for r in chunk_ids:
        num_tokens[r] = int(rng.integers(1, 600))  # a chunk (1: a one-token prefill, not a chunk)
        del draft_tokens[r]
    ca.install(m, grid_3ctx, aware(tail, True))
    got = m.get_num_tokens(num_tokens, draft_tokens)
    slot = m.req_states.req_id_to_index
    s_tail = tail_context_sum(int(contexts.astype(np.int64).sum()), int(contexts.max()), num_reqs, tail)
    real = [r for r in chunk_ids if num_tokens[r] > 1]
    c = {r: int(m.req_states.num_computed_tokens_np[slot[r]]) for r in real}
    pairs = sum(num_tokens[r] * (c[r] + num_tokens[r]) for r in real)
    non_draft = sum(num_tokens.values()) - sum(len(d) for d in draft_tokens.values())
    n_max = grid_3ctx.costs.max_num_batched_tokens
    r_max = min(n_max, grid_3ctx.costs.profile_num_reqs)
    verify_sum = s_tail - sum(c.values()) + -(-(r_max * pairs) // n_max) if pairs else s_tail
    tables = tuple(np.array(a) for a in m.cost_tables)
    sizes = np.arange(non_draft, MAX_TOKENS + 1)
    draft, verify = grid_3ctx.price(np.full(len(sizes), s_tail), np.full(len(sizes), num_reqs), sizes,
                                    verify_sum=np.full(len(sizes), verify_sum))
    assert tables[0][num_reqs] == draft[0] and np.array_equal(tables[1][sizes], verify)
    assert ca.installed_state(m).last_context == ceil_mean(s_tail, num_reqs)  # drafts: the mean, chunks or not
    assert got == vllm_with_tables(tables, m, num_tokens, draft_tokens)[0]
    # chunk pricing off: the same step's verify at the KV sum
    off = make_manager(reference_table.dense_tables(8192), rng=np.random.default_rng(seed))
    off.req_states, off._stale_confidences = m.req_states, m._stale_confidences
    ca.install(off, grid_3ctx, aware(tail))
    off.get_num_tokens(num_tokens, draft_tokens)
    _, kv = grid_3ctx.price(np.full(len(sizes), s_tail), np.full(len(sizes), num_reqs), sizes)
    assert np.array_equal(np.array(off.cost_tables[1])[sizes], kv)
    # the H200 costs rise with context at every size: pairs above the KV sum price the step higher
    assert (verify >= kv).all() if verify_sum >= s_tail else (verify <= kv).all()


def test_tail_is_checked_and_replaced_by_a_second_install(grid_3ctx):
    m = make_manager(grid_3ctx.tables_for(8192))
    with pytest.raises(ValueError, match="tail_milli"):
        ca.install(m, grid_3ctx, aware(1001))
    # the step prices by this release's rule only: a policy naming the first would be written into
    # observe files as what the engine priced with, and validate would price its steps by it
    with pytest.raises(ValueError, match="by the bounded rule, not 'linear'"):
        ca.install(m, grid_3ctx, dataclasses.replace(aware(200), tail_rule="linear"))
    assert ca.install(m, grid_3ctx, aware(250)).tail == 250
    assert ca.install(m, grid_3ctx).tail == 0


def test_context_changes_the_choice_on_h200(grid_3ctx, reference_table):
    """Not vacuous: some batches get another budget at 1k or 16k context than 8k pricing gives."""
    changed = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        num_reqs = int(rng.integers(8, 200))
        for ctx in (1024, 16384):
            m = make_manager(reference_table.dense_tables(8192), rng=rng)
            num_tokens, draft_tokens = schedule(m, np.full(num_reqs, ctx, np.int32), [STEPS] * num_reqs, rng)
            static = m.get_num_tokens(num_tokens, draft_tokens)
            ca.install(m, grid_3ctx)
            changed += m.get_num_tokens(num_tokens, draft_tokens) != static
    assert changed >= 5


@SETTINGS
@given(batch=batches)
def test_single_context_table_leaves_behaviour_identical(reference_table_8192, batch):
    num_reqs, centre, seed = batch
    rng = np.random.default_rng(seed)
    base = reference_table_8192.dense_tables(8192)
    m = make_manager(base, rng=rng)
    grid = ca.grid_for_manager(m, reference_table_8192.curves)
    contexts = np.maximum(0, centre + rng.integers(-400, 400, num_reqs)).astype(np.int32)
    num_tokens, draft_tokens = schedule(m, contexts, rng.integers(0, STEPS + 1, num_reqs), rng)
    plain = m.get_num_tokens(num_tokens, draft_tokens), m._batch_budget
    ca.install(m, grid)
    assert (m.get_num_tokens(num_tokens, draft_tokens), m._batch_budget) == plain
    assert all(np.array_equal(a, b) for a, b in zip(m.cost_tables, base))


def test_grid_rows_at_profiled_contexts_equal_vllms_set_cost_curves(reference_table, single_rank):
    m = make_manager()
    grid = ca.grid_for_manager(m, reference_table.curves)
    assert single_rank.calls == 1  # the curves came from TP rank 0, once
    for ctx in reference_table.context_lens():
        m.set_cost_curves(*reference_table.curves[ctx].as_vllm())  # vLLM builds its tables
        for ours, theirs in zip(grid.tables_for(ctx), m.cost_tables, strict=True):
            assert ours.tobytes() == theirs.tobytes()


def test_grid_uses_rank_zeros_curves(reference_table, reference_table_8192, monkeypatch):
    """A rank that read another table still builds rank 0's grid."""
    rank0 = {c: p.as_vllm() for c, p in reference_table.curves.items()}

    class OtherRank(SingleRank):
        def broadcast_object(self, obj, src=0):
            return rank0

    monkeypatch.setattr(av, "get_tp_group", lambda: OtherRank())
    grid = ca.grid_for_manager(make_manager(), reference_table_8192.curves)
    assert grid.contexts == (1024, 8192, 16384)


def test_install_is_per_instance_idempotent_and_undone(grid_3ctx, reference_table):
    base = reference_table.dense_tables(8192)
    m, other = make_manager(base), make_manager(base)
    first = ca.install(m, grid_3ctx)
    wrapper = m.get_num_tokens
    grid2 = ContextGrid.from_table(reference_table, tolerance=0.05)
    assert ca.install(m, grid2) is first and m.get_num_tokens is wrapper and first.grid is grid2
    assert first.original.__func__ is av.AdaptiveVerificationManager.get_num_tokens
    assert ca.is_installed(m) and not ca.is_installed(other)
    assert other.get_num_tokens.__func__ is av.AdaptiveVerificationManager.get_num_tokens
    rng = np.random.default_rng(1)
    m.get_num_tokens(*schedule(m, np.full(4, 1024, np.int32), [7] * 4, rng))
    assert m.cost_tables is not base
    assert ca.uninstall(m) and not ca.uninstall(m)
    assert m.cost_tables is base and "get_num_tokens" not in m.__dict__
    assert m.get_num_tokens.__func__ is av.AdaptiveVerificationManager.get_num_tokens


def test_batch_context_sum_both_paths(reference_table):
    rng = np.random.default_rng(5)
    for n in (1, ca._SMALL_BATCH, ca._SMALL_BATCH + 1, 256):
        m = make_manager()
        contexts = rng.integers(0, 2**31 // 256, n).astype(np.int32)
        num_tokens, _ = schedule(m, contexts, [0] * n, rng)
        total = ca.batch_context_sum(m.req_states, num_tokens)
        assert total == int(contexts.astype(np.int64).sum()) and type(total) is int


# -- observe mode's capture at budget time (dspark_calib.vllm.observe_step) ----------------------
@SETTINGS
@given(batch=batches, mid_prefill=st.floats(0, 0.5))
def test_capture_step_matches_vllms_choice_and_the_other_pricing(grid_3ctx, reference_table, batch, mid_prefill):
    from dspark_calib.vllm.step_capture import capture_step, to_observed

    num_reqs, centre, seed = batch
    rng = np.random.default_rng(seed)
    static = reference_table.dense_tables(8192)
    m = make_manager(static, rng=rng)
    contexts = np.maximum(0, centre + rng.integers(-400, 400, num_reqs)).astype(np.int32)
    drafts = rng.integers(0, STEPS + 1, num_reqs)
    num_tokens, draft_tokens = schedule(m, contexts, drafts, rng)
    slots = np.array([m.req_states.req_id_to_index[r] for r in num_tokens])
    prefilling = rng.random(num_reqs) < mid_prefill  # these do not sample this step
    m.req_states.prefill_len.np[slots[prefilling]] = contexts[prefilling] + 100
    chunks = rng.integers(1, 25, num_reqs)  # a prefilling request runs a chunk, without drafts
    for i, r in enumerate(num_tokens):
        if prefilling[i]:
            num_tokens[r], draft_tokens[r], drafts[i] = int(chunks[i]), [], 0
    state = ca.install(m, grid_3ctx)
    total = m.get_num_tokens(num_tokens, draft_tokens)
    cap = capture_step(m, num_tokens, draft_tokens, priced_context=state.last_context, alt_tables=static)
    assert cap.num_target_tokens == total and cap.draft_budget == m._batch_budget[2]
    assert (cap.context_sum, cap.context_max) == (int(contexts.astype(np.int64).sum()), int(contexts.max()))
    assert cap.scheduled_drafts == int(drafts.sum()) and cap.priced_context == ceil_mean(cap.context_sum, num_reqs)
    (gd,), (gv,) = grid_3ctx.price([cap.context_sum], [num_reqs], [total])
    assert cap.predicted_draft_ms == gd and cap.predicted_verify_ms == gv
    # the other pricing's budget is what vLLM's own rule picks with those tables
    assert cap.alt_budget == vllm_with_tables(static, m, num_tokens, draft_tokens)[1][2]
    rec = to_observed(cap, step=3, forward_ms=1.5, drafter_ms=0.5, num_target_tokens=total, full_cudagraph=True,
                      context_aware=True)
    assert (rec.budget_context_aware, rec.budget_static) == (cap.draft_budget, cap.alt_budget)
    assert rec.context_mean == cap.context_sum / num_reqs
    # the requests' order statistics, of the same computed tokens vLLM's manager holds
    ordered = np.sort(contexts.astype(np.int64))
    assert rec.context_quantiles == tuple(int(ordered[round(i * (num_reqs - 1) / 8)]) for i in range(9))
    assert rec.context_quantiles[-1] == cap.context_max
    # the prefill chunks, from vLLM's own split into draft and non-draft tokens (chunks of 1 are decode-like)
    q = np.array([m._batch_budget[1][r] for r in num_tokens], dtype=np.int64)
    chunk = q > 1
    c = contexts.astype(np.int64)[chunk]
    assert (rec.prefill_tokens, rec.prefill_context_sum) == (int(q[chunk].sum()), int(c.sum()))
    assert rec.prefill_pairs == sum(int(a) * (int(b) + int(a)) for a, b in zip(q[chunk], c))
    assert (rec.prefill_tokens > 0) == bool((prefilling & (chunks > 1)).any())


def test_grid_without_broadcast_makes_no_collective(reference_table, single_rank):
    grid = ca.grid_for_manager(make_manager(), reference_table.curves, broadcast=False)
    assert single_rank.calls == 0 and grid.contexts == (1024, 8192, 16384)


def test_chunk_pair_price_is_the_profiles_largest_step_not_the_serving_engines(reference_table):
    """An engine may serve with a smaller max_num_batched_tokens than the table was profiled at
    (the loader allows it): a pair is still priced as the profile's largest step prices it
    (R / N_max of the curves, 256 / 8192 here), and the log line says which price is in effect."""
    m = make_manager(reference_table.dense_tables(8192))
    m.req_states.max_num_batched_tokens = 4096
    line = ca.enable(m, reference_table.curves)
    state = ca.installed_state(m)
    assert state.grid.costs.max_num_batched_tokens == 4096  # the engine's sizes, for its tables
    biggest = max(n for pair in reference_table.curves.values() for n, _ in pair.as_vllm()[1])
    assert biggest == 8192 and state.chunk_ratio == (256, 8192) == state.grid.costs.chunk_ratio()
    assert line.endswith("prefill chunks priced by the KV sum")  # enable's own default: chunks off
    assert "a pair = 256/8192 KV tokens" in ca.enable(m, reference_table.curves, aware(chunks=True))


def test_enable_installs_for_several_contexts_only(reference_table, reference_table_8192):
    base = reference_table.dense_tables(8192)
    m = make_manager(base)
    line = ca.enable(m, reference_table.curves)
    assert ca.is_installed(m) and "context-aware costs on" in line and "\n" not in line
    assert ca.installed_state(m).grid.contexts == (1024, 8192, 16384)
    single = make_manager(base)
    assert "off" in ca.enable(single, reference_table_8192.curves) and not ca.is_installed(single)
    broken = make_manager(base)
    broken.req_states = SimpleNamespace()  # no sizes: the grid cannot be built
    line = ca.enable(broken, reference_table.curves)
    assert "off (AttributeError" in line and not ca.is_installed(broken) and broken.cost_tables is base


# -- through load mode (the plugin on vLLM's real manager) -----------------------------------
@pytest.fixture
def two_context_load(tmp_path, monkeypatch):
    """A 1024+16384 table loaded by the plugin at context 16384 into vLLM's manager."""
    import json

    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.async_utils import StepTimingSample

    from tests.helpers import build_reference_table, fixture_json
    from dspark_calib.table.file import write_table
    from dspark_calib.vllm import plugin

    table = build_reference_table([fixture_json(1024), fixture_json(16384)])
    capture_sizes = json.load(open(fixture_json(8192)))["capture_sizes"]
    for key in [k for k in __import__("os").environ if k.startswith("DSPARK_CALIB_")]:
        monkeypatch.delenv(key)
    for k, v in {"DSPARK_CALIB_TABLE": write_table(table, tmp_path), "DSPARK_CALIB_ALLOW_REFERENCE": "1",
                 "DSPARK_CALIB_CONTEXT_LEN": "16384", "DSPARK_CALIB_PROBE": "0"}.items():
        monkeypatch.setenv(k, v)

    def load(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        plugin.register()
        m = make_manager()
        m.cost_tables = None
        batches = list(m.batches_to_profile(capture_sizes))
        m.set_initial_cost_curves([StepTimingSample(1.0, 1.0, b["num_tokens"], 1, True) for b in batches])
        return m

    yield table, load
    plugin.unpatch(av.AdaptiveVerificationManager, model_runner)
    for key in ("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"):
        __import__("os").environ.pop(key, None)


def vllm_tables_at(table, ctx, limit):
    """What vLLM's own set_cost_curves builds from the table's curves at one context."""
    m = make_manager(cudagraph_limit=limit)
    av.AdaptiveVerificationManager.set_cost_curves(m, *table.curves[ctx].as_vllm())
    return m.cost_tables


def test_load_mode_prices_each_step_at_the_batch_context(two_context_load, caplog):
    import logging

    table, load = two_context_load
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        m = load()
    assert ca.is_installed(m)
    on = [r for r in caplog.records if "context-aware costs on" in r.getMessage()]
    assert len(on) == 1 and on[0].levelno == logging.INFO and "contexts 1024..16384" in on[0].getMessage()
    static = vllm_tables_at(table, 16384, m._cudagraph_limit)
    assert all(np.array_equal(a, b) for a, b in zip(m.cost_tables, static))  # what set_cost_curves installed
    rng = np.random.default_rng(3)
    grid = ca.installed_state(m).grid
    costs = ContextCosts({c: table.curves[c].as_vllm() for c in table.curves}, MAX_REQS, MAX_TOKENS,
                         m._cudagraph_limit)
    for ctx in (1024, 16384):
        num_tokens, draft_tokens = schedule(m, np.full(64, ctx, np.int32), rng.integers(0, STEPS + 1, 64), rng)
        got = m.get_num_tokens(num_tokens, draft_tokens)
        draft, verify = (np.array(a) for a in m.cost_tables)
        # drafts: vLLM's own table at the batch's (profiled) context, bit for bit
        assert np.array_equal(draft, vllm_tables_at(table, ctx, m._cudagraph_limit)[0]), ctx
        # verify at N: vLLM's tables interpolated at the context whose dummy batch read 64 x ctx KV tokens
        for n in (64, 100, 255, 256, 512, 4000, MAX_TOKENS):
            exact = costs.at(verify_context(64 * ctx, n, MAX_REQS)).verify[n]
            assert abs(verify[n] / exact - 1) <= grid.max_rel_error, (ctx, n)
        assert got == vllm_with_tables((draft, verify), m, num_tokens, draft_tokens)[0]
    assert not all(np.array_equal(a, b) for a, b in zip(vllm_tables_at(table, 1024, m._cudagraph_limit), static))


def test_context_aware_0_keeps_vllms_static_tables(two_context_load, caplog):
    import logging

    table, load = two_context_load
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        m = load(DSPARK_CALIB_CONTEXT_AWARE="0")
    assert not ca.is_installed(m) and "get_num_tokens" not in vars(m)
    assert any("context-aware costs off (DSPARK_CALIB_CONTEXT_AWARE=0)" in r.getMessage() for r in caplog.records)
    static = vllm_tables_at(table, 16384, m._cudagraph_limit)
    rng = np.random.default_rng(4)
    num_tokens, draft_tokens = schedule(m, np.full(64, 1024, np.int32), rng.integers(0, STEPS + 1, 64), rng)
    m.get_num_tokens(num_tokens, draft_tokens)
    assert all(np.array_equal(a, b) for a, b in zip(m.cost_tables, static))


class CountedStates(SimpleNamespace):
    """vLLM's RequestState contract for slots: ids map to slots only in add/remove_request."""

    def add_request(self, req_id, num_computed_tokens):
        slot = self.free.pop()
        self.req_id_to_index[req_id] = slot
        self.num_computed_tokens_np[slot] = num_computed_tokens

    def remove_request(self, req_id):
        slot = self.req_id_to_index.pop(req_id)
        self.free.insert(0, slot)
        return slot


@pytest.mark.parametrize("tail", [0, 300])
def test_slot_cache_is_reused_for_the_same_batch_and_dropped_when_a_slot_changes(grid_3ctx, tail):
    m = make_manager(grid_3ctx.tables_for(8192))
    base = m.req_states
    m.req_states = CountedStates(**vars(base), free=list(range(MAX_REQS)))
    rng = np.random.default_rng(7)
    ids = [f"r{i}" for i in range(150)]  # above the small-batch path
    for r in ids:
        m.req_states.add_request(r, int(rng.integers(1000, 16000)))
    for i in range(50):  # held but not scheduled, too many for the held-slot path (_held_slots): ids looked up
        m.req_states.add_request(f"idle{i}", 5)
    m.req_states.prefill_len.np[:] = 1
    state = ca.install(m, grid_3ctx, aware(tail))
    num_tokens = {r: 4 for r in ids}
    drafts = {r: [1, 2, 3] for r in ids}

    def expected_ctx():
        held = m.req_states.num_computed_tokens_np[[m.req_states.req_id_to_index[r] for r in ids]]
        raised = tail_context_sum(ca.batch_context_sum(m.req_states, num_tokens), int(held.max()), len(ids), tail)
        return -(-raised // len(ids))

    m.get_num_tokens(num_tokens, drafts)
    first = state.slots
    assert first is not None
    m.req_states.num_computed_tokens_np[first] += 7  # the step advanced every request
    m.get_num_tokens(num_tokens, drafts)
    assert state.slots is first and state.last_context == expected_ctx()  # reused, and the new contexts read
    # the same ids, but r0 was removed and re-added into another slot with another context
    m.req_states.remove_request("r0")
    m.req_states.add_request("r0", 31000)
    m.get_num_tokens(num_tokens, drafts)
    assert state.slots is not first and state.last_context == expected_ctx()
    assert ca.uninstall(m) and "add_request" not in vars(m.req_states) and "remove_request" not in vars(m.req_states)


def test_managers_sharing_a_grid_keep_their_own_verify_table(grid_3ctx, reference_table):
    """The verify table below max_num_reqs requests is a reused buffer: one per manager, so a
    second manager's step never rewrites the table the first one is pricing with."""
    rng = np.random.default_rng(21)
    a, b = (make_manager(reference_table.dense_tables(8192), rng=rng) for _ in range(2))
    ca.install(a, grid_3ctx), ca.install(b, grid_3ctx)
    num_a, drafts_a = schedule(a, np.full(32, 16000, np.int32), [STEPS] * 32, rng)
    a.get_num_tokens(num_a, drafts_a)
    seen = np.array(a.cost_tables[1])
    num_b, drafts_b = schedule(b, np.full(16, 1100, np.int32), [STEPS] * 16, rng)
    b.get_num_tokens(num_b, drafts_b)
    assert a.cost_tables[1] is not b.cost_tables[1] and np.array_equal(a.cost_tables[1], seen)


@pytest.mark.parametrize("tail", [0, 250])
def test_full_occupancy_steps_sum_the_occupied_slots_through_adds_and_removes(grid_3ctx, tail):
    """Requests arrive and finish every few steps (the batch changes, as at high concurrency); when a
    step schedules every request req_states holds, the context sum comes from the occupied-slot
    mask. Whatever path a step takes, its tables are the grid's for the true sum."""
    m = make_manager(grid_3ctx.tables_for(8192))
    m.req_states = CountedStates(**vars(m.req_states), free=list(range(MAX_REQS)))
    rng = np.random.default_rng(13)
    for i in range(60):  # some requests before install
        m.req_states.add_request(f"r{i}", int(rng.integers(0, 20000)))
    m.req_states.prefill_len.np[:] = 1
    state = ca.install(m, grid_3ctx, aware(tail))
    live, next_id, fast = [f"r{i}" for i in range(60)], 60, 0
    for step in range(300):
        for _ in range(int(rng.integers(0, 4))):  # finish some
            if len(live) > 50:
                m.req_states.remove_request(live.pop(int(rng.integers(0, len(live)))))
        for _ in range(int(rng.integers(0, 4))):  # admit some
            if len(live) < MAX_REQS:
                m.req_states.add_request(f"r{next_id}", int(rng.integers(0, 20000)))
                live.append(f"r{next_id}")
                next_id += 1
        if step % 50 == 7:  # vLLM re-adds a request under another slot (resumed): the mask follows
            rid = live[0]
            m.req_states.free.append(m.req_states.req_id_to_index[rid])
            m.req_states.add_request(rid, int(rng.integers(0, 20000)))
        slots = [m.req_states.req_id_to_index[r] for r in live]
        m.req_states.num_computed_tokens_np[slots] += 4
        sched = live if step % 3 else live[: len(live) - 1]  # now and then one request sits out
        fast += len(sched) == len(m.req_states.req_id_to_index)
        num_tokens = {r: 1 for r in sched}
        m.get_num_tokens(num_tokens, {r: [] for r in sched})
        held = m.req_states.num_computed_tokens_np[[m.req_states.req_id_to_index[r] for r in sched]].astype(np.int64)
        total = tail_context_sum(int(held.sum()), int(held.max()), len(sched), tail)
        draft, verify = m.cost_tables
        want_d, want_v = grid_3ctx.price([total] * 3, [len(sched)] * 3, [len(sched), 300, 2000])
        assert draft[len(sched)] == want_d[0] and [verify[k] for k in (len(sched), 300, 2000)] == list(want_v), step
    assert fast >= 150 and state.active.sum() == len(m.req_states.req_id_to_index)
    ca.uninstall(m)
    assert state.active is None and "add_request" not in vars(m.req_states)


@pytest.mark.parametrize("name, attr, default, default_line, other, value, line, bad, warning", [
    ("DSPARK_CALIB_CONTEXT_TAIL", "tail", 200, "mixed batches priced at mean + 0.2 x min(max - mean, mean^2 / (max - mean))",
     "0.25", 250, "mixed batches priced at mean + 0.25 x min(max - mean, mean^2 / (max - mean))",
     "1.5", "DSPARK_CALIB_CONTEXT_TAIL='1.5' must be between 0 and 1; the default tail 0.2 taken"),
    ("DSPARK_CALIB_CONTEXT_TAIL", "tail", 200, "prefill chunks priced by their query-context pairs", "0", 0,
     "mixed batches priced at their mean context", "", ""),
    ("DSPARK_CALIB_CONTEXT_CHUNKS", "chunks", True, "prefill chunks priced by their query-context pairs",
     "0", False, "prefill chunks priced by the KV sum",
     "pairs", "DSPARK_CALIB_CONTEXT_CHUNKS='pairs' is not a boolean (1/0, true/false, yes/no); the default taken"),
])
def test_context_env_reaches_the_installed_wrapper_and_a_bad_one_is_one_warning(two_context_load, caplog, name, attr,
                                                                                 default, default_line, other, value,
                                                                                 line, bad, warning):
    import logging

    from dspark_calib import env as E

    table, load = two_context_load
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        assert getattr(ca.installed_state(load()), attr) == default  # unset: the default, and the line says so
    assert E.DEFAULT_CONTEXT_TAIL_MILLI == 200 and E.DEFAULT_CONTEXT_CHUNKS is True
    assert any(default_line in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        m = load(**{name: other})
    assert getattr(ca.installed_state(m), attr) == value
    assert any(line in r.getMessage() for r in caplog.records)
    if not bad:
        return
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        wrong = load(**{name: bad})
    warned = [r for r in caplog.records if name in r.getMessage()]  # every line naming the variable: one
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING and warning in warned[0].getMessage()
    assert "\n" not in warned[0].getMessage()
    assert getattr(ca.installed_state(wrong), attr) == default  # context-aware stays on, at the default


@pytest.mark.slow
@SETTINGS
@given(num_reqs=st.integers(4, 200), seed=st.integers(0, 2**31 - 1))
def test_chunk_pricing_of_the_engine_is_what_validate_reprices(grid_3ctx, reference_table, tmp_path_factory, num_reqs,
                                                              seed):
    """The engine (chunks on) and validate agree step for step, also where a request with drafts
    schedules extra non-draft tokens and draft_tokens names a request that is not scheduled: both
    split tokens as vLLM's get_num_tokens does."""
    from dspark_calib.observe.file import ObservedWriter, read_observed
    from dspark_calib.validate import validate
    from dspark_calib.vllm.step_capture import capture_step, to_observed

    rng = np.random.default_rng(seed)
    m = make_manager(reference_table.dense_tables(8192), rng=rng)
    contexts = rng.choice([0, 900, 8000, 16500], num_reqs).astype(np.int32)
    num_tokens, draft_tokens = schedule(m, contexts, rng.integers(1, STEPS + 1, num_reqs), rng)
    ids = list(num_tokens)
    for r in ids[:2]:  # two fresh chunks without drafts (what makes the engine look)
        num_tokens[r] = int(rng.integers(2, 700))
        del draft_tokens[r]
    num_tokens[ids[2]] += 3  # drafts, and 4 non-draft tokens
    draft_tokens["not-scheduled"] = [1, 2]  # ignored by vLLM's split, and by both of ours
    state = ca.install(m, grid_3ctx, aware(chunks=True))
    total = m.get_num_tokens(num_tokens, draft_tokens)
    cap = capture_step(m, num_tokens, draft_tokens, priced_context=state.last_context)
    assert cap.prefill_tokens == num_tokens[ids[0]] + num_tokens[ids[1]] + 4
    d = tmp_path_factory.mktemp("agree")
    meta = {**state.policy.metadata(), "max_num_reqs": MAX_REQS, "max_num_batched_tokens": MAX_TOKENS}  # observe's
    with ObservedWriter(d, metadata=meta) as w:
        w.append(to_observed(cap, step=0, forward_ms=1.0, drafter_ms=0.5, num_target_tokens=total, full_cudagraph=True,
                             context_aware=True))
    result = validate(reference_table, read_observed([d]))
    assert (result.engine.compared, result.engine.verify_equal, result.engine.draft_equal) == (1, 1, 1)


class VllmSlots(SimpleNamespace):
    """vLLM 0.33's RequestState as far as slots go: add_request pops a free slot (the last one freed
    first, so slots are reused at once; re-adding a held id leaks its old slot, as vLLM does),
    remove_request frees it and returns it (None for an id it does not hold)."""

    def add_request(self, req_id, num_computed_tokens):
        slot = self.free_indices.pop()
        self.req_id_to_index[req_id] = slot
        self.num_computed_tokens_np[slot] = num_computed_tokens

    def remove_request(self, req_id):
        slot = self.req_id_to_index.pop(req_id, None)
        if slot is not None:
            self.free_indices.append(slot)
        return slot


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), tail=st.sampled_from([0, 200, 1000]), chunks=st.booleans(),
       start=st.integers(0, 200))
def test_held_slot_path_equals_looking_every_id_up(grid_3ctx, data, tail, chunks, start):
    """The held-slot path (_held_slots: every held request's slot but the unscheduled ones', kept
    between steps) against the same wrapper with the slot watch off (every id looked up, the code
    it replaces) and a from-scratch sum, on random steps: requests arriving, finishing, re-added
    under another slot, slots reused at once, some held but not scheduled (the same ones for a
    while, or others), prefill chunks, drafts or none. Tables, context and vLLM's budget must be
    identical at every step."""
    states = VllmSlots(req_id_to_index={}, num_computed_tokens_np=np.zeros(MAX_REQS, np.int32),
                       prefill_len=SimpleNamespace(np=np.ones(MAX_REQS, np.int32)), max_num_reqs=MAX_REQS,
                       max_num_batched_tokens=MAX_TOKENS, num_speculative_steps=STEPS,
                       free_indices=list(range(MAX_REQS)))
    fast, slow = make_manager(), make_manager()  # the same confidences (the same seed)
    fast.req_states = states
    slow.req_states = SimpleNamespace(**{k: v for k, v in vars(states).items() if k != "free_indices"})  # unwatched
    next_id = 0

    def admit(count):
        nonlocal next_id
        for _ in range(count):
            if states.free_indices:
                states.add_request(f"r{next_id}", data.draw(st.integers(0, 40000)))
                next_id += 1

    admit(start)  # some before install
    fast_state = ca.install(fast, grid_3ctx, aware(tail, chunks))
    slow_state = ca.install(slow, grid_3ctx, aware(tail, chunks))
    assert fast_state.watched and not slow_state.watched
    sits_out: list = []
    for _ in range(data.draw(st.integers(1, 12))):
        held = list(states.req_id_to_index)
        churn = data.draw(st.booleans())  # or a step with the same requests held (the caches' case)
        for r in data.draw(st.lists(st.sampled_from(held), max_size=6, unique=True)) if held and churn else ():
            if data.draw(st.booleans()):
                states.remove_request(r)  # finished
            elif states.free_indices:  # resumed: the same id under another slot
                states.add_request(r, data.draw(st.integers(0, 40000)))
        admit(data.draw(st.integers(0, 20)) if churn else 0)
        held = list(states.req_id_to_index)
        if not held:
            continue
        slots = list(states.req_id_to_index.values())
        states.num_computed_tokens_np[slots] += data.draw(st.integers(0, 9))
        kind = data.draw(st.sampled_from(["all", "same", "same", "swap", "few", "any"]))
        if kind == "all":
            sits_out = []
        elif kind == "swap" and sits_out:  # one that sat out finishes, another sits out: as many as before
            states.remove_request(sits_out[0])
            held = list(states.req_id_to_index)
            others = [r for r in held if r not in sits_out]
            sits_out = sits_out[1:] + ([data.draw(st.sampled_from(others))] if others else [])
        elif kind == "few" or not sits_out:
            sits_out = data.draw(st.lists(st.sampled_from(held), max_size=max(1, len(held) // 4), unique=True))
        elif kind == "any":
            sits_out = data.draw(st.lists(st.sampled_from(held), max_size=len(held) - 1, unique=True))
        sched = [r for r in held if r not in sits_out]
        if not sched:
            continue
        sched = data.draw(st.permutations(sched))
        drafts = {r: list(range(d)) for r in sched if (d := data.draw(st.integers(0, STEPS)))}
        if not drafts:
            drafts = {sched[0]: [0]}  # vLLM's rule needs one drafted request
        budget = MAX_TOKENS // 2
        num_tokens = {}
        for r in sched:
            extra = data.draw(st.sampled_from([1, 1, 1, 2, 64, 300])) if chunks else 1
            extra = max(1, min(extra, budget // len(sched)))
            num_tokens[r] = len(drafts.get(r, ())) + extra
        got = fast.get_num_tokens(num_tokens, drafts)
        got_tables = [np.array(t) for t in fast.cost_tables]
        assert got == slow.get_num_tokens(num_tokens, drafts) and fast._batch_budget == slow._batch_budget
        assert all(np.array_equal(a, b) for a, b in zip(got_tables, slow.cost_tables))
        values = [int(states.num_computed_tokens_np[states.req_id_to_index[r]]) for r in sched]
        total = tail_context_sum(sum(values), max(values), len(sched), tail)
        assert fast_state.last_context == slow_state.last_context == ceil_mean(total, len(sched))
        verify_sum = None
        if chunks and len(drafts) < len(sched):
            verify_sum = ca.chunk_verify_sum(total, num_tokens, drafts, states.req_id_to_index.__getitem__,
                                             states.num_computed_tokens_np, min(MAX_REQS, MAX_TOKENS), MAX_TOKENS)
        want = grid_3ctx.step_tables(total, len(sched), None, verify_sum)
        assert all(np.array_equal(a, b) for a, b in zip(got_tables, want))
    assert fast_state.active.sum() == len(states.req_id_to_index)  # the mask still follows


# -- the dummy-batch contract dspark_calib.context.verify_context rests on -------------------------
def test_profile_requests_is_vllms_dummy_batch():
    """The contract verify_context rests on: vLLM's profiling batch of N tokens has min(N,
    max_num_reqs) requests, each given the same context_len (read from the installed vLLM)."""
    import inspect

    from vllm.v1.worker.gpu import input_batch
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert "num_reqs = min(num_tokens, self.max_num_reqs)" in inspect.getsource(GPUModelRunner._dummy_run)
    assert "num_computed_tokens_np.fill(context_len)" in inspect.getsource(input_batch.set_dummy_context)
    assert [profile_requests(n, 256) for n in (1, 255, 256, 8192)] == [1, 255, 256, 256]
    assert verify_context(32 * 16384, 152, 256) == -(-32 * 16384 // 152)  # 3450: not the mean, 16384
    assert verify_context(256 * 1000, 1024, 256) == 1000

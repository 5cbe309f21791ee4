"""dspark_calib.fit against the installed vLLM's own adaptive-verification code.

Every comparison here is exact (== on floats, np.array_equal on tables): the
point of fit.py is that a table loaded into vLLM prices steps bit-for-bit as
vLLM's own start-up profiling would have. vLLM is imported directly: these
tests must run wherever vllm is installed, never skip.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from vllm.v1.worker.gpu.async_utils import StepTimingSample

from dspark_calib.errors import CalibError
from dspark_calib.fit import build_cost_tables, choose_draft_budget, fit_curves, fit_pair
from dspark_calib.samples import Sample
from dspark_calib.table.model import CostTable
from tests.helpers import DATA_DIR, FIXTURE_JSONS, load_fixture_json

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- vLLM managers without a GPU -------------------------------------------------------
class _SingleRankTP:
    """get_tp_group() of a one-rank tensor-parallel group."""

    def __init__(self):
        self.calls = []

    def broadcast_object(self, obj, src=0):
        self.calls.append(src)
        return obj


@contextmanager
def single_rank_tp():
    tp = _SingleRankTP()
    with mock.patch.object(av, "get_tp_group", lambda: tp):
        yield tp


def curve_manager(max_num_reqs: int, max_num_batched_tokens: int, cudagraph_limit: int):
    """An AdaptiveVerificationManager with just what set_cost_curves touches.

    Returns (manager, captured): captured["curves"] receives the (draft, verify)
    curves vLLM hands to set_cost_curves.
    """
    m = object.__new__(av.AdaptiveVerificationManager)
    m.req_states = SimpleNamespace(max_num_reqs=max_num_reqs, max_num_batched_tokens=max_num_batched_tokens)
    m._cudagraph_limit = cudagraph_limit
    m.cost_tables = None
    captured = {}
    real = m.set_cost_curves

    def spy(draft_curve, verify_curve):
        captured["curves"] = (draft_curve, verify_curve)
        return real(draft_curve, verify_curve)

    m.set_cost_curves = spy
    return m, captured


def vllm_curves_and_tables(samples, max_num_reqs, max_num_batched_tokens, cudagraph_limit):
    m, captured = curve_manager(max_num_reqs, max_num_batched_tokens, cudagraph_limit)
    with single_rank_tp() as tp:
        m.set_initial_cost_curves(list(samples))
    assert tp.calls == [0], "set_cost_curves must broadcast from rank 0 exactly once"
    return captured["curves"], m.cost_tables


def ours(samples, context_len=8192):
    return [Sample.from_vllm(s, context_len=context_len) for s in samples]


def assert_curve_lists_identical(got, want):
    """Same sizes, bit-identical costs, same Python types (vLLM keys ints, costs floats)."""
    assert len(got) == len(want)
    for (gs, gc), (ws, wc) in zip(got, want):
        assert gs == ws and type(gs) is int
        assert type(gc) is float
        assert gc == wc or (np.isnan(gc) and np.isnan(wc))
        assert np.float64(gc).tobytes() == np.float64(wc).tobytes()


def assert_tables_identical(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == np.float64
        assert g.shape == w.shape
        assert np.array_equal(g, w)


# -- strategies --------------------------------------------------------------------------
# Costs: arbitrary non-negative floats plus a few values that tie exactly.
costs = st.one_of(
    st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1.0, 2.5, 1e-9, 5e-324, 1234.5678]),
)
# Few distinct sizes, so groups hold several samples (even counts: median of two).
token_sizes = st.one_of(st.sampled_from([1, 2, 3, 8, 512, 513, 768, 1024, 8192]), st.integers(1, 9000))
req_counts = st.one_of(st.sampled_from([1, 2, 4, 256]), st.integers(1, 300))
vllm_samples = st.builds(
    StepTimingSample,
    forward_ms=costs,
    drafter_ms=costs,
    num_target_tokens=token_sizes,
    num_reqs=req_counts,
    full_cudagraph=st.booleans(),
)


@st.composite
def curves(draw, max_size=10_000, max_points=12):
    """(size, cost) lists as vLLM builds them: sizes strictly increasing, costs >= 0, any order."""
    sizes = sorted(draw(st.sets(st.integers(1, max_size), min_size=1, max_size=max_points)))
    cs = draw(st.lists(costs, min_size=len(sizes), max_size=len(sizes)))
    return list(zip(sizes, cs))


# -- fit_pair == set_initial_cost_curves -------------------------------------------------
@SETTINGS
@given(
    samples=st.lists(vllm_samples, min_size=1, max_size=60),
    max_num_reqs=st.integers(1, 300),
    max_tokens=st.integers(1, 10_000),
    limit=st.one_of(st.just(0), st.just(512), st.integers(0, 2048)),
)
def test_fit_pair_matches_set_initial_cost_curves(samples, max_num_reqs, max_tokens, limit):
    pair = fit_pair(ours(samples))
    if not any(s.full_cudagraph for s in samples):
        # No graph replay at all: vLLM refuses to build tables; we produce an empty
        # draft curve, which a CostTable refuses too.
        with single_rank_tp(), pytest.raises(RuntimeError, match="could not profile"):
            curve_manager(max_num_reqs, max_tokens, limit)[0].set_initial_cost_curves(samples)
        assert len(pair.draft) == 0
        return
    (v_draft, v_verify), v_tables = vllm_curves_and_tables(samples, max_num_reqs, max_tokens, limit)
    draft, verify = pair.as_vllm()
    assert_curve_lists_identical(draft, v_draft)
    assert_curve_lists_identical(verify, v_verify)
    assert_tables_identical(build_cost_tables(draft, verify, max_num_reqs, max_tokens, limit), v_tables)
    # The spread columns describe the same groups vLLM took the median of.
    assert pair.verify.n.sum() == len(samples)
    assert pair.draft.n.sum() == sum(s.full_cudagraph for s in samples)
    for c in (pair.draft, pair.verify):
        assert (c.min_ms <= c.p25_ms).all() and (c.p25_ms <= c.cost_ms).all()
        assert (c.cost_ms <= c.p75_ms).all() and (c.p75_ms <= c.max_ms).all()


def test_no_graph_samples_refused_by_vllm_and_by_cost_table(reference_table_8192):
    samples = [StepTimingSample(5.0, 1.0, n, min(n, 256), False) for n in (1, 2, 4) for _ in range(3)]
    with single_rank_tp(), pytest.raises(RuntimeError):
        curve_manager(256, 8192, 512)[0].set_initial_cost_curves(samples)
    with pytest.raises(CalibError, match="draft curve at context 8192 is empty"):
        CostTable.from_samples(ours(samples), reference_table_8192.fingerprint)


def test_draft_curve_skips_eager_only_sizes():
    """num_reqs seen only in eager steps has no draft point, in vLLM and in ours."""
    samples = [
        StepTimingSample(5.0, 1.0, 1, 1, True),
        StepTimingSample(5.5, 1.1, 2, 2, True),
        StepTimingSample(9.0, 50.0, 768, 2, False),  # same num_reqs as a graph step: ignored for draft
        StepTimingSample(9.5, 60.0, 1024, 3, False),  # num_reqs 3 never replayed a graph
        StepTimingSample(6.0, 1.3, 4, 4, True),
    ]
    (v_draft, v_verify), v_tables = vllm_curves_and_tables(samples, 8, 2048, 512)
    pair = fit_pair(ours(samples))
    assert pair.draft.as_vllm() == v_draft == [(1, 1.0), (2, 1.1), (4, 1.3)]
    assert pair.verify.as_vllm() == v_verify
    assert_tables_identical(build_cost_tables(*pair.as_vllm(), 8, 2048, 512), v_tables)
    # Request count 3 is priced as the next profiled graph size, 4.
    assert v_tables[0][3] == 1.3


def test_fit_curves_splits_by_context_and_each_matches_vllm():
    rng = np.random.default_rng(0)
    raw = {
        ctx: [StepTimingSample(float(rng.gamma(2.0) * ctx / 1024), float(rng.gamma(1.0)), int(n), int(min(n, 256)),
                               bool(n <= 512)) for n in (1, 2, 4, 512, 768, 1024) for _ in range(5)]
        for ctx in (1024, 8192)
    }
    fitted = fit_curves([s for ctx, group in raw.items() for s in ours(group, ctx)])
    assert sorted(fitted) == [1024, 8192]
    for ctx, group in raw.items():
        (v_draft, v_verify), _ = vllm_curves_and_tables(group, 256, 1024, 512)
        assert fitted[ctx].as_vllm() == (v_draft, v_verify)


# -- build_cost_tables == build_cost_tables_from_curves ----------------------------------
@SETTINGS
@given(
    draft=curves(max_size=400),
    verify=curves(max_size=12_000),
    max_num_reqs=st.integers(0, 400),
    max_tokens=st.integers(0, 12_000),
    limit=st.one_of(st.just(0), st.integers(0, 12_000)),
)
@example(draft=[(1, 1.0)], verify=[(1, 2.0)], max_num_reqs=4, max_tokens=16, limit=0)  # one point
@example(draft=[(1, 1.0)], verify=[(1, 2.0)], max_num_reqs=4, max_tokens=16, limit=8)
def test_build_cost_tables_matches_vllm(draft, verify, max_num_reqs, max_tokens, limit):
    want = av.build_cost_tables_from_curves(draft, verify, max_num_reqs, max_tokens, limit)
    got = build_cost_tables(draft, verify, max_num_reqs, max_tokens, limit)
    assert_tables_identical(got, want)
    assert len(got[0]) == max_num_reqs + 1 and len(got[1]) == max_tokens + 1


EDGE_CASES = {
    "one point each": ([(4, 2.0)], [(16, 5.0)], 8, 64, 0),
    "one point, below limit": ([(4, 2.0)], [(16, 5.0)], 8, 64, 32),
    "ties / equal costs": ([(1, 1.0), (2, 1.0), (4, 1.0)], [(1, 3.0), (8, 3.0), (16, 3.0), (32, 3.0)], 8, 64, 16),
    "non-monotone costs": ([(1, 3.0), (2, 1.0), (4, 2.0)], [(1, 9.0), (2, 1.0), (600, 4.0), (900, 2.0)], 8, 1024, 512),
    "all sizes above capture limit": ([(300, 2.0), (400, 3.0)], [(600, 4.0), (800, 6.0), (1000, 7.0)], 500, 1200, 256),
    "limit 0": ([(1, 1.0), (8, 2.0)], [(1, 1.0), (64, 2.0), (512, 4.0)], 16, 1024, 0),
    "extrapolation past the last point": ([(1, 1.0), (2, 1.5)], [(1, 2.0), (512, 10.0), (768, 14.0)], 256, 8192, 512),
    "extrapolation with a flat tail": ([(1, 1.0), (2, 1.0)], [(1, 2.0), (2, 2.0)], 64, 4096, 0),
    "zero costs floored": ([(1, 0.0), (2, 0.0)], [(1, 0.0), (4, 0.0)], 4, 8, 2),
    "limit above every size": ([(1, 1.0), (3, 2.0)], [(1, 1.0), (5, 2.0)], 8, 16, 10_000),
    "limit equals a profiled size": ([(1, 1.0), (4, 2.0)], [(1, 1.0), (512, 3.0), (768, 5.0)], 8, 1024, 512),
    "zero-length tables": ([(1, 1.0)], [(1, 1.0)], 0, 0, 0),
}


@pytest.mark.parametrize("draft,verify,max_num_reqs,max_tokens,limit", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_build_cost_tables_edge_cases_match_vllm(draft, verify, max_num_reqs, max_tokens, limit):
    want = av.build_cost_tables_from_curves(draft, verify, max_num_reqs, max_tokens, limit)
    got = build_cost_tables(draft, verify, max_num_reqs, max_tokens, limit)
    assert_tables_identical(got, want)
    assert (got[0] >= 0).all() and (got[1] >= 1e-6).all()


def test_build_cost_tables_shape_is_not_vacuous():
    """The rules the equality tests pin down, spelled out once on a hand-checked case."""
    draft, verify = build_cost_tables([(1, 1.0), (4, 2.0)], [(2, 1.0), (4, 3.0), (8, 5.0), (16, 9.0)], 4, 20, 4)
    assert draft.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]
    # <= limit: step function to the next profiled size; above: interpolate between
    # points above the limit; past the last point: extrapolate the last slope (0.5/token).
    assert verify[:5].tolist() == [1.0, 1.0, 1.0, 3.0, 3.0]
    assert verify[5:9].tolist() == [5.0, 5.0, 5.0, 5.0]  # below the first point above the limit (8): its cost
    assert verify[12] == 7.0 and verify[16] == 9.0 and verify[20] == 11.0


def test_build_cost_tables_rejects_empty_curves():
    with pytest.raises(ValueError):
        build_cost_tables([], [(1, 1.0)], 4, 4)
    with pytest.raises(ValueError):
        build_cost_tables([(1, 1.0)], [], 4, 4)


# -- choose_draft_budget == get_num_tokens ------------------------------------------------
def budget_manager(cost_tables, conf_buffer, req_slots, num_computed, prefill_len, *, num_steps,
                   num_bonus_tokens, max_total_logits):
    m = object.__new__(av.AdaptiveVerificationManager)
    m.req_states = SimpleNamespace(
        req_id_to_index=dict(req_slots),
        num_computed_tokens_np=num_computed,
        prefill_len=SimpleNamespace(np=prefill_len),
        max_num_reqs=conf_buffer.shape[0],
        max_num_batched_tokens=len(cost_tables[1]) - 1,
        num_speculative_steps=num_steps,
    )
    stale = SimpleNamespace(np=conf_buffer)
    m._stale_confidences = [stale, stale]
    m._stale_idx = 0
    m.num_speculative_steps = num_steps
    m.num_bonus_tokens = num_bonus_tokens
    m._max_total_logits = max_total_logits
    m.cost_tables = cost_tables
    m._batch_budget = None
    return m


confidence_values = st.one_of(st.floats(0.0, 1.0, width=32), st.sampled_from([0.0, 0.5, 1.0]))


@st.composite
def decode_batches(draw, max_reqs=48):
    num_steps = draw(st.integers(1, 8))
    num_bonus = draw(st.integers(1, 2))
    num_reqs = draw(st.integers(1, max_reqs))
    buffer_rows = draw(st.integers(num_reqs, max_reqs + 8))
    slots = draw(st.permutations(range(buffer_rows)))[:num_reqs]
    conf = draw(arrays(np.float32, (buffer_rows, num_steps), elements=confidence_values))
    drafts = draw(st.lists(st.integers(0, num_steps), min_size=num_reqs, max_size=num_reqs))
    non_draft = draw(st.lists(st.integers(1, 64), min_size=num_reqs, max_size=num_reqs))
    mid_prefill = draw(st.lists(st.booleans(), min_size=num_reqs, max_size=num_reqs))
    computed = np.zeros(buffer_rows, dtype=np.int32)
    prefill = np.zeros(buffer_rows, dtype=np.int32)
    for slot, nd, mid in zip(slots, non_draft, mid_prefill):
        computed[slot] = draw(st.integers(0, 20_000))
        done = computed[slot] + nd  # tokens known after this step
        # Mid-prefill: the prompt is longer than what this step reaches, so nothing samples.
        prefill[slot] = draw(st.integers(done + 1, done + 5000)) if mid else draw(st.integers(1, done))
    bound = num_reqs * num_bonus + sum(drafts)
    max_total_logits = draw(st.one_of(st.just(1 << 30), st.integers(0, bound + 4)))
    omit_empty = draw(st.booleans())  # requests without drafts: absent from draft_tokens, or []
    return SimpleNamespace(num_steps=num_steps, num_bonus=num_bonus, slots=slots, conf=conf, drafts=drafts,
                           non_draft=non_draft, num_sampling=num_reqs - sum(mid_prefill), computed=computed,
                           prefill=prefill, max_total_logits=max_total_logits, omit_empty=omit_empty)


def vllm_budget(tables, b):
    req_ids = [f"req-{i}" for i in range(len(b.slots))]
    m = budget_manager(tables, b.conf, zip(req_ids, b.slots), b.computed, b.prefill, num_steps=b.num_steps,
                       num_bonus_tokens=b.num_bonus, max_total_logits=b.max_total_logits)
    num_tokens_per_req = {r: nd + d for r, nd, d in zip(req_ids, b.non_draft, b.drafts)}
    draft_tokens = {r: list(range(100, 100 + d)) for r, d in zip(req_ids, b.drafts) if d or not b.omit_empty}
    total = m.get_num_tokens(num_tokens_per_req, draft_tokens)
    drafts_per_req, non_draft_per_req, budget = m._batch_budget
    assert drafts_per_req == dict(zip(req_ids, b.drafts))
    assert non_draft_per_req == dict(zip(req_ids, b.non_draft))
    assert total == sum(b.non_draft) + budget
    return budget


def our_budget(tables, b):
    return choose_draft_budget(
        tables[0], tables[1], b.conf[b.slots], b.drafts, b.non_draft,
        num_sampling_requests=b.num_sampling, max_total_logits=b.max_total_logits, num_bonus_tokens=b.num_bonus,
    )


@pytest.fixture(scope="module")
def h200_tables(reference_table_8192):
    return reference_table_8192.dense_tables(8192)


@SETTINGS
@given(b=decode_batches())
def test_choose_draft_budget_matches_get_num_tokens_on_h200_tables(h200_tables, b):
    budget = our_budget(h200_tables, b)
    assert budget == vllm_budget(h200_tables, b)
    assert 0 <= budget <= min(sum(b.drafts), max(0, b.max_total_logits - len(b.slots) * b.num_bonus))


@SETTINGS
@given(b=decode_batches(max_reqs=24), draft=curves(max_size=40), verify=curves(max_size=2500), limit=st.integers(0, 600))
def test_choose_draft_budget_matches_get_num_tokens_on_random_tables(b, draft, verify, limit):
    tables = build_cost_tables(draft, verify, len(b.conf), sum(b.non_draft) + sum(b.drafts) + 8, limit)
    assert our_budget(tables, b) == vllm_budget(tables, b)


def test_choose_draft_budget_defaults_are_vllm_with_no_limits(h200_tables):
    """Defaults: every request samples, no logit cap."""
    rng = np.random.default_rng(7)
    for num_reqs in (1, 3, 16, 64, 200):
        conf = rng.uniform(0.3, 1.0, size=(num_reqs, 7)).astype(np.float32)
        b = SimpleNamespace(num_steps=7, num_bonus=1, slots=list(range(num_reqs)), conf=conf, drafts=[7] * num_reqs,
                            non_draft=[1] * num_reqs, num_sampling=num_reqs,
                            computed=np.full(num_reqs, 100, np.int32), prefill=np.full(num_reqs, 10, np.int32),
                            max_total_logits=1 << 30, omit_empty=False)
        assert choose_draft_budget(*h200_tables, conf, b.drafts, b.non_draft) == vllm_budget(h200_tables, b)


@pytest.mark.parametrize("num_reqs", [1, 8, 64, 256])
def test_budget_responds_to_confidence_like_vllm(h200_tables, num_reqs):
    """Not vacuous: on the H200 tables the budget spans 0..all drafts as confidence rises."""
    budgets = []
    for conf_value in (0.0, 0.3, 0.6, 0.9, 1.0):
        conf = np.full((num_reqs, 7), conf_value, dtype=np.float32)
        b = SimpleNamespace(num_steps=7, num_bonus=1, slots=list(range(num_reqs)), conf=conf, drafts=[7] * num_reqs,
                            non_draft=[1] * num_reqs, num_sampling=num_reqs,
                            computed=np.full(num_reqs, 100, np.int32), prefill=np.full(num_reqs, 10, np.int32),
                            max_total_logits=1 << 30, omit_empty=False)
        ours_ = our_budget(h200_tables, b)
        assert ours_ == vllm_budget(h200_tables, b)
        budgets.append(ours_)
    assert budgets[0] == 0
    assert budgets == sorted(budgets)
    if num_reqs <= 8:
        assert budgets[-1] == 7 * num_reqs  # certain drafts on a small batch: verify them all


# -- the recorded H200 start-up profiles --------------------------------------------------
@pytest.fixture(scope="module", params=FIXTURE_JSONS, ids=lambda p: p.stem)
def recording(request):
    return load_fixture_json(request.param)


def test_recorded_batches_are_vllms_batches_to_profile(recording, monkeypatch):
    monkeypatch.setenv("VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN", str(recording["ctx"]))
    m = object.__new__(av.AdaptiveVerificationManager)
    m.req_states = SimpleNamespace(max_num_reqs=recording["max_num_reqs"],
                                   max_num_batched_tokens=recording["max_num_batched_tokens"])
    assert list(m.batches_to_profile(list(recording["capture_sizes"]))) == recording["batches"]
    assert m._cudagraph_limit == recording["cudagraph_limit"]


def test_recorded_profile_refits_to_recorded_curves(recording):
    samples = [StepTimingSample(**row) for row in recording["rows"]]
    want_draft = [tuple(p) for p in recording["draft_curve"]]
    want_verify = [tuple(p) for p in recording["verify_curve"]]
    (v_draft, v_verify), v_tables = vllm_curves_and_tables(
        samples, recording["max_num_reqs"], recording["max_num_batched_tokens"], recording["cudagraph_limit"])
    # vLLM's code reproduces what vLLM recorded on the H200 ...
    assert v_draft == want_draft and v_verify == want_verify
    # ... and so does ours, bit for bit, tables included.
    pair = fit_pair(ours(samples, recording["ctx"]))
    assert_curve_lists_identical(pair.draft.as_vllm(), want_draft)
    assert_curve_lists_identical(pair.verify.as_vllm(), want_verify)
    ours_tables = build_cost_tables(*pair.as_vllm(), recording["max_num_reqs"], recording["max_num_batched_tokens"],
                                    recording["cudagraph_limit"])
    assert_tables_identical(ours_tables, v_tables)


def test_reference_table_holds_recorded_curves(reference_table, recording):
    ctx = recording["ctx"]
    pair = reference_table.curves[ctx]
    assert pair.draft.as_vllm() == [tuple(p) for p in recording["draft_curve"]]
    assert pair.verify.as_vllm() == [tuple(p) for p in recording["verify_curve"]]
    fp = reference_table.fingerprint
    assert fp.cudagraph_limit == recording["cudagraph_limit"]
    assert fp.max_num_seqs == recording["max_num_reqs"]
    assert fp.max_num_batched_tokens == recording["max_num_batched_tokens"]
    samples = [StepTimingSample(**row) for row in recording["rows"]]
    _, v_tables = vllm_curves_and_tables(samples, fp.max_num_seqs, fp.max_num_batched_tokens, fp.cudagraph_limit)
    assert_tables_identical(reference_table.dense_tables(ctx), v_tables)
    # Each profiled size was replayed 5 times (vLLM's _PROFILE_REPLAYS); replays are numbered 0..4.
    frame = reference_table.samples.select(context_len=ctx).to_frame()
    assert len(frame) == len(recording["rows"])
    assert sorted(frame.groupby("num_target_tokens").replay.apply(sorted).map(tuple).unique()) == [(0, 1, 2, 3, 4)]


def test_nearest_context_default_is_vllms_profile_context(reference_table):
    assert reference_table.nearest_context(None) == 8192
    assert DATA_DIR.is_dir()

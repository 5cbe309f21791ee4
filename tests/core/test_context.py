"""Costs at any context (dspark_calib.context) on the real H200 curves and random ones."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_calib.pricing.grid import DEFAULT_TOLERANCE, ContextGrid
from dspark_calib.pricing.costs import ContextCosts, OutOfRange, blend, dense_tables
from dspark_calib.pricing.rules import ceil_mean, profile_requests, verify_context
from dspark_calib.errors import CalibError
from dspark_calib.fit import DRAFT_FLOOR_MS, VERIFY_FLOOR_MS, build_cost_tables
from tests.helpers import REPO

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def costs(reference_table):
    return ContextCosts.from_table(reference_table)


@pytest.fixture(scope="module")
def grid(costs):
    return ContextGrid(costs)


def _vllm_tables(table, ctx):
    fp = table.fingerprint
    return build_cost_tables(*table.curves[ctx].as_vllm(), fp.max_num_seqs, fp.max_num_batched_tokens,
                             fp.cudagraph_limit)


def _pct_error(predicted, measured):
    return np.abs(predicted[1:] - measured[1:]) / measured[1:] * 100  # size 0 is never priced


def test_interpolating_1024_and_16384_predicts_8192_within_issue_bounds(reference_table):
    """Issue 9: interpolating ctx 1024 and 16384 predicts the measured ctx-8192 tables.

    Achieved on the real H200 profiles (every dense size 1..max): verify median 0.801 %,
    max 1.712 % (at 4096 tokens); draft median 0.212 %, max 0.451 %. The issue's bounds,
    1.71 % and 0.45 %, are these maxima to two decimals, so that is how they are asserted.
    """
    two = {c: reference_table.curves[c] for c in (1024, 16384)}
    fp = reference_table.fingerprint
    priced = ContextCosts(two, fp.max_num_seqs, fp.max_num_batched_tokens, fp.cudagraph_limit).at(8192)
    assert priced.warning is None and (priced.lower, priced.upper) == (1024, 16384)
    draft_8192, verify_8192 = _vllm_tables(reference_table, 8192)
    verify_err = _pct_error(priced.verify, verify_8192)
    draft_err = _pct_error(priced.draft, draft_8192)
    assert round(verify_err.max(), 2) <= 1.71 and np.median(verify_err) < 1.0
    assert round(draft_err.max(), 2) <= 0.45 and np.median(draft_err) < 0.3
    # Not vacuous: the nearest profiled context alone is far off (the problem this solves).
    nearest_err = _pct_error(_vllm_tables(reference_table, 16384)[1], verify_8192)
    assert nearest_err.max() > 50


@pytest.mark.parametrize("ctx", [1024, 8192, 16384])
def test_profiled_contexts_are_bit_identical_to_build_cost_tables(reference_table, costs, grid, ctx):
    want = _vllm_tables(reference_table, ctx)
    for got in (costs.at(ctx).as_tuple(), grid.tables_for(ctx), dense_tables(reference_table, ctx).as_tuple()):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes()
    assert costs.at(ctx).warning is None


@pytest.mark.parametrize("ctx,used", [(16385, 16384), (10**7, 16384)])
def test_above_the_range_is_the_longest_context_plus_a_warning(reference_table, costs, grid, ctx, used):
    priced = costs.at(ctx)
    assert isinstance(priced.warning, OutOfRange) and not priced.warning.extrapolated
    assert priced.warning.used_context == used
    assert str(priced.warning).count("\n") == 0 and str(used) in str(priced.warning)
    want = _vllm_tables(reference_table, used)
    assert np.array_equal(priced.verify, want[1]) and np.array_equal(priced.draft, want[0])
    assert grid.tables_for(ctx)[1] is grid.tables_for(used)[1]


@pytest.mark.parametrize("ctx", [0, 1, 512, 1023])
def test_below_the_range_is_the_line_through_the_two_shortest(reference_table, costs, grid, ctx):
    """Linear in context below the shortest profiled one (attention reads ctx KV tokens) towards a
    context-0 table kept between vLLM's floor and the shortest context's costs and non-decreasing
    in size (as vLLM makes every table); a warning says so."""
    priced = costs.at(ctx)
    assert isinstance(priced.warning, OutOfRange) and priced.warning.extrapolated
    assert "extrapolated linearly from contexts 1024 and 8192" in str(priced.warning)
    (d0, v0), (d1, v1) = _vllm_tables(reference_table, 1024), _vllm_tables(reference_table, 8192)
    k = 1024 / (8192 - 1024)
    zero_v = np.maximum.accumulate(np.clip(v0 - (v1 - v0) * k, VERIFY_FLOOR_MS, v0))
    zero_d = np.maximum.accumulate(np.clip(d0 - (d1 - d0) * k, DRAFT_FLOOR_MS, d0))
    w = ctx / 1024
    np.testing.assert_allclose(priced.verify, zero_v + w * (v0 - zero_v), rtol=1e-9)
    np.testing.assert_allclose(priced.draft, zero_d + w * (d0 - zero_d), rtol=1e-9, atol=1e-12)
    for table, top in ((priced.verify, v0), (priced.draft, d0)):
        assert (np.diff(table) >= 0).all() and (table <= top).all()  # vLLM's shape; never above 1024's
    assert (priced.verify > 0).all()
    np.testing.assert_allclose(dense_tables(reference_table, ctx).verify, priced.verify, rtol=1e-12)
    g = grid.tables_for(ctx)[1]  # the grid rounds up: within its bound, never below
    assert (g >= priced.verify * (1 - 1e-12)).all() and (g <= priced.verify * (1 + grid.max_rel_error) + 1e-12).all()


def test_no_extrapolation_when_the_two_shortest_are_too_close():
    """A line over a short span would stretch profiling noise all the way to context 0: when the
    two shortest contexts are less than the shortest apart, below the range is the shortest's."""
    curves = {4096: ([(1, 1.0), (8, 1.1)], [(1, 5.0), (8, 5.5)]), 4352: ([(1, 1.1), (8, 1.2)], [(1, 5.4), (8, 6.0)])}
    costs = ContextCosts(curves, 8, 16)
    assert not costs.extrapolates_below and costs.knots == (4096, 4352)
    priced = costs.at(2048)
    assert not priced.warning.extrapolated and "priced at context 4096" in str(priced.warning)
    assert np.array_equal(priced.verify, costs.tables[4096][1])


def test_monotone_in_context_on_h200(costs, grid):
    """Every H200 table entry rises with context; so must every priced context in between."""
    contexts = list(range(1024, 16385, 97)) + [16384]
    verify = np.stack([costs.at(c).verify for c in contexts])
    draft = np.stack([costs.at(c).draft for c in contexts])
    assert (np.diff(verify, axis=0) >= 0).all() and (np.diff(draft, axis=0) >= 0).all()
    rows = [grid.index(c) for c in range(0, 20000, 13)]
    assert rows == sorted(rows)
    assert (np.diff(grid.verify, axis=0) >= 0).all()


def test_grid_error_bound_holds_and_rounds_up(costs, grid):
    assert 0 < grid.max_rel_error <= 0.005 + 1e-12
    rng = np.random.default_rng(3)
    for ctx in rng.integers(1025, 16384, 200).tolist():
        exact = costs.at(ctx)
        gd, gv = grid.tables_for(ctx)
        assert np.all(np.abs(gv - exact.verify) <= grid.max_rel_error * exact.verify * (1 + 1e-12))
        assert np.all(np.abs(gd[1:] - exact.draft[1:]) <= grid.max_rel_error * exact.draft[1:] * (1 + 1e-12))
        # rounded up: the grid context is >= ctx, so (costs rising with context) never cheaper
        assert grid.points[grid.index(ctx)] >= ctx and np.all(gv >= exact.verify)


def test_grid_memory_cap_loosens_the_tolerance(costs):
    row = 8 * (costs.max_num_reqs + costs.max_num_batched_tokens + 2)
    small = ContextGrid(costs, tolerance=0.001, max_bytes=60 * row)
    assert len(small) <= 60 and small.tolerance > 0.001
    assert small.max_rel_error <= small.tolerance * (1 + 1e-9)
    assert set(costs.contexts) <= set(small.points)


def test_single_context_grid_is_that_context_everywhere(reference_table_8192):
    grid = ContextGrid.from_table(reference_table_8192)
    assert grid.points == (8192,) and grid.max_rel_error == 0.0
    want = _vllm_tables(reference_table_8192, 8192)
    for ctx in (0, 1, 8191, 8192, 8193, 10**6):
        assert all(np.array_equal(g, w) for g, w in zip(grid.tables_for(ctx), want))


def test_bad_inputs_are_calib_errors():
    with pytest.raises(CalibError):
        ContextCosts({}, 4, 8)
    with pytest.raises(CalibError):
        ContextGrid(ContextCosts({1: ([(1, 1.0)], [(1, 1.0)])}, 4, 8), tolerance=0)


def test_ceil_mean_is_exact_integer_ceiling():
    assert ceil_mean(10, 3) == 4 and ceil_mean(9, 3) == 3 and ceil_mean(0, 5) == 0
    assert ceil_mean(10**15 + 1, 10**15) == 2  # floats would lose this


# -- properties on random curves -----------------------------------------------------------
positive_costs = st.floats(min_value=0.01, max_value=1e3, allow_nan=False)


@st.composite
def curve_sets(draw):
    """2-4 contexts; each context's curve = a base curve plus a non-negative per-context bump
    scaled per size (attention's share differs by size), so costs rise with context entry by
    entry, at slopes that differ by size (what stresses the extrapolation to context 0)."""
    sizes = sorted(draw(st.sets(st.integers(1, 300), min_size=1, max_size=12)))
    rsizes = sorted(draw(st.sets(st.integers(1, 20), min_size=1, max_size=5)))
    contexts = sorted(draw(st.sets(st.integers(0, 50_000), min_size=2, max_size=4)))
    base_v = [draw(positive_costs) for _ in sizes]
    base_d = [draw(positive_costs) for _ in rsizes]
    # non-decreasing in size (a bigger batch's attention share is not smaller), which keeps
    # vLLM's extrapolation past the last size rising with context too
    scale_v = sorted(draw(st.floats(0, 3)) for _ in sizes)
    scale_d = sorted(draw(st.floats(0, 3)) for _ in rsizes)
    curves, extra = {}, 0.0
    for c in contexts:
        extra += draw(st.floats(0, 100))
        curves[c] = ([(s, b + extra * k) for s, b, k in zip(rsizes, base_d, scale_d)],
                     [(s, b + extra * k) for s, b, k in zip(sizes, base_v, scale_v)])
    return curves, draw(st.integers(0, 320))


@SETTINGS
@given(data=curve_sets(), probe=st.integers(-10, 60_000))
def test_properties_on_random_curves(data, probe):
    curves, limit = data
    costs = ContextCosts(curves, 24, 400, limit)
    ctxs = costs.contexts
    for c in ctxs:  # exact at every profiled context
        want = build_cost_tables(*curves[c], 24, 400, limit)
        assert all(np.array_equal(g, w) for g, w in zip(costs.at(c).as_tuple(), want))
    priced = costs.at(probe)
    assert (priced.warning is None) == (ctxs[0] <= probe <= ctxs[-1])
    lo, hi = costs.tables[priced.lower], costs.tables[priced.upper]
    for got, a, b in zip(priced.as_tuple(), lo, hi):  # between its two neighbours
        assert np.all(got >= np.minimum(a, b)) and np.all(got <= np.maximum(a, b))
    for table in priced.as_tuple():  # vLLM's shape survives blending and the extrapolation below
        assert (np.diff(table) >= 0).all()
    # monotone in context where the inputs are
    later = costs.at(probe + 37)
    assert np.all(later.verify >= priced.verify) and np.all(later.draft >= priced.draft)
    grid = ContextGrid(costs, tolerance=0.02)
    gd, gv = grid.tables_for(probe)
    assert np.all(gv >= priced.verify) and np.all(np.abs(gv - priced.verify) <= grid.max_rel_error * priced.verify * (1 + 1e-9))
    assert np.all(gd[1:] >= priced.draft[1:])


@SETTINGS
@given(a=st.floats(0, 1e4), b=st.floats(0, 1e4), w1=st.floats(0, 1), w2=st.floats(0, 1))
def test_blend_is_monotone_in_weight_and_bounded(a, b, w1, w2):
    lo, hi = sorted((w1, w2))
    x, y = np.array([a]), np.array([b])
    first, second = blend(x, y, lo)[0], blend(x, y, hi)[0]
    assert min(a, b) <= first <= max(a, b)
    assert (first <= second) if b >= a else (first >= second)
    assert blend(x, y, 0.0)[0] == a


def test_cost_table_dense_tables_prices_any_context(reference_table, costs):
    """CostTable.dense_tables(context_len=L) is the interpolation, still a (draft, verify) pair:
    at 4096 it lies between 1024's and 8192's and equals ContextCosts.at; above the range it is
    the line through the two longest, at or above the longest's tables, and says so; None is the
    default context's, bit for bit."""
    lo, hi, mid = reference_table.dense_tables(1024), reference_table.dense_tables(8192), reference_table.dense_tables(4096)
    draft, verify = mid
    assert isinstance(mid, tuple) and len(mid) == 2 and mid.warning is None
    np.testing.assert_array_equal(verify, costs.at(4096).verify)
    assert np.all(verify >= lo[1]) and np.all(verify <= hi[1]) and np.any(verify > lo[1]) and np.any(verify < hi[1])
    assert (mid.priced.lower, mid.priced.upper, mid.priced.weight) == (1024, 8192, 3072 / 7168)
    far = reference_table.dense_tables(65536)
    assert far.warning is not None and far.warning.extrapolated and far.warning.profiled == (1024, 8192, 16384)
    assert "above the profiled range 1024..16384: extrapolated linearly from contexts 8192 and 16384" in str(far.warning)
    longest, before = reference_table.dense_tables(16384)[1], reference_table.dense_tables(8192)[1]
    assert np.all(far[1] >= longest) and np.all(np.diff(far[1]) >= 0)
    line = longest + (longest - before) * (65536 - 16384) / (16384 - 8192)  # where the line stays above the longest
    np.testing.assert_allclose(far[1][line >= longest], np.maximum.accumulate(np.maximum(line, longest))[line >= longest])
    default = reference_table.dense_tables()
    want = build_cost_tables(*reference_table.pair().as_vllm(), reference_table.fingerprint.max_num_seqs,
                             reference_table.fingerprint.max_num_batched_tokens, reference_table.fingerprint.cudagraph_limit)
    for got, exp in zip(default, want):
        np.testing.assert_array_equal(got, exp)


# -- a serving step's pricing: verify at the context whose dummy batch read as much KV ------------
def test_step_tables_price_verify_by_the_kv_read(grid):
    costs = grid.costs
    reqs = costs.max_num_reqs
    rng = np.random.default_rng(4)
    for _ in range(200):
        n = int(rng.integers(1, reqs + 1))
        total = int(rng.integers(0, 40_000)) * n
        draft, verify = grid.step_tables(total, n)
        assert draft is grid.tables_for(-(-total // n))[0]  # drafts: the mean context's row
        for tokens in {n, min(reqs - 1, 3 * n), reqs, 2000, costs.max_num_batched_tokens}:
            if tokens < n:
                continue
            exact = costs.at(verify_context(total, tokens, reqs)).verify[tokens]
            assert abs(verify[tokens] / exact - 1) <= grid.max_rel_error + 1e-12, (n, total, tokens)
            floor = costs.at(total // profile_requests(tokens, reqs)).verify[tokens]
            assert verify[tokens] >= floor * (1 - 1e-12)  # S rounded up, never below (costs rise with context)
        if n == reqs:  # a full batch: one context for every size, a row of the grid itself
            assert verify is grid.tables_for(-(-total // reqs))[1]


def test_step_tables_reused_buffer_always_matches_price(grid):
    """Calls in any order (the verify buffer is refreshed only when its rows change) give what the
    vectorised price() gives for that step, at every size the engine can read."""
    rng = np.random.default_rng(9)
    sizes = np.arange(grid.costs.max_num_batched_tokens + 1)
    total, n = 5000, 10
    for _ in range(60):
        if rng.random() < 0.5:
            total += int(rng.integers(0, 3)) * n  # decode: S creeps up, rows mostly unchanged
        else:
            n, total = int(rng.integers(1, 300)), int(rng.integers(0, 6_000_000))
        n = min(n, grid.costs.max_num_reqs)
        draft, verify = grid.step_tables(total, n)
        want_d, want_v = grid.price(np.full(len(sizes), total), np.full(len(sizes), n), sizes)
        assert draft[n] == want_d[0]
        assert np.array_equal(verify[n:], want_v[n:])  # vLLM reads from N >= num_reqs only


def test_kv_rows_cover_every_sum_within_the_bound(grid):
    d = grid.describe()
    assert d["kv_points"] == len(grid.head_points) and grid.head.shape == (len(grid.head_points),
                                                                              grid.costs.max_num_reqs)
    assert grid.head_points[0] == 1  # from S = 1: below the range, verify is extrapolated too
    assert grid.head_points[-1] == grid.contexts[-1] * grid.costs.max_num_reqs
    steps = np.diff(grid.head_points)
    assert (steps >= 1).all() and (steps <= np.maximum(1, np.asarray(grid.head_points[:-1]) // 200)).all()
    assert grid.max_rel_error <= DEFAULT_TOLERANCE + 1e-9


def test_kv_rows_use_the_profiling_engines_max_num_seqs(reference_table):
    """R(N) caps at the max_num_seqs the table was profiled with, also when the engine's differs
    (validate of another engine's files): the KV rows are that wide, and step_tables agrees with
    price() for batches below, at and above it."""
    costs = ContextCosts.from_table(reference_table, max_num_reqs=300, max_num_batched_tokens=9000)
    assert costs.profile_num_reqs == 256 and costs.max_num_reqs == 300
    grid = ContextGrid(costs)
    assert grid.head.shape[1] == 256
    sizes = np.arange(9001)
    for n, total in ((100, 100 * 5000), (256, 256 * 3000), (280, 280 * 12000), (1, 70)):
        draft, verify = grid.step_tables(total, n)
        want_d, want_v = grid.price(np.full(len(sizes), total), np.full(len(sizes), n), sizes)
        assert draft[n] == want_d[0] and np.array_equal(verify[n:], want_v[n:]), n
        exact = costs.at(verify_context(total, max(n, 300), 256)).verify[max(n, 300)]
        assert abs(verify[max(n, 300)] / exact - 1) <= grid.max_rel_error + 1e-12


# -- above the longest profiled context: measured on the H200 -------------------------------------
LONG = REPO / "benchmarks" / "results" / "h200" / "2026-12-01-1557-long-context" / "h200-tp1-ctx4-long.parquet"


def test_above_the_longest_context_the_line_through_the_two_longest_holds_on_the_h200():
    """One engine start profiled 8192, 16384, 24576 and 32768 (dummy weights, H200): priced from
    8192 and 16384 alone, 24576 (the context the rule was chosen on) and 32768 (held out) are
    within 0.5 % median and 2.5 % at worst of their own profiles when the line is extended, where
    the longest context's costs (the rule before) are 20-40 % low."""
    from dspark_calib.table.file import read_table

    table = read_table(LONG)
    fp = table.fingerprint
    measured = ContextCosts(table.curves, fp.max_num_seqs, fp.max_num_batched_tokens, fp.cudagraph_limit)
    two = {c: table.curves[c] for c in (8192, 16384)}
    line = ContextCosts(two, fp.max_num_seqs, fp.max_num_batched_tokens, fp.cudagraph_limit, extrapolate_to=40960)
    flat = ContextCosts(two, fp.max_num_seqs, fp.max_num_batched_tokens, fp.cudagraph_limit)
    for ctx in (24576, 32768):
        for kind in (0, 1):  # drafts, verify
            true = measured.tables[ctx][kind][1:]
            err = np.abs(line.at(ctx).as_tuple()[kind][1:] / true - 1) * 100
            assert np.median(err) < 0.5 and err.max() < 2.5, (ctx, kind, np.median(err), err.max())
            low = (1 - flat.at(ctx).as_tuple()[kind][1:] / true) * 100
            assert np.median(low) > 19, (ctx, kind, np.median(low))


def test_two_longest_contexts_close_together_are_not_extended():
    """The line through 16000 and 16384 would stretch their noise 300-fold to 131072: costs stay
    the longest context's there, as below the range where the two shortest are too close."""
    from dspark_calib.table.file import read_table

    table = read_table(LONG)
    fp = table.fingerprint
    close = {16000: table.curves[8192], 16384: table.curves[16384]}
    costs = ContextCosts(close, fp.max_num_seqs, fp.max_num_batched_tokens, fp.cudagraph_limit, extrapolate_to=131072)
    assert not costs.extrapolates_above and costs.knots[-1] == 16384
    np.testing.assert_array_equal(costs.at(100000).verify, costs.tables[16384][1])


# -- the grid's row lookup -----------------------------------------------------------------------
def _per_token_rows(points: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    """The row of every integer context lo..hi as the grid looked it up before: a per-token index
    of the first point at or above it (clamped to the grid's ends)."""
    ctx = np.arange(lo, hi + 1)
    return np.searchsorted(np.asarray(points), np.clip(ctx, points[0], points[-1]), side="left")


def test_grid_rows_are_those_of_the_per_token_index_at_every_context(reference_table):
    """Bisecting the points prices every context exactly as the per-token index did: below the
    range, between contexts, and in the line above the longest up to extrapolate_to."""
    fp = reference_table.fingerprint
    costs = ContextCosts(reference_table.curves, fp.max_num_seqs, fp.max_num_batched_tokens, fp.cudagraph_limit,
                         extrapolate_to=40960)
    grid = ContextGrid(costs)
    assert costs.knots[0] == 0 and costs.knots[-1] == 40960
    lo, hi = -3, 40970
    want = _per_token_rows(grid.points, lo, hi)
    got = np.array([grid.index(c) for c in range(lo, hi + 1)])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(grid.indices(np.arange(lo, hi + 1)), want)
    for c in range(lo, hi + 1, 7):
        draft, verify = grid.tables_for(c)
        assert draft is grid.draft[want[c - lo]].base or np.shares_memory(draft, grid.draft[want[c - lo]])
        np.testing.assert_array_equal(draft, grid.draft[want[c - lo]])
        np.testing.assert_array_equal(verify, grid.verify[want[c - lo]])


def test_grid_memory_does_not_follow_the_longest_context(reference_table):
    """A context far above the profiled ones (the engine's max_model_len, or a forged table's)
    costs the grid no memory per token of the range: only its points."""
    import tracemalloc

    fp = reference_table.fingerprint

    def peak(far: int) -> int:
        costs = ContextCosts(reference_table.curves, fp.max_num_seqs, fp.max_num_batched_tokens,
                             fp.cudagraph_limit, extrapolate_to=far)
        tracemalloc.start()
        try:
            ContextGrid(costs)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    near, far = peak(40960), peak(1 << 24)
    assert far - near < 32 << 20, (near, far)  # a per-token index: 4 bytes a token, 64 MiB here

"""diff's library: per-size changes, significance, dense fallback, decision impact, threshold."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from dspark_calib.compare import (
    DENSE, MEDIAN, choose_contexts, compare_tables, p_values, threshold_exceeded, threshold_verdict,
)
from dspark_calib.fit import decision_map
from dspark_calib.inspection import CONFIDENCE_GRID
from dspark_calib.table.model import CostTable

from tests.helpers import build_reference_table, fixture_json


def _fixture(*ctxs: int) -> CostTable:
    return build_reference_table([fixture_json(c) for c in ctxs])


@pytest.fixture(scope="module")
def t1024(table_1024) -> CostTable:
    return table_1024


@pytest.fixture(scope="module")
def t16384(table_16384) -> CostTable:
    return table_16384


def _rebuild(table: CostTable, keep=lambda s: True, change=lambda s: s, **fp_changes) -> CostTable:
    """A new table from (a filtered, modified copy of) another's raw samples."""
    samples = [change(s) for s in table.iter_samples() if keep(s)]
    return CostTable.from_samples(samples, table.fingerprint.replace(**fp_changes))


def test_table_against_itself_changes_nothing(t1024):
    r = compare_tables(t1024, t1024)
    assert r.fingerprint_changes == []
    for cd in r.curves.values():
        assert all(p.rel_change == 0 and p.source == MEDIAN for p in cd.points)
        assert cd.summary.significant == 0 and cd.summary.max_abs_rel_change == 0
        assert cd.summary.untested == 0  # 5 replays per size: every point is testable
    assert r.decisions.changes == ()
    assert not threshold_exceeded(r, 0)


def test_context_1024_vs_16384(t1024, t16384):
    r = compare_tables(t1024, t16384)
    assert (r.old_context, r.new_context) == (1024, 16384)
    assert {c.key for c in r.fingerprint_changes} == {"context_lens", "extra.source"}
    src = next(c for c in r.fingerprint_changes if c.key == "extra.source")
    assert (src.old, src.new) == (["qwen3-8b_dspark-block7_ctx1024.json"], ["qwen3-8b_dspark-block7_ctx16384.json"])
    verify = r.curves["verify"]
    assert [p.size for p in verify.points] == t1024.pair().verify.size.tolist()
    # Longer context: every verify step costs more, and the medians are vLLM's own.
    old = dict(t1024.pair().verify.as_vllm())
    new = dict(t16384.pair().verify.as_vllm())
    for p in verify.points:
        assert p.old_ms == old[p.size] and p.new_ms == new[p.size]
        assert p.rel_change == pytest.approx(new[p.size] / old[p.size] - 1)
    assert verify.summary.significant_slower == verify.summary.significant > 40
    assert verify.summary.significant_faster == 0
    rel = [abs(p.rel_change) for p in verify.points]
    assert verify.summary.max_abs_rel_change == max(rel)
    assert verify.summary.median_abs_rel_change == pytest.approx(float(np.median(rel)))
    assert threshold_exceeded(r, 5)
    assert not threshold_exceeded(r, 1e6)
    assert r.decisions.changes  # the cost shift moves budgets
    json.dumps(r.to_dict(), allow_nan=False)


def test_draft_significance_uses_graph_replays_only(t1024):
    r = compare_tables(t1024, t1024)
    s = t1024.samples.to_frame()
    at_256 = s[s.num_reqs == 256]
    graph = int(at_256.full_cudagraph.sum())
    assert graph < len(at_256), "fixture should have eager steps at num_reqs 256"
    p = next(p for p in r.curves["draft"].points if p.size == 256)
    assert p.old_n == p.new_n == graph
    v = next(p for p in r.curves["verify"].points if p.size == 8192)
    assert v.old_n == int((s.num_target_tokens == 8192).sum())


def test_batched_p_values_match_one_scipy_call_each(t1024, t16384):
    from scipy.stats import mannwhitneyu

    rng = np.random.default_rng(0)
    pairs = [
        (rng.normal(5, 1, 5), rng.normal(6, 1, 5)),
        (rng.normal(5, 1, 5), rng.normal(5, 1, 5)),
        (np.array([1.0, 1.0, 2.0, 3.0, 4.0]), np.array([1.0, 2.0, 5.0, 6.0, 7.0])),  # ties: asymptotic
        (rng.normal(5, 1, 12), rng.normal(5.5, 1, 9)),  # large: asymptotic
        (rng.normal(5, 1, 3), rng.normal(9, 1, 4)),
        (rng.normal(5, 1, 2), rng.normal(5, 1, 5)),  # too few
        (None, rng.normal(5, 1, 5)),  # missing side
    ]
    got = p_values(pairs)
    for (a, b), p in zip(pairs, got):
        if a is None or len(a) < 3 or len(b) < 3:
            assert p is None
        else:
            assert p == pytest.approx(float(mannwhitneyu(a, b, alternative="two-sided").pvalue), rel=1e-12)


def test_few_samples_make_significance_unknown_and_never_trip_threshold(t1024):
    # Keep two replays per size and triple every cost: a huge change nobody can test.
    # (Sizes > 256 all run 256 requests: they would pool into a testable draft point.)
    few = _rebuild(t1024, keep=lambda s: s.replay < 2 and s.num_target_tokens <= 256,
                   change=lambda s: dataclasses.replace(s, forward_ms=s.forward_ms * 3, drafter_ms=s.drafter_ms * 3))
    r = compare_tables(t1024, few)
    for cd in r.curves.values():
        assert all(p.p_value is None for p in cd.points)
        assert cd.summary.untested == len(cd.points) and cd.summary.significant == 0
        assert cd.summary.max_abs_rel_change > 1.5
    assert not threshold_exceeded(r, 1)


def test_size_on_one_side_only_compares_dense_tables(t1024):
    new = _rebuild(t1024, keep=lambda s: s.num_target_tokens != 768)
    r = compare_tables(t1024, new)
    p = next(p for p in r.curves["verify"].points if p.size == 768)
    assert p.source == DENSE and p.p_value is None and p.new_n == 0 and p.old_n == 5
    old_dense, new_dense = t1024.dense_tables()[1], new.dense_tables()[1]
    assert p.old_ms == old_dense[768] and p.new_ms == new_dense[768]
    # Above the capture limit the new table interpolates 512..1024 where 768 was measured.
    assert p.new_ms != p.old_ms
    others = [q for q in r.curves["verify"].points if q.size != 768]
    assert all(q.source == MEDIAN and q.rel_change == 0 for q in others)


def test_sizes_beyond_the_common_range_are_reported_not_compared(t1024):
    small = _rebuild(t1024, keep=lambda s: s.num_target_tokens <= 4096, max_num_batched_tokens=4096)
    r = compare_tables(t1024, small)
    assert r.curves["verify"].uncovered_sizes == (8192,)
    assert 8192 not in [p.size for p in r.curves["verify"].points]


def test_decision_impact_matches_decision_maps(t1024, t16384):
    r = compare_tables(t1024, t16384)
    reqs = list(r.decisions.old.num_reqs)
    om = decision_map(*t1024.dense_tables(1024), reqs, CONFIDENCE_GRID, 7)
    nm = decision_map(*t16384.dense_tables(16384), reqs, CONFIDENCE_GRID, 7)
    expected = {(reqs[i], CONFIDENCE_GRID[j]) for i, j in zip(*np.nonzero(om != nm))}
    assert {(c.num_reqs, c.confidence) for c in r.decisions.changes} == expected
    for c in r.decisions.changes:
        i, j = reqs.index(c.num_reqs), CONFIDENCE_GRID.index(c.confidence)
        assert (c.old, c.new) == (om[i, j], nm[i, j])


def test_decision_grid_is_capped_per_table(t1024):
    capped = _rebuild(t1024, keep=lambda s: s.num_reqs <= 64, max_num_seqs=64)
    r = compare_tables(t1024, capped)
    assert r.decisions.old.num_reqs[-1] == 256  # union of both grids
    unpriced = {c.num_reqs for c in r.decisions.changes if c.new is None}
    assert unpriced == {128, 256}
    assert all(c.old is not None for c in r.decisions.changes)
    json.dumps(r.to_dict(), allow_nan=False)


def test_context_choice():
    multi = _fixture(1024, 8192, 16384)
    single = _fixture(16384)
    assert choose_contexts(multi, multi) == (8192, 8192)  # shared, nearest to 8192
    assert choose_contexts(multi, single) == (16384, 16384)  # the shared one
    assert choose_contexts(multi, single, old_context=1000) == (1024, 16384)
    r = compare_tables(multi, single, old_context=2000)
    assert r.old_context == 1024
    assert any("2000" in n for n in r.notes)
    assert r.curves["verify"].summary.significant_slower > 0


def test_threshold_counts_only_significant_points(t1024):
    r = compare_tables(t1024, t1024)
    sig = dataclasses.replace(r.curves["verify"].points[0], new_ms=r.curves["verify"].points[0].old_ms * 1.2,
                              p_value=0.001)
    insig = dataclasses.replace(sig, p_value=0.2)
    for point, expect in ((sig, True), (insig, False)):
        r.curves["verify"] = dataclasses.replace(r.curves["verify"], points=(point,))
        assert threshold_exceeded(r, 10) is expect
        assert threshold_exceeded(r, 25) is False
    assert math.isclose(sig.rel_change, 0.2)


def test_decision_cells_count_only_what_a_table_can_price(t1024):
    # max_num_batched_tokens 512: with 7 drafts a step of R requests needs 8R tokens, so neither
    # table can price R = 128 or 256 (2 rows x 9 confidences). Those 18 cells are no decision.
    small = _rebuild(t1024, keep=lambda s: s.num_target_tokens <= 512, max_num_batched_tokens=512)
    r = compare_tables(small, small)
    priced = int(np.isfinite(r.decisions.old.budget_per_req).sum())
    assert priced == 63 and r.decisions.cells == 63
    assert r.decisions.to_dict()["cells"] == 63


def test_threshold_counts_a_significant_speed_up(t1024):
    # Every cost 20% lower: a faster engine is as much a different engine as a slower one.
    faster = _rebuild(t1024, change=lambda s: dataclasses.replace(s, forward_ms=s.forward_ms * 0.8,
                                                                    drafter_ms=s.drafter_ms * 0.8))
    r = compare_tables(t1024, faster)
    v = threshold_verdict(r, 10)
    assert v.exceeded and all(p.rel_change < -0.1 and p.significant for _, p in v.over)
    assert threshold_exceeded(r, 10) and not threshold_exceeded(r, 25)
    slower = compare_tables(faster, t1024)  # and the other direction, for symmetry
    assert threshold_exceeded(slower, 10)


def test_without_significance_nothing_is_tested_and_scipy_is_not_needed(t1024, t16384):
    r = compare_tables(t1024, t16384, significance=False)
    assert not r.significance_tested and r.to_dict()["significance_tested"] is False
    for cd in r.curves.values():
        assert all(p.p_value is None for p in cd.points)
        assert cd.summary.significant == 0 and cd.summary.untested == len(cd.points)
    tested = compare_tables(t1024, t16384)
    # The same points, costs and sample counts either way: only the tests differ.
    for kind in r.curves:
        assert [(p.size, p.old_ms, p.new_ms, p.old_n, p.new_n) for p in r.curves[kind].points] == \
               [(p.size, p.old_ms, p.new_ms, p.old_n, p.new_n) for p in tested.curves[kind].points]
    assert not threshold_exceeded(r, 0)


def test_decision_impact_leaves_out_cells_neither_table_can_price(reference_table_8192):
    """A table against itself with a small token budget: the batches it cannot price (NaN on both
    sides) are no decision at all, neither changed nor counted among the cells."""
    from dspark_calib.compare import compare_decisions

    small = dataclasses.replace(reference_table_8192,
                                fingerprint=reference_table_8192.fingerprint.replace(max_num_batched_tokens=64, max_num_seqs=64))
    impact = compare_decisions(small, small, 8192, 8192)
    unpriced = np.isnan(impact.old.budget_per_req)
    assert unpriced.any() and not unpriced.all()  # rows of 16+ requests x 8 tokens exceed 64 tokens
    assert impact.changes == () and impact.cells == int((~unpriced).sum())

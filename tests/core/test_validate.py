"""validate on synthetic observed files made from the real H200 curves plus noise."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from dspark_calib.pricing.costs import ContextCosts
from dspark_calib.pricing.grid import ContextGrid
from dspark_calib.pricing.rules import verify_context
from dspark_calib.errors import CalibError
from dspark_calib.observe.step import ObservedStep, ObserveMeta
from dspark_calib.observe.file import OBSERVED_SCHEMA_VERSION, ObservedSteps, ObservedWriter, read_observed
from dspark_calib.render.validation import plot_validation, render_validation
from dspark_calib.validate import (AWARE, SINGLE, max_error_exceeded, pow2_bucket, recorded_chunks, recorded_tail,
                                   validate)
from dspark_calib.pricing.policy import CONTEXT_AWARE, DEFAULT_CONTEXT_CHUNKS, DEFAULT_CONTEXT_TAIL_MILLI, TAIL_RULE

ENGINE = {"mode": CONTEXT_AWARE, "context_tail_rule": TAIL_RULE}  # what every context-aware engine records
NOISE = 0.002  # 0.2 % multiplicative noise: the repeat spread of an H200 profile


def synthetic_steps(table, contexts, *, per_context=300, seed=0, spread=0, prefill_every=0):
    """Decode steps measured as the profile says a batch reading their KV costs (plus noise):
    drafts at the mean context, verify at N tokens at verify_context(S, N); the two pricings'
    budgets differ in every third step (step 0, 3, ...). prefill_every=k: every k-th step also
    carries a prefill chunk (its verify cost: the table's plus 30 %)."""
    rng = np.random.default_rng(seed)
    costs = ContextCosts.from_table(table)
    grid = ContextGrid(costs)
    out, i = [], 0
    for ctx in contexts:
        for _ in range(per_context):
            reqs = int(rng.integers(1, 257))
            budget = int(rng.integers(0, 7 * reqs + 1))
            prefill = int(rng.integers(16, 4096)) if prefill_every and i % prefill_every == 0 else 0
            tokens = reqs + budget + prefill
            ctxs = np.full(reqs, ctx) + (rng.integers(0, spread + 1, reqs) if spread else 0)
            total = int(ctxs.sum())
            (gd,), (gv,) = grid.price([total], [reqs], [tokens])
            verify = costs.at(verify_context(total, tokens, costs.max_num_reqs)).verify[tokens]
            draft = costs.at(-(-total // reqs)).draft[reqs]
            out.append(ObservedStep(
                step=i, forward_ms=float(verify * (1.3 if prefill else 1.0) * (1 + rng.normal(0, NOISE))),
                drafter_ms=float(draft * (1 + rng.normal(0, NOISE))), num_target_tokens=tokens,
                num_reqs=reqs, full_cudagraph=tokens <= 512, context_mean=total / reqs, context_max=int(ctxs.max()),
                context_sum=total, scheduled_drafts=7 * reqs, draft_budget=budget, priced_context=ctx,
                predicted_draft_ms=float(gd), predicted_verify_ms=float(gv),
                budget_static=budget if i % 3 else (budget + 1 if budget < 7 * reqs else budget - 1),
                budget_context_aware=budget))
            i += 1
    return out


@pytest.fixture(scope="module")
def observed_dir(tmp_path_factory, reference_table):
    d = tmp_path_factory.mktemp("observed")
    with ObservedWriter(d, rows_per_file=250, metadata={"mode": "context_aware"}) as w:
        for s in synthetic_steps(reference_table, (1024, 8192, 16384), prefill_every=10):
            w.append(s)
    return d


@pytest.fixture(scope="module")
def result(observed_dir, reference_table):
    return validate(reference_table, read_observed([observed_dir]))


def _by_context(result, kind, bucket):
    (g,) = [g for g in result.by_context if g.kind == kind and g.context_bucket == bucket]
    return g.errors


def test_context_aware_is_right_at_every_profiled_context(result):
    assert result.num_steps == 900 and len(result.files) == 4 and result.out_of_range_steps == 0
    assert result.single_context == 8192
    for kind in ("draft", "verify"):
        for bucket in ("1024-2047", "8192-16383", "16384-32767"):
            e = _by_context(result, kind, bucket)[AWARE]
            assert e.n > 0 and e.median_pct < 0.5 and e.p90_pct < 1.0, (kind, bucket, e)
    assert not max_error_exceeded(result, 2.0)


def test_single_context_pricing_is_far_off_away_from_its_context(result):
    at_8k = _by_context(result, "draft", "8192-16383")
    assert at_8k[SINGLE].median_pct == pytest.approx(at_8k[AWARE].median_pct)  # same tables there
    short, long = _by_context(result, "verify", "1024-2047"), _by_context(result, "verify", "16384-32767")
    assert short[SINGLE].median_pct > 20 and short[SINGLE].median_signed_pct > 0  # 8k prices 1k steps too high
    assert long[SINGLE].median_pct > 5
    # at 8k the verify of a step with more tokens than requests reads less KV than 8k's profile did
    assert _by_context(result, "verify", "8192-16383")[SINGLE].median_signed_pct > 5
    assert max_error_exceeded(result, 2.0, pricing=SINGLE)
    assert not max_error_exceeded(result, 1000.0, pricing=SINGLE)


def test_prefill_steps_are_reported_apart_and_not_judged(result):
    (pre,) = [g for g in result.overall if g.kind == "verify_prefill"]
    assert pre.errors[AWARE].n == 90 and pre.errors[AWARE].median_signed_pct < -20  # measured 30 % above
    assert not max_error_exceeded(result, 2.0)


def test_between_profiled_contexts_the_grid_predicts_the_interpolation(reference_table, tmp_path):
    """Steps at 4000 and 12000 measured as the interpolation says: context-aware stays within the
    grid's 0.5 % bound plus noise, single-context does not."""
    with ObservedWriter(tmp_path) as w:
        for s in synthetic_steps(reference_table, (4000, 12000), per_context=200, seed=2, spread=40):
            w.append(s)
    res = validate(reference_table, read_observed([tmp_path]))
    for g in res.by_context:
        assert g.errors[AWARE].median_pct < 0.8
    assert any(g.errors[SINGLE].median_pct > 10 for g in res.by_context if g.kind == "verify")


def test_groups_and_budget_change(result):
    assert result.budget_change.compared == 900 and result.budget_change.changed == 300
    assert {g.kind for g in result.groups} == {"draft", "verify", "verify_prefill"}
    assert sum(g.errors[AWARE].n for g in result.groups if g.kind.startswith("verify")) == 900
    graph_steps = sum(g.errors[AWARE].n for g in result.overall if g.kind == "draft")
    assert 0 < graph_steps < 900  # drafts priced from full-graph steps only


def test_single_context_can_be_chosen(observed_dir, reference_table):
    res = validate(reference_table, read_observed([observed_dir]), single_context=1000)
    assert res.single_context == 1024
    assert _by_context(res, "draft", "1024-2047")[SINGLE].median_pct < 0.5


def test_to_dict_is_json_and_rendering_draws(result, tmp_path):
    d = json.loads(json.dumps(result.to_dict()))
    assert d["budget_change"]["share"] == pytest.approx(300 / 900)
    assert d["by_context"][0]["context_aware"]["median_pct"] >= 0
    console = Console(record=True, width=200)
    render_validation(result, console, max_error=2.0)
    text = console.export_text()
    assert "context-aware median" in text and "16384-32767" in text and "300 of 900" in text
    png = plot_validation(result, tmp_path / "v.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_empty_and_bad_pricing_are_calib_errors(result, reference_table, observed_dir):
    with pytest.raises(CalibError):
        max_error_exceeded(result, 2.0, pricing="nope")
    steps = read_observed([observed_dir])
    empty = type(steps)({k: v[:0] for k, v in steps.columns.items()}, steps.files, steps.metadata)
    with pytest.raises(CalibError):
        validate(reference_table, empty)


def test_pow2_bucket():
    assert pow2_bucket(np.array([1, 2, 3, 4, 1023, 1024, 2**40])).tolist() == [1, 2, 2, 4, 512, 1024, 2**40]
    assert pow2_bucket(np.array([0, 500, 1024, 1500]), floor=1024).tolist() == [0, 0, 1024, 1024]


def test_validate_imports_no_torch_or_vllm(observed_dir, table_file):
    code = ("import sys\nfrom dspark_calib.table.file import read_table\nfrom dspark_calib.observe.file import read_observed\n"
            "from dspark_calib.validate import validate\nfrom dspark_calib.render.validation import render_validation\n"
            f"r = validate(read_table({str(table_file)!r}), read_observed([{str(observed_dir)!r}]))\n"
            "assert r.num_steps == 900\n"
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_steps_measured_exactly_as_the_grid_predicts_have_zero_error(reference_table, tmp_path):
    """No noise, contexts anywhere (inside and outside the profiled range): context-aware pricing is
    the engine's own prediction, so its error is exactly 0; single-context's is not."""
    grid = ContextGrid.from_table(reference_table)
    rng = np.random.default_rng(11)
    with ObservedWriter(tmp_path) as w:
        for i in range(300):
            reqs = int(rng.integers(1, 257))
            tokens = reqs + int(rng.integers(0, 7 * reqs + 1)) if i % 2 else int(rng.integers(reqs, 8193))
            ctxs = rng.integers(0, 20000, reqs)
            total = int(ctxs.sum())
            (gd,), (gv,) = grid.price([total], [reqs], [tokens])
            w.append(ObservedStep(step=i, forward_ms=float(gv), drafter_ms=float(gd),
                                  num_target_tokens=tokens, num_reqs=reqs, full_cudagraph=True,
                                  context_mean=total / reqs, context_max=int(ctxs.max()), context_sum=total,
                                  scheduled_drafts=7 * reqs, draft_budget=min(7 * reqs, tokens - reqs),
                                  priced_context=0, predicted_draft_ms=1.0,
                                  predicted_verify_ms=1.0))
    # priced at the plain mean (tail 0) as written; files without a context-aware engine would
    # otherwise get the plugin's default tail (test_stock_files_are_priced_with_the_plugins_defaults)
    res = validate(reference_table, read_observed([tmp_path]), tail_milli=0, chunks=False)
    assert res.budget_change.compared == 0 and res.budget_change.share is None
    assert {g.kind for g in res.overall} == {"draft", "verify", "verify_prefill"}
    for g in res.groups + res.by_context + res.overall:
        assert g.errors[AWARE].n > 0 and g.errors[AWARE].median_pct == 0.0 and g.errors[AWARE].p90_pct == 0.0
    assert [g for g in res.overall if g.kind == "verify"][0].errors[SINGLE].median_pct > 5


def test_engine_sizes_recorded_in_the_files_size_the_tables(reference_table, tmp_path):
    meta = {"max_num_reqs": 300, "max_num_batched_tokens": 9000}
    with ObservedWriter(tmp_path, metadata=meta) as w:
        for s in synthetic_steps(reference_table, (8192,), per_context=5):
            w.append(s)
    res = validate(reference_table, read_observed([tmp_path]))
    want = ContextGrid.from_table(reference_table, max_num_reqs=300, max_num_batched_tokens=9000)
    assert res.grid["bytes"] == want.nbytes and res.grid["points"] == len(want)


def test_the_contexts_an_engine_priced_are_the_ones_validate_prices_with(reference_table, tmp_path):
    """An engine whose probe left 1024 out of its grid records the contexts it priced; validate
    builds its grid from those, as the engine did (a grid over all three prices otherwise)."""
    meta = {**ENGINE, "context_tail_milli": 0, "context_chunks": False, "context_priced": [8192, 16384]}
    with ObservedWriter(tmp_path / "two", metadata=meta) as w:
        for s in synthetic_steps(reference_table, (8192,), per_context=5):
            w.append(s)
    res = validate(reference_table, read_observed([tmp_path / "two"]))
    assert tuple(res.grid["contexts"]) == (8192, 16384)
    with ObservedWriter(tmp_path / "other", metadata={**meta, "context_priced": [8192, 32768]}) as w:
        w.append(synthetic_steps(reference_table, (8192,), per_context=1)[0])
    with pytest.raises(CalibError, match="not all in this table"):
        validate(reference_table, read_observed([tmp_path / "other"]))


def test_verify_context_uses_the_tables_own_max_num_seqs_and_counts_out_of_range(reference_table, tmp_path):
    """Files from an engine with another max_num_seqs: R(N) stays the profiling engine's (the
    table's); decode steps verifying below the shortest profiled context are counted."""
    meta = {"max_num_reqs": 300, "max_num_batched_tokens": 9000}
    with ObservedWriter(tmp_path, metadata=meta) as w:
        for i, (reqs, ctx) in enumerate([(4, 1100), (4, 1100), (200, 16000)]):
            tokens = reqs * 8  # 7 drafts each: verify context ctx x reqs / min(tokens, 256)
            w.append(ObservedStep(step=i, forward_ms=10.0, drafter_ms=1.0, num_target_tokens=tokens, num_reqs=reqs,
                                  full_cudagraph=True, context_mean=float(ctx), context_max=ctx,
                                  context_sum=ctx * reqs, scheduled_drafts=7 * reqs, draft_budget=7 * reqs,
                                  priced_context=ctx, predicted_draft_ms=1.0, predicted_verify_ms=10.0))
    res = validate(reference_table, read_observed([tmp_path]))
    assert res.verify_out_of_range_steps == 2 and res.out_of_range_steps == 0  # 1100 x 4 / 32 = 138 < 1024
    assert ContextCosts.from_table(reference_table, max_num_reqs=300, max_num_batched_tokens=9000).profile_num_reqs \
        == reference_table.fingerprint.max_num_seqs
    costs = ContextCosts.from_table(reference_table, max_num_reqs=300, max_num_batched_tokens=9000)
    r256, r300 = (costs.at(verify_context(16000 * 200, 1600, r)).verify[1600] for r in (256, 300))
    (g,) = [g for g in res.by_context if g.kind == "verify" and g.context_bucket == "8192-16383"]
    signed = g.errors[AWARE].median_signed_pct  # the one step there, measured 10 ms
    assert abs(signed - (r256 / 10 - 1) * 100) <= 0.6 * r256 / 10  # R = 256: 12500 of context, not 10667
    assert abs(signed - (r300 / 10 - 1) * 100) > 0.6 * r256 / 10


def mixed_steps(table, tail_milli, n, *, seed=5):
    """Decode steps of batches mixing 1k and 16k requests, measured exactly as pricing at the raised
    sum tail_context_sum(S, max, n, tail_milli) predicts (what a kernel tail would do)."""
    from dspark_calib.pricing.rules import tail_context_sum

    grid = ContextGrid.from_table(table)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        reqs = int(rng.integers(4, 65))
        ctxs = rng.choice([1024, 16384], reqs)
        ctxs[0] = 16384  # every batch mixed: its longest is >= 1.25 x its mean unless all are long
        ctxs[-1] = 1024
        tokens = reqs + int(rng.integers(0, 4 * reqs + 1))
        total = int(ctxs.sum())
        (d,), (v,) = grid.price([tail_context_sum(total, int(ctxs.max()), reqs, tail_milli)], [reqs], [tokens])
        out.append(ObservedStep(step=i, forward_ms=float(v), drafter_ms=float(d), num_target_tokens=tokens,
                                num_reqs=reqs, full_cudagraph=True, context_mean=total / reqs,
                                context_max=int(ctxs.max()), context_sum=total, scheduled_drafts=7 * reqs,
                                draft_budget=tokens - reqs, priced_context=0, predicted_draft_ms=1.0,
                                predicted_verify_ms=1.0))
    return out


def test_stock_files_are_priced_with_the_plugins_defaults_and_old_aware_files_as_they_were(reference_table, tmp_path):
    """Context-aware pricing of a stock engine's steps is what this release's context-aware mode
    would do (its defaults); a context-aware engine's file without the keys predates them, and
    such engines priced at tail 0 and chunks by the KV sum."""
    def write(name, **meta):
        with ObservedWriter(tmp_path / name, metadata=meta) as w:
            for s in mixed_steps(reference_table, 40, 20):
                w.append(s)
        return read_observed([tmp_path / name])

    for files in (write("stock", mode="stock"), write("none")):
        assert (recorded_tail(files), recorded_chunks(files)) == (DEFAULT_CONTEXT_TAIL_MILLI, DEFAULT_CONTEXT_CHUNKS)
        assert validate(reference_table, files).tail_fit.tail == DEFAULT_CONTEXT_TAIL_MILLI / 1000
    old = write("old", **ENGINE)
    assert (recorded_tail(old), recorded_chunks(old)) == (0, False)
    assert validate(reference_table, old).tail_fit.tail == 0
    assert (DEFAULT_CONTEXT_TAIL_MILLI, DEFAULT_CONTEXT_CHUNKS) == (200, True)


def test_tail_fit_recovers_the_tail_of_mixed_batches(reference_table, tmp_path):
    with ObservedWriter(tmp_path) as w:
        for s in mixed_steps(reference_table, 300, 60):
            w.append(s)
    observed = read_observed([tmp_path])
    plain = validate(reference_table, observed, tail_milli=0)
    fit = plain.tail_fit
    assert fit.steps == 60 and fit.tail == 0 and fit.verify.median_pct > 3 and fit.verify.median_signed_pct < 0
    assert fit.best_tail == 0.3 and fit.best_verify.median_pct == 0.0 and fit.best_draft.median_pct == 0.0
    raised = validate(reference_table, observed, tail_milli=300)  # context-aware pricing itself uses it
    verify = [g for g in raised.overall if g.kind == "verify"][0].errors[AWARE]
    assert verify.median_pct == 0.0 and raised.tail_fit.tail == 0.3
    json.dumps(raised.to_dict())
    with pytest.raises(CalibError, match="tail"):
        validate(reference_table, observed, tail_milli=1200)


def test_the_tail_is_fitted_on_mixes_up_to_twice_the_mean_not_on_one_long_request_among_short_ones(
        reference_table, tmp_path):
    """Mixes measured as tail 0.3 prices them, beside one-long-among-63-short batches that ran 7 %
    above their KV sum (as on the H200): the skewed steps would pull the fit to another t, so the
    fit rests on the mixes alone (and says how many)."""
    grid = ContextGrid.from_table(reference_table)
    mixes = [s for s in mixed_steps(reference_table, 300, 200) if s.context_max * s.num_reqs <= 2 * s.context_sum]
    skewed = []
    for i in range(40):
        ctxs = np.array([30000 + 4 * i] + [1024 + 4 * i] * 63)
        total, tokens = int(ctxs.sum()), 64 + i
        (d,), (v,) = grid.price([total * 107 // 100], [64], [tokens])
        skewed.append(dataclasses.replace(mixes[0], step=1000 + i, forward_ms=float(v), drafter_ms=float(d),
                                          num_target_tokens=tokens, num_reqs=64, context_mean=total / 64,
                                          context_max=int(ctxs.max()), context_sum=total, draft_budget=tokens - 64))
    with ObservedWriter(tmp_path) as w:
        for s in mixes[:30] + skewed:
            w.append(s)
    fit = validate(reference_table, read_observed([tmp_path]), tail_milli=0).tail_fit
    assert (fit.steps, fit.fitted) == (70, 30)
    assert fit.best_tail == 0.3 and fit.best_verify.median_pct == 0.0


def test_tail_recorded_by_the_engine_is_used_and_few_mixed_steps_fit_nothing(reference_table, tmp_path):
    with ObservedWriter(tmp_path, metadata={**ENGINE, "context_tail_milli": 300}) as w:
        for s in mixed_steps(reference_table, 300, 12) + synthetic_steps(reference_table, (8192,), per_context=30):
            w.append(s)
    res = validate(reference_table, read_observed([tmp_path]))
    assert res.tail_fit.tail == 0.3 and res.tail_fit.steps == 12  # uniform batches are not "mixed"
    assert res.tail_fit.verify.median_pct == 0.0 and res.tail_fit.best_tail is None
    console = Console(record=True, width=200)
    render_validation(res, console)
    text = console.export_text()
    assert "mixed-context decode steps (longest >= 1.25 x mean): 12" in text and "too few up to 2 x mean to fit a tail" in text


def test_files_from_engines_with_different_tails_are_refused_and_stock_files_record_none(reference_table, tmp_path):
    def write(d, meta):
        with ObservedWriter(tmp_path / d, metadata=meta) as w:
            for s in mixed_steps(reference_table, 200, 5):
                w.append(s)
        return tmp_path / d

    a = write("a", {**ENGINE, "context_tail_milli": 200})
    b = write("b", {**ENGINE, "context_tail_milli": 0})
    stock = write("stock", {"mode": "stock", "context_tail_milli": 0})
    with pytest.raises(CalibError, match=r"different tails \(0 in .*/b/observed-\S+, 0.2 in .*/a/observed-"):
        validate(reference_table, read_observed([a, b]))  # each tail named with a file that records it
    assert validate(reference_table, read_observed([a, b]), tail_milli=200).tail_fit.tail == 0.2  # --tail: one pricing
    assert validate(reference_table, read_observed([a, stock])).tail_fit.tail == 0.2  # stock prices no tail
    bad = write("bad", {**ENGINE, "context_tail_milli": 5000})
    with pytest.raises(CalibError, match="context_tail_milli=5000"):
        validate(reference_table, read_observed([bad]))


def test_tail_context_sum_by_hand():
    from dspark_calib.pricing.rules import tail_context_sum

    # 1000, 8000, 8000: S 17000, gap G = n max - S 7000 <= S: S + t G (t 0.25 -> 18750)
    assert tail_context_sum(17000, 8000, 3, 250) == 18750 and tail_context_sum(17000, 8000, 3, 0) == 17000
    # 1000, 1000, 16000: S 18000, G 30000 > S (max > 2 x mean): S + t S^2 / G = 18000 + t 10800
    assert tail_context_sum(18000, 16000, 3, 250) == 20700 and tail_context_sum(18000, 16000, 3, 1000) == 28800
    assert tail_context_sum(10, 4, 3, 333) == 10  # rounds down
    big = np.array([2**31 - 1], dtype=np.int64)  # int32's limit as a max over 256 requests: no overflow
    assert tail_context_sum(big * 200, big, 256, 1000)[0] == (2**31 - 1) * 256
    huge = 1 << 40  # S^2 past int64 (the largest contexts and batches a file may record): exact, as in Python
    assert tail_context_sum(np.array([huge]), np.array([huge]), 1 << 16, 1000)[0] == tail_context_sum(
        huge, huge, 1 << 16, 1000) == huge + huge * huge // ((1 << 56) - huge)


def test_a_long_request_among_many_short_ones_is_priced_about_at_its_kv_sum():
    """One 30000-token request beside 63 of 1024 (the served skewed workload): the tail charges t of
    mean^2 / gap, not t of the gap (which priced it at 4.9x the KV it reads)."""
    from dspark_calib.pricing.rules import tail_context_sum

    contexts = [30000] + [1024] * 63
    s = sum(contexts)
    raised = tail_context_sum(s, max(contexts), len(contexts), DEFAULT_CONTEXT_TAIL_MILLI)
    assert s < raised <= 1.02 * s
    assert tail_context_sum(np.array([s]), np.array([30000]), 64, DEFAULT_CONTEXT_TAIL_MILLI)[0] == raised


def test_the_linear_rule_charges_the_whole_gap_as_engines_before_the_bound_did():
    """TAIL_RULE_LINEAR: S + t G at every gap, scalars and arrays alike (exact past int64); up to
    twice the mean both rules agree. An unknown rule in the arrays' path is one line."""
    from dspark_calib.pricing.policy import TAIL_RULE_LINEAR
    from dspark_calib.pricing.rules import tail_context_sum

    # 1000, 1000, 16000: S 18000, G 30000 > S: linear 18000 + 0.25 x 30000, bounded 18000 + 0.25 x 10800
    assert tail_context_sum(18000, 16000, 3, 250, TAIL_RULE_LINEAR) == 25500
    assert tail_context_sum(18000, 16000, 3, 250, TAIL_RULE) == tail_context_sum(18000, 16000, 3, 250) == 20700
    assert tail_context_sum(np.array([18000, 17000]), np.array([16000, 8000]), 3, 250, TAIL_RULE_LINEAR).tolist() \
        == [25500, 18750]  # 1000, 8000, 8000: G <= S, the two rules agree
    assert tail_context_sum(17000, 8000, 3, 250, TAIL_RULE_LINEAR) == tail_context_sum(17000, 8000, 3, 250) == 18750
    with pytest.raises(CalibError, match="unknown tail rule 'square' \\(known: bounded, linear\\)"):
        tail_context_sum(np.array([18000]), np.array([16000]), 3, 250, "square")


SKEWED = "benchmarks/results/h200/2026-12-01-2043-skewed/aware-tail20-chunks/observed-dp0-2496-e0-000000.parquet"
SHIPPED = "profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"


def test_a_file_from_before_the_bound_is_priced_by_the_linear_rule_its_engine_priced_with():
    """The committed skewed arm (one 30000-token request beside 63 of 1024, tail 0.2, observe schema
    1.2: before the tail rule was recorded) read by its engine's rule: validate's context-aware
    pricing is the engine's own prediction on every step, and its mixed verifies are +106 % off
    (summary.md's "tail 0.2 before"). Priced by the bounded rule (--tail 0.2) they read 6.64 %."""
    import pathlib

    from dspark_calib.table.file import read_table

    repo = pathlib.Path(__file__).resolve().parents[2]
    observed = read_observed([repo / SKEWED])
    assert observed.metadata[0].raw["schema_version"] == OBSERVED_SCHEMA_VERSION  # migrated
    assert observed.metadata[0].policy().tail_rule == "linear"
    table = read_table(repo / SHIPPED)
    res = validate(table, observed)
    assert (res.tail_fit.tail, res.tail_fit.tail_rule, res.tail_fit.steps) == (0.2, "linear", 29)
    assert round(res.tail_fit.verify.median_pct, 2) == 106.28
    assert (res.engine.compared, res.engine.verify_equal, res.engine.draft_equal) == (47, 47, 47)
    console = Console(record=True, width=400)
    render_validation(res, console)
    assert "at tail 0.2 by the linear rule the files record (this release's: bounded)" in console.export_text()
    bounded = validate(table, observed, tail_milli=200)  # --tail: this release's rule
    assert bounded.tail_fit.tail_rule == TAIL_RULE and round(bounded.tail_fit.verify.median_pct, 2) == 6.64


def test_files_priced_by_different_tail_rules_are_refused_unless_no_tail_was_charged(reference_table, tmp_path):
    def write(d, **meta):
        with ObservedWriter(tmp_path / d, metadata={**ENGINE, **meta}) as w:
            for s in mixed_steps(reference_table, 200, 5):
                w.append(s)
        return tmp_path / d

    linear = write("linear", context_tail_milli=200, context_tail_rule="linear")
    bounded = write("bounded", context_tail_milli=200)
    with pytest.raises(CalibError, match=r"different tail rules \(bounded in .*, linear in .*\): validate them apart"):
        validate(reference_table, read_observed([linear, bounded]))
    untailed = write("untailed", context_tail_milli=0)  # a tail of 0 charges no gap: its rule is no matter
    assert validate(reference_table, read_observed([linear, untailed]), tail_milli=200).tail_fit.tail_rule == TAIL_RULE
    assert validate(reference_table, read_observed([untailed])).tail_fit.tail_rule == TAIL_RULE


def test_mixes_up_to_twice_their_mean_are_priced_as_before_and_no_tail_passes_t_of_the_sum():
    """The tail was fitted on 1k/8k/16k mixes, whose longest request is at most ~2x the mean: those
    keep S + t (n max - S), integer for integer; every batch stays within S..S + t S."""
    from dspark_calib.pricing.rules import tail_context_sum

    rng = np.random.default_rng(21)
    for _ in range(2000):
        contexts = rng.choice([1024, 8192, 16384, 30000], int(rng.integers(1, 257)))
        if rng.random() < 0.3:
            contexts[1:] = rng.integers(0, 2048, len(contexts) - 1)
        s, top, n, t = int(contexts.sum()), int(contexts.max()), len(contexts), int(rng.integers(0, 1001))
        raised = tail_context_sum(s, top, n, t)
        assert s <= raised <= s + t * s // 1000
        if top * n - s <= s:  # max <= 2 x mean
            assert raised == s + t * (top * n - s) // 1000
        assert tail_context_sum(np.array([s]), np.array([top]), np.array([n]), t)[0] == raised


def chunk_steps(table, n, *, seed=7, per_step=False):
    """Steps of decode requests at 8k plus one prefill chunk of q tokens at context c, measured as
    the profile's largest step would cost for as many query-context pairs: at KV sum
    S_decode + ceil(R q (c + q) / N_max) (context.CHUNK_RULE); per_step: as the first rule priced,
    ceil(R(M) q (c + q) / M), M the step's non-draft tokens. Written out here, not through
    context.prefill_context_sum."""
    grid = ContextGrid.from_table(table)
    reqs_profiled, n_max = grid.costs.profile_num_reqs, grid.costs.profile_num_tokens
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        decode = int(rng.integers(8, 64))
        q, c = int(rng.integers(512, 4096)), int(rng.choice([0, 4096, 8192]))
        tokens = decode * 4 + q
        ctxs = np.full(decode, 8192)
        s_decode = int(ctxs.sum())
        non_draft = decode + q  # 3 drafts verified per decode request
        r, per = (min(non_draft, reqs_profiled), non_draft) if per_step else (min(n_max, reqs_profiled), n_max)
        kv = s_decode + -(-(r * q * (c + q)) // per)
        (_,), (v,) = grid.price([kv], [decode + 1], [tokens])
        total = s_decode + c
        out.append(ObservedStep(step=i, forward_ms=float(v), drafter_ms=1.0, num_target_tokens=tokens,
                                num_reqs=decode + 1, full_cudagraph=False, context_mean=total / (decode + 1),
                                context_max=max(8192, c), context_sum=total, scheduled_drafts=7 * decode,
                                draft_budget=3 * decode, priced_context=0, predicted_draft_ms=1.0,
                                predicted_verify_ms=1.0, prefill_tokens=q, prefill_context_sum=c,
                                prefill_pairs=q * (c + q)))
    return out


def test_prefill_chunks_priced_by_query_context_pairs(reference_table, tmp_path):
    rows = chunk_steps(reference_table, 40)
    with ObservedWriter(tmp_path / "new") as w:
        for s in rows:
            w.append(s)
    pre = validate(reference_table, read_observed([tmp_path / "new"]), tail_milli=0).prefill  # written at tail 0
    assert (pre.steps, pre.recorded) == (40, 40)
    assert pre.pairs.median_pct == 0.0 and pre.pairs.p90_pct == 0.0
    assert pre.kv_sum.median_pct > 10 and pre.kv_sum.median_signed_pct < 0  # the KV sum prices chunks nearly free
    assert pre.single.n == 40
    # the same steps from an engine before observe schema 1.1: counted, not re-priced
    with ObservedWriter(tmp_path / "old") as w:
        for s in rows:
            w.append(dataclasses.replace(s, prefill_tokens=None, prefill_context_sum=None, prefill_pairs=None))
    old = validate(reference_table, read_observed([tmp_path / "old"]))
    assert (old.prefill.steps, old.prefill.recorded, old.prefill.pairs) == (40, 0, None)
    assert json.loads(json.dumps(old.to_dict()))["prefill"]["pairs"] is None
    console = Console(record=True, width=300)
    render_validation(old, console)
    assert "their chunks are not recorded" in console.export_text()


def write_steps(directory, rows, **meta):
    """Observe files of these steps with this metadata, read back."""
    with ObservedWriter(directory, metadata=meta) as w:
        for s in rows:
            w.append(s)
    return read_observed([directory])


def aware_prefill(result):
    (g,) = [g for g in result.overall if g.kind == "verify_prefill"]
    return g.errors[AWARE]


def test_chunk_pricing_follows_the_engines_and_the_option(reference_table, tmp_path):
    from dspark_calib.pricing.policy import CHUNK_RULE

    rows = chunk_steps(reference_table, 30)

    def write(name, **meta):
        return write_steps(tmp_path / name, rows, **meta)

    by_pairs = write("pairs", **ENGINE, context_chunks=True, context_chunk_rule=CHUNK_RULE)
    r = validate(reference_table, by_pairs)
    assert r.prefill.by_pairs and aware_prefill(r).median_pct == 0.0  # priced as that engine priced
    assert aware_prefill(validate(reference_table, by_pairs, chunks=False)).median_pct > 10
    kv = write("kv", **ENGINE)  # an engine without chunk pricing (context_chunks absent: off)
    assert not validate(reference_table, kv).prefill.by_pairs
    assert aware_prefill(validate(reference_table, kv, chunks=True)).median_pct == 0.0
    # only context-aware engines price chunks: a stock engine's files get the plugin's default, whatever they say
    stock = write("stock", mode="stock", context_chunks=False)
    assert validate(reference_table, stock).prefill.by_pairs is DEFAULT_CONTEXT_CHUNKS is True
    with pytest.raises(CalibError, match="different chunk pricing .*--chunks or --no-chunks"):
        validate(reference_table, read_observed([tmp_path / "pairs", tmp_path / "kv"]))
    with pytest.raises(CalibError, match="context_chunks='yes'"):
        validate(reference_table, write("bad", **ENGINE, context_chunks="yes"))
    console = Console(record=True, width=400)
    render_validation(r, console)
    line = [ln for ln in console.export_text().splitlines() if ln.startswith("prefill-carrying")][0]
    assert "context-aware chunks by query-context pairs (in use) 0.00%" in line


def test_chunk_pair_price_follows_the_rule_the_files_record(reference_table, tmp_path):
    """Files from before 2026-12-01 (context_chunks true, no context_chunk_rule) were priced by the
    first rule, R(N) / N a pair: validate reproduces them as recorded, prices them by this
    release's rule under --chunks, and refuses to pool the two rules."""
    from dspark_calib.pricing.policy import CHUNK_RULE, CHUNK_RULE_PER_STEP

    def write(name, rows, **meta):
        return write_steps(tmp_path / name, rows, **meta)

    old = write("old", chunk_steps(reference_table, 30, per_step=True), **ENGINE, context_chunks=True)
    r = validate(reference_table, old)
    assert r.prefill.pair_rule == CHUNK_RULE_PER_STEP and aware_prefill(r).median_pct == 0.0
    now = validate(reference_table, old, chunks=True)
    assert now.prefill.pair_rule == CHUNK_RULE and aware_prefill(now).median_pct > 1  # the rules differ
    new = write("new", chunk_steps(reference_table, 30), **ENGINE, context_chunks=True,
                context_chunk_rule=CHUNK_RULE)
    assert aware_prefill(validate(reference_table, new)).median_pct == 0.0
    assert json.loads(json.dumps(validate(reference_table, new).to_dict()))["prefill"]["pair_rule"] == CHUNK_RULE
    with pytest.raises(CalibError, match="different chunk pricing rules .*--chunks"):
        validate(reference_table, read_observed([tmp_path / "old", tmp_path / "new"]))
    assert aware_prefill(validate(reference_table, new, chunks=True)).median_pct == 0.0
    bad = ObservedSteps(old.columns, old.files, (ObserveMeta.from_dict({**old.metadata[0].raw, "context_chunk_rule": "nope"}),))
    with pytest.raises(CalibError, match="context_chunk_rule='nope'"):
        validate(reference_table, bad)
    console = Console(record=True, width=400)
    render_validation(r, console)
    assert "(the per-step rule of files before 2026-12-01)" in console.export_text()


def test_chunk_pair_price_takes_n_max_from_the_table_not_the_files(reference_table, tmp_path):
    """Files of an engine that served with max_num_batched_tokens 4096 against a table profiled to
    8192: the engine priced a pair at 256 / 8192 (the profile's largest step), so must validate."""
    from dspark_calib.pricing.policy import CHUNK_RULE

    rows = [r for r in chunk_steps(reference_table, 30) if r.num_target_tokens <= 4096]
    assert len(rows) >= 10
    small = write_steps(tmp_path / "small", rows, **ENGINE, context_chunks=True,
                        context_chunk_rule=CHUNK_RULE, max_num_batched_tokens=4096, max_num_reqs=256)
    r = validate(reference_table, small)
    assert aware_prefill(r).median_pct == 0.0 and aware_prefill(r).n == len(rows)


def test_prefill_context_sum_by_hand():
    from dspark_calib.pricing.policy import CHUNK_RULE, CHUNK_RULE_PER_STEP
    from dspark_calib.pricing.rules import chunk_kv_ratio, prefill_context_sum

    # this release's rule: a pair at R / N_max KV tokens, whatever the step's size (256 / 8192 here)
    assert chunk_kv_ratio(CHUNK_RULE, 256, 8192) == (256, 8192)
    assert chunk_kv_ratio(CHUNK_RULE, 512, 256) == (256, 256)  # R(N_max) = min(N_max, max_num_seqs)
    # decode-only (no chunk): the KV sum unchanged
    assert prefill_context_sum(5000, 0, 0, 256, 8192) == 5000
    # a 4000-token chunk at context 1000 beside 3 decode requests (S 3 x 8000 + 1000)
    assert prefill_context_sum(25000, 1000, 4000 * 5000, 256, 8192) == 24000 + -(-256 * 20_000_000 // 8192)
    # a 496-token last chunk at 15888 beside 30 decodes, N 526 (the H200 step the first rule priced 3.3x)
    first = prefill_context_sum(511608, 15888, 8_126_464, *chunk_kv_ratio(CHUNK_RULE_PER_STEP, 256, 8192, 526))
    assert first == 495720 + -(-256 * 8_126_464 // 526) and prefill_context_sum(
        511608, 15888, 8_126_464, 256, 8192) == 495720 + 253_952
    # the first rule below R requests: R(N) = N, so the chunk's pairs count whole
    assert prefill_context_sum(100, 0, 64 * 64, *chunk_kv_ratio(CHUNK_RULE_PER_STEP, 256, 8192, 70)) == 100 + 64 * 64
    got = prefill_context_sum(np.array([5000, 25000]), np.array([0, 1000]), np.array([0, 20_000_000]),
                              *chunk_kv_ratio(CHUNK_RULE_PER_STEP, 256, 8192, np.array([300, 4012])))
    assert got.tolist() == [5000, 24000 + -(-256 * 20_000_000 // 4012)]
    with pytest.raises(CalibError, match="unknown chunk pricing rule 'x'"):
        chunk_kv_ratio("x", 256, 8192)


def test_files_without_steps_are_named(reference_table):
    from dspark_calib.observe.file import COLUMNS

    empty = ObservedSteps(columns={name: np.zeros(0) for name in COLUMNS}, files=("a/observed-1.parquet",),
                          metadata=())
    with pytest.raises(CalibError, match="no observed steps to validate against in a/observed-1.parquet"):
        validate(reference_table, empty)


def test_host_time_beside_the_priced_time_by_kind_and_context(reference_table, tmp_path):
    """Hand-set intervals: at 1k forward 100 + drafter 20 ms and intervals 150..180 (one step without
    an interval), at 16k forward 150 + drafter 30 and intervals 200..230 plus one 3 s stall. Median,
    p95 (linear, as numpy) and max of the interval and of interval - forward - drafter; stalls over 1 s."""
    steps = synthetic_steps(reference_table, (1024, 16384), per_context=5)
    times = {1024: (100.0, 20.0, [150.0, 160.0, 170.0, 180.0, None], [2.0, 4.0, 6.0, 8.0, 10.0]),
             16384: (150.0, 30.0, [200.0, 210.0, 220.0, 230.0, 3000.0], [1.0, None, 1.0, 1.0, 2950.0])}
    with ObservedWriter(tmp_path) as w:
        for i, st in enumerate(steps):
            forward, drafter, intervals, hosts = times[st.priced_context]
            w.append(dataclasses.replace(st, forward_ms=forward, drafter_ms=drafter, full_cudagraph=True,
                                         step_interval_ms=intervals[i % 5], host_ms=hosts[i % 5]))
    res = validate(reference_table, read_observed([tmp_path]))
    assert res.interval_steps == 9
    got = {(g.kind, g.context_bucket): g for g in res.host_time}
    assert list(got) == [(kind, bucket) for kind in ("draft", "verify") for bucket in ("all", "1024-2047", "16384-32767")]
    for kind in ("draft", "verify"):
        everything, short, long = (got[kind, b] for b in ("all", "1024-2047", "16384-32767"))
        assert (short.steps, long.steps, everything.steps) == (4, 5, 9)
        assert dataclasses.astuple(short.interval) == pytest.approx((165.0, 178.5, 180.0))
        assert dataclasses.astuple(short.unpriced) == pytest.approx((45.0, 58.5, 60.0))
        assert dataclasses.astuple(short.host) == pytest.approx((5.0, 7.7, 8.0))  # no interval: not in it
        assert (short.stalls, np.isnan(short.largest_stall_ms)) == (0, True)
        assert dataclasses.astuple(long.interval) == pytest.approx((220.0, 2446.0, 3000.0))
        assert dataclasses.astuple(long.unpriced) == pytest.approx((40.0, 2266.0, 2820.0))
        assert dataclasses.astuple(long.host) == pytest.approx((1.0, 2507.65, 2950.0))  # null host_ms: left out
        assert (long.stalls, long.largest_stall_ms) == (1, 3000.0)
        assert dataclasses.astuple(everything.interval) == pytest.approx((200.0, 1892.0, 3000.0))
        assert dataclasses.astuple(everything.unpriced) == pytest.approx((40.0, 1716.0, 2820.0))
        assert (everything.stalls, everything.largest_stall_ms) == (1, 3000.0)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["host_time"]["steps"] == 9 and d["host_time"]["stall_ms"] == 1000.0
    long = d["host_time"]["groups"][2]
    assert {k: long.pop(k) for k in ("interval_ms", "unpriced_ms", "host_ms")} == {
        "interval_ms": {"median_ms": 220.0, "p95_ms": pytest.approx(2446.0), "max_ms": 3000.0},
        "unpriced_ms": {"median_ms": 40.0, "p95_ms": pytest.approx(2266.0), "max_ms": 2820.0},
        "host_ms": {"median_ms": 1.0, "p95_ms": pytest.approx(2507.65), "max_ms": 2950.0}}
    assert long == {"kind": "draft", "context_bucket": "16384-32767", "steps": 5, "stalls": 1,
                    "largest_stall_ms": 3000.0}
    assert d["host_time"]["groups"][1]["largest_stall_ms"] is None
    console = Console(record=True, width=250)
    render_validation(res, console)
    text = console.export_text()
    assert "host time between steps, ms (TP rank 0; 9 of 10 steps)" in text
    assert "draft  │ 16384-32767 │     5 │      220 │ 2446 │ 3000 │     40.0 │ 2266 │ 2820 │  1.0 │      1 │    3000" in text
    with ObservedWriter(tmp_path / "older") as w:  # no interval recorded (as files before observe schema 1.6)
        for st in steps:
            w.append(st)
    older = validate(reference_table, read_observed([tmp_path / "older"]))
    assert older.interval_steps == 0 and older.host_time == ()
    console = Console(record=True, width=250)
    render_validation(older, console)
    assert "host time between steps: not recorded in these files (observe schema 1.6 records it)" in console.export_text()


def test_decode_verifies_by_shape_split_the_profiles_own_shape_from_fewer_longer_requests(reference_table, tmp_path):
    """Steps of the profile's shape (requests fill R(N)) measured as priced, steps of fewer requests
    at the same size measured 10 % slower, steps of drafts (<= half of R(N)) 3 % slower: the shape
    buckets show each lean apart in one context bucket, and the render names them."""
    grid = ContextGrid.from_table(reference_table)
    rng = np.random.default_rng(3)
    rows, want = [], {">0.9": 0.0, "0.5-0.9": 0.10, "<=0.5": 0.03}
    for i in range(240):
        tokens = int(rng.choice([16, 32, 48, 64]))
        label = (">0.9", "0.5-0.9", "<=0.5")[i % 3]
        reqs = {">0.9": tokens, "0.5-0.9": int(tokens * 0.7), "<=0.5": tokens // 4}[label]
        total = reqs * int(rng.integers(9000, 16000))
        (gd,), (gv,) = grid.price([total], [reqs], [tokens])
        rows.append(ObservedStep(step=i, forward_ms=float(gv) * (1 + want[label]), drafter_ms=float(gd),
                                 num_target_tokens=tokens, num_reqs=reqs, full_cudagraph=True,
                                 context_mean=total / reqs, context_max=-(-total // reqs), context_sum=total,
                                 scheduled_drafts=7 * reqs, draft_budget=tokens - reqs, priced_context=0,
                                 predicted_draft_ms=1.0, predicted_verify_ms=1.0))
    res = validate(reference_table, write_steps(tmp_path, rows), tail_milli=0, chunks=False)
    shape = {g.fill_bucket: g for g in res.by_shape}
    assert set(shape) == set(want) and {g.context_bucket for g in res.by_shape} == {"8192-16383"}
    for label, slower in want.items():
        e = shape[label].errors[AWARE]
        assert e.n == 80
        assert e.median_signed_pct == pytest.approx(-100 * slower / (1 + slower), abs=1e-6)  # priced below the step
    assert json.loads(json.dumps(res.to_dict()))["by_shape"][0]["fill_bucket"] in want
    console = Console(record=True, width=220)
    render_validation(res, console)
    text = console.export_text()
    assert "decode verifies by shape" in text and "0.5-0.9" in text and "-9.09%" in text


def test_shape_buckets_at_their_edges_and_only_decode_verifies(reference_table, tmp_path):
    """Requests / R(N) of exactly 0.5 is "<=0.5", of exactly 0.9 "0.5-0.9", above it ">0.9" (R(N) is
    min(N, max_num_seqs): 600 tokens over 256 requests is 1.0); a step carrying a prefill chunk (more
    non-draft tokens than requests) is in no shape bucket."""
    rows = []
    for i, (tokens, reqs, budget) in enumerate([(100, 50, 50), (100, 90, 10), (100, 91, 9), (600, 256, 344),
                                                (100, 95, 0), (100, 95, 0)]):
        total = reqs * 9000
        rows.append(ObservedStep(step=i, forward_ms=10.0, drafter_ms=1.0, num_target_tokens=tokens, num_reqs=reqs,
                                 full_cudagraph=True, context_mean=9000.0, context_max=9000, context_sum=total,
                                 scheduled_drafts=7 * reqs, draft_budget=budget, priced_context=0,
                                 predicted_draft_ms=1.0, predicted_verify_ms=1.0))
    res = validate(reference_table, write_steps(tmp_path, rows), tail_milli=0, chunks=False)
    counts = {g.fill_bucket: g.errors[AWARE].n for g in res.by_shape}
    assert counts == {"<=0.5": 1, "0.5-0.9": 1, ">0.9": 2}  # the two prefill-carrying steps in none
    assert {g.context_bucket for g in res.by_shape} == {"8192-16383"}

"""inspect's analysis: each warning fires on the case it names and not otherwise."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_calib.fit import decision_map
from dspark_calib.inspection import (
    CONFIDENCE_GRID, FALLING_MEDIAN, FEW_SAMPLES, HIGH_SPREAD, NOTE, SHORT_DRAFT, SHORT_VERIFY, WARNING,
    dip_within_spread, inspect_table, num_reqs_grid,
)
from dspark_calib.samples import Sample
from dspark_calib.table.model import CostTable

from tests.helpers import SCHEMA10, build_reference_table, draft_model_table, fixture_json


@pytest.fixture(scope="module")
def real() -> CostTable:
    return build_reference_table([fixture_json(c) for c in (1024, 8192)])


def _synthetic(real: CostTable, verify: dict[int, list[float]], *, max_num_seqs=16, max_num_batched_tokens=64):
    """Samples with the given forward_ms per size; drafter cost grows with requests, 5 replays."""
    samples = []
    for size, values in verify.items():
        for r, v in enumerate(values):
            samples.append(Sample(forward_ms=v, drafter_ms=1.0 + 0.01 * min(size, max_num_seqs),
                                  num_target_tokens=size, num_reqs=min(size, max_num_seqs), full_cudagraph=True,
                                  context_len=2048, replay=r))
    fp = real.fingerprint.replace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  cudagraph_capture_sizes=(1, 2, 4, 8), cudagraph_limit=8)
    return CostTable.from_samples(samples, fp)


def test_each_warning_on_its_case(real):
    t = _synthetic(real, {
        1: [5.0, 5.0, 5.0, 5.0, 5.0],
        2: [4.0, 4.0, 4.0, 4.0, 4.0],  # below size 1: vLLM's running max hides it
        4: [5.0, 5.5, 6.0, 7.0, 8.0],  # IQR 1.5 / median 6 = 25%
        8: [9.0, 9.1],  # two samples
    })
    insp = inspect_table(t)
    got = {(w.code, w.curve, w.size) for w in insp.warnings}
    assert got == {
        (FALLING_MEDIAN, "verify", 2),
        (HIGH_SPREAD, "verify", 4),
        (FEW_SAMPLES, "verify", 8),
        (FEW_SAMPLES, "draft", 8),  # the draft point at 8 requests has the same two samples
        (SHORT_VERIFY, "verify", 8),  # 8 < max_num_batched_tokens 64
        (SHORT_DRAFT, "draft", 8),  # 8 < max_num_seqs 16
    }
    dip = next(w for w in insp.warnings if w.code == FALLING_MEDIAN)
    assert "size 1" in dip.message and "5.000" in dip.message and dip.context_len == 2048


def test_a_verify_curve_ending_at_vllms_clamp_is_not_short(real):
    """vLLM's dummy run clamps a draft model's largest batch to max_num_batched_tokens -
    max_num_seqs (one extra query slot a request): 64 - 16 = 48 is where its own profile ends."""
    sizes = (1, 2, 4, 8, 16)
    clamped = _synthetic(real, {**{s: [float(s)] * 5 for s in sizes}, 48: [48.0] * 5}, max_num_batched_tokens=64)
    assert not [w for w in inspect_table(clamped).warnings if w.code == SHORT_VERIFY]
    short = _synthetic(real, {**{s: [float(s)] * 5 for s in sizes}, 40: [40.0] * 5}, max_num_batched_tokens=64)
    assert [(w.code, w.size) for w in inspect_table(short).warnings if w.code == SHORT_VERIFY] == [(SHORT_VERIFY, 40)]


def test_a_clean_table_has_no_warnings(real):
    t = _synthetic(real, {s: [float(s)] * 5 for s in (1, 2, 4, 8, 16, 32, 64)})
    assert inspect_table(t).warnings == []


def test_falling_median_names_the_running_max_not_the_previous_point(real):
    t = _synthetic(real, {1: [5.0] * 5, 2: [9.0] * 5, 4: [7.0] * 5, 8: [8.0] * 5}, max_num_batched_tokens=8,
                   max_num_seqs=8)
    dips = [w for w in inspect_table(t).warnings if w.code == FALLING_MEDIAN and w.curve == "verify"]
    assert [w.size for w in dips] == [4, 8]
    assert all("size 2's" in w.message for w in dips)


def test_real_fixture_dips_match_a_direct_scan(real):
    insp = inspect_table(real)
    for ctx in (1024, 8192):
        c = real.curves[ctx].verify
        expected = [int(c.size[i]) for i in range(1, len(c)) if c.cost_ms[i] < c.cost_ms[:i].max()]
        got = [w.size for w in insp.warnings if w.code == FALLING_MEDIAN and w.context_len == ctx and w.curve == "verify"]
        assert got == expected and expected  # the H200 recordings do dip past 256 tokens
    assert not [w for w in insp.warnings if w.code in (SHORT_VERIFY, SHORT_DRAFT, FEW_SAMPLES)]


def test_decision_map_and_context_choice(real):
    insp = inspect_table(real)
    assert insp.context_lens == [1024, 8192]
    assert insp.decision.context_len == 8192  # vLLM's default profiling context
    expected = decision_map(*real.dense_tables(8192), list(insp.decision.num_reqs), list(insp.decision.confidence), 7)
    np.testing.assert_array_equal(insp.decision.budget_per_req, expected)
    one = inspect_table(real, context_len=1500)
    assert one.context_lens == [1024] and one.decision.context_len == 1024
    assert one.notes and "1500" in one.notes[0]


def test_grid_is_capped_at_max_num_seqs():
    assert num_reqs_grid(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert num_reqs_grid(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert num_reqs_grid(1024) == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_to_dict_is_plain_json(real):
    d = json.loads(json.dumps(inspect_table(real).to_dict(), allow_nan=False))
    assert d["content_hash"] == real.content_hash
    pts = d["curves"]["8192"]["verify"]["points"]
    assert [p["size"] for p in pts] == real.curves[8192].verify.size.tolist()
    assert [p["captured"] for p in pts] == [s <= 512 for s in real.curves[8192].verify.size.tolist()]
    assert d["num_samples"] == {"1024": 280, "8192": 280}
    assert len(d["decision_map"]["budget_per_req"]) == len(d["decision_map"]["num_reqs"])


def _face_value_budgets(t: CostTable, ctx: int, lowered_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The decision map as vLLM prices the table, and with one verify point at its own median
    (every size of these synthetic curves is captured: the dense table is a step function)."""
    fp = t.fingerprint
    draft, verify = t.dense_tables(ctx)
    reqs = num_reqs_grid(fp.max_num_seqs)
    base = decision_map(draft, verify, reqs, CONFIDENCE_GRID, fp.num_speculative_tokens)
    c = t.curves[ctx].verify
    y = np.maximum.accumulate(c.cost_ms)
    i = int(np.flatnonzero(c.size == lowered_size)[0])
    y[i] = c.cost_ms[i]
    face = y[np.minimum(np.searchsorted(c.size, np.arange(len(verify)), side="left"), len(y) - 1)]
    return base, decision_map(draft, face, reqs, CONFIDENCE_GRID, fp.num_speculative_tokens)


def test_a_dip_is_a_note_unless_it_changes_a_draft_budget(real):
    """Size 2 dips 1 % (budgets the same either way: a note); size 4 dips from 9 to 5.5, which
    priced at its own median makes 3-4 drafts cheap (a warning). Checked against decision maps
    built here, with and without the running max at the dip."""
    t = _synthetic(real, {1: [5.0] * 5, 2: [4.95] * 5, 3: [9.0] * 5, 4: [5.5] * 5, 8: [9.5] * 5},
                   max_num_batched_tokens=8, max_num_seqs=8)
    dips = {w.size: w for w in inspect_table(t).warnings if w.code == FALLING_MEDIAN and w.curve == "verify"}
    assert set(dips) == {2, 4}
    base, face = _face_value_budgets(t, 2048, 2)
    assert np.array_equal(base, face, equal_nan=True)
    assert dips[2].severity == NOTE and "the same draft budgets" in dips[2].message and not dips[2].blocks
    base, face = _face_value_budgets(t, 2048, 4)
    assert not np.array_equal(base, face, equal_nan=True)
    assert dips[4].severity == WARNING and "changes a draft budget" in dips[4].message
    assert "beyond the points' spread" in dips[4].message and not dips[4].blocks


def test_dip_severity_rule():
    """fall <= max(IQR here, IQR of the running-max point): within the spread (said in a budget
    warning's message)."""
    nan = float("nan")
    assert dip_within_spread(0.2, 0.3, 0.0) and dip_within_spread(0.2, 0.0, 0.3)  # either point's spread
    assert dip_within_spread(0.2, 0.2, 0.1)  # equal: still within
    assert not dip_within_spread(0.21, 0.2, 0.1)
    assert dip_within_spread(0.1, nan, 0.2) and not dip_within_spread(0.3, nan, 0.2)  # NaN ignored
    assert not dip_within_spread(0.01, nan, nan)  # no spread recorded: cannot call it noise


def test_the_face_value_dense_table_is_vllms_rule_without_the_running_max_at_the_dip(real):
    """Above the capture limit vLLM interpolates: the dip's own median must enter the
    interpolation exactly, as a copy of the rule without the running max would."""
    from dspark_calib.inspection import _face_value_dense

    t = _synthetic(real, {1: [5.0] * 5, 2: [6.0] * 5, 16: [9.0] * 5, 32: [7.0] * 5, 64: [12.0] * 5},
                   max_num_batched_tokens=64, max_num_seqs=8)
    c = t.curves[2048].verify
    got = _face_value_dense(c, [3], 64, 8, t.curves[2048].draft.as_vllm(), "verify", t)
    sizes = np.arange(65)
    expected = np.empty(65)
    expected[:3] = [5.0, 5.0, 6.0]
    expected[3:] = np.interp(sizes[3:], [16, 32, 64], [9.0, 7.0, 12.0])  # all above the limit 8
    expected[3:9] = 9.0  # up to the limit: padded to the next captured point, 16
    np.testing.assert_allclose(got[sizes > 8], np.interp(sizes[sizes > 8], [16, 32, 64], [9.0, 7.0, 12.0]))
    np.testing.assert_allclose(got[:9], expected[:9])


def test_verdict_blocks_on_what_makes_costs_unlike_vllms_own(real):
    """Few samples, a noisy point, a short curve: not fit, each named; dips alone: fit."""
    dips_only = _synthetic(real, {s: [float(s)] * 5 for s in (1, 2, 4, 8, 16, 32, 64)} | {16: [3.0] * 5})
    v = inspect_table(dips_only).verdict
    assert v.fit and v.line.startswith("fit to serve: ") and v.reasons == ()
    bad = _synthetic(real, {1: [5.0] * 5, 2: [4.0] * 5, 4: [5.0, 5.5, 6.0, 7.0, 8.0], 8: [9.0, 9.1]})
    v = inspect_table(bad).verdict
    assert not v.fit and v.line.startswith("not fit to serve: ")
    assert "2 point(s) with fewer than 3 samples" in v.line and "1 noisy point(s)" in v.line
    assert "verify curve(s) short of max_num_batched_tokens" in v.line and "draft curve(s) short of max_num_seqs" in v.line
    assert "dip" not in v.line  # the dip at 2 is a finding, never a reason
    d = inspect_table(bad).to_dict()["verdict"]
    assert d["fit"] is False and d["line"] == v.line and len(d["reasons"]) == 4


def test_verdict_counts_the_whole_table_whatever_context_is_shown(real):
    t = _synthetic(real, {1: [5.0] * 5, 8: [9.0, 9.1]})
    assert not inspect_table(t, context_len=2048).verdict.fit
    assert not inspect_table(t, context_len=99999).verdict.fit


def test_thermal_throttling_blocks_and_power_limits_are_a_note(real):
    import dataclasses

    from dspark_calib.inspection import THROTTLE
    from dspark_calib.telemetry import Telemetry

    clean = _synthetic(real, {s: [float(s)] * 5 for s in (1, 2, 4, 8, 16, 32, 64)})

    def with_throttle(reasons):
        blocks = [{"context_len": 2048, "block": b, "start": {"throttle": []},
                   "end": {"throttle": reasons if b >= 1 else []}} for b in range(-1, 4)]
        return dataclasses.replace(clean, telemetry=Telemetry.from_json({"source": "nvml", "blocks": blocks}))

    insp = inspect_table(with_throttle(["hw_slowdown"]))
    (w,) = [w for w in insp.warnings if w.code == THROTTLE]
    assert w.severity == NOTE and "3 of 4 timed blocks" in w.message and insp.verdict.fit
    insp = inspect_table(with_throttle(["hw_thermal"]))
    (w,) = [w for w in insp.warnings if w.code == THROTTLE]
    assert w.severity == WARNING and w.blocks and not insp.verdict.fit and "throttling" in insp.verdict.line


def test_a_level_shift_makes_the_table_unfit(reference_table_8192):
    from tests.cli.test_conditions_cli import table_with

    assert not any("level shift" in r for r in inspect_table(table_with(reference_table_8192)).verdict.reasons)
    v = inspect_table(table_with(reference_table_8192, step_ms=0.18, seed=1)).verdict
    assert not v.fit and "1 level shift(s) between blocks" in v.line


def test_summary_ends_with_the_verdict_and_inspect_shows_notes_only_with_all(real):
    import io

    from rich.console import Console

    from dspark_calib.render import render_inspect, render_summary

    t = _synthetic(real, {1: [5.0] * 5, 2: [4.95] * 5, 4: [6.0] * 5, 8: [8.0] * 5},
                   max_num_batched_tokens=8, max_num_seqs=8)
    insp = inspect_table(t)
    assert insp.counts == {WARNING: 0, NOTE: 1} and insp.verdict.fit
    out = io.StringIO()
    render_summary(insp, Console(file=out, width=300))
    lines = out.getvalue().splitlines()
    assert lines[-2] == "0 warnings, 1 note (dspark-calib inspect for details)"
    assert lines[-1] == insp.verdict.line and lines[-1].startswith("fit to serve: ")
    out = io.StringIO()
    render_inspect(insp, Console(file=out, width=300))
    text = out.getvalue()
    assert text.splitlines()[0] == insp.verdict.line
    assert text.rstrip().splitlines()[-1] == "summary: 0 warnings, 1 note (--all shows the notes)"
    assert "1 note:" not in text and "dip?" not in text and "warning:" not in text
    out = io.StringIO()
    render_inspect(insp, Console(file=out, width=300), all_points=True)
    text = out.getvalue()
    assert "1 note:" in text and "dip?" in text and text.rstrip().endswith("summary: 0 warnings, 1 note")


def test_cost_against_context_for_tables_with_several_contexts(real):
    """inspect shows verify cost at a few sizes per profiled context: exactly the dense tables
    vLLM would build, in text and JSON; a one-context table has no such view."""
    from typer.testing import CliRunner

    from dspark_calib.cli.app import app
    from dspark_calib.inspection import cost_by_context

    view = inspect_table(real).by_context
    assert view.contexts == (1024, 8192) and view.sizes == (1, 16, 64, 256, 1024, 4096, 8192)
    for i, size in enumerate(view.sizes):
        assert view.verify_ms[i] == tuple(float(real.dense_tables(c)[1][size]) for c in view.contexts)
    assert view.verify_ms[3][1] > 3 * view.verify_ms[3][0]  # 256 tokens: context matters
    single = build_reference_table([fixture_json(8192)])
    assert cost_by_context(single) is None and inspect_table(single).to_dict()["cost_by_context"] is None
    r = CliRunner().invoke(app, ["inspect", str(SCHEMA10)])
    assert "verify cost (ms) against context" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["256"] and "x" in line)
    assert row.split() == ["256", "16.807", "74.867", "142.393", "8.47x"]
    d = json.loads(CliRunner().invoke(app, ["inspect", str(SCHEMA10), "--json"]).stdout)
    assert d["cost_by_context"]["contexts"] == [1024, 8192, 16384] and len(d["cost_by_context"]["verify_ms"]) == 7


def test_the_face_value_trick_with_nothing_lowered_is_vllms_dense_table(real):
    """build(y + m x) - build(m x) with the running max kept everywhere is the dense table vLLM
    builds, on both curves of the H200 recordings (steps, interpolation, extrapolation)."""
    from dspark_calib.inspection import _face_value_dense

    fp = real.fingerprint
    for ctx in real.context_lens():
        draft, verify = real.dense_tables(ctx)
        pair = real.curves[ctx]
        got_v = _face_value_dense(pair.verify, [], fp.max_num_batched_tokens, fp.cudagraph_limit,
                                  pair.draft.as_vllm(), "verify", real)
        got_d = _face_value_dense(pair.draft, [], fp.max_num_seqs, fp.cudagraph_limit, pair.verify.as_vllm(), "draft",
                                  real)
        np.testing.assert_allclose(got_v, verify, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(got_d, draft, rtol=1e-12, atol=1e-9)


def test_a_fall_after_warm_up_is_a_finding_never_a_reason_to_refuse():
    """The draft-model H200 curve at 1024 (flat, then down to ~64 ms at 192-224 requests): each
    point below the running peak is a falling-median finding, a warning where the fall is beyond the
    allowance a profile without warm-up is refused for; the verdict does not count falls."""
    insp = inspect_table(draft_model_table(5), context_len=1024)
    falls = {w.size: w for w in insp.warnings if w.code == FALLING_MEDIAN and w.curve == "draft"}
    assert set(range(176, 257, 8)) <= set(falls) and not any(w.blocks for w in falls.values())
    assert falls[200].message.startswith("draft @ctx 1024: size 200 median 65.033 ms is 59.8% below size 8's "
                                         "161.606 ms; vLLM charges 161.606")
    assert falls[200].severity == WARNING and falls[200].message.endswith(
        "the same draft budgets; a fall beyond max(3 x IQR, 10%) (refused in a profile without warm-up)")
    assert falls[168].severity == NOTE  # 7.3 % below the peak: within the allowance, budgets the same
    assert not any("falling" in r or "dip" in r for r in insp.verdict.reasons)

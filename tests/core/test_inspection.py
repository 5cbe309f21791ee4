"""inspect's analysis: each warning fires on the case it names and not otherwise."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_calib.fit import decision_map
from dspark_calib.inspection import (
    FALLING_MEDIAN, FEW_SAMPLES, HIGH_SPREAD, NOTE, SHORT_DRAFT, SHORT_VERIFY, WARNING, dip_within_spread, inspect_table,
    num_reqs_grid,
)
from dspark_calib.samples import Sample
from dspark_calib.table.model import CostTable

from tests.helpers import SCHEMA10, build_reference_table, fixture_json


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


def test_a_dip_within_the_points_own_spread_is_a_note(real):
    t = _synthetic(real, {
        1: [5.0] * 5,
        2: [4.8, 4.9, 4.95, 5.2, 5.3],  # median 4.95 < 5.0, but its p75 (5.2) reaches 5.0: noise
        4: [6.0] * 5,
        8: [5.0, 5.0, 5.0, 5.05, 5.1],  # median 5.0 < 6.0 and p75 5.05 far below: a real dip
    }, max_num_batched_tokens=8, max_num_seqs=8)
    dips = {w.size: w for w in inspect_table(t).warnings if w.code == FALLING_MEDIAN}
    assert dips[2].severity == NOTE and "within the points' p25-p75 spread" in dips[2].message
    assert dips[8].severity == WARNING
    insp = inspect_table(t)
    assert insp.counts == {WARNING: 1, NOTE: 1} and insp.summary == "1 warning, 1 note"
    d = insp.to_dict()
    assert d["counts"] == {"warning": 1, "note": 1} and {w["severity"] for w in d["warnings"]} == {"warning", "note"}


def test_dip_severity_rule():
    """fall <= max(IQR here, IQR of the running-max point): a note; else a warning."""
    nan = float("nan")
    assert dip_within_spread(0.2, 0.3, 0.0) and dip_within_spread(0.2, 0.0, 0.3)  # either point's spread
    assert dip_within_spread(0.2, 0.2, 0.1)  # equal: still within
    assert not dip_within_spread(0.21, 0.2, 0.1)
    assert dip_within_spread(0.1, nan, 0.2) and not dip_within_spread(0.3, nan, 0.2)  # NaN ignored
    assert not dip_within_spread(0.01, nan, nan)  # no spread recorded: cannot call it noise


def test_a_dip_within_the_running_max_points_spread_is_a_note(real):
    """The point that set the running max was noisy (IQR 0.4), the dipping point steady: a fall
    of 0.3 is within the larger spread; a fall of 0.5 is not."""
    t = _synthetic(real, {
        1: [4.6, 4.8, 5.0, 5.2, 5.4],  # median 5.0, p25 4.8, p75 5.2: IQR 0.4
        2: [4.7] * 5,  # falls 0.3 <= 0.4: note
        4: [6.0] * 5,
        8: [5.5] * 5,  # falls 0.5 > max(0, 0): warning
    }, max_num_batched_tokens=8, max_num_seqs=8)
    dips = {w.size: w for w in inspect_table(t).warnings if w.code == FALLING_MEDIAN and w.curve == "verify"}
    assert dips[2].severity == NOTE and dips[8].severity == WARNING


def test_summary_and_inspect_output_count_only_warnings_as_warnings(real):
    import io

    from rich.console import Console

    from dspark_calib.render import render_inspect, render_summary

    t = _synthetic(real, {1: [5.0] * 5, 2: [4.8, 4.9, 4.95, 5.2, 5.3], 4: [6.0] * 5, 8: [8.0] * 5},
                   max_num_batched_tokens=8, max_num_seqs=8)
    insp = inspect_table(t)
    assert insp.counts == {WARNING: 0, NOTE: 1}
    out = io.StringIO()
    render_summary(insp, Console(file=out, width=200))
    assert out.getvalue().splitlines()[-1] == "no warnings, 1 note"
    out = io.StringIO()
    render_inspect(insp, Console(file=out, width=200))
    text = out.getvalue()
    assert text.rstrip().splitlines()[-1] == "summary: 0 warnings, 1 note"
    assert "1 note:" in text and "warning:" not in text and "dip?" in text


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

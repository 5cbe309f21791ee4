"""Observe files: round trip, rolling and atomic writes, one-line errors on bad input, PendingSteps."""

from __future__ import annotations

import dataclasses
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dspark_calib.observe import file as observe
from dspark_calib.errors import CalibError
import math

from dspark_calib.observe.step import (ABSENT, ACCEPTANCE, COLUMNS, CONTEXT_QUANTILES, ESTIMATOR, GPU, HOST, PREFILL,
                                       ObservedStep, PendingSteps, context_quantiles)
from dspark_calib.observe.file import ObservedWriter, read_observed


def step(i=0, **kw):
    base = dict(step=i, forward_ms=10.0 + i, drafter_ms=2.0, num_target_tokens=64, num_reqs=8, full_cudagraph=True,
                context_mean=1500.5, context_max=2000, context_sum=12004, scheduled_drafts=56, draft_budget=40,
                priced_context=1536, predicted_draft_ms=2.1, predicted_verify_ms=10.5, budget_static=None,
                budget_context_aware=40)
    base.update(kw)
    return ObservedStep(**base)


# 8 requests, 40 drafts verified: 6 accepted at position 1, 4 at 2, ... (each graded one had all before accepted)
GRADED, ACCEPTED = (8, 6, 4, 2, 1, 0, 0), (6, 4, 2, 1, 0, 0, 0)
# vLLM's acceptance estimator after 3 refits (300 of its steps and 12 more)
ESTIMATED = dict(estimator_refits=3, estimator_steps=312, estimator_slope=0.75,
                 estimator_intercepts=(2.5, 1.25, 0.5, -0.25, -1.0, -1.5, -2.0))


# the 8 requests of step(): contexts summing to 12004 (mean 1500.5), the longest 2000
CONTEXTS = (1000, 1200, 1300, 1500, 1502, 1502, 2000, 2000)
QUANTILES = context_quantiles(CONTEXTS)


def test_context_quantiles_are_order_statistics_by_hand():
    assert sum(CONTEXTS) == 12004
    # 8 requests: ranks round(i x 7 / 8) = 0, 1, 2, 3, 4, 4, 5, 6, 7 of the sorted contexts
    assert QUANTILES == (1000, 1200, 1300, 1500, 1502, 1502, 1502, 2000, 2000)
    assert context_quantiles([7]) == (7,) * CONTEXT_QUANTILES
    assert context_quantiles(list(range(17, 0, -1))) == (1, 3, 5, 7, 9, 11, 13, 15, 17)  # any order in


def test_round_trip_keeps_every_value(tmp_path):
    steps = [step(i, budget_static=i % 3 if i % 2 else None, full_cudagraph=bool(i % 2),
                  **(dict(prefill_tokens=3 * i, prefill_context_sum=100 * i, prefill_pairs=3 * i * (100 + 3 * i))
                     if i % 3 else {}),
                  **(dict(position_graded=GRADED, position_accepted=ACCEPTED) if i % 2 == 0 else {}),
                  **(ESTIMATED if i % 3 == 1 else {}),
                  **(dict(gpu_sm_mhz=1515.0 + 15 * i, gpu_power_w=699.5) if i % 4 else {}),
                  **(dict(step_interval_ms=188.5 + i, host_ms=0.25 * i) if i % 5 else {}),
                  **(dict(context_quantiles=QUANTILES) if i % 2 else {}))
             for i in range(7)]
    with ObservedWriter(tmp_path, metadata={"mode": "context_aware", "table_hash": "ab" * 32, "tp_rank": 1}) as w:
        for s in steps:
            w.append(s)
    got = read_observed([tmp_path])
    assert len(got) == 7 and got.metadata[0].raw["mode"] == "context_aware"
    assert got.metadata[0].raw["schema_version"] == observe.OBSERVED_SCHEMA_VERSION
    assert os.path.basename(got.files[0]).startswith("observed-r1-")
    for name in COLUMNS:
        want = [getattr(s, name) for s in steps]
        absent = ([ABSENT] * len(GRADED) if name in ACCEPTANCE else [ABSENT] * CONTEXT_QUANTILES
                  if name == "context_quantiles" else ABSENT)
        if name in ("estimator_slope", "estimator_intercepts", *GPU, *HOST):  # null floats read as NaN
            absent = [math.nan] * len(GRADED) if name == "estimator_intercepts" else math.nan
        want = [absent if v is None else list(v) if isinstance(v, tuple) else v for v in want]
        assert json.dumps(got[name].tolist()) == json.dumps(want), name  # NaN == NaN as text
    assert [i for i in range(7) if got["estimator_refits"][i] != ABSENT] == [1, 4]


def test_a_12_file_reads_with_no_estimator_recorded(tmp_path):
    """The 1.2 -> 1.3 migration: the four estimator columns read null (ABSENT counts, NaN coefficients)."""
    with ObservedWriter(tmp_path) as w:
        w.append(step(0, position_graded=GRADED, position_accepted=ACCEPTED))
    (path,) = [tmp_path / n for n in os.listdir(tmp_path)]
    t = pq.read_table(path)
    meta = json.loads(t.schema.metadata[observe.METADATA_KEY])
    t = t.drop_columns(list(ESTIMATOR)).replace_schema_metadata(
        {observe.METADATA_KEY: json.dumps({**meta, "schema_version": "1.2"}).encode()})
    pq.write_table(t, path)
    got = read_observed([path])
    assert got["estimator_refits"].tolist() == got["estimator_steps"].tolist() == [ABSENT]
    assert math.isnan(got["estimator_slope"][0]) and math.isnan(got["estimator_intercepts"][0, 0])
    assert got["position_graded"].tolist() == [list(GRADED)]


def test_a_13_file_reads_as_priced_by_the_linear_tail_rule_and_a_14_file_as_it_records(tmp_path):
    """The 1.3 -> 1.4 migration: every engine before the tail rule was recorded charged the whole
    gap (the linear rule); a newer file's own rule stays."""
    from dspark_calib.pricing.policy import CONTEXT_AWARE, PricingPolicy

    meta = PricingPolicy(CONTEXT_AWARE, 8192, tail_milli=200).metadata()
    with ObservedWriter(tmp_path, metadata=meta) as w:
        w.append(step(0))
    (path,) = [tmp_path / n for n in os.listdir(tmp_path)]
    assert read_observed([path]).metadata[0].policy().tail_rule == "bounded"
    t = pq.read_table(path)
    written = json.loads(t.schema.metadata[observe.METADATA_KEY])
    assert written["schema_version"] == observe.OBSERVED_SCHEMA_VERSION and written["context_tail_rule"] == "bounded"
    old = {k: v for k, v in written.items() if k != "context_tail_rule"}
    pq.write_table(t.replace_schema_metadata({observe.METADATA_KEY: json.dumps({**old, "schema_version": "1.3"}).encode()}),
                   path)
    got = read_observed([path]).metadata[0]
    assert got.schema_version == observe.OBSERVED_SCHEMA_VERSION
    assert got.policy() == PricingPolicy(CONTEXT_AWARE, 8192, 200, tail_rule="linear")


# a 1.6 engine's GPU and host readings of one step
RECORDED = dict(gpu_sm_mhz=1530.0, gpu_power_w=700.0, step_interval_ms=190.0, host_ms=3.0)


@pytest.mark.parametrize("older,dropped", [("1.4", GPU + HOST), ("1.5", HOST)])
def test_an_older_file_reads_with_the_later_floats_null(tmp_path, older, dropped):
    """The 1.4 -> 1.5 migration (the SM clock and power) and 1.5 -> 1.6 (the host's step interval and
    issue time): what the older engine did not record reads null (NaN), what it did stays."""
    recorded = RECORDED
    with ObservedWriter(tmp_path) as w:
        w.append(step(0, **recorded))
    (path,) = [tmp_path / n for n in os.listdir(tmp_path)]
    t = pq.read_table(path)
    meta = json.loads(t.schema.metadata[observe.METADATA_KEY])
    assert meta["schema_version"] == "1.7" and {k: read_observed([path])[k].tolist() for k in recorded} == {
        k: [v] for k, v in recorded.items()}
    t = t.drop_columns(list(dropped)).replace_schema_metadata(
        {observe.METADATA_KEY: json.dumps({**meta, "schema_version": older}).encode()})
    pq.write_table(t, path)
    got = read_observed([path])
    assert got.metadata[0].schema_version == "1.7"
    assert {k: math.isnan(got[k][0]) for k in recorded} == {k: k in dropped for k in recorded}
    assert got["forward_ms"].tolist() == [10.0]


@pytest.mark.parametrize("name,value,row_says,file_says", [
    *((name, value, "must be a number in", "outside")
      for name, value in (("gpu_sm_mhz", 0.0), ("gpu_sm_mhz", -1515.0), ("gpu_power_w", 1e9), ("gpu_power_w", math.inf))),
    *((name, value, "must be a finite number >= 0 or None", "must be finite and >= 0")
      for name, value in (("step_interval_ms", -1.0), ("host_ms", math.inf)))])
def test_an_impossible_gpu_or_host_reading_is_refused_in_a_row_and_in_a_file(tmp_path, name, value, row_says,
                                                                            file_says):
    for bad in (value, True):
        with pytest.raises(CalibError, match=f"bad observed step: {name} {row_says}"):
            step(0, **{name: bad})
    with ObservedWriter(tmp_path) as w:
        w.append(step(0, **RECORDED))
    (path,) = [tmp_path / n for n in os.listdir(tmp_path)]
    t = pq.read_table(path)
    t = t.set_column(t.schema.get_field_index(name), name, pa.array([float(value)]))
    pq.write_table(t, path)
    with pytest.raises(CalibError, match=f"row 0: {name} {file_says}"):
        read_observed([path])


def test_rolling_files_are_bounded_and_keep_the_newest(tmp_path):
    w = ObservedWriter(tmp_path, rows_per_file=3, max_files=2)
    written = [w.append(step(i)) for i in range(10)]
    assert sum(p is not None for p in written) == 3  # after rows 3, 6, 9
    w.close()  # the last row
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and not any(n.startswith(".") for n in names)
    got = read_observed([tmp_path])
    assert got["step"].tolist() == [6, 7, 8, 9]


def test_buffer_age_flushes(tmp_path):
    now = [0.0]
    w = ObservedWriter(tmp_path, rows_per_file=1000, max_buffer_s=5.0, clock=lambda: now[0])
    assert w.append(step(0)) is None
    now[0] = 6.0
    assert w.append(step(1)) is not None
    assert read_observed([tmp_path])["step"].tolist() == [0, 1]


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    w = ObservedWriter(tmp_path, rows_per_file=2)
    w.append(step(0))

    def broken(table, fh, **kw):
        fh.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(CalibError) as err:
        w.append(step(1))
    assert "disk full" in str(err.value) and "2 observed steps dropped" in str(err.value)
    assert os.listdir(tmp_path) == []


def test_an_unusable_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CalibError) as err:
        ObservedWriter(blocker / "sub")
    assert str(blocker / "sub") in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("bad", [dict(forward_ms=-1.0), dict(forward_ms=float("nan")), dict(num_reqs=0),
                                 dict(draft_budget=57), dict(budget_static=-2), dict(context_mean=3.0),
                                 dict(context_max=10), dict(full_cudagraph=1), dict(step=1.5),
                                 # prefill: all three or none; within the step's tokens and contexts
                                 dict(prefill_tokens=10), dict(prefill_tokens=65, prefill_context_sum=0, prefill_pairs=65 ** 2),
                                 dict(prefill_tokens=10, prefill_context_sum=12005, prefill_pairs=200),
                                 dict(prefill_tokens=10, prefill_context_sum=1000, prefill_pairs=19),
                                 dict(prefill_tokens=10, prefill_context_sum=1000, prefill_pairs=10 * 2011),
                                 dict(prefill_tokens=0, prefill_context_sum=5, prefill_pairs=0),
                                 dict(prefill_tokens=-2, prefill_context_sum=0, prefill_pairs=0),
                                 # acceptance: both or neither, equal lengths, counts that a verification can give
                                 dict(position_graded=GRADED),
                                 dict(position_graded=GRADED, position_accepted=ACCEPTED[:3]),
                                 dict(position_graded=(9, 0), position_accepted=(0, 0)),  # more than 8 requests
                                 dict(position_graded=(8, 8, 8, 8, 8, 8), position_accepted=(8,) * 6),  # 48 > 40 drafts
                                 dict(position_graded=(4, 5), position_accepted=(4, 1)),  # graded rises
                                 dict(position_graded=(4, 3), position_accepted=(2, 1)),  # 3 graded at 2, 2 accepted at 1
                                 dict(position_graded=(4, 0), position_accepted=(5, 0)),
                                 dict(position_graded=(4, -1), position_accepted=(2, 0)),
                                 # estimator: all four or none; counts >= 0; finite coefficients; slope >= 0
                                 dict(estimator_slope=0.5),
                                 {**ESTIMATED, "estimator_refits": -1},
                                 {**ESTIMATED, "estimator_slope": -0.1},
                                 {**ESTIMATED, "estimator_slope": float("nan")},
                                 {**ESTIMATED, "estimator_intercepts": ()},
                                 {**ESTIMATED, "estimator_intercepts": (1.0, float("inf"))}])
def test_bad_steps_are_refused(bad):
    with pytest.raises(CalibError) as err:
        step(**bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad,says", [
    (QUANTILES[:-1], "must be 9 integers"), ((1000.0,) * 9, "must be 9 integers"),
    ((1200, 1000) + QUANTILES[2:], "non-decreasing"), ((-1,) + QUANTILES[1:], "non-decreasing"),
    (QUANTILES[:-1] + (2001,), "end at context_max"), ((1600,) * 8 + (2000,), "shortest request above the mean")])
def test_impossible_context_quantiles_are_refused_in_a_row_and_in_a_file(tmp_path, bad, says):
    with pytest.raises(CalibError, match=f"bad observed step: .*{says}"):
        step(context_quantiles=bad)
    with ObservedWriter(tmp_path) as w:
        w.append(step(0, context_quantiles=QUANTILES))
    (path,) = [tmp_path / n for n in os.listdir(tmp_path)]
    t = pq.read_table(path)
    t = t.set_column(t.schema.get_field_index("context_quantiles"), "context_quantiles",
                     pa.array([list(bad)], type=pa.list_(pa.float64() if isinstance(bad[0], float) else pa.int64())))
    pq.write_table(t, path)
    with pytest.raises(CalibError) as err:
        read_observed([path])
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_list_longer_than_a_steps_quantiles_is_refused_before_it_is_read(tmp_path):
    with ObservedWriter(tmp_path) as w:
        w.append(step(0, context_quantiles=QUANTILES))
    (path,) = [tmp_path / n for n in os.listdir(tmp_path)]
    t = pq.read_table(path)
    t = t.set_column(t.schema.get_field_index("context_quantiles"), "context_quantiles",
                     pa.array([list(QUANTILES) * 1000], type=pa.list_(pa.int64())))
    pq.write_table(t, path)
    with pytest.raises(CalibError, match="context_quantiles has a list of 9000 values, over the 9"):
        read_observed([path])


def test_a_16_file_reads_with_no_context_quantiles(tmp_path):
    """The 1.6 -> 1.7 migration: a 1.6 engine recorded no order statistics; they read ABSENT
    (rows, 9), what it did record stays."""
    with ObservedWriter(tmp_path) as w:
        w.append(step(0, context_quantiles=QUANTILES, **RECORDED))
    (path,) = [tmp_path / n for n in os.listdir(tmp_path)]
    assert read_observed([path])["context_quantiles"].tolist() == [list(QUANTILES)]
    t = pq.read_table(path)
    meta = json.loads(t.schema.metadata[observe.METADATA_KEY])
    t = t.drop_columns(["context_quantiles"]).replace_schema_metadata(
        {observe.METADATA_KEY: json.dumps({**meta, "schema_version": "1.6"}).encode()})
    pq.write_table(t, path)
    got = read_observed([path])
    assert got.metadata[0].schema_version == "1.7"
    assert got["context_quantiles"].tolist() == [[ABSENT] * CONTEXT_QUANTILES]
    assert got["host_ms"].tolist() == [3.0]


# -- bad files -------------------------------------------------------------------------------
def _good_file(tmp_path):
    with ObservedWriter(tmp_path / "ok") as w:
        for i in range(4):
            w.append(step(i))
    return w.files[0]


def _rewrite(path, out, *, drop=None, cast=None, replace=None, meta=None):
    t = pq.read_table(path)
    if drop:
        t = t.drop_columns([drop])
    if cast:
        name, typ = cast
        t = t.set_column(t.column_names.index(name), name, t.column(name).cast(typ))
    if replace:
        name, values = replace
        t = t.set_column(t.column_names.index(name), pa.field(name, t.schema.field(name).type), pa.array(values, t.schema.field(name).type))
    md = dict(t.schema.metadata or {})
    if meta is not None:
        md[observe.METADATA_KEY] = meta
    pq.write_table(t.replace_schema_metadata(md), out)
    return str(out)


def _bad_cases(tmp_path, good):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1]}), plain)
    (tmp_path / "empty").mkdir()
    return {
        "no such file": str(tmp_path / "missing.parquet"),
        "holds no observed": str(tmp_path / "empty"),
        "not a readable parquet": str(garbage),
        "without dspark-calib observed metadata": str(plain),
        "column drafter_ms is missing": _rewrite(good, tmp_path / "a.parquet", drop="drafter_ms"),
        "column num_reqs has type": _rewrite(good, tmp_path / "b.parquet", cast=("num_reqs", pa.float64())),
        "column forward_ms has 1 null": _rewrite(good, tmp_path / "c.parquet", replace=("forward_ms", [1.0, None, 2.0, 3.0])),
        "row 2: forward_ms must be finite": _rewrite(good, tmp_path / "d.parquet", replace=("forward_ms", [1.0, 2.0, -3.0, 4.0])),
        "row 0: draft_budget outside": _rewrite(good, tmp_path / "e.parquet", replace=("draft_budget", [99, 1, 1, 1])),
        "row 1: budget_static outside": _rewrite(good, tmp_path / "f.parquet", replace=("budget_static", [None, 70, None, None])),
        "observed schema 2.0 is not readable": _rewrite(good, tmp_path / "g.parquet",
                                                        meta=json.dumps({"schema_version": "2.0"}).encode()),
        "malformed observed metadata": _rewrite(good, tmp_path / "h.parquet", meta=b"{not json"),
        "column prefill_pairs is missing": _rewrite(good, tmp_path / "i.parquet", drop="prefill_pairs"),  # a 1.1 file
        "row 3: prefill columns null in some": _rewrite(good, tmp_path / "j.parquet",
                                                        replace=("prefill_tokens", [None, None, None, 4])),
        "row 0: prefill columns disagree": _rewrite(
            _rewrite(_rewrite(good, tmp_path / "k0.parquet", replace=("prefill_tokens", [4, None, None, None])),
                     tmp_path / "k1.parquet", replace=("prefill_context_sum", [0, None, None, None])),
            tmp_path / "k.parquet", replace=("prefill_pairs", [7, None, None, None])),
    }


def test_bad_files_are_one_line_errors_naming_the_file(tmp_path):
    good = _good_file(tmp_path)
    assert len(read_observed([good])) == 4
    for expected, path in _bad_cases(tmp_path, good).items():
        with pytest.raises(CalibError) as err:
            read_observed([path])
        msg = str(err.value)
        assert expected in msg and path in msg and "\n" not in msg, (expected, msg)


def test_a_1_0_file_reads_with_the_prefill_columns_absent(tmp_path):
    """The 1.0 -> 1.1 migration: the H200 files of 2026-11-30 are 1.0 and must stay readable."""
    good = _good_file(tmp_path)
    t = pq.read_table(good).drop_columns(list(PREFILL + ACCEPTANCE))
    meta = json.loads(t.schema.metadata[observe.METADATA_KEY])
    meta["schema_version"] = "1.0"
    pq.write_table(t.replace_schema_metadata({observe.METADATA_KEY: json.dumps(meta).encode()}), tmp_path / "old.parquet")
    got = read_observed([tmp_path / "old.parquet"])
    assert len(got) == 4 and all(got[name].tolist() == [ABSENT] * 4 for name in PREFILL)
    assert got["forward_ms"].tolist() == read_observed([good])["forward_ms"].tolist()


def test_a_1_1_file_reads_with_no_acceptance_recorded(tmp_path):
    """The 1.1 -> 1.2 migration: a 1.1 file has no acceptance columns; every row reads as not recorded."""
    good = _good_file(tmp_path)
    t = pq.read_table(good).drop_columns(list(ACCEPTANCE))
    meta = json.loads(t.schema.metadata[observe.METADATA_KEY])
    meta["schema_version"] = "1.1"
    pq.write_table(t.replace_schema_metadata({observe.METADATA_KEY: json.dumps(meta).encode()}), tmp_path / "old.parquet")
    got = read_observed([tmp_path / "old.parquet"])
    assert all((got[name][:, 0] == ABSENT).all() for name in ACCEPTANCE)
    assert got.metadata[0].raw["schema_version"] == observe.OBSERVED_SCHEMA_VERSION  # migrated all the way


def test_files_of_different_widths_read_together_padded(tmp_path):
    """Files of engines with other num_speculative_tokens read together: the shorter lists are padded with
    0 (nothing graded there), a file without acceptance stays not recorded."""
    with ObservedWriter(tmp_path / "a", name="a") as w:
        w.append(step(0, position_graded=(8, 6), position_accepted=(6, 4)))
    with ObservedWriter(tmp_path / "b", name="b") as w:
        w.append(step(1, position_graded=GRADED, position_accepted=ACCEPTED))
        w.append(step(2))
    got = read_observed([tmp_path / "a", tmp_path / "b"])
    assert got["position_graded"].tolist() == [[8, 6, 0, 0, 0, 0, 0], list(GRADED), [ABSENT] * 7]


def test_bad_acceptance_in_a_file_is_one_line(tmp_path):
    with ObservedWriter(tmp_path / "ok") as w:
        w.append(step(0, position_graded=(8, 6), position_accepted=(6, 4)))
    bad = _rewrite(w.files[0], tmp_path / "bad.parquet", replace=("position_accepted", [[5, 4]]))
    with pytest.raises(CalibError, match="row 0: accepted drafts outside"):
        read_observed([bad])


def test_a_newer_minor_with_extra_columns_is_read(tmp_path):
    good = _good_file(tmp_path)
    t = pq.read_table(good)
    meta = json.loads(t.schema.metadata[observe.METADATA_KEY])
    meta["schema_version"] = "1.7"
    t = t.append_column("future", pa.array([1, 2, 3, 4])).replace_schema_metadata(
        {observe.METADATA_KEY: json.dumps(meta).encode()})
    pq.write_table(t, tmp_path / "newer.parquet")
    assert len(read_observed([tmp_path / "newer.parquet"])) == 4


# -- PendingSteps ----------------------------------------------------------------------------
class FakeEvent:
    def __init__(self, t):
        self.t, self.done = t, False

    def query(self):
        return self.done

    def elapsed_time(self, end):
        assert self.done and end.done, "elapsed_time on an unfinished event would synchronise"
        return end.t - self.t


def fake_step(t0):
    return dataclasses.make_dataclass("E", ["forward_start", "forward_end", "drafter_start", "drafter_end"])(
        FakeEvent(t0), FakeEvent(t0 + 5), FakeEvent(t0 + 5.5), FakeEvent(t0 + 7))


def finish(ev):
    for e in (ev.forward_start, ev.forward_end, ev.drafter_start, ev.drafter_end):
        e.done = True


def test_pending_steps_resolve_in_order_without_waiting():
    p = PendingSteps(max_pending=3)
    steps = [fake_step(10.0 * i) for i in range(4)]
    assert [p.add(ev, i) for i, ev in enumerate(steps)] == [True, True, True, False]
    assert p.dropped == 1 and p.resolve_ready() == []
    finish(steps[1])  # a later step done first: still waits for step 0 (same stream order)
    assert p.resolve_ready() == []
    finish(steps[0])
    assert p.resolve_ready() == [(5.0, 1.5, 0), (5.0, 1.5, 1)]
    assert len(p) == 1
    finish(steps[2])
    assert [info for *_, info in p.resolve_ready()] == [2] and len(p) == 0

"""Sample (one record) and Samples (columnar): validation on construction, immutability.

Conversion from vLLM's StepTimingSample: tests/vllm/test_sample_from_vllm.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dspark_calib.errors import CalibError
from dspark_calib.fit import fit_pair
from dspark_calib.samples import SAMPLE_COLUMNS, Sample, Samples, samples_from_dicts

GOOD = dict(forward_ms=5.0, drafter_ms=1.5, num_target_tokens=8, num_reqs=8, full_cudagraph=True, context_len=8192)


def make(**changes):
    return Sample(**{**GOOD, **changes})


def test_valid_sample_and_defaults():
    s = make()
    assert s.replay == 0
    assert s.to_dict() == {**GOOD, "replay": 0}
    assert Sample(**s.to_dict()) == s


@pytest.mark.parametrize("field", ["forward_ms", "drafter_ms"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, -1e-300, -1, np.float64("nan"),
                                   np.float32("inf"), np.float32(-2.0)])
def test_rejects_non_finite_or_negative_costs(field, value):
    with pytest.raises(CalibError, match=field):
        make(**{field: value})


@pytest.mark.parametrize("field", ["forward_ms", "drafter_ms"])
@pytest.mark.parametrize("value", [True, False, np.bool_(True), "5.0", None, [1.0], b"1", 1 + 0j])
def test_rejects_non_numeric_costs(field, value):
    with pytest.raises(CalibError, match=field):
        make(**{field: value})


@pytest.mark.parametrize("field", ["forward_ms", "drafter_ms"])
@pytest.mark.parametrize("value", [0, 0.0, 3, 2.5, np.float64(2.5), np.float32(2.5), np.int64(3), 1e-300])
def test_accepts_numeric_costs_and_stores_python_floats(field, value):
    s = make(**{field: value})
    assert type(getattr(s, field)) is float
    assert getattr(s, field) == float(value)


@pytest.mark.parametrize("field", ["num_target_tokens", "num_reqs", "context_len"])
@pytest.mark.parametrize("value", [0, -1, -8192, 0.0, 2.5, 1e-3, math.nan, math.inf, True, False,
                                   np.bool_(True), "8", None, np.int64(0), np.int32(-3)])
def test_rejects_non_positive_or_non_integral_sizes(field, value):
    with pytest.raises(CalibError, match=field):
        make(**{field: value})


@pytest.mark.parametrize("field", ["num_target_tokens", "num_reqs", "context_len"])
@pytest.mark.parametrize("value", [1, 8192, 4.0, np.int64(512), np.int32(7), np.uint16(3)])
def test_accepts_integral_sizes_and_stores_python_ints(field, value):
    s = make(**{field: value})
    assert type(getattr(s, field)) is int
    assert getattr(s, field) == int(value)


@pytest.mark.parametrize("value", [-1, 1.5, True, None, "0", math.nan])
def test_rejects_bad_replay(value):
    with pytest.raises(CalibError, match="replay"):
        make(replay=value)


@pytest.mark.parametrize("value", ["yes", "True", 1, 0, 1.0, None, [True]])
def test_rejects_non_bool_full_cudagraph(value):
    with pytest.raises(CalibError, match="full_cudagraph"):
        make(full_cudagraph=value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)])
def test_accepts_bools_for_full_cudagraph(value):
    s = make(full_cudagraph=value)
    assert type(s.full_cudagraph) is bool and s.full_cudagraph == bool(value)


def test_samples_are_immutable_and_hashable():
    s = make()
    for field, value in [("forward_ms", 1.0), ("num_reqs", 2), ("full_cudagraph", False), ("replay", 1)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(s, field, value)
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
        s.extra = 1  # slots: no new attributes either
    with pytest.raises(dataclasses.FrozenInstanceError):
        del s.forward_ms
    assert s == make() and hash(s) == hash(make())
    assert s.forward_ms == 5.0


def test_samples_from_dicts_validates_every_row():
    rows = [{**GOOD, "replay": i} for i in range(3)]
    assert [s.replay for s in samples_from_dicts(rows)] == [0, 1, 2]
    with pytest.raises(CalibError, match="drafter_ms"):
        samples_from_dicts(rows + [{**GOOD, "drafter_ms": -0.5}])
    with pytest.raises(TypeError):
        samples_from_dicts([{**GOOD, "bogus": 1}])


# -- Samples: the columnar type a table holds ----------------------------------------------------
def columns(n=6, **changes):
    cols = {"context_len": [1024, 1024, 1024, 8192, 8192, 8192][:n], "replay": list(range(n)),
            "forward_ms": [5.0 + i for i in range(n)], "drafter_ms": [1.0 + i for i in range(n)],
            "num_target_tokens": [8, 16, 8, 8, 16, 8][:n], "num_reqs": [8, 16, 8, 8, 16, 8][:n],
            "full_cudagraph": [True, False, True, True, True, False][:n]}
    return {**cols, **changes}


def test_samples_round_trip_records_and_columns():
    records = [make(replay=i, num_reqs=1 + i) for i in range(4)]
    s = Samples.from_records(records)
    assert len(s) == 4 and s.records() == records
    assert {c: a.dtype for c, a in s.columns().items()} == {c: np.dtype(t) for c, t in SAMPLE_COLUMNS.items()}
    assert Samples.from_columns(s.columns()).digest() == s.digest()
    assert list(s.to_frame().columns) == list(SAMPLE_COLUMNS)


def test_samples_are_validated_once_on_construction():
    for change, word in [({"forward_ms": [math.nan, 1, 1, 1, 1, 1]}, "forward_ms"),
                         ({"drafter_ms": [-1.0, 1, 1, 1, 1, 1]}, "drafter_ms"),
                         ({"num_reqs": [0, 1, 1, 1, 1, 1]}, "num_reqs"),
                         ({"context_len": [1.5, 1, 1, 1, 1, 1]}, "context_len"),
                         ({"replay": [-1, 0, 0, 0, 0, 0]}, "replay"),
                         ({"full_cudagraph": [2, 0, 0, 0, 0, 0]}, "full_cudagraph"),
                         ({"full_cudagraph": ["yes"] * 6}, "full_cudagraph"),
                         ({"num_reqs": [1, 2]}, "num_reqs")]:
        with pytest.raises(CalibError, match=word):
            Samples.from_columns(columns(**change))
    with pytest.raises(CalibError, match="missing"):
        Samples.from_columns({"forward_ms": [1.0]})


def test_samples_columns_are_read_only():
    s = Samples.from_columns(columns())
    with pytest.raises(ValueError):
        s.forward_ms[0] = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.forward_ms = np.zeros(6)


def test_select_draft_is_what_vllms_fit_prices_the_draft_from():
    s = Samples.from_columns(columns())
    draft = s.select("draft")
    assert draft.full_cudagraph.all() and len(draft) == 4
    assert len(s.select("verify")) == len(s.select()) == 6
    at_8192 = s.select("draft", 8192)
    assert at_8192.context_len.tolist() == [8192, 8192] and at_8192.replay.tolist() == [3, 4]
    pair = fit_pair(s.select(context_len=1024))
    assert pair.draft.n.sum() == len(s.select("draft", 1024)) == 2  # the eager step at 16 is not priced
    assert pair.draft.size.tolist() == [8] and pair.verify.size.tolist() == [8, 16]
    assert s.points("draft")[0] is s.num_reqs and s.points("verify")[1] is s.forward_ms
    with pytest.raises(ValueError):
        s.select("drafts")


def test_digest_changes_with_any_value_and_order():
    s = Samples.from_columns(columns())
    base = s.digest()
    for name in SAMPLE_COLUMNS:
        cols = {c: np.array(v) for c, v in s.columns().items()}
        cols[name][0] = (not cols[name][0]) if cols[name].dtype == bool else cols[name][0] + 1
        assert Samples.from_columns(cols).digest() != base, name
    assert s.take(np.arange(6)[::-1]).digest() != base
    assert Samples.concat([s.take(slice(0, 3)), s.take(slice(3, 6))]).digest() == base

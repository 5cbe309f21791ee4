"""The Sample record: validation on construction, vLLM conversion, immutability."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.worker.gpu.async_utils import StepTimingSample

from dspark_calib.errors import CalibError
from dspark_calib.samples import VLLM_SAMPLE_FIELDS, Sample, samples_from_dicts

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


def test_from_vllm_converts_a_real_step_timing_sample():
    v = StepTimingSample(forward_ms=12.25, drafter_ms=1.75, num_target_tokens=768, num_reqs=256, full_cudagraph=False)
    s = Sample.from_vllm(v, context_len=16384, replay=3)
    assert s == Sample(12.25, 1.75, 768, 256, False, 16384, 3)
    assert tuple(f.name for f in dataclasses.fields(StepTimingSample)) == VLLM_SAMPLE_FIELDS


def test_from_vllm_validates_and_rejects_other_objects():
    with pytest.raises(CalibError, match="forward_ms"):
        Sample.from_vllm(StepTimingSample(math.nan, 1.0, 1, 1, True), context_len=8192)
    with pytest.raises(CalibError, match="num_reqs"):
        Sample.from_vllm(StepTimingSample(1.0, 1.0, 1, 0, True), context_len=8192)
    with pytest.raises(CalibError, match="not a vLLM StepTimingSample"):
        Sample.from_vllm(object(), context_len=8192)
    with pytest.raises(CalibError, match="context_len"):
        Sample.from_vllm(StepTimingSample(1.0, 1.0, 1, 1, True), context_len=0)


finite_costs = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=50, deadline=None)
@given(forward=finite_costs, drafter=finite_costs, tokens=st.integers(1, 1 << 20), reqs=st.integers(1, 4096),
       graph=st.booleans(), ctx=st.integers(1, 1 << 20), replay=st.integers(0, 1000))
def test_from_vllm_round_trips_every_valid_sample(forward, drafter, tokens, reqs, graph, ctx, replay):
    s = Sample.from_vllm(StepTimingSample(forward, drafter, tokens, reqs, graph), context_len=ctx, replay=replay)
    assert (s.forward_ms, s.drafter_ms, s.num_target_tokens, s.num_reqs, s.full_cudagraph) == (
        forward, drafter, tokens, reqs, graph)
    assert samples_from_dicts([s.to_dict()]) == [s]


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

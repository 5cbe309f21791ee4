"""Sample.from_vllm: conversion of vLLM's own StepTimingSample (needs the installed vLLM)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.worker.gpu.async_utils import StepTimingSample

from dspark_calib.errors import CalibError
from dspark_calib.samples import VLLM_SAMPLE_FIELDS, Sample, samples_from_dicts


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

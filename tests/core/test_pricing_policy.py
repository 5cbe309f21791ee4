"""The pricing policy: one value, written into observe files and read back as the engine priced."""

from __future__ import annotations

import pytest

from dspark_calib.errors import CalibError
from dspark_calib.pricing.policy import (CHUNK_RULE, CHUNK_RULE_PER_STEP, CONTEXT_AWARE, STOCK, TABLE,
                                         PricingPolicy)


@pytest.mark.parametrize("policy", [
    PricingPolicy(STOCK, 8192),
    PricingPolicy(TABLE, 16384),
    PricingPolicy(CONTEXT_AWARE, 8192, tail_milli=200, chunks=True),
    PricingPolicy(CONTEXT_AWARE, 8192, tail_milli=0, chunks=False),
    PricingPolicy(CONTEXT_AWARE, 1024, tail_milli=1000, chunks=True, chunk_rule=CHUNK_RULE_PER_STEP),
    PricingPolicy(CONTEXT_AWARE, 8192, 200, True, extrapolate_to=32768, contexts=(1024, 8192)),
])
def test_what_observe_writes_reads_back_as_the_same_policy(policy):
    assert PricingPolicy.from_metadata(policy.metadata()) == policy


def test_a_file_that_predates_a_key_reads_as_the_engines_of_its_time_priced():
    # a context-aware file before tail, chunks and the chunk rule were recorded: no tail, KV sum
    assert PricingPolicy.from_metadata({"mode": CONTEXT_AWARE, "static_context": 8192}) == \
        PricingPolicy(CONTEXT_AWARE, 8192, tail_milli=0, chunks=False, chunk_rule=CHUNK_RULE)
    # chunks by pairs, before the rule was recorded: the first (per-step) rule priced them
    old = PricingPolicy.from_metadata({"mode": CONTEXT_AWARE, "context_chunks": True})
    assert old.chunks and old.chunk_rule == CHUNK_RULE_PER_STEP


def test_other_modes_price_neither_tail_nor_chunks_whatever_the_file_says():
    p = PricingPolicy.from_metadata({"mode": STOCK, "static_context": 8192, "context_tail_milli": "junk",
                                     "context_chunks": "yes"})
    assert p == PricingPolicy(STOCK, 8192) and not p.context_aware


@pytest.mark.parametrize("meta, words", [
    ({"context_tail_milli": 1001}, "context_tail_milli=1001 (want 0..1000)"),
    ({"context_tail_milli": True}, "context_tail_milli=True"),
    ({"context_chunks": 1}, "context_chunks=1 (want true or false)"),
    ({"context_chunks": True, "context_chunk_rule": "nope"}, "context_chunk_rule='nope'"),
    ({"context_extrapolate_to": -1}, "context_extrapolate_to=-1"),
    ({"context_priced": [1024, "x"]}, "context_priced="),
])
def test_a_bad_setting_in_a_context_aware_file_is_one_line(meta, words):
    with pytest.raises(CalibError, match=None) as err:
        PricingPolicy.from_metadata({"mode": CONTEXT_AWARE, **meta})
    assert words in str(err.value) and "\n" not in str(err.value)

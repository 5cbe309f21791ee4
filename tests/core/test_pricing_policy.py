"""The pricing policy: one value, written into observe files and read back as the engine priced."""

from __future__ import annotations

import pytest

from dspark_calib.errors import CalibError
from dspark_calib.pricing.policy import (CHUNK_RULE, CHUNK_RULE_PER_STEP, CONTEXT_AWARE, STOCK, TABLE, TAIL_RULE,
                                         TAIL_RULE_LINEAR, PricingPolicy)


LINEAR = {"context_tail_rule": TAIL_RULE_LINEAR}


@pytest.mark.parametrize("policy", [
    PricingPolicy(STOCK, 8192),
    PricingPolicy(TABLE, 16384),
    PricingPolicy(CONTEXT_AWARE, 8192, tail_milli=200, chunks=True),
    PricingPolicy(CONTEXT_AWARE, 8192, tail_milli=0, chunks=False),
    PricingPolicy(CONTEXT_AWARE, 1024, tail_milli=1000, chunks=True, chunk_rule=CHUNK_RULE_PER_STEP),
    PricingPolicy(CONTEXT_AWARE, 8192, 200, True, extrapolate_to=32768, contexts=(1024, 8192)),
    PricingPolicy(CONTEXT_AWARE, 8192, 200, True, tail_rule=TAIL_RULE_LINEAR),
])
def test_what_observe_writes_reads_back_as_the_same_policy(policy):
    assert PricingPolicy.from_metadata(policy.metadata()) == policy


def test_a_file_that_predates_a_key_reads_as_the_engines_of_its_time_priced():
    # a context-aware file before tail, chunks and the chunk rule were recorded: no tail, KV sum (its tail
    # rule: the observe file's migration writes it into files before schema 1.4)
    assert PricingPolicy.from_metadata({"mode": CONTEXT_AWARE, "static_context": 8192, **LINEAR}) == \
        PricingPolicy(CONTEXT_AWARE, 8192, tail_milli=0, chunks=False, chunk_rule=CHUNK_RULE, tail_rule=TAIL_RULE_LINEAR)
    # chunks by pairs, before the rule was recorded: the first (per-step) rule priced them
    old = PricingPolicy.from_metadata({"mode": CONTEXT_AWARE, "context_chunks": True, **LINEAR})
    assert old.chunks and old.chunk_rule == CHUNK_RULE_PER_STEP


def test_other_modes_price_neither_tail_nor_chunks_whatever_the_file_says():
    p = PricingPolicy.from_metadata({"mode": STOCK, "static_context": 8192, "context_tail_milli": "junk",
                                     "context_chunks": "yes"})
    assert p == PricingPolicy(STOCK, 8192) and not p.context_aware


def test_a_context_aware_engine_records_its_tail_rule_and_a_file_without_one_is_refused():
    assert PricingPolicy(CONTEXT_AWARE, 8192, 200).metadata()["context_tail_rule"] == TAIL_RULE == "bounded"
    with pytest.raises(CalibError, match=r"context_tail_rule=None \(want one of bounded, linear\)"):
        PricingPolicy.from_metadata({"mode": CONTEXT_AWARE, "context_tail_milli": 200})


@pytest.mark.parametrize("meta, words", [
    ({"context_tail_milli": 1001}, "context_tail_milli=1001 (want 0..1000)"),
    ({"context_tail_rule": "square"}, "context_tail_rule='square' (want one of bounded, linear)"),
    ({"context_tail_milli": True}, "context_tail_milli=True"),
    ({"context_chunks": 1}, "context_chunks=1 (want true or false)"),
    ({"context_chunks": True, "context_chunk_rule": "nope"}, "context_chunk_rule='nope'"),
    ({"context_extrapolate_to": -1}, "context_extrapolate_to=-1"),
    ({"context_priced": [1024, "x"]}, "context_priced="),
])
def test_a_bad_setting_in_a_context_aware_file_is_one_line(meta, words):
    with pytest.raises(CalibError, match=None) as err:
        PricingPolicy.from_metadata({"mode": CONTEXT_AWARE, "context_tail_rule": TAIL_RULE, **meta})
    assert words in str(err.value) and "\n" not in str(err.value)


# -- coverage: the table's contexts against the engine's max_model_len ---------------------------
@pytest.mark.parametrize("contexts, max_model_len, said", [
    ((1024, 8192, 16384), 32768, "contexts 1024, 8192, 16384 of max_model_len 32768: above 16384 extrapolated on "
                                 "the line through 8192 and 16384 (context-aware)"),
    ((16000, 16384), 32768, "contexts 16000, 16384 of max_model_len 32768: above 16384 at 16384's costs "
                            "(16000 and 16384 are less than a factor 2 apart)"),
    ((1024, 8192, 40960), 40960, "contexts 1024, 8192, 40960 cover max_model_len 40960"),
    ((1024, 8192, 40928), 40960, "contexts 1024, 8192, 40928 of max_model_len 40960: above 40928 extrapolated on "
                                 "the line through 8192 and 40928 (context-aware)"),
    ((8192,), 32768, "one profiled context (8192): every context priced at its costs"),
    ((1024, 8192), None, "contexts 1024, 8192; engine max_model_len unknown"),
])
def test_coverage_says_the_contexts_against_max_model_len_and_the_rule_above(contexts, max_model_len, said):
    from dspark_calib.pricing.policy import coverage

    assert coverage(contexts, max_model_len) == said


@pytest.mark.parametrize("contexts", [(1024, 8192, 16384), (8192, 16384), (16000, 16384), (1024, 1500), (4096, 8192)])
def test_coverage_says_what_the_engines_pricing_does_above_the_longest(contexts):
    """The sentence and ContextCosts share one rule (policy.extrapolates_above): a costed context above
    the longest is on the line exactly when coverage says 'extrapolated'."""
    from dspark_calib.pricing.costs import ContextCosts
    from dspark_calib.pricing.policy import coverage
    from tests.helpers import build_reference_table

    pair = next(iter(build_reference_table().curves.values()))
    costs = ContextCosts({c: pair for c in contexts}, 256, 8192, 512, extrapolate_to=32768)
    assert costs.extrapolates_above == ("extrapolated" in coverage(contexts, 32768))

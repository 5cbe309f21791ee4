"""advise: goodput of fixed K and adaptive verification on hand-made tables, checked by hand arithmetic;
the schedule from observe files (Kaplan-Meier over the per-position counts); bad input."""

from __future__ import annotations

import pytest

from dspark_calib.advise import (Acceptance, advise, check_schedule, observed_acceptance, parse_rates, predict_observed,
                                 predict_steps)
from dspark_calib.errors import CalibError
from dspark_calib.fingerprint import ENGINE_KEYS
from dspark_calib.fit import Curve, CurvePair
from dspark_calib.observe.file import ObservedWriter, read_observed
from dspark_calib.table.model import CostTable
from tests.core.test_observe import step
from tests.helpers import build_reference_table

RATES = (0.8, 0.5, 0.2)


def curve(costs):
    """Costs at sizes 1, 2, ...: every size profiled, so vLLM's dense table is these costs exactly."""
    n = len(costs)
    nan = [float("nan")] * n
    return Curve(size=list(range(1, n + 1)), cost_ms=costs, n=[5] * n, min_ms=nan, p25_ms=nan, p75_ms=nan,
                 max_ms=nan, mad_ms=nan)


@pytest.fixture(scope="module")
def hand_table():
    """k = 3, one request at a time (max_num_seqs 1: every verify token is the one request's, so
    context-aware pricing reads each context's own table), 4 tokens a step. At 1024: drafts 1 ms,
    verify 1 + N ms; at 8192: drafts 2 ms, verify 1 + 4 N ms."""
    fp = build_reference_table().fingerprint.replace(
        num_speculative_tokens=3, max_num_seqs=1, max_num_batched_tokens=4, cudagraph_capture_sizes=(1, 2, 4),
        cudagraph_limit=4, context_lens=(1024, 8192), max_model_len=16384)
    curves = {1024: CurvePair(curve([1.0]), curve([2.0, 3.0, 4.0, 5.0])),
              8192: CurvePair(curve([2.0]), curve([5.0, 9.0, 13.0, 17.0]))}
    table = CostTable(fingerprint=fp, curves=curves, samples=None)
    table.validate()
    return table


def given(rates=RATES):
    return Acceptance(tuple(rates), "given")


def test_fixed_k_and_adaptive_by_hand(hand_table):
    a = advise(hand_table, given())
    assert a.contexts == (1024, 8192) and a.batch_sizes == (1,) and a.one_context == 8192
    c = a.cell(1, 1024)
    # fixed K: (1 + r1 + .. + rK) tokens over draft 1 + verify (1 + (1 + K)) ms
    assert [o.tokens_per_step for o in c.fixed] == pytest.approx([1.8, 2.3, 2.5])
    assert [o.step_ms for o in c.fixed] == pytest.approx([4.0, 5.0, 6.0])
    assert [o.goodput for o in c.fixed] == pytest.approx([1.8 / 4, 2.3 / 5, 2.5 / 6])
    # adaptive, priced at 1024: ratios 1/3, 1.8/4, 2.3/5, 2.5/6 -> 2 drafts, 0.46
    assert c.adaptive.drafts_per_request == 2 and c.adaptive.goodput == pytest.approx(0.46)
    # adaptive deciding with 8192's tables: 1/7, 1.8/11, 2.3/15, 2.5/19 -> 1 draft, paying 1024's 4 ms: 0.45
    assert c.one_context.drafts_per_request == 1 and c.one_context.goodput == pytest.approx(0.45)
    assert c.best_fixed.name == "K=2" and c.best.name == "adaptive" and c.advice == "adaptive"
    assert c.adaptive_vs_fixed == pytest.approx(0.0) and c.one_context_vs_fixed == pytest.approx(0.45 / 0.46 - 1)
    # at 8192: drafts 2, verify 1 + 4 N: K=1 1.8/11, K=2 2.3/15, K=3 2.5/19; adaptive (either pricing): 1 draft
    c = a.cell(1, 8192)
    assert [o.goodput for o in c.fixed] == pytest.approx([1.8 / 11, 2.3 / 15, 2.5 / 19])
    assert c.adaptive.goodput == c.one_context.goodput == pytest.approx(1.8 / 11)
    assert [x.context_len for x in a.losses(one_context=True)] == [1024] and a.losses() == []


def test_a_fixed_k_is_advised_only_past_the_minimum_gain(hand_table):
    """vLLM's one-chunk logit limit 2^30 / (4 V): V = 2^27 leaves 2 logits, one bonus token and one
    draft, so adaptive stops at 0.45 where K=2 makes 0.46: a 2.2 % gain."""
    a = advise(hand_table, given(), contexts=[1024], vocab_size=1 << 27)
    c = a.cell(1, 1024)
    assert a.max_total_logits == 2 and c.adaptive.drafts_per_request == 1
    assert c.adaptive_vs_fixed == pytest.approx(0.45 / 0.46 - 1) and c.advice == "K=2" and c.best.name == "K=2"
    assert advise(hand_table, given(), contexts=[1024], vocab_size=1 << 27, min_gain=0.05).cell(1, 1024).advice \
        == "adaptive"


def test_the_result_as_json_holds_tokens_and_costs_per_option(hand_table):
    d = advise(hand_table, given(), contexts=[1024]).to_dict()
    assert d["acceptance"] == {"rates": list(RATES), "source": "given", "tokens_per_step_all_drafts": 2.5}
    (cell,) = d["cells"]
    assert [o["name"] for o in cell["fixed"]] == ["K=1", "K=2", "K=3"]
    assert cell["fixed"][1] == pytest.approx({"name": "K=2", "drafts_per_request": 2.0, "tokens_per_step": 2.3,
                                              "draft_ms": 1.0, "verify_ms": 4.0, "step_ms": 5.0,
                                              "goodput_per_ms": 0.46})
    assert cell["adaptive"]["name"] == "adaptive" and cell["adaptive_one_context"]["name"] == "adaptive@8192"
    assert cell["advice"] == "adaptive" and d["losses"]["adaptive"] == {"cells": 0, "worst": None}
    assert d["losses"]["adaptive_one_context"]["worst"]["pct"] == pytest.approx(100 * (0.45 / 0.46 - 1))


@pytest.mark.parametrize("rates, why", [((0.8, 0.5), "2 rates, the table's num_speculative_tokens is 3"),
                                        ((0.8, 0.5, 0.6), "rate 3 (0.6) is above rate 2 (0.5)"),
                                        ((1.2, 0.5, 0.2), "1.2 is not a rate in [0, 1]"),
                                        ((0.8, float("nan"), 0.2), "nan is not a rate"),
                                        ((0.8, 0.5, -0.1), "-0.1 is not a rate")])
def test_bad_schedules_are_one_line(rates, why):
    with pytest.raises(CalibError, match=__import__("re").escape(why)):
        check_schedule(rates, 3)


def test_rates_parse_or_say_what_they_want():
    assert parse_rates("0.9, 0.8,0.7") == (0.9, 0.8, 0.7)
    for bad in ("0.9;0.8", "", "x"):
        with pytest.raises(CalibError, match="--acceptance"):
            parse_rates(bad)


def test_limits_the_table_cannot_model_are_one_line(hand_table):
    with pytest.raises(CalibError, match="--max-num-seqs 2: the table prices batches of 1..1 requests"):
        advise(hand_table, given(), max_num_seqs=2)
    with pytest.raises(CalibError, match="--context 16381: a request there cannot hold 4 more tokens"):
        advise(hand_table, given(), contexts=[16381])


# -- acceptance from observe files -----------------------------------------------------------
def engine_of(table, **changes):
    """The engine keys an observe file records (describe_engine), as a table's own engine reports them."""
    d = table.fingerprint.to_dict()
    return {**{k: d[k] for k in ENGINE_KEYS if d.get(k) is not None}, **changes}


def observed_dir(tmp_path, table, rows, *, engine=None, name="a"):
    meta = {} if engine is False else {"engine": engine or engine_of(table)}
    with ObservedWriter(tmp_path / name, metadata=meta, name=name) as w:
        for i, (graded, accepted) in enumerate(rows):
            w.append(step(i, position_graded=graded, position_accepted=accepted))
    return tmp_path / name


def test_the_schedule_from_observe_files_is_the_product_of_per_position_ratios(tmp_path, hand_table):
    """Kaplan-Meier: position 1 accepted 12 of 16, position 2 6 of 10 graded, position 3 1 of 4:
    0.75, 0.75 x 0.6, 0.75 x 0.6 x 0.25 (a step recording nothing counts for nothing)."""
    d = observed_dir(tmp_path, hand_table, [((8, 6, 2), (6, 3, 1)), ((8, 4, 2), (6, 3, 0)), ((0, 0, 0), (0, 0, 0))])
    acc = observed_acceptance(hand_table, read_observed([d]))
    assert acc.rates == pytest.approx((0.75, 0.45, 0.1125))
    assert (acc.graded, acc.accepted, acc.steps, acc.source) == ((16, 10, 4), (12, 6, 1), 2, "observed")


def test_observe_files_of_another_engine_are_refused_naming_the_file(tmp_path, hand_table):
    d = observed_dir(tmp_path, hand_table, [((8, 6, 2), (6, 3, 1))], engine=engine_of(hand_table, gpu_name="NVIDIA B200"))
    with pytest.raises(CalibError, match="observed on another engine than the table's fingerprint: gpu_name") as err:
        observed_acceptance(hand_table, read_observed([d]))
    assert str(d) in str(err.value)


def test_observe_files_without_acceptance_are_refused(tmp_path, hand_table):
    d = observed_dir(tmp_path, hand_table, [((8, 6, 2), (6, 3, 1))], engine=False)
    with pytest.raises(CalibError, match="records no engine fingerprint"):
        observed_acceptance(hand_table, read_observed([d]))
    with ObservedWriter(tmp_path / "none", metadata={"engine": engine_of(hand_table)}) as w:
        w.append(step(0))
    with pytest.raises(CalibError, match="record no draft acceptance"):
        observed_acceptance(hand_table, read_observed([tmp_path / "none"]))


def test_a_position_never_graded_is_refused(tmp_path, hand_table):
    d = observed_dir(tmp_path, hand_table, [((8, 6, 0), (6, 3, 0))])
    with pytest.raises(CalibError, match="no draft at position 3 was ever graded"):
        observed_acceptance(hand_table, read_observed([d]))


def test_a_k_that_does_not_fit_the_token_budget_is_no_option(hand_table):
    """max_num_batched_tokens 3: one request fits 2 drafts, so K=3 is no option and adaptive schedules 2."""
    import dataclasses

    small = dataclasses.replace(hand_table, fingerprint=hand_table.fingerprint.replace(max_num_batched_tokens=3))
    c = advise(small, given(), contexts=[1024]).cell(1, 1024)
    assert c.fixed[2] is None and c.best_fixed.name == "K=2" and c.adaptive.drafts_per_request == 2
    assert advise(small, given(), contexts=[1024]).to_dict()["cells"][0]["fixed"][2] is None


# -- goodput over a mix of decode steps ------------------------------------------------------
STEPS = ([1, 1, 1], [1024, 1024, 8192])  # two steps at 1024, one at 8192


def test_a_step_mix_sums_tokens_and_time_over_its_steps_by_hand(hand_table):
    mix = predict_steps(hand_table, given(), *STEPS)
    assert mix.steps == 3 and mix.requests == 3 and mix.context_mean == pytest.approx((2 * 1024 + 8192) / 3)
    got = {o.name: (o.tokens, o.ms) for o in mix.options}
    # fixed K: per step 1 + r1..rK tokens; 1024 costs 1 + (2 + K) ms, 8192 costs 2 + (1 + 4 (1 + K)) ms
    assert got["K=1"] == pytest.approx((3 * 1.8, 4 + 4 + 11))
    assert got["K=2"] == pytest.approx((3 * 2.3, 5 + 5 + 15))
    assert got["K=3"] == pytest.approx((3 * 2.5, 6 + 6 + 19))
    # adaptive: 2 drafts at 1024 (2.3 tokens, 5 ms), 1 at 8192 (1.8, 11 ms)
    assert got["adaptive"] == pytest.approx((2.3 + 2.3 + 1.8, 5 + 5 + 11))
    assert mix.option("adaptive").drafts == 5
    # deciding with 8192's tables: 1 draft everywhere, each step paying its own context
    assert got["adaptive@8192"] == pytest.approx((3 * 1.8, 4 + 4 + 11))
    # the goodput is total tokens over total time, not the mean of the steps' goodputs
    assert mix.option("adaptive").goodput == pytest.approx(6.4 / 21)
    assert mix.ratio("adaptive") == pytest.approx((6.4 / 21) / (5.4 / 19))
    assert mix.ratio("adaptive@8192") == 1.0 and mix.ratio("K=9") is None


def test_the_one_context_adaptive_decides_with_is_a_setting(hand_table):
    """Deciding with 1024's tables: 2 drafts everywhere, the 8192 step then paying 2 + 1 + 4 x 3 ms."""
    mix = predict_steps(hand_table, given(), *STEPS, one_context=1024)
    assert mix.one_context_name == "adaptive@1024"
    assert (mix.option("adaptive@1024").tokens, mix.option("adaptive@1024").ms) == pytest.approx((6.9, 25))


def test_one_step_is_advise_s_cell(hand_table):
    cell = advise(hand_table, given(), contexts=[8192]).cell(1, 8192)
    mix = predict_steps(hand_table, given(), [1], [8192])
    for o in (*cell.fixed, cell.adaptive, cell.one_context):
        assert mix.option(o.name).goodput == pytest.approx(o.goodput)


def test_a_k_that_does_not_fit_some_step_is_no_option_of_the_mix(hand_table):
    import dataclasses

    small = dataclasses.replace(hand_table, fingerprint=hand_table.fingerprint.replace(max_num_batched_tokens=3))
    mix = predict_steps(small, given(), *STEPS)
    assert [o.name for o in mix.options] == ["K=1", "K=2", "adaptive", "adaptive@8192"]
    d = mix.to_dict()
    assert [o["name"] for o in d["options"]] == ["K=1", "K=2", "adaptive", "adaptive@8192"]
    assert d["options"][3]["vs_one_context"] == 1.0 and d["goodput_unit"] == "tokens/ms"


@pytest.mark.parametrize("steps, why", [(([1, 1], [1024]), "2 batch sizes and 1 contexts"),
                                        (([], []), "no decode steps"),
                                        (([2], [1024]), "a step of 2 requests: the table prices batches of 1..1"),
                                        (([1], [float("nan")]), "finite and >= 0")])
def test_steps_the_table_cannot_model_are_one_line(hand_table, steps, why):
    with pytest.raises(CalibError, match=__import__("re").escape(why)):
        predict_steps(hand_table, given(), *steps)


def one_request(i, context, **kw):
    """A decode step of the hand table's engine: one request, 3 drafts scheduled, 2 verified."""
    return step(i, **{**dict(num_reqs=1, context_mean=float(context), context_max=context, context_sum=context,
                             scheduled_drafts=3, draft_budget=2, num_target_tokens=3, budget_context_aware=2), **kw})


def test_observed_steps_are_modelled_by_their_decode_steps(tmp_path, hand_table):
    """Two decode steps at 1024, one at 8192, a step carrying a prefill chunk (4 tokens: 2 non-draft) and
    one without drafts: the mix is STEPS' exactly."""
    rows = [one_request(0, 1024), one_request(1, 8192), one_request(2, 1024),
            one_request(3, 1024, num_target_tokens=4), one_request(4, 1024, scheduled_drafts=0, draft_budget=0,
                                                                   num_target_tokens=1, budget_context_aware=0)]
    with ObservedWriter(tmp_path / "o", metadata={"engine": engine_of(hand_table)}, name="o") as w:
        for r in rows:
            w.append(r)
    mix = predict_observed(hand_table, given(), read_observed([tmp_path / "o"]))
    assert mix.to_dict() == predict_steps(hand_table, given(), *STEPS).to_dict()


def test_observed_steps_of_another_engine_or_without_decode_steps_are_refused(tmp_path, hand_table):
    with ObservedWriter(tmp_path / "a", metadata={"engine": engine_of(hand_table, tensor_parallel_size=2)},
                        name="a") as w:
        w.append(one_request(0, 1024))
    with pytest.raises(CalibError, match="observed on another engine"):
        predict_observed(hand_table, given(), read_observed([tmp_path / "a"]))
    with ObservedWriter(tmp_path / "b", metadata={}, name="b") as w:  # no engine recorded: steps still usable
        w.append(one_request(0, 1024, num_target_tokens=4))
    with pytest.raises(CalibError, match="record no decode step with drafts"):
        predict_observed(hand_table, given(), read_observed([tmp_path / "b"]))

"""benchmarks/serving/ab_advise.py: advise's prediction beside an A/B's measurement, by hand."""

import json
from pathlib import Path

import pytest

from dspark_calib.advise import ADAPTIVE, Acceptance, predict_steps
from dspark_calib.table.file import read_table

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "profiles" / "h200" / "qwen3-8b__eagle3-qwen3-8b__tp1__nvidia-h200__81458b2ae409.parquet"
RATES = [0.9, 0.8, 0.7, 0.55, 0.4, 0.3, 0.2]


@pytest.fixture()
def ab(sc, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "serving"))
    import ab_advise

    return ab_advise


def test_expected_tokens_spread_the_drafts_position_by_position(ab):
    # 3 drafts over 2 requests: one verifies 2 (1 + 0.9 + 0.8), the other 1 (1 + 0.9)
    assert ab.expected_tokens(2, 3, [0.9, 0.8, 0.7]) == pytest.approx(2 + 1.7 + 0.9)
    assert ab.expected_tokens(4, 0, [0.9, 0.8]) == 4  # nothing verified: the bonus token each
    assert ab.expected_tokens(1, 2, [0.9, 0.8]) == pytest.approx(2.7)  # every draft
    assert ab.expected_tokens(3, 6, [0.5, 0.25]) == pytest.approx(3 * 1.75)


def test_decode_steps_pair_each_call_with_its_own_length_and_keep_all_decode_calls_only(ab):
    raw = {"interval_ms": [None, 10.0, 20.0, 30.0, 40.0],
           "num_tokens": [4096, 16, 24, 16, 16],  # a prefill, two requests x 8, three x 8, ...
           "num_reqs": [4, 2, 3, 2, 2],
           "forward_tokens": [4096, 9, 24, None, 16]}
    # call 0 prefills; call 1 (2 x 8) forwarded 9 (7 drafts) and lasted until call 2 (20 ms);
    # call 2 lasted 30 ms; call 3 has no forward count; call 4 has no successor
    assert ab.decode_steps(raw, 7) == [(2, 7, 20.0), (3, 21, 30.0)]


def _turn(wall_s, tok_s, steps):
    """A turn's summary entry and its per-step file from (requests, drafts, ms) decode steps, after
    one prefill call of 100 ms."""
    interval = [None, 100.0] + [ms for _, _, ms in steps] + [None]
    return ({"wall_s": wall_s, "output_tok_s": tok_s},
            {"interval_ms": interval[:-1],
             "num_tokens": [8192] + [r * 8 for r, _, _ in steps],
             "num_reqs": [8] + [r for r, _, _ in steps],
             "forward_tokens": [8192] + [r + d for r, d, _ in steps]})


SPEC = {"name": "w", "prompt_lens": [1024, 8192], "concurrency": 16, "num_requests": 32, "output_len": 256}
STOCK = [(16, 48, 12.0), (16, 48, 12.0), (8, 24, 10.0)]


def _ab_arm(tmp_path):
    """An A/B arm "a" of one workload "w": stock turns of STOCK's steps, table turns of 7 drafts a request."""
    table = [(16, 112, 13.0), (8, 56, 11.0)]
    turns = {"stock1": _turn(2.0, 1000.0, STOCK), "table1": _turn(1.8, 1100.0, table),
             "table2": _turn(1.8, 1120.0, table), "stock2": _turn(2.0, 990.0, STOCK)}
    summary = {"workloads": {f"w@{t}": {**s, "workload": {**SPEC, "name": f"w@{t}"}} for t, (s, _) in turns.items()}}
    steps = {f"w@{t}": raw for t, (_, raw) in turns.items()}
    (tmp_path / "context-a.json").write_text(json.dumps(summary))
    (tmp_path / "context-a-steps.json").write_text(json.dumps(steps))


def test_analyse_by_hand(ab, tmp_path):
    _ab_arm(tmp_path)

    (row,) = ab.analyse(str(tmp_path), "a", str(TABLE), RATES)
    assert row["workload"] == "w" and row["context_modelled"] == (1024 + 8192) / 2 + 128
    s1 = row["turns"]["stock1"]
    assert (s1["decode_steps"], s1["decode_ms"]) == (3, 34.0)
    stock_tokens = 16 * (1 + sum(RATES[:3])) * 2 + 8 * (1 + sum(RATES[:3]))
    table_tokens = 16 * (1 + sum(RATES)) + 8 * (1 + sum(RATES))
    assert s1["decode_tokens"] == pytest.approx(stock_tokens, abs=0.05)
    assert row["drafts_measured"] == {"table": 7.0, "stock": 3.0}
    assert (s1["mean_requests"], s1["full_batch_share"]) == (round(40 / 3, 2), round(2 / 3, 3))
    assert row["mean_requests"] == {"table": 12.0, "stock": round(40 / 3, 2)}
    # each turn's steps against the model's at their batch size under the turn's own pricing
    tab = read_table(str(TABLE), samples=False)
    at = {n: predict_steps(tab, Acceptance(tuple(RATES), "given"), [n], [row["context_modelled"]]) for n in (8, 16)}
    one = {n: m.option(m.one_context_name).ms for n, m in at.items()}
    aware = {n: m.option(ADAPTIVE).ms for n, m in at.items()}
    assert s1["step_vs_model"]["median"] == pytest.approx(sorted([12 / one[16], 12 / one[16], 10 / one[8]])[1],
                                                          abs=1e-4)
    assert s1["step_vs_model"]["total"] == pytest.approx(34 / (2 * one[16] + one[8]), abs=1e-4)
    assert row["turns"]["table1"]["step_vs_model"]["median"] == pytest.approx((13 / aware[16] + 11 / aware[8]) / 2,
                                                                              abs=1e-4)
    g = row["decode_goodput_ratio"]
    assert g["measured"] == pytest.approx((table_tokens / 24.0) / (stock_tokens / 34.0))
    assert g["noise"] == 0.0
    mix = predict_steps(read_table(str(TABLE), samples=False), Acceptance(tuple(RATES), "given"),
                        [16, 16, 8] * 2, [row["context_modelled"]] * 6)
    predicted = mix.option(ADAPTIVE).goodput / mix.option(mix.one_context_name).goodput
    assert g["predicted"] == pytest.approx(predicted)
    # the table's own batch sizes (16 and 8, once each per table turn) against stock's pricing on them
    own = predict_steps(tab, Acceptance(tuple(RATES), "given"), [16, 8, 16, 8], [row["context_modelled"]] * 4)
    assert g["predicted_own_batches"] == pytest.approx(own.option(ADAPTIVE).goodput / mix.option(mix.one_context_name).goodput)
    t = row["tok_s_ratio"]
    assert t["measured"] == pytest.approx(1110.0 / 995.0)
    assert t["noise"] == pytest.approx(1120.0 / 1100.0 - 1)  # the larger of the two pricings' spreads
    assert t["predicted"] == pytest.approx(2000.0 / (2000.0 - 34.0 + 34.0 / predicted))
    assert row["decode_share_stock"] == pytest.approx(0.017)
    assert "| w |" in ab.markdown([row])


def test_a_workload_missing_a_turn_is_left_out(ab, tmp_path):
    summary = {"workloads": {"w@stock1": {"wall_s": 1.0, "output_tok_s": 1.0, "workload": {}}}}
    (tmp_path / "context-a.json").write_text(json.dumps(summary))
    (tmp_path / "context-a-steps.json").write_text(json.dumps({}))
    assert ab.analyse(str(tmp_path), "a", str(TABLE), RATES) == []


def test_a_fixed_k_arm_beside_the_ab_by_hand(ab, tmp_path):
    _ab_arm(tmp_path)
    fixed_dir = tmp_path / "fixed"
    fixed_dir.mkdir()
    summary, raw = _turn(1.9, 1050.0, [(16, 112, 14.0), (8, 56, 12.0)])
    engine = {"speculative_config": {"enable_adaptive_verification": False, "num_speculative_tokens": 7,
                                     "synthetic_acceptance_rates": RATES}}
    (fixed_dir / "context-f.json").write_text(json.dumps({"engine": engine, "workloads": {"w": {**summary, "workload": SPEC}}}))
    (fixed_dir / "context-f-steps.json").write_text(json.dumps({"w": raw}))
    # an arm that is not fixed K at this schedule is refused in one line
    with pytest.raises(SystemExit, match="not fixed K=7 .*adaptive verification False, K 7, rates"):
        ab.fixed_arm(str(fixed_dir), "f", RATES[:-1] + [0.1])
    fixed = ab.fixed_arm(str(fixed_dir), "f", RATES)
    every = 1 + sum(RATES)  # a request verifying all 7 drafts
    assert fixed["w"]["decode_goodput"] == pytest.approx(24 * every / 26.0)

    (row,) = ab.analyse(str(tmp_path), "a", str(TABLE), RATES, fixed)
    f = row["fixed"]
    stock_goodput = (16 * (1 + sum(RATES[:3])) * 2 + 8 * (1 + sum(RATES[:3]))) / 34.0
    assert f["k"] == 7
    assert f["decode_goodput_ratio_vs_stock"]["measured"] == pytest.approx((24 * every / 26.0) / stock_goodput)
    assert f["tok_s_ratio_vs_stock"]["measured"] == pytest.approx(1050.0 / 995.0)
    assert f["tok_s_table_over_fixed"]["measured"] == pytest.approx(1110.0 / 1050.0)
    # predicted on the stock turns' batch sizes: advise's K=7 over its adaptive@8192, made whole-workload
    mix = predict_steps(read_table(str(TABLE), samples=False), Acceptance(tuple(RATES), "given"),
                        [16, 16, 8] * 2, [row["context_modelled"]] * 6)
    kfix = mix.option("K=7").goodput / mix.option(mix.one_context_name).goodput
    assert f["decode_goodput_ratio_vs_stock"]["predicted"] == pytest.approx(kfix)
    assert f["tok_s_ratio_vs_stock"]["predicted"] == pytest.approx(2000.0 / (2000.0 - 34.0 + 34.0 / kfix))
    assert f["tok_s_table_over_fixed"]["predicted"] == pytest.approx(
        row["tok_s_ratio"]["predicted"] / f["tok_s_ratio_vs_stock"]["predicted"])
    assert "| w (K=7) |" in ab.markdown([row])
    # without a fixed arm the row has none, and the markdown no fixed-K table
    (plain,) = ab.analyse(str(tmp_path), "a", str(TABLE), RATES)
    assert "fixed" not in plain and "fixed K" not in ab.markdown([plain])

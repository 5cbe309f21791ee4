"""benchmarks/serving/wave_pricing.py: FA3's tile rounds, by hand, and the wave-aware price of served
decode verifies on committed H200 runs (f chosen on one arm's workload, the rest held out)."""

import json

import numpy as np
import pytest

from tests.benchmarks.conftest import REPO, load_scripts

RESULTS = REPO / "benchmarks" / "results" / "h200"
SHIPPED = REPO / "profiles" / "h200" / "qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"
HW = {"kv_heads": 8, "sms": 132, "block_n": 128, "max_splits": 32}


@pytest.fixture(scope="module")
def wp(sc):  # noqa: ARG001 - serve_context imported first, as the scripts import it
    return load_scripts("judge_tables", "wave_pricing")


def test_the_rounds_follow_fa3s_split_rule_by_hand(wp):
    ctx = np.full(4, 12800.0)  # 100 blocks of 128 tokens
    reqs = np.array([18, 32, 14, 8])
    got = wp.rounds_over_ideal(reqs, ctx, 1.0, **HW)
    # 18 requests: 1.1 x 1800 x 8 / 132 -> 120 blocks an SM, no split: 144 tiles, 2 rounds of 100 blocks
    # over an ideal of 18 x 100 x 8 / 132 = 109.1
    assert got[0] == pytest.approx(200 / (1800 * 8 / 132))
    assert got[1] == pytest.approx(200 / (3200 * 8 / 132))  # 256 tiles: 2 rounds, nearly full
    # 14 requests: 94 blocks an SM, so 2 splits of 50 blocks: 224 tiles, 2 rounds of 50
    assert got[2] == pytest.approx(100 / (1400 * 8 / 132))
    # 8 requests: 54 an SM, 2 splits: 128 tiles in one round of 50 blocks
    assert got[3] == pytest.approx(50 / (800 * 8 / 132))
    # a partial last round costs max(k / SMs, 1 / f) of a full one: 12 of 132 tiles at f = 2 -> 0.5
    assert wp.rounds_over_ideal(reqs[:1], ctx[:1], 2.0, **HW)[0] == pytest.approx(150 / (1800 * 8 / 132))
    # f that large: the partial round costs its share, the ideal
    assert wp.rounds_over_ideal(reqs[:1], ctx[:1], 1e9, **HW)[0] == pytest.approx((1 + 12 / 132) / (1800 * 8 / 132) * 100)


def test_requests_of_their_own_lengths_by_hand_and_equal_ones_as_the_mean(wp):
    for n in (1, 8, 14, 18, 32, 40, 256):
        equal = wp.rounds_over_ideal_lengths(np.full(n, 12800.0), 1.8, **HW)
        assert equal == pytest.approx(wp.rounds_over_ideal(np.array([n]), np.array([12800.0]), 1.8, **HW)[0])
    # 16 requests of 12800 (100 blocks) and 16 of 1280 (10): 1760 blocks, 118 an SM: no split;
    # 256 tiles, the 128 long ones first: round 1 (132 tiles) as long as 100 blocks, round 2 (124
    # tiles, part full: max(124 / 132, 1 / 2)) as long as its longest, 10
    lengths = np.array([12800.0] * 16 + [1280.0] * 16)
    assert wp.rounds_over_ideal_lengths(lengths, 2.0, **HW) == pytest.approx((100 + 10 * 124 / 132) / (1760 * 8 / 132))
    # the recorded order statistics stand for the requests: 9 values for 32 requests, linear between
    q = np.array([1280, 1280, 1280, 1280, 1280, 12800, 12800, 12800, 12800])
    got = wp.request_lengths(q, 32)
    assert len(got) == 32 and got[0] == 1280 and got[-1] == 12800 and got[15] == 1280 and got[20] == 12800


def test_a_step_that_recorded_its_lengths_is_priced_by_them(wp):
    from dspark_calib.observe.step import ABSENT

    d = {"priced": np.array([10.0, 10.0]), "at_zero": np.array([4.0, 4.0]), "num_reqs": np.array([32, 32]),
         "context": np.array([7040.0, 7040.0]), "profile_reqs": np.array([32, 32]),
         "profile_context": np.array([7040.0, 7040.0]),
         "quantiles": np.array([[ABSENT] * 9, [1280] * 5 + [12800] * 4])}
    priced = wp.wave_price(d, 2.0, **HW)
    assert priced[0] == pytest.approx(10.0)  # the mean, and the profile's shape at it: as priced
    # the long requests' tiles set the rounds: dearer than 32 requests at the mean
    assert priced[1] > 10.5


def test_f_is_chosen_on_the_decide_workload_and_the_held_out_shape_residual_falls(wp, tmp_path):
    """The serving-state run's stock arm decides f on ctx3k; its ctx12k / mix steps and the 0742
    run's stock arm are held out: their 8192-16383 decode verifies of 0.5-0.9 of R(N) requests,
    priced 5.8-8.2 % low by the shipped table, come within 1 % (median and bias)."""
    out = tmp_path / "w.json"
    argv = ["--arm", "A", str(RESULTS / "2026-12-02-1524-serving-state" / "arms"), "stock", str(SHIPPED),
            "--arm", "D", str(RESULTS / "2026-12-01-0742-context"), "stock", str(SHIPPED),
            "--decide", "A:ctx3k", "--json", str(out), "--md", str(tmp_path / "w.md")]
    assert wp.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["decide"]["workloads"] == ["ctx3k"] and doc["decide"]["steps"] == 187
    assert 1.0 < doc["decide"]["f"] < 4.0
    rows = {(r["arm"], r["context_bucket"], r["fill_bucket"]): r for r in doc["rows"]}
    assert ("A", "2048-4095", "all") not in rows  # the decide steps are not reported as held out
    for arm in ("A", "D"):
        r = rows[(arm, "8192-16383", "0.5-0.9")]
        assert r["steps"] >= 30 and r["priced"]["median_signed_pct"] < -5
        assert r["wave_aware"]["median_pct"] < 1.0 and abs(r["wave_aware"]["median_signed_pct"]) < 1.0
        same = rows[(arm, "8192-16383", ">0.9")]  # the profile's own shape: the model leaves it as priced
        assert same["wave_aware"] == same["priced"]
    # the cause, with nothing chosen: the less full the served step's rounds, the lower its price
    fills = {r["round_fill"]: r for r in doc["by_round_fill"] if (r["arm"], r["context_bucket"]) == ("A", "8192-16383")}
    assert fills["0.6-0.75"]["priced"]["median_signed_pct"] < -5 < fills[">=0.9"]["priced"]["median_signed_pct"]
    assert "wave-aware" in (tmp_path / "w.md").read_text()


def test_bad_input_is_one_line_and_exit_2(wp, tmp_path, capsys):
    run = str(RESULTS / "2026-12-01-0742-context")
    assert wp.main(["--arm", "D", run, "stock", str(tmp_path / "none.parquet"), "--decide", "D:ctx1k"]) == 2
    assert wp.main(["--arm", "D", run, "stock", str(SHIPPED), "--decide", "X:ctx1k"]) == 2
    assert wp.main(["--arm", "D", run, "stock", str(SHIPPED), "--decide", "D:ctx3k"]) == 2
    assert wp.main(["--arm", "D", run, "stock", str(SHIPPED), "--decide", "D"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and "none.parquet" in err[0] and "not one of the --arm names" in err[1]
    assert "ctx3k" in err[2] and "--decide NAME:WORKLOAD" in err[3]

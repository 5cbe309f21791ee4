"""benchmarks/serving/shape_pricing.py: served decode verifies priced with a second, uniform-decode
shape beside the profile's, on a committed H200 run, against shape samples made by hand."""

import json

import numpy as np
import pytest

from tests.benchmarks.conftest import REPO, load_scripts

RUN = REPO / "benchmarks" / "results" / "h200" / "2026-12-02-1524-serving-state"
TABLE = RUN / "tables" / "startup.parquet"
SIZES = [8, 16, 32, 64, 128, 256, 512, 1024, 2048]


@pytest.fixture(scope="module")
def sp(sc):  # noqa: ARG001 - serve_context imported first, as the scripts import it
    return load_scripts("judge_tables", "shape_pricing")


def capture_of(scale=1.0, q=8):
    """Shape samples as the KV-sum rule prices them (N / q requests of context L read N x L / q
    KV tokens: the profile shape at context L / q), times `scale`; three replays a size."""
    from dspark_calib.pricing.costs import ContextCosts
    from dspark_calib.table.file import read_table

    costs = ContextCosts.from_table(read_table(str(TABLE)))
    samples = []
    for ctx in (1024, 8192, 16384):
        for n in SIZES:
            ms = float(costs.at(max(ctx // q, 1)).verify[n]) * scale
            samples += [{"context_len": ctx, "num_target_tokens": n, "num_reqs": n // q, "forward_ms": ms + d,
                         "replay": r} for r, d in enumerate((-0.01, 0.0, 0.01))]
    return {"shape_samples": samples}


def test_shape_curves_take_the_median_and_refuse_a_capture_without_one_shape(sp):
    q, curves = sp.shape_curves(capture_of())
    assert q == 8 and sorted(curves) == [1024, 8192, 16384] and sorted(curves[1024]) == SIZES
    with pytest.raises(ValueError, match="no shape_samples"):
        sp.shape_curves({"samples": []})
    mixed = capture_of()
    mixed["shape_samples"][0] = {**mixed["shape_samples"][0], "num_reqs": 2}
    with pytest.raises(ValueError, match="mix tokens per request"):
        sp.shape_curves(mixed)


def test_the_shape_price_interpolates_by_hand_and_the_blend_follows_tokens_a_request(sp):
    curves = {1000: {8: 1.0, 16: 3.0}, 3000: {8: 5.0, 16: 7.0}}
    got = sp.shape_price(curves, np.array([12.0, 8.0, 16.0, 32.0]), np.array([2000.0, 1000.0, 5000.0, 2000.0]))
    assert got[:3] == pytest.approx([4.0, 1.0, 11.0])  # mid-mid; a corner; the two contexts' line past 3000
    assert np.isnan(got[3])  # above the measured sizes
    profile = np.array([10.0, 10.0, 10.0, 10.0])
    # 8 tokens over 8, 2 and 1 requests (t = 1, 4, 8 of q = 8), and a size the curve lacks
    out = sp.two_shapes(profile, curves, 8, np.array([8, 2, 1, 1]), np.array([8, 8, 8, 32]),
                        np.array([8 * 250, 2 * 1000, 1000, 32 * 100]))
    # t = 4: w = 3/7 of the uniform shape at 8 x 2000 / 8 = 2000 (3.0); t = 8: all of it at 1000 (1.0)
    assert out == pytest.approx([10.0, 10.0 * 4 / 7 + 3.0 * 3 / 7, 1.0, 10.0])


def test_a_shape_the_kv_rule_prices_right_changes_little_and_a_slower_one_shows_on_drafting_steps(sp, tmp_path):
    """Shape samples exactly at the KV rule's price: the two pricings agree within the context
    interpolation; 20 % slower: the steps verifying several tokens a request are priced higher."""
    def rows(scale):
        return {(r["part"], r["context_bucket"], r["fill_bucket"]): r
                for r in sp.compare(capture_of(scale), str(TABLE), str(RUN / "arms"), "aware-tail20-chunks",
                                    {"ctx3k"})["rows"]}

    same, slower = rows(1.0), rows(1.2)
    key = ("held_out", "8192-16383", "<=0.5")  # the context-aware arm verifies several drafts a request
    assert same[key]["steps"] == slower[key]["steps"] > 20
    assert abs(same[key]["two_shapes"]["median_signed_pct"] - same[key]["profile_shape"]["median_signed_pct"]) < 3
    assert slower[key]["two_shapes"]["median_signed_pct"] > same[key]["two_shapes"]["median_signed_pct"] + 5
    # the profile shape's price is validate's own, whatever the shape samples say
    assert slower[key]["profile_shape"] == same[key]["profile_shape"]
    md = tmp_path / "s.md"
    assert sp.main([str(tmp_path / "cap.json"), str(TABLE), str(RUN / "arms"), "aware-tail20-chunks",
                    "--decide", "ctx3k"]) == 2  # no such capture: one line, exit 2
    (tmp_path / "cap.json").write_text(json.dumps(capture_of()))
    assert sp.main([str(tmp_path / "cap.json"), str(TABLE), str(RUN / "arms"), "aware-tail20-chunks",
                    "--decide", "ctx3k", "--md", str(md)]) == 0
    assert "| 8192-16383 | <=0.5 |" in md.read_text() and "Held out:" in md.read_text()

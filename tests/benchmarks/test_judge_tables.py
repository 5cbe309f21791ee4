"""benchmarks/serving/judge_tables.py: tables judged on an arm's steps split into decide and held-out
workloads, on a committed H200 run (the shipped tp 1 table's own serving run)."""

import json

import pytest

from tests.benchmarks.conftest import REPO, load_scripts

RUN = REPO / "benchmarks" / "results" / "h200" / "2026-12-01-0742-context"
SHIPPED = REPO / "profiles" / "h200" / "qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"
DRAFT_TABLE = REPO / "profiles" / "h200" / "qwen3-8b__qwen3-0.6b__tp1__nvidia-h200__a9f289a525a3.parquet"


@pytest.fixture(scope="module")
def jt(sc):  # noqa: ARG001 - serve_context imported first, as the script imports it
    return load_scripts("judge_tables")


def test_the_held_out_part_is_the_other_workloads_and_validate_prices_each_part(jt, tmp_path):
    from dspark_calib.observe.file import ObservedSteps, read_observed
    from dspark_calib.table.file import read_table
    from dspark_calib.validate import AWARE, validate

    out = tmp_path / "j.json"
    assert jt.main([str(RUN), "stock", "--table", f"shipped={SHIPPED}", "--decide", "ctx1k,ctx8k",
                    "--json", str(out), "--md", str(tmp_path / "j.md")]) == 0
    doc = json.loads(out.read_text())
    assert doc["workloads"] == {"decide": ["ctx1k", "ctx8k"], "held_out": ["ctx16k", "mix"]}
    rows = {(r["part"], r["kind"], r["context_bucket"]): r for r in doc["rows"]}
    # the held-out steps are the ctx16k and mix segments: validate on exactly those rows agrees
    obs = read_observed([str(RUN / "context-stock-observed.parquet")])
    cols = jt.sc.sorted_columns(dict(obs.columns))
    segs, _ = jt.sc.segment_steps(cols, 4)
    import numpy as np

    held = np.concatenate([segs[1], segs[2]])
    want = validate(read_table(str(SHIPPED)), ObservedSteps({k: v[held] for k, v in cols.items()}, obs.files,
                                                            obs.metadata))
    for g in want.by_context:
        got = rows[("held_out", g.kind, g.context_bucket)]
        assert got["steps"] == g.errors[AWARE].n
        assert got["context_aware"]["median_pct"] == pytest.approx(g.errors[AWARE].median_pct)
    decide_steps = sum(r["steps"] for r in doc["rows"] if r["part"] == "decide" and r["context_bucket"] == "all")
    held_steps = sum(r["steps"] for r in doc["rows"] if r["part"] == "held_out" and r["context_bucket"] == "all")
    assert decide_steps > 0 and held_steps == sum(g.errors[AWARE].n for g in want.overall)
    # the goal reads the held-out buckets of >= 20 steps only: this run's 16k buckets miss it
    goal = doc["goal"]["shipped"]
    assert goal["met"] is False and goal["buckets"] == 5
    assert any(m.startswith("verify 16384-32767: 2.65 %") for m in goal["misses"])
    md = (tmp_path / "j.md").read_text()
    assert "Held out: median absolute error" in md and "| verify | 16384-32767 | 34 |" in md


def test_held_out_steps_by_sm_clock_and_a_goal_with_no_bucket_to_judge(jt, tmp_path):
    """A draft-model run whose observe files record the SM clock per step (and the engine: its table fits)."""
    run = REPO / "benchmarks" / "results" / "h200" / "2026-12-02-0537-draft-goodput-warm"
    md = tmp_path / "j.md"
    assert jt.main([str(run), "draft-stock-pinned", "--table", f"t={DRAFT_TABLE}", "--decide", "ctx1k",
                    "--md", str(md), "--json", str(tmp_path / "j.json")]) == 0
    text = md.read_text()
    assert "Held out, by the GPU's SM clock" in text and "| verify | 1950-1999 | 37 |" in text
    assert "- t: not judged: no held-out bucket has 20 steps" in text


def test_the_goal_by_hand(jt):
    def row(kind, bucket, n, med, bias, part="held_out", table="t"):
        return {"table": table, "part": part, "kind": kind, "context_bucket": bucket, "steps": n,
                "context_aware": {"median_pct": med, "median_signed_pct": bias}}

    rows = [row("verify", "1024-2047", 20, 2.0, -1.0), row("draft", "1024-2047", 19, 9.0, 9.0),  # too few: not judged
            row("verify", "all", 500, 9.0, 9.0), row("verify", "2048-4095", 50, 9.0, 0.0, part="decide")]
    assert jt.goal(rows, "t") == {"buckets": 1, "met": True, "misses": []}
    rows.append(row("verify", "4096-8191", 30, 1.5, -1.2))
    assert jt.goal(rows, "t") == {"buckets": 2, "met": False, "misses": ["verify 4096-8191: 1.50 % (bias -1.20 %)"]}
    assert jt.goal(rows, "other")["met"] is False  # nothing judged is not a pass


def test_a_table_of_another_speculator_is_not_judged_and_the_others_still_are(jt, tmp_path):
    """This run's observe files record no engine: the arm's own speculative config decides."""
    out = tmp_path / "j.json"
    assert jt.main([str(RUN), "stock", "--table", f"draft={DRAFT_TABLE}", "--table", f"shipped={SHIPPED}",
                    "--decide", "ctx1k", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["tables"]["draft"]["error"].endswith("speculative_method: table draft_model, arm dspark")
    assert {r["table"] for r in doc["rows"]} == {"shipped"} and set(doc["goal"]) == {"shipped"}
    assert jt.speculator_mismatch({"speculative_method": "dspark", "draft_model": "dspark-qwen3-8b-block7"},
                                  {"engine": {"speculative_config": {"method": "dspark",
                                                                     "model": "/x/dspark-qwen3-8b-block7/"}}}) is None


@pytest.mark.parametrize("args, says", [
    (["--table", f"s={SHIPPED}", "--table", f"s={SHIPPED}", "--decide", "ctx1k"], "the name s is given twice"),
    (["--table", f"s={SHIPPED}", "--decide", "ctx1k", "--md", "/no/such/dir/j.md"], "--md /no/such/dir/j.md: no such directory"),
    (["--table", "x=/nope.parquet", "--decide", "ctx1k"], "--table x=/nope.parquet: give NAME=PATH of an existing table"),
    (["--table", f"s={SHIPPED}", "--decide", "ctx2k"], "--decide ctx2k: not a workload of this arm"),
    (["--table", f"s={SHIPPED}", "--decide", "ctx1k,ctx16k,mix,ctx8k"], "leave others held out"),
])
def test_bad_input_is_one_line_and_exit_2(jt, capsys, args, says):
    assert jt.main([str(RUN), "stock", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_held_out_decode_verifies_by_shape_match_validate_on_the_held_out_rows(jt, tmp_path):
    from dspark_calib.observe.file import ObservedSteps, read_observed
    from dspark_calib.table.file import read_table
    from dspark_calib.validate import AWARE, validate
    import numpy as np

    out, md = tmp_path / "j.json", tmp_path / "j.md"
    assert jt.main([str(RUN), "stock", "--table", f"shipped={SHIPPED}", "--decide", "ctx1k,ctx8k",
                    "--json", str(out), "--md", str(md)]) == 0
    got = {(g["context_bucket"], g["fill_bucket"]): g for g in json.loads(out.read_text())["by_shape"]
           if g["part"] == "held_out"}
    obs = read_observed([str(RUN / "context-stock-observed.parquet")])
    cols = jt.sc.sorted_columns(dict(obs.columns))
    segs, _ = jt.sc.segment_steps(cols, 4)
    held = np.concatenate([segs[1], segs[2]])
    want = validate(read_table(str(SHIPPED)), ObservedSteps({k: v[held] for k, v in cols.items()}, obs.files,
                                                            obs.metadata)).by_shape
    assert want and set(got) == {(g.context_bucket, g.fill_bucket) for g in want}
    for g in want:
        row = got[(g.context_bucket, g.fill_bucket)]
        assert row["steps"] == g.errors[AWARE].n
        assert row["context_aware"]["median_signed_pct"] == pytest.approx(g.errors[AWARE].median_signed_pct)
    assert sum(g.errors[AWARE].n for g in want) == sum(
        r["steps"] for r in json.loads(out.read_text())["rows"]
        if r["part"] == "held_out" and r["kind"] == "verify" and r["context_bucket"] == "all")
    assert "Held out, decode verifies by shape" in md.read_text()


def test_prefill_carrying_steps_split_by_their_chunk_pairs_cover_every_such_step(jt, tmp_path):
    """The by-pairs split holds each held-out prefill-carrying step that recorded its pairs once, and
    on this run the chunks of 64M pairs or more are priced high (the chunk rule's price a pair)."""
    import numpy as np

    out = tmp_path / "j.json"
    assert jt.main([str(RUN), "stock", "--table", f"shipped={SHIPPED}", "--decide", "ctx1k,ctx8k",
                    "--json", str(out), "--md", str(tmp_path / "j.md")]) == 0
    doc = json.loads(out.read_text())
    held = [g for g in doc["by_pairs"] if g["part"] == "held_out"]
    assert [g["pairs"] for g in held] == [p for p in jt.PAIR_LABELS if p in {g["pairs"] for g in held}]
    rows = {(r["part"], r["kind"], r["context_bucket"]): r for r in doc["rows"]}
    from dspark_calib.observe.file import read_observed

    cols = read_observed([str(RUN / "context-stock-observed.parquet")]).columns
    assert np.all(cols["prefill_pairs"][cols["prefill_tokens"] > 0] > 0)  # every chunk step recorded its pairs
    assert sum(g["steps"] for g in held) == rows[("held_out", "verify_prefill", "all")]["steps"]
    top = next(g for g in held if g["pairs"] == ">=64M")
    assert top["steps"] >= 20 and top["context_aware"]["median_signed_pct"] > 1.0
    assert "chunks' query-context pairs" in (tmp_path / "j.md").read_text()

"""The serving harness's in-engine A/B (pricing ab): the plan, the swap on vLLM's real manager
against the plugin's own load mode, the drive loop's swaps on the fake engine, and the report."""

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests.vllm.test_context_aware import (av, ca, make_manager, schedule, single_rank,  # noqa: F401 - fixtures
                                           two_context_load)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def swap_mod(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "serving"))  # as the worker imports it
    import pricing_swap

    return pricing_swap


def test_ab_plan_runs_each_workload_under_both_pricings_abba_and_refit_keeps_them(sc):
    plan = [sc.Workload("a", (1024,), 32, 96), sc.Workload("b", (4096,), 32, 96)]
    ab = sc.ab_plan(plan)
    assert [(w.name, w.pricing) for w in ab] == [
        ("a@stock1", "stock"), ("a@table1", "table"), ("a@table2", "table"), ("a@stock2", "stock"),
        ("b@stock1", "stock"), ("b@table1", "table"), ("b@table2", "table"), ("b@stock2", "stock")]
    assert {w.num_requests for w in ab} == {96}
    shrunk = sc.refit([sc.Workload("c@table1", (16384,), 64, 128, pricing="table")], kv_tokens=300_000)
    assert shrunk[0].shrunk and shrunk[0].pricing == "table"  # a shrunk workload keeps its pricing


def test_ab_arm_starts_stock_with_the_context_settings_and_refuses_observe(sc, tmp_path):
    env = sc.arm_env("ab", "/t.parquet", str(tmp_path), every=0, tail=0.2, chunks=True, base={})
    assert "DSPARK_CALIB_TABLE" not in env and "DSPARK_CALIB_OBSERVE" not in env  # vLLM profiles at start
    assert env["DSPARK_CALIB_CONTEXT_TAIL"] == "0.2" and env["DSPARK_CALIB_CONTEXT_CHUNKS"] == "1"
    with pytest.raises(ValueError, match="arm ab needs a table"):
        sc.arm_env("ab", None, str(tmp_path), every=0, base={})
    assert sc.CONFIG["arms"]["draft-ab-tail20-chunks-noobs-pinned"]["pricing"] == "ab"
    rc = sc.main(["arm", "draft-ab-tail20-chunks-noobs-pinned", "--table", str(tmp_path / "t.parquet"),
                  "--out", str(tmp_path), "--observe-every", "4", "--dry-run"])
    assert rc == 2  # observe would keep the first pricing it saw in its file


def test_swap_installs_what_load_mode_installs_and_gives_vllms_tables_back(two_context_load, swap_mod, tmp_path,  # noqa: F811
                                                                            monkeypatch):
    """A stock manager swapped to a table prices every step as the plugin's load mode does with
    that table (same static tables, same budgets at two contexts); swapped back, it holds the very
    tables vLLM's profile fitted."""
    from dspark_calib.table.file import write_table

    table, load = two_context_load
    loaded = load()  # the plugin's load mode: the table at 16384, context-aware
    assert ca.is_installed(loaded)
    path = write_table(table, tmp_path / "swap")
    for key in ("DSPARK_CALIB_TABLE", "DSPARK_CALIB_CONTEXT_LEN"):
        monkeypatch.delenv(key)
    m = make_manager(cudagraph_limit=loaded._cudagraph_limit)
    vllms = (np.arange(3.0), np.arange(5.0))  # stands for what vLLM's start-up profile fitted
    m.cost_tables = vllms
    got = swap_mod.swap(m, str(path), 16384, vllms)
    assert got["pricing"] == "table" and got["context_aware"] and got["table_hash"] == table.content_hash[:12]
    assert ca.installed_state(m).policy == ca.installed_state(loaded).policy
    rng = np.random.default_rng(5)
    for ctx in (1024, 16384):
        contexts, drafts = np.full(48, ctx, np.int32), rng.integers(0, 8, 48)
        want = loaded.get_num_tokens(*schedule(loaded, contexts, drafts, np.random.default_rng(ctx)))
        assert m.get_num_tokens(*schedule(m, contexts, drafts, np.random.default_rng(ctx))) == want, ctx
        assert all(np.array_equal(a, b) for a, b in zip(m.cost_tables, loaded.cost_tables)), ctx
    back = swap_mod.swap(m, None, 16384, vllms)
    assert back == {"pricing": "stock", "context_aware": False}
    assert m.cost_tables is vllms and not ca.is_installed(m)
    assert swap_mod.swap(m, str(path), 16384, vllms)["context_aware"]  # and in again
    with pytest.raises(ValueError, match="no context 8192"):
        swap_mod.swap(m, str(path), 8192, vllms)


def test_swap_rpc_keeps_vllms_tables_once_and_refuses_what_it_cannot_swap(swap_mod, monkeypatch):
    calls = []
    monkeypatch.setattr(swap_mod, "swap", lambda m, path, ctx, stock: calls.append((path, ctx, stock)) or
                        {"pricing": "table" if path else "stock"})

    class Worker(swap_mod.PricingSwapProbe):
        def __init__(self, manager):
            self.model_runner = type("Runner", (), {"adaptive_verification": manager})()

    m = make_manager()
    m.cost_tables = vllms = ("vllm's",)
    w = Worker(m)
    assert w.pricing_swap("/t.parquet") == {"pricing": "table"}
    m.cost_tables = ("the table's",)
    assert w.pricing_swap(None) == {"pricing": "stock"}
    assert [c[2] for c in calls] == [vllms, vllms] and calls[0][1] == 8192  # kept at the first swap only
    assert "adaptive verification is off" in Worker(None).pricing_swap("/t.parquet")["error"]
    monkeypatch.setattr(ca, "is_installed", lambda manager: True)  # an engine that loaded a table at start
    assert "loaded a table at start" in Worker(make_manager()).pricing_swap(None)["error"]
    monkeypatch.setattr(swap_mod, "swap", lambda *a: 1 / 0)
    w2 = Worker(make_manager())
    w2._harness_stock_tables = ()
    assert w2.pricing_swap(None)["error"].startswith("ZeroDivisionError")


def test_drive_swaps_before_each_ab_workload_and_skips_one_whose_swap_failed(sc, tmp_path):
    eng = sc.FakeEngine(None, 4, str(sc.SHIPPED_TABLE), "stock")
    plan = sc.ab_plan([sc.Workload("a", (512,), 8, 16, 32)])
    events = []
    asyncio.run(sc.drive(eng, plan, events.append, deadline=float("inf"), ab_table="/t.parquet"))
    swaps = [(e["workload"], e["answers"][0]["pricing"]) for e in events if e["event"] == "pricing"]
    assert swaps == [("a@stock1", "stock"), ("a@table1", "table"), ("a@table2", "table"), ("a@stock2", "stock")]
    ran = [e["workload"]["name"] for e in events if e["event"] == "workload"]
    assert ran == ["a@stock1", "a@table1", "a@table2", "a@stock2"]
    order = [e["event"] for e in events if e["event"] in ("pricing", "start")]
    assert order == ["pricing", "start"] * 4  # swapped before the workload's marker and start
    drafts = [e["step_timer"]["verified_drafts_per_request"] for e in events if e["event"] == "workload"]
    assert drafts[0] == drafts[3] and drafts[1] == drafts[2] and drafts[0] != drafts[1]  # the fake's two rules

    async def refuse(method, args=()):
        return [{"error": "x"}] if method == "pricing_swap" else await inner(method, args)

    eng2 = sc.FakeEngine(None, 4, str(sc.SHIPPED_TABLE), "stock")
    inner = eng2.collective_rpc
    eng2.collective_rpc = refuse
    events = []
    asyncio.run(sc.drive(eng2, plan[:1], events.append, deadline=float("inf"), ab_table="/t.parquet"))
    assert [e for e in events if e["event"] == "workload"] == []
    assert {"event": "skipped", "workload": "a@stock1", "why": "pricing swap failed"} in events


def test_forward_tokens_and_the_ab_report_by_hand(sc):
    raw = {"start_s": [0.0, 0.1, 0.2, 0.3], "end_s": [0.01, 0.11, 0.21, 0.31],
           "num_tokens": [8192, 64, 64, 16], "num_reqs": [1, 8, 8, 2], "forward_tokens": [8192, 40, 48, None]}
    # the prefill step (8192 for 1 request) and the step without a recorded batch do not count
    assert sc.forward_tokens(raw) == {"decode_steps": 2, "forward_tokens_mean": 44.0,
                                      "verified_drafts_per_request": 4.5}
    assert sc.forward_tokens({**raw, "forward_tokens": None})["decode_steps"] == 0

    def turn(tok_s, tpot, drafts):
        return {"workload": {"concurrency": 32}, "requests": 96, "output_tok_s": tok_s, "tpot_p50_ms": tpot,
                "tpot_p90_ms": tpot, "step_timer": {"verified_drafts_per_request": drafts, "drafter_p50_ms": 80.0}}

    arm = {"workloads": {"x@stock1": turn(100.0, 10.0, 3.0), "x@table1": turn(110.0, 9.0, 5.0),
                         "x@table2": turn(108.0, 9.2, 5.0), "x@stock2": turn(98.0, 10.2, 3.0)}}
    report = sc.build_report({"draft-ab-tail20-chunks-noobs-pinned": arm})
    (ab,) = report["ab"]
    assert ab["workload"] == "x" and ab["table_vs_stock_tok_s"] == round(109.0 / 99.0, 4)
    assert ab["stock_vs_table_tpot_p50"] == round(10.1 / 9.1, 4)
    assert ab["noise"] == round(max(abs(98 / 100 - 1), abs(108 / 110 - 1)), 4)
    assert ab["turns"]["table1"]["verified_drafts_per_request"] == 5.0
    md = sc.markdown(report)
    assert "| draft-ab-tail20-chunks-noobs-pinned | x | 100 tok/s, 10.00 ms, 3.00 drafts, drafter 80.0 ms |" in md
    assert "| 1.101 | 1.110 | 0.020 |" in md
    assert ab["table_vs_stock_drafter_held"] is None  # no drafter share: nothing held
    half = sc.build_report({"a": {"workloads": {"x@stock1": turn(100.0, 10.0, 3.0)}}})["ab"][0]
    assert half["table_vs_stock_tok_s"] is None and half["noise"] is None  # a turn missing: no ratio


def test_the_drafter_share_pairs_each_call_with_its_own_step_in_the_summary_and_the_steps_file(sc):
    """Call i's step is start[i+1] - start[i] and its drafter drafter_ms[i]; the last call and a call
    without a drafter count in neither. The live summary and the report's reading of the per-step
    file (interval_ms[i + 1]) agree."""
    start = [0.0, 0.100, 0.130, 0.300, 0.310, 0.500]
    drafter = [60.0, 20.0, None, 5.0, 150.0, 70.0]
    raw = {"start_s": start, "end_s": [t + 0.001 for t in start], "num_tokens": [8] * 6, "num_reqs": [1] * 6,
           "drafter_ms": drafter, "target_ms": [1.0] * 6}
    # pairs: (100, 60), (30, 20), (10, 5), (190, 150); call 2 has no drafter, call 5 no successor
    want = {"drafter_share_steps": 4, "step_mean_ms": 82.5, "drafter_mean_ms": 58.75, "rest_mean_ms": 23.75}
    got = sc.step_timer_summary(raw)
    assert {k: got[k] for k in want} == want
    steps = sc.step_times(raw)
    assert sc.drafter_share(steps["interval_ms"][1:], steps["drafter_ms"]) == want


def test_the_ab_report_holds_the_drafter_at_the_pooled_mean_by_hand(sc, tmp_path):
    """Turns whose drafter changed pace (60 and 100 ms a step) around the same rest: held at the
    pooled 80 ms, each turn's tok/s is scaled by its step over rest + 80. The figures come from the
    arm's per-step file (interval i+1 is call i's step)."""
    import json

    def steps(drafter, rest, n=4):  # n calls, each a step of drafter + rest ms
        return {"interval_ms": [None] + [drafter + rest] * (n - 1), "drafter_ms": [drafter] * n,
                "host_ms": [1.0] * n, "num_tokens": [64] * n, "num_reqs": [8] * n, "forward_tokens": [40] * n,
                "target_ms": [5.0] * n}

    per_turn = {"stock1": (60.0, 10.0, 100.0), "table1": (100.0, 12.0, 75.0), "table2": (60.0, 12.0, 110.0),
                "stock2": (100.0, 10.0, 70.0)}
    arm = {"workloads": {f"x@{t}": {"workload": {"concurrency": 8}, "requests": 16, "output_tok_s": tok,
                                    "tpot_p50_ms": 10.0, "tpot_p90_ms": 10.0, "step_timer": {"drafter_p50_ms": d}}
                         for t, (d, _, tok) in per_turn.items()}}
    (tmp_path / "context-draft-ab-tail20-chunks-noobs-pinned.json").write_text(json.dumps(arm))
    (tmp_path / "context-draft-ab-tail20-chunks-noobs-pinned-steps.json").write_text(
        json.dumps({f"x@{t}": steps(d, rest) for t, (d, rest, _) in per_turn.items()}))
    assert sc.main(["report", "--results", str(tmp_path), "--json", str(tmp_path / "r.json"),
                    "--md", str(tmp_path / "r.md")]) == 0
    (ab,) = json.loads((tmp_path / "r.json").read_text())["ab"]
    held = {t: tok * (d + rest) / (rest + 80.0) for t, (d, rest, tok) in per_turn.items()}
    assert ab["drafter_pool_ms"] == 80.0
    assert ab["turns"]["table1"]["rest_mean_ms"] == 12.0 and ab["turns"]["stock2"]["drafter_mean_ms"] == 100.0
    assert ab["table_vs_stock_drafter_held"] == round((held["table1"] + held["table2"]) / (held["stock1"] + held["stock2"]), 4)
    assert ab["noise_drafter_held"] == round(max(abs(held["stock2"] / held["stock1"] - 1),
                                                 abs(held["table2"] / held["table1"] - 1)), 4)
    assert ab["table_vs_stock_tok_s"] == round(185 / 170, 4)  # raw: the drafter's pace decides it
    md = (tmp_path / "r.md").read_text()
    assert f"| 80.0 | {ab['table_vs_stock_drafter_held']:.3f} | {ab['noise_drafter_held']:.3f} |" in md
    # a steps file from a timer without CUDA events (no drafter_ms): no share, nothing held, the report still made
    no_events = {f"x@{t}": {k: v for k, v in steps(d, rest).items() if k not in ("drafter_ms", "target_ms")}
                 for t, (d, rest, _) in per_turn.items()}
    (tmp_path / "context-draft-ab-tail20-chunks-noobs-pinned-steps.json").write_text(json.dumps(no_events))
    assert sc.main(["report", "--results", str(tmp_path), "--json", str(tmp_path / "r.json"),
                    "--md", str(tmp_path / "r.md")]) == 0
    (ab,) = json.loads((tmp_path / "r.json").read_text())["ab"]
    assert ab["drafter_pool_ms"] is None and ab["table_vs_stock_drafter_held"] is None


def test_cpus_pins_the_engine_child_and_the_step_timer_says_where_it_ran(sc, tmp_path):
    """--cpus runs the engine child under taskset; the step timer's placement, read inside it, shows it."""
    import json
    import os
    import shutil

    if shutil.which("taskset") is None:
        pytest.skip("no taskset here")
    cpu = min(os.sched_getaffinity(0))
    rc = sc.main(["arm", "draft-fixed", "--table", str(sc.SHIPPED_TABLE), "--out", str(tmp_path), "--workloads",
                  "ctx1k-c32", "--waves", "1", "--acceptance-rates", "low", "--cpus", str(cpu), "--dry-run",
                  "--work", str(tmp_path / "work")])
    assert rc == 0
    summary = json.loads((tmp_path / "context-draft-fixed.json").read_text())
    assert summary["cpus"] == str(cpu)
    assert summary["workloads"]["ctx1k-c32"]["step_timer"]["cpu"]["affinity"] == [cpu]

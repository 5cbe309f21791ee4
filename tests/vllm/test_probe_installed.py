"""The probe judges what vLLM installs, at every context the engine prices (real vLLM classes, CPU).

Each forgery keeps the genuine fingerprint and samples and gets a fresh content hash (the
file is written as a valid table), so only the probe or the read checks can catch it. The
"GPU" of run_engine measures the genuine table's costs; the engine loads the forgery.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest


from dspark_calib.fit import Curve, CurvePair
from dspark_calib.pricing.costs import ContextCosts
from dspark_calib.selection import decide
from dspark_calib.table.file import _write_parquet, read_table, to_arrow
from dspark_calib.table.meta import METADATA_KEY
from dspark_calib.telemetry import Reading
from dspark_calib.vllm import load as loader
from dspark_calib.vllm import probe as P
from dspark_calib.vllm import context_aware as ca
from tests.helpers import SHIPPED, SHIPPED_DRAFT_MODEL
from tests.vllm.test_probe import LIMIT, OURS, PROBES, WARMUPS, load_env, make_manager, patched, run_engine  # noqa: F401

PROBE_LINE = "probe "


def forge(table, change):
    """table with change(ctx, kind, columns) applied to every curve's columns (a dict of arrays)."""
    def one(ctx, kind, c):
        cols = {f.name: np.array(getattr(c, f.name), dtype=float if f.name not in ("size", "n") else np.int64)
                for f in dataclasses.fields(c)}
        change(ctx, kind, cols)
        return Curve.from_columns(cols)

    return dataclasses.replace(table, curves={ctx: CurvePair(draft=one(ctx, "draft", p.draft),
                                                             verify=one(ctx, "verify", p.verify))
                                              for ctx, p in table.curves.items()})


def write_forgery(table, path):
    """A valid table file of these curves: the content hash recomputed, no write-time checks."""
    arrow = to_arrow(table)
    curve_rows = json.loads(arrow.schema.metadata[METADATA_KEY])["curve_rows"]
    with open(path, "wb") as fh:
        _write_parquet(arrow, fh, curve_rows)
    return str(path)


def halve_1024_and_16384(ctx, kind, cols):
    if ctx in (1024, 16384):
        for k in ("cost_ms", "min_ms", "p25_ms", "p75_ms", "max_ms", "mad_ms"):
            cols[k] = cols[k] * 0.5


def huge_below_the_probed_sizes(ctx, kind, cols):
    """Every point below the capture-limit step (512 tokens, 256 requests) at 59,999 ms, with a
    spread wide enough for the read-time fall check (3 x IQR covers the drop to the real point)."""
    below = cols["size"] < (256 if kind == "draft" else LIMIT)
    below[0] = False  # the one-request step keeps its real point (the smallest size probed)
    cols["cost_ms"][below] = 59_999.0
    cols["mad_ms"][below] = 12_500.0
    cols["p25_ms"][below], cols["min_ms"][below] = 47_499.0, 47_499.0
    cols["p75_ms"][below], cols["max_ms"][below] = 72_499.0, 72_499.0


def flat_but_the_probed_points(ctx, kind, cols):
    """Every point at the capture-limit step's cost, but the ones the old probe read (verify 512
    and 8192, draft 256): small batches priced as a full one."""
    keep = np.isin(cols["size"], [LIMIT, 8192] if kind == "verify" else [256])
    flat = float(cols["cost_ms"][cols["size"] == (LIMIT if kind == "verify" else 256)][0])
    for k in ("cost_ms", "min_ms", "p25_ms", "p75_ms", "max_ms"):
        cols[k][~keep] = flat
    cols["mad_ms"][~keep] = 0.0


def one_point_per_curve(ctx, kind, cols):
    """Only the old probe's full-graph point is left in each curve."""
    keep = cols["size"] == (LIMIT if kind == "verify" else 256)
    for k in list(cols):
        cols[k] = cols[k][keep]


def point_at_2_to_40(ctx, kind, cols):
    """One extra verify point past the engine's max_num_batched_tokens: the chunk pair price then
    divides by 2^40 tokens (prefill priced as free)."""
    if kind == "verify":
        for k in list(cols):
            extra = 2 ** 40 if k == "size" else (1 if k == "n" else 59_999.0)
            cols[k] = np.append(cols[k], extra)
        cols["mad_ms"][-1] = 0.0


def start(monkeypatch, caplog, path, genuine, policy="strict", **env):
    load_env(monkeypatch, path, policy, **env)
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches, _ = run_engine(m, sizes_of(genuine), genuine)
    return m, batches, [r.getMessage() for r in caplog.records if r.name == "vllm.dspark_calib"]


def sizes_of(table):
    return list(table.fingerprint.cudagraph_capture_sizes)


@pytest.mark.parametrize("change, caught", [
    (halve_1024_and_16384, "context 16384: verify@512 2.00x"),
    (huge_below_the_probed_sizes, "verify@512 0.00x"),
    (one_point_per_curve, "verify@8192 no table point"),
])
def test_forgeries_that_read_as_genuine_fail_the_probe_under_strict(monkeypatch, caplog, tmp_path, reference_table,
                                                                    change, caught):
    forged = forge(reference_table, change)
    path = write_forgery(forged, tmp_path / "forged.parquet")
    assert decide(path, {}, policy="strict", allow_reference=True).load  # every read-time check passes it
    with pytest.raises(RuntimeError, match="policy strict") as err:
        start(monkeypatch, caplog, path, reference_table)
    assert caught in str(err.value) and "does not match this GPU's measured costs" in str(err.value)


def test_halved_contexts_would_price_a_16384_verify_at_half(reference_table):
    """What the first forgery does if it loads: context-aware mode prices a 16384 verify at half."""
    from dspark_calib.pricing.costs import ContextCosts

    real = ContextCosts(reference_table.curves, 256, 8192, LIMIT).at(16384).verify[LIMIT]
    forged = ContextCosts(forge(reference_table, halve_1024_and_16384).curves, 256, 8192, LIMIT).at(16384).verify[LIMIT]
    assert forged == pytest.approx(real / 2) and real == pytest.approx(144, abs=1)


@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_a_point_past_max_num_batched_tokens_is_refused_at_read_time(monkeypatch, caplog, tmp_path, reference_table,
                                                                      policy):
    path = write_forgery(forge(reference_table, point_at_2_to_40), tmp_path / "forged.parquet")
    d = decide(path, {}, policy=policy, allow_reference=True)
    assert not d.load
    why = d.refuse if policy == "strict" else d.lines[0]
    assert f"size {2 ** 40} exceeds the table's own max_num_batched_tokens 8192" in why


def test_a_draft_point_past_max_num_seqs_is_refused_at_read_time(tmp_path, reference_table):
    def draft_past(ctx, kind, cols):
        if kind == "draft":
            for k in list(cols):
                cols[k] = np.append(cols[k], 512 if k == "size" else (1 if k == "n" else cols[k][-1]))

    d = decide(write_forgery(forge(reference_table, draft_past), tmp_path / "f.parquet"), {}, policy="strict",
               allow_reference=True)
    assert not d.load and "exceeds the table's own max_num_seqs 256" in d.refuse


# -- the plan ---------------------------------------------------------------------------------
def flat_tables(ms_per_step):
    return (np.full(257, ms_per_step / 2), np.full(8193, ms_per_step / 2))


def test_plan_probes_the_chosen_context_first_then_the_farthest_within_the_budget():
    installed = {c: flat_tables(100.0) for c in (1024, 4096, 8192, 16384, 32768)}
    plan = P.plan_probe(installed, 8192, [1, LIMIT, 8192])
    # 3 steps per context, 300 ms each context: 4 contexts fit 12 steps and 1.2 s; 4096 is the nearest
    assert plan.contexts == (1024, 8192, 16384, 32768) and plan.skipped == (4096,)
    assert len(plan.steps) == P.MAX_PROBE_STEPS == 12 and plan.predicted_ms == pytest.approx(1200)
    assert [s.context_len for s in plan.steps] == [1024] * 3 + [8192] * 3 + [16384] * 3 + [32768] * 3
    slow = P.plan_probe({c: flat_tables(400.0) for c in (1024, 8192, 16384)}, 8192, [1, LIMIT, 8192])
    assert slow.contexts == (8192,) and slow.skipped == (1024, 16384)  # 1.2 s each: only the chosen one
    assert len(slow.steps) == 3
    assert P.plan_probe(installed, 8192, []).note  # nothing to probe: said, never a silent pass
    assert slow.budget_ms == P.PROBE_BUDGET_MS and slow.profile_ms is None  # no profile to price: the floor


def vllm_profile(table):
    """The dummy-run sizes of vLLM's own start-up profile for the table's capture sizes, replays included."""
    return [b["num_tokens"] for b in make_manager().batches_to_profile(sizes_of(table))]


def installed_tables(table):
    """What load mode judges against at every profiled context (probe_setup's installed)."""
    costs = ContextCosts(table.curves, 256, 8192, LIMIT)
    return {c: costs.tables[c] for c in table.context_lens()}


def slow_drafter(ctx, kind, cols):
    """A draft-model speculator's costs: the reference table's drafter 20x slower (about 220, 380
    and 560 ms at 256 requests at contexts 1024, 8192 and 16384, as the shipped draft_model table)."""
    if kind == "draft":
        for k in ("cost_ms", "min_ms", "p25_ms", "p75_ms", "max_ms", "mad_ms"):
            cols[k] = cols[k] * 20


def test_a_table_of_slow_drafter_steps_has_every_context_probed(reference_table):
    """Two steps at a context cost about 1 s here: a fixed 1.5 s budget priced context 8192 alone.
    The budget is 5 % of the ~88 s start-up profile the probe replaces (4.4 s), so all three are probed."""
    slow = forge(reference_table, slow_drafter)
    installed = installed_tables(slow)
    profile = vllm_profile(slow)
    assert len(profile) == 56 * 5  # vLLM's 51 captured and 5 tail sizes, 5 replays each
    plan = P.plan_probe(installed, 8192, [LIMIT, 8192], profile)
    assert plan.contexts == (1024, 8192, 16384) and not plan.skipped and len(plan.steps) == 6
    assert plan.predicted_ms > P.PROBE_BUDGET_MS and plan.budget_ms == pytest.approx(0.05 * plan.profile_ms)
    assert plan.profile_ms == pytest.approx(sum(P.step_cost(installed[8192], n) for n in profile))


def test_a_dspark_table_plan_is_the_one_of_the_fixed_budget(reference_table):
    """A DSpark table's start-up profile (~20 s) sets no more than the floor: its plan is unchanged."""
    installed = installed_tables(reference_table)
    plan = P.plan_probe(installed, 8192, [LIMIT, 8192], vllm_profile(reference_table))
    fixed = P.plan_probe(installed, 8192, [LIMIT, 8192])
    assert (plan.steps, plan.contexts, plan.skipped) == (fixed.steps, fixed.contexts, fixed.skipped)
    assert plan.contexts == (1024, 8192, 16384) and plan.budget_ms == P.PROBE_BUDGET_MS
    assert P.PROBE_SHARE * plan.profile_ms < P.PROBE_BUDGET_MS


def test_the_budget_is_capped_however_slow_the_table_says_it_is(reference_table):
    """4 s per context and a 560 s predicted profile: 5 % would be 28 s; the cap keeps 10 s, two contexts."""
    installed = {c: flat_tables(2000.0) for c in (1024, 8192, 16384)}
    plan = P.plan_probe(installed, 8192, [LIMIT, 8192], vllm_profile(reference_table))
    assert plan.profile_ms == pytest.approx(56 * 5 * 2000.0) and plan.budget_ms == P.PROBE_BUDGET_CAP_MS == 10_000
    assert plan.contexts == (8192, 16384) and plan.skipped == (1024,) and plan.predicted_ms == pytest.approx(8000)
    assert P.probe_budget_ms(1e12) == P.PROBE_BUDGET_CAP_MS and P.probe_budget_ms(None) == P.PROBE_BUDGET_MS
    assert plan.budget == ("12 steps, 10.00 s of the table's predicted step time: 5% of its predicted 560.0 s "
                           "start-up profile, kept within 1.5-10 s")  # docs/serving.md's example


@pytest.mark.parametrize("path, profile_s, budget_s, predicted_s", [
    (SHIPPED, 19.6, 1.5, 1.05),  # DSpark: the floor, the plan of the fixed budget
    (SHIPPED_DRAFT_MODEL, 97.4, 4.87, 3.56),  # a fixed 1.5 s priced context 8192 alone
])
def test_the_shipped_tables_have_every_context_probed(path, profile_s, budget_s, predicted_s):
    """docs/serving.md's figures: the shipped H200 tables on their own engine (256 requests,
    8192 batched tokens, capture limit 512), at the chosen context 8192."""
    table = read_table(path)
    plan = P.plan_probe(installed_tables(table), 8192, [LIMIT, 8192], vllm_profile(table))
    assert plan.contexts == (1024, 8192, 16384) and len(plan.steps) == 6
    assert (round(plan.profile_ms / 1000, 1), round(plan.budget_ms / 1000, 2), round(plan.predicted_ms / 1000, 2)) \
        == (profile_s, budget_s, predicted_s)


def test_an_engine_of_a_slow_drafter_prices_every_context(monkeypatch, caplog, tmp_path, reference_table):
    """Through load mode: the plan priced vLLM's own profile batches, so the grid keeps all three contexts."""
    slow = forge(reference_table, slow_drafter)
    m, batches, lines = start(monkeypatch, caplog, write_forgery(slow, tmp_path / "slow.parquet"), slow)
    assert len(batches) == WARMUPS + PROBES and {b["context_len"] for b in batches[WARMUPS:]} == {1024, 8192, 16384}
    probe = next(x for x in lines if x.startswith("dspark-calib: probe"))
    assert "over the probe's budget" not in probe and "keeping" in probe, probe
    assert ca.installed_state(m).grid.contexts == (1024, 8192, 16384)


def test_flat_curves_that_keep_the_probed_points_are_not_caught():
    """Every point but the probed ones (verify 512 and 8192, draft 256) flattened to the
    capture-limit step's cost: the probe reads genuine points. It stays a limitation (the
    one-request step that would catch it reads 1.04-1.27x a genuine table on an H200): only a
    pin protects against a forger who knows the probed sizes."""
    assert not {1, 2, 4} & set(loader.probe_sizes([1, 2, 4, 512, 768, 8192], 512))


def test_probe_sizes_are_the_capture_limit_and_the_largest_tail():
    assert loader.probe_sizes([1, 2, 4, 512, 768, 8192], 512) == [512, 8192]
    assert loader.probe_sizes([768, 8192], 0) == [8192]  # no graphs captured: the tail only


def test_a_table_of_one_context_or_context_aware_off_probes_its_context_only(monkeypatch, caplog, tmp_path,
                                                                             reference_table, reference_table_8192):
    from dspark_calib.table.file import write_table

    _, batches, lines = start(monkeypatch, caplog, write_table(reference_table_8192, tmp_path), reference_table_8192)
    assert [(b["num_tokens"], b["context_len"]) for b in batches[WARMUPS:]] == [(LIMIT, 8192), (8192, 8192)]
    caplog.clear()
    _, batches, lines = start(monkeypatch, caplog, write_table(reference_table, tmp_path / "all.parquet"),
                              reference_table, DSPARK_CALIB_CONTEXT_AWARE="0")
    assert len(batches) == WARMUPS + 2 and "2 steps in" in next(x for x in lines if x.startswith("dspark-calib: probe"))


def test_contexts_over_the_budget_are_left_out_of_the_grid(monkeypatch, caplog, tmp_path, reference_table):
    from dspark_calib.table.file import write_table

    monkeypatch.setattr(P, "MAX_PROBE_STEPS", 4)  # room for two contexts: 8192, then 16384 (the farthest)
    m, batches, lines = start(monkeypatch, caplog, write_table(reference_table, tmp_path), reference_table)
    assert len(batches) == WARMUPS + 4 and {b["context_len"] for b in batches[WARMUPS:]} == {8192, 16384}
    probe = next(x for x in lines if x.startswith("dspark-calib: probe"))
    assert ("contexts 1024 over the probe's budget (4 steps, 1.50 s of the table's predicted step time: 5% of its "
            "predicted ") in probe and " s start-up profile, kept within 1.5-10 s): left out of the context-aware grid" \
        in probe, probe  # the budget it used, said
    assert ca.installed_state(m).grid.contexts == (8192, 16384)
    # the load line's coverage named 1024 too: said again of what is priced
    assert "the context-aware grid, which prices contexts 8192, 16384" in probe, probe


def throttled_at(sm_mhz):
    """A probe reader (NVML's kind) that reads hw_slowdown at this SM clock every time."""
    class Throttled:
        source = "nvml"

        def read(self):
            return Reading(sm_mhz=sm_mhz, throttle=("hw_slowdown",))

    return Throttled


def test_probe_line_says_the_gpu_throttled(monkeypatch, caplog, tmp_path, reference_table):
    from dspark_calib.table.file import write_table

    monkeypatch.setattr(loader, "probe_reader", throttled_at(1410.0))
    _, _, lines = start(monkeypatch, caplog, write_table(reference_table, tmp_path), reference_table)
    probe = [x for x in lines if x.startswith("dspark-calib: probe")]
    assert len(probe) == 1
    assert "GPU throttled during the probe (hw_slowdown), SM 1410-1410 MHz" in probe[0]


def test_probe_line_does_not_blame_throttling_for_a_ratio_below_one(monkeypatch, caplog, tmp_path, reference_table):
    # NVML can flag hw_slowdown at full clock; throttling makes steps slower, so it cannot explain
    # a GPU that ran faster than the table says
    monkeypatch.setattr(loader, "probe_reader", throttled_at(1980.0))
    path = write_forgery(forge(reference_table, huge_below_the_probed_sizes), tmp_path / "slow.parquet")
    with pytest.raises(RuntimeError, match="policy strict") as err:
        start(monkeypatch, caplog, path, reference_table)  # the table's costs far above this GPU's
    assert "verify@512 0.00x" in str(err.value)
    assert ("GPU throttled during the probe (hw_slowdown), SM 1980-1980 MHz: throttling slows steps, so it does "
            "not explain a ratio below 1.00x") in str(err.value)
    assert "ratios measured on a slowed GPU" not in str(err.value)
    readings = [Reading(sm_mhz=1980.0, throttle=("hw_slowdown",)), Reading(sm_mhz=1965.0)]
    low = P.conditions(readings, worst_ratio=0.80)
    assert low == ("GPU throttled during the probe (hw_slowdown), SM 1965-1980 MHz: throttling slows steps, "
                   "so it does not explain a ratio below 1.00x")
    assert P.conditions(readings, worst_ratio=1.2).endswith("ratios measured on a slowed GPU")
    assert P.conditions(readings).endswith("ratios measured on a slowed GPU")


def test_probe_line_gives_the_sm_clock_when_not_throttled():
    readings = [Reading(sm_mhz=1980.0), Reading(sm_mhz=1965.0)]
    assert P.conditions(readings) == "SM 1965-1980 MHz, no throttling"
    assert P.conditions([Reading()], "no NVML") == "SM clock not read (no NVML)"


# -- every rank runs rank 0's plan ------------------------------------------------------------
def test_other_tp_ranks_run_rank_0s_plan_whatever_their_env(monkeypatch, caplog, tmp_path, reference_table):
    from dspark_calib.table.file import write_table
    from dspark_calib.vllm import engine_info

    path = write_table(reference_table, tmp_path)
    sent = []
    monkeypatch.setattr(engine_info, "broadcast_from_rank0", lambda obj: sent.append(obj) or obj)
    _, rank0_batches, _ = start(monkeypatch, caplog, path, reference_table)
    plan = sent[0][1]
    assert len(plan.steps) == PROBES

    replies = iter(sent)
    monkeypatch.setattr(engine_info, "tp_rank_and_size", lambda: (1, 2))
    monkeypatch.setattr(engine_info, "broadcast_from_rank0", lambda obj: next(replies))
    # rank 1 would price one context (its env says context-aware off): it still runs rank 0's steps
    _, rank1_batches, _ = start(monkeypatch, caplog, path, reference_table, DSPARK_CALIB_CONTEXT_AWARE="0")
    assert rank1_batches == rank0_batches and len(rank1_batches) == OURS


def test_dp_replicas_with_other_probe_step_counts_disagree(monkeypatch, caplog, tmp_path, reference_table):
    from dspark_calib.table.file import write_table
    from tests.vllm.test_probe import stub_dp

    stub_dp(monkeypatch, 2, 0, lambda call, mine: [mine[:5] + (2,)] if call == 0 else [mine])
    _, batches, lines = start(monkeypatch, caplog, write_table(reference_table, tmp_path), reference_table,
                              policy="fallback")
    line = next(x for x in lines if "data-parallel replicas decided differently" in x)
    assert "replica 0: True" in line and "fallback 6" in line and "fallback 2" in line  # 6 probe steps here, 2 there
    assert len(batches) == 280  # vLLM's full profile, as on every replica


def test_a_forged_fall_that_claims_a_warm_up_reads_but_fails_the_probe(monkeypatch, caplog, tmp_path,
                                                                       reference_table):
    """Every point below the probed sizes at 59,999 ms, falling to the real ones, spreads left
    tight: refused on read as a cold profile; recorded as warmed up it reads (a fall is then the
    GPU's own), and the probe fails it: the installed cost at a probed size is the peak before it."""
    def huge_below_tight(ctx, kind, cols):
        below = cols["size"] < (256 if kind == "draft" else LIMIT)
        below[0] = False
        cols["cost_ms"][below] = 59_999.0
        for k in ("min_ms", "p25_ms", "p75_ms", "max_ms"):
            cols[k][below] = 59_999.0

    cold = forge(reference_table, huge_below_tight)
    d = decide(write_forgery(cold, tmp_path / "cold.parquet"), {}, policy="strict", allow_reference=True)
    assert not d.load and "falls below the 6e+04 ms" in d.refuse
    warm = dataclasses.replace(cold, fingerprint=cold.fingerprint.replace(warmup_replays=5))
    path = write_forgery(warm, tmp_path / "warm.parquet")
    assert decide(path, {}, policy="strict", allow_reference=True).load
    with pytest.raises(RuntimeError, match="policy strict") as err:
        start(monkeypatch, caplog, path, reference_table)
    assert "verify@512 0.00x" in str(err.value) and "does not match this GPU's measured costs" in str(err.value)

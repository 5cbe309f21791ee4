"""`advise`'s prediction beside an in-engine A/B's measurement, on the decode steps the A/B served.

    python3 benchmarks/serving/ab_advise.py RESULTS ARM TABLE --schedule NAME [--json OUT.json] [--md OUT.md]

RESULTS / ARM: a run folder and its ``ab`` arm (pricing_swap.py: one engine serves each workload
under vLLM's pricing and the table's in turn, stock1, table1, table2, stock2); TABLE: the table
it swapped in; NAME: the arms.json schedule the engine enforced (vLLM's synthetic rejection
sampler, with the acceptance estimator pinned to it, so the expected tokens of a step are known).

Per workload, from the arm's per-step file (its step timer: each call's requests, scheduled and
forwarded tokens, and its length, one call's start to the next's):

* **measured decode goodput** per turn: over the steps whose requests all decode (scheduled
  tokens = requests x (1 + k)), the expected generated tokens over the steps' summed length. A
  step of r requests that forwarded f tokens verified D = f - r drafts; vLLM's budget rule, with
  every position's acceptance equal across requests, gives each request floor(D / r) or one more
  (the first D mod r), and a request verifying d drafts generates 1 + rates[0] + ... + rates[d-1]
  tokens in expectation. The turn's tokens are the enforced schedule's expectation, its time is
  measured;
* **predicted decode goodput**: ``advise.predict_steps`` on the stock turns' decode steps (their
  batch sizes), each at the workload's mean context (its prompts' mean + half the output: the A/B
  runs with observe off, so a step's own context is not recorded), context-aware (the table's
  pricing) over adaptive@8192 (the table's 8192 curves deciding, as vLLM's start-up profile does);
* **predicted tok/s ratio** of the whole workload: the stock turn's wall time over that wall
  time with its decode steps' time divided by the predicted decode ratio (prefill-carrying steps
  and the rest kept), averaged over the two stock turns.

The prediction knows only the stock turns: both pricings are priced on their batch sizes, at one
mean context. Two checks say where it misses: the decode ratio predicted with each pricing on its
own turns' batch sizes (the table's turns finish requests sooner and decode at fewer requests),
and per turn the served decode steps' length over the model's (the median of the per-step
ratios, and the summed time over the summed model). The measured tok/s ratio is the harness
report's (ab_comparison).

``--fixed RESULTS ARM`` puts a fixed-K arm (adaptive verification off, serve_context.py's
``fixed``) beside them: its predicted tok/s over stock's is the same whole-workload conversion
with advise's K=k decode goodput over stock's; measured, its tok/s (and decode goodput, every
request verifying k drafts) over the A/B's stock turns. A fixed-K arm is its own engine, so the
comparison crosses engines (and hosts, when run apart): the A/B's in-engine noise does not bound
it. Analysis only: numpy and this repository, no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_context as sc  # noqa: E402 - a sibling script, found by the path above

from dspark_calib.advise import ADAPTIVE, Acceptance, predict_steps  # noqa: E402
from dspark_calib.table.file import read_table  # noqa: E402

TURNS = tuple(f"{p}{n}" for p, n in sc.AB_ORDER)


def expected_tokens(num_reqs: int, drafts: int, rates: list[float]) -> float:
    """A decode step's expected generated tokens: D drafts over r requests, floor(D / r) each and
    one more for the first D mod r, each request 1 + the survival of the drafts it verifies."""
    each, extra = divmod(drafts, num_reqs)
    cum = [0.0]
    for r in rates:
        cum.append(cum[-1] + r)
    each = min(each, len(rates))
    return num_reqs + (num_reqs - extra) * cum[each] + extra * cum[min(each + 1, len(rates))]


def decode_steps(raw: dict[str, Any], k: int) -> list[tuple[int, int, float]]:
    """(requests, drafts verified, step ms) of each all-decode call that has a successor (its length)."""
    interval = raw["interval_ms"]
    out = []
    for i, (t, r, f) in enumerate(zip(raw["num_tokens"], raw["num_reqs"], raw.get("forward_tokens") or ())):
        if i + 1 >= len(interval) or interval[i + 1] is None or f is None or r <= 0 or t != r * (1 + k):
            continue
        out.append((r, f - r, interval[i + 1]))
    return out


def decode_work(raw: dict[str, Any], rates: list[float]) -> tuple[list[tuple[int, int, float]], float, float,
                                                                  float | None]:
    """A turn's all-decode steps (decode_steps), their expected generated tokens, their summed
    length (ms) and the tokens per ms (None without a step)."""
    dec = decode_steps(raw, len(rates))
    tokens = sum(expected_tokens(r, d, rates) for r, d, _ in dec)
    ms = sum(s for _, _, s in dec)
    return dec, tokens, ms, tokens / ms if ms else None


def step_vs_model(table: Any, acceptance: Acceptance, steps: list[tuple[int, int, float]], context: float, *,
                  stock: bool) -> dict[str, float | None]:
    """A turn's decode steps' measured length over the model's step at its batch size and the
    turn's pricing (adaptive@8192 for stock turns, context-aware for the table's), at the
    workload's mean context: the median of the per-step ratios, and the summed time over the
    summed model (what a goodput ratio sees): are the table's step costs what served?"""
    modelled: dict[int, float] = {}
    ratios, served, model = [], 0.0, 0.0
    for r, _, ms in steps:
        if r not in modelled:
            mix = predict_steps(table, acceptance, [r], [context])
            o = mix.option(mix.one_context_name if stock else ADAPTIVE)
            modelled[r] = o.ms
        ratios.append(ms / modelled[r])
        served, model = served + ms, model + modelled[r]
    if not ratios:
        return {"median": None, "total": None}
    return {"median": round(float(np.median(ratios)), 4), "total": round(served / model, 4)}


def arm_files(results: str, arm: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """An arm's harness summary and its per-step file (serve_context.py's context-ARM.json and
    context-ARM-steps.json)."""
    with open(os.path.join(results, f"context-{arm}.json")) as fh:
        summary = json.load(fh)
    with open(os.path.join(results, f"context-{arm}-steps.json")) as fh:
        return summary, json.load(fh)


def fixed_arm(results: str, arm: str, rates: list[float]) -> dict[str, dict[str, float | None]]:
    """Per workload of a fixed-K arm: its tok/s and measured decode goodput (all-decode steps, each
    request verifying every draft)."""
    summary, steps = arm_files(results, arm)
    spec = (summary.get("engine") or {}).get("speculative_config") or {}
    served = (spec.get("enable_adaptive_verification"), spec.get("num_speculative_tokens"),
              spec.get("synthetic_acceptance_rates"))
    if served != (False, len(rates), rates):
        sys.exit(f"{results}: arm {arm} is not fixed K={len(rates)} at rates {rates}: its engine served adaptive "
                 f"verification {served[0]}, K {served[1]}, rates {served[2]}")
    return {name: {"output_tok_s": w["output_tok_s"],
                   "decode_goodput": decode_work(steps[name], rates)[3] if name in steps else None}
            for name, w in summary["workloads"].items()}


def whole_ratio(turns: list[dict[str, Any]], decode_ratio: float) -> float:
    """A workload's predicted tok/s ratio: each stock turn's wall time over that wall time with its
    decode steps' time divided by the predicted decode goodput ratio, averaged over the turns."""
    whole = [t["wall_s"] * 1000 / (t["wall_s"] * 1000 - t["decode_ms"] + t["decode_ms"] / decode_ratio) for t in turns]
    return sum(whole) / len(whole)


def analyse(results: str, arm: str, table_path: str, rates: list[float],
            fixed: dict[str, dict[str, float | None]] | None = None) -> list[dict[str, Any]]:
    summary, steps = arm_files(results, arm)
    table = read_table(table_path, samples=False)
    k = len(rates)
    acceptance = Acceptance(tuple(rates), "given")
    bases = list(dict.fromkeys(n.partition("@")[0] for n in summary["workloads"]))  # in served order
    out = []
    for base in bases:
        turns, decs, spec = {}, {}, None
        for turn in TURNS:
            w = summary["workloads"].get(f"{base}@{turn}")
            raw = steps.get(f"{base}@{turn}")
            if w is None or raw is None:
                break
            spec = w["workload"]
            dec, tokens, ms, goodput = decode_work(raw, rates)
            decs[turn] = dec
            turns[turn] = {"wall_s": w["wall_s"], "output_tok_s": w["output_tok_s"], "decode_steps": len(dec),
                           "mean_requests": round(sum(r for r, _, _ in dec) / max(1, len(dec)), 2),
                           "full_batch_share": round(sum(r == spec["concurrency"] for r, _, _ in dec) / max(1, len(dec)), 3),
                           "decode_ms": round(ms, 1), "decode_tokens": round(tokens, 1),
                           "drafts_per_request": round(sum(d for _, d, _ in dec) / max(1, sum(r for r, _, _ in dec)), 3),
                           "decode_goodput": goodput, "requests": [r for r, _, _ in dec]}
        if len(turns) < len(TURNS):
            continue
        context = sum(spec["prompt_lens"]) / len(spec["prompt_lens"]) + spec["output_len"] / 2
        for turn, t in turns.items():
            t["step_vs_model"] = step_vs_model(table, acceptance, decs[turn], context, stock=turn.startswith("stock"))
        stock_reqs = turns["stock1"]["requests"] + turns["stock2"]["requests"]
        mix = predict_steps(table, acceptance, stock_reqs, [context] * len(stock_reqs))
        aware, one = mix.option(ADAPTIVE), mix.option(mix.one_context_name)
        predicted = aware.goodput / one.goodput
        table_reqs = turns["table1"]["requests"] + turns["table2"]["requests"]
        own = predict_steps(table, acceptance, table_reqs, [context] * len(table_reqs)).option(ADAPTIVE)

        def mean(key: str, pricing: str) -> float:
            return (turns[f"{pricing}1"][key] + turns[f"{pricing}2"][key]) / 2

        def spread(key: str) -> float:
            return max(abs(turns[f"{p}2"][key] / turns[f"{p}1"][key] - 1) for p in ("stock", "table"))

        stock_turns = [turns["stock1"], turns["stock2"]]
        row = {
            "workload": base, "context_modelled": context, "turns": {t: {k2: v for k2, v in x.items() if k2 != "requests"}
                                                                    for t, x in turns.items()},
            "decode_share_stock": round(mean("decode_ms", "stock") / (mean("wall_s", "stock") * 1000), 3),
            "drafts_modelled": {"table": aware.drafts / mix.requests, "stock": one.drafts / mix.requests},
            "drafts_measured": {"table": mean("drafts_per_request", "table"), "stock": mean("drafts_per_request", "stock")},
            "mean_requests": {"table": mean("mean_requests", "table"), "stock": mean("mean_requests", "stock")},
            "decode_goodput_ratio": {"predicted": predicted, "predicted_own_batches": own.goodput / one.goodput,
                                     "measured": mean("decode_goodput", "table") / mean("decode_goodput", "stock"),
                                     "noise": spread("decode_goodput")},
            "tok_s_ratio": {"predicted": whole_ratio(stock_turns, predicted),
                            "measured": mean("output_tok_s", "table") / mean("output_tok_s", "stock"),
                            "noise": spread("output_tok_s")},
            "fixed_k_vs_stock_predicted": {o.name: o.goodput / one.goodput for o in mix.options if o.name.startswith("K=")},
        }
        f = (fixed or {}).get(base)
        if f is not None:
            kfix = mix.option(f"K={k}").goodput / one.goodput
            pred = whole_ratio(stock_turns, kfix)
            goodput = f["decode_goodput"]
            row["fixed"] = {
                "k": k, "decode_goodput_ratio_vs_stock": {
                    "predicted": kfix, "measured": goodput / mean("decode_goodput", "stock") if goodput else None},
                "tok_s_ratio_vs_stock": {"predicted": pred,
                                         "measured": f["output_tok_s"] / mean("output_tok_s", "stock")},
                "tok_s_table_over_fixed": {"predicted": row["tok_s_ratio"]["predicted"] / pred,
                                           "measured": mean("output_tok_s", "table") / f["output_tok_s"]}}
        out.append(row)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | drafts a request stock / table: modelled | measured | decode share (stock) "
             "| decode goodput table / stock: predicted | measured (noise) | tok/s table / stock: predicted "
             "| measured (noise) | apart |",
             "|---|---|---|---:|---:|---|---:|---|---:|"]
    for r in rows:
        dm, dd = r["drafts_modelled"], r["drafts_measured"]
        g, t = r["decode_goodput_ratio"], r["tok_s_ratio"]
        lines.append(f"| {r['workload']} | {dm['stock']:.2f} / {dm['table']:.2f} | {dd['stock']:.2f} / {dd['table']:.2f} "
                     f"| {r['decode_share_stock']:.2f} | {g['predicted']:.3f} | {g['measured']:.3f} ({g['noise']:.3f}) "
                     f"| {t['predicted']:.3f} | {t['measured']:.3f} ({t['noise']:.3f}) "
                     f"| {100 * (t['predicted'] / t['measured'] - 1):+.1f} % |")
    lines += ["", "| workload | decode goodput ratio predicted on each pricing's own turns' batch sizes | measured |",
              "|---|---:|---:|"]
    lines += [f"| {r['workload']} | {r['decode_goodput_ratio']['predicted_own_batches']:.3f} "
              f"| {r['decode_goodput_ratio']['measured']:.3f} |" for r in rows]
    lines += ["", "| workload | turn | decode steps | mean requests | full-batch share "
              "| measured / modelled step: median | summed |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for turn, t in r["turns"].items():
            v = t["step_vs_model"]
            lines.append(f"| {r['workload']} | {turn} | {t['decode_steps']} | {t['mean_requests']:.1f} "
                         f"| {t['full_batch_share']:.2f} | {v['median']:.3f} | {v['total']:.3f} |")
    fixed = [r for r in rows if "fixed" in r]
    if fixed:
        lines += ["", "| workload | fixed K: tok/s over stock, predicted | measured | decode goodput over stock, "
                  "predicted | measured | table over fixed K tok/s, predicted | measured |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in fixed:
            f = r["fixed"]
            t, g, tf = f["tok_s_ratio_vs_stock"], f["decode_goodput_ratio_vs_stock"], f["tok_s_table_over_fixed"]
            gm = "-" if g["measured"] is None else f"{g['measured']:.3f}"
            lines.append(f"| {r['workload']} (K={f['k']}) | {t['predicted']:.3f} | {t['measured']:.3f} "
                         f"| {g['predicted']:.3f} | {gm} | {tf['predicted']:.3f} | {tf['measured']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("arm")
    p.add_argument("table")
    p.add_argument("--schedule", required=True, choices=sorted(sc.CONFIG["schedules"]))
    p.add_argument("--fixed", nargs=2, metavar=("RESULTS", "ARM"), help="a fixed-K arm served at the same schedule")
    p.add_argument("--json")
    p.add_argument("--md")
    a = p.parse_args(argv)
    rates = list(sc.CONFIG["schedules"][a.schedule])
    rows = analyse(a.results, a.arm, a.table, rates, fixed_arm(*a.fixed, rates) if a.fixed else None)
    text = markdown(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"schedule": a.schedule, "fixed": a.fixed, "rows": rows}, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

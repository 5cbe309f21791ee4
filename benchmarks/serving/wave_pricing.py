"""Do FlashAttention-3's work-tile rounds explain the decode verifies a table prices low? Offline,
on committed observe files.

    python3 benchmarks/serving/wave_pricing.py --arm NAME RESULTS ARM TABLE [--arm ...]
        --decide NAME:WORKLOAD[,WORKLOAD...] [--kv-heads 8] [--sms 132] [--block-n 128]
        [--max-splits 32] [--json OUT.json] [--md OUT.md]

Each --arm is a serving run's folder and arm that observed (as judge_tables.py takes them) and the
table that prices its steps. The KV-sum rule prices a decode verify of N tokens by the KV it reads,
as R(N) = min(N, max_num_seqs) requests of the mean context S / R(N): the profile's shape. On an
H200 vLLM 0.33 runs that attention with FA3 (Hopper) and its scheduler metadata: every request
splits into ceil(blocks / blocks_per_sm) pieces, blocks_per_sm = ceil(1.1 x total blocks x KV heads
/ SMs) (flash_prepare_scheduler.cu; at most --max-splits, vLLM's cap under CUDA graphs), and the
request x KV-head x split tiles run in rounds over the SMs. A step with a few more tiles than SMs
(18 requests x 8 KV heads = 144 on 132 SMs, no split) needs a second round for 12 tiles; the
profile's R(N) requests at the same KV read fill their rounds. The model, per step, with
uniform request lengths where the step recorded only their mean:

* tiles, tile length and rounds as above; a last round of k < SMs tiles takes max(k / SMs, 1 / f)
  of a full one: a lone SM streams at most f times its fair share of HBM (f = 1: a whole round,
  f -> infinity: no cost for the partial round);
* wave-aware price = a + (P - a) x rounds_served / rounds_profile (each over its ideal, the tiles'
  blocks spread evenly), P the engine's price, a the table's verify at N extrapolated to context 0
  (through its two shortest contexts): the part that does not read the KV.

Where a step recorded its requests' context order statistics (observe's context_quantiles,
schema 1.7), the served step's requests take those lengths (interpolated between the recorded
ranks) instead of the mean: each request splits by its own blocks, the tiles run longest first,
and each round lasts as long as its longest tile (a part-full last round as above).

f is the one number chosen, on the --decide arm's named workloads only (the f in 1.00, 1.05 ...
4.00 with the smallest median absolute error); every other step is held out from it. The report:
today's residual by the served step's round fill (f = 1, no choice involved: the telemetry that
shows the cause), and today's pricing against the wave-aware one per arm, context bucket and shape
bucket (validate.fill_buckets). Analysis only: numpy and this repository, no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import judge_tables as jt  # noqa: E402 - a sibling script, found by the path above

F_GRID = np.round(np.arange(1.0, 4.0001, 0.05), 2)
FILL_EDGES = (0.6, 0.75, 0.9)  # round-fill buckets of the served step
FILL_NAMES = ("<0.6", "0.6-0.75", "0.75-0.9", ">=0.9")
CONTEXT_FLOOR = 1024


def rounds_over_ideal(num_reqs: np.ndarray, context: np.ndarray, f: float, *, kv_heads: int, sms: int,
                      block_n: int, max_splits: int) -> np.ndarray:
    """FA3's attention time of num_reqs requests of `context` tokens each over the time of the same
    blocks spread evenly over the SMs (>= 1): the rounds of its split tiles, a partial last round
    taking max(k / sms, 1 / f) of a full one."""
    n = np.maximum(np.asarray(num_reqs, dtype=float), 1.0)
    blocks = np.maximum(np.ceil(np.asarray(context, dtype=float) / block_n), 1.0)
    per_sm = np.ceil(n * blocks * 1.1 * kv_heads / sms)
    splits = np.clip(np.ceil(blocks / per_sm), 1, max_splits)
    tile = np.ceil(blocks / splits)
    tiles = n * kv_heads * splits
    full = np.floor(tiles / sms)
    last = tiles - full * sms
    rounds = full + np.where(last > 0, np.maximum(last / sms, 1.0 / f), 0.0)
    return rounds * tile / (n * blocks * kv_heads / sms)


def rounds_over_ideal_lengths(lengths: np.ndarray, f: float, *, kv_heads: int, sms: int, block_n: int,
                              max_splits: int) -> float:
    """rounds_over_ideal of one step whose requests have these lengths: the FA3 split per request,
    its tiles longest first in rounds of `sms`, each round as long as its longest tile, a partial
    last round max(k / sms, 1 / f) of that. Equal lengths give rounds_over_ideal's value."""
    blocks = np.maximum(np.ceil(np.asarray(lengths, dtype=float) / block_n), 1.0)
    per_sm = np.ceil(blocks.sum() * 1.1 * kv_heads / sms)
    splits = np.clip(np.ceil(blocks / per_sm), 1, max_splits).astype(np.int64)
    tiles = np.sort(np.repeat(np.ceil(blocks / splits), splits * kv_heads))[::-1]
    heads = tiles[::sms]  # each round's longest tile
    last = len(tiles) - (len(heads) - 1) * sms
    time = heads[:-1].sum() + heads[-1] * (1.0 if last == sms else max(last / sms, 1.0 / f))
    return float(time / (blocks.sum() * kv_heads / sms))


def request_lengths(quantiles: np.ndarray, num_reqs: int) -> np.ndarray:
    """num_reqs lengths whose order statistics are the recorded ones (at observe.step.quantile_ranks),
    linear between them."""
    from dspark_calib.observe.step import quantile_ranks

    return np.interp(np.arange(num_reqs), quantile_ranks(num_reqs), quantiles)


def decode_verifies(results: str, arm: str, table_path: str,
                    decide: set[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """An arm's decode verifies, split into the decide workloads and the rest
    (judge_tables.arm_parts) or, without decide, all of them held out; with what the model needs:
    the engine's price, the measured forward, requests, R(N), the priced and the served contexts,
    and the table's price at context 0."""
    from dspark_calib.observe.file import read_observed
    from dspark_calib.pricing.rules import tail_context_sum
    from dspark_calib.table.file import read_table
    from dspark_calib.validate import AWARE, price_steps

    table = read_table(table_path)
    if decide is None:
        parts = {"held_out": read_observed([os.path.join(results, f"context-{arm}-observed.parquet")])}
    else:
        _, _, parts = jt.arm_parts(results, arm, decide)
    out = {}
    for part, sub in parts.items():
        p = price_steps(table, sub)
        c = sub.columns
        keep = np.asarray(p.steps["verify"])
        n, tokens = c["num_reqs"], c["num_target_tokens"]
        profile_reqs = np.minimum(tokens, p.costs.profile_num_reqs)
        kv = tail_context_sum(c["context_sum"], c["context_max"], n, p.tail, p.tail_rule).astype(float)
        lo, hi = sorted(p.costs.tables)[:2]
        v_lo, v_hi = p.costs.tables[lo][1][tokens], p.costs.tables[hi][1][tokens]
        out[part] = {"priced": np.asarray(p.predicted["verify"][AWARE], dtype=float)[keep],
                     "measured": np.asarray(c["forward_ms"], dtype=float)[keep],
                     "num_reqs": n[keep], "num_tokens": tokens[keep], "profile_reqs": profile_reqs[keep],
                     "profile_context": (kv / np.maximum(profile_reqs, 1))[keep],
                     "context": c["context_mean"][keep].astype(float),
                     "quantiles": c["context_quantiles"][keep],
                     "at_zero": (v_lo - (v_hi - v_lo) * lo / (hi - lo))[keep]}
    return out


def served_rounds(d: dict[str, np.ndarray], f: float, **hw: int) -> np.ndarray:
    """rounds_over_ideal of each served step: of its requests' recorded lengths where observe
    recorded their order statistics, else of num_reqs requests at the mean."""
    from dspark_calib.observe.step import ABSENT

    served = rounds_over_ideal(d["num_reqs"], d["context"], f, **hw)
    for i in np.flatnonzero(d["quantiles"][:, 0] != ABSENT):
        served[i] = rounds_over_ideal_lengths(request_lengths(d["quantiles"][i], int(d["num_reqs"][i])), f, **hw)
    return served


def wave_price(d: dict[str, np.ndarray], f: float, **hw: int) -> np.ndarray:
    served = served_rounds(d, f, **hw)
    profiled = rounds_over_ideal(d["profile_reqs"], d["profile_context"], f, **hw)
    return d["at_zero"] + (d["priced"] - d["at_zero"]) * served / profiled


def choose_f(d: dict[str, np.ndarray], **hw: int) -> float:
    scores = [float(np.median(np.abs(wave_price(d, f, **hw) / d["measured"] - 1.0))) for f in F_GRID]
    return float(F_GRID[int(np.argmin(scores))])


def analyse(arms: dict[str, tuple[str, str, str]], decide_arm: str, decide: set[str], **hw: int) -> dict[str, Any]:
    from dspark_calib.validate import FILL_LABELS, ErrorStats, bucket_label, fill_buckets, pow2_bucket

    if decide_arm not in arms:
        raise ValueError(f"--decide {decide_arm}: not one of the --arm names ({', '.join(arms)})")
    steps = {name: decode_verifies(*spec, decide if name == decide_arm else None) for name, spec in arms.items()}
    fit = steps[decide_arm].get("decide")
    if fit is None or not len(fit["measured"]):
        raise ValueError(f"--decide {decide_arm}:{','.join(sorted(decide))}: no decode verifies to choose f on")
    f = choose_f(fit, **hw)
    rows, fills = [], []
    for name, parts in steps.items():
        held = {part: d for part, d in parts.items() if not (name == decide_arm and part == "decide")}
        if not held:
            continue
        d = {k: np.concatenate([h[k] for h in held.values()]) for k in next(iter(held.values()))}
        wave = wave_price(d, f, **hw)
        ctx = pow2_bucket(d["context"].astype(np.int64), CONTEXT_FLOOR)
        fill = 1.0 / served_rounds(d, 1.0, **hw)
        fill_bucket = np.searchsorted(np.asarray(FILL_EDGES), fill, side="right")
        fills += [{"arm": name, "context_bucket": bucket_label(int(cb), CONTEXT_FLOOR), "round_fill": label,
                   "steps": int(sel.sum()), "priced": ErrorStats.of(d["priced"][sel], d["measured"][sel]).to_dict()}
                  for cb in np.unique(ctx) for b, label in enumerate(FILL_NAMES)
                  for sel in [(ctx == cb) & (fill_bucket == b)] if sel.any()]
        shape = fill_buckets(d["num_reqs"], d["num_tokens"], int(d["profile_reqs"].max()))
        groups = [("all", "all", np.ones(len(ctx), bool))]
        groups += [(bucket_label(int(cb), CONTEXT_FLOOR), "all", ctx == cb) for cb in np.unique(ctx)]
        groups += [(bucket_label(int(cb), CONTEXT_FLOOR), FILL_LABELS[sb], (ctx == cb) & (shape == sb))
                   for cb in np.unique(ctx) for sb in np.unique(shape[ctx == cb])]
        rows += [{"arm": name, "context_bucket": cb, "fill_bucket": fb, "steps": int(sel.sum()),
                  "priced": ErrorStats.of(d["priced"][sel], d["measured"][sel]).to_dict(),
                  "wave_aware": ErrorStats.of(wave[sel], d["measured"][sel]).to_dict()} for cb, fb, sel in groups]
    fit_err = ErrorStats.of(wave_price(fit, f, **hw), fit["measured"]).to_dict()
    return {"arms": {n: {"results": r, "arm": a, "table": t} for n, (r, a, t) in arms.items()},
            "decide": {"arm": decide_arm, "workloads": sorted(decide), "steps": int(len(fit["measured"])),
                       "f": f, "priced": ErrorStats.of(fit["priced"], fit["measured"]).to_dict(), "wave_aware": fit_err},
            "hardware": hw, "by_round_fill": fills, "rows": rows}


def markdown(doc: dict[str, Any]) -> str:
    dec, hw = doc["decide"], doc["hardware"]
    lines = [f"Decode verifies priced as the engine prices them and wave-aware (FA3 tile rounds: {hw['kv_heads']} KV "
             f"heads, {hw['sms']} SMs, {hw['block_n']}-token blocks, at most {hw['max_splits']} splits). "
             f"f = {dec['f']:g}, chosen on {dec['steps']} decode verifies of arm {dec['arm']} "
             f"({', '.join(dec['workloads'])}): priced {jt._cell(dec['priced'])} -> wave-aware "
             f"{jt._cell(dec['wave_aware'])}. Every row below is held out from that choice. "
             "Median absolute error % (bias %).", "", "Arms:", ""]
    lines += [f"- {n}: `{a['results']}` arm `{a['arm']}`, table `{a['table']}`" for n, a in doc["arms"].items()]
    lines += ["", "Today's pricing by context and the served step's round fill (its tiles' blocks over its rounds' "
                  "capacity, f = 1: nothing chosen):", "",
              "| arm | context | round fill | steps | priced |", "|---|---|---|---:|---:|"]
    lines += [f"| {r['arm']} | {r['context_bucket']} | {r['round_fill']} | {r['steps']} | {jt._cell(r['priced'])} |"
              for r in doc["by_round_fill"]]
    lines += ["", "By context and shape (requests / R(N)):", "",
              "| arm | context | requests / R(N) | steps | priced | wave-aware |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['arm']} | {r['context_bucket']} | {r['fill_bucket']} | {r['steps']} | {jt._cell(r['priced'])} | "
              f"{jt._cell(r['wave_aware'])} |" for r in doc["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", nargs=4, action="append", required=True, metavar=("NAME", "RESULTS", "ARM", "TABLE"))
    p.add_argument("--decide", required=True, metavar="NAME:WORKLOAD[,WORKLOAD...]")
    p.add_argument("--kv-heads", type=int, default=8, help="the target's KV heads per GPU (Qwen3-8B at tp 1: 8)")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SMs (H200: 132)")
    p.add_argument("--block-n", type=int, default=128, help="FA3's KV block of a decode tile, tokens")
    p.add_argument("--max-splits", type=int, default=32, help="vLLM's split cap under full CUDA graphs")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    arms = {}
    for name, results, arm, table in args.arm:
        if name in arms or not os.path.isfile(table):
            print(f"--arm {name}: " + ("the name is given twice" if name in arms else f"no table {table}"),
                  file=sys.stderr)
            return 2
        arms[name] = (results, arm, table)
    decide_arm, colon, workloads = args.decide.partition(":")
    hw = {"kv_heads": args.kv_heads, "sms": args.sms, "block_n": args.block_n, "max_splits": args.max_splits}
    if not colon or not workloads or min(hw.values()) < 1:
        print("--decide NAME:WORKLOAD[,...] and positive hardware numbers expected", file=sys.stderr)
        return 2
    return jt.run("wave_pricing", args, lambda: analyse(arms, decide_arm, set(workloads.split(",")), **hw), markdown)


if __name__ == "__main__":
    sys.exit(main())

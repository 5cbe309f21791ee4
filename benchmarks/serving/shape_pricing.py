"""Would a second verify shape price served steps better? Offline, on committed observe files.

    python3 benchmarks/serving/shape_pricing.py CAPTURE TABLE RESULTS ARM --decide WORKLOAD[,...]
        [--json OUT.json] [--md OUT.md]

CAPTURE is rank 0's kept capture of a `profile --shape-replays N` run (samples-rank0.json with
``shape_samples``), TABLE the table that run wrote (the profile's own shape: R(N) = min(N,
max_num_seqs) requests of about one token), RESULTS / ARM a serving run's folder and an arm that
observed (as judge_tables.py takes them). The capture's shape samples time each size N above
the CUDA-graph capture limit as N / q requests of q = k + 1 tokens at every profiled context
(capture.py says why not below it).

Every decode verify of the arm is priced two ways:

* **profile shape**: exactly as the engine prices it today (validate.price_steps, context-aware);
* **two shapes**: the step's tokens a request t = N / requests (1 <= t <= q) place it between the
  profile's shape (t = 1, the price above) and the uniform-decode shape (t = q: the shape curve
  at N, at the context whose N / q requests read the step's KV sum, q x S / N), linearly in t.
  S is the KV sum the engine prices (raised by its mixed-context tail, as the price above).
  Sizes outside the shape curve's range (below its smallest N, above its largest) keep the
  profile shape's price.

The errors are reported per part (the --decide workloads, and the rest held out), context bucket
and shape bucket (validate.fill_buckets), as judge_tables.py splits them; the verdict reads the
held-out part only. Analysis only: numpy and this repository, no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import judge_tables as jt  # noqa: E402 - a sibling script, found by the path above

PRICINGS = ("profile_shape", "two_shapes")


def shape_curves(capture: dict[str, Any]) -> tuple[int, dict[int, dict[int, float]]]:
    """(q, {context: {N: median forward_ms}}) of the capture's shape samples; q from their
    tokens over requests (one q for all, else ValueError)."""
    samples = capture.get("shape_samples") or []
    if not samples:
        raise ValueError("the capture holds no shape_samples: profile with --shape-replays N and --keep-capture")
    qs = {s["num_target_tokens"] // s["num_reqs"] for s in samples if s["num_reqs"] > 0}
    if len(qs) != 1:
        raise ValueError(f"the shape samples mix tokens per request {sorted(qs)}: one uniform-decode shape expected")
    grouped: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        grouped[int(s["context_len"])][int(s["num_target_tokens"])].append(float(s["forward_ms"]))
    return qs.pop(), {ctx: {n: float(np.median(v)) for n, v in sorted(by_n.items())}
                      for ctx, by_n in sorted(grouped.items())}


def shape_price(curves: dict[int, dict[int, float]], n: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    """The shape curve at sizes n and per-request contexts ctx: linear in N between measured sizes
    (NaN outside them), then linear in context between the two nearest profiled contexts (the
    two nearest ends' line outside)."""
    contexts = sorted(curves)
    sizes = sorted(set.intersection(*(set(curves[c]) for c in contexts)))
    at_ctx = np.array([np.interp(n, sizes, [curves[c][s] for s in sizes], left=np.nan, right=np.nan)
                       for c in contexts])  # contexts x steps
    if len(contexts) == 1:
        return at_ctx[0]
    hi = np.clip(np.searchsorted(contexts, ctx), 1, len(contexts) - 1)
    lo = hi - 1
    c_lo, c_hi = np.asarray(contexts)[lo], np.asarray(contexts)[hi]
    cols = np.arange(len(n))
    y_lo, y_hi = at_ctx[lo, cols], at_ctx[hi, cols]
    return y_lo + (y_hi - y_lo) * (ctx - c_lo) / (c_hi - c_lo)


def two_shapes(profile: np.ndarray, curves: dict[int, dict[int, float]], q: int, num_reqs: np.ndarray,
               num_tokens: np.ndarray, context_sum: np.ndarray) -> np.ndarray:
    """The profile shape's price moved towards the uniform-decode shape's by the step's tokens a
    request (the module docstring)."""
    t = num_tokens / np.maximum(num_reqs, 1)
    w = np.clip((t - 1.0) / (q - 1.0), 0.0, 1.0)
    uniform = shape_price(curves, num_tokens.astype(float), q * context_sum / np.maximum(num_tokens, 1))
    return np.where(np.isnan(uniform), profile, (1 - w) * profile + w * np.nan_to_num(uniform))


def compare(capture: dict[str, Any], table_path: str, results: str, arm: str, decide: set[str]) -> dict[str, Any]:
    from dspark_calib.pricing.rules import tail_context_sum
    from dspark_calib.table.file import read_table
    from dspark_calib.validate import AWARE, FILL_LABELS, ErrorStats, bucket_label, fill_buckets, pow2_bucket, price_steps

    q, curves = shape_curves(capture)
    table = read_table(table_path)
    arm_json, _, parts = jt.arm_parts(results, arm, decide)
    rows = []
    for part, sub in parts.items():
        p = price_steps(table, sub)
        c = sub.columns
        keep = np.asarray(p.steps["verify"])
        profile = np.asarray(p.predicted["verify"][AWARE], dtype=float)
        kv = tail_context_sum(c["context_sum"], c["context_max"], c["num_reqs"], p.tail, p.tail_rule)
        priced = {"profile_shape": profile,
                  "two_shapes": two_shapes(profile, curves, q, c["num_reqs"], c["num_target_tokens"], kv)}
        measured = np.asarray(c["forward_ms"], dtype=float)
        ctx_bucket = pow2_bucket(c["context_mean"].astype(np.int64), 1024)
        fill_bucket = fill_buckets(c["num_reqs"], c["num_target_tokens"], p.costs.profile_num_reqs)
        groups = [("all", "all", keep)]
        groups += [(bucket_label(int(cb), 1024), "all", keep & (ctx_bucket == cb)) for cb in np.unique(ctx_bucket[keep])]
        groups += [(bucket_label(int(cb), 1024), FILL_LABELS[fb], keep & (ctx_bucket == cb) & (fill_bucket == fb))
                   for cb in np.unique(ctx_bucket[keep]) for fb in np.unique(fill_bucket[keep & (ctx_bucket == cb)])]
        for context_bucket, fill_label, sel in groups:
            rows.append({"part": part, "context_bucket": context_bucket, "fill_bucket": fill_label,
                         "steps": int(sel.sum()),
                         **{how: ErrorStats.of(priced[how][sel], measured[sel]).to_dict() for how in PRICINGS}})
    return {"capture_q": q, "shape_contexts": sorted(curves), "table": table_path, "results": results, "arm": arm,
            "workloads": {"decide": [w for w in arm_json["workloads"] if w in decide],
                          "held_out": [w for w in arm_json["workloads"] if w not in decide]}, "rows": rows}


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"Decode verifies of arm `{doc['arm']}` ({doc['results']}), priced by `{doc['table']}` (profile shape) "
             f"and with the uniform-decode shape of {doc['capture_q']} tokens a request beside it (two shapes); "
             f"decided on {', '.join(doc['workloads']['decide'])}, held out: "
             f"{', '.join(doc['workloads']['held_out'])}. Median absolute error % (bias %).", ""]
    for part in jt.PARTS:
        rows = [r for r in doc["rows"] if r["part"] == part]
        if not rows:
            continue
        lines += [f"{'Decide' if part == 'decide' else 'Held out'}:", "",
                  "| context | requests / R(N) | steps | profile shape | two shapes |", "|---|---|---:|---:|---:|"]
        lines += [f"| {r['context_bucket']} | {r['fill_bucket']} | {r['steps']} | {jt._cell(r['profile_shape'])} | "
                  f"{jt._cell(r['two_shapes'])} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("capture")
    p.add_argument("table")
    p.add_argument("results")
    p.add_argument("arm")
    p.add_argument("--decide", required=True, help="comma list of the workloads a choice is decided on")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    def build() -> dict[str, Any]:
        with open(args.capture) as fh:
            capture = json.load(fh)
        return compare(capture, args.table, args.results, args.arm, set(args.decide.split(",")))

    return jt.run("shape_pricing", args, build, markdown)


if __name__ == "__main__":
    sys.exit(main())

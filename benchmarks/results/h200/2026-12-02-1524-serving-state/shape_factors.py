"""The simplest shape correction, decided on one workload and judged on the others.

One factor per shape bucket of the decode verifies (validate.fill_buckets: the step's requests
over the profile's R(N)), the median of measured / priced over the stock arm's ctx3k steps of
this run (the decide part, the startup table), applied to steps it was not fitted on: this run's
stock arm on ctx12k and the mix, the context-aware arm's ctx12k and mix steps (same table), and
the stock arms of two earlier runs priced by the shipped table (all their workloads; the 0438
run on another host than the table's). Prices are validate's own (price_steps, context-aware, the
tail and chunks each file's engine recorded). Median signed error % (bias) and median absolute
error %, before and after, per context and shape bucket of at least MIN_STEPS steps. Run from
the repository root:

    python benchmarks/results/h200/2026-12-02-1524-serving-state/shape_factors.py
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join("benchmarks", "serving"))

import serve_context as sc  # noqa: E402 - the harness's segmentation of an arm's observe file

from dspark_calib.observe.file import ObservedSteps, read_observed  # noqa: E402
from dspark_calib.table.file import read_table  # noqa: E402
from dspark_calib.validate import AWARE, FILL_LABELS, bucket_label, fill_buckets, pow2_bucket, price_steps  # noqa: E402

H = "benchmarks/results/h200/"
RUN = H + "2026-12-02-1524-serving-state/"
STARTUP = RUN + "tables/startup.parquet"
SHIPPED = "profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"
MIN_STEPS = 20


def decode_verifies(results: str, arm: str, table: str, workloads: set[str] | None) -> dict[str, np.ndarray]:
    """The arm's decode verifies of these workloads (None: all): measured, priced, shape, context,
    whether the step replayed a full CUDA graph, and its tokens."""
    with open(os.path.join(results, f"context-{arm}.json")) as fh:
        names = list(json.load(fh)["workloads"])
    obs = read_observed([os.path.join(results, f"context-{arm}-observed.parquet")])
    cols = sc.sorted_columns(dict(obs.columns))
    segments, why = sc.segment_steps(cols, len(names))
    if segments is None:
        raise SystemExit(f"{results} {arm}: {why}")
    rows = np.concatenate([s for w, s in zip(names, segments) if workloads is None or w in workloads])
    sub = ObservedSteps({k: v[rows] for k, v in cols.items()}, obs.files, obs.metadata)
    p = price_steps(read_table(table), sub)
    c, keep = sub.columns, np.asarray(p.steps["verify"])
    return {"measured": c["forward_ms"][keep], "priced": np.asarray(p.predicted["verify"][AWARE])[keep],
            "shape": fill_buckets(c["num_reqs"], c["num_target_tokens"], p.costs.profile_num_reqs)[keep],
            "context": pow2_bucket(c["context_mean"].astype(np.int64), 1024)[keep],
            "full_graph": np.asarray(c["full_cudagraph"]).astype(bool)[keep], "tokens": c["num_target_tokens"][keep]}


def report(name: str, steps: dict[str, np.ndarray], factors: dict[int, float]) -> list[str]:
    after = steps["priced"] * np.array([factors.get(int(s), 1.0) for s in steps["shape"]])
    lines = [f"{name}:", "", "| context | requests / R(N) | steps | bias before | median before | bias after | "
             "median after |", "|---|---|---:|---:|---:|---:|---:|"]
    for cb in np.unique(steps["context"]):
        for sb in np.unique(steps["shape"][steps["context"] == cb]):
            sel = (steps["context"] == cb) & (steps["shape"] == sb)
            if sel.sum() < MIN_STEPS:
                continue
            m = steps["measured"][sel]
            before, now = (steps["priced"][sel] - m) / m * 100, (after[sel] - m) / m * 100
            lines.append(f"| {bucket_label(int(cb), 1024)} | {FILL_LABELS[sb]} | {int(sel.sum())} | "
                         f"{np.median(before):+.2f} | {np.median(np.abs(before)):.2f} | {np.median(now):+.2f} | "
                         f"{np.median(np.abs(now)):.2f} |")
    return lines + [""]


def main() -> None:
    decide = decode_verifies(RUN + "arms", "stock", STARTUP, {"ctx3k"})
    factors = {int(s): float(np.median(decide["measured"][decide["shape"] == s] / decide["priced"][decide["shape"] == s]))
               for s in np.unique(decide["shape"])}
    out = ["Factors (measured / priced, median) fitted on this run's stock ctx3k decode verifies: "
           + ", ".join(f"{FILL_LABELS[s]} x{f:.4f}" for s, f in sorted(factors.items())), ""]
    held = {"ctx12k", "mix-2-4-12k"}
    out += report("this run, stock, ctx12k + mix (startup table)", decode_verifies(RUN + "arms", "stock", STARTUP, held),
                  factors)
    out += report("this run, context-aware, ctx12k + mix (startup table)",
                  decode_verifies(RUN + "arms", "aware-tail20-chunks", STARTUP, held), factors)
    for run in ("2026-12-01-0438-context", "2026-12-01-0742-context"):
        out += report(f"{run}, stock, all workloads (shipped table)", decode_verifies(H + run, "stock", SHIPPED, None),
                      factors)
    text = "\n".join(out)
    with open(RUN + "shape_factors.md", "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Does the mix's 4096-8191 residual follow the batch's make-up? Its held-out decode verifies of
at least 25 requests (the mix's full batches), priced by the shipped table as validate prices them
(price_steps, context-aware, each file's recorded tail and chunks), split into thirds of their mean
context; the longest request beside it. Stock arms of this run (host B) and of the 2026-12-02
15:24 run (host A), decided on ctx3k as judge_tables.py splits them. Run from the repository root:

    PYTHONPATH=. python benchmarks/results/h200/2026-12-03-1234-shape-heldout/mix_makeup.py

Writes mix_makeup.md beside this file and prints it.
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(RESULTS)), "serving"))

import judge_tables as jt  # noqa: E402 - benchmarks/serving, found by the path above

from dspark_calib.table.file import read_table  # noqa: E402
from dspark_calib.validate import AWARE, price_steps  # noqa: E402

SHIPPED = "profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"
HOSTS = {"A": os.path.join(RESULTS, "2026-12-02-1524-serving-state", "arms"), "B": os.path.join(HERE, "arms")}
MIN_REQS = 25


def thirds(results: str) -> tuple[list[str], int]:
    _, _, parts = jt.arm_parts(results, "stock", {"ctx3k"})
    sub = parts["held_out"]
    p, c = price_steps(read_table(SHIPPED), sub), sub.columns
    keep = (np.asarray(p.steps["verify"]) & (c["context_mean"] >= 4096) & (c["context_mean"] < 8192)
            & (c["num_reqs"] >= MIN_REQS))
    err = ((np.asarray(p.predicted["verify"][AWARE], float) - c["forward_ms"]) / c["forward_ms"] * 100)[keep]
    mean, top = c["context_mean"][keep], c["context_max"][keep]
    edges = np.quantile(mean, [0, 1 / 3, 2 / 3, 1])
    cells = []
    for i in range(3):
        sel = (mean >= edges[i]) & (mean <= edges[i + 1])
        cells.append(f"{edges[i]:.0f}-{edges[i + 1]:.0f}: {np.median(err[sel]):+.2f} / {np.median(abs(err[sel])):.2f}"
                     f" ({int(sel.sum())} steps, longest {int(top[sel].min())}-{int(top[sel].max())})")
    return cells, int(keep.sum())


def main() -> None:
    lines = [f"Held-out decode verifies of {MIN_REQS}+ requests at 4096-8191, shipped table, by thirds of their mean "
             "context: median signed error % / median absolute error % (steps, the longest request's range).", "",
             "| host | steps | lowest third | middle | highest |", "|---|---:|---|---|---|"]
    for host, results in HOSTS.items():
        cells, n = thirds(results)
        lines.append(f"| {host} | {n} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(HERE, "mix_makeup.md"), "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()

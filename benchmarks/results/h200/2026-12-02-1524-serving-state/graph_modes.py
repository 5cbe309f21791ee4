"""Is the 0.5-0.9 shape's residual the CUDA-graph mode? The decode verifies by shape and by whether
the step replayed a full CUDA graph (observe's `full_cudagraph`), per context bucket.

Each step's shape as in validate (its requests over the profile's R(N)); prices are validate's own
(price_steps, context-aware, the tail and chunks each file's engine recorded), as in
shape_factors.py beside it, whose step selection this reuses: this run's two arms on every
workload (startup table), and the stock arms of two earlier runs (shipped table). Median signed
error % (bias: > 0 priced high) and median absolute error %, per group of at least MIN_STEPS
steps. Run from the repository root:

    python benchmarks/results/h200/2026-12-02-1524-serving-state/graph_modes.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shape_factors as sf  # noqa: E402 - a sibling script, found by the path above

from dspark_calib.validate import FILL_LABELS, bucket_label  # noqa: E402

MIN_STEPS = 10


def report(name: str, steps: dict[str, np.ndarray]) -> list[str]:
    lines = [f"{name}: {len(steps['measured'])} decode verifies, {steps['full_graph'].mean():.0%} replayed a full "
             "CUDA graph", "", "| context | requests / R(N) | full CUDA graph | steps | tokens | bias | median |",
             "|---|---|---|---:|---|---:|---:|"]
    err = (steps["priced"] - steps["measured"]) / steps["measured"] * 100
    for cb in np.unique(steps["context"]):
        for sb in range(len(FILL_LABELS)):
            for full in (True, False):
                sel = (steps["context"] == cb) & (steps["shape"] == sb) & (steps["full_graph"] == full)
                if sel.sum() < MIN_STEPS:
                    continue
                n = steps["tokens"][sel]
                lines.append(f"| {bucket_label(int(cb), 1024)} | {FILL_LABELS[sb]} | {'yes' if full else 'no'} | "
                             f"{int(sel.sum())} | {int(n.min())}-{int(n.max())} | {np.median(err[sel]):+.2f} | "
                             f"{np.median(np.abs(err[sel])):.2f} |")
    return lines + [""]


def main() -> None:
    out = report("this run, stock (startup table)", sf.decode_verifies(sf.RUN + "arms", "stock", sf.STARTUP, None))
    out += report("this run, context-aware (startup table)",
                  sf.decode_verifies(sf.RUN + "arms", "aware-tail20-chunks", sf.STARTUP, None))
    for run in ("2026-12-01-0438-context", "2026-12-01-0742-context"):
        out += report(f"{run}, stock (shipped table)", sf.decode_verifies(sf.H + run, "stock", sf.SHIPPED, None))
    text = "\n".join(out)
    with open(sf.RUN + "graph_modes.md", "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Pointwise relative differences between independent profiles of the same engine.

    python3 benchmarks/proofs/stability.py [RUN_DIR]

RUN_DIR (default: the committed 2026-11-30 morning run, benchmarks/results/h200/2026-11-30-morning)
holds the two context-8192 tables h200-tp1-ctx8192-{a,b}.parquet, the three-context table
and serve_proof.json (serve_proof.py's stock and fallback starts); writes RUN_DIR/stability.json
and prints a short table.
Relative difference at a size = |b - a| / a of the two medians (vLLM's cost), over the sizes
both curves have.
"""
import json
import os
import sys

import numpy as np

from dspark_calib.table.file import read_table

here = os.path.dirname(os.path.abspath(__file__))
res_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "results", "h200", "2026-11-30-morning")
# the three-context table profiled on GPU 0 in the same run (schema 1.0)
shipped = os.path.join(res_dir, "qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__ad4ef3d97317.parquet")


def curves_from_table(path, ctx=8192):
    t = read_table(path)
    d, v = t.curves[ctx].as_vllm()
    return {"draft": d, "verify": v}


def stats(a, b):
    out = {}
    for kind in ("draft", "verify"):
        da, db = dict(a[kind]), dict(b[kind])
        common = sorted(set(da) & set(db))
        rel = np.array([abs(db[s] - da[s]) / da[s] for s in common]) * 100
        out[kind] = {"points": len(common), "median_pct": float(np.median(rel)), "p95_pct": float(np.percentile(rel, 95)),
                     "max_pct": float(rel.max()), "max_at_size": int(common[int(rel.argmax())])}
    return out


serve = json.load(open(os.path.join(res_dir, "serve_proof.json")))
stock = {r["case"]: {"draft": r["draft_curve"], "verify": r["verify_curve"]} for r in serve["results"]
         if r.get("n_samples") == 280 and "verify_curve" in r}
A = curves_from_table(os.path.join(res_dir, "h200-tp1-ctx8192-a.parquet"))
B = curves_from_table(os.path.join(res_dir, "h200-tp1-ctx8192-b.parquet"))
S = curves_from_table(shipped)
pairs = {
    "dspark-calib A vs B (GPU 1, 20 replays each; each ran while the other GPU of the host was busy)": (A, B),
    "dspark-calib shipped (GPU 0) vs A (GPU 1)": (S, A),
    "dspark-calib shipped (GPU 0) vs B (GPU 1)": (S, B),
    "vLLM start-up profile: stock vs fallback start (GPU 0, 5 replays each, sequential)": (stock["a_stock"], stock["c_mismatch_fallback"]),
    "vLLM stock start-up profile vs dspark-calib shipped (both GPU 0)": (stock["a_stock"], S),
}
out = {name: stats(a, b) for name, (a, b) in pairs.items()}
json.dump(out, open(os.path.join(res_dir, "stability.json"), "w"), indent=1)
print(f"{'pair':92} {'curve':6} {'median%':>8} {'p95%':>7} {'max%':>7} {'at':>5}")
for name, s in out.items():
    for kind, st in s.items():
        print(f"{name[:92]:92} {kind:6} {st['median_pct']:8.3f} {st['p95_pct']:7.3f} {st['max_pct']:7.3f} {st['max_at_size']:5}")

"""Fidelity proof: does `dspark-calib profile` measure what vLLM itself measures?

One idle H200, one lease, nothing else on the GPU, runs one after another:
  two stock vLLM start-up profiles (context 8192, vLLM's own 5 replays per size), then
  two `dspark-calib profile` runs (context 8192, 20 replays), same engine settings
  (Qwen3-8B + DSpark block-7 configs, dummy weights, max_num_seqs 256,
  max_num_batched_tokens 8192, max_model_len 32768, gpu_memory_utilization 0.85).

  python3 benchmarks/proofs/fidelity.py stock DIR       # GPU host: stock_a.json, stock_b.json
  for ab in a b; do OUT=DIR bash benchmarks/proofs/profile.sh fid-product-$ab \
      --tp 1 --context-len 8192 --replays 20 --max-model-len 32768; done   # GPU host: the two profile runs
  python3 benchmarks/proofs/fidelity.py report DIR [OUT]  # anywhere: writes OUT (default DIR/fidelity.json)

Stock runs use serve_one.py (a fresh process each; its hooks record the curves vLLM
fits at start-up, unpatched by dspark-calib). `profile` runs the engine core in a child
process, as `vllm serve` does; serve_one runs it in its own process so its hooks see it.
Both put the timed steps in a process with nothing else to do.

Pointwise relative differences at every profiled size, per curve: A vs B pairs are
|B - A| / A; vLLM vs product pools all four pairings (product_i - vllm_j) / vllm_j, so its
max is the worst of the four, and its signed median says which way the product leans.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SMI_FIELDS = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active"


def smi() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", "-i",
                               os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def stock(out_dir: str) -> None:
    sys.path.insert(0, HERE)
    from procs import serve_one_case

    os.makedirs(out_dir, exist_ok=True)
    for name in ("stock_a", "stock_b"):
        before = smi()
        res, text = serve_one_case(name, {"VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "8192",
                                          "SERVE_MAX_MODEL_LEN": "32768"}, 300)
        if not res.get("started"):
            res["error_tail"] = text[-3000:]
        res.update(smi_before=before, smi_after=smi(), smi_fields=SMI_FIELDS)
        with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:  # saved per case: a cut call keeps it
            json.dump(res, fh)
        print(name, "started" if res.get("started") else "FAILED", f"profile {res.get('profile_s', 0):.2f} s",
              f"engine start {res.get('engine_start_s', 0):.1f} s", f"n_samples {res.get('n_samples')}", flush=True)


# -- report (pure; no GPU) ---------------------------------------------------------------
def rel_diffs(base: dict[int, float], other: dict[int, float], *, signed: bool) -> list[float]:
    if set(base) != set(other):
        raise SystemExit(f"fidelity: size sets differ: only in one {sorted(set(base) ^ set(other))[:10]}")
    out = [(other[s] - base[s]) / base[s] * 100.0 for s in sorted(base)]
    return out if signed else [abs(d) for d in out]


def stats(values: list[float], signed: list[float] | None = None) -> dict[str, float]:
    import numpy as np

    a = np.abs(np.asarray(values, dtype=float))
    res = {"median_pct": float(np.median(a)), "p95_pct": float(np.percentile(a, 95)), "max_pct": float(a.max()),
           "n": int(a.size)}
    if signed is not None:
        res["signed_median_pct"] = float(np.median(np.asarray(signed, dtype=float)))
    return res


def pairs(vllm: dict[str, dict], product: dict[str, dict]) -> dict[str, dict]:
    """vllm/product: {"a": {"draft": {size: ms}, "verify": {...}}, "b": ...}."""
    out: dict[str, dict] = {"vllm_a_vs_vllm_b": {}, "product_a_vs_product_b": {}, "vllm_vs_product": {}}
    for kind in ("draft", "verify"):
        for key, runs in (("vllm_a_vs_vllm_b", vllm), ("product_a_vs_product_b", product)):
            d = rel_diffs(runs["a"][kind], runs["b"][kind], signed=True)
            out[key][kind] = stats(d, d)
        cross = [rel_diffs(vllm[v][kind], product[p][kind], signed=True) for v in ("a", "b") for p in ("a", "b")]
        pooled = [x for c in cross for x in c]
        out["vllm_vs_product"][kind] = stats(pooled, pooled)
    return out


def per_size(vllm: dict[str, dict], product: dict[str, dict]) -> dict[str, list]:
    """Mean of the two products vs mean of the two vLLM runs, signed %, per size: where it leans."""
    res = {}
    for kind in ("draft", "verify"):
        sizes = sorted(vllm["a"][kind])
        res[kind] = [[s, round(((product["a"][kind][s] + product["b"][kind][s])
                                / (vllm["a"][kind][s] + vllm["b"][kind][s]) - 1.0) * 100.0, 4)] for s in sizes]
    return res


def goals(p: dict[str, dict]) -> dict[str, bool]:
    vp, pab, vab = p["vllm_vs_product"], p["product_a_vs_product_b"], p["vllm_a_vs_vllm_b"]
    g = {}
    for kind in ("draft", "verify"):
        g[f"{kind}_signed_median_within_0.05"] = abs(vp[kind]["signed_median_pct"]) <= 0.05
        g[f"{kind}_max_le_0.6"] = vp[kind]["max_pct"] <= 0.6
        g[f"{kind}_product_ab_le_vllm_ab"] = all(pab[kind][k] <= vab[kind][k] for k in ("median_pct", "p95_pct", "max_pct"))
    return g


def _curve(points: list) -> dict[int, float]:
    return {int(s): float(ms) for s, ms in points}


def report(src: str, out_path: str) -> dict:
    sys.path.insert(0, ROOT)
    from dspark_calib.stability import table_flags
    from dspark_calib.table.file import read_table

    vllm, product, runs = {}, {}, {}
    for ab in ("a", "b"):
        with open(os.path.join(src, f"stock_{ab}.json")) as fh:
            s = json.load(fh)
        if not s.get("started") or "verify_curve" not in s:
            raise SystemExit(f"fidelity: stock_{ab} did not profile: {s.get('error_tail', '')[-400:]}")
        vllm[ab] = {"draft": _curve(s["draft_curve"]), "verify": _curve(s["verify_curve"])}
        runs[f"vllm_{ab}"] = {k: s.get(k) for k in ("profile_s", "engine_start_s", "n_samples", "smi_before",
                                                     "smi_after", "smi_fields")}
        t = read_table(os.path.join(src, f"fid-product-{ab}.parquet"))
        if 8192 not in t.curves:
            raise SystemExit(f"fidelity: fid-product-{ab}.parquet has no context 8192 ({t.context_lens()})")
        d, v = t.curves[8192].as_vllm()
        product[ab] = {"draft": _curve(d), "verify": _curve(v)}
        fp = t.fingerprint
        tel = t.telemetry.summary().to_dict() if t.telemetry is not None else None
        runs[f"product_{ab}"] = {"content_hash": t.content_hash[:12], "replays": fp.replays,
                                 "warmup_replays": fp.warmup_replays, "profile_s": fp.extra.get("profile_s"),
                                 "level_shifts": [repr(x) for x in table_flags(t)], "telemetry": tel}
    host = {}
    cap = os.path.join(src, "fid-product-a-samples-rank0.json")
    if os.path.exists(cap):
        with open(cap) as fh:
            c = json.load(fh)
        host = {"hardware": c.get("hardware"), "engine": {k: c.get("engine", {}).get(k) for k in (
            "gpu_name", "gpu_count", "driver", "vllm_version", "torch_version", "cuda_version", "tp_size",
            "attention_backend", "cudagraph_mode") if k in c.get("engine", {})}}
    p = pairs(vllm, product)
    result = {"host": host, "pairs": p, "goals": goals(p), "per_size_signed_pct": per_size(vllm, product),
              "runs": runs, "method": __doc__.strip().split("\n\n", 1)[1]}
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(markdown(p))
    print("goals:", ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in result["goals"].items()))
    return result


def markdown(p: dict[str, dict]) -> str:
    rows = ["| pair | draft median / p95 / max | verify median / p95 / max | signed median draft / verify |",
            "|---|---|---|---|"]
    names = {"vllm_a_vs_vllm_b": "vLLM start-up profile A vs B", "product_a_vs_product_b": "`dspark-calib profile` A vs B",
             "vllm_vs_product": "vLLM vs `dspark-calib profile` (4 pairings)"}
    for key, title in names.items():
        d, v = p[key]["draft"], p[key]["verify"]
        rows.append(f"| {title} | {d['median_pct']:.3f} / {d['p95_pct']:.3f} / {d['max_pct']:.3f} % | "
                    f"{v['median_pct']:.3f} / {v['p95_pct']:.3f} / {v['max_pct']:.3f} % | "
                    f"{d['signed_median_pct']:+.3f} / {v['signed_median_pct']:+.3f} % |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "stock":
        stock(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else os.path.join(sys.argv[2], "fidelity.json"))
    else:
        raise SystemExit(__doc__)

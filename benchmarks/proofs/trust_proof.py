"""Trust proof: tables that must not load are caught, one line each,
and the load-time probe measures what the table predicts.

Usage (GPU host, from the repository root): python3 benchmarks/proofs/trust_proof.py TABLE OUTDIR CASE[,CASE...]
TABLE is a table `profile` just made on this host for the serve_one.py engine. One fresh
process per case (serve_one.py: in-process engine, so its timers see the worker); results are
merged into OUTDIR/trust_proof.json by case name, so the cases can be split over several calls.

Cases (derived tables are written to /tmp/trust/; every one keeps a valid content hash):
  stock               no table: vLLM's own start-up profile (the baseline)
  match_strict        TABLE itself under strict: loads; the probe's ratios should be ~1.0
  x13_{fallback,warn,strict}   every curve cost x1.3 (a plausible forgery): the probe must catch it
  backend_{strict,fallback}    fingerprint says another attention backend (FLASHINFER)
  cgmode_{strict,warn}         fingerprint says another CUDA-graph mode (PIECEWISE)
  mml4096_{strict,fallback}    TABLE, but the engine runs with max_model_len 4096
"""
import json
import os
import subprocess
import sys
from dataclasses import replace

from procs import serve_one_case  # beside this script

WORK = "/tmp/trust"


def derived(table_path):
    from dspark_calib.fit import CurvePair
    from dspark_calib.table.file import read_table, write_table

    t = read_table(table_path)
    os.makedirs(WORK, exist_ok=True)

    def scaled(c, k):
        return replace(c, **{f: getattr(c, f) * k for f in ("cost_ms", "min_ms", "p25_ms", "p75_ms", "max_ms", "mad_ms")})

    out = {"match": table_path}
    x13 = replace(t, curves={ctx: CurvePair(scaled(p.draft, 1.3), scaled(p.verify, 1.3)) for ctx, p in t.curves.items()})
    out["x13"] = write_table(x13, os.path.join(WORK, "x13.parquet"))
    out["backend"] = write_table(replace(t, fingerprint=t.fingerprint.replace(attention_backend="FLASHINFER")),
                                 os.path.join(WORK, "backend.parquet"))
    out["cgmode"] = write_table(replace(t, fingerprint=t.fingerprint.replace(cudagraph_mode="PIECEWISE")),
                                os.path.join(WORK, "cgmode.parquet"))
    hashes = {}
    for name, path in out.items():
        hashes[name] = read_table(path, samples=False).content_hash[:12]
    return out, hashes, t.fingerprint


def case_env(case, tables):
    kind, policy = case.rsplit("_", 1) if "_" in case else (case, "")
    env = {"VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "8192"}
    if kind == "stock":
        return env
    env["DSPARK_CALIB_POLICY"] = policy
    env["DSPARK_CALIB_TABLE"] = tables["match" if kind in ("match", "mml4096") else kind]
    if kind == "mml4096":
        env["SERVE_MAX_MODEL_LEN"] = "4096"
    return env


def run_case(case, tables):
    res, text = serve_one_case(case, case_env(case, tables), 540)
    res.pop("cost_tables", None)
    res["wall_s"] = round(res["wall_s"], 1)
    res["dspark_log"] = [ln for ln in text.splitlines() if "dspark-calib" in ln or "dspark_calib" in ln]
    return res


def main():
    table, out_dir, cases = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    tables, hashes, fp = derived(table)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "trust_proof.json")
    doc = json.load(open(path)) if os.path.exists(path) else {"results": {}}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    doc.update(host={"gpu": smi, "vllm": fp.vllm_version, "torch": fp.torch_version, "cuda": fp.cuda_version},
               table=os.path.basename(table), hashes=hashes)
    for case in cases:
        res = run_case(case, tables)
        doc["results"][case] = res
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
        short = {k: res.get(k) for k in ("case", "started", "engine_start_s", "profile_s", "n_samples", "gen_32x64_s")}
        print(json.dumps(short), flush=True)
        for ln in res["dspark_log"][-6:]:
            print("   ", ln[:400], flush=True)
        if not res.get("started") and "error" in res and not res["dspark_log"]:
            print(res["error"][-1500:], flush=True)
    print(f"\n{'case':20} {'started':8} {'start_s':>8} {'profile_s':>9} {'samples':>7}")
    for name, r in doc["results"].items():
        print(f"{name:20} {str(r.get('started')):8} {r.get('engine_start_s') or 0:8.1f} {r.get('profile_s') or 0:9.2f} "
              f"{r.get('n_samples') or 0:7}")


if __name__ == "__main__":
    main()

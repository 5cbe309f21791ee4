"""Serve-time proof: stock start vs a loaded table vs a mismatching table under each policy.

Usage (GPU host, from the repository root): python3 benchmarks/proofs/serve_proof.py TABLE.parquet OUTDIR
Writes OUTDIR/serve_proof.json and prints a short table last.
"""
import json, os, sys

import numpy as np

from dspark_calib.table.file import read_table, write_table
from procs import serve_one_case  # noqa: E402 - beside this script

table_path, out_dir = os.path.abspath(sys.argv[1]), sys.argv[2]
table = read_table(table_path)
# A table that does not fit this engine: the same curves, but profiled on another GPU.
other_dir = "/tmp/mismatch-table"
os.makedirs(other_dir, exist_ok=True)
from dataclasses import replace
mismatch = replace(table, fingerprint=table.fingerprint.replace(gpu_name="NVIDIA H100 80GB HBM3"))
mismatch_path = write_table(mismatch, other_dir)

cases = [
    ("a_stock", {}),
    ("b_table", {"DSPARK_CALIB_TABLE": table_path}),
    ("c_mismatch_fallback", {"DSPARK_CALIB_TABLE": mismatch_path, "DSPARK_CALIB_POLICY": "fallback"}),
    ("c_mismatch_warn", {"DSPARK_CALIB_TABLE": mismatch_path, "DSPARK_CALIB_POLICY": "warn"}),
    ("c_mismatch_strict", {"DSPARK_CALIB_TABLE": mismatch_path, "DSPARK_CALIB_POLICY": "strict"}),
]
results = []
for name, env in cases:
    res, text = serve_one_case(name, {**env, "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "8192"}, 400)
    res["dspark_log"] = [l for l in text.splitlines() if "dspark-calib" in l]
    if name == "b_table" and "cost_tables" in res:
        # What vLLM builds from the table's own samples: its set_initial_cost_curves on them.
        from types import SimpleNamespace
        from vllm.v1.worker.gpu.async_utils import StepTimingSample
        from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av
        av.get_tp_group = lambda: SimpleNamespace(broadcast_object=lambda obj, src=0: obj)
        m = object.__new__(av.AdaptiveVerificationManager)
        m.req_states = SimpleNamespace(max_num_reqs=res["max_num_reqs"], max_num_batched_tokens=res["max_num_batched_tokens"])
        m._cudagraph_limit = res["cudagraph_limit"]
        ctx = table.nearest_context(8192)
        s = table.samples[table.samples.context_len == ctx]
        m.set_initial_cost_curves([StepTimingSample(r.forward_ms, r.drafter_ms, int(r.num_target_tokens), int(r.num_reqs),
                                                    bool(r.full_cudagraph)) for r in s.itertuples()])
        res["tables_equal_vllm_from_samples"] = bool(
            np.array_equal(np.array(res["cost_tables"][0]), m.cost_tables[0])
            and np.array_equal(np.array(res["cost_tables"][1]), m.cost_tables[1]))
    for k in ("cost_tables",):
        res.pop(k, None)
    results.append(res)
    print(json.dumps({k: res.get(k) for k in ("case", "started", "engine_start_s", "profile_s", "n_samples",
                                              "gen_32x64_s", "tables_equal_vllm_from_samples", "dspark_log", "error")})[:1500], flush=True)
    if res.get("no_result"):
        print(text[-4000:])
os.makedirs(out_dir, exist_ok=True)
json.dump({"table": os.path.basename(table_path), "table_hash": table.short_hash,
           "mismatch_table_hash": mismatch.short_hash, "results": results},
          open(os.path.join(out_dir, "serve_proof.json"), "w"), indent=1)
print(f"{'case':22} {'started':8} {'start_s':>8} {'profile_s':>9} {'samples':>7} {'gen_s':>6}")
for r in results:
    print(f"{r['case']:22} {str(r.get('started')):8} {r.get('engine_start_s', 0):8.1f} {r.get('profile_s', 0):9.2f} "
          f"{r.get('n_samples', 0):7} {r.get('gen_32x64_s', 0):6.2f}")

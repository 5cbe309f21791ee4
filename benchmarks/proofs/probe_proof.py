"""The load-time probe against real vLLM 0.33, one engine start per case.

Usage (GPU host, from the repository root): python3 benchmarks/proofs/probe_proof.py TABLE OUTDIR
Cases: the matching table under strict (expect a load, ratios ~1.0); the same table with
every cost x1.3 (content hash recomputed: a plausible forgery) under fallback (expect the
probe to fail and vLLM's own full profile to run) and under strict (expect a refusal).
The child calls load.install_hooks() before the engine starts (idempotent: the plugin
installs the same hook when it patches vLLM), so the probe's timing hook is in place
before any engine code runs. In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
hook reaches the worker.
"""
import json, os, subprocess, sys

CHILD = r'''
import json, logging, os, sys, time
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append([record.levelname, record.getMessage()])
logging.getLogger("vllm.dspark_calib").addHandler(Keep())
from dspark_calib.vllm import load
load.install_hooks()
from vllm import LLM
root = os.getcwd()
t = time.time()
res = {"case": sys.argv[1]}
try:
    llm = LLM(model=f"{root}/profiles/configs/qwen3-8b", speculative_config={
        "method": "dspark", "model": f"{root}/profiles/configs/dspark-qwen3-8b-block7",
        "num_speculative_tokens": 7, "enable_adaptive_verification": True},
        load_format="dummy", skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=8192,
        max_model_len=32768, gpu_memory_utilization=0.85, seed=0)
    res["started"] = True
except Exception as exc:
    res["started"] = False
    res["error"] = f"{type(exc).__name__}: {exc}"[:600]
res["engine_start_s"] = round(time.time() - t, 1)
res["dspark_lines"] = lines
print("RESULT " + json.dumps(res), flush=True)
os._exit(0)
'''


def forge(src, dst, scale):
    from dataclasses import replace
    from dspark_calib.fit import CurvePair
    from dspark_calib.table.file import read_table, write_table

    t = read_table(src)
    def change(c):
        return replace(c, **{k: getattr(c, k) * scale for k in ("cost_ms", "min_ms", "p25_ms", "p75_ms", "max_ms", "mad_ms")})
    curves = {ctx: CurvePair(change(p.draft), change(p.verify)) for ctx, p in t.curves.items()}
    return write_table(replace(t, curves=curves), dst)


def main():
    table, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    scaled = forge(table, "/tmp/scaled-1.3.parquet", 1.3)
    cases = [("match-strict", table, "strict"), ("x1.3-fallback", scaled, "fallback"), ("x1.3-strict", scaled, "strict")]
    results = []
    for name, path, policy in cases:
        env = {**os.environ, "DSPARK_CALIB_TABLE": path, "DSPARK_CALIB_POLICY": policy}
        p = subprocess.run([sys.executable, "-c", CHILD, name], env=env, capture_output=True, text=True, timeout=400)
        got = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        r = json.loads(got[-1][7:]) if got else {"case": name, "rc": p.returncode, "tail": p.stderr[-1500:]}
        results.append(r)
        print(json.dumps(r)[:1500], flush=True)
        with open(os.path.join(out, "probe_proof.json"), "w") as fh:
            json.dump({"host": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                              capture_output=True, text=True).stdout.strip(),
                       "table": os.path.basename(table), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()

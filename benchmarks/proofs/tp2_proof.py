"""Multi-GPU proof on a two-GPU host: tp 2 serving with a table, and DP 2 starting with one.

  python3 benchmarks/proofs/tp2_proof.py TP2_TABLE TP1_TABLE OUTDIR [tp,dp]

Cases, one fresh engine each, one after another (nothing else on the GPUs):
  tp2_stock         tp 2, vLLM's own start-up profile (context 8192)
  tp2_table         tp 2, DSPARK_CALIB_TABLE=TP2_TABLE under strict (a probe miss would refuse)
  tp2_tp1_strict    tp 2, the tp 1 table under strict: refused, one line naming tensor_parallel_size
  dp2_table         `vllm serve --data-parallel-size 2` (two tp-1 replicas, one GPU each) with TP1_TABLE
                    (profiled on this host); both replicas must log the same decision; one completion
tp cases run serve_one.py (offline LLM; at tp 2 the workers are other processes, so the
profiling window is read from vLLM's own "Graph capturing finished in N secs" line of TP
rank 0, which includes the adaptive-verification profile). Every dspark-calib log line is
kept: one load line per engine (TP rank 0) is the claim checked.
Qwen3-8B is dense: vLLM runs dense DP replicas as independent engines (DP 1 each, no DP
collective: EngineCoreProc, reconfigure_for_independent_dp_rank), so the DP agreement
code is not exercised here (it is with MoE; unit-tested with stubbed groups).
"""
import json, os, re, subprocess, sys, time, urllib.request

from procs import kill_group, serve_one_case

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
tp2_table, tp1_table, out_dir = (os.path.abspath(a) for a in sys.argv[1:4])
which = set((sys.argv[4] if len(sys.argv) > 4 else "tp,dp").split(","))  # tp: the three tp 2 cases; dp: DP 2
os.makedirs(out_dir, exist_ok=True)
CAPTURE_RE = re.compile(r"Graph capturing finished in (\d+) secs")


COMMON = {"VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "8192", "SERVE_MAX_MODEL_LEN": "32768",
          "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_USE_V2_MODEL_RUNNER": "1"}


def dspark_lines(text):
    return [ln for ln in text.splitlines() if "dspark-calib" in ln]


def tp_case(name, extra):
    res, text = serve_one_case(name, {**COMMON, **extra}, 420)
    for k in ("draft_curve", "verify_curve", "cost_tables"):
        res.pop(k, None)
    res.update(dspark_log=dspark_lines(text), graph_capture_s=[int(m) for m in CAPTURE_RE.findall(text)])
    return res, text


def dp_case(name, table):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_CALIB_")}
    env.update(COMMON, DSPARK_CALIB_TABLE=table)
    port = 8011
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", f"{root}/profiles/configs/qwen3-8b",
           "--speculative-config", json.dumps({"method": "dspark", "model": f"{root}/profiles/configs/dspark-qwen3-8b-block7",
                                               "num_speculative_tokens": 7, "enable_adaptive_verification": True}),
           "--load-format", "dummy", "--skip-tokenizer-init", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
           "--max-model-len", "32768", "--gpu-memory-utilization", "0.85", "--seed", "0",
           "--data-parallel-size", "2", "--port", str(port)]
    log_path = os.path.join(out_dir, f"{name}.serve.log")
    t = time.time()
    res = {"case": name, "started": False}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while time.time() - t < 420 and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            res.update(started=True, ready_s=time.time() - t)
                            break
                except OSError:
                    pass
                time.sleep(2)
            if res["started"]:
                body = json.dumps({"model": f"{root}/profiles/configs/qwen3-8b", "prompt": list(range(100, 612)),
                                   "max_tokens": 32, "temperature": 0, "ignore_eos": True}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        reply = json.loads(r.read())
                    res["completion"] = {"status": 200, "usage": reply.get("usage")}
                except Exception as exc:  # noqa: BLE001 - recorded, the start is the claim
                    res["completion"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            kill_group(proc.pid, grace_s=30)  # the API server and both engine cores
            proc.wait()
    text = open(log_path, errors="replace").read()
    res.update(wall_s=time.time() - t, dspark_log=dspark_lines(text),
               graph_capture_s=[int(m) for m in CAPTURE_RE.findall(text)],
               exit_code=proc.returncode)
    if not res["started"]:
        res["error"] = text[-3000:]
    return res


results = []


def save():
    """After every case: a run cut short (a time limit, a lost host) still leaves every case
    that finished on disk."""
    json.dump({"tp2_table": os.path.basename(tp2_table), "tp1_table": os.path.basename(tp1_table), "results": results},
              open(os.path.join(out_dir, "tp2_proof.json"), "w"), indent=1)


for name, extra in () if "tp" not in which else (("tp2_stock", {"SERVE_TP": "2"}),
                    ("tp2_table", {"SERVE_TP": "2", "DSPARK_CALIB_TABLE": tp2_table, "DSPARK_CALIB_POLICY": "strict"}),
                    ("tp2_tp1_strict", {"SERVE_TP": "2", "DSPARK_CALIB_TABLE": tp1_table, "DSPARK_CALIB_POLICY": "strict"})):
    res, text = tp_case(name, extra)
    results.append(res)
    save()
    print(json.dumps({k: res.get(k) for k in ("case", "started", "engine_start_s", "graph_capture_s", "dspark_log")})[:1200],
          flush=True)
    if name == "tp2_stock" and not res.get("started"):
        print(text[-4000:])
if "dp" in which:
    results.append(dp_case("dp2_table", tp1_table))
    save()
    print(json.dumps({k: results[-1].get(k) for k in ("case", "started", "ready_s", "graph_capture_s", "dspark_log",
                                                     "completion")})[:2000], flush=True)
print(f"{'case':16} {'started':8} {'start_s':>8} {'capture_s':>10} dspark-calib lines")
for r in results:
    print(f"{r['case']:16} {str(r.get('started')):8} {r.get('engine_start_s', r.get('ready_s', 0)) or 0:8.1f} "
          f"{str(r.get('graph_capture_s')):>10} {len(r.get('dspark_log', []))}")

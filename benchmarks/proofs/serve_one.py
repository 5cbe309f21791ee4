"""One vLLM start (offline LLM), as a user serves: times start-up and its profiling, then generates.

Run by serve_proof.py in a fresh process per case (env decides the case). Profiling
time = from StepTimingCollector.collect() entry to set_cost_curves() return: the same
window in stock vLLM and with a table loaded (neither is patched by dspark-calib).
Prints one JSON line prefixed RESULT.
"""
import json, os, sys, time

t0 = time.time()
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the timers below see the worker
import contextlib
from vllm.v1.worker.gpu import async_utils
from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

res = {"case": sys.argv[1], "env": {k: v for k, v in os.environ.items() if k.startswith("DSPARK_CALIB_")}}
orig_collect, orig_set = async_utils.StepTimingCollector.collect, av.AdaptiveVerificationManager.set_cost_curves
orig_btp = av.AdaptiveVerificationManager.batches_to_profile


@contextlib.contextmanager
def collect(self):
    res.setdefault("profile_start", time.time())
    with orig_collect(self) as samples:
        yield samples
    res["n_samples"] = len(samples)


def set_cost_curves(self, draft_curve, verify_curve):
    draft, verify = draft_curve, verify_curve
    orig_set(self, draft, verify)
    res["profile_end"] = time.time()
    res["draft_curve"], res["verify_curve"] = [list(p) for p in draft], [list(p) for p in verify]
    res["cost_tables"] = [t.tolist() for t in self.cost_tables]
    res["max_num_reqs"], res["max_num_batched_tokens"] = self.req_states.max_num_reqs, self.req_states.max_num_batched_tokens
    res["cudagraph_limit"] = self._cudagraph_limit


def btp(self, capture_sizes):
    res["capture_sizes"] = list(capture_sizes)
    return orig_btp(self, capture_sizes)


async_utils.StepTimingCollector.collect = collect
av.AdaptiveVerificationManager.set_cost_curves = set_cost_curves
av.AdaptiveVerificationManager.batches_to_profile = btp
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
t_import = time.time()
try:
    llm = LLM(model=f"{root}/profiles/configs/qwen3-8b", speculative_config={
        "method": "dspark", "model": f"{root}/profiles/configs/dspark-qwen3-8b-block7",
        "num_speculative_tokens": 7, "enable_adaptive_verification": True},
        load_format="dummy", skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=8192,
        max_model_len=int(os.environ.get("SERVE_MAX_MODEL_LEN", "32768")), gpu_memory_utilization=0.85, seed=0,
        tensor_parallel_size=int(os.environ.get("SERVE_TP", "1")))  # tp > 1: workers elsewhere, profile_s not seen here
except Exception as exc:  # strict policy: the engine must refuse to start
    res["started"] = False
    res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    print("RESULT " + json.dumps(res), flush=True)
    sys.exit(0)
t_ready = time.time()
res.update(started=True, import_s=t_import - t0, engine_start_s=t_ready - t_import,
           profile_s=res.get("profile_end", 0) - res.get("profile_start", 0))
t1 = time.time()
outs = llm.generate([TokensPrompt(prompt_token_ids=list(range(100, 612)))] * 32,
                    SamplingParams(max_tokens=64, temperature=0.0, detokenize=False, ignore_eos=True))
res["gen_32x64_s"] = time.time() - t1
res["gen_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps(res), flush=True)
os._exit(0)  # skip vLLM's teardown: the measurement is done

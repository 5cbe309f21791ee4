"""The serving harness for context-aware costs: real vLLM 0.33 serving four workloads, one arm per engine.

Usage (from the repository root; arms and workloads are the named configs in arms.json beside this file):
    python3 benchmarks/serving/serve_context.py plan               # the workloads, concurrency and time estimates
    python3 benchmarks/serving/serve_context.py arm NAME --table T --out DIR [--deadline-epoch S] [--dry-run]
    python3 benchmarks/serving/serve_context.py report --results DIR [--json F] [--md F]   # anywhere, no GPU
benchmarks/serving/run.sh runs a whole comparison (every arm of one, then the report).

What runs
---------
One fresh engine per arm (vLLM's AsyncLLM in a child process of this script, V2 model
runner): Qwen3-8B target + DSpark block-7 drafter from profiles/configs, dummy weights,
skip_tokenizer_init, K=7, adaptive verification on, max_num_seqs 256,
max_num_batched_tokens 8192, max_model_len 32768, gpu_memory_utilization 0.85 (the
engine the tables are profiled for). Arms (named in arms.json by pricing and settings):
  stock   no table: vLLM's own start-up profile at VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN=8192
  static  the multi-context table, DSPARK_CALIB_CONTEXT_AWARE=0, DSPARK_CALIB_CONTEXT_LEN=8192
  aware   the multi-context table, context-aware pricing per step, at tail 0 and chunks by the KV sum
          unless the arm sets context_tail / context_chunks (the plugin's defaults: tail
          0.2, chunks by pairs; the harness always sets both, so the label says what ran)
Every arm: DSPARK_CALIB_POLICY=warn (the table loads even if a detail differs: the
benchmark must not silently turn into stock; the plugin's lines are kept in the summary;
`--policy strict` makes the engine refuse to start instead, the proof that it loads as an operator's would),
DSPARK_CALIB_OBSERVE=<fresh dir>, DSPARK_CALIB_OBSERVE_EVERY=4 (observe's default: a sampled
step costs the host tens of microseconds more in the context-aware arm, which computes the
other pricing's budget too; sampling keeps that bias out of the throughput comparison).

Controlled acceptance. vLLM 0.33 has the knob (read in the installed wheel):
  vllm/config/speculative.py:83    RejectionSampleMethod = Literal["standard", "synthetic", "block", "fly"]
  vllm/config/speculative.py:562  rejection_sample_method: ... = "standard"
  vllm/config/speculative.py:571  synthetic_acceptance_rates: per-position *unconditional* rates, non-increasing
  vllm/config/speculative.py:579  synthetic_acceptance_length: mean acceptance length incl. the bonus token, in [1, K+1]
  vllm/config/speculative.py:590  _acceptance_length_to_rates: the "minimum-variance schedule":
                                   length 4.0 with K=7 -> rates [1, 1, 1, 0, 0, 0, 0]
  vllm/config/speculative.py:1973 __post_init__ resolves the length to rates
  vllm/v1/worker/gpu/spec_decode/rejection_sampler.py:168  V2 runner: rates -> conditional rates tensor
  vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py:613 (greedy; 692 sampled): accepted = u < rate[i] for
                                   verified position i (positions past the chosen budget are never verified)
So the speculative config gets {"rejection_sample_method": "synthetic",
"synthetic_acceptance_length": 4.0} (3 of 7 drafts accepted, deterministically, when at
least 3 are verified); --acceptance-rates gives a decaying schedule instead.

What dummy weights and synthetic acceptance can and cannot show
--------------------------------------------------------------
Can: step costs (a step's time does not depend on weight values), so the prediction
error of each pricing on real serving steps, per context, is real; which budget each
pricing picks for the same confidences; throughput and TPOT of real vLLM steps at a
chosen, fixed acceptance.
Cannot: anything about real acceptance. The confidence head's outputs are those of random
weights (near-constant, unrelated to the synthetic acceptance), so the adaptive budgets
here answer "given these confidences, which budget do these costs buy", not "which budget
is best for real drafts". A throughput gain here is a gain from pricing steps right at a
fixed acceptance of 3/7, not a forecast for a trained drafter. Context is the prompt
length plus tokens generated so far (random token ids, unique per request: no prefix
cache hits).

Workloads and KV capacity (the arithmetic)
------------------------------------------
KV bytes per token: 2 (K and V) x 8 KV heads x 128 head_dim x 2 bytes (bf16) = 4096 B per
layer; 36 target layers + 5 drafter layers (the drafter keeps its own KV in the same
blocks) = 41 x 4096 = 167,936 B (164 KiB) per token.
Memory for KV: 143,771 MiB x 0.85 = 122,205 MiB, minus weights 17.37 GiB (measured:
target ~15.3 GiB + drafter ~2 GiB) minus ~4.1 GiB activations and CUDA graphs = 97.86 GiB
(the H200 log: "Available KV cache memory: 97.86 GiB") -> 97.86 GiB / 167,936 B =
625,700 tokens; vLLM's log said 625,680 (39,105 blocks of 16).
A request holds ceil((prompt + 256 output + K + 1) / 16) x 16 tokens at its end. The
concurrency is the wanted one, capped so that the worst case (every in-flight request at
the workload's longest prompt, at its end) fits in 90 % of the KV tokens, rounded down to
a multiple of 8: no preemption by construction.
  workload  prompts           tokens/req  fit in 90 %  concurrency  worst case KV
  ctx1k     1,024             1,296       434          256 (cap)    331,776 (53 %)
  ctx8k     8,192             8,464       66           64           541,696 (87 %)
  ctx16k    16,384            16,656      33           32           532,992 (85 %)
  mix       1k/8k/16k r-robin 16,656      33           32           532,992 (85 %)
(16k prompts cannot run 256 at once: 256 x 16,656 = 4.3 M tokens, 6.8x the cache.) The mix
is sized as if all were 16k: a closed loop keeps long requests in flight longer, so its
in-flight mix drifts towards them. `python3 serve_context.py plan` prints this table from
`plan_workloads` over arms.json's workloads (the source of truth; tests pin it).
Requests per workload = 2 x concurrency (two waves in a closed loop), 256 output tokens,
ignore_eos, temperature 0. At run time the engine's real KV capacity
(cache_config.num_gpu_blocks x block_size) is recorded; a workload whose worst case does
not fit it is shrunk (recorded as "shrunk" in the summary), never preempted.

Closed loop, exact concurrency: vLLM's AsyncLLM (the engine core in its own process, as
`vllm serve` runs it) with an asyncio.Semaphore(concurrency): at most `concurrency`
requests in flight, a new one as soon as one finishes. LLM.generate with max_num_seqs =
concurrency is not the honest equivalent here: max_num_seqs is fixed per engine (and part
of the table's fingerprint), and LLM.generate admits every request at once.

Metrics per arm and workload: output tokens/s (all output tokens / workload wall time);
TPOT per request = (last_token_ts - first_token_ts) / (n - 1) from RequestOutput.metrics
(vLLM's RequestStateStats: engine-core monotonic timestamps, with log stats on), client
receive times as fallback, p50/p90 over requests; TTFT; tokens per engine step seen by a
request; per-request acceptance from vLLM's per_request_spec_decode_metrics=summary;
the chosen budgets from the observe files (draft_budget per step, per request, share full
/ zero, and how often budget_static != budget_context_aware); the engine's own prediction
error (predicted_*_ms vs measured, per kind and context bucket); and `dspark-calib
validate TABLE OBSERVE_DIR --json` on the arm's observe files (both pricings side by side).
Observe rows are attributed to workloads by marker batches: before each workload and
after the last, 3 requests of 17-token prompts and 64 output tokens run alone; steps with
<= 3 requests all below 100 tokens of context occur only there.

Time (one arm, one engine; --deadline-epoch bounds it, by default DEFAULT_BUDGET_S after the start):
engine start 30-60 s warm (230 s cold; 160-240 s with a draft-model drafter's start-up profile),
import ~15 s, warm-up + markers ~10 s, workloads as the plan line estimates (estimate_seconds;
ctx1k, ctx16k and mix ~150-190 s), post-processing ~15 s. A workload that would end past the
deadline is skipped (recorded); the engine child is killed 35 s before the deadline so the
summary and the observe files still come back.

Step timer (every arm alike, fixed K included: observe mode times only the steps it prices):
the worker extension (estimator_probe.EstimatorProbe, with step_timer.StepTimerProbe) wraps the
model runner's execute_model on TP rank 0 after the warm-up and records each serving call's
host start and return (perf_counter, no sync); per workload the arm's summary keeps the steps,
the intervals between successive call starts (p50/p90/p99/max), the stalls over 1 s (observe's
STALL_MS, each with its step index) and the host time inside the call. The same steps' GPU side:
CUDA events at execute_model's start and around the drafter's propose (target and drafter GPU
ms, resolved behind one sync when each window is taken), and the worker's CPU placement.

Outputs under --out (5 files per arm): context-ARM.json (summary), context-ARM-requests.json
(per request), context-ARM-steps.json (per workload, the step timer's steps one by one: interval,
host ms, target and drafter GPU ms, scheduled tokens and requests), context-ARM-observed.parquet (the arm's observe files
compacted into one, metadata kept: `dspark-calib validate` reads it), context-ARM.log (engine and
harness log, last 4 MB). `report` joins the arms into serve_context.json and serve_context.md: each arm's
tok/s against its speculator's stock arm, the step timer's table per arm and workload (steps,
interval p50/p90/max, stalls over 1 s and the largest, host ms p50, target and drafter GPU ms), and `dspark-calib advise`'s model beside the arms
(advise_report: advise.predict_steps over each workload's decode steps in the stock arm's observe
file, each arm as the option that models it, the predicted ratio to stock against the measured one,
within 5 %, and the predicted ranking against the measured one).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TARGET = os.path.join(ROOT, "profiles", "configs", "qwen3-8b")
SHIPPED_TABLE = os.path.join(ROOT, "profiles", "h200",
                             "qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet")

K = 7
MAX_NUM_SEQS = 256
MAX_BATCHED = 8192
MAX_MODEL_LEN = 32768
GPU_UTIL = 0.85
OUTPUT_LEN = 256
KV_BLOCK = 16
KV_LAYERS = 36 + 5  # target + drafter
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 128, 2
GPU_MIB = 143_771
WEIGHTS_GIB = 17.37  # "Model loading took 17.37 GiB" (H200 log, both models)
OTHER_GIB = 4.09  # activations + CUDA graphs: what makes 97.86 GiB of KV at 0.85
KV_TOKENS_MEASURED = 625_680  # "GPU KV cache size: 625,680 tokens" (benchmarks/results/h200/2026-11-30-morning/h200-tp1.log)
KV_HEADROOM = 0.90
ACCEPTANCE_LENGTH = 4.0  # 3 of 7 drafts + the bonus token
ARMS = ("stock", "static", "aware", "fixed", "ab")  # fixed: adaptive verification off, every step verifies K
# ab: one engine started stock serves each workload four times, vLLM's pricing and the table's context-aware
# pricing in turn (AB_ORDER, pricing_swap.py), so the two meet the same engine
AB_ORDER = (("stock", 1), ("table", 1), ("table", 2), ("stock", 2))  # ABBA: a drift over the run cancels
CONTEXT_ARMS = ("aware", "ab")  # the arms that price context-aware steps: a context tail and chunk pricing apply
MARKER_PROMPT, MARKER_TOKENS, MARKER_REQS = 17, 64, 3
MARKER_MAX_CTX = 100  # a marker step's requests are all below this context
WARMUP = dict(requests=8, prompt=1024, tokens=32)
# Then a full batch: adaptive verification's draft-budget allocation is a torch.compile'd function
# that vLLM's own warm-up never runs (adaptive verification off there), and it runs only on steps
# whose budget binds; with MAX_NUM_SEQS requests decoding K drafts each, the rejection sampler's
# logits cap (get_max_chunk_logits) binds. Its first call compiles for seconds: inside a timed
# workload that stall is spread over every request's TPOT. Enough tokens that the first requests
# admitted still decode when the last are (admission takes a step per MAX_BATCHED prompt tokens);
# the prompt stays above MARKER_MAX_CTX, so none of these steps reads as a marker's.
FULL_BATCH_WARMUP = dict(requests=MAX_NUM_SEQS, prompt=128, tokens=64)
CONTEXT_FLOOR = 1024  # validate's context buckets: [0,1024), [1024,2048), ...
KILL_MARGIN_S = 65.0  # the engine child is stopped this long before the deadline: up to 35 s graceful
# (AsyncLLM.shutdown(timeout=30) + 5 s, so observe's last file is written), 10 s of group kill,
# then ~15 s of post-processing and writing the results
LOG_CAP = 4 << 20
DEFAULT_BUDGET_S = 1200.0  # an arm takes 4-6 min (engine start up to 230 s cold): the deadline only
# bounds an engine that hangs, so that the summary and the observe files are still written
GPU_SAMPLE_S = 0.2  # the parent's GPU readings while the engine serves (GpuSampler)
GPU_MAX_SAMPLES = 6000  # 20 minutes at 5 Hz: bounds the summary's memory, never reached in one arm


# -- workloads and concurrency (pure) ---------------------------------------------------------
def kv_bytes_per_token(layers: int = KV_LAYERS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
                       dtype_bytes: int = DTYPE_BYTES) -> int:
    return 2 * kv_heads * head_dim * dtype_bytes * layers


def kv_capacity_tokens(gpu_mib: float = GPU_MIB, util: float = GPU_UTIL, weights_gib: float = WEIGHTS_GIB,
                       other_gib: float = OTHER_GIB, block: int = KV_BLOCK) -> int:
    """KV tokens the engine gets: (memory x util - weights - activations/graphs) / bytes per token, in blocks."""
    free = gpu_mib * util * 2**20 - (weights_gib + other_gib) * 2**30
    return max(0, int(free // kv_bytes_per_token()) // block * block)


def tokens_per_request(prompt_len: int, output_len: int = OUTPUT_LEN, k: int = K, block: int = KV_BLOCK) -> int:
    """KV tokens one request holds at its end: prompt + output + the K draft slots and the bonus, in blocks."""
    return -(-(prompt_len + output_len + k + 1) // block) * block


def fit_concurrency(wanted: int, kv_tokens: int, longest_prompt: int, *, output_len: int = OUTPUT_LEN,
                    headroom: float = KV_HEADROOM, cap: int = MAX_NUM_SEQS) -> int:
    """The wanted concurrency, capped so that every in-flight request at the longest prompt, at its
    end, fits in headroom x the KV tokens (no preemption by construction); rounded down to a
    multiple of 8 (when >= 8); at least 1."""
    fits = int(kv_tokens * headroom // tokens_per_request(longest_prompt, output_len))
    c = min(wanted, fits, cap)
    return max(1, c // 8 * 8 if c >= 8 else c)


def num_requests(lens: tuple[int, ...], concurrency: int, waves: int) -> int:
    """waves x concurrency requests, rounded up so that a mix gets every prompt length equally often."""
    return -(-waves * concurrency // len(lens)) * len(lens)


def worst_case_tokens(lens: tuple[int, ...], requests: int, concurrency: int, output_len: int = OUTPUT_LEN) -> int:
    """KV tokens when the `concurrency` largest of the workload's requests are in flight at their end."""
    sizes = sorted((tokens_per_request(lens[i % len(lens)], output_len) for i in range(requests)), reverse=True)
    return sum(sizes[:concurrency])


def fit_skewed(w_lens: tuple[int, ...], wanted: int, kv_tokens: int, *, waves: int, output_len: int = OUTPUT_LEN,
               headroom: float = KV_HEADROOM, cap: int = MAX_NUM_SEQS) -> int:
    """fit_concurrency for a workload whose longest prompt is one of many (a skewed batch): the worst
    case is the c largest requests of the whole workload in flight at their end (a closed loop keeps
    the long ones in flight longest, but there are only so many of them)."""
    c = min(wanted, cap)
    while c > 1 and worst_case_tokens(w_lens, num_requests(w_lens, c, waves), c, output_len) > kv_tokens * headroom:
        c -= 1
    return max(1, c // 8 * 8 if c >= 8 else c)


def fit_workload(lens: tuple[int, ...], wanted: int, kv_tokens: int, *, waves: int, output_len: int = OUTPUT_LEN) -> int:
    """The concurrency a workload runs at: fit_skewed for one long prompt among many short ones,
    else fit_concurrency (every in-flight request at the longest: a mix's long requests stay in
    flight longest in a closed loop)."""
    if lens.count(max(lens)) == 1 and len(lens) > 3:
        return fit_skewed(lens, wanted, kv_tokens, waves=waves, output_len=output_len)
    return fit_concurrency(wanted, kv_tokens, max(lens), output_len=output_len)


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_lens: tuple[int, ...]  # request i gets prompt_lens[i % len]
    concurrency: int
    num_requests: int
    output_len: int = OUTPUT_LEN
    wanted_concurrency: int = 0
    shrunk: bool = False
    pricing: str = ""  # the ab arm: "stock" or "table", swapped in before this workload runs

    def prompt_len(self, i: int) -> int:
        return self.prompt_lens[i % len(self.prompt_lens)]

    @property
    def longest(self) -> int:
        return max(self.prompt_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_len(i) for i in range(self.num_requests))

    @property
    def worst_case_tokens(self) -> int:
        """KV tokens when the `concurrency` largest requests are in flight at their end."""
        return worst_case_tokens(self.prompt_lens, self.num_requests, self.concurrency, self.output_len)

    @property
    def prompts_label(self) -> str:
        """The prompt lengths as people read them: '1024/8192/16384', or '30000+63x1024'."""
        if len(self.prompt_lens) > 3 and len(set(self.prompt_lens[1:])) == 1:
            return f"{self.prompt_lens[0]}+{len(self.prompt_lens) - 1}x{self.prompt_lens[1]}"
        return "/".join(map(str, self.prompt_lens))


# -- the named configs (arms.json) -----------------------------------------------------------------
CONFIG_PATH = os.path.join(HERE, "arms.json")
ARM_DEFAULTS = {"observe_every": 4, "context_tail": 0.0, "context_chunks": False, "rerun": False,
                "speculator": "dspark", "seed": False, "estimator": "learn"}
ESTIMATORS = ("learn", "pinned")  # pinned: estimator_probe.EstimatorProbe.estimator_pin, the enforced acceptance


def load_config(path: str = CONFIG_PATH) -> dict[str, Any]:
    """arms.json: the workloads (in run order) and the named arms, each checked to be what its name says."""
    with open(path) as fh:
        cfg = json.load(fh)
    for name, arm in cfg["arms"].items():
        s = {**ARM_DEFAULTS, **arm}
        if s["pricing"] not in ARMS:
            raise ValueError(f"{path}: arm {name}: pricing must be one of {', '.join(ARMS)}, got {s['pricing']!r}")
        if s["speculator"] not in cfg["speculators"]:
            raise ValueError(f"{path}: arm {name}: unknown speculator {s['speculator']!r}")
        label = arm_label(s["pricing"], s["observe_every"], s["context_tail"], s["context_chunks"], s["rerun"],
                          s["speculator"], s["seed"], s["estimator"])
        if s["estimator"] not in ESTIMATORS:
            raise ValueError(f"{path}: arm {name}: estimator must be one of {', '.join(ESTIMATORS)}, "
                             f"got {s['estimator']!r}")
        if s["estimator"] == "pinned" and ("estimator_cold" not in cfg["speculators"][s["speculator"]]
                                           or s["pricing"] == "fixed" or s["seed"]):
            raise ValueError(f"{path}: arm {name}: a pinned estimator needs a speculator with one "
                             "(estimator_cold), adaptive verification and no seed")
        if s["seed"] and s.get("seed_from") not in cfg["arms"]:
            raise ValueError(f"{path}: arm {name}: a seeded arm names the arm whose observe file makes its seed "
                             f"(seed_from), got {s.get('seed_from')!r}")
        if label != name:
            raise ValueError(f"{path}: arm {name}: its settings make the label {label!r}; name it so")
    for runs in cfg.get("comparisons", {}).values():
        unknown = [a for a in runs if a not in cfg["arms"]]
        if unknown:
            raise ValueError(f"{path}: a comparison names unknown arms {unknown}")
    return cfg


def workload_specs(cfg: dict[str, Any]) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """(name, prompt lengths, wanted concurrency) per workload, most telling first (a late one may be skipped)."""
    return tuple((w["name"], tuple(w["prompt_lens"]), w["concurrency"]) for w in cfg["workloads"])


def apply_arm_config(args: argparse.Namespace) -> None:
    """`arm NAME`: the named arm's settings, under any option given on the command line; args.arm
    becomes the pricing (stock / static / aware) and the files are named by the settings' label."""
    s = {**ARM_DEFAULTS, **CONFIG["arms"][args.arm]}
    for key in ARM_DEFAULTS:
        if getattr(args, key) is None:
            setattr(args, key, s[key])
    args.seed_from = s.get("seed_from")
    args.arm = s["pricing"]


def plan_workloads(kv_tokens: int = KV_TOKENS_MEASURED, *, waves: int = 2, output_len: int = OUTPUT_LEN,
                   specs: Iterable[tuple[str, tuple[int, ...], int]] | None = None,
                   only: Iterable[str] | None = None) -> list[Workload]:
    specs = WORKLOAD_SPECS if specs is None else specs
    keep = set(only) if only else None
    out = []
    for name, lens, wanted in specs:
        if keep is not None and name not in keep:
            continue
        c = fit_workload(tuple(lens), wanted, kv_tokens, waves=waves, output_len=output_len)
        out.append(Workload(name, tuple(lens), c, num_requests(tuple(lens), c, waves), output_len,
                            wanted_concurrency=wanted))
    return out


def ab_plan(plan: list[Workload]) -> list[Workload]:
    """The ab arm's plan: each workload four times in a row, named WORKLOAD@PRICINGn, under vLLM's
    pricing and the table's in the order AB_ORDER."""
    return [replace(w, name=f"{w.name}@{pricing}{n}", pricing=pricing) for w in plan for pricing, n in AB_ORDER]


def refit(plan: list[Workload], kv_tokens: int) -> list[Workload]:
    """The plan against the engine's real KV capacity: a workload whose worst case no longer fits
    is shrunk (never preempted); the others are left exactly as planned (same in every arm)."""
    out = []
    for w in plan:
        c = fit_workload(w.prompt_lens, w.concurrency, kv_tokens, waves=max(1, w.num_requests // w.concurrency),
                         output_len=w.output_len)
        if c < w.concurrency:
            n = -(-(w.num_requests * c // w.concurrency) // len(w.prompt_lens)) * len(w.prompt_lens)
            w = replace(w, concurrency=c, num_requests=max(n, len(w.prompt_lens)), shrunk=True)
        out.append(w)
    return out


def estimate_seconds(w: Workload, *, prefill_tok_s: float = 30_000.0, step_floor_ms: float = 12.0,
                     tokens_per_step: float = 2.0) -> float:
    """A deliberately pessimistic wall-time guess for one workload on the H200 (Qwen3-8B bf16):
    prefill at 30k tokens/s (8192-token chunks ~0.2-0.27 s), then waves of decode where a step
    costs reading the weights (~16 GB) plus every in-flight request's KV from HBM (~4 TB/s),
    at 2 tokens per step (the synthetic 3/7 acceptance gives up to 4)."""
    prefill = w.prompt_tokens / prefill_tok_s
    mean_ctx = sum(w.prompt_lens) / len(w.prompt_lens) + w.output_len / 2
    kv_gb = w.concurrency * mean_ctx * kv_bytes_per_token() / 1e9
    step_ms = step_floor_ms + (16.4 + kv_gb) / 4.0 + 0.02 * w.concurrency  # + host/sampler per request
    waves = w.num_requests / w.concurrency
    decode = waves * (w.output_len / tokens_per_step) * step_ms / 1000.0
    return prefill + decode


# -- prompts ----------------------------------------------------------------------------------
def make_prompt(tag: str, i: int, length: int, lo: int = 1000, hi: int = 150_000) -> list[int]:
    """Random token ids, the same for a (tag, i) in every arm and run, unique across requests
    (no prefix-cache hits between requests)."""
    import numpy as np

    rng = np.random.default_rng([zlib.crc32(tag.encode()), i, length])
    return rng.integers(lo, hi, size=length, dtype=np.int64).tolist()


# -- metrics from timestamps (pure) -----------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def request_tpot_s(rec: dict[str, Any]) -> tuple[float | None, str]:
    """(TPOT seconds, clock): (last - first token time) / (n - 1); engine timestamps when the
    engine gave both, else the client's receive times; None for n < 2."""
    n = rec.get("n", 0)
    if n < 2:
        return None, "none"
    ef, el = rec.get("engine_first"), rec.get("engine_last")  # None: the engine gave none (vLLM's 0.0)
    if ef is not None and el is not None and el >= ef:
        return (el - ef) / (n - 1), "engine"
    cf, cl = rec.get("client_first"), rec.get("client_last")
    if cf is not None and cl is not None and cl >= cf:
        return (cl - cf) / (n - 1), "client"
    return None, "none"


def summarize_requests(recs: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    tpots, clocks, ttfts, per_step, accept = [], set(), [], [], []
    for r in recs:
        t, clock = request_tpot_s(r)
        if t is not None:
            tpots.append(t * 1000.0)
            clocks.add(clock)
        if r.get("ttft") is not None:
            ttfts.append(r["ttft"] * 1000.0)
        steps = r.get("spec_steps") or r.get("chunks")  # engine steps (vLLM's count); deltas merge steps under load
        if steps:
            per_step.append(r["n"] / steps)
        if r.get("mean_acceptance_length") is not None:
            accept.append(r["mean_acceptance_length"])
    out_tokens = sum(r.get("n", 0) for r in recs)
    return {
        "requests": len(recs), "output_tokens": out_tokens, "wall_s": round(wall_s, 3),
        "output_tok_s": round(out_tokens / wall_s, 1) if wall_s > 0 else None,
        "tpot_p50_ms": _r(percentile(tpots, 50)), "tpot_p90_ms": _r(percentile(tpots, 90)),
        "tpot_mean_ms": _r(sum(tpots) / len(tpots)) if tpots else None,
        "ttft_p50_ms": _r(percentile(ttfts, 50)), "ttft_p90_ms": _r(percentile(ttfts, 90)),
        "tokens_per_step_mean": _r(sum(per_step) / len(per_step)) if per_step else None,
        "acceptance_length_mean": _r(sum(accept) / len(accept)) if accept else None,
        "tpot_clock": "+".join(sorted(clocks)) or "none",
        "short_requests": sum(1 for r in recs if r.get("n", 0) != r.get("max_tokens", r.get("n", 0))),
        "preemptions": sum(r.get("preemptions") or 0 for r in recs),
    }


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else _r(seconds * 1000.0)


# -- observe files (pure: numpy/pyarrow, dspark_calib.observe/validate) --------------------------
def sorted_columns(cols: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    order = np.argsort(cols["step"], kind="stable")
    return {k: v[order] for k, v in cols.items()}


def marker_mask(cols: dict[str, Any], *, max_reqs: int = MARKER_REQS, max_ctx: int = MARKER_MAX_CTX) -> Any:
    return (cols["num_reqs"] <= max_reqs) & (cols["context_max"] < max_ctx)


def marker_runs(mask: Any, min_run: int = 2) -> list[tuple[int, int]]:
    """[start, end) of every run of >= min_run consecutive True rows."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            if i - start >= min_run:
                runs.append((start, i))
            start = None
    return runs


def segment_steps(cols: dict[str, Any], n_workloads: int, *, min_run: int = 2) -> tuple[list[Any] | None, str]:
    """Row indices (into step-sorted columns) of each workload, delimited by marker runs: one
    before each workload and one after the last completed one (or the killed workload's own
    marker). None, with the reason, unless exactly n_workloads + 1 runs are found."""
    import numpy as np

    runs = marker_runs(marker_mask(cols), min_run)
    if len(runs) != n_workloads + 1:
        return None, f"found {len(runs)} marker runs for {n_workloads} workloads (expected {n_workloads + 1})"
    return [np.arange(runs[i][1], runs[i + 1][0]) for i in range(n_workloads)], "ok"


def budget_distribution(cols: dict[str, Any], rows: Any | None = None, k: int = K) -> dict[str, Any]:
    """The chosen budgets over the observed steps that had drafts: per step, per request
    (draft_budget / num_reqs), shares full (all scheduled drafts verified) and zero, a histogram
    of the per-request budget rounded to 0..K, and how often the two pricings disagree."""
    import numpy as np

    from dspark_calib.observe.step import ABSENT

    sel = np.ones(len(cols["step"]), dtype=bool) if rows is None else np.zeros(len(cols["step"]), dtype=bool)
    if rows is not None:
        sel[rows] = True
    sel &= cols["scheduled_drafts"] > 0
    b, s, n = cols["draft_budget"][sel], cols["scheduled_drafts"][sel], cols["num_reqs"][sel]
    out: dict[str, Any] = {"steps": int(sel.sum())}
    if not sel.any():
        return out
    per_req = b / n
    hist = np.bincount(np.clip(np.rint(per_req).astype(int), 0, k), minlength=k + 1)
    bs, ba = cols["budget_static"][sel], cols["budget_context_aware"][sel]
    both = (bs != ABSENT) & (ba != ABSENT)
    out.update({
        "budget_p10": float(np.percentile(b, 10)), "budget_p50": float(np.percentile(b, 50)),
        "budget_p90": float(np.percentile(b, 90)), "budget_mean": _r(float(b.mean())),
        "per_request_mean": _r(float(b.sum() / n.sum())),
        "per_request_p10": _r(float(np.percentile(per_req, 10))),
        "per_request_p50": _r(float(np.percentile(per_req, 50))),
        "per_request_p90": _r(float(np.percentile(per_req, 90))),
        "share_full": _r(float((b == s).mean()), 4), "share_zero": _r(float((b == 0).mean()), 4),
        "verified_share": _r(float(b.sum() / s.sum()), 4),
        "per_request_hist": hist.tolist(),
        "pricings_compared": int(both.sum()),
        "pricings_disagree_share": _r(float((bs[both] != ba[both]).mean()), 4) if both.any() else None,
    })
    return out


def own_prediction_errors(cols: dict[str, Any], rows: Any | None = None,
                          floor: int = CONTEXT_FLOOR) -> list[dict[str, Any]]:
    """The engine's own predicted cost (predicted_*_ms, what it priced the step with) against the
    measured one, per kind and context bucket (validate's buckets and rules: verify = every step's
    forward_ms, draft = full-CUDA-graph steps' drafter_ms)."""
    import numpy as np

    from dspark_calib.validate import ErrorStats, bucket_label, pow2_bucket

    sel = np.ones(len(cols["step"]), dtype=bool) if rows is None else np.zeros(len(cols["step"]), dtype=bool)
    if rows is not None:
        sel[rows] = True
    ctx_b = pow2_bucket(cols["context_mean"].astype(np.int64), floor)
    kinds = {
        "verify": (cols["predicted_verify_ms"], cols["forward_ms"], sel & (cols["forward_ms"] > 0)),
        "draft": (cols["predicted_draft_ms"], cols["drafter_ms"],
                  sel & cols["full_cudagraph"] & (cols["drafter_ms"] > 0)),
    }
    out = []
    for kind, (pred, meas, keep) in kinds.items():
        for label, mask in [("all", keep)] + [(bucket_label(int(cb), floor), keep & (ctx_b == cb))
                                              for cb in np.unique(ctx_b[keep])]:
            e = ErrorStats.of(pred[mask], meas[mask]).to_dict()
            out.append({"kind": kind, "context_bucket": label, **{k: _r(v) if isinstance(v, float) else v
                                                                   for k, v in e.items()}})
    return out


def compact_observed(src_dir: str, dst: str) -> dict[str, Any]:
    """Every observed-*.parquet under src_dir as one parquet file (rows in file order, the first
    file's schema and metadata), checked by reading it back with dspark_calib's reader."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dspark_calib.observe.file import METADATA_KEY, observed_paths, read_observed

    paths = observed_paths([src_dir])
    tables = [pq.read_table(p) for p in paths]
    schema = tables[0].schema
    # created_at is per file (second resolution): files of one engine differ in it and nothing else
    metas = {json.dumps({k: v for k, v in json.loads(t.schema.metadata[METADATA_KEY]).items() if k != "created_at"},
                        sort_keys=True)
             for t in tables if t.schema.metadata and METADATA_KEY in t.schema.metadata}
    merged = pa.concat_tables([t.cast(schema) for t in tables])
    tmp = dst + ".tmp"
    pq.write_table(merged, tmp, compression="zstd")
    os.replace(tmp, dst)
    back = read_observed([dst])
    return {"files": len(paths), "rows": len(back), "metadata_variants": len(metas),
            "metadata": back.metadata[0].raw}


def validate_by_context(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """validate --json's by_context rows, flattened: kind, context, both pricings' median/p90."""
    rows = []
    for g in doc.get("by_context", []):
        row = {"kind": g["kind"], "context_bucket": g["context_bucket"]}
        for p in ("single_context", "context_aware"):
            e = g.get(p) or {}
            row[f"{p}_n"] = e.get("n")
            row[f"{p}_median_pct"] = _r(e.get("median_pct"))
            row[f"{p}_p90_pct"] = _r(e.get("p90_pct"))
        rows.append(row)
    return rows


# -- the arms ---------------------------------------------------------------------------------
def arm_env(arm: str, table: str | None, observe_dir: str, *, every: int = 4, tail: float = 0.0,
            chunks: bool = False, base: dict[str, str] | None = None, seed: str | None = None,
            policy: str = "warn") -> dict[str, str]:
    """The engine child's environment: base (os.environ) without any DSPARK_CALIB_* or profile
    context, plus the arm's own (tail, chunks: the aware arm's DSPARK_CALIB_CONTEXT_TAIL and
    DSPARK_CALIB_CONTEXT_CHUNKS, set either way; seed: DSPARK_CALIB_ESTIMATOR_SEED). policy: the
    plugin's DSPARK_CALIB_POLICY wherever a table or a seed is given: warn (a detail that differs
    is a line, the table still serves: the benchmark never silently turns into stock) or strict
    (the engine refuses to start instead: the proof that the table loads as an operator's would)."""
    if policy not in ("warn", "strict"):
        raise ValueError(f"policy must be warn or strict, got {policy!r}")
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {arm!r}")
    if (tail or chunks) and arm not in CONTEXT_ARMS:
        raise ValueError(f"a context tail or chunk pricing prices context-aware steps: arm aware or ab, got {arm!r}")
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("DSPARK_CALIB_") and k != "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN"}
    # the worker imports the estimator probe (engine_kwargs' worker_extension_cls) from here
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    env.update({"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "8192",
                "VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1"})
    if every > 0:  # every 0: observe off (the baseline for observe's own throughput cost)
        env.update({"DSPARK_CALIB_OBSERVE": observe_dir, "DSPARK_CALIB_OBSERVE_EVERY": str(every)})
    if seed:
        env.update({"DSPARK_CALIB_ESTIMATOR_SEED": seed, "DSPARK_CALIB_POLICY": policy})
    if arm == "ab":
        if not table:
            raise ValueError("arm ab needs a table (swapped in between workloads)")
        # the engine starts stock (no DSPARK_CALIB_TABLE); the swap reads these as load mode does
        env.update(context_aware_env(tail, chunks))
    elif arm not in ("stock", "fixed"):
        if not table:
            raise ValueError(f"arm {arm} needs a table")
        env.update({"DSPARK_CALIB_TABLE": table, "DSPARK_CALIB_POLICY": policy})
        if arm == "static":
            env.update({"DSPARK_CALIB_CONTEXT_AWARE": "0", "DSPARK_CALIB_CONTEXT_LEN": "8192"})
        else:
            env.update(context_aware_env(tail, chunks))
    return env


def context_aware_env(tail: float, chunks: bool) -> dict[str, str]:
    """The plugin's context-aware settings of an arm. Both always set: the label names them (aware =
    tail 0, chunks by the KV sum), whatever the plugin's defaults are (tail 0.2 and chunks by pairs)."""
    return {"DSPARK_CALIB_CONTEXT_AWARE": "1", "DSPARK_CALIB_CONTEXT_TAIL": f"{tail:g}",
            "DSPARK_CALIB_CONTEXT_CHUNKS": "1" if chunks else "0"}


# The suffixes of an arm's label, in their order, with the pattern each matches in a file name
# (ARM_FILE reads labels back by the same list).
LABEL_SUFFIXES = (("tail", r"-tail\d+"), ("chunks", "-chunks"), ("noobs", "-noobs"), ("seed", "-seed"),
                  ("pinned", "-pinned"), ("rerun", "-rerun"))


def arm_label(arm: str, observe_every: int, tail: float = 0.0, chunks: bool = False, rerun: bool = False,
              speculator: str = "dspark", seed: bool = False, estimator: str = "learn") -> str:
    """The files' and the report's name: the speculator when not DSpark (SPECULATOR-), the arm, -tailNN
    (the tail in hundredths), -chunks, -noobs, -seed (the acceptance estimator seeded at start), -pinned
    (the estimator pinned to the enforced acceptance), -rerun (the same arm again on the same host: the
    run-to-run spread the other differences are judged by)."""
    parts = {"tail": f"-tail{round(tail * 100)}" if tail else "", "chunks": "-chunks" if chunks else "",
             "noobs": "" if observe_every > 0 else "-noobs", "seed": "-seed" if seed else "",
             "pinned": "-pinned" if estimator == "pinned" else "", "rerun": "-rerun" if rerun else ""}
    return ("" if speculator == "dspark" else f"{speculator}-") + arm + "".join(parts[k] for k, _ in LABEL_SUFFIXES)


def conditional_rates(rates: list[float]) -> list[float]:
    """vLLM's synthetic rates are unconditional (position i accepted with all before it); the
    estimator predicts each position given the ones before: r[i] / r[i - 1]."""
    out, prev = [], 1.0
    for r in rates:
        out.append(r / prev if prev > 0 else 0.0)
        prev = r
    return out


def pinned_intercepts(rates: list[float]) -> list[float]:
    """The estimator's intercepts that, with slope 0, predict the conditional acceptance of these
    unconditional rates whatever the draft's feature: logit(c), c kept off 0 and 1."""
    return [math.log(c / (1 - c)) for c in (min(max(x, 1e-4), 1 - 1e-4) for x in conditional_rates(rates))]


CONFIG = load_config()
WORKLOAD_SPECS = workload_specs(CONFIG)


def speculative_config(acceptance_length: float | None = ACCEPTANCE_LENGTH,
                       acceptance_rates: list[float] | None = None, *, speculator: str = "dspark",
                       adaptive: bool = True) -> dict[str, Any]:
    spec = CONFIG["speculators"][speculator]
    cfg: dict[str, Any] = {"method": spec["method"], "model": os.path.join(ROOT, spec["draft"]),
                           "num_speculative_tokens": K, "enable_adaptive_verification": adaptive,
                           "rejection_sample_method": "synthetic"}
    if acceptance_rates is not None:
        cfg["synthetic_acceptance_rates"] = list(acceptance_rates)
    else:
        cfg["synthetic_acceptance_length"] = float(acceptance_length)
    return cfg


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """AsyncEngineArgs for the arms: the engine the table is profiled for (profile.sh), with the
    estimator probe mixed into the worker (estimator_probe.py: read between workloads only)."""
    return dict(model=TARGET, speculative_config=spec, load_format="dummy", skip_tokenizer_init=True,
                max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED, max_model_len=MAX_MODEL_LEN,
                gpu_memory_utilization=GPU_UTIL, seed=0, disable_log_stats=False,
                per_request_spec_decode_metrics="summary",
                worker_extension_cls="estimator_probe.EstimatorProbe")


# -- the engine child: drives workloads through AsyncLLM (or the fake) ----------------------------
async def run_requests(engine: Any, tag: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                       *, clock: Callable[[], float] = time.monotonic) -> tuple[list[dict[str, Any]], float]:
    """Closed loop: at most `concurrency` requests in flight (asyncio.Semaphore, FIFO). Returns the
    per-request records and the wall time from the first submit to the last completion."""
    sp = _sampling_params(max_tokens)
    sem = asyncio.Semaphore(concurrency)
    recs: list[dict[str, Any]] = []

    async def one(i: int) -> None:
        async with sem:
            rec: dict[str, Any] = {"i": i, "prompt_len": len(prompts[i]), "max_tokens": max_tokens, "n": 0,
                                   "chunks": 0}
            t_submit = clock()
            first = last = None
            final = None
            async for out in engine.generate(_prompt(prompts[i]), sp, request_id=f"{tag}-{i}"):
                now = clock()
                got = len(out.outputs[0].token_ids) if out.outputs else 0
                if got:
                    rec["n"] += got
                    rec["chunks"] += 1
                    first = now if first is None else first
                    last = now
                final = out
            rec.update(client_first=first, client_last=last,
                       ttft=None if first is None else first - t_submit)
            m = getattr(final, "metrics", None)
            if m is not None:
                rec["engine_first"] = getattr(m, "first_token_ts", 0.0) or None
                rec["engine_last"] = getattr(m, "last_token_ts", 0.0) or None
                lat = getattr(m, "first_token_latency", 0.0)
                if lat:
                    rec["ttft_engine"] = lat
                rec["preemptions"] = getattr(m, "num_preemptions", 0)
            sdm = getattr(final.outputs[0], "spec_decode_metrics", None) if final and final.outputs else None
            if sdm is not None:
                d = sdm.to_dict() if hasattr(sdm, "to_dict") else dict(sdm)
                rec["mean_acceptance_length"] = d.get("mean_acceptance_length")
                rec["spec_steps"] = d.get("num_spec_steps")
                rec["accepted_drafts"] = d.get("num_accepted_draft_tokens")
                rec["drafts"] = d.get("num_draft_tokens")
            recs.append(rec)

    t0 = clock()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    recs.sort(key=lambda r: r["i"])
    return recs, clock() - t0


def _sampling_params(max_tokens: int) -> Any:
    try:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
    except ImportError:  # dry run without vLLM
        from types import SimpleNamespace

        return SimpleNamespace(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)


def _prompt(ids: list[int]) -> Any:
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:
        return {"prompt_token_ids": ids}
    return TokensPrompt(prompt_token_ids=ids)


async def all_rpc(engine: Any, method: str, args: tuple = ()) -> list[Any]:
    """Every worker's answer to collective_rpc(method, args); [{"error": ...}] when the call failed."""
    try:
        return list(await engine.collective_rpc(method, args=args))
    except Exception as exc:  # noqa: BLE001 - a report, not the run: say why and go on
        return [{"error": f"{type(exc).__name__}: {str(exc)[:200]}"}]


async def rank0_rpc(engine: Any, method: str) -> Any:
    """The worker extension's answer to collective_rpc(method) on rank 0 (the first), None
    without one, or {"error": ...} when the call failed (a report, not the run)."""
    if getattr(engine, "collective_rpc", None) is None:
        return None
    states = await all_rpc(engine, method)
    return states[0] if states else None


async def estimator_state(engine: Any) -> Any:
    """What the draft-model speculator's acceptance estimator has learned (rank 0), or None
    (DSpark's confidence head, adaptive verification off, or the dry run's fake engine)."""
    return await rank0_rpc(engine, "estimator_state")


def step_timer_summary(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """One window of the step timer (step_timer.StepTimer.take: every serving execute_model call
    on TP rank 0): steps, the intervals between successive call starts (the whole step as the
    host lived it: forward, sampling, drafting, scheduling, any stall), the stalls (intervals
    over observe's STALL_MS, each with the index of the step that began after it), the host's
    time inside each call, and the steps that scheduled tokens. None without a timer; an
    {"error": ...} answer passes through."""
    if not raw or "error" in raw:
        return raw or None
    from dspark_calib.observe.step import STALL_MS

    interval, host = _step_ms(raw)
    stalls = [{"step": i + 1, "ms": _r(x, 1)} for i, x in enumerate(interval) if x > STALL_MS]
    gpu = {}
    for name in ("target", "drafter"):
        ms = [x for x in raw.get(f"{name}_ms") or () if x is not None]
        gpu |= {f"{name}_steps": len(ms), f"{name}_p50_ms": _r(percentile(ms, 50)),
                f"{name}_p90_ms": _r(percentile(ms, 90)), f"{name}_max_ms": _r(max(ms)) if ms else None}
    return {"steps": len(host), "dropped": raw.get("dropped", 0),
            "steps_with_tokens": sum(1 for t in raw["num_tokens"] if t > 0),
            **drafter_share(interval, raw.get("drafter_ms") or ()),
            "intervals": len(interval), "interval_p50_ms": _r(percentile(interval, 50)),
            "interval_p90_ms": _r(percentile(interval, 90)), "interval_p99_ms": _r(percentile(interval, 99)),
            "interval_max_ms": _r(max(interval)) if interval else None,
            "stall_ms": STALL_MS, "stalls": stalls,
            "host_p50_ms": _r(percentile(host, 50)), "host_p90_ms": _r(percentile(host, 90)),
            "host_max_ms": _r(max(host)) if host else None} | gpu | forward_tokens(raw) | {"cpu": raw.get("cpu")}


def drafter_share(interval: list[float], drafter: Any) -> dict[str, Any]:
    """The mean step of the window's calls that ran a drafter and have a successor (a call's step:
    its start to the next call's), the drafter's mean in it and the rest (target, sampling, host):
    what a pricing controls is the rest and the tokens a step, the drafter's time is the same
    draft steps whatever is verified."""
    pairs = [(step, d) for step, d in zip(interval, drafter) if d is not None]
    if not pairs:
        return {"drafter_share_steps": 0, "step_mean_ms": None, "drafter_mean_ms": None, "rest_mean_ms": None}
    step = sum(s for s, _ in pairs) / len(pairs)
    mean = sum(d for _, d in pairs) / len(pairs)
    return {"drafter_share_steps": len(pairs), "step_mean_ms": _r(step), "drafter_mean_ms": _r(mean),
            "rest_mean_ms": _r(step - mean)}


def add_drafter_share(summary: dict[str, Any], steps: dict[str, Any]) -> None:
    """Each workload's step-timer figures get drafter_share from the arm's per-step file (the
    steps one by one), so the report has it for runs whose summaries were written without it."""
    for name, w in summary.get("workloads", {}).items():
        one = steps.get(name)
        if one and isinstance(w.get("step_timer"), dict):
            w["step_timer"] |= drafter_share(one["interval_ms"][1:], one.get("drafter_ms") or ())


def forward_tokens(raw: dict[str, Any]) -> dict[str, Any]:
    """The tokens the window's forwards ran after the draft budget, over the steps whose requests
    all decode (scheduled tokens = requests x (1 + K)): their mean and the mean drafts verified a
    request, where pricings that decide differently show apart."""
    k1 = 1 + K
    pairs = [(f, r) for f, t, r in zip(raw.get("forward_tokens") or (), raw["num_tokens"], raw["num_reqs"])
             if f is not None and r > 0 and t == r * k1]
    if not pairs:
        return {"decode_steps": 0, "forward_tokens_mean": None, "verified_drafts_per_request": None}
    return {"decode_steps": len(pairs), "forward_tokens_mean": _r(sum(f for f, _ in pairs) / len(pairs), 1),
            "verified_drafts_per_request": _r(sum(f - r for f, r in pairs) / sum(r for _, r in pairs))}


def step_times(raw: dict[str, Any] | None) -> dict[str, list] | None:
    """The window's steps one by one (the per-arm steps file): interval since the previous
    start and host time in ms (0.001 ms), scheduled tokens and requests."""
    if not raw or "error" in raw:
        return None
    interval, host = _step_ms(raw)
    gpu = {f"{name}_ms": [None if x is None else round(x, 3) for x in raw.get(f"{name}_ms") or [None] * len(host)]
           for name in ("target", "drafter")}
    return {"interval_ms": [None] + [round(x, 3) for x in interval], "host_ms": [round(x, 3) for x in host],
            "num_tokens": raw["num_tokens"], "num_reqs": raw["num_reqs"],
            "forward_tokens": raw.get("forward_tokens") or [None] * len(host)} | gpu


def _step_ms(raw: dict[str, Any]) -> tuple[list[float], list[float]]:
    """A step timer window's intervals between successive call starts and its calls' host times, ms."""
    start = raw["start_s"]
    return [(b - a) * 1e3 for a, b in zip(start, start[1:])], [(b - a) * 1e3 for a, b in zip(start, raw["end_s"])]


async def drive(engine: Any, plan: list[Workload], sink: Callable[[dict[str, Any]], None], *,
                deadline: float, est_factor: float = 1.5, now: Callable[[], float] = time.time,
                cold: dict[str, int] | None = None, track_estimator: bool = False,
                ab_table: str | None = None) -> None:
    """Warm-up (a few long requests, then a full batch of short ones: FULL_BATCH_WARMUP), the
    estimator's cold phase when the speculator has one (timed and reported
    apart: an unfitted estimator trims almost every draft), then per workload: a marker, the
    workload, what the estimator has learned; a final marker. A workload that would end past the
    deadline (its estimate x est_factor) is skipped, and so is its marker.
    The step timer (step_timer.py) starts after the warm-up, in every arm; its window is taken
    right before each workload (the marker's and cold phase's steps: a "step_timer" event) and
    right after it (the workload's own steps: its event's step_timer and step_times), so a
    workload's intervals never span the harness's idle time between workloads.
    A workload with a pricing (the ab arm) first has it swapped in on every worker (pricing_swap:
    ab_table for "table", vLLM's own tables for "stock"), before its marker; a swap that fails
    skips the workload (said in a "pricing" event), never serves it under the other pricing."""
    recs, wall = await run_requests(engine, "warmup", [make_prompt("warmup", i, WARMUP["prompt"])
                                                       for i in range(WARMUP["requests"])],
                                    WARMUP["tokens"], WARMUP["requests"])
    full = FULL_BATCH_WARMUP
    full_recs, full_wall = await run_requests(engine, "warmup-full", [make_prompt("warmup-full", i, full["prompt"])
                                                                      for i in range(full["requests"])],
                                              full["tokens"], full["requests"])
    sink({"event": "warmup", "wall_s": round(wall, 3), "requests": len(recs),
          "full_batch_wall_s": round(full_wall, 3), "full_batch_requests": len(full_recs)})
    sink({"event": "step_timer", "started": await rank0_rpc(engine, "step_timer_start")})
    if cold:
        sink({"event": "estimator", "after": "warmup", "state": await estimator_state(engine)})
        recs, wall = await run_requests(engine, "cold", [make_prompt("cold", i, cold["prompt"])
                                                         for i in range(cold["requests"])],
                                        cold["tokens"], cold["concurrency"])
        sink({"event": "cold", "summary": summarize_requests(recs, wall), "settings": cold})
        sink({"event": "estimator", "after": "cold", "state": await estimator_state(engine)})
    markers = 0

    async def marker() -> None:
        nonlocal markers
        await run_requests(engine, f"marker{markers}", [make_prompt(f"marker{markers}", i, MARKER_PROMPT)
                                                        for i in range(MARKER_REQS)], MARKER_TOKENS, MARKER_REQS)
        markers += 1

    for w in plan:
        est = estimate_seconds(w)
        if now() + est * est_factor > deadline:
            sink({"event": "skipped", "workload": w.name, "estimate_s": round(est, 1),
                  "left_s": round(deadline - now(), 1)})
            continue
        if w.pricing:
            answers = await all_rpc(engine, "pricing_swap", (ab_table if w.pricing == "table" else None,))
            sink({"event": "pricing", "workload": w.name, "pricing": w.pricing, "answers": answers})
            if any(not isinstance(a, dict) or "error" in a or a.get("pricing") != w.pricing for a in answers):
                sink({"event": "skipped", "workload": w.name, "why": "pricing swap failed"})
                continue
        await marker()
        prompts = [make_prompt(w.name, i, w.prompt_len(i)) for i in range(w.num_requests)]
        sink({"event": "step_timer", "before": w.name,
              "summary": step_timer_summary(await rank0_rpc(engine, "step_timer_take"))})
        sink({"event": "start", "workload": w.name, "estimate_s": round(est, 1)})
        recs, wall = await run_requests(engine, w.name, prompts, w.output_len, w.concurrency)
        steps = await rank0_rpc(engine, "step_timer_take")
        sink({"event": "workload", "workload": asdict(w), "estimate_s": round(est, 1),
              "summary": summarize_requests(recs, wall), "requests": recs,
              "step_timer": step_timer_summary(steps), "step_times": step_times(steps)})
        if cold or track_estimator:
            sink({"event": "estimator", "after": w.name, "state": await estimator_state(engine)})
    await marker()
    sink({"event": "markers", "count": markers})


def engine_child(args: argparse.Namespace) -> int:
    """Runs in its own process (the arm's environment): start the engine, drive, shut down."""
    results = open(args.results, "a", buffering=1)

    def sink(obj: dict[str, Any]) -> None:
        obj = {**obj, "t": round(time.time(), 3)}  # wall clock: joins the parent's GPU readings
        results.write(json.dumps(obj) + "\n")
        results.flush()
        if obj.get("event") != "workload":
            print("HARNESS " + json.dumps(obj), flush=True)
        else:
            print("HARNESS " + json.dumps({"workload": obj["workload"]["name"], **obj["summary"]}), flush=True)

    plan = [Workload(**{**w, "prompt_lens": tuple(w["prompt_lens"])}) for w in json.loads(args.plan)]
    rates = [float(x) for x in args.acceptance_rates.split(",")] if args.acceptance_rates else None
    spec = speculative_config(args.acceptance_length, rates, speculator=args.speculator, adaptive=not args.fixed)
    # vLLM's draft-model speculator has an acceptance estimator under adaptive verification; a pinned
    # one has no cold phase: it is right from the first step
    has_estimator = not args.fixed and "estimator_cold" in CONFIG["speculators"][args.speculator]
    cold = CONFIG["speculators"][args.speculator]["estimator_cold"] if has_estimator and not args.pin_estimator \
        else None

    async def main() -> None:
        t0 = time.time()
        if args.dry_run:
            t_import = time.time()
            engine = FakeEngine.from_env(args.table, estimator_keys=fake_estimator_keys(spec) if has_estimator else None,
                                         fixed=args.fixed)
        else:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            t_import = time.time()
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(spec)))
        cc = engine.vllm_config.cache_config
        kv_tokens = int((cc.num_gpu_blocks or 0) * cc.block_size)
        fitted = refit(plan, kv_tokens) if kv_tokens else plan
        sink({"event": "engine", "import_s": round(t_import - t0, 2), "start_s": round(time.time() - t_import, 2),
              "kv_tokens": kv_tokens,
              "kv_blocks": cc.num_gpu_blocks, "block_size": cc.block_size, "speculative_config": spec,
              "plan": [asdict(w) for w in fitted]})
        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # the parent's deadline
        if args.pin_estimator:
            states = await engine.collective_rpc("estimator_pin", args=(pinned_intercepts(rates),))
            if not states or states[0] is None:
                raise RuntimeError("--pin-estimator: the speculator has no acceptance estimator to pin")
            sink({"event": "estimator", "after": "pin", "state": states[0]})
        try:
            await drive(engine, fitted, sink, deadline=args.child_deadline, cold=cold,
                        track_estimator=bool(cold or args.pin_estimator), ab_table=args.ab_table)
        except asyncio.CancelledError:
            sink({"event": "cancelled", "at": round(time.time(), 1)})
        finally:
            t1 = time.time()
            # the engine core gets SIGTERM and up to 30 s to exit cleanly (observe writes its last file)
            engine.shutdown(timeout=30) if not args.dry_run else engine.shutdown()
            sink({"event": "shutdown", "s": round(time.time() - t1, 2)})

    asyncio.run(main())
    return 0


# -- the fake engine (--dry-run: the whole control flow on CPU) --------------------------------
class FakeEngine:
    """Stands in for AsyncLLM: one step loop over the active requests (8192-token chunked prefill,
    then decode with K drafts, a budget of min(K, 3 or 5) per request, all K with adaptive
    verification off (fixed), and 3 accepted), DELTA outputs with vLLM-like metrics, and observe
    files written as the plugin would (predicted costs from the arm's pricing, "measured" costs
    from the table's curves at the step's context plus noise, the drafts graded and accepted per
    position). It proves the harness, not vLLM."""

    def __init__(self, observe_dir: str | None, every: int, table_path: str, pricing: str,
                 estimator_keys: dict[str, Any] | None = None, fixed: bool = False):
        import numpy as np

        from types import SimpleNamespace

        from dspark_calib.fingerprint import ENGINE_KEYS
        from dspark_calib.pricing.costs import ContextCosts
        from dspark_calib.pricing.grid import ContextGrid
        from dspark_calib.observe.file import ObservedWriter
        from dspark_calib.table.file import read_table

        table = read_table(table_path, samples=False)
        self.costs = ContextCosts.from_table(table)
        self.grid = ContextGrid(self.costs)
        self.pricing = pricing
        self.fixed = fixed
        self.rng = np.random.default_rng(0)
        self.every = max(1, every)
        # the engine the plugin would record (describe_engine): the table's own, so advise reads the acceptance
        fp = table.fingerprint.to_dict()
        self.writer = ObservedWriter(observe_dir, rows_per_file=500, metadata={
            "mode": pricing, "table_hash": table.content_hash if pricing != "stock" else None, "tp_rank": 0,
            "engine": {k: fp[k] for k in ENGINE_KEYS if fp.get(k) is not None},
            "sample_every": self.every, "max_num_reqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_BATCHED,
            **({"estimator_keys": estimator_keys} if estimator_keys else {}),
        }) if observe_dir else None
        # a speculator with vLLM's acceptance estimator: started from the seed when one is set (the plugin
        # would), refitted every 100 steps toward fixed coefficients, read on refit boundaries as observe does
        self.estimator = None
        if estimator_keys:
            seed_file = os.environ.get("DSPARK_CALIB_ESTIMATOR_SEED")
            if seed_file:
                from dspark_calib.seed import read_seed

                seed = read_seed(seed_file)
                self.estimator = {"refits": 0, "slope": seed.slope, "intercepts": list(seed.intercepts)}
            else:
                self.estimator = {"refits": 0, "slope": 0.5, "intercepts": [-0.2] * K}
        self.estimator_written: int | None = None
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=KV_TOKENS_MEASURED // 16,
                                                                       block_size=16))
        self.active: list[dict[str, Any]] = []
        self.step_no = 0
        # the worker extension's step timer, on a stand-in worker whose runner's execute_model is one fake step
        if HERE not in sys.path:  # the engine child runs from HERE; a test imports this file by path
            sys.path.insert(0, HERE)
        from step_timer import StepTimerProbe

        class HostEvent:  # the events' arithmetic on the host clock: the dry run's columns, not measurements
            def record(self) -> None:
                self.t = time.perf_counter()

            def elapsed_time(self, other: "HostEvent") -> float:
                return (other.t - self.t) * 1e3

            def synchronize(self) -> None:
                pass

        class FakeWorker(StepTimerProbe):
            step_timer_event = HostEvent

            def _step_timer_tp_rank(self) -> int:
                return 0

        self.worker = FakeWorker()
        runner = SimpleNamespace(speculator=SimpleNamespace(propose=lambda **kwargs: None), forward_tokens=0,
                                 step_timing=SimpleNamespace(record_batch=lambda input_batch, full_cudagraph: None))
        # vLLM's execute_model hands step_timing the input batch after the budget; the fake does too
        runner.execute_model = lambda scheduler_output, **kwargs: runner.step_timing.record_batch(
            SimpleNamespace(num_tokens=runner.forward_tokens), False)
        self.worker.model_runner = runner
        self.loop_task: asyncio.Task | None = None

    @classmethod
    def from_env(cls, table_path: str, estimator_keys: dict[str, Any] | None = None,
                 fixed: bool = False) -> "FakeEngine":
        env = os.environ
        pricing = ("stock" if "DSPARK_CALIB_TABLE" not in env else
                   "static" if env.get("DSPARK_CALIB_CONTEXT_AWARE") == "0" else "aware")
        return cls(env.get("DSPARK_CALIB_OBSERVE"), int(env.get("DSPARK_CALIB_OBSERVE_EVERY", "4")),
                   table_path, pricing, estimator_keys, fixed)

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """The worker extension's calls, as one rank answers them: the step timer's (the
        extension's own code on the fake's runner); the pin (the fake's estimator then predicts
        the given conditional rates and stops refitting); no estimator state to read."""
        if method.startswith("step_timer_"):
            return [getattr(self.worker, method)(*args)]
        if method == "pricing_swap":  # the fake prices as its table arm or its stock arm would
            self.pricing = "aware" if args[0] else "stock"
            return [{"pricing": "table" if args[0] else "stock", "context_aware": bool(args[0])}]
        if method == "estimator_pin" and self.estimator is not None:
            self.estimator = {"refits": self.estimator["refits"], "slope": 0.0, "intercepts": list(args[0]),
                              "pinned": True}
            return [dict(self.estimator)]
        return [None]

    async def generate(self, prompt: Any, sp: Any, request_id: str):
        ids = prompt["prompt_token_ids"]
        q: asyncio.Queue = asyncio.Queue()
        self.active.append({"id": request_id, "prompt": len(ids), "computed": 0, "out": 0, "max": sp.max_tokens,
                            "q": q, "first": None, "last": None, "arrival": time.monotonic()})
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = asyncio.get_running_loop().create_task(self._loop())
        while True:
            out = await q.get()
            yield out
            if out.finished:
                return

    async def _loop(self) -> None:
        pause = float(os.environ.get("SERVE_CONTEXT_FAKE_STEP_S", "0"))  # dry runs of the deadline paths
        while self.active:
            self._step()
            await asyncio.sleep(pause)

    def _step(self) -> None:
        from types import SimpleNamespace

        running = self.active[:MAX_NUM_SEQS]
        budget_tokens = MAX_BATCHED
        sched = []
        for r in running:  # decodes first, then prefill chunks, as vLLM's scheduler
            if r["computed"] >= r["prompt"]:
                sched.append((r, 1 + K, K))
                budget_tokens -= 1 + K
        for r in running:
            if r["computed"] < r["prompt"] and budget_tokens > 0:
                chunk = min(r["prompt"] - r["computed"], budget_tokens)
                sched.append((r, chunk, 0))
                budget_tokens -= chunk
        if not sched:
            return
        ctx = [r["computed"] for r, _, _ in sched]
        n, csum = len(sched), sum(ctx)
        scheduled = sum(d for _, _, d in sched)
        mean_ctx = -(-csum // n)
        per_req = K if self.fixed else 3 if (self.pricing != "aware" or mean_ctx > 4096) else 5
        budget = sum(min(d, per_req) for _, _, d in sched)
        non_draft = sum(t - d for _, t, d in sched)
        tokens = non_draft + budget
        runner = self.worker.model_runner
        runner.forward_tokens = tokens  # the runner's forward runs the budget's tokens, as vLLM's
        runner.execute_model(SimpleNamespace(
            total_num_scheduled_tokens=sum(t for _, t, _ in sched), num_scheduled_tokens={r["id"]: t for r, t, _ in sched}))
        runner.speculator.propose()  # the step's sample_tokens drafts after its execute_model
        if self.pricing == "aware":
            pd, pv = self.grid.step_tables(csum, n)
            priced = mean_ctx
        else:
            pd, pv = self.costs.tables[8192]
            priced = 8192
        from dspark_calib.pricing.rules import verify_context

        # the fake's truth: what the profile says a batch reading this much KV costs. Circular on
        # purpose (the model under test makes the data): the dry run checks plumbing, not pricing.
        truth = self.costs.at(mean_ctx)
        truth_verify = self.costs.at(verify_context(csum, min(tokens, MAX_BATCHED), MAX_NUM_SEQS)).verify
        noise = 1 + self.rng.normal(0, 0.003, 2)
        self.step_no += 1
        est = self.estimator
        if est is not None and not est.get("pinned") and self.step_no % 100 == 0:  # the fake refit: halfway to slope 1, intercepts 2 - i/2
            est["refits"] += 1
            est["slope"] += (1.0 - est["slope"]) / 2
            est["intercepts"] = [b + (2.0 - i / 2 - b) / 2 for i, b in enumerate(est["intercepts"])]
        reading = {}
        if est is not None and self.step_no % self.every == 0 and est["refits"] != self.estimator_written:
            reading = dict(estimator_refits=est["refits"], estimator_steps=self.step_no, estimator_slope=est["slope"],
                           estimator_intercepts=tuple(est["intercepts"]))
            self.estimator_written = est["refits"]
        if self.writer is not None and self.step_no % self.every == 0:
            from dspark_calib.observe.step import ObservedStep

            # per position i (vLLM's estimator labels): graded where the first i drafts were accepted and an
            # (i+1)-th verified, accepted where it was accepted too (3 accepted of min(d, per_req) verified)
            verified = [min(d, per_req) for _, _, d in sched if d]
            graded = tuple(sum(b > i and min(b, 3) >= i for b in verified) for i in range(K))
            accepted = tuple(sum(min(b, 3) > i for b in verified) for i in range(K))

            self.writer.append(ObservedStep(
                step=self.step_no, forward_ms=float(truth_verify[min(tokens, MAX_BATCHED)] * noise[0]),
                drafter_ms=float(truth.draft[n] * noise[1]), num_target_tokens=max(1, tokens), num_reqs=n,
                full_cudagraph=tokens <= 512, context_mean=csum / n, context_max=max(ctx), context_sum=csum,
                scheduled_drafts=scheduled, draft_budget=budget, priced_context=priced,
                predicted_draft_ms=float(pd[n]), predicted_verify_ms=float(pv[min(tokens, MAX_BATCHED)]),
                budget_static=min(budget, scheduled) if self.pricing == "static" else None,
                budget_context_aware=budget if self.pricing == "aware" else None,
                position_graded=graded, position_accepted=accepted, **reading))
        now = time.monotonic()
        for r, t, d in sched:
            if d == 0:
                r["computed"] += t
                got = 1 if r["computed"] >= r["prompt"] else 0
            else:
                got = min(min(d, per_req), 3) + 1
                r["computed"] += got
            got = min(got, r["max"] - r["out"])
            if got <= 0:
                continue
            r["out"] += got
            r["first"] = now if r["first"] is None else r["first"]
            r["last"] = now
            done = r["out"] >= r["max"]
            metrics = SimpleNamespace(first_token_ts=r["first"], last_token_ts=r["last"], num_preemptions=0,
                                      first_token_latency=r["first"] - r["arrival"])
            sdm = {"mean_acceptance_length": 4.0, "num_spec_steps": 1, "num_accepted_draft_tokens": 3,
                   "num_draft_tokens": 7} if done else None
            r["q"].put_nowait(SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=[0] * got, spec_decode_metrics=sdm)], finished=done,
                metrics=metrics))
            if done:
                self.active.remove(r)

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()


def fake_estimator_keys(spec: dict[str, Any]) -> dict[str, Any]:
    """The seed keys (seed.SEED_KEYS) the fake engine records: the speculative config's, None for the models'."""
    from dspark_calib.seed import KEY_NAMES

    return {**dict.fromkeys(KEY_NAMES), "speculative_method": spec["method"], "num_speculative_tokens": K,
            "load_format": "dummy", "rejection_sample_method": spec.get("rejection_sample_method"),
            "synthetic_acceptance_rates": spec.get("synthetic_acceptance_rates")}


# -- the arm (parent: spawns the engine child, then post-processes) ------------------------------
def run_arm(args: argparse.Namespace) -> int:
    t_start = time.time()
    arm = args.arm
    if (args.context_tail or args.context_chunks) and arm not in CONTEXT_ARMS:
        print(f"arm {arm}: --context-tail and --context-chunks price context-aware steps (arms aware and ab only)",
              file=sys.stderr)
        return 2
    if arm == "ab" and (args.observe_every > 0 or not args.table):
        print(f"arm {arm}: the in-engine A/B needs --table and --observe-every 0 (observe mode keeps the pricing "
              "it saw first in each file; the step timer records every step of both)", file=sys.stderr)
        return 2
    if not (0.0 <= args.context_tail <= 1.0 and abs(args.context_tail * 100 - round(args.context_tail * 100)) < 1e-9):
        print(f"arm {arm}: --context-tail {args.context_tail:g} must be a multiple of 0.01 between 0 and 1 "
              f"(the files are named by it)", file=sys.stderr)
        return 2
    label = arm_label(arm, args.observe_every, args.context_tail, args.context_chunks, args.rerun, args.speculator,
                      args.seed, args.estimator)
    if args.estimator == "pinned" and not args.acceptance_rates:
        print(f"arm {label}: a pinned estimator predicts the enforced rates: give --acceptance-rates", file=sys.stderr)
        return 2
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    seed = seed_info = None
    if args.seed:
        try:
            seed, seed_info = arm_seed(args.seed_file, getattr(args, "seed_from", None), out_dir)
        except Exception as exc:  # noqa: BLE001 - dspark_calib's CalibError: one line, the arm not run
            print(f"arm {label}: no estimator seed ({exc})", file=sys.stderr)
            return 2
    work = os.path.abspath(args.work or f"/tmp/serve-context-{label}")
    obs = os.path.join(work, "observe")
    if os.path.isdir(work):
        import shutil

        shutil.rmtree(work)
    os.makedirs(obs)
    results_path = os.path.join(work, "results.jsonl")
    log_path = os.path.join(work, "engine.log")
    table = os.path.abspath(args.table) if args.table else None
    plan = plan_workloads(only=args.workloads.split(",") if args.workloads else None,
                          waves=args.waves)
    if arm == "ab":
        plan = ab_plan(plan)
    env = arm_env(arm, table, obs, every=args.observe_every, tail=args.context_tail, chunks=args.context_chunks,
                  seed=seed, policy=args.policy)
    deadline = args.deadline_epoch or (t_start + DEFAULT_BUDGET_S)
    child_deadline = deadline - KILL_MARGIN_S
    cmd = [sys.executable, os.path.abspath(__file__), "_engine", "--results", results_path,
           "--plan", json.dumps([asdict(w) for w in plan]), "--child-deadline", str(child_deadline),
           "--acceptance-length", str(args.acceptance_length), "--speculator", args.speculator]
    if arm == "fixed":
        cmd += ["--fixed"]
    if arm == "ab":
        cmd += ["--ab-table", table]
    if args.estimator == "pinned":
        cmd += ["--pin-estimator"]
    if args.acceptance_rates:
        cmd += ["--acceptance-rates", args.acceptance_rates]
    if args.dry_run:
        cmd += ["--dry-run", "--table", table or SHIPPED_TABLE]
    if args.cpus:
        import shutil

        if shutil.which("taskset") is None:
            print(f"arm {label}: --cpus {args.cpus}: taskset is not on this host", file=sys.stderr)
            return 2
        cmd = ["taskset", "-c", args.cpus] + cmd
    print(f"arm {arm}: table {table or '-'}; observe {obs}; deadline in {deadline - time.time():.0f} s; plan "
          + ", ".join(f"{w.name} c{w.concurrency} n{w.num_requests} ~{estimate_seconds(w):.0f}s" for w in plan),
          flush=True)
    killed = False
    sampler = GpuSampler(GPU_SAMPLE_S)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sampler.start()
        try:
            rc = proc.wait(timeout=max(1.0, child_deadline - time.time()))
        except subprocess.TimeoutExpired:
            killed = True
            _kill_group(proc)
            rc = proc.wait()
        finally:
            sampler.stop()
    t_child = time.time()
    events = _read_jsonl(results_path)
    log_text = _tail(log_path, LOG_CAP)
    summary = post_process(arm, events, obs, table, out_dir, log_text=_grep(log_path, LOG_PATTERN), rc=rc,
                           killed=killed, dry_run=args.dry_run, label=label, observe_every=args.observe_every,
                           env=env)
    summary["seed"] = seed_info
    summary["gpu"] = gpu_by_workload(sampler.samples, events, sampler.source, sampler.note)
    summary["host"] = _host()
    summary["cpus"] = args.cpus
    try:
        from dspark_calib import __version__ as tool_version
    except ImportError:
        tool_version = None
    summary["dspark_calib_version"] = tool_version
    summary["timing"] = {"engine_child_s": round(t_child - t_start, 1), "post_s": round(time.time() - t_child, 1),
                         "deadline_left_s": round(deadline - time.time(), 1)}
    _write_json(os.path.join(out_dir, f"context-{label}.json"), summary)
    with open(os.path.join(out_dir, f"context-{label}.log"), "w") as fh:
        fh.write(log_text)
    print_arm(summary)
    return 0 if summary["workloads"] else 1


def arm_seed(seed_file: str | None, seed_from: str | None, out_dir: str) -> tuple[str, dict[str, Any]]:
    """(the seed a seeded arm serves with, what it holds): --seed-file, else one made once from the observe
    file the arm named by seed_from left in this run's folder (context-SEED_FROM-observed.parquet ->
    SEED_FROM-estimator-seed.json), as `dspark-calib seed` makes it. Raises CalibError when it cannot."""
    from dspark_calib.seed import read_seed, seed_from_observed, write_seed

    if seed_file is None and seed_from is None:
        raise ValueError("this arm names no arm to make its seed from (seed_from): give --seed-file")
    if seed_file is None:
        seed_file = os.path.join(out_dir, f"{seed_from}-estimator-seed.json")
        if not os.path.exists(seed_file):
            write_seed(seed_from_observed([os.path.join(out_dir, f"context-{seed_from}-observed.parquet")]), seed_file)
    seed = read_seed(seed_file)
    return os.path.abspath(seed_file), {"file": os.path.abspath(seed_file), "slope": seed.slope,
                                        "intercepts": list(seed.intercepts), "refits": seed.refits,
                                        "steps": seed.steps, "source": seed.source}


class GpuSampler:
    """The GPU's clocks, power and throttle reasons every period seconds, from this (parent)
    process while the engine child serves: NVML reads ~1 ms on the host and none on the GPU, so
    it does not touch the timed steps. Why: serving steps can run slower than the profile says
    even at a profiled context; sustained-load clocks against the profile's short blocks are
    one cause, and these readings (beside the table's own block telemetry) show it."""

    def __init__(self, period: float):
        import threading

        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.source, self.note = "none", ""

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:  # the engine's GPU: this process has no CUDA, so the first visible device's index
            from dspark_calib.vllm.gpu_readings import GpuReader, first_visible_index

            index, where = first_visible_index()
            reader = GpuReader(index)
        except Exception as exc:  # noqa: BLE001 - no readings is a result, not a failed arm
            self.note = "; ".join(x for x in (where, f"{type(exc).__name__}: {exc}"[:200]) if x)
            return
        self.source, self.note = reader.source, "; ".join(x for x in (where, reader.note) if x)
        while not self._stop.wait(self.period):
            if len(self.samples) >= GPU_MAX_SAMPLES:
                self.note = "; ".join(x for x in (self.note, f"stopped at {GPU_MAX_SAMPLES} readings") if x)
                return
            try:
                r = reader.read()
            except Exception as exc:  # noqa: BLE001 - a reading lost ends the series, never the arm
                self.note = "; ".join(x for x in (self.note, f"reading failed: {type(exc).__name__}") if x)
                return
            self.samples.append({"t": round(time.time(), 3), "sm_mhz": r.sm_mhz, "power_w": r.power_w,
                                 "temp_c": r.temp_c, "throttle": list(r.throttle)})

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


def gpu_by_workload(samples: list[dict[str, Any]], events: list[dict[str, Any]], source: str,
                    note: str) -> dict[str, Any]:
    """Per workload (between its "start" and "workload" events): median and min SM clock, median
    and max power, the share of readings with any throttle reason and which reasons."""
    out: dict[str, Any] = {"source": source, "note": note, "samples": len(samples), "period_s": GPU_SAMPLE_S,
                           "by_workload": {}}
    starts = {e["workload"]: e["t"] for e in events if e.get("event") == "start" and "t" in e}
    for e in events:
        if e.get("event") != "workload" or "t" not in e:
            continue
        name = e["workload"]["name"]
        t0, t1 = starts.get(name), e["t"]
        win = [s for s in samples if t0 is not None and t0 <= s["t"] <= t1]
        sm = [s["sm_mhz"] for s in win if s["sm_mhz"] is not None]
        pw = [s["power_w"] for s in win if s["power_w"] is not None]
        reasons = sorted({r for s in win for r in s["throttle"]})
        out["by_workload"][name] = {
            "readings": len(win), "sm_mhz_p50": percentile(sm, 50), "sm_mhz_min": min(sm) if sm else None,
            "power_w_p50": percentile(pw, 50), "power_w_max": max(pw) if pw else None,
            "throttled_share": _r(sum(1 for s in win if s["throttle"]) / len(win), 3) if win else None,
            "reasons": reasons}
    return out


def _kill_group(proc: subprocess.Popen, graceful_s: float = 35.0) -> None:
    """SIGTERM to the engine child alone (it cancels its work and shuts the engine down, so the
    engine core exits cleanly and observe can write its last file), then SIGTERM and SIGKILL to
    its whole process group (it was started in a session of its own: only our processes)."""
    steps = ((lambda: os.kill(proc.pid, signal.SIGTERM), graceful_s),
             (lambda: os.killpg(proc.pid, signal.SIGTERM), 5.0),
             (lambda: os.killpg(proc.pid, signal.SIGKILL), 5.0))
    for send, wait in steps:
        try:
            send()
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the child may be gone with its engine core still up
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    out = []
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by a kill
    return out


LOG_PATTERN = re.compile(r"dspark[-_]calib|Error|Traceback|Using V2 Model Runner|GPU KV cache size|SpecDecoding")


def _grep(path: str, pattern: re.Pattern, limit: int = 2000) -> str:
    """The lines of the whole log that match (the start-up lines may be far from its tail)."""
    out: list[str] = []
    if os.path.exists(path):
        with open(path, "rb") as fh:
            for raw in fh:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if pattern.search(line):
                    out.append(line[-1000:])
    return "\n".join(out[:limit // 2] + out[-(limit // 2):] if len(out) > limit else out)


def _host() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _tail(path: str, cap: int) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - cap))
        return fh.read().decode("utf-8", "replace")


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, default=str)
    os.replace(tmp, path)


DSPARK_LINE = re.compile(r"dspark[-_]calib")


def post_process(arm: str, events: list[dict[str, Any]], obs: str, table: str | None, out_dir: str, *,
                 log_text: str = "", rc: int | None = 0, killed: bool = False, dry_run: bool = False,
                 label: str | None = None, observe_every: int = 4, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The arm's summary from the child's events and the observe files; writes the compacted
    observe file and the per-request file under out_dir (named by label: arm_label). env: the
    engine child's environment as run (recorded: its DSPARK_* and VLLM_* settings; never rebuilt
    here, which lost the arm's tail and chunks once)."""
    label = label or arm
    engine = next((e for e in events if e.get("event") == "engine"), {})
    done = [e for e in events if e.get("event") == "workload"]
    summary: dict[str, Any] = {
        "arm": label, "pricing": arm, "observe_every": observe_every, "dry_run": dry_run, "child_rc": rc,
        "child_killed": killed,
        "env": {k: v for k, v in (env or {}).items() if k.startswith(("DSPARK", "VLLM"))},
        "table": _table_info(table) if table else None,
        "engine": {k: engine.get(k) for k in ("import_s", "start_s", "kv_tokens", "kv_blocks", "block_size",
                                              "speculative_config")},
        "plan": engine.get("plan"),
        "skipped": [e for e in events if e.get("event") == "skipped"],
        "dspark_log": [ln[-600:] for ln in log_text.splitlines() if DSPARK_LINE.search(ln)][-40:],
        "errors": [ln[-600:] for ln in log_text.splitlines() if "Error" in ln or "Traceback" in ln][-20:],
        "vllm_log": [ln[-400:] for ln in log_text.splitlines()
                     if "Using V2 Model Runner" in ln or "GPU KV cache size" in ln][:4],
        "spec_log": [ln[-600:] for ln in log_text.splitlines() if "SpecDecoding metrics" in ln][-30:],
        "workloads": {},
        # the draft-model speculator's cold phase (unfitted estimator) and what the estimator learned
        "cold": next((e for e in events if e.get("event") == "cold"), None),
        "estimator": [{"after": e.get("after"), **(e.get("state") or {})} for e in events
                      if e.get("event") == "estimator"],
        # the step timer (every arm): whether rank 0 installed it, and the steps between workloads
        # (markers, the cold phase); each workload's own steps are under its name
        "step_timer": {"started": next((e.get("started") for e in events
                                        if e.get("event") == "step_timer" and "started" in e), None),
                       "before": {e["before"]: e.get("summary") for e in events
                                  if e.get("event") == "step_timer" and "before" in e}},
    }
    reqs, steps = {}, {}
    for e in done:
        name = e["workload"]["name"]
        summary["workloads"][name] = {"workload": e["workload"], "estimate_s": e.get("estimate_s"), **e["summary"],
                                      "step_timer": e.get("step_timer")}
        steps[name] = e.get("step_times")
        reqs[name] = [{k: r.get(k) for k in ("i", "prompt_len", "n", "chunks", "ttft", "ttft_engine", "preemptions",
                                             "mean_acceptance_length", "spec_steps", "accepted_drafts", "drafts")}
                      | {"tpot_ms": _ms(request_tpot_s(r)[0])} for r in e["requests"]]
    _write_json(os.path.join(out_dir, f"context-{label}-requests.json"), reqs)
    _write_json(os.path.join(out_dir, f"context-{label}-steps.json"), steps)
    if observe_every <= 0:
        summary["observed"] = {"rows": 0, "off": True}
        return summary
    # observe
    try:
        import numpy as np  # noqa: F401

        from dspark_calib.observe.file import read_observed

        dst = os.path.join(out_dir, f"context-{label}-observed.parquet")
        summary["observed"] = compact_observed(obs, dst)
        cols = sorted_columns(dict(read_observed([dst]).columns))
    except Exception as exc:  # noqa: BLE001 - no observe files is a result to report, not a crash
        summary["observed"] = {"rows": 0, "error": f"{type(exc).__name__}: {exc}"[:500]}
        return summary
    summary["budgets"] = budget_distribution(cols)
    summary["own_error"] = own_prediction_errors(cols)
    segments, why = segment_steps(cols, len(done))
    summary["observed"]["segmented"] = why
    if segments is not None:
        for e, rows in zip(done, segments):
            w = summary["workloads"][e["workload"]["name"]]
            w["observed_steps"] = int(len(rows))
            w["budgets"] = budget_distribution(cols, rows)
            w["own_error"] = own_prediction_errors(cols, rows)
    if table:
        summary["validate"] = run_validate(table, dst)
        if summary["validate"].get("doc"):
            summary["validate_by_context"] = validate_by_context(summary["validate"]["doc"])
    return summary


def _table_info(path: str) -> dict[str, Any]:
    try:
        from dspark_calib.table.file import read_table

        t = read_table(path, samples=False)
        return {"path": path, "hash": t.content_hash[:12], "contexts": sorted(int(c) for c in t.curves),
                "source": "shipped" if os.path.samefile(path, SHIPPED_TABLE) else "profiled"}
    except Exception as exc:  # noqa: BLE001
        return {"path": path, "error": f"{type(exc).__name__}: {exc}"[:300]}


def run_validate(table: str, observed: str) -> dict[str, Any]:
    """`dspark-calib validate TABLE OBSERVED --json`, as a user runs it."""
    cmd = [sys.executable, "-m", "dspark_calib", "validate", table, observed, "--json"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"rc": None, "error": "validate timed out (120 s)"}
    out: dict[str, Any] = {"rc": p.returncode, "command": " ".join(["dspark-calib", *cmd[3:]])}
    try:
        out["doc"] = json.loads(p.stdout)
    except ValueError:
        out["error"] = (p.stderr or p.stdout)[-1500:]
    return out


def print_arm(s: dict[str, Any]) -> None:
    print(f"\narm {s['arm']}: engine start {s['engine'].get('start_s')} s, KV {s['engine'].get('kv_tokens')} tokens, "
          f"observed {s.get('observed', {}).get('rows')} steps ({s.get('observed', {}).get('segmented', '-')})")
    if not s.get("observed", {}).get("rows") and not s.get("observed", {}).get("off"):  # evidence missing: say it
        print(f"    OBSERVE WROTE NO ROWS: {s.get('observed', {}).get('error', 'no error recorded')}")
    for ln in s["dspark_log"][-6:]:
        print("   ", ln[-300:])
    if s.get("skipped"):
        print("   skipped:", ", ".join(e["workload"] for e in s["skipped"]))
    print(f"{'workload':8} {'conc':>4} {'reqs':>4} {'tok/s':>8} {'tpot50':>7} {'tpot90':>7} {'tok/step':>8} "
          f"{'budget/req':>10} {'verify err% (own, median)':>26}")
    for name, w in s["workloads"].items():
        err = [e for e in w.get("own_error", []) if e["kind"] == "verify" and e["context_bucket"] != "all"]
        errs = " ".join(f"{e['context_bucket']}:{e['median_pct']}" for e in err) or "-"
        print(f"{name:8} {w['workload']['concurrency']:4} {w['requests']:4} {w['output_tok_s'] or 0:8.0f} "
              f"{w['tpot_p50_ms'] or 0:7.2f} {w['tpot_p90_ms'] or 0:7.2f} {w['tokens_per_step_mean'] or 0:8.2f} "
              f"{(w.get('budgets') or {}).get('per_request_mean', '-')!s:>10} {errs}")
    for row in s.get("validate_by_context", []):
        print(f"   validate {row['kind']:6} ctx {row['context_bucket']:12} single {row['single_context_median_pct']}% "
              f"aware {row['context_aware_median_pct']}% (n {row['context_aware_n']})")


# -- report (anywhere) ------------------------------------------------------------------------
def build_report(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One row per arm x workload, plus validate's per-context errors per arm, plus throughput of
    each arm relative to its speculator's stock arm per workload."""
    rows, errors = [], []
    for arm in [a for a in ARMS if a in arms] + sorted(set(arms) - set(ARMS)):
        s = arms[arm]
        for name, w in s.get("workloads", {}).items():
            b = w.get("budgets") or {}
            rows.append({"arm": arm, "workload": name, "concurrency": w["workload"]["concurrency"],
                         "requests": w["requests"], "output_tok_s": w["output_tok_s"],
                         "tpot_p50_ms": w["tpot_p50_ms"], "tpot_p90_ms": w["tpot_p90_ms"],
                         "tokens_per_step": w.get("tokens_per_step_mean"),
                         "acceptance_length": w.get("acceptance_length_mean"),
                         "budget_per_request": b.get("per_request_mean"), "share_full": b.get("share_full"),
                         "share_zero": b.get("share_zero"), "pricings_disagree": b.get("pricings_disagree_share"),
                         "own_verify_error_pct": {e["context_bucket"]: e["median_pct"] for e in w.get("own_error", [])
                                                  if e["kind"] == "verify"},
                         "gpu": ((s.get("gpu") or {}).get("by_workload") or {}).get(name),
                         "step_timer": w.get("step_timer")})
        for e in s.get("own_error", []):
            errors.append({"arm": arm, "source": "engine", **e})
        for v in s.get("validate_by_context", []):
            errors.append({"arm": arm, "source": "validate", **v})
    stock = {(r["arm"], r["workload"]): r["output_tok_s"] for r in rows}
    for r in rows:  # each speculator's arms against its own stock arm
        base = stock.get((speculator_prefix(r["arm"]) + "stock", r["workload"]))
        r["vs_stock"] = _r(r["output_tok_s"] / base, 4) if base and r["output_tok_s"] else None
    return {"arms": sorted(arms), "rows": rows, "errors": errors, "observe_cost": observe_cost(rows),
            "cold": cold_phases(arms), "ab": ab_comparison(rows),
            "tables": {a: arms[a].get("table") for a in arms}, "dry_run": any(arms[a].get("dry_run") for a in arms)}


def _mean(xs: list[Any]) -> float | None:
    """The mean, or None when a value is missing (a turn that did not run)."""
    return sum(xs) / len(xs) if None not in xs else None


def ab_comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ab arms' workloads, one entry per arm and workload: tok/s, TPOT p50, drafts verified a
    request and the drafter's GPU ms of each of the four turns (AB_ORDER); the table's tok/s and
    TPOT over vLLM's (each the mean of its two turns) and the noise, the larger spread between a
    pricing's two turns.

    The same ratio and noise with the drafter held: each turn's tok/s scaled by its mean step over
    that step with the turn's drafter mean replaced by the four turns' (drafter_share). A host-bound
    drafter (the draft-model speculator's eager draft steps) changes its pace from one stretch of
    steps to the next whatever the pricing, and moves a turn's tok/s by more than a pricing does;
    held, the turns differ by what the pricing controls (the tokens a step, and the rest of the
    step). It assumes the drafter's time does not follow the pricing: the turns' drafter means
    stand beside it."""
    turns: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        base, at, turn = r["workload"].partition("@")
        if at:
            turns.setdefault((r["arm"], base), {})[turn] = r
    out = []
    for (arm, base), got in turns.items():
        each = {}
        for p, n in AB_ORDER:
            r = got.get(f"{p}{n}") or {}
            timer = r.get("step_timer") or {}
            each[f"{p}{n}"] = {"output_tok_s": r.get("output_tok_s"), "tpot_p50_ms": r.get("tpot_p50_ms"),
                               "verified_drafts_per_request": timer.get("verified_drafts_per_request"),
                               "drafter_p50_ms": timer.get("drafter_p50_ms"),
                               "drafter_mean_ms": timer.get("drafter_mean_ms"), "rest_mean_ms": timer.get("rest_mean_ms"),
                               "step_mean_ms": timer.get("step_mean_ms")}
        pool = _mean([t["drafter_mean_ms"] for t in each.values()])
        for t in each.values():
            t["output_tok_s_drafter_held"] = (
                _r(t["output_tok_s"] * t["step_mean_ms"] / (t["rest_mean_ms"] + pool))
                if pool is not None and None not in (t["output_tok_s"], t["step_mean_ms"], t["rest_mean_ms"]) else None)
        held = {p: [each[f"{p}{n}"]["output_tok_s_drafter_held"] for n in (1, 2)] for p in ("stock", "table")}
        tok = {p: [each[f"{p}{n}"]["output_tok_s"] for n in (1, 2)] for p in ("stock", "table")}
        tpot = {p: [each[f"{p}{n}"]["tpot_p50_ms"] for n in (1, 2)] for p in ("stock", "table")}
        ps, pt = _mean(tpot["stock"]), _mean(tpot["table"])
        out.append({"arm": arm, "workload": base, "turns": each, **ratio_and_noise(tok, "table_vs_stock_tok_s", "noise"),
                    "stock_vs_table_tpot_p50": _r(ps / pt, 4) if ps and pt else None,
                    "drafter_pool_ms": _r(pool), **ratio_and_noise(held, "table_vs_stock_drafter_held", "noise_drafter_held")})
    return out


def ratio_and_noise(tok: dict[str, list[Any]], ratio: str, noise: str) -> dict[str, float | None]:
    """The table's mean over vLLM's mean of its two turns, and the larger spread between a pricing's two turns."""
    spreads = [abs(xs[1] / xs[0] - 1) for xs in (tok["stock"], tok["table"]) if None not in xs and xs[0]]
    ms, mt = _mean(tok["stock"]), _mean(tok["table"])
    return {ratio: _r(mt / ms, 4) if ms and mt else None, noise: _r(max(spreads), 4) if len(spreads) == 2 else None}


def cold_phases(arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm with an estimator cold phase (the first requests after the engine start, timed apart):
    its throughput and TPOT, whether the estimator started from a seed, and what it had learned after."""
    out = []
    for arm in sorted(arms):
        cold = (arms[arm].get("cold") or {}).get("summary")
        if not cold:
            continue
        after = next((e for e in arms[arm].get("estimator", []) if e.get("after") == "cold"), {})
        seed = arms[arm].get("seed") or {}
        out.append({"arm": arm, "seeded": bool(seed), "seed_refits": seed.get("refits"),
                    "output_tok_s": cold.get("output_tok_s"), "tpot_p50_ms": cold.get("tpot_p50_ms"),
                    "acceptance_length": cold.get("acceptance_length_mean"),
                    "refits_after": after.get("refits"), "survival_after": after.get("survival")})
    return out


def observe_cost(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Observe mode's own cost: per workload, each observing arm against the same
    pricing with observe off (ARM-noobs), as ratios (> 1: observing is slower); a -rerun arm of the
    same pricing gives the run-to-run spread to read them against."""
    by = {(r["arm"], r["workload"]): r for r in rows}
    out = []
    for (off_arm, workload), off in by.items():
        if not off_arm.endswith("-noobs"):
            continue
        base = off_arm[: -len("-noobs")]
        for on_arm in (base, base + "-rerun"):
            on = by.get((on_arm, workload))
            if on is None:
                continue
            ratio = {k: _r(on[k] / off[k], 4) if on[k] and off[k] else None
                     for k in ("tpot_p50_ms", "tpot_p90_ms", "output_tok_s")}
            out.append({"workload": workload, "observed": on_arm, "baseline": off_arm,
                        "tpot_p50_ratio": ratio["tpot_p50_ms"], "tpot_p90_ratio": ratio["tpot_p90_ms"],
                        "output_tok_s_ratio": ratio["output_tok_s"]})
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = ["| arm | workload | conc | tok/s | vs stock | TPOT p50 ms | TPOT p90 ms | tok/step | budget/req | "
             "full | zero | verify err % by context (engine's own, median) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        errs = ", ".join(f"{k}: {v}" for k, v in r["own_verify_error_pct"].items() if k != "all")
        lines.append(f"| {r['arm']} | {r['workload']} | {r['concurrency']} | {_f(r['output_tok_s'], 0)} | "
                     f"{_f(r['vs_stock'], 3)} | {_f(r['tpot_p50_ms'], 2)} | {_f(r['tpot_p90_ms'], 2)} | "
                     f"{_f(r['tokens_per_step'], 2)} | {_f(r['budget_per_request'], 2)} | {_f(r['share_full'], 2)} | "
                     f"{_f(r['share_zero'], 2)} | {errs or '-'} |")
    gpu = [r for r in report["rows"] if r.get("gpu")]
    if gpu:
        lines += ["", "The GPU while each workload served (the harness's NVML readings every "
                      f"{GPU_SAMPLE_S} s; the table's own profile blocks, for comparison, are in its telemetry: "
                      "`dspark-calib inspect TABLE`):", "",
                  "| arm | workload | readings | SM MHz p50 / min | power W p50 / max | throttled share | reasons |",
                  "|---|---|---:|---|---|---:|---|"]
        for r in gpu:
            g = r["gpu"]
            lines.append(f"| {r['arm']} | {r['workload']} | {g['readings']} | {_f(g['sm_mhz_p50'], 0)} / "
                         f"{_f(g['sm_mhz_min'], 0)} | {_f(g['power_w_p50'], 0)} / {_f(g['power_w_max'], 0)} | "
                         f"{_f(g['throttled_share'], 2)} | {', '.join(g['reasons']) or '-'} |")
    timed = [r for r in report["rows"] if isinstance(r.get("step_timer"), dict) and "steps" in r["step_timer"]]
    if timed:
        stall = f"{timed[0]['step_timer']['stall_ms'] / 1e3:g} s"
        lines += ["", "The harness's step timer (every arm alike: each serving execute_model call on TP rank 0, "
                      "host perf_counter, no sync; interval: one call's start to the next's, the whole step as the "
                      f"host lived it; host: inside the call; stalls: intervals over {stall}; target and drafter: "
                      "CUDA events from execute_model's start to the drafter's and around the drafter, resolved "
                      "between workloads):", "",
                  f"| arm | workload | steps | interval p50 / p90 / max ms | stalls > {stall} | largest stall ms | "
                  "host ms p50 | target GPU ms p50 / p90 | drafter GPU ms p50 / p90 |",
                  "|---|---|---:|---|---:|---:|---:|---|---|"]
        for r in timed:
            t = r["step_timer"]
            largest = max((x["ms"] for x in t["stalls"]), default=None)
            lines.append(f"| {r['arm']} | {r['workload']} | {t['steps']} | {_f(t['interval_p50_ms'], 2)} / "
                         f"{_f(t['interval_p90_ms'], 2)} / {_f(t['interval_max_ms'], 1)} | {len(t['stalls'])} | "
                         f"{_f(largest, 1)} | {_f(t['host_p50_ms'], 3)} | {_f(t.get('target_p50_ms'), 2)} / "
                         f"{_f(t.get('target_p90_ms'), 2)} | {_f(t.get('drafter_p50_ms'), 2)} / "
                         f"{_f(t.get('drafter_p90_ms'), 2)} |")
    if report.get("ab"):
        lines += ab_table(
            report["ab"], "The in-engine A/B (one engine started stock serves each workload under vLLM's pricing and "
            "the table's in turn, stock, table, table, stock; per turn tok/s, TPOT p50 ms, drafts verified a request on "
            "the all-decode steps, the drafter's GPU ms p50; the ratio of the means, and the noise: the larger spread "
            "between a pricing's two turns):", ("table / stock tok/s", "stock / table TPOT", "noise"),
            lambda t: f"{_f(t['output_tok_s'], 0)} tok/s, {_f(t['tpot_p50_ms'], 2)} ms, "
                      f"{_f(t['verified_drafts_per_request'], 2)} drafts, drafter {_f(t['drafter_p50_ms'], 1)} ms",
            lambda a: (_f(a["table_vs_stock_tok_s"], 3), _f(a["stock_vs_table_tpot_p50"], 3), _f(a["noise"], 3)))
        lines += ab_table(
            report["ab"], "The same with the drafter held (each turn's tok/s scaled by its mean step over that step "
            "with the turn's drafter mean replaced by the pooled mean of the four turns: the host-bound drafter changes "
            "pace whatever the pricing; this assumes its time does not follow the pricing; per turn the drafter's mean "
            "ms, the rest of the mean step, and the held tok/s):",
            ("pooled drafter ms", "table / stock tok/s, held", "noise, held"),
            lambda t: f"drafter {_f(t['drafter_mean_ms'], 1)} + rest {_f(t['rest_mean_ms'], 2)} ms, "
                      f"{_f(t['output_tok_s_drafter_held'], 0)} tok/s",
            lambda a: (_f(a["drafter_pool_ms"], 1), _f(a["table_vs_stock_drafter_held"], 3),
                       _f(a["noise_drafter_held"], 3)))
    if report.get("observe_cost"):
        lines += ["", "Observe mode's own cost: each observing arm over the same pricing with observe off, per "
                      "workload (> 1: slower with observe on; TPOT is the steady decode, tok/s includes the "
                      "prefill waves and the tail):", "",
                  "| workload | observed arm | vs | TPOT p50 | TPOT p90 | tok/s |", "|---|---|---|---:|---:|---:|"]
        for c in report["observe_cost"]:
            lines.append(f"| {c['workload']} | {c['observed']} | {c['baseline']} | {_f(c['tpot_p50_ratio'], 3)} | "
                         f"{_f(c['tpot_p90_ratio'], 3)} | {_f(c['output_tok_s_ratio'], 3)} |")
    if report.get("cold"):
        lines += ["", "The acceptance estimator's cold phase (the first requests after the engine start, timed apart; "
                      "seeded: DSPARK_CALIB_ESTIMATOR_SEED from the seed's refits):", "",
                  "| arm | seeded | tok/s | TPOT p50 ms | acceptance length | refits after | survival after |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for c in report["cold"]:
            survival = ", ".join(f"{x:.2f}" for x in c["survival_after"]) if c["survival_after"] else "-"
            lines.append(f"| {c['arm']} | {'yes (' + str(c['seed_refits']) + ' refits)' if c['seeded'] else 'no'} | "
                         f"{_f(c['output_tok_s'], 0)} | {_f(c['tpot_p50_ms'], 2)} | {_f(c['acceptance_length'], 2)} | "
                         f"{c['refits_after'] if c['refits_after'] is not None else '-'} | {survival} |")
    val = [e for e in report["errors"] if e["source"] == "validate"]
    if val:
        lines += ["", "`dspark-calib validate` on each arm's observed steps, as run on the host (the arm's own "
                      "checkout; median / p90 absolute % error):", "",
                  "| arm | kind | context | single-context | context-aware | steps |", "|---|---|---|---|---|---:|"]
        for e in val:
            lines.append(f"| {e['arm']} | {e['kind']} | {e['context_bucket']} | {_f(e['single_context_median_pct'], 2)}"
                         f" / {_f(e['single_context_p90_pct'], 2)} | {_f(e['context_aware_median_pct'], 2)} / "
                         f"{_f(e['context_aware_p90_pct'], 2)} | {e['context_aware_n']} |")
    rv = report.get("revalidated_with") or {}
    if any(rv.get("arms", {}).values()):
        lines += ["", f"Re-validated offline by this checkout (git {rv.get('git') or '?'}) on the same observe files, "
                      "per workload (median / p90 absolute % error, signed median):", "",
                  "| arm | workload | kind | steps | single-context | context-aware |", "|---|---|---|---:|---|---|"]
        for arm, rows in rv["arms"].items():
            for e in rows or []:
                lines.append(f"| {arm} | {e['workload']} | {e['kind']} | {e['steps']} | "
                             f"{_f(e['single_context_median_pct'], 2)} / {_f(e['single_context_p90_pct'], 2)} "
                             f"({_f(e['single_context_median_signed_pct'], 1)}) | "
                             f"{_f(e['context_aware_median_pct'], 2)} / {_f(e['context_aware_p90_pct'], 2)} "
                             f"({_f(e['context_aware_median_signed_pct'], 1)}) |")
    if report.get("advice"):
        lines += advice_markdown(report["advice"])
    if report.get("dry_run"):
        lines += ["", "DRY RUN: fake engine, not measurements."]
    return "\n".join(lines) + "\n"


# -- advise's prediction beside the arms (report) ---------------------------------------------------
PREDICTED_AS = {"fixed": "fixed", "stock": "one context", "static": "one context", "aware": "context-aware"}
WITHIN = 0.05  # the prediction holds when its ratio to stock is within 5 % of the measured one


def speculator_prefix(label: str) -> str:
    """'draft-' for an arm of the draft speculator (arm_label's prefix), '' for DSpark's."""
    return next((f"{s}-" for s in CONFIG["speculators"] if s != "dspark" and label.startswith(f"{s}-")), "")


def pinned(label: str) -> bool:
    """An arm whose acceptance estimator is pinned to the enforced rates (arm_label's -pinned)."""
    return bool(re.search(r"-pinned(-|$)", label))


def same_family(arms: dict[str, dict[str, Any]], a: str, stock: str) -> bool:
    """a is compared with stock: the same speculator, and the same estimator (learning or pinned) unless a
    verifies every draft (fixed K: no estimator decides anything)."""
    return speculator_prefix(a) == speculator_prefix(stock) and \
        (arms[a].get("pricing") == "fixed" or pinned(a) == pinned(stock))


def predicted_arms(arms: dict[str, dict[str, Any]], stock: str) -> list[str]:
    """The arms of stock's family advise models (stock first): stock, static, aware and fixed, once each
    (not a rerun, a seeded arm or one with observe off: those are the same engine as one listed)."""
    prefix = speculator_prefix(stock)
    same = [a for a in arms if same_family(arms, a, stock) and arms[a].get("pricing") in PREDICTED_AS
            and not re.search(r"-(rerun|seed|noobs)(-|$)", a[len(prefix):])]
    return [stock] + sorted(a for a in same if a != stock)


def enforced_schedule(spec: dict[str, Any]) -> list[float] | None:
    """The acceptance schedule a synthetic-acceptance engine enforced: its synthetic_acceptance_rates, or its
    synthetic_acceptance_length as vLLM resolves it (the minimum-variance schedule: whole drafts accepted
    with probability 1, the fraction at the next position); None for real acceptance."""
    if spec.get("rejection_sample_method") != "synthetic":
        return None
    if spec.get("synthetic_acceptance_rates") is not None:
        return [float(r) for r in spec["synthetic_acceptance_rates"]]
    k, drafts = int(spec["num_speculative_tokens"]), float(spec["synthetic_acceptance_length"]) - 1
    full = int(drafts)
    return ([1.0] * full + [drafts - full] + [0.0] * (k - full - 1))[:k]


def decode_rows(cols: dict[str, Any], rows: Any) -> Any:
    """These rows split into (the steps advise models: decode steps with drafts; the others: steps carrying
    a prefill chunk, or no drafts)."""
    from dspark_calib.advise import modelled_steps

    keep = modelled_steps({k: v[rows] for k, v in cols.items()})
    return rows[keep], rows[~keep]


def target_vocab_size() -> int | None:
    """The served target's vocabulary (adaptive verification's one-chunk logit limit), from its config."""
    try:
        with open(os.path.join(TARGET, "config.json")) as fh:
            return int(json.load(fh)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def advise_workloads(table_path: str, observed: str, workloads: list[str], spec: dict[str, Any], *,
                     one_context: int, acceptance_files: list[str]) -> dict[str, Any]:
    """advise.predict_steps over each workload's decode steps in the stock arm's observe file (rows between
    the marker batches), at the schedule the run enforced and at the acceptance observe mode measured
    (acceptance_files: every arm's observe file of the run; the fixed arm grades every position), with
    the stock arm's measured decode and other-step (prefill chunks) time beside it."""
    from dspark_calib.advise import Acceptance, observed_acceptance, predict_steps
    from dspark_calib.errors import CalibError
    from dspark_calib.observe.file import read_observed
    from dspark_calib.table.file import read_table

    table = read_table(table_path, samples=False)
    acceptances, notes = {}, []
    schedule = enforced_schedule(spec)
    if schedule is not None:
        acceptances["schedule"] = Acceptance(tuple(schedule), "given")
    try:
        acceptances["observed"] = observed_acceptance(table, read_observed(acceptance_files))
    except CalibError as exc:
        notes.append(f"no observed acceptance: {exc}")
    cols = sorted_columns(dict(read_observed([observed]).columns))
    segments, why = segment_steps(cols, len(workloads))
    out: dict[str, Any] = {"table_hash": table.content_hash[:12], "one_context": one_context,
                           "vocab_size": target_vocab_size(), "segmented": why, "notes": notes,
                           "acceptance": {k: a.to_dict() for k, a in acceptances.items()}, "workloads": {}}
    ms = cols["forward_ms"] + cols["drafter_ms"]
    for name, rows in zip(workloads, segments or []):
        decode, other = decode_rows(cols, rows)
        w: dict[str, Any] = {"decode_steps": int(len(decode)), "other_steps": int(len(other)),
                             "decode_ms": float(ms[decode].sum()), "other_ms": float(ms[other].sum()), "mix": {}}
        for source, acc in acceptances.items() if len(decode) else ():
            try:
                mix = predict_steps(table, acc, cols["num_reqs"][decode], cols["context_mean"][decode],
                                    one_context=one_context, vocab_size=out["vocab_size"])
            except CalibError as exc:
                notes.append(f"{name}, {source} acceptance: {exc}")
                continue
            w["mix"][source] = mix.to_dict()
        out["workloads"][name] = w
    return out


def option_of(summary: dict[str, Any], one_context: int) -> str:
    """advise's option that models an arm: K=k for fixed, adaptive@C for one-context pricing, adaptive."""
    kind = PREDICTED_AS[summary["pricing"]]
    if kind == "fixed":
        return f"K={(summary.get('engine') or {}).get('speculative_config', {}).get('num_speculative_tokens', K)}"
    return f"adaptive@{one_context}" if kind == "one context" else "adaptive"


def ranking(values: dict[str, float], tie: float = 0.0) -> list[list[str]]:
    """Names from the highest value down, grouped where a value is within `tie` (relative) of its group's
    first: [["a"], ["b", "c"]] reads a > b = c."""
    groups: list[list[str]] = []
    top = None
    for name in sorted(values, key=lambda n: -values[n]):
        if top is not None and values[name] * (1 + tie) >= top:
            groups[-1].append(name)
        else:
            groups.append([name])
            top = values[name]
    return groups


def rank_agrees(predicted: dict[str, float], measured: dict[str, float], tie: float,
                noise: float | None) -> bool | None:
    """Every pair the prediction orders (by more than `tie`) is measured in that order, and every pair it
    predicts within `tie` (advise's minimum gain: below it the model claims no order) is measured within
    the larger of `tie` and the noise (|rerun / stock - 1|), when the noise is known. None when there is
    nothing to check: fewer than two arms, or every pair predicted equal and no noise known."""
    pairs = [(a, b) for a in predicted for b in predicted if predicted[a] > predicted[b] * (1 + tie)]
    if len(predicted) < 2 or (not pairs and noise is None):
        return None
    apart = all(measured[a] > measured[b] for a, b in pairs)
    if noise is None:
        return apart
    spread = max(tie, noise)
    return apart and all(measured[a] <= measured[b] * (1 + spread) for a in predicted for b in predicted
                         if predicted[a] <= predicted[b] * (1 + tie))


def compare_advice(arms: dict[str, dict[str, Any]], stock: str, advice: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload and acceptance: each modelled arm's predicted goodput and ratio to stock (decode steps
    alone, and the workload: the stock arm's measured other-step time added to every arm) beside its
    measured output tok/s ratio to stock (and to the mean of stock and its rerun), whether each predicted
    ratio is within WITHIN of the measured one, and whether the predicted ranking of the arms is the
    measured one; the noise (rerun over stock) beside it."""
    from dspark_calib.advise import MIN_GAIN  # predicted ratios closer than advise's minimum gain are a tie

    names = predicted_arms(arms, stock)
    rerun = arms.get(f"{stock}-rerun")
    out = []
    for workload, w in advice.get("workloads", {}).items():
        served = {a: arms[a].get("workloads", {}).get(workload) or {} for a in names}
        measured = {a: served[a].get("output_tok_s") for a in names}
        tpot = {a: served[a].get("tpot_p50_ms") for a in names}
        base = measured[stock]
        again = ((rerun or {}).get("workloads", {}).get(workload) or {}).get("output_tok_s")
        base_mean = (base + again) / 2 if base and again else None
        noise = abs(again / base - 1) if base and again else None
        for source, mix in w["mix"].items():
            options = {o["name"]: o for o in mix["options"]}
            one = options[f"adaptive@{advice['one_context']}"]
            rows = []
            for a in names:
                o = options.get(option_of(arms[a], advice["one_context"]))
                if o is None:
                    continue
                decode = o["goodput_per_ms"] / one["goodput_per_ms"]
                # every arm pays the stock arm's other steps; its decode steps take stock's time / decode ratio
                total = w["decode_ms"] + w["other_ms"]
                whole = total / (w["other_ms"] + w["decode_ms"] / decode) if total else None
                m = measured[a]
                ratio = m / base if m and base else None
                per_token = tpot[stock] / tpot[a] if tpot[stock] and tpot[a] else None  # > 1: faster decode
                rows.append({"arm": a, "option": o["name"], "predicted_tok_s": _r(1000 * o["goodput_per_ms"], 1),
                             "predicted_drafts_per_request": _r(o["drafts"] / mix["requests"]),
                             "predicted_decode_ratio": _r(decode, 4), "predicted_ratio": _r(whole, 4),
                             "measured_tok_s": m, "measured_ratio": _r(ratio, 4),
                             "measured_ratio_stock_mean": _r(m / base_mean, 4) if m and base_mean else None,
                             "within": (abs(whole / ratio - 1) <= WITHIN) if whole and ratio else None,
                             "measured_tpot_ratio": _r(per_token, 4),
                             "within_tpot": (abs(decode / per_token - 1) <= WITHIN) if per_token else None})
            ranked = [r for r in rows if r["measured_ratio"] is not None and r["predicted_ratio"] is not None]
            predicted = {r["arm"]: r["predicted_ratio"] for r in ranked}
            seen = {r["arm"]: r["measured_ratio"] for r in ranked}
            out.append({"workload": workload, "acceptance": source, "stock": stock,
                        "decode_steps": w["decode_steps"], "other_steps": w["other_steps"],
                        "other_time_share": _r(w["other_ms"] / (w["decode_ms"] + w["other_ms"]), 4)
                        if w["decode_ms"] + w["other_ms"] else None,
                        "rates": mix["acceptance"]["rates"], "arms": rows, "rank_predicted": ranking(predicted, MIN_GAIN),
                        "rank_measured": ranking(seen), "rank_agrees": rank_agrees(predicted, seen, MIN_GAIN, noise),
                        "all_within": all(r["within"] for r in ranked) if ranked else None,
                        "noise": _r(again / base, 4) if base and again else None})
    return out


def advise_report(arms: dict[str, dict[str, Any]], folders: dict[str, str]) -> dict[str, Any] | None:
    """advise's prediction beside each speculator's measured arms (compare_advice), from the files each arm
    left in its run folder (folders: arm -> folder): the stock arm's observe file and summary, the table
    beside them; None without a stock arm that left them."""
    out: dict[str, Any] = {"groups": [], "rows": []}
    for stock in sorted(a for a in arms if a in (speculator_prefix(a) + "stock", speculator_prefix(a) + "stock-pinned")):
        s = arms[stock]
        observed = os.path.join(folders[stock], f"context-{stock}-observed.parquet")
        spec = (s.get("engine") or {}).get("speculative_config") or {}
        group = predicted_arms(arms, stock)
        files = [f for a in arms if same_family(arms, a, stock)
                 for f in [os.path.join(folders[a], f"context-{a}-observed.parquet")] if os.path.isfile(f)]
        one = int((s.get("env") or {}).get("VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN", 8192))
        try:  # one bad file costs this prediction, not the report
            table = local_table(s, folders[stock])
            if not (os.path.isfile(observed) and table):
                continue
            advice = advise_workloads(table, observed, list(s.get("workloads", {})), spec, one_context=one,
                                      acceptance_files=files)
        except Exception as exc:  # noqa: BLE001
            print(f"advise on {observed} skipped: {type(exc).__name__}: {exc}"[:300])
            continue
        out["groups"].append({"stock": stock, "arms": group, **{k: v for k, v in advice.items() if k != "workloads"},
                              "workloads": advice["workloads"]})
        out["rows"] += compare_advice(arms, stock, advice)
    return out if out["groups"] else None


def advice_markdown(advice: dict[str, Any]) -> list[str]:
    from dspark_calib.advise import MIN_GAIN

    lines = []
    for g in advice["groups"]:
        acc = "; ".join(f"{k} {', '.join(f'{r:.3f}' for r in a['rates'])}" for k, a in g["acceptance"].items())
        lines += ["", f"`dspark-calib advise`'s model beside the arms (advise.predict_steps, table {g['table_hash']}, "
                      f"vocabulary {g['vocab_size']}): over the decode steps {g['stock']} served in each workload "
                      f"(its observe file), each arm as an option: fixed as K, stock and static as adaptive@"
                      f"{g['one_context']} (deciding with the table's {g['one_context']} tables, as vLLM's "
                      "start-up profile at VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN), aware as adaptive "
                      f"(priced per step at its mean context; the context tail is not modelled). Acceptance: {acc}. "
                      "Ratios to stock: decode, the decode steps alone; workload, with the stock arm's measured time "
                      "of its other steps (prefill chunks) added to every arm; measured, output tok/s, and stock's "
                      "TPOT p50 over the arm's (the steady decode). Within: the workload ratio within "
                      f"{100 * WITHIN:g} % of the measured tok/s ratio / the decode ratio within {100 * WITHIN:g} % "
                      "of the TPOT ratio. Ranking (by the workload ratio): = where the predicted "
                      f"ratios differ by less than {100 * MIN_GAIN:g} % (advise's minimum gain); it agrees when every "
                      "pair predicted apart is measured in that order and every pair predicted equal is measured "
                      f"within the larger of {100 * MIN_GAIN:g} % and the noise (rerun against stock).", ""]
        lines += [f"- {n}" for n in g["notes"]]
        lines += ["| workload | acceptance | arm | modelled as | drafts/req | predicted tok/s (decode) | "
                  "predicted vs stock: decode / workload | measured vs stock | vs stock+rerun mean | "
                  "TPOT p50 stock / arm | within: workload / decode |",
                  "|---|---|---|---|---:|---:|---|---:|---:|---:|---|"]
        rows = [r for r in advice["rows"] if r["stock"] == g["stock"]]
        for r in rows:
            for a in r["arms"]:
                within = " / ".join("-" if x is None else "yes" if x else "no" for x in (a["within"], a["within_tpot"]))
                lines.append(f"| {r['workload']} | {r['acceptance']} | {a['arm']} | {a['option']} | "
                             f"{_f(a['predicted_drafts_per_request'], 2)} | {_f(a['predicted_tok_s'], 0)} | "
                             f"{_f(a['predicted_decode_ratio'], 3)} / {_f(a['predicted_ratio'], 3)} | "
                             f"{_f(a['measured_ratio'], 3)} | {_f(a['measured_ratio_stock_mean'], 3)} | "
                             f"{_f(a['measured_tpot_ratio'], 3)} | {within} |")
        lines.append("")
        for r in rows:
            agrees = "-" if r["rank_agrees"] is None else "yes" if r["rank_agrees"] else "no"
            share = None if r["other_time_share"] is None else 100 * r["other_time_share"]
            order = [" > ".join(" = ".join(g) for g in r[k]) or "-" for k in ("rank_predicted", "rank_measured")]
            lines.append(f"- {r['workload']}, {r['acceptance']} acceptance ({r['decode_steps']} decode steps; "
                         f"{r['other_steps']} others, {_f(share, 0)} % of the stock arm's time): ranking predicted "
                         f"{order[0]}, measured {order[1]}: agrees {agrees}; every workload ratio within "
                         f"{100 * WITHIN:g} %: {'-' if r['all_within'] is None else 'yes' if r['all_within'] else 'no'}; "
                         f"noise (rerun / stock) {_f(r['noise'], 3)}")
    return lines


def ab_table(ab: list[dict[str, Any]], title: str, heads: tuple[str, ...], cell: Callable[[dict[str, Any]], str],
             tail: Callable[[dict[str, Any]], tuple[str, ...]]) -> list[str]:
    """One markdown table of the A/B: a row per arm and workload, a cell per turn, then the tail columns."""
    lines = ["", title, "", "| arm | workload | " + " | ".join(f"{p}{n}" for p, n in AB_ORDER) + " | "
             + " | ".join(heads) + " |", "|---|---|" + "---|" * len(AB_ORDER) + "---:|" * len(heads)]
    for a in ab:
        lines.append(f"| {a['arm']} | {a['workload']} | " + " | ".join(cell(t) for t in a["turns"].values())
                     + " | " + " | ".join(tail(a)) + " |")
    return lines


def _f(x: Any, nd: int) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def revalidate(table_path: str, observed_path: str, workloads: list[str]) -> list[dict[str, Any]]:
    """validate() of this checkout on an arm's compacted observe file, per workload (rows between
    the marker batches, as post_process segments them) and over all steps: the pricing of the
    code at hand, not of the commit the arm ran (the on-host numbers stay in context-ARM.json)."""
    from dspark_calib.pricing.policy import CHUNK_RULE
    from dspark_calib.observe.file import ObservedSteps, read_observed
    from dspark_calib.table.file import read_table
    from dspark_calib.validate import AWARE, SINGLE, validate

    obs = read_observed([observed_path])
    cols = sorted_columns(dict(obs.columns))
    table = read_table(table_path)
    segments, _ = segment_steps(cols, len(workloads))
    parts = [("all", None)] + list(zip(workloads, segments or []))
    out = []
    for name, rows in parts:
        sub = ObservedSteps(cols if rows is None else {k: v[rows] for k, v in cols.items()}, obs.files, obs.metadata)
        if len(sub) == 0:
            continue
        result = validate(table, sub)
        kinds = [(g.kind, g.errors[SINGLE], g.errors[AWARE]) for g in result.overall]
        pre = result.prefill
        if pre.recorded:  # observe schema >= 1.1: the chunk steps under the pricing not in use, one more row
            kinds.append(("verify_prefill, chunks by KV sum", pre.single, pre.kv_sum) if pre.by_pairs
                         else ("verify_prefill, chunks by pairs", pre.single, pre.pairs))
            if pre.by_pairs and pre.pair_rule != CHUNK_RULE:  # served at the first pair price: this one's too
                now = validate(table, sub, chunks=True).prefill
                kinds.append(("verify_prefill, chunks by pairs (largest-step rule)", now.single, now.pairs))
        for kind, single, aware in kinds:
            d = {"single_context": single.to_dict(), "context_aware": aware.to_dict()}
            out.append({"workload": name, "kind": kind, "steps": aware.n,
                        **{f"{p}_{k}": d[p][k] for p in d for k in ("median_pct", "p90_pct", "median_signed_pct")}})
    return out


def _git_rev() -> str | None:
    """HEAD, marked -dirty when the tree has changes (the report's pricing is the tree's, not HEAD's)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, cwd=ROOT, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# an arm's summary file: context-LABEL.json, LABEL as arm_label makes it (the speculator's prefix when not DSpark)
ARM_FILE = re.compile(r"context-((?:(?:%s)-)?[a-z]+%s)\.json"
                      % ("|".join(re.escape(s) for s in CONFIG["speculators"] if s != "dspark"),
                         "".join(f"(?:{pattern})?" for _, pattern in LABEL_SUFFIXES)))


def local_table(summary: dict[str, Any], results: str) -> str | None:
    """The copy of the arm's table in the run folder (run.sh puts it there), or None; ValueError when the
    copy is another table than the arm loaded."""
    info = summary.get("table") or {}
    local = os.path.join(results, os.path.basename(info["path"])) if info.get("path") else None
    if not (local and os.path.isfile(local)):
        return None
    got = _table_info(local).get("hash")
    if info.get("hash") and got != info["hash"]:
        raise ValueError(f"{local} has hash {got}, the arm loaded {info['hash']}")
    return local


def run_report(args: argparse.Namespace) -> int:
    arms, folders = {}, {}
    for d in args.results:
        for name in sorted(os.listdir(d)):
            m = ARM_FILE.fullmatch(name)
            if m:
                with open(os.path.join(d, name)) as fh:
                    arms[m.group(1)] = json.load(fh)
                folders[m.group(1)] = d
                steps = os.path.join(d, f"context-{m.group(1)}-steps.json")
                if os.path.isfile(steps):
                    with open(steps) as fh:
                        add_drafter_share(arms[m.group(1)], json.load(fh))
                observed = os.path.join(d, f"context-{m.group(1)}-observed.parquet")
                if os.path.isfile(observed):
                    try:  # one bad file costs its own rows, not the report
                        local = local_table(arms[m.group(1)], d)
                        if local:
                            arms[m.group(1)]["revalidated"] = revalidate(local, observed,
                                                                         list(arms[m.group(1)].get("workloads", {})))
                    except Exception as exc:  # noqa: BLE001
                        print(f"re-validation of {observed} skipped: {type(exc).__name__}: {exc}"[:300])
    if not arms:
        print(f"no context-ARM.json under {', '.join(args.results)}")
        return 1
    rep = build_report(arms)
    rep["revalidated_with"] = {"git": _git_rev(), "arms": {a: arms[a].get("revalidated") for a in arms}}
    rep["advice"] = advise_report(arms, folders)
    _write_json(args.json, rep)
    md = markdown(rep)
    with open(args.md, "w") as fh:
        fh.write(md)
    print(md)
    print(f"wrote {args.json} and {args.md}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    kv = args.kv_tokens or KV_TOKENS_MEASURED
    print(f"KV: {kv_bytes_per_token()} B/token; capacity from the arithmetic {kv_capacity_tokens()} tokens, "
          f"measured {KV_TOKENS_MEASURED}; planning with {kv}")
    total = 0.0
    for w in plan_workloads(kv, waves=args.waves):
        est = estimate_seconds(w)
        total += est
        worst = w.worst_case_tokens
        print(f"{w.name:7} prompts {w.prompts_label:16} concurrency {w.concurrency:3} "
              f"(wanted {w.wanted_concurrency}) requests {w.num_requests:3}  worst-case KV {worst:7} tokens "
              f"({worst / kv:5.1%})  estimate {est:5.1f} s")
    print(f"workloads ~{total:.0f} s (+ warm-up and markers ~10 s, engine start 30-60 s warm / 230 s cold, "
          f"post ~15 s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--kv-tokens", type=int)
    p.add_argument("--waves", type=int, default=2)
    a = sub.add_parser("arm")
    a.add_argument("arm", choices=sorted(CONFIG["arms"]), help="a named arm of arms.json")
    a.add_argument("--table", help="the multi-context table (static/aware load it; every arm validates with it)")
    a.add_argument("--out", required=True)
    a.add_argument("--work", help="scratch dir (default /tmp/serve-context-ARM, emptied first)")
    a.add_argument("--deadline-epoch", type=float, help="unix time by which everything must be written")
    a.add_argument("--workloads", help="comma list (default: every workload of arms.json, in its order)")
    a.add_argument("--waves", type=int, default=2)
    # each option overrides the named arm's setting; the files are named by the settings (arm_label)
    a.add_argument("--policy", choices=("warn", "strict"), default="warn",
                   help="DSPARK_CALIB_POLICY for a table or a seed (default warn: a differing detail is a line; "
                        "strict: the engine refuses to start)")
    a.add_argument("--observe-every", type=int, default=None, help="0: observe off (files context-ARM-noobs.*)")
    a.add_argument("--context-tail", type=float, default=None,
                   help="aware arm: DSPARK_CALIB_CONTEXT_TAIL (files context-aware-tailNN.*); 0 unless the arm "
                        "sets it, not the plugin's 0.2")
    a.add_argument("--context-chunks", action="store_true", default=None,
                   help="aware arm: DSPARK_CALIB_CONTEXT_CHUNKS=1 (files context-aware[-tailNN]-chunks.*); 0 "
                        "(the KV sum) unless the arm sets it, not the plugin's default")
    a.add_argument("--rerun", action="store_true", default=None,
                   help="the same arm a second time on this host (files context-ARM...-rerun.*): the spread")
    a.add_argument("--acceptance-length", type=float, default=ACCEPTANCE_LENGTH)
    a.add_argument("--acceptance-rates", help="comma list of K non-increasing unconditional rates (instead), "
                                              "or the name of a schedule in arms.json")
    a.add_argument("--speculator", default=None, help="a speculator of arms.json (the arm's unless given)")
    a.add_argument("--seed", action="store_true", default=None,
                   help="start the acceptance estimator from a seed (files ...-seed.*); a seeded arm of arms.json sets it")
    a.add_argument("--estimator", choices=ESTIMATORS, default=None,
                   help="pinned: the draft-model speculator's acceptance estimator predicts the enforced rates and "
                        "never refits (files ...-pinned.*); the arm's unless given")
    a.add_argument("--seed-file", help="the seed (`dspark-calib seed`); default: made from the observe file of the "
                                       "arm the seeded arm names (seed_from) in --out")
    a.add_argument("--dry-run", action="store_true", help="fake engine on CPU: the whole control flow, no vLLM")
    a.add_argument("--cpus", help="taskset's CPU list for the engine child and its processes (e.g. 0-7): the "
                                  "draft-model drafter is host-bound, so its speed follows the cores it gets")
    e = sub.add_parser("_engine")
    e.add_argument("--results", required=True)
    e.add_argument("--plan", required=True)
    e.add_argument("--child-deadline", type=float, required=True)
    e.add_argument("--acceptance-length", type=float, default=ACCEPTANCE_LENGTH)
    e.add_argument("--acceptance-rates")
    e.add_argument("--speculator", default="dspark")
    e.add_argument("--fixed", action="store_true", help="adaptive verification off: every step verifies K")
    e.add_argument("--ab-table", help="the ab arm: the table swapped in before each workload priced by it")
    e.add_argument("--pin-estimator", action="store_true", help="the estimator predicts the enforced rates, never refits")
    e.add_argument("--dry-run", action="store_true")
    e.add_argument("--table")
    r = sub.add_parser("report")
    r.add_argument("--results", nargs="+", required=True, help="run folders holding context-ARM.json files")
    r.add_argument("--json", help="default: serve_context.json in the first --results folder")
    r.add_argument("--md", help="default: serve_context.md in the first --results folder")
    args = ap.parse_args(argv)
    if args.cmd == "report":
        args.json = args.json or os.path.join(args.results[0], "serve_context.json")
        args.md = args.md or os.path.join(args.results[0], "serve_context.md")
    if args.cmd == "arm":
        apply_arm_config(args)
        if args.acceptance_rates in CONFIG.get("schedules", {}):
            args.acceptance_rates = ",".join(f"{x:g}" for x in CONFIG["schedules"][args.acceptance_rates])
    return {"plan": run_plan, "arm": run_arm, "_engine": engine_child, "report": run_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""What a `profile` run will do, said before the engine starts and followed while it runs.

The worker runs capture.Schedule (vLLM's own batches_to_profile sequence, repeated in
blocks, per context). The driver cannot see the engine's CUDA-graph sizes before the
engine resolves them, so it builds the same Schedule from vLLM's default sizes
(an estimate, exact for default settings); the progress bar's total is the worker's
own, from progress.json, once profiling starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from dspark_calib.speculators import DSPARK, SPECULATORS
from dspark_calib.vllm.capture import Plan, Schedule
from dspark_calib.telemetry import SERVING, STARTUP
from dspark_calib.vllm.gpu_state import DEFAULT_COOLDOWN_S, DEFAULT_SETTLE_S


@dataclass
class ProfileOptions:
    model: str
    draft: str  # for mtp, the target itself (its own layers draft)
    method: str = DSPARK  # vLLM's speculative_config.method (speculators.SPECULATORS)
    tp: int = 1
    num_speculative_tokens: int | None = None  # default: a DSpark drafter's block_size; needed otherwise
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    context_lens: tuple[int, ...] = ()  # (): default_contexts, once max_model_len is known
    replays: int = 20
    warmup: int = 2
    gpu_state: str = STARTUP  # the state blocks start in (vllm/gpu_state.py)
    cooldown_s: float = DEFAULT_COOLDOWN_S  # startup: the most rank 0 pauses before each block but the first
    settle_s: float = DEFAULT_SETTLE_S  # serving: the most the settle steps before each block last
    shape_replays: int = 0  # a shape block per context (capture.py): uniform-decode replays of each size
    load_format: str = "dummy"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.85
    distributed_executor_backend: str | None = None  # mp on one node, ray across nodes
    max_model_len: int | None = None
    quantization: str | None = None
    seed: int = 0
    extra_engine_args: dict[str, Any] = field(default_factory=dict)  # --engine-arg / --engine-args-json
    model_name: str | None = None  # what the user typed (a hub id), when `model` is its cache snapshot
    draft_name: str | None = None


# The short end of `profile`'s default contexts: 1024 (the line below the range needs a second
# context at least its own length further) and vLLM's own profile context, the curve its static
# tables are built from.
DEFAULT_CONTEXTS = (1024, 8192)


def default_contexts(max_model_len: int, query_len: int) -> tuple[int, ...]:
    """`profile`'s contexts when none are given: DEFAULT_CONTEXTS up to the longest context vLLM
    profiles under this max_model_len (its clamp, fit.profile_context_len, for the largest batch's
    query_len), and that longest one, so a table covers the engine's contexts up to max_model_len
    instead of pricing the longest ones by extrapolation."""
    from dspark_calib.fit import profile_context_len

    top = profile_context_len(max_model_len, max_model_len, query_len)
    return tuple(sorted({c for c in DEFAULT_CONTEXTS if c < top} | {top})) if top > 0 else ()


# EngineArgs fields that `profile` sets from its own options: --engine-arg must not
# contradict them silently. speculative_config is merged instead (see engine_kwargs).

# Wall time of one profile step, fitted on a real run (Qwen3-8B + DSpark block 7, one
# H200, tp 1, contexts 1024/8192/16384: within 7 % of each context's total). Other
# models and GPUs differ: the line printed says it is an estimate.
STEP_MS = 5.0  # per step: launch, host sync, the drafter's small graphs
MS_PER_1K_TOKENS = 27.0  # grows with the step's token count
MS_PER_1K_CONTEXT = 6.4  # and with the dummy requests' context length


def plan_of(opts: Any) -> Plan:
    """The plan the driver writes for the worker, and the one the estimate is made from."""
    return Plan(context_lens=tuple(opts.context_lens), replays=opts.replays, warmup=opts.warmup,
                cooldown_s=opts.cooldown_s, gpu_state=opts.gpu_state, settle_s=opts.settle_s,
                shape_replays=opts.shape_replays)


def default_capture_sizes(opts: Any) -> list[int]:
    """vLLM 0.33's default CUDA-graph sizes (VllmConfig._set_cudagraph_sizes): 1, 2, 4,
    multiples of 8 below 256, of 16 up to min(max_num_seqs x (1 + k) x 2, 512), within
    max_num_batched_tokens. --engine-arg compilation settings can change them."""
    k = int(opts.num_speculative_tokens or 1)
    top = min(opts.max_num_seqs * (1 + k) * 2, 512, opts.max_num_batched_tokens)
    return [s for s in (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)) if s <= top]


def vllm_batches(opts: Any, capture_sizes: list[int] | None = None) -> list[dict]:
    """The installed vLLM's own, unpatched batches_to_profile for these sizes (tail included)."""
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

    from dspark_calib.vllm.runtime import MARK

    fn = av.AdaptiveVerificationManager.batches_to_profile
    fn = getattr(fn, MARK, fn)  # the plugin may have patched it in this process (tp 1)
    stand_in = SimpleNamespace(req_states=SimpleNamespace(max_num_batched_tokens=opts.max_num_batched_tokens))
    sizes = default_capture_sizes(opts) if capture_sizes is None else capture_sizes
    return list(fn(stand_in, list(sizes)))


@dataclass(frozen=True)
class Expected:
    """The schedule the worker is expected to run, and how long profiling should take."""

    schedule: Schedule
    contexts: int
    sizes: int
    seconds: float  # steps, cool-downs and settles together
    cooldown_s: float = 0.0  # the most the cool-downs take (they end early once the GPU is back)
    settle_s: float = 0.0  # the most the settles take (they end early once the clocks are steady)
    method: str = DSPARK  # the step model above is DSpark's drafter

    @property
    def blocks(self) -> int:
        return self.schedule.warmup_blocks + self.schedule.timed_blocks

    @property
    def samples_per_size(self) -> int:
        return self.schedule.timed_blocks * self.schedule.vllm_replays

    @property
    def shape_steps(self) -> int:
        return sum(t.shape for t in self.schedule.tags)

    def line(self, replays: int) -> str:
        """One line, printed before the engine starts."""
        s = self.schedule
        rounded = "" if self.samples_per_size == replays else f" (--replays {replays} rounded up to whole blocks)"
        shapes = (f", then a shape block per context ({self.shape_steps // max(self.contexts, 1)} uniform-decode "
                  "steps: k + 1 tokens a request, kept in the capture only)" if self.shape_steps else "")
        return (f"profile plan: {self.contexts} context(s) x ~{self.sizes} sizes x {self.blocks} blocks of vLLM's "
                f"{s.vllm_replays} back-to-back replays ({s.timed_blocks} timed: {self.samples_per_size} samples per "
                f"size{rounded}; {s.warmup_blocks} warm-up){shapes} = ~{len(s.tags)} steps; expected ~{_human(self.seconds)} "
                f"of profiling once the engine is up (an estimate: ~{STEP_MS:g} ms a step + a cost growing with "
                f"tokens and context; measured on one H200 with Qwen3-8B{self._between_blocks_note()})"
                + ("" if SPECULATORS[self.method].one_pass else
                   f"; the step model is DSpark's one-pass drafter: a {self.method} drafter runs K passes a step, "
                   "each reading its own KV, and can cost several times more (docs/results)"))

    def _between_blocks_note(self) -> str:
        if self.settle_s:
            return (f"; up to {_human(self.settle_s)} of it settling under load before each block, less once "
                    "the clocks are steady")
        if self.cooldown_s:
            return f"; up to {_human(self.cooldown_s)} of it cool-down between blocks, less once the GPU is back"
        return ""

    def position(self, state: dict) -> dict:
        """progress.json plus where it is: block b of B in its context (warm-up or timed), or its
        shape block (each context's steps end with it)."""
        total, done = int(state.get("total") or 0), int(state.get("done") or 0)
        per_ctx = total // max(self.contexts, 1)
        regular = per_ctx - self.shape_steps // max(self.contexts, 1)
        at = done % per_ctx if per_ctx else 0
        per_block = regular // max(self.blocks, 1)
        block = at // per_block + 1 if per_block else 1
        return {**state, "block": min(block, self.blocks), "blocks": self.blocks,
                "warmup": block <= self.schedule.warmup_blocks, "shape": bool(self.shape_steps) and at >= regular,
                "samples_per_size": self.samples_per_size, "vllm_replays": self.schedule.vllm_replays}


def expected(opts: Any, capture_sizes: list[int] | None = None) -> Expected:
    batches = vllm_batches(opts, capture_sizes)
    plan = plan_of(opts)
    k = int(opts.num_speculative_tokens or 0)
    sizes = default_capture_sizes(opts) if capture_sizes is None else capture_sizes
    schedule = Schedule.build(plan, batches, k + 1 if k else 0, opts.max_num_seqs, max(sizes, default=0))
    ms = sum(STEP_MS + MS_PER_1K_TOKENS * t.num_tokens / 1000 + MS_PER_1K_CONTEXT * t.context_len / 1000
             for t in schedule.tags)
    blocks = len(plan.context_lens) * (schedule.warmup_blocks + schedule.timed_blocks + (1 if any(
        t.shape for t in schedule.tags) else 0))
    # startup: a cool-down before every block but the capture's first; serving: a settle before every block
    cooldown = plan.cooldown_s * (blocks - 1) if plan.gpu_state == STARTUP else 0.0
    settle = plan.settle_s * blocks if plan.gpu_state == SERVING else 0.0
    return Expected(schedule, len(plan.context_lens), len({b["num_tokens"] for b in batches}),
                    ms / 1000 + cooldown + settle, cooldown, settle, opts.method)


def _human(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"

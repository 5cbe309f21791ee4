"""One observed serving step: its columns, the checks on one row and on whole columns,
what a file says of the engine that wrote it (``ObserveMeta``, with its pricing policy),
and the steps whose timings are still on the device (``PendingSteps``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import numpy as np

from dspark_calib.errors import CalibError
from dspark_calib.fileformat.limits import MAX_CONTEXT_LEN, MAX_NUM_SEQS, MAX_STEP_TOKENS
from dspark_calib.fingerprint import Fingerprint, load_mismatches
from dspark_calib.pricing.policy import STOCK, PricingPolicy

INT, FLOAT, BOOL = "int64", "float64", "bool"
POSITIONS = "int64[]"  # one int64 per draft position (a list column; in memory a (rows, positions) array)
COEFFICIENTS = "float64[]"  # one float64 per draft position (a list column; in memory a (rows, positions) array)
# The scheduled requests' computed tokens at CONTEXT_QUANTILES evenly spaced order statistics (the
# shortest, ..., the longest; context_quantiles): how the KV divides over a step's requests, which
# its mean and maximum do not say (an attention kernel's work tiles follow each request's length).
# A list column of a fixed length; in memory a (rows, CONTEXT_QUANTILES) array.
QUANTILES = "int64[]"
CONTEXT_QUANTILES = 9
# Column -> type, in file order. Every step the engine observed:
COLUMNS: dict[str, str] = {
    "step": INT,  # the engine's step counter (increasing per writer)
    "forward_ms": FLOAT,  # StepTimingCollector: target forward (the verify step)
    "drafter_ms": FLOAT,  # StepTimingCollector: drafter
    "num_target_tokens": INT,  # tokens the target ran (after the budget trimmed drafts)
    "num_reqs": INT,
    "full_cudagraph": BOOL,  # replayed a full CUDA graph (vLLM prices drafts from these only)
    "context_mean": FLOAT,  # num_computed_tokens over the scheduled requests
    "context_max": INT,
    "context_sum": INT,
    "scheduled_drafts": INT,  # drafts scheduled before the budget
    "draft_budget": INT,  # drafts verified (the budget chosen)
    "priced_context": INT,  # the context the step's drafts were priced at (context-aware: the batch mean,
    # raised by the tail when one is set: ceil(S' / n), rules.tail_context_sum)
    "predicted_draft_ms": FLOAT,  # the engine's cost tables for this step
    "predicted_verify_ms": FLOAT,
    "budget_static": INT,  # nullable: budget under the table's one-context pricing
    "budget_context_aware": INT,  # nullable: budget under context-aware pricing
    # 1.1: the prefill chunks (requests with more than one non-draft token); null: not recorded
    "prefill_tokens": INT,
    "prefill_context_sum": INT,
    "prefill_pairs": INT,
    # 1.2: the drafts judged per position (null: not recorded), as vLLM's acceptance estimator labels
    # them: position i is graded in a request whose first i drafts were accepted and which verified an
    # (i+1)-th; accepted when that draft was accepted too
    "position_graded": POSITIONS,
    "position_accepted": POSITIONS,
    # 1.3: vLLM's online acceptance estimator as this step's drafts were ranked by it (null: not read
    # at this step; recorded on the first sampled step and on the first after each refit, never for
    # a speculator without the estimator): its refits and step() calls since the engine started
    # (vLLM's kernel warm-up steps included), its shared slope and per-position intercepts
    "estimator_refits": INT,
    "estimator_steps": INT,
    "estimator_slope": FLOAT,
    "estimator_intercepts": COEFFICIENTS,
    # 1.5: the GPU's SM clock and power as a sampler thread last read them when the step was sampled
    # (NVML, a few readings a second, never on the step's path; null: no NVML, or no reading yet)
    "gpu_sm_mhz": FLOAT,
    "gpu_power_w": FLOAT,
    # 1.6: the host's wall time (TP rank 0, time.perf_counter) from the previous execute_model call's start to
    # this step's (null: the observer's first call, or the previous call was a dummy run or a warm-up step), and
    # from this step's execute_model start to its return (the host issuing the step; the GPU may run behind)
    "step_interval_ms": FLOAT,
    "host_ms": FLOAT,
    # 1.7: the scheduled requests' computed tokens at CONTEXT_QUANTILES order statistics (null: not recorded)
    "context_quantiles": QUANTILES,
}
BUDGETS = ("budget_static", "budget_context_aware")
PREFILL = ("prefill_tokens", "prefill_context_sum", "prefill_pairs")
ACCEPTANCE = ("position_graded", "position_accepted")
ESTIMATOR = ("estimator_refits", "estimator_steps", "estimator_slope", "estimator_intercepts")
GPU = ("gpu_sm_mhz", "gpu_power_w")
HOST = ("step_interval_ms", "host_ms")
# A host interval over this is a stall (a compile, a collection, a page-fault storm), not a step's time:
# the observer says each one before a priced step, validate counts them.
STALL_MS = 1000.0
MAX_GPU_READING = 100_000.0  # MHz or W: far above any GPU; a larger value is damage, not a reading
NULLABLE = frozenset(BUDGETS + PREFILL + ACCEPTANCE + ESTIMATOR + GPU + HOST + ("context_quantiles",))
ABSENT = -1  # in memory, a null budget; a null acceptance row is ABSENT at every position
# in memory, a null float (estimator_slope) is NaN, and a null estimator_intercepts row NaN at every position


@dataclass(frozen=True, slots=True)
class ObservedStep:
    """One observed serving step; checked on construction (sampled steps only: cheap enough)."""

    step: int
    forward_ms: float
    drafter_ms: float
    num_target_tokens: int
    num_reqs: int
    full_cudagraph: bool
    context_mean: float
    context_max: int
    context_sum: int
    scheduled_drafts: int
    draft_budget: int
    priced_context: int
    predicted_draft_ms: float
    predicted_verify_ms: float
    budget_static: int | None = None
    budget_context_aware: int | None = None
    prefill_tokens: int | None = None
    prefill_context_sum: int | None = None
    prefill_pairs: int | None = None
    position_graded: tuple[int, ...] | None = None
    position_accepted: tuple[int, ...] | None = None
    estimator_refits: int | None = None
    estimator_steps: int | None = None
    estimator_slope: float | None = None
    estimator_intercepts: tuple[float, ...] | None = None
    gpu_sm_mhz: float | None = None
    gpu_power_w: float | None = None
    step_interval_ms: float | None = None
    host_ms: float | None = None
    context_quantiles: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problem = row_problem({f.name: getattr(self, f.name) for f in fields(self)})
        if problem:
            raise CalibError(f"bad observed step: {problem}")


def row_problem(r: dict[str, Any]) -> str | None:
    """The first thing wrong with one row (scalars), or None."""
    for name in ("forward_ms", "drafter_ms", "predicted_draft_ms", "predicted_verify_ms", "context_mean"):
        v = r[name]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            return f"{name} must be a finite number >= 0, got {v!r}"
    for name, low in (("step", 0), ("num_target_tokens", 1), ("num_reqs", 1), ("context_max", 0),
                      ("context_sum", 0), ("scheduled_drafts", 0), ("draft_budget", 0), ("priced_context", 0)):
        v = r[name]
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low:
            return f"{name} must be an integer >= {low}, got {v!r}"
    if not isinstance(r["full_cudagraph"], (bool, np.bool_)):
        return f"full_cudagraph must be a bool, got {r['full_cudagraph']!r}"
    n, total = r["num_reqs"], r["context_sum"]
    if abs(r["context_mean"] - total / n) > 1e-9 * max(1.0, total / n) or r["context_max"] * n < total:
        return f"context mean/max/sum disagree (mean {r['context_mean']}, max {r['context_max']}, sum {total}, {n} reqs)"
    for name in ("draft_budget", "budget_static", "budget_context_aware"):
        v = r[name]
        if v is None and name in NULLABLE:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 0 <= v <= r["scheduled_drafts"]:
            return f"{name} must be an integer in 0..scheduled_drafts ({r['scheduled_drafts']}), got {v!r}"
    prefill = [r[name] for name in PREFILL]
    if any(v is not None for v in prefill):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in prefill):
            return f"prefill_tokens/context_sum/pairs must be integers >= 0 (or all None), got {prefill!r}"
        tokens, ctx_sum, pairs = prefill
        # each chunk has q >= 2 non-draft tokens at c <= context_max: 2q <= q (c + q) <= q (max + q)
        if tokens > r["num_target_tokens"] or ctx_sum > total or (tokens == 0 and ctx_sum) \
                or not 2 * tokens <= pairs <= tokens * (r["context_max"] + tokens):
            return (f"prefill columns disagree with the step (tokens {tokens}, context sum {ctx_sum}, pairs {pairs}; "
                    f"step: {r['num_target_tokens']} tokens, context sum {total}, max {r['context_max']})")
    graded, accepted = r["position_graded"], r["position_accepted"]
    if (graded is None) != (accepted is None):
        return "position_graded and position_accepted must both be recorded or both be None"
    if graded is not None:
        if len(graded) != len(accepted) or not graded or not all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (*graded, *accepted)):
            return f"position_graded/accepted must be equal-length lists of integers, got {graded!r}, {accepted!r}"
        bad = acceptance_problem(np.array([graded]), np.array([accepted]), np.array([n]), np.array([r["draft_budget"]]))
        if bad is not None:
            return f"{bad[1]} (graded {list(graded)}, accepted {list(accepted)})"
    for name in GPU:
        v = r[name]
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= MAX_GPU_READING):
            return f"{name} must be a number in (0, {MAX_GPU_READING:g}] or None, got {v!r}"
    for name in HOST:
        v = r[name]
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0):
            return f"{name} must be a finite number >= 0 or None, got {v!r}"
    q = r["context_quantiles"]
    if q is not None:
        if not isinstance(q, (tuple, list)) or len(q) != CONTEXT_QUANTILES or not all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in q):
            return f"context_quantiles must be {CONTEXT_QUANTILES} integers or None, got {q!r}"
        bad = quantiles_problem(np.array([q]), np.array([n]), np.array([total]), np.array([r["context_max"]]))
        if bad is not None:
            return f"{bad[1]} (context_quantiles {list(q)})"
    return estimator_problem(*(r[name] for name in ESTIMATOR))


def quantile_ranks(num_reqs: int) -> np.ndarray:
    """The ranks (0-based, in sorted order) of a step's num_reqs requests that context_quantiles
    records: round(i (n - 1) / (CONTEXT_QUANTILES - 1)) for i = 0 .. CONTEXT_QUANTILES - 1."""
    return np.rint(np.arange(CONTEXT_QUANTILES) * (num_reqs - 1) / (CONTEXT_QUANTILES - 1)).astype(np.intp)


def context_quantiles(computed: np.ndarray) -> tuple[int, ...]:
    """The CONTEXT_QUANTILES order statistics of a step's per-request computed tokens (at least
    one request): sorted, the ones at quantile_ranks."""
    ordered = np.sort(np.asarray(computed, dtype=np.int64))
    return tuple(int(v) for v in ordered[quantile_ranks(len(ordered))])


def quantiles_problem(q: np.ndarray, num_reqs: np.ndarray, context_sum: np.ndarray,
                      context_max: np.ndarray) -> tuple[np.ndarray, str] | None:
    """(bad rows, what) of the first rule recorded context_quantiles rows break, or None. Rows whose
    first entry is ABSENT are not recorded. Order statistics of the requests whose sum and maximum
    the step records: non-decreasing from >= 0, the last the maximum, the shortest no longer
    than the mean."""
    known = q[:, 0] != ABSENT
    damaged = ~known & (q != ABSENT).any(axis=1)  # a null row is ABSENT throughout
    if not known.any() and not damaged.any():
        return None
    if q.shape[1] != CONTEXT_QUANTILES:
        return known | damaged, f"context_quantiles must hold {CONTEXT_QUANTILES} values a step"
    for bad, what in ((damaged | (known & ((q < 0).any(axis=1) | (np.diff(q, axis=1) < 0).any(axis=1))),
                       "context_quantiles must be non-decreasing and >= 0"),
                      (known & (q[:, -1] != context_max), "context_quantiles must end at context_max"),
                      (known & (q[:, 0] * np.maximum(num_reqs, 1) > context_sum),
                       "context_quantiles' shortest request above the mean")):
        if bad.any():
            return bad, what
    return None


def estimator_problem(refits: Any, steps: Any, slope: Any, intercepts: Any) -> str | None:
    """What is wrong with one row's estimator reading (all four None: not read), or None. vLLM's
    refit never takes the slope below 0."""
    given = [v is not None for v in (refits, steps, slope, intercepts)]
    if not any(given):
        return None
    if not all(given):
        return "estimator_refits/steps/slope/intercepts must all be recorded or all be None"
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in (refits, steps)):
        return f"estimator_refits and estimator_steps must be integers >= 0, got {refits!r}, {steps!r}"
    numbers = (slope, *intercepts) if isinstance(intercepts, (tuple, list)) and intercepts else None
    if numbers is None or not all(isinstance(v, (int, float, np.floating)) and not isinstance(v, bool)
                                  and math.isfinite(v) for v in numbers) or slope < 0:
        return (f"estimator_slope must be a finite number >= 0 and estimator_intercepts a non-empty list of finite "
                f"numbers, got {slope!r}, {intercepts!r}")
    return None


def acceptance_problem(graded: np.ndarray, accepted: np.ndarray, num_reqs: np.ndarray,
                       draft_budget: np.ndarray) -> tuple[np.ndarray, str] | None:
    """(bad rows, what) of the first rule recorded acceptance rows break, or None. Rows whose first
    entry is ABSENT are not recorded. A request graded at position i+1 had its draft i accepted,
    and each graded draft was verified: graded never rises along positions, accepted[i] lies
    between graded[i+1] and graded[i], graded[0] <= num_reqs and the graded sum <= draft_budget."""
    known = graded[:, 0] != ABSENT
    nxt = np.concatenate([graded[:, 1:], np.zeros((len(graded), 1), dtype=graded.dtype)], axis=1)
    for bad, what in (((accepted[:, 0] != ABSENT) != known, "position_graded/accepted null in one, not both"),
                      (known & ((graded < 0).any(axis=1) | (accepted < 0).any(axis=1)), "negative acceptance counts"),
                      (known & (graded[:, 0] > num_reqs), "more requests graded at position 1 than the step has"),
                      (known & (graded.sum(axis=1) > draft_budget), "more drafts graded than verified"),
                      (known & ((accepted > graded) | (accepted < nxt)).any(axis=1),
                       "accepted drafts outside graded[i+1]..graded[i]")):
        if bad.any():
            return bad, what
    return None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class ObserveMeta:
    """What an observe file says of the engine that wrote it (the file's metadata, typed).

    ``raw`` keeps every key as written (a newer minor's keys included). The pricing
    policy is parsed when asked for (``policy()``): only ``validate`` needs it, and a
    context-aware file's bad setting is its error, named then."""

    schema_version: str
    mode: str = STOCK
    table_hash: str = ""
    sample_every: int | None = None
    max_num_reqs: int | None = None  # the engine's sizes, when recorded
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ObserveMeta":
        mode = raw.get("mode", STOCK)
        table_hash = raw.get("table_hash", "")
        return cls(schema_version=str(raw.get("schema_version", "")), mode=mode if isinstance(mode, str) else STOCK,
                   table_hash=table_hash if isinstance(table_hash, str) else "",
                   sample_every=_positive_int(raw.get("sample_every")),
                   max_num_reqs=_positive_int(raw.get("max_num_reqs")),
                   max_num_batched_tokens=_positive_int(raw.get("max_num_batched_tokens")),
                   max_model_len=_positive_int(raw.get("max_model_len")), raw=dict(raw))

    def policy(self) -> PricingPolicy:
        return PricingPolicy.from_metadata(self.raw)

    def check_engine(self, fingerprint: Fingerprint, path: str) -> bool:
        """Are these steps of an engine of this fingerprint? CalibError naming the first blocking key
        that differs (fingerprint.load_mismatches); False when the file records no engine (written
        before schema 1.2), True when its engine fits."""
        engine = self.raw.get("engine")
        if not isinstance(engine, dict):
            return False
        try:
            mismatches = load_mismatches(fingerprint, engine)
        except Exception as exc:  # noqa: BLE001 - a value of a type no engine has: this file's problem
            raise CalibError(f"records an engine fingerprint this table cannot compare ({exc})", path=path) from None
        if mismatches:
            more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
            raise CalibError(f"observed on another engine than the table's fingerprint: {mismatches[0]}{more}",
                             path=path)
        return True


def meta_problem(raw: Mapping[str, Any]) -> str | None:
    """The first engine size in an observe file's metadata that no engine has (validate sizes
    its dense tables by them), or None."""
    for name, top in (("max_num_reqs", MAX_NUM_SEQS), ("max_num_batched_tokens", MAX_STEP_TOKENS),
                      ("max_model_len", MAX_CONTEXT_LEN)):
        value = _positive_int(raw.get(name))
        if value is not None and value > top:
            return f"metadata {name} {value} is over {top} (no engine has it; damaged or forged)"
    return None


def decode_steps(c: Mapping[str, np.ndarray]) -> np.ndarray:
    """Which steps are decode-shaped (one non-draft token per request, no prefill chunk): the shape
    vLLM profiles, priced by the decode tables and modelled by advise."""
    return c["num_target_tokens"] - c["draft_budget"] == c["num_reqs"]


def column_problem(c: dict[str, np.ndarray]) -> str | None:
    """Vectorised row_problem over whole columns: the first bad row, named."""
    checks: list[tuple[np.ndarray, str]] = []
    for name in ("forward_ms", "drafter_ms", "predicted_draft_ms", "predicted_verify_ms", "context_mean"):
        checks.append((~np.isfinite(c[name]) | (c[name] < 0), f"{name} must be finite and >= 0"))
    for name, low in (("step", 0), ("num_target_tokens", 1), ("num_reqs", 1), ("context_max", 0),
                      ("context_sum", 0), ("scheduled_drafts", 0), ("priced_context", 0)):
        checks.append((c[name] < low, f"{name} must be >= {low}"))
    # validate sizes arrays by these (one entry per token of a step, per context): bounded
    for name, top in (("num_target_tokens", MAX_STEP_TOKENS), ("num_reqs", MAX_NUM_SEQS),
                      ("scheduled_drafts", MAX_STEP_TOKENS), ("context_max", MAX_CONTEXT_LEN),
                      ("priced_context", MAX_CONTEXT_LEN)):
        checks.append((c[name] > top, f"{name} must be <= {top}"))
    n = np.maximum(c["num_reqs"], 1)
    mean = c["context_sum"] / n
    checks.append((np.abs(c["context_mean"] - mean) > 1e-9 * np.maximum(1.0, mean), "context_mean != context_sum / num_reqs"))
    checks.append((c["context_max"] * n < c["context_sum"], "context_max below the mean"))
    checks.append(((c["draft_budget"] < 0) | (c["draft_budget"] > c["scheduled_drafts"]),
                   "draft_budget outside 0..scheduled_drafts"))
    for name in BUDGETS:
        v = c[name]
        checks.append(((v != ABSENT) & ((v < 0) | (v > c["scheduled_drafts"])), f"{name} outside 0..scheduled_drafts"))
    tokens, ctx_sum, pairs = (c[name] for name in PREFILL)
    known = tokens != ABSENT
    checks.append(((known != (ctx_sum != ABSENT)) | (known != (pairs != ABSENT)), "prefill columns null in some, not all"))
    checks.append((known & ((tokens < 0) | (tokens > c["num_target_tokens"]) | (ctx_sum < 0)
                            | (ctx_sum > c["context_sum"]) | ((tokens == 0) & (ctx_sum != 0)) | (pairs < 2 * tokens)
                            | (pairs > tokens * (c["context_max"] + tokens))),
                   "prefill columns disagree with the step's tokens and contexts"))
    acceptance = acceptance_problem(c["position_graded"], c["position_accepted"], c["num_reqs"], c["draft_budget"])
    if acceptance is not None:
        checks.append(acceptance)
    refits, steps = c["estimator_refits"], c["estimator_steps"]
    slope, intercepts = c["estimator_slope"], c["estimator_intercepts"]
    read = refits != ABSENT  # a null slope and intercepts row read as NaN, a null count as ABSENT
    checks.append(((read != (steps != ABSENT)) | (read == np.isnan(slope)) | (read == np.isnan(intercepts[:, 0])),
                   "estimator columns null in some, not all"))
    checks.append((read & ((refits < 0) | (steps < 0) | ~(slope >= 0) | ~np.isfinite(intercepts).all(axis=1)),
                   "estimator_refits or estimator_steps below 0, estimator_slope below 0 or an intercept not finite"))
    for name in GPU:  # null: NaN
        v = c[name]
        checks.append((~np.isnan(v) & ~((v > 0) & (v <= MAX_GPU_READING)), f"{name} outside (0, {MAX_GPU_READING:g}]"))
    for name in HOST:  # null: NaN
        v = c[name]
        checks.append((~np.isnan(v) & ~(np.isfinite(v) & (v >= 0)), f"{name} must be finite and >= 0"))
    quantiles = quantiles_problem(c["context_quantiles"], c["num_reqs"], c["context_sum"], c["context_max"])
    if quantiles is not None:
        checks.append(quantiles)
    for bad, what in checks:
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            return f"row {row}: {what} ({int(bad.sum())} bad rows)"
    return None


# -- the in-engine sampler's pure part ---------------------------------------------------------
class PendingSteps:
    """Sampled steps whose CUDA events may still be on device, oldest first.

    ``events``: anything with forward_start/forward_end/drafter_start/drafter_end
    events (vLLM's StepTimingEvents). Steps on one stream finish in issue order,
    so resolution stops at the first step whose drafter_end is not done; nothing
    here ever waits. When ``max_pending`` steps are in flight a new one is dropped
    (and counted): observing must never hold events without bound.
    """

    def __init__(self, max_pending: int = 256):
        self.max_pending = max_pending
        self._queue: deque[tuple[Any, Any]] = deque()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, events: Any, info: Any) -> bool:
        if len(self._queue) >= self.max_pending:
            self.dropped += 1
            return False
        self._queue.append((events, info))
        return True

    def resolve_ready(self) -> list[tuple[float, float, Any]]:
        """(forward_ms, drafter_ms, info) of every finished step, in order; never blocks."""
        done = []
        queue = self._queue
        while queue and queue[0][0].drafter_end.query():
            events, info = queue.popleft()
            done.append((events.forward_start.elapsed_time(events.forward_end),
                         events.drafter_start.elapsed_time(events.drafter_end), info))
        return done

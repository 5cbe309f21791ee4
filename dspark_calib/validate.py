"""How right are the costs? Predicted vs measured step cost on observed serving steps.

``validate(table, observed)`` prices every observed step two ways from the
table's curves and compares with what the step measured:

* single-context: the dense tables of one profiled context (what a table
  loaded without context-aware mode, or vLLM's own start-up profile, prices
  every step at; by default the context nearest vLLM's profile default 8192);
* context-aware: ``ContextGrid.price``, exactly what context-aware mode installs
  for that step (drafts at the mean context, verify at the context whose
  profiled dummy batch read as much KV: rules.verify_context).

Step kinds follow vLLM's fit: "draft" = drafter_ms against the draft table at
num_reqs (full-CUDA-graph steps only, as vLLM prices drafts from graph replays
only); "verify" = forward_ms against the verify table at num_target_tokens, on
decode steps (one non-draft token per request: the shape vLLM profiles);
"verify_prefill" = the same on steps that carry a prefill chunk. No profile times
a prefill chunk (vLLM's dummy batches are decode-shaped), so no table prices
those well; they are reported apart and left out of --max-error (on the H200 a
8192-token chunk over 1k contexts measured 25 % below the verify curve).
Errors are absolute % of the measured cost, median and p90, per kind x
size bucket x context bucket (powers of two), per kind x context bucket, and per
kind; and per kind x SM-clock bucket (CLOCK_BUCKET_MHZ wide) where the files record the GPU's
clock per step (observe schema 1.4), so a run can show whether the residuals follow the clock
(a profile's clocks against serving's). Decode verifies also per context bucket x shape
(``ShapeErrors``): the step's requests over the profile's at its size, R(N) = min(N, the profiling
engine's max_num_seqs). The profile times R(N) requests of one token each (vLLM's dummy batches)
and the KV-sum rule prices a step of fewer, longer requests as that shape at the same KV read;
a step whose requests fill R(N) is the profile's own shape, one that fills it partly (requests
with several tokens each, or a size padded to a captured graph) is a shape no profile ran, and
the split shows whether the residuals follow it. Where the files record the host's step interval (observe
schema 1.6: the previous execute_model call's start to the step's, on TP rank 0), the interval per
kind and context bucket beside the GPU-timed forward + drafter (``HostTime``): what no event prices
(sampling, scheduling, the host's own work, a compile), and the stalls (intervals over STALL_MS).
The interval ends where the row's step starts, so it spans the step before it: in steady decode a
step's neighbour is alike, and a one-time stall shows as one large interval, not a shift of all.
Also: the share of observed steps whose budget the two pricings choose
differently (from the engine's budget_static / budget_context_aware columns:
a budget needs the step's draft confidences, which only the engine has).

Mixed contexts (``TailFit``): decode steps whose longest request is at least
MIXED_SPREAD x the mean and at most twice it (where t charges the whole gap to the
longest) are re-priced with the mixed-context tail t of rules.tail_context_sum over 0,
0.05, ..., 1; the t with the smallest median verify error is reported, with the steps it
rests on, for the operator to set
(DSPARK_CALIB_CONTEXT_TAIL). Context-aware pricing here uses the tail the files
record (the engine's; 0 for a context-aware file from before the tail), the plugin's
default for files of stock engines (what context-aware mode would have done), or
``tail_milli``; by the rule the files record (observe schema 1.4's context_tail_rule:
the linear rule for files from before it), or this release's with ``tail_milli``. The
fitted steps (up to twice the mean) are priced alike by both rules.

Prefill chunks (``PrefillCheck``): where the files record the chunks (observe schema
1.1), the prefill-carrying steps' verify is priced both by the KV sum and by
query-context pairs (rules.prefill_context_sum), so served steps say which to serve
with. Context-aware pricing itself prices chunks as the files' context-aware engines did
(DSPARK_CALIB_CONTEXT_CHUNKS, recorded as context_chunks; the KV sum for files from before
it), as the plugin's default for stock engines' files, or as ``chunks`` says.

Analysis only: numpy, no torch, no vllm. The tables are sized to cover every
observed step (a dense table's entry at a size does not depend on its length),
so a step is priced exactly as the engine would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from dspark_calib.pricing.policy import (CHUNK_RULE, CONTEXT_AWARE, DEFAULT_CONTEXT_CHUNKS, DEFAULT_CONTEXT_TAIL_MILLI,
                                         MAX_TAIL_MILLI, TAIL_RULE)
from dspark_calib.pricing.grid import DEFAULT_TOLERANCE, ContextGrid
from dspark_calib.pricing.costs import ContextCosts
from dspark_calib.pricing.rules import prefill_context_sum, tail_context_sum
from dspark_calib.errors import CalibError, display_path
from dspark_calib.observe.step import ABSENT, STALL_MS, decode_steps
from dspark_calib.observe.file import ObservedSteps

SINGLE, AWARE = "single_context", "context_aware"
PRICINGS = (SINGLE, AWARE)
KINDS = ("draft", "verify", "verify_prefill")
VERDICT_KINDS = ("draft", "verify")  # --max-error: the step shapes a profile measures
VLLM_DEFAULT_CONTEXT = 8192
ALL = "all"
MIXED_SPREAD = 1.25  # a decode step is "mixed" when its longest context is >= 1.25 x its mean
MIN_TAIL_STEPS = 20  # fewer mixed steps than this: no tail is suggested
TAIL_STEP_MILLI = 50
CLOCK_BUCKET_MHZ = 50  # an H200 serves at 1515-1575 MHz at its power limit, profiles at up to 1980
# Shape buckets of a decode verify: its requests over the profile's R(N) (ShapeErrors). Above the
# last edge the step is the profile's own shape (up to a few padded slots); at or below the first,
# most requests verify drafts (several tokens each)
FILL_EDGES = (0.5, 0.9)
FILL_LABELS = ("<=0.5", "0.5-0.9", ">0.9")


def fill_buckets(num_reqs: np.ndarray, num_tokens: np.ndarray, profile_num_reqs: int) -> np.ndarray:
    """Each step's shape bucket, an index into FILL_LABELS: its requests over R(N) = min(N, the
    profiling engine's max_num_seqs); (0, .5] -> 0, (.5, .9] -> 1, above -> 2."""
    fill = num_reqs / np.minimum(num_tokens, profile_num_reqs).clip(1)
    return np.searchsorted(np.asarray(FILL_EDGES), fill, side="left")


@dataclass(frozen=True)
class ErrorStats:
    """Absolute % errors of one group of steps under one pricing."""

    n: int
    median_pct: float
    p90_pct: float
    median_signed_pct: float  # > 0: the pricing over-predicts the cost

    @classmethod
    def of(cls, predicted: np.ndarray, measured: np.ndarray) -> "ErrorStats":
        if len(measured) == 0:
            return cls(0, math.nan, math.nan, math.nan)
        with np.errstate(over="ignore", invalid="ignore"):  # a ~0 ms measurement: an infinite error, said as inf
            signed = (predicted - measured) / measured * 100.0
            err = np.abs(signed)
            return cls(len(err), float(np.median(err)), float(np.percentile(err, 90)), float(np.median(signed)))

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class GroupErrors:
    kind: str
    size_bucket: str  # "all" or "lo-hi" (num_reqs for draft, num_target_tokens for verify)
    context_bucket: str  # "all" or "lo-hi" tokens of mean computed context
    errors: dict[str, ErrorStats]  # pricing -> stats

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "size_bucket": self.size_bucket, "context_bucket": self.context_bucket,
                **{p: s.to_dict() for p, s in self.errors.items()}}


@dataclass(frozen=True)
class ClockErrors:
    """One kind's steps whose GPU SM clock, as sampled with the step, fell in one bucket."""

    kind: str
    clock_bucket: str  # "lo-hi" MHz
    power_w: float  # the steps' median power (NaN: none recorded)
    errors: dict[str, ErrorStats]  # pricing -> stats

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "clock_bucket_mhz": self.clock_bucket,
                "median_power_w": _ms(self.power_w),
                **{p: s.to_dict() for p, s in self.errors.items()}}


def _ms(value: float) -> float | None:
    """A measured figure for JSON: None where there is none (NaN)."""
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class Spread:
    """Median, p95 and max of some milliseconds (NaN: none)."""

    median_ms: float
    p95_ms: float
    max_ms: float

    @classmethod
    def of(cls, values: np.ndarray) -> "Spread":
        if len(values) == 0:
            return cls(math.nan, math.nan, math.nan)
        return cls(float(np.median(values)), float(np.percentile(values, 95)), float(values.max()))

    def to_dict(self) -> dict[str, Any]:
        return {k: _ms(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class HostTime:
    """One kind's steps (in one context bucket, or all) whose host interval the files record."""

    kind: str
    context_bucket: str  # "all" or "lo-hi"
    steps: int
    interval: Spread  # step_interval_ms: the previous execute_model call's start to this step's
    unpriced: Spread  # step_interval_ms - forward_ms - drafter_ms: what neither GPU span holds
    host: Spread  # host_ms: this step's execute_model call, start to return (NaN where not recorded)
    stalls: int  # intervals over STALL_MS
    largest_stall_ms: float  # NaN: no stall

    @classmethod
    def of(cls, kind: str, context_bucket: str, c: Any, sel: np.ndarray) -> "HostTime":
        interval = c["step_interval_ms"][sel]
        host = c["host_ms"][sel]
        stalled = interval[interval > STALL_MS]
        return cls(kind, context_bucket, len(interval), Spread.of(interval),
                   Spread.of(interval - c["forward_ms"][sel] - c["drafter_ms"][sel]), Spread.of(host[~np.isnan(host)]),
                   len(stalled), float(stalled.max()) if len(stalled) else math.nan)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "context_bucket": self.context_bucket, "steps": self.steps,
                "interval_ms": self.interval.to_dict(), "unpriced_ms": self.unpriced.to_dict(),
                "host_ms": self.host.to_dict(), "stalls": self.stalls,
                "largest_stall_ms": _ms(self.largest_stall_ms)}


@dataclass(frozen=True)
class BudgetChange:
    compared: int  # steps with both budgets recorded
    changed: int

    @property
    def share(self) -> float | None:
        return self.changed / self.compared if self.compared else None

    def to_dict(self) -> dict[str, Any]:
        return {"compared": self.compared, "changed": self.changed, "share": self.share}


@dataclass(frozen=True)
class TailFit:
    """Decode verifies of mixed-context batches, priced with the tail in use and with the best one."""

    steps: int  # mixed decode steps (max >= MIXED_SPREAD x mean)
    fitted: int  # of which the fit rests on: max <= 2 x mean, where t charges the whole gap
    tail: float  # the tail context-aware pricing used here (files' or --tail)
    verify: ErrorStats  # at that tail
    best_tail: float | None  # None: fewer than MIN_TAIL_STEPS mixed steps
    best_verify: ErrorStats | None
    best_draft: ErrorStats | None  # drafts of the same steps (full CUDA graph) at best_tail
    tail_rule: str  # the rule of `tail` (policy.TAIL_RULES: the files' or, with --tail, this release's)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "fitted": self.fitted, "tail": self.tail, "tail_rule": self.tail_rule,
                "verify": self.verify.to_dict(),
                "best_tail": self.best_tail,
                "best_verify": self.best_verify and self.best_verify.to_dict(),
                "best_draft": self.best_draft and self.best_draft.to_dict(), "spread": MIXED_SPREAD}


@dataclass(frozen=True)
class PrefillCheck:
    """Verifies of steps carrying a prefill chunk, priced three ways (recorded chunks only)."""

    steps: int  # prefill-carrying steps (timed)
    recorded: int  # of which the files record the chunks (observe schema >= 1.1)
    single: ErrorStats | None  # on the recorded ones (None: none recorded)
    kv_sum: ErrorStats | None  # context-aware, chunks priced by the KV sum (as decode requests)
    pairs: ErrorStats | None  # context-aware, chunks priced by query-context pairs
    by_pairs: bool = False  # context-aware pricing here (the engines', or --chunks) priced recorded chunks by pairs
    pair_rule: str = CHUNK_RULE  # the pair price of `pairs` (policy.CHUNK_RULES)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "recorded": self.recorded, "by_pairs": self.by_pairs, "pair_rule": self.pair_rule,
                **{k: (v.to_dict() if v is not None else None)
                   for k, v in (("single_context", self.single), ("kv_sum", self.kv_sum), ("pairs", self.pairs))}}


@dataclass(frozen=True)
class EngineAgreement:
    """Does this pricing reproduce what the context-aware engines predicted for their own steps?
    (Files record predicted_draft_ms / predicted_verify_ms from the tables the engine installed.)
    A difference means the files come from another pricing (an older dspark-calib, another
    table or engine sizes), so the context-aware column below is not what served them."""

    compared: int  # steps (only when every file is a context-aware engine's, priced as recorded)
    verify_equal: int  # within 1e-9 relative
    draft_equal: int

    def to_dict(self) -> dict[str, Any]:
        return {"compared": self.compared, "verify_equal": self.verify_equal, "draft_equal": self.draft_equal}


@dataclass(frozen=True)
class ShapeErrors:
    """One context bucket's decode verifies whose requests fill the profile's R(N) by one share."""

    kind: str
    context_bucket: str
    fill_bucket: str  # FILL_LABELS: the step's num_reqs / R(num_target_tokens)
    errors: dict[str, ErrorStats]  # pricing -> stats

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "context_bucket": self.context_bucket, "fill_bucket": self.fill_bucket,
                **{p: s.to_dict() for p, s in self.errors.items()}}


@dataclass(frozen=True)
class ValidationResult:
    table_hash: str
    files: tuple[str, ...]
    num_steps: int
    profiled_contexts: tuple[int, ...]
    single_context: int
    out_of_range_steps: int  # mean context outside the profiled range (below: extrapolated; above: the longest)
    verify_out_of_range_steps: int  # decode steps whose verify context (verify_context) is outside it
    grid: dict[str, Any]
    overall: tuple[GroupErrors, ...]  # per kind
    by_context: tuple[GroupErrors, ...]  # per kind x context bucket
    groups: tuple[GroupErrors, ...]  # per kind x size bucket x context bucket
    clocked_steps: int  # steps whose SM clock the files record (observe schema >= 1.4, NVML)
    by_clock: tuple[ClockErrors, ...]  # per kind x SM-clock bucket, over the clocked steps
    by_shape: tuple[ShapeErrors, ...]  # decode verifies per context bucket x fill of the profile's R(N)
    interval_steps: int  # steps whose host interval the files record (observe schema >= 1.6)
    host_time: tuple[HostTime, ...]  # per kind (context "all"), then per kind x context bucket
    budget_change: BudgetChange
    tail_fit: TailFit
    prefill: PrefillCheck
    engine: EngineAgreement

    def to_dict(self) -> dict[str, Any]:
        return {
            "table_hash": self.table_hash, "files": list(self.files), "num_steps": self.num_steps,
            "profiled_contexts": list(self.profiled_contexts), "single_context": self.single_context,
            "out_of_range_steps": self.out_of_range_steps,
            "verify_out_of_range_steps": self.verify_out_of_range_steps, "grid": self.grid,
            "overall": [g.to_dict() for g in self.overall],
            "by_context": [g.to_dict() for g in self.by_context],
            "groups": [g.to_dict() for g in self.groups],
            "clocked_steps": self.clocked_steps, "by_clock": [g.to_dict() for g in self.by_clock],
            "by_shape": [g.to_dict() for g in self.by_shape],
            "host_time": {"steps": self.interval_steps, "stall_ms": STALL_MS,
                          "groups": [g.to_dict() for g in self.host_time]},
            "budget_change": self.budget_change.to_dict(), "tail_fit": self.tail_fit.to_dict(),
            "prefill": self.prefill.to_dict(), "engine_agreement": self.engine.to_dict(),
        }


@dataclass(frozen=True)
class PricedSteps:
    """The observed steps priced as the engines that wrote them priced them (price_steps)."""

    costs: ContextCosts
    grid: ContextGrid
    single: int  # the single-context pricing's context
    tail: int  # thousandths
    tail_rule: str  # policy.TAIL_RULES
    chunks: bool  # chunks priced by query-context pairs
    rule: str  # their pair price
    as_recorded: bool  # priced with the files' own settings (no option overrode them)
    priced: Callable[..., tuple[np.ndarray, np.ndarray]]  # (tail, by_pairs=chunks) -> (draft, verify) ms per step
    predicted: dict[str, dict[str, np.ndarray]]  # kind -> pricing -> ms per step
    measured: dict[str, np.ndarray]  # kind -> ms per step
    sizes: dict[str, np.ndarray]  # kind -> the curve size pricing it (num_reqs, num_target_tokens)
    steps: dict[str, np.ndarray]  # kind -> which steps are of that kind (timed)
    single_verify: np.ndarray
    aware_draft: np.ndarray
    aware_verify: np.ndarray


def pow2_bucket(values: np.ndarray, floor: int = 1) -> np.ndarray:
    """Lower bound of each value's power-of-two bucket [2^k, 2^(k+1)); values below floor: 0."""
    v = np.asarray(values, dtype=np.int64)
    out = np.zeros(len(v), dtype=np.int64)
    pos = v >= max(floor, 1)
    out[pos] = 1 << (np.log2(v[pos]).astype(np.int64))
    # float log2 can land one below at exact powers of two for huge ints: fix up
    low = out[pos] * 2 <= v[pos]
    out[np.flatnonzero(pos)[low]] *= 2
    return out


def bucket_label(lo: int, floor: int) -> str:
    if lo == 0:
        return f"0-{floor - 1}"
    return f"{lo}-{2 * lo - 1}"


def _recorded(observed: ObservedSteps, key: str, default: int) -> int:
    values = {getattr(m, key) for m in observed.metadata}
    if len(values) == 1:
        (value,) = values
        if value is not None:
            return value
    return int(default)


def _recorded_setting(observed: ObservedSteps, field: str, default: Any, what: str, option: str,
                      show: Any = str, among: Any = None) -> Any:
    """One setting of the pricing policy the context-aware engines that wrote these files priced with
    (PricingPolicy.from_metadata: a file that predates the key reads as what such engines did);
    default (this release's engine default) when none was context-aware. Engines that disagree are
    an error: the files must be validated apart, or with the option that sets it."""
    first: dict[Any, str] = {}  # each value -> the first file recording it, to name in an error
    for path, meta in zip(observed.files, observed.metadata):
        policy = meta.policy() if meta.mode == CONTEXT_AWARE else None
        if policy is not None and (among is None or among(policy)):
            first.setdefault(getattr(policy, field), path)
    if len(first) > 1:
        shown = ", ".join(f"{show(v)} in {display_path(first[v])}" for v in sorted(first))
        raise CalibError(f"the observe files come from engines with different {what} ({shown}): validate them "
                         f"apart, or price them all with {option}")
    return next(iter(first)) if first else default


def recorded_tail(observed: ObservedSteps) -> int:
    """The tail (thousandths) the context-aware engines that wrote these files priced with."""
    return _recorded_setting(observed, "tail_milli", DEFAULT_CONTEXT_TAIL_MILLI, "tails", "--tail",
                             lambda v: f"{v / MAX_TAIL_MILLI:g}")


def recorded_tail_rule(observed: ObservedSteps) -> str:
    """The tail rule (policy.TAIL_RULES) of the context-aware engines that priced these files with a
    tail; this release's when none did."""
    return _recorded_setting(observed, "tail_rule", TAIL_RULE, "tail rules", "--tail", among=lambda p: p.tail_milli > 0)


def recorded_chunks(observed: ObservedSteps) -> bool:
    """Did the context-aware engines that wrote these files price prefill chunks by their pairs?"""
    return _recorded_setting(observed, "chunks", DEFAULT_CONTEXT_CHUNKS, "chunk pricing", "--chunks or --no-chunks")


def recorded_chunk_rule(observed: ObservedSteps) -> str:
    """The pair price (policy.CHUNK_RULES) of the context-aware engines that priced chunks by
    pairs in these files; this release's when none did."""
    return _recorded_setting(observed, "chunk_rule", CHUNK_RULE, "chunk pricing rules", "--chunks",
                             among=lambda p: p.chunks)


def recorded_extrapolate_to(observed: ObservedSteps, table: Any) -> int:
    """How far above its longest profiled context the context-aware engines that wrote these files
    priced (their max_model_len; 0 in files before the key: the longest context's costs). When
    none was context-aware, this release's engine: up to the engine's max_model_len (recorded by
    newer files, else the table's), and never below the longest observed context."""
    longest = int(observed.columns["context_max"].max()) if len(observed) else 0
    engine_max = _recorded(observed, "max_model_len", table.fingerprint.max_model_len or 0)
    return _recorded_setting(observed, "extrapolate_to", max(engine_max, longest), "context coverage",
                             "one engine's files at a time")


def price_steps(table: Any, observed: ObservedSteps, *, single_context: int | None = None,
                tail_milli: int | None = None, chunks: bool | None = None,
                grid_tolerance: float = DEFAULT_TOLERANCE) -> PricedSteps:
    """Every observed step priced both ways, as the engines that wrote the files priced it (see
    the module docstring): what validate compares, and what calibrate fits a correction on."""
    if len(observed) == 0:
        shown = ", ".join(display_path(f) for f in observed.files[:3]) + (", ..." if len(observed.files) > 3 else "")
        raise CalibError(f"no observed steps to validate against in {shown or 'no file'}")
    fp = table.fingerprint
    c = observed.columns
    # The engine's sizes when the files recorded them (its grid is then this one, point for point),
    # else the table's; never below an observed step.
    max_reqs = max(_recorded(observed, "max_num_reqs", fp.max_num_seqs), int(c["num_reqs"].max()))
    max_tokens = max(_recorded(observed, "max_num_batched_tokens", fp.max_num_batched_tokens),
                     int(c["num_target_tokens"].max()))
    # R(N) of verify_context is the profiling engine's max_num_seqs (the table's), whatever the files say
    # the contexts the engines priced (the probe may leave some of the table's out of their grids)
    priced = _recorded_setting(observed, "contexts", (), "priced contexts", "one engine's files at a time",
                               lambda v: ",".join(map(str, v)) or "all")
    if priced and not set(priced) <= set(table.curves):
        raise CalibError(f"the observe files priced contexts {', '.join(map(str, priced))}, not all in this table "
                         f"({', '.join(map(str, sorted(table.curves)))}): validate them with the table they served")
    curves = {c: table.curves[c] for c in priced} if priced else table.curves
    costs = ContextCosts(curves, max_reqs, max_tokens, int(fp.cudagraph_limit),
                         profile_num_reqs=min(int(fp.max_num_seqs), max_tokens),
                         extrapolate_to=recorded_extrapolate_to(observed, table))
    grid = ContextGrid(costs, tolerance=grid_tolerance)
    wanted = VLLM_DEFAULT_CONTEXT if single_context is None else int(single_context)
    single = min(costs.contexts, key=lambda x: (abs(x - wanted), -x))  # ties: the longer, as the load decision
    single_draft, single_verify = costs.tables[single]

    num_reqs, num_tokens = c["num_reqs"], c["num_target_tokens"]
    tail = recorded_tail(observed) if tail_milli is None else int(tail_milli)
    tail_rule = recorded_tail_rule(observed) if tail_milli is None else TAIL_RULE
    if not 0 <= tail <= MAX_TAIL_MILLI:
        raise CalibError(f"the tail must be between 0 and 1, got {tail / MAX_TAIL_MILLI:g}")

    as_recorded = tail_milli is None and chunks is None
    # The pair price of pricing by pairs, in use or as the other pricing: explicit --chunks /
    # --no-chunks, this release's; else the files' engines' (this release's too unless some priced
    # by pairs, and then recorded_chunks is true or refuses the mix)
    rule = recorded_chunk_rule(observed) if chunks is None else CHUNK_RULE
    chunks = recorded_chunks(observed) if chunks is None else bool(chunks)
    chunked = c["prefill_pairs"] > 0  # recorded (1.1) and carrying a chunk
    non_draft = num_tokens - c["draft_budget"]

    def priced(t: int, by_pairs: bool = chunks) -> tuple[np.ndarray, np.ndarray]:
        """As the engine prices: drafts and verify at the KV sum raised by tail t, and with by_pairs
        a chunk step's verify at prefill_context_sum of it, at the pair price rule (N: the
        non-draft tokens, as the first rule took); the tail by tail_rule."""
        s = tail_context_sum(c["context_sum"], c["context_max"], num_reqs, t, tail_rule)
        v = None
        if by_pairs and chunked.any():
            ratio = costs.chunk_ratio(rule, non_draft)
            v = np.where(chunked, prefill_context_sum(s, c["prefill_context_sum"], c["prefill_pairs"], *ratio), s)
        return grid.price(s, num_reqs, num_tokens, verify_sum=v)

    aware_draft, aware_verify = priced(tail)
    verify = {SINGLE: single_verify[num_tokens], AWARE: aware_verify}
    predicted = {"draft": {SINGLE: single_draft[num_reqs], AWARE: aware_draft},
                 "verify": verify, "verify_prefill": verify}
    measured = {"draft": c["drafter_ms"], "verify": c["forward_ms"], "verify_prefill": c["forward_ms"]}
    sizes = {"draft": num_reqs, "verify": num_tokens, "verify_prefill": num_tokens}
    decode = decode_steps(c)
    timed = c["forward_ms"] > 0
    steps = {"draft": c["full_cudagraph"] & (c["drafter_ms"] > 0), "verify": timed & decode,
             "verify_prefill": timed & ~decode}
    return PricedSteps(costs, grid, single, tail, tail_rule, chunks, rule, as_recorded, priced, predicted, measured,
                       sizes, steps, single_verify[num_tokens], aware_draft, aware_verify)


def validate(table: Any, observed: ObservedSteps, *, single_context: int | None = None, tail_milli: int | None = None,
             chunks: bool | None = None, grid_tolerance: float = DEFAULT_TOLERANCE, context_floor: int = 1024) -> ValidationResult:
    """Compare the table's predictions with observed steps (see the module docstring)."""
    p = price_steps(table, observed, single_context=single_context, tail_milli=tail_milli, chunks=chunks,
                    grid_tolerance=grid_tolerance)
    c, costs, grid, steps, predicted, measured, sizes = (observed.columns, p.costs, p.grid, p.steps, p.predicted,
                                                         p.measured, p.sizes)
    priced, tail, chunks, rule, aware_draft, aware_verify = p.priced, p.tail, p.chunks, p.rule, p.aware_draft, p.aware_verify
    num_reqs, num_tokens = c["num_reqs"], c["num_target_tokens"]
    ctx = -(-c["context_sum"] // num_reqs)  # ceil(mean), exactly as context-aware mode prices drafts
    ctx_bucket = pow2_bucket(c["context_mean"].astype(np.int64), context_floor)
    clocked = ~np.isnan(c["gpu_sm_mhz"])
    clock_bucket = (np.nan_to_num(c["gpu_sm_mhz"]) // CLOCK_BUCKET_MHZ).astype(np.int64) * CLOCK_BUCKET_MHZ

    intervals = ~np.isnan(c["step_interval_ms"])
    fill_bucket = fill_buckets(num_reqs, num_tokens, costs.profile_num_reqs)

    overall, by_context, groups, by_clock, by_shape, host_time = [], [], [], [], [], []
    for kind in KINDS:
        keep = steps[kind]
        size_bucket = pow2_bucket(sizes[kind])

        def stats(mask: np.ndarray) -> dict[str, ErrorStats]:
            sel = keep & mask
            return {how: ErrorStats.of(predicted[kind][how][sel], measured[kind][sel]) for how in PRICINGS}

        if not keep.any() and kind == "verify_prefill":
            continue
        overall.append(GroupErrors(kind, ALL, ALL, stats(np.ones(len(keep), dtype=bool))))
        for cb in np.unique(ctx_bucket[keep]):
            label = bucket_label(int(cb), context_floor)
            by_context.append(GroupErrors(kind, ALL, label, stats(ctx_bucket == cb)))
            for sb in np.unique(size_bucket[keep & (ctx_bucket == cb)]):
                groups.append(GroupErrors(kind, bucket_label(int(sb), 1), label,
                                          stats((ctx_bucket == cb) & (size_bucket == sb))))
        for lo in np.unique(clock_bucket[keep & clocked]):
            sel = clocked & (clock_bucket == lo)
            power = c["gpu_power_w"][keep & sel]
            power = power[~np.isnan(power)]
            by_clock.append(ClockErrors(kind, f"{lo}-{lo + CLOCK_BUCKET_MHZ - 1}",
                                        float(np.median(power)) if len(power) else math.nan, stats(sel)))
        if kind == "verify":
            by_shape += [ShapeErrors(kind, bucket_label(int(cb), context_floor), FILL_LABELS[fb],
                                     stats((ctx_bucket == cb) & (fill_bucket == fb)))
                         for cb in np.unique(ctx_bucket[keep]) for fb in np.unique(fill_bucket[keep & (ctx_bucket == cb)])]
        timed = keep & intervals
        if timed.any():
            host_time.append(HostTime.of(kind, ALL, c, timed))
            host_time.extend(HostTime.of(kind, bucket_label(int(cb), context_floor), c, timed & (ctx_bucket == cb))
                             for cb in np.unique(ctx_bucket[timed]))

    mixed = steps["verify"] & (c["context_max"] * num_reqs >= MIXED_SPREAD * c["context_sum"])
    now = ErrorStats.of(aware_verify[mixed], c["forward_ms"][mixed])  # the pricing above, not priced again
    # t is the mixes' coefficient: fitted where it charges the whole gap (rules.tail_context_sum), not on
    # batches whose longest request is past twice the mean, where the rule only bounds what it charges
    near = mixed & (c["context_max"] * num_reqs <= 2 * c["context_sum"])
    tail_fit = _fit_tail(priced, tail, p.tail_rule, now, int(mixed.sum()), near, near & steps["draft"], c)
    prefill = _check_prefill(priced, tail, chunks, steps["verify_prefill"], p.single_verify, aware_verify, c,
                             rule)

    both = (c["budget_static"] != ABSENT) & (c["budget_context_aware"] != ABSENT)
    changed = int((c["budget_static"][both] != c["budget_context_aware"][both]).sum())
    lo, hi = costs.contexts[0], costs.contexts[-1]
    vctx = -(-c["context_sum"] // np.minimum(num_tokens, costs.profile_num_reqs).clip(1))
    return ValidationResult(
        table_hash=str(getattr(table, "content_hash", "")), files=observed.files, num_steps=len(observed),
        profiled_contexts=costs.contexts, single_context=p.single,
        out_of_range_steps=int(((ctx < lo) | (ctx > hi)).sum()),
        verify_out_of_range_steps=int((steps["verify"] & ((vctx < lo) | (vctx > hi))).sum()), grid=grid.describe(),
        overall=tuple(overall), by_context=tuple(by_context), groups=tuple(groups),
        clocked_steps=int(clocked.sum()), by_clock=tuple(by_clock), by_shape=tuple(by_shape),
        interval_steps=int(intervals.sum()), host_time=tuple(host_time),
        budget_change=BudgetChange(int(both.sum()), changed), tail_fit=tail_fit, prefill=prefill,
        engine=_agreement(observed, p.as_recorded, aware_draft, aware_verify),
    )


def _agreement(observed: ObservedSteps, as_recorded: bool, draft: np.ndarray, verify: np.ndarray) -> EngineAgreement:
    c = observed.columns
    if not as_recorded or any(m.mode != CONTEXT_AWARE for m in observed.metadata):
        return EngineAgreement(0, 0, 0)

    def equal(a: np.ndarray, b: np.ndarray) -> int:
        return int(np.isclose(a, b, rtol=1e-9, atol=0.0).sum())

    return EngineAgreement(len(observed), equal(verify, c["predicted_verify_ms"]), equal(draft, c["predicted_draft_ms"]))


def _check_prefill(priced: Any, tail: int, chunks: bool, steps: np.ndarray, single: np.ndarray,
                   aware: np.ndarray, c: dict, pair_rule: str) -> PrefillCheck:
    """The prefill-carrying steps whose chunks are recorded, priced single-context, by the KV sum
    and by query-context pairs (rules.prefill_context_sum), the tail in use under both (aware:
    the context-aware verify already priced, chunks as in use; only the other pricing is new)."""
    sel = steps & (c["prefill_tokens"] != ABSENT)
    if not sel.any():  # no chunk recorded: whatever the setting, the KV sum is what priced them
        return PrefillCheck(int(steps.sum()), 0, None, None, None, False)
    measured = c["forward_ms"][sel]
    in_use = ErrorStats.of(aware[sel], measured)
    other = ErrorStats.of(priced(tail, not chunks)[1][sel], measured)
    kv_sum, pairs = (other, in_use) if chunks else (in_use, other)
    return PrefillCheck(int(steps.sum()), int(sel.sum()), ErrorStats.of(single[sel], measured), kv_sum, pairs,
                        chunks, pair_rule)


def _fit_tail(priced: Any, tail: int, rule: str, now: ErrorStats, steps: int, mixed: np.ndarray,
              mixed_drafts: np.ndarray, c: dict) -> TailFit:
    """The tail (0, 0.05, ..., 1) with the smallest median verify error on the mixed decode steps
    given (now: the errors of every mixed decode step, steps of them, at the tail in use)."""
    def errors(t: int) -> tuple[ErrorStats, ErrorStats]:
        draft, verify = priced(t)
        return (ErrorStats.of(verify[mixed], c["forward_ms"][mixed]),
                ErrorStats.of(draft[mixed_drafts], c["drafter_ms"][mixed_drafts]))

    n = int(mixed.sum())
    if n < MIN_TAIL_STEPS:
        return TailFit(steps, n, tail / MAX_TAIL_MILLI, now, None, None, None, rule)
    fits = {t: errors(t) for t in range(0, MAX_TAIL_MILLI + 1, TAIL_STEP_MILLI)}
    best = min(fits, key=lambda t: (fits[t][0].median_pct, t))  # ties: the smaller tail
    return TailFit(steps, n, tail / MAX_TAIL_MILLI, now, best / MAX_TAIL_MILLI, *fits[best], rule)


def max_error_exceeded(result: ValidationResult, pct: float, *, pricing: str = AWARE) -> bool:
    """The CI / fleet verdict: is the median error of drafts or decode verifies at any context
    bucket above pct? (Prefill-carrying steps: reported, not judged; see the module docstring.)

    Per context bucket, not overall: a pricing that is right on average can be far
    off at short or long contexts, which is exactly what context-awareness fixes.
    """
    if pricing not in PRICINGS:
        raise CalibError(f"pricing must be one of {', '.join(PRICINGS)}, got {pricing!r}")
    return any(g.kind in VERDICT_KINDS and g.errors[pricing].n and g.errors[pricing].median_pct > pct
               for g in result.by_context)

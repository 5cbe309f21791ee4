"""Cost tables priced at any context length, from a table's per-context curves.

vLLM prices every step with curves profiled at one context length. A table may
hold several; this module turns them into the dense (draft, verify) tables vLLM
indexes, at any context L:

* ``ContextCosts.at(L)``: per size, linear interpolation in context between the
  dense tables of the two nearest profiled contexts (attention reads every
  request's KV cache, so the verify cost is close to linear in context). Each
  profiled context's dense table comes from ``fit.build_cost_tables`` (vLLM's
  own rule), so the step function below the capture limit, the interpolation
  above it and the extrapolation past the last size all stay vLLM's. At a
  profiled context the result IS that table (bit-identical); above the
  profiled range it is the longest context's table, below it the line through
  the two shortest extended towards context 0 (its context-0 point kept between
  vLLM's floor and the shortest context's costs), each with an ``OutOfRange``
  warning object (never a print: the caller decides
  where it goes). Below the range is where the H200 data says so: see
  ContextCosts.
* ``ContextGrid``: the same, precomputed at load on a grid of contexts (from 0),
  so a serving step gets its tables with two row lookups (no allocation).

Grid choice (see ``ContextGrid``): points are placed so that rounding a context
up to the next point changes no table entry by more than ``tolerance`` (0.5 %
by default) relative to the exact interpolation. A uniform grid cannot do that
cheaply: on the H200 Qwen3-8B curves a 256-token step is a 12 % cost change at
context 1024 (verify at 256 tokens costs 16.8 ms there and rises ~8 us per
context token) but 1.5 % at 16384. Error-driven spacing is dense where the
cost is small and sparse where it is large: 0..16384 takes 583 points, and
the KV-sum rows for verify sizes below max_num_reqs (next section) 2310 (44 MiB
in all at max_num_batched_tokens 8192, built in 0.2-0.3 s; a 1 % tolerance would
halve both). Memory is capped by ``max_bytes`` (64 MiB by default) for the
context rows plus a quarter of it for the KV-sum rows: past either the
tolerance is loosened to fit and ``max_rel_error`` says what was achieved.

Which context a serving step is priced at (``ContextGrid.step_tables``)
--------------------------------------------------------------------
A table's point (N tokens, context L) was timed on vLLM's profiling dummy
batch: ``profile_requests(N)`` = min(N, max_num_reqs) requests, each with L
tokens of KV (``_dummy_run``, ``set_dummy_context``), so its attention read
R(N) x L KV tokens. A serving step of n requests reads the sum S of their
computed tokens, whatever N it verifies. So the step's verify cost at N is the
table's at ``verify_context(S, N)`` = S / R(N), not at the mean S / n: for
N >= max_num_reqs that is S / max_num_reqs, below it S / N. The draft curve is
keyed by requests (profiled with n requests x L), so drafts are priced at the
mean. Pricing verify at the mean over-charged every step whose N exceeds its
requests: on the H200 run (2026-11-30) 32 requests at 16k verifying ~150
tokens were predicted 45 % too slow at the mean, 4 % at S / R(N), and the
context-aware arm picked budgets 5 % smaller and lost 9 % throughput.

Mixed contexts: the tail term (``tail_context_sum``; the plugin's default t = 0.2)
---------------------------------------------------------------------------------
The profile's dummy batches give every request the same context. A serving batch
that mixes short and long requests reads the same S but runs slower: the long
requests' KV splits finish last. On the H200 (2026-11-30, two runs, two hosts, six
arms) a 1k/8k/16k mix ran 8-12 % slower than priced at its S (drafts up to 9 %);
pricing it at S' = S + t (n max - S), i.e. at mean + t (max - mean), with t = 0.25
left +0.4 ... +3.8 %, and moved uniform batches (max ~ mean) by under 1 %. t is the
kernel's, not the table's: it is read from served steps (``validate`` fits it) and
set by the operator (DSPARK_CALIB_CONTEXT_TAIL; 0.2 by default since it was served on the
H200, 2026-12-01: mixed decode steps 10.0 % -> 1.4 % median error), in thousandths so
that every rank computes the same integer S'.

Prefill chunks: priced by query-context pairs (``prefill_context_sum``)
----------------------------------------------------------------------
S / R(N) holds for decode requests (a few queries each, memory-bound: the step reads
their KV once). A prefill chunk of q tokens at context c does q x (c + q) query-context
pairs of attention on only c + q tokens of KV, compute-bound, and S / R(N) prices it as
nearly free: on the H200 steps carrying an 8k chunk ran 18-31 % slower than that pricing
said. The profile's largest dummy step (N_max tokens: the largest verify size profiled, the
profiling engine's max_num_batched_tokens, whatever the serving engine's; R = R(N_max)
requests, at context L) does N_max x L pairs while reading R x L tokens of KV,
and a chunk's pair is priced as a pair costs there: R / N_max KV tokens (1/32 on the
H200 engine: 256 requests, 8192 tokens), so ``prefill_context_sum`` = (S - S_p) +
ceil(R P / N_max), P the chunks' pairs, S_p their computed tokens. A decode-only step
(P = 0) is priced exactly as before.

The first rule (CHUNK_RULE_PER_STEP, served until 2026-12-01) took the ratio at the step's
own N, R(N) / N; it equals this one at N_max, where the 8k-chunk steps are, but a short
chunk beside a few decodes (N ~ 500) was worth half a KV token a pair and priced up to 3.7x
its cost (the dummy step of that size reads 256 requests' KV; the chunk reads one). On the
H200 files of 2026-12-01 (seven arms, two hosts, 727 chunk steps, both rules re-priced
offline, each arm at its own tail) this rule gives median 2.6-3.9 % per arm against
2.7-4.4 %, p90 5.8-7.2 % against 6.8-7.5 %, the steps of 512-1023 tokens -2 to -11 % against
+112 to +267 %, and prices the steps of 1-4k tokens 9-16 % low (the first rule: -10 to +55 %).
Files record which rule priced them (observe metadata ``context_chunk_rule``; absent: the
first), so ``validate`` reproduces any engine.

Only numpy here: ``validate`` prices observed steps with this, and it must
not pull in torch or vllm.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from dspark_calib.errors import CalibError
from dspark_calib.fit import DRAFT_FLOOR_MS, VERIFY_FLOOR_MS, build_cost_tables

DEFAULT_TOLERANCE = 0.005  # grid rounding error bound, relative to the exact interpolation
DEFAULT_MAX_BYTES = 64 << 20

Tables = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class OutOfRange:
    """A context outside the profiled range: above it, priced at the longest profiled context;
    below it, extrapolated linearly from the two shortest (see ContextCosts)."""

    context_len: int
    used_context: int
    profiled: tuple[int, ...]
    extrapolated: bool = False  # below the range, on the line through the two shortest

    def __str__(self) -> str:
        side = "below" if self.context_len < self.used_context else "above"
        how = (f"extrapolated linearly from contexts {self.profiled[0]} and {self.profiled[1]}" if self.extrapolated
               else f"priced at context {self.used_context}")
        return f"context {self.context_len} is {side} the profiled range {self.profiled[0]}..{self.profiled[-1]}: {how}"


@dataclass(frozen=True, eq=False)
class PricedTables:
    """Dense tables at one context: ``weight`` of ``upper`` blended with ``lower``."""

    draft: np.ndarray
    verify: np.ndarray
    context_len: int
    lower: int
    upper: int
    weight: float  # 0: lower's table, 1: upper's
    warning: OutOfRange | None = None

    def as_tuple(self) -> Tables:
        return self.draft, self.verify


def _vllm_curves(pair: Any) -> tuple[list, list]:
    """A CurvePair (table.curves values) or vLLM's (draft, verify) list pair."""
    if hasattr(pair, "as_vllm"):
        return pair.as_vllm()
    draft, verify = pair
    return list(draft), list(verify)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def profile_requests(num_tokens: int, max_num_reqs: int) -> int:
    """Requests in vLLM's profiling dummy batch of num_tokens tokens: ``_dummy_run``'s
    ``min(num_tokens, self.max_num_reqs)`` (its speculator bound, max_num_batched_tokens //
    num_query_per_req, is above max_num_reqs for DSpark)."""
    return min(int(num_tokens), int(max_num_reqs))


def verify_context(context_sum: int, num_tokens: int, max_num_reqs: int) -> int:
    """The profiled context whose verify cost at num_tokens matches a step reading context_sum KV
    tokens: ceil(S / R(N)) (see the module docstring). Integers only: identical on every rank."""
    return -(-int(context_sum) // max(1, profile_requests(num_tokens, max_num_reqs)))


MAX_TAIL_MILLI = 1000  # t = 1: every request priced at the batch's longest context


def tail_context_sum(context_sum: Any, context_max: Any, num_reqs: Any, tail_milli: int) -> Any:
    """The KV sum a step is priced at with the mixed-context tail (module docstring):
    S + t (n max - S), t = tail_milli / 1000, rounded down. Integers only (identical on every
    rank); scalars or numpy arrays alike; tail_milli 0 returns S unchanged."""
    if not tail_milli:
        return context_sum
    return context_sum + (tail_milli * (context_max * num_reqs - context_sum)) // MAX_TAIL_MILLI


CHUNK_RULE = "largest-step"  # a pair at R(N_max) / N_max KV tokens (the module docstring)
CHUNK_RULE_PER_STEP = "per-step"  # the first rule: R(N) / N at the step's own N (files before 2026-12-01)
CHUNK_RULES = (CHUNK_RULE, CHUNK_RULE_PER_STEP)


def prefill_context_sum(context_sum: Any, chunk_context_sum: Any, chunk_pairs: Any, kv_reqs: Any,
                        kv_tokens: Any) -> Any:
    """The KV sum a step carrying prefill chunks is priced at (module docstring): the decode
    requests' own KV plus the chunks' query-context pairs P at kv_reqs / kv_tokens KV tokens a
    pair, (S - S_p) + ceil(kv_reqs P / kv_tokens); chunk_kv_ratio gives the two for a rule.
    Integers only; scalars or numpy arrays alike; P = 0 returns S."""
    out = context_sum - chunk_context_sum + -(-(kv_reqs * chunk_pairs) // kv_tokens)
    if type(out) is int:  # the engine's plain integers (once per chunk step): no numpy call
        return out
    return int(out) if np.ndim(out) == 0 else out


def chunk_kv_ratio(rule: str, profile_num_reqs: int, profile_num_tokens: int, num_tokens: Any = None) -> tuple[Any, Any]:
    """(kv_reqs, kv_tokens) of prefill_context_sum under a chunk rule: the profile's largest step
    (CHUNK_RULE; constants), or the step's own N (CHUNK_RULE_PER_STEP; num_tokens: the steps'
    non-draft tokens, as the engines of that rule took them)."""
    if rule == CHUNK_RULE:
        return min(int(profile_num_tokens), int(profile_num_reqs)), int(profile_num_tokens)
    if rule == CHUNK_RULE_PER_STEP:
        tokens = np.maximum(np.asarray(num_tokens, dtype=np.int64), 1)
        return np.minimum(tokens, int(profile_num_reqs)), tokens
    raise CalibError(f"unknown chunk pricing rule {rule!r} (known: {', '.join(CHUNK_RULES)})")


def blend(lower: np.ndarray, upper: np.ndarray, weight: float | np.ndarray) -> np.ndarray:
    """lower + weight * (upper - lower), kept within [min, max] of the two per entry.

    This form (not (1-w)*lo + w*hi) is monotone in ``weight`` entry by entry under
    float rounding, and the clip keeps every entry between its neighbours, so a
    grid over increasing contexts is increasing wherever the profiled tables are.
    """
    out = upper - lower
    out *= weight
    out += lower
    np.clip(out, np.minimum(lower, upper), np.maximum(lower, upper), out=out)
    return out


class ContextCosts:
    """The dense tables of every profiled context, for one engine's table sizes.

    ``curves``: context_len -> CurvePair (``CostTable.curves``) or vLLM's
    (draft, verify) list pair. The sizes are the engine's (the manager's
    req_states and ``_cudagraph_limit``), so a profiled context's tables are
    exactly what vLLM's set_cost_curves would build from its curves.
    """

    def __init__(self, curves: Mapping[int, Any], max_num_reqs: int, max_num_batched_tokens: int,
                 cudagraph_limit: int = 0, *, profile_num_reqs: int | None = None):
        if not curves:
            raise CalibError("no curves to price contexts with")
        self.contexts: tuple[int, ...] = tuple(sorted(int(c) for c in curves))
        if self.contexts[0] < 0:
            raise CalibError(f"negative context length {self.contexts[0]}")
        self.max_num_reqs = int(max_num_reqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.cudagraph_limit = int(cudagraph_limit)
        # R(N)'s cap in verify_context: the max_num_seqs of the engine that profiled the curves (the
        # loader requires the serving engine's to be equal; validate may see files from another)
        self.profile_num_reqs = int(profile_num_reqs or max_num_reqs)
        if self.max_num_reqs > self.max_num_batched_tokens:
            raise CalibError(f"max_num_reqs {self.max_num_reqs} exceeds max_num_batched_tokens "
                             f"{self.max_num_batched_tokens} (vLLM refuses such an engine)")
        if not 1 <= self.profile_num_reqs <= self.max_num_batched_tokens:
            raise CalibError(f"profiled max_num_seqs {self.profile_num_reqs} is outside 1..max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}")
        by_ctx = {int(c): p for c, p in curves.items()}
        self.tables: dict[int, Tables] = {}
        # N_max of the chunk pair price: the largest verify size profiled (the profile's largest
        # dummy step), never the serving engine's max_num_batched_tokens, which may be smaller
        self.profile_num_tokens = 0
        for ctx in self.contexts:
            draft_curve, verify_curve = _vllm_curves(by_ctx[ctx])
            self.profile_num_tokens = max(self.profile_num_tokens, *(int(n) for n, _ in verify_curve))
            draft, verify = build_cost_tables(draft_curve, verify_curve, self.max_num_reqs,
                                              self.max_num_batched_tokens, self.cudagraph_limit)
            self.tables[ctx] = (_readonly(draft), _readonly(verify))
        # The interpolation's knots: the profiled contexts and, below the shortest, context 0 with
        # the line through the two shortest extended to it. Attention cost is linear in the KV
        # read, and below the range that line measured 10x closer than the shortest context's
        # flat costs on real H200 serving steps (verify 0.6 % against 5.8 % median; drafts 1.2 %
        # against 2.4 %). Guards, since profiling noise on a short span would be stretched: only
        # when the two shortest are at least c0 apart (the line reaches 0 within its own span);
        # the context-0 table is kept between vLLM's floor and the shortest context's, and made
        # non-decreasing in size as vLLM makes every table. Above the range: the longest
        # context's costs (profile up to the engine's max_model_len: `profile` does by default).
        self.knots: tuple[int, ...] = self.contexts
        c0, c1 = (self.contexts + (0,))[:2]
        self.extrapolates_below = len(self.contexts) > 1 and 0 < c0 <= c1 - c0
        if self.extrapolates_below:
            (d0, v0), (d1, v1) = self.tables[c0], self.tables[c1]
            zero = []
            for lo, hi, floor in ((d0, d1, DRAFT_FLOOR_MS), (v0, v1, VERIFY_FLOOR_MS)):
                z = np.clip(lo - (hi - lo) * (c0 / (c1 - c0)), floor, lo)
                zero.append(_readonly(np.maximum.accumulate(z)))  # <= lo still: lo is non-decreasing
            self.tables[0] = (zero[0], zero[1])
            self.knots = (0, *self.contexts)

    @classmethod
    def from_table(cls, table: Any, *, max_num_reqs: int | None = None, max_num_batched_tokens: int | None = None,
                   cudagraph_limit: int | None = None) -> "ContextCosts":
        """A CostTable's curves at its own engine's sizes (or the given ones, as CostTable.dense_tables)."""
        fp = table.fingerprint
        return cls(table.curves, max_num_reqs or fp.max_num_seqs, max_num_batched_tokens or fp.max_num_batched_tokens,
                   fp.cudagraph_limit if cudagraph_limit is None else cudagraph_limit,
                   profile_num_reqs=min(fp.max_num_seqs, max_num_batched_tokens or fp.max_num_batched_tokens))

    def chunk_ratio(self, rule: str = CHUNK_RULE, num_tokens: Any = None) -> tuple[Any, Any]:
        """(kv_reqs, kv_tokens) of prefill_context_sum under rule, for these curves (chunk_kv_ratio)."""
        return chunk_kv_ratio(rule, self.profile_num_reqs, self.profile_num_tokens, num_tokens)

    def bracket(self, context_len: int) -> tuple[int, int, float]:
        """(lower, upper, weight) for context_len: between two knots; above the range, the longest."""
        return self.bracket_of(self.knots, context_len)

    @staticmethod
    def bracket_of(ctxs: Sequence[int], context_len: int) -> tuple[int, int, float]:
        if context_len <= ctxs[0]:
            return ctxs[0], ctxs[0], 0.0
        if context_len >= ctxs[-1]:
            return ctxs[-1], ctxs[-1], 0.0
        hi = int(np.searchsorted(ctxs, context_len, side="left"))
        lo_ctx, hi_ctx = ctxs[hi - 1], ctxs[hi]
        if context_len == hi_ctx:
            return hi_ctx, hi_ctx, 0.0
        return lo_ctx, hi_ctx, (context_len - lo_ctx) / (hi_ctx - lo_ctx)

    def at(self, context_len: int) -> PricedTables:
        """Dense (draft, verify) tables priced at context_len (read-only arrays)."""
        context_len = int(context_len)
        lo, hi, w = self.bracket(context_len)
        warning = None
        if not self.contexts[0] <= context_len <= self.contexts[-1]:
            warning = OutOfRange(context_len, min(max(context_len, self.contexts[0]), self.contexts[-1]),
                                 self.contexts, extrapolated=self.extrapolates_below and context_len < self.contexts[0])
        if lo == hi:  # a profiled context (or clamped to one): its own tables, bit for bit
            draft, verify = self.tables[lo]
        else:
            (d0, v0), (d1, v1) = self.tables[lo], self.tables[hi]
            draft, verify = _readonly(blend(d0, d1, w)), _readonly(blend(v0, v1, w))
        return PricedTables(draft, verify, context_len, lo, hi, w, warning)


class DenseTables(tuple):
    """A (draft, verify) pair, as vLLM's dense tables always were, that also says where it was
    priced: ``.priced`` (the PricedTables) and ``.warning`` (OutOfRange or None)."""

    priced: PricedTables
    warning: OutOfRange | None

    def __new__(cls, priced: PricedTables) -> "DenseTables":
        self = super().__new__(cls, priced.as_tuple())
        self.priced, self.warning = priced, priced.warning
        return self


def dense_tables(table: Any, context_len: int, **sizes: int | None) -> PricedTables:
    """``CostTable.dense_tables(context_len=L)`` with interpolation (issue 9 item 2). Only the
    one or two bracketing contexts' tables are built (a CLI prices one context at a time)."""
    ctxs = sorted(table.curves)
    lo, hi, _ = ContextCosts.bracket_of(ctxs, int(context_len))
    if int(context_len) < ctxs[0] and len(ctxs) > 1:  # extrapolated from the two shortest
        lo, hi = ctxs[0], ctxs[1]
    fp = table.fingerprint
    costs = ContextCosts({c: table.curves[c] for c in {lo, hi}}, sizes.get("max_num_reqs") or fp.max_num_seqs,
                         sizes.get("max_num_batched_tokens") or fp.max_num_batched_tokens,
                         fp.cudagraph_limit if sizes.get("cudagraph_limit") is None else sizes["cudagraph_limit"])
    priced = costs.at(int(context_len))
    if priced.warning is not None:  # the warning names the whole profiled range, not just the bracket
        w = priced.warning
        priced = PricedTables(priced.draft, priced.verify, priced.context_len, priced.lower, priced.upper,
                              priced.weight, OutOfRange(int(context_len), w.used_context, tuple(ctxs), w.extrapolated))
    return priced


class ContextGrid:
    """Dense tables precomputed at grid contexts; ``tables_for(L)`` is one array lookup.

    Points: every profiled context, plus, inside each profiled segment, points
    spaced so that the largest relative change of any table entry between two
    neighbours is at most ``tolerance`` (error-driven: spacing grows with the
    cost). ``tables_for(L)`` rounds L UP to the next point: the step's attention
    reads its computed tokens plus the ones it schedules, so the true context is
    above ``num_computed_tokens`` and rounding up moves the price toward it; and
    where costs rise with context (every H200 size) a rounded price is never
    below the exact one. ``max_rel_error`` is the achieved bound: no entry of
    ``tables_for(L)`` differs from ``ContextCosts.at(L)`` by more than that
    fraction, for any L.
    """

    def __init__(self, costs: ContextCosts, *, tolerance: float = DEFAULT_TOLERANCE,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        if not tolerance > 0:
            raise CalibError(f"grid tolerance must be > 0, got {tolerance}")
        self.costs = costs
        row_bytes = 8 * (costs.max_num_reqs + costs.max_num_batched_tokens + 2)
        max_points = max(len(costs.knots), max_bytes // row_bytes)
        points = self._place(costs, tolerance)
        while len(points) > max_points:  # point count ~ 1/tolerance: loosen until it fits
            tolerance *= 1.25 * len(points) / max_points
            points = self._place(costs, tolerance)
        self.tolerance = tolerance
        self.points: tuple[int, ...] = tuple(points)
        n = len(points)
        self.draft = np.empty((n, costs.max_num_reqs + 1))
        self.verify = np.empty((n, costs.max_num_batched_tokens + 1))
        for i, p in enumerate(points):
            priced = costs.at(p)
            self.draft[i], self.verify[i] = priced.draft, priced.verify
        _readonly(self.draft), _readonly(self.verify)
        # Prebuilt tuples of row views: a step assigns one, allocating nothing.
        self._tables: list[Tables] = [(self.draft[i], self.verify[i]) for i in range(n)]
        self._lo, self._hi = points[0], points[-1]
        # _slot[L - lo] = index of the first point >= L, for every integer L in the range.
        slots = np.searchsorted(np.asarray(points), np.arange(self._lo, self._hi + 1), side="left")
        self._slot = array("I", slots.astype(np.uint32).tobytes())
        self._build_head(tolerance, max(row_bytes, max_bytes // 4))
        self.max_rel_error = self._achieved_error()

    def _build_head(self, tolerance: float, max_bytes: int) -> None:
        """Verify costs below max_num_reqs tokens, by the step's KV sum S (``verify_context``):
        ``head[j, N]`` = the interpolated verify cost at N tokens and context head_points[j] / N.
        Rows are S = 1, 2, ... then geometric, each point p followed by p + max(1, p // q) with
        q = 1 / tolerance (integers only: the same points on every host and rank). The cost is
        linear in context between knots, so neighbouring rows differ by about the tolerance at
        most; the achieved bound joins ``max_rel_error``. From max_num_reqs tokens up a step's
        verify context is S / max_num_reqs: a row of the main grid."""
        costs = self.costs
        reqs = costs.profile_num_reqs
        knots = costs.knots
        s_hi = max(1, knots[-1]) * max(1, reqs)
        q = max(1, int(round(1 / tolerance)))
        while True:
            points = [s_hi] if len(knots) == 1 else _int_geometric(1, s_hi, q)
            if len(points) * reqs * 8 <= max_bytes or q == 1:
                break
            q = max(1, int(q * max_bytes / (len(points) * reqs * 8) / 1.25))
        pts = np.asarray(points, dtype=np.int64)
        verify = np.stack([costs.tables[c][1][:reqs] for c in knots])  # (knots, reqs)
        sizes = np.arange(reqs)
        # ceil(S_j / N), as verify_context rounds: with S_j >= S, a row never prices below the step
        context = (-(-pts[:, None] // np.maximum(sizes, 1)[None, :])).astype(np.float64)
        if len(knots) == 1:
            head = np.broadcast_to(verify[0], context.shape).copy()
        else:
            at = np.clip(np.searchsorted(np.asarray(knots), context, side="left"), 1, len(knots) - 1)
            c0, c1 = np.asarray(knots, dtype=np.float64)[at - 1], np.asarray(knots, dtype=np.float64)[at]
            weight = np.clip((context - c0) / (c1 - c0), 0.0, 1.0)
            head = blend(verify[at - 1, sizes], verify[at, sizes], weight)  # per entry, as at() blends
        self.head = _readonly(head)
        self.head_points: tuple[int, ...] = tuple(points)  # bisected per step: no numpy call
        self._head_last = len(points) - 1
        self._head_tolerance = 1 / q
        self._buffer = StepBuffer(self)  # for callers that bring none (one grid, one caller)

    @staticmethod
    def _place(costs: ContextCosts, tolerance: float) -> list[int]:
        ctxs = costs.knots
        points = [ctxs[0]]
        for c0, c1 in zip(ctxs, ctxs[1:]):
            (d0, v0), (d1, v1) = costs.tables[c0], costs.tables[c1]
            lo, hi = np.concatenate([d0, v0]), np.concatenate([d1, v1])
            delta = np.abs(hi - lo)
            p = c0
            while p < c1:
                # From p to q the entries change by (q - p)/(c1 - c0) * delta; relative to
                # min(T(p), T(q)), which is >= min(T(p), hi), that must stay <= tolerance.
                floor = np.minimum(blend(lo, hi, (p - c0) / (c1 - c0)), hi)
                rate = np.max(np.divide(delta, floor, out=np.zeros_like(delta), where=floor > 0)) / (c1 - c0)
                step = c1 - p if rate == 0 else max(1, math.floor(tolerance / rate))
                p = min(c1, p + step)
                points.append(p)
        return points

    def _achieved_error(self) -> float:
        worst = 0.0
        for table in (self.draft, self.verify, self.head):
            if len(table) < 2:
                continue
            a, b = table[:-1], table[1:]
            low = np.minimum(a, b)
            diff = np.abs(b - a)
            rel = np.divide(diff, low, out=np.where(diff > 0, np.inf, 0.0), where=low > 0)
            worst = max(worst, float(rel.max()))
        return worst

    @classmethod
    def from_table(cls, table: Any, **kw: Any) -> "ContextGrid":
        sizes = {k: kw.pop(k) for k in ("max_num_reqs", "max_num_batched_tokens", "cudagraph_limit") if k in kw}
        return cls(ContextCosts.from_table(table, **sizes), **kw)

    @property
    def contexts(self) -> tuple[int, ...]:
        return self.costs.contexts

    @property
    def nbytes(self) -> int:
        return (self.draft.nbytes + self.verify.nbytes + self.head.nbytes + self._buffer.verify.nbytes
                + self._slot.itemsize * len(self._slot))

    def __len__(self) -> int:
        return len(self.points)

    def index(self, context_len: int) -> int:
        """Grid row for a context: the first point >= it, clamped to the grid (its first knot, 0
        when the costs extrapolate below the shortest profiled context, to the longest)."""
        i = context_len - self._lo
        if i <= 0:
            return 0
        if context_len >= self._hi:
            return len(self._tables) - 1
        return self._slot[i]

    def tables_for(self, context_len: int) -> Tables:
        """The (draft, verify) tables for a step at this (integer) context: O(1), no allocation."""
        i = context_len - self._lo
        if i <= 0:
            return self._tables[0]
        if context_len >= self._hi:
            return self._tables[-1]
        return self._tables[self._slot[i]]

    def step_tables(self, context_sum: int, num_reqs: int, buffer: "StepBuffer | None" = None,
                    verify_sum: int | None = None) -> Tables:
        """The (draft, verify) tables for a serving step of num_reqs requests whose computed
        tokens sum to context_sum: drafts at the mean context, verify at N tokens at
        ``verify_context(S, N)`` (module docstring), S = verify_sum when given (a step whose
        prefill chunks are priced by their pairs: prefill_context_sum). O(1) per step: two row
        lookups; below max_num_reqs requests the verify array is ``buffer``'s (one per manager;
        the grid's own when None), rewritten only when its rows change, so it is valid until the
        next call with that buffer (vLLM reads it within the step)."""
        reqs = self.costs.profile_num_reqs
        if verify_sum is None:
            if num_reqs == reqs:  # a full batch: one context for drafts and every verify size (a prebuilt pair)
                return self.tables_for(-(-context_sum // reqs))
            verify_sum = context_sum
        if num_reqs <= 0:
            num_reqs = 1
        draft = self._tables[self.index(-(-context_sum // num_reqs))][0]
        context_sum = verify_sum
        tail = self.index(-(-context_sum // reqs))
        if num_reqs > reqs:  # every N >= num_reqs > R: one verify context
            return draft, self._tables[tail][1]
        head = bisect_left(self.head_points, context_sum)
        if head > self._head_last:
            head = self._head_last
        buffer = buffer or self._buffer
        rows, scratch = buffer.rows, buffer.verify
        if rows[1] != tail:
            scratch[reqs:] = self.verify[tail, reqs:]
            rows[1] = tail
        if rows[0] != head:
            scratch[:reqs] = self.head[head]
            rows[0] = head
        return draft, scratch

    def price(self, context_sum: Sequence[int] | np.ndarray, num_reqs: Sequence[int] | np.ndarray,
              num_tokens: Sequence[int] | np.ndarray,
              verify_sum: Sequence[int] | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised ``step_tables``: each step's (draft cost at num_reqs, verify cost at
        num_tokens), exactly the entries the engine's tables held for it."""
        s = np.asarray(context_sum, dtype=np.int64)
        n = np.asarray(num_reqs, dtype=np.int64)
        tokens = np.asarray(num_tokens, dtype=np.int64)
        reqs = self.costs.profile_num_reqs
        draft = self.draft[self.indices(-(-s // np.maximum(n, 1))), n]
        if verify_sum is not None:
            s = np.asarray(verify_sum, dtype=np.int64)
        verify = self.verify[self.indices(-(-s // reqs)), tokens]
        small = tokens < reqs
        rows = np.minimum(np.searchsorted(np.asarray(self.head_points), s[small], side="left"), self._head_last)
        verify[small] = self.head[rows, tokens[small]]
        return draft, verify

    def indices(self, context_lens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Vectorised ``index`` (for pricing many observed steps at once)."""
        ctx = np.clip(np.asarray(context_lens, dtype=np.int64), self._lo, self._hi)
        return np.searchsorted(np.asarray(self.points), ctx, side="left")

    def describe(self) -> dict[str, Any]:
        return {"contexts": list(self.contexts), "points": len(self.points), "bytes": self.nbytes,
                "tolerance": self.tolerance, "max_rel_error": self.max_rel_error,
                "kv_points": len(self.head_points), "kv_tolerance": self._head_tolerance}


class StepBuffer:
    """The verify table ContextGrid.step_tables hands out below max_num_reqs requests (a head row
    and a main-grid tail), and which rows it holds: one per manager, so two managers sharing a
    grid never see each other's step."""

    __slots__ = ("verify", "rows")

    def __init__(self, grid: ContextGrid):
        self.verify = np.empty(grid.costs.max_num_batched_tokens + 1)
        self.rows = [-1, -1]  # (head row, tail row) written into verify; -1: none yet


def _int_geometric(lo: int, hi: int, q: int) -> list[int]:
    """lo, then p + max(1, p // q) up to hi (included): ratio ~1 + 1/q, integers only."""
    out = [lo]
    while out[-1] < hi:
        out.append(min(hi, out[-1] + max(1, out[-1] // q)))
    return out


def ceil_mean(total: int, count: int) -> int:
    """ceil(total / count) in integers: the batch's mean context, rounded up (exact, no floats)."""
    return -(-int(total) // int(count))

"""Cost tables priced at any context length, from a table's per-context curves.

vLLM prices every step with curves profiled at one context length. A table may
hold several; ``ContextCosts.at(L)`` turns them into the dense (draft, verify)
tables vLLM indexes, at any context L: per size, linear interpolation in context
between the dense tables of the two nearest profiled contexts (attention reads
every request's KV cache, so the verify cost is close to linear in context). Each
profiled context's dense table comes from ``fit.build_cost_tables`` (vLLM's own
rule), so the step function below the capture limit, the interpolation above it
and the extrapolation past the last size all stay vLLM's. At a profiled context
the result IS that table (bit-identical); above the profiled range it is the
longest context's table, below it the line through the two shortest extended
towards context 0 (its context-0 point kept between vLLM's floor and the shortest
context's costs), each with an ``OutOfRange`` warning object (never a print: the
caller decides where it goes).

Only numpy here: ``validate`` prices observed steps with this, and it must not pull
in torch or vllm.
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from dspark_calib.errors import CalibError
from dspark_calib.fit import DRAFT_FLOOR_MS, VERIFY_FLOOR_MS, build_cost_tables
from dspark_calib.pricing.policy import CHUNK_RULE, extrapolates_above
from dspark_calib.pricing.rules import chunk_kv_ratio

Tables = tuple[np.ndarray, np.ndarray]
# The dense tables of every context together (and the two extrapolated ones): a table's sizes
# and contexts come from a file, and the sizes alone are bounded per value (fileformat.limits),
# so their product is bounded here, before anything is allocated. 8 contexts of a 2M-token
# engine fit.
MAX_DENSE_BYTES = 256 << 20


@dataclass(frozen=True)
class OutOfRange:
    """A context outside the profiled range: above it, priced at the longest profiled context;
    below it, extrapolated linearly from the two shortest (see ContextCosts)."""

    context_len: int
    used_context: int
    profiled: tuple[int, ...]
    extrapolated: bool = False  # below the range, on the line through the two shortest

    def __str__(self) -> str:
        below = self.context_len < self.used_context or self.context_len < self.profiled[0]
        side = "below" if below else "above"
        pair = self.profiled[:2] if below else self.profiled[-2:]
        how = (f"extrapolated linearly from contexts {pair[0]} and {pair[1]}" if self.extrapolated
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


def readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


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
                 cudagraph_limit: int = 0, *, profile_num_reqs: int | None = None, extrapolate_to: int = 0):
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
        need = 8 * (len(self.contexts) + 2) * (self.max_num_reqs + self.max_num_batched_tokens + 2)
        if need > MAX_DENSE_BYTES:
            raise CalibError(f"dense tables of {len(self.contexts)} contexts at max_num_batched_tokens "
                             f"{self.max_num_batched_tokens} need {need >> 20} MiB, over the {MAX_DENSE_BYTES >> 20} "
                             "MiB priced at once")
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
            self.tables[ctx] = (readonly(draft), readonly(verify))
        # The interpolation's knots: the profiled contexts and, below the shortest, context 0 with
        # the line through the two shortest extended to it. Attention cost is linear in the KV
        # read, and below the range that line measured 10x closer than the shortest context's
        # flat costs on real H200 serving steps (verify 0.6 % against 5.8 % median; drafts 1.2 %
        # against 2.4 %). Guards, since profiling noise on a short span would be stretched: only
        # when the two shortest are at least c0 apart (the line reaches 0 within its own span);
        # the context-0 table is kept between vLLM's floor and the shortest context's, and made
        # non-decreasing in size as vLLM makes every table. Above the range, up to extrapolate_to
        # (the engine's max_model_len): the line through the two longest, extended (on the H200,
        # 8192/16384 extended to 24576 and 32768 came within 0.3 % median of profiles at those
        # contexts, where the longest context's flat costs were 24 and 39 % low; docs/pricing.md);
        # kept at or above the longest context's costs. Beyond it (or with one context, or
        # extrapolate_to 0): the longest context's costs.
        self.knots: tuple[int, ...] = self.contexts
        c0, c1 = (self.contexts + (0,))[:2]
        self.extrapolates_below = len(self.contexts) > 1 and 0 < c0 <= c1 - c0
        if self.extrapolates_below:
            (d0, v0), (d1, v1) = self.tables[c0], self.tables[c1]
            zero = []
            for lo, hi, floor in ((d0, d1, DRAFT_FLOOR_MS), (v0, v1, VERIFY_FLOOR_MS)):
                z = np.clip(lo - (hi - lo) * (c0 / (c1 - c0)), floor, lo)
                zero.append(readonly(np.maximum.accumulate(z)))  # <= lo still: lo is non-decreasing
            self.tables[0] = (zero[0], zero[1])
            self.knots = (0, *self.contexts)
        self.extrapolate_to = int(extrapolate_to)
        # Guarded as below the range (policy.extrapolates_above): the two longest at least a factor 2 apart.
        self.extrapolates_above = extrapolates_above(self.contexts, self.extrapolate_to)
        if self.extrapolates_above:
            (c0, (d0, v0)), (c1, (d1, v1)) = [(c, self.tables[c]) for c in self.contexts[-2:]]
            stretch = (self.extrapolate_to - c1) / (c1 - c0)
            far = [readonly(np.maximum.accumulate(np.maximum(hi + (hi - lo) * stretch, hi)))
                   for lo, hi in ((d0, d1), (v0, v1))]
            self.tables[self.extrapolate_to] = (far[0], far[1])
            self.knots = (*self.knots, self.extrapolate_to)

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
            below = context_len < self.contexts[0]
            extrapolated = (self.extrapolates_below if below else
                            self.extrapolates_above and context_len <= self.extrapolate_to)
            used = (self.contexts[0] if below else context_len if extrapolated else
                    self.extrapolate_to if self.extrapolates_above else self.contexts[-1])
            warning = OutOfRange(context_len, used, self.contexts, extrapolated=extrapolated)
        if lo == hi:  # a profiled context (or clamped to one): its own tables, bit for bit
            draft, verify = self.tables[lo]
        else:
            (d0, v0), (d1, v1) = self.tables[lo], self.tables[hi]
            draft, verify = readonly(blend(d0, d1, w)), readonly(blend(v0, v1, w))
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


def curves_for_broadcast(curves: Mapping[int, Any]) -> dict[int, tuple[list, list]]:
    """context -> (draft, verify) as vLLM's (size, cost) lists: plain objects to broadcast."""
    out = {}
    for ctx, pair in sorted(curves.items()):
        draft, verify = pair.as_vllm() if hasattr(pair, "as_vllm") else pair
        out[int(ctx)] = (list(draft), list(verify))
    return out


def dense_tables(table: Any, context_len: int, **sizes: int | None) -> PricedTables:
    """``CostTable.dense_tables(context_len=L)`` with interpolation. Only the
    one or two bracketing contexts' tables are built (a CLI prices one context at a time)."""
    ctxs = sorted(table.curves)
    lo, hi, _ = ContextCosts.bracket_of(ctxs, int(context_len))
    if int(context_len) < ctxs[0] and len(ctxs) > 1:  # extrapolated from the two shortest
        lo, hi = ctxs[0], ctxs[1]
    if int(context_len) > ctxs[-1] and len(ctxs) > 1:  # extrapolated from the two longest
        lo, hi = ctxs[-2], ctxs[-1]
    fp = table.fingerprint
    costs = ContextCosts({c: table.curves[c] for c in {lo, hi}}, sizes.get("max_num_reqs") or fp.max_num_seqs,
                         sizes.get("max_num_batched_tokens") or fp.max_num_batched_tokens,
                         fp.cudagraph_limit if sizes.get("cudagraph_limit") is None else sizes["cudagraph_limit"],
                         extrapolate_to=int(context_len))
    priced = costs.at(int(context_len))
    if priced.warning is not None:  # the warning names the whole profiled range, not just the bracket
        w = priced.warning
        priced = PricedTables(priced.draft, priced.verify, priced.context_len, priced.lower, priced.upper,
                              priced.weight, OutOfRange(int(context_len), w.used_context, tuple(ctxs), w.extrapolated))
    return priced



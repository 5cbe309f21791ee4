"""Dense tables precomputed at a grid of contexts, so a serving step gets its tables with
two row lookups and no allocation (``ContextGrid``).

Points are placed so that rounding a context up to the next point changes no table
entry by more than ``tolerance`` relative to the exact interpolation: error-driven
spacing, dense where the cost is small and sparse where it is large (a uniform grid
cannot do that cheaply: the relative change of a fixed context step shrinks as the
cost grows). Memory is capped by ``max_bytes`` for the context rows plus a quarter
of it for the KV-sum rows (verify sizes below max_num_reqs); past either the
tolerance is loosened to fit and ``max_rel_error`` says what was achieved.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Any, Sequence

import numpy as np

from dspark_calib.errors import CalibError
from dspark_calib.pricing.costs import ContextCosts, Tables, blend, readonly

DEFAULT_TOLERANCE = 0.005  # grid rounding error bound, relative to the exact interpolation
DEFAULT_MAX_BYTES = 64 << 20


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
        readonly(self.draft), readonly(self.verify)
        # Prebuilt tuples of row views: a step assigns one, allocating nothing.
        self._tables: list[Tables] = [(self.draft[i], self.verify[i]) for i in range(n)]
        self._lo, self._hi = points[0], points[-1]
        # A row is found by bisecting the points (O(log points), no allocation): never a per-token
        # index over lo..hi, whose size would follow the longest context, not the point count.
        self._last = n - 1
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
        self.head = readonly(head)
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
        return self.draft.nbytes + self.verify.nbytes + self.head.nbytes + self._buffer.verify.nbytes

    def __len__(self) -> int:
        return len(self.points)

    def index(self, context_len: int) -> int:
        """Grid row for a context: the first point >= it, clamped to the grid (its first knot, 0
        when the costs extrapolate below the shortest profiled context, to the longest)."""
        if context_len <= self._lo:
            return 0
        if context_len >= self._hi:
            return self._last
        return bisect_left(self.points, context_len)

    def tables_for(self, context_len: int) -> Tables:
        """The (draft, verify) tables for a step at this (integer) context: a bisection of the
        points, no allocation."""
        if context_len <= self._lo:
            return self._tables[0]
        if context_len >= self._hi:
            return self._tables[-1]
        return self._tables[bisect_left(self.points, context_len)]

    def step_tables(self, context_sum: int, num_reqs: int, buffer: "StepBuffer | None" = None,
                    verify_sum: int | None = None) -> Tables:
        """The (draft, verify) tables for a serving step of num_reqs requests whose computed
        tokens sum to context_sum: drafts at the mean context, verify at N tokens at
        ``verify_context(S, N)`` (module docstring), S = verify_sum when given (a step whose
        prefill chunks are priced by their pairs: prefill_context_sum). Two row
        lookups per step (bisections of the points); below max_num_reqs requests the verify array is ``buffer``'s (one per manager;
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

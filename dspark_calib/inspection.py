"""What `inspect` finds in a table: findings, the verdict on them, and the draft budgets it implies.

Analysis only (no printing): render/ draws it, the CLI's --json dumps ``to_dict()``.
numpy-only, so `inspect` starts without scipy or matplotlib.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from dspark_calib.fit import (
    CURVE_KINDS, DRAFT, DRAFT_FLOOR_MS, VERIFY, VERIFY_FLOOR_MS, Curve, build_cost_tables, decision_map,
)
from dspark_calib.speculators import is_clamped_batch
from dspark_calib.stability import LevelShift, table_flags
from dspark_calib.table.model import FALL_FRACTION, FALL_IQRS, CostTable, falls_beyond_spread
from dspark_calib.telemetry import Telemetry

# A median from fewer samples than this is one outlier away from a wrong cost.
MIN_SAMPLES = 3
# IQR / median above this: the GPU was not quiet, the median may not be typical.
MAX_REL_SPREAD = 0.10
NUM_REQS_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONFIDENCE_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

FEW_SAMPLES = "few_samples"
HIGH_SPREAD = "high_spread"
FALLING_MEDIAN = "falling_median"
SHORT_VERIFY = "short_verify"
SHORT_DRAFT = "short_draft"
LEVEL_SHIFT = "level_shift"
THROTTLE = "throttle"

# Severity: a WARNING is worth a look; a NOTE is a fact about the measurement that needs no
# action (shown with --all). A finding that `blocks` makes the table unfit to serve (the
# verdict): its costs are not the ones vLLM would measure on a quiet GPU of this engine.
#
# A falling median (a size cheaper than a smaller one) never reaches vLLM as such: its
# running maximum charges the larger earlier cost. So a dip is a NOTE when the draft budgets
# come out the same whether vLLM charges the running max or the dip's own median (the
# decision map, at every grid cell, with and without the dip): then it does not matter which
# is the truth. A dip that changes a budget is a WARNING (the message says whether the fall is
# within the points' p25-p75 spread, where more replays would settle it). A fall beyond
# max(3 x IQR, 10 %) (table.model.falls_beyond_spread) is a WARNING either way: a table
# reads with one only after a warm-up (CostTable.check_plausible), so it is the GPU's own
# measurement, but one worth a look. No dip blocks: vLLM's own start-up profile sees the
# same dips, from fewer samples, and absorbs them the same way; what blocks is a table unlike
# what vLLM would measure on a quiet GPU (too few samples, a noisy point, a level shift,
# thermal throttling, a curve short of the engine).
WARNING = "warning"
NOTE = "note"
SEVERITIES = (WARNING, NOTE)
# Throttle reasons that mean the GPU was too hot or braked from outside: serving clocks may
# differ. Power capping and hw_slowdown at the power limit are the steady state of heavy steps
# (a serving GPU under the same load runs the same way); they matter when they move costs
# between blocks, which the level-shift test measures.
BLOCKING_THROTTLE = ("sw_thermal", "hw_thermal", "hw_power_brake")
# A curve with more dips than this is not attributed dip by dip (each needs a decision map).
MAX_DIPS_ATTRIBUTED = 64


@dataclass(frozen=True)
class TableWarning:
    code: str
    message: str
    context_len: int | None = None
    curve: str | None = None  # "draft" | "verify"
    size: int | None = None
    severity: str = WARNING
    blocks: bool = False  # makes the table unfit to serve (see Verdict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class DecisionMap:
    """Draft budget per request vLLM would pick, for R requests at mean confidence c.

    ``budget_per_req[i, j]`` is for ``num_reqs[i]`` and ``confidence[j]``; NaN where the
    table cannot price the batch.
    """

    context_len: int
    num_speculative_tokens: int
    num_reqs: tuple[int, ...]
    confidence: tuple[float, ...]
    budget_per_req: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return {
            "context_len": self.context_len,
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_reqs": list(self.num_reqs),
            "confidence": list(self.confidence),
            "budget_per_req": [[_num(v) for v in row] for row in self.budget_per_req.tolist()],
        }


def _num(value: float) -> float | None:
    """JSON has no NaN: unpriced cells become null."""
    return None if value is None or not math.isfinite(value) else value


def num_reqs_grid(max_num_seqs: int, grid: Sequence[int] = NUM_REQS_GRID) -> tuple[int, ...]:
    """The grid capped at max_num_seqs, plus max_num_seqs itself so the top is always shown."""
    out = [r for r in grid if r <= max_num_seqs]
    if max_num_seqs not in out and max_num_seqs < max(grid):
        out.append(max_num_seqs)
    return tuple(out)


def table_decision_map(
    table: CostTable,
    context_len: int | None = None,
    *,
    reqs: Sequence[int] | None = None,
    confidence: Sequence[float] = CONFIDENCE_GRID,
) -> DecisionMap:
    ctx = table.nearest_context(context_len)  # None: table.default_context()
    fp = table.fingerprint
    reqs = num_reqs_grid(fp.max_num_seqs) if reqs is None else tuple(int(r) for r in reqs)
    draft, verify = table.dense_tables(ctx)
    grid = decision_map(draft, verify, reqs, confidence, fp.num_speculative_tokens)
    return DecisionMap(ctx, fp.num_speculative_tokens, tuple(reqs), tuple(float(c) for c in confidence), grid)


def curve_warnings(curve: Curve, kind: str, context_len: int,
                   budget_changes: Callable[[list[int]], set[int]] | None = None) -> list[TableWarning]:
    """Per-point findings for one curve (vectorised: curves can have 8192 points).

    budget_changes: given the indices of the curve's dips, those whose own median would give
    other draft budgets than vLLM's running max (see WARNING/NOTE above); None: no table
    to price against, so every dip is taken to change one.
    """
    out: list[TableWarning] = []
    where = f"{kind} @ctx {context_len}"
    # Python scalars: formatting numpy ones is ~10x slower, and a noisy 8192-point
    # curve can have thousands of dips.
    sizes, ns, cost = curve.size.tolist(), curve.n.tolist(), curve.cost_ms.tolist()
    for i in np.flatnonzero(curve.n < MIN_SAMPLES).tolist():
        size, n = sizes[i], ns[i]
        out.append(TableWarning(FEW_SAMPLES, f"{where}: size {size} has only {n} sample{'s' if n != 1 else ''} "
                                f"(want >= {MIN_SAMPLES})", context_len, kind, size, blocks=True))
    spread = curve.rel_spread
    for i in np.flatnonzero(np.nan_to_num(spread) > MAX_REL_SPREAD).tolist():
        size = sizes[i]
        out.append(TableWarning(HIGH_SPREAD, f"{where}: size {size} spread p25-p75 is {float(spread[i]):.0%} of "
                                f"its median (> {MAX_REL_SPREAD:.0%}): noisy measurement", context_len, kind, size,
                                blocks=True))
    if len(cost) > 1:
        arr = curve.cost_ms
        run_max = np.maximum.accumulate(arr)
        prev_max = np.concatenate(([-np.inf], run_max[:-1]))
        # Index of the point that set the running max so far, to name it in the message.
        setter = np.maximum.accumulate(np.where(arr >= prev_max, np.arange(len(arr)), 0)).tolist()
        iqr = (curve.p75_ms - curve.p25_ms).tolist()
        dips = np.flatnonzero(arr < prev_max).tolist()
        changing = set(dips) if budget_changes is None else budget_changes(dips)
        beyond = {i for i, _ in falls_beyond_spread(curve)}
        for i in dips:
            j = setter[i - 1]
            size, earlier, c, top = sizes[i], sizes[j], cost[i], cost[j]
            text = f"{where}: size {size} median {c:.3f} ms is {_drop(1 - c / top)} below size {earlier}'s {top:.3f} ms"
            far = (f"; a fall beyond max({FALL_IQRS:g} x IQR, {FALL_FRACTION:.0%}) (refused in a profile without "
                   "warm-up)") if i in beyond else ""
            if i not in changing:
                out.append(TableWarning(FALLING_MEDIAN, f"{text}; vLLM charges {top:.3f}, the same draft budgets{far}",
                                        context_len, kind, size, WARNING if far else NOTE))
                continue
            why = ("within the points' p25-p75 spread: more replays would settle it"
                   if dip_within_spread(top - c, iqr[i], iqr[j]) else "beyond the points' spread")
            out.append(TableWarning(FALLING_MEDIAN, f"{text}; vLLM charges {top:.3f}, which changes a draft budget "
                                    f"({why}){far}", context_len, kind, size, WARNING))
    return out


def dip_within_spread(fall: float, iqr_here: float, iqr_top: float) -> bool:
    """Whether a fall is noise (see WARNING/NOTE above): no larger than the larger IQR of the
    dipping point and the point that set the running max. NaN spreads are ignored; with none
    recorded the fall cannot be called noise."""
    spreads = [s for s in (iqr_here, iqr_top) if math.isfinite(s)]
    return bool(spreads) and fall <= max(spreads)


def _drop(fraction: float) -> str:
    return f"{fraction:.1%}" if fraction >= 0.001 else f"{fraction:.2%}"


def _face_value_dense(curve: Curve, lowered: Sequence[int], length_minus_one: int, limit: int,
                      other: Sequence[tuple[int, float]], kind: str, table: CostTable) -> np.ndarray:
    """vLLM's dense table for `curve` with the running max applied everywhere but at the points
    `lowered`, which keep their own medians.

    Built with vLLM's own rule (fit.build_cost_tables) rather than a copy of it: apart from
    the running max, that rule (step, interpolation, extrapolation) is linear in the costs,
    so dense(y) = dense(y + m x) - dense(m x) for any slope m, and a slope steep enough makes
    y + m x rise everywhere, where the running max changes nothing.
    """
    fp = table.fingerprint
    x = curve.size.astype(np.float64)
    y = np.maximum.accumulate(curve.cost_ms)
    y[list(lowered)] = curve.cost_ms[list(lowered)]
    slope = 1.0 + float(np.max(np.maximum(0.0, -np.diff(y)) / np.diff(x), initial=0.0)) * 2
    sizes = curve.size.tolist()

    def dense(costs: np.ndarray) -> np.ndarray:
        pts = list(zip(sizes, costs.tolist()))
        pair = (pts, other) if kind == DRAFT else (other, pts)
        return build_cost_tables(*pair, fp.max_num_seqs, fp.max_num_batched_tokens, limit)[0 if kind == DRAFT else 1]

    floor = DRAFT_FLOOR_MS if kind == DRAFT else VERIFY_FLOOR_MS
    return np.maximum(dense(y + slope * x) - dense(slope * x), floor)


def dip_budget_check(table: CostTable, context_len: int, kind: str) -> Callable[[list[int]], set[int]]:
    """budget_changes for curve_warnings: which dips, priced at their own median instead of
    vLLM's running max, change a cell of the decision map (inspect's grid) at this context.

    All dips of the curve are tried together first (one map: the common case is no change);
    only when that changes a budget is each dip tried alone. When together they change one
    but none does alone, or the curve has more than MAX_DIPS_ATTRIBUTED dips, all count.
    """
    fp = table.fingerprint
    pair = table.curves[context_len]
    curve = pair.curve(kind)
    other = pair.curve(VERIFY if kind == DRAFT else DRAFT).as_vllm()
    draft, verify = table.dense_tables(context_len)
    reqs = num_reqs_grid(fp.max_num_seqs)

    def budgets(dense: np.ndarray) -> np.ndarray:
        tables = (dense, verify) if kind == DRAFT else (draft, dense)
        return decision_map(*tables, reqs, CONFIDENCE_GRID, fp.num_speculative_tokens)

    length = fp.max_num_seqs if kind == DRAFT else fp.max_num_batched_tokens

    def priced(lowered: list[int]) -> np.ndarray:
        return budgets(_face_value_dense(curve, lowered, length, fp.cudagraph_limit, other, kind, table))

    base: list[np.ndarray] = []  # vLLM's own map, built the same way (no float noise can tell them apart)

    def changes(lowered: list[int]) -> bool:
        return not np.array_equal(priced(lowered), base[0], equal_nan=True)

    def check(dips: list[int]) -> set[int]:
        if not dips:
            return set()
        base.append(priced([]))
        if not changes(dips):
            return set()
        if len(dips) > MAX_DIPS_ATTRIBUTED:
            return set(dips)
        alone = {i for i in dips if changes([i])}
        return alone or set(dips)

    return check


def _telemetry_findings(table: CostTable, context_lens: Sequence[int]) -> list[TableWarning]:
    """Throttling in the timed blocks of the contexts shown: blocking reasons (BLOCKING_THROTTLE)
    are a warning, the others a note."""
    if table.telemetry is None:
        return []
    out = []
    for ctx in context_lens:
        timed = [b for b in table.telemetry.blocks if b.block >= 0 and b.context_len == ctx]
        reasons = sorted({r for b in timed for r in b.throttle})
        for reason in reasons:
            n = sum(reason in b.throttle for b in timed)
            blocking = reason in BLOCKING_THROTTLE
            tail = ("the GPU was too hot or braked: serving clocks may differ" if blocking
                    else "the GPU at its limits in heavy steps, as under the same serving load; costs moved only "
                         "if a level shift is flagged")
            out.append(TableWarning(THROTTLE, f"ctx {ctx}: throttled ({reason}) in {n} of {len(timed)} timed blocks: "
                                    f"{tail}", ctx, None, None, WARNING if blocking else NOTE, blocks=blocking))
    return out


def table_warnings(table: CostTable, context_lens: Sequence[int] | None = None,
                   level_shifts: Sequence[LevelShift] = ()) -> list[TableWarning]:
    """Every finding for the given contexts (default: all), each with its severity."""
    fp = table.fingerprint
    out: list[TableWarning] = []
    ctxs = table.context_lens() if context_lens is None else list(context_lens)
    for ctx in ctxs:
        pair = table.curves[ctx]
        for kind in CURVE_KINDS:
            out += curve_warnings(pair.curve(kind), kind, ctx, dip_budget_check(table, ctx, kind))
        # Past its last point vLLM extrapolates linearly: a guess, not a measurement.
        last_v = int(pair.verify.size[-1])
        # vLLM's own profile ends where _dummy_run clamps the largest batch (a draft model: 7936 of 8192)
        if last_v < fp.max_num_batched_tokens and not is_clamped_batch(last_v, fp.max_num_batched_tokens,
                                                                        min(fp.max_num_seqs, fp.max_num_batched_tokens)):
            out.append(TableWarning(SHORT_VERIFY, f"verify @ctx {ctx}: last size {last_v} < max_num_batched_tokens "
                                    f"{fp.max_num_batched_tokens}; larger steps are extrapolated", ctx, VERIFY, last_v,
                                    blocks=True))
        last_d = int(pair.draft.size[-1])
        if last_d < fp.max_num_seqs:
            out.append(TableWarning(SHORT_DRAFT, f"draft @ctx {ctx}: last size {last_d} < max_num_seqs "
                                    f"{fp.max_num_seqs}; larger batches are extrapolated", ctx, DRAFT, last_d,
                                    blocks=True))
    for shift in level_shifts:
        if shift.context_len in ctxs:
            out.append(TableWarning(LEVEL_SHIFT, f"level shift: {shift}", shift.context_len, blocks=True))
    return out + _telemetry_findings(table, ctxs)


def count_by_severity(warnings: Sequence[TableWarning]) -> dict[str, int]:
    return {sev: sum(w.severity == sev for w in warnings) for sev in SEVERITIES}


def summary_line(warnings: Sequence[TableWarning]) -> str:
    """'2 warnings, 23 notes': the one line inspect ends with and profile/merge/import print."""
    counts = count_by_severity(warnings)
    parts = [f"{counts[WARNING]} warning{'s' if counts[WARNING] != 1 else ''}"]
    if counts[NOTE]:
        parts.append(f"{counts[NOTE]} note{'s' if counts[NOTE] != 1 else ''}")
    return ", ".join(parts)


# What each blocking code says in the verdict, counted over the table.
_UNFIT = {
    FEW_SAMPLES: "{n} point(s) with fewer than {MIN_SAMPLES} samples",
    HIGH_SPREAD: "{n} noisy point(s) (p25-p75 over {MAX_REL_SPREAD:.0%} of the median)",
    SHORT_VERIFY: "{n} verify curve(s) short of max_num_batched_tokens",
    SHORT_DRAFT: "{n} draft curve(s) short of max_num_seqs",
    LEVEL_SHIFT: "{n} level shift(s) between blocks",
    THROTTLE: "thermal or power-brake throttling ({n} finding(s))",
}


@dataclass(frozen=True)
class Verdict:
    """Fit to serve or not, and why: the first line of `inspect` and the last of `profile`.

    Unfit when any finding blocks (see WARNING/NOTE): its reasons are those findings,
    counted by kind, over the whole table whatever --context-len shows.
    """

    fit: bool
    reasons: tuple[str, ...]
    warnings: int  # non-blocking warnings worth a look
    notes: int

    @property
    def line(self) -> str:
        if not self.fit:
            return "not fit to serve: " + "; ".join(self.reasons)
        tail = [f"{self.warnings} warning{'s' if self.warnings != 1 else ''} to look at"] if self.warnings else []
        if self.notes:
            tail.append(f"{self.notes} note{'s' if self.notes != 1 else ''}")
        return ("fit to serve: enough samples, tight spreads, curves up to the engine's limits, one level "
                "across blocks, no thermal throttling" + (f" ({', '.join(tail)})" if tail else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"fit": self.fit, "line": self.line, "reasons": list(self.reasons), "warnings": self.warnings,
                "notes": self.notes}


def verdict(findings: Sequence[TableWarning]) -> Verdict:
    blocking: dict[str, int] = {}
    for w in findings:
        if w.blocks:
            blocking[w.code] = blocking.get(w.code, 0) + 1
    reasons = tuple(_UNFIT[code].format(n=n, MIN_SAMPLES=MIN_SAMPLES, MAX_REL_SPREAD=MAX_REL_SPREAD)
                    for code, n in blocking.items())
    counts = count_by_severity(findings)
    return Verdict(not reasons, reasons, sum(w.severity == WARNING and not w.blocks for w in findings), counts[NOTE])


# Step sizes at which `inspect` shows cost against context (capped at max_num_batched_tokens).
CONTEXT_VIEW_SIZES = (1, 16, 64, 256, 1024, 4096, 8192)


@dataclass(frozen=True, eq=False)
class CostByContext:
    """Verify cost vLLM would charge (its dense table) at a few step sizes, per profiled context:
    how much context moves the price. Only for tables with 2+ contexts."""

    contexts: tuple[int, ...]
    sizes: tuple[int, ...]
    verify_ms: tuple[tuple[float, ...], ...]  # [size][context]

    def to_dict(self) -> dict[str, Any]:
        return {"contexts": list(self.contexts), "sizes": list(self.sizes),
                "verify_ms": [[_num(v) for v in row] for row in self.verify_ms]}


def cost_by_context(table: CostTable, sizes: Sequence[int] = CONTEXT_VIEW_SIZES) -> CostByContext | None:
    ctxs = table.context_lens()
    if len(ctxs) < 2:
        return None
    top = table.fingerprint.max_num_batched_tokens
    shown = tuple(s for s in sizes if s <= top) + ((top,) if top not in sizes and top < max(sizes) else ())
    verify = [table.dense_tables(c)[1] for c in ctxs]
    return CostByContext(tuple(ctxs), shown, tuple(tuple(float(v[s]) for v in verify) for s in shown))


@dataclass(eq=False)
class Inspection:
    table: CostTable
    context_lens: list[int]  # the ones shown
    warnings: list[TableWarning]  # every finding, each with its severity (WARNING or NOTE)
    decision: DecisionMap
    path: str | None = None
    notes: list[str] = field(default_factory=list)
    by_context: CostByContext | None = None  # None: one profiled context
    level_shifts: tuple[LevelShift, ...] = ()  # stability.py, over the table's timed blocks
    verdict: Verdict = field(default_factory=lambda: Verdict(True, (), 0, 0))  # over the whole table

    @property
    def counts(self) -> dict[str, int]:
        return count_by_severity(self.warnings)

    @property
    def summary(self) -> str:
        return summary_line(self.warnings)

    def to_dict(self) -> dict[str, Any]:
        t = self.table
        limit = t.fingerprint.cudagraph_limit
        curves: dict[str, Any] = {}
        for ctx in self.context_lens:
            pair = t.curves[ctx]
            curves[str(ctx)] = {kind: curve_to_dict(pair.curve(kind), limit) for kind in CURVE_KINDS}
        return {
            "path": self.path,
            "schema_version": t.schema_version,
            "tool_version": t.tool_version,
            "created_at": t.created_at,
            "content_hash": t.content_hash,
            "calibration": t.calibration.to_json() if t.calibration is not None else None,
            "fingerprint": t.fingerprint.to_dict(),
            "context_lens": list(self.context_lens),
            "num_samples": {str(ctx): t.num_samples(ctx) for ctx in self.context_lens},
            "curves": curves,
            "verdict": self.verdict.to_dict(),
            "warnings": [w.to_dict() for w in self.warnings],
            "counts": self.counts,
            "summary": self.summary,
            "decision_map": self.decision.to_dict(),
            "cost_by_context": self.by_context.to_dict() if self.by_context else None,
            "notes": list(self.notes),
            "telemetry": telemetry_view(t.telemetry),
            "level_shifts": [f.to_dict() for f in self.level_shifts],
        }


def telemetry_view(telemetry: Telemetry | None) -> dict[str, Any] | None:
    """One row per block (what `inspect` prints and --json holds), the summary `diff` compares,
    and where the readings came from. None: the table recorded no telemetry (schema < 1.2)."""
    if telemetry is None:
        return None
    rows = []
    for b in telemetry.blocks:
        sm = b.sm_range
        rows.append({"context_len": b.context_len, "block": b.block, "warmup": b.block < 0,
                     "sm_mhz_min": sm[0] if sm else None, "sm_mhz_max": sm[1] if sm else None,
                     "mem_mhz": b.peak("mem_mhz"), "temp_c_max": b.peak("temp_c"), "power_w_max": b.peak("power_w"),
                     "throttle": list(b.throttle), "load1_max": b.peak("load1"),
                     "cpu_s": (b.end.cpu_s - b.start.cpu_s) if b.end.cpu_s is not None and b.start.cpu_s is not None
                     else None})
    return {"source": telemetry.source, "note": telemetry.note, "summary": telemetry.summary().to_dict(),
            "blocks": rows}


def curve_to_dict(curve: Curve, cudagraph_limit: int) -> dict[str, Any]:
    cols = {name: getattr(curve, name).tolist() for name in
            ("size", "cost_ms", "n", "min_ms", "p25_ms", "p75_ms", "max_ms", "mad_ms")}
    points = [dict(zip(cols, row)) for row in zip(*cols.values())]
    for p in points:
        for k, v in p.items():
            if isinstance(v, float):
                p[k] = _num(v)
        p["captured"] = bool(cudagraph_limit) and p["size"] <= cudagraph_limit
    return {"cudagraph_limit": cudagraph_limit, "points": points}


def inspect_table(table: CostTable, *, context_len: int | None = None, path: str | None = None) -> Inspection:
    """Everything `inspect` shows. context_len picks one profiled context (the nearest); None: all."""
    notes = []
    if context_len is None:
        shown = table.context_lens()
    else:
        ctx = table.nearest_context(context_len)
        if ctx != context_len:
            notes.append(f"no curves at context {context_len}; showing the nearest, {ctx}")
        shown = [ctx]
        if len(table.context_lens()) > 1:
            notes.append(f"the verdict covers all {len(table.context_lens())} profiled contexts; the findings below, "
                         f"context {ctx} only")
    decision = table_decision_map(table, context_len)
    shifts = table_flags(table)
    findings = table_warnings(table, level_shifts=shifts)
    return Inspection(table=table, context_lens=shown, warnings=[w for w in findings if w.context_len in shown],
                      decision=decision, path=path, notes=notes, by_context=cost_by_context(table),
                      level_shifts=tuple(f for f in shifts if f.context_len in shown), verdict=verdict(findings))

"""What `inspect` finds in a table: warnings and the draft-budget decisions it implies.

Analysis only (no printing): render.py draws it, the CLI's --json dumps ``to_dict()``.
numpy-only, so `inspect` starts without scipy or matplotlib.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from dspark_calib.fit import CURVE_KINDS, DRAFT, VERIFY, Curve, decision_map
from dspark_calib.stability import LevelShift, table_flags
from dspark_calib.table.model import CostTable
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

# Severity: a WARNING is worth acting on (re-profile, profile longer, check the GPU); a NOTE
# is a fact about the measurement that needs no action. A falling median is a NOTE when the
# fall (the running max before the point minus the point's median) is no larger than the
# larger p25-p75 range (IQR) of the two points compared (this point, and the one that set the
# running max): two medians that close are not told apart by their own samples, and vLLM's
# running max absorbs the dip anyway. A larger fall is a WARNING, as is any fall where
# neither point recorded a spread (NaN: noise cannot be told from a real dip).
WARNING = "warning"
NOTE = "note"
SEVERITIES = (WARNING, NOTE)


@dataclass(frozen=True)
class TableWarning:
    code: str
    message: str
    context_len: int | None = None
    curve: str | None = None  # "draft" | "verify"
    size: int | None = None
    severity: str = WARNING

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


def curve_warnings(curve: Curve, kind: str, context_len: int) -> list[TableWarning]:
    """Per-point warnings for one curve (vectorised: curves can have 8192 points)."""
    out: list[TableWarning] = []
    where = f"{kind} @ctx {context_len}"
    # Python scalars: formatting numpy ones is ~10x slower, and a noisy 8192-point
    # curve can have thousands of dips.
    sizes, ns, cost = curve.size.tolist(), curve.n.tolist(), curve.cost_ms.tolist()
    for i in np.flatnonzero(curve.n < MIN_SAMPLES).tolist():
        size, n = sizes[i], ns[i]
        out.append(TableWarning(FEW_SAMPLES, f"{where}: size {size} has only {n} sample{'s' if n != 1 else ''} "
                                f"(want >= {MIN_SAMPLES})", context_len, kind, size))
    spread = curve.rel_spread
    for i in np.flatnonzero(np.nan_to_num(spread) > MAX_REL_SPREAD).tolist():
        size = sizes[i]
        out.append(TableWarning(HIGH_SPREAD, f"{where}: size {size} spread p25-p75 is {float(spread[i]):.0%} of "
                                f"its median (> {MAX_REL_SPREAD:.0%}): noisy measurement", context_len, kind, size))
    if len(cost) > 1:
        arr = curve.cost_ms
        run_max = np.maximum.accumulate(arr)
        prev_max = np.concatenate(([-np.inf], run_max[:-1]))
        # Index of the point that set the running max so far, to name it in the message.
        setter = np.maximum.accumulate(np.where(arr >= prev_max, np.arange(len(arr)), 0)).tolist()
        iqr = (curve.p75_ms - curve.p25_ms).tolist()
        for i in np.flatnonzero(arr < prev_max).tolist():
            j = setter[i - 1]
            size, earlier, c, top = sizes[i], sizes[j], cost[i], cost[j]
            within = dip_within_spread(top - c, iqr[i], iqr[j])
            out.append(TableWarning(
                FALLING_MEDIAN,
                f"{where}: size {size} median {c:.3f} ms is {_drop(1 - c / top)} below size {earlier}'s "
                f"{top:.3f} ms" + (" (within the points' p25-p75 spread)" if within else "") + f"; vLLM charges {top:.3f}",
                context_len, kind, size, NOTE if within else WARNING))
    return out


def dip_within_spread(fall: float, iqr_here: float, iqr_top: float) -> bool:
    """The severity rule (see WARNING/NOTE above): a fall no larger than the larger IQR of the
    dipping point and the point that set the running max is noise. NaN spreads are ignored;
    with none recorded the fall cannot be called noise."""
    spreads = [s for s in (iqr_here, iqr_top) if math.isfinite(s)]
    return bool(spreads) and fall <= max(spreads)


def _drop(fraction: float) -> str:
    return f"{fraction:.1%}" if fraction >= 0.001 else f"{fraction:.2%}"


def table_warnings(table: CostTable, context_lens: Sequence[int] | None = None) -> list[TableWarning]:
    fp = table.fingerprint
    out: list[TableWarning] = []
    for ctx in (table.context_lens() if context_lens is None else context_lens):
        pair = table.curves[ctx]
        for kind in CURVE_KINDS:
            out += curve_warnings(pair.curve(kind), kind, ctx)
        # Past its last point vLLM extrapolates linearly: a guess, not a measurement.
        last_v = int(pair.verify.size[-1])
        if last_v < fp.max_num_batched_tokens:
            out.append(TableWarning(SHORT_VERIFY, f"verify @ctx {ctx}: last size {last_v} < max_num_batched_tokens "
                                    f"{fp.max_num_batched_tokens}; larger steps are extrapolated", ctx, VERIFY, last_v))
        last_d = int(pair.draft.size[-1])
        if last_d < fp.max_num_seqs:
            out.append(TableWarning(SHORT_DRAFT, f"draft @ctx {ctx}: last size {last_d} < max_num_seqs "
                                    f"{fp.max_num_seqs}; larger batches are extrapolated", ctx, DRAFT, last_d))
    return out


def count_by_severity(warnings: Sequence[TableWarning]) -> dict[str, int]:
    return {sev: sum(w.severity == sev for w in warnings) for sev in SEVERITIES}


def summary_line(warnings: Sequence[TableWarning]) -> str:
    """'2 warnings, 23 notes': the one line inspect ends with and profile/merge/import print."""
    counts = count_by_severity(warnings)
    parts = [f"{counts[WARNING]} warning{'s' if counts[WARNING] != 1 else ''}"]
    if counts[NOTE]:
        parts.append(f"{counts[NOTE]} note{'s' if counts[NOTE] != 1 else ''}")
    return ", ".join(parts)


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
            "fingerprint": t.fingerprint.to_dict(),
            "context_lens": list(self.context_lens),
            "num_samples": {str(ctx): t.num_samples(ctx) for ctx in self.context_lens},
            "curves": curves,
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
    decision = table_decision_map(table, context_len)
    return Inspection(table=table, context_lens=shown, warnings=table_warnings(table, shown),
                      decision=decision, path=path, notes=notes, by_context=cost_by_context(table),
                      level_shifts=tuple(f for f in table_flags(table) if f.context_len in shown))

"""What `diff` computes: how two cost tables differ, and whether it matters.

Three levels, from cause to effect: the fingerprint (what changed in the setup),
the curves (how each cost moved, and whether the raw samples say the move is real),
and the decisions (where vLLM would now pick a different draft budget).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from dspark_calib.fingerprint import changed_keys
from dspark_calib.fit import CURVE_KINDS, Curve
from dspark_calib.inspection import CONFIDENCE_GRID, DecisionMap, num_reqs_grid, table_decision_map
from dspark_calib.table.model import DEFAULT_CONTEXT, CostTable, nearest
from dspark_calib.telemetry import TelemetrySummary

ALPHA = 0.01  # significance level for "significant" changes
MIN_SAMPLES_FOR_TEST = 3  # fewer and Mann-Whitney cannot say anything useful
MEDIAN = "median"  # both curves profiled this size: compare their medians
DENSE = "dense"  # only one did: compare what vLLM's dense tables price it at


def _num(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass(frozen=True)
class FingerprintChange:
    key: str
    old: Any
    new: Any

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PointChange:
    size: int
    old_ms: float
    new_ms: float
    source: str  # MEDIAN or DENSE
    old_n: int  # samples behind each side's median at this size (0: that side did not profile it)
    new_n: int
    # Mann-Whitney U two-sided on the raw samples; None when not tested (significance not asked
    # for, a table without raw samples, or fewer than 3 samples on a side).
    p_value: float | None = None

    @property
    def abs_change_ms(self) -> float:
        return self.new_ms - self.old_ms

    @property
    def rel_change(self) -> float:
        """(new - old) / old; +0.1 means 10% slower. inf when old is 0 and new is not."""
        if self.old_ms == 0:
            return 0.0 if self.new_ms == 0 else math.inf
        return self.new_ms / self.old_ms - 1

    @property
    def significant(self) -> bool:
        return self.p_value is not None and self.p_value < ALPHA

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(abs_change_ms=self.abs_change_ms, rel_change=_num(self.rel_change), significant=self.significant)
        return d


@dataclass(frozen=True)
class CurveSummary:
    points: int
    median_abs_rel_change: float | None
    max_abs_rel_change: float | None
    max_change_size: int | None  # where the largest |relative change| is
    significant: int  # points with p < ALPHA
    significant_slower: int
    significant_faster: int
    untested: int  # points with no p-value (too few samples on a side)

    def to_dict(self) -> dict[str, Any]:
        return {k: _num(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class CurveDiff:
    kind: str  # "draft" | "verify"
    points: tuple[PointChange, ...]
    summary: CurveSummary
    uncovered_sizes: tuple[int, ...] = ()  # profiled sizes beyond the range both tables price

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "summary": self.summary.to_dict(), "uncovered_sizes": list(self.uncovered_sizes),
                "points": [p.to_dict() for p in self.points]}


@dataclass(frozen=True)
class DecisionChange:
    num_reqs: int
    confidence: float
    old: float | None  # draft budget per request; None where that table cannot price the batch
    new: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class DecisionImpact:
    old: DecisionMap
    new: DecisionMap
    changes: tuple[DecisionChange, ...]

    @property
    def cells(self) -> int:
        """Cells at least one table can price: a batch neither can price is no decision at all."""
        both_unpriced = np.isnan(self.old.budget_per_req) & np.isnan(self.new.budget_per_req)
        return int(both_unpriced.size - both_unpriced.sum())

    def to_dict(self) -> dict[str, Any]:
        return {"cells": self.cells, "changed": len(self.changes), "old": self.old.to_dict(),
                "new": self.new.to_dict(), "changes": [c.to_dict() for c in self.changes]}


@dataclass(eq=False)
class DiffResult:
    old_hash: str
    new_hash: str
    old_context: int
    new_context: int
    fingerprint_changes: list[FingerprintChange]
    curves: dict[str, CurveDiff]
    decisions: DecisionImpact
    old_path: str | None = None
    new_path: str | None = None
    notes: list[str] = field(default_factory=list)
    significance_tested: bool = True
    # Each table's GPU/host conditions (TelemetrySummary), None where it recorded none: a cost
    # change beside a clock, temperature or throttling change is explained by it.
    old_conditions: TelemetrySummary | None = None
    new_conditions: TelemetrySummary | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "old": {"path": self.old_path, "content_hash": self.old_hash, "context_len": self.old_context},
            "new": {"path": self.new_path, "content_hash": self.new_hash, "context_len": self.new_context},
            "alpha": ALPHA,
            "significance_tested": self.significance_tested,
            "fingerprint_changes": [c.to_dict() for c in self.fingerprint_changes],
            "curves": {k: c.to_dict() for k, c in self.curves.items()},
            "decisions": self.decisions.to_dict(),
            "notes": list(self.notes),
            "conditions": {"old": self.old_conditions.to_dict() if self.old_conditions else None,
                           "new": self.new_conditions.to_dict() if self.new_conditions else None},
        }


@dataclass(frozen=True)
class ThresholdVerdict:
    """`diff --threshold PCT`: which significant points moved by more than PCT percent.

    Either direction counts: a significant speed-up beyond PCT is as much a sign that the
    table no longer describes the engine as a slow-down. Only significant points count, so
    noise cannot fail a CI gate; a table without raw samples never exceeds (no p-values).
    """

    pct: float
    over: tuple[tuple[str, PointChange], ...]  # (curve kind, point), in curve order

    @property
    def exceeded(self) -> bool:
        return bool(self.over)

    def to_dict(self) -> dict[str, Any]:
        return {"pct": self.pct, "exceeded": self.exceeded,
                "over": [{"curve": kind, "size": p.size, "rel_change": _num(p.rel_change)} for kind, p in self.over]}


def threshold_verdict(result: DiffResult, pct: float) -> ThresholdVerdict:
    over = tuple((kind, p) for kind, c in result.curves.items() for p in c.points
                 if p.significant and abs(p.rel_change) * 100 > pct)
    return ThresholdVerdict(float(pct), over)


def threshold_exceeded(result: DiffResult, pct: float) -> bool:
    return threshold_verdict(result, pct).exceeded


def choose_contexts(old: CostTable, new: CostTable, old_context: int | None = None,
                    new_context: int | None = None) -> tuple[int, int]:
    """Default: a context length both profiled (nearest to 8192), else each side's default_context()."""
    shared = sorted(set(old.context_lens()) & set(new.context_lens()))
    default = nearest(shared, DEFAULT_CONTEXT) if shared else None
    o = old.nearest_context(default if old_context is None else old_context)
    n = new.nearest_context(default if new_context is None else new_context)
    return o, n


def _raw_groups(table: CostTable, kind: str, context_len: int) -> dict[int, np.ndarray]:
    """Raw samples per size, selected as vLLM's fit does (draft: graph replays only)."""
    if table.samples is None:
        return {}
    keys, values = table.samples.select(kind, context_len).points(kind)
    if len(keys) == 0:
        return {}
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], values[order]
    uniq, starts = np.unique(keys, return_index=True)
    return {int(k): v for k, v in zip(uniq.tolist(), np.split(values, starts[1:]))}


def p_values(pairs: Sequence[tuple[np.ndarray | None, np.ndarray | None]]) -> list[float | None]:
    """Two-sided Mann-Whitney U p-value per (old, new) sample pair; None if a side has < 3.

    Same numbers as one scipy call per pair, but batched: an 8192-point curve would
    otherwise take ~2 ms x 8192 in scipy's per-call overhead. Rows are grouped by
    (n_old, n_new, has ties) because scipy's method="auto" picks exact vs asymptotic
    from the whole batch's ties, and a tie in one row must not change another's test.
    """
    out: list[float | None] = [None] * len(pairs)
    groups: dict[tuple[int, int, bool], list[int]] = {}
    for i, (a, b) in enumerate(pairs):
        if a is None or b is None or len(a) < MIN_SAMPLES_FOR_TEST or len(b) < MIN_SAMPLES_FOR_TEST:
            continue
        ties = bool((np.diff(np.sort(np.concatenate((a, b)))) == 0).any())
        groups.setdefault((len(a), len(b), ties), []).append(i)
    if not groups:
        return out
    from scipy.stats import mannwhitneyu  # only diff needs scipy: keep it out of inspect's start-up

    for idx in groups.values():
        x = np.stack([pairs[i][0] for i in idx])
        y = np.stack([pairs[i][1] for i in idx])
        p = np.atleast_1d(mannwhitneyu(x, y, alternative="two-sided", axis=1).pvalue)
        for i, v in zip(idx, p.tolist()):
            out[i] = float(v)
    return out


def _summarise(points: Sequence[PointChange]) -> CurveSummary:
    if not points:
        return CurveSummary(0, None, None, None, 0, 0, 0, 0)
    rel = np.array([abs(p.rel_change) for p in points])
    i = int(np.argmax(rel))
    sig = [p for p in points if p.significant]
    return CurveSummary(
        points=len(points),
        median_abs_rel_change=float(np.median(rel)),
        max_abs_rel_change=float(rel[i]),
        max_change_size=points[i].size,
        significant=len(sig),
        significant_slower=sum(p.new_ms > p.old_ms for p in sig),
        significant_faster=sum(p.new_ms < p.old_ms for p in sig),
        untested=sum(p.p_value is None for p in points),
    )


def compare_curves(kind: str, old: Curve, new: Curve, old_dense: np.ndarray, new_dense: np.ndarray,
                   old_raw: dict[int, np.ndarray] | None, new_raw: dict[int, np.ndarray] | None) -> CurveDiff:
    """old_raw/new_raw: raw samples per size for the significance test; None: not tested."""
    old_cost = dict(zip(old.size.tolist(), old.cost_ms.tolist()))
    new_cost = dict(zip(new.size.tolist(), new.cost_ms.tolist()))
    old_n = dict(zip(old.size.tolist(), old.n.tolist()))
    new_n = dict(zip(new.size.tolist(), new.n.tolist()))
    common_top = min(len(old_dense), len(new_dense)) - 1  # largest size both dense tables price
    rows: list[tuple[int, float, float, str]] = []
    uncovered = []
    for size in sorted(set(old_cost) | set(new_cost)):
        if size in old_cost and size in new_cost:
            o, n, source = old_cost[size], new_cost[size], MEDIAN
        elif size <= common_top:
            # Profiled on one side only: compare what each engine would actually be charged.
            o, n, source = float(old_dense[size]), float(new_dense[size]), DENSE
        else:
            uncovered.append(size)
            continue
        rows.append((size, o, n, source))
    if old_raw is None or new_raw is None:
        pvals: list[float | None] = [None] * len(rows)
    else:
        pvals = p_values([(old_raw.get(size), new_raw.get(size)) for size, *_ in rows])
    points = [PointChange(size=size, old_ms=o, new_ms=n, source=source, old_n=int(old_n.get(size, 0)),
                          new_n=int(new_n.get(size, 0)), p_value=p)
              for (size, o, n, source), p in zip(rows, pvals)]
    return CurveDiff(kind, tuple(points), _summarise(points), tuple(uncovered))


def compare_decisions(old: CostTable, new: CostTable, old_context: int, new_context: int,
                      confidence: Sequence[float] = CONFIDENCE_GRID) -> DecisionImpact:
    # One grid for both (union of each table's capped grid) so cells line up; a table
    # that cannot price a row leaves it NaN and the cell counts as changed.
    reqs = sorted(set(num_reqs_grid(old.fingerprint.max_num_seqs)) | set(num_reqs_grid(new.fingerprint.max_num_seqs)))
    om = table_decision_map(old, old_context, reqs=reqs, confidence=confidence)
    nm = table_decision_map(new, new_context, reqs=reqs, confidence=confidence)
    changes = []
    for i, r in enumerate(reqs):
        for j, c in enumerate(om.confidence):
            a, b = float(om.budget_per_req[i, j]), float(nm.budget_per_req[i, j])
            if math.isnan(a) and math.isnan(b):
                continue
            if math.isnan(a) or math.isnan(b) or a != b:
                changes.append(DecisionChange(r, c, None if math.isnan(a) else a, None if math.isnan(b) else b))
    return DecisionImpact(om, nm, tuple(changes))


def _fingerprint_changes(old: CostTable, new: CostTable) -> list[FingerprintChange]:
    """changed_keys, with `extra` (free-form notes) split per note: one timing note differing
    should not hide which."""
    out = []
    for key, o, n in changed_keys(old.fingerprint, new.fingerprint):
        if key == "extra" and isinstance(o, dict) and isinstance(n, dict):
            out += [FingerprintChange(f"extra.{k}", o.get(k), n.get(k)) for k in sorted(set(o) | set(n), key=str)
                    if o.get(k) != n.get(k)]
        else:
            out.append(FingerprintChange(key, o, n))
    return out


def calibration_notes(old: CostTable, new: CostTable) -> list[str]:
    """What a diff of a calibrated table says of its correction: a table calibrated from the
    other holds the other's raw samples, so its curve changes are the correction itself and a
    significance test on the samples cannot see them."""
    notes = []
    for side, table, other in (("old", old, new), ("new", new, old)):
        cal = table.calibration
        if cal is None:
            continue
        notes.append(f"{side} table is {cal.summary()}")
        if cal.parent == other.content_hash:
            notes.append(f"{side} is calibrated from the other table: its curves are the other's times the "
                         "correction, its raw samples the same (a significance test cannot see the correction)")
    return notes


def compare_tables(old: CostTable, new: CostTable, *, old_context: int | None = None,
                   new_context: int | None = None, old_path: str | None = None,
                   new_path: str | None = None, significance: bool = True) -> DiffResult:
    """significance=False skips the Mann-Whitney tests (and scipy's ~0.8 s import): every
    p-value is None, nothing counts as significant."""
    oc, nc = choose_contexts(old, new, old_context, new_context)
    notes = []
    for side, want, got in (("old", old_context, oc), ("new", new_context, nc)):
        if want is not None and want != got:
            notes.append(f"{side} table has no curves at context {want}; using the nearest, {got}")
    if oc != nc:
        notes.append(f"comparing different context lengths: old {oc}, new {nc}")
    notes.extend(calibration_notes(old, new))
    old_dense = old.dense_tables(oc)  # each with its own cudagraph_limit and engine limits
    new_dense = new.dense_tables(nc)
    curves = {}
    for i, kind in enumerate(CURVE_KINDS):
        old_raw = _raw_groups(old, kind, oc) if significance else None
        new_raw = _raw_groups(new, kind, nc) if significance else None
        curves[kind] = compare_curves(kind, old.curves[oc].curve(kind), new.curves[nc].curve(kind),
                                      old_dense[i], new_dense[i], old_raw, new_raw)
    return DiffResult(
        old_hash=old.short_hash, new_hash=new.short_hash, old_context=oc, new_context=nc,
        fingerprint_changes=_fingerprint_changes(old, new),
        curves=curves, decisions=compare_decisions(old, new, oc, nc),
        old_path=old_path, new_path=new_path, notes=notes, significance_tested=significance,
        old_conditions=old.telemetry.summary() if old.telemetry else None,
        new_conditions=new.telemetry.summary() if new.telemetry else None,
    )


__all__ = [
    "ALPHA", "CurveDiff", "CurveSummary", "DecisionChange", "DecisionImpact", "DiffResult", "FingerprintChange",
    "PointChange", "ThresholdVerdict", "p_values", "choose_contexts", "compare_curves", "compare_decisions",
    "compare_tables", "threshold_exceeded", "threshold_verdict",
]

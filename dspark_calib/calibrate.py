"""Calibration from served steps: a measured table's curves corrected by what serving measured.

``calibrate(table, files)`` prices every observed step exactly as ``validate`` does (each file
apart, with the settings its engine priced with: ``validate.price_steps``), and fits one
multiplicative factor per curve kind and size region (table/calibration.py): the median of
measured / predicted over the drafts (full CUDA-graph steps) and over the decode verifies
(the shapes a profile measures; steps carrying a prefill chunk are priced by the verify curve
too, and moved with it, but fitted on by nobody). A region with fewer than ``MIN_STEPS``
steps takes its kind's factor over both regions; a kind with fewer is left at 1.

Why this model: the part of the residuals a factor can carry is a host's level (H200s of one
pool serve a few % apart at the profile's own step shape), uniform over a curve, and graph
replays and eager steps are the two kinds of step whose level may differ. Decode verifies of
another shape than the profile's (validate's by-shape split) lean further, each shape its own
way; one factor per kind cannot follow that and leaves it in validate's report. A per-context
scale (more parameters) made held-out steps worse; the factors here are what docs/pricing.md
reports on held-out served steps.

Which files: only evidence of this table's engine. A file recording the table it served
with must record this table (another table's steps would be fitted on another pricing); a
file of stock vLLM (no table) must record its engine's fingerprint keys (observe schema
1.2's ``engine``), which must fit the table's (``ObserveMeta.check_engine``); a file
recording neither is refused, as is a calibrated table (calibrate its measured parent).
The result is a new table of the same fingerprint; nothing is written over the parent.

Analysis only: numpy, no torch, no vllm.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dspark_calib import __version__
from dspark_calib.errors import CalibError, display_path
from dspark_calib.fileformat.version import utc_now
from dspark_calib.observe.file import ObservedSteps, read_observed
from dspark_calib.table.calibration import ABOVE, REGIONS, WITHIN, Calibration
from dspark_calib.table.model import SCHEMA_VERSION, CostTable
from dspark_calib.validate import AWARE, ErrorStats, price_steps

MIN_STEPS = 20  # fewer steps than this say nothing of a median (validate's MIN_TAIL_STEPS, the docs' buckets)
FITTED_KINDS = {"draft": "draft", "verify": "verify"}  # validate's step kind -> the curve it prices by


@dataclass(frozen=True)
class FitCheck:
    """One curve kind on the steps it was fitted on: context-aware errors before and after."""

    kind: str
    before: ErrorStats
    after: ErrorStats

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "before": self.before.to_dict(), "after": self.after.to_dict()}


@dataclass(frozen=True)
class CalibrationResult:
    table: CostTable  # the calibrated table (not written yet)
    calibration: Calibration
    fitted: tuple[FitCheck, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"content_hash": self.table.content_hash, "summary": self.calibration.summary(),
                "calibration": self.calibration.to_json(), "fitted": [f.to_dict() for f in self.fitted]}


def check_evidence(table: CostTable, path: str, observed: ObservedSteps) -> None:
    """Refuse a file that is no evidence of this table's engine (see the module docstring)."""
    meta = observed.metadata[0]
    if meta.table_hash and meta.table_hash != table.content_hash:
        raise CalibError(f"table_hash {meta.table_hash[:12]} is not this table's {table.short_hash}: its steps were "
                         "served and priced with another table; calibrate that table with them", path=path)
    if not meta.check_engine(table.fingerprint, path) and not meta.table_hash:
        raise CalibError("records neither a table_hash nor an engine fingerprint (engine): nothing ties its steps "
                         "to this table's engine", path=path)


def _ratios(table: CostTable, observed: ObservedSteps) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per step kind: (predicted, measured, size) of the steps of that kind, priced as validate prices."""
    p = price_steps(table, observed)
    return {kind: (p.predicted[kind][AWARE][p.steps[kind]], p.measured[kind][p.steps[kind]],
                   p.sizes[kind][p.steps[kind]]) for kind in FITTED_KINDS}


def _factors(predicted: np.ndarray, measured: np.ndarray, sizes: np.ndarray, limit: int) -> dict[str, float]:
    ratio = measured / predicted
    if len(ratio) < MIN_STEPS:
        return {r: 1.0 for r in REGIONS}
    overall = float(np.median(ratio))
    within = sizes <= limit
    return {region: float(np.median(ratio[sel])) if sel.sum() >= MIN_STEPS else overall
            for region, sel in ((WITHIN, within), (ABOVE, ~within))}


def calibrate(table: CostTable, files: Sequence[str]) -> CalibrationResult:
    """The table corrected by the served steps of `files` (see the module docstring)."""
    if table.calibration is not None:
        raise CalibError(f"the table is calibrated already (from parent {table.calibration.parent[:12]}): "
                         "calibrate its measured parent")
    if table.samples is None:
        raise CalibError("the table was read without its raw samples; calibrate keeps them: read it whole")
    pooled: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {k: [] for k in FITTED_KINDS}
    provenance, read = [], []
    for path in files:
        observed = read_observed([path])  # each file as its own engine priced it (settings may differ)
        check_evidence(table, display_path(path), observed)
        if len(observed) == 0:
            raise CalibError("holds no observed steps", path=display_path(path))
        read.append(observed)
        for kind, part in _ratios(table, observed).items():
            pooled[kind].append(part)
        meta = observed.metadata[0]
        provenance.append({"name": os.path.basename(path), "steps": len(observed), "table_hash": meta.table_hash,
                           "mode": meta.mode, "created_at": meta.raw.get("created_at"), "host": meta.raw.get("host")})
    if not provenance:
        raise CalibError("no observe files to calibrate from")
    limit = int(table.fingerprint.cudagraph_limit)
    joined = {kind: tuple(np.concatenate(cols) for cols in zip(*parts)) for kind, parts in pooled.items()}
    factors = {FITTED_KINDS[k]: _factors(*joined[k], limit) for k in FITTED_KINDS}
    cal = Calibration(parent=table.content_hash, capture_limit=limit, factors=factors,
                      steps={FITTED_KINDS[k]: len(joined[k][0]) for k in FITTED_KINDS}, files=tuple(provenance))
    cal.check()
    new = dataclasses.replace(table, curves=cal.apply(table.curves), calibration=cal, created_at=utc_now(),
                              tool_version=__version__, schema_version=SCHEMA_VERSION)
    new.validate()
    new.check_plausible()
    # the fitted steps priced again, by the calibrated table: what it prices, not what the factors promise
    repriced = [_ratios(new, observed) for observed in read]
    fitted = tuple(FitCheck(kind, ErrorStats.of(*joined[kind][:2]),
                            ErrorStats.of(np.concatenate([r[kind][0] for r in repriced]), joined[kind][1]))
                   for kind in FITTED_KINDS)
    return CalibrationResult(new, cal, fitted)

"""A calibrated table's correction: what it multiplies the measured curves by, and where from.

``calibrate`` (dspark_calib/calibrate.py) fits the correction on served steps; this module
is what a table holds of it (the ``calibration`` metadata key, table schema 1.3).

How a calibrated table keeps the measured curves: its curve rows are the CORRECTED curves
(every cost column of a point, spread included, times the factor of the point's kind and
size region), so the loader, the pricing, ``validate``, ``advise`` and the plugin price a
calibrated table exactly like any other, with nothing applied at serving time that one of
them could miss. The measured curves stay available three ways: the raw samples are the
parent's, unchanged (they refit to the parent's curves exactly), the factors are recorded
here (dividing by them gives the measured curves back), and the parent's content hash is
recorded (``diff PARENT CALIBRATED`` shows what the correction moved). The content hash
covers the correction like every metadata key, and a table is calibrated once, from a
measured parent (``calibrate`` refuses a calibrated table: fit again from its parent).

The correction: one factor per curve kind (draft, verify) and size region: within the CUDA
graph capture limit (``cudagraph_limit``: sizes vLLM replays as graphs) and above it (eager
steps), the two regions whose serving-state slowdown the profile's short blocks measure
differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark_calib.errors import CalibError
from dspark_calib.fit import CURVE_COLUMNS, CURVE_KINDS, Curve, CurvePair

WITHIN, ABOVE = "within_capture", "above_capture"
REGIONS = (WITHIN, ABOVE)
# A factor outside this is no correction of one engine's profile but another engine or a broken
# fit: refused on fit and on read. A serving state moves a curve by a few %; the largest measured
# correction is a host-bound drafter (vLLM's draft_model drafter runs eagerly; its profile steps
# cost about twice its served ones, docs/results/2026-12-02-draft-goodput-pinned.md), so the
# bound leaves a factor of 4 either way.
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0
_COST_COLUMNS = tuple(c for c in CURVE_COLUMNS if c.endswith("_ms"))


@dataclass(frozen=True)
class Calibration:
    """The correction a calibrated table's curves carry, with its provenance."""

    parent: str  # the measured parent's content hash (sha256 hex)
    capture_limit: int  # sizes <= this are WITHIN
    factors: dict[str, dict[str, float]]  # curve kind -> region -> factor (1.0: not corrected)
    steps: dict[str, int]  # curve kind -> served steps the factors rest on
    files: tuple[dict[str, Any], ...] = field(default=())  # per observe file: name, steps, table_hash, mode, host

    def factor(self, kind: str, sizes: np.ndarray) -> np.ndarray:
        f = self.factors[kind]
        return np.where(np.asarray(sizes) <= self.capture_limit, f[WITHIN], f[ABOVE])

    def apply(self, curves: dict[int, CurvePair]) -> dict[int, CurvePair]:
        """The curves corrected: every cost column of a point times its factor."""
        def corrected(curve: Curve, kind: str) -> Curve:
            f = self.factor(kind, curve.size)
            return Curve.from_columns({c: getattr(curve, c) * f if c in _COST_COLUMNS else getattr(curve, c)
                                       for c in CURVE_COLUMNS})

        return {ctx: CurvePair(*(corrected(pair.curve(k), k) for k in CURVE_KINDS)) for ctx, pair in curves.items()}

    def hosts(self) -> list[str]:
        return sorted({str(f.get("host")) for f in self.files if f.get("host")})

    def _where(self) -> str:
        """'N steps of hosts H' (observe files counted when no host is recorded)."""
        hosts = self.hosts()
        where = (f"host{'s' * (len(hosts) != 1)} {', '.join(hosts)}" if hosts
                 else f"{len(self.files)} observe file{'s' * (len(self.files) != 1)} (no host recorded)")
        served = sum(int(f.get("steps") or 0) for f in self.files)  # observed steps, drafts and verifies in them
        return f"{served} steps of {where}"

    def provenance(self) -> str:
        """What the load line (and check's, the same line) says of a calibrated table."""
        return f"calibrated from {self._where()} (parent {self.parent[:12]})"

    def summary(self) -> str:
        """One line: calibrated from parent X on N steps of hosts H, and the factors."""
        moved = ", ".join(f"{k} x{self.factors[k][WITHIN]:.4f} (<= {self.capture_limit}) / x{self.factors[k][ABOVE]:.4f}"
                          for k in CURVE_KINDS)
        return f"calibrated from parent {self.parent[:12]} on {self._where()}: {moved}"

    def to_json(self) -> dict[str, Any]:
        return {"parent": self.parent, "capture_limit": self.capture_limit,
                "factors": {k: dict(v) for k, v in self.factors.items()}, "steps": dict(self.steps),
                "files": [dict(f) for f in self.files]}

    @classmethod
    def from_json(cls, raw: Any) -> "Calibration | None":
        """None for a measured table (no key, or null); CalibError for anything malformed."""
        if raw is None:
            return None
        try:
            cal = cls(parent=str(raw["parent"]), capture_limit=int(raw["capture_limit"]),
                      factors={k: {r: float(raw["factors"][k][r]) for r in REGIONS} for k in CURVE_KINDS},
                      steps={k: int(raw["steps"][k]) for k in CURVE_KINDS},
                      files=tuple(dict(f) for f in raw.get("files", ())))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CalibError("metadata calibration is malformed (want parent, capture_limit, factors and steps "
                             "per curve kind)") from None
        cal.check()
        return cal

    def check(self) -> None:
        if len(self.parent) != 64 or any(ch not in "0123456789abcdef" for ch in self.parent):
            raise CalibError("calibration parent is not a sha256 hex digest")
        for kind in CURVE_KINDS:
            for region in REGIONS:
                f = self.factors[kind][region]
                if not (math.isfinite(f) and MIN_FACTOR <= f <= MAX_FACTOR):
                    raise CalibError(f"calibration factor {kind} {region} {f!r} is outside "
                                     f"[{MIN_FACTOR:g}, {MAX_FACTOR:g}] (no correction of one engine's profile is that large)")

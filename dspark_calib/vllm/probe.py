"""The load-time probe: time a couple of real steps and compare them with the table.

A fingerprint proves a table was made for this kind of engine, and a content hash
proves it was not damaged; neither proves the costs are true (a copied fingerprint
and a recomputed hash make a valid forgery). So load mode times, after
the warm-ups, at most two steps at the table's chosen context:

* the capture limit: a full CUDA-graph step, so both the verify (forward_ms) and
  the draft (drafter_ms) curve are measured;
* the largest tail size: a piecewise step, warmed up just before (a first run of a
  piecewise shape includes one-time work and is never judged).

A probed cost passes when |measured / median - 1| <= min(max(3 x IQR / median, 5 %), 15 %),
the IQR being the table's own spread at that point: 5 % because host noise in the
timed window is a few percent (VLLM_FACTS), 3 x IQR because a noisy point must
not fail a genuine table. PR #52233 accepts 0.4-2.5x; this is far tighter.

Timings come from vLLM's own StepTimingCollector: hook_collector() lets the load decision
find the collector whose collect() block is running (the one timing the dummy
runs); the events of the probe steps are resolved right after their last step,
behind one synchronize, as vLLM does on leaving the block.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

MIN_TOLERANCE = 0.05
IQR_FACTOR = 3.0
# The table's p25/p75 are untrusted: a forged table with p25=0, p75=2x cost would otherwise
# allow +/- 600 % and pass costs x1.3 (measured 0.74-0.77x on the H200). Real H200 spreads
# are ~0.1-2 % of the median (3 x IQR <= ~6-12 %), so 15 % never fails a genuine table.
MAX_TOLERANCE = 0.15
_MARK = "_dspark_calib_original"
_active = threading.local()


# -- finding the collector ----------------------------------------------------------------
def hook_collector(collector_cls: Any = None) -> None:
    """Wrap StepTimingCollector.collect so active_collector() names the collector whose block
    is running on this thread. Idempotent. plugin.py calls it when it patches vLLM."""
    if collector_cls is None:
        from vllm.v1.worker.gpu.async_utils import StepTimingCollector as collector_cls
    orig = collector_cls.collect
    if hasattr(orig, _MARK):
        return
    import contextlib

    @functools.wraps(orig)
    @contextlib.contextmanager
    def collect(self: Any):
        outer = getattr(_active, "collector", None)
        _active.collector = self
        try:
            with orig(self) as samples:
                yield samples
        finally:
            _active.collector = outer

    setattr(collect, _MARK, orig)
    collector_cls.collect = collect


def unhook_collector(collector_cls: Any = None) -> None:
    if collector_cls is None:
        from vllm.v1.worker.gpu.async_utils import StepTimingCollector as collector_cls
    orig = getattr(collector_cls.collect, _MARK, None)
    if orig is not None:
        collector_cls.collect = orig


def active_collector() -> Any:
    return getattr(_active, "collector", None)


def timed_count(collector: Any) -> int | None:
    """Steps timed so far in the running block (None when the collector's shape is unknown)."""
    timed = getattr(collector, "_timed", None)
    return len(timed) if isinstance(timed, list) else None


@dataclass(frozen=True)
class Measured:
    forward_ms: float
    drafter_ms: float
    num_target_tokens: int
    num_reqs: int
    full_cudagraph: bool


def resolve(collector: Any, start: int) -> list[Measured]:
    """The timings of the steps timed since `start`, behind one sync on the last one."""
    timed = collector._timed[start:]
    if not timed:
        return []
    timed[-1][0].drafter_end.synchronize()  # same stream, issue order: the rest are done too
    return [Measured(float(ev.forward_start.elapsed_time(ev.forward_end)),
                     float(ev.drafter_start.elapsed_time(ev.drafter_end)), int(n), int(r), bool(full))
            for ev, (full, n, r) in timed]


# -- judging ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    what: str  # "verify@512"
    ratio: float  # measured / table median
    tolerance: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.ratio) and abs(self.ratio - 1.0) <= self.tolerance

    def __str__(self) -> str:
        # "allowed": the bound, said so a failing line does not read as a pass
        return f"{self.what} {self.ratio:.2f}x (allowed 1.00x +/- {self.tolerance:.0%})"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    checks: tuple[Check, ...] = ()
    note: str = ""  # why nothing could be judged

    @property
    def worst(self) -> Check | None:
        return max(self.checks, key=lambda c: abs(c.ratio - 1.0) if math.isfinite(c.ratio) else math.inf,
                   default=None)

    def summary(self) -> str:
        if not self.checks:
            return f"probe inconclusive ({self.note})"
        ratios = ", ".join(f"{c.what} {c.ratio:.2f}x" for c in self.checks)
        return f"probe ratios {ratios}; worst {self.worst}"


def _point(curve: Any, size: int) -> tuple[float, float] | None:
    """(median, tolerance) of the table's point at exactly `size`, if it has one."""
    hits = [i for i, s in enumerate(curve.size.tolist()) if s == size]
    if not hits:
        return None
    i = hits[0]
    median = float(curve.cost_ms[i])
    iqr = float(curve.p75_ms[i]) - float(curve.p25_ms[i])
    rel = IQR_FACTOR * iqr / median if median > 0 and math.isfinite(iqr) and iqr >= 0 else 0.0
    return median, min(max(rel, MIN_TOLERANCE), MAX_TOLERANCE)


def judge(pair: Any, measured: list[Measured], expected: int) -> Verdict:
    """Compare each probed step with the table's point medians (draft only for full-graph steps,
    as vLLM's draft curve uses only those)."""
    if len(measured) < expected:
        return Verdict(False, note=f"{len(measured)} of {expected} probe steps were timed")
    checks = []
    for m in measured:
        for kind, curve, size, value in (("verify", pair.verify, m.num_target_tokens, m.forward_ms),
                                         ("draft", pair.draft, m.num_reqs, m.drafter_ms)):
            if kind == "draft" and not m.full_cudagraph:
                continue
            point = _point(curve, size)
            if point is None:
                continue
            median, tol = point
            checks.append(Check(f"{kind}@{size}", value / median if median > 0 else math.inf, tol))
    if not checks:
        return Verdict(False, note="the table has no point at the probed sizes")
    return Verdict(all(c.ok for c in checks), tuple(checks))

"""The load-time probe: time a few real steps and compare them with what the engine installs.

A fingerprint proves a table was made for this kind of engine, and a content hash
proves it was not damaged; neither proves the costs are true (a copied fingerprint
and a recomputed hash make a valid forgery). So load mode times, after the warm-ups,
two steps at every context the engine will price (plan_probe):

* the capture limit: a full CUDA-graph step, so both the verify (forward_ms) and
  the draft (drafter_ms) curve are measured at max_num_seqs requests;
* the largest tail size: a piecewise step, warmed up just before (a first run of a
  piecewise shape includes one-time work and is never judged).

Not the one-request step: a few milliseconds, mostly host time in the timed window, it read
1.04-1.27x a genuine table on an H200 (load.probe_sizes).

The contexts: every profiled context of a table the context-aware grid prices, else the
chosen one. Each step is compared with the installed cost, the dense table vLLM's rule
builds from that context's curves (the running max over all points, so a forged point
below the probed size shows; at a profiled context the grid's row is that table), and the
table must have a point at every probed size (a curve without one is priced by points the
probe never saw). The budget bounds start-up: MAX_PROBE_STEPS steps, and a predicted time of
them (the table's own costs) that scales with what the probe replaces (probe_budget_ms: a share
of the table's predicted time of vLLM's start-up profile, between a floor and a cap); a context
left out by it is left out of the grid.

A probed cost passes when |measured / installed - 1| <= min(max(3 x IQR / median, 5 %), 15 %),
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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark_calib.pricing.costs import Tables
    from dspark_calib.telemetry import Reading

MIN_TOLERANCE = 0.05
IQR_FACTOR = 3.0
# The table's p25/p75 are untrusted: a forged table with p25=0, p75=2x cost would otherwise
# allow +/- 600 % and pass costs x1.3 (measured 0.74-0.77x on the H200). Real H200 spreads
# are ~0.1-2 % of the median (3 x IQR <= ~6-12 %), so 15 % never fails a genuine table.
MAX_TOLERANCE = 0.15
# The probe's budget: at most this many timed steps (6 contexts of two sizes), and the table's own
# predicted time of them at most probe_budget_ms. Contexts past the budget are left out of the grid.
MAX_PROBE_STEPS = 12
# The budget's floor: a DSpark table's steps are fast (the shipped H200 table's plan, 6 steps at
# contexts 1024, 8192 and 16384, is about 1.05 s predicted), and its start-up profile is ~20 s.
PROBE_BUDGET_MS = 1500.0
# The share of the skipped start-up profile's predicted time the probe may spend above the floor:
# small beside what load mode saves, and enough for a slow speculator (a draft model's drafter
# steps are several times a DSpark head's) to have every priced context probed instead of
# single-context pricing.
PROBE_SHARE = 0.05
# The budget's cap, whatever the table claims: its costs are untrusted until the probe judges them,
# and past 10 s the probe alone would cost half a DSpark engine's whole start-up profile; a table
# slower still has contexts left out, and the probe's line says the budget.
PROBE_BUDGET_CAP_MS = 10_000.0
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


# -- the plan ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One probe step: a vLLM dummy-run size at one context."""

    context_len: int
    num_tokens: int


@dataclass(frozen=True)
class Plan:
    """The probe's steps, decided on TP rank 0 and broadcast (every rank runs them)."""

    steps: tuple[Step, ...] = ()
    contexts: tuple[int, ...] = ()  # probed, ascending: the only ones the engine then prices
    skipped: tuple[int, ...] = ()  # contexts the grid would price that the budget left out
    predicted_ms: float = 0.0  # the table's own cost of the steps (what the GPU should take)
    note: str = ""  # why no plan could be made
    budget_ms: float = PROBE_BUDGET_MS  # the predicted step time the plan was allowed (probe_budget_ms)
    profile_ms: float | None = None  # the table's predicted time of the skipped start-up profile

    @property
    def budget(self) -> str:
        """The budget in words, for the line that names the contexts it left out."""
        why = "" if self.profile_ms is None else (
            f": {PROBE_SHARE:.0%} of its predicted {self.profile_ms / 1000:.1f} s start-up profile, "
            f"kept within {PROBE_BUDGET_MS / 1000:g}-{PROBE_BUDGET_CAP_MS / 1000:g} s")
        return f"{MAX_PROBE_STEPS} steps, {self.budget_ms / 1000:.2f} s of the table's predicted step time{why}"


def step_cost(tables: Tables, num_tokens: int) -> float:
    """The installed cost of one dummy step: its verify plus its drafter (num_reqs = tokens,
    capped at max_num_reqs, as vLLM's _dummy_run builds it)."""
    draft, verify = tables
    return float(verify[min(num_tokens, len(verify) - 1)]) + float(draft[min(num_tokens, len(draft) - 1)])


def profile_ms(tables: Tables, profile_sizes: Sequence[int]) -> float | None:
    """The table's own predicted time of the start-up profile load mode skips: vLLM's dummy runs
    (every size as often as vLLM replays it), each priced as step_cost at one context. None when
    there is no such run to price."""
    return sum(step_cost(tables, n) for n in profile_sizes) if profile_sizes else None


def probe_budget_ms(skipped_ms: float | None) -> float:
    """The probe's budget of predicted step time: PROBE_SHARE of what it replaces, never below
    PROBE_BUDGET_MS nor above PROBE_BUDGET_CAP_MS; PROBE_BUDGET_MS when that is unknown."""
    if skipped_ms is None or not math.isfinite(skipped_ms):
        return PROBE_BUDGET_MS
    return min(max(PROBE_BUDGET_MS, PROBE_SHARE * skipped_ms), PROBE_BUDGET_CAP_MS)


def plan_probe(installed: Mapping[int, Tables], chosen: int, sizes: Sequence[int],
               profile_sizes: Sequence[int] = ()) -> Plan:
    """The chosen context's steps always; then the others, farthest from it first, while the plan
    stays within MAX_PROBE_STEPS and probe_budget_ms of the table's own predicted step time, the
    profile the probe replaces being vLLM's dummy runs of `profile_sizes` priced at the chosen
    context (the one vLLM's profile would have priced). A context left out is left out of the
    grid too (the engine prices only what was judged)."""
    if not sizes:
        return Plan(note="no dummy-run size to probe (no captured graph, no tail size)")
    skipped_profile = profile_ms(installed[chosen], profile_sizes)
    budget = probe_budget_ms(skipped_profile)
    order = [chosen] + sorted((c for c in installed if c != chosen), key=lambda c: (-abs(c - chosen), -c))
    steps: list[Step] = []
    probed, skipped, predicted = [], [], 0.0
    for ctx in order:
        cost = sum(step_cost(installed[ctx], n) for n in sizes)
        fits = len(steps) + len(sizes) <= MAX_PROBE_STEPS and predicted + cost <= budget
        if ctx != chosen and not fits:
            skipped.append(ctx)
            continue
        probed.append(ctx)
        predicted += cost
        steps += [Step(ctx, n) for n in sizes]
    steps.sort(key=lambda s: (s.context_len, s.num_tokens))
    return Plan(tuple(steps), tuple(sorted(probed)), tuple(sorted(skipped)), predicted,
                budget_ms=budget, profile_ms=skipped_profile)


# -- judging ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    what: str  # "verify@512"
    ratio: float  # measured / installed cost (nan: the table has no point there)
    tolerance: float
    context_len: int | None = None

    @property
    def ok(self) -> bool:
        return math.isfinite(self.ratio) and abs(self.ratio - 1.0) <= self.tolerance

    @property
    def shown(self) -> str:
        return f"{self.ratio:.2f}x" if not math.isnan(self.ratio) else "no table point"

    def __str__(self) -> str:
        where = self.what if self.context_len is None else f"{self.what} at context {self.context_len}"
        if math.isnan(self.ratio):
            return f"{where}: the table has no point at the probed size"
        # "allowed": the bound, said so a failing line does not read as a pass
        return f"{where} {self.ratio:.2f}x (allowed 1.00x +/- {self.tolerance:.0%})"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    checks: tuple[Check, ...] = ()
    note: str = ""  # why nothing could be judged
    conditions: str = ""  # the GPU's SM clock and throttle state around the probe steps
    steps: int = 0  # probe steps run
    seconds: float | None = None  # their wall time, the resolve included

    @property
    def worst(self) -> Check | None:
        return max(self.checks, key=lambda c: abs(c.ratio - 1.0) if math.isfinite(c.ratio) else math.inf,
                   default=None)

    def summary(self) -> str:
        after = f"; {self.steps} steps in {self.seconds:.2f} s" if self.seconds is not None else ""
        after += f"; {self.conditions}" if self.conditions else ""
        if not self.checks:
            return f"probe inconclusive ({self.note}){after}"
        groups: dict[int | None, list[str]] = {}
        for c in self.checks:
            groups.setdefault(c.context_len, []).append(f"{c.what} {c.shown}")
        ratios = "; ".join((f"context {ctx}: " if ctx is not None else "") + ", ".join(items)
                           for ctx, items in groups.items())
        return f"probe ratios {ratios}; worst {self.worst}{after}"


def _tolerance(curve: Any, size: int) -> float | None:
    """The tolerance at the table's point at exactly `size` (None: no point there)."""
    hits = [i for i, s in enumerate(curve.size.tolist()) if s == size]
    if not hits:
        return None
    i = hits[0]
    median = float(curve.cost_ms[i])
    iqr = float(curve.p75_ms[i]) - float(curve.p25_ms[i])
    rel = IQR_FACTOR * iqr / median if median > 0 and math.isfinite(iqr) and iqr >= 0 else 0.0
    return min(max(rel, MIN_TOLERANCE), MAX_TOLERANCE)


def _check(kind: str, ctx: int, curve: Any, table: Any, size: int, value: float) -> Check:
    tol = _tolerance(curve, size)
    if tol is None or not 0 <= size < len(table):
        return Check(f"{kind}@{size}", math.nan, 0.0, ctx)
    expected = float(table[size])
    return Check(f"{kind}@{size}", value / expected if expected > 0 else math.inf, tol, ctx)


def judge(installed: Mapping[int, Tables], pairs: Mapping[int, Any], measured: list[Measured],
          steps: Sequence[Step]) -> Verdict:
    """Each probed step against what the engine installs at its context (the dense tables, after
    vLLM's running max), within the table's own spread at that point; the table must have a point
    at every probed size. Draft only for full-graph steps, as vLLM's draft curve uses only those."""
    if not steps:
        return Verdict(False, note="no probe steps were planned")
    if len(measured) < len(steps):
        return Verdict(False, note=f"{len(measured)} of {len(steps)} probe steps were timed")
    checks = []
    for step, m in zip(steps, measured):
        draft, verify = installed[step.context_len]
        pair = pairs[step.context_len]
        checks.append(_check("verify", step.context_len, pair.verify, verify, m.num_target_tokens, m.forward_ms))
        if m.full_cudagraph:
            checks.append(_check("draft", step.context_len, pair.draft, draft, m.num_reqs, m.drafter_ms))
    return Verdict(all(c.ok for c in checks), tuple(checks))


def conditions(readings: Sequence[Reading], source: str = "", worst_ratio: float | None = None) -> str:
    """What the GPU ran at around the probe steps, for the probe's line: a throttled GPU runs every
    step slower, so its ratios read high (and a genuine table may fail). A worst ratio below 1 (the
    GPU faster than the table) is the one throttling cannot explain, and the line says so."""
    sm = [r.sm_mhz for r in readings if r.sm_mhz is not None]
    throttle = sorted({t for r in readings for t in r.throttle})
    clock = f"SM {min(sm):.0f}-{max(sm):.0f} MHz" if sm else "SM clock not read" + (f" ({source})" if source else "")
    if throttle:
        said = f"GPU throttled during the probe ({', '.join(throttle)}), {clock}"
        if worst_ratio is not None and math.isfinite(worst_ratio) and worst_ratio < 1.0:
            return f"{said}: throttling slows steps, so it does not explain a ratio below 1.00x"
        return f"{said}: ratios measured on a slowed GPU"
    return f"{clock}, no throttling" if sm else clock

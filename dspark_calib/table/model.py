"""The cost table: what a profile measured, as vLLM uses it (the file format is file.py).

A CostTable is immutable and validated: the fingerprint of the engine it was profiled
on, one curve pair per profiled context length, and the raw samples behind them
(columnar ``Samples``; None when read for serving, which never needs them).
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from dspark_calib import __version__
from dspark_calib.errors import CalibError
from dspark_calib.fileformat.version import parse_version, utc_now
from dspark_calib.fingerprint import Fingerprint, merge_mismatches
from dspark_calib.fit import CURVE_KINDS, DRAFT, VERIFY, Curve, CurvePair, fit_curves
from dspark_calib.samples import SAMPLE_COLUMNS, Sample, Samples
from dspark_calib.table.calibration import Calibration
from dspark_calib.table.identity import content_hash
from dspark_calib.telemetry import MAX_BLOCKS, Telemetry

if TYPE_CHECKING:
    from dspark_calib.pricing.costs import DenseTables

SCHEMA_VERSION = "1.4"  # what write_table writes; file.py's header has the format history
DEFAULT_CONTEXT = 8192  # vLLM's default profiling context length
# Physical bounds of one step (ms): below a microsecond or above a minute no GPU step is real.
MIN_STEP_MS = 1e-3
MAX_STEP_MS = 60_000.0
# A curve of a profile without warm-up may dip (kernel shapes, noise: the shipped H200 table
# dips 6.4 % at 432 tokens) but not fall below its running peak by more than
# max(FALL_IQRS x IQR, FALL_FRACTION) (CostTable.check_plausible says why only then).
FALL_IQRS = 3.0
FALL_FRACTION = 0.10
# A point's IQR / median above this is refused at read time: real H200 tables measure <= 3.8 %
# (shipped profile 1.5 %, benchmarks/results/h200 0.8-3.8 %), a 2-replay split of the test
# recording 51 % at one draft point; a forged huge spread (forge.py: 200 %) would widen the
# probe's tolerance and the fall check.
MAX_REL_IQR = 1.0
SPREAD_FLOOR_MS = 0.05  # below this an IQR is timer noise whatever the median (a tiny draft step)


def nearest(context_lens: Iterable[int], wanted: int) -> int:
    """The context length closest to `wanted`; a tie goes to the longer one (the safer, higher cost)."""
    return min(context_lens, key=lambda c: (abs(c - wanted), -c))


@dataclass(frozen=True, eq=False)
class CostTable:
    fingerprint: Fingerprint
    curves: dict[int, CurvePair]  # context_len -> curve pair
    samples: Samples | None  # None: read without raw samples (serving)
    created_at: str = field(default_factory=utc_now)
    tool_version: str = __version__
    schema_version: str = SCHEMA_VERSION
    # Samples.digest(); recomputed whenever samples are present, taken from the file when they were not read.
    samples_digest: str = ""
    # GPU/host conditions per profile block (schema 1.2); None: not recorded or an older table.
    telemetry: Telemetry | None = None
    # The correction its curves carry (schema 1.3; calibration.py); None: the curves are as measured.
    calibration: Calibration | None = None
    # (recomputed, stored) hash of a table read from a file, set by TableFile.read only: a newer
    # minor's file (unknown fingerprint keys under extra) recomputes another hash than the stored,
    # verified one that pins match. Not an init field: dataclasses.replace() drops it.
    _read_hash: tuple[str, str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        samples = self.samples
        if samples is not None and not isinstance(samples, Samples):  # any column mapping (a DataFrame)
            samples = Samples.from_columns({c: np.asarray(samples[c]) for c in SAMPLE_COLUMNS})
            object.__setattr__(self, "samples", samples)
        if samples is not None:
            object.__setattr__(self, "samples_digest", samples.digest())

    def num_samples(self, context_len: int | None = None) -> int:
        """Raw samples (at one context length); 0 when they were not read."""
        if self.samples is None:
            return 0
        return len(self.samples.select(context_len=context_len))

    @classmethod
    def from_samples(cls, samples: Iterable[Sample] | Samples, fingerprint: Fingerprint, **kw: Any) -> "CostTable":
        samples = samples if isinstance(samples, Samples) else Samples.from_records(samples)
        if not len(samples):
            raise CalibError("no samples to fit")
        curves = fit_curves(samples)
        fingerprint = fingerprint.replace(context_lens=tuple(sorted(curves)))
        table = cls(fingerprint=fingerprint, curves=curves, samples=samples, **kw)
        table.validate()
        return table

    # -- identity -----------------------------------------------------------------
    @property
    def content_hash(self) -> str:
        """sha256 of what the table means, under its schema version's rule (see identity.py; file.py has the format history)."""
        found = content_hash(self)
        if self._read_hash is not None and self._read_hash[0] == found:
            return self._read_hash[1]  # the file's verified hash (the one a pin matches)
        return found

    @property
    def short_hash(self) -> str:
        return self.content_hash[:12]

    def default_filename(self) -> str:
        fp = self.fingerprint

        def slug(text: str) -> str:
            return re.sub(r"[^A-Za-z0-9.]+", "-", os.path.basename(str(text).rstrip("/"))).strip("-").lower()

        parts = [slug(fp.target_model), slug(fp.draft_model), f"tp{fp.tensor_parallel_size}", slug(fp.gpu_name), self.short_hash]
        return "__".join(p for p in parts if p) + ".parquet"

    # -- use ----------------------------------------------------------------------
    def context_lens(self) -> list[int]:
        return sorted(self.curves)

    def default_context(self) -> int:
        """The one default-context rule: the profiled length nearest vLLM's 8192 (ties: the longer)."""
        return nearest(self.context_lens(), DEFAULT_CONTEXT)

    def nearest_context(self, context_len: int | None) -> int:
        """The profiled context length closest to `context_len` (None: default_context())."""
        if context_len is None:
            return self.default_context()
        return nearest(self.context_lens(), context_len)

    def pair(self, context_len: int | None = None) -> CurvePair:
        return self.curves[self.nearest_context(context_len)]

    def dense_tables(self, context_len: int | None = None, *, max_num_reqs: int | None = None,
                     max_num_batched_tokens: int | None = None) -> "DenseTables":
        """vLLM's dense (draft, verify) tables priced at context L, for the engine this table was
        profiled on (or the given limits). Between profiled contexts: per size, linear in
        context (dspark_calib.context); at a profiled context: exactly vLLM's tables from its
        curves; above the range: the longest context's; below it: the line through the two
        shortest, extended towards 0 (costs.ContextCosts); outside, ``.warning`` is set (OutOfRange).
        None: default_context(). Curve display uses pair()/nearest_context() instead."""
        from dspark_calib.pricing.costs import DenseTables, dense_tables

        ctx = self.default_context() if context_len is None else int(context_len)
        return DenseTables(dense_tables(self, ctx, max_num_reqs=max_num_reqs,
                                        max_num_batched_tokens=max_num_batched_tokens))

    def iter_samples(self, context_len: int | None = None) -> list[Sample]:
        return [] if self.samples is None else self.samples.select(context_len=context_len).records()

    # -- checks -------------------------------------------------------------------
    def validate(self) -> None:
        """Raise CalibError on anything vLLM could not use or that makes no sense.
        (Samples validate themselves on construction.)"""
        if not self.curves:
            raise CalibError("table has no curves")
        if sorted(self.curves) != sorted(self.fingerprint.context_lens):
            raise CalibError(f"curves cover context lengths {sorted(self.curves)} but the fingerprint says "
                             f"{list(self.fingerprint.context_lens)}")
        for ctx, pair in self.curves.items():
            for kind in CURVE_KINDS:
                curve = pair.curve(kind)
                where = f"{kind} curve at context {ctx}"
                if len(curve) == 0:
                    raise CalibError(f"{where} is empty")
                if (curve.size <= 0).any() or (np.diff(curve.size) <= 0).any():
                    raise CalibError(f"{where}: sizes must be positive and strictly increasing")
                costs = np.stack([curve.cost_ms, curve.min_ms, curve.p25_ms, curve.p75_ms, curve.max_ms])
                # Spread columns may be NaN (absent), never infinite or negative.
                bad = ~np.isfinite(curve.cost_ms) | np.isinf(costs).any(axis=0) | (np.nan_to_num(costs) < 0).any(axis=0)
                if bad.any():
                    raise CalibError(f"{where}, size {curve.size[np.flatnonzero(bad)[0]]}: costs must be finite and >= 0")
                if (curve.n < 1).any():
                    raise CalibError(f"{where}: every point needs n >= 1")

    def check_spread(self) -> None:
        """Read time only (a merge of several machines' samples may be wide when written): refuse a
        point whose IQR is implausibly wide for its median, as a forgery widening the probe would be."""
        for ctx, pair in sorted(self.curves.items()):
            for kind in CURVE_KINDS:
                c = pair.curve(kind)
                iqr = np.nan_to_num(np.maximum(c.p75_ms - c.p25_ms, 0.0))
                wide = np.flatnonzero((iqr > MAX_REL_IQR * c.cost_ms) & (iqr > SPREAD_FLOOR_MS))
                if len(wide):
                    i = int(wide[0])
                    raise CalibError(f"{kind} curve at context {ctx}, size {c.size[i]}: IQR {iqr[i]:.4g} ms is more "
                                     f"than {MAX_REL_IQR:.0%} of the {c.cost_ms[i]:.4g} ms median, "
                                     f"not a plausible spread")

    def check_plausible(self) -> None:
        """Costs a GPU can produce, or a CalibError naming the point: a forged or broken table
        must not reach vLLM (0 or inf swings its budget to 0 or the maximum).

        A fall (a size cheaper than a smaller one by more than its spread allows, falls_beyond_spread)
        is refused only when the profile ran no warm-up (``warmup_replays`` 0: `profile --warmup 0`,
        or vLLM's own start-up pass that `import-vllm` reads). There a fall is the mark of
        first-use costs: the first replays of the smallest sizes pay one-time work, and vLLM's
        running maximum would charge that to every larger size. After warm-up a fall is the GPU's
        own measurement (vLLM's set_initial_cost_curves fits the same samples and shows it) and
        it cannot lower a price: vLLM, pricing.costs and the probe all take the running maximum,
        so a fall prices as if its points were raised to the peak before it. A forged fall is then
        a forged higher cost, which the probe measures at every context it prices (the installed
        curve at a probed size is the peak of every point below it); claiming a warm-up therefore
        opens no door. Such a fall is a finding of `inspect` (inspection.FALLING_MEDIAN), never a
        refusal."""
        fp = self.fingerprint
        # vLLM's dummy runs never exceed the engine's limits; a point past them is priced by nobody's
        # step, yet it sets the extrapolation and the chunk pair price (its largest verify size)
        bounds = {DRAFT: ("max_num_seqs", fp.max_num_seqs), VERIFY: ("max_num_batched_tokens", fp.max_num_batched_tokens)}
        for ctx, pair in sorted(self.curves.items()):
            for kind in CURVE_KINDS:
                c = pair.curve(kind)
                where = f"{kind} curve at context {ctx}"
                if len(c) == 0:
                    raise CalibError(f"{where} has no points")
                name, top = bounds[kind]
                if isinstance(top, int) and top > 0 and int(c.size[-1]) > top:
                    raise CalibError(f"{where}: size {int(c.size[-1])} exceeds the table's own {name} {top} "
                                     "(no step of that engine is that large)")
                lowest = MIN_STEP_MS if kind == VERIFY else 0.0  # a draft step may be tiny, never free
                bad = ~np.isfinite(c.cost_ms) | (c.cost_ms <= lowest) | (c.cost_ms > MAX_STEP_MS)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise CalibError(f"{where}, size {c.size[i]}: cost {float(c.cost_ms[i])!r} ms is not a plausible step "
                                     f"({'> 0' if kind == DRAFT else f'> {MIN_STEP_MS:g}'} and <= {MAX_STEP_MS:g} ms)")
                if fp.warmup_replays > 0:
                    continue
                falls = falls_beyond_spread(c)
                if falls:
                    i, j = falls[0]
                    raise CalibError(f"{where}, size {c.size[i]}: cost {c.cost_ms[i]:.4g} ms falls below the "
                                     f"{c.cost_ms[j]:.4g} ms at size {c.size[j]} by more than its spread "
                                     f"allows (max of {FALL_IQRS:g} x IQR, {FALL_FRACTION:.0%}) in a profile without "
                                     "warm-up, where first-use costs look like this (profile with --warmup)")


def falls_beyond_spread(curve: Curve) -> list[tuple[int, int]]:
    """(index, index of the running peak before it) of every point below the curve's running peak
    by more than max(FALL_IQRS x the larger IQR of the two, FALL_FRACTION x the peak)."""
    c = curve
    iqr = np.nan_to_num(np.maximum(c.p75_ms - c.p25_ms, 0.0))
    peak = np.maximum.accumulate(c.cost_ms)
    at_peak = np.maximum.accumulate(np.where(c.cost_ms == peak, np.arange(len(c)), 0))
    allowed = np.maximum(FALL_IQRS * np.maximum(iqr, iqr[at_peak]), FALL_FRACTION * peak)
    return [(int(i), int(at_peak[i])) for i in np.flatnonzero(peak - c.cost_ms > allowed)]


# Two runs of one engine share a timing (every column equal) by chance only rarely; a table
# pooled into another shares all of its own. More than this share of the smaller input's
# samples in common is the same measurement counted twice.
MAX_SHARED_FRACTION = 0.01


def _shared_measurements(tables: Sequence[CostTable], names: Sequence[str]) -> None:
    """Refuse inputs that hold the same measurements: a table and one it was merged into (its
    merged_from), or any two sharing their timings (a copy re-saved, a merge of a merge)."""
    for i, a in enumerate(tables):
        for j, b in enumerate(tables):
            if i != j and b.short_hash in (a.fingerprint.extra.get("merged_from") or []):
                raise CalibError(f"{names[j]} was merged into {names[i]} already (its merged_from lists "
                                 f"{b.short_hash}); merging them again counts its samples twice")
    sets = [t.samples.measurements() for t in tables]
    for i, j in itertools.combinations(range(len(tables)), 2):
        shared = len(sets[i] & sets[j])
        smaller = min(len(sets[i]), len(sets[j]))
        if shared > max(1, MAX_SHARED_FRACTION * smaller):
            raise CalibError(f"{names[j]} and {names[i]} share {shared} of {smaller} measured samples (one run "
                             "pooled into, or copied from, the other); merging them counts those samples twice")


def merge_tables(tables: Sequence[CostTable], names: Sequence[str] | None = None) -> CostTable:
    """One table from several runs of the same engine: samples pooled, curves refitted.

    Refused when any MERGE_KEYS key differs (naming it and both values), a table has no
    raw samples (its curves cannot be refitted honestly) or is schema 1.0 (its hash leaves its
    samples out: forged samples in a file that verifies would become the merged curves), or two
    inputs hold the same measurements (same content hash or samples, one merged into the other, shared timings:
    `merge T T` or `merge T merge(T, U)` would fake replays). `names` (the files) name the
    inputs in errors; by default "input N (hash)".
    """
    if not tables:
        raise CalibError("nothing to merge")
    names = list(names) if names is not None else [f"input {i + 1} ({t.short_hash})" for i, t in enumerate(tables)]
    first = tables[0]
    for name, other in zip(names[1:], tables[1:]):
        bad = merge_mismatches(first.fingerprint, other.fingerprint)
        if bad:
            m = bad[0]
            raise CalibError(f"cannot merge tables profiled differently: {m.key} is {m.table_value!r} in "
                             f"{names[0]} but {m.engine_value!r} in {name}")
    for name, t in zip(names, tables):
        if t.calibration is not None:  # the refit would drop its correction without a word
            raise CalibError(f"{name} is calibrated (from parent {t.calibration.parent[:12]}): merge the measured "
                             "tables, then calibrate the merged one")
        if t.samples is None or not len(t.samples):
            raise CalibError(f"{name} has no raw samples to merge")
        if parse_version(t.schema_version) < (1, 1):  # the refit would turn unverified samples into curves
            raise CalibError(f"{name} is a schema {t.schema_version} table: its content hash does not cover its raw "
                             "samples, so curves refitted from them are not what its hash vouches for; merge takes "
                             "schema 1.1 or newer tables")
    seen: dict[str, int] = {}
    for i, t in enumerate(tables):
        for key in (t.content_hash, t.samples_digest):
            if key in seen:
                raise CalibError(f"{names[seen[key]]} and {names[i]} are the same run ({t.short_hash}); "
                                 "merging a run with itself would fake replays")
            seen[key] = i
    _shared_measurements(tables, names)
    parts = []
    offset = 0
    for t in tables:  # keep replay indices distinct across runs
        part = t.samples.with_replay_offset(offset)
        offset = int(part.replay.max()) + 1
        parts.append(part)
    fp = first.fingerprint.replace(
        replays=merged_replays(tables),
        # the least warm-up any input ran: a cold run's samples keep the fall check (check_plausible)
        warmup_replays=min(t.fingerprint.warmup_replays for t in tables),
        extra=merged_extra(tables),
    )
    return CostTable.from_samples(Samples.concat(parts), fp, telemetry=merged_telemetry(tables))


def merged_telemetry(tables: Sequence[CostTable]) -> Telemetry | None:
    """Every input's block readings, in input order: the merged curves come from all of those
    blocks, so the conditions they ran under stay beside them (`inspect`, `diff`)."""
    have = [t.telemetry for t in tables if t.telemetry is not None]
    if not have:
        return None
    sources = sorted({t.source for t in have if t.source})
    notes = list(dict.fromkeys(t.note for t in have if t.note))
    blocks = tuple(b for t in have for b in t.blocks)
    if len(blocks) > MAX_BLOCKS:  # what a reader takes: a merged file must read back
        notes.insert(0, f"{len(blocks)} blocks merged, the first {MAX_BLOCKS} kept")
        blocks = blocks[:MAX_BLOCKS]
    return Telemetry(source=", ".join(sources)[:40], note="; ".join(notes)[:200], blocks=blocks)


def merged_replays(tables: Sequence[CostTable]) -> int:
    """The replays behind every point of the merged table: per context, the inputs that profiled
    it pooled; the fewest over the contexts. Runs of one context add up (5 + 5 = 10 samples per
    size); runs of different contexts do not (1024 from one, 16384 from another: 5 each)."""
    per_context: dict[int, int] = {}
    for t in tables:
        for ctx in t.context_lens():
            per_context[ctx] = per_context.get(ctx, 0) + t.fingerprint.replays
    return min(per_context.values())


# notes that say something of one run's own curves or its merge, never true of a refit of pooled
# samples however many inputs say them (vLLM's fit was compared with each run's, not the merge's)
RUN_CLAIMS = ("vllm_curves_equal", "merged_from", "merged_inputs")


def merged_extra(tables: Sequence[CostTable]) -> dict[str, Any]:
    """The run notes every input shares, `merged_from` (the inputs' hashes), and per input the
    notes that differ (`merged_inputs`: a run's profile time, host, capture), so no input's own
    run reads as the merged table's."""
    extras = [t.fingerprint.extra for t in tables]
    shared = {k: v for k, v in extras[0].items()
              if k not in RUN_CLAIMS and all(k in e and e[k] == v for e in extras[1:])}
    own = {t.short_hash: {k: v for k, v in t.fingerprint.extra.items() if k not in shared}
           for t in tables}
    return {**shared, "merged_from": [t.short_hash for t in tables],
            **({"merged_inputs": own} if any(own.values()) else {})}

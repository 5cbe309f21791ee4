"""Observed serving steps (observe mode) and their rolling parquet files.

Format history (OBSERVED_SCHEMA_VERSION, "major.minor"):

* 1.0 (dspark-calib 0.1.0): first format. One row per observed serving step,
  columns ``COLUMNS`` in that order (the two ``budget_*`` columns may be null:
  the engine did not price the step the other way). File metadata is JSON under
  the parquet key-value key ``dspark_calib_observed``: schema_version,
  tool_version, created_at (UTC, ISO 8601), plus what the writer was given
  (e.g. table_hash, mode, tp_rank, sample_every, host, max_num_reqs,
  max_num_batched_tokens).
* 1.1 (dspark-calib 0.1.0): three nullable columns at the end, the step's prefill chunks
  (requests with more than one non-draft token): ``prefill_tokens`` (their non-draft
  tokens), ``prefill_context_sum`` (their computed tokens) and ``prefill_pairs`` (sum of
  q x (c + q): the query-context pairs their attention does; pricing.rules.prefill_context_sum
  prices by it). Migration (``MIGRATIONS``, the same toolkit as tables): a 1.0 file reads
  with the three ABSENT (not recorded), and ``validate`` then leaves prefill-carrying
  steps at the plain KV sum.
* 1.2 (dspark-calib 0.1.0): two nullable list columns at the end, one int64 per draft position
  (num_speculative_tokens of them): ``position_graded`` (requests whose draft there was judged:
  every draft before it accepted, itself verified) and ``position_accepted`` (those whose draft
  there was accepted), read from the rejection sampler's num_sampled / num_rejected; and the
  metadata key ``engine``: the engine's fingerprint keys as the load decision reads them
  (``advise`` refuses files of another engine than its table). Migration: a 1.1 file reads with
  both columns ABSENT (no acceptance recorded).
* 1.3 (dspark-calib 0.1.0): four nullable columns at the end, vLLM's online acceptance estimator
  as the step's drafts were ranked by it: ``estimator_refits``, ``estimator_steps`` (its step()
  calls since the engine started), ``estimator_slope`` and ``estimator_intercepts`` (a float64
  list, one per draft position); recorded on the first sampled step and on the first after each
  refit, null otherwise and for speculators without the estimator; and the metadata key
  ``estimator_keys`` (engines with the estimator): what a seed made from the file must match
  (seed.SEED_KEYS). Migration: a 1.2 file reads with the four null (ABSENT counts, NaN
  coefficients).
* 1.4 (dspark-calib 0.1.0): the metadata key ``context_tail_rule``, how the engine's mixed-context
  tail charged a batch's gap (pricing.policy.TAIL_RULES: ``bounded``, S + t min(G, S^2 / G), or
  ``linear``, S + t G). No column. Migration: an older file reads as ``linear``
  (policy.UNRECORDED_TAIL_RULE), the rule of every release engine before the key, so ``validate``
  and ``calibrate`` price its steps as its engine did (a development build between the bound and
  the key wrote 1.3 files priced bounded: those need ``--tail``).
* 1.5 (dspark-calib 0.1.0): two nullable float64 columns at the end, the GPU's state as the step
  was sampled: ``gpu_sm_mhz`` (SM clock) and ``gpu_power_w`` (board power), the latest reading of
  a sampler thread that reads NVML a few times a second off the step's path (null without NVML,
  or before its first reading); ``validate`` reports errors per SM-clock bucket by them.
  Migration: a 1.4 file reads with both null (NaN).
* 1.6 (dspark-calib 0.1.0): two nullable float64 columns at the end, the host's time around the
  step on TP rank 0 (``time.perf_counter``, one reading per execute_model call, no sync):
  ``step_interval_ms`` (from the previous execute_model call's start to this step's; null for
  the first call the observer saw and after a dummy run or a warm-up step, which are not
  serving) and ``host_ms`` (from this step's execute_model start to its return: the host
  issuing the step, which with async scheduling runs ahead of the GPU). ``validate`` sets the
  interval beside the GPU-timed forward + drafter (the time no event prices) and counts stalls
  (intervals over a second). Migration: a 1.5 file reads with both null (NaN).
* 1.7 (dspark-calib 0.1.0): one nullable list<int64> column at the end, ``context_quantiles``: the
  scheduled requests' computed tokens at 9 evenly spaced order statistics (the shortest, ...,
  the longest; ``step.context_quantiles``), so a step's make-up (how its KV divides over its
  requests) is known beside its mean and maximum. Migration: a 1.6 file reads it null (ABSENT).

Compatibility rules, as for tables: a reader accepts every minor of its major
(columns and metadata keys a newer minor adds are ignored; a minor may only add
columns or metadata keys); a newer major is refused naming both versions.

Writing: rows are buffered and written as one file per ``rows_per_file`` rows
(or ``max_buffer_s`` seconds) through ``atomic.atomic_write`` (temp file, then
rename: a reader never sees half a file); a writer keeps at most ``max_files``
of its own files, deleting the oldest, so a long-running server's disk use is
bounded by rows_per_file * max_files rows. Reading treats a file as untrusted, as a
table is (``READ_LIMITS``, fileformat.parquet: regular files only, the decoded size
bounded before anything is decoded, engine sizes bounded before validate sizes arrays
by them) and validates every column and every row; a bad file is one CalibError naming
it, never a traceback.

What a row is, and the checks on rows and columns, live in step.py.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from dspark_calib import __version__
from dspark_calib.atomic import atomic_write
from dspark_calib.errors import CalibError, display_path, first_line
from dspark_calib.fileformat.arrow import column, list_column, list_lengths
from dspark_calib.fileformat.limits import ReadLimits, load_json
from dspark_calib.fileformat.version import Migrations, parse_version, utc_now
from dspark_calib.observe.step import (ABSENT, ACCEPTANCE, BOOL, COEFFICIENTS, COLUMNS, CONTEXT_QUANTILES, ESTIMATOR,
                                       FLOAT, GPU, HOST, INT, NULLABLE, POSITIONS, PREFILL, ObservedStep, ObserveMeta,
                                       column_problem, meta_problem)
from dspark_calib.pricing.policy import UNRECORDED_TAIL_RULE
from dspark_calib.safe_open import open_local

OBSERVED_SCHEMA_VERSION = "1.7"
METADATA_KEY = b"dspark_calib_observed"
FILE_PREFIX = "observed-"
# Reading, as tables are read (fileformat.limits): a writer's file is rows_per_file rows (4096 by
# default) of ~150 bytes and a footer of kilobytes. validate reads at most MAX_OBSERVED_STEPS
# steps of all its files together (64 files of the default 4096 rows: a default writer's whole
# directory), so its working memory stays within a few hundred MB (docs/shared-storage.md).
MAX_OBSERVED_STEPS = 1 << 18
READ_LIMITS = ReadLimits(max_file_bytes=256 << 20, max_metadata_bytes=1 << 20, max_rows=MAX_OBSERVED_STEPS,
                         max_row_groups=64, max_curve_points=0, max_decoded_bytes=128 << 20, max_pages=4096)
# The acceptance columns are read as (rows, widest list) arrays, so a list's length sizes every
# row's: one row of 100,000 positions among 2^17 would ask for 100 GB from a 15 KB file. A list
# is at most as long as MAX_OBSERVED_STEPS rows of both columns fit the decode budget (32
# positions: an engine drafts a handful a step); the estimator's intercepts (float64, one per
# position) are bounded alike and add at most half of that again.
MAX_DRAFT_POSITIONS = READ_LIMITS.max_decoded_bytes // (2 * 8 * MAX_OBSERVED_STEPS)


def _arrow_types() -> dict[str, Any]:
    import pyarrow as pa

    return {INT: pa.int64(), FLOAT: pa.float64(), BOOL: pa.bool_(), POSITIONS: pa.list_(pa.int64()),
            COEFFICIENTS: pa.list_(pa.float64())}


class ObservedWriter:
    """Buffers steps; writes rolling parquet files atomically, at most max_files of its own."""

    def __init__(self, directory: str | os.PathLike, *, metadata: dict[str, Any] | None = None,
                 rows_per_file: int = 4096, max_files: int = 64, max_buffer_s: float = 60.0,
                 name: str | None = None, clock: Callable[[], float] = time.monotonic):
        if rows_per_file < 1 or max_files < 1:
            raise CalibError("observe: rows_per_file and max_files must be >= 1")
        self.directory = os.fspath(directory)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise CalibError(f"observe: cannot create the directory ({exc.strerror or first_line(exc)})",
                             path=self.directory) from None
        meta = dict(metadata or {})
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise CalibError(f"observe: metadata is not JSON ({first_line(exc)})") from None
        self.metadata = meta
        self.rows_per_file, self.max_files, self.max_buffer_s = rows_per_file, max_files, max_buffer_s
        # One name per writer (rank and pid by default): writers sharing a directory never collide.
        self.name = name or f"r{meta.get('tp_rank', 0)}-{os.getpid()}"
        self._clock = clock
        self._buffer: list[ObservedStep] = []
        self._first_at = 0.0
        self._seq = 0
        self.files: deque[str] = deque()

    def append(self, step: ObservedStep) -> str | None:
        """Add a step; returns the path written if this filled a file (or the buffer aged out)."""
        if not self._buffer:
            self._first_at = self._clock()
        self._buffer.append(step)
        if len(self._buffer) >= self.rows_per_file or self._clock() - self._first_at >= self.max_buffer_s:
            return self.flush()
        return None

    def flush(self) -> str | None:
        if not self._buffer:
            return None
        rows, self._buffer = self._buffer, []
        path = os.path.join(self.directory, f"{FILE_PREFIX}{self.name}-{self._seq:06d}.parquet")
        self._seq += 1
        try:
            _write(path, rows, self.metadata)
        except OSError as exc:  # disk full, directory removed...: the rows are dropped, the caller decides
            raise CalibError(f"observe: cannot write ({exc.strerror or first_line(exc)}); "
                             f"{len(rows)} observed steps dropped", path=path) from None
        self.files.append(path)
        while len(self.files) > self.max_files:
            try:
                os.unlink(self.files.popleft())
            except FileNotFoundError:
                pass
        return path

    def close(self) -> str | None:
        return self.flush()

    def __enter__(self) -> "ObservedWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _write(path: str, rows: Sequence[ObservedStep], metadata: dict[str, Any]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = _arrow_types()
    arrays = [pa.array([getattr(r, name) for r in rows], type=types[typ]) for name, typ in COLUMNS.items()]
    meta = {**metadata, "schema_version": OBSERVED_SCHEMA_VERSION, "tool_version": __version__,
            "created_at": utc_now()}
    schema = pa.schema([pa.field(n, types[t], nullable=n in NULLABLE) for n, t in COLUMNS.items()],
                       metadata={METADATA_KEY: json.dumps(meta).encode()})
    table = pa.Table.from_arrays(arrays, schema=schema)
    return atomic_write(path, lambda fh: pq.write_table(table, fh, compression="zstd", write_page_checksum=True),
                        durable=False)  # observation files may be lost on power failure, never torn


# -- reading ---------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ObservedSteps:
    """Every row of one or more observed files, columnar (numpy); null budgets are ABSENT."""

    columns: dict[str, np.ndarray]
    files: tuple[str, ...]
    metadata: tuple[ObserveMeta, ...]  # one per file

    def __len__(self) -> int:
        return len(self.columns["step"])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]


def observed_paths(sources: Iterable[str | os.PathLike]) -> list[str]:
    """Files as given; a directory stands for its observed-*.parquet files (temp files skipped)."""
    out = []
    for src in sources:
        src = os.fspath(src)
        if os.path.isdir(src):
            names = sorted(n for n in os.listdir(src) if n.startswith(FILE_PREFIX) and n.endswith(".parquet"))
            if not names:
                raise CalibError("directory holds no observed-*.parquet files", path=src)
            out.extend(os.path.join(src, n) for n in names)
        else:
            out.append(src)
    return out


def read_observed(sources: Iterable[str | os.PathLike]) -> ObservedSteps:
    paths = observed_paths(sources)
    if not paths:
        raise CalibError("no observed files given")
    parts, metas, rows = [], [], 0
    for path in paths:
        cols, meta = _read_one(path, MAX_OBSERVED_STEPS - rows)
        rows += len(cols["step"])
        parts.append(cols)
        metas.append(meta)
    columns = {name: _concatenate([p[name] for p in parts]) for name in COLUMNS}
    for arr in columns.values():
        arr.flags.writeable = False
    return ObservedSteps(columns=columns, files=tuple(paths), metadata=tuple(ObserveMeta.from_dict(m) for m in metas))


def _concatenate(parts: list[np.ndarray]) -> np.ndarray:
    """Rows of several files; per-position columns padded to the widest file's positions with 0
    (counts: nothing graded there) or NaN (coefficients: none there)."""
    if len(parts) == 1:  # one file: its arrays are already fresh
        return parts[0]
    if parts[0].ndim == 1:
        return np.concatenate(parts)
    width = max(p.shape[1] for p in parts)
    fill = np.nan if parts[0].dtype == np.float64 else 0
    return np.concatenate([np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=fill) for p in parts])


# -- migrations: a minor adds columns (an older minor's file reads them as ABSENT) or metadata keys --
MIGRATIONS = Migrations(OBSERVED_SCHEMA_VERSION)
migration = MIGRATIONS.add


@migration("1.0", "1.1")
def _m_1_0_to_1_1(cols: dict[str, np.ndarray], meta: dict) -> tuple[dict[str, np.ndarray], dict]:
    """1.1 added the prefill columns: a 1.0 engine recorded none (validate then leaves its
    prefill-carrying steps at the plain KV sum)."""
    rows = len(next(iter(cols.values()))) if cols else 0
    return {**cols, **{name: np.full(rows, ABSENT, dtype=COLUMNS[name]) for name in PREFILL}}, \
        {**meta, "schema_version": "1.1"}


@migration("1.1", "1.2")
def _m_1_1_to_1_2(cols: dict[str, np.ndarray], meta: dict) -> tuple[dict[str, np.ndarray], dict]:
    """1.2 added the per-position acceptance: a 1.1 engine recorded none (advise refuses such files)."""
    rows = len(next(iter(cols.values()))) if cols else 0
    return {**cols, **{name: np.full((rows, 1), ABSENT, dtype=np.int64) for name in ACCEPTANCE}}, \
        {**meta, "schema_version": "1.2"}


@migration("1.2", "1.3")
def _m_1_2_to_1_3(cols: dict[str, np.ndarray], meta: dict) -> tuple[dict[str, np.ndarray], dict]:
    """1.3 added the acceptance estimator's coefficients: a 1.2 engine recorded none (seed refuses such files)."""
    rows = len(next(iter(cols.values()))) if cols else 0
    return {**cols, **null_estimator(rows)}, {**meta, "schema_version": "1.3"}


@migration("1.3", "1.4")
def _m_1_3_to_1_4(cols: dict[str, np.ndarray], meta: dict) -> tuple[dict[str, np.ndarray], dict]:
    """1.4 records the tail rule: every engine before it charged the whole gap (the linear rule)."""
    return cols, {**meta, "context_tail_rule": UNRECORDED_TAIL_RULE, "schema_version": "1.4"}


@migration("1.4", "1.5")
def _m_1_4_to_1_5(cols: dict[str, np.ndarray], meta: dict) -> tuple[dict[str, np.ndarray], dict]:
    """1.5 added the GPU's SM clock and power per step: a 1.4 engine read none."""
    return _null_floats(cols, GPU), {**meta, "schema_version": "1.5"}


@migration("1.5", "1.6")
def _m_1_5_to_1_6(cols: dict[str, np.ndarray], meta: dict) -> tuple[dict[str, np.ndarray], dict]:
    """1.6 added the host's step interval and issue time: a 1.5 engine read neither."""
    return _null_floats(cols, HOST), {**meta, "schema_version": "1.6"}


@migration("1.6", "1.7")
def _m_1_6_to_1_7(cols: dict[str, np.ndarray], meta: dict) -> tuple[dict[str, np.ndarray], dict]:
    """1.7 added the requests' context order statistics per step: a 1.6 engine recorded none."""
    return {**cols, "context_quantiles": _unrecorded_quantiles(len(cols["step"]))}, {**meta, "schema_version": "1.7"}


def _unrecorded_quantiles(rows: int) -> np.ndarray:
    """A context_quantiles column of rows none of which recorded them: ABSENT, CONTEXT_QUANTILES wide
    (a list column of nulls alone reads one wide)."""
    return np.full((rows, CONTEXT_QUANTILES), ABSENT, dtype=np.int64)


def _null_floats(cols: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    """cols with float columns `names` added, null at every row (NaN in memory)."""
    rows = len(next(iter(cols.values()))) if cols else 0
    return {**cols, **{name: np.full(rows, np.nan) for name in names}}


def null_estimator(rows: int) -> dict[str, np.ndarray]:
    """The four estimator columns of `rows` rows that read nothing (in memory: ABSENT counts, NaN coefficients)."""
    return {"estimator_refits": np.full(rows, ABSENT, dtype=np.int64),
            "estimator_steps": np.full(rows, ABSENT, dtype=np.int64),
            "estimator_slope": np.full(rows, np.nan), "estimator_intercepts": np.full((rows, 1), np.nan)}


def _read_one(path: str, rows_left: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One file, bounded as a table is (READ_LIMITS; at most rows_left rows), opened once and
    never waited on (a FIFO is refused)."""
    from dspark_calib.fileformat.parquet import open_bounded

    shown = display_path(path)
    handle, size = open_local(path, shown)
    with handle, open_bounded(handle, size, shown, READ_LIMITS) as bp:
        if bp.file.metadata.num_rows > rows_left:
            raise CalibError(f"{bp.file.metadata.num_rows} observed steps take the files given over the "
                             f"{MAX_OBSERVED_STEPS} steps read at once; validate fewer files at a time", path=shown)
        raw = bp.schema.metadata or {}
        if METADATA_KEY not in raw:
            raise CalibError("parquet file without dspark-calib observed metadata (not an observe file)", path=shown)
        meta = _parse_meta(raw[METADATA_KEY], shown)
        types = _arrow_types()
        present = [name for name in COLUMNS if name in bp.schema.names]
        for name in present:
            typ = bp.schema.field(name).type
            if typ != types[COLUMNS[name]]:
                raise CalibError(f"column {name} has type {typ}, expected {types[COLUMNS[name]]}", path=shown)
        try:
            arrow = bp.read(range(len(bp.group_rows)), present)
        except CalibError:
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for bad files
            raise CalibError(f"not a readable parquet file ({first_line(exc)})", path=shown) from None
    problem = _lists_problem(arrow)
    if problem:
        raise CalibError(problem, path=shown)
    cols: dict[str, np.ndarray] = {}
    for name in present:  # a column of a newer minor than the file's: its migration adds it, else refused below
        col = arrow.column(name)
        if col.null_count and name not in NULLABLE:
            raise CalibError(f"column {name} has {col.null_count} null values", path=shown)
        values, valid = (list_column if COLUMNS[name] in (POSITIONS, COEFFICIENTS) else column)(arrow, name)  # fresh
        # nullable budgets, prefill, acceptance and estimator columns: ABSENT where null (NaN for floats)
        values[~valid] = np.nan if values.dtype == np.float64 else ABSENT
        cols[name] = values
    quantiles = cols.get("context_quantiles")
    if quantiles is not None and quantiles.shape[1] != CONTEXT_QUANTILES and (quantiles[:, 0] == ABSENT).all():
        cols["context_quantiles"] = _unrecorded_quantiles(len(quantiles))
    cols, meta, _ = MIGRATIONS.apply(cols, meta, shown)
    missing = [name for name in COLUMNS if name not in cols]
    if missing:
        raise CalibError(f"column {missing[0]} is missing", path=shown)
    problem = column_problem(cols) or meta_problem(meta)
    if problem:
        raise CalibError(problem, path=shown)
    return cols, meta


def _lists_problem(arrow: Any) -> str | None:
    """Checked on the lists before they become (rows, positions) arrays: each at most
    MAX_DRAFT_POSITIONS long, and a row's two lists of one length (a row is one step's
    positions; the arrays are compared element-wise)."""
    lengths = {name: list_lengths(arrow, name) for name in (*ACCEPTANCE, ESTIMATOR[-1]) if name in arrow.column_names}
    for name, length in lengths.items():
        widest = int(length.max(initial=0))
        if widest > MAX_DRAFT_POSITIONS:
            return f"column {name} has a list of {widest} positions, over the {MAX_DRAFT_POSITIONS} read"
    if "context_quantiles" in arrow.column_names:
        widest = int(list_lengths(arrow, "context_quantiles").max(initial=0))
        if widest > CONTEXT_QUANTILES:
            return f"column context_quantiles has a list of {widest} values, over the {CONTEXT_QUANTILES} a step holds"
    lengths.pop(ESTIMATOR[-1], None)
    if len(lengths) == 2:
        differ = np.flatnonzero(np.not_equal(*lengths.values()))
        if len(differ):
            return f"row {int(differ[0])}: position_graded and position_accepted differ in length"
    return None


def _parse_meta(raw: bytes, path: str) -> dict[str, Any]:
    meta = load_json(raw, path, READ_LIMITS, "observed metadata")
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise CalibError("observed metadata lacks schema_version", path=path)
    version = parse_version(meta["schema_version"], path, what="observed schema_version")
    if version[0] != parse_version(OBSERVED_SCHEMA_VERSION)[0]:
        raise CalibError(f"observed schema {meta['schema_version']} is not readable by this dspark-calib "
                         f"(reads {OBSERVED_SCHEMA_VERSION}); use a matching version", path=path)
    return meta



"""Observed serving steps (observe mode) and their rolling parquet files.

Format history (OBSERVED_SCHEMA_VERSION, "major.minor"):

* 1.0 (dspark-calib 0.1.0): first format. One row per observed serving step,
  columns ``COLUMNS`` in that order (the two ``budget_*`` columns may be null:
  the engine did not price the step the other way). File metadata is JSON under
  the parquet key-value key ``dspark_calib_observed``: schema_version,
  tool_version, created_at (UTC, ISO 8601), plus what the writer was given
  (e.g. table_hash, mode, tp_rank, sample_every, max_num_reqs,
  max_num_batched_tokens).
* 1.1 (dspark-calib 0.1.0): three nullable columns at the end, the step's prefill chunks
  (requests with more than one non-draft token): ``prefill_tokens`` (their non-draft
  tokens), ``prefill_context_sum`` (their computed tokens) and ``prefill_pairs`` (sum of
  q x (c + q): the query-context pairs their attention does; context.prefill_context_sum
  prices by it). Migration: a 1.0 file reads with the three ABSENT (not recorded), and
  ``validate`` then leaves prefill-carrying steps at the plain KV sum.

Compatibility rules, as for tables: a reader accepts every minor of its major
(columns a newer minor adds are ignored; a minor may only add columns); a newer
major is refused naming both versions.

Writing: rows are buffered and written as one file per ``rows_per_file`` rows
(or ``max_buffer_s`` seconds) through ``atomic.atomic_write`` (temp file, then
rename: a reader never sees half a file); a writer keeps at most ``max_files``
of its own files, deleting the oldest, so a long-running server's disk use is
bounded by rows_per_file * max_files rows. Reading validates every column and
every row; a bad file is one CalibError naming it, never a traceback.

``PendingSteps`` is the in-engine sampler's pure part: it holds the CUDA events
of sampled steps and resolves the ones that are done with ``query()``, so
observing never synchronises the host with the device.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from dspark_calib import __version__
from dspark_calib.atomic import atomic_write
from dspark_calib.errors import CalibError, first_line

OBSERVED_SCHEMA_VERSION = "1.1"
METADATA_KEY = b"dspark_calib_observed"
FILE_PREFIX = "observed-"
INT, FLOAT, BOOL = "int64", "float64", "bool"
# Column -> type, in file order. Every step the engine observed:
COLUMNS: dict[str, str] = {
    "step": INT,  # the engine's step counter (increasing per writer)
    "forward_ms": FLOAT,  # StepTimingCollector: target forward (the verify step)
    "drafter_ms": FLOAT,  # StepTimingCollector: drafter
    "num_target_tokens": INT,  # tokens the target ran (after the budget trimmed drafts)
    "num_reqs": INT,
    "full_cudagraph": BOOL,  # replayed a full CUDA graph (vLLM prices drafts from these only)
    "context_mean": FLOAT,  # num_computed_tokens over the scheduled requests
    "context_max": INT,
    "context_sum": INT,
    "scheduled_drafts": INT,  # drafts scheduled before the budget
    "draft_budget": INT,  # drafts verified (the budget chosen)
    "priced_context": INT,  # the context the step's drafts were priced at (context-aware: the batch mean,
    # raised by the tail when one is set: ceil(S' / n), context.tail_context_sum)
    "predicted_draft_ms": FLOAT,  # the engine's cost tables for this step
    "predicted_verify_ms": FLOAT,
    "budget_static": INT,  # nullable: budget under the table's one-context pricing
    "budget_context_aware": INT,  # nullable: budget under context-aware pricing
    # 1.1: the prefill chunks (requests with more than one non-draft token); null: not recorded
    "prefill_tokens": INT,
    "prefill_context_sum": INT,
    "prefill_pairs": INT,
}
BUDGETS = ("budget_static", "budget_context_aware")
PREFILL = ("prefill_tokens", "prefill_context_sum", "prefill_pairs")
NULLABLE = frozenset(BUDGETS + PREFILL)
# Columns a minor added, and the minor: a file of an older minor reads them as ABSENT (migration).
ADDED_IN_MINOR = {name: 1 for name in PREFILL}
ABSENT = -1  # in memory, a null budget


@dataclass(frozen=True, slots=True)
class ObservedStep:
    """One observed serving step; checked on construction (sampled steps only: cheap enough)."""

    step: int
    forward_ms: float
    drafter_ms: float
    num_target_tokens: int
    num_reqs: int
    full_cudagraph: bool
    context_mean: float
    context_max: int
    context_sum: int
    scheduled_drafts: int
    draft_budget: int
    priced_context: int
    predicted_draft_ms: float
    predicted_verify_ms: float
    budget_static: int | None = None
    budget_context_aware: int | None = None
    prefill_tokens: int | None = None
    prefill_context_sum: int | None = None
    prefill_pairs: int | None = None

    def __post_init__(self) -> None:
        problem = _row_problem({f.name: getattr(self, f.name) for f in fields(self)})
        if problem:
            raise CalibError(f"bad observed step: {problem}")


def _row_problem(r: dict[str, Any]) -> str | None:
    """The first thing wrong with one row (scalars), or None."""
    for name in ("forward_ms", "drafter_ms", "predicted_draft_ms", "predicted_verify_ms", "context_mean"):
        v = r[name]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            return f"{name} must be a finite number >= 0, got {v!r}"
    for name, low in (("step", 0), ("num_target_tokens", 1), ("num_reqs", 1), ("context_max", 0),
                      ("context_sum", 0), ("scheduled_drafts", 0), ("draft_budget", 0), ("priced_context", 0)):
        v = r[name]
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low:
            return f"{name} must be an integer >= {low}, got {v!r}"
    if not isinstance(r["full_cudagraph"], (bool, np.bool_)):
        return f"full_cudagraph must be a bool, got {r['full_cudagraph']!r}"
    n, total = r["num_reqs"], r["context_sum"]
    if abs(r["context_mean"] - total / n) > 1e-9 * max(1.0, total / n) or r["context_max"] * n < total:
        return f"context mean/max/sum disagree (mean {r['context_mean']}, max {r['context_max']}, sum {total}, {n} reqs)"
    for name in ("draft_budget", "budget_static", "budget_context_aware"):
        v = r[name]
        if v is None and name in NULLABLE:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 0 <= v <= r["scheduled_drafts"]:
            return f"{name} must be an integer in 0..scheduled_drafts ({r['scheduled_drafts']}), got {v!r}"
    prefill = [r[name] for name in PREFILL]
    if any(v is not None for v in prefill):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in prefill):
            return f"prefill_tokens/context_sum/pairs must be integers >= 0 (or all None), got {prefill!r}"
        tokens, ctx_sum, pairs = prefill
        # each chunk has q >= 2 non-draft tokens at c <= context_max: 2q <= q (c + q) <= q (max + q)
        if tokens > r["num_target_tokens"] or ctx_sum > total or (tokens == 0 and ctx_sum) \
                or not 2 * tokens <= pairs <= tokens * (r["context_max"] + tokens):
            return (f"prefill columns disagree with the step (tokens {tokens}, context sum {ctx_sum}, pairs {pairs}; "
                    f"step: {r['num_target_tokens']} tokens, context sum {total}, max {r['context_max']})")
    return None


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _arrow_types() -> dict[str, Any]:
    import pyarrow as pa

    return {INT: pa.int64(), FLOAT: pa.float64(), BOOL: pa.bool_()}


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
            "created_at": _utc_now()}
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
    metadata: tuple[dict[str, Any], ...]  # one per file

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
    parts, metas = [], []
    for path in paths:
        cols, meta = _read_one(path)
        parts.append(cols)
        metas.append(meta)
    columns = {name: np.concatenate([p[name] for p in parts]) for name in COLUMNS}
    for arr in columns.values():
        arr.flags.writeable = False
    return ObservedSteps(columns=columns, files=tuple(paths), metadata=tuple(metas))


def _read_one(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise CalibError("no such file", path=path)
    if not os.path.isfile(path):
        raise CalibError("not a regular file", path=path)
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        raw = pf.schema_arrow.metadata or {}
        if METADATA_KEY not in raw:
            raise CalibError("parquet file without dspark-calib observed metadata (not an observe file)", path=path)
        meta = _parse_meta(raw[METADATA_KEY], path)
        arrow = pf.read()
    except CalibError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for bad files
        raise CalibError(f"not a readable parquet file ({first_line(exc)})", path=path) from None
    if arrow.num_rows != pf.metadata.num_rows:
        raise CalibError("row counts in the parquet footer disagree (damaged file)", path=path)
    types = _arrow_types()
    cols: dict[str, np.ndarray] = {}
    minor = int(str(meta["schema_version"]).split(".")[1])
    for name, typ in COLUMNS.items():
        if name not in arrow.column_names:
            if minor < ADDED_IN_MINOR.get(name, 0):  # an older minor's file: not recorded
                cols[name] = np.full(arrow.num_rows, ABSENT, dtype=typ)
                continue
            raise CalibError(f"column {name} is missing", path=path)
        col = arrow.column(name)
        if col.type != types[typ]:
            raise CalibError(f"column {name} has type {col.type}, expected {types[typ]}", path=path)
        if col.null_count and name not in NULLABLE:
            raise CalibError(f"column {name} has {col.null_count} null values", path=path)
        cols[name] = _numpy(col.combine_chunks(), typ)
    problem = _column_problem(cols)
    if problem:
        raise CalibError(problem, path=path)
    return cols, meta


def _numpy(arr: Any, typ: str) -> np.ndarray:
    """An arrow array as numpy (nulls: ABSENT), from its buffers: pyarrow's to_numpy imports
    pandas, which would be most of `validate`'s start-up."""
    n, off = len(arr), arr.offset
    if n == 0:
        return np.zeros(0, dtype=bool if typ == BOOL else typ)
    validity, data = arr.buffers()[:2]
    if typ == BOOL:
        return np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")[off:off + n].astype(bool)
    out = np.frombuffer(data, dtype=typ)[off:off + n].copy()
    if arr.null_count:  # nullable budgets: ABSENT where null
        valid = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")[off:off + n].astype(bool)
        out[~valid] = ABSENT
    return out


def _parse_meta(raw: bytes, path: str) -> dict[str, Any]:
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CalibError(f"malformed observed metadata JSON ({first_line(exc)})", path=path) from None
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise CalibError("observed metadata lacks schema_version", path=path)
    version = str(meta["schema_version"]).split(".")
    ours = OBSERVED_SCHEMA_VERSION.split(".")
    if len(version) != 2 or not all(v.isdigit() for v in version):
        raise CalibError(f"bad observed schema_version {meta['schema_version']!r}", path=path)
    if int(version[0]) != int(ours[0]):
        raise CalibError(f"observed schema {meta['schema_version']} is not readable by this dspark-calib "
                         f"(reads {OBSERVED_SCHEMA_VERSION}); use a matching version", path=path)
    return meta


def _column_problem(c: dict[str, np.ndarray]) -> str | None:
    """Vectorised _row_problem over whole columns: the first bad row, named."""
    checks: list[tuple[np.ndarray, str]] = []
    for name in ("forward_ms", "drafter_ms", "predicted_draft_ms", "predicted_verify_ms", "context_mean"):
        checks.append((~np.isfinite(c[name]) | (c[name] < 0), f"{name} must be finite and >= 0"))
    for name, low in (("step", 0), ("num_target_tokens", 1), ("num_reqs", 1), ("context_max", 0),
                      ("context_sum", 0), ("scheduled_drafts", 0), ("priced_context", 0)):
        checks.append((c[name] < low, f"{name} must be >= {low}"))
    n = np.maximum(c["num_reqs"], 1)
    mean = c["context_sum"] / n
    checks.append((np.abs(c["context_mean"] - mean) > 1e-9 * np.maximum(1.0, mean), "context_mean != context_sum / num_reqs"))
    checks.append((c["context_max"] * n < c["context_sum"], "context_max below the mean"))
    checks.append(((c["draft_budget"] < 0) | (c["draft_budget"] > c["scheduled_drafts"]),
                   "draft_budget outside 0..scheduled_drafts"))
    for name in BUDGETS:
        v = c[name]
        checks.append(((v != ABSENT) & ((v < 0) | (v > c["scheduled_drafts"])), f"{name} outside 0..scheduled_drafts"))
    tokens, ctx_sum, pairs = (c[name] for name in PREFILL)
    known = tokens != ABSENT
    checks.append(((known != (ctx_sum != ABSENT)) | (known != (pairs != ABSENT)), "prefill columns null in some, not all"))
    checks.append((known & ((tokens < 0) | (tokens > c["num_target_tokens"]) | (ctx_sum < 0)
                            | (ctx_sum > c["context_sum"]) | ((tokens == 0) & (ctx_sum != 0)) | (pairs < 2 * tokens)
                            | (pairs > tokens * (c["context_max"] + tokens))),
                   "prefill columns disagree with the step's tokens and contexts"))
    for bad, what in checks:
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            return f"row {row}: {what} ({int(bad.sum())} bad rows)"
    return None


# -- the in-engine sampler's pure part ---------------------------------------------------------
class PendingSteps:
    """Sampled steps whose CUDA events may still be on device, oldest first.

    ``events``: anything with forward_start/forward_end/drafter_start/drafter_end
    events (vLLM's StepTimingEvents). Steps on one stream finish in issue order,
    so resolution stops at the first step whose drafter_end is not done; nothing
    here ever waits. When ``max_pending`` steps are in flight a new one is dropped
    (and counted): observing must never hold events without bound.
    """

    def __init__(self, max_pending: int = 256):
        self.max_pending = max_pending
        self._queue: deque[tuple[Any, Any]] = deque()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, events: Any, info: Any) -> bool:
        if len(self._queue) >= self.max_pending:
            self.dropped += 1
            return False
        self._queue.append((events, info))
        return True

    def resolve_ready(self) -> list[tuple[float, float, Any]]:
        """(forward_ms, drafter_ms, info) of every finished step, in order; never blocks."""
        done = []
        queue = self._queue
        while queue and queue[0][0].drafter_end.query():
            events, info = queue.popleft()
            done.append((events.forward_start.elapsed_time(events.forward_end),
                         events.drafter_start.elapsed_time(events.drafter_end), info))
        return done

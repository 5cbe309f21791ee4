"""The cost table and its parquet file format.

Format history (SCHEMA_VERSION, "major.minor"):

* 1.0 (dspark-calib 0.1.0): first format. One parquet file per table, long format:
  every row is a fitted curve point (record "draft" or "verify") or a raw timed
  sample (record "sample"); columns that do not apply to a row are null. Table
  metadata is JSON under the parquet key-value metadata key ``dspark_calib``:
  schema_version, tool_version, created_at (UTC, ISO 8601), content_hash and
  fingerprint (see fingerprint.py). Page checksums are written and verified.

Compatibility rules: a reader accepts every minor version of its major. An older
minor is migrated on read by ``_MIGRATIONS`` (columns it lacked are filled with
nulls); unknown fingerprint keys from a newer minor are kept under
``fingerprint.extra``. A newer major is refused, naming both versions. A minor
bump may only add optional columns or keys; anything else is a major bump.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspark_calib import __version__
from dspark_calib.atomic import atomic_write
from dspark_calib.errors import CalibError, first_line
from dspark_calib.fingerprint import Fingerprint, merge_mismatches
from dspark_calib.fit import CURVE_KINDS, DRAFT, VERIFY, Curve, CurvePair, build_cost_tables, fit_curves
from dspark_calib.samples import Sample, samples_from_dicts

if TYPE_CHECKING:  # pandas is imported where samples are used: it is most of `inspect`'s start-up
    import pandas as pd

SCHEMA_VERSION = "1.0"
METADATA_KEY = b"dspark_calib"
RECORD_SAMPLE = "sample"
RECORD_KINDS = (DRAFT, VERIFY, RECORD_SAMPLE)

# Column -> arrow type, in file order. The README documents each one.
COLUMNS: dict[str, pa.DataType] = {
    "record": pa.string(),  # "draft" | "verify" | "sample"
    "context_len": pa.int64(),  # all rows
    # fitted curve points (record draft/verify)
    "size": pa.int64(),  # num_reqs (draft) or num_target_tokens (verify)
    "cost_ms": pa.float64(),  # median: what vLLM uses
    "n": pa.int64(),
    "min_ms": pa.float64(),
    "p25_ms": pa.float64(),
    "p75_ms": pa.float64(),
    "max_ms": pa.float64(),
    "mad_ms": pa.float64(),
    # raw samples (record sample): vLLM's StepTimingSample fields + replay index
    "replay": pa.int64(),
    "forward_ms": pa.float64(),
    "drafter_ms": pa.float64(),
    "num_target_tokens": pa.int64(),
    "num_reqs": pa.int64(),
    "full_cudagraph": pa.bool_(),
}
SCHEMA = pa.schema(list(COLUMNS.items()))
CURVE_COLUMNS = ("size", "cost_ms", "n", "min_ms", "p25_ms", "p75_ms", "max_ms", "mad_ms")
SAMPLE_COLUMNS = ("context_len", "replay", "forward_ms", "drafter_ms", "num_target_tokens", "num_reqs", "full_cudagraph")


def nearest(context_lens: Iterable[int], wanted: int) -> int:
    """The context length closest to `wanted`; a tie goes to the longer one (the safer, higher cost)."""
    return min(context_lens, key=lambda c: (abs(c - wanted), -c))


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _content_hash(fingerprint: dict[str, Any], curves: dict[int, CurvePair]) -> str:
    fp = {k: v for k, v in fingerprint.items() if k != "extra"}  # notes do not change what the table means
    body = {
        "fingerprint": fp,
        "curves": {
            str(ctx): {kind: pair.curve(kind).as_vllm() for kind in CURVE_KINDS}
            for ctx, pair in sorted(curves.items())
        },
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True, eq=False)
class CostTable:
    fingerprint: Fingerprint
    curves: dict[int, CurvePair]  # context_len -> curve pair
    samples: pd.DataFrame  # SAMPLE_COLUMNS; columnar so 100k samples load fast (see _LazySamples)
    created_at: str = field(default_factory=_utc_now)
    tool_version: str = __version__
    schema_version: str = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.samples, _LazySamples):
            # A table read from a file: `samples` is built on first access (__getattr__).
            object.__setattr__(self, "_lazy_samples", self.samples)
            object.__delattr__(self, "samples")

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails, i.e. `samples` of a read table before first use.
        lazy = self.__dict__.get("_lazy_samples") if name == "samples" else None
        if lazy is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        frame = lazy.frame()
        object.__setattr__(self, "samples", frame)
        return frame

    def num_samples(self, context_len: int | None = None) -> int:
        """Raw samples (at one context length), without building the DataFrame."""
        if "samples" in self.__dict__:
            ctx = self.samples["context_len"].to_numpy()
        else:
            ctx = self.__dict__["_lazy_samples"].columns["context_len"]
        return len(ctx) if context_len is None else int((ctx == context_len).sum())

    @classmethod
    def from_samples(cls, samples: Iterable[Sample], fingerprint: Fingerprint, **kw: Any) -> "CostTable":
        samples = list(samples)
        if not samples:
            raise CalibError("no samples to fit")
        curves = fit_curves(samples)
        import pandas as pd

        frame = pd.DataFrame({c: [getattr(s, c) for s in samples] for c in SAMPLE_COLUMNS})
        fingerprint = fingerprint.replace(context_lens=tuple(sorted(curves)))
        table = cls(fingerprint=fingerprint, curves=curves, samples=frame, **kw)
        table.validate()
        return table

    # -- identity -----------------------------------------------------------------
    @property
    def content_hash(self) -> str:
        """sha256 over the fingerprint and every curve's (size, cost): what vLLM would use."""
        return _content_hash(self.fingerprint.to_dict(), self.curves)

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

    def nearest_context(self, context_len: int | None) -> int:
        """The profiled context length closest to `context_len` (ties: the longer, the safer cost)."""
        lens = self.context_lens()
        if context_len is None:
            return lens[-1] if 8192 not in lens else 8192
        return nearest(lens, context_len)

    def pair(self, context_len: int | None = None) -> CurvePair:
        return self.curves[self.nearest_context(context_len)]

    def dense_tables(self, context_len: int | None = None, *, max_num_reqs: int | None = None,
                     max_num_batched_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """vLLM's dense tables for the engine this table was profiled on (or the given limits)."""
        fp = self.fingerprint
        draft, verify = self.pair(context_len).as_vllm()
        return build_cost_tables(draft, verify, max_num_reqs or fp.max_num_seqs,
                                 max_num_batched_tokens or fp.max_num_batched_tokens, fp.cudagraph_limit)

    def iter_samples(self, context_len: int | None = None) -> list[Sample]:
        frame = self.samples if context_len is None else self.samples[self.samples.context_len == context_len]
        return samples_from_dicts(frame.to_dict("records"))

    # -- checks -------------------------------------------------------------------
    def validate(self) -> None:
        """Raise CalibError on anything vLLM could not use or that makes no sense."""
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
                if not np.isfinite(curve.cost_ms).all() or np.isinf(costs).any() or (costs[np.isfinite(costs)] < 0).any():
                    raise CalibError(f"{where}: costs must be finite and >= 0")
                if (curve.n < 1).any():
                    raise CalibError(f"{where}: every point needs n >= 1")
        if "samples" in self.__dict__:
            s = self.samples
            if len(s):
                _check_samples({c: s[c].to_numpy(dtype=np.float64, na_value=np.nan) for c in SAMPLE_COLUMNS})
        else:
            _check_samples({c: v.astype(np.float64) for c, v in self.__dict__["_lazy_samples"].columns.items()})


def _check_samples(cols: dict[str, np.ndarray]) -> None:
    """Sample columns as float64, NaN where missing."""
    if not len(cols["context_len"]):
        return
    for col in ("forward_ms", "drafter_ms"):
        vals = cols[col]
        if not np.isfinite(vals).all() or (vals < 0).any():
            raise CalibError(f"sample {col} must be finite and >= 0")
    for col in ("num_target_tokens", "num_reqs", "context_len"):
        vals = cols[col]
        if np.isnan(vals).any() or (vals <= 0).any():
            raise CalibError(f"sample {col} must be a positive integer")
    replay = cols["replay"]
    if np.isnan(replay).any() or (replay < 0).any() or np.isnan(cols["full_cudagraph"]).any():
        raise CalibError("sample replay/full_cudagraph missing or negative")


class _LazySamples:
    """A read table's raw samples as numpy columns; the DataFrame is made on first use.

    `inspect` never touches raw samples, and importing pandas costs more than the
    whole rest of a load (0.5-1 s on a small VM).
    """

    def __init__(self, columns: dict[str, np.ndarray]):
        self.columns = columns

    def frame(self) -> "pd.DataFrame":
        import pandas as pd

        return pd.DataFrame(self.columns, columns=list(SAMPLE_COLUMNS))


def merge_tables(tables: Sequence[CostTable]) -> CostTable:
    """One table from several runs of the same engine: samples pooled, curves refitted.

    Refused when any MERGE_KEYS key differs (naming it and both values) or a table
    has no raw samples (its curves cannot be refitted honestly).
    """
    if not tables:
        raise CalibError("nothing to merge")
    first = tables[0]
    for other in tables[1:]:
        bad = merge_mismatches(first.fingerprint, other.fingerprint)
        if bad:
            m = bad[0]
            raise CalibError(f"cannot merge tables profiled differently: {m.key} is {m.table_value!r} in "
                             f"{first.short_hash} but {m.engine_value!r} in {other.short_hash}")
    for t in tables:
        if t.samples.empty:
            raise CalibError(f"table {t.short_hash} has no raw samples to merge")
    frames = []
    offset = 0
    for t in tables:  # keep replay indices distinct across runs
        f = t.samples.copy()
        f["replay"] = f["replay"] + offset
        offset = int(f["replay"].max()) + 1
        frames.append(f)
    import pandas as pd

    extra = dict(first.fingerprint.extra, merged_from=[t.short_hash for t in tables])
    fp = first.fingerprint.replace(
        replays=sum(t.fingerprint.replays for t in tables),
        warmup_replays=max(t.fingerprint.warmup_replays for t in tables),
        extra=extra,
    )
    return CostTable.from_samples(samples_from_dicts(pd.concat(frames, ignore_index=True).to_dict("records")), fp)


# -- the file -------------------------------------------------------------------------
def to_arrow(table: CostTable) -> pa.Table:
    columns: dict[str, list[np.ndarray]] = {name: [] for name in COLUMNS}
    n_total = 0

    def add(n: int, values: dict[str, Any]) -> None:
        nonlocal n_total
        for name in COLUMNS:
            v = values.get(name)
            columns[name].append(np.asarray(v) if v is not None else None)
        sizes.append(n)
        n_total += n

    sizes: list[int] = []
    for ctx, pair in sorted(table.curves.items()):
        for kind in CURVE_KINDS:
            curve = pair.curve(kind)
            n = len(curve)
            add(n, {"record": np.full(n, kind, dtype=object), "context_len": np.full(n, ctx, dtype=np.int64),
                    **{c: getattr(curve, c) for c in CURVE_COLUMNS}})
    s = table.samples
    add(len(s), {"record": np.full(len(s), RECORD_SAMPLE, dtype=object),
                 **{c: s[c].to_numpy() for c in SAMPLE_COLUMNS}})
    arrays = []
    for name, typ in COLUMNS.items():
        chunks = [pa.array(v, type=typ) if v is not None else pa.nulls(n, type=typ)
                  for v, n in zip(columns[name], sizes)]
        arrays.append(pa.concat_arrays(chunks) if chunks else pa.array([], type=typ))
    meta = {
        "schema_version": table.schema_version,
        "tool_version": table.tool_version,
        "created_at": table.created_at,
        "content_hash": table.content_hash,
        "fingerprint": table.fingerprint.to_dict(),
    }
    return pa.Table.from_arrays(arrays, schema=SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta).encode()}))


def prepare_out_path(out: str) -> str:
    """--out: an existing directory, a path ending in '/', or a new name without .parquet are
    directories (the table's default file name goes inside, see write_table); anything else is
    the file. Directories are created now, so a bad --out fails before minutes of profiling."""
    if out.endswith(("/", os.sep)) or (not os.path.exists(out) and not out.endswith(".parquet")):
        os.makedirs(out, exist_ok=True)
    elif not os.path.isdir(out):
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return out


def write_table(table: CostTable, path: str | os.PathLike) -> str:
    """Write atomically; `path` may be a directory (the default file name goes inside).

    Temp file in the destination directory, fsync, rename: readers (and a vLLM
    starting from that directory) never see a half-written table.
    """
    table.validate()
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, table.default_filename())
    arrow = to_arrow(table)
    return atomic_write(path, lambda fh: pq.write_table(arrow, fh, compression="zstd", write_page_checksum=True))


def _parse_version(text: Any, path: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", str(text))
    if not m:
        raise CalibError(f"bad schema_version {text!r}", path=path)
    return int(m.group(1)), int(m.group(2))


# (major, minor) -> function(arrow table, metadata) -> (arrow table, metadata), applied in order
# to bring an older minor up to SCHEMA_VERSION. Missing columns are filled generically below.
_MIGRATIONS: dict[tuple[int, int], Callable[[pa.Table, dict], tuple[pa.Table, dict]]] = {}


def _migrate(arrow: pa.Table, meta: dict, version: tuple[int, int], path: str) -> tuple[pa.Table, dict]:
    current = _parse_version(SCHEMA_VERSION, path)
    if version[0] > current[0]:
        raise CalibError(f"table schema {version[0]}.{version[1]} is newer than this dspark-calib reads "
                         f"({SCHEMA_VERSION}); upgrade dspark-calib", path=path)
    if version[0] < current[0]:
        migrate = _MIGRATIONS.get(version)
        if migrate is None:
            raise CalibError(f"table schema {version[0]}.{version[1]} is too old to migrate to {SCHEMA_VERSION}", path=path)
        arrow, meta = migrate(arrow, meta)
    names = arrow.column_names
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise CalibError(f"duplicate columns {dupes}", path=path)
    # Columns we do not know can only come from a newer minor; in a file claiming a version
    # we know, they mean a damaged column name (and the real column would be lost as "absent").
    unknown = [n for n in names if n not in COLUMNS]
    if unknown and version[0] == current[0] and version[1] <= current[1]:
        raise CalibError(f"unknown columns {unknown} in a schema {version[0]}.{version[1]} file "
                         "(damaged or not written by dspark-calib)", path=path)
    for name, typ in COLUMNS.items():  # an older minor lacked an optional column: nulls
        if name not in arrow.column_names:
            arrow = arrow.append_column(pa.field(name, typ), pa.nulls(arrow.num_rows, type=typ))
    return arrow, meta


def read_metadata(path: str | os.PathLike, *, filesystem: Any = None) -> dict[str, Any]:
    """Just the JSON metadata (cheap: reads the footer only); `filesystem`: a pyarrow.fs one for URIs."""
    path = os.fspath(path)
    if filesystem is None:
        _check_path(path)
    try:
        if filesystem is None:
            schema = pq.read_schema(path)
        else:
            with filesystem.open_input_file(path) as fh:
                schema = pq.read_schema(fh)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for bad files
        raise CalibError(f"not a readable parquet file ({first_line(exc)})", path=path) from None
    return _parse_meta(schema.metadata, path)


def _check_path(path: str) -> None:
    if not os.path.exists(path):
        raise CalibError("no such file", path=path)
    if os.path.isdir(path):
        raise CalibError("is a directory, not a table file", path=path)


def _parse_meta(raw: dict | None, path: str) -> dict[str, Any]:
    if not raw or METADATA_KEY not in raw:
        raise CalibError("parquet file without dspark-calib metadata (not a cost table)", path=path)
    try:
        meta = json.loads(raw[METADATA_KEY].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CalibError(f"malformed metadata JSON ({first_line(exc)})", path=path) from None
    if not isinstance(meta, dict):
        raise CalibError("malformed metadata: not a JSON object", path=path)
    for key in ("schema_version", "fingerprint", "content_hash"):
        if key not in meta:
            raise CalibError(f"metadata lacks {key}", path=path)
    return meta


def read_table(path: str | os.PathLike, *, filesystem: Any = None) -> CostTable:
    """Read and fully validate a table. Every problem is a CalibError naming the file."""
    path = os.fspath(path)
    if filesystem is None:
        _check_path(path)
    try:
        pf = pq.ParquetFile(filesystem.open_input_file(path) if filesystem else path,
                            page_checksum_verification=True)
        raw_meta = pf.schema_arrow.metadata
        meta = _parse_meta(raw_meta, path)
        version = _parse_version(meta["schema_version"], path)
        arrow = pf.read()
        _check_row_counts(pf.metadata, arrow, path)
    except CalibError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CalibError(f"not a readable parquet file ({first_line(exc)})", path=path) from None
    arrow, meta = _migrate(arrow, meta, version, path)
    try:
        return _from_arrow(arrow, meta, path)
    except CalibError as exc:
        if exc.path:
            raise
        raise CalibError(str(exc), path=path) from None


_NUMPY_TYPES = {pa.int64(): np.int64, pa.float64(): np.float64}


def _column(arrow: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, valid) of one column, decoded from its Arrow buffers.

    Not ChunkedArray.to_numpy(): even a zero-copy conversion imports pandas, which
    would triple `inspect`'s start-up. Values where valid is False are meaningless.
    Types are checked against COLUMNS before this is called.
    """
    col = arrow.column(name)
    typ = col.type
    values, valid = [], []
    for chunk in col.chunks:
        n, off = len(chunk), chunk.offset
        if n == 0:
            continue
        bufs = chunk.buffers()
        if bufs[0] is None or chunk.null_count == 0:
            valid.append(np.ones(n, dtype=bool))
        else:
            valid.append(np.unpackbits(np.frombuffer(bufs[0], np.uint8), bitorder="little")[off:off + n].view(bool))
        if typ == pa.string():
            values.append(np.array(chunk.to_pylist(), dtype=object))
        elif bufs[1] is None:  # an all-null column added by a migration
            values.append(np.zeros(n, dtype=bool if typ == pa.bool_() else _NUMPY_TYPES[typ]))
        elif typ == pa.bool_():
            values.append(np.unpackbits(np.frombuffer(bufs[1], np.uint8), bitorder="little")[off:off + n].view(bool))
        else:
            values.append(np.frombuffer(bufs[1], dtype=_NUMPY_TYPES[typ])[off:off + n])
    if not values:
        empty = np.array([], dtype=object if typ == pa.string() else bool if typ == pa.bool_() else _NUMPY_TYPES[typ])
        return empty, np.array([], dtype=bool)
    return np.concatenate(values), np.concatenate(valid)


def _record_kinds(arrow: pa.Table) -> np.ndarray:
    """The `record` column as indices into RECORD_KINDS (-1: null or unknown), from its buffers.

    Vectorised byte comparison: a Python string per row costs more than the rest of a load.
    """
    codes = []
    for chunk in arrow.column("record").chunks:
        n, off = len(chunk), chunk.offset
        if n == 0:
            continue
        bufs = chunk.buffers()
        offsets = np.frombuffer(bufs[1], dtype=np.int32)[off:off + n + 1]
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        starts, lengths = offsets[:-1], np.diff(offsets)
        code = np.full(n, -1, dtype=np.int8)
        for i, kind in enumerate(RECORD_KINDS):
            word = np.frombuffer(kind.encode(), dtype=np.uint8)
            rows = np.flatnonzero(lengths == len(word))
            if len(rows):
                same = (data[starts[rows, None] + np.arange(len(word))] == word).all(axis=1)
                code[rows[same]] = i
        if bufs[0] is not None and chunk.null_count:
            valid = np.unpackbits(np.frombuffer(bufs[0], np.uint8), bitorder="little")[off:off + n].view(bool)
            code[~valid] = -1
        codes.append(code)
    return np.concatenate(codes) if codes else np.zeros(0, dtype=np.int8)


def _check_row_counts(md: pq.FileMetaData, arrow: pa.Table, path: str) -> None:
    """Page checksums do not cover the footer: a damaged row count there makes pyarrow
    read fewer rows without complaint. Every count the footer holds must agree."""
    groups = [md.row_group(i) for i in range(md.num_row_groups)]
    # Our columns are flat: each column chunk holds one value (or null) per row.
    if not (arrow.num_rows == md.num_rows == sum(g.num_rows for g in groups)
            and all(g.column(j).num_values == g.num_rows for g in groups for j in range(g.num_columns))):
        raise CalibError("row counts in the parquet footer disagree (damaged file)", path=path)


def _from_arrow(arrow: pa.Table, meta: dict, path: str) -> CostTable:
    for name, typ in COLUMNS.items():
        have = arrow.schema.field(name).type
        if have != typ:
            raise CalibError(f"column {name} has type {have}, expected {typ}")
    fingerprint = Fingerprint.from_dict(meta["fingerprint"])
    record_kind = _record_kinds(arrow)
    if (record_kind < 0).any():
        found = arrow.column("record").to_pylist()  # the error path may be slow
        bad = sorted({str(found[i]) for i in np.flatnonzero(record_kind < 0)})
        raise CalibError(f"unknown record kinds {bad}")
    columns = {name: _column(arrow, name) for name in COLUMNS if name != "record"}
    ctx_all, ctx_valid = columns["context_len"]
    curves: dict[int, dict[str, Curve]] = {}
    for kind in CURVE_KINDS:
        mask = record_kind == RECORD_KINDS.index(kind)
        if not mask.any():
            continue
        for c in ("size", "cost_ms", "n"):
            if not columns[c][1][mask].all():
                raise CalibError(f"{kind} curve has missing {c}")
        cols = {}
        for c in CURVE_COLUMNS:
            vals, valid = columns[c]
            vals, valid = vals[mask], valid[mask]
            # optional spread (min..mad): NaN when absent
            cols[c] = vals if valid.all() else np.where(valid, vals.astype(np.float64), np.nan)
        if not ctx_valid[mask].all():
            raise CalibError(f"{kind} curve has missing context_len")
        ctx = ctx_all[mask]
        for c in np.unique(ctx):
            sel = ctx == c
            curves.setdefault(int(c), {})[kind] = Curve.from_columns({k: v[sel] for k, v in cols.items()})
    pairs = {}
    for ctx, kinds in curves.items():
        for kind in CURVE_KINDS:
            if kind not in kinds:
                raise CalibError(f"{kind} curve at context {ctx} is empty")
        pairs[ctx] = CurvePair(draft=kinds[DRAFT], verify=kinds[VERIFY])
    smask = record_kind == RECORD_KINDS.index(RECORD_SAMPLE)
    sample_cols, valid = {}, {}
    for c in SAMPLE_COLUMNS:
        vals, ok = columns[c]
        sample_cols[c], valid[c] = vals[smask], ok[smask]
    if not all(v.all() for v in valid.values()):  # nulls must fail here: typed columns cannot show them
        _check_samples({c: np.where(valid[c], v.astype(np.float64), np.nan) for c, v in sample_cols.items()})
    table = CostTable(fingerprint=fingerprint, curves=pairs, samples=_LazySamples(sample_cols),
                      created_at=str(meta.get("created_at", "")), tool_version=str(meta.get("tool_version", "")),
                      schema_version=str(meta["schema_version"]))
    table.validate()
    # Checked against the fingerprint as the file stores it: a newer minor's extra keys
    # (moved under fingerprint.extra here) were part of the hash its writer computed.
    found = _content_hash(meta["fingerprint"], pairs)
    if found != meta["content_hash"]:
        raise CalibError(f"content hash mismatch (metadata says {str(meta['content_hash'])[:12]}, curves give "
                         f"{found[:12]}): the file was altered or corrupted")
    return table

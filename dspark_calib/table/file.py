"""The cost-table file: layout, format history, migrations, read limits, checks on read.

Format history (SCHEMA_VERSION, "major.minor"):

* 1.0 (dspark-calib 0.1.0): first format. One parquet file per table, long format:
  every row is a fitted curve point (record "draft" or "verify") or a raw timed
  sample (record "sample"); columns that do not apply to a row are null. Table
  metadata is JSON under the parquet key-value metadata key ``dspark_calib``:
  schema_version, tool_version, created_at (UTC, ISO 8601), content_hash and
  fingerprint (see fingerprint.py). Page checksums are written and verified.
  content_hash: sha256 of the fingerprint (less ``extra``) and each curve's
  (size, cost) pairs only.
* 1.1: the curve rows come first, in row group(s) of their own, before the sample
  row groups, so a server reads curves and metadata without touching raw samples.
  Metadata gains ``curve_rows`` (how many leading rows are curve points) and
  ``samples_digest`` (sha256 of the raw sample columns, Samples.digest). The
  content hash covers every metadata key but itself (so created_at, tool_version,
  the whole fingerprint, curve_rows and samples_digest) and every curve column with
  its spread. created_at must be ISO 8601 UTC, not before 2025 nor over a day ahead.
  Same columns as 1.0. A 1.0 file migrates on read and keeps verifying under 1.0's rule.
* 1.2: metadata gains ``telemetry`` (telemetry.py: GPU clocks, temperature, power,
  throttle reasons and host load at each profile block's start and end; null when not
  recorded), covered by the 1.1 hash rule like every metadata key. Same columns. A 1.1
  (or 1.0) file migrates on read with telemetry null and keeps verifying under its rule.
* 1.3: metadata gains ``calibration`` (table/calibration.py: the parent's content hash, the
  per-kind, per-size-region factors the curve rows carry, the served steps and observe files
  they were fitted on; null for a measured table), covered by the 1.1 hash rule. Same
  columns. An older file migrates on read with calibration null and keeps verifying under its rule.
  The fingerprint's ``speculative_method`` (which the last 1.2 writers began to record) is
  recorded by every 1.3 writer; an older file without it migrates as "dspark", the only
  method then profiled or imported. Migrated keys never enter the hash check: a file verifies
  against its metadata as stored.
* 1.4: the fingerprint's ``gpu_state`` (telemetry.GPU_STATES: the GPU state the profile's
  blocks started in; `profile --gpu-state`) is recorded by every 1.4 writer. Same columns, same
  metadata keys. An older file without it migrates as "startup", the only state then profiled
  (and the state of vLLM's own start-up pass, which import-vllm reads); it keeps verifying
  under its rule, against its metadata as stored.

Compatibility rules: a reader accepts every minor version of its major. An older
minor is migrated on read by ``MIGRATIONS`` (append-only; columns it lacked are filled
with nulls); unknown fingerprint keys from a newer minor are kept under
``fingerprint.extra``. A newer major is refused, naming both versions. A minor bump
may only add optional columns or keys; anything else is a major bump.

Everything read is bounded by ``ReadLimits`` before it is allocated, and a table
whose costs no GPU could produce (0, negative, infinite, over 60 s, falling beyond
their own spread) is refused: a file from shared storage is untrusted input.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dspark_calib.fileformat import arrow as _arrow
from dspark_calib.atomic import atomic_write
from dspark_calib.errors import CalibError, display_path, first_line
from dspark_calib.fit import CURVE_COLUMNS, CURVE_KINDS, DRAFT, VERIFY, Curve, CurvePair
from dspark_calib.samples import SAMPLE_COLUMNS, Samples
from dspark_calib.speculators import DSPARK
from dspark_calib.safe_open import open_fs, open_local
from dspark_calib.table.calibration import Calibration
from dspark_calib.table.identity import content_hash, hash_1_0, hash_1_1, meta_1_1
from dspark_calib.table.model import SCHEMA_VERSION, CostTable
from dspark_calib.telemetry import STARTUP, Telemetry
from dspark_calib.fileformat.version import Migrations, parse_version
from dspark_calib.fileformat.limits import ReadLimits, check_limit
from dspark_calib.fileformat.parquet import open_bounded
from dspark_calib.table.meta import CLI_LIMITS, METADATA_KEY, TableMeta, parse_created_at, parse_meta

RECORD_SAMPLE = "sample"
RECORD_KINDS = (DRAFT, VERIFY, RECORD_SAMPLE)


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    since: str  # the schema version that added it; a migration from an older one must add it


# Every column, in file order, defined once; the README documents each one.
_CURVE_TYPES = {"size": pa.int64(), "n": pa.int64()}  # the other curve columns are float64 ms
_SAMPLE_TYPES = {np.int64: pa.int64(), np.float64: pa.float64(), np.bool_: pa.bool_()}
COLUMN_LIST: tuple[Column, ...] = (
    Column("record", pa.string(), "1.0"),  # "draft" | "verify" | "sample"
    Column("context_len", pa.int64(), "1.0"),  # all rows
    *(Column(c, _CURVE_TYPES.get(c, pa.float64()), "1.0") for c in CURVE_COLUMNS),  # curve points
    *(Column(c, _SAMPLE_TYPES[t], "1.0") for c, t in SAMPLE_COLUMNS.items() if c != "context_len"),  # samples
)
COLUMNS: dict[str, pa.DataType] = {c.name: c.type for c in COLUMN_LIST}
SCHEMA = pa.schema(list(COLUMNS.items()))
CURVE_READ_COLUMNS = ("record", "context_len", *CURVE_COLUMNS)  # all a serving read needs


def columns_in(version: str) -> list[str]:
    return [c.name for c in COLUMN_LIST if parse_version(c.since) <= parse_version(version)]


# -- migrations ---------------------------------------------------------------------------
MIGRATIONS = Migrations(SCHEMA_VERSION)
migration = MIGRATIONS.add


@migration("1.0", "1.1")
def _m_1_0_to_1_1(arrow: pa.Table, meta: dict) -> tuple[pa.Table, dict]:
    """1.1 added metadata and a row-group layout, no columns: the columns pass through unchanged.
    A 1.0 file has no curve_rows/samples_digest (None); its hash stays under the 1.0 rule."""
    return arrow, {**meta, "schema_version": "1.1", "curve_rows": None, "samples_digest": None}


@migration("1.1", "1.2")
def _m_1_1_to_1_2(arrow: pa.Table, meta: dict) -> tuple[pa.Table, dict]:
    """1.2 added the telemetry metadata key, no columns: an older table recorded none."""
    return arrow, {**meta, "schema_version": "1.2", "telemetry": None}


@migration("1.2", "1.3")
def _m_1_2_to_1_3(arrow: pa.Table, meta: dict) -> tuple[pa.Table, dict]:
    """1.3 added the calibration metadata key, no columns: an older table is as measured. Every
    1.3 writer records the fingerprint's speculative_method, which the last 1.2 writers began to:
    an older table without it is a DSpark table, the only kind profile and import-vllm made then."""
    fp = meta.get("fingerprint")
    if isinstance(fp, dict) and "speculative_method" not in fp:
        meta = {**meta, "fingerprint": {**fp, "speculative_method": DSPARK}}
    return arrow, {**meta, "schema_version": "1.3", "calibration": None}


@migration("1.3", "1.4")
def _m_1_3_to_1_4(arrow: pa.Table, meta: dict) -> tuple[pa.Table, dict]:
    """1.4 writers record the fingerprint's gpu_state: an older table was profiled in the startup
    state, the only one profile had (import-vllm reads vLLM's start-up pass, the same state)."""
    fp = meta.get("fingerprint")
    if isinstance(fp, dict) and "gpu_state" not in fp:
        meta = {**meta, "fingerprint": {**fp, "gpu_state": STARTUP}}
    return arrow, {**meta, "schema_version": "1.4"}


def migrate(arrow: pa.Table, meta: dict, path: str) -> tuple[pa.Table, dict]:
    """Bring a file's (arrow, metadata) to SCHEMA_VERSION; refuse a newer major."""
    version, current = parse_version(meta["schema_version"], path), parse_version(SCHEMA_VERSION)
    if version[0] != current[0]:
        raise CalibError(f"table schema {version[0]}.{version[1]} is {'newer' if version > current else 'older'} than "
                         f"this dspark-calib reads ({SCHEMA_VERSION}); "
                         f"{'upgrade' if version > current else 'use an older'} dspark-calib", path=path)
    arrow, meta, version = MIGRATIONS.apply(arrow, meta, path)
    names = arrow.column_names
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise CalibError(f"duplicate columns {dupes}", path=path)
    for name in names:  # in a version we know, an unknown name is a damaged one (its data would be lost)
        if name not in COLUMNS and version <= current:
            raise CalibError(f"unknown column {name[:40]!r} in a schema {meta['schema_version']} file "
                             "(damaged or not written by dspark-calib)", path=path)
    return arrow, meta


class TableFile:
    """One table file over ONE open handle: the metadata checked at open and the curves read
    by .read() come from the same bytes, however the name is renamed meanwhile."""

    def __init__(self, handle: Any, size: int, path: str, limits: ReadLimits):
        self._handle, self.path, self.limits = handle, path, limits
        try:
            # `record` as a dictionary: a string repeated on every row is held once
            self._pq = open_bounded(handle, size, path, limits, dictionary=("record",))
            self._groups, schema = self._pq.group_rows, self._pq.schema
            self.meta = parse_meta(schema.metadata, path, limits, MIGRATIONS)
        except CalibError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for bad files
            self.close()
            raise CalibError(f"not a readable parquet file ({first_line(exc)})", path=path) from None
        for f in schema:
            if f.name in COLUMNS and f.type != COLUMNS[f.name]:
                self.close()
                raise CalibError(f"column {f.name} has type {f.type}, expected {COLUMNS[f.name]}", path=path)

    @classmethod
    def open(cls, source: str | os.PathLike, *, filesystem: Any = None, limits: ReadLimits | None = None) -> "TableFile":
        path = os.fspath(source)
        shown = display_path(path)
        handle, size = open_local(path, shown) if filesystem is None else open_fs(filesystem, path, shown)
        return cls(handle, size, shown, limits or CLI_LIMITS)

    def __enter__(self) -> "TableFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        pq_file, self._pq = getattr(self, "_pq", None), None
        if pq_file is not None:
            pq_file.close()  # pyarrow's reader before the handle it reads (BoundedParquet says why)
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def read(self, samples: bool = True) -> CostTable:
        """The table, fully checked. samples=False: curves and metadata only (raw-sample rows
        are never read in a 1.1 file; a 1.0 file's single row group is projected to the curve
        columns, so only its record/context_len values of sample rows are read)."""
        path, raw = self.path, self.meta.raw
        version = parse_version(raw["schema_version"], path)
        groups, columns = list(range(len(self._groups))), list(self._pq.schema.names)
        if not samples:
            columns = [c for c in CURVE_READ_COLUMNS if c in columns]
            if version >= (1, 1):  # only the leading row groups that hold the curve_rows curve points
                if not 0 < self.meta.curve_rows <= sum(self._groups):
                    raise CalibError(f"metadata curve_rows {self.meta.curve_rows} is not a row count of this file", path=path)
                groups = [i for i in groups if sum(self._groups[:i]) < self.meta.curve_rows]
                # the writer ends a group at curve_rows: a group running on into millions of
                # sample rows would be decoded whole (hundreds of MB) for a few curve points
                check_limit("rows in the curve row groups", sum(self._groups[i] for i in groups),
                            self.limits.max_curve_points, "max_curve_points", path)
        try:
            arrow = self._pq.read(groups, columns)
        except CalibError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CalibError(f"not a readable parquet file ({first_line(exc)})", path=path) from None
        arrow, meta = migrate(arrow, dict(raw), path)
        try:
            table = _decode(arrow, meta, self.meta, samples, self.limits, path)
            table.validate()
            found = hash_1_0(raw["fingerprint"], table.curves) if version < (1, 1) else hash_1_1(raw, table.curves)
            if found != self.meta.content_hash:
                raise CalibError(f"content hash mismatch (metadata says {self.meta.content_hash[:12]}, contents "
                                 f"give {found[:12]}): the file was altered or corrupted")
            table.check_plausible()  # a validly hashed table can still be forged
            table.check_spread()
            object.__setattr__(table, "_read_hash", (content_hash(table), self.meta.content_hash))
        except CalibError as exc:
            raise exc if exc.path else CalibError(str(exc), path=path) from None
        if samples and self.meta.samples_digest is not None and table.samples_digest != self.meta.samples_digest:
            raise CalibError("raw samples do not match the samples_digest in the hashed metadata: "
                             "the file was altered or corrupted", path=path)
        return table


def _decode(arrow: pa.Table, meta: dict, tm: TableMeta, samples: bool, limits: ReadLimits, path: str) -> CostTable:
    for name, typ in COLUMNS.items():  # an older minor lacked an optional column: nulls
        if name not in arrow.column_names and (samples or name in CURVE_READ_COLUMNS):
            arrow = arrow.append_column(pa.field(name, typ), pa.nulls(arrow.num_rows, type=typ))
    kinds = _arrow.string_codes(arrow, "record", RECORD_KINDS)
    if (kinds < 0).any():
        found = arrow.column("record").slice(int(np.flatnonzero(kinds < 0)[0]), 1).to_pylist()[0]
        raise CalibError(f"unknown record kind {str(found)[:40]!r}")
    is_curve = kinds != RECORD_KINDS.index(RECORD_SAMPLE)
    n_curve = int(is_curve.sum())
    check_limit("curve points", n_curve, limits.max_curve_points, "max_curve_points", path)
    if tm.curve_rows is not None and not samples:  # 1.1 layout: the first curve_rows rows are the curve points
        # (A full read takes curves by record kind; the hash then shows any that curve_rows would miss.)
        if not is_curve[:tm.curve_rows].all():
            raise CalibError("curve rows are not where curve_rows says (damaged layout)")
        arrow, kinds, is_curve = arrow.slice(0, tm.curve_rows), kinds[:tm.curve_rows], is_curve[:tm.curve_rows]
    columns = {c: _arrow.column(arrow, c) for c in (COLUMNS if samples else CURVE_READ_COLUMNS) if c != "record"}
    ctx_all, ctx_valid = columns["context_len"]
    if not ctx_valid.all():
        raise CalibError("rows with missing context_len")
    curves: dict[int, dict[str, Curve]] = {}
    for kind in CURVE_KINDS:
        mask = kinds == RECORD_KINDS.index(kind)
        for c in ("size", "cost_ms", "n"):
            if not columns[c][1][mask].all():
                raise CalibError(f"{kind} curve has missing {c}")
        cols = {}
        for c in CURVE_COLUMNS:  # the spread (min..mad) may be absent: NaN
            vals, valid = columns[c][0][mask], columns[c][1][mask]
            cols[c] = vals if valid.all() else np.where(valid, vals.astype(np.float64), np.nan)
        ctx = ctx_all[mask]
        for x in np.unique(ctx):
            sel = ctx == x
            curves.setdefault(int(x), {})[kind] = Curve.from_columns({k: v[sel] for k, v in cols.items()})
    pairs = {}
    for x, got in curves.items():
        for kind in CURVE_KINDS:
            if kind not in got:
                raise CalibError(f"{kind} curve at context {x} is empty")
        pairs[x] = CurvePair(draft=got[DRAFT], verify=got[VERIFY])
    table_samples = None
    if samples:
        smask = ~is_curve
        cols = {}
        for c in SAMPLE_COLUMNS:
            vals, valid = columns[c]
            if not valid[smask].all():
                raise CalibError(f"sample {c} missing in {int((~valid[smask]).sum())} rows")
            cols[c] = vals[smask]
        table_samples = Samples.from_columns(cols)
    return CostTable(fingerprint=tm.fingerprint, curves=pairs, samples=table_samples,
                     samples_digest=tm.samples_digest or "", created_at=str(meta["created_at"]),
                     tool_version=tm.tool_version, schema_version=tm.schema_version,
                     telemetry=Telemetry.from_json(meta.get("telemetry")),
                     calibration=Calibration.from_json(meta.get("calibration")))


# -- the public API ---------------------------------------------------------------------------
def read_table(source: str | os.PathLike, *, filesystem: Any = None, samples: bool = True,
               limits: ReadLimits | None = None) -> CostTable:
    """Read and fully check a table. Every problem is one CalibError naming the file."""
    with TableFile.open(source, filesystem=filesystem, limits=limits) as tf:
        return tf.read(samples=samples)


def read_metadata(source: str | os.PathLike, *, filesystem: Any = None, limits: ReadLimits | None = None) -> TableMeta:
    """Just the metadata (the footer; no column is read)."""
    with TableFile.open(source, filesystem=filesystem, limits=limits) as tf:
        return tf.meta


def to_arrow(table: CostTable) -> pa.Table:
    """The table as one Arrow table in file order (curve rows, then samples), metadata attached."""
    if table.samples is None:
        raise CalibError("table was read without its raw samples; read it with samples=True to write it")
    if table.schema_version != SCHEMA_VERSION:  # a migrated table is written (and hashed) as today's schema
        table = dataclasses.replace(table, schema_version=SCHEMA_VERSION)
    arrays: dict[str, list[pa.Array]] = {name: [] for name in COLUMNS}

    def add(n: int, values: dict[str, Any]) -> None:
        for name, typ in COLUMNS.items():
            v = values.get(name)
            arrays[name].append(pa.array(v, type=typ) if v is not None else pa.nulls(n, type=typ))

    for ctx, pair in sorted(table.curves.items()):
        for kind in CURVE_KINDS:
            curve = pair.curve(kind)
            n = len(curve)
            add(n, {"record": [kind] * n, "context_len": np.full(n, ctx, dtype=np.int64),
                    **{c: getattr(curve, c) for c in CURVE_COLUMNS}})
    s = table.samples
    add(len(s), {"record": [RECORD_SAMPLE] * len(s), **s.columns()})
    meta = {**meta_1_1(table, SCHEMA_VERSION), "content_hash": content_hash(table)}  # recomputed, never a read one
    return pa.Table.from_arrays([pa.concat_arrays(v) for v in arrays.values()],
                                schema=SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta).encode()}))


def write_table(table: CostTable, path: str | os.PathLike) -> str:
    """Write atomically as the current schema; `path` may be a directory (the default name goes inside).

    Temp file in the destination directory, fsync, rename: readers (and a vLLM starting
    from that directory) never see a half-written table.
    """
    table.validate()
    table.check_plausible()
    parse_created_at(table.created_at)
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, table.default_filename())
    arrow = to_arrow(table)
    curve_rows = json.loads(arrow.schema.metadata[METADATA_KEY])["curve_rows"]

    return atomic_write(path, lambda fh: _write_parquet(arrow, fh, curve_rows))


def _write_parquet(arrow: pa.Table, fh: BinaryIO, curve_rows: int) -> None:
    with pq.ParquetWriter(fh, arrow.schema, compression="zstd", write_page_checksum=True) as writer:
        writer.write_table(arrow.slice(0, curve_rows), row_group_size=curve_rows)  # curves: their own group
        if arrow.num_rows > curve_rows:
            writer.write_table(arrow.slice(curve_rows))

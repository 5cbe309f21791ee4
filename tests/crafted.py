"""Hostile files built with pyarrow: small on disk, huge when decoded (shared by the read-bound tests).

Each keeps a genuine table's (or observe file's) metadata, so it passes every footer check
and reaches the decode; the bytes on disk stay in the tens of kilobytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.helpers import REPO

TABLE_KEY = b"dspark_calib"
OBSERVED_KEY = b"dspark_calib_observed"


def _write(path: Path, arrow: pa.Table, meta_key: bytes, meta: dict, *, row_group: int | None = None,
           repeat: int = 1, struct_first: bool = False, **options) -> Path:
    """`arrow` written `repeat` times (one batch in memory, many rows on disk); no ARROW:schema,
    so a dictionary column reads back as the plain type its parquet column has. struct_first: a
    struct of 32 leaves before the others (a newer minor's column, ignored by the readers), so
    every other column's chunk is 31 places after its place among the columns: at its place
    stands one of the struct's cheap chunks."""
    if struct_first:
        zeros = pa.array(np.zeros(arrow.num_rows, np.int64))
        arrow = arrow.add_column(0, "extra", pa.StructArray.from_arrays([zeros] * 32, names=[f"f{i}" for i in range(32)]))
    with pq.ParquetWriter(path, arrow.schema, compression="zstd", store_schema=False, **options) as w:
        for _ in range(repeat):
            w.write_table(arrow, row_group_size=row_group or arrow.num_rows)
        w.add_key_value_metadata({meta_key.decode(): json.dumps(meta)})
    return path


def _table_columns(rows: int, record: pa.Array) -> dict[str, pa.Array]:
    from dspark_calib.table.file import COLUMNS

    cols = {}
    for name, typ in COLUMNS.items():
        cols[name] = record if name == "record" else pa.array(np.zeros(rows, dtype=typ.to_pandas_dtype()))
    return cols


def table_meta(good: Path, **changes) -> dict:
    return {**json.loads(pq.ParquetFile(good).schema_arrow.metadata[TABLE_KEY]), **changes}


def dictionary_bomb(path: Path, good: Path, *, rows: int = 200_000, value_bytes: int = 64 << 10) -> Path:
    """Curve rows whose `record` is one long string on every row: ~30 KB on disk, rows x
    value_bytes (13 GB by default) read as plain strings."""
    record = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array(["x" * value_bytes]))
    return _write(path, pa.table(_table_columns(rows, record)), TABLE_KEY, table_meta(good, curve_rows=rows))


def zstd_bomb(path: Path, good: Path, *, value_bytes: int = 160 << 20, rows: int = 16,
              struct_first: bool = False) -> Path:
    """One dictionary page that zstd-decompresses to value_bytes of zeros (its header says so)."""
    record = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array(["\0" * value_bytes]))
    return _write(path, pa.table(_table_columns(rows, record)), TABLE_KEY, table_meta(good, curve_rows=rows),
                  dictionary_pagesize_limit=value_bytes + (1 << 20), struct_first=struct_first)


def row_bomb(path: Path, good: Path, *, rows: int = 16_000_000, batch: int = 1_000_000) -> Path:
    """Millions of rows of zeros (curve and sample rows alike): ~100 KB on disk, ~2 GB decoded."""
    record = pa.DictionaryArray.from_arrays(pa.array(np.zeros(batch, np.int32)), pa.array(["sample"]))
    return _write(path, pa.table(_table_columns(batch, record)), TABLE_KEY, table_meta(good, curve_rows=1),
                  row_group=batch, repeat=rows // batch)


def observed_columns(rows: int, **values: int) -> dict[str, pa.Array]:
    """Rows of a plausible decode step (2 requests at context 1000), `values` overriding columns."""
    from dspark_calib.observe.step import ACCEPTANCE, BOOL, COLUMNS, ESTIMATOR, FLOAT, GPU, HOST

    step = {"step": 0, "forward_ms": 10.0, "drafter_ms": 1.0, "num_target_tokens": 16, "num_reqs": 2,
            "full_cudagraph": True, "context_mean": 1000.0, "context_max": 1000, "context_sum": 2000,
            "scheduled_drafts": 14, "draft_budget": 14, "priced_context": 1000, "predicted_draft_ms": 1.0,
            "predicted_verify_ms": 10.0, **values}
    out = {}
    for name, typ in COLUMNS.items():
        if name in ACCEPTANCE + ESTIMATOR + GPU + HOST + ("context_quantiles",):  # 1.2's to 1.7's columns: these
            continue  # files are 1.1, migrated
        dtype = np.float64 if typ == FLOAT else np.bool_ if typ == BOOL else np.int64
        if name in step:
            out[name] = pa.array(np.full(rows, step[name], dtype=dtype))
        else:  # budgets and prefill: null (not recorded)
            out[name] = pa.nulls(rows, pa.int64())
    return out


def observed_file(path: Path, *, rows: int = 100, meta: dict | None = None, repeat: int = 1, **values: int) -> Path:
    meta = {"schema_version": "1.1", "tool_version": "0.1.0", "created_at": "2026-12-01T00:00:00Z",
            "mode": "stock", **(meta or {})}
    return _write(path, pa.table(observed_columns(rows, **values)), OBSERVED_KEY, meta, repeat=repeat)


def observed_lists_file(path: Path, graded: list, accepted: list, *, rows: int = 100) -> Path:
    """A schema 1.2 file whose acceptance columns hold `graded` and `accepted` on every row but
    the last, which holds their last element (so one long list sits among short ones)."""
    cols = observed_columns(rows)
    for name, lists in (("position_graded", graded), ("position_accepted", accepted)):
        cols[name] = pa.array([lists[0]] * (rows - 1) + [lists[-1]], type=pa.list_(pa.int64()))
    meta = {"schema_version": "1.2", "tool_version": "0.1.0", "created_at": "2026-12-01T00:00:00Z", "mode": "stock"}
    return _write(path, pa.table(cols), OBSERVED_KEY, meta)


def observed_list_bomb(path: Path, *, values: int = 20_000_000, rows: int = 16, struct_first: bool = False) -> Path:
    """A schema 1.2 file whose last row's position_accepted holds `values` zeros (160 MB decoded
    by default, a few KB on disk)."""
    cols = observed_columns(rows)
    cols["position_graded"] = pa.array([[0]] * rows, type=pa.list_(pa.int64()))
    cols["position_accepted"] = pa.ListArray.from_arrays(pa.array(np.array([0] * rows + [values], dtype=np.int32)),
                                                         pa.array(np.zeros(values, np.int64)))
    meta = {"schema_version": "1.2", "tool_version": "0.1.0", "created_at": "2026-12-01T00:00:00Z", "mode": "stock"}
    return _write(path, pa.table(cols), OBSERVED_KEY, meta, struct_first=struct_first)


# -- running a command under an address-space cap -------------------------------------------
# Threads and allocator arenas reserve address space per CPU: fixed here, so the cap measures
# what the command allocates, the same on a 2-core VM and a 128-core host.
CAPPED_ENV = {"MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_capped(cap_mib: int, code: str, *, timeout: int = 300) -> subprocess.CompletedProcess:
    """`code` (Python) in a fresh interpreter whose address space is capped at cap_mib MiB."""
    prelude = (f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({cap_mib << 20}, {cap_mib << 20}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_CALIB_")}
    env.update(CAPPED_ENV, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def cli_code(*argv: str) -> str:
    """Python that runs `dspark-calib ARGV` and exits with its code."""
    return (f"import sys\nfrom dspark_calib.cli.app import main\nsys.argv = ['dspark-calib', *{[str(a) for a in argv]!r}]\n"
            "main()\n")


def forged_sizes(path: Path, good: Path, **fingerprint) -> Path:
    """`good` with fingerprint values changed and the content hash recomputed over them: a file
    every check before the fingerprint's own passes (the hash is a checksum, not a signature)."""
    from dspark_calib.table.file import SCHEMA_VERSION, _write_parquet, read_table, to_arrow
    from dspark_calib.table.identity import hash_1_1, meta_1_1

    table = read_table(good)
    meta = meta_1_1(table, SCHEMA_VERSION)
    meta["fingerprint"] = {**meta["fingerprint"], **fingerprint}
    meta["content_hash"] = hash_1_1(meta, table.curves)
    arrow = to_arrow(table).replace_schema_metadata({TABLE_KEY: json.dumps(meta).encode()})
    with open(path, "wb") as fh:
        _write_parquet(arrow, fh, meta["curve_rows"])
    return path


def json_elements(path: Path, good: Path, n: int = 240_000) -> Path:
    """`good` with n empty objects in the fingerprint's extra (under 1 MB of footer)."""
    meta = table_meta(good)
    meta["fingerprint"] = {**meta["fingerprint"], "extra": {"x": [{}] * n}}
    return _write(path, pq.read_table(good).replace_schema_metadata(None), TABLE_KEY, meta)

"""read_table on bad input: every problem is a CalibError naming the file, nothing else escapes.

Also the command line on the same inputs: exit 2, one stderr line with the path, no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_calib.errors import CalibError
from dspark_calib.fit import CURVE_KINDS
from dspark_calib.table.file import CURVE_COLUMNS, read_metadata, read_table, to_arrow, write_table
from dspark_calib.table.meta import METADATA_KEY
from tests.helpers import REPO

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- helpers ------------------------------------------------------------------------------
def expect_error(path, match: str | None = None) -> CalibError:
    """read_table(path) raises CalibError whose message names the path (and says `match`)."""
    with pytest.raises(CalibError) as err:
        read_table(path)
    msg = str(err.value)
    assert str(path) in msg, msg
    if match:
        assert match in msg, msg
    return err.value


def read_or_error(path, original) -> str:
    """The only two acceptable outcomes for a damaged file: the same table, or a CalibError naming it."""
    try:
        table = read_table(path)
    except CalibError as exc:
        assert str(path) in str(exc), str(exc)
        return "error"
    # Anything that reads must be the table that was written (damage in bytes nobody uses).
    assert table.fingerprint.replace(extra={}) == original.fingerprint.replace(extra={})
    assert table.content_hash == original.content_hash
    for ctx, pair in original.curves.items():
        for kind in CURVE_KINDS:
            for c in CURVE_COLUMNS:
                got, want = getattr(table.curves[ctx].curve(kind), c), getattr(pair.curve(kind), c)
                np.testing.assert_array_equal(got, want, err_msg=f"{ctx} {kind} {c}")
    assert table.samples_digest == original.samples_digest
    return "ok"


def arrow_and_meta(table) -> tuple[pa.Table, dict]:
    arrow = to_arrow(table)
    return arrow, json.loads(arrow.schema.metadata[METADATA_KEY])


def write_raw(path, arrow: pa.Table, meta=None, *, raw_meta: bytes | None = None) -> Path:
    if raw_meta is None and meta is not None:
        raw_meta = json.dumps(meta).encode()
    arrow = arrow.replace_schema_metadata(None if raw_meta is None else {METADATA_KEY: raw_meta})
    pq.write_table(arrow, path)
    return Path(path)


def set_column(arrow: pa.Table, name: str, values) -> pa.Table:
    i = arrow.schema.get_field_index(name)
    return arrow.set_column(i, name, values)


def where(arrow: pa.Table, record: str, ctx: int | None = None) -> np.ndarray:
    mask = arrow.column("record").to_numpy(zero_copy_only=False) == record
    if ctx is not None:
        mask &= arrow.column("context_len").to_numpy(zero_copy_only=False) == ctx
    return mask


@pytest.fixture(scope="module")
def small(reference_table_8192):
    return reference_table_8192


@pytest.fixture(scope="module")
def good_bytes(small, tmp_path_factory) -> bytes:
    return Path(write_table(small, tmp_path_factory.mktemp("good") / "good.parquet")).read_bytes()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A directory for hypothesis examples (function-scoped tmp_path does not mix with @given)."""
    return tmp_path_factory.mktemp("fuzz")


def scratch_file(scratch: Path, data: bytes, name: str = "t.parquet") -> Path:
    fd, path = tempfile.mkstemp(prefix="case-", suffix="-" + name, dir=scratch)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return Path(path)


# -- not a table at all ----------------------------------------------------------------------
def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.parquet", "no such file")


def test_directory(tmp_path):
    expect_error(tmp_path, "directory")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.parquet"
    path.write_bytes(b"")
    expect_error(path)


@pytest.mark.parametrize("data", [b"PAR1", b"PAR1PAR1", b"PAR1" + b"\0" * 64 + b"PAR1", b"hello\n", b"\xff" * 10_000,
                                  b"PAR1" + (2**31 - 1).to_bytes(4, "little") + b"PAR1"])
def test_not_parquet(tmp_path, data):
    path = tmp_path / "junk.parquet"
    path.write_bytes(data)
    expect_error(path)


@FUZZ
@given(data=st.binary(max_size=4096), framed=st.booleans())
def test_random_bytes(scratch, data, framed):
    # Framed: parquet's magic at both ends and a plausible footer length, to get past the first checks.
    if framed:
        data = b"PAR1" + data + len(data).to_bytes(4, "little") + b"PAR1"
    path = scratch_file(scratch, data)
    expect_error(path)
    with pytest.raises(CalibError, match=str(path)):
        read_metadata(path)


# -- damaged tables --------------------------------------------------------------------------
def test_truncated_everywhere(scratch, good_bytes):
    n = len(good_bytes)
    lengths = sorted({0, 1, 3, 4, 8, n // 2, n - 8, n - 5, n - 4, n - 1} | set(range(0, n, max(1, n // 150))))
    for length in lengths:
        expect_error(scratch_file(scratch, good_bytes[:length]))


@FUZZ
@given(data=st.data())
def test_truncated_random(scratch, good_bytes, data):
    length = data.draw(st.integers(0, len(good_bytes) - 1))
    expect_error(scratch_file(scratch, good_bytes[:length]))


@pytest.mark.slow
def test_bit_flip_sweep(scratch, good_bytes, small):
    """One flipped bit at ~600 positions spread over the whole file, the footer densely."""
    n = len(good_bytes)
    footer_len = int.from_bytes(good_bytes[-8:-4], "little")
    positions = set(range(0, n, 41)) | set(range(max(0, n - footer_len - 8), n, 13)) | set(range(n - 12, n))
    outcomes = {"ok": 0, "error": 0}
    for pos in sorted(positions):
        damaged = bytearray(good_bytes)
        damaged[pos] ^= 1 << (pos % 8)
        outcomes[read_or_error(scratch_file(scratch, bytes(damaged)), small)] += 1
    assert outcomes["error"] > len(positions) // 2  # damage is overwhelmingly detected


def _zigzag_varint(n: int) -> bytes:
    z, out = n << 1, bytearray()
    while True:
        out.append((z & 0x7F) | (0x80 if z > 0x7F else 0))
        z >>= 7
        if not z:
            return bytes(out)


@pytest.mark.slow
def test_row_count_damage_in_footer(scratch, good_bytes, small):
    """Page checksums do not cover the footer's row counts: one flipped bit there once made
    pyarrow read one sample fewer, silently. Flip every bit of every encoded row count."""
    md = pq.ParquetFile(pa.BufferReader(good_bytes)).metadata
    footer_start = len(good_bytes) - int.from_bytes(good_bytes[-8:-4], "little") - 8
    counts = {md.num_rows, *(md.row_group(g).num_rows for g in range(md.num_row_groups))}
    starts = []
    for encoded in map(_zigzag_varint, counts):
        i = good_bytes.find(encoded, footer_start)
        while i != -1:
            starts.append((i, encoded))
            i = good_bytes.find(encoded, i + 1)
    assert len(starts) >= 3  # the file's and each row group's count (curves, samples), at least
    outcomes = []
    for start, encoded in starts:
        for pos in range(start, start + len(encoded)):
            for bit in range(8):
                damaged = bytearray(good_bytes)
                damaged[pos] ^= 1 << bit
                outcomes.append(read_or_error(scratch_file(scratch, bytes(damaged)), small))
    assert "error" in outcomes


@FUZZ
@given(data=st.data())
def test_bit_flips_random(scratch, good_bytes, small, data):
    damaged = bytearray(good_bytes)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(damaged) - 1))
        damaged[pos] ^= 1 << data.draw(st.integers(0, 7))
    read_or_error(scratch_file(scratch, bytes(damaged)), small)


@FUZZ
@given(data=st.data())
def test_overwritten_ranges(scratch, good_bytes, small, data):
    """A run of bytes replaced by random ones, or a chunk duplicated/removed (bad copies, bad disks)."""
    n = len(good_bytes)
    start = data.draw(st.integers(0, n - 1))
    length = data.draw(st.integers(1, 512))
    kind = data.draw(st.sampled_from(["overwrite", "zero", "duplicate", "remove"]))
    b = good_bytes
    if kind == "overwrite":
        chunk = data.draw(st.binary(min_size=length, max_size=length))
        damaged = b[:start] + chunk + b[start + length:]
    elif kind == "zero":
        damaged = b[:start] + bytes(min(length, n - start)) + b[start + length:]
    elif kind == "duplicate":
        damaged = b[:start + length] + b[start:start + length] + b[start + length:]
    else:
        damaged = b[:start] + b[start + length:]
    read_or_error(scratch_file(scratch, damaged), small)


# -- parquet, but not our table ----------------------------------------------------------------
def test_parquet_without_our_metadata(tmp_path):
    path = tmp_path / "plain.parquet"
    pd.DataFrame({"a": [1, 2], "b": [0.5, 1.5]}).to_parquet(path)
    expect_error(path, "without dspark-calib metadata")
    with pytest.raises(CalibError, match=str(path)):
        read_metadata(path)


def test_our_columns_without_our_metadata(tmp_path, small):
    arrow, _ = arrow_and_meta(small)
    expect_error(write_raw(tmp_path / "t.parquet", arrow, None), "without dspark-calib metadata")


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b"\xff\xfe{}", b"[]", b"42", b"null", b'"1.0"',
                                 b'{"schema_version": "1.0"}', b'{"schema_version": "1.0", "content_hash": "x"}'])
def test_malformed_metadata_json(tmp_path, small, raw):
    arrow, _ = arrow_and_meta(small)
    path = write_raw(tmp_path / "t.parquet", arrow, raw_meta=raw)
    expect_error(path)
    with pytest.raises(CalibError, match=str(path)):
        read_metadata(path)


FINGERPRINT_DAMAGE = [
    ("gpu_count", "one"), ("gpu_count", True), ("gpu_count", 1.5), ("gpu_name", 7), ("gpu_name", None),
    ("context_lens", []), ("context_lens", 8192), ("context_lens", ["a"]), ("context_lens", None),
    ("context_lens", [[8192]]), ("context_lens", {"8192": 1}),
    ("cudagraph_capture_sizes", [4, 2, 1]), ("cudagraph_capture_sizes", None), ("cudagraph_capture_sizes", 512),
    ("cudagraph_capture_sizes", ["x"]), ("extra", 5), ("extra", "ab"), ("extra", [1, 2, 3]),
    ("max_num_seqs", "256"), ("num_speculative_tokens", None), ("max_model_len", "long"),
]


@pytest.mark.parametrize("key,value", FINGERPRINT_DAMAGE, ids=[f"{k}={v!r}" for k, v in FINGERPRINT_DAMAGE])
def test_malformed_fingerprint(tmp_path, small, key, value):
    arrow, meta = arrow_and_meta(small)
    meta["fingerprint"][key] = value
    expect_error(write_raw(tmp_path / "t.parquet", arrow, meta))


@pytest.mark.parametrize("change", ["not a dict", "missing key", "content_hash", "no fingerprint", "no hash",
                                    "no version", "version number"])
def test_malformed_metadata_fields(tmp_path, small, change):
    arrow, meta = arrow_and_meta(small)
    if change == "not a dict":
        meta["fingerprint"] = ["gpu_name", "NVIDIA H200"]
    elif change == "missing key":
        del meta["fingerprint"]["gpu_name"]
    elif change == "content_hash":
        meta["content_hash"] = "0" * 64
    elif change == "no fingerprint":
        del meta["fingerprint"]
    elif change == "no hash":
        del meta["content_hash"]
    elif change == "no version":
        del meta["schema_version"]
    elif change == "version number":
        meta["schema_version"] = 2.0  # a JSON number, not a string: still a newer major
    expect_error(write_raw(tmp_path / "t.parquet", arrow, meta))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@FUZZ
@given(data=st.data())
def test_fuzzed_metadata_values(scratch, small, data):
    """Any JSON value in place of any metadata or fingerprint entry: the same table or a CalibError."""
    arrow, meta = arrow_and_meta(small)
    for _ in range(data.draw(st.integers(1, 3))):
        target = data.draw(st.sampled_from(["meta", "fingerprint"]))
        d = meta if target == "meta" or not isinstance(meta.get("fingerprint"), dict) else meta["fingerprint"]
        key = data.draw((st.sampled_from(sorted(d)) | st.text(max_size=6)) if d else st.text(max_size=6))
        d[key] = data.draw(json_values)
    raw = json.dumps(meta).encode()  # NaN/Infinity allowed: JSON as Python writes it
    path = scratch_file(scratch, b"")
    write_raw(path, arrow, raw_meta=raw)
    try:
        table = read_table(path)
    except CalibError as exc:
        assert str(path) in str(exc)
        return
    # Accepted: only if nothing that defines the table changed.
    assert table.content_hash == small.content_hash
    assert table.curves[8192].as_vllm() == small.curves[8192].as_vllm()


# -- columns ------------------------------------------------------------------------------------
@pytest.mark.parametrize("column", ["record", "context_len", "size", "cost_ms", "n"])
def test_missing_required_column(tmp_path, small, column):
    arrow, meta = arrow_and_meta(small)
    expect_error(write_raw(tmp_path / "t.parquet", arrow.drop_columns([column]), meta))


@pytest.mark.parametrize("column", ["forward_ms", "drafter_ms", "num_target_tokens", "num_reqs", "full_cudagraph",
                                    "replay"])
def test_missing_sample_column(tmp_path, small, column):
    arrow, meta = arrow_and_meta(small)
    expect_error(write_raw(tmp_path / "t.parquet", arrow.drop_columns([column]), meta), "sample")


@pytest.mark.parametrize("column,typ", [("cost_ms", pa.string()), ("cost_ms", pa.float32()), ("size", pa.float64()),
                                        ("size", pa.int32()), ("record", pa.large_string()),
                                        ("full_cudagraph", pa.int64()), ("context_len", pa.string()),
                                        ("forward_ms", pa.string())])
def test_wrong_column_type(tmp_path, small, column, typ):
    arrow, meta = arrow_and_meta(small)
    arrow = set_column(arrow, column, pc.cast(arrow.column(column), typ))
    expect_error(write_raw(tmp_path / "t.parquet", arrow, meta), column)


def test_duplicated_column(tmp_path, small):
    arrow, meta = arrow_and_meta(small)
    arrow = arrow.append_column("cost_ms", arrow.column("cost_ms"))
    expect_error(write_raw(tmp_path / "t.parquet", arrow, meta), "cost_ms")


def test_unknown_record_kind(tmp_path, small):
    arrow, meta = arrow_and_meta(small)
    records = arrow.column("record").to_numpy(zero_copy_only=False).copy()
    records[0] = "drfat"
    expect_error(write_raw(tmp_path / "t.parquet", set_column(arrow, "record", pa.array(records)), meta), "drfat")


@pytest.mark.parametrize("record,column,value", [
    ("verify", "cost_ms", np.nan), ("draft", "cost_ms", np.nan), ("verify", "cost_ms", -1.0),
    ("draft", "cost_ms", np.inf), ("verify", "p25_ms", -0.5), ("draft", "max_ms", -np.inf),
    ("sample", "forward_ms", np.nan), ("sample", "drafter_ms", -2.0), ("sample", "forward_ms", np.inf),
])
def test_bad_costs(tmp_path, small, record, column, value):
    arrow, meta = arrow_and_meta(small)
    values = arrow.column(column).to_numpy(zero_copy_only=False).astype(np.float64)
    values[np.flatnonzero(where(arrow, record))[3]] = value
    expect_error(write_raw(tmp_path / "t.parquet", set_column(arrow, column, pa.array(values)), meta))


@pytest.mark.parametrize("record,column,value", [
    ("verify", "size", 0), ("draft", "size", -4), ("verify", "size", 10**6), ("draft", "n", 0),
    ("sample", "num_reqs", 0), ("sample", "num_target_tokens", -1), ("sample", "context_len", 0),
    ("sample", "replay", -1), ("verify", "size", None), ("verify", "cost_ms", None), ("sample", "num_reqs", None),
    ("sample", "full_cudagraph", None), ("draft", "context_len", None), ("sample", "forward_ms", None),
])
def test_bad_values(tmp_path, small, record, column, value):
    arrow, meta = arrow_and_meta(small)
    values = arrow.column(column).to_pylist()
    values[np.flatnonzero(where(arrow, record))[3]] = value
    arrow = set_column(arrow, column, pa.array(values, type=arrow.schema.field(column).type))
    expect_error(write_raw(tmp_path / "t.parquet", arrow, meta))


@pytest.mark.parametrize("drop", ["draft", "verify", "all curves", "everything"])
def test_empty_curves(tmp_path, small, drop):
    arrow, meta = arrow_and_meta(small)
    if drop == "everything":
        keep = np.zeros(arrow.num_rows, dtype=bool)
    elif drop == "all curves":
        keep = where(arrow, "sample")
    else:
        keep = ~where(arrow, drop, 8192)
    err = expect_error(write_raw(tmp_path / "t.parquet", arrow.filter(pa.array(keep)), meta))
    if drop in ("draft", "verify"):
        assert f"{drop} curve at context 8192 is empty" in str(err)
    else:
        assert "no curves" in str(err)


def test_duplicated_curve_rows(tmp_path, small):
    arrow, meta = arrow_and_meta(small)
    first_verify = np.flatnonzero(where(arrow, "verify"))[:5]
    arrow = pa.concat_tables([arrow, arrow.take(pa.array(first_verify))])
    expect_error(write_raw(tmp_path / "t.parquet", arrow, meta), "strictly increasing")


def test_curves_for_a_context_the_fingerprint_lacks(tmp_path, small):
    arrow, meta = arrow_and_meta(small)
    ctx = arrow.column("context_len").to_numpy(zero_copy_only=False).copy()
    ctx[where(arrow, "draft") | where(arrow, "verify")] = 4096
    expect_error(write_raw(tmp_path / "t.parquet", set_column(arrow, "context_len", pa.array(ctx)), meta), "4096")


def test_altered_cost_with_stale_hash(tmp_path, small):
    arrow, meta = arrow_and_meta(small)
    values = arrow.column("cost_ms").to_numpy(zero_copy_only=False).copy()
    values[np.flatnonzero(where(arrow, "verify"))[-1]] *= 0.5  # still valid, but not what was hashed
    expect_error(write_raw(tmp_path / "t.parquet", set_column(arrow, "cost_ms", pa.array(values)), meta),
                 "content hash mismatch")


def test_valid_file_with_odd_path_reads(tmp_path, small):
    """Control for all of the above: the unmodified arrow/meta pair written the same way reads fine."""
    arrow, meta = arrow_and_meta(small)
    path = write_raw(tmp_path / "t é.parquet", arrow, meta)
    assert read_or_error(path, small) == "ok"


# -- the command line ---------------------------------------------------------------------------
def _bad_files(tmp_path: Path, small, good_bytes: bytes) -> dict[str, Path]:
    d = tmp_path / "bad inputs é"
    d.mkdir()
    files = {"missing": d / "missing.parquet", "directory": d / "a directory"}
    files["directory"].mkdir()
    (files.setdefault("random bytes", d / "random.parquet")).write_bytes(os.urandom(3000))
    (files.setdefault("truncated", d / "truncated.parquet")).write_bytes(good_bytes[: len(good_bytes) // 2])
    flipped = bytearray(good_bytes)
    flipped[len(flipped) // 3] ^= 0x10
    (files.setdefault("bit flip", d / "flipped.parquet")).write_bytes(bytes(flipped))
    files["plain parquet"] = d / "plain.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(files["plain parquet"])
    arrow, meta = arrow_and_meta(small)
    files["bad json"] = write_raw(d / "badjson.parquet", arrow, raw_meta=b"{nope")
    bad_fp = json.loads(json.dumps(meta))
    bad_fp["fingerprint"]["context_lens"] = 8192
    files["bad fingerprint"] = write_raw(d / "badfp.parquet", arrow, bad_fp)
    newer = dict(meta, schema_version="2.0")
    files["newer major"] = write_raw(d / "newer.parquet", arrow, newer)
    files["empty curve"] = write_raw(d / "nodraft.parquet", arrow.filter(pa.array(~where(arrow, "draft"))), meta)
    return files


@pytest.mark.slow
def test_cli_inspect_bad_inputs(tmp_path, small, good_bytes):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for what, path in _bad_files(tmp_path, small, good_bytes).items():
        proc = subprocess.run([sys.executable, "-m", "dspark_calib", "inspect", str(path)], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == 2, (what, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, (what, proc.stderr)
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and proc.stderr.endswith("\n"), (what, proc.stderr)
        assert str(path) in lines[0], (what, lines[0])


def test_a_refusal_leaves_no_pyarrow_reader_open(tmp_path, small):
    """pyarrow's reader calls back into the Python file (taking the GIL) from C++: one left to a
    refusal's traceback is destroyed only as the interpreter shuts down, where that ends the
    process (seen as 'terminate called without an active exception', exit -6, after the one line).
    Every refusal closes it: none stays open while the error is still held."""
    import gc

    from dspark_calib.fileformat.parquet import BoundedParquet
    from dspark_calib.observe.file import read_observed

    arrow, meta = arrow_and_meta(small)
    newer = write_raw(tmp_path / "newer.parquet", arrow, dict(meta, schema_version="2.0"))
    bad_json = write_raw(tmp_path / "badjson.parquet", arrow, raw_meta=b"{nope")
    not_observe = write_raw(tmp_path / "observed-x.parquet", arrow, meta)  # a table, not an observe file
    for read in (lambda: read_table(newer), lambda: read_metadata(bad_json), lambda: read_observed([str(not_observe)])):
        with pytest.raises(CalibError) as err:
            read()
        still_open = [o for o in gc.get_objects() if isinstance(o, BoundedParquet) and o.file is not None]
        assert still_open == [], err.value  # while the refusal (and its frames) is still held
        del err

"""The file format as untrusted input: schema 1.1 layout and hash, migrations, limits,
plausible costs, opening only regular files, and the one default-context rule."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from packaging.requirements import Requirement

from dspark_calib.compare import choose_contexts
from dspark_calib.errors import CalibError
from dspark_calib.fit import CURVE_KINDS, Curve, CurvePair
from dspark_calib.inspection import inspect_table
from dspark_calib.table.model import CostTable, merge_tables, nearest
from tests.helpers import DATA_DIR, REPO, SCHEMA10, build_reference_table
from dspark_calib.table.file import COLUMNS, CURVE_COLUMNS, MIGRATIONS, SCHEMA_VERSION, TableFile, columns_in, migration, read_metadata, read_table, to_arrow, write_table
from dspark_calib.table.meta import METADATA_KEY, ReadLimits

RESULTS = REPO / "benchmarks" / "results" / "h200" / "2026-11-30-morning"
BENCH_RESULTS = sorted(RESULTS.glob("h200-tp1-ctx8192-*.parquet"))  # the morning's tables (schema 1.0)
SHIPPED_NEWER = sorted(p for p in (REPO / "profiles" / "h200").glob("*.parquet") if p != SCHEMA10)
SHIPPED_DSPARK = [p for p in SHIPPED_NEWER if "__dspark-" in p.name]  # profiled before the method was recorded
SHIPPED_OTHER_METHODS = [p for p in SHIPPED_NEWER if p not in SHIPPED_DSPARK]


def forge(path, table: CostTable, **meta_changes) -> Path:
    """A file with a valid hash for whatever `table` holds (as an attacker with the format
    would write it): to_arrow computes the hash; nothing checks plausibility on the way."""
    arrow = to_arrow(table)
    meta = json.loads(arrow.schema.metadata[METADATA_KEY])
    meta.update(meta_changes)
    pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), path)
    return Path(path)


def with_cost(table: CostTable, ctx: int, kind: str, index: int, value: float) -> CostTable:
    pair = table.curves[ctx]
    cols = {c: np.array(getattr(pair.curve(kind), c)) for c in CURVE_COLUMNS}
    cols["cost_ms"][index] = value
    new = CurvePair(**{k: Curve.from_columns(cols) if k == kind else pair.curve(k) for k in CURVE_KINDS})
    return dataclasses.replace(table, curves={**table.curves, ctx: new})


@pytest.fixture(scope="module")
def t8192():
    return build_reference_table([DATA_DIR / "qwen3-8b_dspark-block7_ctx8192.json"])


@pytest.fixture
def path8192(tmp_path, t8192):
    return Path(write_table(t8192, tmp_path / "t.parquet"))


# -- dependency floor (CVE-2023-47248) --------------------------------------------------------
def test_pyarrow_floor_excludes_the_vulnerable_release():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == "pyarrow"]
    assert not spec.contains("14.0.0"), f"pyarrow{spec} admits 14.0.0 (CVE-2023-47248: code execution on read)"
    assert not spec.contains("13.0.0") and spec.contains("14.0.1")


# -- schema 1.1: layout ------------------------------------------------------------------------
def test_curves_come_first_in_their_own_row_group(path8192, t8192):
    pf = pq.ParquetFile(path8192)
    meta = json.loads(pf.schema_arrow.metadata[METADATA_KEY])
    n_curve = sum(len(t8192.curves[8192].curve(k)) for k in CURVE_KINDS)
    assert meta["schema_version"] == SCHEMA_VERSION == "1.4" and meta["curve_rows"] == n_curve
    assert pf.metadata.num_row_groups >= 2 and pf.metadata.row_group(0).num_rows == n_curve
    assert set(pf.read_row_group(0, columns=["record"]).column(0).to_pylist()) == {"draft", "verify"}
    assert set(pf.read_row_group(1, columns=["record"]).column(0).to_pylist()) == {"sample"}


def _damage_sample_group(path: Path) -> None:
    """Flip bytes in the middle of the forward_ms column chunk of the first sample row group."""
    md = pq.ParquetFile(path).metadata
    col = md.row_group(1).column(list(COLUMNS).index("forward_ms"))
    start = col.data_page_offset
    data = bytearray(path.read_bytes())
    mid = start + col.total_compressed_size // 2
    data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
    path.write_bytes(bytes(data))


def test_serving_read_never_touches_the_sample_row_groups(path8192, t8192):
    _damage_sample_group(path8192)
    with pytest.raises(CalibError, match=str(path8192)):
        read_table(path8192)  # the damage is real: a full read finds it
    curves_only = read_table(path8192, samples=False)
    assert curves_only.samples is None and curves_only.num_samples() == 0
    assert curves_only.content_hash == t8192.content_hash  # verified: hash covers the digest, not the rows
    for kind in CURVE_KINDS:
        assert curves_only.curves[8192].curve(kind).as_vllm() == t8192.curves[8192].curve(kind).as_vllm()


def test_one_handle_what_was_checked_is_what_is_read(tmp_path, t8192, reference_table):
    path = Path(write_table(t8192, tmp_path / "t.parquet"))
    other = write_table(reference_table, tmp_path / "other.parquet")
    with TableFile.open(path) as tf:
        os.replace(other, path)  # a rename race: the name now points at another table
        table = tf.read(samples=False)
    assert tf.meta.content_hash == table.content_hash == t8192.content_hash


def test_read_table_does_not_import_pandas(path8192):
    code = (f"import sys\nfrom dspark_calib.table.file import read_table\nt = read_table({str(path8192)!r})\n"
            "assert len(t.samples) == 280 and 'pandas' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})


# -- schema 1.1: what the hash covers -------------------------------------------------------------
def test_hash_covers_created_at_spread_and_samples(tmp_path, t8192):
    arrow = to_arrow(t8192)
    meta = json.loads(arrow.schema.metadata[METADATA_KEY])

    def rewrite(name, arrow=arrow, **changes):
        p = tmp_path / name
        pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: json.dumps({**meta, **changes}).encode()}), p)
        return p

    for name, change in [("date", {"created_at": "2026-01-01T00:00:00Z"}), ("tool", {"tool_version": "9.9"}),
                         ("extra", {"fingerprint": {**meta["fingerprint"], "extra": {"x": 1}}})]:
        with pytest.raises(CalibError, match="content hash mismatch"):
            read_table(rewrite(name, **change), samples=False)
    # Spread zeroed (p25 = p75 = median): the curves vLLM uses are unchanged, the table is not.
    i = arrow.schema.get_field_index("p25_ms")
    flat = arrow.set_column(i, "p25_ms", arrow.column("p75_ms"))
    with pytest.raises(CalibError, match="content hash mismatch"):
        read_table(rewrite("spread", arrow=flat), samples=False)
    # Samples x100: caught by the digest whenever samples are read.
    j = arrow.schema.get_field_index("forward_ms")
    scaled = pa.array([None if v is None else v * 100 for v in arrow.column("forward_ms").to_pylist()], pa.float64())
    path = rewrite("samples", arrow=arrow.set_column(j, "forward_ms", scaled))
    with pytest.raises(CalibError, match="samples_digest"):
        read_table(path)


@pytest.mark.parametrize("created_at", ["yesterday", "2026-11-30", "2026-11-30T10:00:00", "2026-11-30T10:00:00+02:00",
                                        "2024-12-31T23:59:59Z", "9999-01-01T00:00:00Z", 1764500000, None])
def test_created_at_must_be_a_plausible_utc_timestamp(tmp_path, t8192, created_at):
    path = forge(tmp_path / "t.parquet", t8192, created_at=created_at)
    with pytest.raises(CalibError, match="created_at") as err:
        read_metadata(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CalibError, match="created_at"):
        write_table(dataclasses.replace(t8192, created_at=str(created_at)), tmp_path / "w.parquet")


def test_metadata_is_typed(path8192, t8192):
    meta = read_metadata(path8192)
    assert meta.created_at.utcoffset().total_seconds() == 0 and meta.content_hash == t8192.content_hash
    assert meta.fingerprint == t8192.fingerprint and meta.samples_digest == t8192.samples_digest


# -- schema 1.0 and migrations ---------------------------------------------------------------------
@pytest.mark.parametrize("path", [SCHEMA10, *BENCH_RESULTS], ids=lambda p: p.name)
def test_shipped_1_0_tables_read_and_verify_under_their_own_rule(path, tmp_path):
    assert read_metadata(path).schema_version == "1.0"
    full, curves = read_table(path), read_table(path, samples=False)
    assert full.content_hash == curves.content_hash == read_metadata(path).content_hash
    if path == SCHEMA10:
        assert full.short_hash in path.name
    again = read_table(write_table(full, tmp_path / "new.parquet"))  # rewritten as 1.1, new hash rule
    assert again.schema_version == SCHEMA_VERSION and again.samples_digest == full.samples_digest
    for ctx in full.curves:
        assert full.curves[ctx].as_vllm() == again.curves[ctx].as_vllm()


# Keys added to the registry after the shipped tables were profiled: absent from them, so not
# compared when they load (named "not recorded in the table" in the load line).
ADDED_AFTER_SHIPPED = ("attention_config_hash", "kernel_config_hash", "offload_config_hash", "kv_connector",
                       "additional_config_hash", "cudnn_version", "flashinfer_version")


@pytest.mark.parametrize("path", SHIPPED_NEWER, ids=lambda p: p.name)
def test_newer_shipped_tables_verify_and_carry_every_key_and_telemetry(path):
    """Tables shipped after schema 1.0 (the tp 2 one): the hash in the name verifies, every
    registry key the engine reports is recorded (none 'not recorded'), telemetry is stored."""
    meta = read_metadata(path)
    assert meta.schema_version != "1.0" and meta.content_hash[:12] in path.name
    t = read_table(path)
    assert t.content_hash == meta.content_hash and t.telemetry is not None and t.telemetry.blocks
    unset = {f.name for f in dataclasses.fields(t.fingerprint) if getattr(t.fingerprint, f.name) is None}
    # none / dummy weights: nothing to record; and the keys the registry gained after they were profiled
    assert unset <= {"quantization", "model_revision", "draft_revision", *ADDED_AFTER_SHIPPED}


def test_1_0_hash_leaves_out_only_optional_keys_not_recorded():
    """The 1.0 rule hashes the keys a 1.0 file holds: keys added later (optional) and unrecorded
    do not count, so adding registry keys never breaks a shipped table; a value set does count."""
    from dspark_calib.fingerprint import KEYS

    full = read_table(SCHEMA10, samples=False)
    stored = read_metadata(SCHEMA10).raw["fingerprint"]
    migrated = ("speculative_method", "gpu_state")
    absent = [k for k in KEYS if k.optional and k.name not in stored and k.name not in migrated]
    assert len(absent) >= 10 and all(getattr(full.fingerprint, k.name) is None for k in absent)
    # a table from before the method was recorded is a DSpark table (the only kind then made),
    # profiled in the startup state (the only one then)
    assert not set(migrated) & set(stored)
    assert (full.fingerprint.speculative_method, full.fingerprint.gpu_state) == ("dspark", "startup")
    assert full.fingerprint.max_model_len == stored["max_model_len"] == 32768  # recorded by 1.0: hashed
    assert full.content_hash == read_metadata(SCHEMA10).content_hash
    changed = dataclasses.replace(full, fingerprint=full.fingerprint.replace(kv_block_size=16))
    assert changed.schema_version == "1.0" and changed.content_hash != full.content_hash
    moved = dataclasses.replace(full, fingerprint=full.fingerprint.replace(tensor_parallel_size=2))
    assert moved.content_hash != full.content_hash  # a 1.0 key still counts


def _stored_as(table, path, change) -> Path:
    """The table written with its metadata changed by `change`, hashed again (a file a writer of
    that metadata would have made)."""
    from dspark_calib.table.identity import hash_1_1

    arrow = to_arrow(table)
    meta = json.loads(arrow.schema.metadata[METADATA_KEY])
    change(meta)
    meta["content_hash"] = hash_1_1({k: v for k, v in meta.items() if k != "content_hash"}, table.curves)
    pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), path,
                   row_group_size=meta["curve_rows"])
    return path


def _stored_with_key(table, tmp_path, version, key, value=None) -> Path:
    """The table as a `version` writer would have written it, its fingerprint without `key`, or
    with `value` for it (a 1.2 writer wrote no calibration key)."""
    def change(meta):
        meta["schema_version"] = version
        if version == "1.2":
            del meta["calibration"]
        meta["fingerprint"].pop(key, None)
        if value:
            meta["fingerprint"][key] = value
    return _stored_as(table, tmp_path / f"{version}-{key}-{value}.parquet", change)


def _read_as(path, key, want):
    """The metadata alone and the whole table read `key` as `want`, and the table verifies against
    its metadata as stored; returns the metadata."""
    meta, table = read_metadata(path), read_table(path)
    assert getattr(meta.fingerprint, key) == getattr(table.fingerprint, key) == want, path.name
    assert table.content_hash == meta.content_hash
    return meta


def test_the_method_of_an_older_table_is_its_formats_migration_not_a_default(reference_table, tmp_path):
    """speculative_method is filled by the 1.2 -> 1.3 migration alone: a 1.2 file without it is a
    DSpark table (the only kind then made), a 1.2 file that recorded one keeps it, and a 1.3 file
    without it (no 1.3 writer makes one) has not recorded it: the load line says so, as for any
    key a table lacks. Fingerprint.from_dict itself fills nothing."""
    from dspark_calib.fingerprint import Fingerprint
    from dspark_calib.selection import decide

    bare = {k: v for k, v in reference_table.fingerprint.to_dict().items() if k != "speculative_method"}
    assert Fingerprint.from_dict(bare).speculative_method is None

    def stored(version, method=None):
        return _stored_with_key(reference_table, tmp_path, version, "speculative_method", method)

    for path, method in ((stored("1.2"), "dspark"), (stored("1.2", "eagle3"), "eagle3"), (stored("1.3"), None)):
        meta = _read_as(path, "speculative_method", method)
        assert "speculative_method" not in meta.raw["fingerprint"] or method == "eagle3"
    engine = {k: v for k, v in reference_table.fingerprint.to_dict().items() if k not in ("extra", "context_lens")}
    (tmp_path / "d").mkdir()
    os.replace(stored("1.3"), tmp_path / "d" / "t.parquet")
    [line] = decide(str(tmp_path / "d"), {**engine, "speculative_method": "dspark"}, probe=False,
                    allow_reference=True).lines
    assert "loaded cost table" in line and "not recorded in the table: speculative_method" in line


def test_the_gpu_state_of_an_older_table_is_its_formats_migration_not_a_default(reference_table, tmp_path):
    """gpu_state is filled by the 1.3 -> 1.4 migration alone: a 1.3 file without it was profiled
    in the startup state (the only one then), a 1.3 file that holds one keeps it, and a 1.4 file
    without it has not recorded it (None, shown as '-')."""
    from dspark_calib.fingerprint import Fingerprint

    bare = {k: v for k, v in reference_table.fingerprint.to_dict().items() if k != "gpu_state"}
    assert Fingerprint.from_dict(bare).gpu_state is None
    for version, state, want in (("1.3", None, "startup"), ("1.3", "serving", "serving"), ("1.4", None, None)):
        meta = _read_as(_stored_with_key(reference_table, tmp_path, version, "gpu_state", state), "gpu_state", want)
        assert "gpu_state" not in meta.raw["fingerprint"] or state == "serving"


@pytest.mark.parametrize("path", [SCHEMA10, *SHIPPED_DSPARK], ids=lambda p: p.name)
def test_shipped_tables_read_as_dspark_with_the_hash_in_their_name(path):
    """Every shipped DSpark table predates the keys: read (metadata alone, or whole) as a DSpark
    table profiled in the startup state, with the content hash its name carries."""
    meta, table = read_metadata(path), read_table(path)
    assert "speculative_method" not in meta.raw["fingerprint"] and "gpu_state" not in meta.raw["fingerprint"]
    assert meta.fingerprint.speculative_method == table.fingerprint.speculative_method == "dspark"
    assert meta.fingerprint.gpu_state == table.fingerprint.gpu_state == "startup"
    assert meta.content_hash[:12] in path.name and table.content_hash == meta.content_hash


@pytest.mark.parametrize("path", SHIPPED_OTHER_METHODS, ids=lambda p: p.name)
def test_shipped_tables_of_other_methods_record_theirs(path):
    """A shipped table of another speculator records its method (schema 1.3) and the drafter its
    name carries; the content hash is in its name."""
    meta, table = read_metadata(path), read_table(path)
    method = meta.raw["fingerprint"]["speculative_method"]
    assert method != "dspark" and meta.fingerprint.speculative_method == table.fingerprint.speculative_method == method
    assert f"__{meta.fingerprint.draft_model}__" in path.name and meta.schema_version >= "1.3"
    assert meta.content_hash[:12] in path.name and table.content_hash == meta.content_hash
    assert meta.fingerprint.gpu_state == table.fingerprint.gpu_state == "startup"  # profiled before the key


def test_non_dspark_tables_ship():
    assert sorted(read_metadata(p).fingerprint.speculative_method for p in SHIPPED_OTHER_METHODS) == [
        "dflash", "draft_model", "eagle3", "mtp"]


def _arrow_at(version: str, n: int = 5) -> pa.Table:
    """A table with every column of `version`, each holding distinct values."""
    values = {"string": lambda: pa.array([f"r{i}" for i in range(n)]), "int64": lambda: pa.array(range(7, 7 + n)),
              "double": lambda: pa.array([0.5 + i for i in range(n)]), "bool": lambda: pa.array([i % 2 == 0 for i in range(n)])}
    return pa.table({c: values[str(COLUMNS[c])]() for c in columns_in(version)})


def assert_every_column_survives(m) -> None:
    before = _arrow_at(m.from_version)
    meta = {"schema_version": m.from_version, "content_hash": "0" * 64, "created_at": "2026-01-01T00:00:00Z",
            "fingerprint": {"gpu_name": "x"}}
    after, new_meta = m.apply(before, dict(meta))
    assert new_meta["schema_version"] == m.to_version
    for key in meta:
        assert key in new_meta, f"migration {m.from_version}->{m.to_version} dropped metadata key {key}"
    for name in before.column_names:
        assert name in after.column_names, f"migration {m.from_version}->{m.to_version} dropped column {name}"
        assert after.column(name).to_pylist() == before.column(name).to_pylist(), name


def test_migrations_chain_to_the_current_schema():
    assert [m.from_version for m in MIGRATIONS][0] == "1.0" and MIGRATIONS[-1].to_version == SCHEMA_VERSION
    assert all(a.to_version == b.from_version for a, b in zip(MIGRATIONS, MIGRATIONS[1:]))


@pytest.mark.parametrize("m", MIGRATIONS, ids=lambda m: f"{m.from_version}->{m.to_version}")
def test_every_column_survives_every_migration_with_its_values(m):
    assert_every_column_survives(m)


def test_the_survival_check_catches_a_migration_that_renames_a_column():
    registered = list(MIGRATIONS)
    try:
        @migration("1.4", "1.5")
        def rename(arrow, meta):
            return arrow.rename_columns(["mad" if c == "mad_ms" else c for c in arrow.column_names]), {**meta, "schema_version": "1.5"}
        assert MIGRATIONS[-1].apply is rename  # the decorator appends
        with pytest.raises(AssertionError, match="dropped column mad_ms"):
            assert_every_column_survives(MIGRATIONS[-1])
    finally:
        MIGRATIONS[:] = registered


# -- limits ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("max_file_bytes", 1000), ("max_metadata_bytes", 100), ("max_rows", 100),
                                         ("max_row_groups", 1), ("max_curve_points", 10)])
def test_each_read_limit_refuses_in_one_line(path8192, field, value):
    limits = dataclasses.replace(ReadLimits(1 << 30, 1 << 30, 1 << 30, 1 << 30, 1 << 30), **{field: value})
    with pytest.raises(CalibError) as err:
        read_table(path8192, samples=False, limits=limits)
    msg = str(err.value)
    assert f"{field}={value}" in msg and str(path8192) in msg and "\n" not in msg
    read_table(path8192, limits=dataclasses.replace(limits, **{field: 1 << 30}))  # and only that limit


def test_deeply_nested_metadata_json_is_one_line(tmp_path, t8192):
    arrow = to_arrow(t8192)
    bomb = b"[" * 100_000 + b"]" * 100_000
    pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: bomb}), tmp_path / "n.parquet")
    with pytest.raises(CalibError, match="metadata JSON elements 100001 exceeds the read limit max_json_elements="):
        read_metadata(tmp_path / "n.parquet")
    pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: b"[" * 40 + b"]" * 40}), tmp_path / "n.parquet")
    with pytest.raises(CalibError, match="metadata JSON nesting depth 40 exceeds the read limit max_json_depth=32"):
        read_metadata(tmp_path / "n.parquet")


# -- plausible costs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,index,value,match", [
    ("verify", 3, 0.0, "not a plausible step"), ("draft", 0, 0.0, "not a plausible step"),
    ("draft", 2, -1.0, "must be finite and >= 0"), ("verify", 5, 1.7e308, "not a plausible step"),
    ("verify", 0, 1e-4, "not a plausible step"), ("verify", -1, 61_000.0, "not a plausible step"),
    ("verify", 20, 1.0, "falls below"), ("draft", 30, 0.5, "falls below")])
def test_implausible_costs_are_refused_naming_the_point(tmp_path, t8192, kind, index, value, match):
    forged = forge(tmp_path / "f.parquet", with_cost(t8192, 8192, kind, index, value))
    for samples in (True, False):
        with pytest.raises(CalibError, match=match) as err:
            read_table(forged, samples=samples)
        msg = str(err.value)
        size = t8192.curves[8192].curve(kind).size[index]
        assert str(forged) in msg and f"{kind} curve at context 8192" in msg and f"size {size}" in msg


def test_the_bound_a_refused_cost_names_excludes_it(tmp_path, t8192):
    """A verify cost of exactly MIN_STEP_MS is refused: the line says the bound is strict."""
    from dspark_calib.table.model import MIN_STEP_MS

    forged = forge(tmp_path / "f.parquet", with_cost(t8192, 8192, "verify", 0, MIN_STEP_MS))
    with pytest.raises(CalibError, match="not a plausible step") as err:
        read_table(forged)
    assert f"(> {MIN_STEP_MS:g} and" in str(err.value) and ">=" not in str(err.value)


def test_small_dips_within_the_spread_are_fine(tmp_path, t8192):
    verify = t8192.curves[8192].verify
    dipped = with_cost(t8192, 8192, "verify", 20, verify.cost_ms[19] * 0.999)  # a 0.1 % dip
    assert read_table(write_table(dipped, tmp_path / "d.parquet")).content_hash == dipped.content_hash


def test_tiny_draft_costs_are_fine(tmp_path, t8192):
    tiny = with_cost(t8192, 8192, "draft", 0, 1e-6)
    read_table(write_table(tiny, tmp_path / "tiny.parquet"))


# -- opening -----------------------------------------------------------------------------------------------
def test_fifo_refused_without_blocking(tmp_path):
    fifo = tmp_path / "x.parquet"
    os.mkfifo(fifo)
    code = f"from dspark_calib.table.file import read_table\nread_table({str(fifo)!r})\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "is a FIFO, not a regular file" in r.stderr and str(fifo) in r.stderr


def test_device_refused():
    with pytest.raises(CalibError, match="is a device, not a regular file"):
        read_table("/dev/zero")


def test_symlink_loop_said_as_such(tmp_path):
    (tmp_path / "a.parquet").symlink_to(tmp_path / "b.parquet")
    (tmp_path / "b.parquet").symlink_to(tmp_path / "a.parquet")
    with pytest.raises(CalibError, match="symlink loop"):
        read_table(tmp_path / "a.parquet")


def test_permission_denied_said_as_such(tmp_path, path8192, monkeypatch):
    if os.geteuid() != 0:
        path8192.chmod(0)
    else:  # root reads anything: make the open fail as it would for any other user
        def denied(*a, **kw):
            raise PermissionError(errno.EACCES, "Permission denied", str(path8192))
        monkeypatch.setattr(os, "open", denied)
    with pytest.raises(CalibError, match="permission denied") as err:
        read_table(path8192)
    assert str(path8192) in str(err.value)


def test_non_utf8_file_name_reads_fine(tmp_path, path8192, t8192):
    odd = os.path.join(os.fsencode(tmp_path), b"caf\xe9.parquet")
    shutil.copyfile(path8192, odd)
    assert read_table(os.fsdecode(odd)).content_hash == t8192.content_hash
    missing = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"\xff\x1b[2J.parquet"))
    with pytest.raises(CalibError) as err:
        read_table(missing)
    msg = str(err.value)
    assert "no such file" in msg and "\\xff" in msg and "\x1b" not in msg
    msg.encode("utf-8")  # printable on any terminal


# -- merge: the same run twice -----------------------------------------------------------------------------
def test_merge_refuses_the_same_run_twice(t8192):
    with pytest.raises(CalibError, match="same run"):
        merge_tables([t8192, t8192])
    renamed = dataclasses.replace(t8192, created_at="2026-01-01T00:00:00Z")  # other hash, same samples
    assert renamed.content_hash != t8192.content_hash
    with pytest.raises(CalibError, match="same run"):
        merge_tables([t8192, renamed])


# -- output errors name the user's path ---------------------------------------------------------------------
def test_write_error_names_the_users_path_not_the_temp_file(tmp_path, t8192):
    target = tmp_path / "no-write" / "t.parquet"
    target.parent.mkdir()
    target.parent.chmod(0o500)
    dest = "/proc/t.parquet" if os.geteuid() == 0 else str(target)
    with pytest.raises(OSError) as err:
        write_table(t8192, dest)
    assert err.value.filename == dest and ".dspark-calib-" not in str(err.value)


# -- the default-context rule --------------------------------------------------------------------------------
def test_nearest_tie_goes_to_the_longer_context():
    assert nearest([4096, 12288], 8192) == 12288
    assert nearest([12288, 4096], 8192) == 12288
    assert nearest([1024, 3072], 2048) == 3072


def test_default_context_when_8192_was_not_profiled():
    t = build_reference_table([DATA_DIR / "qwen3-8b_dspark-block7_ctx1024.json",
                               DATA_DIR / "qwen3-8b_dspark-block7_ctx16384.json"])
    assert t.default_context() == 1024 == t.nearest_context(None)  # |1024-8192| < |16384-8192|
    assert choose_contexts(t, t) == (1024, 1024)
    assert inspect_table(t).decision.context_len == 1024
    pair = t.curves[1024]
    tie = dataclasses.replace(t, curves={4096: pair, 12288: pair},
                              fingerprint=t.fingerprint.replace(context_lens=(4096, 12288)))
    assert tie.default_context() == 12288 and choose_contexts(tie, tie) == (12288, 12288)


def test_default_context_is_8192_when_profiled(reference_table):
    assert reference_table.default_context() == 8192


def test_to_arrow_of_a_migrated_table_is_a_valid_current_file(tmp_path):
    old = read_table(SCHEMA10)
    back = read_table(forge(tmp_path / "f.parquet", old))
    assert back.schema_version == SCHEMA_VERSION and back.curves[8192].as_vllm() == old.curves[8192].as_vllm()


# -- review finding 5: a newer minor's table keeps its stored, verified hash -------------------
def test_newer_minor_table_reports_its_stored_hash(tmp_path, reference_table):
    from dspark_calib.table.meta import METADATA_KEY
    from dspark_calib.table.file import read_metadata
    from dspark_calib.table.identity import hash_1_1

    p = write_table(reference_table, tmp_path / "h11.parquet")
    arrow = pq.read_table(p)
    meta = json.loads(arrow.schema.metadata[METADATA_KEY])
    meta["schema_version"] = "1.2"
    meta["fingerprint"]["new_key_from_1_2"] = "x"  # this reader moves it under extra
    meta["content_hash"] = hash_1_1(meta, read_table(p).curves)
    newer = tmp_path / "h12.parquet"
    pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), newer,
                   row_group_size=meta["curve_rows"], write_page_checksum=True)
    stored = read_metadata(newer).content_hash
    t = read_table(newer)
    assert t.content_hash == stored
    from typer.testing import CliRunner
    from dspark_calib.cli.app import app
    r = CliRunner().invoke(app, ["inspect", str(newer), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["content_hash"] == stored
    # a table changed after the read computes its own hash again; one built in memory too
    changed = dataclasses.replace(t, created_at="2026-01-01T00:00:00Z")
    assert changed.content_hash != stored
    assert reference_table.content_hash == read_table(p).content_hash


# -- review finding 3: a curve row group that runs on into sample rows is refused ---------------
def test_serving_read_refuses_a_curve_row_group_full_of_sample_rows(tmp_path, reference_table):
    from dspark_calib.table.file import TableFile, to_arrow
    from dspark_calib.table.meta import SERVE_LIMITS

    arrow = to_arrow(reference_table)
    path = tmp_path / "one-group.parquet"
    pq.write_table(arrow, str(path), row_group_size=arrow.num_rows)  # curve rows and every sample row: one group
    curve_rows = json.loads(arrow.schema.metadata[b"dspark_calib"])["curve_rows"]
    assert curve_rows < arrow.num_rows
    limits = dataclasses.replace(SERVE_LIMITS, max_curve_points=curve_rows)
    with TableFile.open(path, limits=limits) as tf:
        with pytest.raises(CalibError, match="rows in the curve row groups .* max_curve_points"):
            tf.read(samples=False)
    with TableFile.open(write_table(reference_table, tmp_path / "good.parquet"), limits=limits) as tf:
        tf.read(samples=False)  # the writer's layout: the curve group holds exactly curve_rows


def test_an_unknown_column_in_a_known_schema_version_is_refused_not_dropped(tmp_path, t8192):
    """A column the current schema does not name, in a file of that very schema, is damage
    (or a writer we do not know): its data would be lost by dropping it, so the read refuses."""
    arrow = to_arrow(t8192)
    meta = arrow.schema.metadata
    arrow = arrow.append_column("bogus", pa.array(np.zeros(arrow.num_rows))).replace_schema_metadata(meta)
    pq.write_table(arrow, tmp_path / "x.parquet")
    with pytest.raises(CalibError, match=rf"unknown column 'bogus' in a schema {SCHEMA_VERSION} file"):
        read_table(tmp_path / "x.parquet")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _patch_footer_counts(path: Path, *, file_rows: int | None = None, group0_rows: int | None = None) -> None:
    """Rewrite row counts in the parquet footer (thrift compact: an i64 field is 0x16 then the
    zigzag varint), as a damaged footer would hold them; page checksums do not cover it."""
    md = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")

    def sub(old: bytes, new: bytes) -> None:
        footer = bytes(data[start:-8])
        assert footer.count(old) == 1 and len(old) == len(new)
        at = start + footer.index(old)
        data[at:at + len(old)] = new

    if file_rows is not None:  # FileMetaData.num_rows
        sub(b"\x16" + _varint(2 * md.num_rows), b"\x16" + _varint(2 * file_rows))
    if group0_rows is not None:  # RowGroup.num_rows, right after its total_byte_size
        rg = md.row_group(0)
        size = b"\x16" + _varint(2 * rg.total_byte_size)
        sub(size + b"\x16" + _varint(2 * rg.num_rows), size + b"\x16" + _varint(2 * group0_rows))
    path.write_bytes(bytes(data))


def test_footer_row_counts_that_disagree_are_refused_at_open(path8192):
    """The curve row group claims one row fewer than the file: refused by open, before any read."""
    rows = pq.ParquetFile(path8192).metadata.row_group(0).num_rows
    _patch_footer_counts(path8192, group0_rows=rows - 1)
    with pytest.raises(CalibError, match="row counts in the parquet footer disagree"):
        TableFile.open(path8192).close()


@pytest.mark.parametrize("samples", [True, False])
def test_footer_row_counts_that_agree_but_not_with_the_data_are_refused_at_read(path8192, samples):
    """File and row group both claim one row fewer, consistently: open passes; the read finds
    the column chunks hold more values than the footer's count (pyarrow alone reads fewer rows)."""
    md = pq.ParquetFile(path8192).metadata
    _patch_footer_counts(path8192, file_rows=md.num_rows - 1, group0_rows=md.row_group(0).num_rows - 1)
    with TableFile.open(path8192) as tf:
        with pytest.raises(CalibError, match="row counts in the parquet footer disagree"):
            tf.read(samples=samples)


def test_a_fifo_swapped_in_after_the_stat_is_refused_by_the_fstat(tmp_path, path8192, monkeypatch):
    """The name is a regular file when stat looks and a FIFO when open runs: what was opened
    is checked again (fstat), so the read never waits on a writer that does not come."""
    import dspark_calib.safe_open as safe_open

    fifo = tmp_path / "swapped.parquet"
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(safe_open.os, "stat",
                        lambda p, *a, **kw: real_stat(path8192) if os.fspath(p) == str(fifo) else real_stat(p, *a, **kw))
    with pytest.raises(CalibError, match="is a FIFO, not a regular file"):
        safe_open.open_local(str(fifo), str(fifo))


def _launder(src: Path, dest: Path, factor: float) -> Path:
    """A 1.0 file whose raw samples are scaled, its metadata (and so its 1.0 hash) untouched:
    1.0 hashed the fingerprint and the (size, cost) pairs only."""
    arrow = pq.read_table(src)
    sample = pc.equal(arrow["record"], "sample")
    forward = pc.if_else(sample, pc.multiply(arrow["forward_ms"], factor), arrow["forward_ms"])
    arrow = arrow.set_column(arrow.schema.get_field_index("forward_ms"), "forward_ms", forward)
    pq.write_table(arrow, dest)
    return dest


def test_merge_refuses_schema_1_0_whose_samples_its_hash_does_not_cover(tmp_path):
    """Merging refits from raw samples; a 1.0 file's hash leaves them out, so forged samples
    in a file that still verifies would come out as the merged table's curves."""
    a, b = BENCH_RESULTS[:2]
    forged = read_table(_launder(a, tmp_path / "a.parquet", 100.0))
    genuine = read_table(a)
    assert forged.content_hash == genuine.content_hash and forged.schema_version == "1.0"
    with pytest.raises(CalibError, match="schema 1.0") as err:
        merge_tables([forged, read_table(b)], names=["a.parquet", "b.parquet"])
    assert "a.parquet" in str(err.value) and "content hash" in str(err.value)

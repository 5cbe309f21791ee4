"""The parquet table format: round trip, identity, versions, merging, atomic writes."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dspark_calib import __version__
from dspark_calib.errors import CalibError
from dspark_calib.fingerprint import MERGE_KEYS, Fingerprint
from dspark_calib.fit import CURVE_KINDS, Curve, CurvePair
from dspark_calib.table import file as tablefile
from dspark_calib.table.model import CostTable, merge_tables
from tests.helpers import DATA_DIR, REPO, build_reference_table, draft_model_table
from dspark_calib.table.file import COLUMNS, CURVE_COLUMNS, SCHEMA_VERSION, read_metadata, read_table, to_arrow, write_table
from dspark_calib.table.meta import METADATA_KEY

TESTS_DIR = Path(__file__).resolve().parent


# -- helpers ------------------------------------------------------------------------------
def arrow_and_meta(table: CostTable) -> tuple[pa.Table, dict]:
    arrow = to_arrow(table)
    return arrow, json.loads(arrow.schema.metadata[METADATA_KEY])


def write_raw(path, arrow: pa.Table, meta: dict | None) -> Path:
    """A parquet file exactly as given: how another (older, newer, broken) writer would leave it."""
    arrow = arrow.replace_schema_metadata(None if meta is None else {METADATA_KEY: json.dumps(meta).encode()})
    pq.write_table(arrow, path)
    return Path(path)


def hash_as_written(meta: dict, table: CostTable) -> str:
    """content_hash as schema 1.1 defines it: sha256 of the canonical JSON of every metadata key
    but content_hash, then per context, kind and curve column a header and the little-endian bytes."""
    body = {k: v for k, v in meta.items() if k != "content_hash"}
    h = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for ctx, pair in sorted(table.curves.items()):
        for kind in CURVE_KINDS:
            for c in CURVE_COLUMNS:
                arr = getattr(pair.curve(kind), c)
                h.update(f"/{ctx}/{kind}/{c}/{len(arr)}/".encode())
                h.update(arr.astype(arr.dtype.newbyteorder("<")).tobytes())
    return h.hexdigest()


def with_curve(table: CostTable, ctx: int, kind: str, **columns) -> CostTable:
    """The same table with some columns of one curve replaced."""
    pair = table.curves[ctx]
    curve = pair.curve(kind)
    cols = {c: np.array(getattr(curve, c)) for c in CURVE_COLUMNS}
    cols.update(columns)
    new_pair = CurvePair(**{k: (Curve.from_columns(cols) if k == kind else pair.curve(k)) for k in CURVE_KINDS})
    return dataclasses.replace(table, curves={**table.curves, ctx: new_pair})


def assert_same_content(a: CostTable, b: CostTable) -> None:
    assert a.fingerprint == b.fingerprint
    assert a.content_hash == b.content_hash
    assert sorted(a.curves) == sorted(b.curves)
    for ctx in a.curves:
        for kind in CURVE_KINDS:
            ca, cb = a.curves[ctx].curve(kind), b.curves[ctx].curve(kind)
            for c in CURVE_COLUMNS:
                np.testing.assert_array_equal(getattr(ca, c), getattr(cb, c), err_msg=f"{ctx} {kind} {c}")
    assert a.samples_digest == b.samples_digest
    pd.testing.assert_frame_equal(a.samples.to_frame(), b.samples.to_frame())


# -- round trip -----------------------------------------------------------------------------
def test_plain_pandas_and_pyarrow_read_the_file(table_file, reference_table):
    n_points = sum(len(p.curve(k)) for p in reference_table.curves.values() for k in CURVE_KINDS)
    frame = pd.read_parquet(table_file)
    assert list(frame.columns) == list(COLUMNS)
    assert len(frame) == n_points + len(reference_table.samples)
    assert frame.record.value_counts().to_dict() == {
        "sample": 840, "verify": 3 * 56, "draft": 3 * 35}
    draft8192 = frame[(frame.record == "draft") & (frame.context_len == 8192)]
    assert draft8192["cost_ms"].tolist() == reference_table.curves[8192].draft.cost_ms.tolist()

    arrow = pq.read_table(table_file)
    assert arrow.schema.remove_metadata() == pa.schema(list(COLUMNS.items()))
    meta = json.loads(arrow.schema.metadata[METADATA_KEY])
    assert set(meta) >= {"schema_version", "tool_version", "created_at", "content_hash", "fingerprint"}
    assert meta["schema_version"] == SCHEMA_VERSION == "1.4"
    assert meta["tool_version"] == __version__
    created = dt.datetime.fromisoformat(meta["created_at"].replace("Z", "+00:00"))
    assert meta["created_at"].endswith("Z") and created.utcoffset() == dt.timedelta(0)
    assert meta["content_hash"] == reference_table.content_hash
    assert len(meta["content_hash"]) == 64 and int(meta["content_hash"], 16) >= 0
    assert set(meta["fingerprint"]) == {f.name for f in dataclasses.fields(Fingerprint)}
    assert meta["fingerprint"]["gpu_name"] == "NVIDIA H200"
    assert meta["fingerprint"]["context_lens"] == [1024, 8192, 16384]
    assert read_metadata(table_file).raw == meta


def test_read_back_is_identical(table_file, reference_table):
    back = read_table(table_file)
    assert_same_content(back, reference_table)
    assert (back.created_at, back.tool_version, back.schema_version) == (
        reference_table.created_at, reference_table.tool_version, reference_table.schema_version)
    for ctx in (1024, 8192, 16384):
        for got, want in zip(back.dense_tables(ctx), reference_table.dense_tables(ctx)):
            assert np.array_equal(got, want)
    assert back.iter_samples(8192) == reference_table.iter_samples(8192)


def test_content_hash_stable_across_write_and_read(tmp_path, reference_table):
    first = read_table(write_table(reference_table, tmp_path / "a.parquet"))
    second = read_table(write_table(first, tmp_path / "b.parquet"))
    assert reference_table.content_hash == first.content_hash == second.content_hash
    # Built again from the same recordings at another time: created_at is part of the identity (1.1).
    again = dataclasses.replace(build_reference_table(), created_at="2026-01-02T03:04:05Z")
    assert again.content_hash != reference_table.content_hash
    assert dataclasses.replace(again, created_at=reference_table.created_at).content_hash == reference_table.content_hash


def test_content_hash_changes_with_any_cost_or_engine_key(reference_table):
    h = reference_table.content_hash
    cost = np.array(reference_table.curves[8192].verify.cost_ms)
    cost[10] = np.nextafter(cost[10], np.inf)  # one ulp
    assert with_curve(reference_table, 8192, "verify", cost_ms=cost).content_hash != h
    dcost = np.array(reference_table.curves[1024].draft.cost_ms)
    dcost[0] += 0.5
    assert with_curve(reference_table, 1024, "draft", cost_ms=dcost).content_hash != h
    size = np.array(reference_table.curves[16384].verify.size)
    size[-1] += 1
    assert with_curve(reference_table, 16384, "verify", size=size).content_hash != h
    for key, value in [("gpu_name", "NVIDIA A100"), ("vllm_version", "0.32.0"), ("max_num_seqs", 128)]:
        changed = dataclasses.replace(reference_table, fingerprint=reference_table.fingerprint.replace(**{key: value}))
        assert changed.content_hash != h, key
    # Since 1.1 everything in the metadata is hashed, the free-form notes included.
    noted = reference_table.fingerprint.replace(extra={"host": "somewhere"})
    assert dataclasses.replace(reference_table, fingerprint=noted).content_hash != h
    # And every curve column, the spread included (vLLM uses only the median; inspect/diff use the rest).
    p25 = np.array(reference_table.curves[8192].verify.p25_ms)
    p25[3] = np.nextafter(p25[3], 0)
    assert with_curve(reference_table, 8192, "verify", p25_ms=p25).content_hash != h


def test_default_filename_contains_the_hash(tmp_path, reference_table):
    name = reference_table.default_filename()
    assert reference_table.short_hash in name and name.endswith(".parquet")
    assert name.startswith("qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__")
    written = write_table(reference_table, tmp_path)  # a directory: default name inside
    assert Path(written) == tmp_path / name
    assert read_table(written).content_hash == reference_table.content_hash
    other = dataclasses.replace(reference_table, fingerprint=reference_table.fingerprint.replace(vllm_version="0.32.0"))
    assert other.default_filename() != name and other.short_hash in other.default_filename()


def test_written_file_permissions_follow_umask(tmp_path, reference_table):
    """Written like any other file (0666 & ~umask), not mkstemp's private 0600:
    a vLLM server running as another user must be able to read the table."""
    old = os.umask(0o022)
    try:
        path = write_table(reference_table, tmp_path / "t.parquet")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o644


# -- schema versions ---------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["2.0", "2.7", "10.0"])
def test_newer_major_schema_refused_naming_both_versions(tmp_path, reference_table_8192, version):
    arrow, meta = arrow_and_meta(reference_table_8192)
    meta["schema_version"] = version
    path = write_raw(tmp_path / "future.parquet", arrow, meta)
    with pytest.raises(CalibError) as err:
        read_table(path)
    msg = str(err.value)
    assert version in msg and SCHEMA_VERSION in msg and str(path) in msg


@pytest.mark.parametrize("version", ["0.9", "1", "one", "1.0.0", ""])
def test_unreadable_or_unmigratable_versions_refused(tmp_path, reference_table_8192, version):
    arrow, meta = arrow_and_meta(reference_table_8192)
    meta["schema_version"] = version
    path = write_raw(tmp_path / "odd.parquet", arrow, meta)
    with pytest.raises(CalibError, match=str(path)):
        read_table(path)


def test_file_lacking_an_optional_column_reads_with_nulls(tmp_path, reference_table_8192):
    """A writer whose minor format had no mad_ms column: read, spread filled with NaN."""
    arrow, meta = arrow_and_meta(reference_table_8192)
    no_mad = reference_table_8192
    for kind in CURVE_KINDS:  # what that writer held, and hashed: no spread column mad_ms
        no_mad = with_curve(no_mad, 8192, kind, mad_ms=np.full(len(no_mad.curves[8192].curve(kind)), np.nan))
    meta["content_hash"] = hash_as_written(meta, no_mad)
    path = write_raw(tmp_path / "old.parquet", arrow.drop_columns(["mad_ms"]), meta)
    back = read_table(path)
    for kind in CURVE_KINDS:
        curve = back.curves[8192].curve(kind)
        assert np.isnan(curve.mad_ms).all()
        want = reference_table_8192.curves[8192].curve(kind)
        assert np.array_equal(curve.cost_ms, want.cost_ms) and np.array_equal(curve.p75_ms, want.p75_ms)
    assert back.content_hash == no_mad.content_hash == meta["content_hash"]
    # And it can be written again in the current format.
    again = read_table(write_table(back, tmp_path / "rewritten.parquet"))
    assert np.isnan(again.curves[8192].draft.mad_ms).all()


def test_newer_minor_with_extra_column_and_fingerprint_key_is_accepted(tmp_path, reference_table_8192):
    """What a 1.x writer may add (optional columns, fingerprint keys) must not stop a 1.0 reader."""
    arrow, meta = arrow_and_meta(reference_table_8192)
    meta["schema_version"] = "1.5"
    meta["fingerprint"]["nvlink_topology"] = "NV18"
    meta["future_note"] = {"anything": [1, 2]}
    meta["content_hash"] = hash_as_written(meta, reference_table_8192)
    arrow = arrow.append_column("power_limit_w", pa.array(np.full(arrow.num_rows, 700.0)))
    path = write_raw(tmp_path / "newer.parquet", arrow, meta)
    back = read_table(path)
    assert back.schema_version == "1.5"
    assert back.fingerprint.extra["nvlink_topology"] == "NV18"  # kept, not dropped
    for kind in CURVE_KINDS:
        assert back.curves[8192].curve(kind).as_vllm() == reference_table_8192.curves[8192].curve(kind).as_vllm()
    # A rewrite by this reader keeps the new key and reads back.
    again = read_table(write_table(back, tmp_path / "rewritten.parquet"))
    assert again.fingerprint.extra["nvlink_topology"] == "NV18"


def test_current_hash_definition_matches_docstring(reference_table):
    _, meta = arrow_and_meta(reference_table)
    assert hash_as_written(meta, reference_table) == reference_table.content_hash == meta["content_hash"]


# -- falls -----------------------------------------------------------------------------------
def test_a_fall_is_refused_only_in_a_profile_without_warm_up(tmp_path):
    """The draft-model H200 run's curve: after warm-up its fall is the GPU's own (vLLM fits it
    too) and the table is written and read; the same samples recorded as a cold profile are
    refused, where a fall is the mark of first-use costs."""
    warm, cold = draft_model_table(5), draft_model_table(0)
    draft = warm.curves[1024].draft
    cost = dict(zip(draft.size.tolist(), draft.cost_ms.tolist()))
    assert cost[200] < 0.45 * cost[8] and cost[240] > 0.85 * cost[8]  # the shape: down to ~64 ms, back to ~139 ms
    warm.check_plausible()
    assert read_table(write_table(warm, tmp_path / "warm.parquet")).content_hash == warm.content_hash
    with pytest.raises(CalibError) as err:
        cold.check_plausible()
    assert str(err.value).startswith("draft curve at context 1024, size 176: cost 135.4 ms falls below the 161.6 ms "
                                     "at size 8 by more than its spread allows")
    assert "in a profile without warm-up" in str(err.value)
    with pytest.raises(CalibError, match="falls below"):
        write_table(cold, tmp_path / "cold.parquet")
    assert not (tmp_path / "cold.parquet").exists()


def test_a_fall_never_reaches_the_price(tmp_path):
    """What a fall is charged: the running maximum before it, as vLLM's own rule installs it."""
    warm = read_table(write_table(draft_model_table(5), tmp_path / "warm.parquet"), samples=False)
    draft, _ = warm.dense_tables(1024)
    curve = warm.curves[1024].draft
    peak = float(np.max(curve.cost_ms[curve.size <= 200]))
    assert draft[200] == peak == float(curve.cost_ms[curve.size == 8][0])


def test_a_merge_records_the_least_warm_up():
    """A cold run pooled with a warm one keeps the fall check: its samples carry first-use costs."""
    warm = build_reference_table([DATA_DIR / "qwen3-8b_dspark-block7_ctx1024.json"])
    warm = dataclasses.replace(warm, fingerprint=warm.fingerprint.replace(warmup_replays=5))
    cold = build_reference_table([DATA_DIR / "qwen3-8b_dspark-block7_ctx16384.json"])
    assert merge_tables([warm, cold]).fingerprint.warmup_replays == 0


# -- merge -----------------------------------------------------------------------------------
def split_runs(table: CostTable, first_replays=(0, 1, 2)) -> tuple[CostTable, CostTable]:
    """Two 'runs' of the same engine: the recorded replays split in two."""
    a = [s for s in table.iter_samples() if s.replay in first_replays]
    b = [dataclasses.replace(s, replay=s.replay - len(first_replays)) for s in table.iter_samples()
         if s.replay not in first_replays]
    fp = table.fingerprint
    return (CostTable.from_samples(a, fp.replace(replays=len(first_replays))),
            CostTable.from_samples(b, fp.replace(replays=fp.replays - len(first_replays))))


def test_merge_pools_samples_and_refits(tmp_path, reference_table_8192):
    run_a, run_b = split_runs(reference_table_8192)
    # Each run alone fits differently from the whole ...
    assert run_a.content_hash != reference_table_8192.content_hash
    # ... pooled (through files, as the CLI does) they give back exactly the full recording.
    run_a = read_table(write_table(run_a, tmp_path / "a.parquet"))
    run_b = read_table(write_table(run_b, tmp_path / "b.parquet"))
    merged = merge_tables([run_a, run_b])
    assert len(merged.samples) == len(run_a.samples) + len(run_b.samples) == 280
    assert merged.fingerprint.replays == 5
    assert merged.fingerprint.extra["merged_from"] == [run_a.short_hash, run_b.short_hash]
    full = reference_table_8192.curves[8192]
    for kind in CURVE_KINDS:
        for c in CURVE_COLUMNS:
            assert np.array_equal(getattr(merged.curves[8192].curve(kind), c), getattr(full.curve(kind), c)), (kind, c)
    assert merged.curves[8192].as_vllm() == full.as_vllm()
    # Replays stay distinct per batch size across the runs.
    s = merged.samples.to_frame()
    assert not s.duplicated(["context_len", "num_target_tokens", "replay"]).any()
    assert read_table(write_table(merged, tmp_path / "m.parquet")).content_hash == merged.content_hash


def test_merge_of_different_context_lengths_covers_both():
    t1024 = build_reference_table([DATA_DIR / "qwen3-8b_dspark-block7_ctx1024.json"])
    t16k = build_reference_table([DATA_DIR / "qwen3-8b_dspark-block7_ctx16384.json"])
    merged = merge_tables([t1024, t16k])
    assert merged.context_lens() == [1024, 16384]
    assert merged.fingerprint.context_lens == (1024, 16384)
    assert merged.curves[1024].as_vllm() == t1024.curves[1024].as_vllm()
    assert merged.curves[16384].as_vllm() == t16k.curves[16384].as_vllm()


def test_a_merge_of_other_contexts_keeps_each_contexts_replays_and_each_runs_notes():
    """1024 from one run and 16384 from another, 5 replays each: every point of the merge has 5
    samples, not 10; a note both runs share stays, one only a run has (its profile time, its
    capture) is listed under that run, never read as the merge's own."""
    def run(path, **notes):
        t = build_reference_table([DATA_DIR / path])
        return dataclasses.replace(t, fingerprint=t.fingerprint.replace(replays=5, extra=notes))

    a = run("qwen3-8b_dspark-block7_ctx1024.json", load_format="dummy", profile_s=261.4, from_capture={"file": "a"},
            vllm_curves_equal=True)
    b = run("qwen3-8b_dspark-block7_ctx16384.json", load_format="dummy", profile_s=350.5, vllm_curves_equal=True)
    merged = merge_tables([a, b])
    assert merged.fingerprint.replays == 5
    extra = merged.fingerprint.extra
    assert extra["load_format"] == "dummy" and "profile_s" not in extra and "from_capture" not in extra
    # each run's curves equalled vLLM's fit of its own samples; the pooled refit was compared with none
    assert "vllm_curves_equal" not in extra
    assert extra["merged_from"] == [a.short_hash, b.short_hash]
    assert extra["merged_inputs"] == {
        a.short_hash: {"profile_s": 261.4, "from_capture": {"file": "a"}, "vllm_curves_equal": True},
        b.short_hash: {"profile_s": 350.5, "vllm_curves_equal": True}}
    # a third run of 1024 pools with the first: 10 there, still 5 at 16384
    c = run("qwen3-8b_dspark-block7_ctx1024.json", load_format="dummy")
    c = CostTable.from_samples([dataclasses.replace(s, forward_ms=s.forward_ms * 1.01) for s in c.iter_samples()],
                               c.fingerprint)
    assert merge_tables([a, b, c]).fingerprint.replays == 5
    assert merge_tables([a, c]).fingerprint.replays == 10


def test_a_merge_keeps_every_inputs_telemetry():
    """The merged curves come from every input's blocks: their readings stay beside them."""
    from dspark_calib.telemetry import BlockTelemetry, Reading, Telemetry

    def run(path, sm):
        t = build_reference_table([DATA_DIR / path])
        ctx = t.context_lens()[0]
        tel = Telemetry(source="nvml", note="", blocks=(BlockTelemetry(ctx, 0, Reading(sm_mhz=sm), Reading(sm_mhz=sm)),))
        return dataclasses.replace(t, telemetry=tel)

    a, b = run("qwen3-8b_dspark-block7_ctx1024.json", 1980.0), run("qwen3-8b_dspark-block7_ctx16384.json", 1890.0)
    merged = merge_tables([a, b])
    assert [(x.context_len, x.start.sm_mhz) for x in merged.telemetry.blocks] == [(1024, 1980.0), (16384, 1890.0)]
    assert merged.telemetry.source == "nvml"
    bare = dataclasses.replace(b, telemetry=None)
    assert len(merge_tables([a, bare]).telemetry.blocks) == 1
    assert merge_tables([dataclasses.replace(a, telemetry=None), bare]).telemetry is None


def test_a_merge_of_more_blocks_than_a_reader_takes_reads_back(monkeypatch, tmp_path):
    """A reader refuses telemetry past MAX_BLOCKS: the merge keeps the first ones and says so,
    so its file reads back."""
    import dspark_calib.table.model as model
    import dspark_calib.telemetry as telemetry
    from dspark_calib.telemetry import BlockTelemetry, Reading, Telemetry

    monkeypatch.setattr(model, "MAX_BLOCKS", 3)
    monkeypatch.setattr(telemetry, "MAX_BLOCKS", 3)

    def run(path):
        t = build_reference_table([DATA_DIR / path])
        blocks = tuple(BlockTelemetry(t.context_lens()[0], i, Reading(sm_mhz=1980.0), Reading(sm_mhz=1980.0))
                       for i in range(2))
        return dataclasses.replace(t, telemetry=Telemetry(source="nvml", note="", blocks=blocks))

    merged = merge_tables([run("qwen3-8b_dspark-block7_ctx1024.json"), run("qwen3-8b_dspark-block7_ctx16384.json")])
    assert len(merged.telemetry.blocks) == 3 and merged.telemetry.note == "4 blocks merged, the first 3 kept"
    write_table(merged, tmp_path / "m.parquet")
    assert read_table(tmp_path / "m.parquet").telemetry.note == merged.telemetry.note


@pytest.mark.parametrize("key,value", [
    ("gpu_name", "NVIDIA A100-SXM4-80GB"),
    ("vllm_version", "0.32.0"),
    ("num_speculative_tokens", 5),
    ("target_config_hash", "sha256:0000000000000000"),
    ("tensor_parallel_size", 2),
])
def test_merge_refused_when_fingerprints_disagree(reference_table_8192, key, value):
    assert key in MERGE_KEYS
    run_a, run_b = split_runs(reference_table_8192)
    run_b = dataclasses.replace(run_b, fingerprint=run_b.fingerprint.replace(**{key: value}))
    with pytest.raises(CalibError) as err:
        merge_tables([run_a, run_b])
    msg = str(err.value)
    assert key in msg and repr(getattr(run_a.fingerprint, key)) in msg and repr(value) in msg


def test_merge_refused_without_raw_samples_or_tables(reference_table_8192):
    bare = dataclasses.replace(reference_table_8192, samples=reference_table_8192.samples.take(slice(0, 0)))
    with pytest.raises(CalibError, match="no raw samples"):
        merge_tables([reference_table_8192, bare])
    with pytest.raises(CalibError, match="nothing to merge"):
        merge_tables([])


# -- atomic writes ---------------------------------------------------------------------------
def test_failed_write_leaves_old_file_and_no_temp(tmp_path, reference_table_8192, reference_table, monkeypatch):
    dest = Path(write_table(reference_table_8192, tmp_path / "t.parquet"))
    real = tablefile._write_parquet

    def half_then_fail(arrow, fh, curve_rows):
        real(arrow.slice(0, 10), fh, 5)
        raise OSError("disk full")

    monkeypatch.setattr(tablefile, "_write_parquet", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_table(reference_table, dest)
    assert os.listdir(tmp_path) == ["t.parquet"]
    assert read_table(dest).content_hash == reference_table_8192.content_hash


CHILD = textwrap.dedent(r"""
    import os, sys, time
    from dspark_calib.table import file as tablefile
    from dspark_calib.table.file import read_table, write_table

    mode, src, dest = sys.argv[1:4]
    table = read_table(src)
    if mode == "partial":  # stop (and get killed) with half the bytes in the temp file
        real = tablefile._write_parquet
        def half(arrow, fh, curve_rows):
            import io
            buf = io.BytesIO()
            real(arrow, buf, curve_rows)
            data = buf.getvalue()
            fh.write(data[: len(data) // 2])
            fh.flush()
            os.fsync(fh.fileno())
            print("mid-write", flush=True)
            time.sleep(120)
        tablefile._write_parquet = half
    elif mode == "renaming":  # complete temp file, killed just before the rename
        def stall(*a, **kw):
            print("mid-write", flush=True)
            time.sleep(120)
        os.replace = stall
    print("ready", flush=True)
    while True:
        write_table(table, dest)
        if mode != "loop":
            break
    print("done", flush=True)
    time.sleep(120)
""")


@pytest.fixture(scope="module")
def big_tables(tmp_path_factory, reference_table_8192):
    """Two large complete tables (old and new) with different content hashes, as files."""
    base = reference_table_8192
    rng = np.random.default_rng(1)
    reps = 300  # ~84k sample rows, a few MB: writing takes a while
    frame = pd.concat([base.samples.to_frame()] * reps, ignore_index=True)
    frame["replay"] = np.repeat(np.arange(reps), len(base.samples)) * 5 + frame["replay"]
    frame["forward_ms"] = frame["forward_ms"] * rng.uniform(0.9, 1.1, len(frame))
    old = dataclasses.replace(base, samples=frame)
    cost = np.array(base.curves[8192].verify.cost_ms) * 1.01
    new = dataclasses.replace(with_curve(base, 8192, "verify", cost_ms=cost), samples=frame)
    d = tmp_path_factory.mktemp("big")
    return {
        "old": (write_table(old, d / "old.parquet"), old.content_hash),
        "new": (write_table(new, d / "new.parquet"), new.content_hash),
        "rows": len(frame),
    }


def start_writer(mode: str, src: str, dest: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, src, str(dest)], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def wait_for(proc: subprocess.Popen, marker: str) -> None:
    while True:
        line = proc.stdout.readline()
        assert line, f"writer exited (rc={proc.poll()}) before printing {marker!r}"
        if line.strip() == marker:
            return


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


def check_destination(dest: Path, big_tables, allowed: set[str]) -> list[str]:
    """dest is one complete table; leftovers are hidden temp files no table scan picks up."""
    back = read_table(dest)
    assert back.content_hash in allowed
    assert len(back.samples) == big_tables["rows"]
    assert len(pd.read_parquet(dest)) > big_tables["rows"]
    leftovers = sorted(set(os.listdir(dest.parent)) - {dest.name})
    for name in leftovers:
        assert name.startswith(".") and not name.endswith(".parquet"), name
    assert sorted(p.name for p in dest.parent.glob("*.parquet")) == [dest.name]
    return leftovers


@pytest.mark.parametrize("mode", ["partial", "renaming"])
def test_writer_killed_mid_write_leaves_old_table(tmp_path, big_tables, mode):
    old_path, old_hash = big_tables["old"]
    new_path, _ = big_tables["new"]
    dest = tmp_path / "table.parquet"
    dest.write_bytes(Path(old_path).read_bytes())
    proc = start_writer(mode, str(new_path), dest)
    try:
        wait_for(proc, "mid-write")
    finally:
        kill(proc)
    leftovers = check_destination(dest, big_tables, {old_hash})
    assert len(leftovers) == 1, "the killed writer should have left its temp file"
    temp = dest.parent / leftovers[0]
    if mode == "partial":
        assert 0 < temp.stat().st_size < dest.stat().st_size
        with pytest.raises(CalibError, match=str(temp)):
            read_table(temp)


@pytest.mark.slow
def test_writer_killed_at_random_times_never_leaves_a_partial_table(tmp_path, big_tables):
    old_path, old_hash = big_tables["old"]
    new_path, new_hash = big_tables["new"]
    rng = random.Random(20261130)
    procs = []
    for i in range(6):  # concurrent writers, each over its own destination
        dest = tmp_path / f"w{i}" / "table.parquet"
        dest.parent.mkdir()
        dest.write_bytes(Path(old_path).read_bytes())
        procs.append((start_writer("loop", str(new_path), dest), dest))
    try:
        for proc, _ in procs:
            wait_for(proc, "ready")
        for proc, dest in procs:
            # Kill somewhere in the first few writes (writing this table takes a fraction of a second).
            time.sleep(rng.uniform(0.0, 0.6))
            kill(proc)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                kill(proc)
    for _, dest in procs:
        check_destination(dest, big_tables, {old_hash, new_hash})

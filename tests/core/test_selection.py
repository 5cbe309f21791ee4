"""The load decision on untrusted table sources (issue 12): every crafted file generated here.

Each attack ends, under each policy, in one line and a clean load of a good table,
a clean fallback or a clean refusal. decide() runs offline (no vLLM needed); the
bounded paths run through decide_within, so a regression that blocks shows up as a
"no decision within" line (a failed assertion), never as a hung test run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest

from dspark_calib.fit import CurvePair
from dspark_calib.table.file import to_arrow, write_table
from dspark_calib.table import sources as C
from dspark_calib import env as E
from dspark_calib import selection as L

POLICIES = ("fallback", "strict", "warn")


@pytest.fixture(scope="module")
def engine(reference_table):
    fp = reference_table.fingerprint
    return {"cudagraph_capture_sizes": list(fp.cudagraph_capture_sizes), "max_num_seqs": fp.max_num_seqs,
            "max_num_batched_tokens": fp.max_num_batched_tokens, "num_speculative_tokens": fp.num_speculative_tokens}


def run(source, engine, policy="fallback", timeout=20.0, **kw):
    kw.setdefault("allow_reference", True)
    return L.decide_within(timeout, policy, str(source), lambda: L.decide(str(source), engine, policy=policy, **kw))


def one_line(d: L.Decision) -> str:
    assert len(d.lines) == 1 and "\n" not in d.lines[0] and "\x1b" not in d.lines[0], d.lines
    assert "no decision within" not in d.lines[0], d.lines[0]
    return d.lines[0]


def assert_policy(d: L.Decision, policy: str, *, loads_good: bool = False):
    """A clean load of a good table, else the policy: fallback/warn profile, strict refuses."""
    line = one_line(d)
    if loads_good:
        assert d.load and not d.refuse and "loaded cost table" in line and d.outcome is L.Outcome.LOAD
    elif policy == "strict":
        assert not d.load and d.refuse == line and d.outcome is L.Outcome.REFUSE
    else:
        assert not d.load and not d.refuse and "profiling at start-up as usual" in line
        assert d.outcome is L.Outcome.PROFILE
    return line


def forged(table, scale=None, values=None):
    """The same table with its curve costs replaced, and a content hash recomputed to match."""
    curves = {}
    for ctx, pair in table.curves.items():
        def change(curve):
            cost = curve.cost_ms * scale if scale is not None else np.full(len(curve), values, dtype=float)
            return replace(curve, cost_ms=cost, min_ms=cost, p25_ms=cost, p75_ms=cost, max_ms=cost)
        curves[ctx] = CurvePair(change(pair.draft), change(pair.verify))
    return replace(table, curves=curves)


def write_unchecked(table, path):
    """Bypasses write_table's validation, as an attacker would."""
    pq.write_table(to_arrow(table), str(path))
    return str(path)


# -- the good path and its record (contract C3) -----------------------------------------
def test_loads_good_table_and_reports_candidates(tmp_path, reference_table, engine):
    good = write_table(reference_table, tmp_path)
    (tmp_path / "junk.parquet").write_bytes(b"not a table")
    d = run(tmp_path, engine)
    line = assert_policy(d, "fallback", loads_good=True)
    assert reference_table.short_hash in line and "1 unreadable" in line
    assert d.chosen.status == "chosen" and d.chosen.content_hash == reference_table.content_hash
    assert {c.status for c in d.candidates} == {"chosen", "unreadable"}
    assert d.content_hash == reference_table.content_hash and d.context_len == 8192 and d.pair is not None
    assert good in line


def test_decide_imports_no_torch_or_vllm(tmp_path, reference_table):
    path = write_table(reference_table, tmp_path)
    code = ("import sys; from dspark_calib.selection import decide; "
            f"d = decide({path!r}, {{}}, allow_reference=True); assert d.load, d.lines; "
            "bad = [m for m in ('torch', 'vllm') if m in sys.modules]; assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert res.returncode == 0, res.stderr[-2000:]


# -- item 2: bounded decision -------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_fifo_is_refused_without_opening(tmp_path, reference_table, engine, policy):
    fifo = tmp_path / "x.parquet"
    os.mkfifo(fifo)
    line = assert_policy(run(fifo, engine, policy), policy)
    assert "not a regular file" in line
    write_table(reference_table, tmp_path)  # a good table beside it still loads
    d = run(tmp_path, engine, policy)
    assert "1 refused" in assert_policy(d, policy, loads_good=True)


def test_fifo_swapped_in_after_listing_is_not_waited_on(tmp_path):
    fifo = tmp_path / "late.parquet"
    os.mkfifo(fifo)
    with pytest.raises(C.CalibError, match="not a regular file"):
        C.open_table(str(fifo), None)


@pytest.fixture
def silent_endpoint():
    """A TCP server that accepts connections and never answers a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield server.getsockname()[1]
    stop.set()
    t.join()
    for s in held:
        s.close()
    server.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_silent_object_store_ends_within_the_deadline(monkeypatch, silent_endpoint, engine, policy):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    src = f"s3://bucket/tables?endpoint_override=127.0.0.1:{silent_endpoint}&scheme=http"
    d = L.decide_within(1.0, policy, src, lambda: L.decide(src, engine, policy=policy,
                                                            limits=C.Limits(io_timeout_s=0.5)))
    line = d.lines[0]
    assert len(d.lines) == 1 and not d.load and (bool(d.refuse) == (policy == "strict"))
    assert "DSPARK_CALIB_TABLE" in line and ("no decision within" in line or "imeout" in line or "rror" in line)


@pytest.mark.parametrize("policy", POLICIES)
def test_deadline_applies_the_policy(policy):
    gate = threading.Event()
    d = L.decide_within(0.05, policy, "s3://slow/tables", lambda: gate.wait(30) or L.Decision(True, ("never",)))
    gate.set()
    line = d.lines[0]
    assert not d.load and "no decision within 0.05 s" in line and E.LOAD_TIMEOUT in line
    assert bool(d.refuse) == (policy == "strict")


def test_decision_thread_stops_reading_after_the_deadline(monkeypatch, tmp_path, engine):
    """Review finding 3: after the deadline vLLM profiles; the decision thread must stop reading."""
    for i in range(10):
        (tmp_path / f"junk{i}.parquet").write_bytes(b"x")
    calls, examine = [], L._examine

    def slow(*a, **k):
        calls.append(1)
        time.sleep(0.1)
        return examine(*a, **k)

    monkeypatch.setattr(L, "_examine", slow)
    cancel = threading.Event()
    src = str(tmp_path)
    d = L.decide_within(0.25, "fallback", src, lambda: L.decide(src, engine, cancel=cancel), cancel)
    assert not d.load and "no decision within" in d.lines[0] and cancel.is_set()
    time.sleep(0.6)  # the thread finishes the file in hand, then stops
    assert len(calls) <= 4, len(calls)


def test_exception_in_decision_is_one_line():
    def boom():
        raise ValueError("first\nsecond\x1b[2J")
    line = one_line(L.decide_within(5, "fallback", "x", boom))
    assert "ValueError: first" in line and "second" not in line


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("limit,expect", [(dict(max_file_bytes=2000), "max_file_bytes=2000"),
                                          (dict(max_rows=100), "max_rows=100"),
                                          (dict(max_metadata_bytes=500), "max_metadata_bytes=500")])
def test_file_limits(tmp_path, reference_table, engine, policy, limit, expect):
    write_table(reference_table, tmp_path)
    d = run(tmp_path, engine, policy, limits=C.Limits(**limit))
    assert expect in assert_policy(d, policy)


def test_row_group_limit(tmp_path, reference_table, engine):
    pq.write_table(to_arrow(reference_table), str(tmp_path / "t.parquet"), row_group_size=10)
    assert "row groups" in one_line(run(tmp_path, engine, limits=C.Limits(max_row_groups=8)))


def test_newer_junk_files_never_hide_the_good_table(tmp_path, reference_table, engine):
    """Review finding 2 (/tmp/flood.py): one-byte junk .parquet files newer than the good table."""
    good = write_table(reference_table, tmp_path / "good.parquet")
    os.utime(good, (1, 1))  # oldest by modification time
    for i in range(20):
        (tmp_path / f"junk{i:02}.parquet").write_bytes(b"x")
    line = one_line(run(tmp_path, engine, limits=C.Limits(max_candidates=3)))
    assert "loaded cost table" in line and "20 unreadable" in line and "not read" not in line


def test_newer_mismatching_tables_never_hide_the_engines_own(tmp_path, reference_table, engine):
    """Review finding 2 (/tmp/fleet.py): other engines' tables written later, more than the cap."""
    tp = reference_table.fingerprint.tensor_parallel_size
    good = write_table(reference_table, tmp_path / "ours.parquet")
    os.utime(good, (1, 1))
    for i in range(5):
        other = replace(reference_table, fingerprint=reference_table.fingerprint.replace(tensor_parallel_size=tp + 1 + i))
        write_table(other, tmp_path / f"other{i}.parquet")
    d = run(tmp_path, {**engine, "tensor_parallel_size": tp}, "strict", limits=C.Limits(max_candidates=3))
    line = one_line(d)
    assert d.load and "ours.parquet" in line and "5 mismatch" in line


def test_curve_reads_are_capped_best_first_and_counted(tmp_path, reference_table, engine):
    for i in range(5):  # metadata fits, the read refuses them: each costs a curve read
        write_unchecked(forged(replace(reference_table, created_at=f"2026-0{i + 1}-01T00:00:00Z"), values=0.0),
                        tmp_path / f"forged{i}.parquet")
    line = one_line(run(tmp_path, engine, limits=C.Limits(max_candidates=3)))
    assert "3 unreadable" in line and "2 not read (over the 3-read limit, best first)" in line


@pytest.mark.parametrize("policy", POLICIES)
def test_nested_json_metadata_never_hides_a_good_table(tmp_path, reference_table, engine, policy):
    import pyarrow as pa

    bomb = pa.table({"a": [1]}).replace_schema_metadata({b"dspark_calib": b"[" * 200_000 + b"]" * 200_000})
    pq.write_table(bomb, str(tmp_path / "bomb.parquet"))
    line = assert_policy(run(tmp_path, engine, policy, limits=C.Limits(max_metadata_bytes=1 << 20)), policy)
    assert "metadata JSON elements 200001 exceeds the read limit max_json_elements=" in line
    write_table(reference_table, tmp_path)
    assert "max_json_elements" in assert_policy(run(tmp_path, engine, policy), policy, loads_good=True)


# -- forged costs -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("values", [0.0, 1e9, float("inf")])
def test_forged_costs_are_refused(tmp_path, reference_table, engine, policy, values):
    write_unchecked(forged(reference_table, values=values), tmp_path / "forged.parquet")
    line = assert_policy(run(tmp_path, engine, policy), policy)
    assert "forged.parquet" in line and ("is not a plausible step" in line or "must be finite" in line)


# -- item 4: the bytes checked are the bytes loaded ---------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_rename_race_checks_what_was_read(monkeypatch, tmp_path, reference_table, engine, policy):
    other_gpu = replace(reference_table, fingerprint=reference_table.fingerprint.replace(max_num_seqs=512))
    target = write_table(reference_table, tmp_path / "t.parquet")
    swap = write_table(other_gpu, tmp_path / "swap.tmp")
    listed = L.list_candidates

    def racing(*a, **k):
        out = listed(*a, **k)
        os.replace(swap, target)  # between listing and reading
        return out

    monkeypatch.setattr(L, "list_candidates", racing)
    d = run(tmp_path, engine, policy)
    line = d.lines[0]
    assert other_gpu.short_hash in line and reference_table.short_hash not in line  # the hash of what was read
    assert "max_num_seqs" in line
    if policy == "warn":
        assert d.load and d.content_hash == other_gpu.content_hash
        assert d.verify_curve == other_gpu.curves[8192].verify.as_vllm()
    else:
        assert_policy(d, policy)


def test_rename_race_to_another_fitting_table_loads_what_was_read(monkeypatch, tmp_path, reference_table, engine):
    second = forged(reference_table, scale=1.01)
    target = write_table(reference_table, tmp_path / "t.parquet")
    swap = write_table(second, tmp_path / "swap.tmp")
    listed = L.list_candidates
    monkeypatch.setattr(L, "list_candidates", lambda *a, **k: (listed(*a, **k), os.replace(swap, target))[0])
    d = run(tmp_path, engine, "strict")
    assert d.load and d.content_hash == second.content_hash and second.short_hash in d.lines[0]
    assert d.verify_curve == second.curves[8192].verify.as_vllm()


# -- item 6: pinning ----------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_only_pinned_tables_load(tmp_path, reference_table, engine, policy):
    other = forged(reference_table, scale=1.01)
    write_table(reference_table, tmp_path)
    write_table(other, tmp_path)
    d = run(tmp_path, engine, policy, pins=frozenset({other.content_hash}))
    assert d.content_hash == other.content_hash and "1 unpinned" in assert_policy(d, policy, loads_good=True)
    d = run(tmp_path, engine, policy, pins=frozenset({"0" * 64}))
    line = assert_policy(d, policy)  # warn never loads an unpinned table
    assert "2 unpinned" in line and "DSPARK_CALIB_TABLE_SHA256" in line


def test_pin_env_parsing():
    h = "ab" * 32
    assert E.pinned_hashes({}) is None
    assert E.pinned_hashes({E.TABLE_SHA256: f" {h.upper()} , sha256:{'cd' * 32},{h},"}) == (h, "cd" * 32)  # in order
    for bad in ("abc", h + "0", "zz" * 32, ",", "\x1b[2J"):
        with pytest.raises(E.CalibError) as err:
            E.pinned_hashes({E.TABLE_SHA256: bad})
        assert E.TABLE_SHA256 in str(err.value) and "\x1b" not in str(err.value)


def test_env_parsing():
    assert E.load_timeout({}) == E.DEFAULT_LOAD_TIMEOUT_S and E.load_timeout({E.LOAD_TIMEOUT: "2.5"}) == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon", "1e9"):
        with pytest.raises(E.CalibError, match=E.LOAD_TIMEOUT):
            E.load_timeout({E.LOAD_TIMEOUT: bad})
    assert E.dp_timeout({}) == E.DEFAULT_DP_TIMEOUT_S and E.dp_timeout({E.DP_TIMEOUT: "1200"}) == 1200
    for bad in ("0", "nan", "soon", "3601"):
        with pytest.raises(E.CalibError, match=E.DP_TIMEOUT):
            E.dp_timeout({E.DP_TIMEOUT: bad})
    assert E.policy({E.POLICY: " STRICT "}) == "strict" and E.policy({}) == "fallback"
    with pytest.raises(E.CalibError, match=E.POLICY):
        E.policy({E.POLICY: "lenient"})
    assert E.context_len({E.CONTEXT_LEN: "4096"}) == 4096 and E.context_len({}) is None
    with pytest.raises(E.CalibError):
        E.context_len({E.CONTEXT_LEN: "-5"})
    assert E.allow_reference({E.ALLOW_REFERENCE: "Yes"}) and not E.allow_reference({})
    assert E.probe_enabled({}) and not E.probe_enabled({E.PROBE: "0"})
    with pytest.raises(E.CalibError, match=E.PROBE):
        E.probe_enabled({E.PROBE: "maybe"})
    assert set(E.ALL) == {getattr(E, n) for n in dir(E) if isinstance(getattr(E, n), str)
                          and getattr(E, n).startswith("DSPARK_CALIB_") and n != "PREFIX"}


# -- item 5: the context vLLM would profile -----------------------------------------------
@pytest.mark.parametrize("mml,loads,ctx,effective", [(32768, True, 8192, 8192), (8000, True, 8192, 7999),
                                                     (4096, False, 1024, 4095), (1100, True, 1024, 1099)])
@pytest.mark.parametrize("policy", POLICIES)
def test_effective_context(tmp_path, reference_table, engine, policy, mml, loads, ctx, effective):
    write_table(reference_table, tmp_path)
    d = run(tmp_path, {**engine, "max_model_len": mml}, policy)
    line = d.lines[0]
    if loads:
        assert d.context_len == ctx and f"context {ctx} for effective context {effective} (engine max_model_len {mml})" in line
        assert_policy(d, policy, loads_good=True)
    elif policy == "warn":
        assert d.load and "despite mismatch context_len" in line and f"{ctx}" in line and f"{effective}" in line
    else:
        assert_policy(d, policy)
        assert f"context {ctx} is" in line and f"effective context {effective} (engine max_model_len {mml})" in line


def test_profile_context_len_is_vllms_clamp():
    assert L.profile_context_len(8192, 4096) == 4095
    assert L.profile_context_len(8192, 32768) == 8192
    assert L.profile_context_len(8192, 1, query_len=4) == 0


def test_future_created_at_does_not_win(tmp_path, reference_table, engine):
    real = write_table(replace(reference_table, created_at="2026-06-01T00:00:00Z"), tmp_path / "real.parquet")
    write_unchecked(replace(forged(reference_table, scale=1.01), created_at="9999-01-01T00:00:00Z"),
                    tmp_path / "future.parquet")  # write_table refuses it; an attacker would not use it
    d = run(tmp_path, engine)
    from dspark_calib.table.file import read_metadata

    assert d.load and real in d.lines[0] and d.content_hash == read_metadata(real).content_hash


def test_fingerprint_that_breaks_comparison_stays_with_its_file(monkeypatch, tmp_path, reference_table, engine):
    write_table(reference_table, tmp_path / "good.parquet")
    write_table(forged(reference_table, scale=1.01), tmp_path / "odd.parquet")
    real, calls = L.load_mismatches, []

    def explode_once(fp, eng):
        calls.append(fp)
        if len(calls) == 1:
            raise TypeError("'>=' not supported between instances of 'str' and 'int'")
        return real(fp, eng)

    monkeypatch.setattr(L, "load_mismatches", explode_once)
    d = run(tmp_path, engine)
    assert d.load and "fingerprint: TypeError" in d.lines[0]


def test_every_candidate_is_reported_with_its_hash_or_why_it_did_not_read(tmp_path, reference_table, engine):
    write_table(reference_table, tmp_path)
    (tmp_path / "junk.parquet").write_bytes(b"x")
    d = L.decide(str(tmp_path), engine, allow_reference=True)
    assert sorted(c.status for c in d.candidates) == ["chosen", "unreadable"]
    good = next(c for c in d.candidates if c.status == "chosen")
    assert good.content_hash == reference_table.content_hash and not good.reason and d.outcome is L.Outcome.LOAD


def test_object_store_filesystems_are_built_with_bounded_waits():
    import pyarrow.fs as pafs

    fs, path = C.filesystem_for("s3://bucket/dir/?region=us-east-1&endpoint_override=127.0.0.1:9&scheme=http",
                                C.Limits(io_timeout_s=1.5))
    assert isinstance(fs, pafs.S3FileSystem) and path == "bucket/dir"
    fs, path = C.filesystem_for("gs://bucket/dir", C.Limits(io_timeout_s=1.5))
    assert isinstance(fs, pafs.GcsFileSystem) and path == "bucket/dir"
    assert C.filesystem_for("file:///tmp/x.parquet") == (None, "/tmp/x.parquet")  # local: stat before open
    with pytest.raises(C.CalibError, match="unsupported S3 URI option"):
        C.filesystem_for("s3://bucket/dir?proxy_options=evil")


# -- bounded memory and lines that say what happened ----------------------------------------
def _with_context(table, ctx: int, like: int):
    """The table with one more profiled context, its curves copied from `like` (a forger's fit)."""
    curves = {**table.curves, ctx: table.curves[like]}
    fp = table.fingerprint.replace(context_lens=tuple(sorted(curves)))
    return replace(table, curves=curves, fingerprint=fp)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_context_above_max_model_len_is_left_out_and_said(tmp_path, reference_table, engine, policy):
    """A table context no step of this engine reaches (2^24, the largest a file may state, with
    max_model_len 32768) is never priced: context-aware mode would place grid points up to it.
    The rest of the table loads. (2^31 is refused on read: tests/core/test_read_bounds.py.)"""
    far = 1 << 24
    write_unchecked(_with_context(reference_table, far, 16384), tmp_path / "far.parquet")
    d = run(tmp_path, {**engine, "max_model_len": 32768}, policy)
    line = assert_policy(d, policy, loads_good=True)
    assert f"table context {far} above the engine's max_model_len 32768 left out (no step reaches it)" in line
    assert sorted(d.curves) == sorted(d.pairs) == [1024, 8192, 16384] and d.context_len == 8192
    d = run(tmp_path, {**engine, "max_model_len": 8000}, policy)  # the chosen context (8192, nearest) stays
    assert d.load and d.context_len == 8192 and sorted(d.curves) == [1024, 8192]
    assert f"table contexts 16384, {far} above the engine's max_model_len 8000 left out" in d.lines[0]


def test_a_decision_keeps_no_listed_file_s_parsed_metadata(tmp_path, reference_table, engine):
    """Twenty copies of a table whose footer holds 40,000 {} in extra: each parsed footer is
    dropped once judged (the decision's peak stays near one copy's), and the good one loads."""
    import tracemalloc

    fat = replace(reference_table, fingerprint=reference_table.fingerprint.replace(extra={"pad": [{}] * 40_000}))
    for i in range(20):
        write_table(replace(fat, created_at=f"2026-06-01T00:00:{i:02}Z"), tmp_path / f"fat{i}.parquet")
    write_table(reference_table, tmp_path / "good.parquet")
    L.decide(str(tmp_path), engine, allow_reference=True)  # imports and caches outside the measurement
    tracemalloc.start()
    try:
        d = L.decide(str(tmp_path), engine, allow_reference=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert d.load and d.content_hash == reference_table.content_hash
    assert peak < 16 << 20, peak >> 20  # 3 MiB; 20 parsed footers kept: 55 MiB


def test_schema_1_0_never_loads_under_a_pin(tmp_path):
    """A 1.0 hash leaves the spreads (the probe's tolerance), created_at and the samples out:
    a pin cannot vouch for them. Without a pin the same file loads."""
    from tests.helpers import SCHEMA10
    from dspark_calib.table.file import read_metadata

    path = tmp_path / SCHEMA10.name
    path.write_bytes(SCHEMA10.read_bytes())
    pin = read_metadata(path).content_hash
    assert run(tmp_path, {}).load
    for policy in POLICIES:
        d = run(tmp_path, {}, policy, pins=(pin,))
        line = assert_policy(d, policy)
        assert f"schema 1.0 under {E.TABLE_SHA256}" in line and "schema 1.1 or newer" in line


def test_under_a_pin_the_pin_order_decides_not_the_dates(tmp_path, reference_table, engine):
    older = write_table(replace(reference_table, created_at="2026-01-01T00:00:00Z"), tmp_path / "older.parquet")
    newer = replace(forged(reference_table, scale=1.01), created_at="2026-06-01T00:00:00Z")
    write_table(newer, tmp_path / "newer.parquet")
    from dspark_calib.table.file import read_metadata

    first = read_metadata(older).content_hash
    assert run(tmp_path, engine).content_hash == newer.content_hash  # no pin: the newest
    for pins in ((first, newer.content_hash), (first,)):
        d = run(tmp_path, engine, pins=pins)
        assert d.load and d.content_hash == first and f"pinned by {E.TABLE_SHA256}" in d.lines[0]
    assert run(tmp_path, engine, pins=(newer.content_hash, first)).content_hash == newer.content_hash


def test_a_table_dated_ahead_of_this_host_is_ordered_last_and_said(tmp_path, reference_table, engine):
    """23 h ahead passes the reader (a day of skew), but does not win 'newest': ordered after
    every table dated up to now, and the line says why. Alone, it still loads."""
    import datetime as dt

    ahead = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=23)).strftime("%Y-%m-%dT%H:%M:%SZ")
    future = replace(forged(reference_table, scale=1.01), created_at=ahead)
    write_table(future, tmp_path / "future.parquet")
    d = run(tmp_path, engine)
    assert d.load and d.content_hash == future.content_hash
    assert "23.0 h ahead of this host's clock" in d.lines[0] or "22.9 h ahead" in d.lines[0]
    write_table(replace(reference_table, created_at="2026-01-01T00:00:00Z"), tmp_path / "today.parquet")
    d = run(tmp_path, engine)
    assert d.load and d.content_hash != future.content_hash and "h ahead of this host's clock" in d.lines[0]
    assert run(tmp_path, engine, pins=(future.content_hash,)).content_hash == future.content_hash  # the pin decides


def test_the_deadline_line_says_what_was_measured():
    """A decision busy on this host's CPU, or waiting while memory grew, is not blamed on the
    source; one mostly waiting with calm memory is. Where it stopped is said either way."""
    busy = L.Progress(phase="reading metadata", listed=100_010, examined=4_512)
    line = L.missed_deadline(5.0, busy, 4.6, 30 * 1024, 0)
    assert "no decision within 5 s" in line and "stopped reading metadata, 4512 of 100010 listed files" in line
    assert "ran 4.6 s on CPU" in line and "busy on this host" in line and "not a slow source" in line
    assert "source's reads" not in line
    line = L.missed_deadline(5.0, busy, 0.4, 3 << 20, 40_000)
    assert "memory grew" in line and "3072 MiB" in line and "not the source" in line
    line = L.missed_deadline(5.0, L.Progress(), 0.1, 1024, 0)
    assert "still listing the source" in line and "mostly waiting" in line and "on the source's reads" in line
    gate = threading.Event()
    d = L.decide_within(0.2, "strict", "s3://b/t", lambda: gate.wait(30) or L.Decision(True, ("late",)),
                        progress=L.Progress())
    gate.set()
    assert d.refuse and "still listing the source" in d.lines[0] and "its thread ran" in d.lines[0]


def test_table_files_over_the_count_are_counted_and_check_says_the_same(tmp_path, reference_table, engine):
    """A fixed count of files examined (newest first), the same on every host: what check says
    is what the engine decides, whatever the engine's speed."""
    from dspark_calib.check import check_tables

    limits = replace(C.SERVE_LIMITS, max_tables=5)
    good = write_table(reference_table, tmp_path / "good.parquet")
    os.utime(good, (1, 1))
    for i in range(6):
        (tmp_path / f"junk{i}.parquet").write_bytes(b"j")
    d = run(tmp_path, engine, limits=limits)
    assert not d.load and "2 more *.parquet files not examined (over the 5-file limit" in d.lines[0]
    d = run(tmp_path, engine)  # the default count examines all 7
    assert d.load
    result = check_tables(str(tmp_path), engine, allow_reference=True, env={})
    assert result.loads and result.lines == d.lines


def test_check_honours_the_pin_and_the_deadline_of_the_environment(tmp_path, reference_table, engine, monkeypatch):
    from dspark_calib.check import check_tables

    write_table(reference_table, tmp_path / "good.parquet")
    assert check_tables(str(tmp_path), engine, allow_reference=True, env={}).loads
    result = check_tables(str(tmp_path), engine, allow_reference=True, env={E.TABLE_SHA256: "ab" * 32})
    assert not result.loads and "1 unpinned" in result.lines[0] and result.tables[0].status == "mismatch"
    with pytest.raises(E.CalibError, match=E.TABLE_SHA256):
        check_tables(str(tmp_path), engine, env={E.TABLE_SHA256: "abc"})
    gate = threading.Event()
    monkeypatch.setattr(L, "list_candidates", lambda *a, **k: gate.wait(30))
    result = check_tables(str(tmp_path), engine, allow_reference=True, env={E.LOAD_TIMEOUT: "0.2"})
    gate.set()
    assert not result.loads and "no decision within 0.2 s" in result.lines[0]


@pytest.mark.parametrize("raw", ["\u0661\u0662", "\u00b2", "1_000", "\uff11\uff12"])
def test_env_numbers_are_ascii_digits(raw):
    for name, parse in ((E.CONTEXT_LEN, E.context_len), (E.LOAD_TIMEOUT, E.load_timeout),
                        (E.OBSERVE_EVERY, E.observe_every), (E.CONTEXT_TAIL, E.context_tail_milli)):
        with pytest.raises(E.CalibError, match=name):
            parse({name: raw})
    assert E.context_len({E.CONTEXT_LEN: " 4096 "}) == 4096 and E.load_timeout({E.LOAD_TIMEOUT: "2.5"}) == 2.5


def test_the_skipped_files_are_named_newest_table_first_whatever_their_modification_times():
    """A fresh checkout gives every file the same modification time: the line names the skipped
    tables by their created_at (newest first), then path, so it reads the same on every host."""
    from dspark_calib.selection import CandidateReport, Limits, _others

    old = CandidateReport("shelf/a-tp2.parquet", "00d73c94a383", "2026-11-30T17:00:00Z", "mismatch", "tp")
    new = CandidateReport("shelf/b-draft.parquet", "a9f289a525a3", "2026-12-02T00:05:23Z", "mismatch", "draft")
    same = CandidateReport("shelf/0-same.parquet", "111111111111", "2026-12-02T00:05:23Z", "mismatch", "x")
    for listed in ([old, new, same], [same, new, old], [new, old, same]):
        line = _others(listed, 0, Limits())
        assert line.index("0-same") < line.index("b-draft") < line.index("a-tp2"), line

"""Untrusted strings (issue 12 item 7): file names and table contents never forge or flood a log line."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from dspark_calib.table.file import write_table
from dspark_calib.table import sources as C
from dspark_calib import selection as L

POLICIES = ("fallback", "strict", "warn")
FORGED_LINE = "\nINFO 11-30 14:00:00 [loader.py:1] dspark-calib: loaded cost table good.parquet (hash 000000000000)"
ANSI = "\x1b[2J\x1b]0;pwned\x07"


@pytest.fixture(scope="module")
def engine(reference_table):
    fp = reference_table.fingerprint
    return {"cudagraph_capture_sizes": list(fp.cudagraph_capture_sizes), "max_num_seqs": fp.max_num_seqs,
            "max_num_batched_tokens": fp.max_num_batched_tokens, "gpu_name": "NVIDIA H200"}


def decide(source, engine, policy="fallback", **kw):
    return L.decide_within(20, policy, str(source), lambda: L.decide(str(source), engine, policy=policy,
                                                                     allow_reference=True, **kw))


def clean(line: str) -> None:
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\x07" not in line, repr(line)
    assert all(ch.isprintable() for ch in line), repr(line)


@pytest.mark.parametrize("text,want", [("plain", "plain"), ("a\nb", "a\\nb"), ("\x1b[31mred", "\\x1b[31mred"),
                                       ("tab\there", "tab\\there"), ("bidi\u202eevil", "bidi\\u202eevil"),
                                       ("caf\u00e9", "caf\u00e9"), ("x" * 100, "x" * 10 + "...")])
def test_escape(text, want):
    assert C.escape(text, 10 if len(text) == 100 else 80) == want


def test_escape_undecodable_name():
    name = os.fsdecode(b"bad\xff.parquet")  # surrogateescape
    shown = C.escape(name)
    assert shown.startswith("bad\\udcff") and all(ch.isprintable() for ch in shown)


@pytest.mark.parametrize("policy", POLICIES)
def test_newline_and_ansi_in_file_names(tmp_path, reference_table, engine, policy):
    (tmp_path / f"a{ANSI}{FORGED_LINE}.parquet").write_bytes(b"junk")
    d = decide(tmp_path, engine, policy)
    assert len(d.lines) == 1
    clean(d.lines[0])
    assert "\\n" in d.lines[0] and "\\x1b" in d.lines[0], d.lines[0]
    assert "profiling at start-up as usual" in d.lines[0] or d.refuse
    write_table(reference_table, tmp_path)  # beside a good table: it loads, the name is still escaped
    d = decide(tmp_path, engine, policy)
    assert d.load
    clean(d.lines[0])


@pytest.mark.parametrize("policy", POLICIES)
def test_ansi_and_newlines_in_table_metadata(tmp_path, reference_table, engine, policy):
    evil = replace(reference_table, fingerprint=reference_table.fingerprint.replace(gpu_name=f"H100{FORGED_LINE}{ANSI}"))
    write_table(evil, tmp_path)
    d = decide(tmp_path, engine, policy)
    line = d.lines[0]
    clean(line)
    assert "gpu_name: table 'H100\\nINFO" in line  # escaped (and truncated by Mismatch.__str__)
    assert bool(d.refuse) == (policy == "strict") and d.load == (policy == "warn")
    # created_at is parsed by the reader (C1): an escape there makes the file unreadable, said cleanly.
    import pyarrow.parquet as pq

    from dspark_calib.table.file import to_arrow

    pq.write_table(to_arrow(replace(reference_table, created_at=f"2026{ANSI}")), str(tmp_path / "when.parquet"))
    d = decide(tmp_path, engine, policy)
    line = d.lines[0]
    clean(line)
    assert "created_at" in line and "\\x1b" in line and "1 unreadable" in line
    for report in d.candidates:
        for text in (report.path, report.reason, report.created_at, report.content_hash):
            clean(text)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_ten_thousand_junk_files_make_one_short_line(tmp_path, reference_table, engine, policy):
    for i in range(10_000):
        (tmp_path / f"junk-{i:05}-{'x' * 60}.parquet").write_bytes(b"j")
    os.mkfifo(tmp_path / "fifo.parquet")
    d = decide(tmp_path, engine, policy)
    line = d.lines[0]
    clean(line)
    assert len(d.lines) == 1 and len(line) < 2000, len(line)
    # the newest max_tables footers are checked, the rest counted: a fixed count, so check and every
    # engine host examine the same files whatever their speed
    assert f"{C.SERVE_LIMITS.max_tables} unreadable" in line and "not read" not in line and "1 refused" in line
    assert f"{10_000 - C.SERVE_LIMITS.max_tables} more *.parquet files not examined" in line
    assert line.count("junk-") <= L.MAX_NAMED
    good = write_table(reference_table, tmp_path / "good.parquet")
    os.utime(good, (1, 1))  # older than every junk file: past the count, and said so
    d = decide(tmp_path, engine, policy)
    assert not d.load and f"{10_001 - C.SERVE_LIMITS.max_tables} more *.parquet files not examined" in d.lines[0]
    os.utime(good)  # the newest: examined first
    d = decide(tmp_path, engine, policy)
    assert d.load and len(d.lines[0]) < 2000

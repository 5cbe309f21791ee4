"""Untrusted files cost bounded memory: crafted tables and observe files, tens of kilobytes on
disk and gigabytes decoded, are refused before the decode, in one line naming the file and the
cause, and `inspect`, `check` and `validate` stay within CAP_MIB of address space on them.

Every command on a crafted file runs in a fresh interpreter under RLIMIT_AS (crafted.run_capped):
without the bounds, these files would take the test runner's memory with them.
"""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from dspark_calib.errors import CalibError
from dspark_calib.table.file import read_metadata
from dspark_calib.table.meta import CLI_LIMITS
from tests import crafted as C
from tests.helpers import SHIPPED

# Address space a command may use: the normal paths need 470-660 MiB here (an interpreter with
# numpy, pyarrow, rich; measured by bisecting the cap with crafted.CAPPED_ENV), and the largest
# input validate accepts (2^18 steps) runs at 700 MiB. Without the bounds each crafted file
# needs gigabytes (the dictionary bomb 13 GB).
CAP_MIB = 1024
MEMORY_WORDS = ("MemoryError", "realloc", "malloc", "out of memory", "Failed to launch", "bad_alloc")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("crafted")
    return {"dictionary": C.dictionary_bomb(d / "dictionary.parquet", SHIPPED),
            "zstd": C.zstd_bomb(d / "zstd.parquet", SHIPPED),
            "zstd after a struct": C.zstd_bomb(d / "zstd-struct.parquet", SHIPPED, struct_first=True),
            "rows": C.row_bomb(d / "rows.parquet", SHIPPED),
            "sizes": C.forged_sizes(d / "sizes.parquet", SHIPPED, max_num_batched_tokens=1 << 31)}


# What each crafted table is refused for, by `inspect` (the CLI limits) and by the load decision
# (`check`, the serving limits).
TABLE_CAUSES = {"dictionary": ("unknown record kind 'xxxx", "unknown record kind 'xxxx"),
                "zstd": ("exceeds the read limit max_decoded_bytes=134217728",
                         "exceeds the read limit max_decoded_bytes=67108864"),
                # a struct's extra leaves put every later column's chunk 31 places on: each
                # column's pages are still the ones counted
                "zstd after a struct": ("exceeds the read limit max_decoded_bytes=134217728",
                                        "exceeds the read limit max_decoded_bytes=67108864"),
                "rows": ("exceeds the read limit max_decoded_bytes=134217728", None),  # serving never reads samples
                "sizes": ("fingerprint max_num_batched_tokens 2147483648 is outside 0..2097152",) * 2}


def one_line_refusal(result, path, cause: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith("dspark-calib: error: ") and str(path) in lines[0], lines[0]
    assert cause in lines[0] and not any(w in lines[0] for w in MEMORY_WORDS), lines[0]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TABLE_CAUSES))
def test_inspect_refuses_each_crafted_table_within_the_bound(files, name):
    result = C.run_capped(CAP_MIB, C.cli_code("inspect", files[name]))
    one_line_refusal(result, files[name], TABLE_CAUSES[name][0])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TABLE_CAUSES))
def test_check_finds_the_good_table_beside_each_crafted_one_within_the_bound(tmp_path, files, name):
    shutil.copy(SHIPPED, tmp_path / SHIPPED.name)
    shutil.copy(files[name], tmp_path / files[name].name)
    result = C.run_capped(CAP_MIB, C.cli_code("check", tmp_path))
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])  # loads if the engine matches
    out = result.stdout.replace("\n", " ")
    assert f"loaded cost table {tmp_path / SHIPPED.name}" in out
    cause = TABLE_CAUSES[name][1]
    if cause:
        assert f"1 unreadable ({tmp_path / files[name].name}" in out and cause in out, out
    assert not any(w in out for w in MEMORY_WORDS), out


def test_the_normal_paths_run_under_the_cap(tmp_path):
    assert C.run_capped(CAP_MIB, C.cli_code("inspect", SHIPPED)).returncode == 0
    observed = C.observed_file(tmp_path / "observed-a.parquet", rows=4096)
    r = C.run_capped(CAP_MIB, C.cli_code("validate", SHIPPED, observed))
    assert r.returncode == 0, r.stderr[-2000:]


EDGES = {  # the largest values validate accepts -> observe file builder
    "262,144 steps": lambda p: C.observed_file(p, rows=1 << 18),
    "engine sizes": lambda p: C.observed_file(p, meta={"max_num_batched_tokens": 1 << 21, "max_num_reqs": 1 << 16}),
    "contexts": lambda p: C.observed_file(p, context_max=1 << 24, context_sum=1 << 25, context_mean=float(1 << 24)),
    # every step read as wide as the widest list (the decode budget allows ~20 a step on all)
    "32 draft positions": lambda p: C.observed_lists_file(p, [[1], [1] * 14 + [0] * 18], [[1], [1] * 13 + [0] * 19],
                                                          rows=1 << 18),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EDGES))
def test_validate_at_the_edges_of_what_it_accepts_runs_under_the_cap(tmp_path, name):
    observed = EDGES[name](tmp_path / "observed-a.parquet")
    r = C.run_capped(CAP_MIB, C.cli_code("validate", SHIPPED, observed))
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_validate_at_its_largest_input_runs_under_the_cap(tmp_path):
    from dspark_calib.observe.file import MAX_OBSERVED_STEPS

    observed = C.observed_file(tmp_path / "observed-a.parquet", rows=MAX_OBSERVED_STEPS)
    r = C.run_capped(CAP_MIB, C.cli_code("validate", SHIPPED, observed))
    assert r.returncode == 0 and f"{MAX_OBSERVED_STEPS}" in r.stdout, r.stderr[-2000:]
    one_more = C.observed_file(tmp_path / "observed-b.parquet", rows=1)
    r = C.run_capped(CAP_MIB, C.cli_code("validate", SHIPPED, observed, one_more))
    one_line_refusal(r, one_more, f"over the {MAX_OBSERVED_STEPS} steps read at once; validate fewer files")


OBSERVED = {  # name -> (builder, cause)
    "30M rows in 2 MB": (lambda p: C.observed_file(p, rows=1_000_000, repeat=30),
                         "rows 30000000 exceeds the read limit max_rows=262144"),
    "max_num_batched_tokens=2^28": (lambda p: C.observed_file(p, meta={"max_num_batched_tokens": 1 << 28}),
                                    "metadata max_num_batched_tokens 268435456 is over 2097152"),
    "max_num_reqs=2^28": (lambda p: C.observed_file(p, meta={"max_num_reqs": 1 << 28}),
                          "metadata max_num_reqs 268435456 is over 65536"),
    "num_target_tokens=2^31": (lambda p: C.observed_file(p, num_target_tokens=1 << 31, scheduled_drafts=0,
                                                         draft_budget=0),
                               "num_target_tokens must be <= 2097152 (100 bad rows)"),
    "context_max=2^40": (lambda p: C.observed_file(p, context_max=1 << 40, context_sum=1 << 41,
                                                   context_mean=float(1 << 40), priced_context=1000),
                         "context_max must be <= 16777216 (100 bad rows)"),
    # 14 KB on disk; every row would be as wide as the longest list: 100 GB
    "a list of 100,000 positions": (lambda p: C.observed_lists_file(p, [[0], [0] * 100_000], [[0], [0] * 100_000],
                                                                    rows=1 << 17),
                                    "column position_graded has a list of 100000 positions, over the 32 read"),
    "a list of 20M values": (lambda p: C.observed_list_bomb(p),
                             "bytes decoded 160003003 exceeds the read limit max_decoded_bytes=134217728"),
    "a list of 20M values after a struct": (lambda p: C.observed_list_bomb(p, struct_first=True),
                                            "bytes decoded 160003003 exceeds the read limit max_decoded_bytes"),
    "lists of two lengths": (lambda p: C.observed_lists_file(p, [[2, 1, 0]], [[1, 0, 0, 0]]),
                             "row 0: position_graded and position_accepted differ in length"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OBSERVED))
def test_validate_refuses_each_crafted_observe_file_within_the_bound(tmp_path, name):
    build, cause = OBSERVED[name]
    observed = build(tmp_path / "observed-x.parquet")
    one_line_refusal(C.run_capped(CAP_MIB, C.cli_code("validate", SHIPPED, observed)), observed, cause)


def test_observe_files_are_opened_as_tables_are(tmp_path):
    """A FIFO named like an observe file is refused, never waited on."""
    import os

    from dspark_calib.observe.file import read_observed

    os.mkfifo(tmp_path / "observed-fifo.parquet")
    with pytest.raises(CalibError, match="is a FIFO, not a regular file"):
        read_observed([tmp_path / "observed-fifo.parquet"])


# -- footer JSON -------------------------------------------------------------------------------
@pytest.mark.parametrize("reader", ["observe", "table"])
def test_a_column_name_given_twice_is_one_line(tmp_path, reader):
    """Columns are read by name: a second column of a name is refused naming the file (an observe
    file gave pyarrow's KeyError as a traceback)."""
    import numpy as np
    import pyarrow as pa

    from dspark_calib.observe.file import read_observed
    from dspark_calib.table.file import read_table

    path = tmp_path / "observed-x.parquet"
    if reader == "observe":
        arrow = pa.table(C.observed_columns(4))
        meta, key = {"schema_version": "1.1", "tool_version": "0.1.0", "created_at": "2026-12-01T00:00:00Z"}, C.OBSERVED_KEY
    else:
        arrow, meta, key = pq.read_table(SHIPPED).replace_schema_metadata(None), C.table_meta(SHIPPED), C.TABLE_KEY
    arrow = arrow.add_column(0, "step" if reader == "observe" else "size", pa.array(np.zeros(arrow.num_rows, np.int64)))
    C._write(path, arrow, key, meta)
    with pytest.raises(CalibError, match="appears more than once"):
        (read_observed if reader == "observe" else read_table)([path] if reader == "observe" else path)


def test_footer_json_element_count_is_capped(tmp_path):
    """240,000 empty objects in a 1 MB footer parsed into ~30 MB of dicts per file listed."""
    path = C.json_elements(tmp_path / "t.parquet", SHIPPED)
    with pytest.raises(CalibError, match=r"t.parquet: metadata JSON elements \d+ exceeds the read limit "
                                         r"max_json_elements=100000"):
        read_metadata(path)
    raw = pq.ParquetFile(SHIPPED).schema_arrow.metadata[C.TABLE_KEY]  # the largest real footer JSON
    assert raw.count(b",") + raw.count(b"{") + raw.count(b"[") < 500
    read_metadata(SHIPPED)


def test_footer_json_element_cap_in_observe_files(tmp_path):
    from dspark_calib.observe.file import read_observed

    path = C.observed_file(tmp_path / "observed-x.parquet", meta={"extra": [{}] * 200_000})
    with pytest.raises(CalibError, match="observed metadata JSON elements \\d+ exceeds the read limit "
                                         "max_json_elements=100000"):
        read_observed([path])


def test_the_load_decision_finds_the_good_table_beside_many_capped_footers(tmp_path):
    from dspark_calib import selection as L

    bad = C.json_elements(tmp_path / "bad.parquet", SHIPPED)
    for i in range(20):
        shutil.copy(bad, tmp_path / f"bad-{i}.parquet")
    shutil.copy(SHIPPED, tmp_path / "good.parquet")
    d = L.decide(str(tmp_path), {}, policy="warn")
    assert d.load and d.chosen.path.endswith("good.parquet")
    assert "21 unreadable" in d.lines[0] and "max_json_elements=100000" in d.lines[0]


# -- the page walk is pyarrow's ----------------------------------------------------------------
@pytest.mark.parametrize("good", [SHIPPED], ids=["shipped"])
def test_the_footer_parse_agrees_with_pyarrow_on_every_chunk(good):
    from dspark_calib.fileformat import parquet as P

    md = pq.ParquetFile(good).metadata
    with open(good, "rb") as fh:
        bp = P.BoundedParquet(fh, good.stat().st_size, str(good), CLI_LIMITS, dictionary=("record",))
        chunks = bp._chunks(range(md.num_row_groups), bp.schema.names)
        for g, name, meta in chunks:
            col = md.row_group(g).column(bp.schema.names.index(name))
            assert (meta[5], meta[7], meta[9]) == (col.num_values, col.total_compressed_size, col.data_page_offset)
            assert meta.get(11) == (col.dictionary_page_offset if col.has_dictionary_page else None)
        decoded = bp._decoded_bytes(chunks)
        # every page's declared size, summed, is the footer's total less the page headers
        pages = sum(md.row_group(g).column(bp.schema.names.index(n)).total_uncompressed_size for g, n, _ in chunks)
        values = sum(meta[5] for _, _, meta in chunks)
        assert pages - 200 * len(chunks) < decoded - 8 * values <= 2 * pages


def test_a_page_header_that_lies_about_its_size_is_what_is_counted(tmp_path):
    """The footer's totals are the writer's word: the page headers are walked, and a page whose
    header declares gigabytes is counted as such (pyarrow allocates what the header says)."""
    from dspark_calib.fileformat import parquet as P

    path = C.zstd_bomb(tmp_path / "z.parquet", SHIPPED, value_bytes=80 << 20)
    md = pq.ParquetFile(path).metadata
    with open(path, "rb") as fh:
        bp = P.BoundedParquet(fh, path.stat().st_size, str(path), CLI_LIMITS, dictionary=("record",))
        with pytest.raises(CalibError, match="bytes decoded 1[67]\\d{7} exceeds the read limit max_decoded_bytes"):
            bp.read([0], ["record"])
    assert md.row_group(0).column(0).total_compressed_size < 20_000


def test_too_many_pages_are_refused(tmp_path):
    import pyarrow as pa

    from dspark_calib.fileformat import parquet as P

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"a": list(range(5000))}), path, data_page_size=1, write_batch_size=1,
                   use_dictionary=False)
    limits = __import__("dataclasses").replace(CLI_LIMITS, max_pages=100)
    with open(path, "rb") as fh:
        bp = P.BoundedParquet(fh, path.stat().st_size, str(path), limits)
        with pytest.raises(CalibError, match="pages to read exceed the read limit max_pages=100"):
            bp.read([0], ["a"])


def test_engine_sizes_in_a_fingerprint_are_bounded(files):
    from dspark_calib.fileformat.limits import MAX_STEP_TOKENS

    with pytest.raises(CalibError, match=f"max_num_batched_tokens 2147483648 is outside 0..{MAX_STEP_TOKENS}"):
        read_metadata(files["sizes"])


def test_dense_tables_are_bounded_before_they_are_allocated(reference_table):
    from dspark_calib.fileformat.limits import MAX_STEP_TOKENS
    from dspark_calib.pricing.costs import MAX_DENSE_BYTES, ContextCosts

    curves = {c: reference_table.curves[8192] for c in range(1000, 1000 + 20)}  # 22 x 16 MiB
    with pytest.raises(CalibError, match=f"over the {MAX_DENSE_BYTES >> 20} MiB priced at once"):
        ContextCosts(curves, 256, MAX_STEP_TOKENS, 512)


@pytest.mark.slow
def test_inspect_and_check_at_the_largest_engine_sizes_run_under_the_cap(tmp_path):
    from dspark_calib.fileformat.limits import MAX_NUM_SEQS, MAX_STEP_TOKENS

    path = C.forged_sizes(tmp_path / "edge.parquet", SHIPPED, max_num_batched_tokens=MAX_STEP_TOKENS,
                          max_num_seqs=MAX_NUM_SEQS)
    r = C.run_capped(CAP_MIB, C.cli_code("inspect", path))
    assert r.returncode == 0 and "2097152" in r.stdout, r.stderr[-2000:]
    r = C.run_capped(CAP_MIB, C.cli_code("check", path))
    assert r.returncode == 3 and "loaded cost table" in r.stdout, r.stderr[-2000:]

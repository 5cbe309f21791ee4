"""`dspark-calib validate`: observed files made with ObservedWriter from the shipped table's curves."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from dspark_calib.cli.app import app
from dspark_calib.observe.file import ObservedWriter
from dspark_calib.table.file import read_table
from tests.core.test_validate import synthetic_steps
from tests.helpers import SCHEMA10, assert_command_is_light, one_line_error

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def shipped_observed(tmp_path_factory):
    """Steps at 1024, 4096 (between profiled contexts) and 16384, priced truthfully by the
    shipped table's own curves: 3 rolling files of 100 rows."""
    d = tmp_path_factory.mktemp("observed")
    with ObservedWriter(d, rows_per_file=100, metadata={"mode": "context_aware"}) as w:
        for s in synthetic_steps(read_table(SCHEMA10, samples=False), (1024, 4096, 16384), per_context=100):
            w.append(s)
    assert len(os.listdir(d)) == 3
    return d


def test_report_on_the_shipped_table(shipped_observed):
    r = invoke("validate", SCHEMA10, shipped_observed)
    assert r.exit_code == 0, r.output
    assert "validate table ad4ef3d97317: 300 observed steps from 3 file(s)" in r.stdout
    assert "single-context pricing at 8192" in r.stdout and "budget would change in 100 of 300 steps" in r.stdout


def test_errors_by_sm_clock_beside_the_context_buckets(shipped_observed, tmp_path):
    """Steps served at 1530 MHz ran 3 % slower than the table says, those at 1980 MHz as it says:
    the SM-clock buckets show it (--json and text); files without clocks say none was recorded."""
    import dataclasses

    steps = synthetic_steps(read_table(SCHEMA10, samples=False), (1024, 16384), per_context=100)
    hot = [dataclasses.replace(st, forward_ms=st.forward_ms * 1.03, drafter_ms=st.drafter_ms * 1.03,
                               gpu_sm_mhz=1530.0, gpu_power_w=699.0) if st.step % 2 else
           dataclasses.replace(st, gpu_sm_mhz=1980.0, gpu_power_w=310.0) for st in steps]
    with ObservedWriter(tmp_path, metadata={"mode": "context_aware"}) as w:
        for st in hot[:-20]:
            w.append(st)
        for st in hot[-20:]:  # no NVML on these
            w.append(dataclasses.replace(st, gpu_sm_mhz=None, gpu_power_w=None))
    d = json.loads(invoke("validate", SCHEMA10, tmp_path, "--json").stdout)
    assert d["clocked_steps"] == 180
    verify = {g["clock_bucket_mhz"]: g for g in d["by_clock"] if g["kind"] == "verify"}
    assert set(verify) == {"1500-1549", "1950-1999"}
    assert verify["1500-1549"]["median_power_w"] == 699.0 and verify["1950-1999"]["median_power_w"] == 310.0
    slow, fast = (verify[b]["context_aware"]["median_signed_pct"] for b in ("1500-1549", "1950-1999"))
    assert slow < -2.0 and abs(fast) < 1.0  # priced below what the lower clock measured
    text = invoke("validate", SCHEMA10, tmp_path).stdout
    assert "by GPU SM clock (as sampled with the step; 180 of 200 steps)" in text and "1500-1549" in text
    assert "by GPU SM clock: not recorded" in invoke("validate", SCHEMA10, shipped_observed).stdout
    assert json.loads(invoke("validate", SCHEMA10, shipped_observed, "--json").stdout)["by_clock"] == []


def test_host_time_is_in_json_where_recorded(shipped_observed):
    """Files without the host interval (as before observe schema 1.6): the key says none."""
    d = json.loads(invoke("validate", SCHEMA10, shipped_observed, "--json").stdout)
    assert d["host_time"] == {"steps": 0, "stall_ms": 1000.0, "groups": []}
    assert "host time between steps: not recorded" in invoke("validate", SCHEMA10, shipped_observed).stdout


def test_json_and_context(shipped_observed):
    d = json.loads(invoke("validate", SCHEMA10, shipped_observed, "--json", "--context", "1000").stdout)
    assert d["table_hash"].startswith("ad4ef3d97317") and d["num_steps"] == 300 and d["single_context"] == 1024
    assert d["max_error"] is None and d["plot"] is None and len(d["files"]) == 3
    verify = next(g for g in d["overall"] if g["kind"] == "verify")
    # Truthful steps with 0.2 % noise: context-aware within 1 %, one-context pricing at 1024 far off at 16384.
    assert verify["context_aware"]["median_pct"] < 1.0 and verify["single_context"]["median_pct"] > 10


def test_max_error_sets_the_exit_code(shipped_observed):
    r = invoke("validate", SCHEMA10, shipped_observed, "--max-error", "5")
    assert r.exit_code == 0 and "max error 5%: within" in r.stdout
    r = invoke("validate", SCHEMA10, shipped_observed, "--max-error", "0.0001")
    assert r.exit_code == 1 and "exceeded" in r.stdout
    d = json.loads(invoke("validate", SCHEMA10, shipped_observed, "--max-error", "0.0001", "--json").stdout)
    assert d["max_error"] == {"pct": 0.0001, "exceeded": True}


def test_plot_follows_the_suffix_and_never_overwrites_an_input(shipped_observed, tmp_path):
    out = tmp_path / "v.svg"
    r = invoke("validate", SCHEMA10, shipped_observed, "--plot", out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes().startswith(b"<?xml") and f"plot written to {out}" in r.stdout
    table = tmp_path / SCHEMA10.name
    shutil.copyfile(SCHEMA10, table)
    one_line_error(invoke("validate", table, shipped_observed, "--plot", table), "would overwrite the input")
    assert table.read_bytes() == SCHEMA10.read_bytes()
    inside = sorted(shipped_observed.iterdir())[0]  # a file the directory stands for is an input too
    before = inside.read_bytes()
    one_line_error(invoke("validate", SCHEMA10, shipped_observed, "--plot", inside), "would overwrite the input")
    assert inside.read_bytes() == before


def test_bad_inputs_are_one_line(shipped_observed, tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"nope" * 100)
    # --plot is checked before any input is read: its problem is the one reported.
    one_line_error(invoke("validate", broken, shipped_observed, "--plot", tmp_path / "x.bmp"), "unknown plot format")
    one_line_error(invoke("validate", broken, shipped_observed), str(broken))
    one_line_error(invoke("validate", SCHEMA10, tmp_path / "absent.parquet"), "absent.parquet", "no such file")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(invoke("validate", SCHEMA10, empty), "no observed-*.parquet files")
    one_line_error(invoke("validate", SCHEMA10, SCHEMA10), "not an observe file")
    assert invoke("validate", SCHEMA10).exit_code == 2  # OBSERVED is required


@pytest.mark.slow
def test_validate_command_imports_no_torch_or_vllm(shipped_observed):
    assert_command_is_light('validate', str(SCHEMA10), str(shipped_observed), '--json')
    assert_command_is_light('validate', str(SCHEMA10), str(shipped_observed), '--tail', '0.2')  # the rendering too


def test_tail_option_and_its_bounds(shipped_observed):
    d = json.loads(invoke("validate", SCHEMA10, shipped_observed, "--json", "--tail", "0.2").stdout)
    assert d["tail_fit"]["tail"] == 0.2 and d["tail_fit"]["spread"] == 1.25
    one_line_error(invoke("validate", SCHEMA10, shipped_observed, "--tail", "1.5"), "validate: ", "'--tail'")
    one_line_error(invoke("validate", SCHEMA10, shipped_observed, "--tail", "nan"), "--tail nan", "between 0 and 1")
    one_line_error(invoke("validate", SCHEMA10, shipped_observed, "--tail", "0.0004"), "--tail 0.0004", "resolution")


def test_chunks_option(shipped_observed):
    docs = {flag: json.loads(invoke("validate", SCHEMA10, shipped_observed, "--json", *flag).stdout)["prefill"]
            for flag in ((), ("--chunks",), ("--no-chunks",))}
    # rows without their chunks recorded: nothing can be priced by pairs, whatever the setting
    assert [d["by_pairs"] for d in docs.values()] == [False, False, False]
    assert all(d["recorded"] == 0 and d["pairs"] is None for d in docs.values())  # rows without their chunks recorded


def test_json_with_an_infinite_error_is_valid_json_and_the_normal_exit(tmp_path):
    """Steps measured at the smallest positive double give an infinite % error: --json still prints
    strict JSON (infinity as "inf", nothing-to-say as null) and exits as the text report does."""
    import dataclasses

    steps = synthetic_steps(read_table(SCHEMA10, samples=False), (1024,), per_context=50)
    with ObservedWriter(tmp_path, rows_per_file=100, metadata={"mode": "context_aware"}) as w:
        for s in steps:
            w.append(dataclasses.replace(s, forward_ms=5e-324, drafter_ms=5e-324))
    for extra, code in (((), 0), (("--max-error", "5"), 1)):
        text = invoke("validate", SCHEMA10, tmp_path, *extra)
        r = invoke("validate", SCHEMA10, tmp_path, "--json", *extra)
        assert text.exit_code == r.exit_code == code, r.output
        d = json.loads(r.stdout)
        draft = next(g for g in d["overall"] if g["kind"] == "draft")
        assert draft["context_aware"]["median_pct"] == "inf"

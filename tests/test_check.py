"""`check`: the plugin's own load decision, offline, for an engine described by options."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import DRAFT, MODEL, REPO, SHIPPED, build_reference_table, fixture_json, one_line_error
from dspark_calib.check import LOADS, MISMATCH, check_tables, describe, parse_engine_pairs
from dspark_calib.cli import app
from dspark_calib.fingerprint import LOAD_CHECKS
from dspark_calib.vllm.loader import decide

runner = CliRunner()
ENGINE = ("--model", MODEL, "--draft", DRAFT, "--tp", "1", "--max-num-seqs", "256", "--max-num-batched-tokens",
          "8192", "--num-speculative-tokens", "7", "--dtype", "bfloat16", "--kv-cache-dtype", "auto",
          "--gpu-name", "NVIDIA H200", "--vllm-version", "0.33.0")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    """A directory as DSPARK_CALIB_TABLE takes it: the shipped table and an H100 reference one."""
    d = tmp_path_factory.mktemp("shelf")
    shutil.copyfile(SHIPPED, d / SHIPPED.name)
    from dspark_calib.table import write_table

    write_table(build_reference_table([fixture_json(8192)], gpu_name="NVIDIA H100"), d / "h100.parquet")
    return d


def test_the_shipped_table_loads_for_its_engine(shelf):
    r = invoke("check", shelf / SHIPPED.name, *ENGINE)
    assert r.exit_code == 0, r.output
    assert f"would load: {shelf / SHIPPED.name} (hash ad4ef3d97317)" in r.stdout
    assert "not checked (not given): cudagraph_capture_sizes, pipeline_parallel_size, quantization" in r.stdout
    assert "plugin log:" in r.stdout and "loaded cost table" in r.stdout


def test_directory_reports_every_other_table_by_its_first_misfit(shelf):
    r = invoke("check", shelf, *ENGINE, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["loads"] and d["chosen"]["path"].endswith(SHIPPED.name)
    other = next(t for t in d["tables"] if t["path"].endswith("h100.parquet"))
    assert other["status"] == MISMATCH and other["reason"].startswith("backend: table 'reference'")
    # As DSPARK_CALIB_ALLOW_REFERENCE=1: the backend passes, and the GPU is what does not fit.
    d = json.loads(invoke("check", shelf, *ENGINE, "--json", "--allow-reference").stdout)
    other = next(t for t in d["tables"] if t["path"].endswith("h100.parquet"))
    assert other["reason"].startswith("gpu_name: table 'NVIDIA H100' vs engine 'NVIDIA H200'")


def test_no_fitting_table_exits_1_naming_the_key(shelf):
    args = list(ENGINE)
    args[args.index("--max-num-seqs") + 1] = "128"
    r = invoke("check", shelf, *args)
    assert r.exit_code == 1, r.output
    assert "would load: nothing" in r.stdout
    assert "max_num_seqs: table 256 vs engine 128" in r.stdout


def test_keys_not_given_are_not_checked_and_never_fail(shelf):
    r = invoke("check", shelf / SHIPPED.name, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["engine"] == {} and d["unchecked"] == [k for k, _ in LOAD_CHECKS]


@pytest.mark.parametrize("key, _rule", LOAD_CHECKS)
def test_every_load_check_key_can_be_given_and_fails_when_wrong(shelf, key, _rule):
    """Driven from the plugin's key list: a check dropped from it (or from check) shows here."""
    wrong = {"cudagraph_capture_sizes": "1,2,3", "quantization": '"fp8"', "max_num_batched_tokens": "99999"}
    value = wrong.get(key, '"nope"' if key not in ("num_speculative_tokens", "max_num_seqs", "tensor_parallel_size",
                                                   "pipeline_parallel_size") else "3")
    r = invoke("check", shelf / SHIPPED.name, "--engine", f"{key}={value}", "--json")
    assert r.exit_code == 1, (key, r.output)
    d = json.loads(r.stdout)
    assert d["tables"][0]["reason"].startswith(f"{key}:"), d["tables"][0]


def test_same_decision_as_the_plugin(shelf):
    engine = describe(model=MODEL, draft=DRAFT, gpu_name="NVIDIA H200", max_num_seqs=256)
    result = check_tables(str(shelf), engine, context_len=1024)
    plugin = decide(str(shelf), engine, context_len=1024)
    assert result.lines == plugin.lines and result.loads == plugin.load
    assert "context 1024 (wanted 1024)" in result.lines[-1]
    assert result.chosen.status == LOADS


def test_engine_pairs():
    assert parse_engine_pairs(["cudagraph_capture_sizes=1,2,4", "max_model_len=32768", "quantization=null",
                               "dtype=bfloat16"]) == {
        "cudagraph_capture_sizes": [1, 2, 4], "max_model_len": 32768, "quantization": None, "dtype": "bfloat16"}


@pytest.mark.parametrize("pair, fragment", [("bogus=1", "--engine bogus: not a fingerprint key"),
                                            ("dtype", "expected KEY=VALUE")])
def test_bad_engine_pairs_are_one_line_errors(pair, fragment):
    one_line_error(invoke("check", SHIPPED, "--engine", pair), fragment)


def test_missing_model_dir_is_one_line_error(tmp_path):
    one_line_error(invoke("check", SHIPPED, "--model", tmp_path / "nope"), "config.json")


def test_check_imports_no_torch_or_vllm():
    code = ("import sys\nfrom dspark_calib.cli import main\n"
            f"sys.argv = ['dspark-calib', 'check', {str(SHIPPED)!r}, '--model', {MODEL!r}, '--gpu-name', 'NVIDIA H200']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "heavy = [m for m in ('torch', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\nassert code in (0, None), code\nprint('OK')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_CALIB_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr


def test_unreadable_tables_are_reported_and_a_missing_source_is_one_line(tmp_path):
    shutil.copyfile(SHIPPED, tmp_path / SHIPPED.name)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet\n" * 20)
    r = invoke("check", tmp_path, "--gpu-name", "NVIDIA H200", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    broken = next(t for t in d["tables"] if t["path"].endswith("broken.parquet"))
    assert broken["status"] == "unreadable" and "broken.parquet" in broken["reason"]
    one_line_error(invoke("check", tmp_path / "absent"), str(tmp_path / "absent"), "no such file or directory")

"""`check`: the plugin's own load decision, offline, for an engine described by options."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from typer.testing import CliRunner

from dspark_calib.check import LOADS, MISMATCH, check_tables, describe, parse_engine_pairs
from dspark_calib.cli.app import app
from dspark_calib.fingerprint import BLOCKING, EQUAL, KEYS, LOAD_RULES, RECORDED, unchecked_keys
from dspark_calib.table.file import read_metadata, read_table, write_table
from dspark_calib.selection import decide
from tests.helpers import (DRAFT, MODEL, REPO, SCHEMA10, SHIPPED, assert_command_is_light, build_reference_table,
                           fixture_json, one_line_error)

runner = CliRunner()
_GIVEN = {"target_config_hash": "x", "draft_config_hash": "x", "max_num_batched_tokens": 1, "num_speculative_tokens": 1,
          "kv_cache_dtype": "x", "vllm_version": "x"}
ENGINE = ("--model", MODEL, "--draft", DRAFT, "--tp", "1", "--max-num-seqs", "256", "--max-num-batched-tokens",
          "8192", "--num-speculative-tokens", "7", "--dtype", "bfloat16", "--kv-cache-dtype", "auto",
          "--gpu-name", "NVIDIA H200", "--vllm-version", "0.33.0")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    """A directory as DSPARK_CALIB_TABLE takes it: the shipped table and an H100 reference one."""
    d = tmp_path_factory.mktemp("shelf")
    shutil.copyfile(SCHEMA10, d / SCHEMA10.name)
    from dspark_calib.table.file import write_table

    write_table(build_reference_table([fixture_json(8192)], gpu_name="NVIDIA H100"), d / "h100.parquet")
    return d


def test_the_schema_1_0_table_loads_for_its_engine(shelf):
    r = invoke("check", shelf / SCHEMA10.name, *ENGINE)
    assert r.exit_code == 0, r.output
    assert f"would load: {shelf / SCHEMA10.name} (hash ad4ef3d97317)" in r.stdout
    given = {"gpu_name", "tensor_parallel_size", "max_num_seqs", "dtype"}
    unchecked = r.stdout.split("not checked (not given): ")[1].split("\n\n")[0].replace("\n", " ")
    listed = {k.strip() for k in unchecked.split(",")}
    assert listed == set(unchecked_keys({k.name: 1 for k in KEYS if k.name in given} | _GIVEN)) and not listed & given
    assert "plugin log:" in r.stdout and "loaded cost table" in r.stdout


def test_directory_reports_every_other_table_by_its_first_misfit(shelf):
    r = invoke("check", shelf, *ENGINE, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["loads"] and d["chosen"]["path"].endswith(SCHEMA10.name)
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
    r = invoke("check", shelf / SCHEMA10.name, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["engine"] == {} and d["unchecked"] == unchecked_keys({}) == [k.name for k in KEYS if k.load in LOAD_RULES]
    assert d["not_recorded"] == []


def _values(key):
    """(a value a table records, an engine value that does not fit it), by the key's registry type."""
    if key.types == (tuple,):
        return [1, 2, 4, 8], "1,2,3"
    if key.types == (int,):
        return 16, ("17" if key.load == EQUAL else str(10**7))  # COVERS: the engine asks for more
    return "alpha", "nope"


@pytest.mark.parametrize("key", [k for k in KEYS if k.load in BLOCKING], ids=lambda k: k.name)
def test_every_blocking_key_can_be_given_and_fails_when_wrong(shelf, tmp_path, key):
    """Driven from the registry: a key dropped from the loader's checks (or from check) shows here.
    A key the shipped (1.0) table did not record never blocks and is named as not recorded; a
    table that records it refuses an engine that differs, naming the key."""
    table_value, wrong = _values(key)
    if key.name == "quantization":
        wrong = "fp8"
    shipped_value = getattr(read_metadata(SCHEMA10).fingerprint, key.name)
    if key.recorded(shipped_value):
        path = shelf / SCHEMA10.name
    else:
        r = invoke("check", shelf / SCHEMA10.name, "--engine", f"{key.name}={wrong}", "--json")
        assert r.exit_code == 0, (key.name, r.output)
        assert json.loads(r.stdout)["not_recorded"] == [key.name]
        table = read_table(SCHEMA10)
        path = write_table(dataclasses.replace(table, fingerprint=table.fingerprint.replace(**{key.name: table_value})),
                           tmp_path / "recorded.parquet")
        ok = ",".join(map(str, table_value)) if isinstance(table_value, list) else str(table_value)
        assert invoke("check", path, "--engine", f"{key.name}={ok}").exit_code == 0
    r = invoke("check", path, "--engine", f"{key.name}={wrong}", "--json")
    assert r.exit_code == 1, (key.name, r.output)
    d = json.loads(r.stdout)
    assert d["tables"][0]["reason"].startswith(f"{key.name}:"), d["tables"][0]


def test_a_recorded_only_key_that_differs_loads_and_is_named(shelf):
    key = next(k for k in KEYS if k.load == RECORDED and k.types == (str,))
    r = invoke("check", shelf / SCHEMA10.name, "--engine", f"{key.name}=nope", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["not_load_checks"] == [key.name] and key.name not in d["unchecked"]


def test_same_decision_as_the_plugin(shelf):
    engine = describe(model=MODEL, draft=DRAFT, gpu_name="NVIDIA H200", max_num_seqs=256)
    result = check_tables(str(shelf), engine, context_len=1024)
    plugin = decide(str(shelf), engine, context_len=1024)
    assert result.lines == plugin.lines and result.loads == plugin.load
    assert plugin.context_len == 1024 and "context 1024 for effective context 1024" in result.lines[-1]
    assert result.chosen.status == LOADS


def test_engine_pairs():
    assert parse_engine_pairs(["cudagraph_capture_sizes=1,2,4", "max_model_len=32768", "quantization=null",
                               "dtype=bfloat16", "kv_block_size=16", "model_impl=\"vllm\"", "vllm_version=0.33.0"]) == {
        "cudagraph_capture_sizes": [1, 2, 4], "max_model_len": 32768, "quantization": None, "dtype": "bfloat16",
        "kv_block_size": 16, "model_impl": "vllm", "vllm_version": "0.33.0"}


@pytest.mark.parametrize("pair, fragment", [("bogus=1", "--engine bogus: not a fingerprint key"),
                                            ("dtype", "expected KEY=VALUE"),
                                            ("kv_block_size=big", "--engine kv_block_size='big': must be an integer"),
                                            ("cudagraph_capture_sizes=1,x", "must be a list of integers")])
def test_bad_engine_pairs_are_one_line_errors(pair, fragment):
    one_line_error(invoke("check", SCHEMA10, "--engine", pair), fragment)


def test_missing_model_dir_is_one_line_error(tmp_path):
    one_line_error(invoke("check", SCHEMA10, "--model", tmp_path / "nope"), "config.json")


def test_check_imports_no_torch_or_vllm():
    assert_command_is_light('check', str(SCHEMA10), '--model', MODEL, '--gpu-name', 'NVIDIA H200')


def test_unreadable_tables_are_reported_and_a_missing_source_is_one_line(tmp_path):
    shutil.copyfile(SCHEMA10, tmp_path / SCHEMA10.name)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet\n" * 20)
    r = invoke("check", tmp_path, "--gpu-name", "NVIDIA H200", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    broken = next(t for t in d["tables"] if t["path"].endswith("broken.parquet"))
    assert broken["status"] == "unreadable" and "not a readable parquet file" in broken["reason"]
    one_line_error(invoke("check", tmp_path / "absent"), str(tmp_path / "absent"), "no such file")


@pytest.mark.parametrize("pair, fragment", [("tensor_parallel_size=-5", "not negative"),
                                            ("cudagraph_capture_sizes=1,-2", "not negative"),
                                            ('gpu_name="\\ud800"', "without lone surrogates")])
def test_engine_values_that_no_engine_reports_are_one_line(pair, fragment):
    r = invoke("check", SCHEMA10, "--engine", pair)
    assert r.stdout == ""  # nothing printed before the error
    one_line_error(r, "--engine", fragment)


def test_unrecorded_keys_are_named_for_a_table_under_a_long_path(tmp_path):
    """The loader cuts displayed paths at 160 characters; check must not reopen that display name."""
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 8)
    deep.mkdir(parents=True)
    shutil.copyfile(SCHEMA10, deep / SCHEMA10.name)
    assert len(str(deep / SCHEMA10.name)) > 200
    key = next(k for k in KEYS if k.load in BLOCKING and not k.recorded(getattr(read_metadata(SCHEMA10).fingerprint,
                                                                                  k.name)))
    table_value, wrong = _values(key)
    r = invoke("check", deep / SCHEMA10.name, "--engine", f"{key.name}={wrong}", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["not_recorded"] == [key.name]


def test_the_shipped_directory_picks_the_table_of_the_engines_tp_with_every_key_checked():
    """profiles/h200/ as an operator points DSPARK_CALIB_TABLE at it: a tp 1 engine gets the tp 1
    table (schema 1.2 since 2026-12-01: no key 'not recorded', so none is waved through), a tp 2
    engine the tp 2 one, and each names the other's tensor_parallel_size as its misfit."""

    shelf = REPO / "profiles" / "h200"
    for tp, want in (("1", SHIPPED.name), ("2", "__tp2__")):
        args = list(ENGINE)
        args[args.index("--tp") + 1] = tp
        r = invoke("check", shelf, *args, "--json")
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        assert d["loads"] and want in d["chosen"]["path"] and d["not_recorded"] == []
        other = next(t for t in d["tables"] if t["path"] != d["chosen"]["path"])
        assert other["status"] == MISMATCH and other["reason"].startswith("tensor_parallel_size: table ")
    assert read_metadata(SHIPPED).schema_version == "1.2"


def test_tables_are_listed_newest_first(tmp_path):
    """Three fitting tables whose names sort oldest first: check lists them newest first, the
    order the plugin prefers them in."""
    base = build_reference_table([fixture_json(8192)])
    for name, created in (("a.parquet", "2026-01-01T00:00:00Z"), ("b.parquet", "2026-06-01T00:00:00Z"),
                          ("c.parquet", "2026-11-01T00:00:00Z")):
        write_table(dataclasses.replace(base, created_at=created), tmp_path / name)
    result = check_tables(str(tmp_path), {}, allow_reference=True)
    assert [t.path.rsplit("/", 1)[-1] for t in result.tables] == ["c.parquet", "b.parquet", "a.parquet"]
    assert [t.created_at for t in result.tables] == sorted((t.created_at for t in result.tables), reverse=True)

"""`check`: the plugin's own load decision, offline, for an engine described by options."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_calib.check import (
    LOADS,
    MISMATCH,
    check_tables,
    describe,
    parse_engine_pairs,
)
from dspark_calib.cli.app import app
from dspark_calib.fingerprint import (
    BLOCKING,
    KEY,
    KEYS,
    LOAD_RULES,
    RECORDED,
    unchecked_keys,
)
from dspark_calib.selection import decide
from dspark_calib.table.file import read_metadata, read_table, write_table
from tests.helpers import (
    DRAFT,
    MODEL,
    REPO,
    SCHEMA10,
    SHIPPED,
    assert_command_is_light,
    build_reference_table,
    fixture_json,
    one_line_error,
)

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


def _listed(stdout, label):
    text = stdout.split(label)[1].split("\n\n")[0].split("\nnot checked")[0].replace("\n", " ")
    return {k.strip() for k in text.split(",")}


def test_the_schema_1_0_table_loads_for_its_engine_if_the_keys_decided_at_start_match(shelf):
    """Options that leave blocking keys out (the GPU's memory, the attention backend...) get exit 3
    and the keys named: never a plain "would load"."""
    r = invoke("check", shelf / SCHEMA10.name, *ENGINE)
    assert r.exit_code == 3, r.output
    assert f"would load if the keys decided at start match: {shelf / SCHEMA10.name} (hash ad4ef3d97317)" in r.stdout
    assert "would load: " not in r.stdout
    given = {"gpu_name", "tensor_parallel_size", "max_num_seqs", "dtype"}
    at_start = _listed(r.stdout, "decided at start (blocking; not given, or known only to the running engine): ")
    warning_only = _listed(r.stdout, "not checked (warning only, not given): ")
    expected = unchecked_keys({k.name: 1 for k in KEYS if k.name in given} | _GIVEN)
    assert at_start | warning_only == set(expected) and not (at_start | warning_only) & given
    assert at_start == {k for k in expected if KEY[k].load in BLOCKING} and "attention_backend" in at_start
    assert "plugin log:" in r.stdout and "loaded cost table" in r.stdout


def test_directory_reports_every_other_table_by_its_first_misfit(shelf):
    r = invoke("check", shelf, *ENGINE, "--json")
    assert r.exit_code == 3, r.output
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


def test_keys_not_given_are_decided_at_start_never_a_pass(shelf):
    r = invoke("check", shelf / SCHEMA10.name, "--json")
    assert r.exit_code == 3, r.output
    d = json.loads(r.stdout)
    assert d["engine"] == {} and d["unchecked"] == unchecked_keys({}) == [k.name for k in KEYS if k.load in LOAD_RULES]
    assert d["decided_at_start"] == [k.name for k in KEYS if k.load in BLOCKING] and d["exit_code"] == 3
    assert d["not_recorded"] == []


def _values(key):
    """(a value a table records, an engine value that does not fit it), by the key's registry type."""
    if key.types == (tuple,):
        return [1, 2, 4, 8], "1,2,3"
    if key.types == (int,):
        return 16, "17"
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
        assert r.exit_code == 3, (key.name, r.output)
        assert json.loads(r.stdout)["not_recorded"] == [key.name]
        table = read_table(SCHEMA10)
        path = write_table(dataclasses.replace(table, fingerprint=table.fingerprint.replace(**{key.name: table_value})),
                           tmp_path / "recorded.parquet")
        ok = ",".join(map(str, table_value)) if isinstance(table_value, list) else str(table_value)
        assert invoke("check", path, "--engine", f"{key.name}={ok}").exit_code == 3
    r = invoke("check", path, "--engine", f"{key.name}={wrong}", "--json")
    assert r.exit_code == 1, (key.name, r.output)
    d = json.loads(r.stdout)
    assert d["tables"][0]["reason"].startswith(f"{key.name}:"), d["tables"][0]


def test_a_recorded_only_key_that_differs_loads_and_is_named(shelf):
    key = next(k for k in KEYS if k.load == RECORDED and k.types == (str,))
    r = invoke("check", shelf / SCHEMA10.name, "--engine", f"{key.name}=nope", "--json")
    assert r.exit_code == 3, r.output
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
    assert_command_is_light('check', str(SCHEMA10), '--model', MODEL, '--gpu-name', 'NVIDIA H200', codes=(3,))


def test_unreadable_tables_are_reported_and_a_missing_source_is_one_line(tmp_path):
    shutil.copyfile(SCHEMA10, tmp_path / SCHEMA10.name)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet\n" * 20)
    r = invoke("check", tmp_path, "--gpu-name", "NVIDIA H200", "--json")
    assert r.exit_code == 3, r.output
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
    assert r.exit_code == 3, r.output
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
        assert r.exit_code == 3, r.output
        d = json.loads(r.stdout)
        assert d["loads"] and want in d["chosen"]["path"] and d["not_recorded"] == []
        others = {Path(t["path"]).name.split("__")[1]: t for t in d["tables"] if t["path"] != d["chosen"]["path"]}
        assert all(t["status"] == MISMATCH for t in others.values())
        dspark = [t for name, t in others.items() if name.startswith("dspark-")]
        assert [t["reason"].split(":")[0] for t in dspark] == ["tensor_parallel_size"]
        # the draft-model table's drafter is another model: named by its config's hash
        assert others["qwen3-0.6b"]["reason"].startswith("draft_config_hash: table ")
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


# -- the engine's answer: exit codes, corrupt tables, identical tables, serve flags --------------------
def _every_blocking_key():
    """Options giving every blocking key, as the shipped table's engine has them."""
    fp = read_metadata(SHIPPED).fingerprint
    out = []
    for key in KEYS:
        if key.load in BLOCKING:
            value = getattr(fp, key.name)
            if value is None and not key.none_is_value:  # added after the table: the engine reports one
                value = "engine-value"
            text = "null" if value is None else ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            out += ["--engine", f"{key.name}={text}"]
    return out


def test_a_load_with_every_blocking_key_checked_is_exit_0():
    r = invoke("check", SHIPPED, *_every_blocking_key(), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["decided_at_start"] == [] and d["exit_code"] == 0 and d["loads"]


def test_a_junk_table_is_exit_2_not_none_would_load(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"junk\n")
    one_line_error(invoke("check", junk), str(junk), "not a readable parquet file")


def _damaged_samples(tmp_path):
    """A copy of the shipped table with one byte of a raw-sample page flipped: its metadata and
    curves read, its sample pages fail their checksums."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(SHIPPED).metadata
    samples = meta.row_group(meta.num_row_groups - 1).column(2)  # 'size' of the raw-sample rows
    data = bytearray(SHIPPED.read_bytes())
    data[samples.data_page_offset + samples.total_compressed_size - 8] ^= 0xFF
    path = tmp_path / SHIPPED.name
    path.write_bytes(bytes(data))
    assert decide(str(path), {}).load  # what the plugin reads is intact
    return path


def test_a_table_whose_sample_pages_fail_their_checksums_is_corrupt_exit_2(tmp_path):
    path = _damaged_samples(tmp_path)
    one_line_error(invoke("check", path, *_every_blocking_key()), str(path), "corrupt")
    one_line_error(invoke("check", tmp_path, *_every_blocking_key()), "corrupt")  # chosen from a directory


def test_nothing_loads_and_a_table_is_unreadable_is_exit_2(tmp_path):
    shutil.copyfile(SHIPPED, tmp_path / SHIPPED.name)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet\n" * 20)
    r = invoke("check", tmp_path, "--tp", "8")
    assert "would load: nothing" in r.stdout
    one_line_error(r, "no table would load and 1 could not be read", "broken.parquet")


def test_among_identical_tables_the_reason_says_identical(tmp_path):
    for name in ("a.parquet", "b.parquet"):
        shutil.copyfile(SHIPPED, tmp_path / name)
    d = json.loads(invoke("check", tmp_path, *_every_blocking_key(), "--json").stdout)
    other = next(t for t in d["tables"] if t["status"] == "fits")
    assert other["content_hash"] == d["chosen"]["content_hash"]
    assert other["reason"].startswith("identical to the table that loads (same content hash)")
    assert d["chosen"]["path"] == decide(str(tmp_path), {}).chosen.path  # the plugin's own choice


def test_vllms_profile_context_env_is_read(shelf, monkeypatch):
    """VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN=4096: the engine profiles at 4096, 50 % from the
    table's nearest context, so nothing loads."""
    monkeypatch.setenv("VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN", "4096")
    r = invoke("check", SHIPPED, *_every_blocking_key())
    assert r.exit_code == 1, r.output
    assert "from the effective context 4096" in r.stdout


README_FLAGS = [MODEL, "--speculative-config", json.dumps({"method": "dspark", "model": DRAFT,
                                                           "num_speculative_tokens": 7,
                                                           "enable_adaptive_verification": True}),
                "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--max-model-len", "32768"]
H200 = {"gpu_name": "NVIDIA H200", "gpu_memory_mib": 143155}


def _drop(flag):
    i = README_FLAGS.index(flag)
    return README_FLAGS[:i] + README_FLAGS[i + 2:]


def test_serve_flags_resolve_by_vllms_documented_defaults():
    from dspark_calib.serve_args import resolve

    full = resolve(["vllm", "serve", *README_FLAGS], H200).engine
    assert (full["max_model_len"], full["max_num_seqs"], full["max_num_batched_tokens"]) == (32768, 256, 8192)
    assert full["dtype"] == "bfloat16" and full["tensor_parallel_size"] == 1 and full["num_speculative_tokens"] == 7
    assert resolve(_drop("--max-model-len"), H200).engine["max_model_len"] == 40960  # max_position_embeddings
    assert resolve(_drop("--max-num-seqs"), H200).engine["max_num_seqs"] == 1024  # >= 70 GiB
    assert resolve(_drop("--max-num-seqs"), {"gpu_memory_mib": 48 * 1024}).engine["max_num_seqs"] == 256
    assert "max_num_seqs" not in resolve(_drop("--max-num-seqs"), {}).engine  # no memory: decided at start
    assert resolve([*README_FLAGS, "--dtype", "auto"], H200).engine["dtype"] == "bfloat16"  # the config's
    assert resolve([*README_FLAGS, "--block-size", "32"], H200).engine["kv_block_size"] == 32
    assert resolve(README_FLAGS, H200, {"VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "4096"}).vllm_context_len == 4096


@pytest.fixture
def light(monkeypatch):
    """check as on the light install: vLLM not importable."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))


def test_serve_flags_after_a_double_dash_light(light):
    hardware = ["--gpu-name", "NVIDIA H200", "--engine", "gpu_memory_mib=143155"]
    r = invoke("check", SHIPPED, *hardware, "--json", "--", "vllm", "serve", *README_FLAGS)
    assert r.exit_code == 3, r.output  # loads if the backends, CUDA and torch builds match
    d = json.loads(r.stdout)
    assert d["resolution"].startswith("resolved by vLLM's documented defaults")
    assert {"attention_backend", "cuda_version", "compilation_hash"} <= set(d["decided_at_start"])
    r = invoke("check", SHIPPED, *hardware, "--", *_drop("--max-model-len"))
    assert r.exit_code == 1 and "max_model_len: table 32768 vs engine 40960" in r.stdout


def test_serve_flags_and_engine_options_together_are_one_line(light):
    one_line_error(invoke("check", SHIPPED, "--tp", "2", "--", *README_FLAGS), "--tp", "after --")
    one_line_error(invoke("check", SHIPPED, "--", *README_FLAGS, "--max-num-seqs"), "--max-num-seqs needs a value")


def test_dtype_auto_is_the_model_configs_as_vllm_resolves_it():
    """--dtype auto with --model: vLLM serves the config's torch_dtype (bfloat16), and the table loads;
    without --model, auto is not known and is decided at start."""
    r = invoke("check", SHIPPED, "--model", MODEL, "--dtype", "auto", "--json")
    assert r.exit_code == 3, r.output
    d = json.loads(r.stdout)
    assert d["engine"]["dtype"] == "bfloat16" and d["loads"]
    d = json.loads(invoke("check", SHIPPED, "--dtype", "auto", "--json").stdout)
    assert "dtype" in d["decided_at_start"] and "dtype" not in d["engine"]


@pytest.mark.parametrize("value", ["-1", "auto"])
def test_max_model_len_fitted_to_memory_is_decided_at_start(light, value):
    """vLLM fits --max-model-len -1/auto to the GPU's free memory when the engine starts: check
    cannot know it, and says so (exit 3) instead of answering for the model config's 40960."""
    flags = [*_drop("--max-model-len"), "--max-model-len", value]
    r = invoke("check", SHIPPED, "--gpu-name", "NVIDIA H200", "--engine", "gpu_memory_mib=143155", "--json", "--", *flags)
    assert r.exit_code == 3, r.output
    d = json.loads(r.stdout)
    assert "max_model_len" in d["decided_at_start"] and "max_model_len" not in d["engine"]


def test_check_and_the_load_line_state_the_tables_coverage_of_max_model_len():
    """check says how far the table's contexts reach against the engine's max_model_len, in its report,
    its JSON and the plugin's own load line (one sentence: pricing.policy.coverage)."""
    max_model_len = "32768"
    said = ("contexts 1024, 8192, 16384 of max_model_len 32768: above 16384 extrapolated on the line through "
            "8192 and 16384 (context-aware)")
    fp = read_metadata(SHIPPED).fingerprint
    engine = {"max_model_len": int(max_model_len), "max_num_batched_tokens": fp.max_num_batched_tokens}
    d = decide(str(SHIPPED), engine, policy="strict")
    assert d.load and d.coverage == said and f"; {said}" in d.lines[0]
    r = invoke("check", SHIPPED, "--max-model-len", max_model_len, "--json")
    assert json.loads(r.stdout)["coverage"] == said
    text = runner.invoke(app, ["check", str(SHIPPED), "--max-model-len", max_model_len], env={"COLUMNS": "400"})
    assert f"coverage: {said}" in text.stdout


def test_check_states_no_coverage_when_nothing_loads():
    r = invoke("check", SHIPPED, "--max-model-len", "4096", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["coverage"] == ""

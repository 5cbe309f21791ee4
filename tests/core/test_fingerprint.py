"""The key registry: its rules, its comparisons, its docs table (no vLLM needed).

The readers on real vLLM config objects are tests/vllm/test_engine_info.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing

import pytest

from dspark_calib.errors import CalibError
from dspark_calib.fingerprint import (
    BLOCKING, EQUAL, KEYS, LOAD_RULES, RECORDED, Fingerprint, Mismatch, compatibility_markdown,
    display_rows, load_mismatches, merge_mismatches, recorded_differences)
from tests.helpers import REPO

ROOT = str(REPO)
SCHEMA10 = os.path.join(ROOT, "benchmarks", "results", "h200", "2026-11-30-morning", "qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__ad4ef3d97317.parquet")
COMPATIBILITY_DOC = os.path.join(ROOT, "docs", "compatibility.md")


# -- the registry itself ----------------------------------------------------------------------
def test_registry_and_fingerprint_fields_agree():
    names = [f.name for f in dataclasses.fields(Fingerprint) if f.name != "extra"]
    assert sorted(names) == sorted(k.name for k in KEYS) and len(set(names)) == len(KEYS)
    hints = typing.get_type_hints(Fingerprint)
    for key in KEYS:
        # The annotation says the same type the validator enforces (and None only where allowed).
        hint = hints[key.name]
        args = set(typing.get_args(hint)) or {hint}
        if key.types == (tuple,):
            assert typing.get_origin(hint) is tuple, key.name
            continue
        assert set(key.types) <= args, key.name
        assert (type(None) in args) == (key.optional or key.none_is_value), key.name


def test_every_key_has_a_rule_a_label_and_one_line_why():
    from dspark_calib.vllm.engine_info import READERS

    for key in KEYS:
        assert key.load in LOAD_RULES or key.load is None, key.name
        assert key.label and key.why and "\n" not in key.why, key.name
        # A key compared on load must be readable from the engine, or the rule is dead.
        assert (key.name in READERS) == (key.load is not None) or key.name == "backend", key.name


def test_decisions_asked_for_are_recorded():
    rules = {k.name: k.load for k in KEYS}
    assert rules["torch_version"] == EQUAL and rules["cuda_version"] == EQUAL
    assert rules["driver_version"] == RECORDED
    assert rules["max_model_len"] == EQUAL and rules["max_num_batched_tokens"] == EQUAL
    for name in ("attention_backend", "draft_attention_backend", "cudagraph_mode", "compilation_hash",
                 "kv_block_size", "data_parallel_size", "expert_parallel_size", "decode_context_parallel_size",
                 "hf_overrides", "model_impl", "gpu_memory_mib"):
        assert rules[name] == EQUAL, name


def test_fingerprint_validates_new_keys():
    fp = Fingerprint.from_dict(_shipped_fingerprint())
    with pytest.raises(CalibError, match="kv_block_size must be an integer"):
        fp.replace(kv_block_size="16")
    with pytest.raises(CalibError, match="attention_backend must be a string"):
        fp.replace(attention_backend=3)
    with pytest.raises(CalibError, match="gpu_name must be a string, got None"):
        fp.replace(gpu_name=None)
    data = {**fp.to_dict(), "from_the_future": 1}
    assert Fingerprint.from_dict(data).extra["from_the_future"] == 1


# -- comparing -----------------------------------------------------------------------------------
def _shipped_fingerprint() -> dict:
    from dspark_calib.table.file import read_metadata

    return dict(read_metadata(SCHEMA10).raw["fingerprint"])


def test_recorded_differences_do_not_block():
    fp = Fingerprint.from_dict(_shipped_fingerprint())
    engine = {"driver_version": "590.1", "gpu_name": fp.gpu_name}
    assert load_mismatches(fp, engine) == []
    [diff] = recorded_differences(fp, engine)
    assert diff.key == "driver_version" and diff.rule == RECORDED


def test_quantization_none_is_a_value():
    fp = Fingerprint.from_dict(_shipped_fingerprint())
    [m] = load_mismatches(fp, {"quantization": "fp8"})
    assert m.key == "quantization"
    assert load_mismatches(fp.replace(quantization="fp8"), {"quantization": None})


def test_mismatch_line_is_short_and_escaped():
    m = Mismatch("attention_backend", "FLASH\nATTN" + "x" * 200, "TRITON_ATTN")
    line = str(m)
    assert "\n" not in line and "\\n" in line and len(line) < 160
    assert str(Mismatch("max_num_batched_tokens", 4096, 8192)) == "max_num_batched_tokens: table 4096 vs engine 8192"


def test_merge_requires_new_engine_keys():
    fp = Fingerprint.from_dict(_shipped_fingerprint())
    [m] = merge_mismatches(fp, fp.replace(attention_backend="FLASH_ATTN"))
    assert m.key == "attention_backend"
    assert merge_mismatches(fp, fp.replace(replays=3, context_lens=(1024,))) == []


def test_display_rows_cover_every_key():
    fp = Fingerprint.from_dict(_shipped_fingerprint())
    rows = dict(display_rows(fp))
    assert len(rows) == len(KEYS) and rows["attention backend"] == "-" and rows["GPU"] == "NVIDIA H200"


# -- the docs table and light paths------------------------------------------------------------------
def test_readme_holds_exactly_the_registry_table():
    text = open(COMPATIBILITY_DOC, encoding="utf-8").read()
    assert "## Compatibility: what must match" in text
    start, end = "<!-- compatibility-table:start -->\n", "<!-- compatibility-table:end -->"
    assert start in text and end in text, "markers missing"
    assert text.split(start, 1)[1].split(end, 1)[0] == compatibility_markdown()


def test_registry_imports_no_torch_or_vllm():
    code = ("import sys, dspark_calib.fingerprint, dspark_calib.vllm.engine_info; "
            "print(sorted(m for m in ('torch', 'vllm', 'pyarrow', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.strip() == "[]", out.stderr
    assert BLOCKING == (EQUAL,)

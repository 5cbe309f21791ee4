"""The load check, driven from the key registry: no key can drop out of it unnoticed.

For every key with a blocking load rule, a table that differs from the engine only
in that key is refused under `strict` and not loaded under `fallback`; a RECORDED
key that differs never blocks; a key the table did not record never blocks.
Tables are real files written to tmp and judged by the loader's own decide().
"""

from __future__ import annotations

import logging

import pytest

from dspark_calib.fingerprint import BLOCKING, EQUAL, ENGINE_KEYS, KEY, KEYS, RECORDED, Fingerprint
from dspark_calib.samples import Sample
from dspark_calib.table.model import CostTable
from dspark_calib.table.file import write_table
from dspark_calib.selection import decide

SIZES = (1, 2, 4, 8)

# Every key recorded, as a profile on vLLM 0.33.0 would write it.
FULL = Fingerprint(
    backend="vllm", gpu_name="NVIDIA H200", gpu_count=1, gpu_compute_capability="9.0", driver_version="580.159.04",
    cuda_version="13.0", torch_version="2.14.0+cu130", vllm_version="0.33.0", target_model="qwen3-8b",
    target_config_hash="sha256:c550d8667496e5a6", draft_model="dspark-qwen3-8b-block7",
    draft_config_hash="sha256:4053135faea4140e", speculative_method="dspark", tensor_parallel_size=1,
    pipeline_parallel_size=1, dtype="bfloat16",
    kv_cache_dtype="auto", quantization=None, num_speculative_tokens=7, max_num_seqs=4, max_num_batched_tokens=64,
    cudagraph_capture_sizes=SIZES, cudagraph_limit=8, context_lens=(8192,), replays=3, warmup_replays=1,
    max_model_len=32768, attention_backend="FLASH_ATTN", draft_attention_backend="FLASH_ATTN",
    cudagraph_mode="FULL_AND_PIECEWISE", compilation_hash="sha256:b9a78e5ef96755a6", kv_block_size=16,
    data_parallel_size=1, expert_parallel_size=1, decode_context_parallel_size=1, model_revision="main",
    draft_revision="main", hf_overrides="none", model_impl="auto", gpu_memory_mib=143771, gpu_state="startup",
    attention_config_hash="sha256:85ab606f0c1d2e3f", kernel_config_hash="sha256:fb6366b70c1d2e3f",
    offload_config_hash="sha256:ed6cbbe80c1d2e3f", kv_connector="none", additional_config_hash="none",
    cudnn_version="92400", flashinfer_version="0.7.2.post1",
)


def engine_of(fp: Fingerprint) -> dict:
    """What describe_engine would report for the engine the table was made on (JSON shapes)."""
    d = fp.to_dict()
    return {k.name: d[k.name] for k in KEYS if k.name in ENGINE_KEYS}


def other(key, value):
    """A value that does not fit."""
    if key.name == "quantization":
        return "fp8"
    if isinstance(value, (list, tuple)):
        return [*value, value[-1] * 2]
    if isinstance(value, int):
        return value + 1
    return f"{value}-other"


def write(tmp_path, fp: Fingerprint, name: str = "t.parquet") -> str:
    samples = [Sample(forward_ms=1.0 + 0.01 * s + 0.001 * r, drafter_ms=0.5 + 0.01 * min(s, 4) + 0.001 * r,
                      num_target_tokens=s, num_reqs=min(s, 4), full_cudagraph=True, context_len=8192, replay=r)
               for r in range(3) for s in (*SIZES, 16, 64)]
    return write_table(CostTable.from_samples(samples, fp), str(tmp_path / name))


def test_every_engine_key_is_in_the_full_fingerprint():
    # The fixture must record every key, or the loops below would silently skip one.
    assert all(k.recorded(getattr(FULL, k.name)) for k in KEYS)


def test_identical_engine_loads(tmp_path):
    path = write(tmp_path, FULL)
    d = decide(path, engine_of(FULL), policy="strict")
    assert d.load and not d.refuse


BLOCKING_KEYS = [k for k in KEYS if k.load in BLOCKING]
RECORDED_KEYS = [k for k in KEYS if k.load == RECORDED]


def test_the_blocking_keys_include_the_ones_mutation_testing_removed():
    names = {k.name for k in BLOCKING_KEYS}
    assert {"pipeline_parallel_size", "quantization", "max_model_len", "attention_backend", "cudagraph_mode",
            "kv_block_size", "torch_version", "cuda_version"} <= names


@pytest.mark.parametrize("key", BLOCKING_KEYS, ids=lambda k: k.name)
def test_one_differing_key_is_refused_under_strict_and_falls_back(tmp_path, key):
    path = write(tmp_path, FULL)
    engine = engine_of(FULL)
    engine[key.name] = other(key, engine[key.name])
    strict = decide(path, engine, policy="strict")
    assert not strict.load and strict.refuse
    assert key.name in strict.refuse and "\n" not in strict.refuse
    fallback = decide(path, engine, policy="fallback")
    assert not fallback.load and not fallback.refuse
    assert any(key.name in line for line in fallback.lines)


def test_an_engine_with_fewer_batched_tokens_is_another_engine(tmp_path):
    """vLLM compiles for its max_num_batched_tokens (compile ranges, in the compilation hash), so
    an engine asking for fewer tokens than the table was profiled with runs other graphs: it is
    refused naming the key, also where the table recorded no compilation hash (tests/vllm holds
    the compilation hash's dependence to vLLM's own config classes)."""
    for name, fp in (("full.parquet", FULL), ("no-hash.parquet", FULL.replace(compilation_hash=None))):
        path = write(tmp_path, fp, name)
        engine = engine_of(FULL)
        engine["max_num_batched_tokens"] = 32  # the table's: 64
        d = decide(path, engine, policy="strict")
        assert not d.load and "max_num_batched_tokens: table 64 vs engine 32" in d.refuse


@pytest.mark.parametrize("key", RECORDED_KEYS, ids=lambda k: k.name)
def test_a_recorded_key_that_differs_never_blocks(tmp_path, key):
    path = write(tmp_path, FULL)
    engine = engine_of(FULL)
    engine[key.name] = other(key, engine[key.name])
    d = decide(path, engine, policy="strict")
    assert d.load and not d.refuse
    assert d.level == logging.WARNING and f"recorded only, differs: {key.name}" in d.lines[0]


@pytest.mark.parametrize("key", [k for k in BLOCKING_KEYS if k.optional], ids=lambda k: k.name)
def test_a_key_the_table_did_not_record_does_not_block(tmp_path, key):
    """Older tables lack the newer keys: the engine's value cannot be compared, so it does not fail."""
    path = write(tmp_path, FULL.replace(**{key.name: None}))
    engine = engine_of(FULL)
    engine[key.name] = other(key, engine[key.name])
    d = decide(path, engine, policy="strict")
    assert d.load and d.level == logging.WARNING and "not recorded in the table: " in d.lines[0]
    assert key.name in d.lines[0].split("not recorded in the table: ")[1]


def test_a_key_the_engine_did_not_report_is_not_checked(tmp_path):
    path = write(tmp_path, FULL)
    engine = engine_of(FULL)
    del engine["attention_backend"]
    d = decide(path, engine, policy="strict")
    assert d.load and d.level == logging.INFO and "not checked (engine did not report): attention_backend" in d.lines[0]


def test_registry_rules_are_what_the_loader_reads():
    # Every key with a load rule is read from the engine, by exactly one reader.
    from dspark_calib.fingerprint import ENGINE_KEYS
    from dspark_calib.vllm.engine_info import READERS

    assert set(READERS) == set(ENGINE_KEYS) >= {k.name for k in BLOCKING_KEYS}
    assert KEY["max_num_batched_tokens"].load == EQUAL

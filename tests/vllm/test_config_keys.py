"""The keys that make the fingerprint at least as broad as vLLM's own config hash.

VllmConfig.compute_hash() changes with the attention config, the kernel config, CPU offload and
additional_config; a KV connector changes none of vLLM's hashes but adds work to every step. Each
factor is changed in a real VllmConfig built on CPU from vLLM's own classes, read as a worker
reads it (describe_engine), and a table made on the unchanged engine is refused under strict,
naming the key.
"""

from __future__ import annotations

import pytest

from dspark_calib.selection import decide
from tests.core.test_load_keys import FULL, engine_of, write
from tests.vllm.test_engine_info import build_config, describe


def _changed(**sections):
    from vllm.config import VllmConfig

    base = build_config()
    return VllmConfig(model_config=base.model_config, parallel_config=base.parallel_config,
                      speculative_config=base.speculative_config, cache_config=base.cache_config,
                      scheduler_config=base.scheduler_config, compilation_config=base.compilation_config,
                      device_config=base.device_config, **sections)


def _sections():
    from vllm.config import AttentionConfig, KernelConfig, KVTransferConfig, OffloadConfig
    from vllm.config.offload import UVAOffloadConfig

    return {
        "flash-attn-2": ("attention_config_hash", dict(attention_config=AttentionConfig(flash_attn_version=2))),
        "max-splits-16": ("attention_config_hash",
                          dict(attention_config=AttentionConfig(flash_attn_max_num_splits_for_cuda_graph=16))),
        "moe-triton": ("kernel_config_hash", dict(kernel_config=KernelConfig(moe_backend="triton"))),
        "linear-torch": ("kernel_config_hash", dict(kernel_config=KernelConfig(linear_backend="torch"))),
        "cpu-offload-4g": ("offload_config_hash",
                           dict(offload_config=OffloadConfig(uva=UVAOffloadConfig(cpu_offload_gb=4)))),
        "kv-connector": ("kv_connector", dict(kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector",
                                                                                  kv_role="kv_both"))),
        "additional-config": ("additional_config_hash", dict(additional_config={"ascend": {"mode": 1}})),
    }


CASES = ["flash-attn-2", "max-splits-16", "moe-triton", "linear-torch", "cpu-offload-4g", "kv-connector",
         "additional-config"]


@pytest.fixture(scope="module")
def base_engine():
    return describe(build_config())


def test_an_engine_at_vllms_defaults_reports_every_config_key(base_engine):
    assert base_engine["kv_connector"] == "none" and base_engine["additional_config_hash"] == "none"
    for key in ("attention_config_hash", "kernel_config_hash", "offload_config_hash"):
        assert base_engine[key].startswith("sha256:") and len(base_engine[key]) == len("sha256:") + 16


@pytest.mark.parametrize("case", CASES)
def test_a_changed_factor_changes_vllms_hash_and_our_key_and_refuses_under_strict(tmp_path, base_engine, case):
    key, sections = _sections()[case]
    config = _changed(**sections)
    engine = describe(config)
    assert engine[key] != base_engine[key]
    changed = {k for k in base_engine if engine.get(k) != base_engine[k]}
    assert changed == {key}  # this factor moves exactly its own key
    if key != "kv_connector":  # vLLM's KVTransferConfig hash has no factors: why the connector is a key
        assert config.compute_hash() != build_config().compute_hash()
    table = write(tmp_path, FULL.replace(**{key: base_engine[key]}))
    d = decide(table, {**engine_of(FULL), key: engine[key]}, policy="strict")
    assert not d.load and d.refuse and key in d.refuse and "\n" not in d.refuse


def test_additional_config_is_hashed_as_vllm_hashes_it(base_engine):
    """Key order does not count (vLLM hashes sorted JSON); a value does."""
    a = describe(_changed(additional_config={"x": 1, "y": {"z": 2}}))["additional_config_hash"]
    b = describe(_changed(additional_config={"y": {"z": 2}, "x": 1}))["additional_config_hash"]
    c = describe(_changed(additional_config={"x": 2, "y": {"z": 2}}))["additional_config_hash"]
    assert a == b != c


def test_the_library_builds_are_read_from_torch_and_the_installed_wheel(monkeypatch):
    """cuDNN as torch reports the build it loads; FlashInfer by its wheel's version ("none" without it)."""
    from importlib import metadata

    import torch

    from dspark_calib.vllm import engine_info

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 92400)
    monkeypatch.setattr(metadata, "version", lambda name: "0.7.2.post1" if name == "flashinfer-python" else "")
    assert engine_info.library_builds() == {"cudnn_version": "92400", "flashinfer_version": "0.7.2.post1"}

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    monkeypatch.setattr(metadata, "version", missing)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert engine_info.library_builds() == {"cudnn_version": "none", "flashinfer_version": "none"}


@pytest.mark.parametrize("key, mine, theirs", [("cudnn_version", "92400", "91002"),
                                               ("flashinfer_version", "0.7.2.post1", "0.6.1")])
def test_another_library_build_refuses_under_strict(tmp_path, key, mine, theirs):
    """The builds come with the worker's hardware facts (describe_engine), as a worker gathers them."""
    from dspark_calib.vllm.engine_info import describe_engine

    facts = {**{k: v for k, v in engine_of(FULL).items() if k in ("gpu_name", "gpu_memory_mib")}, key: theirs}
    engine = describe_engine(None, [1, 2, 4, 8], build_config(), hardware_facts=facts)
    assert engine[key] == theirs
    table = write(tmp_path, FULL.replace(**{key: mine}))
    d = decide(table, {**engine_of(FULL), key: engine[key]}, policy="strict")
    assert not d.load and f"{key}: table '{mine}' vs engine '{theirs}'" in d.refuse

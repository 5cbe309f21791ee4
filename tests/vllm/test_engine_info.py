"""The key registry's readers on real vLLM config objects, and vLLM's own context clamp.

vLLM's EngineArgs.create_engine_config() needs a GPU platform, so the VllmConfig
here is assembled from the same config classes on CPU (vLLM's own constructors and
validation), then read through describe_engine exactly as a worker would.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dspark_calib.fingerprint import KEYS, Fingerprint, config_hash, load_mismatches, unchecked_keys, unrecorded_keys
from dspark_calib.fit import profile_context_len
from tests.core.test_fingerprint import _shipped_fingerprint
from tests.helpers import DRAFT, MODEL

HARDWARE = {"gpu_name": "NVIDIA H200", "gpu_compute_capability": "9.0", "gpu_memory_mib": 143771,
            "driver_version": "580.159.04", "cuda_version": "13.0", "torch_version": "2.14.0+cu130"}


def build_config(*, parallel=None, cache=None, model=None, compilation=None):
    """A real VllmConfig for the shipped Qwen3-8B + DSpark configs, on CPU."""
    from vllm.config import (CacheConfig, CompilationConfig, DeviceConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=MODEL, load_format="dummy", skip_tokenizer_init=True, max_model_len=32768,
                      **(model or {}))
    model_config = args.create_model_config()
    parallel_config = ParallelConfig(**(parallel or {}))
    # Adaptive verification needs full CUDA graphs, which a CPU-only platform never resolves;
    # the readers do not depend on it.
    spec = SpeculativeConfig(method="dspark", model=DRAFT, num_speculative_tokens=7,
                             target_model_config=model_config, target_parallel_config=parallel_config)
    return VllmConfig(
        model_config=model_config, parallel_config=parallel_config, speculative_config=spec,
        cache_config=CacheConfig(**{"block_size": 16, **(cache or {})}),
        scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32768,
                                         is_encoder_decoder=False),
        compilation_config=CompilationConfig(**(compilation or {})), device_config=DeviceConfig(device="cuda"))


def describe(cfg, manager=None, sizes=(1, 2, 4, 8)):
    from dspark_calib.vllm.engine_info import describe_engine

    return describe_engine(manager, list(sizes), cfg, hardware_facts=HARDWARE)


@pytest.fixture(scope="module")
def config():
    return build_config()


# -- readers on a real VllmConfig ---------------------------------------------------------------
def test_readers_on_a_real_vllm_config(config):
    import vllm

    d = describe(config)
    assert d["tensor_parallel_size"] == 1 and d["pipeline_parallel_size"] == 1
    assert d["data_parallel_size"] == 1 and d["decode_context_parallel_size"] == 1 and d["expert_parallel_size"] == 1
    assert d["dtype"] == "bfloat16" and d["kv_cache_dtype"] == "auto" and d["quantization"] is None
    assert d["kv_block_size"] == 16 and d["max_model_len"] == 32768
    assert d["num_speculative_tokens"] == 7 and d["max_num_seqs"] == 256 and d["max_num_batched_tokens"] == 8192
    assert d["model_impl"] == "auto" and d["hf_overrides"] == "none"
    assert d["target_config_hash"] == config_hash(MODEL) and d["draft_config_hash"] == config_hash(DRAFT)
    assert d["vllm_version"] == vllm.__version__
    assert d["cudagraph_capture_sizes"] == [1, 2, 4, 8]
    assert d["compilation_hash"].startswith("sha256:")
    assert d["cudagraph_mode"] == config.compilation_config.cudagraph_mode.name
    assert d["gpu_memory_mib"] == 143771 and d["torch_version"] == "2.14.0+cu130"
    # Local directories have no revision, no layer was built: those keys are not reported.
    assert "model_revision" not in d and "attention_backend" not in d
    assert set(d) <= {k.name for k in KEYS}
    # Every value is JSON (the capture file stores it).
    import json

    json.dumps(d)


def test_manager_values_win_over_the_config(config):
    manager = SimpleNamespace(num_speculative_steps=5,
                              req_states=SimpleNamespace(max_num_reqs=64, max_num_batched_tokens=2048))
    d = describe(config, manager=manager)
    assert (d["num_speculative_tokens"], d["max_num_seqs"], d["max_num_batched_tokens"]) == (5, 64, 2048)


def test_changed_settings_change_the_keys():
    from vllm.config.compilation import CUDAGraphMode

    base = build_config()
    d0 = describe(base)
    d = describe(build_config(cache={"block_size": 32}, model={"hf_overrides": {"num_hidden_layers": 4}},
                              compilation={"custom_ops": ["+rms_norm"]}))
    assert d["kv_block_size"] == 32
    assert d["hf_overrides"].startswith("sha256:") and d["hf_overrides"] != d0["hf_overrides"]
    assert d["compilation_hash"] != d0["compilation_hash"]
    # The runner writes the resolved mode back into the compilation config (model_runner.py).
    base.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    assert describe(base)["cudagraph_mode"] == "FULL_AND_PIECEWISE"


def test_parallel_sizes():
    from vllm.config import ParallelConfig

    from dspark_calib.vllm.engine_info import EngineView
    from dspark_calib.vllm.engine_info import read_keys

    # dcp needs tp > the KV heads (8): vLLM says so itself.
    d = describe(build_config(parallel={"tensor_parallel_size": 16, "data_parallel_size": 2,
                                        "decode_context_parallel_size": 2}))
    assert d["tensor_parallel_size"] == 16 and d["data_parallel_size"] == 2 and d["decode_context_parallel_size"] == 2
    assert d["expert_parallel_size"] == 1
    # vLLM refuses expert parallel for a dense model, so the MoE case reads a ParallelConfig alone.
    pc = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    assert read_keys(EngineView(vllm_config=SimpleNamespace(parallel_config=pc)))["expert_parallel_size"] == 4


def test_attention_backends_as_vllm_resolved_them(config):
    """Layers register in static_forward_context; DSpark numbers drafter layers after the target's."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    n = config.model_config.hf_text_config.num_hidden_layers

    class Layer:  # the part of vLLM's Attention layer the reader uses: get_attn_backend()
        def __init__(self, backend):
            self.backend = backend

        def get_attn_backend(self):
            return self.backend

    flash, triton = AttentionBackendEnum.FLASH_ATTN.get_class(), AttentionBackendEnum.TRITON_ATTN.get_class()
    ctx = config.compilation_config.static_forward_context
    ctx.update({f"model.layers.{i}.self_attn.attn": Layer(flash) for i in range(n)})
    ctx[f"model.layers.{n}.self_attn.attn"] = Layer(triton)
    ctx["model.layers.0.mlp"] = object()  # not an attention layer: ignored
    try:
        d = describe(config)
        assert d["attention_backend"] == "FLASH_ATTN" and d["draft_attention_backend"] == "TRITON_ATTN"
        # vLLM's own mark (speculator.py sets is_draft_layer) wins over the numbering.
        for name, layer in ctx.items():
            if isinstance(layer, Layer):
                layer.is_draft_layer = name.endswith("layers.3.self_attn.attn")
        d = describe(config)
        assert d["attention_backend"] == "FLASH_ATTN+TRITON_ATTN" and d["draft_attention_backend"] == "FLASH_ATTN"
    finally:
        ctx.clear()


def test_a_failing_reader_leaves_its_key_out():
    d = describe(None)  # an old vLLM shape without the config: only hardware and manager keys
    assert "tensor_parallel_size" not in d and d["gpu_name"] == "NVIDIA H200"
    assert "tensor_parallel_size" in unchecked_keys(d)


# -- the context clamp --------------------------------------------------------------------------
def vllm_clamp(ctx, max_model_len, query_len=1, num_reqs=2):
    """Run vLLM's own set_dummy_context on CPU arrays and read back the context it gave."""
    import torch
    from vllm.v1.worker.gpu.input_batch import set_dummy_context

    n = num_reqs * query_len
    batch = SimpleNamespace(
        num_reqs=num_reqs, max_query_len=query_len, num_scheduled_tokens=np.full(num_reqs, query_len),
        seq_lens=np.full(num_reqs, query_len), seq_lens_cpu_upper_bound=np.full(num_reqs, query_len),
        num_computed_tokens_np=np.zeros(num_reqs, np.int64), num_computed_prefill_tokens_np=np.zeros(num_reqs, np.int64),
        num_tokens=n, query_start_loc_np=np.arange(0, n + 1, query_len), positions=torch.zeros(n, dtype=torch.int64))
    tables = SimpleNamespace(block_sizes=[16], input_block_tables=[torch.zeros((num_reqs, 4096), dtype=torch.int32)])
    set_dummy_context(batch, tables, ctx, num_kv_blocks=100000, max_model_len=max_model_len)
    return int(batch.num_computed_tokens_np[0])


@pytest.mark.parametrize("ctx,max_model_len,query_len", [
    (8192, 4096, 1), (8192, 32768, 1), (100, 4096, 1), (8192, 4096, 7), (4096, 4096, 1), (5, 3, 7), (1, 2, 1)])
def test_profile_context_len_is_vllms_clamp(ctx, max_model_len, query_len):
    assert profile_context_len(ctx, max_model_len, query_len) == vllm_clamp(ctx, max_model_len, query_len)


# -- comparing -----------------------------------------------------------------------------------
def test_shipped_table_keeps_loading_and_names_what_it_did_not_record(config):
    fp = Fingerprint.from_dict(_shipped_fingerprint())
    engine = {**{k: v for k, v in fp.to_dict().items() if v is not None}, **describe(config)}
    engine.update(target_config_hash=fp.target_config_hash, draft_config_hash=fp.draft_config_hash,
                  num_speculative_tokens=7, cudagraph_capture_sizes=list(fp.cudagraph_capture_sizes),
                  max_num_seqs=256, max_num_batched_tokens=8192, vllm_version="0.33.0",
                  attention_backend="FLASH_ATTN", draft_attention_backend="FLASH_ATTN")
    assert load_mismatches(fp, engine) == []
    assert {"attention_backend", "kv_block_size", "cudagraph_mode", "gpu_memory_mib"} <= set(unrecorded_keys(fp, engine))
    assert "max_model_len" not in unrecorded_keys(fp, engine)  # 1.0 tables did record it


# -- light paths ---------------------------------------------------------------------------------
def test_hardware_facts_without_a_gpu(config, monkeypatch):
    """On this CPU host: torch's own versions, no GPU keys (so they stay unchecked, not wrong)."""
    import torch

    from dspark_calib.vllm import engine_info

    monkeypatch.setattr(engine_info, "driver_version", lambda: "")
    hw = engine_info.hardware()
    assert hw["torch_version"] == torch.__version__ and hw["cuda_version"] == (torch.version.cuda or "")
    assert "gpu_name" not in hw and "gpu_memory_mib" not in hw
    d = engine_info.describe_engine(None, [1, 2], config)
    assert d["torch_version"] == torch.__version__ and "gpu_name" not in d and "driver_version" not in d
    assert {"gpu_name", "gpu_memory_mib", "driver_version"} <= set(unchecked_keys(d))


def test_the_compilation_hash_follows_max_num_batched_tokens():
    """Why max_num_batched_tokens must be equal: vLLM compiles for it (compile_ranges_endpoints),
    so an engine with fewer tokens has another compilation hash, whatever the table says."""
    from vllm.config import CompilationConfig, SchedulerConfig, VllmConfig

    base = build_config()

    def hash_at(tokens):
        cfg = VllmConfig(model_config=base.model_config, parallel_config=base.parallel_config,
                         speculative_config=base.speculative_config, cache_config=base.cache_config,
                         scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=tokens,
                                                          max_model_len=32768, is_encoder_decoder=False),
                         compilation_config=CompilationConfig(), device_config=base.device_config)
        return describe(cfg)["compilation_hash"]

    assert hash_at(8192) != hash_at(4096) and hash_at(8192) == hash_at(8192)

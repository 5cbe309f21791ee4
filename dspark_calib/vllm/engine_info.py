"""The running engine as the fingerprint registry sees it, read from inside a vLLM worker.

``READERS`` holds, for every registry key with a load rule (fingerprint.ENGINE_KEYS),
how it is read from vLLM's own objects: plain attribute walks over the VllmConfig and
the adaptive verification manager, plus hardware facts gathered here inside the
worker, so every reader runs in tests on a real VllmConfig built on CPU.
``describe_engine`` applies them; a key whose reader fails or finds nothing is left
out, and the load decision names it unchecked (fingerprint.unchecked_keys).
Nothing here imports torch or vllm at module level.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from dspark_calib.fingerprint import KEY, config_hash, resolve_config_dir


@dataclass(frozen=True)
class EngineView:
    """What a reader is given: vLLM's objects, plus this process's hardware facts.

    engine_info builds it inside the worker (where torch and the GPU are); the
    facts are gathered there so readers stay plain attribute walks, testable on CPU
    against a real VllmConfig.
    """

    vllm_config: Any = None
    manager: Any = None  # vLLM's AdaptiveVerificationManager, when there is one
    capture_sizes: tuple[int, ...] = ()  # what the CUDA-graph manager actually captured
    hardware: Mapping[str, Any] = field(default_factory=dict)  # engine_info.hardware()


def hw(name: str) -> Callable[[EngineView], Any]:
    return lambda e: e.hardware.get(name)


def vllm_version(e: EngineView) -> str:
    import vllm  # the worker has it imported already; never reached on light paths

    return str(vllm.__version__)


def manager_or(attr: str, config_path: tuple[str, str]) -> Callable[[EngineView], Any]:
    """The manager's value (what vLLM sized the cost tables by), else the config's."""

    def read(e: EngineView) -> Any:
        states = getattr(e.manager, "req_states", None)
        if states is not None:
            return int(getattr(states, attr))
        section, name = config_path
        return int(getattr(getattr(e.vllm_config, section), name))

    return read


def num_spec_tokens(e: EngineView) -> int:
    if e.manager is not None:
        return int(e.manager.num_speculative_steps)
    return int(e.vllm_config.speculative_config.num_speculative_tokens)


def capture_sizes(e: EngineView) -> list[int] | None:
    sizes = e.capture_sizes or e.vllm_config.compilation_config.cudagraph_capture_sizes
    return sorted(int(s) for s in sizes) if sizes else None


def config_hash_of(which: str) -> Callable[[EngineView], str | None]:
    def read(e: EngineView) -> str | None:
        cfg = e.vllm_config.model_config if which == "target" else e.vllm_config.speculative_config
        model = getattr(cfg, "model", None)

        directory = resolve_config_dir(model) if model else None
        return config_hash(directory) if directory else None

    return read


def attention_backends(e: EngineView, draft: bool) -> str | None:
    """The backend class vLLM resolved for each attention layer (layer.get_attn_backend()).

    Layers live in compilation_config.static_forward_context, target and drafter
    alike; vLLM's speculator marks the drafter's with ``is_draft_layer``
    (spec_decode/speculator.py). Without that mark, DSpark's numbering decides:
    drafter layers come after the target's (start_layer_id = target layer count).
    """
    layers = e.vllm_config.compilation_config.static_forward_context
    target_layers = int(e.vllm_config.model_config.hf_text_config.num_hidden_layers)
    names = set()
    for layer_name, layer in layers.items():
        get = getattr(layer, "get_attn_backend", None)
        if get is None:
            continue
        mark = getattr(layer, "is_draft_layer", None)
        if mark is None:
            index = _layer_index(layer_name)
            if index is None:
                continue
            mark = index >= target_layers
        if bool(mark) == draft:
            names.add(get().get_name())
    return "+".join(sorted(names)) or None


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def expert_parallel_size(e: EngineView) -> int:
    pc = e.vllm_config.parallel_config
    # vLLM's FusedMoEParallelConfig: with expert parallel, experts spread over tp x dp x pcp ranks.
    if not pc.enable_expert_parallel:
        return 1
    return int(pc.tensor_parallel_size) * int(pc.data_parallel_size) * int(pc.prefill_context_parallel_size)


def hf_overrides(e: EngineView) -> str:
    value = e.vllm_config.model_config.hf_overrides
    if not value:
        return "none"
    if callable(value):
        return f"callable:{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return "sha256:" + hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def section_hash(section: Any) -> str:
    """vLLM's own hash of one VllmConfig section (the factors it keys its compile cache on)."""
    return "sha256:" + str(section.compute_hash())[:16]


def kv_connector(e: EngineView) -> str:
    """The KV connector and its role ("none" without one): vLLM's KVTransferConfig hash has no
    factors, yet a connector saves or loads KV around every step."""
    kv = e.vllm_config.kv_transfer_config
    if kv is None or not kv.kv_connector:
        return "none"
    return f"{kv.kv_connector}:{kv.kv_role}"


def additional_config_hash(e: EngineView) -> str:
    """additional_config as VllmConfig.compute_hash hashes it: a dict as sorted JSON, an object by its
    own compute_hash; "none" when empty."""
    value = e.vllm_config.additional_config
    if not value:
        return "none"
    text = json.dumps(value, sort_keys=True) if isinstance(value, dict) else str(value.compute_hash())
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def enum_value(value: Any) -> str:
    return str(getattr(value, "value", value))


READERS: dict[str, Callable[[EngineView], Any]] = {
    "gpu_name": hw("gpu_name"),
    "gpu_compute_capability": hw("gpu_compute_capability"),
    "gpu_memory_mib": hw("gpu_memory_mib"),
    "driver_version": hw("driver_version"),
    "cuda_version": hw("cuda_version"),
    "torch_version": hw("torch_version"),
    "vllm_version": vllm_version,
    "target_config_hash": config_hash_of("target"),
    "model_revision": lambda e: e.vllm_config.model_config.revision,
    "hf_overrides": hf_overrides,
    "model_impl": lambda e: enum_value(e.vllm_config.model_config.model_impl),
    "draft_config_hash": config_hash_of("draft"),
    "draft_revision": lambda e: e.vllm_config.speculative_config.revision,
    "speculative_method": lambda e: e.vllm_config.speculative_config.method,
    "tensor_parallel_size": lambda e: int(e.vllm_config.parallel_config.tensor_parallel_size),
    "pipeline_parallel_size": lambda e: int(e.vllm_config.parallel_config.pipeline_parallel_size),
    "data_parallel_size": lambda e: int(e.vllm_config.parallel_config.data_parallel_size),
    "expert_parallel_size": expert_parallel_size,
    "decode_context_parallel_size": lambda e: int(e.vllm_config.parallel_config.decode_context_parallel_size),
    "dtype": lambda e: str(e.vllm_config.model_config.dtype).removeprefix("torch."),
    "kv_cache_dtype": lambda e: str(e.vllm_config.cache_config.cache_dtype),
    "kv_block_size": lambda e: int(e.vllm_config.cache_config.block_size),
    "quantization": lambda e: e.vllm_config.model_config.quantization,
    "attention_backend": lambda e: attention_backends(e, draft=False),
    "draft_attention_backend": lambda e: attention_backends(e, draft=True),
    "num_speculative_tokens": num_spec_tokens,
    "max_num_seqs": manager_or("max_num_reqs", ("scheduler_config", "max_num_seqs")),
    "max_num_batched_tokens": manager_or("max_num_batched_tokens", ("scheduler_config", "max_num_batched_tokens")),
    "max_model_len": lambda e: int(e.vllm_config.model_config.max_model_len),
    "cudagraph_capture_sizes": capture_sizes,
    "cudagraph_mode": lambda e: e.vllm_config.compilation_config.cudagraph_mode.name,
    "compilation_hash": lambda e: "sha256:" + e.vllm_config.compilation_config.compute_hash()[:16],
    "attention_config_hash": lambda e: section_hash(e.vllm_config.attention_config),
    "kernel_config_hash": lambda e: section_hash(e.vllm_config.kernel_config),
    "offload_config_hash": lambda e: section_hash(e.vllm_config.offload_config),
    "kv_connector": kv_connector,
    "additional_config_hash": additional_config_hash,
    "cudnn_version": hw("cudnn_version"),
    "flashinfer_version": hw("flashinfer_version"),
}


def describe_engine(manager: Any, capture_sizes: list[int], vllm_config: Any,
                    hardware_facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """{key: value} for every registry key this engine can report (JSON-ready values)."""
    view = EngineView(vllm_config=vllm_config, manager=manager,
                      capture_sizes=tuple(int(s) for s in capture_sizes or ()),
                      hardware=hardware() if hardware_facts is None else hardware_facts)
    return read_keys(view)


def read_keys(view: EngineView) -> dict[str, Any]:
    desc: dict[str, Any] = {}
    for name, read in READERS.items():
        key = KEY[name]
        try:
            value = read(view)
        except Exception:  # noqa: BLE001 - a config shape this vLLM lacks: the key stays unchecked
            continue
        if key.recorded(value):
            desc[key.name] = list(value) if isinstance(value, tuple) else value
    return desc


def gpu_name() -> str:
    """This process's GPU as torch names it ("" without one); cheap, unlike hardware()."""
    try:
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else ""
    except Exception:  # noqa: BLE001
        return ""


def hardware() -> dict[str, Any]:
    """GPU name/capability/memory, driver, CUDA, torch, cuDNN and FlashInfer versions of this process's device."""
    out: dict[str, Any] = {}
    try:
        import torch

        out["torch_version"] = torch.__version__
        out["cuda_version"] = torch.version.cuda or ""
        if torch.cuda.is_available():
            dev = torch.cuda.current_device()
            major, minor = torch.cuda.get_device_capability(dev)
            out["gpu_compute_capability"] = f"{major}.{minor}"
            # MiB: ECC and MIG slices change it, board-to-board noise does not.
            out["gpu_memory_mib"] = int(torch.cuda.get_device_properties(dev).total_memory) // (1 << 20)
    except Exception:  # noqa: BLE001 - no torch / no GPU: leave the keys out
        pass
    out.update(library_builds())
    name = gpu_name()  # the one place the name is read (tests stand in for it here)
    if name:
        out["gpu_name"] = name
    out["driver_version"] = driver_version()
    return out


def library_builds() -> dict[str, str]:
    """The cuDNN torch loads and the FlashInfer vLLM would import ("none" when absent): kernel
    libraries that come as wheels of their own, apart from torch's and vLLM's versions."""
    out: dict[str, str] = {}
    try:
        import torch

        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        out["cudnn_version"] = str(version) if version else "none"
    except Exception:  # noqa: BLE001 - no torch: the key stays unchecked
        pass
    import importlib.util
    from importlib import metadata

    try:
        out["flashinfer_version"] = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:  # a build without the wheel's metadata is still a FlashInfer
        out["flashinfer_version"] = "none" if importlib.util.find_spec("flashinfer") is None else "unknown build"
    return out


def driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001
        pass
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def tp_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and group size (0, 1 when no group exists)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return int(group.rank_in_group), int(group.world_size)
    except Exception:  # noqa: BLE001 - distributed not initialised (tests, single process)
        return 0, 1


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's object on every TP rank, so every rank makes the same decision.

    All ranks must run the same dummy batches (they contain collectives), so a
    table decision taken per rank could deadlock the engine if files differed.
    """
    rank, size = tp_rank_and_size()
    if size <= 1:
        return obj
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().broadcast_object(obj, src=0)


def current_context_len() -> int:
    try:
        import vllm.envs as envs

        return int(envs.VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN)
    except Exception:  # noqa: BLE001
        return int(os.environ.get("VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN", "8192"))

"""Describe the running engine and its hardware, from inside a vLLM worker.

The same keys as the fingerprint (fingerprint.LOAD_CHECKS), so a table can be
checked against the engine key by key. Keys that cannot be determined are left
out; the loader does not check them and names them in its "loaded" log line.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from dspark_calib.fingerprint import config_hash, resolve_config_dir


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def describe_engine(manager: Any, capture_sizes: list[int], vllm_config: Any) -> dict[str, Any]:
    import vllm

    desc: dict[str, Any] = {
        "cudagraph_capture_sizes": [int(s) for s in capture_sizes],
        "num_speculative_tokens": int(manager.num_speculative_steps),
        "max_num_seqs": int(manager.req_states.max_num_reqs),
        "max_num_batched_tokens": int(manager.req_states.max_num_batched_tokens),
        "vllm_version": vllm.__version__,
    }
    name = gpu_name()
    if name:
        desc["gpu_name"] = name
    if vllm_config is not None:
        pc, mc, cc = vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config
        desc["tensor_parallel_size"] = int(pc.tensor_parallel_size)
        desc["pipeline_parallel_size"] = int(pc.pipeline_parallel_size)
        desc["dtype"] = _dtype_name(mc.dtype)
        desc["kv_cache_dtype"] = str(cc.cache_dtype)
        desc["quantization"] = mc.quantization
        for key, model in (("target", mc.model), ("draft", getattr(vllm_config.speculative_config, "model", None))):
            directory = resolve_config_dir(model) if model else None
            if directory:
                desc[f"{key}_config_hash"] = config_hash(directory)
    return desc


def gpu_name() -> str:
    """This process's GPU as torch names it ("" without one); cheap, unlike hardware()."""
    try:
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else ""
    except Exception:  # noqa: BLE001
        return ""


def hardware() -> dict[str, Any]:
    """GPU name/count/capability, driver, CUDA and torch versions of this process's device."""
    out: dict[str, Any] = {}
    try:
        import torch

        out["torch_version"] = torch.__version__
        out["cuda_version"] = torch.version.cuda or ""
        if torch.cuda.is_available():
            dev = torch.cuda.current_device()
            out["gpu_name"] = torch.cuda.get_device_name(dev)
            major, minor = torch.cuda.get_device_capability(dev)
            out["gpu_compute_capability"] = f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - no torch / no GPU: leave the keys out
        pass
    out["driver_version"] = driver_version()
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

"""Describe the running engine and its hardware, from inside a vLLM worker.

describe_engine walks the fingerprint registry (fingerprint.KEYS): every key with
a reader is read from vLLM's own objects, so a table is checked against the engine
key by key. A key whose reader fails or finds nothing is left out; the loader does
not check it and names it in its log line (fingerprint.unchecked_keys).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from dspark_calib.engine_readers import EngineView
from dspark_calib.fingerprint import KEYS


def describe_engine(manager: Any, capture_sizes: list[int], vllm_config: Any,
                    hardware_facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """{key: value} for every registry key this engine can report (JSON-ready values)."""
    view = EngineView(vllm_config=vllm_config, manager=manager,
                      capture_sizes=tuple(int(s) for s in capture_sizes or ()),
                      hardware=hardware() if hardware_facts is None else hardware_facts)
    return read_keys(view)


def read_keys(view: EngineView) -> dict[str, Any]:
    desc: dict[str, Any] = {}
    for key in KEYS:
        if key.read is None:
            continue
        try:
            value = key.read(view)
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
    """GPU name/capability/memory, driver, CUDA and torch versions of this process's device."""
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
    name = gpu_name()  # the one place the name is read (tests stand in for it here)
    if name:
        out["gpu_name"] = name
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

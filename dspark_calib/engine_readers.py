"""How each fingerprint key is read from a running vLLM engine (the registry's readers).

Plain attribute walks over vLLM's own objects (VllmConfig, the adaptive
verification manager) plus hardware facts gathered by engine_info inside the
worker, so tests can run every reader on a real VllmConfig built on CPU. Nothing
here imports torch or vllm at module level: fingerprint.py imports this module on
light paths (inspect, diff, check).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


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
        from dspark_calib.fingerprint import config_hash, resolve_config_dir

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


def enum_value(value: Any) -> str:
    return str(getattr(value, "value", value))

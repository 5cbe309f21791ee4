"""The engine a `vllm serve` command line starts, by vLLM's documented defaults, without vLLM.

`check` answers for an engine; an operator knows the engine by its `vllm serve` flags, and
most of the keys the load decision compares are the defaults vLLM fills for flags left out.
With vLLM installed, the wing resolves the flags through vLLM's own classes
(``vllm/engine_args.py``); without it, this module applies the defaults vLLM 0.33
documents: max_model_len from the model config, ``--dtype auto`` as the config's
torch_dtype, max_num_seqs and max_num_batched_tokens by the GPU's memory as `vllm serve`
fills them, the profiled context from VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN.

A key whose default depends on a GPU fact that was not given (memory, compute capability),
or on something only the running engine resolves, is left out: the load decision then
names it unchecked and `check` says it is decided at start. Nothing here imports vllm.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dspark_calib.env import is_decimal
from dspark_calib.errors import CalibError

PROFILE_CONTEXT_ENV = "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN"
DEFAULT_PROFILE_CONTEXT = 8192
GIB_MIB = 1024
# The GPU facts an operator gives (check's options), keyed as the fingerprint names them.
HARDWARE_KEYS = ("gpu_name", "gpu_compute_capability", "gpu_memory_mib", "driver_version", "cuda_version",
                 "torch_version")
# vLLM's tiers for `vllm serve` (EngineArgs.get_batch_defaults, OPENAI_API_SERVER):
# (least memory in GiB, max_num_batched_tokens, max_num_seqs); an A100 stays on the small tier.
SERVE_TIERS = ((160, 16384, 1024), (70, 8192, 1024), (0, 2048, 256))
# vLLM's human-readable sizes: 32k is 32000, 32K is 32768
HUMAN_SCALE = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}
DTYPE_NAMES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
               "float32": "float32"}


@dataclass(frozen=True)
class Resolved:
    """The engine dict the load decision checks, vLLM's profiled context, and one line saying how."""

    engine: dict[str, Any]
    vllm_context_len: int
    how: str


def profile_context(environ: Mapping[str, str] | None = None) -> int:
    """VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN as vLLM reads it (default 8192)."""
    raw = (os.environ if environ is None else environ).get(PROFILE_CONTEXT_ENV, "").strip()
    if not raw:
        return DEFAULT_PROFILE_CONTEXT
    if not is_decimal(raw) or int(raw) < 1:
        raise CalibError(f"{PROFILE_CONTEXT_ENV}={raw[:40]!r}: must be a positive integer")
    return int(raw)


def strip_command(argv: Sequence[str]) -> list[str]:
    """The flags without a leading `vllm serve` (a pasted command line works as it is)."""
    args = list(argv)
    if args[:1] == ["vllm"]:
        args = args[1:]
    if args[:1] == ["serve"]:
        args = args[1:]
    return args


def serve_tier(memory_mib: int, gpu_name: str = "") -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) `vllm serve` fills on a GPU with this memory."""
    for least_gib, tokens, seqs in SERVE_TIERS:
        small = least_gib == 70 and "a100" in gpu_name.lower()
        if memory_mib >= least_gib * GIB_MIB and not small:
            return tokens, seqs
    return SERVE_TIERS[-1][1:]


# flag -> (destination, takes a value); vLLM's spellings, short forms included
_FLAGS = {
    "--model": ("model", True), "--speculative-config": ("speculative_config", True),
    "-sc": ("speculative_config", True),
    "--tensor-parallel-size": ("tp", True), "-tp": ("tp", True),
    "--pipeline-parallel-size": ("pp", True), "-pp": ("pp", True),
    "--data-parallel-size": ("dp", True), "-dp": ("dp", True),
    "--decode-context-parallel-size": ("dcp", True), "-dcp": ("dcp", True),
    "--enable-expert-parallel": ("ep", False), "-ep": ("ep", False),
    "--max-num-seqs": ("max_num_seqs", True), "--max-num-batched-tokens": ("max_num_batched_tokens", True),
    "--max-model-len": ("max_model_len", True), "--dtype": ("dtype", True),
    "--kv-cache-dtype": ("kv_cache_dtype", True), "--block-size": ("block_size", True),
    "--quantization": ("quantization", True), "-q": ("quantization", True),
    "--model-impl": ("model_impl", True),
}


def parse_flags(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """({destination: value} for the flags this module knows, the flags it does not)."""
    given: dict[str, Any] = {}
    unknown: list[str] = []
    args = strip_command(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        flag = _FLAGS.get(name.replace("_", "-") if name.startswith("--") else name)
        if not arg.startswith("-"):
            if "model" in given:
                raise CalibError(f"serve flags: a second model {arg[:60]!r}")
            given["model"] = arg
        elif flag is None:
            unknown.append(name)
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1  # its value
        elif not flag[1]:
            given[flag[0]] = True
        elif eq:
            given[flag[0]] = inline
        elif i + 1 < len(args):
            given[flag[0]] = args[i + 1]
            i += 1
        else:
            raise CalibError(f"serve flags: {name} needs a value")
        i += 1
    return given, unknown


def _int(given: Mapping[str, Any], key: str, flag: str) -> int | None:
    raw = given.get(key)
    if raw is None:
        return None
    text = str(raw).strip()
    scale = HUMAN_SCALE.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not is_decimal(digits) or int(digits) < 1:
        raise CalibError(f"serve flags: {flag} {str(raw)[:40]!r} must be a positive integer")
    return int(digits) * scale


def _config(model: str) -> dict:
    from dspark_calib.fingerprint import resolve_config_dir
    from dspark_calib.safe_open import read_json_file

    directory = resolve_config_dir(model)
    if directory is None:
        raise CalibError("no config.json here (a local model directory is needed)", path=model)
    data = read_json_file(os.path.join(directory, "config.json"))
    if not isinstance(data, dict):
        raise CalibError("config.json is not a JSON object", path=model)
    return data


def _speculative(raw: Any) -> dict:
    try:
        spec = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        raise CalibError(f"serve flags: --speculative-config is not JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise CalibError("serve flags: --speculative-config must be a JSON object")
    return spec


# Methods vLLM keeps as given; any other (none, draft_model, mtp, ...) it may re-detect from the
# drafter's path and architectures (SpeculativeConfig.__post_init__: "eagle3" in the path makes a
# draft_model an eagle3 head), which only vLLM's own resolution can answer.
KEPT_METHODS = ("eagle", "eagle3", "dflash", "dspark")


def speculative_method(spec: Mapping[str, Any]) -> str | None:
    """The method vLLM resolves from a --speculative-config, where it keeps the one given; None
    (decided at start) where it detects one."""
    method = spec.get("method")
    return method if method in KEPT_METHODS else None


def resolve(argv: Sequence[str], hardware: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Resolved:
    """The engine `vllm serve ARGV` starts on a GPU with these facts, by vLLM's documented defaults."""
    from dspark_calib.fingerprint import config_hash, resolve_config_dir

    given, unknown = parse_flags(argv)
    model = given.get("model")
    if not model:
        raise CalibError("serve flags: no model (vllm serve MODEL ...)")
    config = _config(model)
    engine: dict[str, Any] = {k: v for k, v in hardware.items() if k in HARDWARE_KEYS and v not in (None, "")}
    engine["target_config_hash"] = config_hash(resolve_config_dir(model) or model)
    spec = _speculative(given["speculative_config"]) if "speculative_config" in given else {}
    if spec.get("model"):
        engine["draft_config_hash"] = config_hash(resolve_config_dir(str(spec["model"])) or str(spec["model"]))
    if isinstance(spec.get("num_speculative_tokens"), int):
        engine["num_speculative_tokens"] = spec["num_speculative_tokens"]
    method = speculative_method(spec)
    if method:
        engine["speculative_method"] = method
    sizes = {k: _int(given, k, f) or 1 for k, f in (("tp", "-tp"), ("pp", "-pp"), ("dp", "-dp"), ("dcp", "-dcp"))}
    engine.update(tensor_parallel_size=sizes["tp"], pipeline_parallel_size=sizes["pp"],
                  data_parallel_size=sizes["dp"], decode_context_parallel_size=sizes["dcp"],
                  expert_parallel_size=sizes["tp"] * sizes["dp"] if given.get("ep") else 1)
    engine["dtype"] = _dtype(str(given.get("dtype", "auto")), config)
    engine["kv_cache_dtype"] = str(given.get("kv_cache_dtype", "auto"))
    engine["model_impl"] = str(given.get("model_impl", "auto"))
    engine["hf_overrides"] = "none"
    quant = given.get("quantization") or (config.get("quantization_config") or {}).get("quant_method")
    engine["quantization"] = quant or None
    block = _int(given, "block_size", "--block-size")
    if block:
        engine["kv_block_size"] = block
    fit_to_memory = str(given.get("max_model_len", "")).strip().lower() in ("-1", "auto")
    if fit_to_memory:  # vLLM fits it to the GPU's free memory when the engine starts: decided at start
        given = {k: v for k, v in given.items() if k != "max_model_len"}
    max_model_len = None if fit_to_memory else (_int(given, "max_model_len", "--max-model-len")
                                               or config.get("max_position_embeddings"))
    if isinstance(max_model_len, int):
        engine["max_model_len"] = max_model_len
    engine.update(_batch_sizes(given, hardware, engine.get("max_model_len")))
    how = "resolved by vLLM's documented defaults (vLLM not installed here)"
    if unknown:
        shown = ", ".join(unknown[:4]) + (f" (+{len(unknown) - 4} more)" if len(unknown) > 4 else "")
        how += f"; not understood without vLLM: {shown}"
    return Resolved(engine, profile_context(environ), how)


def _dtype(flag: str, config: Mapping[str, Any]) -> str:
    if flag != "auto":
        return DTYPE_NAMES.get(flag, flag)
    declared = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").removeprefix("torch.")
    return "bfloat16" if declared == "float32" else DTYPE_NAMES.get(declared, declared)


def model_dtype(flag: str, model: str | None) -> str | None:
    """--dtype as vLLM resolves it for this model (auto without a model: not known, None)."""
    if flag == "auto" and model is None:
        return None
    return _dtype(flag, _config(model) if flag == "auto" and model is not None else {})


def _batch_sizes(given: Mapping[str, Any], hardware: Mapping[str, Any], max_model_len: Any) -> dict[str, int]:
    """max_num_batched_tokens and max_num_seqs as `vllm serve` fills them (chunked prefill on):
    a size the flags leave out needs the GPU's memory, else it is left out."""
    tokens = _int(given, "max_num_batched_tokens", "--max-num-batched-tokens")
    seqs = _int(given, "max_num_seqs", "--max-num-seqs")
    memory = hardware.get("gpu_memory_mib")
    if (tokens is None or seqs is None) and isinstance(memory, int):
        tier_tokens, tier_seqs = serve_tier(memory, str(hardware.get("gpu_name") or ""))
        if tokens is None:
            tokens = tier_tokens
            if seqs is None:
                seqs = tier_seqs
            if isinstance(max_model_len, int):
                tokens = min(seqs * max_model_len, tokens)
        elif seqs is None:
            seqs = tier_seqs
        if _int(given, "max_num_seqs", "--max-num-seqs") is None:
            seqs = min(seqs, tokens)
    return {k: v for k, v in (("max_num_batched_tokens", tokens), ("max_num_seqs", seqs)) if v is not None}

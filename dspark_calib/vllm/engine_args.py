"""The engine a `vllm serve` command line starts, resolved by vLLM's own classes on a machine without a GPU.

`check` must give the engine's answer, and the engine is what vLLM makes of its flags:
the serve parser, ``EngineArgs.create_engine_config`` (the defaults `vllm serve` fills, the
CUDA platform's config rules, the compilation and CUDA-graph settings) and then the same
READERS a worker applies (engine_info.describe_engine). Those need a CUDA platform, so
vLLM's own CUDA platform class stands in, answering the device questions (name, memory,
compute capability) from the GPU facts the operator gave; a default that depends on a
fact not given is left out, and the load decision names it unchecked. What only the
running engine knows (the attention backend each layer resolves, the hardware and
library builds of the serving host) stays with the options.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Any, Iterator, Mapping, Sequence

from dspark_calib.errors import CalibError
from dspark_calib.serve_args import HARDWARE_KEYS, Resolved, profile_context, strip_command

# Keys a default for them depends on the GPU's memory (vLLM's serve tiers) or on its compute
# capability (the attention backend the platform picks, which sizes KV blocks and compiles kernels).
NEEDS_MEMORY = ("max_num_seqs", "max_num_batched_tokens", "cudagraph_capture_sizes", "compilation_hash")
NEEDS_CAPABILITY = ("kv_block_size", "cudagraph_mode", "compilation_hash")
_KERNELS = "vllm._C_stable_libtorch"  # imported by vLLM's CUDA platform module; needs libcuda
SERVING_HOST_GPUS = 64  # vLLM checks the world size against the GPUs present: the serving host has them


def resolve(argv: Sequence[str], hardware: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Resolved:
    """The engine `vllm serve ARGV` starts on a GPU with these facts, as vLLM resolves it."""
    env = dict(os.environ if environ is None else environ)
    # A GPU host has Triton and picks the V2 model runner, the only one with adaptive verification.
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    env["VLLM_LOGGING_LEVEL"] = "ERROR"  # vLLM logs to stdout: check's output (and --json) stays check's
    facts = {k: v for k, v in hardware.items() if k in HARDWARE_KEYS and v not in (None, "")}
    with resolving(env, facts):
        config, args = _engine_config(strip_command(argv))
        from dspark_calib.vllm.engine_info import describe_engine

        engine = describe_engine(None, [], config, hardware_facts=facts)
    dropped = _unknown_without_facts(facts, args)
    for key in dropped:
        engine.pop(key, None)
    how = "resolved through vLLM's EngineArgs -> VllmConfig (vLLM " + str(engine.get("vllm_version", "?")) + ")"
    if dropped:
        how += f"; left to the engine (GPU facts not given): {', '.join(dropped)}"
    return Resolved(engine, profile_context(env), how)


@contextlib.contextmanager
def resolving(env: Mapping[str, str], facts: Mapping[str, Any]) -> Iterator[None]:
    """Everything vLLM's config classes need to resolve serve flags here as on the GPU host: its
    environment, its logging quiet, the stand-in CUDA platform with these facts, the kernel-bound
    constants and no write to its model cache; all as they were afterwards."""
    with _environment(env), _quiet_vllm(), _stand_in_platform(facts), _kernel_free_constants(), _no_modelinfo_write():
        yield


def _unknown_without_facts(facts: Mapping[str, Any], args: Any) -> list[str]:
    """Keys whose value vLLM took from a GPU fact that was not given (the stand-in's guess)."""
    out: list[str] = []
    defaulted = [k for k in ("max_num_seqs", "max_num_batched_tokens") if getattr(args, k) is None]
    if "gpu_memory_mib" not in facts and defaulted:  # the sizes, and what vLLM derives from them
        out += [k for k in NEEDS_MEMORY if k in defaulted or k not in ("max_num_seqs", "max_num_batched_tokens")]
    if "gpu_compute_capability" not in facts:
        out += [k for k in NEEDS_CAPABILITY if k not in out and not (k == "kv_block_size" and args.block_size)]
    if str(getattr(args, "max_model_len", "")).strip().lower() in ("-1", "auto"):
        out.append("max_model_len")  # vLLM fits it to the GPU's free memory when the engine starts
    return out


def _engine_config(argv: list[str]) -> tuple[Any, Any]:
    """(VllmConfig, the EngineArgs as parsed, before vLLM filled its defaults): vLLM's serve parser,
    then create_engine_config as `vllm serve` calls it. vLLM's refusals are the user's input errors."""
    import copy

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        ns = parser.parse_args(argv)
    except SystemExit:
        raise CalibError(f"serve flags: vLLM's serve parser refused {' '.join(argv)[:200]!r}") from None
    if getattr(ns, "model_tag", None) is not None:
        ns.model = ns.model_tag
    args = AsyncEngineArgs.from_cli_args(ns)
    given = copy.copy(args)
    try:
        config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    except Exception as exc:  # noqa: BLE001 - vLLM's own refusal of these flags: one line
        text = " ".join(str(exc).split())
        raise CalibError(f"serve flags: vLLM refuses them: {type(exc).__name__}: {text[:300]}") from None
    return config, given


# Modules vLLM's config code imports for one constant table, whose import needs the CUDA
# kernels (torch.ops._C): the table is read from the module's source instead.
KERNEL_BOUND_CONSTANTS = {"vllm.compilation.passes.fusion.allreduce_rms_fusion": "FI_ALLREDUCE_FUSION_MAX_SIZE_MB"}


@contextlib.contextmanager
def _kernel_free_constants() -> Iterator[None]:
    """Each KERNEL_BOUND_CONSTANTS module that cannot be imported here stands as a module holding
    just its constant (a literal in vLLM's source), removed again afterwards."""
    import ast
    import importlib
    import importlib.util

    placed = []
    for name, constant in KERNEL_BOUND_CONSTANTS.items():
        try:
            importlib.import_module(name)
            continue
        except Exception:  # noqa: BLE001 - no CUDA kernels on this machine
            pass
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            continue
        with open(spec.origin, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in tree.body:
            target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
            if isinstance(target, ast.Name) and target.id == constant and node.value is not None:
                module = types.ModuleType(name)
                setattr(module, constant, ast.literal_eval(node.value))
                sys.modules[name] = module
                placed.append(name)
    try:
        yield
    finally:
        for name in placed:
            sys.modules.pop(name, None)


@contextlib.contextmanager
def _no_modelinfo_write() -> Iterator[None]:
    """vLLM inspects a model class it has no cached record of in a subprocess (this machine's own
    platform), then writes the record to its cache through its model loader, whose attention
    layers import the CUDA flash-attention extension under the stand-in CUDA platform: on a machine
    without CUDA that import fails and vLLM reports the architecture as not inspectable. check needs
    vLLM's answer, not its cache: the write is skipped while check resolves."""
    from vllm.model_executor.models import registry

    lazy = getattr(registry, "_LazyRegisteredModel", None)
    save = getattr(lazy, "_save_modelinfo_to_cache", None)
    if save is None:  # a vLLM without this cache write: nothing to skip
        yield
        return
    lazy._save_modelinfo_to_cache = lambda self, mi, module_hash: None
    try:
        yield
    finally:
        lazy._save_modelinfo_to_cache = save


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM's loggers at ERROR while it resolves, and its logging left unconfigured."""
    import logging

    from vllm.engine import arg_utils

    logger = logging.getLogger("vllm")
    level, configure = logger.level, arg_utils.configure_logging_if_needed
    logger.setLevel(logging.ERROR)
    # create_engine_config configures vLLM's logging for the process it starts; this is check's process
    arg_utils.configure_logging_if_needed = lambda config: None
    try:
        yield
    finally:
        logger.setLevel(level)
        arg_utils.configure_logging_if_needed = configure


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ as the serving process would see it (vLLM reads its settings from there)."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def _cuda_platform_class() -> type:
    """vLLM's CUDA platform class (NonNvml: it asks torch, which the stand-in answers instead)."""
    stub = _KERNELS not in sys.modules
    if stub:  # its kernels need libcuda; the config rules do not
        sys.modules[_KERNELS] = types.ModuleType(_KERNELS)
    try:
        from vllm.platforms.cuda import NonNvmlCudaPlatform
    finally:
        if stub:
            sys.modules.pop(_KERNELS, None)
    return NonNvmlCudaPlatform


@contextlib.contextmanager
def _stand_in_platform(facts: Mapping[str, Any]) -> Iterator[None]:
    """vLLM's current platform is the CUDA one, answering device questions from `facts` (compute
    capability 9.0 when not given: the keys it decides are then left to the engine, NEEDS_CAPABILITY)."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import DeviceCapability

    base = _cuda_platform_class()
    capability = str(facts.get("gpu_compute_capability") or "9.0")
    major, _, minor = capability.partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
        raise CalibError(f"gpu_compute_capability {capability[:20]!r}: expected MAJOR.MINOR, e.g. 9.0")
    memory = facts.get("gpu_memory_mib")

    class StandIn(base):  # type: ignore[misc, valid-type]
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            return DeviceCapability(int(major), int(minor or 0))

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return str(facts.get("gpu_name") or "")

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            if not isinstance(memory, int):
                raise RuntimeError("GPU memory not given")  # vLLM falls back to its small tier; dropped after
            return memory << 20

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            return SERVING_HOST_GPUS

    previous = platforms.current_platform  # resolved now if it was not: restored below
    stand_in = StandIn()
    # modules that bound vLLM's platform object at import time see the stand-in too
    holders = [m for m in list(sys.modules.values()) if m is not None
               and getattr(m, "__dict__", {}).get("current_platform") is previous]
    platforms._current_platform = stand_in
    for module in holders:
        module.current_platform = stand_in
    try:
        yield
    finally:
        platforms._current_platform = previous
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, "__dict__", {}).get("current_platform") is stand_in:
                module.current_platform = previous

"""`dspark-calib profile` with the vLLM backend: the driver on the CLI side.

Starts vLLM offline (LLM) with DSpark + adaptive verification on the V2 model
runner and the plugin in capture mode. vLLM's own capture_model then replays our
extended batches_to_profile under CUDA graphs; the plugin writes TP rank 0's
tagged samples to a capture directory, which we fit into a table.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable

from dspark_calib.errors import PREFIX, CalibError, exception_line, first_line
from dspark_calib.fingerprint import check_model_dtype
from dspark_calib.fit import profile_context_len
from dspark_calib.speculators import DSPARK, speculator
from dspark_calib.table.model import CostTable
from dspark_calib import env as E
from dspark_calib.vllm.capture import CaptureDir, CaptureError
from dspark_calib.vllm.gpu_state import check_cooldown, check_settle, check_state
from dspark_calib.vllm.plugin import RAY_EXTRA_PREFIXES, RAY_EXTRA_VARS
from dspark_calib.vllm.profile.plan import ProfileOptions, default_contexts
from dspark_calib.vllm.profile.table import table_from_capture

# dspark-calib is on no package index: the vLLM extra installs from the checkout.
INSTALL_HINT = "in the dspark-calib checkout, pip install '.[vllm]'"
# Where a GPU shows without importing torch (seconds) or vllm (tens of seconds).
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
DEV = "/dev"


OWNED_ARGS = {
    "model": "--model", "tensor_parallel_size": "--tp", "load_format": "--load-format", "dtype": "--dtype",
    "kv_cache_dtype": "--kv-cache-dtype", "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens", "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization", "seed": "--seed", "quantization": "--quantization",
    "distributed_executor_backend": "--distributed-executor-backend",
}
OWNED_SPEC = ("method", "model", "num_speculative_tokens", "enable_adaptive_verification")


def read_config(model: str, role: str) -> dict[str, Any]:
    path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise CalibError(f"{role} must be a local model directory with a config.json", path=model)
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise CalibError(f"no config.json in this {role} directory", path=model) from None
    except (OSError, ValueError) as exc:
        raise CalibError(f"unreadable config.json ({exc})", path=path) from None


def resolve_model(model: str, option: str) -> tuple[str, str | None]:
    """(local directory, hub id or None): a directory as given, else a Hugging Face id's
    snapshot in the local cache. Profiling never downloads: one line says it is not there."""
    if os.path.isdir(model) or os.path.exists(model):
        return model, None
    looks_like_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_id:
        raise CalibError(f"{option} {model}: no such directory")
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        raise CalibError(f"{option} {model}: no such directory (and huggingface_hub is not installed to "
                         "look in the Hugging Face cache)") from None
    try:
        hit = try_to_load_from_cache(model, "config.json")
    except Exception as exc:  # noqa: BLE001 - a malformed id: say so in one line
        raise CalibError(f"{option} {model}: not a directory nor a Hugging Face model id "
                         f"({first_line(exc, 120)})") from None
    if not isinstance(hit, str):
        raise CalibError(f"{option} {model}: not a directory, and not in the local Hugging Face cache "
                         f"({HF_HUB_CACHE}); fetch it first: huggingface-cli download {model} config.json")
    return os.path.dirname(hit), model


def check_models(opts: ProfileOptions) -> tuple[dict, dict, int | None]:
    """Both configs, and the number of drafts the drafter's config says it was made for."""
    target = read_config(opts.model, "target model")
    draft = read_config(opts.draft, "draft model")
    drafts = speculator(opts.method).check_drafter(draft, opts.draft)
    return target, draft, drafts


def resolve_options(opts: ProfileOptions) -> ProfileOptions:
    """Fill defaults that depend on the model configs; refuse impossible settings."""
    target, _, drafts = check_models(opts)
    try:  # the CLI checked it already; a library caller gets the same one line, as a CalibError
        check_cooldown(opts.cooldown_s)
        check_settle(opts.settle_s)
        check_state(opts.gpu_state)
    except ValueError as exc:
        raise CalibError(str(exc)) from None
    if opts.num_speculative_tokens is None:
        if opts.method != DSPARK:
            raise CalibError(f"--num-speculative-tokens is needed for --method {opts.method} (vLLM has no "
                             "default for its drafter)")
        opts.num_speculative_tokens = drafts or 7
    limit = int(target.get("max_position_embeddings") or 1 << 20)
    # vLLM spreads a profile batch over min(tokens, max_num_seqs) requests, so the largest
    # batch has ceil(max_num_batched_tokens / requests) query tokens per request, and vLLM
    # clamps the dummy context to max_model_len - query_len (fit.profile_context_len).
    query_len = -(-opts.max_num_batched_tokens // min(opts.max_num_seqs, opts.max_num_batched_tokens))
    # max_model_len is a checked key (EQUAL): left unset, vLLM derives it from the model config
    # exactly as `vllm serve` does, so a table made and served with defaults agree.
    max_len = limit if opts.max_model_len is None else opts.max_model_len
    source = "from the model config" if opts.max_model_len is None else "from --max-model-len"
    if not opts.context_lens:
        opts.context_lens = default_contexts(max_len, query_len)
        if not opts.context_lens:
            raise CalibError(f"max_model_len {max_len} {source} leaves no context to profile after the "
                             f"{query_len} query tokens of the largest batch")
    longest = max(opts.context_lens)
    need = longest + query_len
    got = profile_context_len(longest, max_len, query_len)
    if got < longest:
        raise CalibError(f"--context-len {longest} would be profiled by vLLM at {got} (max_model_len {max_len} "
                         f"{source} - {query_len} query tokens); refusing: use --context-len <= {got}"
                         + (f" or --max-model-len >= {need}" if need <= limit else "")
                         + f" (model limit {limit})")
    return opts


def engine_kwargs(opts: ProfileOptions) -> dict[str, Any]:
    """Keyword arguments for vllm.LLM / EngineArgs (the same names)."""
    kw: dict[str, Any] = dict(
        model=opts.model,
        speculative_config={
            "method": opts.method,
            "model": opts.draft,
            "num_speculative_tokens": opts.num_speculative_tokens,
            "enable_adaptive_verification": True,
        },
        tensor_parallel_size=opts.tp,
        load_format=opts.load_format,
        dtype=opts.dtype,
        kv_cache_dtype=opts.kv_cache_dtype,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        seed=opts.seed,
        # dummy weights need only config.json; no tokenizer either
        skip_tokenizer_init=True,
    )
    if opts.max_model_len is not None:
        kw["max_model_len"] = opts.max_model_len
    if opts.quantization:
        kw["quantization"] = opts.quantization
    if opts.distributed_executor_backend:
        kw["distributed_executor_backend"] = opts.distributed_executor_backend
    extra = dict(opts.extra_engine_args)
    spec = extra.pop("speculative_config", None) or {}
    kw["speculative_config"] = {**spec, **kw["speculative_config"]}  # ours win (OWNED_SPEC refused earlier)
    kw.update(extra)
    return kw


def check_engine_args(extra: dict[str, Any]) -> None:
    """Every --engine-arg key is an EngineArgs field of the installed vLLM, and not one
    `profile` sets itself; one line naming the key otherwise. Values are vLLM's to judge."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for key, value in extra.items():
        if key not in known:
            close = sorted(k for k in known if key.split("_")[0] in k)[:4]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise CalibError(f"--engine-arg {key}: not a vLLM EngineArgs field{hint}")
        if key in OWNED_ARGS:
            raise CalibError(f"--engine-arg {key}: set it with {OWNED_ARGS[key]}")
        if key == "speculative_config":
            if not isinstance(value, dict):
                raise CalibError("--engine-arg speculative_config: must be a JSON object")
            taken = [k for k in value if k in OWNED_SPEC]
            if taken:
                raise CalibError(f"--engine-arg speculative_config: {', '.join(taken)} is set by profile "
                                 "(--draft, --num-speculative-tokens)")


def check_dtypes(opts: ProfileOptions) -> None:
    """--dtype / --kv-cache-dtype among vLLM's own choices (its Literal types), before the engine starts."""
    import typing

    from vllm.config.cache import CacheDType, get_kv_cache_dtype_handler
    from vllm.config.model import ModelDType

    dtypes = typing.get_args(ModelDType)
    if opts.dtype not in dtypes:
        raise CalibError(f"--dtype {opts.dtype!r} is not one of vLLM's: {', '.join(dtypes)}")
    kv = typing.get_args(CacheDType)
    if opts.kv_cache_dtype not in kv and get_kv_cache_dtype_handler(opts.kv_cache_dtype) is None:
        raise CalibError(f"--kv-cache-dtype {opts.kv_cache_dtype!r} is not one of vLLM's: {', '.join(kv)}")


def engine_env(capture_dir: str) -> dict[str, str]:
    env = {
        "VLLM_USE_V2_MODEL_RUNNER": "1",  # adaptive verification lives in the V2 runner
        E.CAPTURE: capture_dir,
    }
    # The engine core runs in its own process at every tp, as under `vllm serve` (vLLM's
    # default): vLLM times host work inside each step's window, so nothing of the CLI (its
    # progress bar, the watcher thread) may share the timed process. Errors come back
    # through the capture directory (refusal.txt). VLLM_ENABLE_V1_MULTIPROCESSING=0 set by
    # the user still runs it in process (debugging); it is left as the user set it.
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "dspark_calib" not in plugins.split(","):
        env["VLLM_PLUGINS"] = ",".join(p for p in (plugins, "dspark_calib") if p)
    # The V2 sampler imports flashinfer unless told not to; find_spec does not import it.
    if importlib.util.find_spec("flashinfer") is None and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


def vllm_installed() -> bool:
    """Whether `import vllm` can find it, without importing it."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["vllm"] is None (blocked)
        return False


def visible_gpus() -> int | None:
    """GPUs this process may use, from the driver's files (no torch, no vllm); None when this
    host's kind of GPU cannot be told apart from none that way (ROCm, WSL): torch decides later."""
    names = os.listdir(NVIDIA_GPUS) if os.path.isdir(NVIDIA_GPUS) else []
    if not names:
        try:
            names = [n for n in os.listdir(DEV) if n.startswith("nvidia") and n[6:].isdigit()]
        except OSError:
            names = []
    if not names:
        if any(os.path.exists(os.path.join(DEV, n)) for n in ("kfd", "dxg")):
            return None
        return _nvidia_smi_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(names)
    wanted = [v for v in visible.split(",") if v.strip()]
    return 0 if not wanted or wanted[0].strip().startswith("-") else min(len(names), len(wanted))


def _nvidia_smi_count() -> int:
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def check_before_import(opts: ProfileOptions) -> None:
    """What can be refused before vllm and torch are imported (tens of seconds): the model
    dtype, vLLM's presence, the GPUs. A Ray cluster's GPUs may be on other nodes: not counted."""
    check_model_dtype(opts.dtype, "--dtype")
    if not vllm_installed():
        raise CalibError(f"vllm is not installed: {INSTALL_HINT}")
    if opts.distributed_executor_backend == "ray":
        return
    found = visible_gpus()
    if found == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={hidden!r} hides them" if hidden is not None and os.path.isdir(NVIDIA_GPUS) \
            else f"no NVIDIA driver: no {NVIDIA_GPUS}, {DEV}/nvidia* or nvidia-smi"
        raise CalibError(f"no GPU visible ({why}); profiling needs the GPUs the engine will serve on")
    if found is not None and found < opts.tp:
        raise CalibError(f"--tp {opts.tp} needs {opts.tp} GPUs, {found} visible "
                         "(use --distributed-executor-backend ray across nodes)")


def preflight(opts: ProfileOptions) -> None:
    check_before_import(opts)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise CalibError(f"vllm is not installed: {INSTALL_HINT}") from None
    from dspark_calib.vllm.shape import SUPPORTED_VLLM, detect

    shape = detect()
    if not shape.supported:
        raise CalibError(f"vLLM {shape.vllm_version} is not supported by this dspark-calib ({shape.reason}); "
                         f"supported: vllm{SUPPORTED_VLLM}")
    check_dtypes(opts)
    check_engine_args(opts.extra_engine_args)
    import torch

    if not torch.cuda.is_available():
        raise CalibError("no CUDA GPU visible: profiling needs the GPUs the engine will serve on")
    if opts.distributed_executor_backend != "ray" and torch.cuda.device_count() < opts.tp:
        raise CalibError(f"--tp {opts.tp} needs {opts.tp} GPUs, {torch.cuda.device_count()} visible "
                         "(use --distributed-executor-backend ray across nodes)")


def explain_failure(exc: BaseException, capture: CaptureDir | str, log_path: str | None = None) -> CalibError:
    refusal = (capture if isinstance(capture, CaptureDir) else CaptureDir(capture)).read_refusal()
    if refusal and refusal.startswith(PREFIX):  # the capture's own line, from the engine core
        return CalibError(refusal.removeprefix(PREFIX))
    if refusal:
        return CalibError(f"vLLM refused adaptive verification: {refusal}")
    chain: BaseException | None = exc
    text = f"{type(exc).__name__}: {exc}"
    while chain is not None:  # vLLM wraps worker errors; the cause holds the real text
        if isinstance(chain, CaptureError):  # the plugin's own one line (raised here only when in process)
            return CalibError(first_line(chain, 400).removeprefix(PREFIX))
        text += f" | {type(chain).__name__}: {chain}"
        chain = chain.__cause__ or chain.__context__
    low = text.lower()
    if "adaptive verification" in low:
        line = next((ln for ln in text.split(" | ") if "daptive verification" in ln), text)
        return CalibError(f"vLLM refused adaptive verification: {line.split(': ', 1)[-1].splitlines()[0]}")
    if "out of memory" in low or "outofmemory" in low or "no available memory for the cache" in low:
        return CalibError("out of GPU memory while starting the engine: lower --max-num-seqs, "
                          "--max-num-batched-tokens or --max-model-len, or raise/lower --gpu-memory-utilization")
    return CalibError(f"vLLM engine failed during start-up/profiling ({exception_line(exc, 300)}); "
                      "no table written (details in " + (log_path or "vLLM's log above") + ")")


def _watch_progress(capture: CaptureDir, report: Callable[[dict], None], stop: threading.Event) -> None:
    while not stop.wait(0.25):
        state = capture.read_progress()
        if state is not None:
            report(state)


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    for obj in (core, engine):
        fn = getattr(obj, "shutdown", None)
        if callable(fn):
            try:
                fn()
            except Exception:  # noqa: BLE001 - the table is already safe; shutdown noise is not the user's problem
                pass
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001
        pass


def engine_in_process(opts: ProfileOptions, env: dict[str, str]) -> bool:
    """tp 1, vLLM's "uni" executor and V1 multiprocessing turned off by the user: the worker is
    this process (never by default: the engine core runs in a child process)."""
    extra = opts.extra_engine_args
    single = all(int(extra.get(k) or 1) == 1 for k in ("pipeline_parallel_size", "data_parallel_size"))
    return (opts.tp == 1 and single and opts.distributed_executor_backend in (None, "uni")
            and env.get("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")) == "0")


# What an engine start may change in os.environ, besides engine_env's own keys: the plugin's
# register() adds DSPARK_CALIB_ to vLLM's two Ray copy lists; vLLM itself may turn
# V1 multiprocessing off (external launcher). All restored, so a second profile in this
# process (or a later engine the caller starts) begins from the caller's environment.
TOUCHED_ENV = (E.TABLE, RAY_EXTRA_PREFIXES, RAY_EXTRA_VARS, "VLLM_ENABLE_V1_MULTIPROCESSING")


def _env_snapshot(names: Any) -> dict[str, str | None]:
    keys = {*names, *TOUCHED_ENV, *(k for k in os.environ if k.startswith(E.PREFIX))}
    return {k: os.environ.get(k) for k in keys}


def _env_restore(saved: dict[str, str | None]) -> None:
    for key in {*saved, *(k for k in os.environ if k.startswith(E.PREFIX))}:
        value = saved.get(key)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def run_engine(opts: ProfileOptions, capture_dir: str, phase: Callable[[str], None],
               report: Callable[[dict], None], log_path: str | None = None,
               note: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Start vLLM once (profiling happens during start-up), return rank 0's capture."""
    from dspark_calib.vllm.profile.plan import expected, plan_of

    capture = CaptureDir(capture_dir)
    capture.write_plan(plan_of(opts))
    env = engine_env(capture_dir)
    saved = _env_snapshot(env)
    # TP rank 0 locks the directory for the whole capture. With tp > 1 (or any worker
    # process) that is another process: the driver must not hold the lock, or rank 0
    # fails "another engine is capturing". In process (tp 1) the worker's lock() is
    # re-entrant in this process, and the driver holds the directory from the plan on.
    in_process = engine_in_process(opts, env)
    stop = threading.Event()
    llm = None
    try:
        os.environ.update(env)
        os.environ.pop(E.TABLE, None)  # profiling must measure, never load
        if in_process:
            try:
                capture.lock()
            except CaptureError as exc:
                raise CalibError(first_line(exc, 400).removeprefix(PREFIX)) from None
        phase("importing vLLM")
        from vllm import LLM

        from dspark_calib.vllm import plugin

        plugin.register()  # in-process engine: make sure the hooks are in before LLM() (idempotent)
        try:
            plan = expected(opts)
        except Exception as exc:  # noqa: BLE001 - an estimate must never stop a profile
            plan = None
            note(f"profile plan: no estimate ({first_line(exc, 120)}); the bar shows the engine's own count")
        else:
            note(plan.line(opts.replays))
        phase("starting engine: load, compile, capture CUDA graphs, profile")
        watcher = threading.Thread(target=_watch_progress, daemon=True, args=(
            capture, lambda d: report(d if plan is None else plan.position(d)), stop))
        watcher.start()
        t0 = time.perf_counter()
        try:
            llm = LLM(**engine_kwargs(opts))
        except BaseException as exc:  # noqa: BLE001 - any failure: explain in one line, write nothing
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise explain_failure(exc, capture, log_path) from None
        engine_start_s = time.perf_counter() - t0
        try:
            payload = capture.read_samples(0)
        except (OSError, ValueError) as exc:
            raise CalibError(f"unreadable capture from TP rank 0 ({exc})", path=capture.samples_path(0)) from None
        if payload is None:
            raise CalibError("the engine started but the dspark_calib vLLM plugin captured nothing: is dspark-calib "
                             "installed in the Python environment vLLM runs in (VLLM_PLUGINS must allow dspark_calib)?")
        payload["engine_start_s"] = engine_start_s
        payload["launch"] = launch_of(opts)
        return payload
    finally:
        stop.set()
        phase("shutting the engine down")
        if llm is not None:
            _shutdown(llm)
            del llm
            gc.collect()
        if in_process:
            capture.unlock()  # usually already released by the worker once its samples were written
        _env_restore(saved)


def launch_of(opts: ProfileOptions) -> dict[str, Any]:
    """What the driver started the engine with and the engine does not report (its load format, the
    --engine-arg fields as given): recorded in rank 0's capture, so a table rebuilt from a kept capture
    (profile --from-capture) records the GPU run's, not the rebuild's."""
    return {"load_format": opts.load_format, "engine_args": dict(opts.extra_engine_args)}


def _keep(capture: CaptureDir, into: str, ranks: int, rank0: dict[str, Any]) -> None:
    """The capture directory's files; rank 0's as the table was built from it (the driver's
    engine_start_s and launch added), so `profile --from-capture` rebuilds the same table."""
    if not os.path.isdir(into):
        os.mkdir(into)  # its parent was checked before the run (cli.profile.check_keep_capture)
    for path in (capture.plan_path, capture.progress_path, capture.refusal_path,
                 *(capture.samples_path(r) for r in range(1, ranks))):
        if os.path.exists(path):
            shutil.copy(path, into)
    CaptureDir(into).write_samples(0, rank0)


def run_profile(opts: ProfileOptions, *, phase: Callable[[str], None] = lambda s: None,
                report: Callable[[dict], None] = lambda d: None, keep_capture: str | None = None,
                log_path: str | None = None, note: Callable[[str], None] = lambda line: None) -> CostTable:
    """Profile on the GPUs and return the fitted table (the caller writes it)."""
    opts = resolve_options(opts)
    preflight(opts)
    capture_dir = tempfile.mkdtemp(prefix="dspark-calib-capture-")
    try:
        capture = run_engine(opts, capture_dir, phase, report, log_path, note)
        phase("fitting")
        table = table_from_capture(opts, capture)
        if keep_capture:
            try:
                _keep(CaptureDir(capture_dir), keep_capture, int(capture.get("tp_size") or opts.tp), capture)
            except OSError as exc:  # a GPU run's table is worth more than its raw capture
                note(f"--keep-capture {keep_capture}: not kept ({exc.strerror or exc}); the table is written")
        return table
    finally:
        shutil.rmtree(capture_dir, ignore_errors=True)

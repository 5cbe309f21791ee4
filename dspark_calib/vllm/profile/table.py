"""From rank 0's capture to the cost table `profile` writes: the fingerprint as the engine
resolved it and as the worker ran it, and the fit checked against vLLM's own curves.

The same path rebuilds a table from a kept capture file (`profile --from-capture`), without
a GPU: the options must be the ones the GPU run had (checked against what the capture
recorded), and the table says which file it was built from (its sha256) and keeps the GPU
host, load format and --engine-arg fields the capture names, never the rebuild's.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from dspark_calib.errors import PREFIX, CalibError, first_line
from dspark_calib.fingerprint import BACKEND_VLLM, ENGINE_KEYS, KEYS, RESOLVED_DTYPES, Fingerprint, config_hash
from dspark_calib.safe_open import read_json_bytes
from dspark_calib.samples import samples_from_dicts
from dspark_calib.table.model import CostTable
from dspark_calib.telemetry import STARTUP, Telemetry
from dspark_calib.vllm.capture import CaptureError, check_same_curves
from dspark_calib.vllm.profile.plan import ProfileOptions


def _schedule_of(capture: dict[str, Any]) -> tuple[int, int]:
    """(timed, warm-up) replays per size as the worker ran them: whole blocks of vLLM's replays."""
    try:
        s = capture["schedule"]
        per = int(s["vllm_replays_per_block"])
        return int(s["timed_replays_per_size"]), int(s["warmup_blocks"]) * per
    except (KeyError, TypeError, ValueError):
        raise CalibError("the engine's capture has no schedule (a dspark-calib older than this driver in "
                         "vLLM's environment?); no table written") from None


def _between_blocks_of(capture: dict[str, Any]) -> dict[str, Any]:
    """The plan's cool-down (startup state) or settle (serving state) and what rank 0 spent in it
    (none recorded: an older worker, no keys)."""
    cool, settle = capture.get("cooldown"), capture.get("settle")
    if isinstance(settle, dict):
        return {"settle_s": float(settle.get("seconds", 0.0)), "settle_total_s": float(settle.get("total_s", 0.0)),
                "settle_steps": int(settle.get("steps", 0))}
    if isinstance(cool, dict):
        return {"cooldown_s": float(cool.get("seconds", 0.0)), "cooldown_total_s": float(cool.get("total_s", 0.0))}
    return {}


def gpu_state_of(capture: dict[str, Any]) -> str:
    """The state the worker's plan ran in; a capture from before the choice ran the startup state."""
    return str(capture.get("plan", {}).get("gpu_state", STARTUP))


def fingerprint_from_capture(opts: "ProfileOptions", capture: dict[str, Any]) -> Fingerprint:
    """The table's fingerprint: every registry key as the engine resolved it (not as typed),
    and the replays the worker actually ran (--replays rounded up to whole vLLM blocks)."""
    engine = {**capture.get("hardware", {}), **capture["engine"]}
    read = {k.name: engine[k.name] for k in KEYS if k.name in ENGINE_KEYS and k.name in engine}
    lacking = [k for k in ("vllm_version", "num_speculative_tokens", "max_num_seqs", "max_num_batched_tokens",
                           "cudagraph_capture_sizes") if k not in read]
    if lacking:
        raise CalibError(f"the engine did not report {', '.join(lacking)}; no table written")
    replays, warmup = _schedule_of(capture)
    tp = int(read.get("tensor_parallel_size", opts.tp))
    pp = int(read.get("pipeline_parallel_size", 1))
    defaults = dict(  # keys format 1.0 requires, for an engine that could not report them
        gpu_name="", gpu_compute_capability="", driver_version="", cuda_version="", torch_version="",
        target_config_hash=config_hash(opts.model), draft_config_hash=config_hash(opts.draft),
        tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=opts.dtype, kv_cache_dtype=opts.kv_cache_dtype,
        quantization=opts.quantization, max_model_len=opts.max_model_len, speculative_method=opts.method)
    return Fingerprint(
        **{**defaults, **read},
        backend=BACKEND_VLLM,
        gpu_count=tp * pp,
        target_model=os.path.basename(os.path.normpath(opts.model_name or opts.model)),
        draft_model=os.path.basename(os.path.normpath(opts.draft_name or opts.draft)),
        cudagraph_limit=int(capture["cudagraph_limit"]),
        context_lens=tuple(opts.context_lens),
        replays=replays,
        warmup_replays=warmup,
        gpu_state=gpu_state_of(capture),
        extra={**launch_notes(capture), "profile_s": round(capture.get("profile_s", 0.0), 3),
               **({"engine_start_s": round(capture["engine_start_s"], 3)} if "engine_start_s" in capture else {}),
               "profile_batches": capture.get("num_batches"), "hostname": host_of(capture),
               "replays_asked": opts.replays, "warmup_asked": opts.warmup,
               "vllm_replays_per_block": int(capture["schedule"]["vllm_replays_per_block"]),
               **_between_blocks_of(capture),
               # the capture's second verify shape (capture.py's shape blocks): counted here, kept there
               **({"shape_samples": len(capture["shape_samples"])} if capture.get("shape_samples") else {})},
    )


UNRECORDED = "unrecorded"


def launch_notes(capture: dict[str, Any]) -> dict[str, Any]:
    """The table's load_format and engine_args (the --engine-arg fields, when any) as the driver
    started the engine: from the capture (driver.launch_of), never from the options of a rebuild,
    which starts no engine. A capture from before the driver recorded them: load_format UNRECORDED."""
    launch = capture.get("launch")
    if launch is None:
        return {"load_format": UNRECORDED}
    if not (isinstance(launch, dict) and isinstance(launch.get("load_format"), str)
            and isinstance(launch.get("engine_args"), dict)):
        raise CalibError("not a profile capture rank 0 wrote (launch is not a load_format and engine_args)")
    return {"load_format": launch["load_format"], **({"engine_args": launch["engine_args"]} if launch["engine_args"]
                                                     else {})}


def host_of(capture: dict[str, Any]) -> str:
    """The host rank 0 measured on, as the capture names it (UNRECORDED in a capture from before
    captures named it: the machine reading it may be another)."""
    host = capture.get("hostname")
    return host if isinstance(host, str) and host else UNRECORDED


def check_against_vllm(table: CostTable, capture: dict[str, Any]) -> None:
    """The table we fit must be vLLM's own curves (its set_initial_cost_curves, run by the
    worker on the same samples) at every context: the worker already refused a disagreement
    with dspark_calib.fit; this checks what reaches the file, after the JSON round trip."""
    theirs = capture.get("vllm_curves")
    if not isinstance(theirs, dict) or sorted(int(c) for c in theirs) != table.context_lens():
        got = "none" if not isinstance(theirs, dict) else sorted(int(c) for c in theirs)
        raise CalibError(f"vLLM's own curves in the capture cover contexts {got}, the table "
                         f"{table.context_lens()}; no table written")
    for ctx in table.context_lens():
        vllm = theirs[str(ctx)]
        try:
            check_same_curves(ctx, table.curves[ctx].as_vllm(), (vllm["draft"], vllm["verify"]))
        except CaptureError as exc:
            raise CalibError(first_line(exc, 400).removeprefix(PREFIX)) from None


def table_from_capture(opts: "ProfileOptions", capture: dict[str, Any], notes: dict[str, Any] | None = None) -> CostTable:
    """The table of rank 0's capture; `notes` join the fingerprint's extra (from_capture)."""
    samples = samples_from_dicts(capture["samples"])
    fp = fingerprint_from_capture(opts, capture)
    fp = fp.replace(extra={**fp.extra, **(notes or {})})
    counts: dict[tuple[int, int], int] = {}
    for s in samples:
        counts[(s.context_len, s.num_target_tokens)] = counts.get((s.context_len, s.num_target_tokens), 0) + 1
    off = next(((k, n) for k, n in sorted(counts.items()) if n != fp.replays), None)
    if off is not None:
        (ctx, size), n = off
        raise CalibError(f"the capture holds {n} samples for size {size} at context {ctx}, its schedule "
                         f"{fp.replays}; no table written")
    table = CostTable.from_samples(samples, fp.replace(extra={**fp.extra, "vllm_curves_equal": True}),
                                   telemetry=Telemetry.from_json(capture.get("telemetry")))
    check_against_vllm(table, capture)
    return table


# -- a kept capture file (profile --from-capture) ----------------------------------------------
# rank 0's capture: ~100 bytes a sample (100 KB for 1120 steps); a run of many contexts and
# replays stays far below this.
MAX_CAPTURE_BYTES = 64 << 20
CAPTURE_KEYS = ("engine", "plan", "schedule", "cudagraph_limit", "vllm_curves", "samples")


def recorded_options(opts: "ProfileOptions", capture: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, the options' value, the capture's) for every option the capture recorded: the engine
    as it resolved them, and the plan the driver wrote. An option the engine resolves from
    "auto" (dtype, KV cache dtype) or from the model config (max_model_len, quantization) is
    compared only when given; a key an older capture lacks is left out (the GPU run, too,
    took it from the options)."""
    engine, plan = capture["engine"], capture["plan"]
    dtype = {"half": "float16", "float": "float32"}.get(opts.dtype, opts.dtype)
    pairs = [("target_config_hash", config_hash(opts.model), engine.get("target_config_hash")),
             ("draft_config_hash", config_hash(opts.draft), engine.get("draft_config_hash")),
             ("speculative_method", opts.method, engine.get("speculative_method")),
             ("num_speculative_tokens", opts.num_speculative_tokens, engine.get("num_speculative_tokens")),
             ("tensor_parallel_size", opts.tp, engine.get("tensor_parallel_size")),
             ("max_num_seqs", opts.max_num_seqs, engine.get("max_num_seqs")),
             ("max_num_batched_tokens", opts.max_num_batched_tokens, engine.get("max_num_batched_tokens")),
             ("max_model_len", opts.max_model_len, engine.get("max_model_len")),
             ("quantization", opts.quantization, engine.get("quantization")),
             ("dtype", dtype if dtype in RESOLVED_DTYPES else None, engine.get("dtype")),
             ("kv_cache_dtype", None if opts.kv_cache_dtype == "auto" else opts.kv_cache_dtype,
              engine.get("kv_cache_dtype")),
             ("context_lens", list(opts.context_lens), plan.get("context_lens")),
             ("replays", opts.replays, plan.get("replays")),
             ("warmup", opts.warmup, plan.get("warmup")),
             ("gpu_state", opts.gpu_state, plan.get("gpu_state")),
             ("cooldown_s", opts.cooldown_s, plan.get("cooldown_s")),
             ("settle_s", opts.settle_s, plan.get("settle_s"))]
    return [(k, ours, theirs) for k, ours, theirs in pairs if ours is not None and theirs is not None]


def check_capture_options(opts: "ProfileOptions", capture: Any) -> None:
    """The capture is rank 0's, of the shape `profile` writes, and taken with these options: the
    first difference is one line naming the key and both values."""
    if not isinstance(capture, dict):
        raise CalibError("not a profile capture (a JSON object is expected)")
    lacking = [k for k in CAPTURE_KEYS if k not in capture]
    if lacking or not all(isinstance(capture[k], dict) for k in ("engine", "plan", "schedule", "vllm_curves")):
        raise CalibError(f"not a profile capture rank 0 wrote (no {', '.join(lacking) or 'engine/plan objects'})")
    if capture.get("rank", 0) != 0:
        raise CalibError(f"is TP rank {capture.get('rank')!r}'s capture; a table is built from rank 0's "
                         "(samples-rank0.json)")
    for key, ours, theirs in recorded_options(opts, capture):
        if ours != theirs:
            raise CalibError(f"{key}: the options give {ours!r}, the capture recorded {theirs!r}; rebuild with "
                             "the options of the GPU run")


def table_from_capture_file(opts: "ProfileOptions", path: str) -> CostTable:
    """The table `profile` would have written from this kept capture with these options, built
    without the GPU: the same fingerprint, curves and checks against vLLM's own curves, plus
    extra.from_capture (the file's name and sha256). Every problem is one line naming the file."""
    raw, capture = read_json_bytes(path, max_bytes=MAX_CAPTURE_BYTES)
    try:
        check_capture_options(opts, capture)
        notes = {"from_capture": {"file": os.path.basename(path), "sha256": hashlib.sha256(raw).hexdigest()}}
        try:
            return table_from_capture(opts, capture, notes)
        except (KeyError, TypeError, ValueError) as exc:  # a hand-edited capture: not what rank 0 wrote
            raise CalibError(f"not a profile capture rank 0 wrote ({type(exc).__name__}: {first_line(exc, 120)})") \
                from None
    except CalibError as exc:
        raise exc if exc.path else CalibError(str(exc), path=path) from None

"""The reference backend: tables from vLLM start-up profiles recorded elsewhere.

vLLM's own start-up profile (the StepTimingSamples it timed, in batch order, with
the batches_to_profile kwargs that produced them) saved as JSON, e.g. the H200
captures under tests/data/. Useful as fixtures and to compare dspark-calib's
profiler against vLLM's; the plugin refuses such tables unless
DSPARK_CALIB_ALLOW_REFERENCE=1, since nothing proves they match the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from typing import Any, Sequence

from dspark_calib.errors import CalibError, display_path, first_line
from dspark_calib.fingerprint import (BACKEND_REFERENCE, RESOLVED_DTYPES, Fingerprint, check_model_dtype,
                                      config_hash)
from dspark_calib.safe_open import open_local, read_json_file
from dspark_calib.samples import VLLM_SAMPLE_FIELDS, Sample
from dspark_calib.speculators import DSPARK, speculator
from dspark_calib.table.model import MAX_STEP_MS, CostTable
from dspark_calib.telemetry import STARTUP


# How torch.cuda.get_device_name() names a GPU ("NVIDIA H200", "AMD Instinct MI300X") and
# how vLLM's __version__ reads ("0.33.0", "0.33.1.dev12+gabc"): a table whose names differ
# from what the engine reports can never load.
GPU_VENDORS = ("NVIDIA", "AMD", "Intel")
VLLM_VERSION = re.compile(r"\d+\.\d+\.\d+([.+-]?[0-9A-Za-z.+-]+)?")
# Token counts and context lengths a start-up profile can hold: far above any engine, within
# the 64-bit columns a table stores them in.
MAX_COUNT = 1 << 40


def identity_warnings(gpu_name: str, vllm_version: str) -> list[str]:
    """--gpu-name/--vllm-version: CalibError when unusable, one line per value that looks unlike
    what vLLM and torch report (the plugin compares them verbatim, so the table would never load)."""
    for option, value in (("--gpu-name", gpu_name), ("--vllm-version", vllm_version)):
        if not value.strip() or value != value.strip() or not value.isprintable():
            raise CalibError(f"{option} {value!r}: must be a non-empty name without surrounding spaces "
                             "or control characters")
    out = []
    if gpu_name.split()[0] not in GPU_VENDORS:
        out.append(f"--gpu-name {gpu_name!r} does not look like torch.cuda.get_device_name() "
                   f"(e.g. 'NVIDIA H200'); the plugin compares it verbatim")
    if not VLLM_VERSION.fullmatch(vllm_version):
        out.append(f"--vllm-version {vllm_version!r} does not look like vllm.__version__ (e.g. '0.33.0'); "
                   "the plugin compares it verbatim")
    return out


def _count(value: Any, what: str, low: int = 1) -> int:
    """An integer the engine counted (tokens, requests, a context length): CalibError otherwise."""
    if type(value) is not int or not low <= value <= MAX_COUNT:
        raise CalibError(f"{what} {str(value)[:40]} is not an integer in {low}..{MAX_COUNT}")
    return value


def engine_shape(data: dict[str, Any], path: str) -> dict[str, Any]:
    """The engine limits a start-up profile records, checked as the table's fingerprint and vLLM
    use them (a table must never be written that its own reader or vLLM would refuse)."""
    try:
        this = {k: data[k] for k in ("capture_sizes", "cudagraph_limit", "max_num_reqs", "max_num_batched_tokens")}
    except KeyError as exc:
        raise CalibError(f"lacks {exc.args[0]}", path=path) from None
    try:
        tokens = _count(this["max_num_batched_tokens"], "max_num_batched_tokens")
        if _count(this["max_num_reqs"], "max_num_reqs") > tokens:
            raise CalibError(f"max_num_reqs {this['max_num_reqs']} is above max_num_batched_tokens {tokens}")
        _count(this["cudagraph_limit"], "cudagraph_limit", 0)
        sizes = this["capture_sizes"]
        if not isinstance(sizes, list):
            raise CalibError("capture_sizes is not a list")
        for size in sizes:
            _count(size, "a capture size")
        if sizes != sorted(set(sizes)):
            raise CalibError("capture_sizes are not strictly increasing")
    except CalibError as exc:
        raise CalibError(str(exc), path=path) from None
    return this


def samples_from_startup_json(data: dict[str, Any], path: str) -> list[Sample]:
    """Tag vLLM's samples with the context length and replay of the batch that made them."""
    rows, batches = data.get("rows"), data.get("batches")
    if not isinstance(rows, list) or not isinstance(batches, list) or len(rows) != len(batches):
        raise CalibError("needs 'rows' and 'batches' lists of equal length (row i came from batch i)", path=path)
    if not rows:
        raise CalibError("has no samples ('rows' is empty)", path=path)
    seen: Counter = Counter()
    out = []
    for i, (row, batch) in enumerate(zip(rows, batches)):
        try:
            key = (_count(batch["num_tokens"], "num_tokens"), _count(batch["context_len"], "context_len"))
            sample = Sample(**{k: row[k] for k in VLLM_SAMPLE_FIELDS}, context_len=batch["context_len"],
                            replay=seen[key])
            for name in ("num_target_tokens", "num_reqs"):
                _count(getattr(sample, name), name)
            for name in ("forward_ms", "drafter_ms"):
                if getattr(sample, name) > MAX_STEP_MS:
                    raise CalibError(f"{name} {getattr(sample, name)!r} is not a plausible step (at most "
                                     f"{MAX_STEP_MS:g} ms)")
        except (KeyError, TypeError, AttributeError) as exc:
            raise CalibError(f"row/batch {i} is malformed (missing or bad {exc})", path=path) from None
        except CalibError as exc:
            raise CalibError(f"row {i}: {exc}", path=path) from None
        out.append(sample)
        seen[key] += 1
    return out


def check_draft(draft: str, num_speculative_tokens: int, method: str = DSPARK) -> None:
    """The draft is the method's drafter, and for DSpark K is the block it drafts: a start-up
    profile does not record K, and vLLM runs a DSpark drafter with its block_size unless told
    otherwise."""
    path = os.path.join(draft, "config.json") if os.path.isdir(draft) else draft
    config = read_json_file(path)
    if not isinstance(config, dict):
        raise CalibError("not a JSON object (a model config.json)", path=path)
    block = speculator(method).check_drafter(config, path)
    if block is not None and block != num_speculative_tokens:
        raise CalibError(f"--num-speculative-tokens {num_speculative_tokens} is not this drafter's block_size "
                         f"{block}, the K vLLM profiles it with by default (a start-up profile does not record K)",
                         path=path)


def table_from_startup_json(
    paths: Sequence[str],
    *,
    model: str,
    draft: str | None,
    gpu_name: str,
    vllm_version: str,
    torch_version: str = "",
    driver_version: str = "",
    cuda_version: str = "",
    gpu_compute_capability: str = "",
    num_speculative_tokens: int,
    tensor_parallel_size: int = 1,
    dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    method: str = DSPARK,
) -> CostTable:
    """The table of vLLM start-up profiles, every input checked before anything is made: the
    options, the draft, each file's engine limits and every sample (one CalibError naming the
    file or the option)."""
    if not paths:
        raise CalibError("no start-up profiles given")
    check_model_dtype(dtype, "--dtype", RESOLVED_DTYPES)
    draft = speculator(method).drafter_or_target(draft, model)
    check_draft(draft, num_speculative_tokens, method)
    samples: list[Sample] = []
    per_file: dict[str, list[Sample]] = {}
    engine: dict[str, Any] | None = None
    first = ""
    seen: dict[bytes, str] = {}
    for path in paths:
        fh, _ = open_local(path, path)  # never blocks on a FIFO; permission/symlink loop said as such
        try:
            with fh:
                raw = fh.read()
            data = json.loads(raw)
        except (OSError, ValueError) as exc:
            raise CalibError(f"not a JSON start-up profile ({first_line(exc)})", path=path) from None
        # The same samples twice would double every count and fake precision and significance.
        key = hashlib.sha256(raw).digest()
        if key in seen:
            same = "the same file as" if os.path.realpath(seen[key]) == os.path.realpath(path) else "the same content as"
            raise CalibError(f"is {same} {display_path(seen[key])}; each profile may be imported once", path=path)
        seen[key] = path
        if not isinstance(data, dict):
            raise CalibError("not a JSON object", path=path)
        this = engine_shape(data, path)
        if engine is not None and this != engine:
            raise CalibError(f"profiled on a different engine shape than {display_path(first)}", path=path)
        engine, first = this, first or path
        per_file[path] = samples_from_startup_json(data, path)
        samples += per_file[path]
    assert engine is not None  # paths is not empty, and each file either added samples or raised
    replays = max(Counter((s.num_target_tokens, s.context_len) for s in samples).values())
    fingerprint = Fingerprint(
        backend=BACKEND_REFERENCE,
        gpu_name=gpu_name,
        gpu_count=tensor_parallel_size,
        gpu_compute_capability=gpu_compute_capability,
        driver_version=driver_version,
        cuda_version=cuda_version,
        torch_version=torch_version,
        vllm_version=vllm_version,
        target_model=os.path.basename(os.path.normpath(model)),
        target_config_hash=config_hash(model),
        draft_model=os.path.basename(os.path.normpath(draft)),
        draft_config_hash=config_hash(draft),
        speculative_method=method,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=1,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        quantization=None,
        num_speculative_tokens=num_speculative_tokens,
        max_num_seqs=engine["max_num_reqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        cudagraph_capture_sizes=tuple(engine["capture_sizes"]),
        cudagraph_limit=engine["cudagraph_limit"],
        context_lens=tuple(sorted({s.context_len for s in samples})),
        replays=replays,
        warmup_replays=0,
        gpu_state=STARTUP,  # vLLM's own start-up pass
        extra={"source": [os.path.basename(p) for p in paths]},
    )
    try:
        return _checked(CostTable.from_samples(samples, fingerprint))
    except CalibError as exc:
        raise _named(exc, per_file, fingerprint) from None


def _checked(table: CostTable) -> CostTable:
    """The table as read_table would check it: one its own reader refuses is never made."""
    table.check_plausible()
    table.check_spread()
    return table


def _named(exc: CalibError, per_file: dict[str, list[Sample]], fingerprint: Fingerprint) -> CalibError:
    """A fit's refusal (an empty or falling curve) said about the file whose samples cause it:
    the first that fails on its own, else all of them."""
    for path, samples in per_file.items():
        try:
            _checked(CostTable.from_samples(samples, fingerprint))
        except CalibError as own:
            return CalibError(str(own), path=path)
    return CalibError(f"{exc} (in {', '.join(display_path(p) for p in per_file)} together)")

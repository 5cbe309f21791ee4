"""The reference backend: tables from vLLM start-up profiles recorded elsewhere.

vLLM's own start-up profile (the StepTimingSamples it timed, in batch order, with
the batches_to_profile kwargs that produced them) saved as JSON, e.g. the H200
captures under tests/data/. Useful as fixtures and to compare dspark-calib's
profiler against vLLM's; the plugin refuses such tables unless
DSPARK_CALIB_ALLOW_REFERENCE=1, since nothing proves they match the engine.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any, Sequence

from dspark_calib.errors import CalibError
from dspark_calib.fingerprint import BACKEND_REFERENCE, Fingerprint, config_hash
from dspark_calib.samples import VLLM_SAMPLE_FIELDS, Sample
from dspark_calib.table import CostTable


def samples_from_startup_json(data: dict[str, Any], path: str) -> list[Sample]:
    """Tag vLLM's samples with the context length and replay of the batch that made them."""
    rows, batches = data.get("rows"), data.get("batches")
    if not isinstance(rows, list) or not isinstance(batches, list) or len(rows) != len(batches):
        raise CalibError("needs 'rows' and 'batches' lists of equal length (row i came from batch i)", path=path)
    seen: Counter = Counter()
    out = []
    for i, (row, batch) in enumerate(zip(rows, batches)):
        try:
            key = (batch["num_tokens"], batch["context_len"])
            out.append(Sample(**{k: row[k] for k in VLLM_SAMPLE_FIELDS}, context_len=batch["context_len"],
                              replay=seen[key]))
        except (KeyError, TypeError) as exc:
            raise CalibError(f"row/batch {i} is malformed (missing or bad {exc})", path=path) from None
        except CalibError as exc:
            raise CalibError(f"row {i}: {exc}", path=path) from None
        seen[key] += 1
    return out


def table_from_startup_json(
    paths: Sequence[str],
    *,
    model: str,
    draft: str,
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
) -> CostTable:
    samples: list[Sample] = []
    engine: dict[str, Any] | None = None
    for path in paths:
        try:
            with open(path) as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise CalibError("no such file", path=path) from None
        except (OSError, ValueError) as exc:
            raise CalibError(f"not a JSON start-up profile ({exc})", path=path) from None
        if not isinstance(data, dict):
            raise CalibError("not a JSON object", path=path)
        try:
            this = {k: data[k] for k in ("capture_sizes", "cudagraph_limit", "max_num_reqs", "max_num_batched_tokens")}
        except KeyError as exc:
            raise CalibError(f"lacks {exc.args[0]}", path=path) from None
        if engine is not None and this != engine:
            raise CalibError("profiled on a different engine shape than the first file", path=path)
        engine = this
        samples += samples_from_startup_json(data, path)
    assert engine is not None
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
        extra={"source": [os.path.basename(p) for p in paths]},
    )
    return CostTable.from_samples(samples, fingerprint)

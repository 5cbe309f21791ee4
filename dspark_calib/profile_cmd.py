"""`dspark-calib profile`: options, progress display, writing the table.

Kept apart from cli.py so the CLI module stays light: nothing here imports
vllm or torch until the command runs.
"""

from __future__ import annotations

import os
import time
from typing import List, Optional

import typer


def profile(
    model: str = typer.Option(..., "--model", help="Target model directory (config.json; weights only with --load-format auto)."),
    draft: str = typer.Option(..., "--draft", help="DSpark drafter directory (architectures Qwen3DSparkModel/DSparkDraftModel)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size, through vLLM's own executor."),
    num_speculative_tokens: Optional[int] = typer.Option(None, "--num-speculative-tokens", help="Default: the drafter's block_size."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(8192, "--max-num-batched-tokens"),
    context_len: List[int] = typer.Option([8192], "--context-len", help="Context length of the dummy requests; repeat for several (one engine start)."),
    replays: int = typer.Option(20, "--replays", help="Timed replays per batch size and context length (vLLM: 5)."),
    warmup: int = typer.Option(2, "--warmup", help="Warm-up replays per size and context, timed by vLLM but discarded."),
    load_format: str = typer.Option("dummy", "--load-format", help="dummy: random weights, only config.json is read (timings do not depend on weights)."),
    dtype: str = typer.Option("auto", "--dtype"),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype"),
    quantization: Optional[str] = typer.Option(None, "--quantization"),
    gpu_memory_utilization: float = typer.Option(0.85, "--gpu-memory-utilization"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Default: 32768, or what the longest --context-len needs."),
    distributed_executor_backend: Optional[str] = typer.Option(None, "--distributed-executor-backend", help="mp (one node) or ray (across nodes)."),
    out: str = typer.Option(".", "--out", help="Output file, or directory for the default name (target__draft__tpN__gpu__hash.parquet)."),
    keep_capture: Optional[str] = typer.Option(None, "--keep-capture", help="Also copy the raw per-rank capture JSON here."),
) -> None:
    """Profile vLLM's DSpark draft/verify steps on this machine's GPUs and write a cost table."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from dspark_calib.errors import CalibError
    from dspark_calib.table import prepare_out_path, write_table

    if distributed_executor_backend not in (None, "mp", "ray"):
        raise CalibError(f"--distributed-executor-backend must be mp or ray, not {distributed_executor_backend!r}")
    if load_format not in ("dummy", "auto"):
        raise CalibError(f"--load-format must be dummy or auto, not {load_format!r}")
    if os.path.exists(out) and not os.path.isdir(out) and not out.endswith(".parquet"):
        raise CalibError("--out must be a directory or a .parquet file", path=out)
    try:
        out = prepare_out_path(out)
    except OSError as exc:
        raise CalibError(f"cannot write the table there ({exc.strerror})", path=out) from None
    try:
        from dspark_calib.vllm.profile import ProfileOptions, run_profile
    except ImportError as exc:  # pragma: no cover - the subpackage itself imports nothing heavy
        raise CalibError(f"cannot load the vLLM backend ({exc})") from None

    opts = ProfileOptions(
        model=model, draft=draft, tp=tp, num_speculative_tokens=num_speculative_tokens, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, context_lens=tuple(sorted(set(context_len))), replays=replays,
        warmup=warmup, load_format=load_format, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
        distributed_executor_backend=distributed_executor_backend,
    )
    console = Console(stderr=True)
    started = time.perf_counter()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        phase_task = progress.add_task("preparing", total=None)
        batches_task = None

        def phase(name: str) -> None:
            progress.update(phase_task, description=name)
            console.log(name)

        def report(state: dict) -> None:
            nonlocal batches_task
            if batches_task is None:
                batches_task = progress.add_task("profiling batches", total=state["total"])
            progress.update(batches_task, completed=state["done"],
                            description=f"profiling batches (context {state['context_len']})")

        table = run_profile(opts, phase=phase, report=report, keep_capture=keep_capture)
        progress.update(phase_task, description="writing table")
        path = write_table(table, out)
    extra = table.fingerprint.extra
    console.print(f"wrote {path} (hash {table.short_hash}); engine start {extra.get('engine_start_s', 0):.1f} s, "
                  f"of which profiling {extra.get('profile_s', 0):.1f} s; total {time.perf_counter() - started:.1f} s")
    from dspark_calib.inspection import inspect_table
    from dspark_calib.render import render_summary

    render_summary(inspect_table(table, path=path), Console())

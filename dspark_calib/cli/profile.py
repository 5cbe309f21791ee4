"""`dspark-calib profile`: check every option, run the profiler, show one progress bar, write the table.

app.py registers the command and calls ``main`` once. Everything that can be
checked without a GPU is checked before the engine starts (ranges, the output
path, engine arguments, vLLM's dtype choices, the context vLLM would profile), so
a typo costs a second, not a 7-minute run. vLLM's own output (its log, worker
processes, NCCL, the chat-template warm-up) goes to a log file beside the table;
the terminal shows one progress bar. Nothing here imports vllm or torch until the
command runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from typing import Any, Iterator, Sequence

from dspark_calib.cli.paths import TABLE_SUFFIX, TableOut, table_out
from dspark_calib.errors import CalibError, display_path
from dspark_calib.speculators import speculator


def check_ranges(*, context_len: Sequence[int], max_num_seqs: int, max_num_batched_tokens: int,
                 gpu_memory_utilization: float, replays: int, warmup: int, tp: int,
                 num_speculative_tokens: int | None, max_model_len: int | None, load_format: str,
                 distributed_executor_backend: str | None, cooldown: float | None = None,
                 gpu_state: str = "startup", settle: float | None = None,
                 shape_replays: int = 0) -> tuple[float, float]:
    """Options that can be wrong on their own: one line naming the option and the value. Returns
    the plan's (cooldown_s, settle_s)."""
    for value in context_len:
        if value < 1:
            raise CalibError(f"--context-len must be >= 1, got {value}")
    for name, value, low in (("--max-num-seqs", max_num_seqs, 1), ("--max-num-batched-tokens", max_num_batched_tokens, 1),
                             ("--replays", replays, 1), ("--warmup", warmup, 0), ("--tp", tp, 1),
                             ("--num-speculative-tokens", num_speculative_tokens, 1),
                             ("--max-model-len", max_model_len, 1), ("--shape-replays", shape_replays, 0)):
        if value is not None and value < low:
            raise CalibError(f"{name} must be >= {low}, got {value}")
    if not 0 < gpu_memory_utilization <= 1:
        raise CalibError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    plan_seconds = between_blocks(gpu_state, cooldown, settle)
    if distributed_executor_backend not in (None, "mp", "ray"):
        raise CalibError(f"--distributed-executor-backend must be mp or ray, not {distributed_executor_backend!r}")
    if load_format not in ("dummy", "auto"):
        raise CalibError(f"--load-format must be dummy or auto, not {load_format!r}")
    return plan_seconds


def between_blocks(gpu_state: str, cooldown: float | None, settle: float | None) -> tuple[float, float]:
    """(cooldown_s, settle_s) for the plan: each option belongs to one state, and giving it with the
    other is one line (it would do nothing); left out, its default."""
    from dspark_calib.telemetry import SERVING, STARTUP
    from dspark_calib.vllm.gpu_state import (DEFAULT_COOLDOWN_S, DEFAULT_SETTLE_S, check_cooldown,  # stdlib only
                                             check_settle, check_state)

    try:
        check_state(gpu_state, "--gpu-state")
        cooldown_s = check_cooldown(DEFAULT_COOLDOWN_S if cooldown is None else cooldown, "--cooldown")
        settle_s = check_settle(DEFAULT_SETTLE_S if settle is None else settle, "--settle")
    except ValueError as exc:
        raise CalibError(str(exc)) from None
    if gpu_state == SERVING and cooldown is not None:
        raise CalibError("--cooldown: the serving state settles under load before each block instead of cooling "
                         "down (--settle SECONDS); --cooldown is for --gpu-state startup")
    if gpu_state == STARTUP and settle is not None:
        raise CalibError("--settle: only the serving state settles under load (--gpu-state serving)")
    return cooldown_s, settle_s


def check_keep_capture(keep: str | None) -> None:
    """--keep-capture DIR is written after the whole GPU run: refuse now what would fail then."""
    if keep is None:
        return
    if not keep:
        raise CalibError("--keep-capture is empty")
    if os.path.exists(keep) and not os.path.isdir(keep):
        raise CalibError(f"--keep-capture {keep}: exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(keep))
    if not os.path.isdir(keep) and not os.path.isdir(parent):
        raise CalibError(f"--keep-capture {keep}: directory {parent} does not exist (parents are not created)")


def check_out(out: str, force: bool = False) -> tuple[TableOut, str]:
    """(the checked --out, the log file beside it), refusing an unwritable --out now: the
    --out rule of every command (paths.table_out; a fresh run's table, so an existing file
    needs --force now), and an existing directory proved writable by a probe file, before
    minutes of profiling. A new --out directory is made only when the engine is about to
    start (``_run``), so a refused run leaves nothing behind."""
    target = table_out(out, [], force=force, fresh=True)
    directory = target.directory
    if os.path.isdir(directory):
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".dspark-calib-probe-"):
                pass
        except OSError as exc:
            raise CalibError(f"--out: cannot write there ({exc.strerror})", path=out) from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log = out[: -len(TABLE_SUFFIX)] + ".vllm.log" if not target.is_dir else os.path.join(directory, f"profile-{stamp}.vllm.log")
    return target, log


def parse_engine_args(pairs: Sequence[str], as_json: str | None) -> dict[str, Any]:
    """--engine-arg KEY=VALUE (VALUE parsed as JSON when it parses, else a string; dashes in KEY
    read as underscores, as vLLM's own CLI does) over --engine-args-json FILE|JSON."""
    out: dict[str, Any] = {}
    if as_json:
        if not as_json.lstrip().startswith(("{", "[")):  # a file
            from dspark_calib.safe_open import read_json_file

            data = read_json_file(as_json, f"--engine-args-json {display_path(as_json)}")
        else:
            try:
                data = json.loads(as_json)
            except ValueError as exc:
                raise CalibError(f"--engine-args-json: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise CalibError("--engine-args-json: must be a JSON object of EngineArgs fields")
        out.update({str(k).replace("-", "_"): v for k, v in data.items()})
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise CalibError(f"--engine-arg {pair!r}: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key.strip().replace("-", "_")] = value
    return out


@contextlib.contextmanager
def output_to(log_path: str) -> Iterator[None]:
    """Send file descriptors 1 and 2 to the log: vLLM, its worker processes (which inherit them),
    NCCL and C++ logging all land there, not between the progress bar's redraws."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def refuse_engine_options(given: Sequence[tuple[str, bool]]) -> None:
    """--from-capture starts no engine: an option only an engine uses, given, would be accepted and
    do nothing (the table takes the run's load format and --engine-arg fields from the capture)."""
    named = next((flag for flag, was_given in given if was_given), None)
    if named is not None:
        raise CalibError(f"{named}: only a run that starts the engine uses it, and --from-capture starts none (the "
                         "table takes the GPU run's load format and --engine-arg fields from the capture); leave it out")


def main(*, model: str, draft: str | None, method: str, tp: int, num_speculative_tokens: int | None, max_num_seqs: int,
         max_num_batched_tokens: int, context_len: Sequence[int], replays: int, warmup: int, load_format: str | None,
         dtype: str, kv_cache_dtype: str, quantization: str | None, gpu_memory_utilization: float | None,
         max_model_len: int | None, distributed_executor_backend: str | None, out: str,
         keep_capture: str | None, engine_arg: Sequence[str], engine_args_json: str | None,
         strict_stability: bool = False, cooldown: float | None = None, force: bool = False,
         from_capture: str | None = None, gpu_state: str = "startup", settle: float | None = None,
         shape_replays: int = 0) -> None:
    """The `profile` command: everything checkable first (options, the output path, the model
    configs, vLLM's presence and the GPUs, all without importing vllm or torch), then one
    engine start. With `from_capture`, no engine: the table from that kept capture (rebuild).
    load_format / gpu_memory_utilization None: ProfileOptions' defaults."""
    from dspark_calib.vllm.profile.plan import ProfileOptions

    if from_capture is not None:
        refuse_engine_options((("--load-format", load_format is not None),
                               ("--gpu-memory-utilization", gpu_memory_utilization is not None),
                               ("--distributed-executor-backend", distributed_executor_backend is not None),
                               ("--engine-arg", bool(engine_arg)), ("--engine-args-json", engine_args_json is not None),
                               ("--keep-capture", keep_capture is not None), ("--shape-replays", shape_replays != 0)))
    load_format = ProfileOptions.load_format if load_format is None else load_format
    if gpu_memory_utilization is None:
        gpu_memory_utilization = ProfileOptions.gpu_memory_utilization
    cooldown_s, settle_s = check_ranges(
        context_len=context_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization, replays=replays, warmup=warmup, tp=tp,
        num_speculative_tokens=num_speculative_tokens, max_model_len=max_model_len, load_format=load_format,
        distributed_executor_backend=distributed_executor_backend, cooldown=cooldown, gpu_state=gpu_state,
        settle=settle, shape_replays=shape_replays)
    from dspark_calib.fingerprint import check_model_dtype

    check_model_dtype(dtype, "--dtype")
    extra = parse_engine_args(engine_arg, engine_args_json)
    from dspark_calib.vllm.profile import driver

    draft = speculator(method).drafter_or_target(draft, model)
    model_dir, model_id = driver.resolve_model(model, "--model")
    draft_dir, draft_id = driver.resolve_model(draft, "--draft") if draft != model else (model_dir, model_id)
    if from_capture is not None:
        target = table_out(out, [from_capture], force=force, fresh=True)
    else:
        check_keep_capture(keep_capture)
        target, log_path = check_out(out, force)
    opts = driver.resolve_options(ProfileOptions(
        model=model_dir, draft=draft_dir, method=method, tp=tp, num_speculative_tokens=num_speculative_tokens,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        context_lens=tuple(sorted(set(context_len))), replays=replays, warmup=warmup, gpu_state=gpu_state,
        shape_replays=shape_replays,
        cooldown_s=cooldown_s, settle_s=settle_s, load_format=load_format,
        dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
        distributed_executor_backend=distributed_executor_backend, extra_engine_args=extra,
        model_name=model_id, draft_name=draft_id))
    if from_capture is not None:
        rebuild(opts, target, from_capture, strict_stability)
        return
    driver.check_before_import(opts)
    _run(opts, target, log_path, keep_capture, strict_stability)


def rebuild(opts: Any, out: TableOut, capture: str, strict_stability: bool = False) -> None:
    """`profile --from-capture`: the table the GPU run would have written from this capture, built
    here without a GPU or vLLM (vllm.profile.table.table_from_capture_file), written by the
    same rules."""
    from rich.console import Console

    from dspark_calib.vllm.profile.table import table_from_capture_file

    table = table_from_capture_file(opts, capture)
    path, replaced, shifts = _write(table, out, strict_stability)
    fp = table.fingerprint
    source = fp.extra["from_capture"]
    _said(table, path, replaced, shifts, Console(stderr=True),
          f"wrote {path} from the capture {display_path(capture)} (sha256 "
          f"{source['sha256'][:12]}), measured on {_host(fp.extra['hostname'])}; {fp.replays} samples per size "
          f"({fp.warmup_replays} warm-up discarded); curves equal vLLM's own")


def stability_verdict(table: Any, strict: bool) -> list[str]:
    """The summary's level-shift lines; with --strict-stability a flagged run is refused in
    one line before anything is written. Re-running is the user's call (the cause, e.g.
    another process on the GPU, is outside the tool): we never loop."""
    from dspark_calib.stability import table_flags

    flags = table_flags(table)
    if flags and strict:
        raise CalibError(f"--strict-stability: {len(flags)} level shift(s), first {flags[0]}; no table written "
                         "(re-run when the GPU and host are idle, or drop --strict-stability)")
    return [f"level shift: {f}" for f in flags]


def _run(opts: Any, out: TableOut, log_path: str, keep_capture: str | None, strict_stability: bool = False) -> None:
    """The run, in the --out directory made for it; a run that fails leaves no empty directory."""
    made = out.make_directory()
    try:
        _profile(opts, out, log_path, keep_capture, strict_stability)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(out.directory)  # only when empty: vLLM's log of a failed start stays
        raise


def _profile(opts: Any, out: TableOut, log_path: str, keep_capture: str | None, strict_stability: bool) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.text import Text

    from dspark_calib.vllm.profile.driver import run_profile

    class Count(ProgressColumn):  # "done/total" once the total is known, never "0/None"
        def render(self, task: Any) -> Text:
            return Text("" if task.total is None else f"{int(task.completed)}/{int(task.total)}")

    # The terminal, kept before fds 1/2 go to the log.
    terminal = Console(file=os.fdopen(os.dup(2), "w", buffering=1), stderr=True)
    started = time.perf_counter()
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), Count(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=terminal, transient=True)
    engine_started = False
    with progress:
        task = progress.add_task("checking vLLM and the GPUs", total=None)

        def phase(name: str) -> None:
            nonlocal engine_started
            if name.startswith("starting engine") and not engine_started:
                engine_started = True
                progress.console.print(f"vLLM's log: {log_path}", markup=False, highlight=False)
            progress.update(task, description=name)

        profiling = False

        def note(line: str) -> None:  # one line above the bar: the plan and its expected time
            progress.console.print(line, markup=False, highlight=False, soft_wrap=True)

        def report(state: dict) -> None:
            # total = the worker's own schedule (blocks x sizes x contexts); elapsed and ETA
            # start with profiling, not with the engine's load and compile.
            nonlocal profiling
            if not profiling:
                profiling = True
                progress.reset(task, total=state["total"], completed=state["done"])
            where = f"profiling ctx {state['context_len']}"
            if state.get("shape"):
                where += ", shape block (k + 1 tokens a request: the capture's shape_samples)"
            elif "block" in state:
                kind = "warm-up" if state["warmup"] else f"{state['samples_per_size']} samples/size"
                where += f", block {state['block']}/{state['blocks']} of vLLM's {state['vllm_replays']} replays ({kind})"
            progress.update(task, total=state["total"], completed=state["done"], description=where)

        log_existed = os.path.exists(log_path)
        try:
            with output_to(log_path):
                table = run_profile(opts, phase=phase, report=report, keep_capture=keep_capture,
                                    log_path=log_path, note=note)
        except BaseException:
            if not engine_started and not log_existed:  # refused before vLLM ran: no log worth keeping
                with contextlib.suppress(OSError):
                    os.remove(log_path)
            raise
        phase("writing table")
        path, replaced, shifts = _write(table, out, strict_stability)
        phase("done")
    extra = table.fingerprint.extra
    fp = table.fingerprint
    _said(table, path, replaced, shifts, terminal,
          f"wrote {path} (hash {table.short_hash}); engine start {extra.get('engine_start_s', 0):.1f} s, "
          f"of which profiling {extra.get('profile_s', 0):.1f} s; total {time.perf_counter() - started:.1f} s; "
          f"{fp.replays} samples per size ({fp.warmup_replays} warm-up discarded); curves equal vLLM's own")


def _host(name: str) -> str:
    from dspark_calib.vllm.profile.table import UNRECORDED

    return "a GPU host the capture does not name" if name == UNRECORDED else name


def _write(table: Any, out: TableOut, strict_stability: bool) -> tuple[str, str | None, list[str]]:
    """(the path written, the line when it replaced a table of the same content hash, the
    level-shift lines), after --strict-stability had its say."""
    from dspark_calib.cli.paths import write_error
    from dspark_calib.table.file import write_table

    shifts = stability_verdict(table, strict_stability)
    path, replaced = out.destination(table.default_filename(), table.content_hash)
    try:
        return write_table(table, path), replaced, shifts
    except OSError as exc:
        raise write_error(exc, path, out.option) from None


def _said(table: Any, path: str, replaced: str | None, shifts: list[str], terminal: Any, first: str) -> None:
    """What a written table ends with: its line, the replaced note (stdout), the level shifts,
    the telemetry note, and the summary with its verdict."""
    from rich.console import Console

    terminal.print(first, markup=False, highlight=False, soft_wrap=True)  # paths whole
    if replaced:
        Console().print(replaced, markup=False, highlight=False, soft_wrap=True)  # stdout, as the other commands
    for line in shifts or ["no level shift between blocks"]:
        terminal.print(line, markup=False, highlight=False)
    if table.telemetry is not None and table.telemetry.note:
        terminal.print(f"telemetry ({table.telemetry.source}): {table.telemetry.note}", markup=False, highlight=False)
    from dspark_calib.inspection import inspect_table
    from dspark_calib.render import render_summary
    from dspark_calib.render.text import Terminal

    render_summary(inspect_table(table, path=path), Terminal())

"""The `dspark-calib` command line: a thin typer layer over the library.

Import-time budget: nothing heavy at module level (no torch, vllm, scipy, matplotlib,
not even pandas/pyarrow), so `--help`, `--version` and `inspect` start fast; each
command imports what it needs. Every user-facing failure becomes one stderr line
and exit code 2 (see ``handled``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from typing import Annotated, Any, Callable, List, Optional, TypeVar

import typer
import typer.core

from dspark_calib import __version__
from dspark_calib.env import is_decimal
from dspark_calib.errors import PREFIX, CalibError, first_line
from dspark_calib.pricing.policy import DEFAULT_CONTEXT_CHUNKS, DEFAULT_CONTEXT_TAIL_MILLI  # standard library only

PROG = "dspark-calib"
EXIT_ERROR = 2  # bad input; 1 is reserved for "diff threshold exceeded"


class _OneLineUsageErrors(typer.core.TyperGroup):
    """Usage errors (unknown option, missing argument, value out of range) as one stderr line, exit 2.

    typer draws them in a multi-line rich box; the line names the command, the setting and
    the problem like every other error here. Runs for the console script and CliRunner alike.
    """

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        if sys.stdout is None:  # started with stdout closed (`>&-`): say so before any work or file
            typer.echo(error_line(CalibError("standard output is closed; nothing could be printed")), err=True)
            sys.exit(EXIT_ERROR)
        # typer >= 0.28 vendors click (typer._click); BadParameter's module is the one in use
        exceptions = sys.modules[typer.BadParameter.__module__]
        stdout, sys.stdout = sys.stdout, _NamedStdout(sys.stdout)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except exceptions.ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # the help is already on stdout (typer's own test)
                sys.exit(exc.exit_code)
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path.removeprefix(PROG).strip() if ctx is not None else ""
            hint = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
            message = (f"{where}: " if where else "") + exc.format_message() + hint
            typer.echo(error_line(CalibError(message)), err=True)  # the one place errors become a line
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo(f"{PROG}: aborted", err=True)
            sys.exit(1)
        except OSError as exc:  # --help, --version: they print before any command's handled()
            typer.echo(stdout_lost(exc), err=True)
            sys.exit(EXIT_ERROR)
        finally:
            sys.stdout = stdout
        sys.exit(rv if isinstance(rv, int) else 0)  # typer returns an Exit's code when not standalone


app = typer.Typer(
    cls=_OneLineUsageErrors,
    name=PROG,
    help="Offline cost tables for vLLM's DSpark adaptive verification: inspect, compare, import, merge.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])
# Bounds for the sizes a user types into import-vllm and check: far above any engine, low enough
# that a typo (a pasted 20-digit number) is an error rather than a fingerprint value.
MAX_TP, MAX_K = 4096, 64


def _not_blank(value: Optional[str]) -> Optional[str]:
    if value is not None and not value.strip():
        raise typer.BadParameter("must not be empty")
    return value


def _finite(value: Optional[float]) -> Optional[float]:
    """A threshold option's check: click's range lets nan and inf through, and a nan threshold is
    never exceeded, so a CI gate would silently pass."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def error_line(exc: BaseException) -> str:
    """`dspark-calib: error: <path>: <problem>`, on one line whatever the exception carried."""
    if isinstance(exc, CalibError):
        msg = str(exc)  # already "<path>: <problem>" when it knows the path
    elif isinstance(exc, OSError) and exc.strerror:
        msg = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    else:
        msg = str(exc) or type(exc).__name__
    return PREFIX + "error: " + " ".join(msg.split())


def stdout_lost(exc: BaseException) -> str:
    """The line for output that could not be written (`> /dev/full`). Standard output then goes to
    os.devnull: the text still buffered is not tried again, and said again, at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (CliRunner): nothing buffered there
        pass
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
    return error_line(CalibError(f"standard output could not be written: {why}"))


class StdoutLost(OSError):
    """A write to standard output failed (`> /dev/full`): the line names standard output, where
    an OSError of the write itself names no file."""


class _NamedStdout:
    """Standard output, its write and flush failures raised as StdoutLost (a broken pipe stays
    one: `| head` is no error). Everything else is the stream's own."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._named(self._stream.write, text)

    def flush(self) -> None:
        self._named(self._stream.flush)

    @staticmethod
    def _named(call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutLost(exc.errno, exc.strerror) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def handled(func: F) -> F:
    """Turn CalibError/OSError/ValueError (and RecursionError/MemoryError) into one stderr line and exit 2, never a traceback.

    Wraps each command (not just main) so typer's CliRunner sees the same behaviour
    as the console script. Also used for the `profile` command registered below.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except BrokenPipeError:  # `dspark-calib inspect t | head`: not an error worth a line
            raise typer.Exit(0)
        except StdoutLost as exc:
            typer.echo(stdout_lost(exc), err=True)
            raise typer.Exit(EXIT_ERROR)
        except (CalibError, OSError, ValueError) as exc:
            typer.echo(error_line(exc), err=True)
            raise typer.Exit(EXIT_ERROR)
        except (RecursionError, MemoryError) as exc:  # e.g. deeply nested JSON input
            typer.echo(f"{PROG}: error: input too deeply nested or too large ({type(exc).__name__})", err=True)
            raise typer.Exit(EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


MIN_COLUMNS = 80  # narrower, rich elides the tables' numbers (or prints nothing at COLUMNS=0)


def _columns() -> int | None:
    """The width to render at: COLUMNS when it is a usable number, else 100 when piped (CI logs,
    README snippets: wider than rich's 80), else the terminal's."""
    raw = os.environ.get("COLUMNS")
    if raw is not None and is_decimal(raw.strip()) and int(raw) > 0:
        return max(int(raw), MIN_COLUMNS)
    if not sys.stdout.isatty():
        return 100
    if raw is None:
        return None  # rich asks the terminal
    import shutil

    return shutil.get_terminal_size().columns  # a bad COLUMNS must not reach rich (0: no output at all)


def _console() -> Any:
    from dspark_calib.render.text import Terminal

    class _Console(Terminal):
        def on_broken_pipe(self) -> None:
            # `dspark-calib inspect t | head`: rich exits 1, which reads as "threshold exceeded" /
            # "no table"; handled() turns BrokenPipeError into exit 0 instead.
            self.quiet = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise BrokenPipeError

    return _Console(highlight=False, width=_columns())


def _warn(message: str) -> None:
    typer.echo(f"{PROG}: warning: " + " ".join(message.split()), err=True)


def _write_table(table: Any, out: Any, *, quiet: bool = False) -> str:
    """Write to a checked --out (paths.TableOut), then print the path, whether it replaced a table
    of the same content hash, and the summary (quiet: nothing; the caller prints JSON). The
    summary is made first: a table it cannot describe is never written. A write failure names
    the user's path. Returns the path written."""
    from dspark_calib.cli.paths import write_error
    from dspark_calib.inspection import inspect_table
    from dspark_calib.render import render_summary
    from dspark_calib.table.file import write_table

    path, replaced = out.destination(table.default_filename(), table.content_hash)
    summary = inspect_table(table, path=path)
    try:
        write_table(table, path)
    except OSError as exc:
        raise write_error(exc, path, out.option) from None
    if quiet:
        return path
    typer.echo(path)
    if replaced:
        typer.echo(replaced)
    render_summary(summary, _console())
    return path


def _plot(draw: Callable[..., str], path: str, *args: Any, **kwargs: Any) -> str:
    from dspark_calib.cli.paths import write_error

    try:
        return draw(*args, path, **kwargs)
    except OSError as exc:
        raise write_error(exc, path, "--plot") from None


def _print_json(data: Any) -> None:
    """Strict JSON whatever the numbers: NaN (nothing to say) is null, an infinity (a step measured at
    ~0 ms in an observe file, say) the string "inf" or "-inf"; the command exits as it would
    without --json."""
    typer.echo(json.dumps(_json_numbers(data), indent=2, allow_nan=False))


def _report(data: dict, plot: str | None, as_json: bool, render: Callable[[Any], None]) -> Any:
    """A command's result as JSON (the plot's path in it), or rendered, the plot's path said after;
    the console it rendered to (None for JSON), for a command's own last lines."""
    if as_json:
        _print_json({**data, "plot": plot})
        return None
    console = _console()
    render(console)
    if plot:
        console.print(f"plot written to {plot}", markup=False, soft_wrap=True)  # a path, whole
    return console


def _json_numbers(data: Any) -> Any:
    if isinstance(data, float) and not math.isfinite(data):
        return None if math.isnan(data) else ("inf" if data > 0 else "-inf")
    if isinstance(data, dict):
        return {k: _json_numbers(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_json_numbers(v) for v in data]
    return data


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Offline cost tables for vLLM's DSpark adaptive verification: inspect, compare, import, merge."""


# Options shared by several commands.
JsonOpt = Annotated[bool, typer.Option("--json", help="Print everything as JSON instead of tables.")]
PlotOpt = Annotated[Optional[str], typer.Option(
    "--plot", metavar="FILE", help="Also write a plot; .png, .svg or .pdf (the suffix picks the format).")]
MethodOpt = Annotated[str, typer.Option(
    "--method", help="vLLM's speculative method: dspark, draft_model, eagle, eagle3, mtp or dflash (the ones "
                     "vLLM runs adaptive verification for); recorded in the table and checked on load.")]
ForceOpt = Annotated[bool, typer.Option(
    "--force", help="Replace an existing output file (without it, only a table of the same content hash is).")]


@app.command("inspect")
@handled
def inspect_cmd(
    table: Annotated[str, typer.Argument(metavar="TABLE", help="Cost table (.parquet).")],
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    context_len: Annotated[Optional[int], typer.Option(
        "--context-len", min=1, metavar="L", help="Show only the profiled context length nearest to L.")] = None,
    all_points: Annotated[bool, typer.Option(
        "--all", help="Show every size of long curves, and the notes (findings that need no action).")] = False,
    force: ForceOpt = False,
) -> None:
    """Verdict (fit to serve or not, and why), fingerprint, curves, draft budgets, warnings; notes with --all."""
    from dspark_calib.cli.paths import plot_path

    plot = plot_path(plot, [table], force=force)  # before any work: a bad path costs nothing
    from dspark_calib.inspection import inspect_table
    from dspark_calib.table.file import read_table

    t = read_table(table)
    insp = inspect_table(t, context_len=context_len, path=table)
    if plot:
        from dspark_calib.render import plot_table

        plot = _plot(plot_table, plot, t, context_len=context_len)
    from dspark_calib.render import render_inspect

    _report(insp.to_dict() if as_json else {}, plot, as_json, lambda c: render_inspect(insp, c, all_points=all_points))


@app.command("diff")
@handled
def diff_cmd(
    old: Annotated[str, typer.Argument(metavar="OLD", help="Baseline table.")],
    new: Annotated[str, typer.Argument(metavar="NEW", help="Table to compare against it.")],
    threshold: Annotated[Optional[float], typer.Option(
        "--threshold", min=0, metavar="PCT", callback=_finite,
        help="Exit 1 when a statistically significant (p < 0.01) cost change, slower or faster, exceeds PCT "
             "percent. Implies --significance.")] = None,
    significance: Annotated[bool, typer.Option(
        "--significance", "-s",
        help="Test each size's change on the raw samples (Mann-Whitney U, scipy; ~0.8 s more).")] = False,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    old_context: Annotated[Optional[int], typer.Option(
        "--old-context", min=1, metavar="L", help="Context length of OLD to compare (nearest profiled).")] = None,
    new_context: Annotated[Optional[int], typer.Option(
        "--new-context", min=1, metavar="L", help="Context length of NEW to compare (nearest profiled).")] = None,
    all_points: Annotated[bool, typer.Option(
        "--all", help="List every compared size, not just the largest changes.")] = False,
    force: ForceOpt = False,
) -> None:
    """Compare two tables: fingerprint, per-size cost changes (with significance), decision impact.

    Default context: one both tables profiled (nearest to 8192), else each one's nearest to 8192.
    """
    from dspark_calib.cli.paths import plot_path

    plot = plot_path(plot, [old, new], force=force)
    from dspark_calib.compare import compare_tables, threshold_verdict
    from dspark_calib.table.file import read_table

    a, b = read_table(old), read_table(new)
    result = compare_tables(a, b, old_context=old_context, new_context=new_context, old_path=old, new_path=new,
                            significance=significance or threshold is not None)
    verdict = None if threshold is None else threshold_verdict(result, threshold)
    if plot:
        from dspark_calib.render import plot_diff

        plot = _plot(plot_diff, plot, a, b, result=result)
    from dspark_calib.render import render_diff

    _report({**result.to_dict(), "threshold": verdict.to_dict() if verdict else None} if as_json else {}, plot,
            as_json, lambda c: render_diff(result, c, verdict=verdict, all_points=all_points))
    if verdict is not None and verdict.exceeded:
        raise typer.Exit(1)


@app.command("import-vllm")
@handled
def import_vllm_cmd(
    jsons: Annotated[List[str], typer.Argument(
        metavar="JSON", help="vLLM start-up profiles (rows + batches), one per context length.")],
    model: Annotated[str, typer.Option("--model", metavar="DIR", help="Target model directory (its config.json is hashed).")],
    gpu_name: Annotated[str, typer.Option(
        "--gpu-name", help="GPU the profile was taken on, as torch.cuda.get_device_name() names it ('NVIDIA H200').")],
    vllm_version: Annotated[str, typer.Option("--vllm-version", help="vllm.__version__ of that engine ('0.33.0').")],
    num_speculative_tokens: Annotated[int, typer.Option("--num-speculative-tokens", min=1, max=MAX_K, metavar="K")],
    out: Annotated[str, typer.Option(
        "--out", metavar="FILE|DIR/", help="Table file (.parquet), or a directory for the default file name "
                                           "(a new one ends with '/').")] = ".",
    torch_version: Annotated[str, typer.Option("--torch-version")] = "",
    driver_version: Annotated[str, typer.Option("--driver-version")] = "",
    cuda_version: Annotated[str, typer.Option("--cuda-version")] = "",
    compute_capability: Annotated[str, typer.Option("--compute-capability")] = "",
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", min=1, max=MAX_TP)] = 1,
    dtype: Annotated[str, typer.Option("--dtype", callback=_not_blank)] = "bfloat16",
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", callback=_not_blank)] = "auto",
    method: MethodOpt = "dspark",
    draft: Annotated[Optional[str], typer.Option(
        "--draft", metavar="DIR", help="The drafter's directory for --method (not for mtp: the target drafts).")] = None,
    force: ForceOpt = False,
) -> None:
    """Make a table from vLLM's own start-up profiling samples (saved as JSON)."""
    from dspark_calib.cli.paths import refuse_duplicate_inputs, table_out
    from dspark_calib.reference import identity_warnings, table_from_startup_json

    refuse_duplicate_inputs(jsons, "profile")
    target = table_out(out, jsons, force=force)
    t = table_from_startup_json(
        jsons, model=model, draft=draft, gpu_name=gpu_name, vllm_version=vllm_version,
        num_speculative_tokens=num_speculative_tokens, torch_version=torch_version, driver_version=driver_version,
        cuda_version=cuda_version, gpu_compute_capability=compute_capability,
        tensor_parallel_size=tensor_parallel_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, method=method)
    for line in identity_warnings(gpu_name, vllm_version):  # once the inputs read: bad input stays one line
        _warn(line)
    _write_table(t, target)


@app.command("merge")
@handled
def merge_cmd(
    tables: Annotated[List[str], typer.Argument(metavar="TABLE", help="Tables from runs of the same engine.")],
    out: Annotated[str, typer.Option("--out", metavar="FILE|DIR/", help="Merged table file (.parquet), or a directory for it "
                                                              "(a new one ends with '/').")],
    force: ForceOpt = False,
) -> None:
    """Pool the raw samples of several runs of one engine and refit the curves."""
    from dspark_calib.cli.paths import refuse_duplicate_inputs, refuse_same_tables, table_out
    from dspark_calib.errors import display_path
    from dspark_calib.table.model import merge_tables
    from dspark_calib.table.file import read_table

    refuse_duplicate_inputs(tables, "table")
    target = table_out(out, tables, force=force)
    read = [read_table(p) for p in tables]
    refuse_same_tables(tables, [t.content_hash for t in read])
    merged = merge_tables(read, names=[display_path(p) for p in tables])  # errors name the files
    _write_table(merged, target)


@app.command("check")
@handled
def check_cmd(
    source: Annotated[str, typer.Argument(metavar="TABLE|DIR", help="A table, or a directory of tables, as DSPARK_CALIB_TABLE takes.")],
    serve_flags: Annotated[Optional[List[str]], typer.Argument(
        metavar="[-- VLLM_SERVE_FLAGS...]", show_default=False,
        help="The engine as `vllm serve` is given it, after --: MODEL --speculative-config ... (a leading "
             "'vllm serve' may stay). Resolved through vLLM's own EngineArgs when vLLM is installed, else "
             "by vLLM's documented defaults.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", metavar="DIR", help="Target model directory (config.json hashed as the fingerprint does).")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", metavar="DIR", help="DSpark draft model directory.")] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", min=1, max=MAX_TP, help="tensor_parallel_size.")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option("--max-num-seqs", min=1)] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option("--max-num-batched-tokens", min=1)] = None,
    num_speculative_tokens: Annotated[Optional[int], typer.Option("--num-speculative-tokens", min=1, max=MAX_K,
                                                                  metavar="K")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="As vLLM resolves it: bfloat16, float16, float32.")] = None,
    kv_cache_dtype: Annotated[Optional[str], typer.Option("--kv-cache-dtype")] = None,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", min=1)] = None,
    gpu_name: Annotated[Optional[str], typer.Option("--gpu-name", help="As torch.cuda.get_device_name() says it.")] = None,
    vllm_version: Annotated[Optional[str], typer.Option("--vllm-version")] = None,
    context_len: Annotated[Optional[int], typer.Option("--context-len", min=1, metavar="L", help="DSPARK_CALIB_CONTEXT_LEN: which curve set loads.")] = None,
    engine: Annotated[Optional[List[str]], typer.Option("--engine", metavar="KEY=VALUE", help="Any other fingerprint key, e.g. gpu_memory_mib=143155 or attention_backend=FLASH_ATTN (repeatable).")] = None,
    allow_reference: Annotated[bool, typer.Option("--allow-reference", help="As DSPARK_CALIB_ALLOW_REFERENCE=1: reference tables may load.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Which table the plugin would load for this engine, offline (no GPU).

    Exit 0: a table loads and every blocking key was checked; 3: it loads if the keys decided at start
    match; 1: none loads; 2: bad input, or a corrupt or unreadable table.
    """
    from dspark_calib.check import check_tables, describe, parse_engine_pairs
    from dspark_calib.serve_args import HARDWARE_KEYS, profile_context

    extra = parse_engine_pairs(engine or [])
    engine_options = {"--model": model, "--draft": draft, "--tp": tp, "--max-num-seqs": max_num_seqs,
                      "--max-num-batched-tokens": max_num_batched_tokens, "--dtype": dtype,
                      "--num-speculative-tokens": num_speculative_tokens, "--kv-cache-dtype": kv_cache_dtype,
                      "--max-model-len": max_model_len}
    if serve_flags:
        given = [flag for flag, value in engine_options.items() if value is not None]
        if given:
            raise CalibError(f"{', '.join(given)}: with vllm serve flags, give {'these' if len(given) > 1 else 'it'} "
                             "among them (after --)")
        hardware = {"gpu_name": gpu_name, **{k: v for k, v in extra.items() if k in HARDWARE_KEYS}}
        resolved = _resolve_serve(serve_flags, hardware)
        described = {**resolved.engine, **extra, **({"vllm_version": vllm_version} if vllm_version else {})}
        vllm_context, how = resolved.vllm_context_len, resolved.how
    else:
        described = describe(model=model, draft=draft, extra=extra, tensor_parallel_size=tp,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             num_speculative_tokens=num_speculative_tokens, dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len, gpu_name=gpu_name,
                             vllm_version=vllm_version)
        vllm_context, how = profile_context(), "as the options give it (the vllm serve flags after -- resolve the rest)"
    result = check_tables(source, described, allow_reference=allow_reference, context_len=context_len,
                          vllm_context_len=vllm_context, resolution=how)
    if as_json:
        _print_json(result.to_dict())
    else:
        from dspark_calib.render.text import render_check

        render_check(result, _console())
    if result.problem:  # after the report: the line says why the answer cannot be trusted
        raise CalibError(result.problem, path=source)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def _resolve_serve(flags: List[str], hardware: dict) -> Any:
    """The engine `vllm serve FLAGS` starts: through vLLM's own classes when it is installed (imported
    only here), else by its documented defaults."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        from dspark_calib.vllm.engine_args import resolve
    else:
        from dspark_calib.serve_args import resolve
    return resolve(flags, hardware)


@app.command("validate")
@handled
def validate_cmd(
    table: Annotated[str, typer.Argument(metavar="TABLE", help="The cost table the engine served with.")],
    observed: Annotated[List[str], typer.Argument(
        metavar="OBSERVED...", help="Observe-mode files; a directory stands for its observed-*.parquet files.")],
    context: Annotated[Optional[int], typer.Option(
        "--context", min=1, metavar="L",
        help="Single-context pricing at the profiled context nearest L (default: nearest vLLM's 8192).")] = None,
    max_error: Annotated[Optional[float], typer.Option(
        "--max-error", min=0, metavar="PCT", callback=_finite,
        help="Exit 1 when the context-aware median error of drafts or decode verifies at any context bucket "
             "exceeds PCT percent (steps carrying a prefill chunk are shown, not judged).")] = None,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    all_groups: Annotated[bool, typer.Option("--all", help="List every size x context group.")] = False,
    tail: Annotated[Optional[float], typer.Option(
        "--tail", min=0, max=1, metavar="T",
        help="Context-aware pricing with the mixed-context tail T "
             "(mean + T x min(max - mean, mean^2 / (max - mean))); "
             "default: the tail the files record (DSPARK_CALIB_CONTEXT_TAIL of the engine), else the plugin's "
             f"default ({DEFAULT_CONTEXT_TAIL_MILLI / 1000:g}).")] = None,
    chunks: Annotated[Optional[bool], typer.Option(
        "--chunks/--no-chunks",
        help="Context-aware pricing of prefill chunks by their query-context pairs (--chunks) or by the KV sum; "
             "default: as the files' engines priced them (DSPARK_CALIB_CONTEXT_CHUNKS), else the plugin's default "
             f"({'pairs' if DEFAULT_CONTEXT_CHUNKS else 'the KV sum'}).")] = None,
    force: ForceOpt = False,
) -> None:
    """Predicted vs measured step cost on observed serving steps: single-context and context-aware pricing.

    Offline (no GPU, no torch, no vLLM). Exit 1 with --max-error exceeded (for CI and fleet monitoring).
    """
    from dspark_calib.observe.file import observed_paths
    from dspark_calib.cli.paths import plot_path, refuse_duplicate_inputs

    files = observed_paths(observed)  # directories expanded: --plot is checked against every input
    refuse_duplicate_inputs(files, "observe file")  # a file counted twice doubles its steps' weight
    plot = plot_path(plot, [table, *files], force=force)  # before any work
    from dspark_calib.env import tail_to_milli  # standard library only

    tail_milli = None if tail is None else tail_to_milli(tail, f"--tail {tail:g}")
    from dspark_calib.observe.file import read_observed
    from dspark_calib.table.file import read_table
    from dspark_calib.validate import max_error_exceeded, validate

    t = read_table(table, samples=False)  # curves and metadata: raw samples are not needed here
    result = validate(t, read_observed(files), single_context=context, tail_milli=tail_milli, chunks=chunks)
    exceeded = max_error is not None and max_error_exceeded(result, max_error)
    if plot:
        from dspark_calib.render.validation import plot_validation

        plot = _plot(plot_validation, plot, result)
    from dspark_calib.render.validation import render_validation

    data = {**result.to_dict(), "max_error": None if max_error is None else {"pct": max_error, "exceeded": exceeded}}
    console = _report(data if as_json else {}, plot, as_json,
                      lambda c: render_validation(result, c, max_error=max_error, all_groups=all_groups))
    if console is not None and max_error is not None:
        console.print(f"max error {max_error:g}%: " + ("exceeded (context-aware median, some kind and context)"
                                                      if exceeded else "within"), markup=False)
    if exceeded:
        raise typer.Exit(1)


@app.command("calibrate")
@handled
def calibrate_cmd(
    table: Annotated[str, typer.Argument(metavar="TABLE", help="The measured table the engines served with.")],
    observed: Annotated[List[str], typer.Argument(
        metavar="OBSERVED...", help="Observe-mode files of its engine; a directory stands for its observed-*.parquet "
                                    "files.")],
    out: Annotated[str, typer.Option(
        "--out", metavar="FILE|DIR/", help="The calibrated table (.parquet), or a directory for it (a new one ends "
                                           "with '/'); never the measured table.")],
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """A new table of the same fingerprint, its curves corrected by served steps (one factor per curve kind and
    size region), with the parent's hash and the files it was fitted on recorded.

    Offline (no GPU, no torch, no vLLM). Judge it with `validate` on observe files it was not fitted on.
    """
    from dspark_calib.cli.paths import refuse_duplicate_inputs, table_out
    from dspark_calib.observe.file import observed_paths

    files = observed_paths(observed)
    refuse_duplicate_inputs(files, "observe file")  # a file counted twice doubles its steps' weight
    target = table_out(out, [table, *files], force=force)
    from dspark_calib.calibrate import calibrate
    from dspark_calib.table.file import read_table

    result = calibrate(read_table(table), files)
    path = _write_table(result.table, target, quiet=as_json)
    if as_json:
        _print_json({"path": path, **result.to_dict()})
        return
    from dspark_calib.render.text import render_calibration

    render_calibration(result, _console())


@app.command("advise")
@handled
def advise_cmd(
    table: Annotated[str, typer.Argument(metavar="TABLE", help="The cost table to model the engine with.")],
    observed: Annotated[Optional[List[str]], typer.Argument(
        metavar="[OBSERVED...]", show_default=False,
        help="Observe-mode files (a directory stands for its observed-*.parquet files) of an engine of the "
             "table's fingerprint: the acceptance they measured.")] = None,
    acceptance: Annotated[Optional[str], typer.Option(
        "--acceptance", metavar="RATES",
        help="k comma-separated non-increasing rates in [0, 1], k the table's num_speculative_tokens: rate i is "
             "the probability that the first i drafts are all accepted (vLLM's synthetic_acceptance_rates).")] = None,
    context: Annotated[Optional[List[int]], typer.Option(
        "--context", min=0, metavar="L", help="Context of every request (repeatable; default: the table's "
                                              "profiled contexts).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(
        "--max-num-seqs", min=1, metavar="N", help="Largest batch modelled (default: the table's max_num_seqs); "
                                                   "batches 1, 2, 4, ... N.")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(
        "--vocab-size", min=1, metavar="V", help="The target's vocabulary: adaptive verification then verifies at "
                                                 "most 2^30 / (4 V) logits a step, as vLLM's rejection sampler "
                                                 "(default: no limit modelled).")] = None,
    all_fixed: Annotated[bool, typer.Option("--all", help="A column for every fixed K.")] = False,
    steps_from: Annotated[Optional[List[str]], typer.Option(
        "--steps-from", metavar="OBSERVED",
        help="Observe-mode files (repeatable; a directory stands for its observed-*.parquet files) whose decode "
             "steps to model instead of the grid: each option's goodput over those steps, each at its batch "
             "size and mean context.")] = None,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    force: ForceOpt = False,
) -> None:
    """Modelled goodput of fixed K and adaptive verification per batch size and context; where adaptive loses.

    Offline (no GPU, no torch, no vLLM).
    """
    from dspark_calib.cli.paths import plot_path, refuse_duplicate_inputs
    from dspark_calib.observe.file import observed_paths, read_observed

    if (acceptance is None) == (not observed):
        raise CalibError("give the acceptance either as --acceptance RATES or as observe files, one of the two")
    if steps_from and (context or max_num_seqs or all_fixed or plot):
        raise CalibError("--steps-from models the observed steps; --context, --max-num-seqs, --all and --plot "
                         "shape the grid of batch sizes and contexts: give one or the other")
    files = observed_paths(observed or [])
    refuse_duplicate_inputs(files, "observe file")
    step_files = observed_paths(steps_from or [])
    refuse_duplicate_inputs(step_files, "--steps-from file")
    plot = plot_path(plot, [table, *files], force=force)  # before any work
    from dspark_calib.advise import Acceptance, advise, check_schedule, observed_acceptance, parse_rates
    from dspark_calib.table.file import read_table

    t = read_table(table, samples=False)
    k = int(t.fingerprint.num_speculative_tokens)
    if acceptance is not None:
        given = Acceptance(check_schedule(parse_rates(acceptance), k), "given")
    else:
        given = observed_acceptance(t, read_observed(files))
    if steps_from:
        from dspark_calib.advise import predict_observed
        from dspark_calib.errors import display_path
        from dspark_calib.render.advice import render_step_mix

        mix = predict_observed(t, given, read_observed(step_files), vocab_size=vocab_size)
        _report({**mix.to_dict(), "steps_from": [display_path(f) for f in step_files]} if as_json else {}, None,
                as_json, lambda c: render_step_mix(mix, c))
        return
    result = advise(t, given, contexts=context, max_num_seqs=max_num_seqs, vocab_size=vocab_size)
    if plot:
        from dspark_calib.render import plot_advice

        plot = _plot(plot_advice, plot, result)
    from dspark_calib.render.advice import render_advice

    _report(result.to_dict() if as_json else {}, plot, as_json, lambda c: render_advice(result, c, all_fixed=all_fixed))


@app.command("seed")
@handled
def seed_cmd(
    observed: Annotated[List[str], typer.Argument(
        metavar="OBSERVED...", help="Observe-mode files of one engine (schema 1.3); a directory stands for its "
                                    "observed-*.parquet files.")],
    out: Annotated[str, typer.Option("--out", metavar="FILE", help="The seed file (.json).")],
    as_json: JsonOpt = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing seed file.")] = False,
) -> None:
    """A seed for vLLM's online acceptance estimator: the newest coefficients after a refit that observe mode
    recorded, with the keys an engine must match (DSPARK_CALIB_ESTIMATOR_SEED=FILE starts the estimator there).

    Offline (no GPU, no torch, no vLLM).
    """
    from dspark_calib.cli.paths import refuse_duplicate_inputs, seed_out, write_error
    from dspark_calib.observe.file import observed_paths

    files = observed_paths(observed)
    refuse_duplicate_inputs(files, "observe file")
    target = seed_out(out, files, force=force)  # before any work
    from dspark_calib.seed import seed_from_observed, write_seed

    seed = seed_from_observed(files)
    try:
        write_seed(seed, target)
    except OSError as exc:
        raise write_error(exc, target, "--out") from None
    if as_json:
        _print_json({"path": target, **seed.to_dict()})
        return
    from dspark_calib.render.seed import render_seed

    render_seed(seed, target, _console())


# -- profile (the vLLM backend; imports vllm/torch only when it runs) --------------------------
@app.command("profile")
@handled
def profile_cmd(
    model: Annotated[str, typer.Option("--model", metavar="DIR|HF_ID",
                                       help="Target model: a directory with config.json, or a Hugging Face id "
                                            "already in the local cache.")],
    draft: Annotated[Optional[str], typer.Option(
        "--draft", metavar="DIR|HF_ID", help="The drafter for --method: a DSpark drafter (architectures "
                                             "Qwen3DSparkModel/DSparkDraftModel), a draft model, an EAGLE/EAGLE-3 "
                                             "head, a DFlash drafter; none for mtp (the target's own layers).")] = None,
    method: MethodOpt = "dspark",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size, through vLLM's own executor.")] = 1,
    num_speculative_tokens: Annotated[Optional[int], typer.Option(
        "--num-speculative-tokens", metavar="K", help="Default: a DSpark drafter's block_size; needed for "
                                                     "the other methods.")] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens")] = 8192,
    context_len: Annotated[List[int], typer.Option(
        "--context-len", metavar="L", help="Context length of the dummy requests; repeat for several "
                                          "(one engine start). Refused if vLLM would clamp it. Default: 1024, "
                                          "8192 and the longest context vLLM profiles under max_model_len "
                                          "(max_model_len minus the largest batch's query tokens).")] = [],
    replays: Annotated[int, typer.Option(
        "--replays", help="Timed samples per size and context, run as vLLM runs them: whole blocks of its 5 "
                          "back-to-back replays, so rounded up to a multiple of 5 (--replays 3 gives 5; vLLM "
                          "alone: 5). The table records the number run.")] = 20,
    warmup: Annotated[int, typer.Option(
        "--warmup", help="Warm-up samples per size and context, timed but discarded; rounded up to whole blocks "
                         "of 5 like --replays (0: none).")] = 2,
    gpu_state: Annotated[str, typer.Option(
        "--gpu-state", metavar="startup|serving",
        help="The GPU state each block starts in, recorded in the table (merge pools one state only). startup: "
             "as vLLM's own start-up pass, after light work (cooled down between blocks, --cooldown). serving: as "
             "a loaded server, at its power limit and clocks (settled under the block's heaviest step before "
             "each block, --settle).")] = "startup",
    cooldown: Annotated[Optional[float], typer.Option(
        "--cooldown", metavar="SECONDS",
        help="startup state: most seconds to idle before each block but the first (default 1; 0: off, at most "
             "60; ends early once power and throttling are back to the first block's), so a block's smallest "
             "sizes do not run in the heat the previous block's largest steps left, which vLLM's own single "
             "pass never does.")] = None,
    settle: Annotated[Optional[float], typer.Option(
        "--settle", metavar="SECONDS",
        help="serving state: most seconds of the block's heaviest step, back to back, before each block "
             "(default 5; 0: none, at most 120; ends early, after at least 1 s, once the SM clock and power "
             "have held still for 0.5 s).")] = None,
    shape_replays: Annotated[int, typer.Option(
        "--shape-replays", metavar="N",
        help="Also time, after each context's blocks, every size above the CUDA-graph capture limit that is a "
             "multiple of k + 1 (fewer than max_num_seqs requests) as size / (k + 1) requests of k + 1 tokens "
             "(vLLM's uniform-decode batch: a verify of every draft), N times each; "
             "kept in --keep-capture's samples (shape_samples) for the analysis of served verify shapes, never "
             "in the table's curves (default 0: none).")] = 0,
    load_format: Annotated[Optional[str], typer.Option(
        "--load-format", help="dummy (the default): random weights, only config.json is read (timings do not "
                              "depend on weights); auto: real weights.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="One of vLLM's model dtypes.")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="One of vLLM's KV cache dtypes.")] = "auto",
    quantization: Annotated[Optional[str], typer.Option("--quantization")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(
        "--gpu-memory-utilization", help="In (0, 1]; default 0.85.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(
        "--max-model-len", help="Default: vLLM's own (from the model config, as vllm serve). Checked on load: "
                              "serve with the same.")] = None,
    distributed_executor_backend: Annotated[Optional[str], typer.Option(
        "--distributed-executor-backend", help="mp (one node) or ray (across nodes).")] = None,
    engine_arg: Annotated[List[str], typer.Option(
        "--engine-arg", metavar="KEY=VALUE",
        help="Any other vLLM EngineArgs field, repeatable; VALUE is JSON when it parses, else a string "
             "(e.g. --engine-arg block_size=32 --engine-arg attention_backend=TRITON_ATTN).")] = [],
    engine_args_json: Annotated[Optional[str], typer.Option(
        "--engine-args-json", metavar="FILE|JSON", help="EngineArgs fields as a JSON object, or a file holding one; "
                                                        "--engine-arg wins on the same key.")] = None,
    out: Annotated[str, typer.Option(
        "--out", metavar="FILE|DIR/", help="Table file (.parquet), or a directory for the default name (a new "
                                           "one ends with '/'); vLLM's log goes beside it.")] = ".",
    keep_capture: Annotated[Optional[str], typer.Option(
        "--keep-capture", metavar="DIR", help="Also keep the raw per-rank capture JSON here (rank 0's rebuilds "
                                             "the table: --from-capture).")] = None,
    from_capture: Annotated[Optional[str], typer.Option(
        "--from-capture", metavar="FILE",
        help="No GPU, no engine: build the table from rank 0's capture a GPU run kept (--keep-capture "
             "DIR/samples-rank0.json), as that run would have; give the run's own options (checked against "
             "what the capture recorded).")] = None,
    strict_stability: Annotated[bool, typer.Option(
        "--strict-stability", help="Fail (exit 2, no table) when a block's level shifts from the others by over "
                                   "3 x the points' MAD; re-running is up to you.")] = False,
    force: ForceOpt = False,
) -> None:
    """Profile vLLM's draft/verify steps on this machine's GPUs and write a cost table (or, with
    --from-capture, rebuild one from a kept capture)."""
    options = dict(locals())
    from dspark_calib.cli import profile as profile_cmd

    profile_cmd.main(**options)


def main() -> None:
    """The console script (and ``python -m dspark_calib``). A command that ran without vLLM
    leaves without the interpreter's teardown: pyarrow's native thread pools, destroyed
    there, now and then abort a finished command ("terminate called without an active
    exception", SIGABRT) after its output and exit code were settled. Output is flushed
    first and the command writes its files atomically before it returns, so nothing is
    lost. With vLLM imported (profile), the normal exit runs vLLM's own shutdown hooks."""
    try:
        app(prog_name=PROG)
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    if sys.modules.get("vllm") is not None:
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, exit 1
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BrokenPipeError:  # `| head`: what could be said was said
            code = code or EXIT_ERROR
        except (OSError, ValueError) as exc:  # the output is lost: said, when stderr still takes a line
            if stream is sys.stdout and sys.stderr is not None:
                print(stdout_lost(exc), file=sys.stderr)
            code = EXIT_ERROR
    os._exit(code or 0)


if __name__ == "__main__":
    sys.exit(main())

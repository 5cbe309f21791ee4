"""Drawing only: the terminal view and PNG of a validate result (numbers from validate.py).

matplotlib is imported inside plot_validation, so `validate` without --plot never pays for it.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.table import Table

from dspark_calib.atomic import atomic_write
from dspark_calib.pricing.policy import CHUNK_RULE, TAIL_RULE
from dspark_calib.env import CONTEXT_CHUNKS, CONTEXT_TAIL  # standard library only
from dspark_calib.pricing.policy import DEFAULT_CONTEXT_CHUNKS
from dspark_calib.validate import (AWARE, KINDS, MIN_TAIL_STEPS, MIXED_SPREAD, PRICINGS, SINGLE, STALL_MS,
                                   VERDICT_KINDS, HostTime, ValidationResult)

LABEL = {SINGLE: "single-context", AWARE: "context-aware"}
MAX_GROUP_ROWS = 60


def _pct(value: float) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}%"


def _signed(value: float) -> str:
    return ("+" if value is not None and value > 0 else "") + _pct(value)


def _style(value: float, limit: float | None) -> str:
    if limit is None or value is None or math.isnan(value):
        return ""
    return "red" if value > limit else "green"


# The bucket columns of each errors table: (header, the group's cell).
Columns = Sequence[tuple[str, Callable[[Any], str]]]
CONTEXT: Columns = (("context", lambda g: g.context_bucket),)
SIZE_CONTEXT: Columns = (("size", lambda g: g.size_bucket), *CONTEXT)
SHAPE: Columns = (*CONTEXT, ("requests / R(N)", lambda g: g.fill_bucket))
CLOCK: Columns = (("SM clock MHz", lambda g: g.clock_bucket),
                  ("power W", lambda g: "—" if math.isnan(g.power_w) else f"{g.power_w:.0f}"))


def _errors_table(title: str, groups: Sequence[Any], *, limit: float | None, columns: Columns = CONTEXT) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("kind")
    for header, _ in columns:
        table.add_column(header, justify="right")
    table.add_column("steps", justify="right")
    for p in PRICINGS:
        table.add_column(f"{LABEL[p]} median", justify="right")
        table.add_column("p90", justify="right")
        table.add_column("bias", justify="right")
    for g in groups:
        s = g.errors[PRICINGS[0]]
        cells: list[Any] = [g.kind, *(cell(g) for _, cell in columns), str(s.n)]
        judged = limit if g.kind in VERDICT_KINDS else None  # --max-error judges these kinds only
        for p in PRICINGS:
            e = g.errors[p]
            median = _pct(e.median_pct)
            cells += [f"[{_style(e.median_pct, judged)}]{median}[/]" if _style(e.median_pct, judged) else median,
                      _pct(e.p90_pct), _signed(e.median_signed_pct)]
        table.add_row(*cells)
    return table


def _ms(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def _host_table(result: ValidationResult) -> Table:
    table = Table(title=f"host time between steps, ms (TP rank 0; {result.interval_steps} of {result.num_steps} "
                        f"steps): interval from the previous execute_model start to the step's; unpriced = interval "
                        f"- forward - drafter; host: the step's execute_model call; stalls: intervals over "
                        f"{STALL_MS / 1000:g} s", title_justify="left", show_edge=False, pad_edge=False)
    for header in ("kind", "context", "steps", "interval", "p95", "max", "unpriced", "p95", "max", "host",
                   "stalls", "largest"):
        table.add_column(header, justify="left" if header == "kind" else "right")
    g: HostTime
    for g in result.host_time:
        table.add_row(g.kind, g.context_bucket, str(g.steps), *(_ms(v) for v in (
            g.interval.median_ms, g.interval.p95_ms, g.interval.max_ms, g.unpriced.median_ms, g.unpriced.p95_ms,
            g.unpriced.max_ms, g.host.median_ms)), str(g.stalls), _ms(g.largest_stall_ms))
    return table


def render_validation(result: ValidationResult, console: Console | None = None, *, max_error: float | None = None,
                      all_groups: bool = False) -> None:
    """Header, per-kind and per-context errors, then the size x context detail (capped unless all_groups)."""
    console = console or Console()
    ctxs = ", ".join(str(c) for c in result.profiled_contexts)
    console.print(f"[bold]validate[/] table {result.table_hash[:12] or '—'}: {result.num_steps} observed steps "
                  f"from {len(result.files)} file(s)")
    console.print(f"profiled contexts {ctxs}; single-context pricing at {result.single_context}; "
                  f"context-aware grid {result.grid['points']} points (error bound "
                  f"{100 * result.grid['max_rel_error']:.2f}%)")
    if result.verify_out_of_range_steps:
        console.print(f"[yellow]{result.verify_out_of_range_steps} decode steps verify at a context outside "
                      f"{result.profiled_contexts[0]}..{result.profiled_contexts[-1]}[/]")
    if result.out_of_range_steps:
        console.print(f"[yellow]{result.out_of_range_steps} steps outside the profiled contexts "
                      f"{result.profiled_contexts[0]}..{result.profiled_contexts[-1]} (mean context)[/]")
    change = result.budget_change
    if change.compared:
        console.print(f"budget would change in {change.changed} of {change.compared} steps "
                      f"({100 * change.share:.1f}%) between the two pricings")
    else:
        console.print("budget change: not recorded in these files (needs budget_static and budget_context_aware)")
    fit = result.tail_fit
    if fit.steps:
        line = (f"mixed-context decode steps (longest >= {MIXED_SPREAD:g} x mean): {fit.steps}; context-aware verify "
                f"median {_pct(fit.verify.median_pct)} (bias {_signed(fit.verify.median_signed_pct)}) at tail "
                f"{fit.tail:g}")
        if fit.tail and fit.tail_rule != TAIL_RULE:  # an older engine's rule: say it, the numbers are its
            line += f" by the {fit.tail_rule} rule the files record (this release's: {TAIL_RULE})"
        if fit.best_tail is None:
            line += f"; too few up to 2 x mean to fit a tail ({fit.fitted}, under {MIN_TAIL_STEPS})"
        else:
            line += (f"; best tail {fit.best_tail:g} (on {fit.fitted} steps up to 2 x mean): verify "
                     f"{_pct(fit.best_verify.median_pct)} (bias "
                     f"{_signed(fit.best_verify.median_signed_pct)}), drafts {_pct(fit.best_draft.median_pct)} "
                     f"({CONTEXT_TAIL}={fit.best_tail:g})")
        console.print(line, markup=False)
    eng = result.engine
    if eng.compared:
        if eng.verify_equal == eng.draft_equal == eng.compared:
            console.print(f"context-aware pricing here = the engines' own predictions on all {eng.compared} steps",
                          markup=False)
        else:
            console.print(f"[yellow]context-aware pricing here differs from the engines' own predictions: verify on "
                          f"{eng.compared - eng.verify_equal}, drafts on {eng.compared - eng.draft_equal} of "
                          f"{eng.compared} steps (the files come from another pricing, table or engine sizes)[/]")
    pre = result.prefill
    if pre.steps:
        if pre.recorded:
            by = "chunks by query-context pairs" + ("" if pre.pair_rule == CHUNK_RULE else
                                                    f" (the {pre.pair_rule} rule of files before 2026-12-01)")
            kv, pairs = ("chunks by the KV sum", pre.kv_sum), (by, pre.pairs)
            used, other = (pairs, kv) if pre.by_pairs else (kv, pairs)
            line = (f"prefill-carrying steps: {pre.steps} ({pre.recorded} with their chunks recorded); verify median "
                    + ", ".join(f"{label} {_pct(e.median_pct)} (bias {_signed(e.median_signed_pct)})"
                                for label, e in (("single-context", pre.single),
                                                 (f"context-aware {used[0]} (in use)", used[1]), other))
                    + f" (engines: {CONTEXT_CHUNKS}=1 prices chunks by pairs, =0 by the KV sum; default "
                      f"{int(DEFAULT_CONTEXT_CHUNKS)})")
        else:
            line = (f"prefill-carrying steps: {pre.steps}; their chunks are not recorded (observe files before "
                    f"schema 1.1), so they are priced by the KV sum only")
        console.print(line, markup=False)
    console.print(_errors_table("absolute % error by kind", result.overall, limit=max_error))
    console.print(_errors_table("by context", result.by_context, limit=max_error))
    if result.by_clock:
        console.print(_errors_table(f"by GPU SM clock (as sampled with the step; {result.clocked_steps} of "
                                    f"{result.num_steps} steps)", result.by_clock, limit=None, columns=CLOCK))
    else:
        console.print("by GPU SM clock: not recorded in these files (observe schema 1.5 with NVML records it)")
    if result.by_shape:
        console.print(_errors_table("decode verifies by shape (requests over the profile's R(N) = min(N, max_num_seqs) "
                                    "at the step's size; > 0.9: the shape the profile times)", result.by_shape,
                                    limit=max_error, columns=SHAPE))
    if result.host_time:
        console.print(_host_table(result))
    else:
        console.print("host time between steps: not recorded in these files (observe schema 1.6 records it)")
    groups = result.groups if all_groups else result.groups[:MAX_GROUP_ROWS]
    console.print(_errors_table("by size and context", groups, limit=max_error, columns=SIZE_CONTEXT))
    if len(groups) < len(result.groups):
        console.print(f"({len(result.groups) - len(groups)} more groups: --all or --json)")


def plot_validation(result: ValidationResult, path: str | os.PathLike) -> str:
    """Median absolute % error by context bucket, per kind, both pricings side by side; the
    format follows the suffix (png, svg, pdf), as every --plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if any(g.kind == k for g in result.by_context)] or ["verify"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        groups = [g for g in result.by_context if g.kind == kind]
        labels = [g.context_bucket for g in groups]
        width = 0.4
        for i, p in enumerate(PRICINGS):
            values = [g.errors[p].median_pct for g in groups]
            ax.bar([x + (i - 0.5) * width for x in range(len(groups))], values, width, label=LABEL[p])
        ax.set_xticks(range(len(groups)), labels, rotation=30)
        ax.set_title(f"{kind}: median |predicted - measured| / measured")
        ax.set_xlabel("mean context (tokens)")
        ax.set_ylabel("%")
        ax.legend()
    fig.tight_layout()
    from dspark_calib.render.plots import plot_format

    fmt = plot_format(path) or "png"  # the CLI has checked the suffix (paths.plot_path)
    try:  # atomically: never a half-written plot
        return atomic_write(path, lambda fh: fig.savefig(fh, format=fmt, dpi=110), durable=False)
    finally:
        plt.close(fig)

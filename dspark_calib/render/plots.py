"""Plots (matplotlib) of inspect, diff and advise results: drawing only.

Figure + Agg canvas directly, not pyplot: no global backend state. matplotlib is
imported inside the functions so commands without --plot never pay for it. Files
are written through atomic_write, which alone decides their mode.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from dspark_calib.fit import CURVE_KINDS, DRAFT

if TYPE_CHECKING:
    from dspark_calib.advise import Advice
    from dspark_calib.compare import DiffResult
    from dspark_calib.table.model import CostTable

SIZE_LABEL = {DRAFT: "num_reqs", "verify": "num_target_tokens"}
FORMATS = ("png", "svg", "pdf")  # what --plot writes, chosen by the file's suffix


def _new_figure(rows: int, cols: int, height: float):
    # Figure + Agg canvas directly, not pyplot: no global backend state, nothing to close.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def plot_format(path: str | os.PathLike) -> str:
    """The format a plot path's suffix names ('' when it names none we write)."""
    fmt = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    return fmt if fmt in FORMATS else ""


def _save(fig: Any, path: str | os.PathLike) -> str:
    """Temp file + rename (atomic_write): a viewer or CI artifact never sees half a plot."""
    from dspark_calib.atomic import atomic_write

    fmt = plot_format(path)
    if not fmt:
        raise ValueError(f"{os.fspath(path)}: a plot must end in .png, .svg or .pdf")
    return atomic_write(path, lambda fh: fig.savefig(fh, format=fmt, dpi=110))


def _raw_points(table: "CostTable", kind: str, ctx: int, graph_only: bool | None) -> tuple[np.ndarray, np.ndarray]:
    if table.samples is None:
        return np.array([]), np.array([])
    s = table.samples.select(context_len=ctx)
    if graph_only is not None:
        s = s.take(s.full_cudagraph == graph_only)
    return s.points(kind)


def _style_axis(ax: Any, kind: str, ctx: int | str, limits: Iterable[int]) -> None:
    for limit in sorted(set(limits)):
        if limit:
            ax.axvline(limit, color="tab:red", linestyle="--", linewidth=1, label=f"capture limit {limit}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(SIZE_LABEL[kind])
    ax.set_ylabel("ms")
    ax.set_title(f"{kind} @ctx {ctx}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")


CONTEXT_PLOT_SIZES = {DRAFT: (1, 16, 64, 256), "verify": (1, 64, 256, 1024, 8192)}


def _plot_cost_by_context(table: "CostTable", axes: Any) -> None:
    """Cost as vLLM would charge it against context, at a few sizes: dots at the profiled
    contexts, lines through the interpolation CostTable.dense_tables(L) prices between them."""
    ctxs = table.context_lens()
    grid = np.unique(np.concatenate([np.linspace(ctxs[0], ctxs[-1], 24).astype(int), ctxs]))
    dense = {int(c): table.dense_tables(int(c)) for c in grid}
    fp = table.fingerprint
    for col, kind in enumerate(CURVE_KINDS):
        ax = axes[col]
        top = fp.max_num_seqs if kind == DRAFT else fp.max_num_batched_tokens
        for size in (s for s in CONTEXT_PLOT_SIZES[kind] if s <= top):
            line = ax.plot(grid, [dense[int(c)][col][size] for c in grid], linewidth=1, label=f"{SIZE_LABEL[kind]} {size}")
            ax.plot(ctxs, [dense[c][col][size] for c in ctxs], "o", color=line[0].get_color(), markersize=4)
        ax.set_xlabel("context (tokens); dots: profiled, lines: interpolated")
        ax.set_ylabel("ms")
        ax.set_title(f"{kind} cost against context")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left")


def plot_table(table: "CostTable", path: str | os.PathLike, *, context_len: int | None = None) -> str:
    """Both curves per context length: raw samples as dots, medians, vLLM's dense cost, capture limit."""
    ctxs = table.context_lens() if context_len is None else [table.nearest_context(context_len)]
    by_context = len(ctxs) >= 2  # a last row: cost against context
    rows = len(ctxs) + by_context
    fig, axes = _new_figure(rows, 2, 3.8 * rows)
    fp = table.fingerprint
    if by_context:
        _plot_cost_by_context(table, axes[-1])
    for row, ctx in enumerate(ctxs):
        pair = table.curves[ctx]
        dense = table.dense_tables(ctx)
        for col, kind in enumerate(CURVE_KINDS):
            ax = axes[row][col]
            curve = pair.curve(kind)
            eager_x, eager_y = (_raw_points(table, kind, ctx, graph_only=False) if kind == DRAFT
                                else (np.array([]), np.array([])))
            # vLLM prices the draft from graph replays only; eager draft samples are drawn apart.
            x, y = _raw_points(table, kind, ctx, graph_only=True if kind == DRAFT else None)
            if len(x):
                ax.scatter(x, y, s=8, color="tab:blue", alpha=0.35, label="samples")
            ax.plot(curve.size, curve.cost_ms, "-o", markersize=3, color="tab:orange", linewidth=1.2, label="median")
            sizes = np.arange(1, len(dense[col]))
            ax.plot(sizes, dense[col][1:], color="black", linewidth=0.8, alpha=0.7, label="vLLM dense cost")
            top = max([float(np.max(y)) if len(y) else 0.0, float(np.max(curve.cost_ms)), float(np.max(dense[col]))])
            if len(eager_x):
                off = int((eager_y > top * 1.1).sum())
                ax.scatter(eager_x, eager_y, s=8, marker="x", color="0.6", alpha=0.5,
                           label="eager samples (unused)" + (f", {off} off-scale" if off else ""))
                # Eager outliers (10x the graph cost) would flatten the curve vLLM actually uses.
                ax.set_ylim(0, top * 1.1)
            _style_axis(ax, kind, ctx, [fp.cudagraph_limit])
    fig.suptitle(f"{fp.target_model} + {fp.draft_model}, {fp.gpu_name}, vllm {fp.vllm_version} [{table.short_hash}]")
    return _save(fig, path)


def plot_diff(old: "CostTable", new: "CostTable", path: str | os.PathLike, *, result: "DiffResult") -> str:
    """Old and new medians overlaid, and the relative change per size (filled: significant);
    `result` is compare_tables' answer for these two tables (the plot computes nothing)."""
    oc, nc = result.old_context, result.new_context
    fig, axes = _new_figure(2, 2, 8)
    limits = [old.fingerprint.cudagraph_limit, new.fingerprint.cudagraph_limit]
    for col, kind in enumerate(CURVE_KINDS):
        ax = axes[0][col]
        graph_only = True if kind == DRAFT else None
        for table, ctx, color, label in ((old, oc, "tab:blue", "old"), (new, nc, "tab:orange", "new")):
            x, y = _raw_points(table, kind, ctx, graph_only)
            if len(x):
                ax.scatter(x, y, s=6, color=color, alpha=0.25)
            curve = table.curves[ctx].curve(kind)
            ax.plot(curve.size, curve.cost_ms, "-o", markersize=3, color=color, linewidth=1.2,
                    label=f"{label} [{table.short_hash}] ctx {ctx}")
        _style_axis(ax, kind, oc if oc == nc else f"{oc}→{nc}", limits)
        ax = axes[1][col]
        pts = result.curves[kind].points
        if pts:
            x = np.array([p.size for p in pts])
            rel = np.array([p.rel_change * 100 if math.isfinite(p.rel_change) else np.nan for p in pts])
            sig = np.array([p.significant for p in pts])
            ax.scatter(x[sig], rel[sig], s=18, color="tab:red", label="significant (p < 0.01)")
            ax.scatter(x[~sig], rel[~sig], s=18, facecolors="none", edgecolors="0.4", label="not significant / untested")
        ax.axhline(0, color="black", linewidth=0.8)
        _style_axis(ax, kind, "", limits)
        ax.set_ylabel("change, %")
        ax.set_title(f"{kind}: new vs old")
    fig.suptitle(f"diff {result.old_hash} → {result.new_hash}")
    return _save(fig, path)


def plot_advice(advice: "Advice", path: str | os.PathLike) -> str:
    """Modelled goodput against batch size, one panel per context: each fixed K (thin), adaptive
    verification priced context-aware (bold) and at one context (dashed)."""
    ctxs = advice.contexts
    cols = min(3, len(ctxs))
    rows = -(-len(ctxs) // cols)
    fig, axes = _new_figure(rows, cols, 3.8 * rows)
    for i, ctx in enumerate(ctxs):
        ax = axes[i // cols][i % cols]
        cells = [c for c in advice.cells if c.context_len == ctx]
        n = [c.num_reqs for c in cells]
        for K in range(1, advice.num_speculative_tokens + 1):
            y = [c.fixed[K - 1].goodput if c.fixed[K - 1] is not None else np.nan for c in cells]
            ax.plot(n, y, linewidth=0.8, alpha=0.7, label=f"K={K}")
        ax.plot(n, [c.adaptive.goodput for c in cells], color="black", linewidth=2.2, label="adaptive")
        ax.plot(n, [c.one_context.goodput for c in cells], color="tab:red", linestyle="--", linewidth=1.5,
                label=f"adaptive @{advice.one_context}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in the batch")
        ax.set_ylabel("generated tokens / ms")
        ax.set_title(f"context {ctx}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper left", ncol=2)
    for j in range(len(ctxs), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    rates = ", ".join(f"{r:.2f}" for r in advice.acceptance.rates)
    fig.suptitle(f"advise [{advice.table_hash[:12]}]: acceptance {rates} ({advice.acceptance.source})")
    return _save(fig, path)

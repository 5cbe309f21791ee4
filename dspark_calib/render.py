"""Drawing only: rich terminal views and matplotlib PNGs of inspect and diff results.

The numbers come from inspection.py and compare.py; nothing here decides anything.
matplotlib is imported inside the plot functions so `inspect` without --plot
never pays for it.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
from rich.console import Console
from rich.text import Text

from dspark_calib.fit import CURVE_KINDS, DRAFT, Curve
from dspark_calib.inspection import FALLING_MEDIAN, FEW_SAMPLES, HIGH_SPREAD, DecisionMap, Inspection, TableWarning

if TYPE_CHECKING:
    from dspark_calib.compare import CurveDiff, DiffResult
    from dspark_calib.table import CostTable

MAX_CURVE_ROWS = 80  # beyond this a curve table is a wall of numbers: show a log-spaced selection
CURVE_SAMPLE_ROWS = 40
MAX_DIFF_ROWS = 60  # more than this: only the largest changes
MAX_WARNINGS_PER_GROUP = 8
SIZE_LABEL = {DRAFT: "num_reqs", "verify": "num_target_tokens"}
FLAG = {FEW_SAMPLES: "few", HIGH_SPREAD: "noisy", FALLING_MEDIAN: "dip"}


# -- small helpers -----------------------------------------------------------------------
def _short(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, (list, tuple)):
        if len(value) > 8:
            return f"{value[0]}, {value[1]}, {value[2]}, …, {value[-1]} ({len(value)} sizes)"
        return ", ".join(str(v) for v in value) or "—"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(v)}" for k, v in value.items()) or "—"
    return str(value)


def _ms(value: float) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _budget(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "—"
    if not math.isfinite(value):
        return "∞"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def _select_rows(sizes: np.ndarray, limit: int, max_rows: int, budget: int) -> list[int]:
    """Indices to show for a curve longer than max_rows: ends, both sides of the capture limit,
    and about `budget` log-spaced sizes in between."""
    n = len(sizes)
    if n <= max_rows:
        return list(range(n))
    keep = {0, n - 1}
    below = int(np.searchsorted(sizes, limit, side="right")) - 1 if limit else -1
    keep.update(i for i in (below, below + 1) if 0 <= i < n)
    targets = np.geomspace(max(int(sizes[0]), 1), int(sizes[-1]), budget - len(keep))
    keep.update(np.clip(np.searchsorted(sizes, targets), 0, n - 1).tolist())
    return sorted(keep)


SECTION = object()  # a rule between rows of a grid


def _show(console: Console, text: Text) -> None:
    """Print a grid unwrapped: a wrapped row is unreadable; a terminal may soft-wrap it instead."""
    console.print(text, no_wrap=True, crop=False, overflow="ignore")


def grid(title: str | None, headers: Sequence[str], rows: Iterable[Any], *, left: Sequence[int] = (),
         header_style: str = "bold") -> Text:
    """A table as one styled Text: columns padded by hand.

    rich.Table costs ~1 ms per row here (width measuring, per-cell rendering), which
    for curve tables was most of `inspect`'s own time; this is ~50x cheaper.
    rows: (cells, style or None) pairs, or SECTION for a horizontal rule. A cell is a
    str (drawn in the row's style) or a Text (its own style wins).
    `left`: indices of left-aligned columns (the rest align right, as numbers do).
    """
    rows = list(rows)
    widths = [len(h) for h in headers]
    for row in rows:
        if row is not SECTION:
            for i, cell in enumerate(row[0]):
                widths[i] = max(widths[i], len(cell.plain if isinstance(cell, Text) else cell))
    rule = "─" * (sum(widths) + 2 * (len(widths) - 1))
    out = Text(no_wrap=True, overflow="ignore")

    def add(cells: Sequence[Any], style: str) -> None:
        if not any(isinstance(c, Text) for c in cells):  # the common case: one append per row
            parts = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            out.append("  ".join(parts).rstrip() + "\n", style=style)
            return
        for i, (cell, w) in enumerate(zip(cells, widths)):
            text, cstyle = (cell.plain, str(cell.style) or style) if isinstance(cell, Text) else (cell, style)
            pad = " " * (w - len(text))
            out.append(("  " if i else "") + ("" if i in left else pad))
            out.append(text, style=cstyle)
            if i in left and i < len(widths) - 1:
                out.append(pad)
        out.append("\n")

    if title:
        out.append(title + "\n", style="italic")
    if any(headers):
        add(headers, header_style)
        out.append(rule + "\n", style="dim")
    for row in rows:
        if row is SECTION:
            out.append(rule + "\n", style="dim")
        else:
            add(row[0], row[1] or "")
    out.rstrip()
    return out


# -- inspect -------------------------------------------------------------------------------
def fingerprint_table(table: "CostTable", title: str = "fingerprint") -> Text:
    fp = table.fingerprint
    rows = [
        ("content hash", table.short_hash),
        ("backend", fp.backend),
        ("gpu", f"{fp.gpu_name} x{fp.gpu_count}" + (f" (sm {fp.gpu_compute_capability})" if fp.gpu_compute_capability else "")),
        ("driver / cuda", f"{_short(fp.driver_version)} / {_short(fp.cuda_version)}"),
        ("vllm / torch", f"{_short(fp.vllm_version)} / {_short(fp.torch_version)}"),
        ("target", f"{fp.target_model} ({fp.target_config_hash})"),
        ("draft", f"{fp.draft_model} ({fp.draft_config_hash})"),
        ("tp / pp", f"{fp.tensor_parallel_size} / {fp.pipeline_parallel_size}"),
        ("dtype / kv cache", f"{fp.dtype} / {fp.kv_cache_dtype}" + (f" / {fp.quantization}" if fp.quantization else "")),
        ("speculative tokens", str(fp.num_speculative_tokens)),
        ("max_num_seqs", str(fp.max_num_seqs)),
        ("max_num_batched_tokens", str(fp.max_num_batched_tokens)),
        ("max_model_len", _short(fp.max_model_len)),
        ("cudagraph sizes", _short(fp.cudagraph_capture_sizes)),
        ("capture limit", str(fp.cudagraph_limit)),
        ("context lengths", _short(fp.context_lens)),
        ("replays / warmup", f"{fp.replays} / {fp.warmup_replays}"),
        ("created", f"{table.created_at} by dspark-calib {table.tool_version} (schema {table.schema_version})"),
    ]
    if fp.extra:
        rows.append(("extra", _short(fp.extra)))
    return grid(title, ("", ""), [((k, v), None) for k, v in rows], left=(0, 1))


def curve_table(curve: Curve, kind: str, context_len: int, limit: int, flags: dict[int, list[str]],
                *, all_points: bool = False) -> Text:
    rows = list(range(len(curve))) if all_points else _select_rows(curve.size, limit, MAX_CURVE_ROWS, CURVE_SAMPLE_ROWS)
    title = f"{kind} curve @ctx {context_len} — cost by {SIZE_LABEL[kind]}"
    if len(rows) < len(curve):
        title += f" ({len(rows)} of {len(curve)} sizes; --all shows every one)"
    out: list[Any] = []
    prev = None
    for i in rows:
        if prev is not None and i > prev + 1:
            out.append((("⋮", "", "", "", "", "", f"({i - prev - 1} sizes)"), "dim"))
        prev = i
        size = int(curve.size[i])
        spread = float(curve.rel_spread[i])
        notes = list(flags.get(size, []))
        if limit and size == limit:
            notes.append("◀ capture limit")
        style = "yellow" if flags.get(size) else None
        out.append(((str(size), _ms(curve.cost_ms[i]), str(int(curve.n[i])),
                     f"{_ms(curve.p25_ms[i])}–{_ms(curve.p75_ms[i])}", _pct(spread, signed=False),
                     _ms(curve.mad_ms[i]), " ".join(notes)), style))
        # Above the limit vLLM interpolates instead of padding to a graph: mark the boundary.
        if limit and size <= limit and i + 1 < len(curve) and int(curve.size[i + 1]) > limit:
            out.append(SECTION)
    return grid(title, ("size", "cost ms", "n", "p25–p75 ms", "IQR/med", "MAD ms", "notes"), out, left=(6,))


def warnings_view(warnings: Sequence[TableWarning]) -> list[Text]:
    groups: dict[tuple, list[TableWarning]] = defaultdict(list)
    for w in warnings:
        groups[(w.code, w.context_len, w.curve)].append(w)
    out = []
    for group in groups.values():
        for w in group[:MAX_WARNINGS_PER_GROUP]:
            out.append(Text(f"! {w.message}", style="yellow"))
        if len(group) > MAX_WARNINGS_PER_GROUP:
            out.append(Text(f"  … and {len(group) - MAX_WARNINGS_PER_GROUP} more like it", style="yellow"))
    return out


def _budget_cell(value: float, k: int) -> Text:
    finite = math.isfinite(value)
    style = "dim" if not finite or value == 0 else ("bold green" if value == k else "")
    return Text(_budget(value), style=style)


def decision_table(dm: DecisionMap, title: str | None = None) -> Text:
    k = dm.num_speculative_tokens
    title = title or (f"draft budget per request (of {k}) vLLM picks @ctx {dm.context_len}: "
                      f"R requests decoding at mean confidence c")
    rows = [((str(r), *(_budget_cell(v, k) for v in dm.budget_per_req[i].tolist())), None)
            for i, r in enumerate(dm.num_reqs)]
    return grid(title, ("R \\ c", *(f"{c:g}" for c in dm.confidence)), rows)


def render_inspect(insp: Inspection, console: Console, *, all_points: bool = False) -> None:
    table = insp.table
    if insp.path:
        console.print(Text(insp.path, style="bold"))
    _show(console, fingerprint_table(table))
    for note in insp.notes:
        console.print(Text(f"note: {note}", style="cyan"))
    flags: dict[tuple[int, str], dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for w in insp.warnings:
        if w.size is not None and w.code in FLAG:
            flags[(w.context_len, w.curve)][w.size].append(FLAG[w.code])
    limit = table.fingerprint.cudagraph_limit
    for ctx in insp.context_lens:
        console.print()
        console.print(Text(f"context {ctx}: {table.num_samples(ctx)} raw samples", style="bold"))
        pair = table.curves[ctx]
        for kind in CURVE_KINDS:
            console.print()
            _show(console, curve_table(pair.curve(kind), kind, ctx, limit, flags[(ctx, kind)], all_points=all_points))
    console.print()
    if insp.warnings:
        console.print(Text(f"{len(insp.warnings)} warning{'s' if len(insp.warnings) != 1 else ''}:", style="bold yellow"))
        for line in warnings_view(insp.warnings):
            _show(console, line)
    else:
        console.print(Text("no warnings", style="green"))
    console.print()
    _show(console, decision_table(insp.decision))


def render_summary(insp: Inspection, console: Console) -> None:
    """Short form for commands that write a table (import-vllm, merge)."""
    t = insp.table
    fp = t.fingerprint
    lines = [f"table {t.short_hash}: {fp.target_model} + {fp.draft_model} on {fp.gpu_name} x{fp.gpu_count}, "
             f"vllm {fp.vllm_version}, k={fp.num_speculative_tokens}",
             f"  max_num_seqs {fp.max_num_seqs}, max_num_batched_tokens {fp.max_num_batched_tokens}, "
             f"capture limit {fp.cudagraph_limit}"]
    for ctx in insp.context_lens:
        pair = t.curves[ctx]
        lines.append(f"  ctx {ctx}: draft {len(pair.draft)} sizes ({int(pair.draft.size[0])}..{int(pair.draft.size[-1])}), "
                     f"verify {len(pair.verify)} sizes ({int(pair.verify.size[0])}..{int(pair.verify.size[-1])}), "
                     f"{t.num_samples(ctx)} samples")
    for line in lines:  # Text, not a str: names and paths must not be read as rich markup
        console.print(Text(line), no_wrap=True, crop=False, overflow="ignore")
    if insp.warnings:
        console.print(Text(f"{len(insp.warnings)} warnings (dspark-calib inspect for details)", style="yellow"))
    else:
        console.print(Text("no warnings", style="green"))


# -- diff ----------------------------------------------------------------------------------
def _diff_points_table(cd: "CurveDiff", *, all_points: bool = False) -> Text:
    pts = list(cd.points)
    title = f"{cd.kind} curve: per-size change, new vs old (* p < 0.01; dense: profiled on one side, priced from vLLM's tables)"
    if not any(p.source == "dense" for p in pts):
        title = f"{cd.kind} curve: per-size change, new vs old (* p < 0.01)"
    if not all_points and len(pts) > MAX_DIFF_ROWS:
        top = sorted(range(len(pts)), key=lambda i: -abs(pts[i].rel_change))[:MAX_DIFF_ROWS]
        pts = [pts[i] for i in sorted(top)]
        title += f" — the {MAX_DIFF_ROWS} largest of {len(cd.points)}; --all shows every one"
    rows = []
    for p in pts:
        style = None
        if p.significant:
            style = "red" if p.new_ms > p.old_ms else "green"
        pv = "—" if p.p_value is None else (f"{p.p_value:.1e}" if p.p_value < 0.001 else f"{p.p_value:.3f}")
        mark = ("*" if p.significant else "") + (" dense" if p.source == "dense" else "")
        rows.append(((str(p.size), _ms(p.old_ms), _ms(p.new_ms), f"{p.abs_change_ms:+.3f}", _pct(p.rel_change), pv,
                      f"{p.old_n}/{p.new_n}", mark.strip()), style))
    return grid(title, ("size", "old ms", "new ms", "Δ ms", "Δ", "p", "n old/new", ""), rows, left=(7,))


def render_diff(result: "DiffResult", console: Console, *, threshold: float | None = None,
                all_points: bool = False) -> None:
    from dspark_calib.compare import ALPHA, threshold_exceeded

    console.print(Text(f"old: {result.old_path or '(table)'}  [{result.old_hash}, ctx {result.old_context}]", style="bold"))
    console.print(Text(f"new: {result.new_path or '(table)'}  [{result.new_hash}, ctx {result.new_context}]", style="bold"))
    for note in result.notes:
        console.print(Text(f"note: {note}", style="cyan"))
    console.print()
    if result.fingerprint_changes:
        _show(console, grid("fingerprint changes", ("key", "old", "new"),
                           [((c.key, _short(c.old), _short(c.new)), None) for c in result.fingerprint_changes],
                           left=(0, 1, 2)))
    else:
        console.print(Text("fingerprints identical", style="green"))
    console.print()
    summary = []
    for kind, cd in result.curves.items():
        m = cd.summary
        summary.append(((kind, str(m.points), _pct(m.median_abs_rel_change, signed=False),
                         _pct(m.max_abs_rel_change, signed=False), _short(m.max_change_size), str(m.significant),
                         str(m.significant_slower), str(m.significant_faster), str(m.untested)), None))
    _show(console, grid(f"cost change per curve (significant: Mann-Whitney p < {ALPHA:g} on raw samples)",
                       ("curve", "sizes", "median |Δ|", "max |Δ|", "at size", "significant", "slower", "faster",
                        "untested"), summary, left=(0,)))
    for cd in result.curves.values():
        if cd.uncovered_sizes:
            console.print(Text(f"note: {cd.kind} sizes {_short(list(cd.uncovered_sizes))} lie beyond what both "
                               f"tables price; not compared", style="cyan"))
    for cd in result.curves.values():
        console.print()
        _show(console, _diff_points_table(cd, all_points=all_points))
    console.print()
    d = result.decisions
    console.print(Text(f"decision impact: {len(d.changes)} of {d.cells} (requests x confidence) cells get a different "
                       f"draft budget", style="bold" if d.changes else "green"))
    if d.changes:
        changed = {(c.num_reqs, c.confidence) for c in d.changes}
        rows = []
        for i, r in enumerate(d.old.num_reqs):
            cells: list[Any] = [str(r)]
            for j, c in enumerate(d.old.confidence):
                o, n = float(d.old.budget_per_req[i, j]), float(d.new.budget_per_req[i, j])
                if (r, c) in changed:
                    cells.append(Text(f"{_budget(o)}→{_budget(n)}", style="bold magenta"))
                else:
                    cells.append(Text(_budget(o), style="dim"))
            rows.append((cells, None))
        _show(console, grid(f"draft budget per request, old → new (ctx {result.old_context} → {result.new_context})",
                           ("R \\ c", *(f"{c:g}" for c in d.old.confidence)), rows))
    if threshold is not None:
        console.print()
        over = [p for cd in result.curves.values() for p in cd.points
                if p.significant and abs(p.rel_change) * 100 > threshold]
        if threshold_exceeded(result, threshold):
            console.print(Text(f"threshold {threshold:g}% EXCEEDED: {len(over)} significant point"
                               f"{'s' if len(over) != 1 else ''} changed by more", style="bold red"))
        else:
            console.print(Text(f"threshold {threshold:g}% not exceeded", style="bold green"))


# -- plots ---------------------------------------------------------------------------------
def _new_figure(rows: int, cols: int, height: float):
    # Figure + Agg canvas directly, not pyplot: no global backend state, nothing to close.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def _save_png(fig: Any, path: str | os.PathLike) -> str:
    """Temp file + rename (atomic_write): a viewer or CI artifact never sees half a PNG."""
    from dspark_calib.atomic import atomic_write

    path = atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=110))
    os.chmod(path, _default_mode())  # mkstemp made it 0600; a plot should read like any file
    return path


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


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


def plot_table(table: "CostTable", path: str | os.PathLike, *, context_len: int | None = None) -> str:
    """Both curves per context length: raw samples as dots, medians, vLLM's dense cost, capture limit."""
    ctxs = table.context_lens() if context_len is None else [table.nearest_context(context_len)]
    fig, axes = _new_figure(len(ctxs), 2, 3.8 * len(ctxs))
    fp = table.fingerprint
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
    return _save_png(fig, path)


def plot_diff(old: "CostTable", new: "CostTable", path: str | os.PathLike, *, old_context: int | None = None,
              new_context: int | None = None, result: "DiffResult | None" = None) -> str:
    """Old and new medians overlaid, and the relative change per size (filled: significant)."""
    from dspark_calib.compare import compare_tables

    if result is None:
        result = compare_tables(old, new, old_context=old_context, new_context=new_context)
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
    return _save_png(fig, path)

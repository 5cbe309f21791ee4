"""Terminal views (rich) of inspect and diff results: drawing only.

The numbers, the severities and both verdicts (fit to serve, the diff threshold) come
from inspection.py and compare.py; nothing here decides anything.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
from rich.console import Console
from rich.text import Text

from dspark_calib.errors import escape
from dspark_calib.fit import CURVE_KINDS, DRAFT, Curve
from dspark_calib.inspection import (
    FALLING_MEDIAN, FEW_SAMPLES, HIGH_SPREAD, NOTE, WARNING, CostByContext, DecisionMap, Inspection, TableWarning,
    Verdict, telemetry_view,
)
from dspark_calib.render.conditions import render_conditions_diff, render_telemetry

if TYPE_CHECKING:
    from dspark_calib.calibrate import CalibrationResult
    from dspark_calib.check import CheckResult
    from dspark_calib.compare import CurveDiff, DiffResult, ThresholdVerdict
    from dspark_calib.table.model import CostTable

MAX_CURVE_ROWS = 80  # beyond this a curve table is a wall of numbers: show a log-spaced selection
CURVE_SAMPLE_ROWS = 40
MAX_DIFF_ROWS = 60  # more than this: only the largest changes
MAX_WARNINGS_PER_GROUP = 8
SIZE_LABEL = {DRAFT: "num_reqs", "verify": "num_target_tokens"}
FLAG = {FEW_SAMPLES: "few", HIGH_SPREAD: "noisy", FALLING_MEDIAN: "dip"}
SEVERITY_STYLE = {WARNING: ("!", "yellow"), NOTE: ("·", "dim")}


# -- the render boundary: what reaches the terminal ------------------------------------------
def _cell(text: str) -> str:
    """A table cell as one line: every non-printable character (a newline too) an escape."""
    return text if text.isprintable() else escape(text, sys.maxsize)


def printable(text: Text) -> Text:
    """The Text with every non-printable character but its own line breaks escaped (errors.escape),
    styles kept: a table's strings (names, notes, versions) reach the terminal as text, never as
    escape codes, carriage returns or bidi overrides."""
    plain = text.plain
    if all(line.isprintable() for line in plain.split("\n")):
        return text
    cuts = sorted({0, len(plain), *(s.start for s in text.spans), *(s.end for s in text.spans)})
    out = text.blank_copy()
    for a, b in zip(cuts, cuts[1:]):
        start = len(out)
        out.append("\n".join(_cell(line) for line in plain[a:b].split("\n")))
        for span in text.spans:
            if span.start <= a and span.end >= b:
                out.stylize(span.style, start, len(out))
    return out


class Terminal(Console):
    """The console every text view prints to: each Text (and str, its markup rendered as rich
    would) passes through printable()."""

    def print(self, *objects: Any, **kw: Any) -> None:  # type: ignore[override]
        def safe(o: Any) -> Any:
            if isinstance(o, str):
                o = self.render_str(o, markup=kw.get("markup"), emoji=kw.get("emoji"), highlight=kw.get("highlight"))
            return printable(o) if isinstance(o, Text) else o

        super().print(*(safe(o) for o in objects), **kw)


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
    rows = [row if row is SECTION else ([c if isinstance(c, Text) else _cell(c) for c in row[0]], row[1])
            for row in rows]  # a newline in a cell would draw a row of its own
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
    """Every registry key in registry order (fingerprint.display_rows): a key added there shows here."""
    from dspark_calib.fingerprint import display_rows

    fp = table.fingerprint
    rows = [("content hash", table.short_hash), *display_rows(fp),
            ("created", f"{table.created_at} by dspark-calib {table.tool_version} (schema {table.schema_version})")]
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


def warnings_view(warnings: Sequence[TableWarning], severity: str = WARNING) -> list[Text]:
    """The findings of one severity, grouped by (code, context, curve), long groups shortened."""
    mark, style = SEVERITY_STYLE[severity]
    groups: dict[tuple, list[TableWarning]] = defaultdict(list)
    for w in warnings:
        if w.severity == severity:
            groups[(w.code, w.context_len, w.curve)].append(w)
    out = []
    for group in groups.values():
        for w in group[:MAX_WARNINGS_PER_GROUP]:
            out.append(Text(f"{mark} {w.message}", style=style))
        if len(group) > MAX_WARNINGS_PER_GROUP:
            out.append(Text(f"  … and {len(group) - MAX_WARNINGS_PER_GROUP} more like it", style=style))
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


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


def context_cost_table(view: "CostByContext") -> Text:
    """Verify cost (ms, as vLLM charges it) at a few step sizes against context; the last
    column is the longest context's cost over the shortest's."""
    lo, hi = view.contexts[0], view.contexts[-1]
    headers = ("tokens", *(f"ctx {c}" for c in view.contexts), f"{hi}/{lo}")
    rows = [((str(size), *(f"{v:.3f}" for v in row), f"{row[-1] / row[0]:.2f}x" if row[0] > 0 else "—"), None)
            for size, row in zip(view.sizes, view.verify_ms)]
    return grid("verify cost (ms) against context, as vLLM charges it", headers, rows)


def verdict_text(v: Verdict) -> Text:
    return Text(v.line, style="bold green" if v.fit else "bold red")


def render_inspect(insp: Inspection, console: Console, *, all_points: bool = False) -> None:
    """The verdict first; warnings always, notes only with --all (all_points)."""
    table = insp.table
    _show(console, verdict_text(insp.verdict))
    if insp.path:
        _show(console, Text(insp.path, style="bold"))
    if table.calibration is not None:
        _show(console, Text(table.calibration.summary(), style="cyan"))
    _show(console, fingerprint_table(table))
    for note in insp.notes:
        console.print(Text(f"note: {note}", style="cyan"))
    flags: dict[tuple[int, str], dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for w in insp.warnings:
        if w.size is not None and w.code in FLAG and (all_points or w.severity == WARNING):
            flags[(w.context_len, w.curve)][w.size].append(FLAG[w.code] + ("?" if w.severity == NOTE else ""))
    limit = table.fingerprint.cudagraph_limit
    for ctx in insp.context_lens:
        console.print()
        console.print(Text(f"context {ctx}: {table.num_samples(ctx)} raw samples", style="bold"))
        pair = table.curves[ctx]
        for kind in CURVE_KINDS:
            console.print()
            _show(console, curve_table(pair.curve(kind), kind, ctx, limit, flags[(ctx, kind)], all_points=all_points))
    if insp.by_context:
        console.print()
        _show(console, context_cost_table(insp.by_context))
    console.print()
    _show(console, decision_table(insp.decision))
    console.print()
    render_telemetry(telemetry_view(table.telemetry), insp.level_shifts, console, grid, _show)
    counts = insp.counts
    if counts[WARNING]:
        console.print()
        console.print(Text(_plural(counts[WARNING], "warning") + ":", style="bold yellow"))
        for line in warnings_view(insp.warnings, WARNING):
            _show(console, line)
    if counts[NOTE] and all_points:
        console.print()
        console.print(Text(_plural(counts[NOTE], "note") + ":", style="bold dim"))
        for line in warnings_view(insp.warnings, NOTE):
            _show(console, line)
    console.print()
    hidden = " (--all shows the notes)" if counts[NOTE] and not all_points else ""
    console.print(Text(f"summary: {insp.summary}{hidden}", style="yellow" if counts[WARNING] else "green"))


def render_summary(insp: Inspection, console: Console) -> None:
    """Short form for commands that write a table (profile, import-vllm, merge): the verdict last."""
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
    if t.calibration is not None:
        lines.append(f"  {t.calibration.summary()}")
    for line in lines:  # Text, not a str: names and paths must not be read as rich markup
        console.print(Text(line), no_wrap=True, crop=False, overflow="ignore")
    console.print(Text(f"{insp.summary} (dspark-calib inspect for details)", style="yellow" if insp.counts[WARNING]
                       else "green"), no_wrap=True, crop=False, overflow="ignore")
    _show(console, verdict_text(insp.verdict))


# -- diff ----------------------------------------------------------------------------------
def _diff_points_table(cd: "CurveDiff", *, all_points: bool = False, tested: bool = True) -> Text:
    pts = list(cd.points)
    marks = "* p < 0.01" if tested else "significance not tested"
    title = f"{cd.kind} curve: per-size change, new vs old ({marks}; dense: profiled on one side, priced from vLLM's tables)"
    if not any(p.source == "dense" for p in pts):
        title = f"{cd.kind} curve: per-size change, new vs old ({marks})"
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


def render_diff(result: "DiffResult", console: Console, *, verdict: "ThresholdVerdict | None" = None,
                all_points: bool = False) -> None:
    from dspark_calib.compare import ALPHA

    _show(console, Text(f"old: {result.old_path or '(table)'}  [{result.old_hash}, ctx {result.old_context}]", style="bold"))
    _show(console, Text(f"new: {result.new_path or '(table)'}  [{result.new_hash}, ctx {result.new_context}]", style="bold"))
    for note in result.notes:
        console.print(Text(f"note: {note}", style="cyan"))
    console.print()
    if result.fingerprint_changes:
        _show(console, grid("fingerprint changes", ("key", "old", "new"),
                           [((c.key, _short(c.old), _short(c.new)), None) for c in result.fingerprint_changes],
                           left=(0, 1, 2)))
    else:
        console.print(Text("fingerprints identical", style="green"))
    if result.old_conditions or result.new_conditions:
        console.print()
        render_conditions_diff(result.old_conditions, result.new_conditions, console, grid, _show)
    console.print()
    summary = []
    for kind, cd in result.curves.items():
        m = cd.summary
        summary.append(((kind, str(m.points), _pct(m.median_abs_rel_change, signed=False),
                         _pct(m.max_abs_rel_change, signed=False), _short(m.max_change_size), str(m.significant),
                         str(m.significant_slower), str(m.significant_faster), str(m.untested)), None))
    if result.significance_tested:
        title = f"cost change per curve (significant: Mann-Whitney p < {ALPHA:g} on raw samples)"
    else:
        title = "cost change per curve (significance not tested: --significance runs Mann-Whitney on the raw samples)"
    _show(console, grid(title,
                       ("curve", "sizes", "median |Δ|", "max |Δ|", "at size", "significant", "slower", "faster",
                        "untested"), summary, left=(0,)))
    for cd in result.curves.values():
        if cd.uncovered_sizes:
            console.print(Text(f"note: {cd.kind} sizes {_short(list(cd.uncovered_sizes))} lie beyond what both "
                               f"tables price; not compared", style="cyan"))
    for cd in result.curves.values():
        console.print()
        _show(console, _diff_points_table(cd, all_points=all_points, tested=result.significance_tested))
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
    if verdict is not None:
        console.print()
        if verdict.exceeded:
            console.print(Text(f"threshold {verdict.pct:g}% EXCEEDED: {_plural(len(verdict.over), 'significant point')} "
                               f"changed by more (either direction)", style="bold red"))
        else:
            console.print(Text(f"threshold {verdict.pct:g}% not exceeded", style="bold green"))


# -- check ---------------------------------------------------------------------------------
CHECK_STYLE = {"loads": "bold green", "fits": "", "mismatch": "yellow", "unreadable": "red"}


def render_check(result: "CheckResult", console: Console) -> None:
    chosen = result.chosen
    if chosen and not result.at_start:
        _show(console, Text(f"would load: {chosen.path} (hash {chosen.content_hash[:12]})", style="bold green"))
    elif chosen:
        _show(console, Text(f"would load if the keys decided at start match: {chosen.path} "
                            f"(hash {chosen.content_hash[:12]})", style="bold yellow"))
    else:
        _show(console, Text(f"would load: nothing from {result.source}; vLLM profiles at start-up as usual",
                            style="bold yellow"))
    if result.resolution:
        console.print(Text(f"engine: {result.resolution}", style="dim"), no_wrap=False)
    if result.coverage:
        console.print(Text(f"coverage: {result.coverage}"), no_wrap=False)
    rows = [((t.status, t.content_hash[:12] or "—", t.path, t.reason or "—"), CHECK_STYLE.get(t.status) or None)
            for t in result.tables]
    if rows:
        console.print()
        _show(console, grid("tables, newest first (reason: the first key that does not fit)",
                            ("status", "hash", "table", "reason"), rows, left=(0, 1, 2, 3)))
    console.print()
    checked = ", ".join(f"{k}={_short(v)}" for k, v in sorted(result.engine.items())) or "—"
    console.print(Text(f"checked: {checked}", style="dim"), no_wrap=False)
    if result.at_start:
        console.print(Text(f"decided at start (blocking; not given, or known only to the running engine): "
                           f"{', '.join(result.at_start)}", style="yellow"))
    warning_only = [k for k in result.unchecked if k not in result.at_start]
    if warning_only:
        console.print(Text(f"not checked (warning only, not given): {', '.join(warning_only)}", style="dim"))
    if result.unrecorded:
        console.print(Text(f"not recorded by the table (never blocks): {', '.join(result.unrecorded)}", style="dim"))
    if result.ignored:
        console.print(Text(f"given but never blocking (warning only, or not compared): {', '.join(result.ignored)}",
                           style="dim"))
    console.print()
    console.print(Text("plugin log:", style="bold"))
    for line in result.lines:
        console.print(Text(line), no_wrap=True, crop=False, overflow="ignore")


# -- calibrate ------------------------------------------------------------------------------
def render_calibration(result: "CalibrationResult", console: Console) -> None:
    """After the written table's summary (which holds the correction's line): the fitted steps'
    context-aware errors before and after (in sample: validate on held-out files judges it)."""
    def pct(value: float, signed: bool = False) -> str:
        return "—" if not math.isfinite(value) else f"{value:+.2f}%" if signed else f"{value:.2f}%"

    rows = [((f.kind, str(f.before.n), pct(f.before.median_pct), pct(f.before.median_signed_pct, True),
              pct(f.after.median_pct), pct(f.after.median_signed_pct, True)), None) for f in result.fitted]
    _show(console, grid("the steps it was fitted on (context-aware; judge it on others with validate)",
                        ("kind", "steps", "median before", "bias before", "median after", "bias after"), rows))

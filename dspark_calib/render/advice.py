"""Drawing only: the terminal view of an advise result, per cell or over observed steps (numbers from
advise.py); its plot is plots.plot_advice."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from dspark_calib.advise import ADAPTIVE, Acceptance, Advice, Cell, StepMix


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _loss_line(advice: Advice, name: str, cells: list[Cell], one: bool) -> str:
    if not cells:
        return f"{name} is never below the best fixed K"
    gap = (lambda c: c.one_context_vs_fixed) if one else (lambda c: c.adaptive_vs_fixed)
    worst = min(cells, key=gap)
    return (f"{name} loses to a fixed K in {len(cells)} of {len(advice.cells)} cells, by up to "
            f"{-100 * gap(worst):.1f}% ({worst.num_reqs} requests at context {worst.context_len}: "
            f"{worst.best_fixed.name})")


def _acceptance_line(console: Console, acc: Acceptance, k: int) -> None:
    rates = ", ".join(f"{r:.3f}" for r in acc.rates)
    where = (f"observed: {acc.steps} steps from {len(acc.files)} file(s), drafts graded per position "
             f"{', '.join(map(str, acc.graded))}" if acc.source == "observed" else "given")
    console.print(f"acceptance {rates} ({where}); {acc.tokens_per_step:.2f} tokens per request and step with "
                  f"all {k} drafts verified", markup=False)


def render_step_mix(mix: StepMix, console: Console | None = None) -> None:
    """Header, the acceptance, one row per option over the observed steps, then the best of them."""
    console = console or Console()
    console.print(f"[bold]advise[/] table {mix.table_hash[:12] or '—'} over {mix.steps} observed decode steps "
                  f"({mix.requests} requests, mean context {mix.context_mean:.0f}): goodput in generated tokens "
                  f"per ms (modelled)")
    _acceptance_line(console, mix.acceptance, mix.num_speculative_tokens)
    console.print(f"each step modelled at its batch size and mean context; an option's goodput is its tokens over "
                  f"its time summed over the steps; {mix.one_context_name}: deciding with the tables of context "
                  f"{mix.one_context} alone (stock vLLM)", markup=False)
    if mix.max_total_logits is not None:
        console.print(f"adaptive verifies at most {mix.max_total_logits} logits a step (one rejection-sampling "
                      f"chunk)", markup=False)
    for warning in mix.warnings:
        console.print(f"[yellow]{warning}[/]", markup=True)
    table = Table(show_edge=False, pad_edge=False)
    for name in ("option", "drafts/req", "goodput", "ms/token", f"vs {mix.one_context_name}"):
        table.add_column(name, justify="left" if name == "option" else "right")
    for o in mix.options:
        table.add_row(o.name, f"{o.drafts / mix.requests:.2f}", f"{o.goodput:.3f}", f"{o.ms_per_token:.4f}",
                      _pct(mix.ratio(o.name) - 1))
    console.print(table)
    best = max(mix.options, key=lambda o: o.goodput)
    console.print(f"best over these steps: {best.name} ({_pct(mix.ratio(best.name) - 1)} over "
                  f"{mix.one_context_name})", markup=False)


def render_advice(advice: Advice, console: Console | None = None, *, all_fixed: bool = False) -> None:
    """Header, the acceptance, one table per context (rows: batch sizes), then where adaptive loses."""
    console = console or Console()
    console.print(f"[bold]advise[/] table {advice.table_hash[:12] or '—'}: K up to {advice.num_speculative_tokens}, "
                  f"goodput in generated tokens per ms (modelled)")
    _acceptance_line(console, advice.acceptance, advice.num_speculative_tokens)
    one = f"{ADAPTIVE}@{advice.one_context}"
    console.print(f"adaptive: vLLM's budget rule priced context-aware; {one}: the same rule deciding with the "
                  f"tables of context {advice.one_context} alone (stock vLLM, a table without context-aware "
                  f"pricing); advice: a fixed K only for a gain of {100 * advice.min_gain:g}% or more over adaptive",
                  markup=False)
    if advice.max_total_logits is not None:
        console.print(f"adaptive verifies at most {advice.max_total_logits} logits a step (one rejection-sampling "
                      f"chunk)", markup=False)
    for warning in advice.warnings:
        console.print(f"[yellow]{warning}[/]", markup=True)
    k = advice.num_speculative_tokens
    for ctx in advice.contexts:
        table = Table(title=f"context {ctx}", title_justify="left", show_edge=False, pad_edge=False)
        table.add_column("reqs", justify="right")
        fixed_ks = range(1, k + 1) if all_fixed else ()
        for K in fixed_ks:
            table.add_column(f"K={K}", justify="right")
        for name in ("best fixed", "adaptive", "drafts", "vs fixed", one, "vs fixed", "adaptive ms", "advice"):
            table.add_column(name, justify="right" if name != "advice" else "left")
        for c in (c for c in advice.cells if c.context_len == ctx):
            best = c.best_fixed
            row = [str(c.num_reqs)]
            row += ["—" if o is None else f"{o.goodput:.3f}" for o in c.fixed] if all_fixed else []
            row += [f"{best.name} {best.goodput:.3f}", f"{c.adaptive.goodput:.3f}",
                    f"{c.adaptive.drafts_per_request:.2f}", _pct(c.adaptive_vs_fixed),
                    f"{c.one_context.goodput:.3f}", _pct(c.one_context_vs_fixed), f"{c.adaptive.step_ms:.2f}",
                    c.advice]
            table.add_row(*row)
        console.print(table)
    console.print(_loss_line(advice, "adaptive", advice.losses(), False), markup=False)
    console.print(_loss_line(advice, one, advice.losses(True), True), markup=False)

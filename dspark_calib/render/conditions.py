"""Terminal views of the GPU/host conditions: telemetry per block, level-shift flags
(inspect) and the two tables' condition summaries (diff). Drawing only: the rows come
from inspection.telemetry_view, the flags from stability.py, the summaries from
telemetry.py."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console
from rich.text import Text


def _n(value: Any, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def render_telemetry(view: dict[str, Any] | None, shifts: Sequence[Any], console: Console, grid: Any,
                     show: Any) -> None:
    if view is None:
        console.print(Text("telemetry: none recorded (a table older than schema 1.2, or not from `profile`)",
                           style="dim"))
    else:
        rows = []
        for r in view["blocks"]:
            sm = "-" if r["sm_mhz_min"] is None else (f"{r['sm_mhz_min']:.0f}" if r["sm_mhz_min"] == r["sm_mhz_max"]
                                                     else f"{r['sm_mhz_min']:.0f}-{r['sm_mhz_max']:.0f}")
            rows.append(((str(r["context_len"]), f"{r['block']}{' (warm-up)' if r['warmup'] else ''}", sm,
                          _n(r["mem_mhz"]), _n(r["temp_c_max"]), _n(r["power_w_max"]),
                          ",".join(r["throttle"]) or "none", _n(r["load1_max"], "{:.2f}")),
                         "dim" if r["warmup"] else ("yellow" if r["throttle"] else None)))
        show(console, grid(f"conditions per block (source: {view['source']})",
                           ("ctx", "block", "SM MHz", "mem MHz", "temp C", "power W", "throttle", "load"),
                           rows, left=(1, 6)))
        if view["note"]:
            console.print(Text(f"note: {view['note']}", style="cyan"))
    if shifts:
        for f in shifts:
            console.print(Text(f"level shift: {f}", style="bold yellow"))
    else:
        console.print(Text("no level shift between blocks", style="green"))


def render_conditions_diff(old: Any, new: Any, console: Console, grid: Any, show: Any) -> None:
    if old is None and new is None:
        return
    rows = []
    for label, attr, fmt in (("median SM clock MHz", "median_sm_mhz", "{:.0f}"), ("max temperature C", "max_temp_c", "{:.0f}"),
                             ("max power W", "max_power_w", "{:.0f}")):
        rows.append(((label, _n(getattr(old, attr, None), fmt), _n(getattr(new, attr, None), fmt)), None))
    throttle = [("none" if not s.throttle else ",".join(s.throttle)) if s is not None else "-" for s in (old, new)]
    rows.append((("throttling", *throttle), "yellow" if any(t not in ("none", "-") for t in throttle) else None))
    show(console, grid("conditions (timed blocks)", ("", "old", "new"), rows, left=(0,)))

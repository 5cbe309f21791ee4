"""Drawing only: terminal views (text.py, rich) and plots (plots.py, matplotlib).

matplotlib loads only when a plot is drawn: the plot functions are imported lazily.
"""

from __future__ import annotations

from typing import Any

from dspark_calib.render.text import render_diff, render_inspect, render_summary


def plot_table(*args: Any, **kwargs: Any) -> str:
    from dspark_calib.render.plots import plot_table as draw

    return draw(*args, **kwargs)


def plot_advice(*args: Any, **kwargs: Any) -> str:
    from dspark_calib.render.plots import plot_advice as draw

    return draw(*args, **kwargs)


def plot_diff(*args: Any, **kwargs: Any) -> str:
    from dspark_calib.render.plots import plot_diff as draw

    return draw(*args, **kwargs)


__all__ = ["plot_advice", "plot_diff", "plot_table", "render_diff", "render_inspect", "render_summary"]

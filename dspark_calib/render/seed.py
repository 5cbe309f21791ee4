"""How `dspark-calib seed` shows the seed it wrote."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from dspark_calib.env import ESTIMATOR_SEED
from dspark_calib.errors import display_path, escape

if TYPE_CHECKING:
    from dspark_calib.seed import EstimatorSeed


def render_seed(seed: "EstimatorSeed", path: str, console: Console) -> None:
    """The file written, its coefficients, where they were read, the keys an engine must match, and how to serve it."""
    files = seed.source.get("files", 1)
    keys = ", ".join(f"{name} {escape(value, 60)}" for name, value in seed.keys.items())
    lines = [f"wrote {display_path(path)}: vLLM's acceptance estimator as observed ({files} observe "
             f"file{'s' if files != 1 else ''})",
             f"coefficients  {seed.summary()}",
             f"read from     {escape(seed.source.get('file', '-'), 120)} on {escape(seed.source.get('host') or '-', 60)}",
             f"must match    {keys}",
             f"serve with    {ESTIMATOR_SEED}={display_path(path)} (the estimator starts there and keeps learning)"]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

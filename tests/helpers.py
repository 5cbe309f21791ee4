"""Constants and helpers shared by the test modules (fixtures live in the conftest.py files).

Imported as `from tests.helpers import ...` (the repository root is on sys.path: pyproject's pythonpath)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dspark_calib.reference import table_from_startup_json

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "tests" / "data"
FIXTURE_JSONS = sorted(DATA_DIR.glob("*.json"))
REFERENCE_KWARGS = dict(
    model=str(REPO / "profiles" / "configs" / "qwen3-8b"),
    draft=str(REPO / "profiles" / "configs" / "dspark-qwen3-8b-block7"),
    gpu_name="NVIDIA H200",
    vllm_version="0.33.0",
    num_speculative_tokens=7,
)


def build_reference_table(paths=None, **overrides):
    """A CostTable from recorded vLLM start-up profiles (all fixtures by default)."""
    paths = FIXTURE_JSONS if paths is None else paths
    return table_from_startup_json([str(p) for p in paths], **{**REFERENCE_KWARGS, **overrides})


def load_fixture_json(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


# -- shared by the CLI and analysis tests -----------------------------------------------------
MODEL = REFERENCE_KWARGS["model"]
DRAFT = REFERENCE_KWARGS["draft"]
# The schema-1.0 H200 table (shipped in profiles/ until 2026-12-01; the evidence of that run now)
SCHEMA10 = REPO / "benchmarks" / "results" / "h200" / "2026-11-30-morning" / "qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__ad4ef3d97317.parquet"
SHIPPED = REPO / "profiles" / "h200" / "qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"  # schema 1.2; the config and library keys added since not recorded


# Rank 0's capture of the draft-model H200 run (Qwen3-8B + Qwen3-0.6B, K 7, contexts 1024 and 8192,
# 5 timed replays after a warm-up block): its draft curve at 1024 falls from ~162 ms to ~64 ms at
# 192-224 requests, in every replay and in vLLM's own fit.
DRAFT_MODEL_RUN = REPO / "benchmarks" / "results" / "h200" / "2026-12-01-2035-draft-model"
DRAFT_MODEL_CAPTURE = DRAFT_MODEL_RUN / "h200-tp1-draft-ctx1k8k-samples-rank0.json"
# the shipped draft_model table: that run's 1024 + 8192 merged with a 16384 run of the same engine
SHIPPED_DRAFT_MODEL = next((REPO / "profiles" / "h200").glob("qwen3-8b__qwen3-0.6b__tp1__nvidia-h200__*.parquet"))


def draft_model_table(warmup_replays: int):
    """A table of that capture's samples (no vLLM needed): the reference fingerprint with the
    run's 5 replays and the given warm-up."""
    from dspark_calib.samples import samples_from_dicts
    from dspark_calib.table.model import CostTable

    samples = samples_from_dicts(load_fixture_json(DRAFT_MODEL_CAPTURE)["samples"])
    fp = build_reference_table([fixture_json(8192)]).fingerprint
    return CostTable.from_samples(samples, fp.replace(replays=5, warmup_replays=warmup_replays))


def fixture_json(ctx: int) -> str:
    """The recorded vLLM start-up profile at one context length (1024, 8192 or 16384)."""
    return str(DATA_DIR / f"qwen3-8b_dspark-block7_ctx{ctx}.json")


def one_line_error(result, *fragments: str) -> str:
    """Assert a CliRunner result is exit 2 with exactly one 'dspark-calib: error:' stderr line."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dspark-calib: error: ")
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert "Traceback" not in result.output
    return lines[0]


HEAVY_MODULES = ("torch", "vllm", "pandas", "scipy", "matplotlib")


def assert_command_is_light(*argv: str, codes: tuple[int, ...] = (0,), allow: tuple[str, ...] = ()) -> None:
    """Run `dspark-calib ARGV` in a fresh interpreter: it must end with one of `codes` without
    importing torch, vllm, pandas, scipy or matplotlib (offline commands stay fast on any machine).
    `allow`: what a command may import all the same (a command writing a table: pyarrow imports
    pandas, when installed, to build any Arrow array)."""
    code = ("import sys\nfrom dspark_calib.cli.app import PROG, app\n"
            f"sys.argv = ['dspark-calib', *{[str(a) for a in argv]!r}]\n"
            "try:\n    app(prog_name=PROG)\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            f"heavy = [m for m in {tuple(m for m in HEAVY_MODULES if m not in allow)!r} if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            f"assert (code or 0) in {tuple(codes)!r}, code\nprint('OK')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_CALIB_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr


class FakeClock:
    """cooldown.Clock's stand-in: time moves only when something sleeps, and every sleep is logged."""

    def __init__(self) -> None:
        self.t, self.sleeps = 0.0, []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds

    def now(self) -> float:
        return self.t


def aware(tail_milli: int = 0, chunks: bool = False):
    """A context-aware pricing policy with this tail and chunk setting."""
    from dspark_calib.pricing.policy import CONTEXT_AWARE, PricingPolicy

    return PricingPolicy(CONTEXT_AWARE, tail_milli=tail_milli, chunks=chunks)

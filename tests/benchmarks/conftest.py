"""Fixtures of the benchmark harness tests."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sc():
    """benchmarks/serving/serve_context.py, imported by path (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("serve_context", REPO / "benchmarks" / "serving" / "serve_context.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_context"] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


def load_scripts(*names: str):
    """Sibling scripts of benchmarks/serving imported by path, in order (each may import the ones
    before it by name); the last one returned."""
    mod = None
    for name in names:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "serving" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod

"""Shared fixtures: cost tables built from the real H200 start-up profiles in tests/data."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import DATA_DIR, FIXTURE_JSONS, FakeClock, build_reference_table, fixture_json


@pytest.fixture(scope="session")
def fixture_jsons() -> list[Path]:
    assert FIXTURE_JSONS, "tests/data/*.json fixtures are missing"
    return FIXTURE_JSONS


@pytest.fixture(scope="session")
def reference_table():
    """All three recorded context lengths (1024, 8192, 16384) in one table. Do not mutate."""
    return build_reference_table()


@pytest.fixture(scope="session")
def reference_table_8192():
    """Only the context-8192 recording (vLLM's default profile context). Do not mutate."""
    return build_reference_table([DATA_DIR / "qwen3-8b_dspark-block7_ctx8192.json"])


@pytest.fixture
def table_file(tmp_path, reference_table):
    """The all-contexts reference table written to a fresh parquet file."""
    from dspark_calib.table.file import write_table

    return Path(write_table(reference_table, tmp_path / "reference.parquet"))


@pytest.fixture(scope="session")
def table_1024():
    return build_reference_table([fixture_json(1024)])


@pytest.fixture(scope="session")
def table_16384():
    return build_reference_table([fixture_json(16384)])


@pytest.fixture(scope="session")
def table_files(tmp_path_factory, table_1024, table_16384, reference_table_8192, reference_table) -> dict[str, str]:
    """Parquet files of the reference tables: c1024, c8192, c16384 and all (every context)."""
    from dspark_calib.table.file import write_table

    d = tmp_path_factory.mktemp("tables")
    tables = {"c1024": table_1024, "c8192": reference_table_8192, "c16384": table_16384, "all": reference_table}
    return {name: write_table(t, d / f"{name}.parquet") for name, t in tables.items()}



@pytest.fixture(autouse=True)
def fake_clock(monkeypatch) -> FakeClock:
    """No test really sleeps through a profile's cool-downs (every capture takes them by default)."""
    from dspark_calib.vllm import gpu_state

    clock = FakeClock()
    monkeypatch.setattr(gpu_state, "CLOCK", gpu_state.Clock(sleep=clock.sleep, now=clock.now))
    return clock


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch):
    """Output tests match text: a CI that exports FORCE_COLOR or a narrow COLUMNS must not change
    what the commands print under test (rich honours both)."""
    for name in ("FORCE_COLOR", "COLUMNS", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")

"""inspect / inspect --json / diff / profile --strict-stability show the conditions and the
level-shift flags (schema 1.2 tables built from synthetic samples with a known step)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_calib.cli.app import app
from dspark_calib.errors import CalibError
from dspark_calib.cli.profile import stability_verdict
from dspark_calib.samples import Samples
from dspark_calib.table.model import CostTable
from dspark_calib.table.file import write_table
from dspark_calib.telemetry import Telemetry
from tests.core.test_stability import synthetic
from tests.core.test_telemetry import TELEMETRY

runner = CliRunner()


def table_with(base, *, step_ms=0.0, telemetry=TELEMETRY, seed=0):
    b, s, v = synthetic(seed, step_ms=step_ms, step_from=3 if step_ms else None)
    replay = b * 5 + np.tile(np.arange(5), len(b) // 5)
    cols = {"context_len": np.full(len(b), 8192), "replay": replay, "forward_ms": v, "drafter_ms": 1 + v / 50,
            "num_target_tokens": s, "num_reqs": np.minimum(s, 256), "full_cudagraph": s <= 512}
    fp = base.fingerprint.replace(replays=20, warmup_replays=5, cudagraph_limit=512,
                                  extra={"vllm_replays_per_block": 5})
    return CostTable.from_samples(Samples.from_columns(cols), fp, telemetry=Telemetry.from_json(telemetry))


@pytest.fixture
def paths(tmp_path, reference_table_8192):
    return {"clean": write_table(table_with(reference_table_8192), tmp_path / "clean.parquet"),
            "shifted": write_table(table_with(reference_table_8192, step_ms=0.18, seed=1), tmp_path / "s.parquet"),
            "bare": write_table(table_with(reference_table_8192, telemetry=None), tmp_path / "bare.parquet")}


def test_inspect_shows_conditions_per_block_and_flags(paths):
    out = runner.invoke(app, ["inspect", paths["shifted"]])
    assert out.exit_code == 0, out.output
    assert "conditions per block (source: nvml)" in out.output
    assert "1965-1980" in out.output and "sw_power_cap" in out.output and "(warm-up)" in out.output
    assert "level shift: context 8192, block 3: +0.1" in out.output
    clean = runner.invoke(app, ["inspect", paths["clean"]]).output
    assert "no level shift between blocks" in clean
    assert "telemetry: none recorded" in runner.invoke(app, ["inspect", paths["bare"]]).output


def test_inspect_json_holds_the_same_objects(paths):
    data = json.loads(runner.invoke(app, ["inspect", "--json", paths["shifted"]]).output)
    assert data["schema_version"] == "1.4"
    assert [f["block"] for f in data["level_shifts"]] == [3] and data["level_shifts"][0]["offset_ms"] > 0.1
    rows = data["telemetry"]["blocks"]
    assert [r["block"] for r in rows] == [-1, 0, 1, 2, 3] and rows[-1]["throttle"] == ["sw_power_cap"]
    assert data["telemetry"]["summary"]["median_sm_mhz"] == 1972.5
    assert json.loads(runner.invoke(app, ["inspect", "--json", paths["bare"]]).output)["telemetry"] is None


def test_diff_compares_conditions_beside_costs(paths):
    out = runner.invoke(app, ["diff", paths["bare"], paths["shifted"]])
    assert out.exit_code in (0, 1), out.output
    assert "conditions (timed blocks)" in out.output and "median SM clock MHz" in out.output
    assert "sw_power_cap" in out.output
    data = json.loads(runner.invoke(app, ["diff", "--json", paths["bare"], paths["shifted"]]).output)
    assert data["conditions"]["old"] is None and data["conditions"]["new"]["max_temp_c"] == 48.0


def test_strict_stability_refuses_in_one_line(reference_table_8192):
    assert stability_verdict(table_with(reference_table_8192), strict=True) == []
    shifted = table_with(reference_table_8192, step_ms=0.18, seed=1)
    lines = stability_verdict(shifted, strict=False)
    assert len(lines) == 1 and lines[0].startswith("level shift: context 8192, block 3")
    with pytest.raises(CalibError) as err:
        stability_verdict(shifted, strict=True)
    assert "--strict-stability" in str(err.value) and "no table written" in str(err.value) and "\n" not in str(err.value)


def test_profile_help_documents_strict_stability():
    out = runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "200"})
    assert "--strict-stability" in out.output and "re-running is up to you" in out.output

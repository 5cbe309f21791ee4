"""`dspark-calib calibrate` on the shipped table and the observe files served with it; inspect and
diff of the result; one-line refusals that leave nothing behind; light."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspark_calib.cli.app import app
from dspark_calib.table.file import read_table
from tests.helpers import REPO, SHIPPED, assert_command_is_light, one_line_error

runner = CliRunner()
RUN = REPO / "benchmarks/results/h200/2026-12-01-0742-context"  # served with the shipped table, on its host
SERVED = [RUN / "context-aware-observed.parquet", RUN / "context-aware-tail20-chunks-observed.parquet"]
OTHER_TABLE = REPO / "benchmarks/results/h200/2026-12-01-0438-context/context-aware-observed.parquet"
STOCK_NO_ENGINE = RUN / "context-stock-observed.parquet"  # stock vLLM, before files recorded their engine


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "calibrated.parquet"
    r = invoke("calibrate", SHIPPED, *SERVED, "--out", out)
    assert r.exit_code == 0, r.output
    return out, r.stdout


def test_calibrate_writes_a_new_table_and_says_what_it_fitted(calibrated):
    out, stdout = calibrated
    parent = read_table(SHIPPED)
    table = read_table(out)
    assert stdout.splitlines()[0] == str(out)
    assert f"calibrated from parent {parent.short_hash} on 470 steps of 2 observe files" in stdout
    assert "the steps it was fitted on" in stdout
    assert table.calibration.parent == parent.content_hash and table.fingerprint.to_dict() == parent.fingerprint.to_dict()
    assert [f["name"] for f in table.calibration.files] == [p.name for p in SERVED]


def test_inspect_says_it_is_calibrated_in_one_line(calibrated):
    out, _ = calibrated
    lines = [ln for ln in invoke("inspect", out).stdout.splitlines() if "calibrated from parent" in ln]
    assert len(lines) == 1 and "470 steps" in lines[0]
    data = json.loads(invoke("inspect", out, "--json").stdout)
    assert data["calibration"]["parent"] == read_table(SHIPPED).content_hash
    assert json.loads(invoke("inspect", SHIPPED, "--json").stdout)["calibration"] is None


def test_diff_against_the_parent_shows_what_the_correction_moved(calibrated):
    out, _ = calibrated
    r = invoke("diff", SHIPPED, out, "--json")
    d = json.loads(r.stdout)
    factor = read_table(out).calibration.factors["verify"]["within_capture"]
    assert any("new is calibrated from the other table" in n for n in d["notes"])
    assert d["fingerprint_changes"] == []
    assert d["curves"]["verify"]["summary"]["median_abs_rel_change"] == pytest.approx(factor - 1, abs=1e-9)


def test_json_output(calibrated, tmp_path):
    r = invoke("calibrate", SHIPPED, *SERVED, "--out", tmp_path / "c.parquet", "--json")
    d = json.loads(r.stdout)
    assert d["path"] == str(tmp_path / "c.parquet") and d["calibration"]["steps"] == {"draft": 262, "verify": 262}
    assert [f["kind"] for f in d["fitted"]] == ["draft", "verify"] and d["summary"].startswith("calibrated from")


@pytest.mark.parametrize("files,fragments", [
    ([OTHER_TABLE], ["context-aware-observed.parquet", "table_hash ab68151477b4 is not this table's 15b5101f9d84"]),
    ([STOCK_NO_ENGINE], ["context-stock-observed.parquet", "records neither a table_hash nor an engine fingerprint"]),
])
def test_foreign_observe_files_are_refused_in_one_line_and_nothing_is_written(files, fragments, tmp_path):
    out = tmp_path / "c.parquet"
    one_line_error(invoke("calibrate", SHIPPED, *SERVED, *files, "--out", out), *fragments)
    assert list(tmp_path.iterdir()) == []


def test_a_calibrated_table_is_not_calibrated_again_and_out_is_not_replaced_without_force(calibrated, tmp_path):
    out, _ = calibrated
    one_line_error(invoke("calibrate", out, *SERVED, "--out", tmp_path / "again.parquet"), "calibrated already")
    before = out.read_bytes()
    one_line_error(invoke("calibrate", SHIPPED, *SERVED, "--out", out), str(out))
    assert out.read_bytes() == before


def test_calibrate_is_light(tmp_path):
    """No torch, no vllm, no scipy or matplotlib; pandas only as pyarrow's writer imports it (as merge's)."""
    assert_command_is_light("calibrate", str(SHIPPED), *map(str, SERVED), "--out", str(tmp_path / "c.parquet"),
                            allow=("pandas",))
    assert_command_is_light("calibrate", str(SHIPPED), str(OTHER_TABLE), "--out", str(tmp_path / "d.parquet"),
                            codes=(2,))  # a refusal imports no pandas either way

"""`dspark-calib seed`: writes the seed and says what it holds; --json; one-line refusals that leave
nothing behind; light (no torch, no vLLM)."""

from __future__ import annotations

import json
import os

from typer.testing import CliRunner

from dspark_calib.cli.app import app
from dspark_calib.seed import read_seed
from tests.core.test_seed import KEYS, observed, reading
from tests.helpers import REPO, assert_command_is_light, one_line_error

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def files(tmp_path):
    return observed(tmp_path / "obs", [reading(0, 4), None, reading(1, 104, 0.6, 1.0), reading(2, 204, 0.7, 2.0)])


def test_seed_writes_the_most_refitted_reading_and_says_how_to_serve_it(tmp_path):
    obs = files(tmp_path)
    out = tmp_path / "seed.json"
    r = invoke("seed", tmp_path / "obs", "--out", out)
    assert r.exit_code == 0, r.output
    seed = read_seed(str(out))
    assert (seed.refits, seed.steps, seed.slope, seed.keys) == (2, 204, 0.7, KEYS)
    lines = r.stdout.splitlines()
    assert lines[0] == f"wrote {out}: vLLM's acceptance estimator as observed (1 observe file)"
    assert lines[1].startswith("coefficients  slope 0.7, intercepts 2, 1.75, 1.5, ")
    assert lines[1].endswith("(K=7; fitted over 2 refits, 204 steps)")
    assert lines[2] == f"read from     {os.path.basename(obs)} on h200-a"
    assert "speculative_method draft_model" in lines[3] and "load_format dummy" in lines[3]
    assert lines[4].startswith(f"serve with    DSPARK_CALIB_ESTIMATOR_SEED={out} ")


def test_seed_json(tmp_path):
    files(tmp_path)
    out = tmp_path / "seed.json"
    r = invoke("seed", tmp_path / "obs", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["path"] == str(out) and d["slope"] == 0.7 and d["refits"] == 2 and d["keys"] == KEYS
    assert d == {"path": str(out), **json.loads(out.read_text())}


def test_seed_refuses_in_one_line_and_writes_nothing(tmp_path):
    obs = files(tmp_path)
    out = tmp_path / "seed.json"
    one_line_error(invoke("seed", obs, "--out", tmp_path / "seed.txt"), "--out: a seed is a .json file")
    one_line_error(invoke("seed", obs, obs, "--out", out), "is the same file as")
    one_line_error(invoke("seed", obs, "--out", tmp_path / "nodir" / "s.json"), "does not exist")
    never = observed(tmp_path / "cold", [reading(0, 40)])
    one_line_error(invoke("seed", never, "--out", out), "the estimator never refitted")
    assert not out.exists()
    out.write_text("{}")
    one_line_error(invoke("seed", obs, "--out", out), "--out: exists; pass --force to replace it")
    assert invoke("seed", obs, "--out", out, "--force").exit_code == 0 and read_seed(str(out)).refits == 2
    renamed = tmp_path / "obs.json"
    os.link(obs, renamed)
    one_line_error(invoke("seed", obs, "--out", renamed, "--force"), "would overwrite the input")
    assert sorted(os.listdir(tmp_path)) == ["cold", "obs", "obs.json", "seed.json"]


def test_seed_is_light(tmp_path):
    files(tmp_path)
    assert_command_is_light("seed", str(tmp_path / "obs"), "--out", str(tmp_path / "seed.json"))


def test_seed_refuses_the_h200_runs_estimator_that_ran_away(tmp_path):
    """The committed draft-stock arm (dummy weights): vLLM's estimator ran away on its second refit;
    `seed` says so in one line and writes nothing."""
    obs = REPO / "benchmarks" / "results" / "h200" / "2026-12-02-0005-draft-cold" / "context-draft-stock-observed.parquet"
    out = tmp_path / "seed.json"
    one_line_error(invoke("seed", obs, "--out", out), "the estimator's fit ran away (slope 3.765e+07")
    assert not out.exists()

"""`dspark-calib advise`: the shipped table with a given schedule or observe files; one-line errors; light."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspark_calib.cli.app import app
from dspark_calib.table.file import read_table
from tests.core.test_advise import engine_of, observed_dir
from tests.helpers import SHIPPED, assert_command_is_light, one_line_error

runner = CliRunner()
DECAYING = "0.9,0.8,0.7,0.55,0.4,0.3,0.2"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def shipped():
    return read_table(SHIPPED, samples=False)


def test_json_shape(shipped):
    r = invoke("advise", SHIPPED, "--acceptance", DECAYING, "--context", 4096, "--context", 1024, "--max-num-seqs", 8,
               "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["contexts"] == [1024, 4096] and d["batch_sizes"] == [1, 2, 4, 8] and d["one_context"] == 8192
    assert d["num_speculative_tokens"] == 7 and d["table_hash"] == shipped.content_hash and d["plot"] is None
    assert d["acceptance"]["rates"] == [0.9, 0.8, 0.7, 0.55, 0.4, 0.3, 0.2] and d["min_gain_pct"] == 1.0
    assert len(d["cells"]) == 8 and set(d["losses"]) == {"adaptive", "adaptive_one_context"}
    cell = d["cells"][0]
    assert (cell["num_reqs"], cell["context_len"]) == (1, 1024) and len(cell["fixed"]) == 7
    for option in (*cell["fixed"], cell["adaptive"], cell["adaptive_one_context"]):
        assert set(option) == {"name", "drafts_per_request", "tokens_per_step", "draft_ms", "verify_ms", "step_ms",
                               "goodput_per_ms"}
        assert option["step_ms"] == pytest.approx(option["draft_ms"] + option["verify_ms"])
    assert cell["fixed"][6]["tokens_per_step"] == pytest.approx(4.85)  # 1 + the sum of the rates
    assert cell["advice"] in ("adaptive", *(f"K={k}" for k in range(1, 8)))


def test_text_report_names_where_adaptive_at_one_context_loses():
    r = invoke("advise", SHIPPED, "--acceptance", DECAYING, "--all")
    assert r.exit_code == 0, r.output
    assert "advise table 15b5101f9d84" in r.stdout and "context 16384" in r.stdout and "K=7" in r.stdout
    assert "adaptive is never below the best fixed K" in r.stdout
    assert "adaptive@8192 loses to a fixed K in" in r.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--acceptance", "0.9,0.8"], "--acceptance 0.9,0.8: 2 rates, the table's num_speculative_tokens is 7"),
    (["--acceptance", "0.9,0.8,0.7,0.75,0.4,0.3,0.2"], "rate 4 (0.75) is above rate 3 (0.7)"),
    (["--acceptance", "0.9,0.8,0.7,0.5,0.4,0.3,1.5"], "1.5 is not a rate in [0, 1]"),
    (["--acceptance", "a,b"], "want comma-separated rates"),
    ([], "give the acceptance either as --acceptance RATES or as observe files"),
    (["--acceptance", DECAYING, "--max-num-seqs", "512"], "the table prices batches of 1..256 requests"),
    (["--acceptance", DECAYING, "--context", "40000"], "within the table's max_model_len 32768"),
    (["--acceptance", DECAYING, "--plot", "out.gif"], "unknown plot format"),
])
def test_bad_input_is_one_line(args, fragment):
    one_line_error(invoke("advise", SHIPPED, *args), fragment)


def test_observe_files_give_the_schedule(tmp_path, shipped):
    d = observed_dir(tmp_path, shipped, [((4,) * 7, (4,) * 6 + (2,))] * 3)
    r = invoke("advise", SHIPPED, d, "--json", "--context", 8192)
    assert r.exit_code == 0, r.output
    acc = json.loads(r.stdout)["acceptance"]
    assert acc["rates"] == [1.0] * 6 + [0.5] and acc["source"] == "observed" and acc["steps"] == 3
    one_line_error(invoke("advise", SHIPPED, d, "--acceptance", DECAYING), "one of the two")


def test_observe_files_of_another_engine_are_one_line(tmp_path, shipped):
    d = observed_dir(tmp_path, shipped, [((4,) * 7, (4,) * 7)], engine=engine_of(shipped, tensor_parallel_size=2))
    line = one_line_error(invoke("advise", SHIPPED, d), "observed on another engine than the table's fingerprint")
    assert "tensor_parallel_size" in line and str(d) in line


def test_plot_is_written(tmp_path):
    out = tmp_path / "advice.png"
    r = invoke("advise", SHIPPED, "--acceptance", DECAYING, "--max-num-seqs", 16, "--plot", out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"\x89PNG" and f"plot written to {out}" in r.stdout


def test_advise_is_light(tmp_path, shipped):
    assert_command_is_light("advise", str(SHIPPED), "--acceptance", DECAYING)
    d = observed_dir(tmp_path, shipped, [((4,) * 7, (4,) * 6 + (2,))])
    assert_command_is_light("advise", str(SHIPPED), str(d), "--json")


def steps_dir(tmp_path, n=8, contexts=(1500, 1500, 9000)):
    """Decode steps of n requests at these mean contexts, and one step carrying a prefill chunk."""
    from dspark_calib.observe.file import ObservedWriter
    from tests.core.test_observe import step

    d = tmp_path / "steps"
    with ObservedWriter(d, metadata={}, name="s") as w:
        for i, c in enumerate(contexts):
            w.append(step(i, num_reqs=n, context_mean=float(c), context_max=c, context_sum=n * c,
                          num_target_tokens=n + 40))
        w.append(step(len(contexts), context_mean=1500.0, context_max=1500, context_sum=12000))  # 64 tokens
    return d


def test_steps_from_gives_each_options_goodput_over_the_observed_steps(tmp_path, shipped):
    from dspark_calib.advise import Acceptance, predict_steps

    d = steps_dir(tmp_path)
    r = invoke("advise", SHIPPED, "--acceptance", DECAYING, "--steps-from", d, "--vocab-size", 151936, "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    want = predict_steps(shipped, Acceptance(tuple(float(x) for x in DECAYING.split(",")), "given"), [8] * 3,
                         [1500, 1500, 9000], vocab_size=151936).to_dict()
    assert got == {**json.loads(json.dumps(want)), "steps_from": [str(d / "observed-s-000000.parquet")], "plot": None}
    assert got["steps"] == 3 and [o["name"] for o in got["options"]][-2:] == ["adaptive", "adaptive@8192"]
    text = invoke("advise", SHIPPED, "--acceptance", DECAYING, "--steps-from", d)
    assert text.exit_code == 0, text.output
    assert "over 3 observed decode steps (24 requests, mean context 4000)" in text.stdout
    assert "best over these steps:" in text.stdout and "K=7" in text.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--context", "1024"], "--steps-from models the observed steps"),
    (["--max-num-seqs", "8"], "--steps-from models the observed steps"),
    (["--all"], "give one or the other"),
])
def test_steps_from_with_grid_options_is_one_line(tmp_path, args, fragment):
    one_line_error(invoke("advise", SHIPPED, "--acceptance", DECAYING, "--steps-from", steps_dir(tmp_path), *args),
                   fragment)


def test_steps_from_without_decode_steps_is_one_line(tmp_path):
    d = steps_dir(tmp_path, contexts=())
    one_line_error(invoke("advise", SHIPPED, "--acceptance", DECAYING, "--steps-from", d),
                   "record no decode step with drafts to model")


def test_advise_over_steps_is_light(tmp_path):
    assert_command_is_light("advise", str(SHIPPED), "--acceptance", DECAYING, "--steps-from", str(steps_dir(tmp_path)))

"""import-vllm checks its whole input and `profile` everything it can before vLLM is imported:
each bad input is one stderr line naming the file or option, exit 2, nothing written or left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_calib.cli.app import app
from tests.helpers import DRAFT, MODEL, REPO, fixture_json, one_line_error

runner = CliRunner()
IDENTITY = ("--model", MODEL, "--gpu-name", "NVIDIA H200", "--vllm-version", "0.33.0")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _capture(tmp_path: Path, change) -> Path:
    data = json.loads(Path(fixture_json(1024)).read_text())
    change(data)
    path = tmp_path / "capture.json"
    path.write_text(json.dumps(data))
    return path


def _every_batch(key, value):
    def change(data):
        for batch in data["batches"]:
            batch[key] = value
    return change


@pytest.mark.parametrize("change, fragment", [
    (_every_batch("context_len", 10**30), "row 0: context_len 1000000000000000000000000000000 is not an integer"),
    (lambda d: d.update(max_num_reqs=-5), "max_num_reqs -5 is not an integer"),
    (lambda d: d.update(max_num_reqs=9000), "max_num_reqs 9000 is above max_num_batched_tokens 8192"),
    (lambda d: d.update(capture_sizes=[8, 4]), "capture_sizes are not strictly increasing"),
    (lambda d: d["rows"][3].update(forward_ms=1e308), "row 3: forward_ms 1e+308 is not a plausible step"),
    (lambda d: d["rows"][0].update(num_reqs=10**30), "row 0: num_reqs"),
    (lambda d: [r.update(full_cudagraph=False) for r in d["rows"]], "draft curve at context 1024 is empty"),
    (lambda d: [r.update(forward_ms=100.0 if r["num_target_tokens"] < 50 else 1.0) for r in d["rows"]],
     "verify curve at context 1024, size 56: cost 1 ms falls below the 100 ms"),
])
def test_import_refuses_a_capture_its_reader_or_vllm_could_not_use(tmp_path, change, fragment):
    capture = _capture(tmp_path, change)
    out = tmp_path / "out"
    out.mkdir()
    line = one_line_error(invoke("import-vllm", capture, *IDENTITY, "--draft", DRAFT, "--num-speculative-tokens", "7",
                                 "--out", out), str(capture), fragment)
    assert "Traceback" not in line
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("args, fragments", [
    (("--draft", MODEL, "--num-speculative-tokens", "7"),
     (os.path.join(MODEL, "config.json"), "not a DSpark drafter", "Qwen3ForCausalLM")),
    (("--draft", DRAFT, "--num-speculative-tokens", "3"),
     (os.path.join(DRAFT, "config.json"), "--num-speculative-tokens 3 is not this drafter's block_size 7")),
    (("--draft", DRAFT, "--num-speculative-tokens", "7", "--dtype", "bogus"),
     ("--dtype 'bogus' is not one of vLLM's: bfloat16, float16, float32",)),
])
def test_import_refuses_options_the_capture_was_not_taken_with(tmp_path, args, fragments):
    out = tmp_path / "out"
    out.mkdir()
    one_line_error(invoke("import-vllm", fixture_json(1024), *IDENTITY, *args, "--out", out), *fragments)
    assert list(out.iterdir()) == []


def test_a_different_engine_shape_names_both_files(tmp_path):
    other = _capture(tmp_path, lambda d: d.update(max_num_reqs=128))
    one_line_error(invoke("import-vllm", fixture_json(8192), other, *IDENTITY, "--draft", DRAFT,
                          "--num-speculative-tokens", "7", "--out", f"{tmp_path}/"),
                   str(other), "different engine shape than", fixture_json(8192))


def test_merge_errors_name_the_files(tmp_path):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert invoke("import-vllm", fixture_json(1024), *IDENTITY, "--draft", DRAFT, "--num-speculative-tokens", "7",
                  "--out", a).exit_code == 0
    assert invoke("import-vllm", fixture_json(8192), *IDENTITY, "--draft", DRAFT, "--num-speculative-tokens", "7",
                  "--out", b, "--gpu-name", "NVIDIA H100").exit_code == 0
    one_line_error(invoke("merge", a, b, "--out", tmp_path / "m.parquet"), "gpu_name", f"in {a} but", f"in {b}")
    assert not (tmp_path / "m.parquet").exists()


# -- profile: refused in well under a second, before vllm or torch is imported ------------------
PROFILE = ("profile", "--model", MODEL, "--draft", DRAFT)


def _profile_in_a_fresh_python(args, *, block_vllm=False, **env):
    """`dspark-calib ARGS` in a new interpreter: (exit code, stderr, seconds, heavy modules imported)."""
    code = ("import sys, time\n"
            + ("sys.modules['vllm'] = None\n" if block_vllm else "")
            + "from dspark_calib.cli.app import PROG, app\n"
            f"sys.argv = ['dspark-calib', *{[str(a) for a in args]!r}]\n"
            "t0 = time.perf_counter()\n"
            "try:\n    app(prog_name=PROG)\nexcept SystemExit as e:\n    code = e.code\n"
            "print(code, round(time.perf_counter() - t0, 3), [m for m in ('vllm', 'torch') if sys.modules.get(m)])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, **env})
    code, seconds, heavy = r.stdout.split(" ", 2)
    return int(code), r.stderr, float(seconds), heavy.strip()


@pytest.mark.parametrize("args, env, fragment", [
    ((), {"CUDA_VISIBLE_DEVICES": ""}, "no GPU visible"),
    (("--dtype", "bogus"), {}, "--dtype 'bogus' is not one of vLLM's"),
])
def test_profile_refuses_before_importing_vllm_and_leaves_no_directory(tmp_path, args, env, fragment):
    import importlib.util

    if fragment == "no GPU visible" and importlib.util.find_spec("vllm") is None:
        fragment = "vllm is not installed"  # the light install: said first, as fast
    out = tmp_path / "new"
    code, err, seconds, heavy = _profile_in_a_fresh_python([*PROFILE, *args, "--out", f"{out}/"], **env)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("dspark-calib: error: ") and fragment in err, err
    assert heavy == "[]" and seconds < 2.0, (heavy, seconds)  # ~0.1 s here; 2 s: a loaded CI host
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_profile_without_vllm_says_how_to_install_it_from_the_checkout(tmp_path):
    code, err, seconds, _ = _profile_in_a_fresh_python([*PROFILE, "--out", f"{tmp_path}/"], block_vllm=True)
    assert code == 2 and err.strip() == ("dspark-calib: error: vllm is not installed: in the dspark-calib checkout, "
                                         "pip install '.[vllm]'")
    assert list(tmp_path.iterdir()) == []


def test_profile_does_not_replace_an_existing_table_without_force(tmp_path):
    table = tmp_path / "t.parquet"
    table.write_bytes(b"a table")
    one_line_error(invoke(*PROFILE, "--out", table), str(table), "--out: exists; pass --force")
    assert table.read_bytes() == b"a table" and sorted(os.listdir(tmp_path)) == ["t.parquet"]


def test_profile_counts_gpus_from_the_driver_files(tmp_path, monkeypatch):
    from dspark_calib.vllm.profile import driver

    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (gpus / bus).mkdir()
    monkeypatch.setattr(driver, "NVIDIA_GPUS", str(gpus))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert driver.visible_gpus() == 2
    for visible, count in (("1", 1), ("0,1,2", 2), ("", 0), ("-1", 0)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert driver.visible_gpus() == count, visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(driver, "vllm_installed", lambda: True)
    one_line_error(invoke(*PROFILE, "--tp", "2", "--out", f"{tmp_path}/"), "--tp 2 needs 2 GPUs, 1 visible")


def test_import_records_the_method_and_checks_its_drafter(tmp_path):
    """A start-up profile of a draft-model speculator imports as one, recorded in the table; a
    drafter that is not the method's is one line."""
    from dspark_calib.table.file import read_metadata

    small = str(REPO / "profiles" / "configs" / "qwen3-0.6b")
    out = tmp_path / "t.parquet"
    r = invoke("import-vllm", fixture_json(1024), *IDENTITY, "--draft", small, "--method", "draft_model",
               "--num-speculative-tokens", "7", "--out", out)
    assert r.exit_code == 0, r.output
    assert read_metadata(str(out)).fingerprint.speculative_method == "draft_model"
    one_line_error(invoke("import-vllm", fixture_json(1024), *IDENTITY, "--draft", small,
                          "--num-speculative-tokens", "7", "--out", tmp_path / "u.parquet"),
                   "not a DSpark drafter", "for --method dspark")
    one_line_error(invoke("import-vllm", fixture_json(1024), *IDENTITY, "--draft", small, "--method", "ngram",
                          "--num-speculative-tokens", "7", "--out", tmp_path / "v.parquet"),
                   "--method 'ngram': not supported")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def test_import_of_an_mtp_profile_needs_no_draft_as_profile_does(tmp_path):
    """MTP drafts with the target's own layers: import-vllm takes no --draft for it (the target is
    the drafter, as `profile --method mtp` records it); a method with its own drafter still names
    --draft in one line, the same line `profile` says (speculators.py holds the rule)."""
    from dspark_calib.fingerprint import config_hash
    from dspark_calib.table.file import read_metadata

    out = tmp_path / "t.parquet"
    r = invoke("import-vllm", fixture_json(1024), *IDENTITY, "--method", "mtp", "--num-speculative-tokens", "3",
               "--out", out)
    assert r.exit_code == 0, r.output
    fp = read_metadata(str(out)).fingerprint
    assert fp.speculative_method == "mtp" and fp.draft_config_hash == fp.target_config_hash == config_hash(MODEL)
    for method in ("dspark", "eagle3"):
        line = one_line_error(invoke("import-vllm", fixture_json(1024), *IDENTITY, "--method", method,
                                     "--num-speculative-tokens", "3", "--out", tmp_path / "u.parquet"),
                              f"--draft is needed for --method {method}")
        assert line == one_line_error(invoke(*PROFILE[:PROFILE.index("--draft")], "--method", method,
                                             "--out", f"{tmp_path}/"), "--draft is needed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]

# -- profile --from-capture on the light install ----------------------------------------------
def _draft_model_rebuild(*extra):
    from tests.helpers import DRAFT_MODEL_CAPTURE

    return ["profile", "--model", MODEL, "--draft", str(REPO / "profiles" / "configs" / "qwen3-0.6b"),
            "--method", "draft_model", "--num-speculative-tokens", "7", "--context-len", "1024", "--context-len",
            "8192", "--replays", "5", "--max-model-len", "32768", "--from-capture", str(DRAFT_MODEL_CAPTURE), *extra]


def test_a_rebuild_from_a_capture_needs_no_gpu_torch_or_vllm(tmp_path):
    from tests.helpers import assert_command_is_light

    assert_command_is_light(*_draft_model_rebuild("--out", str(tmp_path / "t.parquet")), allow=("pandas",))
    from dspark_calib.table.file import read_table

    t = read_table(tmp_path / "t.parquet")
    assert t.fingerprint.speculative_method == "draft_model" and t.fingerprint.extra["hostname"] == "unrecorded"
    assert t.fingerprint.extra["from_capture"]["file"] == "h200-tp1-draft-ctx1k8k-samples-rank0.json"


def test_a_rebuild_with_another_engine_limit_is_refused_naming_the_key(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = CliRunner().invoke(app, _draft_model_rebuild("--max-num-seqs", "128", "--out", str(out)))
    one_line_error(r, "h200-tp1-draft-ctx1k8k-samples-rank0.json: max_num_seqs: the options give 128, the capture "
                      "recorded 256; rebuild with the options of the GPU run")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("args, flag", [
    (["--load-format", "dummy"], "--load-format"),  # the default, given: refused all the same
    (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization"),
    (["--distributed-executor-backend", "mp"], "--distributed-executor-backend"),
    (["--engine-arg", "block_size=32"], "--engine-arg"),
    (["--engine-args-json", '{"block_size": 32}'], "--engine-args-json"),
    (["--keep-capture", "kept"], "--keep-capture"),
    (["--shape-replays", "3"], "--shape-replays"),
])
def test_a_rebuild_refuses_the_options_only_an_engine_uses(tmp_path, args, flag):
    """A rebuild starts no engine: an engine's option given to it would be accepted and do nothing
    (or, as --load-format and --engine-arg were, be recorded as the GPU run's)."""
    r = CliRunner().invoke(app, _draft_model_rebuild(*args, "--out", str(tmp_path / "t.parquet")))
    one_line_error(r, f"{flag}: only a run that starts the engine uses it, and --from-capture starts none")
    assert list(tmp_path.iterdir()) == []


def test_a_rebuild_records_the_load_format_and_engine_args_the_capture_recorded(tmp_path):
    """The capture's launch (what the driver started the engine with), not the rebuild's defaults; a
    capture from before the driver recorded it says so."""
    from dspark_calib.table.file import read_table
    from tests.helpers import DRAFT_MODEL_CAPTURE

    capture = json.loads(DRAFT_MODEL_CAPTURE.read_text())
    assert "launch" not in capture
    r = CliRunner().invoke(app, _draft_model_rebuild("--out", str(tmp_path / "old.parquet")))
    assert r.exit_code == 0, r.output
    extra = read_table(tmp_path / "old.parquet").fingerprint.extra
    assert extra["load_format"] == "unrecorded" and "engine_args" not in extra
    launched = tmp_path / "launched.json"
    launched.write_text(json.dumps({**capture, "launch": {"load_format": "auto", "engine_args": {"block_size": 32}}}))
    args = _draft_model_rebuild("--out", str(tmp_path / "new.parquet"))
    args[args.index("--from-capture") + 1] = str(launched)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    extra = read_table(tmp_path / "new.parquet").fingerprint.extra
    assert extra["load_format"] == "auto" and extra["engine_args"] == {"block_size": 32}
    launched.write_text(json.dumps({**capture, "launch": {"load_format": 1, "engine_args": {}}}))
    args[args.index("--out") + 1] = str(tmp_path / "bad.parquet")
    one_line_error(CliRunner().invoke(app, args), "launch is not a load_format and engine_args")


def test_negative_shape_replays_is_one_line_before_any_engine(tmp_path):
    r = CliRunner().invoke(app, ["profile", "--model", MODEL, "--draft", str(REPO / "profiles" / "configs" /
                                 "dspark-qwen3-8b-block7"), "--shape-replays", "-1", "--out", str(tmp_path) + "/"])
    one_line_error(r, "--shape-replays must be >= 0, got -1")
    assert list(tmp_path.iterdir()) == []

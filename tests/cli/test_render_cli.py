"""The CLI end to end (typer's CliRunner, and subprocesses where the process itself matters)."""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_calib import __version__
from dspark_calib.cli.app import app
from dspark_calib.reference import table_from_startup_json
from dspark_calib.table.file import read_table, write_table

from tests.helpers import DRAFT, MODEL, REFERENCE_KWARGS as KW, REPO, fixture_json as _json, one_line_error

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

runner = CliRunner()


@pytest.fixture(scope="module")
def files(table_files) -> dict[str, str]:
    return table_files


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


assert_one_line_error = one_line_error


def test_version_and_help():
    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"dspark-calib {__version__}"
    for cmd in ([], ["inspect"], ["diff"], ["import-vllm"], ["merge"]):
        r = invoke(*cmd, "--help")
        assert r.exit_code == 0, (cmd, r.output)
        assert "Usage" in r.stdout


def test_inspect_human(files):
    r = invoke("inspect", files["c1024"])
    assert r.exit_code == 0, r.output
    out = r.stdout
    for text in ("fingerprint", "NVIDIA H200", "draft curve @ctx 1024", "verify curve @ctx 1024",
                 "◀ capture limit", "warnings:", "size 432 median 19.437 ms is 6.5% below size 416's", "draft budget per request (of 7)"):
        assert text in out, text


def test_inspect_json(files):
    r = invoke("inspect", files["all"], "--json", "--context-len", "9000")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    t = read_table(files["all"])
    assert d["content_hash"] == t.content_hash
    assert d["context_lens"] == [8192] and list(d["curves"]) == ["8192"]
    assert d["decision_map"]["context_len"] == 8192
    assert [p["size"] for p in d["curves"]["8192"]["draft"]["points"]] == t.curves[8192].draft.size.tolist()
    assert {w["code"] for w in d["warnings"]} == {"falling_median"}
    assert d["notes"] and d["plot"] is None


def test_inspect_plot(files, tmp_path):
    png = tmp_path / "sub" / "curves.png"
    png.parent.mkdir()
    r = invoke("inspect", files["all"], "--plot", png)
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert os.listdir(png.parent) == ["curves.png"]  # no temp file left behind
    assert f"plot written to {png}" in r.stdout


def test_diff_identical_passes_any_threshold(files):
    r = invoke("diff", files["c1024"], files["c1024"], "--threshold", "0")
    assert r.exit_code == 0, r.output
    assert "fingerprints identical" in r.stdout and "not exceeded" in r.stdout
    assert "0 of 81" in r.stdout


def test_diff_threshold_exit_codes(files):
    r = invoke("diff", files["c1024"], files["c16384"], "--threshold", "5")
    assert r.exit_code == 1, r.output
    assert "EXCEEDED" in r.stdout and "context_lens" in r.stdout
    r = invoke("diff", files["c1024"], files["c16384"], "--threshold", "100000")
    assert r.exit_code == 0, r.output
    r = invoke("diff", files["c1024"], files["c16384"])  # no threshold: report only
    assert r.exit_code == 0, r.output


def test_diff_json_and_plot(files, tmp_path):
    png = tmp_path / "diff.png"
    r = invoke("diff", files["c1024"], files["c16384"], "--json", "--threshold", "5", "--plot", png)
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert d["threshold"]["pct"] == 5.0 and d["threshold"]["exceeded"] is True
    assert d["threshold"]["over"] and all(abs(o["rel_change"]) > 0.05 for o in d["threshold"]["over"])
    assert d["old"]["context_len"] == 1024 and d["new"]["context_len"] == 16384
    assert d["curves"]["verify"]["summary"]["significant_slower"] > 0
    assert d["decisions"]["changed"] == len(d["decisions"]["changes"]) > 0
    assert png.read_bytes()[:8] == PNG_MAGIC and d["plot"] == str(png)


def test_diff_context_options(files):
    r = invoke("diff", files["all"], files["c8192"], "--json", "--old-context", "1024", "--new-context", "8192")
    d = json.loads(r.stdout)
    assert (d["old"]["context_len"], d["new"]["context_len"]) == (1024, 8192)
    r = invoke("diff", files["all"], files["c8192"], "--json")
    d = json.loads(r.stdout)
    # The shared context by default: the 8192 curves are the same recording, so nothing moves.
    assert (d["old"]["context_len"], d["new"]["context_len"]) == (8192, 8192)
    assert d["curves"]["verify"]["summary"]["max_abs_rel_change"] == 0


def test_import_vllm(tmp_path):
    r = invoke("import-vllm", _json(1024), _json(8192), "--model", MODEL, "--draft", DRAFT, "--gpu-name",
               "NVIDIA H200", "--vllm-version", "0.33.0", "--num-speculative-tokens", "7", "--out", f"{tmp_path / 'new'}/")
    assert r.exit_code == 0, r.output
    path = r.stdout.splitlines()[0]
    assert Path(path).parent == tmp_path / "new" and path.endswith(".parquet")
    t = read_table(path)
    assert t.context_lens() == [1024, 8192]
    rebuilt = table_from_startup_json([_json(1024), _json(8192)], **KW)
    # created_at (in the hash) is the build's own second: the same inputs differ only there
    assert t.content_hash == dataclasses.replace(rebuilt, created_at=t.created_at).content_hash
    assert "ctx 1024" in r.stdout and "ctx 8192" in r.stdout


def test_import_vllm_bad_input(tmp_path):
    missing = tmp_path / "nope.json"
    r = invoke("import-vllm", missing, "--model", MODEL, "--draft", DRAFT, "--gpu-name", "NVIDIA H200", "--vllm-version",
               "0.33.0", "--num-speculative-tokens", "7", "--out", tmp_path)
    assert_one_line_error(r, str(missing), "no such file")
    r = invoke("import-vllm", _json(1024), "--model", tmp_path, "--draft", DRAFT, "--gpu-name", "NVIDIA H200",
               "--vllm-version", "0.33.0", "--num-speculative-tokens", "7", "--out", tmp_path)
    assert_one_line_error(r, str(tmp_path), "config.json")


def test_merge(files, tmp_path):
    out = tmp_path / "merged.parquet"
    r = invoke("merge", files["c1024"], files["c8192"], "--out", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == str(out)
    assert read_table(out).context_lens() == [1024, 8192]


def test_merge_refuses_different_engines(files, tmp_path):
    other = write_table(table_from_startup_json([_json(8192)], **{**KW, "gpu_name": "NVIDIA H100"}),
                        tmp_path / "h100.parquet")
    r = invoke("merge", files["c1024"], other, "--out", tmp_path / "m.parquet")
    assert_one_line_error(r, "gpu_name")
    assert not (tmp_path / "m.parquet").exists()


def test_the_gpu_state_shows_in_inspect_and_diff_and_keeps_merge_to_one_state(files, tmp_path):
    """A table profiled in the serving state beside one in the startup state (import-vllm's: vLLM's
    own start-up pass): inspect names the state, diff lists it as a change, merge refuses to pool
    them in one line naming the key, writing nothing."""
    startup = read_table(files["c8192"])
    serving = dataclasses.replace(startup, fingerprint=startup.fingerprint.replace(gpu_state="serving"))
    other = write_table(serving, tmp_path / "serving.parquet")
    assert startup.fingerprint.gpu_state == "startup"
    r = invoke("inspect", other)
    assert r.exit_code == 0 and any(ln.split()[:3] == ["GPU", "state", "serving"] for ln in r.stdout.splitlines())
    assert json.loads(invoke("inspect", other, "--json").stdout)["fingerprint"]["gpu_state"] == "serving"
    d = json.loads(invoke("diff", files["c8192"], other, "--json").stdout)
    assert {"key": "gpu_state", "old": "startup", "new": "serving"} in d["fingerprint_changes"]
    r = invoke("merge", files["c1024"], other, "--out", tmp_path / "m.parquet")
    assert_one_line_error(r, "gpu_state", "'startup'", "'serving'")
    assert not (tmp_path / "m.parquet").exists()


def test_bad_tables_are_one_line_errors(tmp_path):
    missing = tmp_path / "missing.parquet"
    assert_one_line_error(invoke("inspect", missing), f"{missing}: no such file")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all\n" * 10)
    assert_one_line_error(invoke("inspect", junk), str(junk), "not a readable parquet file")
    assert_one_line_error(invoke("diff", junk, missing), str(junk))


def test_unwritable_plot_is_one_line_error(files, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(invoke("inspect", files["c1024"], "--plot", blocker / "p.png"), str(blocker))


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=120, **kw)


def test_cli_import_stays_light():
    code = ("import sys, dspark_calib.cli.app\n"
            "heavy = [m for m in ('torch', 'vllm', 'scipy', 'matplotlib', 'pandas', 'pyarrow') if m in sys.modules]\n"
            "assert not heavy, heavy")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr


def test_module_entry_point_and_error_without_traceback(tmp_path):
    r = _run("-m", "dspark_calib", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"dspark-calib {__version__}"
    r = _run("-m", "dspark_calib", "inspect", str(tmp_path / "absent.parquet"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"dspark-calib: error: {tmp_path / 'absent.parquet'}: no such file"
    assert r.stdout == ""


def test_diff_threshold_exits_1_on_a_significant_speed_up(files):
    # c16384 -> c1024: every verify step significantly faster; the gate must trip on it too.
    r = invoke("diff", files["c16384"], files["c1024"], "--threshold", "5")
    assert r.exit_code == 1, r.output
    assert "EXCEEDED" in r.stdout


def test_diff_without_significance_says_so_and_needs_no_scipy(files):
    code = ("import sys\nfrom dspark_calib.cli.app import PROG, app\n"
            f"sys.argv = ['dspark-calib', 'diff', {files['c1024']!r}, {files['c16384']!r}]\n"
            "try:\n    app(prog_name=PROG)\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'scipy' not in sys.modules and 'matplotlib' not in sys.modules\n")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert "significance not tested" in r.stdout
    r = invoke("diff", files["c1024"], files["c16384"], "--significance", "--json")
    d = json.loads(r.stdout)
    assert d["significance_tested"] and d["curves"]["verify"]["summary"]["significant_slower"] > 40


SHIPPED = "profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"


def test_inspect_of_the_shipped_table_opens_with_its_verdict_and_hides_notes():
    """26 dips used to print as 26 warnings; vLLM's running max absorbs 23 of them without a
    budget changing: those are notes, shown with --all only; the verdict comes first."""
    r = invoke("inspect", REPO / SHIPPED)
    assert r.exit_code == 0, r.output
    lines = r.stdout.rstrip().splitlines()
    assert lines[0].startswith("fit to serve: ") and "3 warnings to look at, 28 notes" in lines[0]
    assert lines[-1] == "summary: 3 warnings, 28 notes (--all shows the notes)"
    assert "28 notes:" not in r.stdout and "the same draft budgets" not in r.stdout
    full = invoke("inspect", REPO / SHIPPED, "--all").stdout
    assert "28 notes:" in full and full.count("the same draft budgets") == 25 and "hw_slowdown" in full
    d = json.loads(invoke("inspect", REPO / SHIPPED, "--json").stdout)
    assert d["verdict"] == {"fit": True, "line": lines[0], "reasons": [], "warnings": 3, "notes": 28}
    assert len(d["warnings"]) == 31  # --json carries every finding, notes included


ESCAPES = "\x1b[2J\x1b]0;pwned\x07\nFORGED LINE\r\u202e"


def test_inspect_and_diff_print_table_strings_as_text_never_as_escape_codes(tmp_path, reference_table_8192):
    """Every string a table holds (fingerprint values, extra notes, the tool version) reaches the
    terminal escaped: no escape sequence, carriage return or bidi override, and no line it starts."""
    t = reference_table_8192
    fp = t.fingerprint.replace(gpu_name="H200" + ESCAPES, target_model="m" + ESCAPES, extra={"n" + ESCAPES: ESCAPES})
    evil = write_table(dataclasses.replace(t, fingerprint=fp, tool_version="0.1" + ESCAPES), tmp_path / "evil.parquet")
    good = write_table(t, tmp_path / "good.parquet")
    for args in (("inspect", evil), ("inspect", evil, "--all"), ("diff", good, evil), ("diff", evil, good)):
        r = invoke(*args)
        assert r.exit_code in (0, 1), r.output
        assert not any(ch in r.output for ch in "\x1b\x07\r\u202e"), (args, repr(r.output[:400]))
        assert "\\x1b[2J" in r.output and not any(line.startswith("FORGED") for line in r.output.splitlines())


def test_inspect_shows_a_fall_after_warm_up_and_reads_the_table(tmp_path):
    """The draft-model H200 table's fall at 1024 requests-192..224: read without refusal, shown by
    inspect (--all: notes too), each line saying what vLLM charges instead."""
    from tests.helpers import draft_model_table

    path = write_table(draft_model_table(5), tmp_path / "t.parquet")
    r = invoke("inspect", path, "--context-len", "1024", "--all")
    assert r.exit_code == 0, r.output
    assert "draft @ctx 1024: size 200 median 65.033 ms is 59.8% below size 8's 161.606 ms; vLLM charges 161.606" \
        in " ".join(r.stdout.split())

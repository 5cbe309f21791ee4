"""Output paths never lose input, name the user's path, and are checked before any work;
inputs given twice are refused. Each case failed on main 6558d4c (silent loss, exit 0)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_calib.errors import CalibError
from dspark_calib.cli.app import app
from tests.helpers import DRAFT, MODEL, REPO, fixture_json, one_line_error

runner = CliRunner()
IMPORT = ("--model", MODEL, "--draft", DRAFT, "--gpu-name", "NVIDIA H200", "--vllm-version", "0.33.0",
          "--num-speculative-tokens", "7")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def copies(tmp_path, table_files) -> dict[str, Path]:
    """Private copies of two tables (tests overwrite-attempt them)."""
    out = {}
    for name in ("c1024", "c8192"):
        out[name] = tmp_path / f"{name}.parquet"
        shutil.copyfile(table_files[name], out[name])
    return out


def _unchanged(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before, f"{path} was overwritten"


def test_inspect_plot_onto_its_table_is_refused(copies):
    t = copies["c1024"]
    before = t.read_bytes()
    one_line_error(invoke("inspect", t, "--plot", t), str(t), "--plot would overwrite the input")
    _unchanged(t, before)


def test_plot_onto_an_input_through_another_name_is_refused(copies, tmp_path):
    t = copies["c1024"]
    before = t.read_bytes()
    link = tmp_path / "link.png"
    os.symlink(t, link)
    one_line_error(invoke("inspect", t, "--plot", link), "would overwrite the input")
    hard = tmp_path / "hard.png"
    os.link(t, hard)
    one_line_error(invoke("diff", copies["c8192"], t, "--plot", hard), "would overwrite the input")
    _unchanged(t, before)


def test_diff_plot_onto_new_is_refused(copies):
    a, b = copies["c1024"], copies["c8192"]
    before = b.read_bytes()
    one_line_error(invoke("diff", a, b, "--plot", b), str(b), "would overwrite the input")
    _unchanged(b, before)


def test_merge_out_onto_an_input_is_refused(copies):
    a, b = copies["c1024"], copies["c8192"]
    before = a.read_bytes()
    one_line_error(invoke("merge", a, b, "--out", a), str(a), "--out would overwrite the input")
    _unchanged(a, before)


def test_import_out_onto_its_json_is_refused(tmp_path):
    src = tmp_path / "x.json"
    shutil.copyfile(fixture_json(1024), src)
    before = src.read_bytes()
    one_line_error(invoke("import-vllm", src, *IMPORT, "--out", src), str(src), "would overwrite the input")
    _unchanged(src, before)


@pytest.mark.parametrize("command", ["import-vllm", "merge"])
def test_out_onto_a_file_that_is_no_table_is_refused_and_left_alone(tmp_path, command):
    notes = tmp_path / "capture.json"
    notes.write_text('{"mine": true}')
    if command == "import-vllm":
        args = ("import-vllm", fixture_json(1024), *IMPORT)
    else:
        a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
        for ctx, path in ((1024, a), (8192, b)):
            assert invoke("import-vllm", fixture_json(ctx), *IMPORT, "--out", path).exit_code == 0
        args = ("merge", a, b)
    one_line_error(invoke(*args, "--out", notes), str(notes), "must be a directory or a .parquet file")
    assert notes.read_text() == '{"mine": true}'


def test_directory_out_whose_default_name_is_an_input_is_refused(tmp_path, monkeypatch):
    """The default name carries the content hash, which (format 1.1) covers created_at and the
    fingerprint's extra.source, i.e. the input's own name: no real input can be predicted to
    carry it. So the name is pinned to the input's, and the CLI must refuse before writing."""
    from dspark_calib.cli.paths import table_out
    from dspark_calib.table.model import CostTable

    trap = tmp_path / "trap.parquet"  # a JSON input that happens to carry the table's default file name
    shutil.copyfile(fixture_json(1024), trap)
    before = trap.read_bytes()
    with pytest.raises(CalibError, match="would overwrite the input"):
        table_out(str(tmp_path), [str(trap)]).destination(trap.name, "0" * 64)
    monkeypatch.setattr(CostTable, "default_filename", lambda self: trap.name)
    one_line_error(invoke("import-vllm", trap, *IMPORT, "--out", tmp_path), "would overwrite the input")
    _unchanged(trap, before)


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_plot_format_follows_the_suffix(table_files, tmp_path, suffix, magic):
    out = tmp_path / f"p{suffix}"
    r = invoke("inspect", table_files["c1024"], "--plot", out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:len(magic)] == magic
    assert sorted(os.listdir(tmp_path)) == [out.name]  # no temp file left


def test_plot_mode_is_an_ordinary_files(table_files, tmp_path):
    out = tmp_path / "p.png"
    assert invoke("inspect", table_files["c1024"], "--plot", out).exit_code == 0
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o666 & ~umask


@pytest.mark.parametrize("bad, fragment", [
    ("x.gif", "unknown plot format (.gif)"),
    ("x", "unknown plot format (no suffix)"),
    ("", "--plot: empty path"),
])
def test_bad_plot_paths(table_files, tmp_path, bad, fragment):
    path = str(tmp_path / bad) if bad else bad
    one_line_error(invoke("inspect", table_files["c1024"], "--plot", path), fragment)
    assert os.listdir(tmp_path) == []


def test_plot_parent_is_not_created(table_files, tmp_path):
    out = tmp_path / "no" / "such" / "dir" / "p.png"
    one_line_error(invoke("inspect", table_files["c1024"], "--plot", out), str(out), "does not exist (not created")
    assert not (tmp_path / "no").exists()


def test_output_problems_are_found_before_reading_inputs(tmp_path):
    missing = tmp_path / "missing.parquet"
    # The table does not exist either: the plot path is what is reported, so it was checked first.
    one_line_error(invoke("inspect", missing, "--plot", tmp_path / "x.gif"), "x.gif")
    one_line_error(invoke("merge", missing, missing.with_name("m2.parquet"), "--out", tmp_path / "no" / "m.parquet"),
                   "does not exist (not created")


def test_write_failure_names_the_users_path_not_a_temp_file(table_files):
    r = invoke("inspect", table_files["c1024"], "--plot", "/proc/x.png")
    line = one_line_error(r, "/proc/x.png")
    assert ".dspark-calib" not in line and ".tmp" not in line


def test_out_directory_is_made_but_not_its_parents(tmp_path):
    r = invoke("import-vllm", fixture_json(1024), *IMPORT, "--out", f"{tmp_path / 'a' / 'b'}/")
    one_line_error(r, "does not exist (not created")
    assert not (tmp_path / "a").exists()
    r = invoke("import-vllm", fixture_json(1024), *IMPORT, "--out", f"{tmp_path / 'a'}/")
    assert r.exit_code == 0, r.output
    assert Path(r.stdout.splitlines()[0]).parent == tmp_path / "a"


# -- inputs given twice ------------------------------------------------------------------------
def test_merge_refuses_the_same_table_twice(copies, tmp_path):
    a = copies["c1024"]
    one_line_error(invoke("merge", a, a, "--out", tmp_path / "m.parquet"), "is the same file as")
    copy = tmp_path / "copy.parquet"
    shutil.copyfile(a, copy)
    one_line_error(invoke("merge", a, copy, "--out", tmp_path / "m.parquet"), str(copy), "same content as")
    assert not (tmp_path / "m.parquet").exists()


def test_import_refuses_the_same_profile_twice(tmp_path):
    src = fixture_json(1024)
    one_line_error(invoke("import-vllm", src, src, *IMPORT, "--out", tmp_path), "is the same file as")
    copy = tmp_path / "copy.json"
    shutil.copyfile(src, copy)
    one_line_error(invoke("import-vllm", src, copy, *IMPORT, "--out", tmp_path), str(copy), "same content as")
    assert not list(tmp_path.glob("*.parquet"))


def test_empty_import_names_the_file(tmp_path):
    data = json.loads(Path(fixture_json(1024)).read_text())
    data["rows"], data["batches"] = [], []
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(data))
    one_line_error(invoke("import-vllm", empty, *IMPORT, "--out", tmp_path), str(empty), "has no samples")


def test_import_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    one_line_error(invoke("import-vllm", fifo, *IMPORT, "--out", tmp_path), str(fifo), "not a regular file")


@pytest.mark.parametrize("option, value, fragment", [
    ("--gpu-name", "H200", "torch.cuda.get_device_name"),
    ("--vllm-version", "banana", "vllm.__version__"),
])
def test_import_warns_on_unlikely_identity(tmp_path, option, value, fragment):
    args = list(IMPORT)
    args[args.index(option) + 1] = value
    r = invoke("import-vllm", fixture_json(1024), *args, "--out", tmp_path)
    assert r.exit_code == 0, r.output
    warnings = [line for line in r.stderr.splitlines() if line.startswith("dspark-calib: warning:")]
    assert len(warnings) == 1 and fragment in warnings[0] and value in warnings[0]


def test_import_refuses_an_unusable_identity(tmp_path):
    args = list(IMPORT)
    args[args.index("--gpu-name") + 1] = " "
    one_line_error(invoke("import-vllm", fixture_json(1024), *args, "--out", tmp_path), "--gpu-name")


def test_empty_out_and_directory_plot_are_refused(table_files, tmp_path):
    one_line_error(invoke("merge", table_files["c1024"], table_files["c8192"], "--out", ""), "--out: empty path")
    d = tmp_path / "d.png"
    d.mkdir()
    one_line_error(invoke("inspect", table_files["c1024"], "--plot", d), str(d), "is a directory")


# -- review finding 6: deeply nested JSON is one line and exit 2, never a traceback ----------
DEEP = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize("where", ["import-vllm", "check-model", "engine-args-json"])
def test_deeply_nested_json_is_one_line(tmp_path, where):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(DEEP)
    args = {
        "import-vllm": ("import-vllm", deep, *IMPORT, "--out", tmp_path / "o.parquet"),
        "check-model": ("check", tmp_path, "--model", model),
        "engine-args-json": ("profile", "--model", MODEL, "--draft", DRAFT, "--engine-args-json", deep,
                             "--out", tmp_path / "p.parquet"),
    }[where]
    r = invoke(*args)
    assert r.exit_code == 2, (r.exit_code, r.exception, r.output[-500:])
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output
    errors = [line for line in r.output.splitlines() if "error:" in line]
    assert errors == ["dspark-calib: error: input too deeply nested or too large (RecursionError)"]


# -- usage errors: one line too, not typer's box -------------------------------------------
@pytest.mark.parametrize("args, fragments", [
    (("inspect", "--context-len", "0", "t.parquet"), ("inspect: ", "'--context-len'", "0 is not in the range")),
    (("inspect",), ("inspect: ", "Missing argument 'TABLE'")),
    (("diff", "--bogus", "a", "b"), ("diff: ", "No such option: --bogus")),
    (("no-such-command",), ("No such command 'no-such-command'",)),
    (("check", ".", "--tp", "x"), ("check: ", "'--tp'", "'x' is not a valid")),
    (("check", ".", "--tp", "99999999999999999999"), ("check: ", "'--tp'", "1<=x<=4096")),
    (("import-vllm", "x.json", "--model", "m", "--draft", "d", "--gpu-name", "g", "--vllm-version", "0.33.0",
      "--num-speculative-tokens", "7", "--tensor-parallel-size", "99999999999999999999"),
     ("import-vllm: ", "'--tensor-parallel-size'")),
    (("import-vllm", "x.json", "--model", "m", "--draft", "d", "--gpu-name", "g", "--vllm-version", "0.33.0",
      "--num-speculative-tokens", "7", "--kv-cache-dtype", " "), ("import-vllm: ", "'--kv-cache-dtype'", "empty")),
])
def test_usage_errors_are_one_line(args, fragments):
    line = one_line_error(invoke(*args), *fragments)
    assert "╭" not in line and "(see 'dspark-calib" in line


def test_usage_error_from_the_console_script():
    import subprocess
    import sys

    code = "import sys; sys.argv = ['dspark-calib', 'inspect', '--bogus']; from dspark_calib.cli.app import main; main()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=REPO)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["dspark-calib: error: inspect: No such option: --bogus (see 'dspark-calib inspect -h')"]


def test_help_and_no_arguments_still_print_help():
    r = invoke("inspect", "--help")
    assert r.exit_code == 0 and "Usage: dspark-calib inspect" in r.stdout and r.stderr == ""
    r = invoke()
    assert r.exit_code == 2 and "Usage: dspark-calib" in r.stdout and "error" not in r.stderr


# -- the bad-input audit of 2026-12-01 (each case failed before its fix) ----------------------
def _sh(command: str, **env: str):
    import subprocess
    import sys

    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "PY": sys.executable, **env})


SHIPPED_TABLE = "profiles/h200/qwen3-8b__dspark-qwen3-8b-block7__tp1__nvidia-h200__15b5101f9d84.parquet"


def test_a_fifo_or_device_given_as_json_is_refused_not_waited_on(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    os.mkfifo(model / "config.json")
    os.mkfifo(tmp_path / "args.json")
    one_line_error(invoke("check", SHIPPED_TABLE, "--model", model), "config.json", "is a FIFO")
    one_line_error(invoke("check", SHIPPED_TABLE, "--model", "/dev/zero"), "/dev/zero", "is a device")
    one_line_error(invoke("profile", "--model", "/x", "--draft", "/x", "--engine-args-json", tmp_path / "args.json"),
                   "--engine-args-json", "is a FIFO")
    one_line_error(invoke("profile", "--model", "/x", "--draft", "/x", "--engine-args-json", SHIPPED_TABLE),
                   "--engine-args-json", "not UTF-8")


def test_closed_stdout_is_one_line_before_any_work(tmp_path):
    r = _sh(f'"$PY" -m dspark_calib merge {SHIPPED_TABLE} x.parquet --out {tmp_path}/m.parquet >&-')
    assert r.returncode == 2 and r.stderr == "dspark-calib: error: standard output is closed; nothing could be printed\n"
    assert not (tmp_path / "m.parquet").exists()


def test_a_reader_that_stops_early_is_not_an_error():
    r = _sh(f'set -o pipefail; "$PY" -m dspark_calib inspect {SHIPPED_TABLE} --all | head -1')
    assert r.returncode == 0 and r.stdout.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("columns", ["0", "5", "abc", ""])
def test_a_bad_or_tiny_columns_still_prints_whole_numbers(columns):
    r = _sh(f'"$PY" -m dspark_calib inspect {SHIPPED_TABLE}', COLUMNS=columns)
    assert r.returncode == 0 and "content hash" in r.stdout
    # "… and N more like it" is inspect's own grouping of warnings, not a cut cell
    assert all(line.lstrip().startswith("… and ") for line in r.stdout.splitlines() if "…" in line)


@pytest.mark.parametrize("args", [("diff", SHIPPED_TABLE, SHIPPED_TABLE, "--threshold", "nan"),
                                  ("diff", SHIPPED_TABLE, SHIPPED_TABLE, "--threshold", "inf"),
                                  ("validate", SHIPPED_TABLE, "x", "--max-error", "nan")])
def test_a_threshold_that_can_never_be_exceeded_is_refused(args, tmp_path):
    line = one_line_error(invoke(*args, "--plot", tmp_path / "p.png"), "is not a finite number")
    assert args[3] in line and not (tmp_path / "p.png").exists()


def test_validate_refuses_the_same_observe_file_twice():
    obs = "benchmarks/results/h200/2026-12-01-0438-context/context-stock-observed.parquet"
    one_line_error(invoke("validate", SHIPPED_TABLE, obs, "./" + obs), "is the same file as", "observe file once")


def test_profile_checks_keep_capture_and_creates_no_out_dir_for_a_bad_model(tmp_path):
    out = tmp_path / "new"
    one_line_error(invoke("profile", "--model", "/nonexistent", "--draft", "/nonexistent", "--out", out), "--model")
    assert not out.exists()
    model = REPO / "profiles" / "configs"
    model = next(p for p in model.iterdir() if (p / "config.json").exists())
    (tmp_path / "afile").write_text("x")
    for keep, fragment in ((tmp_path / "afile", "exists and is not a directory"),
                           (tmp_path / "no" / "dir", "parents are not created")):
        one_line_error(invoke("profile", "--model", model, "--draft", model, "--keep-capture", keep, "--out", out),
                       "--keep-capture", fragment)
        assert not out.exists()


def test_bad_input_to_import_vllm_is_one_line_even_with_an_odd_gpu_name(tmp_path):
    one_line_error(invoke("import-vllm", SHIPPED_TABLE, "--model", MODEL, "--draft", DRAFT, "--gpu-name", "NVIDIA_H200",
                          "--vllm-version", "0.33.0", "--num-speculative-tokens", "7", "--out", tmp_path / "o.parquet"))
    assert not (tmp_path / "o.parquet").exists()


def test_an_empty_path_is_named():
    one_line_error(invoke("inspect", ""), "error: '': ")


def test_check_on_a_uri_that_cannot_be_listed_is_an_error_not_no_table():
    one_line_error(invoke("check", "bogusscheme://x"), "bogusscheme://x: cannot list tables here", "Unrecognized")


def test_output_paths_are_escaped_like_input_paths(tmp_path):
    bad = os.fsdecode(bytes(tmp_path) + b"/miss\xffing/x.png")
    line = one_line_error(invoke("inspect", SHIPPED_TABLE, "--plot", bad), "miss\\xffing/x.png", "does not exist")
    assert "\udcff" not in line and line.count("miss\\xffing") == 2  # the path and its directory


# -- an existing file is replaced only with --force; a new directory ends with '/' --------------
def _import(out, *extra):
    return invoke("import-vllm", fixture_json(1024), *IMPORT, "--out", out, *extra)


def test_import_and_merge_do_not_replace_an_existing_table_without_force(copies, tmp_path):
    target = tmp_path / "shipped.parquet"
    shutil.copyfile(copies["c8192"], target)
    before = target.read_bytes()
    one_line_error(_import(target), str(target), "--out: exists and holds a table of other content",
                   "pass --force")
    one_line_error(invoke("merge", copies["c1024"], copies["c8192"], "--out", target), str(target), "pass --force")
    _unchanged(target, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c1024.parquet", "c8192.parquet", "shipped.parquet"]
    r = _import(target, "--force")
    assert r.exit_code == 0, r.output
    assert target.read_bytes() != before and "replaced" not in r.stdout


def test_a_file_that_is_no_table_is_not_replaced_without_force(tmp_path):
    junk = tmp_path / "notes.parquet"
    junk.write_text("mine")
    one_line_error(_import(junk), str(junk), "a file that is no readable table", "pass --force")
    assert junk.read_text() == "mine"


def test_a_table_of_the_same_content_hash_is_replaced_and_says_so(tmp_path, monkeypatch, table_1024):
    from dspark_calib import reference

    monkeypatch.setattr(reference, "table_from_startup_json", lambda *a, **k: table_1024)  # one table, twice
    first = _import(tmp_path / "t.parquet")
    assert first.exit_code == 0, first.output
    again = _import(tmp_path / "t.parquet")
    assert again.exit_code == 0, again.output
    lines = again.stdout.splitlines()
    assert lines[0] == str(tmp_path / "t.parquet")
    assert lines[1].startswith(f"replaced {tmp_path / 't.parquet'}: it held a table of the same content hash")


def test_plot_does_not_replace_an_existing_file_without_force(table_files, tmp_path):
    plot = tmp_path / "p.png"
    plot.write_bytes(b"mine")
    for args in (("inspect", table_files["c1024"]), ("diff", table_files["c1024"], table_files["c8192"])):
        one_line_error(invoke(*args, "--plot", plot), str(plot), "--plot: exists; pass --force")
        assert plot.read_bytes() == b"mine"
    r = invoke("inspect", table_files["c1024"], "--plot", plot, "--force")
    assert r.exit_code == 0, r.output
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", ["ab.parqet", "ab", "out.json"])
def test_a_new_out_without_slash_or_parquet_is_refused_not_made_a_directory(copies, tmp_path, name):
    out = tmp_path / name
    line = one_line_error(invoke("merge", copies["c1024"], copies["c8192"], "--out", out), str(out))
    assert "end the name with '/' for a new directory" in line and ".parquet" in line
    assert not out.exists()
    one_line_error(_import(out), str(out), "end the name with '/'")
    assert not out.exists()


def test_a_new_out_directory_ends_with_a_slash(tmp_path):
    r = _import(f"{tmp_path / 'new'}/")
    assert r.exit_code == 0, r.output
    assert Path(r.stdout.splitlines()[0]).parent == tmp_path / "new"


# -- merge never counts one measurement twice ----------------------------------------------------
def test_merge_refuses_a_table_merged_into_another_input(copies, tmp_path):
    a, b = copies["c1024"], copies["c8192"]
    ab = tmp_path / "ab.parquet"
    assert invoke("merge", a, b, "--out", ab).exit_code == 0
    line = one_line_error(invoke("merge", ab, a, "--out", tmp_path / "m.parquet"), str(a), str(ab))
    assert "was merged into" in line and "twice" in line
    assert not (tmp_path / "m.parquet").exists()


def test_merge_refuses_inputs_sharing_their_measurements(copies, tmp_path):
    """A merge of a merge: abc holds a's samples, but its merged_from names only ab and c."""
    a, b = copies["c1024"], copies["c8192"]
    c = tmp_path / "c16384.parquet"
    assert invoke("import-vllm", fixture_json(16384), *IMPORT, "--out", c).exit_code == 0
    ab, abc = tmp_path / "ab.parquet", tmp_path / "abc.parquet"
    assert invoke("merge", a, b, "--out", ab).exit_code == 0
    assert invoke("merge", ab, c, "--out", abc).exit_code == 0
    line = one_line_error(invoke("merge", abc, a, "--out", tmp_path / "m.parquet"), str(a), str(abc))
    assert "share 280 of 280 measured samples" in line
    assert not (tmp_path / "m.parquet").exists()

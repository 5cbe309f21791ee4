"""The console script's exit: the code and output a command settles, without the interpreter's
teardown (where pyarrow's thread pools can abort a finished command), unless vLLM is loaded."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO, SHIPPED

SCRIPT = textwrap.dedent("""
    import atexit, sys
    atexit.register(lambda: print("TEARDOWN", flush=True))
    if sys.argv[1] == "vllm":
        sys.modules["vllm"] = type(sys)("vllm")  # a stand-in: only its presence matters
    if sys.argv[1] == "unflushed":  # a command whose output is still buffered when it returns
        import dspark_calib.cli.app as cli
        cli.app = lambda prog_name: sys.stdout.write("a summary\\n")
    sys.argv = ["dspark-calib", *sys.argv[2:]]
    from dspark_calib.cli.app import main
    main()
""")


def run(*args, stdout=subprocess.PIPE):
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_a_light_command_keeps_its_output_and_code_and_skips_teardown():
    ok = run("light", "--version")
    assert ok.returncode == 0 and ok.stdout.strip() and "TEARDOWN" not in ok.stdout
    bad = run("light", "inspect", "/nonexistent.parquet")
    assert bad.returncode == 2 and bad.stderr.startswith("dspark-calib: ") and "TEARDOWN" not in bad.stdout
    assert bad.stderr.count("\n") == 1


def test_with_vllm_loaded_the_normal_exit_runs_its_shutdown_hooks():
    r = run("vllm", "--version")
    assert r.returncode == 0 and "TEARDOWN" in r.stdout


FULL = "dspark-calib: error: standard output could not be written: No space left on device\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("args", [("light", "--version"), ("light", "--help"), ("light", "inspect", "-h"),
                                  ("unflushed",), ("light", "inspect", "--json", "SHIPPED"),
                                  ("light", "inspect", "SHIPPED")])
def test_output_that_cannot_be_written_is_one_line_and_exit_2(args):
    """`> /dev/full`: what --version and --help print (before any command's own error handling) and
    what is still buffered at exit (flushed by main) fail with ENOSPC: one line, never a traceback
    or a silent exit 2."""
    args = [str(SHIPPED) if a == "SHIPPED" else a for a in args]  # a command's own output, too
    with open("/dev/full", "w") as full:
        r = run(*args, stdout=full)
    assert (r.returncode, r.stderr) == (2, FULL)

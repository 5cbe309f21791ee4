"""The console script's exit: the code and output a command settles, without the interpreter's
teardown (where pyarrow's thread pools can abort a finished command), unless vLLM is loaded."""

import subprocess
import sys
import textwrap

from tests.helpers import REPO

SCRIPT = textwrap.dedent("""
    import atexit, sys
    atexit.register(lambda: print("TEARDOWN", flush=True))
    if sys.argv[1] == "vllm":
        sys.modules["vllm"] = type(sys)("vllm")  # a stand-in: only its presence matters
    sys.argv = ["dspark-calib", *sys.argv[2:]]
    from dspark_calib.cli.app import main
    main()
""")


def run(*args):
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_a_light_command_keeps_its_output_and_code_and_skips_teardown():
    ok = run("light", "--version")
    assert ok.returncode == 0 and ok.stdout.strip() and "TEARDOWN" not in ok.stdout
    bad = run("light", "inspect", "/nonexistent.parquet")
    assert bad.returncode == 2 and bad.stderr.startswith("dspark-calib: ") and "TEARDOWN" not in bad.stdout
    assert bad.stderr.count("\n") == 1


def test_with_vllm_loaded_the_normal_exit_runs_its_shutdown_hooks():
    r = run("vllm", "--version")
    assert r.returncode == 0 and "TEARDOWN" in r.stdout

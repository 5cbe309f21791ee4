"""One engine per case, in its own process group: a case that hangs or exits with os._exit
(leaving its engine core on the GPU) never holds the GPU for the next, and never takes
anyone else's processes with it (only this group is killed)."""
import os
import signal
import subprocess
import time


def run_case(cmd, env, timeout_s):
    """(returncode or None when it ran out of time, stdout, stderr); the group is gone after."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        rc = None
    kill_group(proc.pid)  # the engine core an os._exit left behind
    return rc, out, err


def kill_group(pgid, grace_s=3.0):
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(2)  # the driver frees the memory shortly after the last process exits


HERE = os.path.dirname(os.path.abspath(__file__))


def serve_one_case(case, extra_env, timeout_s):
    """One serve_one.py start (a fresh process group) with the caller's DSPARK_CALIB_* only:
    (its RESULT dict, stdout + stderr). No RESULT line: started False, no_result, the output's tail;
    out of time: timed_out_s. wall_s is the whole case."""
    import json
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_CALIB_")}
    env.update(extra_env)
    t = time.time()
    rc, out, err = run_case([sys.executable, os.path.join(HERE, "serve_one.py"), case], env, timeout_s)
    text = out + err
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    res = json.loads(line[7:]) if line else {"case": case, "started": False, "no_result": True,
                                                  "error": text[-3000:]}
    if rc is None:
        res["timed_out_s"] = timeout_s
    res["wall_s"] = time.time() - t
    return res, text

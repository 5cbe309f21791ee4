"""Load and inspect speed of a large cost table.

Tables load on every vLLM start (plugin) and `inspect` is interactive, so both must
stay fast even for the largest curve a table can hold: a verify point for every
token count 1..8192 (what an exhaustive profile of max_num_batched_tokens=8192
gives). Goals: read_table < 50 ms (median of 20), `dspark-calib inspect` < 0.5 s
(median of 5, a fresh process each time, as users run it).

    .venv/bin/python benchmarks/micro/bench_table.py [--name NAME]

Writes benchmarks/results/micro/table_bench_<NAME>.json (NAME: host name and CPU count by default).
Timings on a shared machine are only as good as its load: the load average before
and after is recorded with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from dspark_calib import __version__  # noqa: E402
from dspark_calib.fingerprint import BACKEND_REFERENCE, Fingerprint  # noqa: E402
from dspark_calib.samples import Sample  # noqa: E402
from dspark_calib.table.model import CostTable  # noqa: E402
from dspark_calib.table.meta import SERVE_LIMITS  # noqa: E402
from dspark_calib.table.file import read_table, write_table

MAX_TOKENS = 8192
MAX_SEQS = 256
REPLAYS = 5
CAPTURE = tuple([1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16)))  # vLLM's 51 defaults
LIMIT = CAPTURE[-1]
CONTEXT = 8192
LOAD_GOAL_S = 0.050
INSPECT_GOAL_S = 0.5


def synthetic_table(seed: int = 0) -> CostTable:
    """Costs shaped like the H200 recordings: ~5 ms floor, linear growth, a jump past the
    capture limit; 1-3% multiplicative noise so medians and spreads are not degenerate."""
    rng = np.random.default_rng(seed)
    samples = []
    for size in range(1, MAX_TOKENS + 1):
        reqs = min(size, MAX_SEQS)
        graph = size <= LIMIT
        fwd = 4.8 + 0.03 * size + (0 if graph else 6.0)
        drf = 1.4 + 0.035 * reqs
        noise = rng.normal(1.0, 0.015, size=(REPLAYS, 2))
        for r in range(REPLAYS):
            samples.append(Sample(forward_ms=fwd * noise[r, 0], drafter_ms=drf * noise[r, 1], num_target_tokens=size,
                                  num_reqs=reqs, full_cudagraph=graph, context_len=CONTEXT, replay=r))
    fp = Fingerprint(
        backend=BACKEND_REFERENCE, gpu_name="synthetic", gpu_count=1, gpu_compute_capability="", driver_version="",
        cuda_version="", torch_version="", vllm_version="0.33.0", target_model="synthetic-target",
        target_config_hash="sha256:0", draft_model="synthetic-draft", draft_config_hash="sha256:0",
        tensor_parallel_size=1, pipeline_parallel_size=1, dtype="bfloat16", kv_cache_dtype="auto", quantization=None,
        num_speculative_tokens=7, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS,
        cudagraph_capture_sizes=CAPTURE, cudagraph_limit=LIMIT, context_lens=(CONTEXT,), replays=REPLAYS,
        warmup_replays=0, extra={"synthetic": "benchmarks/micro/bench_table.py"},
    )
    return CostTable.from_samples(samples, fp)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import pandas
    import pyarrow

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "pyarrow": pyarrow.__version__,
        "pandas": pandas.__version__,
        "numpy": np.__version__,
        "dspark_calib": __version__,
    }


def time_subprocess(cmd: list[str], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    host = re.sub(r"[^A-Za-z0-9.-]+", "-", socket.gethostname()).strip("-") or "host"
    ap.add_argument("--name", default=f"{host}-{os.cpu_count()}cpu")
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--inspects", type=int, default=5)
    args = ap.parse_args()

    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="dspark-bench-"))
    try:
        t0 = time.perf_counter()
        table = synthetic_table()
        build_s = time.perf_counter() - t0
        path = write_table(table, tmp / "bench.parquet")
        size_bytes = os.path.getsize(path)

        read_table(path)  # warm the page cache and any first-call imports
        loads = []
        for _ in range(args.loads):
            t0 = time.perf_counter()
            loaded = read_table(path)
            loads.append(time.perf_counter() - t0)
        assert loaded.content_hash == table.content_hash
        serve_loads = []  # what the plugin reads at engine start: curves + metadata, never the raw samples
        for _ in range(args.loads):
            t0 = time.perf_counter()
            served = read_table(path, samples=False, limits=SERVE_LIMITS)
            serve_loads.append(time.perf_counter() - t0)
        assert served.content_hash == table.content_hash and served.samples is None

        # inspect's own work, without interpreter start-up and imports: what this code controls.
        from rich.console import Console

        from dspark_calib.inspection import inspect_table
        from dspark_calib.render import render_inspect

        work = []
        with open(os.devnull, "w") as devnull:
            for _ in range(args.inspects + 1):
                t0 = time.perf_counter()
                render_inspect(inspect_table(read_table(path), path=path), Console(file=devnull, width=100))
                work.append(time.perf_counter() - t0)
        work = work[1:]  # the first pays rich's lazy imports

        script = shutil.which("dspark-calib", path=str(Path(sys.executable).parent))
        cli = [script] if script else [sys.executable, "-m", "dspark_calib"]
        time_subprocess([*cli, "inspect", path], 1)  # warm-up: .pyc files, page cache
        inspects = time_subprocess([*cli, "inspect", path], args.inspects)
        inspects_json = time_subprocess([*cli, "inspect", "--json", path], args.inspects)
        # Where inspect's time goes: interpreter start, then the imports a load needs.
        python_start = time_subprocess([sys.executable, "-c", "pass"], args.inspects)
        import_table = time_subprocess([sys.executable, "-c", "import dspark_calib.table.file"], args.inspects)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = statistics.median
    result = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "table": {"verify_points": len(table.pair().verify), "draft_points": len(table.pair().draft),
                  "samples": len(table.samples), "file_bytes": size_bytes, "build_s": round(build_s, 3)},
        "read_table_s": {"median": med(loads), "min": min(loads), "max": max(loads), "n": len(loads),
                         "goal": LOAD_GOAL_S, "met": med(loads) < LOAD_GOAL_S},
        "read_table_serve_s": {"median": med(serve_loads), "min": min(serve_loads), "max": max(serve_loads),
                               "n": len(serve_loads), "what": "read_table(samples=False, limits=SERVE_LIMITS)"},
        "inspect_cli_s": {"median": med(inspects), "min": min(inspects), "max": max(inspects), "n": len(inspects),
                          "goal": INSPECT_GOAL_S, "met": med(inspects) < INSPECT_GOAL_S, "command": " ".join(
                              [os.path.basename(cli[0]), *cli[1:], "inspect", "TABLE"])},
        "inspect_in_process_s": {"median": med(work), "min": min(work), "n": len(work),
                                 "what": "read_table + inspect_table + render_inspect, imports excluded"},
        "inspect_json_cli_s": {"median": med(inspects_json), "min": min(inspects_json), "n": len(inspects_json)},
        "python_startup_s": {"median": med(python_start), "min": min(python_start), "n": len(python_start)},
        "import_dspark_calib_table_s": {"median": med(import_table), "min": min(import_table), "n": len(import_table)},
        "load_average_1_5_15": {"before": [round(x, 2) for x in load_before],
                                "after": [round(x, 2) for x in os.getloadavg()]},
    }
    out = REPO / "benchmarks" / "results" / "micro" / f"table_bench_{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    m = result["machine"]
    print(f"{m['cpu_model']} x{m['cpu_count']}, python {m['python']}, pyarrow {m['pyarrow']}, "
          f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"table: {result['table']['verify_points']} verify points, {result['table']['samples']} samples, "
          f"{size_bytes / 1024:.0f} KiB")
    rows = [
        ("read_table", loads, LOAD_GOAL_S),
        ("read_table(samples=False) (serving)", serve_loads, None),
        ("dspark-calib inspect", inspects, INSPECT_GOAL_S),
        ("  of which read+analyse+render", work, None),
        ("dspark-calib inspect --json", inspects_json, None),
        ("  python -c pass", python_start, None),
        ("  python -c 'import dspark_calib.table.file'", import_table, None),
    ]
    print(f"{'':<40} {'median':>9} {'min':>9}   (n)")
    for name, values, goal in rows:
        value = med(values)
        verdict = "" if goal is None else ("  ok" if value < goal else f"  MISSES goal {goal * 1000:.0f} ms")
        print(f"{name:<40} {value * 1000:6.1f} ms {min(values) * 1000:6.1f} ms  ({len(values)}){verdict}")
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

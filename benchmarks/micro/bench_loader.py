"""Load-decision time and peak memory on hostile table sources .

Each case runs in a fresh subprocess (so ru_maxrss is that case's own): it builds
nothing there, only times `decide_within(deadline, policy, source, decide)` as the
plugin runs it, with tracemalloc on (Python-level peak) and ru_maxrss before/after
(process-level peak, pyarrow's C++ allocations included).

    PYTHONPATH=. python benchmarks/micro/bench_loader.py [--out benchmarks/results/micro/loader_bench_<host>.json]

The cases are generated in a temporary directory: a directory of 10,000 tables,
10,000 junk files, 100,010 one-byte junk files, 400 tables with a 0.9 MiB footer beside an
older good one, a FIFO, a huge sparse file, a row bomb (millions of constant
rows that compress to a small file), a metadata bomb, 24 hard links to it, deeply
nested JSON metadata, and a silent object-store endpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 5.0

CHILD = r"""
import json, resource, sys, time, tracemalloc
from dspark_calib import selection as L
from dataclasses import replace
from dspark_calib.table.sources import SERVE_LIMITS
source, engine, policy, deadline = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4])
import pyarrow, pyarrow.parquet, numpy  # imported by any real decision: not part of the case's cost
import dspark_calib.table.file  # noqa: F401 - the reader's own imports, as a decision has them
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
t = time.perf_counter()
progress = L.Progress()  # as the engine passes it: where a decision stopped at its deadline
d = L.decide_within(deadline, policy, source, lambda: L.decide(source, engine, policy=policy, allow_reference=True,
                     limits=replace(SERVE_LIMITS, io_timeout_s=min(SERVE_LIMITS.io_timeout_s, 0.8 * deadline)),
                     progress=progress), progress=progress)
wall = time.perf_counter() - t
peak = tracemalloc.get_traced_memory()[1]
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"wall_s": round(wall, 4), "tracemalloc_peak_mb": round(peak / 2**20, 2),
                  "maxrss_mb": round(rss / 1024, 1), "maxrss_after_imports_mb": round(base / 1024, 1),
                  "load": d.load, "refuse": bool(d.refuse), "line_chars": len(d.lines[0]),
                  "line": d.lines[0][:400]}))
sys.stdout.flush()
import os; os._exit(0)  # a daemon thread may still wait on a silent endpoint: do not wait for it
"""


def make_cases(root: str) -> tuple[dict[str, str], dict]:
    sys.path.insert(0, REPO)
    from dataclasses import replace

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.helpers import build_reference_table
    from dspark_calib.table.file import write_table

    table = build_reference_table()
    fp = table.fingerprint
    engine = {"cudagraph_capture_sizes": list(fp.cudagraph_capture_sizes), "max_num_seqs": fp.max_num_seqs,
              "max_num_batched_tokens": fp.max_num_batched_tokens, "num_speculative_tokens": fp.num_speculative_tokens}
    cases: dict[str, str] = {}

    def fresh(name: str) -> str:
        d = os.path.join(root, name)
        os.makedirs(d)
        cases[name] = d
        return d

    one = write_table(table, os.path.join(root, "one.parquet"))
    cases["one_table"] = one
    d = fresh("tables_10000")
    for i in range(10_000):
        dst = os.path.join(d, f"t{i:05}.parquet")
        shutil.copyfile(one, dst)
        os.utime(dst, (1e9 + i, 1e9 + i))
    d = fresh("junk_10000")
    for i in range(10_000):
        with open(os.path.join(d, f"junk-{i:05}.parquet"), "wb") as fh:
            fh.write(b"junk")
    d = fresh("junk_100010")  # past the directory-entry and table-file counts
    for i in range(100_010):
        with open(os.path.join(d, f"j{i:06}.parquet"), "wb") as fh:
            fh.write(b"j")
    d = fresh("fat_footers_400")  # 400 copies of a table whose footer holds 100,000 {} (~0.9 MiB, under the limit)
    fat = write_table(replace(table, fingerprint=fp.replace(extra={"pad": [{}] * 100_000})),
                      os.path.join(root, "fat.parquet"))
    for i in range(400):
        shutil.copyfile(fat, os.path.join(d, f"fat{i:03}.parquet"))
    shutil.copyfile(one, os.path.join(d, "good.parquet"))
    os.utime(os.path.join(d, "good.parquet"), (1e9, 1e9))  # the oldest: found past every fat one
    d = fresh("fifo")
    os.mkfifo(os.path.join(d, "x.parquet"))
    d = fresh("huge_sparse_1gb")
    with open(os.path.join(d, "huge.parquet"), "wb") as fh:
        fh.truncate(1 << 30)
    raw_meta = pq.read_schema(one).metadata
    d = fresh("row_bomb_5m_rows")
    n = 5_000_000
    bomb = pa.table({"record": pa.array(["sample"] * n), "x": pa.array([1.0] * n)}).replace_schema_metadata(raw_meta)
    pq.write_table(bomb, os.path.join(d, "rows.parquet"), compression="zstd")
    d = fresh("metadata_bomb_3mb")
    meta_bomb = pa.table({"a": [1]}).replace_schema_metadata({**raw_meta, b"pad": b"x" * (3 << 20)})
    pq.write_table(meta_bomb, os.path.join(d, "meta.parquet"), compression="zstd")
    d = fresh("hard_links_24_to_metadata_bomb")
    for i in range(24):
        os.link(os.path.join(root, "metadata_bomb_3mb", "meta.parquet"), os.path.join(d, f"l{i:02}.parquet"))
    d = fresh("nested_json")
    nested = pa.table({"a": [1]}).replace_schema_metadata({b"dspark_calib": b"[" * 200_000 + b"]" * 200_000})
    pq.write_table(nested, os.path.join(d, "nested.parquet"))
    return cases, engine


def silent_endpoint() -> int:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
    return server.getsockname()[1]


def run_case(source: str, engine: dict, policy: str) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "AWS_EC2_METADATA_DISABLED": "true"}
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", CHILD, source, json.dumps(engine), policy, str(DEADLINE_S)],
                         capture_output=True, text=True, env=env, timeout=120)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1:]}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = round(time.perf_counter() - t, 2)
    return out


def host() -> dict:
    import pyarrow

    return {"machine": platform.machine(), "system": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "pyarrow": pyarrow.__version__,
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "micro", "loader_bench_vm-2cpu.json"))
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-loader-")
    try:
        cases, engine = make_cases(root)
        cases["silent_s3_endpoint"] = f"s3://bucket/tables?endpoint_override=127.0.0.1:{silent_endpoint()}&scheme=http"
        results = {}
        for name, source in cases.items():
            for policy in ("fallback", "strict"):
                results[f"{name}/{policy}"] = r = run_case(source, engine, policy)
                shown = {k: r.get(k) for k in ("wall_s", "tracemalloc_peak_mb", "maxrss_mb", "load", "refuse")}
                print(f"{name:34} {policy:8} {json.dumps(shown)}")
        doc = {"host": host(), "deadline_s": DEADLINE_S, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "limits": __import__("dataclasses").asdict(__import__("dspark_calib.table.sources", fromlist=["x"]).SERVE_LIMITS),
               "results": results}
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print("wrote", args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Per-step host overhead of observe mode on vLLM's real AdaptiveVerificationManager (CPU).

Observe mode (dspark_calib/vllm/observe_mode.py) wraps five call points of every
serving step; on a sampled step it also captures the budget (observe_step.capture_step),
creates and records four events, and later resolves them and buffers one row. Measured
per batch size (1, 32, 256 requests of 7 drafts, contexts 1k..16k), on the test suite's
runner stand-in (tests/test_observe_mode.py: vLLM's call order, vLLM's real get_num_tokens
and StepTimingCollector), two runners interleaved step by step, one plain, one observed:

* ``unsampled``: observed runner with DSPARK_CALIB_OBSERVE_EVERY so large no step is sampled;
* ``sampled``: every step sampled (EVERY=1), stock pricing (no alternative budget);
* ``sampled_context_aware``: every step sampled with the context-aware grid installed
  (the capture also computes the static alternative budget).

Each reports the observed step's time minus the plain step's (median and p99 of the
per-step differences) and the plain step itself. Events are stand-ins with no-op
record(): the cost of cudaEventRecord on a real GPU is NOT in these numbers (this VM
has none). ``flush_4096_rows_ms``: one rolling file written (zstd parquet), which a
sampled step pays once per ObservedWriter.rows_per_file rows. GC is off while timing.

    PYTHONPATH=. .venv/bin/python benchmarks/micro/bench_observe.py [--name NAME] [--steps N]

Writes benchmarks/results/micro/observe_bench_<NAME>.json with the host's CPU model, versions
and load average before and after.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))  # bench_context_aware, beside this file
sys.path.insert(0, str(REPO))

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402

from bench_context_aware import default_name, machine  # noqa: E402
from tests.helpers import build_reference_table  # noqa: E402
from dspark_calib.observe.file import ObservedWriter  # noqa: E402
from dspark_calib.vllm import context_aware as ca  # noqa: E402
from dspark_calib.vllm import observer as om  # noqa: E402
from tests.vllm.test_context_aware import SingleRank, make_manager, schedule  # noqa: E402
from tests.vllm.test_observe_mode import Clock, FakeRunner  # noqa: E402
from tests.core.test_observe import step as observed_row  # noqa: E402

STEPS = 7
VARIANTS = 16


class _Event:
    __slots__ = ()

    def record(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1.0


def _events():
    e = _Event()
    return SimpleNamespace(forward_start=e, forward_end=e, drafter_start=e, drafter_end=e)


def _summary(ns):
    us = np.asarray(ns) / 1e3
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(np.mean(us)), "n": len(us)}


def _runner(tables, rng, directory, every, grid=None):
    runner = FakeRunner(make_manager(tables, rng=rng), Clock())
    runner.forward_ms = runner.drafter_ms = 0.0
    if grid is not None:
        ca.install(runner.adaptive_verification, grid)
    if every:
        with mock.patch.dict(os.environ, {"DSPARK_CALIB_OBSERVE": directory, "DSPARK_CALIB_OBSERVE_EVERY": str(every)}):
            om.maybe_observe(runner, None, event_factory=_events, writer_kwargs={"rows_per_file": 1 << 30,
                                                                                 "max_buffer_s": 1e9})
    return runner


def _batches(runner, num_reqs, rng):
    """VARIANTS scheduled batches of num_reqs requests (contexts 1k..16k) in this runner's manager."""
    out = []
    for _ in range(VARIANTS):
        ctx = rng.integers(1024, 16384) + rng.integers(-500, 500, num_reqs)
        out.append(schedule(runner.adaptive_verification, np.maximum(ctx, 0), [STEPS] * num_reqs,
                            np.random.default_rng(int(rng.integers(1 << 30)))))
    return out


def bench_case(num_reqs, tables, grid, steps, every, rng, tmp):
    plain = _runner(tables, np.random.default_rng(1), tmp, 0, grid)
    observed = _runner(tables, np.random.default_rng(1), os.path.join(tmp, f"obs-{num_reqs}-{every}"), every, grid)
    seed = int(rng.integers(1 << 30))
    plan_p = _batches(plain, num_reqs, np.random.default_rng(seed))
    plan_o = _batches(observed, num_reqs, np.random.default_rng(seed))
    clock = time.perf_counter_ns
    base, diff = [], []
    for i in range(steps + steps // 10):  # first tenth: warm-up, dropped
        (nt_p, dt_p), (nt_o, dt_o) = plan_p[i % VARIANTS], plan_o[i % VARIANTS]
        t0 = clock(); plain.execute_model((nt_p, dt_p, True)); plain.sample_tokens(); t1 = clock()
        observed.execute_model((nt_o, dt_o, True)); observed.sample_tokens(); t2 = clock()
        if i >= steps // 10:
            base.append(t1 - t0)
            diff.append((t2 - t1) - (t1 - t0))
    obs = om.observer_of(observed)
    rows = len(obs.writer._buffer) if obs and obs.writer else 0
    om.detach(observed)  # its one flush happens here, outside the timed steps
    return {"added": _summary(diff), "plain_step": _summary(base), "rows_buffered": rows}


def bench_flush(tmp):
    rows = [observed_row(i) for i in range(4096)]
    times = []
    for k in range(5):
        w = ObservedWriter(os.path.join(tmp, f"flush-{k}"), rows_per_file=1 << 30)
        w._buffer = list(rows)
        t0 = time.perf_counter(); w.flush(); times.append((time.perf_counter() - t0) * 1e3)
    return {"p50_ms": float(np.median(times)), "max_ms": float(max(times)), "n": len(times)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default=default_name())
    ap.add_argument("--steps", type=int, default=5000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    table = build_reference_table()
    tables = table.dense_tables(8192)
    with mock.patch.object(av, "get_tp_group", SingleRank), \
            mock.patch.object(parallel_state, "get_tp_group", SingleRank):
        grid = ca.grid_for_manager(make_manager(), table.curves)
        load_before = os.getloadavg()
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            import pyarrow.parquet  # noqa: F401 - as the engine does at start-up
            gc.disable()
            try:
                for n in (1, 32, 256):
                    results[str(n)] = {
                        "unsampled": bench_case(n, tables, None, args.steps, 10**6, rng, tmp),
                        "sampled": bench_case(n, tables, None, args.steps, 1, rng, tmp),
                        "sampled_context_aware": bench_case(n, tables, grid, args.steps, 1, rng, tmp),
                    }
            finally:
                gc.enable()
            flush = bench_flush(tmp)
    result = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(load_before),
        "note": "host time only; event stand-ins (no cudaEventRecord cost); runner stand-in from the tests",
        "steps_per_case": args.steps,
        "by_num_reqs": results,
        "flush_4096_rows_ms": flush,
    }
    out = REPO / "benchmarks" / "results" / "micro" / f"observe_bench_{args.name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'reqs':>5} {'case':<22} {'added p50':>10} {'added p99':>10} {'plain step p50':>15}")
    for n, cases in results.items():
        for case, r in cases.items():
            print(f"{n:>5} {case:<22} {r['added']['p50_us']:>9.2f}u {r['added']['p99_us']:>9.2f}u "
                  f"{r['plain_step']['p50_us']:>14.1f}u")
    print(f"flush of 4096 rows: p50 {flush['p50_ms']:.1f} ms, max {flush['max_ms']:.1f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Per-step overhead of context-aware mode on vLLM's real AdaptiveVerificationManager (CPU).

Context-aware mode (dspark_calib/vllm/context_aware.py) runs before vLLM's
get_num_tokens on every serving step: it sums num_computed_tokens over the
scheduled requests and swaps in the grid's tables. Goal: <= 5 us
median overhead. Measured here, per batch size (1, 32, 256 requests of 7 drafts
each, contexts spread over 1k..16k so lookups hit different grid rows):

* ``added``: the wrapper's own work, timed per call with vLLM's method replaced by
  a no-op (exactly what the mode adds to a step, including the extra call layer), in
  steady decode: the same requests as the step before (the slots are reused), every
  request's context 4 tokens longer than at the step before (3 of 7 accepted + bonus);
* ``added_context_jump``: the same requests, but contexts jump across 1k..16k from one
  call to the next (the worst case for the verify buffer below 256 requests, whose rows
  are then rewritten every call);
* ``added_batch_changed``: as the jump, and every step's batch differs from the last one
  (requests arriving or finishing), every request held being scheduled (full occupancy:
  the sum is one masked reduction over the occupied slots);
* ``added_not_all_scheduled``: the same, with one request held but not scheduled (every
  request's slot looked up again: the worst case; not at 1 request);
* ``added_chunk_step`` (with --chunks): a step in which one request runs a 512-token prefill
  chunk without drafts: a request without drafts makes the wrapper look for chunks (one pass
  over the batch) and price the verify by their pairs (not at 1 request: vLLM needs a drafted
  request to call);
* ``plain`` / ``wrapped``: vLLM's get_num_tokens alone and behind the wrapper,
  interleaved call by call; ``wrapped - plain`` medians as a cross-check.

The grid is the real H200 one (tests/data, three contexts). GC is off while
timing.

    PYTHONPATH=. .venv/bin/python benchmarks/micro/bench_context_aware.py [--name NAME] [--calls N] [--tail T] [--chunks]

--tail T: the same with the mixed-context tail on (the batch's max as well as its sum).
--chunks: with chunk pricing on (DSPARK_CALIB_CONTEXT_CHUNKS=1; decode steps pay one length
comparison), plus the chunk step above.

Writes benchmarks/results/micro/context_aware_bench_<NAME>.json with the host's CPU
model, Python and numpy versions and the load average before and after.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

import vllm  # noqa: E402
import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av  # noqa: E402

from tests.helpers import aware, build_reference_table  # noqa: E402
from dspark_calib import __version__  # noqa: E402
from dspark_calib.vllm import context_aware as ca  # noqa: E402
from dspark_calib.env import tail_to_milli  # noqa: E402
from tests.vllm.test_context_aware import MAX_REQS, STEPS, CountedStates, SingleRank, make_manager  # noqa: E402

GOAL_US = 5.0
VARIANTS = 16  # batches per size, cycled, each with its own contexts





def _pct(values, q):
    return float(np.percentile(np.asarray(values) / 1e3, q))


def _summary(ns):
    return {"p50_us": _pct(ns, 50), "p99_us": _pct(ns, 99), "mean_us": float(np.mean(ns) / 1e3), "n": len(ns)}


def bench_size(num_reqs, grid, tables, calls, rng, tail_milli=0, chunks=False):
    m = make_manager(tables, rng=rng)
    req_ids = [f"req-{i}" for i in range(num_reqs)]
    slots = rng.permutation(MAX_REQS)[:num_reqs]
    # vLLM's RequestState as far as slots go: ids get slots only through add/remove_request
    m.req_states = CountedStates(**vars(m.req_states), free=slots.tolist())
    for r in req_ids:
        m.req_states.add_request(r, 0)  # contexts: set per call below
    num_tokens = {r: 1 + STEPS for r in req_ids}
    # the same requests in another order: a batch that changed since the last step (slot lookup again)
    reordered = dict(reversed(list(num_tokens.items())))
    draft_tokens = {r: list(range(STEPS)) for r in req_ids}
    computed = []
    for _ in range(VARIANTS):
        arr = np.zeros(MAX_REQS, np.int32)
        arr[slots] = rng.integers(1024, 16384) + rng.integers(-500, 500, num_reqs)
        computed.append(arr)
    plain = av.AdaptiveVerificationManager.get_num_tokens.__get__(m)
    state = ca.install(m, grid, aware(tail_milli, chunks))
    wrapped = m.get_num_tokens
    clock = time.perf_counter_ns
    out = {"added": [], "added_context_jump": [], "added_batch_changed": [], "added_not_all_scheduled": [],
           "added_chunk_step": [], "plain": [], "wrapped": []}
    steady = computed[0].copy()
    # The same wrapper code around a no-op instead of vLLM's method: the mode's own work.
    bare_state = ca.ContextAwareState(grid, tables, lambda a, b: 0, policy=aware(tail_milli, chunks))
    bare_state.watched = state.watched  # slot changes are counted (install wrapped req_states)
    bare_state.active = state.active  # and the occupied slots kept
    bare = ca._make_wrapper(m, bare_state)
    # all but the last request: one held, not scheduled (the occupied-slot sum does not apply)
    partial = [dict(list(num_tokens.items())[:-1]), dict(list(reordered.items())[1:])]
    # the last request runs a 512-token prefill chunk, without drafts
    chunk_tokens = {**num_tokens, req_ids[-1]: 512}
    chunk_drafts = {r: d for r, d in draft_tokens.items() if r != req_ids[-1]}
    for phase in ("added", "added_context_jump", "added_batch_changed", "added_not_all_scheduled",
                  "added_chunk_step", "end_to_end"):
        if phase in ("added_not_all_scheduled", "added_chunk_step") and num_reqs < 2:
            continue
        if phase == "added_chunk_step" and not chunks:
            continue
        for i in range(calls + calls // 10):  # first tenth: warm-up, dropped
            m.req_states.num_computed_tokens_np = computed[i % VARIANTS]
            keep = i >= calls // 10
            if phase == "added":  # steady decode: the same requests as the step before, 4 tokens on
                steady[slots] += 4
                if i % 2000 == 0:  # back to the start now and then: stay inside max_model_len
                    steady[slots] = computed[0][slots]
                m.req_states.num_computed_tokens_np = steady
                t0 = clock(); bare(num_tokens, draft_tokens); t1 = clock()
                if keep:
                    out["added"].append(t1 - t0)
            elif phase == "added_context_jump":
                t0 = clock(); bare(num_tokens, draft_tokens); t1 = clock()
                if keep:
                    out["added_context_jump"].append(t1 - t0)
            elif phase == "added_chunk_step":
                t0 = clock(); bare(chunk_tokens, chunk_drafts); t1 = clock()
                if keep:
                    out[phase].append(t1 - t0)
            elif phase in ("added_batch_changed", "added_not_all_scheduled"):  # a different batch each step
                pair = (num_tokens, reordered) if phase == "added_batch_changed" else partial
                t0 = clock(); bare(pair[i % 2], draft_tokens); t1 = clock()
                if keep:
                    out[phase].append(t1 - t0)
            else:
                t0 = clock(); plain(num_tokens, draft_tokens); t1 = clock()
                wrapped(num_tokens, draft_tokens); t2 = clock()
                if keep:
                    out["plain"].append(t1 - t0)
                    out["wrapped"].append(t2 - t1)
    res = {k: _summary(v) if v else None for k, v in out.items()}
    res["wrapped_minus_plain_p50_us"] = res["wrapped"]["p50_us"] - res["plain"]["p50_us"]
    res["goal_p50_us"] = GOAL_US
    res["met"] = res["added"]["p50_us"] <= GOAL_US
    return res


def cpu_model():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def default_name() -> str:
    """The results file's host tag: short host name and CPU count."""
    return f"{socket.gethostname().split('.')[0]}-{os.cpu_count()}cpu"


def machine(load_before) -> dict:
    """What a CPU benchmark result must say about where it ran."""
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__, "vllm": vllm.__version__,
            "dspark_calib": __version__, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default=default_name())
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--tail", type=float, default=0.0, help="the mixed-context tail (DSPARK_CALIB_CONTEXT_TAIL)")
    ap.add_argument("--chunks", action="store_true", help="chunk pricing on (DSPARK_CALIB_CONTEXT_CHUNKS=1)")
    args = ap.parse_args()
    tail_milli = tail_to_milli(args.tail, f"--tail {args.tail:g}")
    rng = np.random.default_rng(0)
    table = build_reference_table()
    with mock.patch.object(av, "get_tp_group", SingleRank):
        t0 = time.perf_counter()
        grid = ca.grid_for_manager(make_manager(rng=rng), table.curves)
        grid_s = time.perf_counter() - t0
    tables = table.dense_tables(8192)
    load_before = os.getloadavg()
    gc.disable()
    try:
        sizes = {str(n): bench_size(n, grid, tables, args.calls, rng, tail_milli, args.chunks) for n in (1, 32, 256)}
    finally:
        gc.enable()
    result = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(load_before),
        "grid": {**grid.describe(), "build_s": grid_s},
        "calls_per_size": args.calls,
        "tail_milli": tail_milli,
        "chunks": args.chunks,
        "by_num_reqs": sizes,
    }
    out = REPO / "benchmarks" / "results" / "micro" / f"context_aware_bench_{args.name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"grid: {len(grid)} points, {grid.nbytes / 2**20:.1f} MiB, max error {grid.max_rel_error:.4%}, "
          f"built in {grid_s:.2f} s")
    print(f"{'reqs':>5} {'added p50':>10} {'added p99':>10} {'jump p50':>9} {'changed p50':>11} {'partial p50':>11} "
          f"{'chunk p50':>10} {'plain p50':>10} {'wrapped p50':>12}  goal {GOAL_US} us")
    for n, r in sizes.items():
        part = r["added_not_all_scheduled"]
        part_p50 = "-" if part is None else f"{part['p50_us']:.2f}u"
        chunk = r["added_chunk_step"]
        chunk_p50 = "-" if chunk is None else f"{chunk['p50_us']:.2f}u"
        print(f"{n:>5} {r['added']['p50_us']:>9.2f}u {r['added']['p99_us']:>9.2f}u "
              f"{r['added_context_jump']['p50_us']:>8.2f}u {r['added_batch_changed']['p50_us']:>10.2f}u "
              f"{part_p50:>11} {chunk_p50:>10} {r['plain']['p50_us']:>9.1f}u "
              f"{r['wrapped']['p50_us']:>11.1f}u  {'met' if r['met'] else 'MISSED'}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

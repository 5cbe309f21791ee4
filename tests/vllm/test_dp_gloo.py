"""Data-parallel replicas agree on the table over real collectives, whatever each one's environment.

Two processes joined by torch.distributed with gloo on CPU stand for two DP replicas (vLLM's DP
group has a gloo cpu_group too, which the agreement uses). One has a table setting, the other no
DSPARK_CALIB_* variable at all (per-node environments). Each registers the plugin as vLLM does,
builds the patched AdaptiveVerificationManager on the VllmConfig of the README's serve flags, and
runs its start-up profile as a worker does: for every batch it yields, one DP all-reduce, as
vLLM's dummy runs sync the replicas (dispatch_cg_and_sync_dp). Both must end, loaded, profiling
or refusing in one line, within BOUND_S; a replica still running then is a hang, and the test
kills it and fails.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
import traceback

import pytest

from tests.vllm.test_check_engine import SHELF

BOUND_S = 180  # two vLLM imports and config builds; a hang never ends
TABLE_ENV = {"DSPARK_CALIB_PROBE": "0", "DSPARK_CALIB_CONTEXT_AWARE": "0"}


def replica(rank: int, port: int, env: dict, out: str, stock: bool = False) -> None:
    """One DP replica: what it yields or why it refused, and its dspark-calib lines, to out/rRANK.json.
    stock: a node without dspark-calib (the plugin never registers: vLLM's own manager)."""
    from dspark_calib.vllm.plugin import RAY_EXTRA_VARS

    # a replica's own environment only: an earlier test's plugin.register() in the parent announced
    # its variables to Ray workers, which would read here as "the driver set them, we missed them"
    for key in [k for k in os.environ if k.startswith("DSPARK_CALIB_") or k == RAY_EXTRA_VARS]:
        del os.environ[key]
    os.environ.update(env)
    result: dict = {"lines": []}
    try:
        result.update(_run_replica(rank, port, result["lines"], stock))
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        result["error"] = traceback.format_exc()[-3000:]
    with open(os.path.join(out, f"r{rank}.json"), "w") as fh:
        json.dump(result, fh)


def _run_replica(rank: int, port: int, lines: list, stock: bool = False) -> dict:
    import logging
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
    from vllm.v1.worker.gpu import model_runner  # noqa: F401 - a worker has it imported: register patches

    from dspark_calib.vllm import engine_info, plugin, runtime
    from tests.vllm.test_check_engine import HARDWARE, README, manager_for, vllm_config
    from tests.vllm.test_plugin import SingleRank

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("vllm.dspark_calib").addHandler(Lines())
    # a long gloo timeout: a replica waiting on the other must show as a hang, not as an error
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=3600))
    parallel_state.get_dp_group = lambda: SimpleNamespace(world_size=2, rank_in_group=rank,
                                                          cpu_group=dist.group.WORLD)
    av.get_tp_group = lambda: SingleRank()
    engine_info.hardware = lambda: dict(HARDWARE)
    engine_info.attention_backends = lambda e, draft: "FLASH_ATTN"
    config = vllm_config(README, {})
    if not stock:
        plugin.register()
    m = manager_for(config)
    sizes = list(config.compilation_config.cudagraph_capture_sizes)
    steps = 0
    try:
        for batch in m.batches_to_profile(sizes):
            dist.all_reduce(torch.tensor([batch["num_tokens"]]))  # vLLM's DP sync in each dummy run
            steps += 1
    except RuntimeError as exc:
        return {"refused": str(exc), "steps": steps}
    run = runtime.state_of(m).run
    return {"steps": steps, "loaded": bool(run and run.decision and run.decision.load)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_replicas(tmp_path, envs, stock: tuple[int, ...] = ()) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=replica, args=(rank, port, env, str(tmp_path), rank in stock))
             for rank, env in enumerate(envs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + BOUND_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert not hung, f"replica(s) {hung} still running after {BOUND_S} s: the DP agreement hangs"
    results = [json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in range(len(envs))]
    for r in results:
        assert "error" not in r, r["error"]
    return results


@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_a_replica_without_any_setting_takes_part_and_neither_hangs(tmp_path, policy):
    with_table = {"DSPARK_CALIB_TABLE": SHELF, "DSPARK_CALIB_POLICY": policy, **TABLE_ENV}
    first, second = run_replicas(tmp_path, [with_table, {}])
    said = [line for line in first["lines"] + second["lines"] if "data-parallel replicas decided differently" in line]
    assert said and all("\n" not in line for line in said)
    if policy == "strict":  # one replica strict: every replica refuses, none waits on another
        assert "refusing to start" in first["refused"] and "refusing to start" in second["refused"]
        assert first["steps"] == second["steps"] == 0
    else:  # neither loads: both run vLLM's own profile, step for step
        assert "refused" not in first and "refused" not in second
        assert not first["loaded"] and first["steps"] == second["steps"] > 0


def test_replicas_that_all_have_the_table_load_it(tmp_path):
    env = {"DSPARK_CALIB_TABLE": SHELF, "DSPARK_CALIB_POLICY": "strict", **TABLE_ENV}
    first, second = run_replicas(tmp_path, [env, env])
    assert first["loaded"] and second["loaded"] and first["steps"] == second["steps"]


def test_replicas_without_any_setting_profile_as_vllm_does(tmp_path):
    first, second = run_replicas(tmp_path, [{}, {}])
    assert first["steps"] == second["steps"] > 0 and first["lines"] == second["lines"] == []


@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_a_replica_without_dspark_calib_is_waited_on_for_the_bound_then_the_policy_applies(tmp_path, policy):
    """The other replica's node has no dspark-calib at all: it never votes and runs vLLM's own
    profile. The replica with the table waits DSPARK_CALIB_DP_TIMEOUT, names the replica that did
    not join, and under fallback profiles as vLLM does, step for step with the stock replica (no
    collective was left half-done on the DP group); under strict it refuses."""
    env = {"DSPARK_CALIB_TABLE": SHELF, "DSPARK_CALIB_POLICY": policy, "DSPARK_CALIB_DP_TIMEOUT": "2", **TABLE_ENV}
    first, second = run_replicas(tmp_path, [env, {"VLLM_PLUGINS": ""}], stock=(1,))  # loads no plugin
    [said] = [line for line in first["lines"] if "did not join" in line]
    assert "data-parallel replica 1 did not join the table agreement within 2 s (DSPARK_CALIB_DP_TIMEOUT)" in said
    assert second["lines"] == []
    if policy == "strict":
        assert "refusing to start (policy strict)" in said and "refusing to start" in first["refused"]
        assert first["steps"] == 0  # the stock replica's own next DP sync then fails: its peer is gone
    else:
        assert "profiling at start-up as usual (policy fallback)" in said
        assert "refused" not in first and "refused" not in second
        assert not first["loaded"] and first["steps"] == second["steps"] > 0


def test_a_replica_arriving_after_the_round_closed_follows_the_closure(monkeypatch):
    """Replica 0 gave up on replica 1 and closed the round: replica 1, arriving later with every
    vote now present, acts on that closure (its agreement names itself missing), never on the
    votes, so it cannot load a table replica 0 has left. The store is torch's own."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import vllm.distributed.parallel_state as parallel_state
    from torch.distributed import distributed_c10d
    from vllm.config import ParallelConfig

    from dspark_calib.vllm import dp_agreement

    store = dist.HashStore()
    monkeypatch.setattr(parallel_state, "get_dp_group", lambda: SimpleNamespace(world_size=2, cpu_group=None))
    monkeypatch.setattr(distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setenv("DSPARK_CALIB_DP_TIMEOUT", "60")
    parallel, key = ParallelConfig(), dp_agreement.Layout(0, 2, 1).key  # DP 2 of one rank each
    vote = (True, "ab" * 32, False, True, "fallback", 6)
    store.set(f"{key}/table/0/vote/0", json.dumps(list(vote)))
    store.set(f"{key}/table/0/closed", "[1]")  # replica 0 closed it: rank 1 missing
    votes = dp_agreement.dp_votes("table", vote, True, parallel)
    assert votes.missing == (1,) and votes.values == [vote]  # what replica 0 counted when it closed
    store.set(f"{key}/table/1/vote/0", json.dumps(list(vote)))  # the next round: both vote, nobody closed it yet
    assert dp_agreement.agree_across_dp("table", vote, True, parallel) == (True, "", [vote, vote])

"""The DP agreement's ranks, rounds and bound, on vLLM's own ParallelConfig and DP groups.

A world of ranks is played by threads of this process over one real torch store: each thread is
one rank, and torch.distributed's rank and vLLM's DP group answer per thread. The DP group each
rank gets is the one vLLM's own initialize_model_parallel builds for that rank (its process-group
constructor recorded instead of run), so the layouts are vLLM's, external launcher included.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch.distributed as dist  # noqa: E402
import vllm.config as vllm_config  # noqa: E402
import vllm.distributed.parallel_state as parallel_state  # noqa: E402
from torch.distributed import distributed_c10d  # noqa: E402
from vllm.config import EPLBConfig, ParallelConfig  # noqa: E402

from dspark_calib.vllm import engine_args as EA  # noqa: E402
from dspark_calib.vllm import dp_agreement  # noqa: E402
from tests.vllm.test_check_engine import HARDWARE  # noqa: E402

VOTE = (True, "ab" * 32, False, True, "fallback", 6)


@pytest.fixture(autouse=True)
def short_bound(monkeypatch):
    """A vote that never comes is waited on this long (tests that wait on one set their own)."""
    monkeypatch.setenv("DSPARK_CALIB_DP_TIMEOUT", "5")


def vllm_dp_group(monkeypatch, parallel, world, rank):
    """The DP group vLLM's initialize_model_parallel gives `rank` in a torch world of `world` ranks:
    SimpleNamespace(ranks, rank_in_group, world_size, cpu_group)."""
    built = {}

    def record(group_ranks, local_rank, backend, **kw):
        mine = next(r for r in group_ranks if rank in r)
        built[kw.get("group_name")] = group = SimpleNamespace(
            ranks=mine, rank_in_group=mine.index(rank), world_size=len(mine), cpu_group=("cpu", tuple(mine)))
        return group

    with monkeypatch.context() as m:
        for name in ("_TP", "_ETP", "_DCP", "_PCP", "_PP", "_DP", "_ENGRAM_DP", "_EP", "_EPLB"):
            m.setattr(parallel_state, name, None)  # vLLM's groups, built below; restored after
        m.setattr(parallel_state, "_WORLD", SimpleNamespace(local_rank=0, device_group=None))
        m.setattr(parallel_state, "init_model_parallel_group", record)
        m.setattr(dist, "is_initialized", lambda: True)
        m.setattr(dist, "get_world_size", lambda group=None: world)
        m.setattr(dist, "get_rank", lambda group=None: rank)
        m.setattr(dist, "get_backend", lambda group=None: "gloo")
        m.setattr(vllm_config, "get_current_vllm_config",
                  lambda: SimpleNamespace(parallel_config=parallel, engram_config=None, model_config=None))
        parallel_state.initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                                 parallel.prefill_context_parallel_size)
    return built["dp"]


class World:
    """`size` ranks played by threads over one torch HashStore; rank r's DP group is groups[r]."""

    def __init__(self, monkeypatch, size, groups):
        self.store, self.local = dist.HashStore(), threading.local()
        me = lambda group=None: self.local.rank  # noqa: E731
        monkeypatch.setattr(dist, "get_rank", me)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
        monkeypatch.setattr(distributed_c10d, "_get_default_store", lambda: self.store)
        monkeypatch.setattr(parallel_state, "get_dp_group", lambda: groups[self.local.rank])
        monkeypatch.setattr(dist, "get_process_group_ranks", self._ranks)
        self.groups = groups

    def _ranks(self, group):
        for g in self.groups.values():
            if g.cpu_group == group:
                return list(g.ranks)
        raise KeyError(group)  # torch's own answer for a group it does not know

    def agree(self, ranks, parallel, what="table", vote=VOTE):
        """agree_across_dp on each of `ranks`, all at once: {rank: its result}."""
        out = {}

        def run(rank):
            self.local.rank = rank
            out[rank] = dp_agreement.agree_across_dp(what, vote, rank == min(ranks), parallel)

        threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return out


def external_launcher(monkeypatch, rank, tp=2, dp=2):
    """vLLM's ParallelConfig for torchrun's `rank` (it reads RANK itself), external launcher."""
    monkeypatch.setenv("RANK", str(rank))
    return ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, distributed_executor_backend="external_launcher")


def test_external_dp_engines_in_one_torchrun_world_vote_apart(monkeypatch):
    """torchrun starts 8 ranks: two engines of DP 2 x TP 2 (external DP 2; vLLM's data_parallel_rank
    comes from VLLM_DP_RANK then). Engine 1 agrees among its own 4 ranks at once; engine 0 is not
    waited on, and a replica of engine 1 that does not vote is named by its DP rank."""
    monkeypatch.setenv("VLLM_DP_SIZE", "2")
    monkeypatch.setenv("DSPARK_CALIB_DP_TIMEOUT", "1")
    configs = {}
    for r in range(8):
        monkeypatch.setenv("VLLM_DP_RANK", str(r % 4 // 2))
        configs[r] = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    assert {c.data_parallel_size for c in configs.values()} == {2}
    groups = {r: vllm_dp_group(monkeypatch, configs[r], 8, r) for r in range(8)}
    assert groups[5].ranks == [5, 7] and groups[5].rank_in_group == 0
    world = World(monkeypatch, 8, groups)
    assert world.agree([4, 5, 6, 7], configs[4]) == {r: (True, "", [VOTE, VOTE]) for r in (4, 5, 6, 7)}
    missing = world.agree([4, 5], configs[4])  # engine 1's replica 1 (ranks 6, 7) never votes
    assert {why for _, why, _ in missing.values()} == {
        "data-parallel replica 1 did not join the table agreement within 1 s (DSPARK_CALIB_DP_TIMEOUT): "
        "no dspark-calib there, or still starting"}


def test_the_external_launcher_engine_of_the_whole_world_agrees_as_before(monkeypatch):
    """torchrun's 4 ranks are one engine of DP 2 x TP 2: vLLM's data_parallel_rank is RANK // 2."""
    configs = {r: external_launcher(monkeypatch, r) for r in range(4)}
    assert [c.data_parallel_rank for c in configs.values()] == [0, 0, 1, 1]
    groups = {r: vllm_dp_group(monkeypatch, configs[r], 4, r) for r in range(4)}
    assert dp_agreement.replica_layout(configs[3], 4, 3, groups[3].ranks) == dp_agreement.Layout(0, 2, 2)
    assert World(monkeypatch, 4, groups).agree(range(4), configs[0]) == {r: (True, "", [VOTE, VOTE]) for r in range(4)}


def test_a_dp_group_not_where_the_config_puts_it_is_refused_naming_the_settings(monkeypatch):
    """The config says TP 1 but vLLM's groups were built for TP 2: no rank can tell its engine's
    ranks, so none votes on them; one line names the settings."""
    built = external_launcher(monkeypatch, 1)
    group = vllm_dp_group(monkeypatch, built, 4, 1)
    told = ParallelConfig(data_parallel_size=2)
    with pytest.raises(dp_agreement.NoAgreement) as exc:
        dp_agreement.replica_layout(told, 4, 1, group.ranks)
    assert str(exc.value) == ("vLLM's DP group (ranks 1, 3) is not where distributed_executor_backend=mp, "
                              "data_parallel_size=2 and tensor x pipeline x prefill-context parallel 1 put it in "
                              "a world of 4 ranks")


def test_elastic_ep_says_what_is_missing_and_why(monkeypatch):
    """vLLM's elastic EP builds its DP group outside torch.distributed (its ranks are unknown there):
    the line names enable_elastic_ep and why the replicas cannot vote, not a bare KeyError."""
    with EA._stand_in_platform(HARDWARE):
        elastic = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                                 enable_elastic_ep=True, eplb_config=EPLBConfig(use_async=False))
    stateless = SimpleNamespace(ranks=[0, 1], rank_in_group=0, world_size=2, cpu_group=object())
    world = World(monkeypatch, 1, {0: stateless})
    world.groups = {}  # torch.distributed knows no such group: get_process_group_ranks raises KeyError
    [(agreed, why, _)] = world.agree([0], elastic).values()
    assert not agreed and why == (
        "data-parallel replicas cannot agree on the table: vLLM's elastic expert parallel (enable_elastic_ep) "
        "builds its DP group outside torch.distributed's world process group, whose store the replicas vote "
        "in: with it the replicas share no store")


def test_two_engines_in_one_process_count_their_rounds_apart(monkeypatch):
    """Each engine's rounds start at 0 in its own store: an earlier engine's rounds in this process
    (or another rank's) do not shift them."""
    parallel = ParallelConfig(data_parallel_size=2)
    groups = {r: SimpleNamespace(ranks=[0, 1], rank_in_group=r, world_size=2, cpu_group="dp") for r in (0, 1)}
    first = World(monkeypatch, 2, groups)
    assert first.agree([0, 1], parallel) == first.agree([0, 1], parallel) == {r: (True, "", [VOTE, VOTE]) for r in (0, 1)}
    second = World(monkeypatch, 2, groups)  # a second engine: a new store, the same process
    assert second.agree([0, 1], parallel) == {r: (True, "", [VOTE, VOTE]) for r in (0, 1)}


@pytest.fixture
def gloo_world():
    """A real one-rank gloo world, so vLLM-made CPU groups are real gloo groups; torn down after."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("setting", "group_s", "waited"), [("300", 60, 54.0), ("300", None, 300.0),
                                                           ("3600", None, 1620.0), ("100", 60, 54.0)])
def test_the_wait_is_clamped_below_the_dp_groups_own_timeout(monkeypatch, caplog, gloo_world, setting, group_s, waited):
    """The DP CPU group's timeout is read from its gloo backend: a real group, made as vLLM makes it
    (new_group with cpu_distributed_timeout_seconds; unset, torch's 1800 s default)."""
    from dspark_calib.vllm import runtime

    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setenv("DSPARK_CALIB_DP_TIMEOUT", setting)
    parallel = ParallelConfig(cpu_distributed_timeout_seconds=group_s)
    cpu_group = dist.new_group([0], backend="gloo", timeout=parallel.cpu_distributed_timeout)
    with caplog.at_level(logging.WARNING, logger="vllm.dspark_calib"):
        assert dp_agreement.vote_timeout(cpu_group, parallel, True) == waited
        assert dp_agreement.vote_timeout(cpu_group, parallel, True) == waited  # the probe's agreement: not said again
    said = [r.getMessage() for r in caplog.records if r.name == "vllm.dspark_calib"]
    if waited < float(setting):
        assert said == [f"dspark-calib: DSPARK_CALIB_DP_TIMEOUT={setting} is past what vLLM's DP group allows "
                        f"({group_s or 1800} s, its gloo timeout): waiting at most {waited:g} s, 90% of it, so a "
                        "replica already in its DP sync is not timed out by vLLM"]
    else:
        assert said == []


def test_an_unreadable_group_timeout_is_vllms_setting_or_torchs_default(monkeypatch):
    assert dp_agreement.dp_group_timeout(object(), ParallelConfig(cpu_distributed_timeout_seconds=120)) == (
        120.0, "cpu_distributed_timeout_seconds")
    assert dp_agreement.dp_group_timeout(object(), ParallelConfig()) == (1800.0, "torch's gloo default")
    assert dp_agreement.dp_group_timeout(object(), None) == (dp_agreement.DP_GROUP_TIMEOUT_S, "torch's gloo default")
    assert timedelta(seconds=dp_agreement.DP_GROUP_TIMEOUT_S) == distributed_c10d.default_pg_timeout

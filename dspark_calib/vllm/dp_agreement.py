"""Agreement across data-parallel replicas: every replica's vote on a decision, and what they agree.

Load mode's decisions (the table, the probe's outcome) must be the same on every replica of a
data-parallel engine: each dummy step has a DP collective, so replicas that profile different
step counts hang. The votes go through the key-value store of the world process group (the one
vLLM's DP rendezvous made), within DSPARK_CALIB_DP_TIMEOUT; a replica that never votes (no
dspark-calib on its node) is named in one line, and the caller's policy applies.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from dspark_calib import env as E
from dspark_calib.errors import PREFIX, CalibError, exception_line
from dspark_calib.table.sources import escape
from dspark_calib.vllm.runtime import log, log_once

# The agreement's keys in the world process group's store: one namespace per engine (its slice of
# the world), and in it one per round of each agreement.
AGREEMENT_KEY = "dspark_calib/agree"
POLL_S = 0.1
SAY_AFTER_S, SAY_EVERY_S = 10.0, 60.0  # a wait this long is said (rank 0), then again every minute
# The DP CPU group's collective timeout when it cannot be read: torch's gloo default, which vLLM's
# group has unless cpu_distributed_timeout_seconds is set.
DP_GROUP_TIMEOUT_S = 1800.0
# The share of that timeout a replica may wait for votes: a replica without dspark-calib is already
# in its first DP sync, since before this one began to wait (the replicas' skew), and vLLM ends the
# group when that sync outlives the timeout.
DP_GROUP_SHARE = 0.9


@dataclass(frozen=True)
class Votes:
    values: list  # the votes of this DP group's replicas that voted, in DP-rank order
    missing: tuple[int, ...] = ()  # the DP replicas that did not vote within the bound
    timeout_s: float = 0.0  # the bound waited (0: nothing to wait for)


class NoAgreement(Exception):
    """Why these replicas cannot hold the vote, in one line naming the setting: the policy applies."""


@dataclass(frozen=True)
class Layout:
    """This engine's ranks in the world process group, laid out as vLLM lays them
    (parallel_state.initialize_model_parallel: external DP x DP x PP x PCP x TP). With the
    external launcher the world can hold several engines (external DP: torchrun starts them all);
    only this engine's ranks vote together, in their own namespace."""

    first: int  # the engine's first global rank
    replicas: int  # vLLM's DP size (its DP group)
    per: int  # ranks per replica: TP x PP x PCP

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.replicas * self.per)

    @property
    def key(self) -> str:
        return f"{AGREEMENT_KEY}/ranks{self.first}-{self.ranks[-1]}"

    def replica(self, rank: int) -> int:
        """vLLM's DP rank of a global rank of this engine."""
        return (rank - self.first) // self.per


def replica_layout(parallel: Any, world: int, me: int, peers: list[int]) -> Layout:
    """Where this engine's replicas sit in a world of `world` ranks, from vLLM's parallel config and
    the global ranks of this rank's DP group (`peers`, in DP-rank order). Raises NoAgreement, naming
    the settings, when vLLM's DP group is not where that layout puts it: then no rank can tell which
    ranks are its engine's, and a vote counted over the wrong ranks could part the replicas."""
    per = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size) * \
        int(parallel.prefill_context_parallel_size)
    layout = Layout(me - me % (per * len(peers)), len(peers), per)
    if world % (per * len(peers)) or list(peers) != [r for r in layout.ranks if r % per == me % per]:
        raise NoAgreement(
            f"vLLM's DP group (ranks {_shown_ranks(peers)}) is not where distributed_executor_backend="
            f"{parallel.distributed_executor_backend}, data_parallel_size={len(peers)} and tensor x pipeline x "
            f"prefill-context parallel {per} put it in a world of {world} ranks")
    return layout


def _shown_ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")


def dp_ranks(group: Any, parallel: Any) -> list[int]:
    """The global ranks of this rank's DP group, in DP-rank order; NoAgreement when the replicas
    cannot vote through the world process group's store."""
    if parallel is None:
        raise NoAgreement("no vLLM parallel config was kept for this engine: its replicas' ranks are unknown")
    if getattr(parallel, "enable_elastic_ep", False):
        raise NoAgreement("vLLM's elastic expert parallel (enable_elastic_ep) builds its DP group outside "
                          "torch.distributed's world process group, whose store the replicas vote in: "
                          "with it the replicas share no store")
    import torch.distributed as dist

    try:
        return dist.get_process_group_ranks(group.cpu_group)
    except KeyError:
        raise NoAgreement("vLLM's DP group is not a torch.distributed process group here (its ranks are "
                          "unknown to torch.distributed): the replicas share no store to vote in") from None


def dp_votes(what: str, mine: tuple, rank0: bool, parallel: Any) -> Votes:
    """Every DP replica's vote on `what` (only this one's when DP is 1 or not initialised).
    parallel: vLLM's ParallelConfig of this engine (where its replicas sit).

    Exchanged through the key-value store of the world process group (the one vLLM's DP
    rendezvous made), not through a collective: a replica whose node runs no dspark-calib never
    votes, and a gather would then wait forever, while a collective given up at a deadline
    (gloo's only bound is the group's own timeout) leaves the group vLLM syncs every dummy step
    on in an undefined state. Store requests leave the group untouched, so a replica that stops
    waiting after the bound can still run vLLM's profile in step with that replica. The first
    rank to close a round (all voted, or these were missing) closes it for every rank of every
    replica, so all of them act on one outcome, a replica that arrives later included.
    Raises NoAgreement (one line) when the replicas cannot vote."""
    try:
        from vllm.distributed.parallel_state import get_dp_group

        group = get_dp_group()
        size = int(group.world_size)
    except Exception:  # noqa: BLE001 - no DP group: tests, single engine
        return Votes([mine])
    if size <= 1:
        return Votes([mine])
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    peers = dp_ranks(group, parallel)  # global ranks, in DP-rank order
    me = dist.get_rank()
    layout = replica_layout(parallel, dist.get_world_size(), me, peers)
    timeout_s = vote_timeout(group.cpu_group, parallel, rank0)
    store = distributed_c10d._get_default_store()
    # The round counter lives in the store, one per rank: a new engine (a new store) starts at
    # round 0 whatever this process ran before, and engines in one process count apart.
    n = store.add(f"{layout.key}/{what}/round/{me}", 1) - 1
    base = f"{layout.key}/{what}/{n}"
    vote = {r: f"{base}/vote/{r}" for r in layout.ranks}
    closed = f"{base}/closed"
    store.set(vote[me], json.dumps(list(mine)))
    _wait(store, vote, closed, timeout_s, what, layout if rank0 else None)
    missing = [r for r in layout.ranks if not store.check([vote[r]])]
    outcome = json.loads(store.compare_set(closed, "", json.dumps(missing)))  # the first to close decides
    # The votes the closure counted, on every rank alike: a late vote stored after the closure
    # would otherwise reach the ranks that read after it and not those that read before.
    present = [tuple(json.loads(store.get(vote[r]))) for r in peers if r not in outcome]
    return Votes(present, tuple(sorted({layout.replica(r) for r in outcome})), timeout_s)


def vote_timeout(cpu_group: Any, parallel: Any, rank0: bool) -> float:
    """DSPARK_CALIB_DP_TIMEOUT (a bad value: the default, said), clamped to DP_GROUP_SHARE of the
    DP CPU group's own collective timeout, said in one line (TP rank 0) when it applies."""
    try:
        wanted = E.dp_timeout()
    except CalibError as exc:
        wanted = E.DEFAULT_DP_TIMEOUT_S
        if rank0:
            log.warning(PREFIX + "%s; waiting at most the default %g s", exc, wanted)
    group_s, source = dp_group_timeout(cpu_group, parallel)
    bound = DP_GROUP_SHARE * group_s
    if wanted <= bound:
        return wanted
    log_once(logging.WARNING, PREFIX + f"{E.DP_TIMEOUT}={wanted:g} is past what vLLM's DP group allows ({group_s:g} s, "
             f"{source}): waiting at most {bound:g} s, {DP_GROUP_SHARE:.0%} of it, so a replica already in its DP "
             "sync is not timed out by vLLM")  # once per engine (the table's and the probe's agreements)
    return bound


def dp_group_timeout(cpu_group: Any, parallel: Any) -> tuple[float, str]:
    """(seconds, where they come from): the DP CPU group's collective timeout, read from its gloo
    backend (what ends a collective), else from vLLM's cpu_distributed_timeout_seconds (what vLLM
    built the group with), else DP_GROUP_TIMEOUT_S (torch's default, which vLLM then leaves)."""
    try:
        import torch

        return cpu_group._get_backend(torch.device("cpu")).options._timeout.total_seconds(), "its gloo timeout"
    except Exception:  # noqa: BLE001 - a torch without these private names: vLLM's setting next
        pass
    seconds = getattr(parallel, "cpu_distributed_timeout_seconds", None)
    if isinstance(seconds, int) and seconds > 0:
        return float(seconds), "cpu_distributed_timeout_seconds"
    return DP_GROUP_TIMEOUT_S, "torch's gloo default"


def _wait(store: Any, vote: dict[int, str], closed: str, timeout_s: float, what: str, say: Layout | None) -> None:
    """Until every rank voted, the round is closed, or timeout_s; said every so often when `say`
    (the layout naming the replicas; None: this rank says nothing) is given."""
    start, next_say = time.monotonic(), SAY_AFTER_S
    while not (store.check(list(vote.values())) or store.check([closed])):
        waited = time.monotonic() - start
        if waited >= timeout_s:
            return
        if say is not None and waited >= next_say:
            late = sorted({say.replica(r) for r, key in vote.items() if not store.check([key])})
            log.warning(PREFIX + "waiting for data-parallel %s to join the %s agreement: %.0f s of at most %g s (%s)",
                        _replicas(late), what, waited, timeout_s, E.DP_TIMEOUT)
            next_say += SAY_EVERY_S
        time.sleep(POLL_S)


def _replicas(indices: Any) -> str:
    return f"replica{'s' * (len(indices) != 1)} {_shown_ranks(list(indices))}"


def agree_across_dp(what: str, mine: tuple, rank0: bool, parallel: Any) -> tuple[bool, str, list]:
    """(all replicas agree, one line naming each replica's value when they do not, or the
    replicas that never voted, the values). parallel: vLLM's ParallelConfig of this engine."""
    try:
        votes = dp_votes(what, mine, rank0, parallel)
    except NoAgreement as exc:
        return False, f"data-parallel replicas cannot agree on the {what}: {exc}", [mine]
    except Exception as exc:  # noqa: BLE001 - a failed exchange is a disagreement, said as such
        return False, f"data-parallel replicas could not agree on the {what} ({exception_line(exc)})", [mine]
    everyone = votes.values
    if votes.missing:
        return False, (f"data-parallel {_replicas(votes.missing)} did not join the {what} agreement within "
                       f"{votes.timeout_s:g} s ({E.DP_TIMEOUT}): no dspark-calib there, or still starting"), everyone
    if all(v == everyone[0] for v in everyone):
        return True, "", everyone
    shown = ", ".join(f"replica {i}: {_show(v)}" for i, v in enumerate(everyone[:8]))
    more = f", +{len(everyone) - 8} more" if len(everyone) > 8 else ""
    return False, f"data-parallel replicas decided differently on the {what} ({shown}{more})", everyone


def _show(value: tuple) -> str:
    return escape(" ".join(str(v)[:12] for v in value), 60)

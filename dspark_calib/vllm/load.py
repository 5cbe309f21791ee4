"""Load mode (DSPARK_CALIB_TABLE=PATH): install a saved table instead of profiling.

The decision itself is ``selection.decide`` (pure; ``check`` runs the same one
offline). Here it runs inside the engine: on TP rank 0 within the deadline
(DSPARK_CALIB_LOAD_TIMEOUT), broadcast in the TP group, then agreed across the DP
replicas (dp_votes: through the world process group's store, within
DSPARK_CALIB_DP_TIMEOUT), so every rank of every replica runs the same number of dummy
steps (each step has TP collectives, and with DP > 1 a DP collective too). A
disagreement, or a replica that never votes (no dspark-calib there), is resolved the
same way on every replica (all fall back, or all refuse under strict): never a hang. A
replica without a table setting votes too (agree_without_table), as one that found no table.

When a table loads, batches_to_profile yields one warm-up run per size above the
capture limit (those runs JIT the piecewise shapes), then the probe (probe.py):
three timed steps at each context the engine will price, planned on TP rank 0 within
the probe's budget and compared with the dense tables the engine installs.
set_initial_cost_curves hands the table's curves to vLLM's own set_cost_curves, so the
TP broadcast and the dense tables stay vLLM's; a table with two or more contexts then
prices each step for its batch (context_aware.py) under the pricing policy set here,
at the contexts the probe judged. Under strict, no table loads on a vLLM that is not a
tested release (shape.untested_why).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from dspark_calib import env as E
from dspark_calib.errors import PREFIX, CalibError, exception_line
from dspark_calib.pricing.policy import (CHUNK_RULE, CONTEXT_AWARE, DEFAULT_CONTEXT_CHUNKS,
                                         DEFAULT_CONTEXT_TAIL_MILLI, MAX_EXTRAPOLATE_TO, PricingPolicy, coverage)
from dspark_calib.selection import Decision, Progress, decide, decide_within, no_table
from dspark_calib.table.sources import SERVE_LIMITS, escape
from dspark_calib.vllm import probe as P
from dspark_calib.vllm.runtime import log, log_once, state_of

def engine_description(manager: Any, capture_sizes: list[int]) -> dict[str, Any]:
    """describe_engine (every registry key, max_model_len included) on the vLLM config
    the plugin kept for this manager."""
    from dspark_calib.vllm.engine_info import describe_engine

    return describe_engine(manager, capture_sizes, state_of(manager).vllm_config)


def max_model_len(manager: Any) -> int:
    """The engine's max_model_len from the config the plugin kept (0 when unknown)."""
    value = getattr(getattr(state_of(manager).vllm_config, "model_config", None), "max_model_len", 0)
    return value if isinstance(value, int) and value > 0 else 0


def parallel_config(manager: Any) -> Any:
    """vLLM's ParallelConfig from the config the plugin kept (None when none was kept)."""
    return getattr(state_of(manager).vllm_config, "parallel_config", None)


def decision_from_env(manager: Any, capture_sizes: list[int]) -> Decision:
    """Everything the env asks for, decided on this rank within the deadline; never raises.

    The decision runs on a thread of this worker, bounded by what it reads rather than stopped
    from outside: a thread cannot be killed, and at the deadline it is only told to stop
    between candidates, so what one read can cost must be bounded before the read starts.
    It is: every read's decoded size is summed from the page headers and refused over
    SERVE_LIMITS.max_decoded_bytes before pyarrow decodes a page (fileformat.parquet), footer
    JSON is capped in elements, curve reads are capped in number, and the engine sizes a table
    states are bounded. So a thread left running after the deadline finishes its current read
    within that budget and stops. A subprocess was the other way, and is not taken: a fresh
    interpreter in every TP rank 0 costs seconds of start-up inside vLLM's start-up, forking a
    process that holds CUDA state is unsafe, and its answer (curves, reports) would have to
    cross a pipe; and `check` must decide exactly as this does, which the shared bounded
    reader gives for free."""
    from dspark_calib.vllm.engine_info import current_context_len

    try:
        policy = E.policy()
    except CalibError as exc:
        msg = PREFIX + f"{exc}; refusing to start"
        return Decision(False, (msg,), logging.ERROR, refuse=msg, policy="strict")
    why = untested_vllm()
    if why and policy == "strict":
        msg = PREFIX + f"{why}; refusing to start (policy strict)"
        return Decision(False, (msg,), logging.ERROR, refuse=msg, policy=policy)
    try:
        ctx, allow, pins = E.context_len(), E.allow_reference(), E.pinned_hashes()
        timeout, probe = E.load_timeout(), E.probe_enabled()
    except CalibError as exc:
        return no_table(policy, str(exc))
    source = E._get(None, E.TABLE) or ""
    vllm_ctx = current_context_len()

    # Object-store requests give up before the deadline, so the thread ends soon after it.
    limits = replace(SERVE_LIMITS, io_timeout_s=min(SERVE_LIMITS.io_timeout_s, 0.8 * timeout))

    cancel, progress = threading.Event(), Progress()

    def run() -> Decision:
        return decide(source, engine_description(manager, capture_sizes), policy=policy, allow_reference=allow,
                      context_len=ctx, vllm_context_len=vllm_ctx, pins=pins, probe=probe, limits=limits,
                      cancel=cancel, progress=progress)

    return decide_within(timeout, policy, source, run, cancel, progress)


def untested_vllm() -> str:
    """Why the running vLLM is untested ('' for a tested release): strict loads no table on it."""
    from dspark_calib.vllm.shape import untested_why

    try:
        import vllm

        version = str(getattr(vllm, "__version__", ""))
    except Exception:  # noqa: BLE001 - no vLLM to ask: nothing to refuse here
        return ""
    return untested_why(version)


def install_hooks() -> None:
    """THE HOOK plugin.py must call once it patches vLLM (next to _wrap_factory): lets the probe
    find the StepTimingCollector timing the dummy runs. Idempotent; without it, no probe."""
    P.hook_collector()


def remove_hooks() -> None:
    """plugin.unpatch's counterpart (tests)."""
    P.unhook_collector()


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


def table_vote(decision: Any, plan: P.Plan | None) -> tuple:
    """What a replica tells the others about its table decision. The policy too: replicas with
    different policies may part ways after the probe (one profiles, one refuses or keeps the
    table) and run different step counts; and the probe's step count (per-replica env may price
    other contexts)."""
    return (decision.load, decision.content_hash, bool(decision.refuse), decision.load and decision.probe,
            decision.policy, len(plan.steps) if plan is not None else 0)


def agree_on_table(decision: Any, plan: P.Plan | None, rank0: bool, parallel: Any) -> Any:
    """The decision every data-parallel replica takes: this one when all voted alike, else none
    loads, and one replica refusing (or strict) makes every replica refuse: none may wait on it."""
    agreed, why, everyone = agree_across_dp("table", table_vote(decision, plan), rank0, parallel)
    if agreed:
        return decision
    strict = decision.policy == "strict" or any(
        v[2] or (len(v) > 4 and v[4] == "strict") for v in everyone if isinstance(v, tuple) and len(v) > 2)
    line, level, refuse = _policy_line("strict" if strict else decision.policy, why)
    if rank0:
        log.log(level, line)
    return replace(decision, load=False, refuse=line if refuse else "", lines=(line,))


def agree_without_table(manager: Any) -> None:
    """A replica with no table setting (no DSPARK_CALIB_TABLE: observe alone, a setting Ray did not
    copy, or no DSPARK_CALIB_* at all) still takes part in the data-parallel agreement, voting as a
    replica that found no table votes: otherwise a replica that has a table waits on it forever
    while it runs vLLM's profile. Raises RuntimeError (the one line) when the replicas must refuse;
    with DP 1 it returns at once."""
    from dspark_calib.vllm.engine_info import tp_rank_and_size

    try:
        policy = E.policy()
    except CalibError:
        policy = "fallback"  # load mode says a bad value where a table is set; here no table is
    decision = agree_on_table(Decision(False, (), policy=policy), None, tp_rank_and_size()[0] == 0,
                              parallel_config(manager))
    if decision.refuse:
        raise RuntimeError(decision.refuse)


def _show(value: tuple) -> str:
    return escape(" ".join(str(v)[:12] for v in value), 60)


def _policy_line(policy: str, why: str) -> tuple[str, int, bool]:
    """(line, level, refuse) for a failed agreement or probe."""
    if policy == "strict":
        return PREFIX + f"{why}; refusing to start (policy strict)", logging.ERROR, True
    return PREFIX + f"{why}; profiling at start-up as usual (policy {policy})", logging.WARNING, False


@dataclass
class LoadRun:
    """What load mode keeps from batches to install_curves, in state_of(manager).run."""

    decision: Any = None
    strip: int = 0  # leading timed steps (warm-ups, probe) that are not vLLM's profile
    priced: tuple[int, ...] | None = None  # the probed contexts, the only ones priced (None: not probed)


def probe_setup(manager: Any, decision: Any, vllm_batches: list[dict]) -> tuple[P.Plan | None, dict]:
    """(the probe's plan, the installed tables it judges against) on TP rank 0: the contexts the
    engine will price (every profiled one when context-aware mode will take the table, else the
    chosen one), probe_sizes at each, within a budget scaled by vLLM's start-up profile that load
    mode skips (vllm_batches, priced by the table). (None, {}) when no probe runs; never raises."""
    if not (decision.load and decision.probe):
        return None, {}
    try:
        from dspark_calib.pricing.costs import ContextCosts

        curves = dict(decision.curves) or {decision.context_len: (decision.draft_curve, decision.verify_curve)}
        try:
            aware = len(curves) >= 2 and E.context_aware_enabled()
        except CalibError:
            aware = False  # _context_aware keeps the static tables then (its own WARNING)
        chosen = int(decision.context_len)
        contexts = sorted(curves) if aware else [chosen]
        rs, limit = manager.req_states, int(manager._cudagraph_limit)
        costs = ContextCosts({c: curves[c] for c in contexts}, rs.max_num_reqs, rs.max_num_batched_tokens, limit)
        installed = {c: costs.tables[c] for c in contexts}
        profiled = [b["num_tokens"] for b in vllm_batches]  # vLLM's start-up profile, replays included
        return P.plan_probe(installed, chosen, probe_sizes(profiled, limit), profiled), installed
    except Exception as exc:  # noqa: BLE001 - said as a probe that could not run, under the policy
        return P.Plan(note=f"no probe plan ({exception_line(exc)})"), {}


def probe_sizes(sizes: list[int], limit: int) -> list[int]:
    """The dummy-run sizes probed at each context: the capture limit (a full graph: verify and
    draft at max_num_seqs) and the largest tail size (piecewise, warmed up just before). Not the
    one-request step: a step of a few milliseconds is mostly host time in its timed window, and
    on an H200 it read 1.04-1.27x a genuine table's own point (benchmarks/results/h200/
    2026-12-01-1631-probe-smoke), where these two read 0.96-1.02x."""
    captured = [n for n in sizes if n <= limit]
    tail = [n for n in sizes if n > limit]
    out = {limit} if limit in captured else set()
    out |= {max(tail)} if tail else set()
    return sorted(out)


def probe_reader() -> Any:
    """The GPU reader whose readings go in the probe's line (rank 0's own GPU)."""
    from dspark_calib.vllm.gpu_readings import GpuReader, nvml_index

    return GpuReader(nvml_index())


def _read(reader: Any) -> Any:
    try:
        return reader.read() if reader is not None else None
    except Exception:  # noqa: BLE001 - a reading lost is not a probe lost
        return None


class LoadMode:
    name = "load"

    def batches(self, manager: Any, capture_sizes: list[int], vllm_batches: list[dict]) -> Iterator[dict]:
        from dspark_calib.vllm.engine_info import broadcast_from_rank0, tp_rank_and_size

        rank0 = tp_rank_and_size()[0] == 0
        decision = plan = None
        installed: dict = {}
        if rank0:
            decision = decision_from_env(manager, capture_sizes)
            for line in decision.lines:
                log.log(decision.level, line)
            plan, installed = probe_setup(manager, decision, vllm_batches)
        decision, plan = broadcast_from_rank0((decision, plan))
        run = state_of(manager).run = LoadRun()
        decision = agree_on_table(decision, plan, rank0, parallel_config(manager))
        run.decision = decision
        if decision.refuse:
            raise RuntimeError(decision.refuse)
        if not decision.load:
            yield from vllm_batches
            return
        limit = manager._cudagraph_limit
        warmups = list({b["num_tokens"]: b for b in vllm_batches if b["num_tokens"] > limit}.values())
        yield from warmups  # one per piecewise shape: its first run includes one-time work
        collector = P.active_collector() if decision.probe else None
        start = P.timed_count(collector) if collector is not None else None
        if start is None or plan is None or plan.note:
            if not decision.probe:
                return
            cause = plan.note if plan is not None and plan.note else \
                "vLLM's step timer is not reachable: plugin hook not active"
            why = f"load-time probe could not run ({cause}); table {decision.chosen.label} is unverified"
            if decision.policy == "strict":
                line = PREFIX + f"{why}; refusing to start (policy strict)"
                if rank0:
                    log.error(line)
                run.decision = replace(decision, load=False, refuse=line, lines=(line,))
                raise RuntimeError(line)
            if rank0:
                log.warning(PREFIX + "%s; loading it unprobed (policy %s)", why, decision.policy)
            return
        reader = probe_reader() if rank0 else None
        readings = [_read(reader)]
        t0 = time.perf_counter()
        yield from self._probe_batches(vllm_batches, plan)
        readings.append(_read(reader))  # the last steps may still run: read under load
        verdict = None
        if rank0:
            verdict = P.judge(installed, decision.pairs, P.resolve(collector, start), plan.steps)
            source = getattr(reader, "source", "")
            verdict = replace(verdict, seconds=time.perf_counter() - t0, steps=len(plan.steps),
                              conditions=P.conditions([r for r in readings if r is not None],
                                                      "" if source in ("nvml", "nvidia-smi") else "no NVML"))
        verdict = broadcast_from_rank0(verdict)  # TP ranks continue (or not) together
        agreed, why, _ = agree_across_dp("probe", (verdict.ok,), rank0, parallel_config(manager))
        if verdict.ok and agreed:
            run.priced = plan.contexts
            if rank0:
                # the load line's coverage was of every context that loads: said again of those priced
                priced = coverage(plan.contexts, max_model_len(manager) or None)
                left = (f"; contexts {', '.join(map(str, plan.skipped))} over the probe's budget ({plan.budget}): "
                        f"left out of the context-aware grid, which prices {priced}") if plan.skipped else ""
                log.info(PREFIX + "%s%s; keeping %s", verdict.summary(), left, decision.chosen.label)
            return
        why = why or f"{verdict.summary()}: table {decision.chosen.label} does not match this GPU's measured costs"
        if decision.policy == "warn" and not why.startswith("data-parallel"):
            if rank0:
                log.warning(PREFIX + "%s; loading it anyway (policy warn)", why)
            return
        line, level, refuse = _policy_line(decision.policy, why)
        if rank0:
            log.log(level, line)
        if refuse:
            run.decision = replace(decision, load=False, refuse=line, lines=(line,))
            raise RuntimeError(line)
        # fallback: vLLM's full profile, in this same generator; its samples only reach vLLM.
        run.strip = P.timed_count(collector) or 0
        run.decision = replace(decision, load=False, lines=(line,))
        yield from vllm_batches

    @staticmethod
    def _probe_batches(vllm_batches: list[dict], plan: P.Plan) -> list[dict]:
        """The plan's steps as vLLM's own dicts (the first of each size), at the step's context."""
        first = {}
        for b in vllm_batches:
            first.setdefault(b["num_tokens"], b)
        return [{**first[s.num_tokens], "context_len": s.context_len} for s in plan.steps]

    def install_curves(self, manager: Any, samples: list, original: Callable[[list], None]) -> None:
        run = state_of(manager).run
        decision = run.decision if isinstance(run, LoadRun) else None
        if decision is None or not decision.load:
            original(samples[run.strip if isinstance(run, LoadRun) else 0:])  # warm-ups and probe are not vLLM's
            return
        manager.set_cost_curves(list(decision.draft_curve), list(decision.verify_curve))
        curves = decision.curves
        if run.priced is not None:  # only what the probe judged is priced
            curves = {c: v for c, v in curves.items() if c in run.priced}
        if len(curves) >= 2:
            _context_aware(manager, curves, decision.context_len)


def _context_aware(manager: Any, curves: dict, static_context: int) -> None:
    """Price each step for its batch (context_aware.py: drafts at the mean context, verify by the
    KV the step reads), unless the env says no.
    The curves came from rank 0 with the decision: no broadcast needed here."""
    from dspark_calib.vllm import context_aware as ca
    from dspark_calib.vllm.engine_info import tp_rank_and_size

    rank0 = tp_rank_and_size()[0] == 0

    def setting(parse: Any, fallback: Any, taken: str) -> Any:
        """The env setting, or fallback with one WARNING (rank 0) naming it and what is done instead."""
        try:
            return parse()
        except CalibError as exc:
            if rank0:
                log.warning(PREFIX + "%s; %s", exc, taken)
            return fallback

    on = setting(E.context_aware_enabled, None, "context-aware costs off, static tables kept")
    if on is None:
        return
    if not on:
        if rank0:
            log.info(PREFIX + "context-aware costs off (%s=0): static tables at one context", E.CONTEXT_AWARE)
        return
    tail = setting(E.context_tail_milli, DEFAULT_CONTEXT_TAIL_MILLI,
                   f"the default tail {DEFAULT_CONTEXT_TAIL_MILLI / 1000:g} taken")
    chunks = setting(E.context_chunks_enabled, DEFAULT_CONTEXT_CHUNKS,
                     f"the default taken (chunk pricing {'on' if DEFAULT_CONTEXT_CHUNKS else 'off'})")
    # the engine's longest context: costs above the table's longest profiled one are extrapolated up to it
    far = min(max_model_len(manager), MAX_EXTRAPOLATE_TO)
    # the contexts priced (the probe may leave some out): recorded, so validate prices with the same
    policy = PricingPolicy(CONTEXT_AWARE, static_context=int(static_context), tail_milli=tail, chunks=chunks,
                           chunk_rule=CHUNK_RULE, extrapolate_to=far, contexts=tuple(sorted(int(c) for c in curves)))
    # never raises; every rank: the same grid
    line = ca.enable(manager, curves, policy, broadcast=False)
    if rank0:
        log.log(logging.WARNING if "static tables kept" in line else logging.INFO, line)

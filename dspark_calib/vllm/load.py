"""Load mode (DSPARK_CALIB_TABLE=PATH): install a saved table instead of profiling.

The decision itself is ``selection.decide`` (pure; ``check`` runs the same one
offline). Here it runs inside the engine: on TP rank 0 within the deadline
(DSPARK_CALIB_LOAD_TIMEOUT), broadcast in the TP group, then agreed across the DP
replicas (dp_agreement.py: through the world process group's store, within
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
from dspark_calib.table.sources import SERVE_LIMITS
from dspark_calib.vllm import probe as P
from dspark_calib.vllm.dp_agreement import agree_across_dp
from dspark_calib.vllm.runtime import log, state_of


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
            aware = False  # price_context_aware keeps the static tables then (its own WARNING)
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
            worst = verdict.worst
            verdict = replace(verdict, seconds=time.perf_counter() - t0, steps=len(plan.steps),
                              conditions=P.conditions([r for r in readings if r is not None],
                                                      "" if source in ("nvml", "nvidia-smi") else "no NVML",
                                                      worst.ratio if worst is not None else None))
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
            price_context_aware(manager, curves, decision.context_len)


def price_context_aware(manager: Any, curves: dict, static_context: int) -> None:
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

"""What observe mode records about a step at budget time (host side, no device work).

Right after vLLM's get_num_tokens chose a budget, ``capture_step`` reads from the
manager what the observed-step record needs besides the timings: the batch's
context (mean/max/sum of num_computed_tokens over the scheduled requests, and their
order statistics), the drafts scheduled and the budget chosen (``manager._batch_budget``), the costs
the engine's tables predicted for that step, and, when given the other
pricing's tables, the budget vLLM's rule would have chosen with them
(fit.choose_draft_budget: the same rule, tested equal to vLLM's). The timings
arrive later (observe.step.PendingSteps); ``to_observed`` joins the two.

Sampled steps only: this costs about one more get_num_tokens (the alternative
budget) on a sampled step, nothing on the others. Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import numpy as np

from dspark_calib.fit import choose_draft_budget
from dspark_calib.observe.step import ESTIMATOR, ObservedStep, context_quantiles
from dspark_calib.pricing.policy import STOCK, TABLE, PricingPolicy


@dataclass(frozen=True, slots=True)
class StepCapture:
    num_reqs: int
    context_sum: int
    context_max: int
    scheduled_drafts: int
    non_draft_tokens: int
    draft_budget: int
    priced_context: int
    predicted_draft_ms: float
    predicted_verify_ms: float
    alt_budget: int | None  # the budget under the other pricing (None: not computed)
    # the prefill chunks (requests with more than one non-draft token): tokens, computed tokens,
    # query-context pairs sum q (c + q) (rules.prefill_context_sum prices by them)
    prefill_tokens: int = 0
    prefill_context_sum: int = 0
    prefill_pairs: int = 0
    context_quantiles: tuple[int, ...] | None = None  # observe.step.context_quantiles of the requests

    @property
    def context_mean(self) -> float:
        return self.context_sum / self.num_reqs

    @property
    def num_target_tokens(self) -> int:
        return self.non_draft_tokens + self.draft_budget


def capture_step(manager: Any, num_tokens_per_req: Mapping[str, int], draft_tokens: Mapping[str, list],
                 *, priced_context: int, alt_tables: tuple[np.ndarray, np.ndarray] | None = None) -> StepCapture:
    """Call right after manager.get_num_tokens(num_tokens_per_req, draft_tokens) returned."""
    req_ids = list(num_tokens_per_req)
    n = len(req_ids)
    rs = manager.req_states
    slots = np.fromiter(map(rs.req_id_to_index.__getitem__, req_ids), dtype=np.intp, count=n)
    computed = rs.num_computed_tokens_np[slots].astype(np.int64)
    drafts_per_req, non_draft_per_req, budget = manager._batch_budget
    drafts = np.fromiter((drafts_per_req[r] for r in req_ids), dtype=np.int64, count=n)
    non_draft = np.fromiter((non_draft_per_req[r] for r in req_ids), dtype=np.int64, count=n)
    non_draft_total = int(non_draft.sum())
    chunk = non_draft > 1
    q, c = non_draft[chunk], computed[chunk]
    draft_table, verify_table = manager.cost_tables
    alt = None
    if alt_tables is not None:
        # vLLM's inputs to the rule, read as get_num_tokens read them
        conf = manager._stale_confidences[manager._stale_idx].np[slots]
        sampling = int(np.count_nonzero(computed + non_draft >= rs.prefill_len.np[slots]))
        alt = choose_draft_budget(alt_tables[0], alt_tables[1], conf, drafts, non_draft,
                                  num_sampling_requests=sampling, max_total_logits=manager._max_total_logits,
                                  num_bonus_tokens=manager.num_bonus_tokens)
    return StepCapture(
        num_reqs=n, context_sum=int(computed.sum()), context_max=int(computed.max()) if n else 0,
        scheduled_drafts=int(drafts.sum()), non_draft_tokens=non_draft_total, draft_budget=int(budget),
        priced_context=int(priced_context), predicted_draft_ms=float(draft_table[n]),
        predicted_verify_ms=float(verify_table[non_draft_total + budget]), alt_budget=alt,
        prefill_tokens=int(q.sum()), prefill_context_sum=int(c.sum()), prefill_pairs=int((q * (c + q)).sum()),
        context_quantiles=context_quantiles(computed) if n else None)


def acceptance_counts(num_sampled: Any, num_rejected: Any, positions: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(graded, accepted) per draft position from the rejection sampler's per-request counts.

    vLLM's num_sampled is the accepted drafts plus the bonus token (0 for a request still
    mid-prefill, which samples nothing), num_rejected the verified drafts after the first
    rejection; so a = num_sampled - 1 drafts were accepted out of d = a + num_rejected verified.
    Position i is graded where a >= i and d > i, accepted where a > i: the drafts vLLM's
    acceptance estimator labels (``_accumulate_kernel``: observed, label)."""
    sampled = np.asarray(num_sampled, dtype=np.int64)
    keep = sampled > 0
    a = sampled[keep] - 1
    d = a + np.asarray(num_rejected, dtype=np.int64)[keep]
    i = np.arange(positions)[:, None]
    graded = ((a[None, :] >= i) & (d[None, :] > i)).sum(axis=1)
    accepted = (a[None, :] > i).sum(axis=1)
    return tuple(int(x) for x in graded), tuple(int(x) for x in accepted)


def to_observed(capture: StepCapture, *, step: int, forward_ms: float, drafter_ms: float, num_target_tokens: int,
                full_cudagraph: bool, context_aware: bool,
                acceptance: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                estimator: tuple[int, int, float, tuple[float, ...]] | None = None,
                gpu: tuple[float | None, float | None] = (None, None),
                host: tuple[float | None, float | None] = (None, None)) -> ObservedStep:
    """The observed record: the capture plus the step's resolved timings (vLLM's StepTimingSample
    fields). context_aware: the engine priced with the grid (the alternative is single-context).
    acceptance: acceptance_counts of the step's verification (None: not read). estimator: the
    acceptance estimator's (refits, steps, slope, intercepts) at this step (None: not read). gpu: the
    GPU's (SM MHz, W) as last sampled when the step was (None: not read). host: the host's
    (step_interval_ms, host_ms) around the step's execute_model call (None: not known)."""
    chosen, alt = capture.draft_budget, capture.alt_budget
    return ObservedStep(
        step=step, forward_ms=float(forward_ms), drafter_ms=float(drafter_ms),
        num_target_tokens=int(num_target_tokens), num_reqs=capture.num_reqs, full_cudagraph=bool(full_cudagraph),
        context_mean=capture.context_mean, context_max=capture.context_max, context_sum=capture.context_sum,
        scheduled_drafts=capture.scheduled_drafts, draft_budget=chosen, priced_context=capture.priced_context,
        predicted_draft_ms=capture.predicted_draft_ms, predicted_verify_ms=capture.predicted_verify_ms,
        budget_static=alt if context_aware else chosen, budget_context_aware=chosen if context_aware else alt,
        prefill_tokens=capture.prefill_tokens, prefill_context_sum=capture.prefill_context_sum,
        prefill_pairs=capture.prefill_pairs, position_graded=None if acceptance is None else acceptance[0],
        position_accepted=None if acceptance is None else acceptance[1],
        **dict(zip(ESTIMATOR, estimator or (None,) * len(ESTIMATOR))), gpu_sm_mhz=gpu[0], gpu_power_w=gpu[1],
        step_interval_ms=host[0], host_ms=host[1], context_quantiles=capture.context_quantiles)


# -- how the engine prices its steps (read once, at the first sampled step) ----------------------
@dataclass(frozen=True)
class Pricing:
    """How this engine prices its steps (read at the first sampled step: the table loads after install):
    its policy, and what observe mode needs besides it."""

    policy: PricingPolicy
    alt_tables: Any = None  # the static tables when the engine prices context-aware (budget_static)
    table_hash: str = ""


def last_context(manager: Any, default: int) -> int:
    from dspark_calib.vllm.context_aware import installed_state

    state = installed_state(manager)
    return state.last_context if state is not None and state.last_context >= 0 else default


def pricing_for(stock_context: int) -> Callable[[Any], Pricing]:
    """How the manager prices steps once its start-up is done: context-aware grid, a loaded
    table's one context, or vLLM's own profile (stock_context: its clamped profile context)."""

    def pricing(manager: Any) -> Pricing:
        from dspark_calib.vllm.context_aware import installed_state
        from dspark_calib.vllm.runtime import state_of

        decision = getattr(state_of(manager).run, "decision", None)
        loaded = bool(getattr(decision, "load", False))
        static = int(decision.context_len) if loaded else int(stock_context)
        table_hash = str(decision.content_hash) if loaded else ""
        ca = installed_state(manager)
        if ca is not None:
            return Pricing(replace(ca.policy, static_context=static), ca.base_tables, table_hash)
        return Pricing(PricingPolicy(TABLE if loaded else STOCK, static), None, table_hash)

    return pricing


def stock_context(runner: Any) -> int:
    from dspark_calib.fit import profile_context_len
    from dspark_calib.vllm.engine_info import current_context_len

    ctx = current_context_len()
    mml = getattr(runner, "max_model_len", None)
    return profile_context_len(ctx, mml) if isinstance(mml, int) and mml > 0 else ctx

"""The integer rules that turn a serving step into the context its costs are read at.

A table's point (N tokens, context L) was timed on vLLM's profiling dummy batch:
R(N) = min(N, max_num_reqs) requests, each with L tokens of KV, so its attention
read R(N) x L KV tokens. A serving step reads S, the sum of its requests' computed
tokens, so its verify cost at N is the table's at S / R(N) (``verify_context``);
drafts are keyed by requests and priced at the mean. Mixed contexts are priced at
S + t min(G, S^2 / G), G = n max - S (``tail_context_sum``), prefill chunks by their
query-context pairs (``prefill_context_sum``, at a rule's pair price: ``chunk_kv_ratio``).
docs/pricing.md gives the reasoning and the measurements behind each rule.

Integers only where the engine uses them: every TP rank computes the same value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark_calib.errors import CalibError
from dspark_calib.pricing.policy import (CHUNK_RULE, CHUNK_RULE_PER_STEP, CHUNK_RULES, MAX_TAIL_MILLI, TAIL_RULE,
                                         TAIL_RULES)


def profile_requests(num_tokens: int, max_num_reqs: int) -> int:
    """Requests in vLLM's profiling dummy batch of num_tokens tokens: ``_dummy_run``'s
    ``min(num_tokens, self.max_num_reqs)`` (its speculator bound, max_num_batched_tokens //
    num_query_per_req, is above max_num_reqs for DSpark)."""
    return min(int(num_tokens), int(max_num_reqs))


def verify_context(context_sum: int, num_tokens: int, max_num_reqs: int) -> int:
    """The profiled context whose verify cost at num_tokens matches a step reading context_sum KV
    tokens: ceil(S / R(N)) (see the module docstring). Integers only: identical on every rank."""
    return -(-int(context_sum) // max(1, profile_requests(num_tokens, max_num_reqs)))


def tail_context_sum(context_sum: Any, context_max: Any, num_reqs: Any, tail_milli: int, rule: str = TAIL_RULE) -> Any:
    """The KV sum a step is priced at with the mixed-context tail: S + t min(G, S^2 / G), G = n max - S
    (the batch's gap to a uniform batch at its longest context), t = tail_milli / 1000, each division
    rounded down. In mean terms: mean + t min(g, mean^2 / g), g = max - mean.

    Up to max = 2 x mean (G <= S) every request is charged t of its gap: a mix of several long
    requests among shorter ones runs at the pace of its long ones. Past it the charge falls as
    mean / g: at most S / max requests can be that long, and one long request among many short
    ones is cut by the attention kernel into pieces run beside the short ones (FlashAttention's
    split of a request longer than an SM's share of the step), so it costs about its KV.
    docs/pricing.md gives the measurements. rule TAIL_RULE_LINEAR is the first rule, S + t G at
    every gap: what engines before it priced with (their observe files record it), so validate and
    calibrate price their steps as they were priced. Integers only (identical on every rank);
    scalars or numpy arrays alike; tail_milli 0 returns S unchanged."""
    if not tail_milli:
        return context_sum
    gap = context_max * num_reqs - context_sum
    if not isinstance(gap, np.ndarray):  # the engine's plain integers, once per step: no numpy call
        if gap > context_sum and rule == TAIL_RULE:  # (the engine's rule is TAIL_RULE: install checks it)
            gap = context_sum * context_sum // gap
        return context_sum + (tail_milli * gap) // MAX_TAIL_MILLI
    if rule not in TAIL_RULES:
        raise CalibError(f"unknown tail rule {rule!r} (known: {', '.join(TAIL_RULES)})")
    total, gap = np.broadcast_arrays(np.asarray(context_sum, dtype=np.int64), gap)
    charged = gap.copy()
    far = (gap > total) if rule == TAIL_RULE else np.zeros(gap.shape, dtype=bool)
    if far.any():  # S^2 can pass int64's range: Python's integers, exact as the engine's
        s = total[far].astype(object)
        charged[far] = (s * s // gap[far].astype(object)).astype(np.int64)
    return total + (tail_milli * charged) // MAX_TAIL_MILLI


def prefill_context_sum(context_sum: Any, chunk_context_sum: Any, chunk_pairs: Any, kv_reqs: Any,
                        kv_tokens: Any) -> Any:
    """The KV sum a step carrying prefill chunks is priced at (module docstring): the decode
    requests' own KV plus the chunks' query-context pairs P at kv_reqs / kv_tokens KV tokens a
    pair, (S - S_p) + ceil(kv_reqs P / kv_tokens); chunk_kv_ratio gives the two for a rule.
    Integers only; scalars or numpy arrays alike; P = 0 returns S."""
    out = context_sum - chunk_context_sum + -(-(kv_reqs * chunk_pairs) // kv_tokens)
    if type(out) is int:  # the engine's plain integers (once per chunk step): no numpy call
        return out
    return int(out) if np.ndim(out) == 0 else out


def chunk_kv_ratio(rule: str, profile_num_reqs: int, profile_num_tokens: int, num_tokens: Any = None) -> tuple[Any, Any]:
    """(kv_reqs, kv_tokens) of prefill_context_sum under a chunk rule: the profile's largest step
    (CHUNK_RULE; constants), or the step's own N (CHUNK_RULE_PER_STEP; num_tokens: the steps'
    non-draft tokens, as the engines of that rule took them)."""
    if rule == CHUNK_RULE:
        return min(int(profile_num_tokens), int(profile_num_reqs)), int(profile_num_tokens)
    if rule == CHUNK_RULE_PER_STEP:
        tokens = np.maximum(np.asarray(num_tokens, dtype=np.int64), 1)
        return np.minimum(tokens, int(profile_num_reqs)), tokens
    raise CalibError(f"unknown chunk pricing rule {rule!r} (known: {', '.join(CHUNK_RULES)})")


def ceil_mean(total: int, count: int) -> int:
    """ceil(total / count) in integers: the batch's mean context, rounded up (exact, no floats)."""
    return -(-int(total) // int(count))

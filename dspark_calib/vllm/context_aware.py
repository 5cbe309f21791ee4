"""Context-aware mode: every step's draft budget priced at the batch's own context.

vLLM's ``AdaptiveVerificationManager.get_num_tokens`` prices a step with
``self.cost_tables``, built once from curves profiled at one context length.
``install(manager, grid)`` puts a per-instance wrapper in front of it that, each
step, sums ``num_computed_tokens`` over the scheduled requests (the manager's
``req_states`` holds them; vLLM's rule reads the same array), sets
``manager.cost_tables`` to the grid's tables for that step (drafts at the mean
context, verify at the context whose profiled batch read as much KV:
grid.ContextGrid.step_tables, two row lookups) and then calls vLLM's own
get_num_tokens, so the budget rule itself stays vLLM's. With a tail (``install(...,
tail_milli=)``, DSPARK_CALIB_CONTEXT_TAIL) the sum is raised towards the batch's
longest context first (rules.tail_context_sum: mixed batches run slower than their
mean says); that needs the max as well, one more reduction over the same slots. With
chunk pricing (``install(..., chunks=True)``, DSPARK_CALIB_CONTEXT_CHUNKS) a step whose
batch holds a request without drafts looks for prefill chunks (chunk_verify_sum) and
prices its verify by their query-context pairs (rules.prefill_context_sum); drafts stay
at the mean. Decode steps (every request drafted) pay one length comparison.

Tensor parallelism: every rank's req_states holds the same scheduler state, so
every rank computes the same context and picks the same grid row: no collective
per step. The grid itself must be the same on every rank: ``grid_for_manager``
broadcasts the curves from TP rank 0 once at load (as vLLM's set_cost_curves
does for its one pair), so ranks that read the table file separately cannot
drift.

Imports vLLM only inside grid_for_manager (the broadcast); install works on any
object shaped like the manager.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from dspark_calib.errors import PREFIX, exception_line
from dspark_calib.pricing.grid import DEFAULT_MAX_BYTES, DEFAULT_TOLERANCE, ContextGrid, StepBuffer
from dspark_calib.pricing.policy import MAX_TAIL_MILLI
from dspark_calib.pricing.costs import ContextCosts, curves_for_broadcast
from dspark_calib.pricing.policy import CONTEXT_AWARE, TAIL_RULE, PricingPolicy
from dspark_calib.pricing.rules import prefill_context_sum, tail_context_sum
from dspark_calib.vllm.runtime import peek_state, state_of

# Below this many requests a Python sum beats numpy's fixed costs (measured on CPU,
# see benchmarks/micro/bench_context_aware.py); above it the array path wins.
_SMALL_BATCH = 48
# From this many requests the held-slot path (the slots of every held request but a few unscheduled
# ones, kept between steps: _held_slots) beats looking the ids up.
_TINY_BATCH = 8
# Up to this many requests the held-slot path reduces in Python (tolist, sum, max: ~1.5 us at 32);
# above it with two numpy reductions (~1 us each, whatever the size).
_LIST_BATCH = 64


class ContextAwareState:
    """What install() keeps on the manager: enough to run the step and to undo it."""

    __slots__ = ("grid", "base_tables", "original", "wrapper", "last_context", "stacked", "policy",
                 "generation", "keys", "slots", "slots_generation", "watched", "buffer", "active", "tail", "chunks",
                 "chunk_ratio", "active_slots", "active_generation", "missing", "missing_slots", "missing_generation", "scratch")

    def __init__(self, grid: ContextGrid | None, base_tables: Any, original: Callable, wrapper: Callable | None = None,
                 stacked: bool = False, policy: PricingPolicy | None = None):
        self.grid = grid  # None after an uninstall that could not unwrap (another wrapper on top)
        self.policy = policy or PricingPolicy(CONTEXT_AWARE)
        # the policy's two settings the step reads, as plain attributes (one lookup each per step)
        self.tail = int(self.policy.tail_milli)  # the mixed-context tail in thousandths (0: the mean)
        self.chunks = bool(self.policy.chunks)  # price prefill chunks by their query-context pairs
        # a pair's KV tokens (policy.CHUNK_RULE: the profile's largest step), constants per grid
        self.chunk_ratio = _chunk_ratio(grid)
        self.base_tables = base_tables
        self.original = original
        self.wrapper = wrapper
        self.stacked = stacked  # original is another instance wrapper (e.g. observe mode's)
        self.last_context = -1  # the context the last step's drafts were priced at (for observe mode)
        self.buffer = StepBuffer(grid) if grid is not None else None  # this manager's verify table
        # The slots of the last large batch, reused while the same requests are scheduled and
        # no request was added or removed since (a removed and re-added request may change
        # slot): decode batches repeat, and looking 256 ids up is most of the step's cost.
        self.generation = 0  # bumped by every req_states.add_request / remove_request
        self.keys: tuple = ()
        self.slots: Any = None
        self.slots_generation = -1
        self.watched: tuple = ()  # the req_states methods we wrapped (for uninstall)
        # Which slots hold a request (kept by the same wrappers): when a step schedules every
        # request req_states holds (decode at full occupancy, the common case), its context sum
        # is a reduction over those slots, even if the batch changed since the last step.
        self.active: Any = None
        # The occupied slots (np.flatnonzero(active)) as of generation active_generation.
        self.active_slots: Any = None
        self.active_generation = -1
        # The held requests the last step with a few unscheduled ones left out (ids, any order), and
        # the slots of the others as of generation missing_generation (_held_slots).
        self.missing: tuple = ()
        self.missing_slots: Any = None
        self.missing_generation = -1
        self.scratch: Any = None  # a mask like active, to build missing_slots in


def batch_context_sum(req_states: Any, num_tokens_per_req: Mapping[str, int]) -> int:
    """Sum of num_computed_tokens over the scheduled requests (the dict's keys)."""
    n = len(num_tokens_per_req)
    index = req_states.req_id_to_index.__getitem__
    computed = req_states.num_computed_tokens_np
    if n <= _SMALL_BATCH:
        return sum(map(computed.item, map(index, num_tokens_per_req)))
    slots = np.fromiter(map(index, num_tokens_per_req), dtype=np.intp, count=n)
    return int(computed[slots].sum(dtype=np.int64))


def chunk_verify_sum(context_sum: int, num_tokens_per_req: Mapping[str, int], draft_tokens: Mapping[str, Any],
                     index: Callable[[str], int], computed: np.ndarray, kv_reqs: int, kv_tokens: int) -> int | None:
    """The verify KV sum of a step with prefill chunks (rules.prefill_context_sum at the rule's
    kv_reqs / kv_tokens), None when it has none. A chunk is a scheduled request with more than one
    non-draft token, split as vLLM's get_num_tokens splits (q - len(draft_tokens.get(r, ()))), so
    the engine and observe's columns (and validate) see the same chunks. Integers only: every
    rank agrees. The caller runs it only when some request has no drafts (vLLM 0.33 lists only
    requests with drafts in draft_tokens, and schedules drafts only for decoding requests)."""
    chunk_sum = pairs = 0
    drafts_of = draft_tokens.get
    for r, q in num_tokens_per_req.items():
        d = drafts_of(r)
        if d:
            q -= len(d)
        if q > 1:
            c = computed.item(index(r))
            chunk_sum += c
            pairs += q * (c + q)
    if not pairs:
        return None
    return prefill_context_sum(context_sum, chunk_sum, pairs, kv_reqs, kv_tokens)


def _make_wrapper(manager: Any, state: ContextAwareState) -> Callable[[dict, dict], int]:
    original = state.original
    small, tiny, listed = _SMALL_BATCH, _TINY_BATCH, _LIST_BATCH
    intp, int64, add_reduce, max_reduce = np.intp, np.int64, np.add.reduce, np.maximum.reduce

    def get_num_tokens(num_tokens_per_req: dict[str, int], draft_tokens: dict[str, list[int]]) -> int:
        n = len(num_tokens_per_req)
        grid = state.grid
        if n and grid is not None:
            # batch_context_sum, inlined: this runs every step.
            req_states = manager.req_states
            held = req_states.req_id_to_index
            index = held.__getitem__
            computed = req_states.num_computed_tokens_np
            tail = state.tail
            slots = None
            if n >= tiny and 4 * (unscheduled := len(held) - n) <= n and state.watched \
                    and state.watched[0][0] is req_states:
                # watched: the occupied-slot mask is kept
                if n > listed and not tail:  # a sum only: one masked reduction, over the held slots
                    if not unscheduled:
                        slots = state.active
                    elif _held_slots(state, held, num_tokens_per_req, unscheduled) is not None:
                        slots = state.scratch  # the held slots less the unscheduled ones' (as a mask)
                    if slots is not None:
                        total = int(add_reduce(computed, where=slots, dtype=int64))
                else:
                    slots = _held_slots(state, held, num_tokens_per_req, unscheduled)
                    if slots is not None:
                        # The same sum and max as looking every id up (integers: any order), over the
                        # slots of the held requests less the unscheduled ones'; every held one
                        # scheduled: the max is clamped at 0, as the masked reduction this replaces
                        # did (contexts are >= 0, so it never bites).
                        if n <= listed:
                            values = computed[slots].tolist()
                            total = sum(values)
                            if tail:
                                top = max(values)
                        else:
                            values = computed[slots]
                            total = int(add_reduce(values, dtype=int64))
                            top = int(max_reduce(values))  # tail on (a sum only took the mask above)
                        if tail:
                            if not unscheduled and top < 0:
                                top = 0
                            total = tail_context_sum(total, top, n, tail)
            if slots is None:  # look the ids up
                if n <= small:
                    if tail:
                        values = list(map(computed.item, map(index, num_tokens_per_req)))
                        total = tail_context_sum(sum(values), max(values), n, tail)
                    else:
                        total = sum(map(computed.item, map(index, num_tokens_per_req)))
                else:
                    keys = tuple(num_tokens_per_req)
                    if keys == state.keys and state.slots_generation == state.generation and state.watched:
                        slots = state.slots
                    else:
                        slots = np.fromiter(map(index, keys), dtype=intp, count=n)
                        state.keys, state.slots, state.slots_generation = keys, slots, state.generation
                    values = computed[slots]
                    total = int(values.sum())
                    if tail:
                        total = tail_context_sum(total, int(values.max()), n, tail)
            state.last_context = -(-total // n)  # ceil(mean): integers only, identical on every rank
            verify_sum = None  # the KV sum, as drafts
            if state.chunks and len(draft_tokens) < n:  # a request without drafts: maybe a prefill chunk
                verify_sum = chunk_verify_sum(total, num_tokens_per_req, draft_tokens, index, computed,
                                              *state.chunk_ratio)
            manager.cost_tables = grid.step_tables(total, n, state.buffer, verify_sum)
        return original(num_tokens_per_req, draft_tokens)

    return get_num_tokens


def _held_slots(state: ContextAwareState, held: Mapping[str, int], scheduled: Mapping[str, int],
                unscheduled: int) -> Any:
    """The slots of the scheduled requests, sorted, when they are every held request but
    ``unscheduled`` of them (a count of held less scheduled); None when that cannot be shown (the
    caller looks the ids up). Kept between steps: the occupied slots (state.active, kept by the
    add/remove_request wrappers) per generation, and the unscheduled ids with the slots of the
    rest. Reused only when exact: the unscheduled ids are all still held and none is scheduled, and
    there are as many as held less scheduled, so the scheduled ids (held, or vLLM's own lookup
    raises KeyError) are the rest of the held ones, whatever their order. While the slots returned
    for unscheduled > 0 are current, state.scratch holds them as a mask."""
    generation = state.generation
    if not unscheduled:
        if state.active_generation != generation:
            state.active_slots = np.flatnonzero(state.active)
            state.active_generation = generation
        return state.active_slots
    missing = state.missing
    same = len(missing) == unscheduled
    if same:
        for r in missing:
            if r in scheduled or r not in held:
                same = False
                break
    if same:
        if state.missing_generation == generation:
            return state.missing_slots
    else:  # other ids sit out this step: find them (one pass in C)
        missing = tuple(held.keys() - scheduled.keys())
        if len(missing) != unscheduled:  # a scheduled id that is not held: the lookup path
            return None
        state.missing = missing
    mask = state.scratch
    if mask is None or len(mask) != len(state.active):
        mask = state.scratch = np.empty_like(state.active)
    np.copyto(mask, state.active)
    mask[[held[r] for r in missing]] = False
    state.missing_slots = np.flatnonzero(mask)
    state.missing_generation = generation
    return state.missing_slots


def _chunk_ratio(grid: ContextGrid | None) -> tuple[int, int]:
    return (1, 1) if grid is None else grid.costs.chunk_ratio()


def install(manager: Any, grid: ContextGrid, policy: PricingPolicy | None = None) -> ContextAwareState:
    """Make this manager's get_num_tokens price each step for its batch (drafts at the mean
    context, verify by the KV the step reads: ContextGrid.step_tables).

    Per instance (other managers in the process are untouched) and idempotent: a
    second install replaces the grid and keeps the original method and tables. It
    wraps what is there: vLLM's method, or another instance wrapper (observe mode's),
    so the two compose in either order. The policy's tail_milli: the mixed-context tail in
    thousandths (rules.tail_context_sum; 0 prices at the plain KV sum); its chunks: price prefill
    chunks by their query-context pairs (chunk_verify_sum; off: by the KV sum, like decode).
    The default policy: context-aware, no tail, no chunk pricing.
    """
    policy = policy or PricingPolicy(CONTEXT_AWARE)
    if not 0 <= int(policy.tail_milli) <= MAX_TAIL_MILLI:
        raise ValueError(f"tail_milli must be between 0 and {MAX_TAIL_MILLI}, got {policy.tail_milli}")
    if policy.tail_rule != TAIL_RULE:  # the step prices by this release's rule only; the policy must say so
        raise ValueError(f"the engine prices the tail by the {TAIL_RULE} rule, not {policy.tail_rule!r}")
    state = installed_state(manager)
    if state is not None:
        state.grid, state.buffer, state.policy = grid, StepBuffer(grid), policy
        state.tail, state.chunks = int(policy.tail_milli), bool(policy.chunks)
        state.chunk_ratio = _chunk_ratio(grid)
        return state
    own = manager.__dict__.get("get_num_tokens")
    original = own if own is not None else type(manager).get_num_tokens.__get__(manager)
    state = ContextAwareState(grid, manager.cost_tables, original, stacked=own is not None, policy=policy)
    state.wrapper = _make_wrapper(manager, state)
    state.watched = _watch_slots(getattr(manager, "req_states", None), state)
    state_of(manager).context_aware = state
    manager.get_num_tokens = state.wrapper
    return state


def _watch_slots(req_states: Any, state: ContextAwareState) -> tuple:
    """Count slot changes and keep the occupied-slot mask (vLLM's RequestState maps ids to slots
    only in these two methods: add_request pops a free slot, remove_request returns the one it
    frees). Without them both caches stay off: every step looks its ids up."""
    names = ("add_request", "remove_request")
    if req_states is None or not all(callable(getattr(req_states, n, None)) for n in names):
        return ()
    ids = req_states.req_id_to_index
    active = np.zeros(len(req_states.num_computed_tokens_np), dtype=bool)
    active[list(ids.values())] = True  # requests added before install
    state.active = active
    add, remove = req_states.add_request, req_states.remove_request

    def add_request(*args: Any, **kwargs: Any) -> Any:
        state.generation += 1
        req_id = args[0] if args else kwargs.get("req_id")
        old = ids.get(req_id)
        out = add(*args, **kwargs)
        new = ids.get(req_id)
        if old is not None and old != new:  # re-added under a new slot: the old one is no longer its
            active[old] = False
        if new is not None:
            active[new] = True
        return out

    def remove_request(*args: Any, **kwargs: Any) -> Any:
        state.generation += 1
        slot = remove(*args, **kwargs)
        if isinstance(slot, (int, np.integer)) and 0 <= slot < len(active):
            active[slot] = False
        return slot

    for name, wrapper, inner in (("add_request", add_request, add), ("remove_request", remove_request, remove)):
        wrapper.__wrapped__ = inner  # type: ignore[attr-defined]
        setattr(req_states, name, wrapper)
    return tuple((req_states, name) for name in names)


def uninstall(manager: Any) -> bool:
    """Back to vLLM's get_num_tokens and the tables it had at install; False if not installed."""
    state = installed_state(manager)
    if state is None:
        return False
    if manager.__dict__.get("get_num_tokens") is state.wrapper:
        if state.stacked:
            manager.get_num_tokens = state.original
        else:
            del manager.get_num_tokens
    state.grid = None  # a wrapper put on top of ours still calls it: it now passes straight through
    for owner, name in state.watched:
        if getattr(owner.__dict__.get(name), "__wrapped__", None) is not None:
            del owner.__dict__[name]  # the class's method again
    state.watched, state.active = (), None
    manager.cost_tables = state.base_tables
    state_of(manager).context_aware = None
    return True


def is_installed(manager: Any) -> bool:
    return installed_state(manager) is not None


def installed_state(manager: Any) -> ContextAwareState | None:
    state = peek_state(manager)
    return state.context_aware if state is not None else None


def grid_for_manager(manager: Any, curves: Mapping[int, Any], *, broadcast: bool = True, extrapolate_to: int = 0,
                     tolerance: float = DEFAULT_TOLERANCE, max_bytes: int = DEFAULT_MAX_BYTES) -> ContextGrid:
    """The grid for this engine: curves from TP rank 0, sizes from the manager.

    Call it where the load decision installs curves (after batches_to_profile has set
    ``_cudagraph_limit``): a profiled context's grid row then equals what vLLM's
    set_cost_curves builds from that context's curves, bit for bit. With
    broadcast (a collective: every TP rank must call it) the curves are rank 0's;
    pass broadcast=False only for curves that already came from rank 0 (the
    loader's Decision is broadcast before install).
    """
    curves = curves_for_broadcast(curves)
    if broadcast:
        import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av

        curves = av.get_tp_group().broadcast_object(curves, src=0)
    rs = manager.req_states
    costs = ContextCosts(curves, rs.max_num_reqs, rs.max_num_batched_tokens, manager._cudagraph_limit,
                         extrapolate_to=extrapolate_to)
    return ContextGrid(costs, tolerance=tolerance, max_bytes=max_bytes)


def enable(manager: Any, curves: Mapping[int, Any], policy: PricingPolicy | None = None, *,
           broadcast: bool = False) -> str:
    """What load mode calls after installing its curves: context-aware when the table has two or
    more contexts. Returns the one line to log; never raises (the engine keeps the static tables)."""
    if len(curves) < 2:
        return PREFIX + "context-aware costs off: the table profiles one context"
    policy = policy or PricingPolicy(CONTEXT_AWARE)
    tail_milli, chunks = policy.tail_milli, policy.chunks
    try:
        grid = grid_for_manager(manager, curves, broadcast=broadcast, extrapolate_to=policy.extrapolate_to)
        install(manager, grid, policy)
    except Exception as exc:  # noqa: BLE001 - a serving engine must not die of an optional mode
        return PREFIX + f"context-aware costs off ({exception_line(exc)}); static tables kept"
    lo, hi = grid.contexts[0], grid.contexts[-1]
    return (PREFIX + f"context-aware costs on: contexts {lo}..{hi} ({len(grid.contexts)} profiled), grid "
            f"{len(grid)} points, {grid.nbytes / 2**20:.1f} MiB, within {100 * grid.max_rel_error:.2f}% of the "
            f"interpolation; verify priced by the KV a step reads; below {lo} costs are extrapolated linearly, "
            + (f"above {hi} too, up to {grid.costs.extrapolate_to} (max_model_len)" if grid.costs.extrapolates_above
               else f"above {hi} they are {hi}'s") + "; mixed batches priced at "
            + (f"mean + {tail_milli / MAX_TAIL_MILLI:g} x min(max - mean, mean^2 / (max - mean))" if tail_milli
               else "their mean context")
            + "; prefill chunks priced by " + ("their query-context pairs (a pair = {}/{} KV tokens)".format(
                *grid.costs.chunk_ratio()) if chunks else "the KV sum"))

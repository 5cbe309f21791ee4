"""Which verification wins where: fixed K against adaptive verification, modelled from a table.

For a decode batch of n requests at context L (every request has L computed tokens and
k = num_speculative_tokens drafts scheduled) and an acceptance schedule r (r[i]: the
probability that the first i+1 drafts of a request are all accepted, vLLM's
``synthetic_acceptance_rates``), the modelled goodput (generated tokens per ms) of:

* fixed K = 1..k (adaptive verification off): every request verifies K drafts and yields
  1 + r[0] + ... + r[K-1] tokens; the step costs draft(n) + verify(n (1 + K));
* adaptive verification, priced context-aware: vLLM's rule (``fit.choose_draft_budget``,
  tested equal to ``AdaptiveVerificationManager.get_num_tokens``) with the per-position
  survival probabilities equal to the schedule, deciding with the tables the
  context-aware plugin installs for this step (``ContextGrid.step_tables``);
* adaptive verification priced at one context (stock vLLM's start-up profile, or a table
  loaded without context-aware pricing): the same rule deciding with the dense tables of
  the table's default context, the step then costing what it costs at L.

Every step is costed at L as the context-aware engine prices it (the grid: drafts at the
mean context, verify by the KV the step reads, ``pricing.rules.verify_context``); each
context's dense tables are vLLM's (``build_cost_tables_from_curves``). The draft cost is
the table's draft curve at n, whatever K: what vLLM charges a step.

The model knows the acceptance exactly, and adaptive verification chooses the budget that
maximises this same ratio over every budget, fixed K's included (b = n K), so adaptive
priced at the step's own context is never below the best fixed K here. Adaptive
verification loses in the model when it decides with other prices than the step pays (one
context for every step) or when its one-chunk logit limit caps the budget below a fixed
K's drafts (``vocab_size``). What the model leaves out (estimated instead of exact
acceptance, the per-step host work of choosing a budget, variable-length graphs) is why a
change away from adaptive verification is advised only for a gain of at least
``min_gain`` (1 %).

Over a mix of decode steps (``predict_steps``: the (batch size, context) of each step a
workload served, e.g. from observe files), each step is modelled as a cell and an option's
goodput is its tokens over its time summed over the steps: each step counts by its length,
as a workload's time is the sum of its steps'.

Acceptance from observe files: per position, the drafts graded (all before it accepted,
itself verified) and accepted, summed over the files' steps; the schedule is the
Kaplan-Meier product of the per-position acceptance ratios, as vLLM's online acceptance
estimator labels drafts.

Analysis only: numpy, no torch, no vllm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from dspark_calib.errors import CalibError, display_path
from dspark_calib.fit import choose_draft_budget
from dspark_calib.observe.file import ObservedSteps
from dspark_calib.observe.step import ABSENT, decode_steps
from dspark_calib.pricing.costs import ContextCosts
from dspark_calib.pricing.grid import ContextGrid
from dspark_calib.pricing.policy import MAX_EXTRAPOLATE_TO

MIN_GAIN = 0.01  # a change away from adaptive verification needs at least this gain
ADAPTIVE = "adaptive"
# vLLM's rejection sampler verifies one chunk of at most 2**30 bytes of fp32 logits
# (get_max_chunk_logits); adaptive verification's budget must fit it, fixed K is chunked.
MAX_CHUNK_LOGIT_BYTES = 1 << 30


def fixed(k: int) -> str:
    return f"K={k}"


# -- the acceptance schedule -----------------------------------------------------------------
def parse_rates(text: str, option: str = "--acceptance") -> tuple[float, ...]:
    """'0.9,0.8,0.7' -> (0.9, 0.8, 0.7); CalibError naming the option for anything else."""
    parts = [p.strip() for p in str(text).replace(" ", ",").split(",") if p.strip()]
    try:
        rates = tuple(float(p) for p in parts)
    except ValueError:
        raise CalibError(f"{option} {str(text)[:60]!r}: want comma-separated rates, e.g. 0.9,0.8,0.7") from None
    if not rates:
        raise CalibError(f"{option}: no rates given")
    return rates


def check_schedule(rates: Sequence[float], k: int, what: str = "--acceptance") -> tuple[float, ...]:
    """k non-increasing rates in [0, 1] (entry i: the first i+1 drafts all accepted), else CalibError."""
    rates = tuple(float(r) for r in rates)
    shown = ",".join(f"{r:g}" for r in rates[:12]) + (",..." if len(rates) > 12 else "")
    if len(rates) != k:
        raise CalibError(f"{what} {shown}: {len(rates)} rates, the table's num_speculative_tokens is {k} "
                         f"(one rate per draft position)")
    bad = [r for r in rates if not (math.isfinite(r) and 0.0 <= r <= 1.0)]
    if bad:
        raise CalibError(f"{what} {shown}: {bad[0]:g} is not a rate in [0, 1]")
    for i in range(1, k):
        if rates[i] > rates[i - 1]:
            raise CalibError(f"{what} {shown}: rate {i + 1} ({rates[i]:g}) is above rate {i} ({rates[i - 1]:g}); "
                             "rate i is the probability that the first i drafts are all accepted, so the rates never rise")
    return rates


@dataclass(frozen=True)
class Acceptance:
    """The schedule advise models with, and where it came from."""

    rates: tuple[float, ...]
    source: str  # "given" or "observed"
    files: tuple[str, ...] = ()
    steps: int = 0  # observed steps that graded a draft
    graded: tuple[int, ...] = ()  # per position, drafts graded (observed)
    accepted: tuple[int, ...] = ()

    @property
    def tokens_per_step(self) -> float:
        """1 + the expected accepted drafts of a request verifying all k."""
        return 1.0 + sum(self.rates)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rates": list(self.rates), "source": self.source,
                               "tokens_per_step_all_drafts": self.tokens_per_step}
        if self.source == "observed":
            out.update(files=list(self.files), steps=self.steps, graded=list(self.graded),
                       accepted=list(self.accepted))
        return out


def observed_acceptance(table: Any, observed: ObservedSteps) -> Acceptance:
    """The schedule the observe files measured (Kaplan-Meier over the per-position counts), after
    checking that every file comes from an engine of the table's fingerprint."""
    fp = table.fingerprint
    k = int(fp.num_speculative_tokens)
    for path, meta in zip(observed.files, observed.metadata):
        if not meta.check_engine(fp, path):
            raise CalibError("records no engine fingerprint (observe files before schema 1.2 record no acceptance "
                             "either): give --acceptance", path=path)
    graded, accepted = observed["position_graded"], observed["position_accepted"]
    recorded = graded[:, 0] != ABSENT if graded.shape[1] else np.zeros(len(observed), dtype=bool)
    if not recorded.any():
        shown = display_path(observed.files[0]) if observed.files else "no file"
        raise CalibError(f"{shown}: the observe files record no draft acceptance (written before observe schema "
                         "1.2): give --acceptance")
    width = graded.shape[1]
    if width < k:
        raise CalibError(f"the observe files record {width} draft positions, the table's num_speculative_tokens is {k}")
    g = graded[recorded, :k].sum(axis=0)
    a = accepted[recorded, :k].sum(axis=0)
    if not g[0]:
        raise CalibError("the observe files graded no draft (no step verified one): give --acceptance")
    unseen = np.flatnonzero(g == 0)
    if len(unseen) and a[unseen[0] - 1] > 0:
        raise CalibError(f"no draft at position {unseen[0] + 1} was ever graded (adaptive verification never verified "
                         "that deep), so its acceptance is unknown: give --acceptance")
    ratio = np.divide(a, g, out=np.zeros(k), where=g > 0)
    rates = tuple(float(r) for r in np.cumprod(ratio))
    return Acceptance(check_schedule(rates, k, "observed acceptance"), "observed", tuple(observed.files),
                      int((recorded & (graded[:, 0] > 0)).sum()), tuple(int(x) for x in g),
                      tuple(int(x) for x in a))


# -- goodput per cell ------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One way to verify in one cell: its drafts, expected tokens and step cost."""

    name: str  # "K=3", "adaptive", "adaptive@8192"
    drafts_per_request: float  # drafts verified per request (adaptive: the budget / n)
    tokens_per_step: float  # per request: 1 + expected accepted drafts
    draft_ms: float
    verify_ms: float
    num_reqs: int

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms

    @property
    def goodput(self) -> float:
        """Generated tokens per ms."""
        return self.num_reqs * self.tokens_per_step / self.step_ms

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "drafts_per_request": self.drafts_per_request,
                "tokens_per_step": self.tokens_per_step, "draft_ms": self.draft_ms, "verify_ms": self.verify_ms,
                "step_ms": self.step_ms, "goodput_per_ms": self.goodput}


@dataclass(frozen=True)
class Cell:
    num_reqs: int
    context_len: int
    fixed: tuple[Option | None, ...]  # K = 1..k; None: n (1 + K) tokens exceed max_num_batched_tokens
    adaptive: Option  # context-aware pricing
    one_context: Option  # adaptive deciding with one context's tables
    min_gain: float = MIN_GAIN

    @property
    def best_fixed(self) -> Option:
        return max((o for o in self.fixed if o is not None), key=lambda o: o.goodput)

    @property
    def best(self) -> Option:
        """The highest modelled goodput of fixed K and adaptive (context-aware); ties: adaptive."""
        return max((self.adaptive, *(o for o in self.fixed if o is not None)), key=lambda o: o.goodput)

    @property
    def adaptive_vs_fixed(self) -> float:
        """Adaptive (context-aware) over the best fixed K, as a fraction (negative: adaptive loses)."""
        return self.adaptive.goodput / self.best_fixed.goodput - 1.0

    @property
    def one_context_vs_fixed(self) -> float:
        return self.one_context.goodput / self.best_fixed.goodput - 1.0

    @property
    def advice(self) -> str:
        """Adaptive verification unless a fixed K gains at least min_gain over it."""
        best = self.best_fixed
        return best.name if best.goodput >= (1.0 + self.min_gain) * self.adaptive.goodput else ADAPTIVE

    def to_dict(self) -> dict[str, Any]:
        return {"num_reqs": self.num_reqs, "context_len": self.context_len,
                "fixed": [o.to_dict() if o is not None else None for o in self.fixed],
                "adaptive": self.adaptive.to_dict(), "adaptive_one_context": self.one_context.to_dict(),
                "best": self.best.name, "best_fixed": self.best_fixed.name, "advice": self.advice,
                "adaptive_vs_best_fixed_pct": 100 * self.adaptive_vs_fixed,
                "adaptive_one_context_vs_best_fixed_pct": 100 * self.one_context_vs_fixed}


@dataclass(frozen=True)
class Advice:
    table_hash: str
    num_speculative_tokens: int
    acceptance: Acceptance
    contexts: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    one_context: int  # the context adaptive@one-context decides with
    cells: tuple[Cell, ...]
    min_gain: float = MIN_GAIN
    max_total_logits: int | None = None
    warnings: tuple[str, ...] = field(default=())

    def cell(self, num_reqs: int, context_len: int) -> Cell:
        return next(c for c in self.cells if c.num_reqs == num_reqs and c.context_len == context_len)

    def losses(self, one_context: bool = False) -> list[Cell]:
        """Cells where adaptive verification (context-aware, or at one context) is below the best fixed K."""
        return [c for c in self.cells if (c.one_context_vs_fixed if one_context else c.adaptive_vs_fixed) < 0]

    def to_dict(self) -> dict[str, Any]:
        def worst(cells: list[Cell], one: bool) -> dict[str, Any] | None:
            if not cells:
                return None
            c = min(cells, key=lambda c: c.one_context_vs_fixed if one else c.adaptive_vs_fixed)
            return {"num_reqs": c.num_reqs, "context_len": c.context_len, "best_fixed": c.best_fixed.name,
                    "pct": 100 * (c.one_context_vs_fixed if one else c.adaptive_vs_fixed)}

        losses = {name: {"cells": len(cells), "worst": worst(cells, one)}
                  for name, one, cells in (("adaptive", False, self.losses()),
                                           ("adaptive_one_context", True, self.losses(True)))}
        return {"table_hash": self.table_hash, "num_speculative_tokens": self.num_speculative_tokens,
                "acceptance": self.acceptance.to_dict(), "contexts": list(self.contexts),
                "batch_sizes": list(self.batch_sizes), "one_context": self.one_context,
                "min_gain_pct": 100 * self.min_gain, "max_total_logits": self.max_total_logits,
                "goodput_unit": "tokens/ms", "cells": [c.to_dict() for c in self.cells], "losses": losses,
                "warnings": list(self.warnings)}


def batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_num_seqs, and max_num_seqs itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i <= max_num_seqs]
    return tuple(sorted(set(sizes) | {max_num_seqs}))


def _confidences(rates: Sequence[float]) -> np.ndarray:
    """Per-position confidences whose running product is the schedule (0 after a zero rate)."""
    r = np.asarray(rates, dtype=np.float64)
    prev = np.concatenate(([1.0], r[:-1]))
    return np.divide(r, prev, out=np.zeros_like(r), where=prev > 0)


def _option(name: str, n: int, budget: int, survival: np.ndarray, draft: np.ndarray, verify: np.ndarray) -> Option:
    """n requests verifying `budget` drafts, the best-surviving first (what vLLM admits)."""
    accepted = float(np.sort(np.repeat(survival, n))[::-1][:budget].sum())
    return Option(name, budget / n, 1.0 + accepted / n, float(draft[n]), float(verify[n + budget]), n)


class _Model:
    """A table's costs and an acceptance schedule, ready to model decode steps one by one:
    the fixed K options and both adaptive pricings of a step of n requests whose computed
    tokens sum to S (what ``advise`` shows per cell and ``predict_steps`` sums over steps)."""

    def __init__(self, table: Any, acceptance: Acceptance, *, one_context: int | None = None,
                 vocab_size: int | None = None):
        fp = table.fingerprint
        self.k = k = int(fp.num_speculative_tokens)
        self.rates = check_schedule(acceptance.rates, k)
        self.max_reqs, self.max_tokens = int(fp.max_num_seqs), int(fp.max_num_batched_tokens)
        self.max_model_len = int(fp.max_model_len or 0)
        self.max_total_logits = None if vocab_size is None else max(1, MAX_CHUNK_LOGIT_BYTES // (int(vocab_size) * 4))
        self.costs = ContextCosts(table.curves, self.max_reqs, self.max_tokens, int(fp.cudagraph_limit),
                                  profile_num_reqs=min(self.max_reqs, self.max_tokens),
                                  extrapolate_to=min(self.max_model_len, MAX_EXTRAPOLATE_TO))
        self.grid = ContextGrid(self.costs)
        self.one_context = table.default_context() if one_context is None else int(one_context)
        self.one_tables = self.costs.at(self.one_context).as_tuple()
        self.survival = np.asarray(self.rates, dtype=np.float64)
        self.conf = _confidences(self.rates)

    def feasible(self, n: int) -> list[int]:
        """The fixed K whose n (1 + K) tokens fit max_num_batched_tokens."""
        return [K for K in range(1, self.k + 1) if n * (1 + K) <= self.max_tokens]

    def step(self, n: int, context_sum: int) -> tuple[tuple[Option | None, ...], Option, Option]:
        """(fixed K = 1..k, None where it does not fit; adaptive; adaptive@one context) for a decode step
        of n requests (each one non-draft token and the most drafts that fit) at this KV sum."""
        feasible = self.feasible(n)
        draft, verify = self.grid.step_tables(context_sum, n)
        draft, verify = np.array(draft), np.array(verify)  # the grid's buffer is rewritten by the next step
        fixed_options = tuple(_option(fixed(K), n, n * K, self.survival, draft, verify) if K in feasible else None
                              for K in range(1, self.k + 1))
        rule = dict(confidences=np.broadcast_to(self.conf, (n, self.k)), scheduled_drafts=[max(feasible)] * n,
                    non_draft_tokens=[1] * n, max_total_logits=self.max_total_logits)
        b = choose_draft_budget(draft, verify, **rule)
        b_one = choose_draft_budget(*self.one_tables, **rule)
        return (fixed_options, _option(ADAPTIVE, n, b, self.survival, draft, verify),
                _option(f"{ADAPTIVE}@{self.one_context}", n, b_one, self.survival, draft, verify))


def advise(table: Any, acceptance: Acceptance, *, contexts: Sequence[int] | None = None,
           max_num_seqs: int | None = None, min_gain: float = MIN_GAIN, vocab_size: int | None = None) -> Advice:
    """The modelled goodput of fixed K and adaptive verification per batch size and context."""
    model = _Model(table, acceptance, vocab_size=vocab_size)
    k, max_reqs = model.k, model.max_reqs
    top = max_reqs if max_num_seqs is None else int(max_num_seqs)
    if not 1 <= top <= max_reqs:
        raise CalibError(f"--max-num-seqs {top}: the table prices batches of 1..{max_reqs} requests "
                         "(its max_num_seqs)")
    ctxs = tuple(sorted(set(int(c) for c in contexts))) if contexts else tuple(table.context_lens())
    for c in ctxs:
        if c < 0 or (model.max_model_len and c + k + 1 > model.max_model_len):
            raise CalibError(f"--context {c}: a request there cannot hold {k + 1} more tokens within the table's "
                             f"max_model_len {model.max_model_len}")
    warnings = [str(w) for w in (model.costs.at(c).warning for c in ctxs) if w is not None]
    cells = []
    for ctx in ctxs:
        for n in batch_sizes(top):
            if not model.feasible(n):
                continue  # not even one draft each fits max_num_batched_tokens: no speculative step
            cells.append(Cell(n, ctx, *model.step(n, n * ctx), min_gain))
    if not cells:
        raise CalibError(f"no batch fits max_num_batched_tokens {model.max_tokens} with a draft per request")
    return Advice(str(getattr(table, "content_hash", "")), k, replace(acceptance, rates=model.rates), ctxs,
                  batch_sizes(top), model.one_context, tuple(cells), min_gain, model.max_total_logits,
                  tuple(warnings))


# -- goodput over a mix of decode steps ------------------------------------------------------
@dataclass(frozen=True)
class MixOption:
    """One way to verify, summed over the steps of a mix: the tokens it generates, the drafts it
    verifies and the modelled time of those steps."""

    name: str
    tokens: float
    drafts: float
    ms: float

    @property
    def goodput(self) -> float:
        """Generated tokens per ms over the whole mix (total tokens over total time, not a mean of steps)."""
        return self.tokens / self.ms

    @property
    def ms_per_token(self) -> float:
        return self.ms / self.tokens

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tokens": self.tokens, "drafts": self.drafts, "ms": self.ms,
                "goodput_per_ms": self.goodput, "ms_per_token": self.ms_per_token}


@dataclass(frozen=True)
class StepMix:
    """Each option's modelled goodput over given decode steps (``predict_steps``)."""

    table_hash: str
    num_speculative_tokens: int
    acceptance: Acceptance
    one_context: int
    steps: int
    requests: int  # summed over the steps
    context_mean: float  # over the steps' requests
    options: tuple[MixOption, ...]  # the fixed K that fit every step, adaptive, adaptive@one_context
    max_total_logits: int | None = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def one_context_name(self) -> str:
        return f"{ADAPTIVE}@{self.one_context}"

    def option(self, name: str) -> MixOption | None:
        return next((o for o in self.options if o.name == name), None)

    def ratio(self, name: str) -> float | None:
        """An option's goodput over adaptive@one_context's (stock vLLM's): > 1 faster."""
        o = self.option(name)
        return None if o is None else o.goodput / self.option(self.one_context_name).goodput

    def to_dict(self) -> dict[str, Any]:
        return {"table_hash": self.table_hash, "num_speculative_tokens": self.num_speculative_tokens,
                "acceptance": self.acceptance.to_dict(), "one_context": self.one_context, "steps": self.steps,
                "requests": self.requests, "context_mean": self.context_mean,
                "max_total_logits": self.max_total_logits, "goodput_unit": "tokens/ms",
                "options": [{**o.to_dict(), "vs_one_context": self.ratio(o.name)} for o in self.options],
                "warnings": list(self.warnings)}


def predict_steps(table: Any, acceptance: Acceptance, num_reqs: Sequence[int], context_lens: Sequence[float], *,
                  one_context: int | None = None, vocab_size: int | None = None) -> StepMix:
    """Each option's goodput over decode steps: step i has num_reqs[i] requests at mean context
    context_lens[i] (its KV sum n L, rounded), each modelled as an ``advise`` cell; an option's
    goodput is its tokens over its time summed over the steps, so each step counts by its length.
    one_context: the context adaptive@ decides with (default the table's default context, as
    ``advise``); a fixed K is an option only where it fits every step."""
    n = np.asarray(num_reqs, dtype=np.int64).ravel()
    ctx = np.asarray(context_lens, dtype=np.float64).ravel()
    if len(n) != len(ctx):
        raise CalibError(f"steps: {len(n)} batch sizes and {len(ctx)} contexts; one of each per step")
    if not len(n):
        raise CalibError("no decode steps to model")
    model = _Model(table, acceptance, one_context=one_context, vocab_size=vocab_size)
    if n.min() < 1 or n.max() > model.max_reqs:
        raise CalibError(f"a step of {int(n.min() if n.min() < 1 else n.max())} requests: the table prices "
                         f"batches of 1..{model.max_reqs} requests (its max_num_seqs)")
    if not np.isfinite(ctx).all() or ctx.min() < 0:
        raise CalibError("step contexts must be finite and >= 0")
    if not model.feasible(int(n.max())):
        raise CalibError(f"a step of {int(n.max())} requests: not even one draft each fits max_num_batched_tokens "
                         f"{model.max_tokens}")
    sums = np.rint(n * ctx).astype(np.int64)
    pairs, counts = np.unique(np.stack([n, sums], axis=1), axis=0, return_counts=True)
    names = [fixed(K) for K in range(1, model.k + 1)] + [ADAPTIVE, f"{ADAPTIVE}@{model.one_context}"]
    totals = {name: np.zeros(3) for name in names}  # tokens, drafts, ms
    for (steps_n, steps_sum), count in zip(pairs.tolist(), counts.tolist()):
        fixed_options, adaptive, one = model.step(steps_n, steps_sum)
        for o in (*fixed_options, adaptive, one):
            if o is None:
                continue
            totals[o.name] += count * np.array([o.num_reqs * o.tokens_per_step, o.num_reqs * o.drafts_per_request,
                                                o.step_ms])
    fits = set(model.feasible(int(n.max())))
    options = tuple(MixOption(name, *(float(x) for x in totals[name])) for name in names
                    if not name.startswith("K=") or int(name[2:]) in fits)
    seen = (model.costs.at(int(c)).warning for c in {math.floor(ctx.min()), math.ceil(ctx.max())})
    return StepMix(str(getattr(table, "content_hash", "")), model.k, replace(acceptance, rates=model.rates),
                   model.one_context, len(n), int(n.sum()), float((n * ctx).sum() / n.sum()), options,
                   model.max_total_logits, tuple(str(w) for w in seen if w is not None))


def modelled_steps(columns: Any) -> np.ndarray:
    """Which observed steps advise models: decode-shaped (observe.step.decode_steps) with drafts scheduled."""
    return decode_steps(columns) & (columns["scheduled_drafts"] > 0)


def predict_observed(table: Any, acceptance: Acceptance, observed: ObservedSteps, *, one_context: int | None = None,
                     vocab_size: int | None = None) -> StepMix:
    """``predict_steps`` over the decode steps observe files recorded (batch size, mean context), after
    checking that every file comes from an engine of the table's fingerprint where it records one."""
    for path, meta in zip(observed.files, observed.metadata):
        meta.check_engine(table.fingerprint, path)
    keep = modelled_steps(observed)
    if not keep.any():
        shown = display_path(observed.files[0]) if observed.files else "no file"
        raise CalibError(f"{shown}: the observe files record no decode step with drafts to model")
    return predict_steps(table, acceptance, observed["num_reqs"][keep], observed["context_mean"][keep],
                         one_context=one_context, vocab_size=vocab_size)

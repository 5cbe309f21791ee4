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
from dspark_calib.observe.step import ABSENT
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


def advise(table: Any, acceptance: Acceptance, *, contexts: Sequence[int] | None = None,
           max_num_seqs: int | None = None, min_gain: float = MIN_GAIN, vocab_size: int | None = None) -> Advice:
    """The modelled goodput of fixed K and adaptive verification per batch size and context."""
    fp = table.fingerprint
    k = int(fp.num_speculative_tokens)
    rates = check_schedule(acceptance.rates, k)
    max_reqs, max_tokens = int(fp.max_num_seqs), int(fp.max_num_batched_tokens)
    top = max_reqs if max_num_seqs is None else int(max_num_seqs)
    if not 1 <= top <= max_reqs:
        raise CalibError(f"--max-num-seqs {top}: the table prices batches of 1..{max_reqs} requests "
                         "(its max_num_seqs)")
    max_model_len = int(fp.max_model_len or 0)
    ctxs = tuple(sorted(set(int(c) for c in contexts))) if contexts else tuple(table.context_lens())
    for c in ctxs:
        if c < 0 or (max_model_len and c + k + 1 > max_model_len):
            raise CalibError(f"--context {c}: a request there cannot hold {k + 1} more tokens within the table's "
                             f"max_model_len {max_model_len}")
    max_total_logits = None if vocab_size is None else max(1, MAX_CHUNK_LOGIT_BYTES // (int(vocab_size) * 4))
    costs = ContextCosts(table.curves, max_reqs, max_tokens, int(fp.cudagraph_limit),
                         profile_num_reqs=min(max_reqs, max_tokens),
                         extrapolate_to=min(max_model_len, MAX_EXTRAPOLATE_TO))
    grid = ContextGrid(costs)
    one_ctx = table.default_context()
    one_draft, one_verify = costs.tables[one_ctx]
    survival = np.asarray(rates, dtype=np.float64)
    conf = _confidences(rates)
    warnings = [str(w) for w in (costs.at(c).warning for c in ctxs) if w is not None]
    cells = []
    for ctx in ctxs:
        for n in batch_sizes(top):
            feasible = [K for K in range(1, k + 1) if n * (1 + K) <= max_tokens]
            if not feasible:
                continue  # not even one draft each fits max_num_batched_tokens: no speculative step
            draft, verify = grid.step_tables(n * ctx, n)
            draft, verify = np.array(draft), np.array(verify)  # the grid's buffer is rewritten by the next step
            options = tuple(_option(fixed(K), n, n * K, survival, draft, verify) if K in feasible else None
                            for K in range(1, k + 1))
            # every request schedules the most drafts that fit, one non-draft token each (a decode step)
            rule = dict(confidences=np.broadcast_to(conf, (n, k)), scheduled_drafts=[max(feasible)] * n,
                        non_draft_tokens=[1] * n, max_total_logits=max_total_logits)
            b = choose_draft_budget(draft, verify, **rule)
            b_one = choose_draft_budget(one_draft, one_verify, **rule)
            cells.append(Cell(n, ctx, options, _option(ADAPTIVE, n, b, survival, draft, verify),
                              _option(f"{ADAPTIVE}@{one_ctx}", n, b_one, survival, draft, verify), min_gain))
    if not cells:
        raise CalibError(f"no batch fits max_num_batched_tokens {max_tokens} with a draft per request")
    return Advice(str(getattr(table, "content_hash", "")), k, replace(acceptance, rates=rates), ctxs,
                  batch_sizes(top), one_ctx, tuple(cells), min_gain, max_total_logits, tuple(warnings))

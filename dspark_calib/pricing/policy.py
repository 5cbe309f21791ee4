"""How an engine prices its steps, as one value: what load mode decides, the context-aware
wrapper prices with, observe mode writes into each file and ``validate`` reads back.

Standard library only: the plugin entry point and the light commands import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dspark_calib.errors import CalibError
from dspark_calib.fileformat.limits import MAX_CONTEXT_LEN

STOCK = "stock"  # vLLM's own start-up profile
TABLE = "table"  # a loaded table's curves at one context
CONTEXT_AWARE = "context-aware"  # each step priced for the context its batch has
MODES = (STOCK, TABLE, CONTEXT_AWARE)

MAX_TAIL_MILLI = 1000  # t = 1: every request priced at the batch's longest context
MAX_EXTRAPOLATE_TO = MAX_CONTEXT_LEN  # far above any model's context; a bigger value is damage
CHUNK_RULE = "largest-step"  # a chunk's pair at R(N_max) / N_max KV tokens (docs/pricing.md)
CHUNK_RULE_PER_STEP = "per-step"  # the first rule: R(N) / N at the step's own N
CHUNK_RULES = (CHUNK_RULE, CHUNK_RULE_PER_STEP)
TAIL_RULE = "bounded"  # S + t min(G, S^2 / G), G = n max - S (rules.tail_context_sum; docs/pricing.md)
TAIL_RULE_LINEAR = "linear"  # the first rule: S + t G, whatever the gap
TAIL_RULES = (TAIL_RULE, TAIL_RULE_LINEAR)

# The plugin's defaults, chosen on served steps (docs/results): a tail of 0.2 for mixed-context
# batches, and prefill chunks priced by their query-context pairs. Uniform batches are priced the
# same either way (their max is their mean); decode-only steps never look for chunks.
DEFAULT_CONTEXT_TAIL_MILLI = 200
DEFAULT_CONTEXT_CHUNKS = True

# What a context-aware file that predates a key was priced with: the engines before the key
# existed had no tail, priced chunks as KV (no pairs), and priced pairs by the first rule.
UNRECORDED_TAIL_MILLI = 0
UNRECORDED_CHUNKS = False
UNRECORDED_CHUNK_RULE = CHUNK_RULE_PER_STEP
UNRECORDED_EXTRAPOLATE_TO = 0  # above the profiled range: the longest context's costs
UNRECORDED_TAIL_RULE = TAIL_RULE_LINEAR  # observe files before schema 1.4 (observe.file's migration)


def _int_in(value: Any, lo: int, hi: int) -> bool:
    """An integer (not a bool: JSON's true is no context) in lo..hi."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def valid_tail(value: Any) -> bool:
    return _int_in(value, 0, MAX_TAIL_MILLI)


def extrapolates_above(contexts: Sequence[int], extrapolate_to: int) -> bool:
    """Whether context-aware costs above the longest profiled context follow the line through the
    two longest (up to extrapolate_to, the engine's max_model_len): only when those two are at
    least a factor 2 apart, since two close contexts would stretch their profiling noise over the
    whole extension. Otherwise the longest context's costs price everything above it."""
    cs = sorted(int(c) for c in contexts)
    return len(cs) > 1 and int(extrapolate_to) > cs[-1] and cs[-1] >= 2 * cs[-2]


def coverage(contexts: Sequence[int], max_model_len: int | None) -> str:
    """One clause: the profiled contexts against the engine's max_model_len, and how contexts
    above the longest are priced (the load line and `check` say it)."""
    cs = sorted({int(c) for c in contexts})
    if len(cs) == 1:
        return f"one profiled context ({cs[0]}): every context priced at its costs"
    span, top = f"contexts {', '.join(map(str, cs))}", cs[-1]
    if not max_model_len:
        return f"{span}; engine max_model_len unknown"
    if top >= max_model_len:
        return f"{span} cover max_model_len {max_model_len}"
    head = f"{span} of max_model_len {max_model_len}: above {top}"
    if extrapolates_above(cs, max_model_len):
        return f"{head} extrapolated on the line through {cs[-2]} and {top} (context-aware)"
    return f"{head} at {top}'s costs ({cs[-2]} and {top} are less than a factor 2 apart)"


@dataclass(frozen=True)
class PricingPolicy:
    """mode: STOCK / TABLE / CONTEXT_AWARE; static_context: the context of the static tables;
    tail_milli, tail_rule, chunks, chunk_rule and extrapolate_to apply in context-aware mode only.
    extrapolate_to: costs above the longest profiled context follow the line through the two
    longest up to this context (the engine's max_model_len); 0: the longest context's costs."""

    mode: str = STOCK
    static_context: int = 0
    tail_milli: int = 0
    chunks: bool = False
    chunk_rule: str = CHUNK_RULE
    extrapolate_to: int = 0
    contexts: tuple[int, ...] = ()  # the profiled contexts the engine prices (); (): all of the table's
    tail_rule: str = TAIL_RULE  # how the tail charges a batch's gap (TAIL_RULES)

    @property
    def context_aware(self) -> bool:
        return self.mode == CONTEXT_AWARE

    def metadata(self) -> dict[str, Any]:
        """The keys observe mode writes into each file's metadata (from_metadata reads them)."""
        meta: dict[str, Any] = {"mode": self.mode, "static_context": self.static_context,
                                "context_tail_milli": self.tail_milli, "context_tail_rule": self.tail_rule,
                                "context_chunks": self.chunks}
        if self.chunks:
            meta["context_chunk_rule"] = self.chunk_rule
        if self.extrapolate_to:
            meta["context_extrapolate_to"] = self.extrapolate_to
        if self.contexts:
            meta["context_priced"] = list(self.contexts)
        return meta

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "PricingPolicy":
        """The policy an observe file records; a key the file predates reads as what the engines
        of that time did (UNRECORDED_*; the tail rule: observe.file's migration writes it into every
        file before schema 1.4, and every engine since records it). Only context-aware files are
        checked for tail and chunks: other modes price neither."""
        mode = meta.get("mode", STOCK)
        static = meta.get("static_context")
        static = static if isinstance(static, int) and not isinstance(static, bool) else 0
        if mode != CONTEXT_AWARE:
            return cls(mode=mode if isinstance(mode, str) else STOCK, static_context=static)
        tail = meta.get("context_tail_milli", UNRECORDED_TAIL_MILLI)
        if not valid_tail(tail):
            raise CalibError(f"an observe file records context_tail_milli={tail!r} (want 0..{MAX_TAIL_MILLI})")
        tail_rule = meta.get("context_tail_rule")
        if tail_rule not in TAIL_RULES:
            raise CalibError(f"an observe file records context_tail_rule={tail_rule!r} (want one of "
                             f"{', '.join(TAIL_RULES)})")
        chunks = meta.get("context_chunks", UNRECORDED_CHUNKS)
        if not isinstance(chunks, bool):
            raise CalibError(f"an observe file records context_chunks={chunks!r} (want true or false)")
        rule = meta.get("context_chunk_rule", UNRECORDED_CHUNK_RULE) if chunks else CHUNK_RULE
        if rule not in CHUNK_RULES:
            raise CalibError(f"an observe file records context_chunk_rule={rule!r} (want one of "
                             f"{', '.join(CHUNK_RULES)})")
        far = meta.get("context_extrapolate_to", UNRECORDED_EXTRAPOLATE_TO)
        if not _int_in(far, 0, MAX_EXTRAPOLATE_TO):
            raise CalibError(f"an observe file records context_extrapolate_to={far!r} (want 0..{MAX_EXTRAPOLATE_TO})")
        priced = meta.get("context_priced", [])
        if not (isinstance(priced, list) and len(priced) <= 64
                and all(_int_in(c, 0, MAX_EXTRAPOLATE_TO) for c in priced)):
            raise CalibError(f"an observe file records context_priced={str(priced)[:80]} (want a list of contexts)")
        return cls(CONTEXT_AWARE, static, tail, chunks, rule, far, tuple(sorted(priced)), tail_rule)

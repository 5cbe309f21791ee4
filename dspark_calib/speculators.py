"""The speculative methods dspark-calib profiles and prices, and what each needs of its drafter.

vLLM 0.33 runs adaptive verification, with the same start-up profile and the same cost
curves, for every speculator built on its draft-model base class: DSpark ranks drafts with
its confidence head, the others (a separate draft model, EAGLE / EAGLE-3 heads, MTP layers,
DFlash) with vLLM's online acceptance estimator. The cost tables do not care which: a step
is a drafter run and a target verify either way. What differs is the drafter (its config
is hashed into the fingerprint, with the method) and the default number of drafts.

Methods without draft logits (n-gram, suffix decoding) or outside the draft-model base
(a custom class, hidden-state extraction) are refused: adaptive verification has nothing
to rank their drafts by, or dspark-calib has not checked their steps.

Nothing here imports torch or vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from dspark_calib.errors import CalibError

DSPARK = "dspark"
DRAFT_MODEL = "draft_model"
T = TypeVar("T")
# vLLM's _dummy_run clamps a profile batch to max_num_batched_tokens - num_reqs x extra for a
# speculator that adds `extra` query slots per request (a draft model: one, so the largest
# verify batch of 8192 tokens at 256 requests runs, and is keyed, as 7936).
MAX_EXTRA_SLOTS = 8


def is_clamped_batch(tokens: int, max_tokens: int, num_reqs: int) -> bool:
    """Whether a batch of `tokens` is vLLM's clamp of a larger one at `num_reqs` requests."""
    return tokens < max_tokens and any(tokens == max_tokens - num_reqs * extra
                                       for extra in range(1, MAX_EXTRA_SLOTS + 1))


@dataclass(frozen=True)
class Speculator:
    method: str  # vLLM's speculative_config.method, as vLLM resolves it
    drafter: str  # what --draft names, for people
    architectures: tuple[str, ...] = ()  # the drafter's config.json must name one ('' = vLLM judges)
    own_drafter: bool = True  # False: the target's own layers draft (MTP); --draft may be left out
    one_pass: bool = False  # True: one drafter pass proposes all K drafts (DSpark's block, DFlash's masks)

    def check_drafter(self, config: Mapping[str, Any], where: str) -> int | None:
        """The number of drafts the drafter was trained for, when its config says (DSpark's
        block size), after checking it is this method's drafter; CalibError naming `where`."""
        archs = config.get("architectures") or []
        if not isinstance(archs, list):
            raise CalibError(f"architectures must be a list, got {str(archs)[:80]}", path=where)
        if self.architectures and not any(a in self.architectures for a in archs):
            raise CalibError(f"not a {self.drafter}: architectures {str(archs)[:80]}, expected one of "
                             f"{', '.join(self.architectures)} for --method {self.method}", path=where)
        if self.method != DSPARK:
            return None
        block = config.get("block_size", config.get("dspark_block_size"))
        return block if type(block) is int and block > 0 else None

    def drafter_or_target(self, draft: T | None, target: T) -> T:
        """What drafts, for every command that takes --draft: the drafter given, or the target
        itself for a method that drafts with the target's own layers (MTP); one line naming
        --draft for a method with a drafter of its own."""
        if draft is not None:
            return draft
        if self.own_drafter:
            raise CalibError(f"--draft is needed for --method {self.method} (the {self.drafter})")
        return target


# The draft architectures vLLM runs as DSpark drafters.
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")

SPECULATORS: dict[str, Speculator] = {s.method: s for s in (
    Speculator(DSPARK, "DSpark drafter", DSPARK_ARCHITECTURES, one_pass=True),
    Speculator(DRAFT_MODEL, "draft model"),
    Speculator("eagle", "EAGLE head"),
    Speculator("eagle3", "EAGLE-3 head"),
    Speculator("mtp", "MTP module", own_drafter=False),
    Speculator("dflash", "DFlash drafter", one_pass=True),
)}
# vLLM's other methods, and why they are refused.
REFUSED = {
    "ngram": "n-gram drafts have no logits to rank",
    "ngram_gpu": "n-gram drafts have no logits to rank",
    "suffix": "suffix decoding drafts have no logits to rank",
    "custom_class": "a custom proposer's steps are not ones dspark-calib has checked",
    "extract_hidden_states": "it drafts nothing",
}


def speculator(method: str, option: str = "--method") -> Speculator:
    """The method's entry; one line naming the option for a method it does not price."""
    if method in SPECULATORS:
        return SPECULATORS[method]
    why = REFUSED.get(method, "not a vLLM 0.33 speculative method")
    raise CalibError(f"{option} {method!r}: not supported ({why}); one of {', '.join(SPECULATORS)}")

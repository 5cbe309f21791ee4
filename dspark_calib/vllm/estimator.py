"""vLLM's online acceptance estimator from the plugin's side: what observe mode reads of it, the
keys a seed of it must match, and the seed written into it at start-up (DSPARK_CALIB_ESTIMATOR_SEED).

vLLM 0.33 builds an ``OnlineAcceptanceEstimator`` in ``DraftModelSpeculator.load_model`` when
adaptive verification ranks drafts without a confidence head (the draft-model, EAGLE, MTP and
DFlash speculators; DSpark without the head). Per draft position k it predicts
sigmoid(slope x f + intercept_k); ``step`` folds each serving step's verdict into per-round
statistics and refits every REFIT_INTERVAL steps, on every TP rank alike; ``predict`` runs
inside the captured draft CUDA graph, reading ``slope`` and ``intercepts`` by address.

Seeding runs once per estimator, right after ``GPUModelRunner.initialize_kv_cache`` (observer.
hook_runner: the estimator exists since load_model; no step has run, the kernel warm-up's
included) and before observe starts, so observe's first row shows the seeded coefficients. TP
rank 0 decides and broadcasts, every rank writes: the ranks must rank drafts alike (each picks
the step's budget from its own estimator), so a rank seeded alone would verify other tokens than
its peers. Writes are in place (``fill_``/``copy_``): the draft graph holds the tensors'
addresses, and vLLM's refit writes them in place too. The estimator keeps learning from there
(seed.py says why nothing else of its state needs restoring).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

from dspark_calib import env as E
from dspark_calib.errors import PREFIX, CalibError, display_path, exception_line
from dspark_calib.vllm.runtime import log_once

_seeded: "weakref.WeakSet[Any]" = weakref.WeakSet()  # estimators already seeded (a later KV re-init keeps learning)


# -- the estimator ---------------------------------------------------------------------------------
def estimator_problem(est: Any) -> str:
    """'' when est has what the plugin reads and writes (vLLM 0.33's shape), else what differs."""
    k = getattr(est, "num_speculative_steps", None)
    slope, intercepts = getattr(est, "slope", None), getattr(est, "intercepts", None)
    if type(k) is not int or k < 1:
        return "no num_speculative_steps"
    if tuple(getattr(slope, "shape", ())) != (1,) or tuple(getattr(intercepts, "shape", ())) != (k,):
        return f"slope is not of shape (1,) or intercepts not of shape ({k},)"
    if not all(type(getattr(est, name, None)) is int for name in ("_refits", "_steps_since_refit", "REFIT_INTERVAL")):
        return "no _refits / _steps_since_refit / REFIT_INTERVAL counters"
    return ""


def estimator_of(runner: Any) -> Any:
    """The runner's speculator's estimator (None without one, or of a shape this version does not know)."""
    est = getattr(getattr(runner, "speculator", None), "acceptance_estimator", None)
    if est is None:
        return None
    why = estimator_problem(est)
    if why:
        log_once(logging.WARNING, PREFIX + f"vLLM's acceptance estimator has another shape ({why}); "
                                  "neither seeded nor observed")
        return None
    return est


def progress(est: Any) -> tuple[int, int]:
    """(refits, step() calls since the engine started): host counters, no device work. vLLM refits
    every REFIT_INTERVAL steps exactly, and never resets either counter."""
    return est._refits, est._refits * est.REFIT_INTERVAL + est._steps_since_refit


def read_coefficients(est: Any) -> tuple[Any, Any]:
    """(slope, intercepts) copied to host memory without a sync: non-blocking (pinned) copies on
    the current stream, read once an event recorded after them is done (observer.py)."""
    return (est.slope.to("cpu", non_blocking=True, copy=True),
            est.intercepts.to("cpu", non_blocking=True, copy=True))


# -- the keys a seed must match --------------------------------------------------------------------
def seed_keys(vllm_config: Any, manager: Any = None) -> dict[str, Any]:
    """seed.SEED_KEYS as this engine reports them: the fingerprint's readers (engine_info.READERS)
    and how drafts are accepted; a key whose reader finds nothing is None (JSON-ready values)."""
    from dspark_calib.seed import KEY_NAMES
    from dspark_calib.vllm.engine_info import READERS, EngineView

    view = EngineView(vllm_config=vllm_config, manager=manager)
    spec = getattr(vllm_config, "speculative_config", None)
    method = str(getattr(spec, "rejection_sample_method", "") or "") or None
    rates = getattr(spec, "synthetic_acceptance_rates", None) if method == "synthetic" else None
    load_format = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    acceptance = {"load_format": None if load_format is None else str(load_format), "rejection_sample_method": method,
                  "synthetic_acceptance_rates": None if rates is None else [float(r) for r in rates]}
    out: dict[str, Any] = {}
    for name in KEY_NAMES:
        if name in acceptance:
            out[name] = acceptance[name]
            continue
        try:
            value = READERS[name](view)
        except Exception:  # noqa: BLE001 - a config shape this vLLM lacks: None, compared as such
            value = None
        out[name] = None if value == "" else value
    return out


# -- the seed at start-up ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SeedDecision:
    """Rank 0's decision, broadcast to every TP rank: the seed to write (None: none), the line."""

    seed: Any = None
    line: str = ""
    level: int = logging.INFO
    refuse: str = ""  # strict: the engine must not start


def unapplied(policy: str, why: str) -> SeedDecision:
    """A seed that is set but not written: strict refuses to start, the other policies start unseeded."""
    if policy == "strict":
        line = PREFIX + f"{why}; refusing to start (policy strict)"
        return SeedDecision(None, line, logging.ERROR, refuse=line)
    return SeedDecision(None, PREFIX + f"{why}; starting unseeded (policy {policy})", logging.WARNING)


def decide(path: str, engine_keys: dict[str, Any], num_positions: int | None, policy: str) -> SeedDecision:
    """The seed at `path` for an engine reporting `engine_keys` whose estimator has `num_positions`
    intercepts (None: the engine has no estimator). Never raises."""
    from dspark_calib.seed import read_seed, seed_mismatches

    shown = display_path(path)
    if num_positions is None:
        return unapplied(policy, f"{E.ESTIMATOR_SEED}={shown} is set, but this engine ranks drafts without vLLM's "
                                 "acceptance estimator (adaptive verification off, or a confidence head)")
    try:
        seed = read_seed(path)
        mismatches = seed_mismatches(seed, engine_keys)
    except CalibError as exc:
        return unapplied(policy, f"estimator seed not read: {exc}")
    except Exception as exc:  # noqa: BLE001 - never stop an engine that would otherwise start
        return unapplied(policy, f"estimator seed not read: {shown}: {exception_line(exc)}")
    fits = len(seed.intercepts) == num_positions
    if mismatches or not fits:
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        why = f"estimator seed {shown} does not fit this engine: " + (
            mismatches[0] + more if mismatches else
            f"{len(seed.intercepts)} intercepts vs the engine estimator's {num_positions} positions")
        if policy == "warn" and fits:
            return SeedDecision(seed, PREFIX + f"{why}; seeding anyway (policy warn)", logging.WARNING)
        return unapplied(policy, why)
    host = seed.source.get("host") or "an unnamed host"
    return SeedDecision(seed, PREFIX + f"estimator seeded from {shown}: {seed.summary()} on {host}; it keeps "
                                       "learning from the first step")


def apply(est: Any, seed: Any) -> None:
    """Write the seed's coefficients into vLLM's estimator, in place (the draft graph reads them by address)."""
    import torch

    with torch.no_grad():
        est.slope.fill_(float(seed.slope))
        est.intercepts.copy_(torch.tensor(seed.intercepts, dtype=est.intercepts.dtype))


def seed_runner(runner: Any, est: Any) -> SeedDecision | None:
    """Seed this runner's estimator est (estimator_of's reading, taken once per start by the caller;
    None: none) when DSPARK_CALIB_ESTIMATOR_SEED is set, once per estimator; the decision (None
    when unset). Raises RuntimeError only to refuse (strict): on every rank when the engine has an
    estimator; without one only rank 0 decides, so only rank 0 refuses (the executor then fails
    the start)."""
    path = E.estimator_seed()
    if not path:
        return None
    if est is not None and est in _seeded:
        return None  # a later initialize_kv_cache: the estimator has learned since
    from dspark_calib.vllm.engine_info import broadcast_from_rank0, tp_rank_and_size

    rank0 = tp_rank_and_size()[0] == 0
    decision = None
    if rank0:
        try:
            policy = E.policy()
        except CalibError as exc:
            line = PREFIX + f"{exc}; refusing to start"
            decision = SeedDecision(None, line, logging.ERROR, refuse=line)
        else:
            try:
                keys = seed_keys(getattr(runner, "vllm_config", None), getattr(runner, "adaptive_verification", None))
            except Exception as exc:  # noqa: BLE001
                decision = unapplied(policy, f"estimator seed not checked (engine keys unread: {exception_line(exc)})")
            else:
                decision = decide(path, keys, None if est is None else int(est.num_speculative_steps), policy)
    if est is not None:  # every rank has one or none (the same config): all join, or none does
        decision = broadcast_from_rank0(decision)
    if decision is None:  # a rank > 0 of an engine without the estimator: rank 0 says it
        return None
    log_once(decision.level, decision.line)
    if decision.refuse:
        raise RuntimeError(decision.refuse)
    if decision.seed is not None and est is not None:
        # Never swallowed: a rank left unseeded while its peers are seeded would pick other budgets.
        apply(est, decision.seed)
        _seeded.add(est)
    return decision

"""The estimator seed: the coefficients vLLM's online acceptance estimator starts from, learned by
an earlier engine of the same deployment, so a restarted server ranks drafts well from its first step.

vLLM's estimator (the draft-model, EAGLE, MTP and DFlash speculators, and DSpark without a
confidence head) predicts, per draft position k, p = sigmoid(slope x f + intercept_k), f being
the top draft probability's log-odds; it starts from fixed defaults and refits every 100 steps.
Observe mode records its coefficients (observe file schema 1.3); ``seed_from_observed`` takes the
newest reading after a refit in the files given (what the estimator learned last), and the plugin
(DSPARK_CALIB_ESTIMATOR_SEED) writes it into the estimator at start-up. The estimator keeps learning: a seed is its first coefficients,
nothing more. Its refit carries nothing from one round to the next but the coefficients (each
round's statistics are cleared, each Newton step damped by that round's own sample count,
n / (n + 50)), so the seed is the estimator's whole learned state, and the first round moves
from it exactly as it would from vLLM's defaults: no prior weight, no refit count to restore.

A file of its own, beside the table rather than a key in it: a table is a profile of step costs
(offline, keyed by GPU and build, pinned by content hash, often shared by a fleet), a seed is a
fit of acceptance (from serving, keyed by the weights and how drafts are accepted, per
workload); it applies to engines with no table at all (stock pricing), and refreshing it must
not re-hash or rewrite a pinned table.

The seed's keys (``SEED_KEYS``) are what changes the meaning of its coefficients: the models
and their weights, the method, K (one intercept per position), the numbers the logits are
computed in, and how drafts are accepted (dummy weights, vLLM's synthetic acceptance). The
workload (prompts, temperature) is not a key: acceptance depends on it, and a seed from
another workload is corrected by the estimator's own refits. Nothing here imports torch or
vllm; numpy only when a seed is made from observe files.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from dspark_calib import __version__
from dspark_calib.atomic import atomic_write
from dspark_calib.errors import CalibError, display_path, escape
from dspark_calib.fileformat.version import parse_version, utc_now

SEED_SCHEMA_VERSION = "1.0"
FORMAT = "dspark-calib estimator seed"
MAX_SEED_BYTES = 64 << 10  # a seed is a few hundred bytes; read at every engine start
MAX_POSITIONS = 64  # intercepts: one per draft position (vLLM drafts a handful)
# vLLM's refit weighs each graded draft by p(1 - p), which float32 makes 0 once a logit passes
# ~17: a fit whose coefficients reach this many logits predicts certainties and cannot step back
# (its Newton steps divide by the L2 term alone); no calibrated fit comes near it.
MAX_LOGIT = 100.0


@dataclass(frozen=True)
class SeedKey:
    name: str
    why: str


SEED_KEYS: tuple[SeedKey, ...] = (
    SeedKey("vllm_version", "the feature (the top draft probability's log-odds) and the fit are vLLM's code"),
    SeedKey("target_config_hash", "the target decides what is accepted"),
    SeedKey("model_revision", "other target weights accept other drafts (the config hash misses a weights-only "
                              "revision)"),
    SeedKey("hf_overrides", "overrides change the models after config.json was read"),
    SeedKey("model_impl", "another implementation computes other logits"),
    SeedKey("draft_config_hash", "the drafter's logits are the feature"),
    SeedKey("draft_revision", "other drafter weights draft with other confidence"),
    SeedKey("speculative_method", "who drafts, and from what"),
    SeedKey("num_speculative_tokens", "one intercept per draft position"),
    SeedKey("dtype", "logits computed in another precision"),
    SeedKey("kv_cache_dtype", "a quantized KV cache changes both models' logits"),
    SeedKey("quantization", "quantized weights change both models' logits"),
    SeedKey("load_format", "dummy weights draft and accept nothing like real ones"),
    SeedKey("rejection_sample_method", "synthetic acceptance ignores what the drafts are"),
    SeedKey("synthetic_acceptance_rates", "under synthetic acceptance the rates are the acceptance (null otherwise)"),
)
KEY_NAMES = tuple(k.name for k in SEED_KEYS)


@dataclass(frozen=True)
class EstimatorSeed:
    """Coefficients for vLLM's OnlineAcceptanceEstimator and the engine they fit (``keys``)."""

    keys: dict[str, Any]
    slope: float
    intercepts: tuple[float, ...]
    refits: int  # refits the recording estimator had done
    steps: int  # its step() calls since its engine started
    source: dict[str, Any] = field(default_factory=dict)  # provenance: files, the file and host read
    # set once, when the seed is made: what `seed --json` prints and the file it writes say the same
    created_at: str = field(default_factory=lambda: utc_now())

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "schema_version": SEED_SCHEMA_VERSION, "tool_version": __version__,
                "created_at": self.created_at, "keys": dict(self.keys), "slope": self.slope,
                "intercepts": list(self.intercepts), "refits": self.refits, "steps": self.steps,
                "source": dict(self.source)}

    @classmethod
    def from_dict(cls, data: Any, path: str) -> "EstimatorSeed":
        """A seed read from a file, checked (the file is operator input, read in every vLLM worker)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CalibError(f"not an estimator seed (no \"format\": \"{FORMAT}\")", path=path)
        version = parse_version(data.get("schema_version"), path, what="seed schema_version")
        if version[0] != parse_version(SEED_SCHEMA_VERSION)[0]:
            raise CalibError(f"seed schema {escape(data.get('schema_version'), 10)} is not readable by this "
                             f"dspark-calib (reads {SEED_SCHEMA_VERSION})", path=path)
        keys = data.get("keys")
        if not isinstance(keys, dict):
            raise CalibError("seed keys must be a JSON object", path=path)
        missing = [name for name in KEY_NAMES if name not in keys]
        if missing:
            raise CalibError(f"seed keys lack {', '.join(missing)}", path=path)
        problem = coefficients_problem(data.get("slope"), data.get("intercepts"))
        if problem:
            raise CalibError(problem, path=path)
        k = keys["num_speculative_tokens"]
        if not (type(k) is int and k == len(data["intercepts"])):
            raise CalibError(f"{len(data['intercepts'])} intercepts for num_speculative_tokens {escape(k, 20)}",
                             path=path)
        counts = [data.get(name) for name in ("refits", "steps")]
        if not all(type(v) is int and v >= 0 for v in counts):
            raise CalibError(f"refits and steps must be integers >= 0, got {escape(counts, 40)}", path=path)
        source, created = data.get("source", {}), data.get("created_at", "")
        return cls(keys={name: keys[name] for name in KEY_NAMES}, slope=float(data["slope"]),
                   intercepts=tuple(float(x) for x in data["intercepts"]), refits=counts[0], steps=counts[1],
                   source=source if isinstance(source, dict) else {},
                   created_at=created if isinstance(created, str) else "")

    def summary(self) -> str:
        """One line: the coefficients and how far they were fitted."""
        return (f"slope {self.slope:.4g}, intercepts {', '.join(f'{x:.3g}' for x in self.intercepts)} "
                f"(K={len(self.intercepts)}; fitted over {self.refits} refits, {self.steps} steps)")


def coefficients_problem(slope: Any, intercepts: Any) -> str:
    """'' when slope is a finite number >= 0 (vLLM's refit keeps it there) and intercepts 1 to
    MAX_POSITIONS finite numbers, none of them past MAX_LOGIT (a fit that ran away); otherwise
    what is wrong."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not (number(slope) and slope >= 0):
        return f"slope must be a finite number >= 0, got {escape(slope, 30)}"
    if not (isinstance(intercepts, list) and 1 <= len(intercepts) <= MAX_POSITIONS
            and all(number(v) for v in intercepts)):
        return f"intercepts must be a list of 1 to {MAX_POSITIONS} finite numbers, got {escape(intercepts, 60)}"
    top = max(map(abs, intercepts))
    if max(slope, top) > MAX_LOGIT:
        return (f"the estimator's fit ran away (slope {slope:.4g}, intercepts up to {top:.4g}; "
                f"a coefficient past {MAX_LOGIT:g} predicts certainties its refits cannot leave): not a seed")
    return ""


# -- files -----------------------------------------------------------------------------------------
def write_seed(seed: EstimatorSeed, path: str) -> str:
    """Atomically (a vLLM starting meanwhile reads the old seed or the new one, never half)."""
    text = json.dumps(seed.to_dict(), indent=2, allow_nan=False) + "\n"
    return atomic_write(path, lambda fh: fh.write(text.encode()))


def read_seed(path: str) -> EstimatorSeed:
    """A seed file, read as untrusted: a regular file only (a FIFO is refused, never waited on),
    at most MAX_SEED_BYTES, every value checked; one CalibError naming the file otherwise."""
    from dspark_calib.safe_open import read_json_file

    shown = display_path(path)
    return EstimatorSeed.from_dict(read_json_file(path, shown, max_bytes=MAX_SEED_BYTES), shown)


# -- matching an engine ------------------------------------------------------------------------
def _shown(value: Any) -> str:
    return escape(repr(value), 60)


def seed_mismatches(seed: EstimatorSeed, engine: Mapping[str, Any]) -> list[str]:
    """'KEY: seed A vs engine B' for every key on which the seed does not fit the engine (a key
    the engine does not report is None there: a seed recorded without it fits, one with it does not)."""
    return [f"{name}: seed {_shown(seed.keys.get(name))} vs engine {_shown(engine.get(name))}"
            for name in KEY_NAMES if seed.keys.get(name) != engine.get(name)]


# -- made from observe files -----------------------------------------------------------------------
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")  # observe's created_at: sorts as text


def _written_at(meta: Mapping[str, Any]) -> str:
    """When an observe file was written (its created_at); '' (before any) when it records none."""
    at = meta.get("created_at")
    return at if isinstance(at, str) and ISO_UTC.fullmatch(at) else ""


def seed_from_observed(paths: Iterable[str]) -> EstimatorSeed:
    """The newest reading after a refit of the estimator in these observe files (schema 1.3), with
    the keys they record; every file must record the same keys.

    Newest: the reading of the file written last (its created_at; files written in the same second:
    the reading with the most steps). Each engine start's estimator counts refits and steps from 0,
    a seeded one too, so counts do not compare across starts: the longest-running start is not the
    best fitted when a later start was seeded from it and refitted further, and a restart serves
    the workload of now. Within a start a later reading is a later refit of the same estimator, so
    the newest reading is that start's last. Readings before any refit (vLLM's defaults, or the
    seed the start was given) are never taken."""
    from dspark_calib.observe.file import read_observed
    from dspark_calib.observe.step import ABSENT

    paths = list(paths)
    keys: dict[str, Any] | None = None
    keys_from = ""
    best: tuple[tuple[str, int, int], EstimatorSeed] | None = None
    unrefitted = -1  # the most steps of a reading before any refit (-1: no reading at all)
    for path in paths:
        steps = read_observed([path])
        meta = steps.metadata[0].raw
        found = meta.get("estimator_keys")
        if not isinstance(found, dict):
            raise CalibError("records no acceptance estimator (written before observe schema 1.3, or by an engine "
                             "whose drafts are ranked without vLLM's estimator, e.g. DSpark's confidence head)",
                             path=path)
        found = {name: found.get(name) for name in KEY_NAMES}
        if keys is None:
            keys, keys_from = found, path
        elif found != keys:
            name = next(n for n in KEY_NAMES if found[n] != keys[n])
            raise CalibError(f"observed on another engine than {display_path(keys_from)}: {name}: "
                             f"{_shown(found[name])} vs {_shown(keys[name])}; make a seed from one engine's files",
                             path=path)
        k = keys["num_speculative_tokens"]
        if type(k) is not int or not 1 <= k <= MAX_POSITIONS:
            raise CalibError(f"records num_speculative_tokens {_shown(k)}", path=path)
        written = _written_at(meta)
        refits, counted = steps["estimator_refits"], steps["estimator_steps"]
        for row in (i for i in range(len(steps)) if refits[i] != ABSENT):
            if refits[row] < 1:
                unrefitted = max(unrefitted, int(counted[row]))
                continue
            rank = (written, int(counted[row]), int(refits[row]))
            if best is None or rank > best[0]:
                intercepts = steps["estimator_intercepts"][row]
                if len(intercepts) < k or (len(intercepts) > k and not all(map(math.isnan, intercepts[k:]))):
                    raise CalibError(f"an estimator reading of another width than num_speculative_tokens {k}",
                                     path=path)
                best = (rank, EstimatorSeed(
                    keys=keys, slope=float(steps["estimator_slope"][row]),
                    intercepts=tuple(float(x) for x in intercepts[:k]), refits=rank[2], steps=rank[1],
                    source={"file": os.path.basename(path), "host": escape(meta.get("host", ""), 80)}))
    if best is None and unrefitted < 0:
        raise CalibError("no estimator reading in the observe files given (the estimator records itself on the "
                         "first sampled step and after each refit)")
    if best is None:
        raise CalibError(f"the estimator never refitted in the observe files given ({unrefitted} steps; vLLM refits "
                         "every 100): its readings are its starting point (vLLM's defaults or its seed), nothing "
                         "learned to seed")
    seed = best[1]
    problem = coefficients_problem(seed.slope, list(seed.intercepts))
    if problem:
        raise CalibError(f"the chosen reading (refit {seed.refits}, {seed.source['file']}): {problem}")
    return replace(seed, source={**seed.source, "files": len(paths)})

"""Every DSPARK_CALIB_* variable: its name and how it is parsed, in one place.

Standard library only: the plugin entry point imports this in every vLLM process
(API server included) before it knows whether it has anything to do.

Parsers raise CalibError with one line naming the variable and its value
(escaped: an env value is operator input, but it still reaches a log line).
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

from dspark_calib.errors import CalibError, escape
from dspark_calib.pricing.policy import DEFAULT_CONTEXT_CHUNKS, DEFAULT_CONTEXT_TAIL_MILLI

PREFIX = "DSPARK_CALIB_"  # every name below; the plugin asks Ray to copy this prefix to its workers
CAPTURE = "DSPARK_CALIB_CAPTURE"  # capture mode: the capture directory (used by `dspark-calib profile`)
TABLE = "DSPARK_CALIB_TABLE"  # load mode: a table file, a directory of tables, or a pyarrow.fs URI
POLICY = "DSPARK_CALIB_POLICY"  # fallback (default) | strict | warn
CONTEXT_LEN = "DSPARK_CALIB_CONTEXT_LEN"  # context to price (default: vLLM's profile context)
ALLOW_REFERENCE = "DSPARK_CALIB_ALLOW_REFERENCE"  # 1: also accept tables converted from vLLM logs
LOAD_TIMEOUT = "DSPARK_CALIB_LOAD_TIMEOUT"  # seconds for the whole load decision (default 5)
DP_TIMEOUT = "DSPARK_CALIB_DP_TIMEOUT"  # seconds a DP replica waits for the others to agree (default 300)
TABLE_SHA256 = "DSPARK_CALIB_TABLE_SHA256"  # comma list of pinned content hashes (64 hex each)
PROBE = "DSPARK_CALIB_PROBE"  # 0: skip the load-time probe (default 1)
CONTEXT_AWARE = "DSPARK_CALIB_CONTEXT_AWARE"  # 0: keep vLLM's static tables for a multi-context table (default 1)
CONTEXT_TAIL = "DSPARK_CALIB_CONTEXT_TAIL"  # 0..1: mixed-context tail (rules.tail_context_sum; default 0.2)
CONTEXT_CHUNKS = "DSPARK_CALIB_CONTEXT_CHUNKS"  # price prefill chunks by query-context pairs (default 1; 0: KV sum)
OBSERVE = "DSPARK_CALIB_OBSERVE"  # observe mode: a directory for observed-*.parquet (with or without a table)
OBSERVE_EVERY = "DSPARK_CALIB_OBSERVE_EVERY"  # time every Nth priced step (default DEFAULT_OBSERVE_EVERY)
ESTIMATOR_SEED = "DSPARK_CALIB_ESTIMATOR_SEED"  # a seed file (`dspark-calib seed`): vLLM's acceptance estimator starts from it

ALL = (CAPTURE, TABLE, POLICY, CONTEXT_LEN, ALLOW_REFERENCE, LOAD_TIMEOUT, DP_TIMEOUT, TABLE_SHA256, PROBE,
       CONTEXT_AWARE, CONTEXT_TAIL, CONTEXT_CHUNKS, OBSERVE, OBSERVE_EVERY, ESTIMATOR_SEED)
POLICIES = ("fallback", "strict", "warn")
DEFAULT_LOAD_TIMEOUT_S = 5.0
MAX_LOAD_TIMEOUT_S = 600.0  # an engine start waits on it; longer is a typo, not a wish
# The replicas reach the agreement when each has loaded its weights, on its own schedule: the
# bound covers that skew, not a table read.
DEFAULT_DP_TIMEOUT_S = 300.0
MAX_DP_TIMEOUT_S = 3600.0
# Every 4th priced step: a sampled step costs tens of microseconds of host time, an unsampled one
# under 1 us (benchmarks/micro/bench_observe.py), so 1 in 4 keeps observing well under 1 % of a
# step while a busy server still records thousands of steps a minute.
DEFAULT_OBSERVE_EVERY = 4
MAX_OBSERVE_EVERY = 1_000_000
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def shown(value: str, limit: int = 40) -> str:
    """An env value as a log line may show it: escaped, truncated, quoted."""
    return repr(escape(value, limit))



def _get(env: Mapping[str, str] | None, name: str) -> str | None:
    return (os.environ if env is None else env).get(name)


def is_active(env: Mapping[str, str] | None = None) -> bool:
    """Does any variable ask the plugin for work? (nothing else is imported until it does)"""
    return bool(_get(env, CAPTURE) or _get(env, TABLE) or observe_dir(env) or estimator_seed(env))


def estimator_seed(env: Mapping[str, str] | None = None) -> str | None:
    """The seed file as given (None when unset or blank); vllm/estimator.py reads it."""
    raw = _get(env, ESTIMATOR_SEED)
    return raw if raw and raw.strip() else None


def observe_dir(env: Mapping[str, str] | None = None) -> str | None:
    """The observe directory as given (None when unset or blank); observer.py checks it."""
    raw = _get(env, OBSERVE)
    return raw if raw and raw.strip() else None


def observe_every(env: Mapping[str, str] | None = None) -> int:
    value = _number(env, OBSERVE_EVERY, int, "an integer")
    if value is None:
        return DEFAULT_OBSERVE_EVERY
    if not 1 <= value <= MAX_OBSERVE_EVERY:
        raise CalibError(f"{OBSERVE_EVERY}={value} must be between 1 and {MAX_OBSERVE_EVERY}")
    return value


def policy(env: Mapping[str, str] | None = None) -> str:
    raw = _get(env, POLICY) or ""
    value = raw.strip().lower() or "fallback"
    if value not in POLICIES:
        raise CalibError(f"{POLICY}={shown(raw)} is not one of {', '.join(POLICIES)}")
    return value


def is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() and int() also take '١٢' (Arabic-Indic), '²' or '1_000',
    which no operator means as a number and which a log line would show as something else."""
    return text.isascii() and text.isdigit()


_ASCII_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _number(env: Mapping[str, str] | None, name: str, convert: Any, what: str) -> Any:
    """The variable as a number, None when unset or empty; anything else is one CalibError line.
    Written in ASCII only (Python's int/float also read other scripts' digits and underscores)."""
    raw = (_get(env, name) or "").strip()
    if not raw:
        return None
    plain = _ASCII_NUMBER.fullmatch(raw) and (convert is float or is_decimal(raw.lstrip("+-")))
    try:
        if not plain:
            raise ValueError(raw)
        return convert(raw)
    except ValueError:
        raise CalibError(f"{name}={shown(raw)} is not {what} (ASCII digits)") from None


def context_len(env: Mapping[str, str] | None = None) -> int | None:
    value = _number(env, CONTEXT_LEN, int, "an integer")
    if value is None:
        return None
    if value <= 0:
        raise CalibError(f"{CONTEXT_LEN}={value} must be positive")
    return value


def _flag(env: Mapping[str, str] | None, name: str, default: bool) -> bool:
    """Unset or blank: the default (as for every other variable here; a blank must not turn a
    default-on setting off without a word)."""
    raw = _get(env, name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise CalibError(f"{name}={shown(raw)} is not a boolean (1/0, true/false, yes/no)")


def allow_reference(env: Mapping[str, str] | None = None) -> bool:
    return _flag(env, ALLOW_REFERENCE, False)


def probe_enabled(env: Mapping[str, str] | None = None) -> bool:
    return _flag(env, PROBE, True)


def context_aware_enabled(env: Mapping[str, str] | None = None) -> bool:
    return _flag(env, CONTEXT_AWARE, True)


def context_chunks_enabled(env: Mapping[str, str] | None = None) -> bool:
    return _flag(env, CONTEXT_CHUNKS, DEFAULT_CONTEXT_CHUNKS)


def context_tail_milli(env: Mapping[str, str] | None = None) -> int:
    """The mixed-context tail t in thousandths (pricing.rules.tail_context_sum); the default when unset."""
    value = _number(env, CONTEXT_TAIL, float, "a number")
    if value is None:
        return DEFAULT_CONTEXT_TAIL_MILLI
    return tail_to_milli(value, f"{CONTEXT_TAIL}={shown((_get(env, CONTEXT_TAIL) or '').strip())}")


def tail_to_milli(value: float, name: str) -> int:
    """A tail in [0, 1] as the integer thousandths every rank prices with; name (the setting, as the
    operator wrote it) leads the one-line error. A nonzero tail finer than 0.001 is refused, not
    silently rounded to 0."""
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise CalibError(f"{name} must be between 0 and 1")
    milli = round(value * 1000)
    if value and not milli:
        raise CalibError(f"{name} is below the tail's resolution, 0.001")
    return milli


def load_timeout(env: Mapping[str, str] | None = None) -> float:
    return _seconds(env, LOAD_TIMEOUT, DEFAULT_LOAD_TIMEOUT_S, MAX_LOAD_TIMEOUT_S)


def dp_timeout(env: Mapping[str, str] | None = None) -> float:
    return _seconds(env, DP_TIMEOUT, DEFAULT_DP_TIMEOUT_S, MAX_DP_TIMEOUT_S)


def _seconds(env: Mapping[str, str] | None, name: str, default: float, top: float) -> float:
    value = _number(env, name, float, "a number of seconds")
    if value is None:
        return default
    if not 0 < value <= top:  # also refuses nan and inf
        raise CalibError(f"{name}={value:g} must be > 0 and <= {top:g} seconds")
    return value


def pinned_hashes(env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The pinned content hashes in the order given (the first that fits loads), or None when
    nothing is pinned.

    A set but malformed pin list is an error, never "no pin": an operator who pins
    has said the bucket is not trusted, so a typo must not open it to every table.
    """
    raw = _get(env, TABLE_SHA256)
    if raw is None or not raw.strip():
        return None
    pins: dict[str, None] = {}
    for item in raw.split(","):
        item = item.strip().lower().removeprefix("sha256:")
        if not item:
            continue
        if not _HEX64.fullmatch(item):
            raise CalibError(f"{TABLE_SHA256}: {shown(item, 20)} is not a full 64-hex content hash "
                             "(`dspark-calib inspect TABLE --json` prints it as content_hash)")
        pins[item] = None
    if not pins:
        raise CalibError(f"{TABLE_SHA256}={shown(raw)} names no hash")
    return tuple(pins)

"""`check`: which table the plugin would load for an engine described offline, and why not the others.

No running engine, no torch, no vllm import here: the engine arrives as the dict the load
decision checks (from options, or resolved from `vllm serve` flags by serve_args or the
vLLM wing before this module is called), and the decision is the plugin's own
(dspark_calib.selection.decide), read from its ``Decision.chosen`` / ``Decision.candidates``
records, never from its log text. Which keys exist, how a value is typed and which keys
block is the fingerprint registry's (fingerprint.KEYS): a key added there is accepted by
--engine and compared here unchanged.

A blocking key the engine dict lacks is one only the running engine decides (its GPU, the
attention backend its layers resolve): never a pass. The verdict says so, and so does the
exit code (``CheckResult.exit_code``): 0 a table loads and every blocking key was checked,
3 a table loads if the keys decided at start match, 1 none loads, 2 a table is corrupt or
unreadable where the answer depends on it. Keys the table did not record (an older table)
never block and are listed.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dspark_calib.env import is_decimal
from dspark_calib.errors import CalibError

EXIT_LOADS, EXIT_NONE, EXIT_CORRUPT, EXIT_IF_MATCH = 0, 1, 2, 3
LOADS = "loads"
FITS = "fits"  # fits, but the plugin picks another (newer) one
MISMATCH = "mismatch"
UNREADABLE = "unreadable"
# The load decision's candidate statuses, as check reports them.
_STATUS = {"chosen": LOADS, "fits": FITS, "mismatch": MISMATCH, "unpinned": MISMATCH, "refused": UNREADABLE,
           "unreadable": UNREADABLE}


def fingerprint_keys() -> list[str]:
    from dspark_calib.fingerprint import KEYS

    return [k.name for k in KEYS]


def parse_engine_pairs(pairs: Sequence[str]) -> dict[str, Any]:
    """--engine KEY=VALUE, typed by the registry: a list key takes comma-separated integers
    (1,2,4 or [1, 2, 4]), an integer key an integer, a string key the text as given; ``null``
    is None (quantization=null: no quantization). KEY must be a registry key."""
    from dspark_calib.fingerprint import KEYS

    registry = {k.name: k for k in KEYS}
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or not name:
            raise CalibError(f"--engine {pair!r}: expected KEY=VALUE")
        key = registry.get(name)
        if key is None:
            raise CalibError(f"--engine {name}: not a fingerprint key (one of {', '.join(registry)})")
        out[name] = _typed(key, raw)
    return out


def _typed(key: Any, raw: str) -> Any:
    if raw == "null":
        return None
    if key.types == (tuple,):
        parts = [p.strip() for p in raw.strip("[]").split(",") if p.strip()]
        if parts and all(is_decimal(p) for p in parts):  # sizes: never negative
            return [int(p) for p in parts]
    elif key.types == (int,):
        if is_decimal(raw):  # sizes and counts: never negative
            return int(raw)
    else:  # a string key: the text, or a JSON string when quoted
        text = raw
        if len(raw) >= 2 and raw[0] == raw[-1] == '"':
            try:
                text = str(json.loads(raw))
            except ValueError:
                pass
        if not any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):  # a lone surrogate cannot be printed
            return text
    what = "text without lone surrogates" if key.types not in ((tuple,), (int,)) else f"{key.type_name}, not negative"
    raise CalibError(f"--engine {key.name}={raw[:40]!r}: must be {what}")


def describe(*, model: str | None = None, draft: str | None = None, extra: dict[str, Any] | None = None,
             **keys: Any) -> dict[str, Any]:
    """The engine dict the load decision checks, from what the user gave (None: not given, not checked).
    Model directories become their config hashes, computed as the fingerprint does; a dtype is named
    as vLLM resolves it (auto: the model config's, so without --model it stays unchecked)."""
    from dspark_calib.fingerprint import config_hash, resolve_config_dir
    from dspark_calib.serve_args import model_dtype

    engine = {k: v for k, v in keys.items() if v is not None}
    if "dtype" in engine:
        engine["dtype"] = model_dtype(str(engine["dtype"]), model)
        if engine["dtype"] is None:
            del engine["dtype"]
    for key, given in (("target_config_hash", model), ("draft_config_hash", draft)):
        if given is not None:
            engine[key] = config_hash(resolve_config_dir(given) or given)
    engine.update(extra or {})
    return engine


def unchecked_keys(engine: dict[str, Any]) -> list[str]:
    """Keys the load decision compares (blocking or warning) that were not given."""
    from dspark_calib import fingerprint

    return list(fingerprint.unchecked_keys(engine))


def decided_at_start(engine: dict[str, Any]) -> list[str]:
    """Blocking keys the engine dict lacks: only the running engine knows them, so a load
    stays conditional on them."""
    from dspark_calib.fingerprint import BLOCKING, KEY

    return [k for k in unchecked_keys(engine) if KEY[k].load in BLOCKING]


def ignored_keys(engine: dict[str, Any]) -> list[str]:
    """Keys given that never block a load (compared at warning only, or not compared at all):
    said, so a user does not think they decided anything."""
    from dspark_calib.fingerprint import BLOCKING, KEYS

    blocking = {k.name for k in KEYS if k.load in BLOCKING}
    return [key for key in engine if key not in blocking]


@dataclass(frozen=True)
class TableReport:
    path: str
    content_hash: str
    created_at: str
    status: str  # LOADS, FITS, MISMATCH or UNREADABLE
    reason: str = ""  # the first key that does not fit, or why it cannot be read

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "content_hash": self.content_hash, "created_at": self.created_at,
                "status": self.status, "reason": self.reason}


@dataclass(frozen=True)
class CheckResult:
    source: str
    engine: dict[str, Any]
    unchecked: tuple[str, ...]  # compared by the load decision, not given
    ignored: tuple[str, ...]  # given, but never blocking
    tables: tuple[TableReport, ...]
    lines: tuple[str, ...]  # what the plugin would log, word for word
    unrecorded: tuple[str, ...] = ()  # given, but the chosen table did not record them
    at_start: tuple[str, ...] = ()  # blocking keys only the running engine decides
    resolution: str = ""  # how the engine dict was made, one line
    problem: str = ""  # nothing loads and some table could not be read: exit 2 after the report
    coverage: str = ""  # the chosen table's contexts against the engine's max_model_len

    @property
    def chosen(self) -> TableReport | None:
        return next((t for t in self.tables if t.status == LOADS), None)

    @property
    def loads(self) -> bool:
        return self.chosen is not None

    @property
    def exit_code(self) -> int:
        if self.problem:
            return EXIT_CORRUPT
        if not self.loads:
            return EXIT_NONE
        return EXIT_IF_MATCH if self.at_start else EXIT_LOADS

    def to_dict(self) -> dict[str, Any]:
        chosen = self.chosen
        return {"source": self.source, "loads": self.loads, "exit_code": self.exit_code,
                "chosen": chosen.to_dict() if chosen else None, "resolution": self.resolution,
                "engine": self.engine, "decided_at_start": list(self.at_start),
                "unchecked": list(self.unchecked), "not_recorded": list(self.unrecorded),
                "not_load_checks": list(self.ignored),
                "coverage": self.coverage, "tables": [t.to_dict() for t in self.tables], "plugin_log": list(self.lines),
                "problem": self.problem}


def check_tables(source: str, engine: dict[str, Any], *, allow_reference: bool = False,
                 context_len: int | None = None, vllm_context_len: int = 8192, resolution: str = "",
                 env: Mapping[str, str] | None = None) -> CheckResult:
    """The plugin's decision for this engine, every table's status, and the chosen table read whole.

    The plugin reads a table's curves only; its raw samples are checked here (page checksums,
    the samples digest), so a damaged file is reported as such, never as a fit. A table that
    cannot be read where the answer depends on it (the file asked about, the one chosen) is a
    CalibError: one line, exit 2; when none loads and some file could not be read, the report
    carries the problem (exit 2 after it is shown).

    As the engine decides: under the pins of DSPARK_CALIB_TABLE_SHA256 and within the deadline of
    DSPARK_CALIB_LOAD_TIMEOUT (from `env`, the process environment by default; a malformed value is
    a CalibError, as it is an engine's refusal), with the same bounds on what is read."""
    from dspark_calib import env as E
    from dspark_calib.selection import Progress, decide, decide_within

    pins, timeout = E.pinned_hashes(env), E.load_timeout(env)
    if "://" not in source and not os.path.lexists(source):  # a typo is the user's error, not "no table"
        raise CalibError("no such file or directory", path=source)
    cancel, progress = threading.Event(), Progress()
    decision = decide_within(timeout, "fallback", source, lambda: decide(
        source, engine, policy="fallback", allow_reference=allow_reference, context_len=context_len,
        vllm_context_len=vllm_context_len, pins=pins, cancel=cancel, progress=progress), cancel, progress)
    if decision.source_error:  # a URI typo or an unreachable bucket: the user's error, as a local typo is
        raise CalibError(f"cannot list tables here: {decision.source_error}", path=source)
    chosen = decision.chosen if decision.load else None  # fallback: only a fitting table is chosen
    single = "://" not in source and not os.path.isdir(source)
    broken = [c for c in decision.candidates if _STATUS.get(c.status) == UNREADABLE and c.status != "refused"]
    if single and broken:
        raise CalibError(broken[0].reason or "unreadable", path=source)
    if chosen is not None or single:
        _read_whole(source, chosen.path if chosen else None, single)
    problem = ""
    if chosen is None and broken:  # the file that cannot be read may be the one that fits
        names = "; ".join(f"{c.path}: {c.reason}" for c in broken[:2]) + (" ..." if len(broken) > 2 else "")
        problem = f"no table would load and {len(broken)} could not be read ({names})"
    reports = [TableReport(c.path, c.content_hash, c.created_at, _STATUS.get(c.status, MISMATCH),
                           c.reason or _fit_reason(c, chosen, pins is not None)) for c in decision.candidates]
    reports.sort(key=lambda t: t.created_at, reverse=True)  # newest first, as the plugin prefers
    # from the decision's own reading (the report's path is escaped and cut for display: not reopened)
    unrecorded = list(decision.unrecorded) if chosen else []
    return CheckResult(source, dict(engine), tuple(unchecked_keys(engine)), tuple(ignored_keys(engine)),
                       tuple(reports), tuple(decision.lines), tuple(unrecorded), tuple(decided_at_start(engine)),
                       resolution, problem, decision.coverage if chosen else "")


def _fit_reason(c: Any, chosen: Any, pinned: bool = False) -> str:
    """Why a fitting table is not the one loaded: said truly for an identical file too."""
    if c.status != "fits" or chosen is None:
        return ""
    if c.content_hash and c.content_hash == chosen.content_hash:
        return "identical to the table that loads (same content hash); the plugin takes the one it lists first"
    if pinned:
        return "fits, but the plugin loads the fitting table whose hash DSPARK_CALIB_TABLE_SHA256 lists first"
    if c.created_at < chosen.created_at:
        return "fits, but the plugin loads a newer fitting table"
    return "fits as well; the plugin takes the one it lists first (newest modification)"


def _read_whole(source: str, shown: str | None, single: bool) -> None:
    """Read the chosen (or the only) table with its raw samples: page checksums and digest verified."""
    from dspark_calib.selection import PATH_LIMIT
    from dspark_calib.table.file import read_table
    from dspark_calib.table.sources import escape, list_candidates

    fs, listing = list_candidates(source)
    paths = [p for p in listing.paths if single or escape(p, PATH_LIMIT) == shown]
    for path in paths[:1]:
        try:
            read_table(path, filesystem=fs)
        except CalibError as exc:
            text = str(exc).removeprefix(f"{exc.path}: ") if exc.path else str(exc)
            raise CalibError(f"corrupt: {text}", path=path) from None

"""`check`: which table the plugin would load for an engine described offline, and why not the others.

No running engine, no torch, no vllm import: the engine is described by options, and the
decision is the plugin's own (dspark_calib.vllm.loader.examine and decide, which import
neither). Engine keys not given are not checked, exactly as when a running engine
cannot report them; they are listed, never failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Sequence

from dspark_calib.errors import CalibError

LOADS = "loads"
FITS = "fits"  # fits, but the plugin picks another (newer) one
MISMATCH = "mismatch"
UNREADABLE = "unreadable"


def fingerprint_keys() -> list[str]:
    from dspark_calib.fingerprint import Fingerprint

    return [f.name for f in fields(Fingerprint) if f.name != "extra"]


def parse_engine_pairs(pairs: Sequence[str]) -> dict[str, Any]:
    """--engine KEY=VALUE: VALUE as JSON when it parses (8192, null, [1, 2, 4]), a comma list of
    integers as a list, anything else as a string. KEY must be a fingerprint key."""
    known = fingerprint_keys()
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CalibError(f"--engine {pair!r}: expected KEY=VALUE")
        if key not in known:
            raise CalibError(f"--engine {key}: not a fingerprint key (one of {', '.join(known)})")
        out[key] = _value(raw.strip())
    return out


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        pass
    parts = [p.strip() for p in raw.split(",")]
    if len(parts) > 1 and all(p.lstrip("-").isdigit() for p in parts):
        return [int(p) for p in parts]
    return raw


def describe(*, model: str | None = None, draft: str | None = None, extra: dict[str, Any] | None = None,
             **keys: Any) -> dict[str, Any]:
    """The engine dict the loader checks, from what the user gave (None: not given, not checked).
    Model directories become their config hashes, computed as the fingerprint does."""
    from dspark_calib.fingerprint import config_hash, resolve_config_dir

    engine = {k: v for k, v in keys.items() if v is not None}
    for key, given in (("target_config_hash", model), ("draft_config_hash", draft)):
        if given is not None:
            engine[key] = config_hash(resolve_config_dir(given) or given)
    engine.update(extra or {})
    return engine


def unchecked_keys(engine: dict[str, Any]) -> list[str]:
    from dspark_calib import fingerprint

    registry = getattr(fingerprint, "unchecked_keys", None)  # C2; LOAD_CHECKS until then
    if registry is not None:
        return list(registry(engine))
    return [key for key, _ in fingerprint.LOAD_CHECKS if key not in engine]


def ignored_keys(engine: dict[str, Any]) -> list[str]:
    """Keys given that the plugin does not check before loading (recorded only): said, so a
    user does not think they were compared."""
    from dspark_calib import fingerprint

    checks = getattr(fingerprint, "LOAD_CHECKS", None)
    if checks is None:
        return []
    checked = {key for key, _ in checks}
    return [key for key in engine if key not in checked]


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
    unchecked: tuple[str, ...]
    ignored: tuple[str, ...]  # given, but not among the plugin's load checks
    tables: tuple[TableReport, ...]
    lines: tuple[str, ...]  # what the plugin would log, word for word

    @property
    def chosen(self) -> TableReport | None:
        return next((t for t in self.tables if t.status == LOADS), None)

    @property
    def loads(self) -> bool:
        return self.chosen is not None

    def to_dict(self) -> dict[str, Any]:
        chosen = self.chosen
        return {"source": self.source, "loads": self.loads, "chosen": chosen.to_dict() if chosen else None,
                "engine": self.engine, "unchecked": list(self.unchecked),
                "not_load_checks": list(self.ignored),
                "tables": [t.to_dict() for t in self.tables], "plugin_log": list(self.lines)}


def _chosen_path(decision: Any, candidates: Sequence[Any]) -> str | None:
    """The table the decision loads. C3's Decision.chosen when present; until then the one its
    'loaded cost table' line names (decide() logs exactly one such line when it loads)."""
    chosen = getattr(decision, "chosen", None)
    if chosen is not None:
        return getattr(chosen, "path", chosen)
    if not decision.load:
        return None
    loaded = [line for line in decision.lines if "loaded cost table " in line]
    for c in sorted(candidates, key=lambda c: -len(c.label)):
        if loaded and f"loaded cost table {c.label}," in loaded[-1]:
            return c.path
    return None


def check_tables(source: str, engine: dict[str, Any], *, allow_reference: bool = False,
                 context_len: int | None = None) -> CheckResult:
    from dspark_calib.vllm.loader import decide, examine

    _, candidates = examine(source, engine, allow_reference)
    decision = decide(source, engine, policy="fallback", allow_reference=allow_reference, context_len=context_len)
    chosen = _chosen_path(decision, candidates)
    reports = []
    for c in sorted(candidates, key=lambda c: c.created_at, reverse=True):
        if c.error:
            reports.append(TableReport(c.path, "", "", UNREADABLE, c.error))
        elif c.path == chosen:
            reports.append(TableReport(c.path, c.content_hash, c.created_at, LOADS))
        elif c.mismatches:
            reports.append(TableReport(c.path, c.content_hash, c.created_at, MISMATCH, str(c.mismatches[0])))
        else:
            why = "fits, but the plugin loads a newer fitting table" if chosen else "fits, but could not be read whole"
            reports.append(TableReport(c.path, c.content_hash, c.created_at, FITS, why))
    return CheckResult(source, dict(engine), tuple(unchecked_keys(engine)),
                       tuple(ignored_keys(engine)), tuple(reports), tuple(decision.lines))

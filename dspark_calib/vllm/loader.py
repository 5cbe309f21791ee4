"""Load mode (DSPARK_CALIB_TABLE=PATH): install a saved table instead of profiling.

Decides, on TP rank 0, whether a table fits the running engine (fingerprint
LOAD_CHECKS plus the backend rule), and applies DSPARK_CALIB_POLICY:

* fallback (default): no fitting table -> log why in one line, profile as vLLM does;
* strict: no fitting table -> refuse to start, naming each mismatching key and both values;
* warn: no fitting table -> load the closest one anyway, logging each mismatch.

When a table loads, batches_to_profile yields one warm-up run per size above the
capture limit (those runs JIT the piecewise shapes; skipping them would move that
cost to the first real request) and set_initial_cost_curves hands the table's
curves to vLLM's own set_cost_curves, so the TP broadcast and the dense tables
stay vLLM's.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from dspark_calib.errors import CalibError, first_line
from dspark_calib.fingerprint import BACKEND_REFERENCE, BACKEND_VLLM, LOAD_CHECKS, Fingerprint, Mismatch, load_mismatches

ENV_TABLE = "DSPARK_CALIB_TABLE"
ENV_POLICY = "DSPARK_CALIB_POLICY"
ENV_CONTEXT_LEN = "DSPARK_CALIB_CONTEXT_LEN"
ENV_ALLOW_REFERENCE = "DSPARK_CALIB_ALLOW_REFERENCE"
POLICIES = ("fallback", "strict", "warn")

# Under "vllm." so the line lands in vLLM's own log, with its format and level.
log = logging.getLogger("vllm.dspark_calib")


@dataclass(frozen=True)
class Candidate:
    path: str
    created_at: str = ""
    content_hash: str = ""
    fingerprint: Fingerprint | None = None
    mismatches: tuple[Mismatch, ...] = ()
    error: str = ""  # unreadable: why

    @property
    def label(self) -> str:
        return f"{self.path} (hash {self.content_hash[:12]})" if self.content_hash else self.path


@dataclass(frozen=True)
class Decision:
    load: bool
    lines: tuple[str, ...]  # what to log, one decision per line
    level: int = logging.INFO
    draft_curve: list = field(default_factory=list)
    verify_curve: list = field(default_factory=list)
    refuse: str = ""  # strict policy: the reason the engine must not start


def _filesystem(source: str) -> tuple[Any, str]:
    if "://" in source:
        import pyarrow.fs

        return pyarrow.fs.FileSystem.from_uri(source)
    return None, source


def list_candidates(source: str) -> tuple[Any, list[str]]:
    """Table files at `source`: the file itself, or every *.parquet in the directory."""
    fs, path = _filesystem(source)
    if fs is None:
        if os.path.isfile(path):
            return None, [path]
        if os.path.isdir(path):
            return None, sorted(os.path.join(path, f) for f in os.listdir(path)
                                if f.endswith(".parquet") and not f.startswith("."))
        raise CalibError("no such file or directory", path=source)
    import pyarrow.fs

    info = fs.get_file_info(path)
    if info.type == pyarrow.fs.FileType.File:
        return fs, [path]
    if info.type == pyarrow.fs.FileType.Directory:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path))
        return fs, sorted(i.path for i in infos if i.path.endswith(".parquet") and not i.base_name.startswith("."))
    raise CalibError("no such file or directory", path=source)


def examine(source: str, engine: dict[str, Any], allow_reference: bool) -> tuple[Any, list[Candidate]]:
    from dspark_calib.table import read_metadata

    fs, paths = list_candidates(source)
    out = []
    for path in paths:
        try:
            meta = read_metadata(path, filesystem=fs)
            fp = Fingerprint.from_dict(meta["fingerprint"])
        except CalibError as exc:
            out.append(Candidate(path=path, error=str(exc)))
            continue
        bad = load_mismatches(fp, engine)
        if fp.backend != BACKEND_VLLM and not (fp.backend == BACKEND_REFERENCE and allow_reference):
            want = f"{BACKEND_VLLM!r} ({ENV_ALLOW_REFERENCE}=1 also allows {BACKEND_REFERENCE!r})"
            bad.insert(0, Mismatch("backend", fp.backend, want))
        out.append(Candidate(path=path, created_at=str(meta.get("created_at", "")), content_hash=str(meta["content_hash"]),
                             fingerprint=fp, mismatches=tuple(bad)))
    return fs, out


def decide(source: str, engine: dict[str, Any], *, policy: str = "fallback", allow_reference: bool = False,
           context_len: int | None = None, vllm_context_len: int = 8192) -> Decision:
    """Pick the table to load (newest fitting one that reads), or say why none is loaded."""
    from dspark_calib.table import nearest, read_table

    if policy not in POLICIES:
        msg = f"dspark-calib: {ENV_POLICY}={policy!r} is not one of {', '.join(POLICIES)}; refusing to start"
        return Decision(False, (msg,), logging.ERROR, refuse=msg)
    try:
        fs, candidates = examine(source, engine, allow_reference)
    except CalibError as exc:
        return _no_table(policy, f"{ENV_TABLE}: {exc}")
    readable = [c for c in candidates if not c.error]
    if not readable:
        why = "; ".join(c.error for c in candidates) or "no *.parquet tables there"
        return _no_table(policy, f"{ENV_TABLE}={source}: no usable table ({why})")
    newest_first = sorted(readable, key=lambda c: c.created_at, reverse=True)
    fitting = [c for c in newest_first if not c.mismatches]
    lines: list[str] = []
    level = logging.INFO
    if fitting:
        choices = fitting
    else:
        closest = sorted(newest_first, key=lambda c: len(c.mismatches))  # stable: newest first among equals
        summary = "; ".join(str(m) for m in closest[0].mismatches)
        if policy == "strict":
            msg = f"dspark-calib: table {closest[0].label} does not fit this engine: {summary} (policy strict)"
            return Decision(False, (msg,), logging.ERROR, refuse=msg)
        if policy == "fallback":
            return Decision(False, (f"dspark-calib: not loading {closest[0].label}: {summary}; "
                                    "profiling at start-up as usual (policy fallback)",), logging.WARNING)
        level = logging.WARNING
        choices = closest
    unchecked = [key for key, _ in LOAD_CHECKS if key not in engine]
    for chosen in choices:  # a damaged newest table must not hide an intact older one
        try:
            table = read_table(chosen.path, filesystem=fs)
        except CalibError as exc:
            level = logging.WARNING
            lines.append(f"dspark-calib: skipping {chosen.label}: {exc}")
            continue
        if not fitting:
            lines += [f"dspark-calib: loading {chosen.label} despite mismatch {m} (policy warn)" for m in chosen.mismatches]
        wanted = context_len if context_len is not None else vllm_context_len
        ctx = nearest(table.context_lens(), wanted)
        draft, verify = table.curves[ctx].as_vllm()
        note = f"; not checked (engine did not report): {', '.join(unchecked)}" if unchecked else ""
        lines.append(f"dspark-calib: loaded cost table {chosen.label}, context {ctx} (wanted {wanted}), "
                     f"{len(draft)} draft / {len(verify)} verify points; start-up profiling skipped{note}")
        return Decision(True, tuple(lines), level, draft_curve=draft, verify_curve=verify)
    no = _no_table(policy, "no table could be read")
    return Decision(False, tuple(lines) + no.lines, logging.ERROR if no.refuse else logging.WARNING, refuse=no.refuse)


def _no_table(policy: str, why: str) -> Decision:
    if policy == "strict":
        msg = f"dspark-calib: {why} (policy strict)"
        return Decision(False, (msg,), logging.ERROR, refuse=msg)
    return Decision(False, (f"dspark-calib: {why}; profiling at start-up as usual (policy {policy})",), logging.WARNING)


def decision_from_env(manager: Any, capture_sizes: list[int]) -> Decision:
    """Everything the env asks for, decided on this rank; never raises (the engine must not die of it)."""
    from dspark_calib.vllm.engine_info import current_context_len, describe_engine

    policy = (os.environ.get(ENV_POLICY, "") or "fallback").strip().lower()
    # decide() refuses a bad policy itself; on the early exits below it is treated as strict.
    early = policy if policy in POLICIES else "strict"
    try:
        raw_ctx = os.environ.get(ENV_CONTEXT_LEN)
        try:
            ctx = int(raw_ctx) if raw_ctx else None
        except ValueError:
            return _no_table(early, f"{ENV_CONTEXT_LEN}={raw_ctx!r} is not an integer")
        engine = describe_engine(manager, capture_sizes, getattr(manager, "_dspark_vllm_config", None))
        return decide(os.environ[ENV_TABLE], engine, policy=policy,
                      allow_reference=os.environ.get(ENV_ALLOW_REFERENCE, "").strip().lower() in ("1", "true", "yes"),
                      context_len=ctx, vllm_context_len=current_context_len())
    except Exception as exc:  # noqa: BLE001 - S3 without credentials, an unknown URI scheme, permissions...
        return _no_table(early, f"{ENV_TABLE}: {type(exc).__name__}: {first_line(exc, 300)}")


class LoadMode:
    name = "load"

    def batches(self, manager: Any, capture_sizes: list[int], vllm_batches: list[dict]) -> Iterator[dict]:
        from dspark_calib.vllm.engine_info import broadcast_from_rank0, tp_rank_and_size

        decision = None
        if tp_rank_and_size()[0] == 0:
            decision = decision_from_env(manager, capture_sizes)
            for line in decision.lines:
                log.log(decision.level, line)
        decision = broadcast_from_rank0(decision)
        manager._dspark_decision = decision
        if decision.refuse:
            raise RuntimeError(decision.refuse)
        if not decision.load:
            yield from vllm_batches
            return
        # One untimed-in-effect warm-up per size vLLM does not capture (JIT for piecewise shapes).
        limit = manager._cudagraph_limit
        seen: set[int] = set()
        for batch in vllm_batches:
            if batch["num_tokens"] > limit and batch["num_tokens"] not in seen:
                seen.add(batch["num_tokens"])
                yield batch

    def install_curves(self, manager: Any, samples: list, original: Callable[[list], None]) -> None:
        decision: Decision | None = getattr(manager, "_dspark_decision", None)
        if decision is None or not decision.load:
            original(samples)
            return
        manager.set_cost_curves(list(decision.draft_curve), list(decision.verify_curve))

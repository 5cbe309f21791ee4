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

from dspark_calib.errors import CalibError
from dspark_calib.fingerprint import BACKEND_REFERENCE, Fingerprint, Mismatch, load_mismatches

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


def _read_meta(fs: Any, path: str) -> dict:
    from dspark_calib.table import _parse_meta, read_metadata
    import pyarrow.parquet as pq

    if fs is None:
        return read_metadata(path)
    try:
        with fs.open_input_file(path) as fh:
            schema = pq.read_schema(fh)
    except Exception as exc:  # noqa: BLE001
        raise CalibError(f"not a readable parquet file ({exc})", path=path) from None
    return _parse_meta(schema.metadata, path)


def examine(source: str, engine: dict[str, Any], allow_reference: bool) -> tuple[Any, list[Candidate]]:
    fs, paths = list_candidates(source)
    out = []
    for path in paths:
        try:
            meta = _read_meta(fs, path)
            fp = Fingerprint.from_dict(meta["fingerprint"])
        except CalibError as exc:
            out.append(Candidate(path=path, error=str(exc)))
            continue
        bad = load_mismatches(fp, engine)
        if fp.backend == BACKEND_REFERENCE and not allow_reference:
            bad.insert(0, Mismatch("backend", fp.backend, f"a measured table ({ENV_ALLOW_REFERENCE}=1 allows reference)"))
        out.append(Candidate(path=path, created_at=str(meta.get("created_at", "")), content_hash=str(meta["content_hash"]),
                             fingerprint=fp, mismatches=tuple(bad)))
    return fs, out


def decide(source: str, engine: dict[str, Any], *, policy: str = "fallback", allow_reference: bool = False,
           context_len: int | None = None, vllm_context_len: int = 8192) -> Decision:
    """Pick the table to load (newest fitting one), or say why none is loaded."""
    if policy not in POLICIES:
        return Decision(False, (f"dspark-calib: {ENV_POLICY}={policy!r} is not one of {', '.join(POLICIES)}; "
                                "refusing to start",), logging.ERROR, refuse=f"bad {ENV_POLICY} {policy!r}")
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
        chosen = fitting[0]
    else:
        closest = min(newest_first, key=lambda c: len(c.mismatches))
        summary = "; ".join(str(m) for m in closest.mismatches)
        if policy == "strict":
            msg = f"dspark-calib: table {closest.label} does not fit this engine: {summary} (policy strict)"
            return Decision(False, (msg,), logging.ERROR, refuse=msg)
        if policy == "fallback":
            return Decision(False, (f"dspark-calib: not loading {closest.label}: {summary}; "
                                    "profiling at start-up as usual (policy fallback)",), logging.WARNING)
        level = logging.WARNING
        lines += [f"dspark-calib: loading {closest.label} despite mismatch {m} (policy warn)" for m in closest.mismatches]
        chosen = closest
    from dspark_calib.table import read_table

    try:
        table = read_table(chosen.path, filesystem=fs)
    except CalibError as exc:
        return _no_table(policy, str(exc))
    wanted = context_len if context_len is not None else vllm_context_len
    ctx = table.nearest_context(wanted)
    draft, verify = table.curves[ctx].as_vllm()
    lines.append(f"dspark-calib: loaded cost table {chosen.label}, context {ctx} (wanted {wanted}), "
                 f"{len(draft)} draft / {len(verify)} verify points; start-up profiling skipped")
    return Decision(True, tuple(lines), level, draft_curve=draft, verify_curve=verify)


def _no_table(policy: str, why: str) -> Decision:
    if policy == "strict":
        return Decision(False, (f"dspark-calib: {why} (policy strict)",), logging.ERROR, refuse=why)
    return Decision(False, (f"dspark-calib: {why}; profiling at start-up as usual (policy {policy})",), logging.WARNING)


def decision_from_env(engine: dict[str, Any]) -> Decision:
    from dspark_calib.vllm.engine_info import current_context_len

    raw_ctx = os.environ.get(ENV_CONTEXT_LEN)
    try:
        ctx = int(raw_ctx) if raw_ctx else None
    except ValueError:
        return _no_table(os.environ.get(ENV_POLICY, "fallback"), f"{ENV_CONTEXT_LEN}={raw_ctx!r} is not an integer")
    return decide(os.environ[ENV_TABLE], engine,
                  policy=os.environ.get(ENV_POLICY, "fallback").strip().lower() or "fallback",
                  allow_reference=os.environ.get(ENV_ALLOW_REFERENCE, "") in ("1", "true", "yes"),
                  context_len=ctx, vllm_context_len=current_context_len())


class LoadMode:
    name = "load"

    def batches(self, manager: Any, capture_sizes: list[int], vllm_batches: list[dict]) -> Iterator[dict]:
        from dspark_calib.vllm.engine_info import broadcast_from_rank0, describe_engine, tp_rank_and_size

        decision = None
        if tp_rank_and_size()[0] == 0:
            engine = describe_engine(manager, capture_sizes, getattr(manager, "_dspark_vllm_config", None))
            decision = decision_from_env(engine)
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

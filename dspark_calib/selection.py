"""The load decision: which table, if any, an engine loads, and the one line that says why.

Pure: given a table source and what the engine is (``describe_engine``'s keys), it
lists and reads the candidates (``table.sources``, bounded: tables are untrusted
input), checks each fingerprint against the engine (``fingerprint.load_mismatches``,
the backend rule, pins, the profiled context) and applies the policy:

* fallback (default): no fitting table -> log why in one line, profile as vLLM does;
* strict: no fitting table -> refuse to start, naming the first problem;
* warn: no fitting table -> load the closest one anyway, logging its mismatches.

``check`` calls ``decide`` offline and load mode calls it inside the engine (on TP
rank 0, within ``decide_within``'s deadline), so what ``check`` says is what the
engine decides from the same inputs. Each file's errors stay with that file; every
string from a table or a file name is escaped before it reaches a line, and the
decision is one line whatever the directory holds. No torch, no vllm.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from dspark_calib import env as E
from dspark_calib import fingerprint as F
from dspark_calib.errors import PREFIX, CalibError, first_line
from dspark_calib.fileformat.version import parse_version
from dspark_calib.fingerprint import BACKEND_REFERENCE, BACKEND_VLLM, Mismatch, load_mismatches
from dspark_calib.fit import profile_context_len  # vLLM's clamp of the profiled context
from dspark_calib.pricing.policy import coverage
from dspark_calib.table.sources import SERVE_LIMITS, Limits, escape, list_candidates, open_table

# Verify cost grows with context (8192 vs 4096: 1.6-1.8x), so ~0.7 per doubling; 10 % of
# context is then ~5-7 % of cost: the probe's own 5 % floor. Farther is a mismatch.
MAX_CONTEXT_GAP = 0.10
MAX_NAMED = 3  # files named per decision line; the rest are counted
FUTURE_SKEW_S = 300.0  # clock skew between the host that wrote a table and this one
PATH_LIMIT = 160


class Outcome(enum.Enum):
    """What the engine does with a decision."""

    LOAD = "load"  # loads the chosen table, start-up profiling skipped
    PROFILE = "profile"  # profiles at start-up as vLLM does (fallback, or warn with nothing readable)
    REFUSE = "refuse"  # refuses to start (strict)


@dataclass(frozen=True)
class CandidateReport:
    """One file the decision looked at, and its first blocking problem."""

    path: str  # escaped for display
    content_hash: str = ""
    created_at: str = ""
    status: str = ""  # chosen | fits | mismatch | unpinned | unreadable | refused
    reason: str = ""  # the first blocking problem, one escaped line

    @property
    def label(self) -> str:
        return f"{self.path} (hash {self.content_hash[:12]})" if self.content_hash else self.path


@dataclass(frozen=True)
class Decision:
    load: bool
    lines: tuple[str, ...]  # what to log: one line per outcome
    level: int = logging.INFO
    draft_curve: list = field(default_factory=list)
    verify_curve: list = field(default_factory=list)
    refuse: str = ""  # strict policy: the reason the engine must not start
    candidates: tuple[CandidateReport, ...] = ()
    chosen: CandidateReport | None = None
    context_len: int = 0  # the table context loaded
    pair: Any = None  # its CurvePair (the probe compares with its spread)
    pairs: dict = field(default_factory=dict)  # context -> CurvePair of every profiled context (the probe's spreads)
    policy: str = "fallback"
    probe: bool = True
    # context -> (draft, verify) of every profiled context, for context-aware mode; filled only for
    # tables with 2+ contexts. Decided on rank 0 and broadcast with the rest, so TP ranks agree.
    curves: dict = field(default_factory=dict)
    source_error: str = ""  # the source itself could not be listed (scheme, bucket, credentials)
    unrecorded: tuple[str, ...] = ()  # blocking keys the engine gave that the chosen table did not record
    coverage: str = ""  # the loaded table's contexts against the engine's max_model_len (pricing.policy.coverage)

    @property
    def content_hash(self) -> str:
        return self.chosen.content_hash if self.chosen and self.load else ""

    @property
    def outcome(self) -> "Outcome":
        if self.load:
            return Outcome.LOAD
        return Outcome.REFUSE if self.refuse else Outcome.PROFILE


@dataclass
class _Examined:
    """What the decision keeps of one file: its report, its escaped problems and its sort key.
    The fingerprint and the read table are kept only for the file whose curves were read (the
    chosen one): every other file's parsed metadata is dropped once judged, so the memory of a
    decision is one table's, however many large footers the directory lists."""

    report: CandidateReport
    problems: list[str]
    sort_key: tuple = ()
    table: Any = None
    context_len: int = 0
    fingerprint: Any = None
    loadable: bool = True  # False: never chosen, whatever the policy (schema 1.0 under a pin)
    future: str = ""  # created_at ahead of this host's clock: said, and not used to order


def _examine(path: str, fs: Any, engine: dict, *, allow_reference: bool, pins: tuple[str, ...] | None,
             effective: int, limits: Limits, beat: tuple | None = None, read: bool = True,
             now: float | None = None) -> _Examined:
    """One file, opened once; every error stays with this file. The curves are read (from the
    same handle, hash-verified against the metadata checked here) only when the metadata says
    this file could beat `beat`, the best key so far."""
    shown = escape(path, PATH_LIMIT)
    try:
        tf = open_table(path, fs, limits)
    except Exception as exc:  # noqa: BLE001 - RecursionError from nested JSON, MemoryError, pyarrow...
        return _Examined(CandidateReport(shown, status="unreadable", reason=_why(exc)), [])
    with tf:
        return _judge(tf, shown, engine, allow_reference=allow_reference, pins=pins, effective=effective, beat=beat,
                      read=read, now=time.time() if now is None else now)


def _judge(tf: Any, shown: str, engine: dict, *, allow_reference: bool, pins: tuple[str, ...] | None,
           effective: int, beat: tuple | None, read: bool = True, now: float = 0.0) -> _Examined:
    meta = tf.meta
    fp, content_hash = meta.fingerprint, meta.content_hash
    base = dict(path=shown, content_hash=escape(content_hash, 64), created_at=escape(meta.raw.get("created_at"), 40))
    if pins is not None and content_hash.lower() not in pins:
        return _Examined(CandidateReport(**base, status="unpinned", reason=f"hash {escape(content_hash, 16)} is not "
                                         f"pinned by {E.TABLE_SHA256}"), [])
    if pins is not None and parse_version(meta.schema_version) < (1, 1):
        return _Examined(CandidateReport(**base, status="mismatch", reason=(
            f"schema {escape(meta.schema_version, 10)} under {E.TABLE_SHA256}: its hash leaves out its spreads, "
            "created_at and samples; a pin needs schema 1.1 or newer")),
            [], loadable=False)
    try:
        mismatches = load_mismatches(fp, engine)
    except Exception as exc:  # noqa: BLE001 - a value of a type no engine has: this file's problem only
        return _Examined(CandidateReport(**base, status="unreadable", reason=f"fingerprint: {_why(exc)}"), [])
    if fp.backend != BACKEND_VLLM and not (fp.backend == BACKEND_REFERENCE and allow_reference):
        want = f"{BACKEND_VLLM!r} ({E.ALLOW_REFERENCE}=1 also allows {BACKEND_REFERENCE!r})"
        mismatches.insert(0, Mismatch("backend", fp.backend, want))
    problems = [escape(m, 200) for m in mismatches]
    del mismatches  # their values are the table's (any size): only the escaped lines are kept
    from dspark_calib.table.model import nearest  # numpy: only once a table is being judged

    ctx = nearest(fp.context_lens, effective) if fp.context_lens else 0
    if effective > 0 and abs(ctx - effective) > MAX_CONTEXT_GAP * effective:
        mml = engine.get("max_model_len")
        problems.append(f"context_len: table's nearest profiled context {ctx} is {abs(ctx - effective) / effective:.0%}"
                        f" from the effective context {effective}" + (f" (engine max_model_len {mml})" if mml else ""))
    status = "mismatch" if problems else "fits"
    sort_key, future = _order(meta, content_hash, pins, now, len(problems))
    reason = problems[0] if problems else future
    ex = _Examined(CandidateReport(**base, status=status, reason=reason), problems, sort_key, None, ctx, future=future)
    if not read or (beat is not None and ex.sort_key <= beat):
        return ex  # metadata only, or cannot be chosen: its curves are never read, its fingerprint not kept
    try:  # the same handle; verifies the content hash and the reader's plausibility checks on what was read
        ex.table = tf.read(samples=False)
        ex.fingerprint = fp
    except Exception as exc:  # noqa: BLE001
        ex.table = None
        ex.report = replace(ex.report, status="unreadable", reason=_why(exc))
    return ex


def _reachable(curves: dict, chosen: int, max_model_len: Any) -> tuple[dict, list[int]]:
    """(the curves an engine of this max_model_len can price, the contexts left out): a context
    above max_model_len is never reached by a step (nor by vLLM's profile, clamped below it), and
    pricing up to it would place grid points over a range no request has; the chosen context (the
    nearest to the profiled one, within MAX_CONTEXT_GAP) always stays. A fitting table records its
    engine's max_model_len, so only an older table, or a forged one, has such a context."""
    if not (type(max_model_len) is int and max_model_len > 0):
        return dict(curves), []
    kept = {c: p for c, p in curves.items() if c <= max_model_len or c == chosen}
    return kept, sorted(c for c in curves if c not in kept)


def _order(meta: Any, content_hash: str, pins: tuple[str, ...] | None, now: float, problems: int) -> tuple[tuple, str]:
    """(sort key, what is said of the date): fewest problems first, then, under a pin, the pin
    listed first (the operator's order, never a date the file states); without one, the newest
    created_at, a date over FUTURE_SKEW_S ahead of this host's clock ordered after every table
    dated up to now (the reader refuses a day ahead; within a day a forged date must not win)."""
    if pins is not None:
        return (-problems, -pins.index(content_hash.lower())), ""
    when = meta.created_at.timestamp()
    if when > now + FUTURE_SKEW_S:
        ahead = (when - now) / 3600
        return ((-problems, 0, when), f"created_at {escape(meta.raw.get('created_at'), 40)} is {ahead:.1f} h ahead "
                f"of this host's clock: ordered after every table dated up to now")
    return (-problems, 1, when), ""


def _why(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "metadata nested too deeply"
    if isinstance(exc, MemoryError):
        return "out of memory while reading"
    if isinstance(exc, CalibError):  # the line names the file already: keep only the problem
        text = str(exc).removeprefix(f"{exc.path}: ") if exc.path else str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return escape(first_line(Exception(text), 300), 200)


def decide(source: str, engine: dict[str, Any], *, policy: str = "fallback", allow_reference: bool = False,
           context_len: int | None = None, vllm_context_len: int = 8192, pins: Sequence[str] | None = None,
           limits: Limits = SERVE_LIMITS, probe: bool = True, cancel: threading.Event | None = None,
           progress: "Progress | None" = None) -> Decision:
    """Pick the table to load (the newest fitting one that reads; under a pin, the first pin listed
    that fits), or say why none is loaded. One line. `cancel` (set by decide_within at its deadline)
    stops the reads between candidates; `progress` says where it is (decide_within's line)."""
    if policy not in E.POLICIES:
        msg = PREFIX + f"{E.POLICY}={escape(policy, 40)!r} is not one of {', '.join(E.POLICIES)}; refusing to start"
        return Decision(False, (msg,), logging.ERROR, refuse=msg, policy="strict")
    progress = progress if progress is not None else Progress()
    pins = tuple(dict.fromkeys(p.lower() for p in pins)) if pins is not None else None
    wanted = context_len if context_len is not None else vllm_context_len
    mml = engine.get("max_model_len")
    effective = profile_context_len(wanted, mml) if mml else wanted
    try:
        fs, listing = list_candidates(source, limits)
    except Exception as exc:  # noqa: BLE001 - no such path, an unknown URI scheme, credentials...
        return replace(no_table(policy, f"{E.TABLE}={escape(source, PATH_LIMIT)}: {_why(exc)}"),
                       source_error=_why(exc))
    seen = [_Examined(CandidateReport(escape(p, PATH_LIMIT), status="refused", reason=escape(w, 120)), [])
            for p, w in listing.refused]
    # Pass 1: every listed file's metadata (footer-bounded, cheap; at most limits.max_tables files,
    # the newest modification first). Pass 2: curve reads, the expensive part, best sort key first
    # and at most limits.max_candidates of them; the first that reads wins (no later one can beat it).
    progress.listed, progress.phase = len(listing.paths), "reading metadata"
    now = time.time()
    judged: list[tuple[str, _Examined]] = []
    for path in listing.paths:
        if cancel is not None and cancel.is_set():
            return no_table(policy, f"{E.TABLE}={escape(source, PATH_LIMIT)}: decision cancelled (deadline)")
        ex = _examine(path, fs, engine, allow_reference=allow_reference, pins=pins, effective=effective, limits=limits,
                      read=False, now=now)
        judged.append((path, ex))
        progress.examined += 1
    progress.phase = "reading curves"
    # stable: ties keep the earlier file, the newest modification
    order = sorted((i for i, (_, ex) in enumerate(judged) if ex.loadable and ex.report.status in ("fits", "mismatch")),
                   key=lambda i: judged[i][1].sort_key, reverse=True)
    best: _Examined | None = None  # highest sort key: fewest problems, then the pin's order or the newest created_at
    unread = 0
    for n, i in enumerate(order):
        if n >= limits.max_candidates:
            unread = len(order) - n
            break
        if cancel is not None and cancel.is_set():
            return no_table(policy, f"{E.TABLE}={escape(source, PATH_LIMIT)}: decision cancelled (deadline)")
        ex = _examine(judged[i][0], fs, engine, allow_reference=allow_reference, pins=pins, effective=effective,
                      limits=limits, now=now)
        judged[i] = (judged[i][0], ex)
        if ex.table is not None:
            best = ex
            break
    seen += [ex for _, ex in judged]
    reports = tuple(e.report for e in seen)
    others = _others([e.report for e in seen if e is not best], unread, limits) + _unlisted(listing, limits)
    if best is None:
        return no_table(policy, f"{E.TABLE}={escape(source, PATH_LIMIT)}: no usable table{others or ' (no *.parquet tables there)'}",
                         reports)
    label = best.report.label
    if best.problems:
        summary = "; ".join(best.problems[:4]) + ("; ..." if len(best.problems) > 4 else "")
        if policy == "strict":
            msg = PREFIX + f"table {label} does not fit this engine: {summary} (policy strict){others}"
            return Decision(False, (msg,), logging.ERROR, refuse=msg, candidates=reports, policy=policy)
        if policy == "fallback":
            return Decision(False, (PREFIX + f"not loading {label}: {summary}; profiling at start-up as usual "
                                    f"(policy fallback){others}",), logging.WARNING, candidates=reports, policy=policy)
    chosen = replace(best.report, status="chosen")
    reports = tuple(chosen if r is best.report else r for r in reports)
    ctx = best.context_len
    curves, far = _reachable(best.table.curves, ctx, mml)
    draft, verify = curves[ctx].as_vllm()
    unchecked, unrecorded, recorded = _key_report(best.fingerprint, engine)
    line = (PREFIX + f"loaded cost table {label}, context {ctx} for effective context {effective} "
            f"(engine max_model_len {mml if mml else 'unknown'}), {len(draft)} draft / {len(verify)} verify points; "
            "start-up profiling skipped")
    if best.table.calibration is not None:  # hosts come from the file: escaped
        line += f"; {escape(best.table.calibration.provenance(), 200)}"
    covered = coverage(curves, mml if isinstance(mml, int) else None)
    line += f"; {covered}"
    if best.problems:
        line += f"; despite mismatch {'; '.join(best.problems[:4])} (policy warn)"
    if far:
        line += (f"; table context{'s' if len(far) > 1 else ''} {_names([str(c) for c in far])} above the engine's "
                 f"max_model_len {mml} left out (no step reaches {'them' if len(far) > 1 else 'it'})")
    if pins is not None:
        line += f"; pinned by {E.TABLE_SHA256} (the first pin listed that fits wins, whatever the dates)"
    elif best.future:
        line += f"; {best.future}"
    if recorded:
        line += f"; recorded only, differs: {'; '.join(recorded[:4])}" + (" ..." if len(recorded) > 4 else "")
    if unrecorded:
        line += f"; not recorded in the table: {_names(unrecorded)}"
    if unchecked:
        line += f"; not checked (engine did not report): {_names(unchecked)}"
    risky = best.problems or recorded or unrecorded
    return Decision(True, (line + others,), logging.WARNING if risky else logging.INFO, draft_curve=draft,
                    verify_curve=verify, candidates=reports, chosen=chosen, context_len=ctx,
                    pair=curves[ctx], pairs=curves, policy=policy, probe=probe, curves=_all_curves(curves),
                    unrecorded=tuple(unrecorded), coverage=covered)


def _all_curves(curves: dict) -> dict:
    if len(curves) < 2:
        return {}
    from dspark_calib.pricing.costs import curves_for_broadcast  # numpy: only once a table loads

    return curves_for_broadcast(curves)


def _others(reports: list[CandidateReport], unread: int, limits: Limits) -> str:
    """'; skipping other files: 2 mismatch (a.parquet: why), 1 unreadable (...), 9996 not read' - bounded length."""
    if not reports and not unread:
        return ""
    groups: dict[str, list[CandidateReport]] = {}
    # within a status, the newest table first (created_at, then the path): the same line on every
    # host, whatever order the files' modification times put them in (a fresh checkout: all equal)
    for r in sorted(sorted(reports, key=lambda r: r.path), key=lambda r: r.created_at, reverse=True):
        groups.setdefault(r.status, []).append(r)
    parts, named = [], 0
    for status, items in groups.items():
        shown = []
        for r in items[: max(0, MAX_NAMED - named)]:
            shown.append(f"{r.label}: {r.reason[:160]}" if r.reason else r.label)
            named += 1
        more = f", +{len(items) - len(shown)} more" if len(items) > len(shown) and shown else ""
        word = "older fitting" if status == "fits" else status  # the chosen one is the newest fit
        parts.append(f"{len(items)} {word}" + (f" ({'; '.join(shown)}{more})" if shown else ""))
    if unread:
        parts.append(f"{unread} not read (over the {limits.max_candidates}-read limit, best first)")
    return "; skipping other files: " + ", ".join(parts)


def _unlisted(listing: Any, limits: Limits) -> str:
    """What the listing left out, and by which bound (the same on every host: check says it too)."""
    out = ""
    if listing.over:
        out += (f"; {listing.over} more *.parquet files not examined (over the {limits.max_tables}-file limit of a "
                "decision, newest modification first)")
    if listing.skipped:
        out += f"; {listing.skipped} directory entries past the first {limits.max_scan} not looked at"
    return out


def _key_report(fp: Any, engine: dict) -> tuple[list[str], list[str], list[str]]:
    """(keys the engine did not report, blocking keys the table did not record, recorded-only
    keys that differ): said in the load line, never a reason to refuse."""
    try:
        return (F.unchecked_keys(engine), F.unrecorded_keys(fp, engine),
                [escape(m, 160) for m in F.recorded_differences(fp, engine)])
    except Exception:  # noqa: BLE001 - a report, never a reason to fail the load
        return [], [], []


def _names(keys: list[str], limit: int = 4) -> str:
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def no_table(policy: str, why: str, reports: tuple = ()) -> Decision:
    if policy == "strict":
        msg = PREFIX + f"{why} (policy strict)"
        return Decision(False, (msg,), logging.ERROR, refuse=msg, candidates=reports, policy=policy)
    return Decision(False, (PREFIX + f"{why}; profiling at start-up as usual (policy {policy})",),
                    logging.WARNING, candidates=reports, policy=policy)


@dataclass
class Progress:
    """Where a decision is, for the line said when it misses its deadline (written by the
    deciding thread, read by the waiting one: plain counters, no lock needed)."""

    phase: str = "listing the source"
    listed: int = 0
    examined: int = 0

    def where(self) -> str:
        if self.phase == "listing the source":
            return "still listing the source"
        return f"stopped {self.phase}, {self.examined} of {self.listed} listed files examined"


def _thread_cpu_s(thread: threading.Thread) -> float | None:
    """CPU seconds the thread has run (None where the platform cannot say)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]
    except (AttributeError, OSError, TypeError, OverflowError):
        return None


def _usage() -> tuple[int, int]:
    """(peak RSS in KiB, major page faults) of this process; (0, 0) where unknown."""
    try:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        return int(ru.ru_maxrss), int(ru.ru_majflt)
    except Exception:  # noqa: BLE001 - a measurement, never a failure
        return 0, 0


def missed_deadline(timeout_s: float, progress: Progress | None, cpu_s: float | None, rss_kib: int, faults: int) -> str:
    """What a decision that missed its deadline was doing, as measured: where it stopped, how much
    of the wait its thread ran on this host's CPU, and what this process's memory did meanwhile.
    The source is named as a possible cause only when the thread was mostly waiting and memory was calm."""
    said = f"no decision within {timeout_s:g} s ({E.LOAD_TIMEOUT})" + (f"; {progress.where()}" if progress else "")
    memory = f"this process's peak RSS +{rss_kib / 1024:.0f} MiB, {faults} major page faults"
    if cpu_s is None:
        return f"{said}; {memory} (its CPU time cannot be read here)"
    said += f"; its thread ran {cpu_s:.1f} s on CPU"
    if cpu_s >= 0.5 * timeout_s:
        return f"{said}: busy on this host (too many or too large files for the deadline, not a slow source); {memory}"
    if faults > 100 or rss_kib > 256 * 1024:
        return f"{said}: mostly waiting while memory grew ({memory}): this host's memory, not the source"
    return (f"{said}: mostly waiting ({memory}): on the source's reads, or on this host's CPU or disk if the "
            "source is local")


def decide_within(timeout_s: float, policy: str, source: str, fn: Callable[[], Decision],
                  cancel: threading.Event | None = None, progress: Progress | None = None) -> Decision:
    """fn() on a daemon thread, waited for at most timeout_s: a stalled store or file system
    (reads that ignore their own timeouts) costs the engine the deadline, never a hang. At the
    deadline `cancel` is set, so a decide() given it stops reading (vLLM is profiling by then),
    and the line says what was measured (missed_deadline), with `progress` (given to decide())."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - reported below in one line
            box.append(exc)

    rss0, faults0 = _usage()
    worker = threading.Thread(target=run, name="dspark-calib-decide", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not box:
        if cancel is not None:
            cancel.set()
        rss1, faults1 = _usage()
        why = missed_deadline(timeout_s, progress, _thread_cpu_s(worker), rss1 - rss0, faults1 - faults0)
        return no_table(policy, f"{E.TABLE}={escape(source, PATH_LIMIT)}: {why}")
    if isinstance(box[0], BaseException):
        return no_table(policy, f"{E.TABLE}: {_why(box[0])}")
    return box[0]

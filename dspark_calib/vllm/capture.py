"""Capture mode (DSPARK_CALIB_CAPTURE=DIR): how `profile` gets samples out of vLLM.

vLLM times its start-up profile inside the worker processes, so the hooks that
extend and collect it run there (loaded by the plugin) and hand the samples to
the `profile` command through one directory, whose layout is owned by
`CaptureDir` below (nobody else builds these paths):

* plan.json (written by `profile`): context lengths, timed and warm-up replays per size, the GPU
  state blocks start in and its cool-down or settle time, and the shape replays (below).
* .lock (TP rank 0, for the whole capture): one engine per directory.
* progress.json (TP rank 0, while profiling): batches done / total.
* samples-rank{R}.json (every TP rank, atomically, when profiling ends): the tagged
  timed samples, vLLM's own curves per context, the engine, the hardware and the host.
* refusal.txt: vLLM's reason when it refuses adaptive verification, or (starting
  "dspark-calib:") the capture's own one-line error. The engine core runs in a child
  process for every tp, so this file is how that line reaches `profile`.

The schedule runs replays the way vLLM runs them: vLLM's batches_to_profile
yields each size _PROFILE_REPLAYS times back to back; we run that whole
sequence, in vLLM's order and grouping, once per block (warm-up blocks first,
discarded), for every context length, TP rank 0 cooling down before every block but
the first, or every rank settling under load before every block (gpu_state.py). A sample's
replay index counts block x vLLM's replays of that size (negative: warm-up and settle steps).

Shape blocks (plan.shape_replays > 0): vLLM's profile times every size N as R(N) = min(N,
max_num_seqs) requests of about one token, the only verify shape a table holds; served verifies
carry several tokens a request. After a context's timed blocks, one more block times each size
above the CUDA-graph capture limit that vLLM's uniform-decode dummy batch can take (N a multiple
of q = k + 1, N / q below R(N)) as N / q requests of q tokens (`uniform_decode=True`, a verify of
every draft; eager, as such a served step runs), shape_replays times back to back: the verify
sizes above the capture limit with several tokens a request that no profile runs. Not below the
limit: there vLLM replays a decode graph captured for R(N) requests and builds the dummy batch
with that graph's request count, so a uniform-decode dummy run is the profile's own batch again
(and a served step with fewer requests runs that graph with empty slots, a batch no dummy run
builds). Those samples go to the payload's ``shape_samples``, never to the curves, vLLM's fit or
the block telemetry: the table stays vLLM's one shape, and the kept capture holds the second for
the analysis that decides whether pricing should use it.

Imports only the standard library at module level: the plugin may import this
module in processes that never capture.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from dspark_calib.errors import PREFIX, CalibError
from dspark_calib.safe_open import open_lock_file
from dspark_calib.speculators import is_clamped_batch
from dspark_calib.atomic import atomic_write, atomic_write_json
from dspark_calib import env as E
from dspark_calib.telemetry import SERVING, STARTUP
from dspark_calib.vllm.gpu_state import (DEFAULT_COOLDOWN_S, DEFAULT_SETTLE_S, Cooldown, Settle, check_cooldown,
                                         check_settle, check_state, heaviest)

PLAN_FILE = "plan.json"
PROGRESS_FILE = "progress.json"
REFUSAL_FILE = "refusal.txt"
LOCK_FILE = ".lock"
DEFAULT_REPLAYS = 20
DEFAULT_WARMUP = 2


def _same_batch(reported: int, scheduled: int, max_reqs: int, max_tokens: int) -> bool:
    """Whether a step that reports `reported` tokens is the `scheduled`-token profile batch: the
    same count, or vLLM's _dummy_run clamp of it to max_num_batched_tokens - num_reqs x extra
    query slots per request (speculators.is_clamped_batch)."""
    if reported == scheduled:
        return True
    return reported < scheduled and is_clamped_batch(reported, max_tokens, min(scheduled, max_reqs))


class CaptureError(RuntimeError):
    """A capture that cannot go on: one line, the engine does not start (profile reports it)."""


@dataclass(frozen=True)
class Plan:
    """replays / warmup: samples wanted per size; rounded up to whole vLLM blocks (Schedule).
    gpu_state: the state blocks start in (gpu_state.py). cooldown_s: in the startup state, the
    most rank 0 pauses before each block but the first (0: never). settle_s: in the serving
    state, the most the settle steps before each block last (0: none)."""

    context_lens: tuple[int, ...]
    replays: int = DEFAULT_REPLAYS
    warmup: int = DEFAULT_WARMUP
    cooldown_s: float = DEFAULT_COOLDOWN_S
    gpu_state: str = STARTUP
    settle_s: float = DEFAULT_SETTLE_S
    shape_replays: int = 0  # timed replays of each size in the uniform-decode shape (0: no shape block)

    def __post_init__(self) -> None:
        if not self.context_lens or any(int(c) <= 0 for c in self.context_lens):
            raise ValueError(f"context lengths must be positive, got {self.context_lens}")
        if self.replays < 1 or self.warmup < 0 or self.shape_replays < 0:
            raise ValueError(f"need replays >= 1, warmup >= 0 and shape replays >= 0, got {self.replays}, "
                             f"{self.warmup}, {self.shape_replays}")
        object.__setattr__(self, "context_lens", tuple(int(c) for c in self.context_lens))
        object.__setattr__(self, "cooldown_s", check_cooldown(self.cooldown_s))
        object.__setattr__(self, "settle_s", check_settle(self.settle_s))
        check_state(self.gpu_state)


# Locks this process holds, by real path: an in-process engine (tp 1 without
# multiprocessing) may come back to its own directory; flock would refuse it.
_HELD: dict[str, int] = {}


class CaptureDir:
    """The capture directory as one typed contract: every file in it, read and written here."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        return f"CaptureDir({self.path!r})"

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def plan_path(self) -> str:
        return self._file(PLAN_FILE)

    @property
    def progress_path(self) -> str:
        return self._file(PROGRESS_FILE)

    @property
    def refusal_path(self) -> str:
        return self._file(REFUSAL_FILE)

    @property
    def lock_path(self) -> str:
        return self._file(LOCK_FILE)

    def samples_path(self, rank: int) -> str:
        return self._file(f"samples-rank{int(rank)}.json")

    # -- plan (profile writes, rank 0 reads) --------------------------------------
    def write_plan(self, plan: Plan) -> None:
        atomic_write_json(self.plan_path, asdict(plan))

    def read_plan(self) -> Plan:
        """A missing or bad plan is an error, never a silent default (a stray
        DSPARK_CALIB_CAPTURE must not turn a normal start into a long profile)."""
        try:
            with open(self.plan_path) as fh:
                data = json.load(fh)
            return Plan(context_lens=tuple(data["context_lens"]), replays=int(data["replays"]),
                        warmup=int(data["warmup"]),  # an older plan.json has no cool-down: the default
                        cooldown_s=float(data.get("cooldown_s", DEFAULT_COOLDOWN_S)),
                        gpu_state=str(data.get("gpu_state", STARTUP)),
                        settle_s=float(data.get("settle_s", DEFAULT_SETTLE_S)),
                        shape_replays=int(data.get("shape_replays", 0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CaptureError(PREFIX + f"{E.CAPTURE}={self.path}: no usable {PLAN_FILE} ({exc}); "
                               "capture mode is set by `dspark-calib profile` only") from None

    # -- progress, samples, refusal -----------------------------------------------
    def write_progress(self, done: int, total: int, context_len: int, *, durable: bool = False) -> None:
        # durable=False: written inside the timed loop, must not stall it on fsync
        atomic_write_json(self.progress_path, {"done": done, "total": total, "context_len": context_len},
                          durable=durable)

    def read_progress(self) -> dict | None:
        try:
            with open(self.progress_path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def write_samples(self, rank: int, payload: dict[str, Any]) -> str:
        return atomic_write_json(self.samples_path(rank), payload)

    def read_samples(self, rank: int = 0) -> dict[str, Any] | None:
        """None when this rank wrote nothing (the plugin did not run)."""
        try:
            with open(self.samples_path(rank)) as fh:
                return json.load(fh)
        except FileNotFoundError:
            return None

    def write_refusal(self, text: str) -> bool:
        """Only while this process holds (or can take) the lock: never into another engine's capture.
        A lock taken only for this write is released again (the directory stays usable)."""
        held = self.locked
        try:
            self.lock()
        except CaptureError:
            return False
        try:
            atomic_write(self.refusal_path, lambda fh: fh.write(text.encode()))
        finally:
            if not held:
                self.unlock()
        return True

    def read_refusal(self) -> str | None:
        try:
            with open(self.refusal_path) as fh:
                return fh.read().strip()
        except FileNotFoundError:
            return None

    # -- the lock ---------------------------------------------------------------
    def lock(self) -> None:
        """Exclusive, non-blocking: a second engine capturing here fails at once, naming the directory."""
        key = os.path.realpath(self.path)
        if key in _HELD:
            return
        try:
            fd = open_lock_file(self.lock_path, LOCK_FILE)
        except CalibError as exc:  # ".lock: is a symlink ...": one line, never an OSError into vLLM's profile loop
            raise CaptureError(PREFIX + f"{E.CAPTURE}={self.path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise CaptureError(PREFIX + f"{E.CAPTURE}={self.path}: another engine is capturing into this "
                               f"directory{who}; give each profile run its own directory") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as exc:  # a full or read-only file system: said in one line, never raised into vLLM
            os.close(fd)
            raise CaptureError(PREFIX + f"{E.CAPTURE}={self.path}: cannot write {LOCK_FILE} ({exc.strerror})") from None
        _HELD[key] = fd

    def unlock(self) -> None:
        fd = _HELD.pop(os.path.realpath(self.path), None)
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock

    @property
    def locked(self) -> bool:
        return os.path.realpath(self.path) in _HELD


@dataclass(frozen=True)
class BatchTag:
    context_len: int
    replay: int  # block x vLLM's replays of this size + k; < 0: warm-up or settle, timed by vLLM but discarded
    num_tokens: int
    block: int = 0  # < 0: a warm-up block
    shape: bool = False  # a shape block's uniform-decode batch: shape_samples only


@dataclass(frozen=True)
class Schedule:
    """vLLM's own profile sequence, repeated in blocks, per context."""

    tags: tuple[BatchTag, ...]
    batches: tuple[dict, ...]
    vllm_replays: int  # times vLLM's sequence holds each size (its _PROFILE_REPLAYS)
    warmup_blocks: int
    timed_blocks: int

    @classmethod
    def build(cls, plan: Plan, vllm_batches: list[dict], query_len: int = 0, max_reqs: int = 0,
              graph_limit: int = 0) -> "Schedule":
        """query_len (the engine's decode query length, k + 1), max_reqs (max_num_seqs) and
        graph_limit (the largest captured size) size the shape blocks; query_len 0: none."""
        if not vllm_batches:
            raise CaptureError(PREFIX + "vLLM's batches_to_profile yielded no batch (no CUDA graph captured?); "
                               "nothing to profile, no table written")
        counts = Counter(b["num_tokens"] for b in vllm_batches)
        per = min(counts.values())
        warmup_blocks, timed_blocks = math.ceil(plan.warmup / per), math.ceil(plan.replays / per)
        tags: list[BatchTag] = []
        batches: list[dict] = []
        for ctx in plan.context_lens:
            for block in range(-warmup_blocks, timed_blocks):
                seen: Counter = Counter()
                for batch in vllm_batches:
                    n = batch["num_tokens"]
                    tags.append(BatchTag(ctx, block * counts[n] + seen[n], n, block))
                    seen[n] += 1
                    batches.append({**batch, "context_len": ctx})  # vLLM's dict, passed through
            shaped: Counter = Counter()
            for batch in shape_batches(vllm_batches, plan.shape_replays, query_len, max_reqs, graph_limit):
                n = batch["num_tokens"]
                tags.append(BatchTag(ctx, shaped[n], n, timed_blocks, shape=True))
                shaped[n] += 1
                batches.append({**batch, "context_len": ctx})
        return cls(tuple(tags), tuple(batches), per, warmup_blocks, timed_blocks)


def decode_query_len(manager: Any) -> int:
    """The runner's decode_query_len from vLLM's manager: drafts + the tokens each step samples
    (its bonus tokens)."""
    return int(manager.num_speculative_steps) + int(getattr(manager, "num_bonus_tokens", 1))


def shape_batches(vllm_batches: list[dict], replays: int, query_len: int, max_reqs: int,
                  graph_limit: int) -> list[dict]:
    """A shape block: each size of vLLM's sequence above graph_limit that its uniform-decode dummy
    batch takes as fewer requests than the profile's (a multiple of query_len, N / query_len below
    min(N, max_reqs)), replays times back to back, in vLLM's size order (the module docstring)."""
    if replays <= 0 or query_len <= 1 or max_reqs <= 0:
        return []
    first = {b["num_tokens"]: b for b in reversed(vllm_batches)}  # each size's first dict, its keys kept
    sizes = [n for n in dict.fromkeys(b["num_tokens"] for b in vllm_batches)
             if n > graph_limit and n % query_len == 0 and n // query_len < min(n, max_reqs)]
    return [{**first[n], "uniform_decode": True} for n in sizes for _ in range(replays)]


@dataclass
class CaptureRun:
    """What capture mode keeps between batches_to_profile and set_initial_cost_curves."""

    plan: Plan
    schedule: Schedule
    capture_sizes: list[int]
    rank: int
    tp_size: int
    start: float
    recorder: Any = None  # gpu_readings.BlockRecorder on TP rank 0: conditions per block
    cooldown: Cooldown | None = None  # TP rank 0's pauses between blocks (startup state)
    settle: Settle | None = None  # every rank's settle steps before each block (serving state)
    ran: list[BatchTag] = field(default_factory=list)  # every step handed to vLLM, settle steps included


def vllm_curves(vllm_set_initial_cost_curves: Callable, samples: list) -> tuple[list, list]:
    """Run the installed vLLM's own set_initial_cost_curves on a stand-in that records the
    curves it would install (no GPU, no TP broadcast)."""

    class _Recorder:
        curves: tuple[list, list] = ([], [])

        def set_cost_curves(self, draft_curve: list, verify_curve: list) -> None:
            self.curves = ([tuple(p) for p in draft_curve], [tuple(p) for p in verify_curve])

    recorder = _Recorder()
    vllm_set_initial_cost_curves(recorder, samples)
    return recorder.curves


def check_same_curves(ctx: int, ours: tuple[list, list], theirs: tuple[list, list]) -> None:
    """One loud line at the first point where dspark_calib.fit and vLLM disagree."""
    for kind, a, b in (("draft", ours[0], theirs[0]), ("verify", ours[1], theirs[1])):
        if [int(n) for n, _ in a] != [int(n) for n, _ in b]:
            raise CaptureError(PREFIX + f"dspark_calib.fit and vLLM's set_initial_cost_curves disagree at "
                               f"context {ctx}: {kind} sizes {len(a)} vs {len(b)} points; no table written")
        for (n, x), (_, y) in zip(a, b):
            if not math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=1e-12):
                raise CaptureError(PREFIX + f"dspark_calib.fit and vLLM's set_initial_cost_curves disagree at "
                                   f"context {ctx}: {kind} size {n}: {float(x)!r} vs vLLM's {float(y)!r} ms; "
                                   "no table written")


class CaptureMode:
    name = "capture"

    def __init__(self, directory: str):
        self.dir = CaptureDir(directory)

    def batches(self, manager: Any, capture_sizes: list[int], vllm_batches: list[dict]) -> Iterator[dict]:
        from dspark_calib.vllm.engine_info import broadcast_from_rank0, tp_rank_and_size
        from dspark_calib.vllm.gpu_readings import block_recorder
        from dspark_calib.vllm.runtime import state_of

        rank, tp_size = tp_rank_and_size()
        # Every rank must run the same batches (they hold collectives): rank 0 locks the
        # directory and reads the plan; its plan, or its one-line refusal, goes to all.
        plan_or_error: Plan | str = ""
        if rank == 0:
            try:
                self.dir.lock()
            except CaptureError as exc:
                plan_or_error = str(exc)
            else:
                try:
                    plan_or_error = self.dir.read_plan()
                except CaptureError as exc:
                    self.dir.unlock()
                    plan_or_error = str(exc)
        plan_or_error = broadcast_from_rank0(plan_or_error)
        with self._reported(rank):  # e.g. vLLM yielded no batch: the line must reach `profile`
            if isinstance(plan_or_error, str):
                raise CaptureError(plan_or_error)
            schedule = Schedule.build(plan_or_error, vllm_batches, decode_query_len(manager),
                                      int(manager.req_states.max_num_reqs),
                                      max(capture_sizes, default=0))
        plan = plan_or_error
        recorder = block_recorder() if rank == 0 else None
        reader = recorder.reader if recorder is not None else None
        cooler = Cooldown(plan.cooldown_s, reader) if reader is not None and plan.gpu_state == STARTUP else None
        settle = Settle(plan.settle_s, reader, agree=broadcast_from_rank0) if plan.gpu_state == SERVING else None
        run = CaptureRun(plan, schedule, list(capture_sizes), rank, tp_size, time.perf_counter(), recorder, cooler,
                         settle)
        state_of(manager).run = run
        yield from self._run(run, vllm_batches)

    def _run(self, run: CaptureRun, vllm_batches: list[dict]) -> Iterator[dict]:
        """Yield the schedule; telemetry is read, the cool-down taken and the settle steps run at
        block boundaries, i.e. between yields, after the previous step returned and before the
        next starts: never inside a timed step. The start reading follows the pause or the
        settle: it shows the state the block starts in. Every step handed out is in run.ran."""
        schedule, recorder, cooler = run.schedule, run.recorder, run.cooldown
        total, last_report, current = len(schedule.tags), 0.0, None
        settle_step = heaviest(vllm_batches)
        for i, (tag, batch) in enumerate(zip(schedule.tags, schedule.batches)):
            if (tag.context_len, tag.block) != current:
                if recorder is not None:
                    recorder.end()
                if cooler is not None and current is not None:
                    cooler.pause()
                first, current = current is None, (tag.context_len, tag.block)
                if run.settle is not None:
                    yield from self._settle(run, {**settle_step, "context_len": tag.context_len})
                reading = recorder.start(*current) if recorder is not None and not tag.shape else None
                if cooler is not None and first:
                    cooler.baseline(reading)
            now = time.monotonic()
            if run.rank == 0 and now - last_report > 0.5:
                last_report = now
                self.dir.write_progress(i, total, tag.context_len)
            run.ran.append(tag)
            yield batch
        if recorder is not None:
            recorder.end()

    @staticmethod
    def _settle(run: CaptureRun, batch: dict) -> Iterator[dict]:
        """The block's heaviest step, back to back, while rank 0 says so (every rank alike)."""
        run.settle.begin()
        while run.settle.more():
            run.ran.append(BatchTag(batch["context_len"], -1, batch["num_tokens"]))  # load, never a sample
            yield batch

    def install_curves(self, manager: Any, samples: list, original: Callable[[list], None]) -> None:
        from dspark_calib.vllm.runtime import state_of

        state = state_of(manager)
        run: CaptureRun = state.run
        try:
            with self._reported(run.rank):
                payload, vllm_ctx = self._payload(manager, state, run, samples)
            self.dir.write_samples(run.rank, payload)
            if run.rank == 0:
                last = run.schedule.tags[-1].context_len
                self.dir.write_progress(len(run.schedule.tags), len(run.schedule.tags), last, durable=True)
        finally:
            if run.rank == 0:
                self.dir.unlock()
        # vLLM still needs cost curves to finish starting: its own rule, on the timed
        # samples of the profiled context nearest the one it would have profiled itself.
        original([s for s, t in zip(samples, run.ran) if t.replay >= 0 and not t.shape and t.context_len == vllm_ctx])

    @contextlib.contextmanager
    def _reported(self, rank: int) -> Iterator[None]:
        """The engine core is another process: vLLM's parent only says "engine core failed".
        Rank 0 leaves the capture's one line where `profile` looks (write_refusal re-checks
        the lock, so never into another engine's directory)."""
        try:
            yield
        except CaptureError as exc:
            if rank == 0:
                self.dir.write_refusal(str(exc))
            raise

    def _payload(self, manager: Any, state: Any, run: CaptureRun, samples: list) -> tuple[dict, int]:
        from dspark_calib.fit import fit_pair
        from dspark_calib.samples import Sample
        from dspark_calib.table.model import nearest
        from dspark_calib.vllm.engine_info import current_context_len, describe_engine, hardware

        tags = run.ran
        if len(samples) != len(tags):
            # Every dummy run reaches drafter_end in 0.33; if not, the pairing is lost.
            raise CaptureError(PREFIX + f"vLLM returned {len(samples)} step timings for {len(tags)} "
                               "profile batches; cannot attribute them, no table written")
        max_reqs = int(manager.req_states.max_num_reqs)
        max_tokens = int(manager.req_states.max_num_batched_tokens)
        for i, (s, t) in enumerate(zip(samples, tags)):
            # vLLM records each step's own token count (input_batch.num_tokens): it must be the batch's,
            # or the batch as _dummy_run clamps it for a speculator that adds query slots per request
            # (a draft model: max_num_batched_tokens - num_reqs x extra slots).
            if not _same_batch(int(s.num_target_tokens), t.num_tokens, max_reqs, max_tokens):
                raise CaptureError(PREFIX + f"step timing {i} reports {s.num_target_tokens} tokens for a "
                                   f"{t.num_tokens}-token profile batch: samples out of batch order, no table written")
        timed = [(s, t) for s, t in zip(samples, tags) if t.replay >= 0 and not t.shape]
        shaped = [(s, t) for s, t in zip(samples, tags) if t.shape]
        query_len = decode_query_len(manager)
        # a shape step vLLM ran as another batch than N / q requests (its dummy run changed) is no
        # sample of the shape: kept out, and counted
        other = [s for s, t in shaped if int(s.num_reqs) * query_len != t.num_tokens]
        shaped = [(s, t) for s, t in shaped if int(s.num_reqs) * query_len == t.num_tokens]
        curves: dict[str, dict[str, list]] = {}
        for ctx in run.plan.context_lens:
            ctx_samples = [s for s, t in timed if t.context_len == ctx]
            theirs = vllm_curves(state.vllm_fit, ctx_samples)
            ours = fit_pair(Sample.from_vllm(s, context_len=ctx) for s in ctx_samples).as_vllm()
            check_same_curves(ctx, ours, theirs)
            curves[str(ctx)] = {"draft": [list(p) for p in theirs[0]], "verify": [list(p) for p in theirs[1]]}
        schedule = run.schedule
        payload = {
            "rank": run.rank,
            "tp_size": run.tp_size,
            "hostname": os.uname().nodename,  # the GPU host that measured (a table rebuilt elsewhere records it)
            "profile_s": time.perf_counter() - run.start,
            "num_batches": len(tags),
            "plan": asdict(run.plan),
            "schedule": {"vllm_replays_per_block": schedule.vllm_replays, "warmup_blocks": schedule.warmup_blocks,
                         "timed_blocks": schedule.timed_blocks,
                         "timed_replays_per_size": schedule.timed_blocks * schedule.vllm_replays},
            "cudagraph_limit": int(manager._cudagraph_limit),
            "engine": describe_engine(manager, run.capture_sizes, state.vllm_config),
            "hardware": hardware(),
            "vllm_curves": curves,
            **({"telemetry": run.recorder.telemetry().to_json()} if run.recorder is not None else {}),
            **({"cooldown": run.cooldown.to_json()} if run.cooldown is not None else {}),
            **({"settle": run.settle.to_json()} if run.settle is not None and run.settle.reader is not None else {}),
            "samples": [Sample.from_vllm(s, context_len=t.context_len, replay=t.replay).to_dict() for s, t in timed],
            **({"shape_samples": [Sample.from_vllm(s, context_len=t.context_len, replay=t.replay).to_dict()
                                  for s, t in shaped], "shape_query_len": query_len,
                "shape_other_batches": len(other)} if shaped or other else {}),
        }
        return payload, nearest(run.plan.context_lens, current_context_len())

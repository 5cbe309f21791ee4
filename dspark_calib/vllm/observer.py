"""Observe mode in the engine: time a sample of real serving steps, write them (DSPARK_CALIB_OBSERVE=DIR).

Why here, and how, in vLLM 0.33's V2 runner:

* Serving steps call ``step_timing.record_batch`` and ``.forward_start`` (in
  execute_model) but never the collector's forward_end/drafter_* (those run in
  ``_dummy_run`` only), and the collector records nothing outside ``collect()``.
  So observe keeps its own events (vLLM's ``StepTimingEvents``), recorded on the
  current stream at the same points vLLM's profile uses: forward_start (wrapped on
  the collector instance), forward end when execute_model returns (as _dummy_run
  does), drafter start/end around ``speculator.propose``. vLLM's collector is only
  ever called through, so its ``collect()`` window behaves as before.
* The step is joined by construction, not by counting: execute_model starts a
  step (dropping a sampled step that never reached propose), get_num_tokens picks
  the sample and captures the budget (step_capture.capture_step), the other
  points fill that same step. Steps without drafts (no get_num_tokens: prefill,
  first decode), without a drafter run, and dummy runs are never rows.
* Sampled steps only (every Nth priced step, DSPARK_CALIB_OBSERVE_EVERY) record
  events; they are resolved with ``query()`` on later sampled steps and at
  shutdown (observe.step.PendingSteps, bounded): never a host sync per step.
* The step's acceptance: ``propose`` is handed the rejection sampler's per-request
  num_sampled / num_rejected; on a sampled step both are copied to pinned host memory
  (non_blocking) on the current stream before drafter_start, so they have landed once
  drafter_end's query() is true; the per-position counts are made on the host then
  (step_capture.acceptance_counts). No sync, no kernel.
* The acceptance estimator (a speculator with vLLM's OnlineAcceptanceEstimator): a sampled step
  whose estimator has refitted since the last written reading (and the first sampled step) also
  copies its slope and intercepts to pinned host memory (non_blocking) next to the verdict, after
  vLLM's step() has enqueued any refit on the same stream: the copy holds the coefficients this
  step's drafts are ranked by, and lands before drafter_end, like the verdict. Reading the
  tensors directly would sync the device; this costs two tiny copies per refit (every 100
  steps), none on other steps. The counters (refits, steps) are host ints.
* The GPU's SM clock and power per row: a sampler thread (gpu_readings.ClockSampler) reads NVML
  a few times a second; a sampled step takes its latest reading (an attribute read), so no
  NVML call is ever on the step's path. Without NVML the rows record none.
* The host's time around each step (TP rank 0): one ``time.perf_counter`` per execute_model call,
  at its start, and one more at a sampled step's return; never a sync. A row records the
  interval since the previous call's start (``step_interval_ms``: the whole previous step as
  the host lived it, sample_tokens, scheduling and any stall included) and its own call's length
  (``host_ms``). The interval is None after a call that was not serving: vLLM's _dummy_run
  (profile, graph capture, compile warm-up, DP padding steps: ``dummy_run=True``) and the
  kernel warm-up's steps (warmup_kernels runs them with ``runner.adaptive_verification`` set
  to None), and for the first call observe sees. A row's step had drafts, made by the step
  before it for the same requests, so the engine was busy across the interval, not idle.
* TP rank 0 only: other ranks install nothing (no collective, no work). Files
  ``observed-dp{D}-{pid}-e{N}-*.parquet``, rolling and bounded (ObservedWriter).
* Any failure inside observe is one WARNING line and observe turns off; vLLM's
  own exceptions pass through untouched.

Wrappers are per instance (manager, collector, runner, speculator); get_num_tokens
composes with context_aware.install in either order (each wraps what is there).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import socket
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from dspark_calib.errors import PREFIX, exception_line
from dspark_calib import env as E
from dspark_calib.vllm.runtime import MARK, log, log_once, peek_state, state_of

# A priced step that starts more than observe.step.STALL_MS after the previous step's start was
# held up on the host: said on every priced step, sampled or not, since one stall lands in the row
# of the step after it only when that step is sampled. The first lines name the step; later ones
# are counted, said once at close.
STALL_LINES = 10

if TYPE_CHECKING:
    from dspark_calib.vllm.step_capture import Pricing

_engines = itertools.count()  # per process: a second engine start in one process writes new names


class _Step:
    """A sampled step in flight on the host (filled by the call points, in order)."""

    __slots__ = ("index", "capture", "batch", "events", "forward_ended", "acceptance", "estimator", "gpu",
                 "interval_ms", "host_ms")

    def __init__(self, index: int, capture: Any, gpu: tuple[float | None, float | None] = (None, None),
                 interval_ms: float | None = None):
        self.index, self.capture, self.gpu = index, capture, gpu  # gpu: (SM MHz, W) as last sampled
        self.interval_ms = interval_ms  # host: the previous execute_model call's start to this one's
        self.host_ms: float | None = None  # host: this step's execute_model call, start to return
        self.batch = None  # (full_cudagraph, num_target_tokens, num_reqs), as vLLM's record_batch
        self.events = None
        self.forward_ended = False
        self.acceptance = None  # (num_sampled, num_rejected) on their way to the host
        self.estimator = None  # (refits, steps, slope, intercepts), the tensors on their way to the host


class Observer:
    """The sampler of one engine (TP rank 0). Hooks never raise: a failure turns observe off."""

    def __init__(self, manager: Any, directory: str, *, every: int, event_factory: Callable[[], Any],
                 pricing: Callable[[Any], Pricing], metadata: dict | None = None, max_pending: int = 256,
                 name: str | None = None, writer_kwargs: dict | None = None, estimator: Any = None,
                 clocks: Any = None, timer: Callable[[], float] = time.perf_counter):
        from dspark_calib.observe.step import STALL_MS, PendingSteps

        self.manager, self.directory, self.every = manager, directory, every
        self.event_factory, self._pricing_of = event_factory, pricing
        self.metadata, self.name, self.writer_kwargs = dict(metadata or {}), name, dict(writer_kwargs or {})
        self.pending = PendingSteps(max_pending)
        self.on = True
        self.priced = 0  # get_num_tokens calls seen (the row's step number)
        self.untimed = 0  # sampled steps that never reached the drafter
        self.current: _Step | None = None
        self.pricing: Pricing | None = None
        self.writer: Any = None
        self.at_exit: Callable[[], None] | None = None
        self.estimator = estimator  # vLLM's acceptance estimator, when the speculator has one
        self.estimator_written: int | None = None  # refits of the last reading written
        self.clocks = clocks  # gpu_readings.ClockSampler (None: no NVML): its `latest` goes into each row
        self.timer = timer  # the host's clock (seconds), read once per execute_model call
        self.started: float | None = None  # the running (or last) call's start; None: it was not serving
        self.interval_ms: float | None = None  # the running call's interval since the previous call's start
        self.stall_ms = STALL_MS
        self.stalls: list[float] = []  # intervals over stall_ms before a priced step (ms)

    # -- call points ---------------------------------------------------------------------
    def after_budget(self, num_tokens_per_req: Any, draft_tokens: Any) -> None:
        self.priced += 1
        if self.interval_ms is not None and self.interval_ms > self.stall_ms and self.on:
            self.stall(self.interval_ms)
        if self.priced % self.every or not self.on:
            return
        try:
            from dspark_calib.vllm.step_capture import capture_step, last_context

            self.drain()
            if self.pricing is None:
                self.pricing = self._pricing_of(self.manager)
            p = self.pricing
            static = p.policy.static_context
            ctx = last_context(self.manager, static) if p.policy.context_aware else static
            capture = capture_step(self.manager, num_tokens_per_req, draft_tokens, priced_context=ctx,
                                   alt_tables=p.alt_tables)
            gpu = self.clocks.latest if self.clocks is not None else (None, None)  # never an NVML call here
            self.current = _Step(self.priced, capture, gpu, self.interval_ms)
        except Exception as exc:  # noqa: BLE001 - observing must never break serving
            self.fail(exc)

    def begin_step(self, now: float, serving: bool) -> None:
        """An execute_model call starts at host time `now` (seconds); serving: not a dummy run or warm-up step."""
        if self.current is not None:  # sampled, but no drafter ran (or no forward): not a row
            self.untimed += 1
            self.current = None
        previous, self.started = self.started, now if serving else None
        self.interval_ms = (now - previous) * 1e3 if serving and previous is not None else None

    def record_batch(self, input_batch: Any, full_cudagraph: bool) -> None:
        step = self.current
        if step is not None:
            step.batch = (bool(full_cudagraph), int(input_batch.num_tokens), int(input_batch.num_reqs))

    def forward_start(self) -> None:
        step = self.current
        if step is not None and step.batch is not None and step.events is None:
            try:
                step.events = self.event_factory()
                step.events.forward_start.record()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)

    def forward_end(self, now: float) -> None:
        """execute_model returns at host time `now`: the forward is enqueued."""
        step = self.current
        if step is not None and step.events is not None and not step.forward_ended:
            try:
                step.events.forward_end.record()
                step.forward_ended = True
                step.host_ms = None if self.started is None else (now - self.started) * 1e3
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)

    def drafter_start(self, num_sampled: Any = None, num_rejected: Any = None) -> bool:
        """Start timing the drafter; first start copying the step's verdict (the rejection sampler's
        per-request counts) to the host, outside both timed windows."""
        step = self.current
        if step is None or not step.forward_ended:
            return False
        try:
            if num_sampled is not None and num_rejected is not None:
                n = step.batch[2]
                step.acceptance = (num_sampled[:n].to("cpu", non_blocking=True),
                                   num_rejected[:n].to("cpu", non_blocking=True))  # pinned: no sync
            est = self.estimator
            if est is not None and est._refits != self.estimator_written:  # a host int: free
                from dspark_calib.vllm.estimator import progress, read_coefficients

                step.estimator = (*progress(est), *read_coefficients(est))  # pinned: no sync
            step.events.drafter_start.record()
            return True
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return False

    def drafter_end(self) -> None:
        step, self.current = self.current, None
        if step is None:
            return
        try:
            step.events.drafter_end.record()
            self.pending.add(step.events, step)  # full: dropped and counted (PendingSteps bounds it)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    # -- resolving and writing -------------------------------------------------------------
    def drain(self) -> int:
        """Write every step whose events are done (query() only); returns how many."""
        from dspark_calib.vllm.step_capture import acceptance_counts, to_observed

        done = self.pending.resolve_ready()
        if not done:
            return 0
        writer = self.writer or self._open_writer()
        aware = self.pricing is not None and self.pricing.policy.context_aware
        positions = int(self.manager.num_speculative_steps)
        for forward_ms, drafter_ms, step in done:
            full_cudagraph, num_target_tokens, _ = step.batch
            # copied before drafter_end on the same stream: landed, since drafter_end is done
            acceptance = None if step.acceptance is None else acceptance_counts(
                step.acceptance[0].numpy(), step.acceptance[1].numpy(), positions)
            estimator = None
            if step.estimator is not None and step.estimator[0] != self.estimator_written:
                refits, steps, slope, intercepts = step.estimator
                estimator = (refits, steps, float(slope.numpy()[0]), tuple(float(x) for x in intercepts.numpy()))
                self.estimator_written = refits
            writer.append(to_observed(step.capture, step=step.index, forward_ms=forward_ms, drafter_ms=drafter_ms,
                                      num_target_tokens=num_target_tokens, full_cudagraph=full_cudagraph,
                                      context_aware=aware, acceptance=acceptance, estimator=estimator, gpu=step.gpu,
                                      host=(step.interval_ms, step.host_ms)))
        return len(done)

    def _open_writer(self) -> Any:
        from dspark_calib.observe.file import ObservedWriter

        p = self.pricing
        meta = {**self.metadata, "sample_every": self.every}
        if p is not None:
            meta.update(p.policy.metadata(), table_hash=p.table_hash)  # validate re-prices by it
        self.writer = ObservedWriter(self.directory, metadata=meta, name=self.name, **self.writer_kwargs)
        return self.writer

    def stall(self, interval_ms: float) -> None:
        """A priced step began interval_ms after the previous step began: its drafts come from that
        step, so the engine was busy across the gap, not idle."""
        self.stalls.append(interval_ms)
        if len(self.stalls) <= STALL_LINES:
            log.warning(PREFIX + "observe: %.2f s between the starts of two serving steps (before priced step %d): "
                        "host time outside every step's GPU timing%s", interval_ms / 1e3, self.priced,
                        "; further stalls are counted" if len(self.stalls) == STALL_LINES else "")

    def close(self) -> None:
        """Resolve what is done and write it (shutdown, atexit); idempotent, never raises."""
        self._stop_clocks()
        if len(self.stalls) > STALL_LINES:
            log.warning(PREFIX + "observe: %d stalls over %.0f s before priced steps, the longest %.2f s",
                        len(self.stalls), self.stall_ms / 1e3, max(self.stalls) / 1e3)
            self.stalls = self.stalls[:STALL_LINES]  # said once (close runs at shutdown and at exit)
        if not self.on:
            return
        try:
            self.drain()
            if self.writer is not None:
                self.writer.flush()
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    def _stop_clocks(self) -> None:
        if self.clocks is not None:
            self.clocks.stop()

    def fail(self, exc: BaseException) -> None:
        self.on, self.current = False, None
        self._stop_clocks()
        log_once(logging.WARNING, PREFIX + f"observe off ({exception_line(exc)}); "
                                  "serving continues unobserved")


# -- wrapping one runner's call points ------------------------------------------------------
def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """owner.name = make(what is there now), as an instance attribute remembering the original."""
    inner = getattr(owner, name)
    wrapper = functools.wraps(inner)(make(inner))
    setattr(wrapper, MARK, (inner, name in owner.__dict__))
    setattr(owner, name, wrapper)


def _budget_hook(obs: Observer) -> Callable[[Callable], Callable]:
    def get_num_tokens(inner: Callable) -> Callable:
        def wrapper(num_tokens_per_req: Any, draft_tokens: Any) -> Any:
            out = inner(num_tokens_per_req, draft_tokens)
            if obs.on:
                obs.after_budget(num_tokens_per_req, draft_tokens)
            return out
        return wrapper
    return get_num_tokens


def rebind(obs: Observer, manager: Any) -> None:
    """The runner built another manager (a later initialize_kv_cache): observe that one."""
    obs.manager, obs.pricing = manager, None
    _wrap(manager, "get_num_tokens", _budget_hook(obs))


def attach(runner: Any, obs: Observer) -> Observer:
    """Install obs at runner's call points (instance attributes only)."""
    get_num_tokens = _budget_hook(obs)
    timer = obs.timer

    def execute_model(inner: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # also for dummy runs: nothing of a serving step may leak into them. Not serving: a dummy
            # run, or a kernel warm-up step (warmup_kernels sets the manager aside while it runs)
            obs.begin_step(timer(), not kwargs.get("dummy_run") and runner.adaptive_verification is not None)
            out = inner(*args, **kwargs)
            if obs.current is not None:
                obs.forward_end(timer())
            return out
        return wrapper

    def record_batch(inner: Callable) -> Callable:
        def wrapper(input_batch: Any, full_cudagraph: bool) -> None:
            inner(input_batch, full_cudagraph)  # vLLM's: records only inside collect()
            if obs.current is not None:
                obs.record_batch(input_batch, full_cudagraph)
        return wrapper

    def forward_start(inner: Callable) -> Callable:
        def wrapper() -> None:
            inner()
            if obs.current is not None:
                obs.forward_start()
        return wrapper

    verdict = _verdict_reader(runner.speculator.propose)

    def propose(inner: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if obs.current is None or kwargs.get("dummy_run") or not obs.drafter_start(*verdict(args, kwargs)):
                return inner(*args, **kwargs)
            out = inner(*args, **kwargs)
            obs.drafter_end()
            return out
        return wrapper

    def shutdown(inner: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)  # vLLM synchronises the device first: every event is done
            finally:
                obs.close()
        return wrapper

    _wrap(runner.adaptive_verification, "get_num_tokens", get_num_tokens)
    _wrap(runner, "execute_model", execute_model)
    _wrap(runner.step_timing, "record_batch", record_batch)
    _wrap(runner.step_timing, "forward_start", forward_start)
    _wrap(runner.speculator, "propose", propose)
    if callable(getattr(runner, "shutdown", None)):
        _wrap(runner, "shutdown", shutdown)
    state_of(runner).observer = obs
    obs.at_exit = functools.partial(_close_if_alive, weakref.ref(obs))  # exit flushes; never keeps obs alive
    atexit.register(obs.at_exit)
    return obs


def _verdict_reader(propose: Callable) -> Callable[[tuple, dict], tuple[Any, Any]]:
    """(num_sampled, num_rejected) from a propose call's arguments, by the parameters' names
    (shape.KEYWORDS checks that propose has both)."""
    import inspect

    names = list(inspect.signature(propose).parameters)
    at = [names.index(name) for name in ("num_sampled", "num_rejected")]

    def read(args: tuple, kwargs: dict) -> tuple[Any, Any]:
        return tuple(args[i] if i < len(args) else kwargs.get(name)
                     for i, name in zip(at, ("num_sampled", "num_rejected")))  # type: ignore[return-value]

    return read


def _close_if_alive(ref: Callable[[], Observer | None]) -> None:
    obs = ref()
    if obs is not None:
        obs.close()


def detach(runner: Any) -> Observer | None:
    """Undo attach (tests): each wrapper still on top goes; one under another wrapper stays, inert."""
    state = peek_state(runner)
    obs = state.observer if state is not None else None
    if obs is None:
        return None
    state.observer = None
    obs.close()
    obs.on = False
    atexit.unregister(obs.at_exit)
    for owner, names in ((runner.adaptive_verification, ("get_num_tokens",)),
                         (runner, ("execute_model", "shutdown")),
                         (runner.step_timing, ("record_batch", "forward_start")),
                         (runner.speculator, ("propose",))):
        for name in names:
            current = owner.__dict__.get(name)
            mark = getattr(current, MARK, None)
            if mark is None:
                continue
            inner, was_own = mark
            if was_own:
                setattr(owner, name, inner)
            else:
                delattr(owner, name)
    return obs


def observer_of(runner: Any) -> Observer | None:
    state = peek_state(runner)
    return state.observer if state is not None else None


# -- engine start ---------------------------------------------------------------------------
def prepare_dir(directory: str) -> str:
    """'' when DIR exists or was created now (its parent must exist: a typo is not silently
    made into a new tree, as `mkdir -p` would); else the one-line reason."""
    try:
        os.mkdir(directory)
    except FileExistsError:
        if not os.path.isdir(directory):
            return "exists and is not a directory"
    except FileNotFoundError:
        return "its parent directory does not exist (create it first; observe does not create parents)"
    except OSError as exc:
        return f"cannot be created ({exc.strerror or type(exc).__name__})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable"
    return ""


def maybe_observe(runner: Any, estimator: Any, *, event_factory: Callable[[], Any] | None = None,
                  writer_kwargs: dict | None = None, timer: Callable[[], float] = time.perf_counter) -> Observer | None:
    """Observe this runner's serving steps when DSPARK_CALIB_OBSERVE is set; never raises
    (an engine that would start without observe starts with it, at worst unobserved). estimator:
    its speculator's acceptance estimator as estimator.estimator_of read it (None: none)."""
    directory = E.observe_dir()
    if not directory:
        return None
    obs = observer_of(runner)
    if obs is not None:
        manager = getattr(runner, "adaptive_verification", None)
        if manager is not None and manager is not obs.manager:
            rebind(obs, manager)
        return obs
    from dspark_calib.errors import escape

    shown = escape(directory, 80)
    try:
        every = E.observe_every()
        manager = getattr(runner, "adaptive_verification", None)
        if manager is None:
            log_once(logging.WARNING, PREFIX + "observe off: adaptive verification is off in this engine "
                                      "(no draft budget to observe)")
            return None
        from dspark_calib.vllm.shape import observe_problem

        why = observe_problem(runner)
        if why:
            log_once(logging.WARNING, PREFIX + f"observe off: this vLLM's step API differs ({why})")
            return None
        from dspark_calib.vllm.engine_info import tp_rank_and_size

        if tp_rank_and_size()[0] != 0:
            return None  # rank 0 writes; the others do nothing at all (no events, no collective)
        why = prepare_dir(directory)
        if why:
            log_once(logging.WARNING, PREFIX + f"observe off: {E.OBSERVE}={shown} {why}")
            return None
        import pyarrow.parquet  # noqa: F401 - at start-up, not inside the first flushing step

        if event_factory is None:
            from vllm.v1.worker.gpu.async_utils import StepTimingEvents as event_factory
        # data_parallel_index: dense DP replicas run as independent engines whose
        # data_parallel_rank vLLM resets to 0 (reconfigure_for_independent_dp_rank)
        pc = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
        dp = getattr(pc, "data_parallel_index", None)
        dp = int(dp if isinstance(dp, int) else getattr(runner, "dp_rank", 0) or 0)
        rs = manager.req_states
        meta = {"tp_rank": 0, "dp_rank": dp, "max_num_reqs": int(rs.max_num_reqs),
                "max_num_batched_tokens": int(rs.max_num_batched_tokens)}
        max_model_len = getattr(runner, "max_model_len", None)
        if isinstance(max_model_len, int) and max_model_len > 0:
            meta["max_model_len"] = max_model_len  # how far validate extrapolates a stock engine's steps
        from dspark_calib.vllm.engine_info import describe_engine

        # the engine's fingerprint keys (capture sizes from the config: graphs are captured later), so
        # advise can refuse files of another engine than its table's
        meta["engine"] = describe_engine(manager, [], getattr(runner, "vllm_config", None))
        meta["host"] = socket.gethostname()  # calibrate records which hosts its steps were served on
        from dspark_calib.vllm.estimator import seed_keys

        if estimator is not None:  # what `dspark-calib seed` writes into a seed made of these files
            meta["estimator_keys"] = seed_keys(getattr(runner, "vllm_config", None), manager)
        from dspark_calib.vllm.gpu_readings import clock_sampler
        from dspark_calib.vllm.step_capture import pricing_for, stock_context

        obs = Observer(manager, directory, every=every, event_factory=event_factory,
                       pricing=pricing_for(stock_context(runner)), metadata=meta,
                       name=f"dp{dp}-{os.getpid()}-e{next(_engines)}", writer_kwargs=writer_kwargs,
                       estimator=estimator, clocks=clock_sampler(), timer=timer)
        attach(runner, obs)
    except Exception as exc:  # noqa: BLE001 - an optional mode must not stop an engine
        log_once(logging.WARNING, PREFIX + f"observe off ({exception_line(exc)})")
        return None
    log_once(logging.INFO, PREFIX + f"observing 1 in {every} priced steps into {shown} (TP rank 0)")
    return obs


def hook_runner(model_runner: Any) -> None:
    """Per engine start, right after GPUModelRunner.initialize_kv_cache (which builds the manager;
    the speculator and its acceptance estimator exist since load_model): the estimator's seed when
    DSPARK_CALIB_ESTIMATOR_SEED is set (every rank, before any step: estimator.seed_runner), then
    observe (TP rank 0), so observe's first reading is the seeded one. Idempotent; plugin.patch calls it."""
    cls = getattr(model_runner, "GPUModelRunner", None)
    orig = getattr(cls, "initialize_kv_cache", None)
    if orig is None:
        if E.observe_dir():
            log_once(logging.WARNING, PREFIX + "observe off: GPUModelRunner.initialize_kv_cache not found")
        return
    if hasattr(orig, MARK):
        return

    @functools.wraps(orig)
    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        # With CUDA graphs on, vLLM first builds a throwaway KV cache (and manager) to measure
        # graph memory (initialize_kv_cache(..., is_profiling=True)), then the real one.
        if not kwargs.get("is_profiling", args[1] if len(args) > 1 else False):
            from dspark_calib.vllm.estimator import estimator_of, seed_runner

            # read once for both (its shape check logs when it refuses), and only when one asks
            estimator = estimator_of(self) if E.estimator_seed() or E.observe_dir() else None
            seed_runner(self, estimator)  # raises only to refuse a start (strict), as load mode does
            maybe_observe(self, estimator)
        return out

    setattr(initialize_kv_cache, MARK, orig)
    cls.initialize_kv_cache = initialize_kv_cache


def unhook_runner(model_runner: Any) -> None:
    cls = getattr(model_runner, "GPUModelRunner", None)
    orig = getattr(getattr(cls, "initialize_kv_cache", None), MARK, None)
    if orig is not None:
        cls.initialize_kv_cache = orig

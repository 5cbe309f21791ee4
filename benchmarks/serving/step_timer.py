"""The harness's step timer: the host's time of every serving step, measured the same way in
every arm (fixed K, stock and table-priced adaptive verification), so arms are compared by one
measure. dspark-calib's observe mode records step intervals only on the steps it prices, and it
prices none with adaptive verification off; this timer needs no pricing.

StepTimer wraps a model runner's ``execute_model`` (an instance attribute over vLLM's V2
runner's method) and records, per serving call, the host's ``time.perf_counter`` at its start
and at its return, plus the scheduled tokens and requests read off the scheduler output (two
host attributes: no GPU sync, no tensor read), and the tokens the forward ran (vLLM hands its
step-timing collector the input batch after adaptive verification's budget: a host int), so an
arm's decisions show without observe mode. vLLM's own dummy runs (profile, graph capture,
compile warm-up, DP padding: ``dummy_run=True``) are passed through unrecorded. Memory is
bounded: the first CAP calls since the last take() are kept, later ones only counted.

The GPU side of the same steps, in every arm alike (the fixed-K arm included, which observe mode
cannot see): the timer also wraps the runner's ``speculator.propose`` and records three CUDA
events per kept step on the current stream: at execute_model's start, and around the drafter's
propose (which runs in the step's sample_tokens call, after its execute_model). ``target_ms``
(execute_model's start to the drafter's: the target's forward and the rejection sampling, and
any GPU idle while the host prepares them) and ``drafter_ms`` are resolved in take(), behind one
sync, when no step runs: no sync on a step's path. The drafter's time is the part of a step
that varies most between engines of one configuration, so every arm records it. take() also
says where the worker's process runs (``cpu``: its CPU affinity, the CPU it last ran on and
that core's clock, the load average): a host-bound drafter's time depends on it.

StepTimerProbe is the worker-side half, mixed into vLLM's worker through the harness's worker
extension (estimator_probe.EstimatorProbe inherits it): ``collective_rpc("step_timer_start")``
installs the timer on TP rank 0 (other ranks record nothing), ``collective_rpc("step_timer_take")``
returns what was recorded since the last take (JSON-able lists) and clears it. The harness
calls both between workloads, when no step is running.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable

CAP = 200_000  # calls kept between two takes: a workload serves a few thousand steps
EVENT_CAP = 20_000  # steps per take with CUDA events (three each): the rest keep host times only


@functools.lru_cache(maxsize=1)
def _cuda() -> Any:
    """torch.cuda when a GPU is there (looked up once: cuda_event runs on every step), else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def cuda_event() -> Any:
    """A timing CUDA event, or None without a GPU (the dry run, the tests' own fakes aside)."""
    cuda = _cuda()
    return None if cuda is None else cuda.Event(enable_timing=True)


def _cpuinfo_mhz(cpu: int, path: str = "/proc/cpuinfo") -> int | None:
    """The "cpu MHz" of one processor in /proc/cpuinfo (None when absent)."""
    try:
        with open(path) as f:
            blocks = f.read().split("\n\n")
    except OSError:
        return None
    for block in blocks:
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if fields.get("processor") == str(cpu) and "cpu MHz" in fields:
            try:
                return round(float(fields["cpu MHz"]))
            except ValueError:
                return None
    return None


def where_it_runs() -> dict[str, Any]:
    """The worker process's CPU placement (Linux; what is not readable is None)."""
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    try:
        with open("/proc/self/stat") as f:
            last_cpu = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39: processor
    except (OSError, ValueError, IndexError):
        last_cpu = None
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    mhz = None
    if last_cpu is not None:  # the clock of the core it last ran on: a host-bound drafter runs at its pace
        try:
            with open(f"/sys/devices/system/cpu/cpu{last_cpu}/cpufreq/scaling_cur_freq") as f:
                mhz = round(int(f.read()) / 1000)
        except (OSError, ValueError):
            mhz = _cpuinfo_mhz(last_cpu)  # virtual machines often have no cpufreq, only /proc/cpuinfo
    return {"affinity": affinity, "last_cpu": last_cpu, "loadavg": load, "last_cpu_mhz": mhz}


class StepTimer:
    def __init__(self, cap: int = CAP, clock: Callable[[], float] = time.perf_counter,
                 event: Callable[[], Any] = cuda_event, event_cap: int = EVENT_CAP):
        self.cap = cap
        self.clock = clock
        self.event = event
        self.event_cap = event_cap
        self._clear()

    def _clear(self) -> None:
        self.start: list[float] = []  # perf_counter seconds at each call's start
        self.end: list[float] = []  # and at its return
        self.tokens: list[int] = []  # total_num_scheduled_tokens (-1: not on the scheduler output)
        self.reqs: list[int] = []  # scheduled requests
        self.dropped = 0  # calls past cap, not kept
        self.events: list[list[Any] | None] = []  # per kept call: [step start, drafter start, drafter end]
        self.forward_tokens: list[int | None] = []  # per kept call: the tokens its forward ran (after the budget)
        self._forward_tokens: int | None = None  # the running call's, from step_timing.record_batch
        self._last_dropped = False  # the last call was past cap: its propose joins no kept call

    def install(self, runner: Any) -> None:
        """Wraps runner.execute_model (what is there: a second install wraps nothing twice)."""
        if getattr(runner, "_step_timer", None) is self:
            return
        inner = runner.execute_model
        timer = self

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dummy_run"):
                return inner(scheduler_output, *args, **kwargs)
            kept = len(timer.start) < timer.cap
            events = None
            if kept and len(timer.start) < timer.event_cap:
                first = timer.event()
                if first is not None:
                    first.record()
                    events = [first]
            timer._forward_tokens = None
            t0 = timer.clock()
            out = inner(scheduler_output, *args, **kwargs)
            t1 = timer.clock()
            timer._last_dropped = not kept
            if not kept:
                timer.dropped += 1
                return out
            timer.start.append(t0)
            timer.end.append(t1)
            timer.tokens.append(getattr(scheduler_output, "total_num_scheduled_tokens", -1))
            timer.reqs.append(len(getattr(scheduler_output, "num_scheduled_tokens", ())))
            timer.events.append(events)
            timer.forward_tokens.append(timer._forward_tokens)
            return out

        runner.execute_model = execute_model
        step_timing = getattr(runner, "step_timing", None)
        if callable(getattr(step_timing, "record_batch", None)):
            inner_record = step_timing.record_batch

            def record_batch(input_batch: Any, *args: Any, **kwargs: Any) -> Any:
                # the forward's batch, after adaptive verification's budget trimmed the drafts: the
                # scheduler's count is before it (what the pricing decided shows only here)
                timer._forward_tokens = getattr(input_batch, "num_tokens", None)
                return inner_record(input_batch, *args, **kwargs)

            step_timing.record_batch = record_batch
        speculator = getattr(runner, "speculator", None)
        if callable(getattr(speculator, "propose", None)):
            inner_propose = speculator.propose

            def propose(*args: Any, **kwargs: Any) -> Any:
                # the drafter of the step whose execute_model came last (sample_tokens follows it)
                events = (timer.events[-1] if timer.events and not timer._last_dropped and not kwargs.get("dummy_run")
                          else None)
                if events is None or len(events) != 1:
                    return inner_propose(*args, **kwargs)
                start, end = timer.event(), timer.event()
                start.record()
                out = inner_propose(*args, **kwargs)
                end.record()
                events += [start, end]
                return out

            speculator.propose = propose
        runner._step_timer = self

    def take(self) -> dict[str, Any]:
        """What was recorded since the last take, then cleared."""
        target, drafter = self._gpu_ms()
        out = {"start_s": self.start, "end_s": self.end, "num_tokens": self.tokens, "num_reqs": self.reqs,
               "dropped": self.dropped, "target_ms": target, "drafter_ms": drafter, "forward_tokens": self.forward_tokens,
               "cpu": where_it_runs()}
        self._clear()
        return out

    def _gpu_ms(self) -> tuple[list[float | None], list[float | None]]:
        """Each kept call's target and drafter GPU ms (None: no events, or no drafter ran for it),
        behind one sync: the events are on one stream, so once the last is done all are."""
        full = [e for e in self.events if e is not None and len(e) == 3]
        if not full:
            return [None] * len(self.events), [None] * len(self.events)
        full[-1][2].synchronize()
        target = [e[0].elapsed_time(e[1]) if e is not None and len(e) == 3 else None for e in self.events]
        drafter = [e[1].elapsed_time(e[2]) if e is not None and len(e) == 3 else None for e in self.events]
        return target, drafter


class StepTimerProbe:
    """The RPCs (methods of vLLM's worker once mixed in: self.model_runner is the worker's)."""

    step_timer_event: Callable[[], Any] = staticmethod(cuda_event)  # the dry run's stand-in has host events

    def step_timer_start(self) -> bool:
        """Installs the timer on TP rank 0 (True there, False on other ranks); clears it when
        it is already installed."""
        if self._step_timer_tp_rank() != 0:
            return False
        timer = getattr(self, "_harness_step_timer", None)
        if timer is None:
            timer = self._harness_step_timer = StepTimer(event=type(self).step_timer_event)
        timer.install(self.model_runner)
        timer.take()
        return True

    def _step_timer_tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def step_timer_take(self) -> dict[str, Any] | None:
        timer = getattr(self, "_harness_step_timer", None)
        return None if timer is None else timer.take()

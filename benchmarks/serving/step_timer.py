"""The harness's step timer: the host's time of every serving step, measured the same way in
every arm (fixed K, stock and table-priced adaptive verification), so arms are compared by one
measure. dspark-calib's observe mode records step intervals only on the steps it prices, and it
prices none with adaptive verification off; this timer needs no pricing.

StepTimer wraps a model runner's ``execute_model`` (an instance attribute over vLLM's V2
runner's method) and records, per serving call, the host's ``time.perf_counter`` at its start
and at its return, plus the scheduled tokens and requests read off the scheduler output (two
host attributes: no GPU sync, no tensor read). vLLM's own dummy runs (profile, graph capture,
compile warm-up, DP padding: ``dummy_run=True``) are passed through unrecorded. Memory is
bounded: the first CAP calls since the last take() are kept, later ones only counted.

StepTimerProbe is the worker-side half, mixed into vLLM's worker through the harness's worker
extension (estimator_probe.EstimatorProbe inherits it): ``collective_rpc("step_timer_start")``
installs the timer on TP rank 0 (other ranks record nothing), ``collective_rpc("step_timer_take")``
returns what was recorded since the last take (JSON-able lists) and clears it. The harness
calls both between workloads, when no step is running.
"""

from __future__ import annotations

import time
from typing import Any, Callable

CAP = 200_000  # calls kept between two takes: a workload serves a few thousand steps


class StepTimer:
    def __init__(self, cap: int = CAP, clock: Callable[[], float] = time.perf_counter):
        self.cap = cap
        self.clock = clock
        self._clear()

    def _clear(self) -> None:
        self.start: list[float] = []  # perf_counter seconds at each call's start
        self.end: list[float] = []  # and at its return
        self.tokens: list[int] = []  # total_num_scheduled_tokens (-1: not on the scheduler output)
        self.reqs: list[int] = []  # scheduled requests
        self.dropped = 0  # calls past cap, not kept

    def install(self, runner: Any) -> None:
        """Wraps runner.execute_model (what is there: a second install wraps nothing twice)."""
        if getattr(runner, "_step_timer", None) is self:
            return
        inner = runner.execute_model
        timer = self

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dummy_run"):
                return inner(scheduler_output, *args, **kwargs)
            t0 = timer.clock()
            out = inner(scheduler_output, *args, **kwargs)
            t1 = timer.clock()
            if len(timer.start) >= timer.cap:
                timer.dropped += 1
                return out
            timer.start.append(t0)
            timer.end.append(t1)
            timer.tokens.append(getattr(scheduler_output, "total_num_scheduled_tokens", -1))
            timer.reqs.append(len(getattr(scheduler_output, "num_scheduled_tokens", ())))
            return out

        runner.execute_model = execute_model
        runner._step_timer = self

    def take(self) -> dict[str, Any]:
        """What was recorded since the last take, then cleared."""
        out = {"start_s": self.start, "end_s": self.end, "num_tokens": self.tokens, "num_reqs": self.reqs,
               "dropped": self.dropped}
        self._clear()
        return out


class StepTimerProbe:
    """The RPCs (methods of vLLM's worker once mixed in: self.model_runner is the worker's)."""

    def step_timer_start(self) -> bool:
        """Installs the timer on TP rank 0 (True there, False on other ranks); clears it when
        it is already installed."""
        if self._step_timer_tp_rank() != 0:
            return False
        timer = getattr(self, "_harness_step_timer", None)
        if timer is None:
            timer = self._harness_step_timer = StepTimer()
        timer.install(self.model_runner)
        timer.take()
        return True

    def _step_timer_tp_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def step_timer_take(self) -> dict[str, Any] | None:
        timer = getattr(self, "_harness_step_timer", None)
        return None if timer is None else timer.take()

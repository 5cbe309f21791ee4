"""The GPU state each profile block starts in, and the work between blocks that sets it.

Two states, chosen by `profile --gpu-state`:

* STARTUP (the default): each block starts as vLLM's own start-up pass starts, after light
  work. Every block ends in the heavy eager tail (768..8192 tokens, ~690 W, NVML hw_slowdown,
  SM clock below boost), and without a pause the next block's smallest sizes run in that
  state: measured on an H200, verify +2 % at 1 token against vLLM's single pass, which
  starts after light work (boost clock, ~160 W, no throttle). So TP rank 0 pauses on the
  host before every block but the capture's first (Cooldown).
* SERVING: each block starts as a loaded server's steps run, at the power limit with the SM
  clock it holds there: before every block, the first included, every rank runs the
  block's heaviest step back to back (Settle) until rank 0's readings are steady or the
  settle time is spent. Those steps are timed by vLLM like any other and discarded.

Both act between the generator's yields: after the previous step returned and before the
next block's first is handed out, where telemetry is read, never inside a timed step.

Only rank 0 pauses: the other ranks run on into the next step and wait in its first
collective for rank 0, so their GPUs idle just as long, and rank 0's timed window never
holds a wait for a peer still sleeping (a pause on every rank, each ending on its own
readings, would put one there). Their own samples' first step of a block holds that
wait, but vLLM and the table use rank 0's samples only. A settle step holds collectives,
so every rank runs the same number: rank 0 decides before each one and its decision goes
to every rank (the `agree` callable: the TP broadcast).

With NVML, the pause ends early once the GPU is back: power within POWER_RATIO of the
reading at the start of the capture's first block and no power or slowdown throttle
reason; never before min(MIN_S, seconds), never after `seconds`. The settle ends early
once the SM clock and power have held still for SETTLE_WINDOW_S (within SETTLE_SM_MHZ and
SETTLE_POWER_RATIO), never before min(SETTLE_MIN_S, seconds), never after `seconds`.
Without NVML both run their full time. Standard library only (capture.py imports it in
every worker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from dspark_calib.telemetry import GPU_STATES

DEFAULT_COOLDOWN_S = 1.0
MAX_COOLDOWN_S = 60.0  # longer is a typo, not a wish: a profile has tens of blocks
POWER_RATIO = 1.5  # "back": power within 1.5 x the first block's start
MIN_S = 0.25  # NVML's power reading lags the load; never trust one taken sooner
POLL_S = 0.05
HOT_REASONS = frozenset({"hw_slowdown", "sw_power_cap", "hw_power_brake"})

DEFAULT_SETTLE_S = 5.0
MAX_SETTLE_S = 120.0  # a profile has tens of blocks: minutes each would be a typo
SETTLE_MIN_S = 1.0  # power and clocks follow a load with a lag; a shorter settle proves nothing
SETTLE_WINDOW_S = 0.5  # steady: every reading over this long within the two bounds below
SETTLE_SM_MHZ = 30.0  # two NVML clock steps (15 MHz each on an H200)
SETTLE_POWER_RATIO = 0.05  # power range within 5 % of its median


def _check_seconds(seconds: float, top: float, name: str) -> float:
    if not 0 <= seconds <= top:  # NaN fails too
        raise ValueError(f"{name} must be between 0 and {top:g} seconds, got {seconds}")
    return float(seconds)


def check_cooldown(seconds: float, name: str = "cooldown_s") -> float:
    """The one range rule, for Plan and the CLI: one line naming the setting (NaN refused too)."""
    return _check_seconds(seconds, MAX_COOLDOWN_S, name)


def check_settle(seconds: float, name: str = "settle_s") -> float:
    return _check_seconds(seconds, MAX_SETTLE_S, name)


def check_state(state: str, name: str = "gpu_state") -> str:
    if state not in GPU_STATES:
        raise ValueError(f"{name} must be one of {', '.join(GPU_STATES)}, got {str(state)[:40]!r}")
    return state


@dataclass(frozen=True)
class Clock:
    """Where pauses get their time: tests swap the module's CLOCK and never really sleep."""

    sleep: Callable[[float], None] = time.sleep
    now: Callable[[], float] = time.monotonic


CLOCK = Clock()


@dataclass(frozen=True)
class Pause:
    seconds: float
    early: bool  # ended on a cool reading, before the full cool-down


class Cooldown:
    """Rank 0's pauses across one capture; `baseline` takes the first block's start reading."""

    def __init__(self, seconds: float, reader: Any, clock: Clock | None = None):
        self.seconds, self.reader, self.clock = check_cooldown(seconds), reader, clock or CLOCK
        self.baseline_w: float | None = None
        self.pauses: list[Pause] = []

    def baseline(self, reading: Any) -> None:
        """The capture's first block start: the state vLLM's pass starts in (after light work)."""
        self.baseline_w = getattr(reading, "power_w", None)

    def _cool(self, reading: Any) -> bool:
        power = reading.power_w
        return (power is not None and power <= POWER_RATIO * self.baseline_w
                and not HOT_REASONS.intersection(reading.throttle))

    def pause(self) -> None:
        """Between blocks only; the caller never calls it before the capture's first block."""
        if self.seconds <= 0:
            return
        sleep, now = self.clock.sleep, self.clock.now
        t0 = now()
        early = False
        if getattr(self.reader, "source", None) != "nvml" or not self.baseline_w:
            sleep(self.seconds)
        else:
            deadline = t0 + self.seconds
            sleep(min(MIN_S, self.seconds))
            while (left := deadline - now()) > 0:
                if self._cool(self.reader.read()):
                    early = True
                    break
                sleep(min(POLL_S, left))
        self.pauses.append(Pause(now() - t0, early))

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "total_s": round(sum(p.seconds for p in self.pauses), 3),
                "pauses": len(self.pauses), "early_exits": sum(p.early for p in self.pauses)}


@dataclass(frozen=True)
class Settling:
    seconds: float
    steps: int
    early: bool  # ended on steady readings, before the full settle time


def heaviest(batches: Any) -> dict:
    """The settle step: the block's largest batch (vLLM's largest tail size), the one that holds
    the GPU at its power limit as a loaded server's steps do."""
    return max(batches, key=lambda b: b["num_tokens"])


class Settle:
    """Every rank's settle steps before each block; rank 0 (the one with a `reader`) decides
    when they end, `agree` hands its decision to every rank (identity at tp 1)."""

    def __init__(self, seconds: float, reader: Any = None, clock: Clock | None = None,
                 agree: Callable[[Any], Any] = lambda decision: decision):
        self.seconds, self.reader, self.clock, self.agree = check_settle(seconds), reader, clock or CLOCK, agree
        self.settles: list[Settling] = []
        self.begin()

    def begin(self) -> None:
        """Before a block's settle steps."""
        self._t0, self._steps, self._first_read = self.clock.now(), 0, None
        self._window: list[tuple[float, float, float]] = []  # (time, SM MHz, power W)

    def more(self) -> bool:
        """Whether to run one more settle step; called before each, on every rank alike."""
        go = bool(self.agree(self._decide() if self.reader is not None else None))
        if go:
            self._steps += 1
        return go

    def _decide(self) -> bool:
        elapsed = self.clock.now() - self._t0
        done = elapsed >= self.seconds
        steady = not done and self._steady(elapsed)
        if done or steady:
            self.settles.append(Settling(elapsed, self._steps, steady))
        return not (done or steady)

    def _steady(self, elapsed: float) -> bool:
        """Read at most every POLL_S (a heavy step is tens of ms; NVML about one); steady once
        SETTLE_MIN_S has passed and the last SETTLE_WINDOW_S of readings held still."""
        if getattr(self.reader, "source", None) != "nvml":
            return False
        now = self.clock.now()
        if self._window and now - self._window[-1][0] < POLL_S:
            return False
        r = self.reader.read()
        if r.sm_mhz is None or r.power_w is None:
            return False
        if self._first_read is None:
            self._first_read = now
        self._window = [w for w in self._window if now - w[0] <= SETTLE_WINDOW_S] + [(now, r.sm_mhz, r.power_w)]
        if elapsed < min(SETTLE_MIN_S, self.seconds) or now - self._first_read < SETTLE_WINDOW_S:
            return False
        sm, power = [w[1] for w in self._window], sorted(w[2] for w in self._window)
        return (max(sm) - min(sm) <= SETTLE_SM_MHZ
                and power[-1] - power[0] <= SETTLE_POWER_RATIO * power[len(power) // 2])

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "total_s": round(sum(s.seconds for s in self.settles), 3),
                "settles": len(self.settles), "steps": sum(s.steps for s in self.settles),
                "early_exits": sum(s.early for s in self.settles)}

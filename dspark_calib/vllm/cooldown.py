"""The cool-down between profile blocks: each block starts in the state vLLM's own pass starts in.

Why: every block ends in the heavy eager tail (768..8192 tokens, ~690 W, NVML hw_slowdown,
SM clock below boost), and without a pause the next block's smallest sizes run in that
state: measured on an H200, verify +2 % at 1 token against vLLM's single pass, which
starts after light work (boost clock, ~160 W, no throttle). So TP rank 0 pauses on the
host before every block but the capture's first, between the generator's yields: after
the previous step returned and before the next is handed out, where telemetry is read,
never inside a timed step.

Only rank 0 pauses: the other ranks run on into the next step and wait in its first
collective for rank 0, so their GPUs idle just as long, and rank 0's timed window never
holds a wait for a peer still sleeping (a pause on every rank, each ending on its own
readings, would put one there). Their own samples' first step of a block holds that
wait, but vLLM and the table use rank 0's samples only.

With NVML, the pause ends early once the GPU is back: power within POWER_RATIO of the
reading at the start of the capture's first block and no power or slowdown throttle
reason; never before min(MIN_S, seconds), never after `seconds`. Without NVML it is the
fixed sleep. Standard library only (capture.py imports it in every worker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_COOLDOWN_S = 1.0
MAX_COOLDOWN_S = 60.0  # longer is a typo, not a wish: a profile has tens of blocks
POWER_RATIO = 1.5  # "back": power within 1.5 x the first block's start
MIN_S = 0.25  # NVML's power reading lags the load; never trust one taken sooner
POLL_S = 0.05
HOT_REASONS = frozenset({"hw_slowdown", "sw_power_cap", "hw_power_brake"})


def check_cooldown(seconds: float, name: str = "cooldown_s") -> float:
    """The one range rule, for Plan and the CLI: one line naming the setting (NaN refused too)."""
    if not 0 <= seconds <= MAX_COOLDOWN_S:
        raise ValueError(f"{name} must be between 0 and {MAX_COOLDOWN_S:g} seconds, got {seconds}")
    return float(seconds)


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

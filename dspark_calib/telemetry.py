"""GPU and host conditions per profile block, as a typed immutable record.

Why: a table's numbers are only vLLM's if the GPU ran at vLLM's clocks and
temperature and the host was idle; a level shift between blocks (stability.py)
is only explainable with these readings beside it. The worker records one
reading at each block's start and end (vllm/gpu_readings.py); the table keeps
them in its hashed metadata (key ``telemetry``, schema 1.2), small JSON that a
serving read parses with the rest of the metadata and never needs.

Standard library only: `inspect`/`diff` import it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from dspark_calib.errors import CalibError

# The GPU state a profile's blocks start in (the fingerprint's gpu_state; vllm/gpu_state.py sets
# it): as vLLM's own start-up pass starts (after light work, cooled down between blocks), or
# as a loaded server runs (after sustained load, at the power limit).
STARTUP = "startup"
SERVING = "serving"
GPU_STATES = (STARTUP, SERVING)

MAX_BLOCKS = 4096  # a real profile has tens; bounds what an untrusted file may make us build
_FIELDS = ("sm_mhz", "mem_mhz", "temp_c", "power_w", "load1", "cpu_s", "read_ms")


def _opt_num(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CalibError(f"telemetry {what} {str(value)[:20]!r} is not a finite number")
    return float(value)


@dataclass(frozen=True)
class Reading:
    """One instant: None where the source could not say (no NVML, no nvidia-smi field)."""

    sm_mhz: float | None = None
    mem_mhz: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    throttle: tuple[str, ...] = ()  # NVML's active clock-event reasons, idle/app-setting ones left out
    load1: float | None = None  # host 1-minute load average
    cpu_s: float | None = None  # the worker process's CPU time (user + system)
    read_ms: float | None = None  # what taking this reading cost (NVML ~1 ms): host time between steps

    @classmethod
    def from_dict(cls, d: Any) -> "Reading":
        if not isinstance(d, dict):
            raise CalibError("telemetry reading is not an object")
        throttle = d.get("throttle") or []
        if not isinstance(throttle, list) or not all(isinstance(t, str) and len(t) <= 40 for t in throttle) \
                or len(throttle) > 32:
            raise CalibError("telemetry throttle reasons are not a short list of names")
        return cls(**{f: _opt_num(d.get(f), f) for f in _FIELDS}, throttle=tuple(throttle))

    def to_dict(self) -> dict[str, Any]:
        return {**{f: getattr(self, f) for f in _FIELDS}, "throttle": list(self.throttle)}


@dataclass(frozen=True)
class BlockTelemetry:
    """Readings at the start and end of one vLLM-shaped block (block < 0: warm-up)."""

    context_len: int
    block: int
    start: Reading
    end: Reading

    @property
    def sm_range(self) -> tuple[float, float] | None:
        vals = [v for v in (self.start.sm_mhz, self.end.sm_mhz) if v is not None]
        return (min(vals), max(vals)) if vals else None

    @property
    def throttle(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.start.throttle) | set(self.end.throttle)))

    def peak(self, field: str) -> float | None:
        vals = [v for v in (getattr(self.start, field), getattr(self.end, field)) if v is not None]
        return max(vals) if vals else None

    def to_dict(self) -> dict[str, Any]:
        return {"context_len": self.context_len, "block": self.block, "start": self.start.to_dict(),
                "end": self.end.to_dict()}


@dataclass(frozen=True)
class Telemetry:
    """Every block's readings; `source` says where they came from ("nvml", "nvidia-smi",
    "host": GPU fields unknown), `note` why GPU fields are missing (said once)."""

    source: str
    blocks: tuple[BlockTelemetry, ...]
    note: str = ""

    @classmethod
    def from_json(cls, data: Any) -> "Telemetry | None":
        """None for a table without telemetry (schema < 1.2, or a capture that recorded none)."""
        if data is None:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("blocks"), list):
            raise CalibError("metadata telemetry is not an object with a blocks list")
        if len(data["blocks"]) > MAX_BLOCKS:
            raise CalibError(f"metadata telemetry has {len(data['blocks'])} blocks (limit {MAX_BLOCKS})")
        blocks = []
        for b in data["blocks"]:
            if not isinstance(b, dict) or type(b.get("context_len")) is not int or type(b.get("block")) is not int:
                raise CalibError("metadata telemetry block lacks an integer context_len/block")
            blocks.append(BlockTelemetry(b["context_len"], b["block"], Reading.from_dict(b.get("start")),
                                         Reading.from_dict(b.get("end"))))
        return cls(source=str(data.get("source", ""))[:40], blocks=tuple(blocks), note=str(data.get("note", ""))[:200])

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "note": self.note, "blocks": [b.to_dict() for b in self.blocks]}

    def summary(self) -> "TelemetrySummary":
        timed = [b for b in self.blocks if b.block >= 0] or list(self.blocks)
        sm = [v for b in timed for v in (b.start.sm_mhz, b.end.sm_mhz) if v is not None]
        temps = [t for b in timed if (t := b.peak("temp_c")) is not None]
        power = [p for b in timed if (p := b.peak("power_w")) is not None]
        throttled = tuple(sorted({r for b in timed for r in b.throttle}))
        return TelemetrySummary(median_sm_mhz=statistics.median(sm) if sm else None,
                                max_temp_c=max(temps) if temps else None,
                                max_power_w=max(power) if power else None, throttle=throttled,
                                blocks=len(timed))


@dataclass(frozen=True)
class TelemetrySummary:
    """What `diff` puts beside the cost diff: one number per condition, over the timed blocks."""

    median_sm_mhz: float | None
    max_temp_c: float | None
    max_power_w: float | None
    throttle: tuple[str, ...]
    blocks: int

    def to_dict(self) -> dict[str, Any]:
        return {"median_sm_mhz": self.median_sm_mhz, "max_temp_c": self.max_temp_c,
                "max_power_w": self.max_power_w, "throttle": list(self.throttle), "blocks": self.blocks}

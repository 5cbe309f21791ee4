"""The sample record: one timed draft/verify step.

Fields mirror vLLM's ``StepTimingSample`` exactly (vllm/v1/worker/gpu/async_utils.py)
plus what vLLM leaves implicit: the context length the dummy requests had, and
which replay of its batch the step was. Records are immutable and validated on
construction, so a table can never hold a NaN cost or a zero-size batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Iterable

import numpy as np

from dspark_calib.errors import CalibError

VLLM_SAMPLE_FIELDS = ("forward_ms", "drafter_ms", "num_target_tokens", "num_reqs", "full_cudagraph")


@dataclass(frozen=True, slots=True)
class Sample:
    forward_ms: float
    drafter_ms: float
    num_target_tokens: int
    num_reqs: int
    full_cudagraph: bool
    context_len: int
    replay: int = 0

    def __post_init__(self) -> None:
        for name in ("forward_ms", "drafter_ms"):
            value = getattr(self, name)
            # numpy scalars count (float32 timings, int64 from a frame); bools do not.
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise CalibError(f"sample {name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise CalibError(f"sample {name} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("num_target_tokens", "num_reqs", "context_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not _is_integral(value) or int(value) <= 0:
                raise CalibError(f"sample {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if isinstance(self.replay, bool) or not _is_integral(self.replay) or int(self.replay) < 0:
            raise CalibError(f"sample replay must be an integer >= 0, got {self.replay!r}")
        object.__setattr__(self, "replay", int(self.replay))
        if not isinstance(self.full_cudagraph, bool):
            # numpy.bool_ from pyarrow round-trips is fine; strings like "yes" are not.
            # (isinstance, not the type's name: numpy 2 renamed it from "bool_" to "bool".)
            if not isinstance(self.full_cudagraph, np.bool_):
                raise CalibError(f"sample full_cudagraph must be a bool, got {self.full_cudagraph!r}")
            object.__setattr__(self, "full_cudagraph", bool(self.full_cudagraph))

    @classmethod
    def from_vllm(cls, sample: Any, *, context_len: int, replay: int = 0) -> "Sample":
        """Convert vLLM's own StepTimingSample (or anything with its fields)."""
        try:
            values = {name: getattr(sample, name) for name in VLLM_SAMPLE_FIELDS}
        except AttributeError as exc:
            raise CalibError(f"not a vLLM StepTimingSample: {exc}") from None
        return cls(**values, context_len=context_len, replay=replay)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_integral(value: Any) -> bool:
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return value.is_integer()
    return hasattr(value, "__index__")


def samples_from_dicts(rows: Iterable[dict[str, Any]]) -> list[Sample]:
    return [Sample(**row) for row in rows]

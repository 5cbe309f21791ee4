"""Timed draft/verify steps: one record (``Sample``) and many, columnar (``Samples``).

Fields mirror vLLM's ``StepTimingSample`` exactly (vllm/v1/worker/gpu/async_utils.py)
plus what vLLM leaves implicit: the context length the dummy requests had, and
which replay of its batch the step was. Both types are immutable and validated on
construction, so a table can never hold a NaN cost or a zero-size batch.

``Sample`` is for conversion from vLLM (a handful at a time); ``Samples`` is what a
table holds: one read-only numpy array per field, because a table's 40k+ samples
must not cost 40k Python objects (nor pandas' import) on every load.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from dspark_calib.errors import CalibError

if TYPE_CHECKING:
    import pandas as pd

VLLM_SAMPLE_FIELDS = ("forward_ms", "drafter_ms", "num_target_tokens", "num_reqs", "full_cudagraph")
# Sample columns -> numpy dtype, in file order: the one list table files and Samples share.
SAMPLE_COLUMNS: dict[str, type] = {
    "context_len": np.int64,
    "replay": np.int64,
    "forward_ms": np.float64,
    "drafter_ms": np.float64,
    "num_target_tokens": np.int64,
    "num_reqs": np.int64,
    "full_cudagraph": np.bool_,
}
DRAFT = "draft"
VERIFY = "verify"


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


@dataclass(frozen=True, eq=False)
class Samples:
    """Many samples, columnar: one read-only numpy array per field, validated once here."""

    context_len: np.ndarray
    replay: np.ndarray
    forward_ms: np.ndarray
    drafter_ms: np.ndarray
    num_target_tokens: np.ndarray
    num_reqs: np.ndarray
    full_cudagraph: np.ndarray

    def __post_init__(self) -> None:
        n = None
        for name, dtype in SAMPLE_COLUMNS.items():
            raw = np.asarray(getattr(self, name))
            if raw.ndim != 1:
                raise CalibError(f"sample column {name} must be one-dimensional")
            if n is not None and len(raw) != n:
                raise CalibError(f"sample column {name} has {len(raw)} values, the others {n}")
            n = len(raw)
            arr = _as_column(name, raw, dtype)
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        if not n:
            return
        for name in ("forward_ms", "drafter_ms"):
            vals = getattr(self, name)
            if not np.isfinite(vals).all() or (vals < 0).any():
                raise CalibError(f"sample {name} must be finite and >= 0")
        for name in ("num_target_tokens", "num_reqs", "context_len"):
            if (getattr(self, name) <= 0).any():
                raise CalibError(f"sample {name} must be a positive integer")
        if (self.replay < 0).any():
            raise CalibError("sample replay must be an integer >= 0")

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_columns(cls, columns: dict[str, Any]) -> "Samples":
        missing = [c for c in SAMPLE_COLUMNS if c not in columns]
        if missing:
            raise CalibError(f"sample columns missing: {missing}")
        return cls(**{c: columns[c] for c in SAMPLE_COLUMNS})

    @classmethod
    def from_records(cls, records: Iterable[Sample]) -> "Samples":
        records = list(records)
        return cls(**{c: np.array([getattr(r, c) for r in records], dtype=t) for c, t in SAMPLE_COLUMNS.items()})

    @classmethod
    def empty(cls) -> "Samples":
        return cls(**{c: np.zeros(0, dtype=t) for c, t in SAMPLE_COLUMNS.items()})

    @classmethod
    def concat(cls, parts: Sequence["Samples"]) -> "Samples":
        if not parts:
            return cls.empty()
        return cls(**{c: np.concatenate([getattr(p, c) for p in parts]) for c in SAMPLE_COLUMNS})

    # -- use ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.context_len)

    def columns(self) -> dict[str, np.ndarray]:
        return {c: getattr(self, c) for c in SAMPLE_COLUMNS}

    def take(self, rows: np.ndarray) -> "Samples":
        """The rows a boolean mask or index array picks (already valid: no re-check needed, but cheap)."""
        return type(self)(**{c: getattr(self, c)[rows] for c in SAMPLE_COLUMNS})

    def select(self, kind: str | None = None, context_len: int | None = None) -> "Samples":
        """kind "draft": the full-CUDA-graph samples vLLM's fit prices the draft curve from;
        "verify" or None: all. context_len: only that context length."""
        if kind not in (None, DRAFT, VERIFY):
            raise ValueError(f"kind must be {DRAFT!r}, {VERIFY!r} or None, not {kind!r}")
        mask = np.ones(len(self), dtype=bool)
        if context_len is not None:
            mask &= self.context_len == context_len
        if kind == DRAFT:
            # Eager-target steps inflate drafter timings (see fit.fit_pair): graph replays only.
            mask &= self.full_cudagraph
        return self if mask.all() else self.take(mask)

    def points(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(size, cost_ms) of each sample on `kind`'s curve: num_reqs/drafter_ms or num_target_tokens/forward_ms."""
        if kind == DRAFT:
            return self.num_reqs, self.drafter_ms
        return self.num_target_tokens, self.forward_ms

    def measurements(self) -> set[bytes]:
        """Each sample as it was measured (every column but the replay index, which a merge
        renumbers): equal in two tables only when the same timing was pooled twice, or by chance."""
        cols = [getattr(self, c) for c in SAMPLE_COLUMNS if c != "replay"]
        rows = np.stack([c.view(np.int64) if c.dtype == np.float64 else c.astype(np.int64) for c in cols], axis=1)
        return {row.tobytes() for row in np.ascontiguousarray(rows)}

    def with_replay_offset(self, offset: int) -> "Samples":
        return type(self)(**{**self.columns(), "replay": self.replay + offset})

    def records(self) -> list[Sample]:
        """One Sample per row (for code that wants records, e.g. vLLM's StepTimingSample)."""
        cols = [getattr(self, c).tolist() for c in SAMPLE_COLUMNS]
        return [Sample(**dict(zip(SAMPLE_COLUMNS, row))) for row in zip(*cols)]

    def to_frame(self) -> "pd.DataFrame":
        import pandas as pd

        return pd.DataFrame(self.columns(), columns=list(SAMPLE_COLUMNS))

    def digest(self) -> str:
        """sha256 over every column's little-endian bytes, in row order: what a table's hash covers."""
        h = hashlib.sha256(f"samples:{len(self)}".encode())
        for name, dtype in SAMPLE_COLUMNS.items():
            h.update(f"/{name}/".encode())
            h.update(np.ascontiguousarray(getattr(self, name), dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
        return h.hexdigest()


def _as_column(name: str, raw: np.ndarray, dtype: type) -> np.ndarray:
    """`raw` as `dtype`, refusing lossy conversions (a float 2.5 replay, a NaN count, a string)."""
    if raw.dtype == dtype:
        return raw
    if len(raw) == 0:
        return raw.astype(dtype)
    if dtype is np.bool_:
        if raw.dtype.kind in "iu" and np.isin(raw, (0, 1)).all():
            return raw.astype(bool)
        raise CalibError(f"sample {name} must be a bool")
    if raw.dtype.kind not in "iuf":
        raise CalibError(f"sample {name} must be a number")
    if dtype is np.int64:
        if raw.dtype.kind == "f" and not (np.isfinite(raw).all() and (raw == np.round(raw)).all()):
            raise CalibError(f"sample {name} must be an integer")
    return raw.astype(dtype)

"""Turn samples into cost curves and dense tables, exactly as vLLM does.

Three rules are copied from vLLM 0.28-0.33 (``spec_decode/adaptive_verification.py``)
and tested against the installed vllm's own code:

* ``fit_curves``: draft = median drafter_ms per num_reqs over samples that replayed a
  full CUDA graph; verify = median forward_ms per num_target_tokens over all samples
  (``set_initial_cost_curves``). We also keep each point's spread.
* ``build_cost_tables``: the dense arrays vLLM indexes at serve time
  (``build_cost_tables_from_curves``).
* ``choose_draft_budget``: the draft budget ``get_num_tokens`` picks.

Only numpy here: inspect and diff must start fast without torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from dspark_calib.samples import DRAFT, VERIFY, Sample, Samples

CURVE_KINDS = (DRAFT, VERIFY)
# vLLM floors: a zero-cost verify step would make the accepted/cost ratio infinite.
DRAFT_FLOOR_MS = 0.0
VERIFY_FLOOR_MS = 1e-6


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One size of a cost curve: vLLM's median plus the spread behind it."""

    size: int
    cost_ms: float  # the median: the only number vLLM uses
    n: int
    min_ms: float
    p25_ms: float
    p75_ms: float
    max_ms: float
    mad_ms: float  # median absolute deviation, unscaled

    @property
    def rel_spread(self) -> float:
        """Interquartile range relative to the median (0 for a perfectly stable point)."""
        return (self.p75_ms - self.p25_ms) / self.cost_ms if self.cost_ms > 0 else 0.0


# Curve columns, in file order (the table file stores exactly these, see table.file.COLUMNS).
CURVE_COLUMNS = ("size", "cost_ms", "n", "min_ms", "p25_ms", "p75_ms", "max_ms", "mad_ms")


@dataclass(frozen=True, eq=False)
class Curve:
    """A cost curve, columnar: one read-only numpy array per CurvePoint field.

    Columnar because tables load on every engine start and an 8192-point curve
    must not cost 8192 Python objects.
    """

    size: np.ndarray
    cost_ms: np.ndarray
    n: np.ndarray
    min_ms: np.ndarray
    p25_ms: np.ndarray
    p75_ms: np.ndarray
    max_ms: np.ndarray
    mad_ms: np.ndarray

    def __post_init__(self) -> None:
        for name in CURVE_COLUMNS:
            arr = np.array(getattr(self, name), dtype=np.int64 if name in ("size", "n") else np.float64)
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)

    @classmethod
    def from_points(cls, points: Iterable[CurvePoint]) -> "Curve":
        points = list(points)
        return cls(**{name: [getattr(p, name) for p in points] for name in CURVE_COLUMNS})

    @classmethod
    def from_columns(cls, columns: dict) -> "Curve":
        return cls(**{name: columns[name] for name in CURVE_COLUMNS})

    def __len__(self) -> int:
        return len(self.size)

    def points(self) -> list[CurvePoint]:
        return [CurvePoint(*row) for row in zip(*(getattr(self, n).tolist() for n in CURVE_COLUMNS))]

    def as_vllm(self) -> list[tuple[int, float]]:
        """The (size, cost) list vLLM's set_cost_curves takes."""
        return list(zip(self.size.tolist(), self.cost_ms.tolist()))

    @property
    def rel_spread(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.cost_ms > 0, (self.p75_ms - self.p25_ms) / self.cost_ms, 0.0)


@dataclass(frozen=True, eq=False)
class CurvePair:
    draft: Curve
    verify: Curve

    def as_vllm(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        return self.draft.as_vllm(), self.verify.as_vllm()

    def curve(self, kind: str) -> Curve:
        return self.draft if kind == DRAFT else self.verify


def point_stats(size: int, values: Sequence[float]) -> CurvePoint:
    arr = np.asarray(values, dtype=np.float64)
    median = float(np.median(arr))  # np.median, as vLLM: mean of the middle two for even n
    p25, p75 = np.percentile(arr, [25, 75])
    return CurvePoint(
        size=int(size),
        cost_ms=median,
        n=int(arr.size),
        min_ms=float(arr.min()),
        p25_ms=float(p25),
        p75_ms=float(p75),
        max_ms=float(arr.max()),
        mad_ms=float(np.median(np.abs(arr - median))),
    )


def median_curve(points: Iterable[tuple[int, float]]) -> Curve:
    grouped: defaultdict[int, list[float]] = defaultdict(list)
    for size, value in points:
        grouped[int(size)].append(float(value))
    return Curve.from_points(point_stats(size, values) for size, values in sorted(grouped.items()))


def _columnar_median_curve(sizes: np.ndarray, values: np.ndarray) -> Curve:
    """median_curve for columns: group by size with one sort instead of a dict of lists."""
    order = np.argsort(sizes, kind="stable")
    sizes, values = sizes[order], values[order]
    uniq, starts = np.unique(sizes, return_index=True)
    return Curve.from_points(point_stats(int(k), v) for k, v in zip(uniq.tolist(), np.split(values, starts[1:])))


def _as_samples(samples: Iterable[Sample] | Samples) -> Samples:
    return samples if isinstance(samples, Samples) else Samples.from_records(samples)


def fit_pair(samples: Iterable[Sample] | Samples) -> CurvePair:
    """vLLM's set_initial_cost_curves rule for one context length."""
    s = _as_samples(samples)
    # Eager-target steps inflate drafter timings and request counts collide across
    # execution modes, so vLLM prices the draft curve from graph replays only (Samples.select).
    draft = _columnar_median_curve(*s.select(DRAFT).points(DRAFT))
    verify = _columnar_median_curve(*s.select(VERIFY).points(VERIFY))
    return CurvePair(draft=draft, verify=verify)


def fit_curves(samples: Iterable[Sample] | Samples) -> dict[int, CurvePair]:
    """One curve pair per context length (vLLM profiles one; we may profile several)."""
    s = _as_samples(samples)
    return {int(ctx): fit_pair(s.select(context_len=int(ctx))) for ctx in np.unique(s.context_len)}


def _dense(curve: Sequence[tuple[int, float]], length_minus_one: int, cudagraph_limit: int) -> np.ndarray:
    xs, ys = np.asarray(curve, dtype=np.float64).T
    ys = np.maximum.accumulate(ys)  # cost never falls as the batch grows
    sizes = np.arange(length_minus_one + 1)
    # Up to the capture limit execution pads to the next captured graph: a step function.
    idx = np.searchsorted(xs, sizes, side="left")
    table = ys[np.minimum(idx, len(xs) - 1)]
    # Above it nothing pads: interpolate, but only between points that are themselves
    # above the limit (falling out of graphs is a real discontinuity).
    if cudagraph_limit:
        smooth = sizes > cudagraph_limit
        above = xs > cudagraph_limit
        if smooth.any() and above.any():
            table[smooth] = np.interp(sizes[smooth], xs[above], ys[above])
    if len(xs) > 1:
        after = sizes > xs[-1]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        table[after] = ys[-1] + slope * (sizes[after] - xs[-1])
    return table


def build_cost_tables(
    draft_curve: Sequence[tuple[int, float]],
    verify_curve: Sequence[tuple[int, float]],
    max_num_reqs: int,
    max_num_batched_tokens: int,
    cudagraph_limit: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Dense (draft, verify) tables of lengths max_num_reqs+1 and max_num_batched_tokens+1."""
    if not draft_curve or not verify_curve:
        raise ValueError("both curves need at least one point")
    draft = np.maximum(_dense(draft_curve, max_num_reqs, cudagraph_limit), DRAFT_FLOOR_MS)
    verify = np.maximum(_dense(verify_curve, max_num_batched_tokens, cudagraph_limit), VERIFY_FLOOR_MS)
    return draft, verify


def choose_draft_budget(
    draft_table: np.ndarray,
    verify_table: np.ndarray,
    confidences: np.ndarray,
    scheduled_drafts: Sequence[int],
    non_draft_tokens: Sequence[int],
    *,
    num_sampling_requests: int | None = None,
    max_total_logits: int | None = None,
    num_bonus_tokens: int = 1,
) -> int:
    """The draft budget vLLM's AdaptiveVerificationManager.get_num_tokens picks.

    confidences: (num_reqs, num_speculative_tokens) per-position draft confidences.
    num_sampling_requests: requests that sample this step (default: all; vLLM excludes
    requests still mid-prefill). max_total_logits: the sampler's one-chunk logit
    limit (default: unbounded).
    """
    confidences = np.asarray(confidences, dtype=np.float64)
    scheduled = np.asarray(scheduled_drafts, dtype=np.int64)
    non_draft = np.asarray(non_draft_tokens, dtype=np.int64)
    num_reqs, num_steps = confidences.shape
    survival = np.cumprod(confidences, axis=1)
    valid = np.arange(num_steps)[None, :] < scheduled[:, None]
    scores = np.sort(survival[valid])[::-1]
    non_draft_total = int(non_draft.sum())
    max_budget = int(scheduled.sum())
    if max_total_logits is not None:
        max_budget = min(max_budget, max(0, max_total_logits - num_reqs * num_bonus_tokens))
    scores = scores[:max_budget]
    sampling = num_reqs if num_sampling_requests is None else num_sampling_requests
    expected_accepted = np.concatenate(([sampling], sampling + np.cumsum(scores)))
    costs = draft_table[num_reqs] + verify_table[non_draft_total : non_draft_total + max_budget + 1]
    return int(np.argmax(expected_accepted / costs))


def decision_map(
    draft_table: np.ndarray,
    verify_table: np.ndarray,
    num_reqs_grid: Sequence[int],
    confidence_grid: Sequence[float],
    num_speculative_tokens: int,
) -> np.ndarray:
    """Draft budget per request for decode batches of R requests at mean confidence c.

    Each request schedules num_speculative_tokens drafts with confidence c at every
    position and one non-draft token (the last sampled one), the steady decode case.
    Returns an array [len(num_reqs_grid), len(confidence_grid)] of budget / R.
    """
    max_reqs = len(draft_table) - 1
    max_tokens = len(verify_table) - 1
    out = np.full((len(num_reqs_grid), len(confidence_grid)), np.nan)
    for i, reqs in enumerate(num_reqs_grid):
        # Batches the table cannot price (more requests or tokens than profiled) stay NaN.
        if reqs > max_reqs or reqs * (1 + num_speculative_tokens) > max_tokens:
            continue
        for j, conf in enumerate(confidence_grid):
            conf_matrix = np.full((reqs, num_speculative_tokens), conf)
            budget = choose_draft_budget(
                draft_table, verify_table, conf_matrix, [num_speculative_tokens] * reqs, [1] * reqs
            )
            out[i, j] = budget / reqs
    return out


def profile_context_len(context_len: int, max_model_len: int, query_len: int = 1) -> int:
    """The context vLLM really gives its dummy profiling requests.

    vLLM clamps it (v1/worker/gpu/input_batch.py, set_dummy_context):
    ``max(min(context_len, max_model_len - query_len), 0)``, so an engine with
    max_model_len 4096 profiles at 4095 whatever context was asked for. The
    loader prices, and `profile` refuses, with this same rule.
    """
    return max(min(int(context_len), int(max_model_len) - int(query_len)), 0)

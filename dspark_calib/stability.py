"""Level shifts between profile blocks: a block that ran uniformly slower or faster.

Why: vLLM's events window includes host time, so something beside the engine (another
process, a clock change) shifts every size of a block by the same milliseconds; noise
does not. The test, per block: for each series (metric, context, size), the block's
median minus the median of the other blocks; the block's offset is the median of those
over all series. It is flagged when |offset| > 3 x the points' MAD (the median over
series of each series' median absolute deviation). Taking a median over many sizes
makes a block's offset far steadier than one point, so noise alone stays well below
3 point-MADs, while a step the size of a point's noise across every size does not.
The reference is the majority level: when most blocks shifted, the minority is flagged
(with the opposite sign), which still tells the user the run was not one level.

Pure numpy on plain arrays: `inspect` (no torch) and `profile` both call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

THRESHOLD_MADS = 3.0


@dataclass(frozen=True)
class LevelShift:
    context_len: int
    block: int
    offset_ms: float
    offset_pct: float
    mad_ms: float

    def __str__(self) -> str:
        return (f"context {self.context_len}, block {self.block}: {self.offset_ms:+.3f} ms "
                f"({self.offset_pct:+.2f} %) from the other blocks, over {THRESHOLD_MADS:g} x MAD {self.mad_ms:.3f} ms")

    def to_dict(self) -> dict[str, Any]:
        return {"context_len": self.context_len, "block": self.block, "offset_ms": self.offset_ms,
                "offset_pct": self.offset_pct, "mad_ms": self.mad_ms}


def block_offsets(block: np.ndarray, series: np.ndarray, value: np.ndarray) -> tuple[dict[int, tuple[float, float]], float]:
    """Per block: (median offset ms, median offset %); and the points' MAD (ms)."""
    block, series, value = np.asarray(block), np.asarray(series), np.asarray(value, dtype=np.float64)
    blocks = np.unique(block)
    offsets: dict[int, list[tuple[float, float]]] = {int(b): [] for b in blocks}
    mads = []
    for s in np.unique(series):
        sel = series == s
        v, b = value[sel], block[sel]
        mads.append(float(np.median(np.abs(v - np.median(v)))))
        per = {int(k): float(np.median(v[b == k])) for k in np.unique(b)}
        if len(per) < 2:
            continue
        for k, m in per.items():
            others = float(np.median([x for j, x in per.items() if j != k]))
            offsets[k].append((m - others, 100.0 * (m - others) / others if others else 0.0))
    out = {k: (float(np.median([o[0] for o in v])), float(np.median([o[1] for o in v]))) for k, v in offsets.items() if v}
    return out, float(np.median(mads)) if mads else 0.0


def level_shifts(block: Sequence[int], series: Sequence[Any], value: Sequence[float], *, context_len: int = 0,
                 threshold: float = THRESHOLD_MADS) -> tuple[LevelShift, ...]:
    """Blocks whose offset exceeds threshold x the points' MAD, in block order."""
    offsets, mad = block_offsets(np.asarray(block), np.asarray(series), np.asarray(value))
    return tuple(LevelShift(context_len, k, ms, pct, mad) for k, (ms, pct) in sorted(offsets.items())
                 if len(offsets) > 1 and abs(ms) > threshold * mad)


def table_level_shifts(samples: Any, replays_per_block: int) -> tuple[LevelShift, ...]:
    """Every context of a table's timed samples (Samples): verify (forward_ms by tokens) and
    draft (drafter_ms of full-graph steps, by requests) series. A sample's block is its
    replay // replays_per_block (capture.py numbers replays block by block)."""
    if samples is None or replays_per_block < 1:
        return ()
    cols = samples.columns()
    found: list[LevelShift] = []
    for ctx in np.unique(cols["context_len"]):
        sel = cols["context_len"] == ctx
        full = cols["full_cudagraph"][sel]
        block = np.concatenate([cols["replay"][sel], cols["replay"][sel][full]]) // replays_per_block
        series = np.concatenate([cols["num_target_tokens"][sel], -1 - cols["num_reqs"][sel][full]])  # disjoint keys
        value = np.concatenate([cols["forward_ms"][sel], cols["drafter_ms"][sel][full]])
        found.extend(level_shifts(block, series, value, context_len=int(ctx)))
    return tuple(found)


def replays_per_block(table: Any) -> int | None:
    """vLLM's replays of a size in one block: recorded by `profile` (fingerprint extra); else
    the timed replays over the timed blocks the telemetry saw; None: blocks unknown (an
    imported or older table), so no level-shift test."""
    fp = table.fingerprint
    per = fp.extra.get("vllm_replays_per_block")
    if isinstance(per, int) and not isinstance(per, bool) and per > 0:
        return per
    if table.telemetry is not None and fp.replays:
        timed = {b.block for b in table.telemetry.blocks if b.block >= 0}
        if timed and fp.replays % len(timed) == 0:
            return fp.replays // len(timed)
    return None


def table_flags(table: Any) -> tuple[LevelShift, ...]:
    """The level shifts of a whole table (none when its blocks are unknown or samples unread)."""
    per = replays_per_block(table)
    return table_level_shifts(table.samples, per) if per else ()

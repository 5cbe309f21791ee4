"""Level-shift detection (stability.py) on synthetic samples shaped like a profile:
4 timed blocks x 5 back-to-back replays of each size, costs 5..225 ms."""

import numpy as np
import pytest

from dspark_calib.samples import Samples
from dspark_calib.stability import level_shifts, table_level_shifts

SIZES = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
BASE = 5.0 + SIZES * (220.0 / 8192)
MAD_MS = 0.02  # realistic: ~0.05-0.2 % of a 10-200 ms step


def synthetic(seed, *, blocks=4, per_block=5, step_ms=0.0, step_from=None):
    rng = np.random.default_rng(seed)
    b, s, v = [], [], []
    for blk in range(blocks):
        for size, base in zip(SIZES, BASE):
            for _ in range(per_block):
                shift = step_ms if step_from is not None and blk >= step_from else 0.0
                b.append(blk), s.append(size), v.append(base + shift + rng.normal(0, MAD_MS / 0.6745))
    return np.array(b), np.array(s), np.array(v)


def test_clean_run_has_no_flag():
    assert level_shifts(*synthetic(0)) == ()


def test_step_from_block_3_is_flagged_at_block_3():
    flags = level_shifts(*synthetic(1, step_ms=0.18, step_from=3), context_len=8192)
    assert [f.block for f in flags] == [3]
    assert flags[0].offset_ms == pytest.approx(0.18, abs=0.03)
    assert flags[0].offset_pct > 0 and flags[0].context_len == 8192
    assert "block 3" in str(flags[0])


def test_step_in_the_minority_of_8_blocks_flags_the_shifted_blocks():
    flags = level_shifts(*synthetic(2, blocks=8, step_ms=0.18, step_from=6))
    assert [f.block for f in flags] == [6, 7]


def test_noise_alone_never_flags_over_many_seeds():
    assert all(level_shifts(*synthetic(seed)) == () for seed in range(300))


def test_heavy_tailed_noise_no_false_flag():
    rng = np.random.default_rng(7)
    for seed in range(100):
        b, s, v = synthetic(seed)
        v = v + rng.standard_t(3, size=len(v)) * MAD_MS * 0.5
        assert level_shifts(b, s, v) == ()


def test_single_block_cannot_be_compared():
    assert level_shifts(*synthetic(0, blocks=1, step_ms=1.0, step_from=0)) == ()


def test_table_level_shifts_reads_samples_columns():
    b, s, v = synthetic(3, step_ms=0.18, step_from=3)
    replay = b * 5 + np.tile(np.arange(5), len(b) // 5)
    cols = {"context_len": np.full(len(b), 8192), "replay": replay, "forward_ms": v, "drafter_ms": v / 10,
            "num_target_tokens": s, "num_reqs": np.minimum(s, 256), "full_cudagraph": s <= 512}
    flags = table_level_shifts(Samples.from_columns(cols), 5)
    assert [(f.context_len, f.block) for f in flags] == [(8192, 3)]

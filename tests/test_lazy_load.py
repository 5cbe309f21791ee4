"""read_table keeps raw samples out of pandas until they are used (inspect's start-up budget)."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dspark_calib.reference import table_from_startup_json
from dspark_calib.table import SAMPLE_COLUMNS, read_table, write_table

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
KW = dict(model=str(REPO / "profiles/configs/qwen3-8b"), draft=str(REPO / "profiles/configs/dspark-qwen3-8b-block7"),
          gpu_name="NVIDIA H200", vllm_version="0.33.0", num_speculative_tokens=7)


@pytest.fixture(scope="module")
def original():
    return table_from_startup_json([str(DATA / f"qwen3-8b_dspark-block7_ctx{c}.json") for c in (1024, 16384)], **KW)


@pytest.fixture
def path(original, tmp_path):
    return write_table(original, tmp_path / "t.parquet")


def test_samples_round_trip_exactly(original, path):
    t = read_table(path)
    assert "samples" not in t.__dict__  # not built yet
    assert t.num_samples() == 560 and t.num_samples(1024) == 280 and t.num_samples(8192) == 0
    pd.testing.assert_frame_equal(t.samples, original.samples)  # dtypes included
    assert list(t.samples.columns) == list(SAMPLE_COLUMNS)
    assert t.samples is t.samples  # built once
    assert t.num_samples(16384) == 280  # same answer from the DataFrame
    assert [s.to_dict() for s in t.iter_samples(1024)] == [s.to_dict() for s in original.iter_samples(1024)]


def test_lazy_table_behaves_like_a_dataclass(path, original):
    t = read_table(path)
    moved = dataclasses.replace(t, created_at="2000-01-01T00:00:00Z")
    pd.testing.assert_frame_equal(moved.samples, original.samples)
    back = pickle.loads(pickle.dumps(read_table(path)))
    pd.testing.assert_frame_equal(back.samples, original.samples)
    with pytest.raises(AttributeError):
        t.no_such_attribute  # noqa: B018


def test_read_table_does_not_import_pandas(path):
    code = ("import sys\nfrom dspark_calib.table import read_table\n"
            f"t = read_table({str(path)!r})\nt.validate()\n"
            "assert 'pandas' not in sys.modules, 'pandas imported'\n"
            "t.samples\nassert 'pandas' in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr

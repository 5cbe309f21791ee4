"""Telemetry in the table file: schema 1.2 metadata (migration from 1.0/1.1, round trip, hash)
and the typed record.

The worker's readings and cool-downs: tests/vllm/test_gpu_readings.py."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest

from dspark_calib.errors import CalibError
from dspark_calib.table.model import SCHEMA_VERSION
from dspark_calib.table.file import read_metadata, read_table, to_arrow, write_table
from dspark_calib.table.identity import hash_1_1
from dspark_calib.table.meta import METADATA_KEY
from dspark_calib.telemetry import Telemetry
from tests.helpers import SCHEMA10


# -- schema 1.2 ---------------------------------------------------------------------------------------
TELEMETRY = {"source": "nvml", "note": "", "blocks": [
    {"context_len": 8192, "block": b, "start": {"sm_mhz": 1980, "mem_mhz": 3201, "temp_c": 40 + b, "power_w": 300.0,
                                                 "load1": 0.5, "cpu_s": 1.0, "throttle": []},
     "end": {"sm_mhz": 1965 - 10 * b, "mem_mhz": 3201, "temp_c": 45 + b, "power_w": 650.0, "load1": 0.6,
             "cpu_s": 2.0, "throttle": ["sw_power_cap"] if b == 3 else []}} for b in range(-1, 4)]}


@pytest.fixture
def with_telemetry(reference_table_8192):
    return dataclasses.replace(reference_table_8192, telemetry=Telemetry.from_json(TELEMETRY))


def test_1_2_round_trips_telemetry(tmp_path, with_telemetry):
    back = read_table(write_table(with_telemetry, tmp_path / "t.parquet"))
    assert back.schema_version == SCHEMA_VERSION == "1.4"
    assert back.telemetry == with_telemetry.telemetry and back.content_hash == with_telemetry.content_hash
    assert read_table(tmp_path / "t.parquet", samples=False).telemetry == with_telemetry.telemetry
    s = back.telemetry.summary()
    assert (s.median_sm_mhz, s.max_temp_c, s.throttle, s.blocks) == (1972.5, 48.0, ("sw_power_cap",), 4)


def test_hash_covers_telemetry(tmp_path, with_telemetry):
    arrow = to_arrow(with_telemetry)
    meta = json.loads(arrow.schema.metadata[METADATA_KEY])
    meta["telemetry"]["blocks"][2]["end"]["temp_c"] = 30
    pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), tmp_path / "x.parquet")
    with pytest.raises(CalibError, match="content hash mismatch"):
        read_table(tmp_path / "x.parquet")
    plain = dataclasses.replace(with_telemetry, telemetry=None)
    assert plain.content_hash != with_telemetry.content_hash


def test_a_1_1_file_reads_with_no_telemetry_and_its_own_hash(tmp_path, reference_table_8192):
    arrow = to_arrow(reference_table_8192)
    meta = json.loads(arrow.schema.metadata[METADATA_KEY])
    del meta["telemetry"]
    meta["schema_version"] = "1.1"
    meta["content_hash"] = hash_1_1(meta, reference_table_8192.curves)
    pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), tmp_path / "old.parquet")
    assert read_metadata(tmp_path / "old.parquet").schema_version == "1.1"
    old = read_table(tmp_path / "old.parquet")
    assert old.telemetry is None and old.schema_version == "1.1" and old.content_hash == meta["content_hash"]
    again = read_table(write_table(old, tmp_path / "new.parquet"))
    assert again.schema_version == SCHEMA_VERSION and again.telemetry is None


def test_a_1_0_file_reads_with_no_telemetry():
    t = read_table(SCHEMA10)
    assert read_metadata(SCHEMA10).schema_version == "1.0" and t.telemetry is None


@pytest.mark.parametrize("bad", [[], {"blocks": "x"}, {"blocks": [{"context_len": "8192", "block": 0}]},
                                 {"blocks": [{"context_len": 1, "block": 0, "start": {"sm_mhz": "fast"}, "end": {}}]},
                                 {"blocks": [{"context_len": 1, "block": 0, "start": {"throttle": "x"}, "end": {}}]}])
def test_bad_telemetry_is_one_line(bad):
    with pytest.raises(CalibError) as err:
        Telemetry.from_json(bad)
    assert "\n" not in str(err.value) and "telemetry" in str(err.value)

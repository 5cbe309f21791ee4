"""The serve-time decision beside crafted tables: within its memory bound, on vLLM's real classes.

The decision runs as load mode runs it (vllm.load.decision_from_env on TP rank 0) in a fresh
interpreter: vLLM, torch and a real VllmConfig built first (tests/vllm/test_engine_info), then
the address space capped at what they took plus DECISION_MIB, then the decision over a
directory holding the shipped table and the crafted ones. Without the read bounds the
dictionary bomb alone decodes to 13 GB on the decision's thread, deadline or not.
"""

from __future__ import annotations

import shutil

import pytest

from tests import crafted as C
from tests.helpers import SHIPPED

DECISION_MIB = 512  # address space the decision may add: one 64 MiB-bounded read at a time, and its thread

CODE = """
import os, re, resource, sys
from types import SimpleNamespace
os.environ.update(DSPARK_CALIB_TABLE={source!r}, DSPARK_CALIB_POLICY="warn", DSPARK_CALIB_LOAD_TIMEOUT="120")
import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from dspark_calib.vllm import load, runtime
from tests.vllm.test_engine_info import build_config
m = object.__new__(av.AdaptiveVerificationManager)
m.req_states = SimpleNamespace(max_num_reqs=256, max_num_batched_tokens=8192)
m.num_speculative_steps, m._cudagraph_limit, m.cost_tables = 7, 512, None
runtime.state_of(m).vllm_config = build_config()
size = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
resource.setrlimit(resource.RLIMIT_AS, (size + ({mib} << 20),) * 2)
d = load.decision_from_env(m, [1, 2, 4, 8, 512])
print("LOAD", d.load, d.chosen.path if d.chosen else "")
print(d.lines[0])
"""


@pytest.mark.slow
def test_the_serving_decision_finds_the_good_table_beside_the_bombs_within_its_bound(tmp_path):
    shutil.copy(SHIPPED, tmp_path / SHIPPED.name)
    C.dictionary_bomb(tmp_path / "dictionary.parquet", SHIPPED)
    C.zstd_bomb(tmp_path / "zstd.parquet", SHIPPED)
    C.row_bomb(tmp_path / "rows.parquet", SHIPPED)
    r = C.run_capped(1 << 20, CODE.format(source=str(tmp_path), mib=DECISION_MIB), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[0] == f"LOAD True {tmp_path / SHIPPED.name}", r.stdout[-3000:]
    line = out[1]
    assert "3 unreadable" in line, line
    assert f"{tmp_path / 'zstd.parquet'} (hash 15b5101f9d84): bytes decoded" in line
    assert "exceeds the read limit max_decoded_bytes=67108864" in line
    assert f"{tmp_path / 'dictionary.parquet'} (hash 15b5101f9d84): unknown record kind 'xxxx" in line
    assert not any(w in line for w in ("MemoryError", "realloc", "malloc", "out of memory", "deadline")), line

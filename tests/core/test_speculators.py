"""The speculative methods dspark-calib prices, their drafters, and the method in the fingerprint."""

from __future__ import annotations

import json

import pytest

from dspark_calib import serve_args
from dspark_calib.errors import CalibError
from dspark_calib.fingerprint import KEY, EQUAL, Fingerprint, load_mismatches
from dspark_calib.speculators import SPECULATORS, speculator
from dspark_calib.table.file import read_metadata
from tests.helpers import DRAFT, REPO, SHIPPED

CONFIGS = REPO / "profiles" / "configs"


def config(name):
    return json.loads((CONFIGS / name / "config.json").read_text())


def test_each_method_checks_its_drafter():
    assert speculator("dspark").check_drafter(config("dspark-qwen3-8b-block7"), DRAFT) == 7  # its block size
    assert speculator("draft_model").check_drafter(config("qwen3-0.6b"), "d") is None  # K must be given
    assert speculator("eagle3").check_drafter(config("eagle3-qwen3-8b"), "e") is None
    assert speculator("dflash").check_drafter(config("dflash-qwen3-8b-b16"), "f") is None  # its block is not K
    with pytest.raises(CalibError, match="not a DSpark drafter: .*Qwen3ForCausalLM.*for --method dspark"):
        speculator("dspark").check_drafter(config("qwen3-0.6b"), "d")
    assert not SPECULATORS["mtp"].own_drafter  # the target's own layers draft


@pytest.mark.parametrize("method, why", [("ngram", "no logits"), ("suffix", "no logits"),
                                         ("custom_class", "not ones dspark-calib has checked"),
                                         ("medusa", "not a vLLM 0.33 speculative method")])
def test_methods_without_adaptive_pricing_are_one_line(method, why):
    with pytest.raises(CalibError) as err:
        speculator(method)
    line = str(err.value)
    assert "\n" not in line and f"--method {method!r}: not supported" in line and why in line
    assert "draft_model" in line  # says which ones are


def test_the_method_is_an_equal_key_and_a_shipped_table_is_dspark():
    assert KEY["speculative_method"].load == EQUAL
    fp = read_metadata(SHIPPED).fingerprint  # written before the key: every such table was DSpark
    assert fp.speculative_method == "dspark"
    [m] = load_mismatches(fp, {"speculative_method": "draft_model"})
    assert m.key == "speculative_method" and "table 'dspark' vs engine 'draft_model'" in str(m)
    recorded = Fingerprint.from_dict({**fp.to_dict(), "speculative_method": "eagle3"})
    assert recorded.speculative_method == "eagle3"  # a recorded method is kept as recorded


@pytest.mark.parametrize("spec, method", [
    ({"method": "dspark", "model": DRAFT}, "dspark"),
    ({"method": "eagle3", "model": "x"}, "eagle3"),
    # vLLM re-detects these from the drafter's path and architectures: decided at start
    ({"model": DRAFT}, None),
    ({"method": "draft_model", "model": "org/Qwen3-8B_eagle3"}, None),
    ({"method": "mtp"}, None),
])
def test_the_light_path_resolves_only_the_methods_vllm_keeps(spec, method):
    assert serve_args.speculative_method(spec) == method

"""The estimator seed (seed.py): made from observe files (the newest reading after a refit), written and read
back, matched against an engine's keys; every bad file or set of files refused in one line."""

from __future__ import annotations

import json
import os

import pytest

from dspark_calib.errors import CalibError
from dspark_calib.observe.file import ObservedWriter
from dspark_calib.seed import (FORMAT, KEY_NAMES, MAX_SEED_BYTES, EstimatorSeed, read_seed, seed_from_observed,
                               seed_mismatches, write_seed)
from tests.core.test_observe import step

# what a Qwen3-8B + Qwen3-0.6B draft-model engine on dummy weights with synthetic acceptance reports
KEYS = {"vllm_version": "0.33.0", "target_config_hash": "sha256:aaaa", "model_revision": None, "hf_overrides": "none",
        "model_impl": "auto", "draft_config_hash": "sha256:bbbb", "draft_revision": None,
        "speculative_method": "draft_model", "num_speculative_tokens": 7, "dtype": "bfloat16", "kv_cache_dtype": "auto",
        "quantization": None, "load_format": "dummy", "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [0.9, 0.8, 0.7, 0.55, 0.4, 0.3, 0.2]}


def reading(refits, steps, slope=0.5, base=-0.2):
    return dict(estimator_refits=refits, estimator_steps=steps, estimator_slope=slope,
                estimator_intercepts=tuple(base - 0.25 * i for i in range(7)))


def observed(directory, readings, *, keys=KEYS, host="h200-a", name=None):
    """An observe file of one engine: a row per reading (a dict, or None for a row without one)."""
    os.makedirs(directory, exist_ok=True)
    meta = {"mode": "stock", "host": host, **({"estimator_keys": keys} if keys is not None else {})}
    with ObservedWriter(directory, metadata=meta, name=name) as w:
        for i, r in enumerate(readings):
            w.append(step(i, **(r or {})))
    return os.path.join(directory, sorted(os.listdir(directory))[-1])


def test_the_seed_is_the_most_refitted_reading_with_the_files_keys(tmp_path):
    a = observed(tmp_path / "a", [reading(0, 3), None, reading(1, 104, 0.6, 1.0), reading(2, 200, 0.7, 2.0)],
                 name="a")
    b = observed(tmp_path / "b", [reading(0, 2), reading(1, 101, 0.9, 1.5)], host="h200-b", name="b")
    seed = seed_from_observed([a, b])
    assert (seed.refits, seed.steps, seed.slope) == (2, 200, 0.7)
    assert seed.intercepts == tuple(2.0 - 0.25 * i for i in range(7))
    assert seed.keys == KEYS and seed.source == {"file": os.path.basename(a), "host": "h200-a", "files": 2}


def written_at(monkeypatch, when):
    """Observe files written from now on record created_at `when` (UTC)."""
    from dspark_calib.observe import file as observe_file

    monkeypatch.setattr(observe_file, "utc_now", lambda: when)


def test_across_engine_starts_the_newest_reading_after_a_refit_is_the_seed(tmp_path, monkeypatch):
    """Start A ran long (5 refits); start B, seeded from A and started after it, refitted twice more
    from there: its counts restart at 0, so the most-refitted reading is A's, yet B's last one is
    what the estimator learned last. Start C, newest, has not refitted: its reading is its seed."""
    written_at(monkeypatch, "2026-12-01T10:00:00Z")
    a = observed(tmp_path / "a", [reading(0, 3), reading(3, 301, 0.6, 1.0), reading(5, 512, 0.65, 1.5)], name="a")
    written_at(monkeypatch, "2026-12-01T11:00:00Z")
    b = observed(tmp_path / "b", [reading(0, 2, 0.65, 1.5), reading(1, 104, 0.7, 2.0), reading(2, 208, 0.75, 2.5),
                                  None], name="b")
    written_at(monkeypatch, "2026-12-01T12:00:00Z")
    c = observed(tmp_path / "c", [reading(0, 2, 0.75, 2.5), None], name="c")
    for files in ([a, b, c], [c, b, a]):  # whatever the order given
        seed = seed_from_observed(files)
        assert (seed.refits, seed.steps, seed.slope, seed.source["file"]) == (2, 208, 0.75, os.path.basename(b))
    # files written in the same second: the reading with the most steps
    written_at(monkeypatch, "2026-12-01T11:00:00Z")
    d = observed(tmp_path / "d", [reading(1, 150, 0.9, 3.0)], name="d")
    assert seed_from_observed([b, d]).slope == 0.75 and seed_from_observed([d, b]).slope == 0.75


def test_a_seed_round_trips_through_its_file(tmp_path):
    seed = seed_from_observed([observed(tmp_path, [reading(3, 312, 0.75, 2.5)])])
    path = write_seed(seed, str(tmp_path / "seed.json"))
    back = read_seed(path)
    assert (back.keys, back.slope, back.intercepts, back.refits, back.steps) == \
        (seed.keys, seed.slope, seed.intercepts, seed.refits, seed.steps)
    assert back.source == seed.source and back.created_at
    raw = json.loads(open(path).read())
    assert raw["format"] == FORMAT and raw["schema_version"] == "1.0" and list(raw["keys"]) == list(KEY_NAMES)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # atomic: no temp file left


def test_a_seed_keeps_the_time_it_was_made(monkeypatch, tmp_path):
    """`seed --json` prints the seed and writes its file from one seed: both carry the time it was
    made, however many seconds pass between the two."""
    import dspark_calib.seed as seed_module

    ticks = iter(f"2026-12-03T07:27:3{i}Z" for i in range(9))
    monkeypatch.setattr(seed_module, "utc_now", lambda: next(ticks))
    seed = EstimatorSeed(keys=KEYS, slope=0.5, intercepts=(0.0,) * 7, refits=1, steps=100)
    assert seed.to_dict()["created_at"] == seed.to_dict()["created_at"] == "2026-12-03T07:27:30Z"
    assert read_seed(write_seed(seed, str(tmp_path / "s.json"))).created_at == "2026-12-03T07:27:30Z"


def test_mismatches_name_the_key_and_both_values():
    seed = EstimatorSeed(keys=KEYS, slope=0.5, intercepts=(0.0,) * 7, refits=1, steps=100)
    assert seed_mismatches(seed, KEYS) == []
    engine = {**KEYS, "load_format": "auto", "synthetic_acceptance_rates": None}
    assert seed_mismatches(seed, engine) == ["load_format: seed 'dummy' vs engine 'auto'",
                                             "synthetic_acceptance_rates: seed [0.9, 0.8, 0.7, 0.55, 0.4, 0.3, 0.2] "
                                             "vs engine None"]
    # a key the engine does not report is None there: a seed that recorded a value does not fit
    assert seed_mismatches(seed, {k: v for k, v in KEYS.items() if k != "dtype"}) == [
        "dtype: seed 'bfloat16' vs engine None"]


@pytest.mark.parametrize("files, why", [
    (lambda d: [observed(d, [reading(1, 100)], keys=None)], "records no acceptance estimator"),
    (lambda d: [observed(d / "a", [reading(1, 100)], name="a"),
                observed(d / "b", [reading(1, 100)], keys={**KEYS, "load_format": "auto"}, name="b")],
     "observed on another engine than"),
    (lambda d: [observed(d, [None, None])], "no estimator reading"),
    (lambda d: [observed(d, [reading(0, 40), reading(0, 80)])], "never refitted"),
    (lambda d: [observed(d, [reading(1, 100)], keys={**KEYS, "num_speculative_tokens": 5})],
     "another width than num_speculative_tokens 5"),
])
def test_files_a_seed_cannot_come_from_are_one_line(tmp_path, files, why):
    with pytest.raises(CalibError, match=why) as err:
        seed_from_observed(files(tmp_path))
    assert "\n" not in str(err.value)


def test_another_engines_files_name_the_key_and_both_values(tmp_path):
    a = observed(tmp_path / "a", [reading(1, 100)], name="a")
    b = observed(tmp_path / "b", [reading(1, 100)], keys={**KEYS, "speculative_method": "eagle3"}, name="b")
    with pytest.raises(CalibError) as err:
        seed_from_observed([a, b])
    assert "speculative_method: 'eagle3' vs 'draft_model'" in str(err.value) and str(err.value).startswith(b)


def good():
    return EstimatorSeed(keys=KEYS, slope=0.5, intercepts=(1.0,) * 7, refits=2, steps=200).to_dict()


@pytest.mark.parametrize("change, why", [
    (lambda d: [1, 2], "not an estimator seed"),
    (lambda d: {**d, "format": "other"}, "not an estimator seed"),
    (lambda d: {**d, "schema_version": "2.0"}, "seed schema 2.0 is not readable"),
    (lambda d: {**d, "schema_version": "x"}, "bad seed schema_version"),
    (lambda d: {**d, "keys": {k: v for k, v in d["keys"].items() if k != "load_format"}}, "seed keys lack load_format"),
    (lambda d: {**d, "keys": "none"}, "seed keys must be a JSON object"),
    (lambda d: {**d, "slope": -0.5}, "slope must be a finite number >= 0"),
    (lambda d: {**d, "slope": "0.5"}, "slope must be a finite number >= 0"),
    (lambda d: {**d, "intercepts": [1.0] * 6}, "6 intercepts for num_speculative_tokens 7"),
    (lambda d: {**d, "intercepts": [1.0] * 65}, "intercepts must be a list of 1 to 64 finite numbers"),
    (lambda d: {**d, "intercepts": []}, "intercepts must be a list of 1 to 64"),
    (lambda d: {**d, "refits": -1}, "refits and steps must be integers >= 0"),
    (lambda d: {**d, "slope": 3.7645e7, "intercepts": [-2.8e5] * 7}, "the estimator's fit ran away"),
    (lambda d: {**d, "intercepts": [395.1, 362.7, 1, 1, 1, 1, 1]}, "the estimator's fit ran away"),
])
def test_bad_seed_files_are_one_line(tmp_path, change, why):
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(change(good())))
    with pytest.raises(CalibError, match=why) as err:
        read_seed(str(path))
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_a_nan_a_fifo_and_a_huge_file_are_refused(tmp_path):
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(good()).replace('"slope": 0.5', '"slope": NaN'))  # Python's json reads NaN
    with pytest.raises(CalibError, match="slope must be a finite number"):
        read_seed(str(nan))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(CalibError, match="is a FIFO"):
        read_seed(str(fifo))
    big = tmp_path / "big.json"
    big.write_text(json.dumps({**good(), "source": {"pad": "x" * MAX_SEED_BYTES}}))
    with pytest.raises(CalibError, match="bytes, over the 64 KiB a JSON input may have"):
        read_seed(str(big))


def test_a_reading_that_ran_away_is_no_seed(tmp_path):
    """The H200 run's estimator on dummy weights: refit 1 overshot to intercepts ~395 (every draft
    certain), refit 2 ran away (slope 5.7e7); the most refitted reading is refused, naming why."""
    path = observed(tmp_path, [reading(1, 88, 0.5, 395.0), reading(9, 884, 3.7645e7, -2.8e5)])
    with pytest.raises(CalibError, match=r"refit 9.*fit ran away \(slope 3.764e\+07") as err:
        seed_from_observed([path])
    assert "\n" not in str(err.value)
    sane = observed(tmp_path / "ok", [reading(2, 200, 0.8, 2.0)])
    assert seed_from_observed([sane]).slope == 0.8

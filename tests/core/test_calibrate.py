"""calibrate on synthetic served steps: the real H200 curves times a known serving-state scale."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest

from dspark_calib.calibrate import calibrate
from dspark_calib.errors import CalibError
from dspark_calib.fingerprint import ENGINE_KEYS
from dspark_calib.observe.file import ObservedWriter, read_observed
from dspark_calib.selection import decide
from dspark_calib.table.calibration import ABOVE, WITHIN, Calibration
from dspark_calib.table.file import read_table, write_table
from dspark_calib.table.meta import METADATA_KEY
from dspark_calib.table.model import merge_tables
from dspark_calib.validate import AWARE, validate
from tests.core.test_validate import synthetic_steps

DRAFT_SCALE, VERIFY_GRAPH, VERIFY_EAGER = 0.98, 1.03, 1.05


def engine_keys(table, **changes):
    d = table.fingerprint.to_dict()
    return {**{k: d[k] for k in ENGINE_KEYS if d.get(k) is not None}, **changes}


def served(table, directory, *, seed=0, name="a", keep=lambda step: True, **meta):
    """Steps as the table prices them, served slower: drafts x0.98, verifies x1.03 within the
    capture limit and x1.05 above it. The observe files written."""
    limit = table.fingerprint.cudagraph_limit
    with ObservedWriter(directory, metadata=meta, name=name) as w:
        for s in synthetic_steps(table, (1024, 8192, 16384), per_context=200, seed=seed):
            scale = VERIFY_GRAPH if s.num_target_tokens <= limit else VERIFY_EAGER
            if keep(s):
                w.append(dataclasses.replace(s, forward_ms=s.forward_ms * scale, drafter_ms=s.drafter_ms * DRAFT_SCALE))
    return sorted(map(str, directory.iterdir()))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, reference_table):
    d = tmp_path_factory.mktemp("served")
    files = served(reference_table, d, mode="context_aware", table_hash=reference_table.content_hash)
    return files, calibrate(reference_table, files)


def test_a_known_scale_per_kind_and_size_region_is_recovered(fitted, reference_table):
    files, result = fitted
    f = result.calibration.factors
    assert f["draft"][WITHIN] == pytest.approx(DRAFT_SCALE, rel=3e-3)
    assert f["verify"][WITHIN] == pytest.approx(VERIFY_GRAPH, rel=3e-3)
    assert f["verify"][ABOVE] == pytest.approx(VERIFY_EAGER, rel=3e-3)
    cal = result.calibration
    assert cal.parent == reference_table.content_hash and cal.capture_limit == reference_table.fingerprint.cudagraph_limit
    assert sum(x["steps"] for x in cal.files) == 600 and [x["name"] for x in cal.files] == [p.split("/")[-1] for p in files]
    # the measured curves are kept: samples untouched, the fingerprint the parent's
    assert result.table.samples_digest == reference_table.samples_digest
    assert result.table.fingerprint.to_dict() == reference_table.fingerprint.to_dict()
    verify = {k.kind: k for k in result.fitted}["verify"]
    assert verify.before.median_signed_pct < -2.5 and abs(verify.after.median_signed_pct) < 0.3


def test_a_calibrated_table_prices_the_steps_corrected(fitted, reference_table, tmp_path):
    _, result = fitted
    held_out = served(reference_table, tmp_path, seed=11, mode="context_aware",
                      table_hash=reference_table.content_hash)  # other steps than the fitted ones
    before = validate(reference_table, read_observed(held_out))
    after = validate(result.table, read_observed(held_out))
    bias = {g.kind: g.errors[AWARE].median_signed_pct for g in after.overall}
    assert {g.kind: g.errors[AWARE].median_signed_pct < -1.5 for g in before.overall}["verify"]
    assert abs(bias["verify"]) < 0.5 and abs(bias["draft"]) < 0.5


def test_the_calibrated_table_round_trips_and_the_loader_loads_it_like_any_table(fitted, reference_table, tmp_path):
    _, result = fitted
    write_table(reference_table, tmp_path / "parent.parquet")
    path = write_table(result.table, tmp_path / "calibrated.parquet")
    back = read_table(path)
    assert back.calibration == result.calibration and back.content_hash == result.table.content_hash
    assert back.curves[8192].verify.as_vllm() == result.table.curves[8192].verify.as_vllm()
    decision = decide(str(path), engine_keys(reference_table), policy="strict", probe=False, allow_reference=True)
    assert decision.load and decision.verify_curve == back.curves[decision.context_len].verify.as_vllm()
    other = decide(str(path), engine_keys(reference_table, gpu_name="NVIDIA B200"), policy="strict", probe=False,
                   allow_reference=True)
    assert not other.load and "gpu_name" in other.refuse  # the same fingerprint rules as its parent


def test_the_content_hash_covers_the_correction(fitted, tmp_path):
    _, result = fitted
    path = write_table(result.table, tmp_path / "c.parquet")
    arrow = pq.read_table(path)
    meta = json.loads(arrow.schema.metadata[METADATA_KEY])
    meta["calibration"]["factors"]["verify"][WITHIN] = 1.5
    pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), tmp_path / "x.parquet",
                   row_group_size=meta["curve_rows"])
    with pytest.raises(CalibError, match="content hash mismatch"):
        read_table(tmp_path / "x.parquet")


def test_observe_files_of_another_table_or_engine_are_refused_naming_the_key(reference_table, tmp_path):
    other = served(reference_table, tmp_path / "t", mode="context_aware", table_hash="ab" * 32)
    with pytest.raises(CalibError, match=r"observed-.*table_hash abababababab is not this table's "):
        calibrate(reference_table, other)
    engine = served(reference_table, tmp_path / "e", engine=engine_keys(reference_table, gpu_name="NVIDIA B200"))
    with pytest.raises(CalibError, match="observed on another engine than the table's fingerprint: gpu_name"):
        calibrate(reference_table, engine)
    bare = served(reference_table, tmp_path / "b")
    with pytest.raises(CalibError, match="records neither a table_hash nor an engine fingerprint"):
        calibrate(reference_table, bare)
    stock = served(reference_table, tmp_path / "s", engine=engine_keys(reference_table))  # stock vLLM, same engine
    assert calibrate(reference_table, stock).calibration.factors["verify"][WITHIN] == pytest.approx(VERIFY_GRAPH,
                                                                                                    rel=3e-3)


def test_a_calibrated_table_is_neither_calibrated_again_nor_merged(fitted, reference_table):
    files, result = fitted
    with pytest.raises(CalibError, match="calibrated already .*calibrate its measured parent"):
        calibrate(result.table, files)
    with pytest.raises(CalibError, match="is calibrated .*merge the measured tables, then calibrate"):
        merge_tables([reference_table, result.table], names=["a", "b"])


def test_a_region_with_few_steps_takes_its_kinds_factor(reference_table, tmp_path):
    limit = reference_table.fingerprint.cudagraph_limit
    eager = iter(range(10))  # ten steps above the capture limit: too few for a factor of their own
    files = served(reference_table, tmp_path, mode="context_aware", table_hash=reference_table.content_hash,
                   keep=lambda s: s.num_target_tokens <= limit or next(eager, None) is not None)
    cal = calibrate(reference_table, files).calibration
    assert cal.steps["verify"] < 600 and cal.factors["verify"][WITHIN] == pytest.approx(VERIFY_GRAPH, rel=3e-3)
    # the kind's median over both regions (its eager steps' own would be 1.05)
    assert cal.factors["verify"][ABOVE] == pytest.approx(VERIFY_GRAPH, rel=3e-3)


def test_the_hosts_the_files_record_are_named(reference_table, tmp_path):
    files = [*served(reference_table, tmp_path, name="a", engine=engine_keys(reference_table), host="gpu-7"),
             *served(reference_table, tmp_path / "b", name="b", engine=engine_keys(reference_table), host="gpu-3")]
    cal = calibrate(reference_table, files).calibration
    assert cal.hosts() == ["gpu-3", "gpu-7"] and " on 1200 steps of hosts gpu-3, gpu-7: " in cal.summary()


def test_the_load_line_and_checks_say_a_calibrated_table_is_calibrated(reference_table, tmp_path):
    """The one load line (the plugin's, and check's, which is the same) says where a calibrated
    table's correction comes from; a measured table's line does not."""
    from dspark_calib.check import check_tables

    files = served(reference_table, tmp_path / "s", engine=engine_keys(reference_table), host="gpu-7")
    calibrated = calibrate(reference_table, files).table
    engine = engine_keys(reference_table)
    for table, name in ((calibrated, "c"), (reference_table, "m")):
        (tmp_path / name).mkdir()
        write_table(table, tmp_path / name / "t.parquet")
        [line] = decide(str(tmp_path / name), engine, probe=False, allow_reference=True).lines
        assert check_tables(str(tmp_path / name), engine, allow_reference=True).lines == (line,)
        said = f"; calibrated from 600 steps of host gpu-7 (parent {reference_table.content_hash[:12]});"
        assert (said in line) == (table is calibrated), line


def test_a_host_bound_drafter_at_half_its_profile_is_calibrated(reference_table, tmp_path):
    """vLLM's draft_model drafter serves at 0.46x its profile steps (H200): a correction that
    large is the profile's, not another engine's, and is fitted; a factor of 5 is refused."""
    keep = {"mode": "context_aware", "table_hash": reference_table.content_hash}
    with ObservedWriter(tmp_path / "half", metadata=keep, name="h") as w:
        for s in synthetic_steps(reference_table, (1024, 8192, 16384), per_context=100):
            w.append(dataclasses.replace(s, drafter_ms=s.drafter_ms * 0.46))
    assert calibrate(reference_table, [str(tmp_path / "half")]).calibration.factors["draft"][WITHIN] == \
        pytest.approx(0.46, rel=3e-3)
    with ObservedWriter(tmp_path / "fifth", metadata=keep, name="f") as w:
        for s in synthetic_steps(reference_table, (1024, 8192, 16384), per_context=100):
            w.append(dataclasses.replace(s, drafter_ms=s.drafter_ms * 0.2))
    with pytest.raises(CalibError, match=r"draft within_capture 0\.(2|19).* is outside \[0\.25, 4\]"):
        calibrate(reference_table, [str(tmp_path / "fifth")])


@pytest.mark.parametrize("raw,match", [({"parent": "x"}, "malformed"),
                                       ({"parent": "a" * 64, "capture_limit": 512, "steps": {"draft": 1, "verify": 1},
                                         "factors": {"draft": {WITHIN: 1, ABOVE: 1}, "verify": {WITHIN: 9, ABOVE: 1}}},
                                        "outside")])
def test_a_malformed_or_implausible_correction_is_refused_on_read(raw, match):
    with pytest.raises(CalibError, match=match):
        Calibration.from_json(raw)

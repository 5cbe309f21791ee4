"""The estimator seed inside vLLM (CPU): vLLM's real draft-model speculator (StandaloneARSpeculator,
built by init_speculator from a real VllmConfig) builds its real OnlineAcceptanceEstimator in
load_model (the drafter's weights stubbed: loading them needs a GPU); the plugin's own patch path
(plugin.patch -> the initialize_kv_cache hook) seeds it. The estimator's triton kernels run only in
step/predict, so a refit is stood in for by writing its tensors and counters as _refit_kernel does.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from vllm.distributed import parallel_state
from vllm.v1.worker.gpu.spec_decode.acceptance_estimator import (_INIT_BIAS, _INIT_SLOPE,
                                                                 OnlineAcceptanceEstimator)

from dspark_calib.cli.app import app
from dspark_calib.observe.file import read_observed
from dspark_calib.observe.step import ABSENT
from dspark_calib.seed import EstimatorSeed, write_seed
from dspark_calib.vllm import estimator as est_mode
from dspark_calib.vllm import plugin
from dspark_calib.vllm import observer as om
from tests.helpers import MODEL, REPO
from tests.vllm.test_context_aware import SingleRank, make_manager
from tests.vllm.test_observe_mode import Clock, FakeRunner, events_factory, lines, step
from tests.vllm.test_observe_mode import clean  # noqa: F401 - the autouse fixture: no DSPARK_CALIB_*, one TP rank

DRAFT_MODEL = str(REPO / "profiles/configs/qwen3-0.6b")
RATES = [0.9, 0.8, 0.7, 0.55, 0.4, 0.3, 0.2]


def build_config(**spec):
    """A real VllmConfig for Qwen3-8B + the Qwen3-0.6B draft model, dummy weights, synthetic acceptance."""
    from vllm.config import (CacheConfig, CompilationConfig, DeviceConfig, LoadConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)
    from vllm.engine.arg_utils import EngineArgs

    model_config = EngineArgs(model=MODEL, load_format="dummy", skip_tokenizer_init=True,
                              max_model_len=32768).create_model_config()
    parallel = ParallelConfig()
    speculative = SpeculativeConfig(**{"method": "draft_model", "model": DRAFT_MODEL, "num_speculative_tokens": 7,
                                       "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": RATES,
                                       **spec}, target_model_config=model_config, target_parallel_config=parallel)
    cfg = VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=speculative,
                     load_config=LoadConfig(load_format="dummy"), cache_config=CacheConfig(block_size=16),
                     scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                                      max_model_len=32768, is_encoder_decoder=False),
                     compilation_config=CompilationConfig(), device_config=DeviceConfig(device="cuda"))
    # vLLM refuses adaptive verification without full CUDA graphs, which a CPU platform never resolves:
    # switched on after validation, as the speculator reads it
    speculative.enable_adaptive_verification = True
    return cfg


def build_speculator(cfg):
    """vLLM's own speculator for cfg, its load_model run (the drafter's weights stubbed)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    with set_current_vllm_config(cfg):
        speculator = init_speculator(cfg, torch.device("cpu"), None)
        speculator.load_draft_model = lambda target, names: torch.nn.Linear(1, 1)
        speculator.load_model(torch.nn.Linear(1, 1))
    return speculator


@pytest.fixture(scope="module")
def config():
    return build_config()


class Runner:
    """GPUModelRunner's part the hook sees: its config, speculator and manager, and initialize_kv_cache."""

    def __init__(self, cfg, speculator):
        self.vllm_config, self.speculator, self.adaptive_verification = cfg, speculator, None
        self.kv_inits = []

    def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
        self.kv_inits.append((kv_cache_config, is_profiling))


@pytest.fixture
def hooked(config):
    """The plugin's real patch path on a runner module whose GPUModelRunner is the stand-in."""
    module = SimpleNamespace(GPUModelRunner=Runner, maybe_create_adaptive_verification_manager=lambda **kw: None)
    plugin.patch(av.AdaptiveVerificationManager, module)
    try:
        yield module
    finally:
        plugin.unpatch(av.AdaptiveVerificationManager, module)


def a_seed(config, tmp_path, **keys):
    seed = EstimatorSeed(keys={**est_mode.seed_keys(config), **keys}, slope=0.75,
                         intercepts=(2.5, 1.5, 0.75, 0.0, -0.5, -1.0, -1.75), refits=12, steps=1234,
                         source={"file": "observed-dp0-1-e0-000003.parquet", "host": "h200-a", "files": 2})
    return write_seed(seed, str(tmp_path / "seed.json")), seed


def coefficients(estimator):
    return float(estimator.slope[0]), tuple(float(x) for x in estimator.intercepts)


UNSEEDED = (_INIT_SLOPE, (pytest.approx(_INIT_BIAS),) * 7)


def test_the_real_speculator_builds_the_estimator_the_plugin_reads(config):
    spec = build_speculator(config)
    est = spec.acceptance_estimator
    assert type(spec).__name__ == "StandaloneARSpeculator" and isinstance(est, OnlineAcceptanceEstimator)
    assert est_mode.estimator_problem(est) == "" and est_mode.progress(est) == (0, 0)
    keys = est_mode.seed_keys(config)
    assert keys["speculative_method"] == "draft_model" and keys["num_speculative_tokens"] == 7
    assert keys["load_format"] == "dummy" and keys["rejection_sample_method"] == "synthetic"
    assert keys["synthetic_acceptance_rates"] == RATES and keys["target_config_hash"].startswith("sha256:")
    assert keys["draft_config_hash"] not in (None, keys["target_config_hash"])


def test_the_seed_is_written_into_vllms_estimator_after_the_serving_kv_init_only(config, hooked, tmp_path,
                                                                                monkeypatch, caplog):
    path, seed = a_seed(config, tmp_path)
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", path)
    runner = hooked.GPUModelRunner(config, build_speculator(config))
    est = runner.speculator.acceptance_estimator
    addresses = (est.slope.data_ptr(), est.intercepts.data_ptr())
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        runner.initialize_kv_cache("minimal", is_profiling=True)  # vLLM's graph-memory pass: not yet
        assert coefficients(est) == UNSEEDED
        runner.initialize_kv_cache("real")
    assert runner.kv_inits == [("minimal", True), ("real", False)]
    assert coefficients(est) == (0.75, pytest.approx(seed.intercepts))
    assert (est.slope.data_ptr(), est.intercepts.data_ptr()) == addresses  # in place: the draft graph's tensors
    assert est_mode.progress(est) == (0, 0)  # the counters stay vLLM's: the damping is per round, not per refit
    (level, line), = lines(caplog)
    assert level == logging.INFO and line.startswith(f"dspark-calib: estimator seeded from {path}: slope 0.75, ")
    assert line.endswith("(K=7; fitted over 12 refits, 1234 steps) on h200-a; it keeps learning from the first step")
    # the estimator learns; a later KV re-init must not put the seed back
    est.slope.fill_(0.9)
    runner.initialize_kv_cache("again")
    assert coefficients(est)[0] == pytest.approx(0.9)


@pytest.mark.parametrize("policy, level, applied, tail", [
    ("fallback", logging.WARNING, False, "; starting unseeded (policy fallback)"),
    ("warn", logging.WARNING, True, "; seeding anyway (policy warn)"),
])
def test_a_seed_of_another_engine_is_one_line_naming_the_key(config, hooked, tmp_path, monkeypatch, caplog, policy,
                                                             level, applied, tail):
    path, _ = a_seed(config, tmp_path, load_format="auto")
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", path)
    monkeypatch.setenv("DSPARK_CALIB_POLICY", policy)
    runner = hooked.GPUModelRunner(config, build_speculator(config))
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        runner.initialize_kv_cache("real")
    (got_level, line), = lines(caplog)
    assert got_level == level
    assert line == (f"dspark-calib: estimator seed {path} does not fit this engine: load_format: seed 'auto' vs "
                    f"engine 'dummy'{tail}")
    assert (coefficients(runner.speculator.acceptance_estimator)[0] == 0.75) is applied


def test_strict_refuses_to_start_on_every_mismatch(config, hooked, tmp_path, monkeypatch, caplog):
    path, _ = a_seed(config, tmp_path, speculative_method="eagle3", dtype="float16")
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", path)
    monkeypatch.setenv("DSPARK_CALIB_POLICY", "strict")
    runner = hooked.GPUModelRunner(config, build_speculator(config))
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"), pytest.raises(RuntimeError) as err:
        runner.initialize_kv_cache("real")
    want = (f"dspark-calib: estimator seed {path} does not fit this engine: speculative_method: seed 'eagle3' vs "
            "engine 'draft_model' (and 1 more); refusing to start (policy strict)")
    assert str(err.value) == want and lines(caplog) == [(logging.ERROR, want)]
    assert coefficients(runner.speculator.acceptance_estimator) == UNSEEDED


def test_a_seed_of_other_width_is_never_written_even_under_warn(config, hooked, tmp_path, monkeypatch, caplog):
    path, _ = a_seed(config, tmp_path)
    data = json.loads(open(path).read())
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", path)
    monkeypatch.setenv("DSPARK_CALIB_POLICY", "warn")
    spec = build_speculator(build_config(num_speculative_tokens=5, synthetic_acceptance_rates=RATES[:5]))
    runner = hooked.GPUModelRunner(spec.vllm_config, spec)
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        runner.initialize_kv_cache("real")
    (level, line), = lines(caplog)
    assert level == logging.WARNING and "num_speculative_tokens: seed 7 vs engine 5 (and 1 more)" in line
    assert line.endswith("; starting unseeded (policy warn)") and len(data["intercepts"]) == 7
    assert coefficients(spec.acceptance_estimator) == (_INIT_SLOPE, (pytest.approx(_INIT_BIAS),) * 5)


@pytest.mark.parametrize("content, why", [
    (None, "no such file"), ("{", "not JSON"), (json.dumps({"format": "x"}), "not an estimator seed")])
def test_an_unreadable_seed_starts_unseeded_with_one_line(config, hooked, tmp_path, monkeypatch, caplog, content, why):
    path = tmp_path / "seed.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", str(path))
    runner = hooked.GPUModelRunner(config, build_speculator(config))
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        runner.initialize_kv_cache("real")
    (level, line), = lines(caplog)
    assert level == logging.WARNING and line.startswith(f"dspark-calib: estimator seed not read: {path}: {why}")
    assert line.endswith("; starting unseeded (policy fallback)")
    assert coefficients(runner.speculator.acceptance_estimator) == UNSEEDED


def test_an_engine_without_the_estimator_says_so(config, hooked, tmp_path, monkeypatch, caplog):
    path, _ = a_seed(config, tmp_path)
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", path)
    runner = hooked.GPUModelRunner(config, SimpleNamespace(acceptance_estimator=None))  # a confidence head ranks
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        runner.initialize_kv_cache("real")
    (level, line), = lines(caplog)
    assert level == logging.WARNING and "ranks drafts without vLLM's acceptance estimator" in line


def test_every_tp_rank_writes_rank_0s_decision(config, tmp_path, monkeypatch):
    """Rank 1 never reads the file (it may differ there, or be missing): it writes what rank 0 broadcast."""
    _, seed = a_seed(config, tmp_path)
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", str(tmp_path / "not-on-this-host.json"))
    sent = []

    class Rank1(SingleRank):
        rank_in_group, world_size = 1, 2

        def broadcast_object(self, obj, src=0):
            sent.append(obj)
            return est_mode.SeedDecision(seed, "line from rank 0")

    monkeypatch.setattr(parallel_state, "get_tp_group", Rank1)
    runner = Runner(config, build_speculator(config))
    decision = est_mode.seed_runner(runner, est_mode.estimator_of(runner))
    assert sent == [None] and decision.line == "line from rank 0"
    assert coefficients(runner.speculator.acceptance_estimator) == (0.75, pytest.approx(seed.intercepts))


def observed_engine(config, table, monkeypatch, tmp_path, *, every):
    """Observe's stand-in runner (vLLM's call order, test_observe_mode) whose speculator has vLLM's
    real estimator, observed every `every` priced steps into tmp/obs: (runner, estimator, observer, clock)."""
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE_EVERY", str(every))
    clock = Clock()
    runner = FakeRunner(make_manager(table.dense_tables(8192)), clock)
    runner.vllm_config = config
    est = runner.speculator.acceptance_estimator = build_speculator(config).acceptance_estimator
    return runner, est, om.maybe_observe(runner, est_mode.estimator_of(runner), event_factory=events_factory(clock)), clock


def test_observe_records_the_estimator_on_refit_boundaries_without_a_sync(config, monkeypatch, tmp_path,
                                                                          reference_table_8192):
    """The first sampled step and the first after each refit carry the coefficients the step's drafts
    were ranked by; every other row reads null. A refit is stood in for as vLLM's step() does it."""
    runner, est, obs, clock = observed_engine(config, reference_table_8192, monkeypatch, tmp_path, every=2)
    refit_at = {5: (0.6, 1.0), 6: (0.7, 2.0), 15: (0.8, 3.0)}  # two refits between two sampled steps at 5-6
    for n in range(1, 21):
        if n in refit_at:  # vLLM's step(): a refit every REFIT_INTERVAL steps, counted on the host
            slope, base = refit_at[n]
            est.slope.fill_(slope)
            est.intercepts.copy_(torch.tensor([base - 0.25 * i for i in range(7)]))
            est._refits += 1
        est._steps_since_refit = n  # not vLLM's count (a stand-in): recorded as read
        step(runner, n)
    runner.shutdown()
    rows = read_observed([obs.directory])
    assert clock.syncs == 0
    read = rows["estimator_refits"] != ABSENT
    assert list(rows["step"][read]) == [2, 6, 16]
    assert list(rows["estimator_refits"][read]) == [0, 2, 3]
    assert list(rows["estimator_steps"][read]) == [2, 2 * 100 + 6, 3 * 100 + 16]
    np.testing.assert_allclose(rows["estimator_slope"][read], [_INIT_SLOPE, 0.7, 0.8])
    np.testing.assert_allclose(rows["estimator_intercepts"][read][:, 0], [_INIT_BIAS, 2.0, 3.0])
    assert np.isnan(rows["estimator_slope"][~read]).all()
    assert rows.metadata[0].raw["estimator_keys"] == est_mode.seed_keys(config)
    om.detach(runner)


def test_observe_files_make_a_seed_that_starts_the_next_engine(config, hooked, monkeypatch, tmp_path,
                                                              reference_table_8192):
    """observe -> `dspark-calib seed` -> DSPARK_CALIB_ESTIMATOR_SEED: the restarted engine's estimator
    starts where the observed one was."""
    runner, est, _, _ = observed_engine(config, reference_table_8192, monkeypatch, tmp_path, every=1)
    for n in range(1, 5):
        if n == 3:
            est.slope.fill_(1.25)
            est.intercepts.copy_(torch.linspace(3.0, -1.0, 7))
            est._refits += 1
        step(runner, n)
    runner.shutdown()
    om.detach(runner)
    out = tmp_path / "seed.json"
    r = CliRunner().invoke(app, ["seed", str(tmp_path / "obs"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    monkeypatch.delenv("DSPARK_CALIB_OBSERVE")
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", str(out))
    restarted = hooked.GPUModelRunner(config, build_speculator(config))
    restarted.initialize_kv_cache("real")
    slope, intercepts = coefficients(restarted.speculator.acceptance_estimator)
    assert slope == 1.25 and intercepts == pytest.approx(tuple(torch.linspace(3.0, -1.0, 7).tolist()))


def test_an_engine_start_reads_the_estimator_once_for_its_seed_and_observe(config, monkeypatch, tmp_path,
                                                                           reference_table_8192):
    """Seed and observe both on: the hook reads the estimator once (estimator_of: its shape check,
    and the one line when it refuses) and both use that reading; the observed rows show the seed."""
    path, seed = a_seed(config, tmp_path)
    monkeypatch.setenv("DSPARK_CALIB_ESTIMATOR_SEED", path)
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE", str(tmp_path / "obs"))
    monkeypatch.setenv("DSPARK_CALIB_OBSERVE_EVERY", "1")
    clock, tables = Clock(), reference_table_8192.dense_tables(8192)

    class Engine(FakeRunner):
        def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
            pass

    reads, read = [], est_mode.estimator_of
    monkeypatch.setattr(est_mode, "estimator_of", lambda runner: reads.append(runner) or read(runner))
    observe = om.maybe_observe
    monkeypatch.setattr(om, "maybe_observe", lambda runner, *a: observe(runner, *a, event_factory=events_factory(clock)))
    module = SimpleNamespace(GPUModelRunner=Engine)
    om.hook_runner(module)
    runner = Engine(make_manager(tables), clock)
    runner.vllm_config = config
    est = runner.speculator.acceptance_estimator = build_speculator(config).acceptance_estimator
    try:
        runner.initialize_kv_cache("real")
        assert reads == [runner]
        assert om.observer_of(runner).estimator is est and coefficients(est) == (0.75, pytest.approx(seed.intercepts))
        step(runner, 4)
        runner.shutdown()
        assert read_observed([tmp_path / "obs"])["estimator_slope"].tolist() == [0.75]
    finally:
        om.unhook_runner(module)
        om.detach(runner)

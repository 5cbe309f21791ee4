"""Which vLLM the plugin patches: the installed 0.33.0 and synthetic modules that
mimic 0.28, 0.29-0.32 and vLLM main. What is checked is what matters: the
profile_only guard in capture_model (read through the syntax tree)."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
from packaging.specifiers import SpecifierSet

import vllm
import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from vllm.v1.worker.gpu import async_utils, model_runner

from dspark_calib.vllm import shape
from tests.helpers import REPO

ROOT = str(REPO)


def test_installed_vllm_is_supported_and_tested():
    result = shape.detect()
    assert result.supported and result.tested, result.reason
    assert result.vllm_version == vllm.__version__
    assert shape.profile_only_guard(model_runner.GPUModelRunner) == ""


def test_pyproject_claims_exactly_the_supported_range():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    extra = re.search(r'^vllm = \["vllm([^"]*)"\]', text, re.M)
    assert extra and SpecifierSet(extra[1]) == SpecifierSet(shape.SUPPORTED_VLLM)
    assert vllm.__version__ in SpecifierSet(shape.SUPPORTED_VLLM)
    for other in ("0.28.0", "0.29.0", "0.32.0", "0.34.0"):
        assert other not in SpecifierSet(shape.SUPPORTED_VLLM)


@pytest.mark.parametrize("version,tested", [("0.33.0", True), ("0.33.1", True), ("0.32.0", False),
                                            ("0.34.0.dev1", False), ("", False)])
def test_tested_versions(version, tested):
    assert shape.ApiShape(shape.SHAPE_V1, "", version).tested is tested


# -- synthetic runners: capture_model as each vLLM release writes it ------------------------
class Runner032:
    """0.29-0.32: the adaptive profile runs in the memory-estimation pass too."""

    def capture_model(self, *, profile_only: bool = False) -> int:
        if self.speculator is not None:
            self.speculator.capture()
        if self.adaptive_verification is not None:
            with self.step_timing.collect() as timings:
                for batch in self.adaptive_verification.batches_to_profile(
                        self.cudagraph_manager.captured_token_counts()):
                    self._dummy_run(**batch)
            self.adaptive_verification.set_initial_cost_curves(timings)
        return 0


class Runner033Reformatted:
    def capture_model(self, *, profile_only=False):
        with self.freeze():
            if (
                not profile_only
                and self.adaptive_verification
                is not None
            ):
                with self.step_timing.collect() as timings:
                    for batch in self.adaptive_verification.batches_to_profile(self.sizes()):
                        self._dummy_run(**batch)
                self.adaptive_verification.set_initial_cost_curves(timings)
        return 0


class RunnerEarlyExit:
    def capture_model(self, *, profile_only=False):
        self.cudagraph_manager.capture()
        if profile_only:
            return 0
        timings = [self._dummy_run(**b) for b in self.adaptive_verification.batches_to_profile([])]
        return len(timings)


class RunnerNestedGuard:
    def capture_model(self, *, profile_only=False):
        if not profile_only:
            if self.adaptive_verification is not None:
                for batch in self.adaptive_verification.batches_to_profile([]):
                    self._dummy_run(**batch)
        return 0


class RunnerGuardedOnlyOnce:
    """One guarded call and one unguarded: refused (any profile in the estimation pass is one too many)."""

    def capture_model(self, *, profile_only=False):
        if self.adaptive_verification is not None and not profile_only:
            list(self.adaptive_verification.batches_to_profile([]))
        try:
            list(self.adaptive_verification.batches_to_profile([]))
        finally:
            pass
        return 0


class RunnerNoProfile:
    def capture_model(self, *, profile_only=False):
        return 0


class RunnerNoFlag:
    def capture_model(self):
        list(self.adaptive_verification.batches_to_profile([]))


def runner_module(runner, factory=model_runner.maybe_create_adaptive_verification_manager):
    return SimpleNamespace(GPUModelRunner=runner, maybe_create_adaptive_verification_manager=factory)


@pytest.mark.parametrize("runner", [Runner033Reformatted, RunnerEarlyExit, RunnerNestedGuard])
def test_guard_is_found_whatever_the_formatting(runner):
    assert shape.detect(model_runner=runner_module(runner)).supported


@pytest.mark.parametrize("runner,why", [
    (Runner032, "memory-estimation pass"),
    (RunnerGuardedOnlyOnce, "memory-estimation pass"),
    (RunnerNoProfile, "does not call batches_to_profile"),
    (RunnerNoFlag, "no profile_only parameter"),
    (None, "capture_model not found"),
])
def test_unguarded_or_moved_profile_is_refused(runner, why):
    result = shape.detect(model_runner=runner_module(runner))
    assert not result.supported and why in result.reason


def test_vllm_029_to_032_is_refused_naming_the_pass():
    result = shape.detect(model_runner=runner_module(Runner032))
    assert not result.supported and "0.29-0.32" in result.reason and "profile_only" in result.reason


def test_vllm_028_factory_without_vllm_config_is_refused():
    def factory_028(*, enable_adaptive_verification, attn_groups, req_states, query_start_loc, num_bonus_tokens,
                    max_total_logits):
        return None

    result = shape.detect(model_runner=runner_module(Runner032, factory_028))
    assert not result.supported and "vllm_config" in result.reason and "0.28" in result.reason


def test_vllm_main_streaming_shape_is_refused():
    class MainManager(av.AdaptiveVerificationManager):
        def consume_step_timing(self, sample):
            pass

        def set_initial_cost_curves(self):
            pass

    fake_av = SimpleNamespace(AdaptiveVerificationManager=MainManager,
                              build_cost_tables_from_curves=av.build_cost_tables_from_curves)
    result = shape.detect(av=fake_av, model_runner=model_runner)
    assert not result.supported and "consume_step_timing" in result.reason
    del MainManager.consume_step_timing
    result = shape.detect(av=fake_av, model_runner=model_runner)
    assert not result.supported and "set_initial_cost_curves" in result.reason


def test_changed_sample_fields_are_refused():
    from dataclasses import make_dataclass

    sample = make_dataclass("StepTimingSample", ["forward_ms", "drafter_ms", "num_target_tokens", "num_reqs",
                                                 "full_cudagraph", "timing_enabled"])
    result = shape.detect(async_utils=SimpleNamespace(StepTimingSample=sample))
    assert not result.supported and "StepTimingSample" in result.reason
    assert shape.detect(async_utils=async_utils).supported

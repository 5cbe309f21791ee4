"""Which vLLM the plugin patches: the installed 0.33.0 and synthetic modules that
mimic 0.28, 0.29-0.32 and vLLM main. What is checked is what matters: the
profile_only guard in capture_model (read through the syntax tree)."""

from __future__ import annotations

import logging
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
    """A model_runner module whose GPUModelRunner has this capture_model (the rest is vLLM's)."""
    cls = type(runner.__name__, (runner, model_runner.GPUModelRunner), {}) if runner is not None else None
    return SimpleNamespace(GPUModelRunner=cls, maybe_create_adaptive_verification_manager=factory)


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


# -- versions: a nightly or a release candidate is untested ----------------------------------
@pytest.mark.parametrize("version,tested", [("0.33.1.dev5", False), ("0.33.1.dev5+g1234abc", False),
                                            ("0.33.0rc1", False), ("0.33.0a1", False), ("0.33.0.post1", True),
                                            ("0.33.0+cu129", True), ("0.33", True), ("garbage", False)])
def test_dev_and_rc_builds_are_untested(version, tested):
    assert shape.ApiShape(shape.SHAPE_V1, "", version).tested is tested
    if not tested and version != "garbage":
        assert "development or pre-release" in shape.untested_why(version)


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin's patch on the installed vLLM, undone after; every log line said again."""
    from dspark_calib.vllm import plugin, runtime

    for key in list(os.environ):
        if key.startswith("DSPARK_CALIB_"):
            monkeypatch.delenv(key)
    runtime.new_engine()
    yield plugin
    plugin.unpatch(av.AdaptiveVerificationManager, model_runner)
    runtime.new_engine()


def plugin_lines(caplog):
    return [r for r in caplog.records if r.name == "vllm.dspark_calib"]


def test_a_nightly_is_patched_with_one_warning(monkeypatch, caplog, fresh_plugin):
    monkeypatch.setattr(vllm, "__version__", "0.33.1.dev5")
    monkeypatch.setenv("DSPARK_CALIB_TABLE", "/tables")  # asked for work: the warning is said
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        fresh_plugin._patch_installed_vllm()
    lines = plugin_lines(caplog)
    assert fresh_plugin.is_patched(av.AdaptiveVerificationManager)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "0.33.1.dev5 is a development or pre-release build" in lines[0].getMessage()
    assert "strict refuses" in lines[0].getMessage()


@pytest.mark.parametrize("version", ["0.33.1.dev5", "0.33.0rc1", "0.34.0"])
def test_strict_refuses_to_load_a_table_on_an_untested_vllm(monkeypatch, tmp_path, version):
    """Even a table profiled on that very build (vllm_version equal): strict loads only on a tested release."""
    from dspark_calib.table.file import write_table
    from dspark_calib.vllm import load
    from tests.helpers import build_reference_table

    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setenv("DSPARK_CALIB_TABLE", write_table(build_reference_table(vllm_version=version), tmp_path))
    monkeypatch.setenv("DSPARK_CALIB_ALLOW_REFERENCE", "1")
    monkeypatch.setenv("DSPARK_CALIB_POLICY", "strict")
    d = load.decision_from_env(SimpleNamespace(), [])
    assert not d.load and f"vLLM {version} is" in d.refuse and "refusing to start (policy strict)" in d.refuse
    monkeypatch.setenv("DSPARK_CALIB_POLICY", "fallback")
    assert load.decision_from_env(SimpleNamespace(), []).load  # the other policies load it (the patch warned)


# -- the exact surface the modes call ---------------------------------------------------------
def _with_extra_keyword(func):
    def changed(self, *args, extra=None, **kwargs):
        return func(self, *args, **kwargs)

    import inspect

    params = list(inspect.signature(func).parameters.values())
    changed.__signature__ = inspect.Signature(params + [inspect.Parameter("extra", inspect.Parameter.KEYWORD_ONLY,
                                                                          default=None)])
    return changed


MODULES = {"adaptive_verification": av, "async_utils": async_utils, "model_runner": model_runner}


def installed_modules():
    from vllm.v1.worker.gpu import states
    from vllm.v1.worker.gpu.spec_decode import speculator

    return {**MODULES, "states": states, "speculator": speculator}


def test_the_installed_vllm_has_the_exact_surface():
    assert shape.surface_problem(installed_modules()) == ""


@pytest.mark.parametrize("mod,cls,name,params", shape.METHODS, ids=lambda v: v if isinstance(v, str) else None)
def test_a_changed_signature_of_any_method_we_call_is_refused(monkeypatch, mod, cls, name, params):
    owner = getattr(installed_modules()[mod], cls)
    monkeypatch.setattr(owner, name, _with_extra_keyword(getattr(owner, name)))
    why = shape.surface_problem(installed_modules())
    assert f"{cls}.{name}" in why and "extra" in why


@pytest.mark.parametrize("mod,cls,name,params", [k for k in shape.KEYWORDS if k[3]],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_a_lost_keyword_of_a_method_we_wrap_is_refused(monkeypatch, mod, cls, name, params):
    owner = getattr(installed_modules()[mod], cls)

    def without(self, *args, **kwargs):
        pass

    monkeypatch.setattr(owner, name, without)
    assert f"{cls}.{name} has no parameter {params[0]}" in shape.surface_problem(installed_modules())


@pytest.mark.parametrize("mod,cls,names", shape.ATTRIBUTES, ids=lambda v: v if isinstance(v, str) else None)
def test_an_attribute_vllm_no_longer_sets_is_refused(mod, cls, names):
    real = getattr(installed_modules()[mod], cls)

    class Renamed(real):  # vLLM's methods, but its source sets none of our attributes
        def __init__(self):
            self.something_else = 0

    modules = {**installed_modules(), mod: SimpleNamespace(**{**vars(installed_modules()[mod]), cls: Renamed})}
    assert f"{cls} no longer sets {names[0]}" in shape.surface_problem(modules)


def test_every_vllm_attribute_the_modes_touch_is_in_the_checked_surface():
    """Collected from the code: each attribute the wing reads or calls on vLLM's manager, request
    state and step collector (by the names the modules give them) is one the shape check covers."""
    import ast

    owners = {"manager": "AdaptiveVerificationManager", "req_states": "RequestState", "rs": "RequestState",
              "collector": "StepTimingCollector"}
    covered = {(cls, name) for _, cls, name, _ in shape.METHODS}
    covered |= {(cls, n) for _, cls, names in shape.ATTRIBUTES for n in names}
    covered |= {("AdaptiveVerificationManager", n) for n in ("batches_to_profile", "set_initial_cost_curves",
                                                            "set_cost_curves", "__dict__")}
    found = set()
    for module in ("context_aware", "observer", "step_capture", "load", "probe", "engine_info"):
        tree = ast.parse((REPO / "dspark_calib" / "vllm" / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in owners:
                found.add((owners[value.id], node.attr, module))
            elif isinstance(value, ast.Attribute) and value.attr == "req_states":
                found.add(("RequestState", node.attr, module))
    assert len(found) > 20
    assert {f for f in found if f[:2] not in covered} == set()


def test_a_changed_get_num_tokens_leaves_vllm_untouched_with_one_line(monkeypatch, caplog, fresh_plugin):
    """A keyword added to get_num_tokens would make the context-aware wrapper raise TypeError on
    every speculative step: the plugin must not patch such a vLLM at all."""
    monkeypatch.setattr(av.AdaptiveVerificationManager, "get_num_tokens",
                        _with_extra_keyword(av.AdaptiveVerificationManager.get_num_tokens))
    monkeypatch.setenv("DSPARK_CALIB_TABLE", "/tables")  # asked for work: the line is said
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        fresh_plugin._patch_installed_vllm()
    lines = plugin_lines(caplog)
    assert not fresh_plugin.is_patched(av.AdaptiveVerificationManager)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "get_num_tokens" in lines[0].getMessage() and "leaving vLLM untouched" in lines[0].getMessage()

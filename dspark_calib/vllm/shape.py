"""Which shape of vLLM's profiling API is installed, and whether we may patch it.

dspark-calib wraps AdaptiveVerificationManager.batches_to_profile(capture_sizes) and
.set_initial_cost_curves(samples), calls .set_cost_curves(draft_curve, verify_curve),
reads StepTimingSample's fields, and wraps model_runner's
maybe_create_adaptive_verification_manager(..., vllm_config) (to hand the manager the
engine config). Supported: exactly what is tested here, vLLM 0.33.

What is checked is what matters, not only signatures:

* 0.28 has the same profiling methods, but its factory takes no vllm_config;
* 0.29-0.32 run the adaptive profile inside the memory-estimation pass too
  (capture_model(profile_only=True), 2 graphs captured), so a table would be
  checked against the wrong capture sizes and a capture would run twice: the
  profile must be guarded by ``not profile_only`` (read from capture_model's
  source through its syntax tree, so formatting does not matter);
* vLLM main pushes samples one at a time (consume_step_timing) and calls
  set_initial_cost_curves() without an argument.

On any shape we do not know we leave vLLM untouched.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from types import ModuleType
from typing import Any

SUPPORTED_VLLM = ">=0.33,<0.34"
TESTED_MINOR = (0, 33)
SHAPE_V1 = "v1"


@dataclass(frozen=True)
class ApiShape:
    name: str | None  # SHAPE_V1, or None when unsupported
    reason: str = ""  # why unsupported
    vllm_version: str = ""

    @property
    def supported(self) -> bool:
        return self.name is not None

    @property
    def tested(self) -> bool:
        """The version is one this release was tested against (SUPPORTED_VLLM)."""
        match = re.match(r"(\d+)\.(\d+)", self.vllm_version)
        return bool(match) and (int(match[1]), int(match[2])) == TESTED_MINOR


def _params(func: Any) -> list[str]:
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return []


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _excludes_profile_only(test: ast.AST) -> bool:
    """`not profile_only`, alone or as one term of an `and`."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _is_name(test.operand, "profile_only")
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_excludes_profile_only(v) for v in test.values)
    return False


def _includes_profile_only(test: ast.AST) -> bool:
    """`profile_only`, alone or as one term of an `or` (an early exit on it guards what follows)."""
    if _is_name(test, "profile_only"):
        return True
    return isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and any(
        _includes_profile_only(v) for v in test.values)


def _calls(node: Any, attr: str) -> int:
    nodes = node if isinstance(node, list) else [node]
    return sum(1 for n in nodes if isinstance(n, ast.AST) for sub in ast.walk(n)
               if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == attr)


def _profile_guards(stmts: list[ast.stmt], guarded: bool, out: list[bool]) -> None:
    """Append, per call to batches_to_profile, whether it is reached only when not profile_only."""
    for st in stmts:
        if isinstance(st, ast.If):
            out.extend([guarded] * _calls(st.test, "batches_to_profile"))
            _profile_guards(st.body, guarded or _excludes_profile_only(st.test), out)
            _profile_guards(st.orelse, guarded, out)
            if _includes_profile_only(st.test) and st.body and isinstance(st.body[-1], (ast.Return, ast.Raise)):
                guarded = True
            continue
        for field, value in ast.iter_fields(st):
            if field in ("body", "orelse", "finalbody") and isinstance(value, list):
                _profile_guards(value, guarded, out)
            elif field == "handlers":
                for handler in value:
                    _profile_guards(handler.body, guarded, out)
            else:
                out.extend([guarded] * _calls(value, "batches_to_profile"))


def profile_only_guard(runner_cls: Any) -> str:
    """'' when capture_model runs the adaptive profile only outside the memory-estimation
    pass (vLLM 0.33's `... and not profile_only`); otherwise why not."""
    fn = getattr(runner_cls, "capture_model", None)
    if fn is None:
        return "GPUModelRunner.capture_model not found"
    if "profile_only" not in _params(fn):
        return "GPUModelRunner.capture_model has no profile_only parameter"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as exc:
        return f"GPUModelRunner.capture_model's source is not readable ({type(exc).__name__})"
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    guards: list[bool] = []
    _profile_guards(func.body if func else [], False, guards)
    if not guards:
        return "GPUModelRunner.capture_model does not call batches_to_profile (the profile moved)"
    if not all(guards):
        return ("GPUModelRunner.capture_model runs the adaptive profile in the memory-estimation pass too "
                "(no `not profile_only` guard, as in vLLM 0.29-0.32)")
    return ""


def detect(av: ModuleType | None = None, model_runner: ModuleType | None = None,
           async_utils: ModuleType | None = None) -> ApiShape:
    """Inspect the installed (or given) vLLM modules; never raises."""
    version = ""
    try:
        import vllm

        version = getattr(vllm, "__version__", "")
        if av is None:
            from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av  # noqa: F811
        if async_utils is None:
            from vllm.v1.worker.gpu import async_utils  # noqa: F811
        if model_runner is None:
            from vllm.v1.worker.gpu import model_runner  # noqa: F811
        from dspark_calib.samples import VLLM_SAMPLE_FIELDS
    except Exception as exc:  # noqa: BLE001 - any import failure means: not a shape we can patch
        return ApiShape(None, f"vLLM's adaptive verification modules do not import ({type(exc).__name__}: {exc})",
                        version)

    manager = getattr(av, "AdaptiveVerificationManager", None)
    if manager is None:
        return ApiShape(None, "no AdaptiveVerificationManager", version)
    if hasattr(manager, "consume_step_timing"):
        return ApiShape(None, "AdaptiveVerificationManager.consume_step_timing exists (newer streaming profile API)",
                        version)
    expected = {
        "batches_to_profile": ["self", "capture_sizes"],
        "set_initial_cost_curves": ["self", "samples"],
        "set_cost_curves": ["self", "draft_curve", "verify_curve"],
    }
    for name, params in expected.items():
        have = _params(getattr(manager, name, None))
        if have != params:
            return ApiShape(None, f"AdaptiveVerificationManager.{name}{tuple(have)} is not {name}{tuple(params)}",
                            version)
    if not callable(getattr(av, "build_cost_tables_from_curves", None)):
        return ApiShape(None, "no build_cost_tables_from_curves", version)
    sample_cls = getattr(async_utils, "StepTimingSample", None)
    fields = tuple(getattr(sample_cls, "__dataclass_fields__", {}) or ())
    if fields != VLLM_SAMPLE_FIELDS:
        return ApiShape(None, f"StepTimingSample fields are {fields}, expected {VLLM_SAMPLE_FIELDS}", version)
    factory = getattr(model_runner, "maybe_create_adaptive_verification_manager", None)
    if "vllm_config" not in _params(factory):
        return ApiShape(None, "model_runner.maybe_create_adaptive_verification_manager has no vllm_config "
                              "(as in vLLM 0.28)", version)
    why = profile_only_guard(getattr(model_runner, "GPUModelRunner", None))
    if why:
        return ApiShape(None, why, version)
    return ApiShape(SHAPE_V1, "", version)


# -- observe mode's call points (checked per runner instance, at engine start) ----------------
OBSERVE_EVENT_FIELDS = ("forward_start", "forward_end", "drafter_start", "drafter_end")


def observe_problem(runner: Any, async_utils: ModuleType | None = None) -> str:
    """'' when this runner has every call point observe mode wraps (vLLM 0.33's); else why not.

    Serving steps call the collector's record_batch and forward_start (in execute_model) but
    never its forward_end/drafter_* (those run in _dummy_run only), so observe ends the
    forward when execute_model returns and times the drafter around speculator.propose.
    """
    try:
        if async_utils is None:
            from vllm.v1.worker.gpu import async_utils  # noqa: F811
    except Exception as exc:  # noqa: BLE001
        return f"vLLM's async_utils does not import ({type(exc).__name__})"
    events = getattr(async_utils, "StepTimingEvents", None)
    if tuple(getattr(events, "__dataclass_fields__", {}) or ()) != OBSERVE_EVENT_FIELDS:
        return f"StepTimingEvents does not have the fields {OBSERVE_EVENT_FIELDS}"
    collector = getattr(runner, "step_timing", None)
    if _params(getattr(collector, "record_batch", None)) != ["input_batch", "full_cudagraph"]:
        return "the runner's step_timing.record_batch(input_batch, full_cudagraph) is missing"
    if _params(getattr(collector, "forward_start", None)) != []:
        return "the runner's step_timing.forward_start() is missing"
    if "dummy_run" not in _params(getattr(runner, "execute_model", None)):
        return "the runner's execute_model has no dummy_run parameter"
    if "dummy_run" not in _params(getattr(getattr(runner, "speculator", None), "propose", None)):
        return "the runner has no speculator.propose(..., dummy_run=) (no drafter to time)"
    manager = getattr(runner, "adaptive_verification", None)
    if not callable(getattr(manager, "get_num_tokens", None)) or not hasattr(manager, "req_states"):
        return "the runner's adaptive_verification manager has no get_num_tokens/req_states"
    return ""

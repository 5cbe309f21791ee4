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
  set_initial_cost_curves() without an argument;
* the load, context-aware and observe modes call more of vLLM than the profiling API
  (get_num_tokens, the request state's add/remove_request and fields, the step
  collector, the runner's execute_model and the speculator's propose): METHODS,
  KEYWORDS and ATTRIBUTES list that surface exactly, since a parameter added to
  get_num_tokens would make the context-aware wrapper raise on every speculative step.

On any shape we do not know we leave vLLM untouched. A version that is not a tested
release (a nightly 0.33.1.devN, an rc) is untested even with the tested shape
(untested_why): patched with a WARNING, and strict loads no table on it.
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
        return not untested_why(self.vllm_version)


# A release (a post-release and a local build label too); dev, alpha, beta and rc builds are not.
_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.\d+)*(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?")


def untested_why(version: str) -> str:
    """'' for a release of the tested minor; otherwise why the version is untested: a nightly
    (0.33.1.dev5) or a release candidate carries changes no release of 0.33 was tested with."""
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return f"vLLM {version or '(no version)'} is a development or pre-release build, not a tested release"
    if (int(match[1]), int(match[2])) != TESTED_MINOR:
        return f"vLLM {version} is outside the tested range vllm{SUPPORTED_VLLM}"
    return ""


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
           async_utils: ModuleType | None = None, states: ModuleType | None = None,
           speculator: ModuleType | None = None) -> ApiShape:
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
    try:
        if states is None:
            from vllm.v1.worker.gpu import states
        if speculator is None:
            from vllm.v1.worker.gpu.spec_decode import speculator
    except Exception as exc:  # noqa: BLE001
        return ApiShape(None, f"vLLM's request state or speculator module does not import ({type(exc).__name__})",
                        version)
    why = surface_problem({"adaptive_verification": av, "async_utils": async_utils, "model_runner": model_runner,
                           "states": states, "speculator": speculator})
    if why:
        return ApiShape(None, why, version)
    return ApiShape(SHAPE_V1, "", version)


# -- the exact surface the modes call -------------------------------------------------------
# (module, class, method, its parameters exactly): every vLLM method the load, context-aware and
# observe modes call or wrap. A parameter added or renamed breaks the call (the context-aware
# wrapper of get_num_tokens takes exactly vLLM's two: an added keyword would be a TypeError on
# every speculative step), so any difference leaves vLLM untouched.
METHODS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("adaptive_verification", "AdaptiveVerificationManager", "get_num_tokens",
     ("self", "num_tokens_per_req", "draft_tokens")),
    ("states", "RequestState", "add_request",
     ("self", "req_id", "prompt_len", "all_token_ids", "num_computed_tokens", "max_tokens")),
    ("states", "RequestState", "remove_request", ("self", "req_id")),
    ("async_utils", "StepTimingCollector", "collect", ("self",)),
    ("async_utils", "StepTimingCollector", "record_batch", ("self", "input_batch", "full_cudagraph")),
    ("async_utils", "StepTimingCollector", "forward_start", ("self",)),
    ("async_utils", "StepTimingCollector", "forward_end", ("self",)),
    ("async_utils", "StepTimingCollector", "drafter_start", ("self",)),
    ("async_utils", "StepTimingCollector", "drafter_end", ("self",)),
)
# (module, class, method, parameters it must have): methods observe mode wraps with *args and
# **kwargs, reading only these by name.
KEYWORDS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("model_runner", "GPUModelRunner", "execute_model", ("dummy_run",)),
    ("model_runner", "GPUModelRunner", "initialize_kv_cache", ("kv_cache_config", "is_profiling")),
    ("model_runner", "GPUModelRunner", "shutdown", ()),
    ("speculator", "BaseSpeculator", "propose", ("dummy_run", "num_sampled", "num_rejected")),
)
# (module, class, attributes): what the modes read or set on vLLM's objects, found as
# ``self.NAME = ...`` in the class's source (instance attributes exist only once built).
ATTRIBUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("adaptive_verification", "AdaptiveVerificationManager",
     ("req_states", "num_speculative_steps", "num_bonus_tokens", "_max_total_logits", "cost_tables",
      "_cudagraph_limit", "_batch_budget", "_stale_confidences", "_stale_idx")),
    ("states", "RequestState",
     ("max_num_reqs", "max_num_batched_tokens", "num_speculative_steps", "req_id_to_index",
      "num_computed_tokens_np", "prefill_len")),
    ("async_utils", "StepTimingCollector", ("_timed",)),
)  # the runner's step_timing, speculator and manager: observe_problem, on the built runner


def assigned_attributes(cls: Any) -> set[str]:
    """Names assigned as ``self.NAME`` anywhere in the class's own source (empty when unreadable)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and _is_name(sub.value, "self"):
                    out.add(sub.attr)
    return out


def surface_problem(modules: dict[str, Any]) -> str:
    """'' when every method and attribute the modes use is there, with the exact parameters;
    otherwise the first difference, named."""
    for mod, cls_name, name, params in METHODS:
        cls = getattr(modules[mod], cls_name, None)
        have = tuple(_params(getattr(cls, name, None)))
        if have != params:
            return f"{cls_name}.{name}{have} is not {name}{params}"
    for mod, cls_name, name, params in KEYWORDS:
        method = getattr(getattr(modules[mod], cls_name, None), name, None)
        missing = [p for p in params if p not in _params(method)]
        if not callable(method) or missing:
            return f"{cls_name}.{name} has no parameter {missing[0]}" if callable(method) and missing \
                else f"{cls_name}.{name} not found"
    events = getattr(modules["async_utils"], "StepTimingEvents", None)
    if tuple(getattr(events, "__dataclass_fields__", {}) or ()) != OBSERVE_EVENT_FIELDS:
        return f"StepTimingEvents does not have the fields {OBSERVE_EVENT_FIELDS}"
    for mod, cls_name, names in ATTRIBUTES:
        cls = getattr(modules[mod], cls_name, None)
        have = assigned_attributes(cls) if cls is not None else set()
        missing = [n for n in names if n not in have]
        if missing:
            return f"{cls_name} no longer sets {', '.join(missing[:3])}"
    return ""


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
    propose = _params(getattr(getattr(runner, "speculator", None), "propose", None))
    if "dummy_run" not in propose:
        return "the runner has no speculator.propose(..., dummy_run=) (no drafter to time)"
    if "num_sampled" not in propose or "num_rejected" not in propose:
        return "the runner's speculator.propose takes no num_sampled/num_rejected (no acceptance to record)"
    manager = getattr(runner, "adaptive_verification", None)
    if not callable(getattr(manager, "get_num_tokens", None)) or not hasattr(manager, "req_states"):
        return "the runner's adaptive_verification manager has no get_num_tokens/req_states"
    return ""

"""Which shape of vLLM's profiling API is installed.

dspark-calib wraps AdaptiveVerificationManager.batches_to_profile(capture_sizes) and
.set_initial_cost_curves(samples), calls .set_cost_curves(draft_curve, verify_curve),
reads StepTimingSample's fields, and wraps model_runner's
maybe_create_adaptive_verification_manager (to hand the manager the engine config).
vLLM 0.28.0 .. 0.33.0 share that shape ("v1"). vLLM main already changed it (samples
pushed one at a time through consume_step_timing, set_initial_cost_curves() without
an argument); on any shape we do not know we must leave vLLM untouched.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any

SUPPORTED_VLLM = ">=0.28.0,<0.34"
SHAPE_V1 = "v1"
from dspark_calib.samples import VLLM_SAMPLE_FIELDS as STEP_TIMING_FIELDS


@dataclass(frozen=True)
class ApiShape:
    name: str | None  # SHAPE_V1, or None when unsupported
    reason: str = ""  # why unsupported
    vllm_version: str = ""

    @property
    def supported(self) -> bool:
        return self.name is not None


def _params(func: Any) -> list[str]:
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return []


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
    except Exception as exc:  # noqa: BLE001 - any import failure means: not a shape we can patch
        return ApiShape(None, f"vLLM's adaptive verification modules do not import ({type(exc).__name__}: {exc})", version)

    manager = getattr(av, "AdaptiveVerificationManager", None)
    if manager is None:
        return ApiShape(None, "no AdaptiveVerificationManager", version)
    if hasattr(manager, "consume_step_timing"):
        return ApiShape(None, "AdaptiveVerificationManager.consume_step_timing exists (newer streaming profile API)", version)
    expected = {
        "batches_to_profile": ["self", "capture_sizes"],
        "set_initial_cost_curves": ["self", "samples"],
        "set_cost_curves": ["self", "draft_curve", "verify_curve"],
    }
    for name, params in expected.items():
        have = _params(getattr(manager, name, None))
        if have != params:
            return ApiShape(None, f"AdaptiveVerificationManager.{name}{tuple(have)} is not {name}{tuple(params)}", version)
    if not callable(getattr(av, "build_cost_tables_from_curves", None)):
        return ApiShape(None, "no build_cost_tables_from_curves", version)
    sample_cls = getattr(async_utils, "StepTimingSample", None)
    fields = tuple(getattr(sample_cls, "__dataclass_fields__", {}) or ())
    if fields != STEP_TIMING_FIELDS:
        return ApiShape(None, f"StepTimingSample fields are {fields}, expected {STEP_TIMING_FIELDS}", version)
    factory = getattr(model_runner, "maybe_create_adaptive_verification_manager", None)
    if "vllm_config" not in _params(factory):
        return ApiShape(None, "model_runner.maybe_create_adaptive_verification_manager(..., vllm_config) not found", version)
    return ApiShape(SHAPE_V1, "", version)

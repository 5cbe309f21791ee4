"""The vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``register`` in the engine process and in every worker, possibly
several times per process, so it is idempotent. It does nothing unless one of
its env vars is set:

* DSPARK_CALIB_CAPTURE=DIR: capture mode (used by `dspark-calib profile`), see capture.py;
* DSPARK_CALIB_TABLE=PATH: load mode (serve time), see loader.py.

It patches vLLM's AdaptiveVerificationManager.batches_to_profile and
.set_initial_cost_curves, and GPUModelRunner.capture_model (only to hand the
manager the engine's config). On an API shape it does not know, it logs one
line and leaves vLLM untouched.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from dspark_calib.vllm.capture import ENV_CAPTURE, CaptureMode
from dspark_calib.vllm.loader import ENV_TABLE, LoadMode

log = logging.getLogger("vllm.dspark_calib")
_MARK = "_dspark_calib_original"


def active_mode() -> CaptureMode | LoadMode | None:
    """Chosen at each engine start from the env, so one process can serve both."""
    if os.environ.get(ENV_CAPTURE):
        return CaptureMode(os.environ[ENV_CAPTURE])  # profiling never loads a table
    if os.environ.get(ENV_TABLE):
        return LoadMode()
    return None


def register() -> None:
    if not (os.environ.get(ENV_CAPTURE) or os.environ.get(ENV_TABLE)):
        return
    from dspark_calib.vllm.shape import detect

    shape = detect()
    if not shape.supported:
        if not getattr(register, "_warned", False):
            register._warned = True  # type: ignore[attr-defined]
            log.warning("dspark-calib: vLLM %s has an adaptive-verification API this version does not know "
                        "(%s); leaving vLLM untouched, it profiles at start-up as usual", shape.vllm_version, shape.reason)
        return
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

    patch(av.AdaptiveVerificationManager, model_runner.GPUModelRunner)
    _record_refusals(model_runner)


def _record_refusals(model_runner: Any) -> None:
    """Capture mode: keep vLLM's reason when it refuses adaptive verification.

    The refusal is raised in a worker; with tensor parallelism the `profile`
    command only sees "worker failed", so the reason also goes to DIR/refusal.txt.
    """
    orig = model_runner.maybe_create_adaptive_verification_manager
    if hasattr(orig, _MARK) or not os.environ.get(ENV_CAPTURE):
        return

    @functools.wraps(orig)
    def maybe_create(*args: Any, **kwargs: Any) -> Any:
        try:
            return orig(*args, **kwargs)
        except ValueError as exc:
            from dspark_calib.atomic import atomic_write

            directory = os.environ.get(ENV_CAPTURE)
            if directory and os.path.isdir(directory):
                atomic_write(os.path.join(directory, "refusal.txt"), lambda fh: fh.write(str(exc).encode()))
            raise

    setattr(maybe_create, _MARK, orig)
    model_runner.maybe_create_adaptive_verification_manager = maybe_create


def is_patched(manager_cls: Any) -> bool:
    return hasattr(manager_cls.batches_to_profile, _MARK)


def patch(manager_cls: Any, runner_cls: Any | None = None) -> None:
    """Wrap the profiling methods once; a second call is a no-op."""
    if is_patched(manager_cls):
        return
    orig_batches = manager_cls.batches_to_profile
    orig_init = manager_cls.set_initial_cost_curves

    @functools.wraps(orig_batches)
    def batches_to_profile(self: Any, capture_sizes: list[int]):
        mode = active_mode()
        # vLLM's own generator sets self._cudagraph_limit and gives its batch plan.
        vllm_batches = list(orig_batches(self, capture_sizes))
        self._dspark_mode = mode
        if mode is None:
            yield from vllm_batches
        else:
            yield from mode.batches(self, list(capture_sizes), vllm_batches)

    @functools.wraps(orig_init)
    def set_initial_cost_curves(self: Any, samples: list) -> None:
        mode = getattr(self, "_dspark_mode", None)
        if mode is None:
            orig_init(self, samples)
        else:
            mode.install_curves(self, samples, lambda s: orig_init(self, s))

    setattr(batches_to_profile, _MARK, orig_batches)
    setattr(set_initial_cost_curves, _MARK, orig_init)
    manager_cls.batches_to_profile = batches_to_profile
    manager_cls.set_initial_cost_curves = set_initial_cost_curves

    if runner_cls is not None and not hasattr(runner_cls.capture_model, _MARK):
        orig_capture = runner_cls.capture_model

        @functools.wraps(orig_capture)
        def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            manager = getattr(self, "adaptive_verification", None)
            if manager is not None:
                manager._dspark_vllm_config = getattr(self, "vllm_config", None)
            return orig_capture(self, *args, **kwargs)

        setattr(capture_model, _MARK, orig_capture)
        runner_cls.capture_model = capture_model


def unpatch(manager_cls: Any, runner_cls: Any | None = None) -> None:
    """Restore vLLM's methods (tests)."""
    for cls, names in ((manager_cls, ("batches_to_profile", "set_initial_cost_curves")),
                       (runner_cls, ("capture_model",))):
        if cls is None:
            continue
        for name in names:
            original = getattr(getattr(cls, name), _MARK, None)
            if original is not None:
                setattr(cls, name, original)

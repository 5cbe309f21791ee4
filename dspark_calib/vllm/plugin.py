"""The vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``register`` in the engine process and in every worker, possibly
several times per process, so it is idempotent. It does nothing unless one of
its env vars is set:

* DSPARK_CALIB_CAPTURE=DIR: capture mode (used by `dspark-calib profile`), see capture.py;
* DSPARK_CALIB_TABLE=PATH: load mode (serve time), see loader.py.

It patches vLLM's AdaptiveVerificationManager.batches_to_profile and
.set_initial_cost_curves, and wraps model_runner's
maybe_create_adaptive_verification_manager (to hand the manager the engine's
config). It patches when vLLM's model runner module is imported (processes that
never import it pay nothing). On an API shape it does not know, it logs one line
and leaves vLLM untouched.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Any

from dspark_calib.vllm.capture import ENV_CAPTURE, CaptureMode
from dspark_calib.vllm.loader import ENV_TABLE, LoadMode

log = logging.getLogger("vllm.dspark_calib")
_MARK = "_dspark_calib_original"


def active_mode() -> CaptureMode | LoadMode | None:
    """Chosen at each engine start from the env (once patched, a later start in the same
    process may switch modes; vLLM loads plugins once per process, so the patch itself
    only happens if one of the env vars was set at that first load)."""
    if os.environ.get(ENV_CAPTURE):
        return CaptureMode(os.environ[ENV_CAPTURE])  # profiling never loads a table
    if os.environ.get(ENV_TABLE):
        return LoadMode()
    return None


MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"


def register() -> None:
    if not (os.environ.get(ENV_CAPTURE) or os.environ.get(ENV_TABLE)):
        return
    if MODEL_RUNNER in sys.modules:
        _patch_installed_vllm()
    elif not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        # Processes that never build a model runner (the API server) must not pay for
        # importing it: patch when, and only if, the worker imports it.
        sys.meta_path.insert(0, _PatchAfterImport())


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs _patch_installed_vllm right after vLLM's model_runner module executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != MODEL_RUNNER:
            return None
        sys.meta_path.remove(self)  # once; also keeps the lookup below from finding us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenPatch(spec.loader)
        return spec


class _ThenPatch(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch_installed_vllm()


def _patch_installed_vllm() -> None:
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

    patch(av.AdaptiveVerificationManager, model_runner)


def is_patched(manager_cls: Any) -> bool:
    return hasattr(manager_cls.batches_to_profile, _MARK)


def patch(manager_cls: Any, model_runner: Any | None = None) -> None:
    """Wrap the profiling methods once; a second call is a no-op."""
    if not is_patched(manager_cls):
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
    if model_runner is not None:
        _wrap_factory(model_runner)


def _wrap_factory(model_runner: Any) -> None:
    """The runner builds its manager through this factory, which also gets the engine config:
    keep the config on the manager (engine_info needs it), and in capture mode keep vLLM's
    reason when it refuses adaptive verification (with TP the `profile` command would only
    see "worker failed"), in DIR/refusal.txt."""
    orig = getattr(model_runner, "maybe_create_adaptive_verification_manager", None)
    if orig is None or hasattr(orig, _MARK):
        return

    @functools.wraps(orig)
    def maybe_create(*args: Any, **kwargs: Any) -> Any:
        try:
            manager = orig(*args, **kwargs)
        except ValueError as exc:
            directory = os.environ.get(ENV_CAPTURE)
            if directory and os.path.isdir(directory):
                from dspark_calib.atomic import atomic_write

                atomic_write(os.path.join(directory, "refusal.txt"), lambda fh: fh.write(str(exc).encode()))
            raise
        if manager is not None:
            manager._dspark_vllm_config = kwargs.get("vllm_config")
        return manager

    setattr(maybe_create, _MARK, orig)
    model_runner.maybe_create_adaptive_verification_manager = maybe_create


def unpatch(manager_cls: Any, model_runner: Any | None = None) -> None:
    """Restore vLLM's functions (tests)."""
    for owner, names in ((manager_cls, ("batches_to_profile", "set_initial_cost_curves")),
                         (model_runner, ("maybe_create_adaptive_verification_manager",))):
        if owner is None:
            continue
        for name in names:
            original = getattr(getattr(owner, name), _MARK, None)
            if original is not None:
                setattr(owner, name, original)

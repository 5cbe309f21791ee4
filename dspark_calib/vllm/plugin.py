"""The vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``register`` in the API server, the engine core and every worker,
possibly several times per process, so it is idempotent, and with no
DSPARK_CALIB_* variable set it imports nothing beyond the standard library.
Modes, chosen from the env at each engine start:

* DSPARK_CALIB_CAPTURE=DIR: capture mode (used by `dspark-calib profile`), capture.py;
* DSPARK_CALIB_TABLE=PATH: load mode (serve time), load.py;
* DSPARK_CALIB_OBSERVE=DIR: observe mode (serving steps timed and written, with or
  without a table), observer.py; it composes with load mode;
* neither, but the driver announced DSPARK_CALIB_* names this process did not
  receive (Ray): one ERROR line, vLLM profiles as usual;
* no table setting at all: vLLM profiles as usual, and with data parallelism the
  replica still votes "no table" in the replicas' agreement (load.agree_without_table),
  so a replica that has a table never waits on one that has none.

It patches vLLM's AdaptiveVerificationManager.batches_to_profile and
.set_initial_cost_curves, and wraps model_runner's
maybe_create_adaptive_verification_manager (to hand the manager the engine's config) and
GPUModelRunner.initialize_kv_cache (where the acceptance estimator's seed,
DSPARK_CALIB_ESTIMATOR_SEED, is written and observe mode starts, per runner), when vLLM's
model runner module is imported (processes that never import it pay nothing), whether or not
a DSPARK_CALIB_* variable is set (the agreement above needs every replica). On an API shape
it does not know, it logs one line (when a variable asked for work) and leaves vLLM
untouched. Our own failures never stop an engine that would otherwise start; capture
failures and strict refusals are one line.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Any, Callable, Iterator

from dspark_calib import env as E  # standard library only
from dspark_calib.errors import PREFIX, exception_line
from dspark_calib.vllm.runtime import MARK, Mode, log_once, new_engine, state_of

# vLLM's own knobs for what Ray copies from the driver to its actors (vllm/ray/ray_env.py).
RAY_EXTRA_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
RAY_EXTRA_VARS = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"

MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"


# -- env: what the driver set, and whether this process got it --------------------------
def _csv(value: str) -> list[str]:
    return [tok.strip() for tok in value.split(",") if tok.strip()]


def _ours() -> list[str]:
    return sorted(k for k, v in os.environ.items() if k.startswith(E.PREFIX) and v)


# Names this process announced itself: never "missing" here (the driver unset them, e.g.
# `profile` restoring its env), and dropped from the announcement once unset.
_announced: set[str] = set()


def carry_to_ray_workers(names: list[str]) -> None:
    """Ray copies only known prefixes to its actors: add ours, and announce the names in
    RAY_EXTRA_VARS, a vLLM variable Ray always copies, so a process can tell it missed them."""
    prefixes = _csv(os.environ.get(RAY_EXTRA_PREFIXES, ""))
    if names and E.PREFIX not in prefixes:
        os.environ[RAY_EXTRA_PREFIXES] = ",".join(prefixes + [E.PREFIX])
    have = _csv(os.environ.get(RAY_EXTRA_VARS, ""))
    keep = [h for h in have if not (h in _announced and h not in names)]
    new = keep + [n for n in names if n not in keep]
    _announced.intersection_update(names)
    _announced.update(n for n in names if n not in have)
    if new != have:
        if new:
            os.environ[RAY_EXTRA_VARS] = ",".join(new)
        else:
            os.environ.pop(RAY_EXTRA_VARS, None)


def missing_from_driver() -> list[str]:
    """DSPARK_CALIB_* names the driver announced that this process did not receive."""
    announced = [n for n in _csv(os.environ.get(RAY_EXTRA_VARS, "")) if n.startswith(E.PREFIX)]
    return [n for n in announced if not os.environ.get(n) and n not in _announced]


class MissingEnvMode:
    """The driver set DSPARK_CALIB_* but this worker never saw them: say so, profile as vLLM does."""

    name = "missing-env"

    def __init__(self, names: list[str]):
        self.names = names

    def batches(self, manager: Any, capture_sizes: list[int], vllm_batches: list[dict]) -> Iterator[dict]:
        log_once(logging.ERROR, PREFIX + f"the driver set {', '.join(self.names)} but this engine's workers "
                                f"did not receive them (not copied to Ray workers?); no table used, "
                                "profiling at start-up as usual")
        from dspark_calib.vllm.load import agree_without_table

        agree_without_table(manager)  # data-parallel replicas that did receive a table must not wait on this one
        yield from vllm_batches

    def install_curves(self, manager: Any, samples: list, original: Callable[[list], None]) -> None:
        original(samples)


def active_mode() -> Mode | None:
    """Chosen at each engine start from the env (vLLM loads plugins once per process, so
    the patch itself only happens if a DSPARK_CALIB_* variable was set at that first load)."""
    missing = missing_from_driver()
    if missing and E.is_active():
        # e.g. the table arrived but DSPARK_CALIB_POLICY=strict did not: never silently
        log_once(logging.ERROR, PREFIX + f"the driver set {', '.join(missing)} but this engine's workers "
                                "did not receive them (not copied to Ray workers?); going on without them")
    if os.environ.get(E.CAPTURE):
        from dspark_calib.vllm.capture import CaptureMode

        return CaptureMode(os.environ[E.CAPTURE])  # profiling never loads a table
    if os.environ.get(E.TABLE):
        from dspark_calib.vllm.load import LoadMode

        return LoadMode()
    return MissingEnvMode(missing) if missing else None


# -- registration ---------------------------------------------------------------------
def register() -> None:
    try:
        names = _ours()
        if names or _announced:
            carry_to_ray_workers(names)
        # Every process that builds a model runner is patched, asked or not: a data-parallel
        # replica without any DSPARK_CALIB_* setting must still take part in the replicas'
        # agreement on the table (having none is a vote too), or a replica with one waits on it.
        if MODEL_RUNNER in sys.modules:
            _patch_installed_vllm()
        elif not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
            # Processes that never build a model runner (the API server) must not pay for
            # importing it: patch when, and only if, the worker imports it.
            sys.meta_path.insert(0, _PatchAfterImport())
    except Exception as exc:  # noqa: BLE001 - never stop an engine that would otherwise start
        log_once(logging.ERROR, PREFIX + f"plugin not registered ({exception_line(exc)}); vLLM runs untouched")


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
    try:
        av = sys.modules.get("vllm.v1.worker.gpu.spec_decode.adaptive_verification")
        manager_cls = getattr(av, "AdaptiveVerificationManager", None)
        if manager_cls is not None and is_patched(manager_cls):
            return  # vLLM loads plugins more than once: detect (it parses vLLM's source) once
        from dspark_calib.vllm.shape import detect, untested_why

        asked = E.is_active() or bool(missing_from_driver())  # unasked, vLLM is patched without a word
        shape = detect()
        if not shape.supported:
            if not asked:
                return
            log_once(logging.WARNING, PREFIX + f"vLLM {shape.vllm_version} has an adaptive-verification API "
                                      f"this version does not know ({shape.reason}); leaving vLLM untouched, it "
                                      "profiles at start-up as usual")
            return
        if not shape.tested and asked:
            log_once(logging.WARNING, PREFIX + f"{untested_why(shape.vllm_version)}; its API has the tested shape, "
                                      f"patching it ({E.POLICY}=strict refuses to load a table on it)")
        from vllm.v1.worker.gpu import model_runner
        from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

        patch(av.AdaptiveVerificationManager, model_runner)
    except Exception as exc:  # noqa: BLE001 - runs inside vLLM's import: must never break it
        log_once(logging.ERROR, PREFIX + f"could not patch vLLM ({exception_line(exc)}); leaving it untouched")


def is_patched(manager_cls: Any) -> bool:
    # getattr: an unknown vLLM shape may lack the method; this runs inside vLLM's import
    return hasattr(getattr(manager_cls, "batches_to_profile", None), MARK)


def patch(manager_cls: Any, model_runner: Any | None = None) -> None:
    """Wrap the profiling methods once; a second call is a no-op."""
    from dspark_calib.vllm import load

    # the probe's timing hook first: if it cannot be installed the class stays unpatched
    # (vLLM untouched), never patched with a probe that cannot run
    load.install_hooks()
    if not is_patched(manager_cls):
        orig_batches = manager_cls.batches_to_profile
        orig_init = manager_cls.set_initial_cost_curves

        @functools.wraps(orig_batches)
        def batches_to_profile(self: Any, capture_sizes: list[int]):
            # vLLM's own generator sets self._cudagraph_limit and gives its batch plan.
            vllm_batches = list(orig_batches(self, capture_sizes))
            state = state_of(self)
            state.vllm_fit = orig_init
            try:
                state.mode = active_mode()
            except Exception as exc:  # noqa: BLE001 - a broken install must not stop the engine
                log_once(logging.ERROR, PREFIX + f"{exception_line(exc)}; profiling at start-up as usual")
                state.mode = None
            if state.mode is None:
                from dspark_calib.vllm.load import agree_without_table

                agree_without_table(self)  # DP: a replica without a table setting votes too (raises to refuse)
                yield from vllm_batches
            else:
                yield from state.mode.batches(self, list(capture_sizes), vllm_batches)

        @functools.wraps(orig_init)
        def set_initial_cost_curves(self: Any, samples: list) -> None:
            mode = state_of(self).mode
            if mode is None:
                orig_init(self, samples)
            else:
                mode.install_curves(self, samples, lambda s: orig_init(self, s))

        setattr(batches_to_profile, MARK, orig_batches)
        setattr(set_initial_cost_curves, MARK, orig_init)
        manager_cls.batches_to_profile = batches_to_profile
        manager_cls.set_initial_cost_curves = set_initial_cost_curves
    if model_runner is not None:
        _wrap_factory(model_runner)
        from dspark_calib.vllm.observer import hook_runner

        hook_runner(model_runner)  # observe starts per engine, when DSPARK_CALIB_OBSERVE is set


def _record_refusal(exc: BaseException) -> None:
    directory = os.environ.get(E.CAPTURE)
    if not directory or not os.path.isdir(directory):
        return
    try:
        from dspark_calib.vllm.capture import CaptureDir

        CaptureDir(directory).write_refusal(str(exc))
    except Exception:  # noqa: BLE001 - never mask vLLM's own error
        pass


def _wrap_factory(model_runner: Any) -> None:
    """The runner builds its manager through this factory, which also gets the engine config:
    keep the config in the manager's state (engine_info needs it), and in capture mode keep
    vLLM's reason when it refuses adaptive verification (with TP the `profile` command would
    only see "worker failed"), in the capture directory."""
    orig = getattr(model_runner, "maybe_create_adaptive_verification_manager", None)
    if orig is None or hasattr(orig, MARK):
        return

    @functools.wraps(orig)
    def maybe_create(*args: Any, **kwargs: Any) -> Any:
        new_engine()
        try:
            manager = orig(*args, **kwargs)
        except ValueError as exc:
            _record_refusal(exc)
            raise
        if manager is not None:
            config = kwargs.get("vllm_config")
            state_of(manager).vllm_config = config
        return manager

    setattr(maybe_create, MARK, orig)
    model_runner.maybe_create_adaptive_verification_manager = maybe_create


def unpatch(manager_cls: Any, model_runner: Any | None = None) -> None:
    """Restore vLLM's functions (tests)."""
    for owner, names in ((manager_cls, ("batches_to_profile", "set_initial_cost_curves")),
                         (model_runner, ("maybe_create_adaptive_verification_manager",))):
        if owner is None:
            continue
        for name in names:
            original = getattr(getattr(owner, name), MARK, None)
            if original is not None:
                setattr(owner, name, original)
    from dspark_calib.vllm import load, observer

    load.remove_hooks()
    if model_runner is not None:
        observer.unhook_runner(model_runner)

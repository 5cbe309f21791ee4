"""The entry point in every vLLM process: cheap (standard library only until a
DSPARK_CALIB_* variable asks), quiet (once per engine, TP rank 0), never the
reason an engine fails, and honest under Ray (our variables reach the workers,
or one ERROR line says they did not)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import vllm.envs
import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
from vllm.distributed import parallel_state
from vllm.ray import ray_env
from vllm.v1.worker.gpu import model_runner

from dspark_calib.vllm import plugin, shape
from tests.helpers import REPO
from dspark_calib.vllm import runtime

ROOT = str(REPO)
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


class Rank:
    def __init__(self, rank=0, world=1):
        self.rank_in_group, self.world_size = rank, world

    def broadcast_object(self, obj, src=0):
        return obj


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for key in list(os.environ):
        if key.startswith("DSPARK_CALIB_") or key.startswith("VLLM_RAY_EXTRA_"):
            monkeypatch.delenv(key)
    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setattr(plugin, "_announced", set())
    monkeypatch.setattr(av, "get_tp_group", lambda: Rank())
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: Rank())
    if hasattr(vllm.envs, "disable_envs_cache"):
        vllm.envs.disable_envs_cache()  # ray_env reads VLLM_RAY_* through vllm.envs
    yield
    plugin.unpatch(av.AdaptiveVerificationManager, model_runner)
    for key in list(os.environ):  # register() announces our variables in os.environ itself
        if key.startswith(("DSPARK_CALIB_", "VLLM_RAY_EXTRA_")):
            del os.environ[key]


def lines(caplog):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "vllm.dspark_calib"]


def make_manager():
    m = object.__new__(av.AdaptiveVerificationManager)
    m.req_states = SimpleNamespace(max_num_reqs=256, max_num_batched_tokens=8192)
    m.num_speculative_steps = 7
    m._cudagraph_limit = 0
    m.cost_tables = None
    return m


# -- cheap --------------------------------------------------------------------------------
IMPORTS = """
import json, os, sys
before = set(sys.modules)
import dspark_calib.vllm.plugin as p
p.register()
new = sorted(set(sys.modules) - before)
print(json.dumps({"new": new, "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_RAY_EXTRA_")}}))
"""


def _imports_in_fresh_process(**env):
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_CALIB_", "VLLM_RAY_EXTRA_"))}
    res = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=120,
                         env={**clean_env, "PYTHONPATH": ROOT, **env})
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _beyond_stdlib(modules):
    # env.py (every DSPARK_CALIB_* name), the pricing policy (its defaults; the context bound from
    # fileformat.limits), runtime.py and errors.py import only the standard library themselves:
    # anything they pulled in would show up here as well.
    ours = {"dspark_calib", "dspark_calib.vllm", "dspark_calib.vllm.plugin", "dspark_calib.env",
            "dspark_calib.errors", "dspark_calib.pricing", "dspark_calib.pricing.policy", "dspark_calib.vllm.runtime",
            "dspark_calib.fileformat", "dspark_calib.fileformat.limits"}
    return [m for m in modules if m not in ours and m.split(".")[0] not in sys.stdlib_module_names]


def test_register_without_env_imports_only_the_standard_library():
    out = _imports_in_fresh_process()
    assert _beyond_stdlib(out["new"]) == []
    assert out["env"] == {}  # and changes nothing


def test_register_with_a_table_still_imports_nothing_heavy_until_the_runner_loads(tmp_path):
    out = _imports_in_fresh_process(DSPARK_CALIB_TABLE=str(tmp_path), DSPARK_CALIB_POLICY="strict")
    assert _beyond_stdlib(out["new"]) == []
    assert out["env"] == {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "DSPARK_CALIB_",
                          "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "DSPARK_CALIB_POLICY,DSPARK_CALIB_TABLE"}


def test_observe_alone_activates_the_plugin_and_stays_light(tmp_path):
    """The stock-vLLM arm is observable: observe alone asks for the patch, still standard library only."""
    from dspark_calib import env as E

    assert E.is_active({"DSPARK_CALIB_OBSERVE": str(tmp_path)}) and not E.is_active({"DSPARK_CALIB_OBSERVE": " "})
    out = _imports_in_fresh_process(DSPARK_CALIB_OBSERVE=str(tmp_path), DSPARK_CALIB_OBSERVE_EVERY="8")
    assert _beyond_stdlib(out["new"]) == []
    assert out["env"] == {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "DSPARK_CALIB_",
                          "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "DSPARK_CALIB_OBSERVE,DSPARK_CALIB_OBSERVE_EVERY"}


def test_observe_every_parsing():
    from dspark_calib.errors import CalibError
    from dspark_calib import env as E

    assert E.observe_every({}) == E.DEFAULT_OBSERVE_EVERY and E.observe_every({"DSPARK_CALIB_OBSERVE_EVERY": " 1 "}) == 1
    for bad in ("0", "-3", "x", "2.5", "10000001"):
        with pytest.raises(CalibError, match="DSPARK_CALIB_OBSERVE_EVERY"):
            E.observe_every({"DSPARK_CALIB_OBSERVE_EVERY": bad})


# -- quiet: once per engine, from TP rank 0 ---------------------------------------------------
@pytest.mark.parametrize("rank,expected", [(0, 1), (1, 0), (3, 0)])
def test_unsupported_shape_is_one_line_from_rank0_only(monkeypatch, caplog, tmp_path, rank, expected):
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: Rank(rank, 4))
    monkeypatch.setattr(shape, "detect", lambda: shape.ApiShape(None, "consume_step_timing exists", "0.99.0"))
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        for _ in range(3):  # vLLM may load plugins more than once
            plugin.register()
    got = lines(caplog)
    assert len(got) == expected and not plugin.is_patched(av.AdaptiveVerificationManager)
    if expected:
        assert got[0][0] == logging.WARNING and "leaving vLLM untouched" in got[0][1] and "0.99.0" in got[0][1]


def test_untested_version_with_the_tested_shape_is_a_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(shape, "detect", lambda: shape.ApiShape(shape.SHAPE_V1, "", "0.34.0"))
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        plugin.register()
        plugin.register()
    got = lines(caplog)
    assert len(got) == 1 and got[0][0] == logging.WARNING and "0.34.0" in got[0][1] and shape.SUPPORTED_VLLM in got[0][1]
    assert plugin.is_patched(av.AdaptiveVerificationManager)


# -- never the reason an engine fails ---------------------------------------------------------
def test_register_never_raises(monkeypatch, caplog, tmp_path):
    def broken(names):
        raise OSError("environment is read-only")

    monkeypatch.setattr(plugin, "carry_to_ray_workers", broken)
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        plugin.register()
    got = lines(caplog)
    assert len(got) == 1 and got[0][0] == logging.ERROR and "read-only" in got[0][1] and "\n" not in got[0][1]


def test_patch_failure_leaves_vllm_untouched(monkeypatch, caplog, tmp_path):
    def exploding():
        raise ImportError("half-installed vllm")

    monkeypatch.setattr(shape, "detect", exploding)
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        plugin.register()
    assert not plugin.is_patched(av.AdaptiveVerificationManager)
    assert [lvl for lvl, _ in lines(caplog)] == [logging.ERROR]


def test_a_broken_mode_falls_back_to_vllms_profile(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path))
    plugin.register()

    def broken():
        raise ImportError("pyarrow missing")

    monkeypatch.setattr(plugin, "active_mode", broken)
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches = list(m.batches_to_profile(SIZES))
    stock = list(getattr(av.AdaptiveVerificationManager.batches_to_profile, runtime.MARK)(make_manager(), SIZES))
    assert batches == stock
    assert [lvl for lvl, _ in lines(caplog)] == [logging.ERROR]


# -- one state object on vLLM's manager ----------------------------------------------------------
def test_factory_keeps_the_config_in_one_state_object(monkeypatch, tmp_path):
    made = make_manager()

    def factory(*, vllm_config, **kwargs):  # vLLM 0.33's factory, minus the GPU
        return made

    monkeypatch.setattr(model_runner, "maybe_create_adaptive_verification_manager", factory)
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path))
    plugin.register()
    config = SimpleNamespace(name="engine config")
    assert model_runner.maybe_create_adaptive_verification_manager(vllm_config=config) is made
    assert runtime.state_of(made).vllm_config is config
    assert {k for k in vars(made) if "dspark" in k} == {runtime.STATE_ATTR}  # nothing else on vLLM's manager


def test_mode_protocol_is_what_the_modes_provide():
    from dspark_calib.vllm.capture import CaptureMode
    from dspark_calib.vllm.load import LoadMode

    for mode in (CaptureMode, LoadMode, plugin.MissingEnvMode):
        for name in ("batches", "install_curves"):
            assert callable(getattr(mode, name)), (mode, name)
        assert isinstance(mode.name, str)


# -- Ray: our variables reach the workers, or one ERROR line says they did not ------------------------
def test_ray_copies_our_variables_once_register_ran_in_the_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path))
    monkeypatch.setenv("DSPARK_CALIB_POLICY", "strict")
    assert "DSPARK_CALIB_TABLE" not in ray_env.get_env_vars_to_copy()  # what vLLM does on its own
    plugin.register()
    plugin.register()  # idempotent: nothing added twice
    copied = ray_env.get_env_vars_to_copy()
    assert {"DSPARK_CALIB_TABLE", "DSPARK_CALIB_POLICY", plugin.RAY_EXTRA_VARS} <= copied
    assert os.environ[plugin.RAY_EXTRA_PREFIXES] == "DSPARK_CALIB_"
    assert os.environ[plugin.RAY_EXTRA_VARS] == "DSPARK_CALIB_POLICY,DSPARK_CALIB_TABLE"


def test_user_prefixes_are_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(plugin.RAY_EXTRA_PREFIXES, "MYLIB_")
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path))
    plugin.register()
    assert os.environ[plugin.RAY_EXTRA_PREFIXES] == "MYLIB_,DSPARK_CALIB_"


def _worker_env(exclude=frozenset()):
    """The env a Ray actor gets: what vLLM's own ray_env says to copy from this driver."""
    copied = ray_env.get_env_vars_to_copy(exclude_vars=set(exclude))
    return {k: os.environ[k] for k in copied if k in os.environ}


@pytest.mark.parametrize("excluded", [(), ("DSPARK_CALIB_TABLE",)])
def test_worker_that_missed_the_drivers_table_says_so_in_one_error(monkeypatch, caplog, tmp_path, excluded):
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path / "missing"))
    plugin.register()  # the driver
    worker = _worker_env(excluded)
    # become the worker, a process of its own (directly: monkeypatch would restore the driver's
    # announcement after the test)
    monkeypatch.setattr(plugin, "_announced", set())
    for key in list(os.environ):
        if key.startswith(("DSPARK_CALIB_", "VLLM_RAY_EXTRA_")):
            del os.environ[key]
    os.environ.update(worker)
    plugin.register()
    m = make_manager()
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        batches = list(m.batches_to_profile(SIZES))
        list(make_manager().batches_to_profile(SIZES))  # a second look in the same engine: still one line
    got = lines(caplog)
    if excluded:
        assert plugin.missing_from_driver() == ["DSPARK_CALIB_TABLE"]
        assert len(got) == 1 and got[0][0] == logging.ERROR and "DSPARK_CALIB_TABLE" in got[0][1]
        stock = list(getattr(av.AdaptiveVerificationManager.batches_to_profile, runtime.MARK)(make_manager(), SIZES))
        assert batches == stock
    else:  # carried: the worker is in load mode and decides for itself (no table there: falls back)
        assert plugin.missing_from_driver() == []
        assert not any("did not receive" in text for _, text in got)
        assert any("profiling at start-up as usual" in text for _, text in got)


def test_no_variable_set_means_no_announcement(monkeypatch):
    plugin.register()
    assert plugin.RAY_EXTRA_PREFIXES not in os.environ and plugin.RAY_EXTRA_VARS not in os.environ
    assert plugin.active_mode() is None


def test_worker_that_got_the_table_but_not_the_policy_says_so(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("DSPARK_CALIB_TABLE", str(tmp_path / "missing"))
    monkeypatch.setenv("DSPARK_CALIB_POLICY", "strict")
    plugin.register()  # the driver
    worker = _worker_env({"DSPARK_CALIB_POLICY"})
    del os.environ["DSPARK_CALIB_POLICY"]
    monkeypatch.setattr(plugin, "_announced", set())  # the worker: a process of its own
    assert worker["DSPARK_CALIB_TABLE"] == os.environ["DSPARK_CALIB_TABLE"]
    with caplog.at_level(logging.INFO, logger="vllm.dspark_calib"):
        list(make_manager().batches_to_profile(SIZES))
    errors = [text for lvl, text in lines(caplog) if lvl == logging.ERROR]
    assert len(errors) == 1 and "DSPARK_CALIB_POLICY" in errors[0] and "DSPARK_CALIB_TABLE" not in errors[0]


def test_driver_that_unsets_its_variable_is_not_a_worker_that_missed_it(monkeypatch, caplog, tmp_path):
    """`profile` sets DSPARK_CALIB_CAPTURE for its engine and restores the env after: neither the
    driver itself nor its next engine start may read that as a lost variable."""
    os.environ["DSPARK_CALIB_CAPTURE"] = str(tmp_path)
    plugin.register()
    del os.environ["DSPARK_CALIB_CAPTURE"]
    assert plugin.missing_from_driver() == [] and plugin.active_mode() is None
    os.environ["DSPARK_CALIB_TABLE"] = str(tmp_path)
    plugin.register()  # the next start re-announces what is set now, and only that
    assert os.environ[plugin.RAY_EXTRA_VARS] == "DSPARK_CALIB_TABLE"
    del os.environ["DSPARK_CALIB_TABLE"]
    plugin.register()
    assert plugin.RAY_EXTRA_VARS not in os.environ


def test_every_env_name_lives_in_env_py():
    """One home for every DSPARK_CALIB_* name: no other module spells one out."""
    import ast
    import pathlib
    import re

    from dspark_calib import env

    root = pathlib.Path(env.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        if path.name == "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"DSPARK_CALIB_[A-Z0-9_]*", node.value):
                found.setdefault(str(path.relative_to(root)), []).append(node.value)
    assert found == {}
    assert set(env.ALL) == {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)
                            and v.startswith(env.PREFIX) and v != env.PREFIX}


def test_context_tail_is_read_in_thousandths_and_checked():
    from dspark_calib.errors import CalibError
    from dspark_calib import env

    assert env.context_tail_milli({}) == 200 and env.context_tail_milli({env.CONTEXT_TAIL: " "}) == 200  # default
    assert env.context_tail_milli({env.CONTEXT_TAIL: "0"}) == 0
    assert env.context_chunks_enabled({}) is True and env.context_chunks_enabled({env.CONTEXT_CHUNKS: "0"}) is False
    for blank in ("", "  "):  # blank is unset, for every flag: a default-on one is not turned off by it
        assert env.context_chunks_enabled({env.CONTEXT_CHUNKS: blank}) is True
        assert env.probe_enabled({env.PROBE: blank}) is True and env.context_aware_enabled({env.CONTEXT_AWARE: blank})
        assert env.allow_reference({env.ALLOW_REFERENCE: blank}) is False
    assert env.context_tail_milli({env.CONTEXT_TAIL: "0.25"}) == 250
    assert env.context_tail_milli({env.CONTEXT_TAIL: "1"}) == 1000
    assert env.context_tail_milli({env.CONTEXT_TAIL: "1e-3"}) == 1 and env.context_tail_milli({env.CONTEXT_TAIL: "-0"}) == 0
    for bad, why in (("-0.1", "between 0 and 1"), ("1.0000001", "='1.0000001' must be between 0 and 1"),
                     ("nan", "between 0 and 1"), ("0.0004", "below the tail's resolution"), ("a lot", "is not a number")):
        with pytest.raises(CalibError, match=why) as exc:
            env.context_tail_milli({env.CONTEXT_TAIL: bad})
        assert str(exc.value).startswith(env.CONTEXT_TAIL) and "\n" not in str(exc.value)


def test_readme_env_table_lists_every_variable_with_the_default_the_parser_returns():
    """The manual's table and env.py cannot drift: every variable has a row, and each stated
    default is what its parser returns with the variable unset."""
    import pathlib
    import re

    from dspark_calib import env

    readme = (pathlib.Path(env.__file__).parents[1] / "docs" / "serving.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(DSPARK_CALIB_[A-Z0-9_]+)` \| (.+?) \|", section, re.M))
    assert set(rows) == set(env.ALL)
    parsed = {env.POLICY: env.policy({}), env.PROBE: env.probe_enabled({}),
              env.CONTEXT_AWARE: env.context_aware_enabled({}), env.CONTEXT_TAIL: env.context_tail_milli({}) / 1000,
              env.CONTEXT_CHUNKS: env.context_chunks_enabled({}), env.LOAD_TIMEOUT: env.load_timeout({}),
              env.DP_TIMEOUT: env.dp_timeout({}),
              env.ALLOW_REFERENCE: env.allow_reference({}), env.OBSERVE_EVERY: env.observe_every({})}
    for name, value in parsed.items():
        stated = re.fullmatch(r"`([^`]+)`", rows[name].strip())
        assert stated, (name, rows[name])
        text = stated.group(1)
        want = (text == "1") if isinstance(value, bool) else type(value)(text)
        assert want == value, (name, text, value)
    for name in set(env.ALL) - set(parsed):  # no default value: the row says unset
        assert rows[name].strip().startswith("unset"), (name, rows[name])

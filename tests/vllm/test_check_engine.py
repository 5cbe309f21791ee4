"""`check` gives the engine's answer: for `vllm serve` flag sets, what `check` says equals what
the plugin decides on the VllmConfig vLLM builds from the same flags.

The plugin side: vLLM's serve parser and EngineArgs.create_engine_config (the CUDA platform's
rules, answered for an H200 by engine_args' stand-in), read by describe_engine as a worker reads
it, plus the attention backends a running engine reports, decided by selection.decide under
strict with the profiled context vLLM would use. The check side: the command line, flags after --.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
from typer.testing import CliRunner

from dspark_calib.cli.app import app
from dspark_calib.selection import decide
from tests.helpers import DRAFT, MODEL, REPO

SHELF = str(REPO / "profiles" / "h200")
TP1, TP2 = "15b5101f9d84", "00d73c94a383"
DRAFT_MODEL, EAGLE3, DFLASH, MTP = "a9f289a525a3", "81458b2ae409", "7e6f4f0df2d4", "cdd0e79fdd2c"
# The H200 the shipped tables were profiled on (its library builds as the newer tables record them:
# cuDNN 9.19, no flashinfer).
HARDWARE = {"gpu_name": "NVIDIA H200", "gpu_compute_capability": "9.0", "gpu_memory_mib": 143155,
            "driver_version": "580.159.04", "cuda_version": "13.0", "torch_version": "2.14.0+cu130",
            "cudnn_version": "91900", "flashinfer_version": "none"}
BACKENDS = {"attention_backend": "FLASH_ATTN", "draft_attention_backend": "FLASH_ATTN"}
SPEC = json.dumps({"method": "dspark", "model": DRAFT, "num_speculative_tokens": 7,
                   "enable_adaptive_verification": True})
README = [MODEL, "--speculative-config", SPEC, "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
          "--max-model-len", "32768"]


def _has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


def without(flag, argv=README):
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def replaced(flag, value, argv=README):
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


# (id, serve flags, env, the table the engine loads: a hash, or None when strict refuses)
CONFIGS = [
    ("readme", README, {}, TP1),
    ("readme-as-pasted", ["vllm", "serve", *README], {}, TP1),
    ("no-max-model-len", without("--max-model-len"), {}, None),  # vLLM fills 40960 from the config
    ("no-max-num-seqs", without("--max-num-seqs"), {}, None),  # vllm serve on >= 70 GiB fills 1024
    ("batched-tokens-4096", replaced("--max-num-batched-tokens", "4096"), {}, None),  # the compilation hash
    ("profile-context-4096", README, {"VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "4096"}, None),
    ("profile-context-1024", README, {"VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "1024"}, TP1),
    ("block-size-32", [*README, "--block-size", "32"], {}, None),
    ("dtype-auto", [*README, "--dtype", "auto"], {}, TP1),
    ("dtype-float16", [*README, "--dtype", "float16"], {}, None),
    ("kv-cache-fp8", [*README, "--kv-cache-dtype", "fp8"], {}, None),
    # TP > 1 on Hopper with flashinfer installed (as in this environment) turns on vLLM's
    # all-reduce + RMSNorm fusion: another compilation hash than the tp2 table's host had
    ("tp2", [*README, "--tensor-parallel-size", "2"], {}, None if _has("flashinfer") else TP2),
    ("max-model-len-32K", replaced("--max-model-len", "32K"), {}, TP1),  # vLLM: K is 1024
    ("max-model-len-32k", replaced("--max-model-len", "32k"), {}, None),  # and k is 1000
    ("max-model-len-16384", replaced("--max-model-len", "16384"), {}, None),
    ("max-num-seqs-128", replaced("--max-num-seqs", "128"), {}, None),
    ("k5", replaced("--speculative-config", SPEC.replace('"num_speculative_tokens": 7', '"num_speculative_tokens": 5')),
     {}, None),
    ("server-only-flags", [*README, "--host", "0.0.0.0", "--port", "8001", "--gpu-memory-utilization", "0.9"], {},
     TP1),
    ("block-size-16", [*README, "--block-size", "16"], {}, TP1),
    # other speculators: each loads its own shipped table (profiled with these flags); the method and
    # the drafter's config refuse every other table
    ("draft-model", replaced("--speculative-config", json.dumps(
        {"method": "draft_model", "model": str(REPO / "profiles" / "configs" / "qwen3-0.6b"),
         "num_speculative_tokens": 7, "enable_adaptive_verification": True})), {}, DRAFT_MODEL),
    # no method: vLLM detects DSpark from the drafter's architecture (the light path leaves it to
    # the engine: decided at start)
    ("no-method", replaced("--speculative-config", json.dumps(
        {"model": DRAFT, "num_speculative_tokens": 7, "enable_adaptive_verification": True})), {}, TP1),
    # an EAGLE-3 head (profiles/configs): vLLM builds its config on this machine
    ("eagle3", replaced("--speculative-config", json.dumps(
        {"method": "eagle3", "model": str(REPO / "profiles" / "configs" / "eagle3-qwen3-8b"),
         "num_speculative_tokens": 7, "enable_adaptive_verification": True})), {}, EAGLE3),
    # a DFlash drafter (profiles/configs, block 16): the same, 15 drafts a step
    ("dflash", replaced("--speculative-config", json.dumps(
        {"method": "dflash", "model": str(REPO / "profiles" / "configs" / "dflash-qwen3-8b-b16"),
         "num_speculative_tokens": 15, "enable_adaptive_verification": True})), {}, DFLASH),
    # MTP: a MiMo-7B target drafts with its own MTP layer (profiles/configs/mimo-7b); vLLM builds
    # its MiMoMTPModel drafter from the target's config
    ("mtp", [str(REPO / "profiles" / "configs" / "mimo-7b"), "--speculative-config", json.dumps(
        {"method": "mtp", "num_speculative_tokens": 3, "enable_adaptive_verification": True}),
        *README[3:]], {}, MTP),
]


def vllm_config(argv, env):
    """The VllmConfig vLLM builds from these serve flags on the H200 stand-in."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dspark_calib.vllm import engine_args as EA

    full = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1", **env}
    with EA.resolving(full, HARDWARE):
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(EA.strip_command(argv))
        ns.model = ns.model_tag or ns.model
        return AsyncEngineArgs.from_cli_args(ns).create_engine_config(UsageContext.OPENAI_API_SERVER)


def manager_for(config):
    """vLLM's manager as the engine built from `config` makes it (test_plugin.make_manager's stand-in)."""
    from tests.vllm.test_plugin import make_manager

    return make_manager(config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens,
                        config.speculative_config.num_speculative_tokens, config=config)


def plugin_decision(argv, env):
    """The plugin's decision (strict) on the VllmConfig vLLM builds from these flags."""
    from dspark_calib.vllm import engine_args as EA
    from dspark_calib.vllm.engine_info import describe_engine

    config = vllm_config(argv, env)
    with EA._environment({**os.environ, **env}):
        import vllm.envs as envs

        vllm_context = int(envs.VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN)
    engine = {**describe_engine(None, [], config, hardware_facts=HARDWARE), **BACKENDS}
    return decide(SHELF, engine, policy="strict", vllm_context_len=vllm_context)


def check_answer(argv, env, *extra):
    options = [f"--gpu-name={HARDWARE['gpu_name']}", *(f"--engine={k}={v}" for k, v in HARDWARE.items()
                                                       if k != "gpu_name"),
               *(f"--engine={k}={v}" for k, v in BACKENDS.items()), *extra]
    with mock.patch.dict(os.environ, env):
        r = CliRunner().invoke(app, ["check", SHELF, *options, "--json", "--", *argv])
    return r


@pytest.mark.parametrize("argv, env, expected", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_check_gives_the_plugins_answer_for_vllm_serve_flags(argv, env, expected):
    plugin = plugin_decision(argv, env)
    r = check_answer(argv, env)
    assert r.exit_code in (0, 1), r.output
    d = json.loads(r.stdout)
    assert d["resolution"].startswith("resolved through vLLM's EngineArgs")
    assert plugin.load == d["loads"] == (expected is not None), (plugin.lines, d["plugin_log"])
    if plugin.load:
        assert plugin.content_hash.startswith(expected) and d["chosen"]["content_hash"] == plugin.content_hash
        assert r.exit_code == 0 and d["decided_at_start"] == []  # every blocking key was checked
    else:
        assert r.exit_code == 1 and plugin.refuse


@pytest.mark.parametrize("argv, env", [c[1:3] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_the_light_resolution_agrees_with_vllms(argv, env):
    """Without vLLM, check applies vLLM's documented defaults: every key it resolves has the value
    vLLM resolves from the same flags."""
    from dspark_calib import serve_args
    from dspark_calib.vllm import engine_args

    with mock.patch.dict(os.environ, env):
        light = serve_args.resolve(argv, HARDWARE)
        full = engine_args.resolve(argv, HARDWARE)
    differ = {k: (v, full.engine.get(k)) for k, v in light.engine.items() if full.engine.get(k) != v}
    assert differ == {}
    assert light.vllm_context_len == full.vllm_context_len
    assert {"max_model_len", "max_num_seqs", "max_num_batched_tokens", "dtype"} <= set(light.engine)


def test_without_the_gpus_facts_its_defaults_are_decided_at_start():
    """vllm serve fills max_num_seqs by the GPU's memory: not given, it is left to the engine (exit 3),
    never taken from this machine."""
    r = CliRunner().invoke(app, ["check", SHELF, "--json", "--", *without("--max-num-seqs")])
    assert r.exit_code == 3, r.output
    d = json.loads(r.stdout)
    assert "max_num_seqs" in d["decided_at_start"] and "gpu_name" in d["decided_at_start"]
    assert "left to the engine (GPU facts not given): max_num_seqs" in d["resolution"]


def test_vllms_refusal_of_the_flags_is_one_line():
    from tests.helpers import one_line_error

    r = CliRunner().invoke(app, ["check", SHELF, "--", *README, "--enforce-eager"])
    one_line_error(r, "serve flags: vLLM refuses them", "full CUDA graphs")


def test_check_resolves_in_a_fresh_process_with_vllms_model_cache_empty(tmp_path):
    """A machine that never ran vLLM has no model-info record in vLLM's cache: vLLM inspects the
    architecture in a subprocess, and its cache write (which imports the CUDA flash-attention
    extension under check's stand-in CUDA platform) must not turn that into a refusal."""
    import subprocess
    import sys

    cache = tmp_path / "vllm-cache"
    options = [f"--gpu-name={HARDWARE['gpu_name']}", *(f"--engine={k}={v}" for k, v in HARDWARE.items()
                                                       if k != "gpu_name"),
               *(f"--engine={k}={v}" for k, v in BACKENDS.items())]
    r = subprocess.run([sys.executable, "-m", "dspark_calib", "check", SHELF, *options, "--json", "--", *README],
                       env={**os.environ, "VLLM_CACHE_ROOT": str(cache)}, capture_output=True, text=True,
                       timeout=600, cwd=REPO, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    assert d["loads"] and d["resolution"].startswith("resolved through vLLM's EngineArgs")
    assert not (cache / "modelinfos").exists()  # check leaves vLLM's cache as it found it


def test_resolution_leaves_vllms_platform_and_logging_as_they_were():
    """check resolves inside its own process: vLLM's platform, its logging and the environment
    are as they were afterwards (the engine would configure them for itself)."""
    import logging

    import vllm.platforms as platforms

    vllm_logger = logging.getLogger("vllm")
    before = (platforms.current_platform, vllm_logger.level, list(vllm_logger.handlers), dict(os.environ))
    check_answer(README, {"VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN": "1024"})
    assert (platforms.current_platform, vllm_logger.level, list(vllm_logger.handlers), dict(os.environ)) == before


@pytest.mark.parametrize("argv, env, expected", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_the_real_patched_plugin_under_strict_agrees_with_check(monkeypatch, argv, env, expected):
    """vLLM's own AdaptiveVerificationManager, patched by the registered plugin (load mode, strict,
    probe off: no GPU to time), on the VllmConfig of these flags: it installs the table check names
    or refuses to start when check says none would load."""
    import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
    from vllm.v1.worker.gpu import model_runner

    from dspark_calib.vllm import engine_info, plugin, runtime
    from tests.vllm.test_plugin import SingleRank

    config = vllm_config(argv, env)
    d = json.loads(check_answer(argv, env).stdout)
    for key in ("DSPARK_CALIB_CONTEXT_LEN", "DSPARK_CALIB_ALLOW_REFERENCE", "DSPARK_CALIB_TABLE_SHA256"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"DSPARK_CALIB_TABLE": SHELF, "DSPARK_CALIB_POLICY": "strict", "DSPARK_CALIB_PROBE": "0",
                       "DSPARK_CALIB_CONTEXT_AWARE": "0", **env}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(av, "get_tp_group", lambda: SingleRank())
    monkeypatch.setattr(engine_info, "hardware", lambda: dict(HARDWARE))  # the H200 this engine runs on
    monkeypatch.setattr(engine_info, "attention_backends", lambda e, draft: "FLASH_ATTN")  # what its layers resolve
    plugin.register()
    try:
        m = manager_for(config)
        sizes = list(config.compilation_config.cudagraph_capture_sizes)
        if expected is None:
            with pytest.raises(RuntimeError, match="policy strict"):
                list(m.batches_to_profile(sizes))
            assert not d["loads"]
            return
        list(m.batches_to_profile(sizes))
        m.set_initial_cost_curves([])
        decision = runtime.state_of(m).run.decision
        assert decision.load and decision.content_hash == d["chosen"]["content_hash"]
        assert decision.content_hash.startswith(expected) and m.cost_tables is not None
    finally:
        plugin.unpatch(av.AdaptiveVerificationManager, model_runner)


def test_max_model_len_fitted_to_memory_is_left_to_the_engine():
    """--max-model-len -1: vLLM fits it to free memory at start; the resolution leaves it out."""
    from dspark_calib.vllm.engine_args import resolve

    flags = ["vllm", "serve", MODEL, "--speculative-config", json.dumps({"method": "dspark", "model": DRAFT,
             "num_speculative_tokens": 7, "enable_adaptive_verification": True}), "--max-model-len", "-1"]
    resolved = resolve(flags, {"gpu_name": "NVIDIA H200", "gpu_memory_mib": 143155, "gpu_compute_capability": "9.0"})
    assert "max_model_len" not in resolved.engine and "max_model_len" in resolved.how


def test_the_shipped_tables_load_on_their_engine_that_reports_the_newer_keys():
    """The shipped tables predate the config-section and library-build keys: on the engine they were
    made on (the README's flags, vLLM's defaults for every section) they load under strict, and the
    load line names those keys as not recorded in the table, rather than comparing them."""
    from tests.core.test_tablefile import ADDED_AFTER_SHIPPED

    engine = describe_engine_of(README, {})
    assert set(ADDED_AFTER_SHIPPED) <= set(engine)  # the engine reports every one of them
    d = plugin_decision(README, {})
    assert d.load and d.content_hash.startswith(TP1) and not d.refuse
    assert set(ADDED_AFTER_SHIPPED) <= set(d.unrecorded)
    assert "not recorded in the table: attention_config_hash" in d.lines[0]


def describe_engine_of(argv, env):
    from dspark_calib.vllm.engine_info import describe_engine

    return {**describe_engine(None, [], vllm_config(argv, env), hardware_facts=HARDWARE), **BACKENDS}


def test_the_draft_model_table_rebuilt_from_the_h200_capture_loads_under_strict(monkeypatch, tmp_path):
    """The draft-model H200 run's capture, rebuilt with the run's own options (its curves equal
    vLLM's fit, checked in the build), loads under strict on the VllmConfig vLLM builds for that
    engine, its draft curve's fall at 1024 included: the decision, and vLLM's own manager patched
    by the plugin (probe off: no GPU to time), which installs it. The engine's every key equals
    the capture's."""
    import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av
    from vllm.v1.worker.gpu import model_runner

    from dspark_calib.vllm import engine_info, plugin, runtime
    from tests.vllm.test_plugin import SingleRank
    from dspark_calib.table.file import write_table
    from dspark_calib.vllm.engine_info import describe_engine
    from dspark_calib.vllm.profile.driver import resolve_options
    from dspark_calib.vllm.profile.plan import ProfileOptions
    from dspark_calib.vllm.profile.table import table_from_capture_file
    from tests.helpers import DRAFT_MODEL_CAPTURE, SHIPPED_DRAFT_MODEL

    small = str(REPO / "profiles" / "configs" / "qwen3-0.6b")
    opts = resolve_options(ProfileOptions(model=MODEL, draft=small, method="draft_model", num_speculative_tokens=7,
                                          context_lens=(1024, 8192), replays=5, max_model_len=32768))
    table = table_from_capture_file(opts, str(DRAFT_MODEL_CAPTURE))
    assert table.fingerprint.extra["vllm_curves_equal"] and table.fingerprint.warmup_replays == 5
    path = write_table(table, tmp_path)
    capture = json.loads(DRAFT_MODEL_CAPTURE.read_text())
    hardware = {**{k: capture["engine"][k] for k in ("gpu_name", "gpu_compute_capability", "gpu_memory_mib",
                                                     "driver_version", "cuda_version", "torch_version")},
                **capture["hardware"]}
    spec = json.dumps({"method": "draft_model", "model": small, "num_speculative_tokens": 7,
                       "enable_adaptive_verification": True})
    argv = replaced("--speculative-config", spec)
    config = vllm_config(argv, {})
    engine = {**describe_engine(None, [], config, hardware_facts=hardware), **BACKENDS}
    recorded = {**capture["hardware"], **capture["engine"]}
    assert {k: v for k, v in engine.items() if k in recorded and recorded[k] != v} == {}
    d = decide(path, engine, policy="strict", vllm_context_len=8192)
    assert d.load and d.content_hash == table.content_hash and d.context_len == 8192, d.lines
    # the shipped table (this run merged with the 16384 one) loads for the same engine under strict
    shipped = decide(str(SHIPPED_DRAFT_MODEL), engine, policy="strict", vllm_context_len=8192)
    assert shipped.load and shipped.content_hash[:12] in SHIPPED_DRAFT_MODEL.name, shipped.lines
    for key in [k for k in os.environ if k.startswith("DSPARK_CALIB_")]:
        monkeypatch.delenv(key)
    for key, value in {"DSPARK_CALIB_TABLE": path, "DSPARK_CALIB_POLICY": "strict", "DSPARK_CALIB_PROBE": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(av, "get_tp_group", lambda: SingleRank())
    monkeypatch.setattr(engine_info, "hardware", lambda: dict(hardware))
    monkeypatch.setattr(engine_info, "attention_backends", lambda e, draft: "FLASH_ATTN")
    plugin.register()
    try:
        m = manager_for(config)
        list(m.batches_to_profile(list(config.compilation_config.cudagraph_capture_sizes)))
        m.set_initial_cost_curves([])
        assert runtime.state_of(m).run.decision.content_hash == table.content_hash
        draft = table.curves[8192].draft
        assert float(m.cost_tables[0][256]) == float(draft.cost_ms[draft.size == 256][0])
    finally:
        plugin.unpatch(av.AdaptiveVerificationManager, model_runner)

"""The profile driver without a GPU: the engine arguments it builds, and its one-line errors."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest

from dspark_calib.errors import CalibError
from dspark_calib.vllm.profile import driver
from dspark_calib.vllm.profile.driver import engine_kwargs, explain_failure, resolve_options
from tests.helpers import DRAFT, MODEL, REPO
from dspark_calib.vllm.profile import table as profile_table
from dspark_calib.vllm.profile.plan import ProfileOptions

ROOT = str(REPO)


def opts(**kw):
    base = dict(model=MODEL, draft=DRAFT, context_lens=(1024, 8192, 16384))
    base.update(kw)
    return ProfileOptions(**base)


def test_engine_args_accepted_by_vllm():
    """vLLM's own EngineArgs, ModelConfig and SpeculativeConfig accept what `profile` builds."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    kw = engine_kwargs(resolve_options(opts(max_model_len=32768)))
    args = EngineArgs(**kw)
    model_config = args.create_model_config()
    assert model_config.max_model_len == 32768
    assert str(model_config.dtype) == "torch.bfloat16"  # "auto" resolved from config.json
    spec = SpeculativeConfig(**kw["speculative_config"], target_model_config=model_config,
                             target_parallel_config=ParallelConfig(tensor_parallel_size=1))
    assert spec.method == "dspark"
    assert spec.enable_adaptive_verification is True
    assert spec.num_speculative_tokens == 7  # from the drafter's block_size
    assert spec.draft_model_config.hf_config.architectures == ["Qwen3DSparkModel"]
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True


def test_max_model_len_left_to_vllm_unless_given():
    """Unset, vLLM derives max_model_len from the model config, as `vllm serve` does (a checked key)."""
    from vllm.engine.arg_utils import EngineArgs

    o = resolve_options(opts(context_lens=(32768,)))
    assert o.max_model_len is None and "max_model_len" not in engine_kwargs(o)
    assert EngineArgs(**engine_kwargs(o)).create_model_config().max_model_len == 40960
    assert engine_kwargs(resolve_options(opts(max_model_len=20000)))["max_model_len"] == 20000
    with pytest.raises(CalibError, match="max_model_len 40960 from the model config"):
        resolve_options(opts(context_lens=(40960,)))  # beyond the model's 40960 positions


SMALL_DRAFT = str(REPO / "profiles" / "configs" / "qwen3-0.6b")
DFLASH_DRAFT = str(REPO / "profiles" / "configs" / "dflash-qwen3-8b-b16")


def test_a_draft_model_speculator_is_what_vllm_builds():
    """--method draft_model: vLLM's own SpeculativeConfig takes the Qwen3-0.6B drafter as a draft
    model with adaptive verification on (its acceptance estimator ranks the drafts)."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    kw = engine_kwargs(resolve_options(opts(draft=SMALL_DRAFT, method="draft_model", num_speculative_tokens=7,
                                            max_model_len=32768)))
    assert kw["speculative_config"]["method"] == "draft_model"
    args = EngineArgs(**kw)
    spec = SpeculativeConfig(**kw["speculative_config"], target_model_config=args.create_model_config(),
                             target_parallel_config=ParallelConfig())
    assert spec.method == "draft_model" and spec.uses_draft_model() and spec.enable_adaptive_verification
    assert spec.draft_model_config.hf_config.architectures == ["Qwen3ForCausalLM"]


def test_other_methods_need_k_and_their_own_drafter():
    with pytest.raises(CalibError, match="--num-speculative-tokens is needed for --method draft_model"):
        resolve_options(opts(draft=SMALL_DRAFT, method="draft_model"))
    with pytest.raises(CalibError, match="not a DSpark drafter") as err:
        resolve_options(opts(draft=SMALL_DRAFT, method="dspark"))
    assert SMALL_DRAFT in str(err.value) and "--method dspark" in str(err.value)
    with pytest.raises(CalibError, match=r"--method 'ngram': not supported \(n-gram drafts have no logits"):
        resolve_options(opts(method="ngram", num_speculative_tokens=3))


def test_cli_profile_refuses_a_method_it_does_not_price(tmp_path):
    res = run_cli("profile", "--model", MODEL, "--method", "suffix", "--out", str(tmp_path))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--method 'suffix': not supported" in res.stderr
    res = run_cli("profile", "--model", MODEL, "--method", "draft_model", "--out", str(tmp_path))
    assert res.returncode == 2 and "--draft is needed for --method draft_model" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_draft_must_be_dspark(tmp_path):
    with pytest.raises(CalibError, match="not a DSpark drafter") as err:
        resolve_options(opts(draft=MODEL))
    assert MODEL in str(err.value)


def test_path_without_config(tmp_path):
    with pytest.raises(CalibError, match="no config.json") as err:
        resolve_options(opts(model=str(tmp_path)))
    assert str(tmp_path) in str(err.value)


def test_env_for_engine_forces_v2_runner_and_capture(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    env = driver.engine_env(str(tmp_path))
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert env["DSPARK_CALIB_CAPTURE"] == str(tmp_path)
    assert env["VLLM_PLUGINS"] == "other,dspark_calib"
    # tp 1 too: the engine core is a child process (nothing of the CLI beside the timed steps)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    o = resolve_options(opts(context_lens=(8192,)))
    assert not driver.engine_in_process(o, env)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the user's debugging choice is kept
    assert driver.engine_in_process(o, driver.engine_env(str(tmp_path)))


def test_explain_the_captures_own_line_from_the_engine_core(tmp_path):
    # The engine core (a child process) left the capture's one line; vLLM's parent only saw a dead core.
    (tmp_path / "refusal.txt").write_text("dspark-calib: dspark_calib.fit and vLLM's set_initial_cost_curves "
                                          "disagree at context 8192")
    msg = str(explain_failure(RuntimeError("Engine core initialization failed. See root cause above."), str(tmp_path)))
    assert msg.startswith("dspark_calib.fit and vLLM's") and "refused" not in msg


def test_explain_refusal_and_oom(tmp_path):
    (tmp_path / "refusal.txt").write_text("Adaptive verification replays decode cudagraphs ... FLASHINFER allows none.")
    msg = str(explain_failure(RuntimeError("Engine core initialization failed"), str(tmp_path)))
    assert msg.startswith("vLLM refused adaptive verification") and "FLASHINFER" in msg
    (tmp_path / "refusal.txt").unlink()
    oom = RuntimeError("wrapper")
    oom.__cause__ = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    msg = str(explain_failure(oom, str(tmp_path)))
    assert "--max-num-seqs" in msg and "--gpu-memory-utilization" in msg
    died = str(explain_failure(RuntimeError("EngineCore died unexpectedly"), str(tmp_path)))
    assert "no table written" in died and "\n" not in died


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dspark_calib", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.slow
def test_cli_profile_without_gpu_is_one_line(tmp_path):
    out = tmp_path / "t.parquet"
    res = run_cli("profile", "--model", MODEL, "--draft", DRAFT, "--out", str(out))
    assert res.returncode == 2
    errors = [l for l in res.stderr.splitlines() if l.startswith("dspark-calib: error:")]
    assert len(errors) == 1 and errors[0].startswith("dspark-calib: error: no GPU visible (")
    assert errors[0].endswith("profiling needs the GPUs the engine will serve on")
    assert "Traceback" not in res.stderr and not out.exists()


def test_cli_profile_without_vllm(tmp_path):
    # A `vllm` that cannot be imported, as on a laptop without the extra.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "vllm.py").write_text("raise ImportError('No module named vllm')\n")
    # ray: GPUs are not counted on this node, so the run gets as far as importing vllm
    res = run_cli("profile", "--model", MODEL, "--draft", DRAFT, "--out", str(tmp_path),
                  "--distributed-executor-backend", "ray", env={"PYTHONPATH": str(shadow)})
    assert res.returncode == 2
    assert "in the dspark-calib checkout, pip install '.[vllm]'" in res.stderr
    assert "Traceback" not in res.stderr and list(tmp_path.glob("*.parquet")) == []


def test_cli_profile_rejects_non_dspark_draft(tmp_path):
    res = run_cli("profile", "--model", MODEL, "--draft", MODEL, "--out", str(tmp_path))
    assert res.returncode == 2 and "not a DSpark drafter" in res.stderr and MODEL in res.stderr


# -- issue 10 item 6 / issue 7: everything checked before the engine starts ----------------------
from dspark_calib.cli import profile as profile_cmd  # noqa: E402
from dspark_calib.fit import profile_context_len  # noqa: E402

RANGES = dict(context_len=[8192], max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
              replays=20, warmup=2, tp=1, num_speculative_tokens=None, max_model_len=None, load_format="dummy",
              distributed_executor_backend=None, cooldown=1.0)


@pytest.mark.parametrize("change,option", [
    ({"context_len": [8192, 0]}, "--context-len"), ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"), ({"gpu_memory_utilization": 2.5}, "--gpu-memory-utilization"),
    ({"gpu_memory_utilization": 0.0}, "--gpu-memory-utilization"), ({"replays": 0}, "--replays"),
    ({"warmup": -1}, "--warmup"), ({"tp": 0}, "--tp"), ({"num_speculative_tokens": 0}, "--num-speculative-tokens"),
    ({"max_model_len": 0}, "--max-model-len"), ({"load_format": "pt"}, "--load-format"),
    ({"distributed_executor_backend": "uni"}, "--distributed-executor-backend"), ({"cooldown": -0.1}, "--cooldown"),
    ({"cooldown": 60.5}, "--cooldown"), ({"cooldown": float("nan")}, "--cooldown"),
    ({"gpu_state": "idle"}, "--gpu-state"), ({"gpu_state": "serving", "settle": 120.5}, "--settle"),
    ({"gpu_state": "serving"}, "--cooldown: the serving state settles"),  # RANGES gives --cooldown
    ({"settle": 2.0}, "--settle: only the serving state")])
def test_ranges_refused_naming_the_option(change, option):
    with pytest.raises(CalibError) as err:
        profile_cmd.check_ranges(**{**RANGES, **change})
    assert str(err.value).startswith(option) and "\n" not in str(err.value)
    profile_cmd.check_ranges(**{**RANGES, "gpu_memory_utilization": 1.0, "warmup": 0})  # the edges are fine
    for edge in (0.0, 60.0):
        profile_cmd.check_ranges(**{**RANGES, "cooldown": edge})
    for edge in (0.0, 120.0):
        assert profile_cmd.check_ranges(**{**RANGES, "cooldown": None, "gpu_state": "serving", "settle": edge}) \
            == (1.0, edge)  # the plan's (cooldown_s, settle_s); an option left out is its default


def test_out_checked_at_once(tmp_path):
    target, _ = profile_cmd.check_out(str(tmp_path))
    assert target.is_dir and target.given == str(tmp_path)  # the table's default name goes inside
    target, log = profile_cmd.check_out(str(tmp_path / "t.parquet"))
    assert not target.is_dir and log == str(tmp_path / "t.vllm.log")
    new = tmp_path / "new"
    target, _ = profile_cmd.check_out(f"{new}/")
    assert not new.exists()  # made when the engine is about to start, not by a check
    assert target.make_directory() and new.is_dir()  # the directory itself; parents are not made
    for bad, words in ((tmp_path / "a" / "b" / "t.parquet", "does not exist"), (f"{tmp_path}/x/y/", "does not exist"),
                       ("/proc/t.parquet", "cannot write"), ("", "empty")):
        with pytest.raises(CalibError, match=words) as err:
            profile_cmd.check_out(str(bad))
        assert str(bad) in str(err.value)
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(CalibError, match="directory or a .parquet"):
        profile_cmd.check_out(str(tmp_path / "notes.txt"))
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert not list(tmp_path.glob(".dspark-calib-probe-*"))  # the write probe leaves nothing


def test_engine_args_parse_json_or_string(tmp_path):
    f = tmp_path / "args.json"
    f.write_text('{"block-size": 16, "enforce_eager": false}')
    got = profile_cmd.parse_engine_args(
        ["block_size=32", "attention_backend=TRITON_ATTN", "hf_overrides={\"rope_theta\": 1e6}", "enforce-eager=true",
         "revision=1.0"], str(f))
    assert got == {"block_size": 32, "attention_backend": "TRITON_ATTN", "hf_overrides": {"rope_theta": 1e6},
                   "enforce_eager": True, "revision": 1.0}
    assert profile_cmd.parse_engine_args([], '{"block_size": 64}') == {"block_size": 64}
    for pairs, js, words in ((["block_size"], None, "KEY=VALUE"), (["=3"], None, "KEY=VALUE"),
                             ([], "[1]", "JSON object"), ([], "{oops", "not JSON"),
                             ([], str(tmp_path / "missing.json"), "missing.json: no such file")):
        with pytest.raises(CalibError, match=words):
            profile_cmd.parse_engine_args(pairs, js)


def test_engine_args_checked_against_vllms_engineargs():
    from vllm.engine.arg_utils import EngineArgs

    driver.check_engine_args({"block_size": 32, "attention_backend": "TRITON_ATTN",
                              "speculative_config": {"attention_backend": "TRITON_ATTN"}})
    for extra, words in (({"blok_size": 32}, "blok_size: not a vLLM EngineArgs field"),
                         ({"max_num_seqs": 3}, "set it with --max-num-seqs"),
                         ({"speculative_config": {"num_speculative_tokens": 3}}, "num_speculative_tokens is set"),
                         ({"speculative_config": "x"}, "JSON object")):
        with pytest.raises(CalibError, match=words) as err:
            driver.check_engine_args(extra)
        assert str(err.value).startswith("--engine-arg ")
    # Passed through to vLLM, speculative_config merged under ours.
    kw = engine_kwargs(resolve_options(opts(extra_engine_args={
        "block_size": 32, "enforce_eager": False, "speculative_config": {"attention_backend": "TRITON_ATTN"}})))
    assert kw["block_size"] == 32 and kw["speculative_config"]["attention_backend"] == "TRITON_ATTN"
    assert kw["speculative_config"]["method"] == "dspark"
    assert EngineArgs(**kw).create_model_config().max_model_len == 40960


def test_dtypes_from_vllms_own_choices():
    import typing

    from vllm.config.cache import CacheDType
    from vllm.config.model import ModelDType

    from dspark_calib.fingerprint import RESOLVED_DTYPES, VLLM_MODEL_DTYPES

    assert VLLM_MODEL_DTYPES == typing.get_args(ModelDType)  # profile refuses a typo before importing vllm
    assert set(RESOLVED_DTYPES) <= set(typing.get_args(ModelDType))
    for dtype in typing.get_args(ModelDType):
        driver.check_dtypes(opts(dtype=dtype))
    for kv in typing.get_args(CacheDType):
        driver.check_dtypes(opts(kv_cache_dtype=kv))
    with pytest.raises(CalibError, match="--dtype 'bogus'"):
        driver.check_dtypes(opts(dtype="bogus"))
    with pytest.raises(CalibError, match="--kv-cache-dtype 'fp7'"):
        driver.check_dtypes(opts(kv_cache_dtype="fp7"))


def test_context_len_vllm_would_clamp_is_refused():
    with pytest.raises(CalibError) as err:
        resolve_options(opts(context_lens=(8192,), max_model_len=4096))
    msg = str(err.value)
    # 8192 tokens over 256 requests: 32 query tokens each; vLLM's clamp gives 4096 - 32.
    assert f"profiled by vLLM at {profile_context_len(8192, 4096, 32)}" in msg and "--max-model-len >= 8224" in msg
    o = resolve_options(opts(context_lens=(4064,), max_model_len=4096))  # exactly what vLLM keeps
    assert o.max_model_len == 4096


@pytest.mark.parametrize("max_model_len, batched, seqs, expected", [
    (None, 8192, 256, (1024, 8192, 40928)),  # the model config's 40960, 32 query tokens per request
    (32768, 8192, 256, (1024, 8192, 32736)),
    (4096, 8192, 256, (1024, 4064)),
    (8224, 8192, 256, (1024, 8192)),  # 8192 is exactly the longest vLLM keeps
    (2048, 2048, 1024, (1024, 2046)),
])
def test_the_default_contexts_reach_max_model_len(max_model_len, batched, seqs, expected):
    """Without --context-len, profile's contexts end at the longest context vLLM profiles under the
    engine's max_model_len (its own clamp for the largest batch), so the engine's longest contexts are
    within the table, not above it."""
    from vllm.engine.arg_utils import EngineArgs

    o = resolve_options(opts(context_lens=(), max_model_len=max_model_len, max_num_batched_tokens=batched,
                             max_num_seqs=seqs))
    assert o.context_lens == expected
    vllm_len = EngineArgs(**engine_kwargs(o)).create_model_config().max_model_len
    query_len = -(-batched // min(seqs, batched))
    assert profile_context_len(o.context_lens[-1], vllm_len, query_len) == o.context_lens[-1]  # vLLM keeps it
    assert o.context_lens[-1] + query_len == vllm_len  # and none longer would be kept


def test_the_cli_leaves_the_contexts_to_the_default():
    from dspark_calib.cli.app import profile_cmd

    assert inspect.signature(profile_cmd).parameters["context_len"].default == []


def _fake_hub(cache, repo, config_dir):
    snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(open(os.path.join(config_dir, "config.json")).read())
    (cache / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
    (cache / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text("abc123")
    return snap


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snap = _fake_hub(tmp_path, "Qwen/Qwen3-8B", MODEL)
    assert driver.resolve_model("Qwen/Qwen3-8B", "--model") == (str(snap), "Qwen/Qwen3-8B")
    assert driver.resolve_model(MODEL, "--model") == (MODEL, None)
    with pytest.raises(CalibError, match="not in the local Hugging Face cache") as err:
        driver.resolve_model("Qwen/Qwen3-32B", "--model")
    assert "--model Qwen/Qwen3-32B" in str(err.value) and str(tmp_path) in str(err.value)
    with pytest.raises(CalibError, match="no such directory"):
        driver.resolve_model("./nope", "--draft")


def test_fingerprint_records_resolved_engine_values():
    """What the capture's engine dict says (read through the registry) is what the table records."""
    from tests.vllm.test_engine_info import HARDWARE, build_config

    from dspark_calib.vllm.engine_info import describe_engine

    o = resolve_options(opts(context_lens=(8192,), extra_engine_args={"block_size": 32}, model_name="Qwen/Qwen3-8B"))
    cfg = build_config(cache={"block_size": 32})
    engine = describe_engine(None, [1, 2, 4], cfg, hardware_facts=HARDWARE)
    schedule = {"vllm_replays_per_block": 5, "warmup_blocks": 1, "timed_blocks": 4, "timed_replays_per_size": 20}
    fp = profile_table.fingerprint_from_capture(o, {"engine": engine, "hardware": HARDWARE, "cudagraph_limit": 4,
                                             "schedule": schedule, "cooldown": {"seconds": 1.0, "total_s": 1.75,
                                                                                "pauses": 4, "early_exits": 3},
                                             "launch": driver.launch_of(o)})  # as run_engine adds it
    assert (fp.extra["cooldown_s"], fp.extra["cooldown_total_s"]) == (1.0, 1.75)
    assert (fp.replays, fp.warmup_replays) == (20, 5)  # what the worker ran: whole blocks of vLLM's 5
    assert fp.kv_block_size == 32 and fp.max_model_len == 32768 and fp.gpu_memory_mib == 143771
    assert fp.target_model == "Qwen3-8B" and fp.extra["engine_args"] == {"block_size": 32}
    assert fp.compilation_hash == engine["compilation_hash"] and fp.torch_version == "2.14.0+cu130"
    # the config sections vLLM's own hash covers, and the library builds, as the worker read them
    for key in ("attention_config_hash", "kernel_config_hash", "offload_config_hash", "kv_connector",
                "additional_config_hash"):
        assert getattr(fp, key) == engine[key] and engine[key]
    build = profile_table.fingerprint_from_capture(o, {"engine": engine, "cudagraph_limit": 4, "schedule": schedule,
                                                       "hardware": {**HARDWARE, "cudnn_version": "92400",
                                                                    "flashinfer_version": "none"}})
    assert (build.cudnn_version, build.flashinfer_version) == ("92400", "none")
    with pytest.raises(CalibError, match="did not report vllm_version"):
        profile_table.fingerprint_from_capture(o, {"engine": {k: v for k, v in engine.items() if k != "vllm_version"},
                                            "hardware": {}, "cudagraph_limit": 4, "schedule": schedule})
    with pytest.raises(CalibError, match="no schedule"):
        profile_table.fingerprint_from_capture(o, {"engine": engine, "hardware": HARDWARE, "cudagraph_limit": 4})


def test_engine_output_goes_to_the_log(tmp_path):
    code = ("import os, subprocess, sys\n"
            "from dspark_calib.cli.profile import output_to\n"
            f"with output_to({str(tmp_path / 'v.log')!r}):\n"
            "    print('from python'); print('to stderr', file=sys.stderr)\n"
            "    subprocess.run(['sh', '-c', 'echo from a worker; echo worker err >&2'])\n"
            "print('back on the terminal')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.stdout == "back on the terminal\n" and res.stderr == ""
    assert (tmp_path / "v.log").read_text().split() == "from python to stderr from a worker worker err".split()


def test_cli_profile_early_errors_are_one_line_and_fast(tmp_path):
    for args, words in ((["--context-len", "0"], "--context-len must be >= 1, got 0"),
                        (["--gpu-memory-utilization", "2.5"], "--gpu-memory-utilization must be in (0, 1]"),
                        (["--out", "/nonexistent/dir/t.parquet"], "/nonexistent/dir/t.parquet"),
                        (["--engine-arg", "nonsense"], "expected KEY=VALUE"),
                        (["--cooldown", "61"], "--cooldown must be between 0 and 60 seconds, got 61.0")):
        res = run_cli("profile", "--model", MODEL, "--draft", DRAFT, "--out", str(tmp_path), *args)
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [f"dspark-calib: error: {res.stderr.split('error: ', 1)[1].strip()}"]
        assert words in res.stderr and "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, no log left


@pytest.mark.slow
def test_cli_profile_unknown_engine_arg_and_missing_hub_model(tmp_path):
    res = run_cli("profile", "--model", MODEL, "--draft", DRAFT, "--out", str(tmp_path), "--engine-arg", "blok_size=3",
                  "--distributed-executor-backend", "ray")  # ray: no GPU counted on this node
    assert res.returncode == 2 and "--engine-arg blok_size: not a vLLM EngineArgs field" in res.stderr
    assert "Traceback" not in res.stderr and list(tmp_path.iterdir()) == []
    res = run_cli("profile", "--model", "nobody/no-such-model", "--draft", DRAFT, "--out", str(tmp_path),
                  env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert res.returncode == 2 and "--model nobody/no-such-model: not a directory, and not in the local Hugging Face cache" \
        in res.stderr


# -- the driver over the real capture side: an in-process "engine" that runs the plugin ----------
import vllm  # noqa: E402

from dspark_calib.vllm import capture as capture_mod, plugin  # noqa: E402
from dspark_calib.vllm import runtime
from dspark_calib.vllm.capture import CaptureDir, vllm_curves  # noqa: E402


@pytest.fixture
def engine_stand_in(monkeypatch):
    """vllm.LLM replaced by what an in-process engine does at start-up: vLLM's own (patched)
    batches_to_profile and set_initial_cost_curves on a manager, timings made up per batch."""
    import tests.vllm.test_capture as tc
    from vllm.v1.worker.gpu import model_runner  # imported: register() patches at once

    for key in list(os.environ):
        if key.startswith(("DSPARK_CALIB_", "VLLM_RAY_EXTRA_")):
            monkeypatch.delenv(key)
    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setattr(plugin, "_announced", set())
    tc.use_group(monkeypatch, tc.Group())
    seen: list[dict] = []

    class LLM:
        def __init__(self, **kw):
            directory = os.environ["DSPARK_CALIB_CAPTURE"]
            seen.append({"kw": kw, "env": dict(os.environ), "driver_locked": CaptureDir(directory).locked,
                         "free_elsewhere": tc._can_lock_elsewhere(directory)})
            if (kw["tensor_parallel_size"] != 1 or kw.get("distributed_executor_backend") == "mp"
                    or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0"):
                raise RuntimeError("EngineCore died unexpectedly")  # workers of their own: not run here
            m = tc.make_manager()
            batches = list(m.batches_to_profile(list(tc.SIZES)))
            m.set_initial_cost_curves(tc.random_samples(batches))

    monkeypatch.setattr(vllm, "LLM", LLM)
    yield seen
    plugin.unpatch(tc.av.AdaptiveVerificationManager, model_runner)
    for path in list(capture_mod._HELD):
        os.close(capture_mod._HELD.pop(path))


def _profile_in_process(tmp_path, monkeypatch, **kw):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the stand-in LLM runs its worker in this process
    o = resolve_options(opts(context_lens=(1024, 8192), **kw))
    lines: list[str] = []
    d = tmp_path / f"cap{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    cap = driver.run_engine(o, str(d), lambda s: None, lambda s: None, note=lines.append)
    return o, cap, lines, d


@pytest.mark.slow
def test_tp1_in_process_capture_to_table_and_env_restored(engine_stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "FOO_")  # the user's own
    monkeypatch.setenv("DSPARK_CALIB_TABLE", "/some/table.parquet")  # profiling never loads it
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process only when the user asks for it
    before = dict(os.environ)
    for run in range(2):  # a second profile in the same process starts from the same env
        o, cap, lines, d = _profile_in_process(tmp_path, monkeypatch, replays=3, warmup=0)
        assert dict(os.environ) == before
        during = engine_stand_in[-1]["env"]
        assert during["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "FOO_,DSPARK_CALIB_"  # register() added ours once
        assert "DSPARK_CALIB_CAPTURE" in during["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"].split(",")
        assert "DSPARK_CALIB_TABLE" not in during and during["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        # in process the driver holds the directory; the worker's lock() re-entered it
        assert engine_stand_in[-1]["driver_locked"] and not engine_stand_in[-1]["free_elsewhere"]
        assert not CaptureDir(d).locked  # released: the directory is free again
        assert len(lines) == 1 and "5 samples per size (--replays 3 rounded up" in lines[0] and "estimate" in lines[0]
        table = profile_table.table_from_capture(o, cap)
        fp = table.fingerprint
        assert (fp.replays, fp.warmup_replays, fp.extra["replays_asked"]) == (5, 0, 3)
        assert fp.extra["vllm_curves_equal"] is True and table.context_lens() == [1024, 8192]
        assert all(n == 5 for n in table.curves[8192].verify.n)
        import tests.vllm.test_capture as tc

        for ctx in (1024, 8192):  # vLLM's own set_initial_cost_curves on the samples the table holds
            theirs = vllm_curves(tc.VLLM_ORIGINAL["set_initial_cost_curves"],
                                 [tc.StepTimingSample(forward_ms=s.forward_ms, drafter_ms=s.drafter_ms,
                                                      num_target_tokens=s.num_target_tokens, num_reqs=s.num_reqs,
                                                      full_cudagraph=s.full_cudagraph) for s in table.iter_samples(ctx)])
            assert table.curves[ctx].as_vllm() == theirs


@pytest.mark.slow
def test_driver_checks_the_table_against_vllms_curves(engine_stand_in, tmp_path, monkeypatch):
    o, cap, _, _ = _profile_in_process(tmp_path, monkeypatch, replays=5, warmup=5)
    assert profile_table.table_from_capture(o, cap).fingerprint.warmup_replays == 5
    assert "shape_samples" not in profile_table.table_from_capture(o, cap).fingerprint.extra
    shaped = {**cap, "shape_samples": [dict(s, num_reqs=1) for s in cap["samples"][:6]]}
    with_shapes = profile_table.table_from_capture(o, shaped)  # counted, never in a curve
    assert with_shapes.fingerprint.extra["shape_samples"] == 6
    assert with_shapes.curves[8192].as_vllm() == profile_table.table_from_capture(o, cap).curves[8192].as_vllm()
    bent = json.loads(json.dumps(cap))
    bent["vllm_curves"]["8192"]["verify"][3][1] *= 1.001
    with pytest.raises(CalibError) as err:
        profile_table.table_from_capture(o, bent)
    assert "disagree at context 8192" in str(err.value) and "verify size" in str(err.value)
    assert not str(err.value).startswith("dspark-calib:")
    short = json.loads(json.dumps(cap))
    del short["vllm_curves"]["1024"]
    with pytest.raises(CalibError, match=r"contexts \[8192\], the table \[1024, 8192\]"):
        profile_table.table_from_capture(o, short)
    missing = json.loads(json.dumps(cap))
    missing["samples"].pop()
    with pytest.raises(CalibError, match="holds 4 samples for size .* its schedule 5"):
        profile_table.table_from_capture(o, missing)


def test_driver_does_not_take_the_lock_when_workers_are_other_processes(engine_stand_in, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    before = dict(os.environ)
    for kw, env in (({"tp": 2}, {}), ({"tp": 1}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
                    ({"tp": 1, "distributed_executor_backend": "mp"}, {})):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        o = resolve_options(opts(context_lens=(8192,), **kw))
        with pytest.raises(CalibError, match="no table written"):
            driver.run_engine(o, str(tmp_path), lambda s: None, lambda s: None)
        seen = engine_stand_in[-1]
        assert not seen["driver_locked"] and seen["free_elsewhere"]  # rank 0, elsewhere, can take it
        for k in env:
            monkeypatch.delenv(k)
        assert dict(os.environ) == before


def test_expected_schedule_is_the_workers(tmp_path):
    """The driver's plan line and progress come from capture.Schedule over vLLM's own sequence."""
    import tests.vllm.test_capture as tc

    from dspark_calib.vllm.capture import Plan, Schedule
    from dspark_calib.vllm.profile.plan import default_capture_sizes, expected

    o = resolve_options(opts(context_lens=(1024, 8192), replays=20, warmup=2))
    # vLLM's own resolution on the H200 (Qwen3-8B, 256 seqs, k 7, 8192 tokens), as the capture recorded it
    with open(os.path.join(ROOT, "benchmarks", "results", "h200", "2026-11-30-fidelity", "fid-product-a-samples-rank0.json")) as fh:
        assert default_capture_sizes(o) == json.load(fh)["engine"]["cudagraph_capture_sizes"]
    e = expected(o, tc.SIZES)
    want = Schedule.build(Plan((1024, 8192), 20, 2), tc.vllm_sequence())
    assert e.schedule == want and (e.blocks, e.samples_per_size) == (5, 20)
    per_block = len(tc.vllm_sequence())
    pos = e.position({"done": 5 * per_block + 2 * per_block + 3, "total": len(want.tags), "context_len": 8192})
    assert (pos["block"], pos["blocks"], pos["warmup"]) == (3, 5, False)
    assert e.position({"done": 5 * per_block, "total": len(want.tags), "context_len": 8192})["warmup"] is True
    assert e.seconds > 0 and "samples per size" in e.line(20) and "rounded" not in e.line(20)


def test_expected_schedule_with_shape_blocks_is_the_workers_and_the_progress_names_them():
    """--shape-replays: the driver's schedule is the worker's (k + 1 from the options, max_num_seqs
    requests at most), the plan line says so, and progress places a step in its block or in the
    context's shape block."""
    import tests.vllm.test_capture as tc

    from dspark_calib.vllm.capture import Plan, Schedule
    from dspark_calib.vllm.profile.plan import expected

    o = resolve_options(opts(context_lens=(1024, 8192), replays=5, warmup=0, shape_replays=3))
    e = expected(o, tc.SIZES)
    want = Schedule.build(Plan((1024, 8192), 5, 0, shape_replays=3), tc.vllm_sequence(), 8, 256, tc.SIZES[-1])
    assert e.schedule == want and e.shape_steps == sum(t.shape for t in want.tags) > 0
    assert "then a shape block per context" in e.line(5)
    per_ctx = len(want.tags) // 2
    regular = per_ctx - e.shape_steps // 2
    at = lambda done: e.position({"done": done, "total": len(want.tags), "context_len": 1024})  # noqa: E731
    assert (at(0)["block"], at(0)["shape"]) == (1, False)
    assert at(regular)["shape"] is True and at(per_ctx - 1)["shape"] is True
    assert (at(per_ctx)["block"], at(per_ctx)["shape"]) == (1, False)  # the next context's first block


def test_the_estimate_says_it_models_dspark_for_other_methods():
    """A draft-model profile ran 4.7x the estimate on an H200: the line says whose step it models."""
    import tests.vllm.test_capture as tc

    from dspark_calib.vllm.profile.plan import expected

    dspark = expected(resolve_options(opts(context_lens=(1024,))), tc.SIZES).line(20)
    draft = expected(resolve_options(opts(context_lens=(1024,), method="draft_model", draft=SMALL_DRAFT,
                                          num_speculative_tokens=7)), tc.SIZES).line(20)
    assert "one-pass drafter" not in dspark
    assert draft.startswith(dspark) and "a draft_model drafter runs K passes a step" in draft


def test_the_estimate_says_no_k_passes_for_a_one_pass_drafter():
    """DFlash proposes its K drafts in one pass over K masked positions, as DSpark does: the line
    claims no K passes for it."""
    import tests.vllm.test_capture as tc

    from dspark_calib.vllm.profile.plan import expected

    dflash = expected(resolve_options(opts(context_lens=(1024,), method="dflash", draft=DFLASH_DRAFT,
                                           num_speculative_tokens=15)), tc.SIZES).line(20)
    assert dflash.startswith("profile plan: ") and "passes a step" not in dflash and "one-pass" not in dflash


def test_estimate_includes_the_cooldown(tmp_path):
    import tests.vllm.test_capture as tc

    from dspark_calib.vllm.profile.plan import expected

    off = expected(resolve_options(opts(context_lens=(1024, 8192), replays=20, warmup=2, cooldown_s=0)), tc.SIZES)
    on = expected(resolve_options(opts(context_lens=(1024, 8192), replays=20, warmup=2, cooldown_s=2.0)), tc.SIZES)
    assert on.schedule == off.schedule and off.cooldown_s == 0 and "cool-down" not in off.line(20)
    assert on.cooldown_s == 2.0 * (2 * 5 - 1)  # before every block but the capture's first, across contexts
    assert on.seconds == pytest.approx(off.seconds + on.cooldown_s) and "18 s of it cool-down" in on.line(20)


def test_estimate_includes_the_settle_before_every_block():
    import tests.vllm.test_capture as tc

    from dspark_calib.vllm.profile.plan import expected

    startup = expected(resolve_options(opts(context_lens=(1024, 8192), settle_s=2.0)), tc.SIZES)
    serving = expected(resolve_options(opts(context_lens=(1024, 8192), gpu_state="serving", settle_s=2.0)), tc.SIZES)
    assert serving.schedule == startup.schedule and startup.settle_s == 0 and serving.cooldown_s == 0
    assert serving.settle_s == 2.0 * 2 * 5  # before every block, the capture's first included
    assert serving.seconds == pytest.approx(startup.seconds - startup.cooldown_s + serving.settle_s)
    line = serving.line(20)
    assert "20 s of it settling under load before each block" in line and "cool-down" not in line


class Ticking:
    """gpu_state's clock for a whole engine run: each look at it is 0.125 s later (a heavy step)."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        self.t += 0.125
        return self.t


@pytest.mark.slow
def test_gpu_state_reaches_the_plan_and_the_table(engine_stand_in, tmp_path, monkeypatch):
    """--gpu-state serving --settle through typer, profile_cmd and ProfileOptions; plan.json carries
    them; the worker settles before each block; the table records the state in its fingerprint and
    the settle in its extra; a rebuild with another state is refused naming the key."""
    from typer.testing import CliRunner

    from dspark_calib.cli.app import app
    from dspark_calib.vllm import gpu_state

    seen = []
    monkeypatch.setattr(profile_cmd, "_run", lambda o, *a, **k: seen.append(o))
    monkeypatch.setattr(driver, "check_before_import", lambda o: None)  # no GPU here
    res = CliRunner().invoke(app, ["profile", "--model", MODEL, "--draft", DRAFT, "--out", str(tmp_path),
                                   "--gpu-state", "serving", "--settle", "0.5"])
    assert res.exit_code == 0 and (seen[0].gpu_state, seen[0].settle_s, seen[0].cooldown_s) == ("serving", 0.5, 1.0)
    monkeypatch.setattr(gpu_state, "CLOCK", gpu_state.Clock(sleep=lambda s: None, now=Ticking().now))
    o, cap, lines, _ = _profile_in_process(tmp_path, monkeypatch, replays=5, warmup=0, gpu_state="serving",
                                           settle_s=0.5)
    assert cap["plan"]["gpu_state"] == "serving" and "cooldown" not in cap
    # begin() looks once, then one look a step: 3 steps reach 0.5 s
    assert cap["settle"] == {"seconds": 0.5, "total_s": 1.0, "settles": 2, "steps": 6, "early_exits": 0}
    assert "settling under load" in lines[0]
    fp = profile_table.table_from_capture(o, cap).fingerprint
    assert fp.gpu_state == "serving" and (fp.extra["settle_s"], fp.extra["settle_total_s"]) == (0.5, 1.0)
    assert fp.extra["settle_steps"] == 6 and "cooldown_s" not in fp.extra
    with pytest.raises(CalibError, match="^gpu_state: the options give 'startup', the capture recorded 'serving'"):
        profile_table.check_capture_options(dataclasses.replace(o, gpu_state="startup"), cap)


@pytest.mark.slow
def test_cooldown_reaches_the_plan_and_the_table(engine_stand_in, tmp_path, monkeypatch):
    """--cooldown through typer, profile_cmd and ProfileOptions; run_engine writes it into plan.json;
    the table's fingerprint extra records it and what the worker spent."""
    from typer.testing import CliRunner

    from dspark_calib.cli.app import app

    seen = []
    monkeypatch.setattr(profile_cmd, "_run", lambda o, *a, **k: seen.append(o))
    monkeypatch.setattr(driver, "check_before_import", lambda o: None)  # no GPU here
    res = CliRunner().invoke(app, ["profile", "--model", MODEL, "--draft", DRAFT, "--out", str(tmp_path),
                                   "--cooldown", "0.5"])
    assert res.exit_code == 0 and seen[0].cooldown_s == 0.5
    o, cap, lines, _ = _profile_in_process(tmp_path, monkeypatch, replays=5, warmup=0, cooldown_s=0.5)
    assert cap["plan"]["cooldown_s"] == 0.5 and cap["cooldown"]["pauses"] == 1  # two contexts, one block each
    assert "cool-down" in lines[0]
    extra = profile_table.table_from_capture(o, cap).fingerprint.extra
    assert extra["cooldown_s"] == 0.5 and 0 < extra["cooldown_total_s"] <= 0.5


def test_terminal_shows_the_plan_line_and_the_schedule_in_the_bar(tmp_path, monkeypatch, capfd):
    import glob

    from dspark_calib.table.file import read_table

    shipped = read_table(sorted(glob.glob(os.path.join(ROOT, "profiles", "h200", "*.parquet")))[0])
    seen = []

    def fake_run_profile(o, *, phase, report, keep_capture, log_path, note):
        phase("starting engine: load, compile, capture CUDA graphs, profile")
        note("profile plan: 1 context(s) x ~56 sizes ...")
        report({"done": 300, "total": 1400, "context_len": 8192, "block": 2, "blocks": 5, "warmup": False,
                "samples_per_size": 20, "vllm_replays": 5})
        seen.append(True)
        return shipped

    monkeypatch.setattr(driver, "run_profile", fake_run_profile)
    out, log = profile_cmd.check_out(str(tmp_path / "t.parquet"))
    profile_cmd._run(resolve_options(opts(context_lens=(8192,))), out, log, None)
    err = capfd.readouterr().err
    assert seen and "profile plan: 1 context(s)" in err
    assert f"{shipped.fingerprint.replays} samples per size" in err and "curves equal vLLM's own" in err


def test_library_callers_get_the_cooldown_range_as_one_calib_error():
    with pytest.raises(CalibError, match="cooldown_s must be between 0 and 60 seconds, got 90"):
        resolve_options(opts(cooldown_s=90.0))


# -- profile --from-capture: the table of a kept capture, without the GPU ------------------------
def _profile_and_keep(tmp_path, monkeypatch):
    """run_profile over the stand-in engine, keeping the capture as `profile --keep-capture` does;
    its timings quiet enough for the read checks (a spread under the median)."""
    import numpy as np

    import tests.vllm.test_capture as tc

    def quiet(batches):
        rng = np.random.default_rng(0)
        return [tc.StepTimingSample(forward_ms=1 + 0.01 * b["num_tokens"] + b["context_len"] / 1000 + rng.uniform(0, 0.1),
                                    drafter_ms=1 + 0.002 * min(b["num_tokens"], 256) + rng.uniform(0, 0.1),
                                    num_target_tokens=b["num_tokens"], num_reqs=min(b["num_tokens"], 256),
                                    full_cudagraph=b["num_tokens"] <= tc.SIZES[-1]) for b in batches]

    monkeypatch.setattr(tc, "random_samples", quiet)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(driver, "preflight", lambda o: None)  # no GPU here
    kept = tmp_path / "kept"
    table = driver.run_profile(opts(context_lens=(1024, 8192), replays=5, warmup=5), keep_capture=str(kept))
    return table, kept / "samples-rank0.json"


def rebuild(capture, *args):
    from typer.testing import CliRunner

    from dspark_calib.cli.app import app

    return CliRunner().invoke(app, ["profile", "--model", MODEL, "--draft", DRAFT, "--context-len", "1024",
                                    "--context-len", "8192", "--replays", "5", "--warmup", "5",
                                    "--from-capture", str(capture), *map(str, args)])


@pytest.mark.slow
def test_a_table_rebuilt_from_the_kept_capture_is_the_profiles_own(engine_stand_in, tmp_path, monkeypatch):
    """Curves, samples, telemetry and every fingerprint key as the GPU run's table; only created_at and
    extra.from_capture (the file and its sha256) differ, and with those the content hash is the same."""
    import dataclasses
    import hashlib

    import numpy as np

    from dspark_calib.fit import CURVE_COLUMNS, CURVE_KINDS
    from dspark_calib.table.file import read_table

    live, kept = _profile_and_keep(tmp_path, monkeypatch)
    res = rebuild(kept, "--out", tmp_path / "rebuilt.parquet")
    assert res.exit_code == 0, res.output
    assert f"from the capture {kept} (sha256" in " ".join(res.stderr.split())
    rebuilt = read_table(tmp_path / "rebuilt.parquet")
    for ctx in live.context_lens():
        for kind in CURVE_KINDS:
            for c in CURVE_COLUMNS:
                assert np.array_equal(getattr(rebuilt.curves[ctx].curve(kind), c), getattr(live.curves[ctx].curve(kind), c),
                                      equal_nan=True)
    assert rebuilt.samples_digest == live.samples_digest and rebuilt.telemetry == live.telemetry
    extra = dict(rebuilt.fingerprint.extra)
    source = extra.pop("from_capture")
    assert source == {"file": "samples-rank0.json", "sha256": hashlib.sha256(kept.read_bytes()).hexdigest()}
    assert extra == live.fingerprint.extra and extra["hostname"] == os.uname().nodename  # the capture's host
    assert "engine_start_s" in extra  # kept with the capture
    # what the driver started the engine with, kept with it too: the rebuild records the run's, not its own
    assert json.loads(kept.read_text())["launch"] == {"load_format": "dummy", "engine_args": {}}
    assert extra["load_format"] == "dummy" and "engine_args" not in extra
    same = dataclasses.replace(rebuilt, created_at=live.created_at, fingerprint=rebuilt.fingerprint.replace(extra=extra))
    assert same.content_hash == live.content_hash


@pytest.mark.slow
def test_a_rebuilt_table_names_the_gpu_host_of_the_capture(engine_stand_in, tmp_path, monkeypatch):
    from dspark_calib.table.file import read_table

    _, kept = _profile_and_keep(tmp_path, monkeypatch)
    capture = json.loads(kept.read_text())
    for host, recorded in (("h200-node-7", "h200-node-7"), (None, "unrecorded")):
        if host is None:
            del capture["hostname"]  # a capture from before captures named their host
        else:
            capture["hostname"] = host
        kept.write_text(json.dumps(capture))
        out = tmp_path / f"{recorded}.parquet"
        res = rebuild(kept, "--out", out)
        assert res.exit_code == 0, res.output
        assert read_table(out).fingerprint.extra["hostname"] == recorded


@pytest.mark.slow
@pytest.mark.parametrize("args, line", [
    (["--max-num-seqs", "128"], "max_num_seqs: the options give 128, the capture recorded 256"),
    (["--num-speculative-tokens", "5"], "num_speculative_tokens: the options give 5, the capture recorded 7"),
    (["--context-len", "16384"], "context_lens: the options give [1024, 8192, 16384], the capture recorded [1024, 8192]"),
    (["--replays", "20"], "replays: the options give 20, the capture recorded 5"),
    (["--dtype", "float16"], "dtype: the options give 'float16', the capture recorded 'bfloat16'"),
    (["--tp", "2"], "tensor_parallel_size: the options give 2, the capture recorded 1"),
    (["--model", DRAFT], "target_config_hash: the options give"),
])
def test_a_rebuild_with_other_options_than_the_capture_is_one_line(engine_stand_in, tmp_path, monkeypatch, args,
                                                                   line):
    from tests.helpers import one_line_error

    _, kept = _profile_and_keep(tmp_path, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    one_line_error(rebuild(kept, "--out", out, *args), str(kept), line, "rebuild with the options of the GPU run")
    assert list(out.iterdir()) == []


def test_a_rebuild_refuses_what_is_no_rank_0_capture(tmp_path):
    from tests.helpers import one_line_error

    cases = {"list.json": ([], "not a profile capture (a JSON object is expected)"),
             "plan.json": ({"context_lens": [8192]}, "not a profile capture rank 0 wrote (no engine, plan"),
             "junk.json": ("{", "not JSON")}
    for name, (data, line) in cases.items():
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        one_line_error(rebuild(path, "--out", tmp_path / "t.parquet"), str(path), line)
    from tests.helpers import DRAFT_MODEL_CAPTURE

    rank1 = {**json.loads(DRAFT_MODEL_CAPTURE.read_text()), "rank": 1}
    (tmp_path / "rank1.json").write_text(json.dumps(rank1))
    one_line_error(rebuild(tmp_path / "rank1.json", "--out", tmp_path / "t.parquet"), "is TP rank 1's capture")
    res = rebuild(tmp_path / "rank1.json", "--out", tmp_path / "t.parquet", "--keep-capture", tmp_path / "k")
    one_line_error(res, "--keep-capture: only a run that starts the engine uses it, and --from-capture starts none")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.json", "list.json", "plan.json", "rank1.json"]

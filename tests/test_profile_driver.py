"""The profile driver without a GPU: the engine arguments it builds, and its one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dspark_calib.errors import CalibError
from dspark_calib.vllm import profile as driver
from dspark_calib.vllm.profile import ProfileOptions, engine_kwargs, explain_failure, resolve_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "profiles", "configs", "qwen3-8b")
DRAFT = os.path.join(ROOT, "profiles", "configs", "dspark-qwen3-8b-block7")


def opts(**kw):
    base = dict(model=MODEL, draft=DRAFT, context_lens=(1024, 8192, 16384))
    base.update(kw)
    return ProfileOptions(**base)


def test_engine_args_accepted_by_vllm():
    """vLLM's own EngineArgs, ModelConfig and SpeculativeConfig accept what `profile` builds."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    kw = engine_kwargs(resolve_options(opts()))
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


def test_max_model_len_grows_with_context():
    o = resolve_options(opts(context_lens=(32768,)))
    assert o.max_model_len > 32768
    with pytest.raises(CalibError, match="max_model_len"):
        resolve_options(opts(context_lens=(40960,)))  # beyond the model's 40960 positions


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
    env = driver.engine_env(str(tmp_path), tp=1)
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert env["DSPARK_CALIB_CAPTURE"] == str(tmp_path)
    assert env["VLLM_PLUGINS"] == "other,dspark_calib"


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


def test_cli_profile_without_gpu_is_one_line(tmp_path):
    out = tmp_path / "t.parquet"
    res = run_cli("profile", "--model", MODEL, "--draft", DRAFT, "--out", str(out))
    assert res.returncode == 2
    errors = [l for l in res.stderr.splitlines() if l.startswith("dspark-calib: error:")]
    assert errors == ["dspark-calib: error: no CUDA GPU visible: profiling needs the GPUs the engine will serve on"]
    assert "Traceback" not in res.stderr and not out.exists()


def test_cli_profile_without_vllm(tmp_path):
    # A `vllm` that cannot be imported, as on a laptop without the extra.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "vllm.py").write_text("raise ImportError('No module named vllm')\n")
    res = run_cli("profile", "--model", MODEL, "--draft", DRAFT, "--out", str(tmp_path),
                  env={"PYTHONPATH": str(shadow)})
    assert res.returncode == 2
    assert "pip install 'dspark-calib[vllm]'" in res.stderr
    assert "Traceback" not in res.stderr and list(tmp_path.glob("*.parquet")) == []


def test_cli_profile_rejects_non_dspark_draft(tmp_path):
    res = run_cli("profile", "--model", MODEL, "--draft", MODEL, "--out", str(tmp_path))
    assert res.returncode == 2 and "not a DSpark drafter" in res.stderr and MODEL in res.stderr

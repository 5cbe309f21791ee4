"""What a table was profiled on, and which parts of that must agree: the key registry.

Every fingerprint key has one home, ``KEYS`` below (pyperf's ``_metadata.py`` is
the model): its type, how it is compared when a table is loaded (``EQUAL`` or
``RECORDED``), whether it must agree before two runs are merged, how
``inspect``/``diff``/the docs show it, and why. How each key is read from a
running engine is apart, in ``vllm/engine_info.READERS`` (pyperf's
``_collect_metadata.py``): every key with a load rule has a reader there. Adding
a key touches this module (the entry and the Fingerprint field), its reader and
its tests, nothing else.

Tables older than a key lack it: a key a table did not record (None, or "" for
strings) is not compared; the load decision names it "not recorded" at WARNING and goes
on, so the shipped 1.0 tables keep loading under ``fallback``.

Nothing here imports torch or vllm.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Mapping

from dspark_calib.errors import CalibError
from dspark_calib.fileformat.limits import MAX_CONTEXT_LEN, MAX_NUM_SEQS, MAX_STEP_TOKENS

BACKEND_VLLM = "vllm"
# Tables not measured by dspark-calib's own profiler (imported vLLM start-up
# profiles, hand-made fixtures): the plugin refuses them unless told otherwise.
BACKEND_REFERENCE = "reference"

EQUAL = "equal"  # the table's value must equal the engine's, or the table does not load
RECORDED = "recorded"  # compared, a difference is logged at WARNING, never blocks
LOAD_RULES = (EQUAL, RECORDED)
BLOCKING = (EQUAL,)


@dataclass(frozen=True)
class Fingerprint:
    backend: str
    gpu_name: str
    gpu_count: int
    gpu_compute_capability: str
    driver_version: str
    cuda_version: str
    torch_version: str
    vllm_version: str
    target_model: str
    target_config_hash: str
    draft_model: str
    draft_config_hash: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    dtype: str
    kv_cache_dtype: str
    quantization: str | None
    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cudagraph_capture_sizes: tuple[int, ...]
    cudagraph_limit: int
    context_lens: tuple[int, ...]
    replays: int
    warmup_replays: int
    # Optional: tables written before a key existed lack it (None = not recorded).
    max_model_len: int | None = None
    attention_backend: str | None = None
    draft_attention_backend: str | None = None
    cudagraph_mode: str | None = None
    compilation_hash: str | None = None
    attention_config_hash: str | None = None
    kernel_config_hash: str | None = None
    offload_config_hash: str | None = None
    kv_connector: str | None = None
    additional_config_hash: str | None = None
    cudnn_version: str | None = None
    flashinfer_version: str | None = None
    kv_block_size: int | None = None
    data_parallel_size: int | None = None
    expert_parallel_size: int | None = None
    decode_context_parallel_size: int | None = None
    model_revision: str | None = None
    draft_revision: str | None = None
    speculative_method: str | None = None
    hf_overrides: str | None = None
    model_impl: str | None = None
    gpu_memory_mib: int | None = None
    gpu_state: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (host, command line)

    def __post_init__(self) -> None:
        for key in KEYS:
            value = getattr(self, key.name)
            if key.types == (tuple,):
                object.__setattr__(self, key.name, _int_tuple(key.name, value))
            elif value is None:
                if not (key.optional or key.none_is_value):
                    raise CalibError(f"fingerprint {key.name} must be {key.type_name}, got None")
            elif isinstance(value, bool) or not isinstance(value, key.types):
                raise CalibError(f"fingerprint {key.name} must be {key.type_name}, got {_short(value)}")
        if not isinstance(self.extra, dict):
            raise CalibError(f"fingerprint extra must be a JSON object, got {_short(self.extra)}")
        for name, values, top in (("max_num_seqs", [self.max_num_seqs], MAX_NUM_SEQS),
                                  ("max_num_batched_tokens", [self.max_num_batched_tokens], MAX_STEP_TOKENS),
                                  ("cudagraph_capture_sizes", self.cudagraph_capture_sizes, MAX_STEP_TOKENS),
                                  ("max_model_len", [self.max_model_len or 0], MAX_CONTEXT_LEN),
                                  ("context_lens", self.context_lens, MAX_CONTEXT_LEN)):
            if any(not 0 <= v <= top for v in values):
                raise CalibError(f"fingerprint {name} {_short(list(values) if len(values) > 1 else values[0])} "
                                 f"is outside 0..{top}")
        if not self.context_lens:
            raise CalibError("fingerprint context_lens is empty")
        if list(self.cudagraph_capture_sizes) != sorted(set(self.cudagraph_capture_sizes)):
            raise CalibError("fingerprint cudagraph_capture_sizes must be strictly increasing")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cudagraph_capture_sizes"] = list(self.cudagraph_capture_sizes)
        d["context_lens"] = list(self.context_lens)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Fingerprint":
        if not isinstance(data, dict):
            raise CalibError("fingerprint is not a JSON object")
        known = {f.name for f in fields(cls)}
        missing = [k.name for k in KEYS if not k.optional and k.name not in data]
        if missing:
            raise CalibError(f"fingerprint lacks {', '.join(missing)}")
        unknown = set(data) - known
        extra = data.get("extra")
        if extra is not None and not isinstance(extra, dict):
            raise CalibError(f"fingerprint extra must be a JSON object, got {_short(extra)}")
        extra = dict(extra or {})
        # Keys from a newer minor format are kept, not dropped, so a rewrite loses nothing.
        extra.update({k: data[k] for k in unknown})
        return cls(**{k: data[k] for k in known if k in data and k != "extra"}, extra=extra)

    def replace(self, **changes: Any) -> "Fingerprint":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(changes)
        return Fingerprint(**d)


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    """A list of integers (numpy ints too) as a tuple; anything else is a CalibError, not a TypeError."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise CalibError(f"fingerprint {name} must be a list of integers, got {_short(value)}")
    items = tuple(value)
    if any(isinstance(v, bool) or not hasattr(v, "__index__") for v in items):
        raise CalibError(f"fingerprint {name} must be a list of integers, got {_short(value)}")
    return tuple(int(v) for v in items)


# -- how values are shown ---------------------------------------------------------------------
def _short(value: Any, limit: int = 60) -> str:
    """One short line: long size lists elided, control characters escaped (repr), long text cut."""
    if isinstance(value, (list, tuple)) and len(value) > 6:
        text = f"[{value[0]}, {value[1]}, ..., {value[-1]}] ({len(value)} sizes)"
    else:
        text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_value(value: Any) -> str:
    """How inspect/diff show a value: strings bare, None as '-', long lists elided."""
    if value is None or value == "":
        return "-"
    if isinstance(value, str):
        return _short(value)[1:-1] if len(repr(value)) <= 60 else _short(value)
    return _short(value)


def format_mib(value: Any) -> str:
    return "-" if value is None else f"{value / 1024:.1f} GiB ({value} MiB)"


# -- the registry -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Key:
    name: str
    types: tuple[type, ...]
    load: str | None  # EQUAL / RECORDED; None: not an engine property (the run, or derived)
    merge: bool  # must agree before two tables' samples are pooled
    label: str  # how inspect, diff and the README name it
    why: str  # one line: why this rule
    format: Callable[[Any], str] = format_value
    optional: bool = False  # added after format 1.0: older tables lack it
    none_is_value: bool = False  # None is a real value (quantization: none), not "not recorded"
    rule_text: str = ""  # the README's "on load" cell, where no load rule says it

    @property
    def type_name(self) -> str:
        names = {int: "an integer", str: "a string", tuple: "a list of integers"}
        return " or ".join(names.get(t, t.__name__) for t in self.types)

    def recorded(self, value: Any) -> bool:
        """Whether a table (or engine) value says something; None/"" mean 'not recorded'."""
        if self.none_is_value:
            return True
        return value is not None and value != ""


_STR, _INT, _INTS = (str,), (int,), (tuple,)
KEYS: tuple[Key, ...] = (
    Key("backend", _STR, None, True, "backend", "who measured it: 'vllm' loads; 'reference' (imported) only "
        "with DSPARK_CALIB_ALLOW_REFERENCE=1 (the loader's own rule)", rule_text="vllm, or reference if allowed"),
    Key("gpu_name", _STR, EQUAL, True, "GPU", "a different GPU model has different kernels and bandwidth"),
    Key("gpu_count", _INT, None, True, "GPU count", "tp x pp; those two are checked"),
    Key("gpu_compute_capability", _STR, RECORDED, True, "compute capability",
        "implied by the GPU name, which is checked"),
    Key("gpu_memory_mib", _INT, EQUAL, True, "GPU memory", "same name, other memory: another board variant "
        "or a MIG slice, with other bandwidth or SM count", format=format_mib, optional=True),
    Key("driver_version", _STR, RECORDED, True, "driver", "kernels come from torch/vLLM builds, not the driver; "
        "a routine driver update must not void every table (logged if different)"),
    Key("cuda_version", _STR, EQUAL, True, "CUDA (torch build)", "the CUDA build selects cuBLAS/NCCL kernels; "
        "vLLM ships wheels for several"),
    Key("torch_version", _STR, EQUAL, True, "torch", "compiled graphs and GEMM kernels come from torch; "
        "vLLM pins one, so another means a custom build"),
    Key("vllm_version", _STR, EQUAL, True, "vLLM", "model code, kernels and the profile rule are vLLM's"),
    Key("target_model", _STR, None, True, "target", "a name for people; the config hash is checked"),
    Key("target_config_hash", _STR, EQUAL, True, "target config.json", "the model's shapes"),
    Key("model_revision", _STR, RECORDED, True, "target revision", "config.json (hashed, checked) fixes the "
        "shapes; a revision that changes only weights does not change step cost", optional=True),
    Key("hf_overrides", _STR, EQUAL, True, "hf_overrides", "overrides change the config after config.json "
        "was read (layers, heads), so the hash alone would miss them", optional=True),
    Key("model_impl", _STR, EQUAL, True, "model implementation", "vllm and transformers implementations run "
        "different kernels", optional=True),
    Key("draft_model", _STR, None, True, "draft", "a name for people; the config hash is checked"),
    Key("draft_config_hash", _STR, EQUAL, True, "draft config.json", "the drafter's shapes and block size"),
    Key("draft_revision", _STR, RECORDED, True, "draft revision", "as the target revision", optional=True),
    Key("speculative_method", _STR, EQUAL, True, "speculative method", "who drafts and how drafts are ranked "
        "(DSpark's confidence head, vLLM's acceptance estimator): other drafter steps", optional=True),
    Key("tensor_parallel_size", _INT, EQUAL, True, "tensor parallel", "shard sizes and all-reduces per step"),
    Key("pipeline_parallel_size", _INT, EQUAL, True, "pipeline parallel", "layers per stage and transfers"),
    Key("data_parallel_size", _INT, EQUAL, True, "data parallel", "every step syncs the replicas "
        "(dispatch_cg_and_sync_dp)",
        optional=True),
    Key("expert_parallel_size", _INT, EQUAL, True, "expert parallel", "MoE experts per rank and all-to-all "
        "traffic (1 when off)", optional=True),
    Key("decode_context_parallel_size", _INT, EQUAL, True, "decode context parallel", "KV split across ranks "
        "changes attention work and adds collectives", optional=True),
    Key("dtype", _STR, EQUAL, True, "dtype", "GEMM kernels and bytes moved"),
    Key("kv_cache_dtype", _STR, EQUAL, True, "KV cache dtype", "attention reads and kernels"),
    Key("kv_block_size", _INT, EQUAL, True, "KV block size", "attention kernels tile and gather by block", optional=True),
    Key("quantization", _STR, EQUAL, True, "quantization", "other weight formats, other kernels", none_is_value=True),
    Key("attention_backend", _STR, EQUAL, True, "attention backend", "the kernel every layer runs; read "
        "from what vLLM resolved per layer", optional=True),
    Key("draft_attention_backend", _STR, EQUAL, True, "draft attention backend", "the drafter may resolve "
        "another backend than the target", optional=True),
    Key("num_speculative_tokens", _INT, EQUAL, True, "speculative tokens", "drafter steps and verify width"),
    Key("max_num_seqs", _INT, EQUAL, True, "max_num_seqs", "dummy runs use min(tokens, max_num_seqs) "
        "requests, so verify points above it depend on it"),
    Key("max_num_batched_tokens", _INT, EQUAL, True, "max_num_batched_tokens", "vLLM compiles its graphs for "
        "it (compile ranges, in the compilation hash) and profiles verify sizes up to it"),
    Key("max_model_len", _INT, EQUAL, True, "max_model_len", "caps the profiled context (max_model_len - "
        "query_len) and sizes the block tables every step copies", optional=True),
    Key("cudagraph_capture_sizes", _INTS, EQUAL, True, "CUDA-graph sizes", "steps pad to the next captured "
        "size: the cost curve's steps are these sizes"),
    Key("cudagraph_limit", _INT, None, True, "capture limit", "the largest captured size; follows from the sizes"),
    Key("cudagraph_mode", _STR, EQUAL, True, "CUDA-graph mode", "full vs piecewise graphs change launch "
        "overhead per step; read after vLLM resolved it", optional=True),
    Key("compilation_hash", _STR, EQUAL, True, "compilation config", "vLLM's CompilationConfig.compute_hash(): "
        "fusion passes, custom ops, inductor settings that change kernels", optional=True),
    Key("attention_config_hash", _STR, EQUAL, True, "attention config", "vLLM's AttentionConfig.compute_hash(): "
        "FlashAttention version, splits under CUDA graphs, backend overrides", optional=True),
    Key("kernel_config_hash", _STR, EQUAL, True, "kernel config", "vLLM's KernelConfig.compute_hash(): the "
        "linear and MoE backends and op priorities, so which GEMM and MoE kernels run", optional=True),
    Key("offload_config_hash", _STR, EQUAL, True, "CPU offload", "vLLM's OffloadConfig.compute_hash(): weights "
        "offloaded to the CPU are copied in on every step", optional=True),
    Key("kv_connector", _STR, EQUAL, True, "KV connector", "a connector saves or loads KV around every step; "
        "vLLM's hash leaves it out, so its name and role are recorded ('none' without one)", optional=True),
    Key("additional_config_hash", _STR, EQUAL, True, "additional_config", "platform plugins read it and may "
        "swap kernels; hashed as vLLM's compute_hash does ('none' when empty)", optional=True),
    Key("cudnn_version", _STR, EQUAL, True, "cuDNN", "the cuDNN build torch loads (a separate wheel): its "
        "kernels may serve convolutions and attention ('none' without cuDNN)", optional=True),
    Key("flashinfer_version", _STR, EQUAL, True, "FlashInfer", "vLLM takes sampling, all-reduce fusion and "
        "attention kernels from it when installed ('none' when not)", optional=True),
    Key("gpu_state", _STR, None, True, "GPU state", "the clocks and power each profile block started at "
        "(`profile --gpu-state`): 'startup' (cooled down, as vLLM's start-up pass) or 'serving' (after sustained "
        "load, as a loaded server); a choice of the run, not of the engine", optional=True),
    Key("context_lens", _INTS, None, False, "context lengths", "what this run profiled; the loader picks the "
        "curve nearest the context vLLM would profile"),
    Key("replays", _INT, None, False, "replays", "how many samples per point (merge adds them up)"),
    Key("warmup_replays", _INT, None, False, "warm-up replays", "discarded runs per point; with none, a "
        "fall in a curve is refused (first-use costs)"),
)
KEY = {k.name: k for k in KEYS}

MERGE_KEYS = tuple(k.name for k in KEYS if k.merge)
ENGINE_KEYS = tuple(k.name for k in KEYS if k.load is not None)  # what a running engine reports


@dataclass(frozen=True)
class Mismatch:
    key: str
    table_value: Any
    engine_value: Any
    rule: str = EQUAL

    def __str__(self) -> str:
        return f"{self.key}: table {_short(self.table_value)} vs engine {_short(self.engine_value)}"


def _same(key: Key, have: Any, want: Any) -> bool:
    if isinstance(have, tuple) and isinstance(want, (list, tuple)):
        want = tuple(want)
    return have == want


def _compared(table: Fingerprint, engine: Mapping[str, Any], rules: tuple[str, ...]):
    for key in KEYS:
        if key.load not in rules or key.name not in engine:
            continue
        have, want = getattr(table, key.name), engine[key.name]
        if key.recorded(have) and key.recorded(want):
            yield key, have, want


def load_mismatches(table: Fingerprint, engine: Mapping[str, Any]) -> list[Mismatch]:
    """Every blocking (EQUAL) key on which the table does not fit the running engine.

    Keys the engine did not report (absent from `engine`) and keys the table did not
    record are not checked (unchecked_keys / unrecorded_keys name them).
    """
    return [Mismatch(k.name, have, want, k.load) for k, have, want in _compared(table, engine, BLOCKING)
            if not _same(k, have, want)]


def recorded_differences(table: Fingerprint, engine: Mapping[str, Any]) -> list[Mismatch]:
    """RECORDED keys that differ: the load decision logs them at WARNING and loads anyway."""
    return [Mismatch(k.name, have, want, RECORDED) for k, have, want in _compared(table, engine, (RECORDED,))
            if not _same(k, have, want)]


def unchecked_keys(engine: Mapping[str, Any]) -> list[str]:
    """Keys with a load rule that the engine did not report (or reported empty)."""
    return [k.name for k in KEYS if k.load in LOAD_RULES and not (k.name in engine and k.recorded(engine[k.name]))]


def unrecorded_keys(table: Fingerprint, engine: Mapping[str, Any]) -> list[str]:
    """Blocking keys the engine reports but the table did not record (an older table):
    named in the load line at WARNING, never a refusal."""
    return [k.name for k in KEYS if k.load in BLOCKING and k.name in engine and k.recorded(engine[k.name])
            and not k.recorded(getattr(table, k.name))]


def merge_mismatches(a: Fingerprint, b: Fingerprint) -> list[Mismatch]:
    return [Mismatch(k, getattr(a, k), getattr(b, k)) for k in MERGE_KEYS if getattr(a, k) != getattr(b, k)]


def changed_keys(old: Fingerprint, new: Fingerprint) -> list[tuple[str, Any, Any]]:
    """Every fingerprint key that differs, for `diff` to show."""
    od, nd = old.to_dict(), new.to_dict()
    return [(k, od.get(k), nd.get(k)) for k in od if od.get(k) != nd.get(k)]


def display_rows(fp: Fingerprint) -> list[tuple[str, str]]:
    """(label, shown value) for every key, registry order: what inspect shows."""
    return [(k.label, k.format(getattr(fp, k.name))) for k in KEYS]


_RULE_TEXT = {EQUAL: "must be equal", RECORDED: "warning if different",
              None: "not compared"}


def compatibility_markdown() -> str:
    """The README's compatibility table, generated from KEYS (tests keep the README in step)."""
    lines = ["| key | shown as | on load | merge | why |", "|---|---|---|---|---|"]
    for k in KEYS:
        why = k.why.replace("|", "\\|")
        lines.append(f"| `{k.name}` | {k.label} | {k.rule_text or _RULE_TEXT[k.load]} | {'equal' if k.merge else '-'} | {why} |")
    return "\n".join(lines) + "\n"


# The values vLLM takes and records, as its own Literal types list them (vllm.config.model's
# ModelDType; the dtype a running engine reports is one of RESOLVED_DTYPES); a test holds them
# to the installed vLLM. Here so that `profile` and `import-vllm` refuse a typo without vllm.
VLLM_MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
RESOLVED_DTYPES = ("bfloat16", "float16", "float32")
def check_model_dtype(dtype: str, option: str, choices: tuple[str, ...] = VLLM_MODEL_DTYPES) -> None:
    if dtype not in choices:
        raise CalibError(f"{option} {dtype!r} is not one of vLLM's: {', '.join(choices)}")


def config_hash(model_dir: str) -> str:
    """sha256 of a model's config.json, canonicalised (key order and whitespace do not count).

    Raises CalibError naming the path when there is no readable config.json.
    """
    from dspark_calib.safe_open import read_json_file

    path = os.path.join(model_dir, "config.json") if os.path.isdir(model_dir) else model_dir
    if not os.path.lexists(path):
        raise CalibError("no config.json here (a local model directory is needed)", path=model_dir)
    data = read_json_file(path)  # a FIFO or device named config.json is refused, not waited on
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()[:16]


def resolve_config_dir(model: str) -> str | None:
    """A local directory holding `model`'s config.json: the path itself, or the HF cache."""
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    try:  # hub ids that vLLM already downloaded
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "config.json")
        if isinstance(hit, str):
            return os.path.dirname(hit)
    except Exception:  # noqa: BLE001 - no hub library, or not cached: the key stays unchecked
        pass
    return None

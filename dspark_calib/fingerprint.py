"""What a table was profiled on, and which parts of that must agree.

A cost table is only valid for the engine it was measured on: the same GPU, the
same models, the same CUDA-graph sizes, the same vLLM. The fingerprint records
all of it; the key lists below say which keys must agree before two tables are
merged (MERGE_KEYS) or a table is loaded into a running engine (LOAD_CHECKS).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dspark_calib.errors import CalibError

BACKEND_VLLM = "vllm"
# Tables not measured by dspark-calib's own profiler (imported vLLM start-up
# profiles, hand-made fixtures): the plugin refuses them unless told otherwise.
BACKEND_REFERENCE = "reference"


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
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (host, command line)

    def __post_init__(self) -> None:
        for name in ("cudagraph_capture_sizes", "context_lens"):
            object.__setattr__(self, name, _int_tuple(name, getattr(self, name)))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type.endswith(" | None") and value is None:
                continue
            if f.type.startswith("int") and (isinstance(value, bool) or not isinstance(value, int)):
                raise CalibError(f"fingerprint {f.name} must be an integer, got {value!r}")
            if f.type.startswith("str") and not isinstance(value, str):
                raise CalibError(f"fingerprint {f.name} must be a string, got {value!r}")
        if not isinstance(self.extra, dict):
            raise CalibError(f"fingerprint extra must be a JSON object, got {self.extra!r}")
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
        required = [f.name for f in fields(cls) if f.name not in ("max_model_len", "extra")]
        missing = [k for k in required if k not in data]
        if missing:
            raise CalibError(f"fingerprint lacks {', '.join(missing)}")
        unknown = set(data) - known
        extra = data.get("extra")
        if extra is not None and not isinstance(extra, dict):
            raise CalibError(f"fingerprint extra must be a JSON object, got {extra!r}")
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
        raise CalibError(f"fingerprint {name} must be a list of integers, got {value!r}")
    items = tuple(value)
    if any(isinstance(v, bool) or not hasattr(v, "__index__") for v in items):
        raise CalibError(f"fingerprint {name} must be a list of integers, got {value!r}")
    return tuple(int(v) for v in items)


# Keys that describe one profiling run rather than the engine: they may differ
# between runs that are merged into one table.
RUN_KEYS = ("context_lens", "replays", "warmup_replays", "extra")
MERGE_KEYS = tuple(f.name for f in fields(Fingerprint) if f.name not in RUN_KEYS)

EQUAL = "equal"
COVERS = "covers"  # the table's value must be >= the engine's
# What the plugin checks before it skips vLLM's start-up profiling.
LOAD_CHECKS: tuple[tuple[str, str], ...] = (
    ("cudagraph_capture_sizes", EQUAL),
    ("num_speculative_tokens", EQUAL),
    # EQUAL, not COVERS: dummy runs use min(num_tokens, max_num_seqs) requests, so the
    # verify points above max_num_seqs tokens depend on it.
    ("max_num_seqs", EQUAL),
    ("max_num_batched_tokens", COVERS),
    ("tensor_parallel_size", EQUAL),
    ("pipeline_parallel_size", EQUAL),
    ("target_config_hash", EQUAL),
    ("draft_config_hash", EQUAL),
    ("dtype", EQUAL),
    ("kv_cache_dtype", EQUAL),
    ("quantization", EQUAL),
    ("gpu_name", EQUAL),
    ("vllm_version", EQUAL),
)


@dataclass(frozen=True)
class Mismatch:
    key: str
    table_value: Any
    engine_value: Any
    rule: str = EQUAL

    def __str__(self) -> str:
        want = "covering" if self.rule == COVERS else ""
        return f"{self.key}: table {_short(self.table_value)} vs engine {want + ' ' if want else ''}{_short(self.engine_value)}"


def _short(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 6:
        return f"[{value[0]}, {value[1]}, ..., {value[-1]}] ({len(value)} sizes)"
    return repr(list(value) if isinstance(value, tuple) else value)


def load_mismatches(table: Fingerprint, engine: dict[str, Any]) -> list[Mismatch]:
    """Every LOAD_CHECKS key on which the table does not fit the running engine.

    Keys the engine could not report (absent from `engine`) are not checked.
    """
    out = []
    for key, rule in LOAD_CHECKS:
        if key not in engine:
            continue
        have, want = getattr(table, key), engine[key]
        if isinstance(have, tuple):
            want = tuple(want)
        ok = (have is not None and want is not None and have >= want) if rule == COVERS else have == want
        if not ok:
            out.append(Mismatch(key, have, want, rule))
    return out


def merge_mismatches(a: Fingerprint, b: Fingerprint) -> list[Mismatch]:
    return [Mismatch(k, getattr(a, k), getattr(b, k)) for k in MERGE_KEYS if getattr(a, k) != getattr(b, k)]


def changed_keys(old: Fingerprint, new: Fingerprint) -> list[tuple[str, Any, Any]]:
    """Every fingerprint key that differs, for `diff` to show."""
    od, nd = old.to_dict(), new.to_dict()
    return [(k, od.get(k), nd.get(k)) for k in od if od.get(k) != nd.get(k)]


def config_hash(model_dir: str) -> str:
    """sha256 of a model's config.json, canonicalised (key order and whitespace do not count).

    Raises CalibError naming the path when there is no readable config.json.
    """
    path = os.path.join(model_dir, "config.json") if os.path.isdir(model_dir) else model_dir
    try:
        with open(path, "rb") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise CalibError("no config.json here (a local model directory is needed)", path=model_dir) from None
    except (OSError, ValueError) as exc:
        raise CalibError(f"unreadable config.json: {exc}", path=path) from None
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

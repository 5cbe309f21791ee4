"""Capture mode (DSPARK_CALIB_CAPTURE=DIR): how `profile` gets samples out of vLLM.

vLLM times its start-up profile inside the worker processes, so the hooks that
extend and collect it run there (loaded by the plugin), and hand the samples to
the `profile` command through files in DIR:

* DIR/plan.json (written by `profile`): context lengths, timed replays, warm-up replays.
* DIR/progress.json (TP rank 0, while profiling): batches done / total.
* DIR/samples-rank{R}.json (every TP rank, atomically, when profiling ends): the
  tagged samples, the engine description and the hardware. `profile` reads rank 0.

The batches extend vLLM's own batches_to_profile: the same sizes (every captured
graph size, then the tail above the capture limit), for every context length,
W warm-up passes then R timed passes. Passes go round-robin over sizes rather
than R back-to-back replays of one size, so slow drift shows up as spread
instead of biasing some sizes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

from dspark_calib.atomic import atomic_write_json
from dspark_calib.samples import Sample
from dspark_calib.table import nearest

ENV_CAPTURE = "DSPARK_CALIB_CAPTURE"
PLAN_FILE = "plan.json"
PROGRESS_FILE = "progress.json"
DEFAULT_REPLAYS = 20
DEFAULT_WARMUP = 2


@dataclass(frozen=True)
class Plan:
    context_lens: tuple[int, ...]
    replays: int = DEFAULT_REPLAYS
    warmup: int = DEFAULT_WARMUP

    def __post_init__(self) -> None:
        if not self.context_lens or any(int(c) <= 0 for c in self.context_lens):
            raise ValueError(f"context lengths must be positive, got {self.context_lens}")
        if self.replays < 1 or self.warmup < 0:
            raise ValueError(f"need replays >= 1 and warmup >= 0, got {self.replays}, {self.warmup}")
        object.__setattr__(self, "context_lens", tuple(int(c) for c in self.context_lens))


def write_plan(directory: str, plan: Plan) -> None:
    atomic_write_json(os.path.join(directory, PLAN_FILE), asdict(plan))


def read_plan(directory: str) -> Plan:
    """The plan `profile` wrote; a missing or bad one is an error, never a silent default
    (a stray DSPARK_CALIB_CAPTURE must not turn a normal start into a long profile)."""
    path = os.path.join(directory, PLAN_FILE)
    try:
        with open(path) as fh:
            data = json.load(fh)
        return Plan(context_lens=tuple(data["context_lens"]), replays=int(data["replays"]), warmup=int(data["warmup"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"dspark-calib: {ENV_CAPTURE}={directory}: no usable {PLAN_FILE} ({exc}); "
                           "capture mode is set by `dspark-calib profile` only") from None


def samples_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"samples-rank{rank}.json")


@dataclass(frozen=True)
class BatchTag:
    context_len: int
    replay: int  # < 0: a warm-up replay, timed by vLLM but discarded
    num_tokens: int


class CaptureMode:
    name = "capture"

    def __init__(self, directory: str):
        self.directory = directory

    def batches(self, manager: Any, capture_sizes: list[int], vllm_batches: list[dict]) -> Iterator[dict]:
        from dspark_calib.vllm.engine_info import broadcast_from_rank0, tp_rank_and_size

        rank, _ = tp_rank_and_size()
        # Every rank must run the same batches (they hold collectives): rank 0's plan for all.
        plan_or_error: Plan | str = ""
        if rank == 0:
            try:
                plan_or_error = read_plan(self.directory)
            except RuntimeError as exc:
                plan_or_error = str(exc)
        plan_or_error = broadcast_from_rank0(plan_or_error)
        if isinstance(plan_or_error, str):
            raise RuntimeError(plan_or_error)
        plan = plan_or_error
        sizes = list(dict.fromkeys(b["num_tokens"] for b in vllm_batches))  # vLLM's sizes, its order
        tags = [BatchTag(ctx, replay, size)
                for ctx in plan.context_lens
                for replay in range(-plan.warmup, plan.replays)
                for size in sizes]
        manager._dspark_capture = {"tags": tags, "plan": plan, "start": time.perf_counter(),
                                   "capture_sizes": list(capture_sizes)}
        last_report = 0.0
        for i, tag in enumerate(tags):
            now = time.monotonic()
            if rank == 0 and now - last_report > 0.5:
                last_report = now
                atomic_write_json(os.path.join(self.directory, PROGRESS_FILE),
                                  {"done": i, "total": len(tags), "context_len": tag.context_len}, durable=False)
            yield {"num_tokens": tag.num_tokens, "context_len": tag.context_len}

    def install_curves(self, manager: Any, samples: list, original: Callable[[list], None]) -> None:
        from dspark_calib.vllm.engine_info import (current_context_len, describe_engine, hardware,
                                                   tp_rank_and_size)

        state = manager._dspark_capture
        profile_s = time.perf_counter() - state["start"]
        tags: list[BatchTag] = state["tags"]
        rank, tp_size = tp_rank_and_size()
        if len(samples) != len(tags):
            # Every dummy run reaches drafter_end in 0.28-0.33; if not, the pairing is lost.
            raise RuntimeError(f"dspark-calib: vLLM returned {len(samples)} step timings for {len(tags)} "
                               "profile batches; cannot attribute them, no table written")
        tagged = [Sample.from_vllm(s, context_len=t.context_len, replay=t.replay)
                  for s, t in zip(samples, tags) if t.replay >= 0]
        for s, t in zip(samples, tags):
            # The pairing must hold: vLLM records the batch's own size with each sample.
            if s.num_target_tokens > t.num_tokens:
                raise RuntimeError(f"dspark-calib: sample for a {t.num_tokens}-token batch reports "
                                   f"{s.num_target_tokens} tokens; no table written")
        payload = {
            "rank": rank,
            "tp_size": tp_size,
            "profile_s": profile_s,
            "num_batches": len(tags),
            "plan": asdict(state["plan"]),
            "cudagraph_limit": int(manager._cudagraph_limit),
            "engine": describe_engine(manager, state["capture_sizes"], getattr(manager, "_dspark_vllm_config", None)),
            "hardware": hardware(),
            "samples": [s.to_dict() for s in tagged],
        }
        atomic_write_json(samples_path(self.directory, rank), payload)
        if rank == 0:
            atomic_write_json(os.path.join(self.directory, PROGRESS_FILE),
                              {"done": len(tags), "total": len(tags), "context_len": tags[-1].context_len})
        # vLLM still needs cost curves to finish starting: give it its own rule on the
        # timed samples of the context length it would have profiled itself.
        wanted = current_context_len()
        ctx = nearest(state["plan"].context_lens, wanted)
        original([s for s, t in zip(samples, tags) if t.replay >= 0 and t.context_len == ctx])

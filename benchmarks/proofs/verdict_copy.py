"""GPU: observe mode reads a sampled step's verdict (num_sampled / num_rejected) without a sync.

Runs the real ``Observer.drafter_start`` / ``drafter_end`` on CUDA tensors and CUDA events (torch
only, no vLLM): under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising call raises)
the verdict is copied to pinned host memory behind queued GPU work; once the drafter_end event's
query() is true the host copy holds the values, and ``acceptance_counts`` makes the per-position
counts from it. Prints one JSON line.

    python benchmarks/proofs/verdict_copy.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dspark_calib.vllm.observer import Observer, _Step  # noqa: E402
from dspark_calib.vllm.step_capture import acceptance_counts  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    n, k = 64, 7
    gen = torch.Generator(device=dev).manual_seed(0)
    accepted = torch.randint(0, k + 1, (n + 8,), device=dev, generator=gen)  # 8 padded rows past num_reqs
    verified = torch.clamp(accepted + torch.randint(0, 2, (n + 8,), device=dev, generator=gen), max=k)
    num_sampled = (accepted + 1).to(torch.int32)
    num_rejected = (verified - accepted).to(torch.int32)
    want = acceptance_counts(num_sampled[:n].cpu().numpy(), num_rejected[:n].cpu().numpy(), k)
    events = lambda: SimpleNamespace(**{f: torch.cuda.Event(enable_timing=True) for f in  # noqa: E731
                                        ("forward_start", "forward_end", "drafter_start", "drafter_end")})
    obs = Observer(SimpleNamespace(num_speculative_steps=k), "/nonexistent", every=1, event_factory=events,
                   pricing=lambda m: None)
    step = _Step(1, None)
    step.batch, step.events, step.forward_ended = (True, n * (1 + k), n), events(), True
    obs.current = step
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    t0 = time.perf_counter()
    for _ in range(20):  # queued work ahead of the copy: the copy cannot have landed when the host returns
        a = a @ a
        a = a / a.abs().max()
    assert obs.drafter_start(num_sampled, num_rejected), "drafter_start refused"
    obs.drafter_end()
    host_s = time.perf_counter() - t0
    torch.cuda.set_sync_debug_mode(0)
    (ev, info), = obs.pending._queue
    landed_before = ev.drafter_end.query()
    polls = 0
    while not ev.drafter_end.query():
        polls += 1
        time.sleep(0.0005)
    ns, nr = info.acceptance
    got = acceptance_counts(ns.numpy(), nr.numpy(), k)
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "pinned": [ns.is_pinned(),
                      nr.is_pinned()], "host_ms_to_queue": round(1e3 * host_s, 3),
                      "done_when_host_returned": landed_before, "polls": polls, "counts_equal": got == want,
                      "graded": got[0], "accepted": got[1], "observe_on": obs.on}))
    assert obs.on and got == want and ns.is_pinned() and nr.is_pinned()


if __name__ == "__main__":
    main()

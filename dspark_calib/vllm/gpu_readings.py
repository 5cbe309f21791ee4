"""Reading the GPU's and host's conditions in the worker, between profile blocks.

Why here: the clocks, temperature and host load that shift vLLM's timings are only
visible from the process that runs the steps. Readings are taken between the
generator's yields: after vLLM's drafter_end event of a block's last step and before the
forward_start of the next block's first, so never inside a timed step. Each reading
records its own cost (read_ms; NVML about a millisecond): the host gap it adds there.
A missing `pynvml` (nvidia-ml-py, or vLLM's own copy of it) or a failing NVML never fails the profile: the next
source is `nvidia-smi` (one call per reading), then host readings only, and the reason
is recorded once in the telemetry's note.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from typing import Any, Callable

from dspark_calib.errors import PREFIX
from dspark_calib.telemetry import BlockTelemetry, Reading, Telemetry

# NVML clock-event reasons worth reporting (idle and application-clock settings are not throttling).
_REASONS = {
    0x2: "sw_power_cap", 0x4: "hw_slowdown", 0x8: "sync_boost", 0x20: "sw_thermal",
    0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks",
}


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in sorted(_REASONS.items()) if mask & bit)


def host_reading() -> dict[str, Any]:
    t = os.times()
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = None
    return {"load1": load1, "cpu_s": t.user + t.system}


def _nvml_module() -> Any:
    """nvidia-ml-py's `pynvml`, else the copy of it vLLM ships (vllm.third_party.pynvml): the
    engine's environment always has that one, so NVML readings need no extra package."""
    try:
        import pynvml
    except ImportError:
        from vllm.third_party import pynvml  # type: ignore[no-redef]
    return pynvml


class GpuReader:
    """One device's readings; `source` is fixed at construction, `note` says what was lost."""

    def __init__(self, device_index: int = 0, *, which: Callable[[str], str | None] = shutil.which):
        self.index, self.note, self._nvml, self._handle = device_index, "", None, None
        try:
            pynvml = _nvml_module()
            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self.source = "nvml"
        except Exception as exc:  # noqa: BLE001 - ImportError or any NVMLError: fall back, never fail
            self.note = f"NVML unavailable ({type(exc).__name__}: {str(exc)[:80]})"
            self._smi = which("nvidia-smi")
            self.source = "nvidia-smi" if self._smi else "host"
            if not self._smi:
                self.note += "; no nvidia-smi: host load only"

    def _nvml_reading(self) -> dict[str, Any]:
        n, h = self._nvml, self._handle
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        return {"sm_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
                "mem_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
                "temp_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                "power_w": n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "throttle": list(throttle_names(int(reasons(h))))}

    def _smi_reading(self) -> dict[str, Any]:
        fields = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active"
        out = subprocess.run([self._smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i",
                              str(self.index)], capture_output=True, text=True, timeout=5, check=True).stdout
        vals = [v.strip() for v in out.strip().splitlines()[0].split(",")]

        def num(v: str) -> float | None:
            try:
                return float(v)
            except ValueError:
                return None
        mask = int(vals[4], 16) if vals[4].lower().startswith("0x") else 0
        return {"sm_mhz": num(vals[0]), "mem_mhz": num(vals[1]), "temp_c": num(vals[2]), "power_w": num(vals[3]),
                "throttle": list(throttle_names(mask))}

    def read(self) -> Reading:
        t0 = time.perf_counter()
        gpu: dict[str, Any] = {}
        if self.source != "host":
            try:
                gpu = self._nvml_reading() if self._nvml else self._smi_reading()
            except Exception as exc:  # noqa: BLE001 - a reading lost is not a profile lost
                if not self.note:
                    self.note = f"{self.source} reading failed ({type(exc).__name__}: {str(exc)[:80]})"
        return Reading.from_dict({**gpu, **host_reading(), "read_ms": (time.perf_counter() - t0) * 1000.0})


class BlockRecorder:
    """Called by the capture schedule at each block boundary (between yields)."""

    def __init__(self, reader: Any):
        self.reader, self.blocks, self._open = reader, [], None

    def start(self, context_len: int, block: int) -> Reading:
        """The block's start reading, also returned: the cool-down's baseline is the first one."""
        self._open = (context_len, block, self.reader.read())
        return self._open[2]

    def end(self) -> None:
        if self._open is not None:
            ctx, block, start = self._open
            self.blocks.append(BlockTelemetry(ctx, block, start, self.reader.read()))
            self._open = None

    def telemetry(self) -> Telemetry:
        return Telemetry(source=self.reader.source, blocks=tuple(self.blocks), note=self.reader.note)


class ClockSampler:
    """The GPU's SM clock and power for observe mode's rows, read off the step's path: a daemon
    thread reads NVML every `period_s` (a few readings a second; about a millisecond each, all
    in NVML's driver call) and keeps the latest; a step takes `latest`, a plain attribute read.
    Only an NVML reader is sampled: nvidia-smi (a process per reading) is not worth it here."""

    def __init__(self, reader: Any, period_s: float = 0.25):
        self.reader, self.period_s = reader, period_s
        self.latest: tuple[float | None, float | None] = (None, None)  # (SM MHz, W); replaced whole
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dspark-calib-gpu-clock", daemon=True)

    def start(self) -> "ClockSampler":
        self._thread.start()
        return self

    def sample(self) -> None:
        r = self.reader.read()
        self.latest = (r.sm_mhz, r.power_w)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a lost reading leaves the last one; rows say None at worst
                pass
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        """Never waits (it may be called on the step path): the thread ends within period_s."""
        self._stop.set()


def clock_sampler() -> ClockSampler | None:
    """Rank 0's sampler on its own GPU, started; None without NVML (rows record no clock)."""
    reader = GpuReader(nvml_index())
    return ClockSampler(reader).start() if reader.source == "nvml" else None


def first_visible_index() -> tuple[int, str]:
    """NVML's index of the first CUDA_VISIBLE_DEVICES entry when it is a number (NVML counts in
    PCI order, as CUDA does with CUDA_DEVICE_ORDER=PCI_BUS_ID), else device 0 and a note saying
    so (a GPU-/MIG- UUID). For a process without CUDA of its own: nvml_index is the worker's."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not first or first.isdigit():
        return int(first or 0), ""
    return 0, f"CUDA_VISIBLE_DEVICES entry {first[:40]!r} is not an index: NVML device 0 read"


def nvml_index() -> int:
    """NVML's index of the GPU this worker runs on: vLLM's own map from the current CUDA device
    through CUDA_VISIBLE_DEVICES (NVML ignores that variable), else its first entry."""
    try:
        import torch
        from vllm.platforms import current_platform

        return int(current_platform.visible_device_id_to_physical_device_id(torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - no CUDA / an older vLLM: the first visible device
        return first_visible_index()[0]


def block_recorder() -> Any:
    """Rank 0's recorder on its own GPU; a lost NVML is said once, and kept in the telemetry note."""
    import logging

    from dspark_calib.vllm.runtime import log_once

    reader = GpuReader(nvml_index())
    if reader.note:  # said once here, and kept in the table's telemetry note
        log_once(logging.WARNING, PREFIX + f"GPU telemetry: {reader.note}")
    return BlockRecorder(reader)

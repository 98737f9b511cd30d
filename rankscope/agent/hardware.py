"""Readings of this rank's GPU (NVML) and of its host (/proc): the raw numbers behind metrics.py.

GPU faults explain many slow or dead ranks: thermal or power throttling, ECC errors, Xid
events (79: fell off the bus, 48: double-bit ECC, ...). NVML (nvidia-ml-py's ``pynvml``, the
``gpu`` extra) reads them without touching CUDA. Without an NVIDIA driver, ``nvmlInit`` raises
``NVMLError_LibraryNotFound`` and ``open_gpu`` returns None: no GPU metrics, and no error. With a
driver but without nvidia-ml-py there are none either, and the agent says once what to install.

Host numbers come from /proc (Linux): CPU time, memory, and per-interface network counters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.agent.config import warn_once

PROC = Path("/proc")

__all__ = ["THROTTLE_REASONS", "CpuSampler", "GpuDevice", "NetCounters", "host_memory", "network_counters", "open_gpu"]

#: NVML's clock throttle ("clocks event") reason bits, by the name rankscope reports
THROTTLE_REASONS: Mapping[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}


class GpuDevice:
    """One GPU through NVML; each reading raises ``pynvml.NVMLError`` when the GPU lacks it."""

    def __init__(self, nvml: Any, handle: Any, label: str) -> None:
        self.nvml = nvml
        self.handle = handle
        self.label = label  # "cuda:<local rank>", as the rank's Register names its device
        self.xid_counts: dict[int, int] = {}
        self._events: Any = None
        try:
            self._events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        except nvml.NVMLError:
            self._events = None  # not supported here, or not permitted: no Xid counts

    def utilization(self) -> tuple[float, float]:
        """(compute, memory controller) busy fractions, 0..1, over NVML's last sample period."""
        rates = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        return rates.gpu / 100.0, rates.memory / 100.0

    def memory(self) -> tuple[int, int]:
        """(used, total) bytes."""
        info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return int(info.used), int(info.total)

    def temperature_c(self) -> float:
        return float(self.nvml.nvmlDeviceGetTemperature(self.handle, self.nvml.NVML_TEMPERATURE_GPU))

    def power_w(self) -> float:
        return self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0

    def sm_clock_hz(self) -> float:
        return self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM) * 1e6

    def throttle_reasons(self) -> int:
        """The bitmask of active throttle reasons (see THROTTLE_REASONS)."""
        try:
            return int(self.nvml.nvmlDeviceGetCurrentClocksEventReasons(self.handle))
        except self.nvml.NVMLError_FunctionNotFound:  # drivers older than 535: the former name
            return int(self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle))

    def ecc_errors(self) -> tuple[int, int]:
        """(corrected, uncorrected) ECC errors since the driver loaded."""
        nvml = self.nvml
        count = nvml.nvmlDeviceGetTotalEccErrors
        return (
            int(count(self.handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)),
            int(count(self.handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
        )

    def poll_xid(self) -> Mapping[int, int]:
        """Xid events so far, by code: waits for none (timeout 0), drains what is pending."""
        if self._events is None:
            return self.xid_counts
        while True:
            try:
                event = self.nvml.nvmlEventSetWait_v2(self._events, 0)
            except self.nvml.NVMLError_Timeout:
                return self.xid_counts
            code = int(event.eventData)
            self.xid_counts[code] = self.xid_counts.get(code, 0) + 1

    def close(self) -> None:
        if self._events is not None:
            self.nvml.nvmlEventSetFree(self._events)
            self._events = None
        self.nvml.nvmlShutdown()


def open_gpu(local_rank: int) -> GpuDevice | None:
    """The GPU that CUDA numbers ``local_rank`` in this process, or None without NVML or GPU."""
    try:
        import pynvml
    except ImportError:
        if (PROC / "driver" / "nvidia").is_dir():  # the driver is loaded: GPU metrics are missed
            warn_once("nvml", "nvidia-ml-py is not installed: no GPU metrics (pip install 'rankscope[gpu]')")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None  # no driver (NVMLError_LibraryNotFound): a CPU machine
    try:
        handle = _handle(pynvml, local_rank)
    except (pynvml.NVMLError, IndexError, ValueError):
        pynvml.nvmlShutdown()
        return None
    return GpuDevice(pynvml, handle, f"cuda:{local_rank}")


def _handle(nvml: Any, local_rank: int) -> Any:
    """NVML numbers every GPU of the machine; CUDA only those in CUDA_VISIBLE_DEVICES, in its order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return nvml.nvmlDeviceGetHandleByIndex(local_rank)
    entry = [v.strip() for v in visible.split(",")][local_rank]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)


# --- the host ---------------------------------------------------------------------------------


class CpuSampler:
    """CPU utilisation of the whole host between two calls, from /proc/stat."""

    def __init__(self) -> None:
        self._last = self._times()

    def utilization(self) -> float | None:
        """Busy fraction 0..1 since the previous call; None when no time has passed."""
        now = self._times()
        busy = (now[0] - self._last[0]) - (now[1] - self._last[1])
        total = now[0] - self._last[0]
        self._last = now
        return busy / total if total > 0 else None

    def _times(self) -> tuple[int, int]:
        """(total, idle + iowait) jiffies of all CPUs."""
        fields = [int(v) for v in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        # guest time is already part of user time
        return sum(fields[:8]), idle


def host_memory() -> tuple[int, int]:
    """(used, total) bytes; used is what is not available to new work (MemTotal - MemAvailable)."""
    info = {}
    for line in (PROC / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        info[key] = int(rest.split()[0]) * 1024
    total = info["MemTotal"]
    return total - info.get("MemAvailable", info.get("MemFree", 0)), total


@dataclass(frozen=True)
class NetCounters:
    """Cumulative counters of one network interface since boot."""

    rx_bytes: int
    rx_packets: int
    rx_errors: int
    rx_dropped: int
    tx_bytes: int
    tx_packets: int
    tx_errors: int
    tx_dropped: int


def network_counters() -> dict[str, NetCounters]:
    """Per interface (loopback excluded), from /proc/net/dev."""
    counters = {}
    for line in (PROC / "net" / "dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        name = name.strip()
        if name == "lo" or not rest:
            continue
        v = [int(x) for x in rest.split()]
        counters[name] = NetCounters(v[0], v[1], v[2], v[3], v[8], v[9], v[10], v[11])
    return counters

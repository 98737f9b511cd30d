"""Timestamps for spans and collectives: one interface, a CPU and a CUDA implementation.

The hot path only asks for a *token* (``Clock.now``); turning tokens into wall-clock
nanoseconds (``Clock.resolve``) happens later on the agent's background thread. That split is
what lets the CUDA clock time GPU work without ever synchronising the device: a token is a slot
of a pool of CUDA events recorded on the current stream, and the background thread polls
``event.query()`` until the GPU has passed it.

Token encoding (int64), by range: 0 means "unknown"; [1, 2**32) an event slot + 1; [2**32,
2**59) a ``time.perf_counter_ns`` reading (monotonic ns since boot: taken by calling the
builtin itself, the cheapest clock Python has); 2**59 and above (any date after 1988) wall-clock
ns, as OpenTelemetry and the flight recorder give them. Resolution adds the CPU clock's anchor
to perf_counter readings, so a CUDA clock can fall back to CPU tokens (pool empty, stream
capture, wrong device) row by row.
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from rankscope.agent.config import warn_once

EVENT_LIMIT = 1 << 32  # tokens in [1, EVENT_LIMIT) are event slots + 1
WALL_MIN = 1 << 59  # tokens from here on are wall-clock ns; between the two, perf_counter_ns


class Clock(Protocol):
    """Where timestamps come from; ``now`` runs on the hot path, the rest in the background."""

    def now(self) -> int:
        """A token for "now" on the current thread (and, on a GPU, its current stream)."""
        ...

    def wall_ns(self) -> int:
        """Wall-clock ns on the CPU, for times that are about the host (issue times, scalars)."""
        ...

    def resolve(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens -> ns where known: (values, mask of resolved entries, None meaning all).

        Resolved entries are replaced by their ns, so the caller keeps the returned array for
        entries it must retry; an event slot is reused once resolved.
        """
        ...

    def done(self, token: int) -> bool:
        """Whether the moment ``token`` stands for has passed (the GPU reached its event)."""
        ...

    def calibrate(self) -> None:
        """Periodic background upkeep (re-anchoring); cheap, never blocks on the device."""
        ...


class CpuClock:
    """``time.perf_counter_ns`` anchored to ``time.time_ns``.

    perf_counter is monotonic and cheap; the anchor puts it on the Unix epoch that the
    collector's clock-offset estimate uses, added off the hot path. ``calibrate`` re-anchors
    only when the system clock was stepped by more than a millisecond, so that spans never
    jump inside a run otherwise.
    """

    def __init__(self) -> None:
        self.now = time.perf_counter_ns  # the builtin itself: no Python frame on the hot path
        self._offset = time.time_ns() - time.perf_counter_ns()

    def wall_ns(self) -> int:
        return time.perf_counter_ns() + self._offset

    def resolve(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        raw = (tokens >= EVENT_LIMIT) & (tokens < WALL_MIN)
        return (np.where(raw, tokens + self._offset, tokens) if raw.any() else tokens), None

    def done(self, token: int) -> bool:
        return True

    def calibrate(self) -> None:
        drift = time.time_ns() - (time.perf_counter_ns() + self._offset)
        if abs(drift) > 1_000_000:
            self._offset += drift


def cores_shared() -> bool:
    """Whether this host's ranks outnumber the cores they may run on.

    Then the scheduler deschedules ranks at random and a segment's wall time mostly measures
    that, so the recorder also takes each span's thread CPU time. It costs a system call per
    span boundary (about 0.6 us here), which a rank with a core of its own does not pay.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > cores


class CudaApi(Protocol):
    """The few torch.cuda calls the CUDA clock makes (a fake stands in for it in tests)."""

    def event(self) -> Any: ...  # an object with record(stream=None), query(), elapsed_time(other)
    def capturing(self) -> bool: ...
    def current_device(self) -> int: ...
    def side_stream(self, device: int) -> Any: ...
    def on_device(self, device: int) -> AbstractContextManager[Any]: ...


class TorchCuda:
    """CudaApi on the real torch.cuda.

    Events are the device-generic ``torch.Event``, whose ``record()`` without a stream finds the
    current stream in C++: ``torch.cuda.Event.record()`` builds a Python ``Stream`` object for it
    first, and that was most of a CUDA span's cost (``make gpu-check`` part 1 measures both).
    """

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._cuda = torch.cuda
        self._capturing = torch._C._cuda_isCurrentStreamCapturing  # what is_current_stream_capturing() calls

    def event(self) -> Any:
        return self._torch.Event(device="cuda", enable_timing=True)

    def capturing(self) -> bool:
        return self._capturing()

    def current_device(self) -> int:
        return self._cuda.current_device()

    def side_stream(self, device: int) -> Any:
        return self._cuda.Stream(device=device)

    def on_device(self, device: int) -> AbstractContextManager[Any]:
        return self._cuda.device(device)


class CudaClock:
    """Tokens are CUDA events recorded on the current stream, resolved by polling.

    Conversion to wall-clock ns goes through a reference event that the background thread
    records on an idle side stream of the same device (so the GPU reaches it at once) next to a
    CPU timestamp, and re-records every ``recalibrate_s``: ``ns(e) = ref_ns +
    ref.elapsed_time(e)``. Keeping the reference young keeps float32 milliseconds precise and
    follows the drift between GPU and CPU clocks. The device is the one current on the first
    thread that takes a token (the training thread), learnt then, because the agent may start
    before the script has chosen its GPU.
    """

    def __init__(self, api: CudaApi, pool_size: int = 16384, recalibrate_s: float = 1.0, cpu: CpuClock | None = None):
        self._api = api
        self._capturing = api.capturing  # bound once: it runs on every token
        self._cpu = cpu or CpuClock()
        self._events = [api.event() for _ in range(pool_size)]
        self._free = list(range(pool_size - 1, -1, -1))  # pop()/append() are atomic under the GIL
        self._device: int | None = None
        self._stream: Any = None
        self._ref: Any = None
        self._ref_ns = 0
        self._pending: tuple[Any, int] | None = None  # (event, cpu ns) not yet reached by the GPU
        self._recalibrate_ns = int(recalibrate_s * 1e9)
        self._next_calibration = 0
        self.fallbacks = 0  # tokens taken from the CPU clock instead (pool empty, capture, errors)

    def wall_ns(self) -> int:
        return self._cpu.wall_ns()

    def now(self) -> int:
        try:
            slot = self._free.pop()
        except IndexError:
            self.fallbacks += 1
            return self._cpu.now()
        try:
            if self._capturing():  # recording a timed event would break a CUDA graph capture
                raise RuntimeError("stream capture")
            self._events[slot].record()
            if self._device is None:
                self._device = self._api.current_device()
            return slot + 1
        except Exception:  # noqa: BLE001 - e.g. an event bound to another device
            self._free.append(slot)
            self.fallbacks += 1
            return self._cpu.now()

    def done(self, token: int) -> bool:
        if not 0 < token < EVENT_LIMIT:
            return True
        try:
            return bool(self._events[token - 1].query())
        except Exception:  # noqa: BLE001 - a broken event never completes; treat it as passed
            return True

    def resolve(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        tokens, _ = self._cpu.resolve(tokens)
        slots = np.flatnonzero((tokens > 0) & (tokens < EVENT_LIMIT))
        if slots.size == 0:
            return tokens, None
        out = tokens.copy()
        ready = np.ones(tokens.shape, dtype=bool)
        for i in slots.tolist():
            slot = int(tokens[i]) - 1
            ns = self._event_ns(self._events[slot])
            if ns is None:
                ready[i] = False
            else:
                out[i] = ns
                self._free.append(slot)
        return out, ready

    def _event_ns(self, event: Any) -> int | None:
        if self._ref is None:
            return None
        try:
            if not event.query():
                return None
            return self._ref_ns + int(self._ref.elapsed_time(event) * 1e6)
        except Exception as exc:  # noqa: BLE001 - never let one bad event stall the others
            warn_once("cuda-event", f"a CUDA event could not be timed ({exc!r}); using the CPU clock for it")
            return self._cpu.wall_ns()

    def calibrate(self) -> None:
        self._cpu.calibrate()
        if self._device is None:
            return
        if self._pending is not None:
            event, cpu_ns = self._pending
            if event.query():
                self._ref, self._ref_ns, self._pending = event, cpu_ns, None
            return
        now = self._cpu.wall_ns()
        if now < self._next_calibration:
            return
        self._next_calibration = now + self._recalibrate_ns
        with self._api.on_device(self._device):
            if self._stream is None:
                self._stream = self._api.side_stream(self._device)
            event = self._api.event()
            cpu_ns = self._cpu.wall_ns()
            event.record(self._stream)
        self._pending = (event, cpu_ns)


def cuda_clock() -> CudaClock | None:
    """A CUDA clock once the script has initialised CUDA, else None.

    The agent never initialises CUDA itself: that would create a context on GPU 0 in every
    rank. The runtime asks again until the script has done it, then swaps clocks; CPU tokens
    taken before stay valid because they are already nanoseconds.
    """
    try:
        import torch

        if not torch.cuda.is_initialized():
            return None
        return CudaClock(TorchCuda())
    except Exception as exc:  # noqa: BLE001 - no usable GPU: CPU time is still correct
        warn_once("cuda-clock", f"CUDA timing unavailable ({exc!r}); spans use the CPU clock")
        return None

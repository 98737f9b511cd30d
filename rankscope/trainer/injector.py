"""Fault injection: real faults in a real run, for the demo, the diagnosis tests and users' drills.

Each fault of an ``--inject`` spec (``rankscope.common.fault_spec``) changes what its rank really
does: a straggler's compute really takes longer, a hung rank really stops before a collective, a
crash really exits non-zero.
"""

from __future__ import annotations

import time

from rankscope.common.fault_spec import Fault


class Injector:
    """The faults that concern one rank, applied at the trainer's hook points.

    Hook points: ``begin_step`` (crash), ``before_collective`` (hang), ``stretch`` (straggler),
    ``poison`` (NaN) and ``link_delay`` (slow link). With no fault for this rank each is a
    cheap check of a precomputed value.
    """

    def __init__(self, faults: list[Fault], rank: int) -> None:
        self.rank = rank
        self.step = 0
        mine = [f for f in faults if f.rank == rank]
        self._crash_steps = {f.step for f in mine if f.kind == "crash"}
        self._hang_steps = {f.step for f in mine if f.kind == "hang"}
        self._nan_steps = {f.step for f in mine if f.kind == "nan"}
        self._stragglers = sorted(((f.from_step, f.factor) for f in mine if f.kind == "straggler"))
        self._link_delay_s = {f.dst: f.delay_ms / 1e3 for f in faults if f.kind == "slow_link" and f.src == rank}
        self._factor = 1.0
        self._hang_armed = False

    def begin_step(self, step: int) -> None:
        """Called at the start of every step; raises the injected crash."""
        self.step = step
        self._factor = max((factor for start, factor in self._stragglers if step >= start), default=1.0)
        self._hang_armed = step in self._hang_steps
        if step in self._crash_steps:
            raise RuntimeError(f"rankscope injected crash: rank {self.rank} at step {step}")

    def before_collective(self) -> None:
        """Called before every collective and point-to-point operation; never returns on an injected hang."""
        if self._hang_armed:
            print(f"[rankscope] injected hang: rank {self.rank} stops at step {self.step}", flush=True)
            while True:  # a real hang: the process lives on, its heartbeats go on, it never arrives
                time.sleep(3600)

    @property
    def stretching(self) -> bool:
        """Whether this rank is an injected straggler at the current step."""
        return self._factor > 1.0

    def stretch(self, compute_s: float, *, burn: bool) -> None:
        """Make ``compute_s`` seconds of this rank's compute take ``factor`` times as long.

        ``burn``: on CPU the rank does the extra work (spins on its CPU clock), so its CPU time
        grows as a slower CPU's would; on a GPU the host sleeps between synchronised points,
        which the device's events record as time the segment took.
        """
        extra = (self._factor - 1.0) * compute_s
        if extra <= 0:
            return
        if not burn:
            time.sleep(extra)
            return
        end = time.thread_time() + extra
        while time.thread_time() < end:
            pass

    def poison(self, step: int) -> bool:
        """Whether this rank's output becomes NaN at ``step``."""
        return step in self._nan_steps

    def link_delay(self, dst: int) -> float:
        """Seconds to delay a point-to-point send to global rank ``dst``."""
        return self._link_delay_s.get(dst, 0.0)


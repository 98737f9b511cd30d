"""Fault injection: real faults in a real run, for the demo, the diagnosis tests and users' drills.

A spec is one or more faults separated by ``;`` (see ``GRAMMAR``). Each fault changes what its
rank really does: a straggler's compute really takes longer, a hung rank really stops before a
collective, a crash really exits non-zero.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

GRAMMAR = """\
fault spec: FAULT[;FAULT...] where FAULT is one of
  straggler:rank=R,factor=F,from_step=S   rank R's compute takes F (>1) times as long from step S
  hang:rank=R,step=S                      rank R stops before its next collective at step S
  crash:rank=R,step=S                     rank R raises and exits non-zero at step S
  nan:rank=R,step=S                       rank R's output (loss or activations) becomes NaN at step S
  slow_link:src=R1,dst=R2,delay_ms=D      every point-to-point send from R1 to R2 is delayed by D ms
steps are numbered from 1; ranks from 0"""

# kind -> {key: type}; every key is required
_KEYS: dict[str, dict[str, type]] = {
    "straggler": {"rank": int, "factor": float, "from_step": int},
    "hang": {"rank": int, "step": int},
    "crash": {"rank": int, "step": int},
    "nan": {"rank": int, "step": int},
    "slow_link": {"src": int, "dst": int, "delay_ms": float},
}
#: a value's type in words, for messages
_WHAT: dict[type, str] = {int: "a whole number", float: "a number"}
_FAULT_RE = re.compile(r"^\s*([a-z_]+)\s*:(.*)$")


class FaultSpecError(ValueError):
    """A malformed fault spec, in one line; ``GRAMMAR`` (in ``rankscope train --help``) lists what is accepted."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"bad --inject: {problem} (faults: straggler, hang, crash, nan, slow_link; the grammar is in rankscope train --help)")


@dataclass(frozen=True)
class Fault:
    """One parsed fault; the fields that its kind does not use stay at their defaults."""

    kind: str
    rank: int = -1
    step: int = 0
    from_step: int = 0
    factor: float = 1.0
    src: int = -1
    dst: int = -1
    delay_ms: float = 0.0

    def check_ranks(self, world_size: int, steps: int) -> None:
        """Refuse ranks outside the job and steps outside the run, before any process starts."""
        for name in ("rank", "src", "dst"):
            value = getattr(self, name)
            if name in _KEYS[self.kind] and not 0 <= value < world_size:
                raise FaultSpecError(f"{self.kind}: {name}={value} is not a rank of this {world_size}-rank job")
        for name in ("step", "from_step"):
            value = getattr(self, name)
            if name in _KEYS[self.kind] and not 1 <= value <= steps:
                raise FaultSpecError(f"{self.kind}: {name}={value} is not a step of this {steps}-step run")


def parse(spec: str) -> list[Fault]:
    """Parse a spec such as ``straggler:rank=5,factor=1.3,from_step=4;hang:rank=2,step=9``."""
    faults: list[Fault] = []
    for part in (p for p in spec.split(";") if p.strip()):
        match = _FAULT_RE.match(part)
        if not match or match.group(1) not in _KEYS:
            raise FaultSpecError(f"{part.strip()!r} does not start with a known fault kind and ':'")
        kind, body = match.group(1), match.group(2)
        wanted = _KEYS[kind]
        values: dict[str, object] = {}
        for item in (i for i in body.split(",") if i.strip()):
            key, sep, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if not sep or key not in wanted:
                raise FaultSpecError(f"{kind}: {item.strip()!r} is not one of {', '.join(k + '=' for k in wanted)}")
            if key in values:
                raise FaultSpecError(f"{kind}: {key} given twice")
            try:
                values[key] = wanted[key](raw)
            except ValueError:
                raise FaultSpecError(f"{kind}: {key}={raw!r} is not {_WHAT[wanted[key]]}") from None
        missing = [k for k in wanted if k not in values]
        if missing:
            raise FaultSpecError(f"{kind}: missing {', '.join(missing)}")
        fault = Fault(kind=kind, **values)  # type: ignore[arg-type]
        if kind == "straggler" and not (fault.factor > 1.0 and math.isfinite(fault.factor)):
            raise FaultSpecError(f"straggler: factor={fault.factor} must be a number above 1")
        if kind == "slow_link" and not (fault.delay_ms > 0 and math.isfinite(fault.delay_ms)):
            raise FaultSpecError(f"slow_link: delay_ms={fault.delay_ms} must be positive")
        if kind == "slow_link" and fault.src == fault.dst:
            raise FaultSpecError("slow_link: src and dst must differ")
        faults.append(fault)
    return faults


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


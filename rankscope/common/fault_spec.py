"""The fault grammar of ``--inject``: what ``rankscope train`` injects into a real run
(``rankscope.trainer.injector``), and what the demo, the scale simulator and the scenarios ask for.

A spec is one or more faults separated by ``;`` (see ``GRAMMAR``), parsed into ``Fault``s.
"""

from __future__ import annotations

import math
import re
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

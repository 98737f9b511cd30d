"""The detectors the diagnosis runs, in precedence order, and the live lanes derived from them.

Registration order is the order of a pass: a detector that heeds another's kinds is registered
after it, in the same lane. The built-ins are registered here, once, at import; a detector of
one's own is added with ``register`` (or for a while, ``added``) and runs in every pass of its
lane from then on, live and offline alike.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import get_args

from rankscope.collector.diagnosis import crash, gpu, hang, nan, slow_link, straggler
from rankscope.collector.diagnosis.detector import Detector, Urgency

_lock = threading.Lock()
_registered: tuple[Detector, ...] = ()  # replaced whole: the lanes' threads read it without the lock


def register(detector: Detector) -> None:
    """Run ``detector`` after those registered before it; refused (ValueError) when its name or a kind
    is taken, its lane unknown, or a kind it heeds is not named by an earlier detector of its lane."""
    global _registered
    with _lock:
        if detector.lane not in get_args(Urgency):
            raise ValueError(f"detector {detector.name!r}: lane {detector.lane!r} is none of {get_args(Urgency)}")
        if not detector.kinds:
            raise ValueError(f"detector {detector.name!r} names no kind of incident")
        for other in _registered:
            if other.name == detector.name:
                raise ValueError(f"a detector named {detector.name!r} is registered already")
            if taken := set(other.kinds) & set(detector.kinds):
                raise ValueError(f"detector {detector.name!r}: kinds {sorted(taken)} are {other.name!r}'s")
        before = {kind for other in _registered if other.lane == detector.lane for kind in other.kinds}
        if unnamed := set(detector.heeds) - before:
            raise ValueError(f"detector {detector.name!r} heeds {sorted(unnamed)}, named by no detector registered before it in its lane")
        _registered = (*_registered, detector)


def unregister(detector: Detector) -> None:
    """Run ``detector`` no more; refused (ValueError) while a registered detector heeds its kinds."""
    global _registered
    with _lock:
        if not any(other is detector for other in _registered):
            raise ValueError(f"detector {detector.name!r} is not registered")
        if heeding := [other.name for other in _registered if set(other.heeds) & set(detector.kinds)]:
            raise ValueError(f"detector {detector.name!r}: {heeding} heed its kinds")
        _registered = tuple(other for other in _registered if other is not detector)


@contextmanager
def added(detector: Detector) -> Iterator[None]:
    """``detector`` registered for the ``with`` block only (a test's, a session's)."""
    register(detector)
    try:
        yield
    finally:
        unregister(detector)


def registered() -> tuple[Detector, ...]:
    """The registered detectors, in the order a pass runs them."""
    return _registered


@dataclass(frozen=True)
class Lane:
    """Detectors the live diagnosis passes together, on their own schedule: the registered detectors of
    ``urgencies``, read at each pass (one registered later is in it); a lane's pass closes only the
    incidents of its detectors' kinds that it no longer finds."""

    name: str
    urgencies: tuple[Urgency, ...]

    @property
    def detectors(self) -> tuple[Detector, ...]:
        return tuple(d for d in _registered if d.lane in self.urgencies)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.detectors)

    def owns(self, kind: str) -> bool:
        return any(kind in d.kinds for d in self.detectors)


#: faults that stop a job: named within seconds of their threshold whatever the other lane costs
URGENT = Lane("urgent", ("urgent",))
THOROUGH = Lane("thorough", ("thorough",))
#: one pass of every detector (``rankscope diagnose``, and ``LiveDiagnosis.pass_once`` by default)
EVERY = Lane("every", ("urgent", "thorough"))

#: the built-ins in precedence order: a hang before crashes, whose detector heeds it
BUILT_IN = (hang.DETECTOR, crash.DETECTOR, straggler.DETECTOR, nan.DETECTOR, slow_link.DETECTOR, gpu.DETECTOR)
for _detector in BUILT_IN:
    register(_detector)

"""What the diagnosis engine needs of a detector: the engine knows none of them by name.

A detector names one family of faults from the store. The engine runs the registered ones
(``rankscope.collector.diagnosis.registry``) in their order, each in its lane, and learns from
the detector itself what it needs beyond the store: the findings of detectors run before it in
the pass (``heeds``: the crash detector heeds hangs, because the ranks that time out after a hang
are its consequences), and stack dumps of the ranks it names (``stack_dumps``: the hang's root).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from rankscope.collector.diagnosis.context import RunContext
from rankscope.common.incidents import Finding

#: the lane a detector runs in, live: "urgent" for faults that stop a job and are cheap to look
#: for (hangs, crashes), named within seconds whatever the other lane costs; "thorough" for the rest
Urgency = Literal["urgent", "thorough"]


@dataclass(frozen=True)
class Scan:
    """One pass over one run as a detector sees it: the run (``ctx``) and what only the pass knows."""

    ctx: RunContext
    #: rank -> when the collector last heard from it (live: its own clock, ahead of what it has
    #: stored when it lags); None offline
    heard: Mapping[int, int] | None
    #: the findings of the kinds the detector heeds, from the detectors before it in this pass
    heeded: tuple[Finding, ...]
    #: the pass's now in ns, read when a detector asks (offline it is a query)
    clock: Callable[[], int]

    @property
    def now_ns(self) -> int:
        """The collector's clock (live) or when the live passes last looked at the run (offline: ``engine.offline_now``)."""
        return self.clock()


class Detector(Protocol):
    """One family of faults the engine looks for on every pass of its lane."""

    @property
    def name(self) -> str:
        """Unique among the registered: what lanes list, the ``detector`` label of /metrics' detector seconds."""
        ...

    @property
    def kinds(self) -> tuple[str, ...]:
        """The incident kinds it names, no other detector's: a pass of its lane closes the incidents of
        these kinds that it no longer finds, and those only."""
        ...

    @property
    def lane(self) -> Urgency:
        """The live lane it runs in."""
        ...

    @property
    def heeds(self) -> tuple[str, ...]:
        """Kinds of the detectors registered before it in its lane whose findings of this pass it is
        handed (``Scan.heeded``): what it must not name again as a fault of its own."""
        ...

    @property
    def stack_dumps(self) -> str | None:
        """Why the agents of the ranks it names are asked for a stack dump (live; the newest dump of
        each since the finding began is attached to it); None: no dumps."""
        ...

    def detect(self, scan: Scan) -> list[Finding]:
        """What it finds in the run now; SQL over ``scan.ctx`` only, so it runs live and offline alike."""
        ...


@dataclass(frozen=True)
class FunctionDetector:
    """A ``Detector`` made of a function of the scan: how the built-in detector modules declare theirs."""

    name: str
    kinds: tuple[str, ...]
    lane: Urgency
    find: Callable[[Scan], list[Finding]]
    heeds: tuple[str, ...] = ()
    stack_dumps: str | None = None

    def detect(self, scan: Scan) -> list[Finding]:
        return self.find(scan)

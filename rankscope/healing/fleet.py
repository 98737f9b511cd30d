"""What a self-healing driver can do to the hosts of a job: pause and resume its workers, check a
host, fence it, make the survivors restart.

``Fleet`` is the seam; ``rankscope.testbed.healing_fleet.TestbedFleet`` drives the namespace hosts of a
test bed from outside, as a cluster's node manager would drive machines.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Protocol

from rankscope.healing.selfcheck import Runner


class Fleet(Protocol):
    """The hosts of one job, seen from the driver."""

    #: where a self-check's commands run
    runner: Runner

    def hosts(self) -> list[str]:
        """Every host that can run the job (evicted ones included until fenced)."""
        ...

    def workers(self, hosts: Iterable[str]) -> set[int]:
        """The training processes running on ``hosts`` now."""
        ...

    def signal(self, pids: Iterable[int], sig: signal.Signals) -> int:
        """Send ``sig`` to those of ``pids`` still running; how many got it."""
        ...

    def fence(self, host: str) -> str:
        """Make sure nothing of the job runs on ``host`` any more, and never rejoins; what was done."""
        ...

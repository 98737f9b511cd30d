"""What a self-healing driver can do to the hosts of a job: pause and resume its workers, check a
host, fence it, make the survivors restart, take a fenced host back.

``Fleet`` is the seam: ``rankscope.healing.slurm_fleet.SlurmFleet`` reaches a Slurm job's nodes
through Slurm alone; ``rankscope.testbed.healing_fleet.TestbedFleet`` drives the namespace hosts of
a test bed from outside, as a cluster's node manager would drive machines.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Protocol

from rankscope.healing.selfcheck import Runner

#: a training process as a fleet names it: (host, its process id there)
Worker = tuple[str, int]


class Fleet(Protocol):
    """The hosts of one job, seen from the driver."""

    #: where a self-check's commands run
    runner: Runner

    def hosts(self) -> list[str]:
        """Every host that can run the job (evicted ones included until fenced)."""
        ...

    def workers(self, hosts: Iterable[str]) -> set[Worker]:
        """The training processes running on ``hosts`` now."""
        ...

    def signal(self, workers: Iterable[Worker], sig: signal.Signals) -> int:
        """Send ``sig`` to those of ``workers`` still running; how many got it."""
        ...

    def fence(self, host: str, reason: str) -> str:
        """Make sure nothing of the job runs on ``host`` any more, and never rejoins; ``reason`` says why
        where the cluster keeps one (a drained node's); returns what was done."""
        ...

    def release(self, host: str) -> str:
        """Let jobs land on a fenced ``host`` again (it passed a self-check since); returns what was done."""
        ...

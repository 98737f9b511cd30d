"""What a self-healing driver can do to the hosts of a job: pause and resume its workers, check a
host, fence it, make the survivors restart.

``Fleet`` is the seam; ``TestbedFleet`` drives the namespace hosts of a test bed from outside, as a
cluster's node manager would drive machines. The workers are torchrun's: killing them makes each
host's elastic agent restart its workers and meet the others at a new rendezvous, without the
fenced host (its agent is gone with it).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from rankscope.healing.selfcheck import Runner, TestbedRunner
from rankscope.testbed import faults
from rankscope.testbed.hosts import Testbed
from rankscope.testbed.job import find_ranks


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


@dataclass
class TestbedFleet:
    """The hosts of a test bed: workers found by their torchrun environment in each namespace."""

    bed: Testbed

    @property
    def runner(self) -> Runner:
        return TestbedRunner(self.bed)

    def hosts(self) -> list[str]:
        return [h.name for h in self.bed.hosts]

    def workers(self, hosts: Iterable[str]) -> set[int]:
        wanted = set(hosts)
        return {rank.pid for rank in find_ranks(self.bed).values() if rank.host.name in wanted}

    def signal(self, pids: Iterable[int], sig: signal.Signals) -> int:
        sent = 0
        for pid in pids:
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
        return sent

    def fence(self, host: str) -> str:
        """Kill every process of the host, its torchrun agent included (a frozen host is thawed to die)."""
        return faults.kill_host(self.bed, self.bed.host(host)).what

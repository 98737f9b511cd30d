"""A test bed as the healing driver sees it: its hosts as a ``Fleet`` (workers found, paused and
fenced from outside, as a cluster's node manager would) and a self-check ``Runner`` that runs the
probes inside each namespace host.

The workers are torchrun's: killing them makes each host's elastic agent restart its workers and
meet the others at a new rendezvous, without the fenced host (its agent is gone with it).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rankscope.common.processes import signal_each
from rankscope.healing.fleet import Worker
from rankscope.healing.selfcheck import Runner
from rankscope.testbed import host_faults
from rankscope.testbed.hosts import SUBNET, Testbed, command_on
from rankscope.testbed.job import find_ranks


@dataclass(frozen=True)
class TestbedRunner:
    """The hosts of a test bed: a command runs in the host's cgroups, CPUs, namespace and host name."""

    __test__ = False  # not a pytest test class, whatever its name

    bed: Testbed
    #: the link tests contact the hosts' own network and loopback only
    networks: tuple[str, ...] = (f"{SUBNET}.0/24", "127.0.0.0/8")

    @property
    def hosts(self) -> list[str]:
        return [h.name for h in self.bed.hosts]

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        return command_on(self.bed.host(host), argv)

    def address(self, host: str) -> str:
        return self.bed.host(host).address


@dataclass
class TestbedFleet:
    """The hosts of a test bed: workers found by their torchrun environment in each namespace."""

    __test__ = False  # not a pytest test class, whatever its name

    bed: Testbed

    @property
    def runner(self) -> Runner:
        return TestbedRunner(self.bed)

    def hosts(self) -> list[str]:
        return [h.name for h in self.bed.hosts]

    def workers(self, hosts: Iterable[str]) -> set[Worker]:
        wanted = set(hosts)
        return {(rank.host.name, rank.pid) for rank in find_ranks(self.bed).values() if rank.host.name in wanted}

    def signal(self, workers: Iterable[Worker], sig: signal.Signals) -> int:
        return signal_each((pid for _, pid in workers), sig)  # the hosts' processes are this machine's

    def fence(self, host: str, reason: str) -> str:
        """Kill every process of the host, its torchrun agent included (a frozen host is thawed to die);
        a test bed keeps no reason."""
        return host_faults.kill_host(self.bed, self.bed.host(host)).what

    def release(self, host: str) -> str:
        return "a test bed keeps no fence: nothing to release"


@dataclass(frozen=True)
class TestbedNodes:
    """A test bed's hosts for ``rankscope node``: no scheduler keeps them, so a drain is only what the
    store says (``rankscope launch`` leaves a fenced host out of its job); a check runs inside the host."""

    __test__ = False  # not a pytest test class, whatever its name

    bed: Testbed

    def drain(self, host: str, reason: str) -> str:
        return f"{host} stays out of the jobs rankscope launches (a test bed keeps no drained state of its own)"

    @contextmanager
    def holding(self, host: str) -> Iterator[Runner]:
        yield TestbedRunner(self.bed)

    def states(self) -> dict[str, tuple[str, str]]:
        return {}

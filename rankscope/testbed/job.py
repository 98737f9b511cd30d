"""A training job on a test bed: one torchrun elastic agent per host, meeting at a c10d rendezvous.

Each host's launcher joins the host's cgroups, takes its CPUs, enters its namespace and a UTS namespace of its own
(so ``socket.gethostname()`` in its ranks is the host's name, as on a real machine), and runs
``torchrun --nnodes=N --rdzv-backend=c10d`` with the rendezvous on host 0. gloo talks over the
host's ``eth0``. The ranks reach the collector through a Unix socket (a file the namespaces share):
the telemetry stays off the links that the faults slow down, like a real cluster's management
network. Which rank runs on which host is read back from the processes (``placement``), never assumed.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.common.processes import training_rank
from rankscope.healing.elastic import RDZV_PORT, agent_command, relay_socket
from rankscope.healing.launchers import Launchers
from rankscope.testbed.hosts import HOST_IF, Host, Testbed, TestbedError, command_on, pin_rank

__all__ = ["Job", "Rank", "find_ranks", "launch", "trainer"]


def trainer(*flags: str) -> list[str]:
    """The bundled trainer as the program of a job: ``launch(bed, trainer("--tp", "2", ...))``."""
    return ["-m", "rankscope.trainer", *flags]


@dataclass(frozen=True)
class Rank:
    """One training process: its global rank, local rank, pid and host."""

    rank: int
    local_rank: int
    pid: int
    host: Host


@dataclass(kw_only=True)
class Job(Launchers):
    """The launchers of one job on a test bed (one per host) and where its ranks run."""

    bed: Testbed
    ranks_per_host: int
    _placement: dict[int, Rank] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.ranks_per_host * len(self.launchers)

    def placement(self, timeout_s: float = 120) -> dict[int, Rank]:
        """Global rank -> its process and host, once every rank has started (read from /proc); each
        rank gets its share of its host's CPU to itself (``pin_rank``) when first found."""
        deadline = time.monotonic() + timeout_s
        while len(self._placement) < self.world_size:
            for rank, found in find_ranks(self.bed).items():
                if rank not in self._placement:  # a rank's first process is the one launched
                    try:
                        pin_rank(found.host, found.local_rank, found.pid, self.ranks_per_host)
                    except ProcessLookupError:
                        pass  # it has ended already
                    self._placement[rank] = found
            if len(self._placement) < self.world_size:
                if time.monotonic() > deadline or self.finished():
                    raise TestbedError(f"only ranks {sorted(self._placement)} of {self.world_size} started\n{self.output()}")
                time.sleep(0.2)
        return dict(self._placement)

    def ranks_on(self, host: Host) -> list[Rank]:
        return sorted((r for r in self.placement().values() if r.host == host), key=lambda r: r.rank)


def launch(
    bed: Testbed, program: Sequence[str], *, run_id: str, workdir: Path, ranks_per_host: int | None = None,
    env: Mapping[str, str] | None = None, max_restarts: int = 0, min_hosts: int | None = None,
    rendezvous: str | None = None, rdzv_conf: Mapping[str, object] | None = None, hosts: Sequence[Host] | None = None,
    cwd: Path | None = None,
) -> Job:  # fmt: skip
    """Start ``program`` (a script and its arguments, or ``-m module ...``) on every host of ``bed``.

    ``env`` is added to this process's environment (the agent's variables, say). The rendezvous id
    is ``run_id``, which the agent also takes as the run's id. ``ranks_per_host`` defaults to the test bed's.
    An elastic job (``min_hosts`` below the number of hosts) goes on with that many hosts after
    torchrun's agents restart it (``max_restarts``). ``rendezvous``: a c10d store already served at
    that ``address:port`` (``rankscope.healing.rendezvous``); by default host 0's agent serves it,
    and the job dies with host 0. ``rdzv_conf``: more of torchrun's ``--rdzv-conf`` keys. ``hosts``:
    the hosts that start it (default: all; ``Job.add`` starts another later). ``cwd``: where the
    program runs (default: ``workdir``), so that its relative paths mean what its user meant.
    """
    ranks_per_host = ranks_per_host or bed.ranks_per_host
    workdir.mkdir(parents=True, exist_ok=True)
    starting = list(hosts or bed.hosts)
    head = starting[0]
    base = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": HOST_IF, "PYTHONUNBUFFERED": "1", **(env or {})}
    nnodes = f"{min_hosts}:{len(starting)}" if min_hosts is not None else str(len(starting))

    def start(host: Host) -> tuple[subprocess.Popen[bytes], Path]:
        conf = {"is_host": str(rendezvous is None and host is head).lower(), **(rdzv_conf or {})}
        torchrun = agent_command(program, run_id=run_id, nnodes=nnodes, ranks_per_host=ranks_per_host,
                                 endpoint=rendezvous or f"{head.address}:{RDZV_PORT}", max_restarts=max_restarts, rdzv_conf=conf,
                                 relay=relay_socket(base, host.name))  # fmt: skip
        log = workdir / f"{host.name}.log"
        with open(log, "wb") as out:
            launcher = subprocess.Popen(
                command_on(host, torchrun), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=base, cwd=cwd or workdir,
                start_new_session=True,
            )  # fmt: skip
        return launcher, log

    job = Job(run_id=run_id, bed=bed, ranks_per_host=ranks_per_host, start_on=lambda name: start(bed.host(name)))
    for host in starting:
        job.add(host.name)
    return job


def find_ranks(bed: Testbed) -> dict[int, Rank]:
    """The training processes running on the test bed now, by global rank."""
    found = {}
    for host in bed.hosts:
        for pid in bed.pids(host):
            rank = training_rank(pid)
            if rank is not None:
                found[rank[0]] = Rank(rank[0], rank[1], pid, host)
    return found

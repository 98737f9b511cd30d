"""A Slurm job's nodes as the healing driver sees them, reached through Slurm alone.

The driver runs inside the job's allocation (``SLURM_JOB_ID``). The job's hosts are its nodes; a
node's workers are found, paused and resumed by a job step on that node (``srun --overlap``
running ``rankscope.healing.node_workers``); the self-check's probes run on a node the same way
(``SlurmRunner``); a node is fenced by draining it with a reason that names the incident (neither
this job nor the next lands on it) and ending the job's processes on it: the job steps that run
on that node alone are cancelled (a torchrun agent a node), the job's training ranks left there
are killed through a step; a node that does not answer is declared DOWN as well. Nothing reaches
a node by any way Slurm does not provide.

``slurm`` wraps each Slurm command (identity on a cluster: they are on PATH, ``SLURM_CONF`` in the
environment; the test bed runs them on its control host).
"""

from __future__ import annotations

import getpass
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rankscope.healing.fleet import Worker

__all__ = ["SlurmError", "SlurmFleet", "SlurmNodes", "SlurmRunner", "Wrap", "addresses", "fields", "node_list"]

Wrap = Callable[[Sequence[str]], list[str]]
#: seconds a Slurm command may take (a node that does not answer makes srun wait for it)
COMMAND_TIMEOUT_S = 60.0
#: seconds a step on one node may take to list or signal its workers (a frozen node never answers)
NODE_TIMEOUT_S = 20.0


class SlurmError(RuntimeError):
    """A Slurm command failed: what it said."""


def _run(wrap: Wrap, argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    done = subprocess.run(wrap(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"{' '.join(argv[:3])}...: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def _in_job(job_id: str) -> tuple[str, ...]:
    """srun's options for a step of job ``job_id`` beside the job's own steps."""
    return ("--overlap", f"--jobid={job_id}")


def _step_on(where: Sequence[str], host: str, argv: Sequence[str]) -> list[str]:
    """``argv`` as one task on node ``host``, where srun's options ``where`` place it (a job's step, a reservation)."""
    return ["srun", *where, f"--nodelist={host}", "--nodes=1", "--ntasks=1", "--quiet", *argv]


def fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value`` (``scontrol --oneliner``) as a dict."""
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


def node_list(slurm: Wrap, job_id: str) -> list[str]:
    """The nodes of Slurm job ``job_id``, in Slurm's order (its batch script runs on the first)."""
    nodes = fields(_run(slurm, ["scontrol", "show", "job", "--oneliner", job_id]))["NodeList"]
    return _run(slurm, ["scontrol", "show", "hostnames", nodes]).split()


@dataclass(frozen=True)
class SlurmRunner:
    """A self-check's commands as srun tasks on the node: job steps beside the job's own (``srun
    --overlap --jobid``), or, for a node outside any job, in a reservation that holds it."""

    #: srun's options that place the task (``_in_job(job_id)``, ``--reservation=NAME``)
    where: tuple[str, ...]
    slurm: Wrap = list
    #: the nodes' addresses (the link probes contact them and loopback only)
    addresses: dict[str, str] = field(default_factory=dict)

    @property
    def networks(self) -> tuple[str, ...]:
        return (*(f"{address}/32" for address in self.addresses.values()), "127.0.0.0/8")

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        return self.slurm(_step_on(self.where, host, argv))

    def address(self, host: str) -> str:
        return self.addresses[host]


@dataclass
class SlurmFleet:
    """The nodes of Slurm job ``job_id``."""

    job_id: str
    slurm: Wrap = list
    #: the Python that runs ``rankscope.healing.node_workers`` on a node (the job's, shared by its nodes)
    python: str = sys.executable
    #: nodes a step could not list or signal workers on (frozen, gone): their workers are not counted
    unreachable: set[str] = field(default_factory=set)
    _runner: SlurmRunner | None = None

    @property
    def runner(self) -> SlurmRunner:
        if self._runner is None:
            self._runner = SlurmRunner(_in_job(self.job_id), self.slurm, addresses(self.slurm, self.hosts()))
        return self._runner

    def hosts(self) -> list[str]:
        return node_list(self.slurm, self.job_id)

    def workers(self, hosts: Iterable[str]) -> set[Worker]:
        found: set[Worker] = set()
        for host in hosts:
            if (answer := self._on(host, ["list"])) is not None:
                found |= {(host, int(pid)) for pid in answer["ranks"]}
        return found

    def signal(self, workers: Iterable[Worker], sig: signal.Signals) -> int:
        by_host: dict[str, list[int]] = {}
        for host, pid in workers:
            by_host.setdefault(host, []).append(pid)
        answers = [self._on(host, ["signal", sig.name, *map(str, pids)]) for host, pids in by_host.items()]
        return sum(int(answer["sent"]) for answer in answers if answer is not None)

    def fence(self, host: str, reason: str) -> str:
        """Drain the node with ``reason``, cancel the job's steps that run on it alone, kill the job's
        ranks left there, or declare it DOWN too when it does not answer; returns what was done."""
        SlurmNodes(self.slurm).drain(host, reason)
        steps = []
        for line in _run(self.slurm, ["squeue", "--steps", f"--jobs={self.job_id}", "--noheader", "--format=%i|%N"]).splitlines():
            step, _, nodes = line.strip().partition("|")
            if nodes and _run(self.slurm, ["scontrol", "show", "hostnames", nodes]).split() == [host]:
                steps.append(step)
        if steps:
            _run(self.slurm, ["scancel", "--quiet", *steps])
        done = f"drained {host} ({reason}); cancelled {', '.join(steps) or 'no step of its own'}"
        left = self.workers([host])
        if host in self.unreachable:
            SlurmNodes(self.slurm).down(host, reason)
            return (f"{done}; {host} does not answer: set DOWN too (still drained), so that Slurm ends the job's part there now "
                    "rather than after SlurmdTimeout")  # fmt: skip
        return f"{done}; killed {self.signal(left, signal.SIGKILL)} ranks left there"

    def release(self, host: str) -> str:
        """The node may take jobs again (it passed its self-check); it is still in this job's allocation."""
        return SlurmNodes(self.slurm).release(host)

    def requeue(self) -> None:
        """Hand the job back to Slurm: it ends the job's processes (this one's among them) and runs its
        batch script again on the nodes it picks, never a drained one, once the old credentials have
        expired (``cred_expire``, 2 minutes by default). It asks for the nodes it holds then: one that
        Slurm has declared DOWN under ``--no-kill`` has left the allocation."""
        _run(self.slurm, ["scontrol", "requeue", self.job_id])

    def _on(self, host: str, argv: Sequence[str]) -> dict[str, Any] | None:
        """``rankscope.healing.node_workers ARGV`` on ``host`` as a step of the job: its answer, None if
        the node did not answer in time (it goes into ``unreachable``)."""
        try:
            out = _run(self.slurm, _step_on(_in_job(self.job_id), host, [self.python, "-m", "rankscope.healing.node_workers", *argv]), NODE_TIMEOUT_S)
            answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        except (SlurmError, subprocess.TimeoutExpired, ValueError, IndexError):
            self.unreachable.add(host)
            return None
        self.unreachable.discard(host)
        return answer


def addresses(slurm: Wrap, nodes: Sequence[str]) -> dict[str, str]:
    """Each of ``nodes``' address, as Slurm knows it."""
    found = {}
    for line in _run(slurm, ["scontrol", "show", "node", "--oneliner", ",".join(nodes)]).splitlines():
        node = fields(line)
        found[node["NodeName"]] = node["NodeAddr"]
    return found


@dataclass(frozen=True)
class SlurmNodes:
    """A Slurm cluster's nodes outside any job (``rankscope node``), through Slurm's own commands; draining,
    resuming and reserving a node take Slurm operator rights."""

    slurm: Wrap = list
    #: the most a check may hold a node before Slurm lets jobs land on it again, whatever happens here
    hold_minutes: int = 30

    def drain(self, host: str, reason: str) -> str:
        _run(self.slurm, ["scontrol", "update", f"NodeName={host}", "State=DRAIN", f"Reason={reason}"])
        return f"drained {host} ({reason})"

    def down(self, host: str, reason: str) -> None:
        """Declare a drained node that does not answer DOWN. Slurm waits for a silent slurmd until
        ``SlurmdTimeout`` (5 minutes by default) before it ends a job's part on it: until then the job
        stays COMPLETING, and a requeued one does not start again (82 s against 26 s on the test bed).
        The drain stays: when the node's slurmd registers again it is still drained, never idle."""
        _run(self.slurm, ["scontrol", "update", f"NodeName={host}", "State=DOWN", f"Reason={reason}"])

    @contextmanager
    def holding(self, host: str) -> Iterator[SlurmRunner]:
        """A maintenance reservation on ``host`` for this user, then the node resumed: only this user's
        tasks in the reservation land on it while it is checked. The reservation is deleted at the end:
        a node drained again meanwhile stays drained, one that passed takes jobs again."""
        name = f"rankscope-check-{host}"
        _run(self.slurm, ["scontrol", "create", "reservation", f"ReservationName={name}", f"Nodes={host}", "StartTime=now",
                          f"Duration={self.hold_minutes}", f"Users={getpass.getuser()}", "Flags=MAINT,IGNORE_JOBS"])  # fmt: skip
        try:
            _run(self.slurm, ["scontrol", "update", f"NodeName={host}", "State=RESUME"])
            yield SlurmRunner((f"--reservation={name}",), self.slurm, addresses(self.slurm, [host]))
        finally:
            self._unreserve(name)

    def _unreserve(self, name: str, timeout_s: float = 30.0) -> None:
        """Cancel what still runs in reservation ``name`` (a check's task that did not end), then delete it."""
        _run(self.slurm, ["scancel", "--quiet", f"--reservation={name}"])
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                _run(self.slurm, ["scontrol", "delete", f"ReservationName={name}"])
                return
            except SlurmError as e:
                if time.monotonic() > deadline:
                    raise SlurmError(f"reservation {name} is still in use after {timeout_s:g} s ({e}): it ends by itself in {self.hold_minutes} minutes") from None
            time.sleep(0.5)

    def release(self, host: str) -> str:
        _run(self.slurm, ["scontrol", "update", f"NodeName={host}", "State=RESUME"])
        return f"resumed {host} in Slurm"

    def states(self) -> dict[str, tuple[str, str]]:
        out = _run(self.slurm, ["sinfo", "--noheader", "--Node", "--format=%N|%T|%E"])
        return {name: (state, "" if reason == "none" else reason) for name, state, reason in (line.split("|", 2) for line in out.splitlines())}

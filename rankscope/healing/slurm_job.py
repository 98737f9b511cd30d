"""A self-healing job inside a Slurm allocation: ``rankscope launch --slurm``, started by the batch script.

The batch script runs on the allocation's first node; the driver and the job's c10d rendezvous store
run there with it. Each of the job's nodes runs torchrun's elastic agent as a job step of its own
(``srun --nodes=1 --nodelist=NODE``); the allocation's nodes beyond the job's wait as spares, and one
joins (a step of its own) for each node evicted. The driver reaches the nodes through Slurm alone
(``SlurmFleet``): a condemned node is drained with the incident as its reason, so neither this job
nor the next lands on it. When too few nodes would be left and the policy requeues, the job goes
back to Slurm (``scontrol requeue``), which runs the batch script again on healthy nodes: the same
run (``slurm-JOBID``), its next attempt, from the last checkpoint. The allocation must outlive a node (``sbatch --no-kill``): without it
Slurm ends the whole job when one of its nodes fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rankscope.collector.client import Client
from rankscope.common.agent_env import agent_environment
from rankscope.common.processes import terminate_tree
from rankscope.healing.driver import Driver
from rankscope.healing.elastic import RDZV_CONF, RDZV_PORT, agent_command, relay_socket, start_rendezvous
from rankscope.healing.launchers import Launchers
from rankscope.healing.policy import Policy
from rankscope.healing.slurm_fleet import SlurmError, SlurmFleet, Wrap, node_list

__all__ = ["Allocation", "allocation", "run"]


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs in: its id and its nodes, in Slurm's order."""

    job_id: str
    nodes: list[str]


def allocation(slurm: Wrap = list) -> Allocation:
    """The allocation this process runs in (``SLURM_JOB_ID``); SlurmError outside one."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise SlurmError("not inside a Slurm allocation (SLURM_JOB_ID is not set): run it from a batch script (sbatch) or salloc")
    return Allocation(job_id, node_list(slurm, job_id))


def run(
    program: Sequence[str], *, collector: str, run_id: str, workdir: Path, policy: Policy, spares: int = 0,
    ranks_per_node: int = 1, max_restarts: int = 3, log: Callable[[str], None] = print, slurm: Wrap = list,
    check_timeout_s: float = 20.0,
) -> tuple[dict[str, int], Driver]:  # fmt: skip
    """Run ``program`` as one elastic job on the allocation's nodes but the last ``spares``, and heal it until it ends.

    Returns each node's exit code (its agent's step) and the driver (what it evicted). Every step it
    started is gone when it returns.
    """
    found = allocation(slurm)
    if not 0 <= spares < len(found.nodes):
        raise SlurmError(f"{spares} spares leave none of the allocation's {len(found.nodes)} nodes to start the job")
    starting, waiting = found.nodes[: len(found.nodes) - spares], found.nodes[len(found.nodes) - spares :]
    if policy.min_hosts > len(starting):
        raise SlurmError(f"the job may shrink to {policy.min_hosts} nodes but starts on {len(starting)}")
    workdir.mkdir(parents=True, exist_ok=True)
    here = socket.gethostname()
    try:
        address = socket.gethostbyname(here)
    except OSError as e:
        raise SlurmError(f"the batch node's name {here!r} does not resolve ({e}): the other nodes could not reach its rendezvous store") from None
    endpoint = f"{here}:{RDZV_PORT}"
    rendezvous = start_rendezvous(f"{address}:{RDZV_PORT}", workdir / "rendezvous.log")
    env = {**os.environ, **agent_environment(collector, run_id, spool_dir=workdir / "spool", every_s=1),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip

    def start_on(node: str) -> tuple[subprocess.Popen[bytes], Path]:
        # each node's relay on a socket named for it: a path on a file system the nodes share (a home
        # directory) would otherwise be one socket for all of them
        agent = agent_command(program, run_id=run_id, nnodes=f"{policy.min_hosts}:{len(starting)}", ranks_per_host=ranks_per_node,
                              endpoint=endpoint, max_restarts=max_restarts, rdzv_conf={"is_host": "false", **RDZV_CONF},
                              relay=relay_socket(env, node))  # fmt: skip
        path = workdir / f"{node}.log"
        step = ["srun", f"--jobid={found.job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--kill-on-bad-exit=0",
                f"--job-name=rankscope-agent-{node}", *agent]  # fmt: skip
        with open(path, "ab") as out:
            proc = subprocess.Popen(slurm(step), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd(),
                                    start_new_session=True)  # fmt: skip
        return proc, path

    job = Launchers(run_id=run_id, start_on=start_on)
    launched_ns = time.time_ns()
    try:
        for node in starting:
            job.add(node)
        fleet = SlurmFleet(found.job_id, slurm)
        with Client(collector) as client:
            driver = Driver(run_id, client, fleet, policy, job, ranks_per_node, check_timeout_s=check_timeout_s, log=log,
                            spares=list(waiting), join=job.add, requeue=fleet.requeue, launched_ns=launched_ns)  # fmt: skip
            log(f"[rankscope launch] run {run_id}: Slurm job {found.job_id}, {ranks_per_node} ranks on each of {', '.join(starting)}"
                f"{'; spares ' + ', '.join(waiting) if waiting else ''}; logs in {workdir}")  # fmt: skip
            return driver.run(), driver
    finally:
        job.stop()
        terminate_tree(rendezvous, 2)

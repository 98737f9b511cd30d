"""Self-healing drills under Slurm: a fault from outside one node of a batch job that runs ``rankscope
launch --slurm``, and the job must finish without that node, drained with the incident as its reason.

Each drill makes a Slurm test bed of 4 namespace hosts of 2 ranks (``rankscope.testbed.slurm``) and a
collector on a Unix socket, and submits a batch script (``sbatch --no-kill``) that runs the bundled
trainer as ``healing_drills`` does: TP2 inside a node, dp over the nodes, a DCP checkpoint every 2
steps. The job takes 3 nodes and keeps the 4th as a spare, or, in a requeue drill, takes 3 of the 4
nodes with none to spare and may not shrink: Slurm must place it again on healthy nodes. When the job
reaches ``fault_step`` the fault hits node1 from outside; nobody acts but the driver. ``Outcome``
holds what the store says, and the reason Slurm keeps for the node.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from rankscope.harness.healing_drills import RANKS_PER_HOST, THROTTLED_STEPS, Drill, Outcome, fault_at_step, read_back, trainer_flags
from rankscope.harness.testbed_scenarios import staged
from rankscope.healing.slurm_fleet import fields
from rankscope.testbed import host_faults, hosts
from rankscope.testbed import slurm as slurm_bed
from rankscope.testbed.job import trainer

__all__ = ["DRILLS", "run"]

NODES = 4
#: the states in which Slurm is done with a job (a requeued one passes through PENDING again)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

DRILLS: dict[str, Drill] = {
    d.name: d
    for d in (
        Drill("kill-node-spare", "every process of node1 killed, slurmd too; node3 waits as a spare", lambda bed, h: host_faults.kill_host(bed, h),
              spares=1),  # fmt: skip
        Drill("freeze-node", "every process of node1 frozen, slurmd too (freezer cgroup)", lambda bed, h: host_faults.freeze_host(h)),
        Drill("throttle-node", "node1's CPU cut to a fifth (cgroup quota)", lambda bed, h: host_faults.throttle_cpu(bed, h, 0.2),
              steps=THROTTLED_STEPS),  # fmt: skip
        Drill("kill-node-requeue", "every process of node1 killed, its relay too; no spare, and the job may not shrink: requeued",
              lambda bed, h: host_faults.kill_host(bed, h), requeue=True, relays=True),  # fmt: skip
    )
}


def run(drill: Drill, *, workdir: Path | None = None, log: Callable[[str], None] = print) -> Outcome:
    """Run one drill on a Slurm test bed of its own; every process and namespace is gone when it returns."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"rankscope-slurm-{drill.name}-"))
    with staged(workdir, NODES, RANKS_PER_HOST) as (bed, address):
        cluster = slurm_bed.start(dataclasses.replace(bed, slurm=True))
        return _play(drill, cluster, address, workdir, log)


def script(drill: Drill, address: str, run_id: str, workdir: Path) -> str:
    """The drill's batch script: the job on 3 nodes (and the spares), or on 3 of 4 with no shrinking and requeue."""
    flags = ["--requeue", "--min-hosts", "3"] if drill.requeue else ["--spares", str(drill.spares), "--min-hosts", "2"]
    launch = [sys.executable, "-m", "rankscope.cli.main", "launch", "--slurm", *flags, "--ranks-per-node", str(RANKS_PER_HOST),
              "--collector", address, "--run-id", run_id, "--workdir", str(workdir / "launch"), "--", *trainer(*trainer_flags(workdir, drill.steps))]  # fmt: skip
    relays = f"export RANKSCOPE_RELAY=unix:{workdir / 'relay.sock'}\n" if drill.relays else ""  # a relay per node, started by the launch
    return (
        f"#!/bin/bash\n#SBATCH --nodes={3 + drill.spares} --no-kill --requeue --open-mode=append --output={workdir / 'job-%j.out'}\n"
        f"{relays}exec {shlex.join(launch)}\n"
    )


def _play(drill: Drill, cluster: slurm_bed.Slurm, address: str, workdir: Path, log: Callable[[str], None]) -> Outcome:
    bed = cluster.bed
    run_id = f"slurm-{drill.name}-{uuid.uuid4().hex[:8]}"
    outcome = Outcome(drill, run_id, target=bed.hosts[drill.target].name)
    batch = workdir / "drill.sbatch"
    batch.write_text(script(drill, address, run_id, workdir))
    job = cluster.run(["sbatch", "--parsable", f"--chdir={workdir}", str(batch)]).stdout.strip().split(";")[0]
    log(f"{drill.name}: Slurm job {job}, run {run_id}")
    applied: list[host_faults.Applied] = []
    stop = threading.Event()
    faulting = fault_at_step(outcome, bed, address, applied, stop.is_set, log)
    try:
        deadline = time.monotonic() + 600
        while (state := _state(cluster, job)) not in ENDED:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job} still {state} after 600 s; its output: {workdir}")
            time.sleep(1)
    finally:
        stop.set()
        faulting.join(30)
        for fault in applied:
            fault.undo()
    outcome.exits = {"slurm": 0 if state == "COMPLETED" else 1}
    outcome.fenced_as = cluster.nodes().get(outcome.target, ("", ""))[1]
    read_back(outcome, address)
    return outcome


def _state(cluster: slurm_bed.Slurm, job: str) -> str:
    try:
        out = cluster.run(["scontrol", "show", "job", "--oneliner", job]).stdout
    except hosts.TestbedError:
        return "UNKNOWN"
    return fields(out).get("JobState", "UNKNOWN")

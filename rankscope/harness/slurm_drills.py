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
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from rankscope.collector.client import Client
from rankscope.harness.healing_drills import ACTIONS_SQL, CKPT_EVERY, FINAL_HOSTS_SQL, RANKS_PER_HOST, STATUS_SQL, STEPS, Drill, Outcome
from rankscope.harness.testbed_scenarios import STEP_SQL, staged
from rankscope.testbed import host_faults, hosts
from rankscope.testbed import slurm as slurm_bed

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
        Drill("throttle-node", "node1's CPU cut to a fifth (cgroup quota)", lambda bed, h: host_faults.throttle_cpu(bed, h, 0.2)),
        Drill("kill-node-requeue", "every process of node1 killed; no spare, and the job may not shrink: requeued",
              lambda bed, h: host_faults.kill_host(bed, h), requeue=True),  # fmt: skip
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
    nodes = 3 + drill.spares
    flags = "--requeue --min-hosts 3" if drill.requeue else f"--spares {drill.spares} --min-hosts 2"
    return (
        f"#!/bin/bash\n#SBATCH --nodes={nodes} --no-kill --requeue --open-mode=append --output={workdir / 'job-%j.out'}\n"
        f"exec {sys.executable} -m rankscope.cli.main launch --slurm {flags} --ranks-per-node {RANKS_PER_HOST} --collector {address} --run-id {run_id}"
        f" --workdir {workdir / 'launch'} -- -m rankscope.trainer --tp 2 --pp 1 --dp 0 --layers 2 --hidden 64 --heads 4 --seq 64"
        f" --vocab 256 --micro-batch 2 --global-batch 12 --steps {STEPS} --ckpt-dir {workdir / 'ckpt'} --ckpt-every {CKPT_EVERY}"
        " --resume --timeout 120\n"
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

    def fault() -> None:
        if drill.apply is None:
            return
        with Client(address) as client:
            while not stop.is_set():
                rows = client.query(STEP_SQL, {"run": run_id}).to_pylist()
                if rows and (rows[0]["step"] or 0) >= drill.fault_step:
                    applied.append(drill.apply(bed, bed.host(outcome.target)))
                    outcome.fault_ns = applied[-1].at_ns
                    log(f"{drill.name}: {applied[-1].what}")
                    return
                time.sleep(0.25)

    faulting = threading.Thread(target=fault, daemon=True, name="fault")
    faulting.start()
    try:
        deadline = time.monotonic() + 600
        while (state := _state(cluster, job)) not in ENDED:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm job {job} still {state} after 600 s; its output: {workdir}")
            time.sleep(1)
    finally:
        stop.set()
        faulting.join(30)
        for applied_fault in applied:
            applied_fault.undo()
    outcome.exits = {"slurm": 0 if state == "COMPLETED" else 1}
    outcome.fenced_as = cluster.nodes().get(outcome.target, ("", ""))[1]
    with Client(address) as client:
        time.sleep(1.5)  # the collector writes every 0.5 s: the driver's last rows are in
        outcome.actions = client.query(ACTIONS_SQL, {"run": run_id}).to_pylist()
        outcome.final_hosts = sorted(client.query(FINAL_HOSTS_SQL, {"run": run_id}).to_pylist()[0]["hosts"])
        outcome.status = client.query(STATUS_SQL, {"run": run_id}).to_pylist()[0]["status"]
    return outcome


def _state(cluster: slurm_bed.Slurm, job: str) -> str:
    try:
        out = cluster.run(["scontrol", "show", "job", "--oneliner", job]).stdout
    except hosts.TestbedError:
        return "UNKNOWN"
    return dict(f.split("=", 1) for f in out.split() if "=" in f).get("JobState", "UNKNOWN")

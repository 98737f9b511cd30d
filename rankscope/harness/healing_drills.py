"""Self-healing drills on a test bed: a fault from outside, and the job must finish without the bad host.

Each drill makes 3 namespace hosts of 2 ranks, starts a collector on a Unix socket and runs the
bundled trainer (TP2 inside each host, data parallel over the hosts, dp re-planned on restart, DCP
checkpoints every 2 steps) under ``testbed.healing_job.run``. When the job reaches ``fault_step`` the
fault hits one host from outside; nobody acts but the driver. ``Outcome`` holds what the test and
the benchmark read back from the store: when the incident, the eviction and the first step after
the restart came, the steps lost, the run's effective training time ratio, and who finished.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankscope.collector.client import Client
from rankscope.collector.progress import wait_for_step
from rankscope.testbed import healing_job
from rankscope.healing.policy import Policy
from rankscope.testbed import hosts
from rankscope.testbed import host_faults
from rankscope.testbed.job import trainer
from rankscope.harness.local_scenarios import SMALL_SHAPE
from rankscope.harness.testbed_scenarios import staged

HOSTS, RANKS_PER_HOST = 3, 2
STEPS, CKPT_EVERY = 16, 2
#: a throttled host's straggler incident opens some steps after the fault and is acted on 3 slow steps later
THROTTLED_STEPS = 30
ACTIONS_SQL = (
    "SELECT toUnixTimestamp64Nano(time) AS time_ns, attempt, action, hosts, incident_id, reason, evidence "
    "FROM actions WHERE run_id = {run:String} ORDER BY time"
)
FINAL_HOSTS_SQL = (
    "SELECT groupUniqArray(host) AS hosts FROM ranks WHERE run_id = {run:String} "
    "AND attempt = (SELECT max(attempt) FROM ranks WHERE run_id = {run:String})"
)
STATUS_SQL = "SELECT argMax(status, updated) AS status FROM runs WHERE run_id = {run:String}"
NODE_STATES_SQL = "SELECT host, state FROM node_states WHERE run_id = {run:String} ORDER BY time"


@dataclass(frozen=True)
class Drill:
    name: str
    doc: str
    #: the fault, or None for a clean run (the benchmark's baseline)
    apply: Callable[[hosts.Testbed, hosts.Host], host_faults.Applied] | None
    fault_step: int = 5
    #: hosts waiting outside the job, beside its ``HOSTS``; one joins for the evicted host
    spares: int = 0
    #: the host the fault hits (node0's first round also serves the workers' store)
    target: int = 1
    #: the job may not shrink and has no spare: its scheduler places it again (Slurm's drills)
    requeue: bool = False
    #: the job's steps: a straggler is acted on only after it stayed slow for some, so a throttle needs more
    steps: int = STEPS
    #: the ranks send through a relay of their host's (``RANKSCOPE_RELAY``), which the fault takes down with the host
    relays: bool = False


DRILLS: dict[str, Drill] = {
    d.name: d
    for d in (
        Drill("kill-host", "every process of node0 killed (SIGKILL)", lambda bed, h: host_faults.kill_host(bed, h), target=0),
        Drill("freeze-host", "every process of node1 frozen (freezer cgroup)", lambda bed, h: host_faults.freeze_host(h)),
        Drill("throttle-host", "node1's CPU cut to a fifth (cgroup quota)", lambda bed, h: host_faults.throttle_cpu(bed, h, 0.2), steps=THROTTLED_STEPS),
        Drill("kill-host-spare", "every process of node0 killed; node3 waits as a spare", lambda bed, h: host_faults.kill_host(bed, h),
              spares=1, target=0),  # fmt: skip
    )
}


CLEAN = Drill("clean", "no fault", None)


@dataclass
class Outcome:
    drill: Drill
    run_id: str
    target: str = ""
    fault_ns: int = 0
    exits: dict[str, int] = field(default_factory=dict)
    actions: list[dict[str, Any]] = field(default_factory=list)
    final_hosts: list[str] = field(default_factory=list)
    status: str = ""
    #: the reason the cluster keeps for the fenced host (a drained Slurm node's)
    fenced_as: str = ""
    #: each host's states as the driver stored them, oldest first
    node_states: dict[str, list[str]] = field(default_factory=dict)

    def first(self, action: str) -> dict[str, Any] | None:
        return next((a for a in self.actions if a["action"] == action), None)

    def seconds_to(self, action: str) -> float | None:
        """Seconds from the fault to the driver's first ``action`` (``incident``: it saw the incident it acted on)."""
        found = next((a for a in self.actions if a["action"] == action and (action != "incident" or "verdict" in a["evidence"]
                      and json.loads(a["evidence"])["verdict"] in ("check", "evict", "requeue"))), None)  # fmt: skip
        return (found["time_ns"] - self.fault_ns) / 1e9 if found is not None and self.fault_ns else None

    @property
    def summary(self) -> dict[str, Any]:
        end = self.first("finished") or self.first("gave_up") or {"evidence": "{}"}
        resumed = self.first("resumed")
        return {
            **json.loads(end["evidence"]),
            "steps_lost": json.loads(resumed["evidence"])["steps_lost"] if resumed else None,
        }

    @property
    def healed(self) -> bool:
        """Finished, without the target host, having evicted it (with the spares in its place)."""
        evicted = [h for a in self.actions if a["action"] == "evict" for h in a["hosts"]]
        joined = [h for a in self.actions if a["action"] == "spare" for h in a["hosts"]]
        return (
            self.status == "finished" and self.first("finished") is not None and self.target in evicted
            and bool(self.final_hosts) and self.target not in self.final_hosts and set(joined) <= set(self.final_hosts)
            and len(joined) == self.drill.spares
        )  # fmt: skip


def run(drill: Drill, *, workdir: Path | None = None, log: Callable[[str], None] = print) -> Outcome:
    """Run one drill on a test bed of its own; every process and namespace is gone when it returns."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"rankscope-heal-{drill.name}-"))
    with staged(workdir, HOSTS + drill.spares, RANKS_PER_HOST) as (bed, address):
        return _play(drill, bed, address, workdir, log)


def trainer_flags(workdir: Path, steps: int = STEPS) -> list[str]:
    """The drills' job: the bundled trainer, TP2 inside a host, dp over the hosts, ``steps`` steps, checkpoints in ``workdir``."""
    return ["--tp", "2", "--pp", "1", "--dp", "0", *SMALL_SHAPE, "--micro-batch", "2", "--global-batch", "12", "--steps", str(steps),
            "--ckpt-dir", str(workdir / "ckpt"), "--ckpt-every", str(CKPT_EVERY), "--resume", "--timeout", "120"]  # fmt: skip


def fault_at_step(
    outcome: Outcome, bed: hosts.Testbed, address: str, applied: list[host_faults.Applied], until: Callable[[], bool],
    log: Callable[[str], None],
) -> threading.Thread:  # fmt: skip
    """Start a thread that hits the drill's target with its fault once the run reaches ``fault_step``
    (unless ``until`` says the job is over first); what it applied goes into ``applied``."""
    drill = outcome.drill

    def apply() -> None:
        if drill.apply is None:
            return
        with Client(address) as client:
            if wait_for_step(client, drill.fault_step, run_id=outcome.run_id, stop=until) is not None:
                applied.append(drill.apply(bed, bed.host(outcome.target)))
                outcome.fault_ns = applied[-1].at_ns
                log(f"{drill.name}: {applied[-1].what}")

    thread = threading.Thread(target=apply, daemon=True, name="fault")
    thread.start()
    return thread


def read_back(outcome: Outcome, address: str) -> None:
    """What the store says of the run once it ended: the driver's actions, the last attempt's hosts, the run's status."""
    with Client(address) as client:
        time.sleep(1.5)  # the collector writes every 0.5 s: the driver's last rows are in
        outcome.actions = client.query(ACTIONS_SQL, {"run": outcome.run_id}).to_pylist()
        outcome.final_hosts = sorted(client.query(FINAL_HOSTS_SQL, {"run": outcome.run_id}).to_pylist()[0]["hosts"])
        outcome.status = client.query(STATUS_SQL, {"run": outcome.run_id}).to_pylist()[0]["status"]
        for row in client.query(NODE_STATES_SQL, {"run": outcome.run_id}).to_pylist():
            outcome.node_states.setdefault(row["host"], []).append(row["state"])


def _play(drill: Drill, bed: hosts.Testbed, address: str, workdir: Path, log: Callable[[str], None]) -> Outcome:
    run_id = f"heal-{drill.name}-{uuid.uuid4().hex[:8]}"
    outcome = Outcome(drill, run_id, target=bed.hosts[drill.target].name)
    applied: list[host_faults.Applied] = []
    try:
        outcome.exits, _ = healing_job.run(bed, trainer(*trainer_flags(workdir, drill.steps)), collector=address, run_id=run_id, workdir=workdir / "job",
                                           policy=Policy(min_hosts=2), log=log, spares=drill.spares,
                                           on_start=lambda job: fault_at_step(outcome, bed, address, applied, job.finished, log))  # fmt: skip
    finally:
        for fault in applied:
            fault.undo()
    read_back(outcome, address)
    return outcome

"""A self-healing job on a test bed: torchrun's elastic agent on every host, the agent on, a driver acting on incidents.

The rendezvous store runs on the test bed's control host (the switch, ``CONTROL_ADDRESS``), not on
a training host, so any host may fail; the agents' command line and the rendezvous settings are
``rankscope.healing.elastic``'s.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rankscope.collector.client import Client
from rankscope.common.agent_env import agent_environment
from rankscope.healing.driver import Driver
from rankscope.healing.elastic import RDZV_CONF, RDZV_PORT, RendezvousError
from rankscope.healing.elastic import start_rendezvous as start_rendezvous_at
from rankscope.testbed.healing_fleet import TestbedFleet
from rankscope.healing.policy import Policy
from rankscope.common.processes import terminate_tree
from rankscope.testbed.hosts import CONTROL_ADDRESS, Testbed, TestbedError
from rankscope.testbed.job import Job, launch


def _start_rendezvous(bed: Testbed, workdir: Path, port: int = RDZV_PORT) -> subprocess.Popen[bytes]:
    """Serve the job's c10d store on the test bed's control host; returns once it listens."""
    try:
        return start_rendezvous_at(f"{CONTROL_ADDRESS}:{port}", workdir / "rendezvous.log", prefix=["ip", "netns", "exec", bed.switch])
    except RendezvousError as e:
        raise TestbedError(str(e)) from None


def run(
    bed: Testbed, program: Sequence[str], *, collector: str, run_id: str, workdir: Path, policy: Policy,
    max_restarts: int = 3, ranks_per_host: int | None = None, log: Callable[[str], None] = print,
    on_start: Callable[[Job], None] | None = None, check_timeout_s: float = 20.0, spares: int = 0,
) -> tuple[dict[str, int], Driver]:  # fmt: skip
    """Run ``program`` on every host of ``bed`` as one elastic job and heal it until it ends.

    ``collector``: the collector's ``unix:PATH`` (the hosts reach no other address of this machine).
    ``on_start`` gets the job once every rank has started (a test applies its fault from there).
    ``spares``: the test bed's last hosts that wait outside the job, each joining it when a host is
    evicted (the job runs on at most as many hosts as it started on).
    Returns each host's launcher exit code and the driver (what it evicted). Every process is gone
    when it returns.
    """
    ranks_per_host = ranks_per_host or bed.ranks_per_host
    if not 0 <= spares < len(bed.hosts):
        raise TestbedError(f"{spares} spares leave no host of the test bed's {len(bed.hosts)} to start the job")
    starting, waiting = bed.hosts[: len(bed.hosts) - spares], bed.hosts[len(bed.hosts) - spares :]
    workdir.mkdir(parents=True, exist_ok=True)
    rendezvous = _start_rendezvous(bed, workdir)
    env = {**agent_environment(collector, run_id, spool_dir=workdir / "spool", every_s=1),
           # A fresh worker store every round: torchrun's shared one (served by the round's first node,
           # chosen once) keeps the previous attempt's keys, whose gloo addresses are dead processes.
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    launched_ns = time.time_ns()
    job = launch(
        bed, program, run_id=run_id, workdir=workdir / "hosts", ranks_per_host=ranks_per_host, env=env, max_restarts=max_restarts,
        min_hosts=policy.min_hosts, rendezvous=f"{CONTROL_ADDRESS}:{RDZV_PORT}", rdzv_conf=RDZV_CONF, hosts=starting, cwd=Path.cwd(),
    )  # fmt: skip
    try:
        with Client(collector) as client:
            driver = Driver(run_id, client, TestbedFleet(bed), policy, job, ranks_per_host, check_timeout_s=check_timeout_s, log=log,
                            spares=[h.name for h in waiting], join=job.add, launched_ns=launched_ns)  # fmt: skip
            placement = job.placement()
            log(f"[rankscope launch] run {run_id}: {len(placement)} ranks on {len(bed.hosts)} hosts; logs in {workdir}")
            if on_start is not None:
                on_start(job)
            return driver.run(), driver
    finally:
        job.stop()
        terminate_tree(rendezvous, 2)

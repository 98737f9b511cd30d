"""A self-healing job on a test bed: torchrun's elastic agent on every host, the agent on, a driver acting on incidents.

The rendezvous store runs on the test bed's control host (the switch, ``CONTROL_ADDRESS``), not on
a training host, so any host may fail. Every host runs ``torchrun --nnodes=MIN:N --max-restarts=R
--rdzv-backend=c10d``; a node whose keep-alive stops is dropped from the rendezvous within a few
seconds (``keep_alive_interval`` x ``keep_alive_max_attempt``), and the survivors wait
``last_call_timeout`` for late joiners before they go on without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rankscope.collector.client import Client
from rankscope.common.agent_env import agent_environment
from rankscope.healing.driver import Driver
from rankscope.testbed.healing_fleet import TestbedFleet
from rankscope.healing.policy import Policy
from rankscope.common.processes import terminate_tree
from rankscope.testbed.hosts import CONTROL_ADDRESS, Testbed, TestbedError
from rankscope.testbed.job import RDZV_PORT, Job, launch

#: torchrun's c10d rendezvous settings of a self-healing job (seconds)
RDZV_CONF = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 8, "join_timeout": 300}


def start_rendezvous(bed: Testbed, workdir: Path, port: int = RDZV_PORT, timeout_s: float = 30) -> subprocess.Popen[bytes]:
    """Serve the job's c10d store on the test bed's control host; returns once it listens."""
    log = workdir / "rendezvous.log"
    env = {k: v for k, v in os.environ.items() if k != "RANKSCOPE_ENABLE"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", bed.switch, sys.executable, "-m", "rankscope.healing.rendezvous", "--listen", f"{CONTROL_ADDRESS}:{port}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while b"serving" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            terminate_tree(proc, 1)
            raise TestbedError(f"the rendezvous store did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return proc


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
    rendezvous = start_rendezvous(bed, workdir)
    env = {**agent_environment(collector, run_id, spool_dir=workdir / "spool", every_s=1),
           # A fresh worker store every round: torchrun's shared one (served by the round's first node,
           # chosen once) keeps the previous attempt's keys, whose gloo addresses are dead processes.
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    job = launch(
        bed, program, run_id=run_id, workdir=workdir / "hosts", ranks_per_host=ranks_per_host, env=env, max_restarts=max_restarts,
        min_hosts=policy.min_hosts, rendezvous=f"{CONTROL_ADDRESS}:{RDZV_PORT}", rdzv_conf=RDZV_CONF, hosts=starting, cwd=Path.cwd(),
    )  # fmt: skip
    try:
        with Client(collector) as client:
            driver = Driver(run_id, client, TestbedFleet(bed), policy, job, ranks_per_host, check_timeout_s=check_timeout_s, log=log,
                            spares=[h.name for h in waiting], join=lambda name: job.add(bed.host(name)))  # fmt: skip
            placement = job.placement()
            log(f"[rankscope launch] run {run_id}: {len(placement)} ranks on {len(bed.hosts)} hosts; logs in {workdir}")
            if on_start is not None:
                on_start(job)
            return driver.run(), driver
    finally:
        job.stop()
        terminate_tree(rendezvous, 2)

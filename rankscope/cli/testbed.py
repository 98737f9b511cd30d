"""``rankscope testbed``: simulated hosts on this machine, a job across them, faults from outside.

``up`` makes the hosts (network namespaces with their own address and host name, cgroups) and
leaves them up, with ``--slurm`` as a Slurm cluster (``slurm -- COMMAND`` runs Slurm's commands
against it); ``run`` starts one torchrun agent per host on a script or the bundled trainer and
waits for it; ``fault`` throttles, freezes, kills or slows a host or a rank of the running job;
``down`` removes a test bed and everything in it. Needs root (Linux namespaces, cgroup v1).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.cli.args import count
from rankscope.common.agent_env import agent_environment

if TYPE_CHECKING:
    from rankscope.testbed.hosts import Testbed

HELP = "simulated hosts (network namespaces) on this machine: run a job across them, apply faults from outside"

FAULTS = ("throttle-cpu", "slow-cpu", "freeze-rank", "freeze-host", "kill-rank", "kill-host", "limit-bandwidth", "delay-link")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="make the hosts and leave them up")
    up.add_argument("--hosts", type=count(1), default=4, help="how many hosts (default: 4)")
    up.add_argument("--ranks-per-host", type=count(1), default=2, help="ranks per host of the jobs run on it (default: 2)")
    up.add_argument("--cores", type=float, help="CPUs per host (default: 70%% of this machine's cores split between the hosts)")
    up.add_argument("--name", help="the test bed's name (default: rs and a random id)")
    up.add_argument("--slurm", action="store_true",
                    help="make the hosts a Slurm cluster: slurmctld on the control host, a slurmd on each host (make slurm installs Slurm)")  # fmt: skip
    slurm = sub.add_parser("slurm", help="run a Slurm command (sinfo, srun, sbatch, scontrol ...) against a test bed's Slurm cluster")
    slurm.add_argument("--testbed", metavar="NAME", help="which test bed (default: the only one up)")
    slurm.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="after --: the command, e.g. -- sinfo -R")
    sub.add_parser("list", help="the test beds that are up")
    down = sub.add_parser("down", help="kill a test bed's processes and remove it")
    down.add_argument("name", nargs="?", help="which test bed (default: the only one `up` made; `list` names every bed, made by `up` or not)")
    run = sub.add_parser("run", help="run a job on every host (one torchrun agent each) until it ends")
    run.add_argument("--testbed", metavar="NAME", help="which test bed (default: the only one up)")
    run.add_argument("--ranks-per-host", type=count(1), help="default: the test bed's")
    run.add_argument("--run-id", help="the rendezvous and run id (default: a new one)")
    run.add_argument("--collector", metavar="unix:PATH",
                     help="switch the agent on and send to this collector; the hosts reach only Unix sockets of this machine")  # fmt: skip
    run.add_argument("--workdir", type=Path, default=Path("testbed-logs"), help="where each host's log goes (default: ./testbed-logs)")
    run.add_argument("program", nargs=argparse.REMAINDER, metavar="PROGRAM",
                     help="after --: a script and its arguments, or -m module ... (-m rankscope.trainer for the bundled trainer)")  # fmt: skip
    fault = sub.add_parser("fault", help="apply a fault to a host or a rank of the running job, from outside it")
    fault.add_argument("kind", choices=FAULTS)
    fault.add_argument("--testbed", metavar="NAME", help="which test bed (default: the only one up)")
    fault.add_argument("--host", help="the host (name or index) for the host faults")
    fault.add_argument("--rank", type=count(0), help="the global rank for freeze-rank and kill-rank")
    fault.add_argument("--share", type=float, default=0.25, help="throttle-cpu: the share of its CPU the host keeps (default: 0.25)")
    fault.add_argument("--factor", type=float, default=2.0,
                       help="slow-cpu: how many times less CPU the host gets than its processes used over the 2 s before (default: 2)")
    fault.add_argument("--wait", dest="wait_s", type=float, default=0.0, metavar="SECONDS",
                       help="slow-cpu: on an idle host, wait this long for its job to start using CPU (default: 0, an error)")
    fault.add_argument("--at-step", type=count(1), metavar="N",
                       help="apply the fault once the job reaches step N, as --collector heard it (the run heard from last since this "
                            "command started): a drill's fault lands at a step, not after a sleep a slow start outruns")
    fault.add_argument("--collector", metavar="ADDRESS", help="--at-step: the collector the job reports to (unix:PATH or HOST:PORT)")
    fault.add_argument("--mbit", type=float, default=20.0, help="limit-bandwidth: Mbit/s each way (default: 20)")
    fault.add_argument("--delay-ms", type=float, default=20.0, help="delay-link: ms each way (default: 20)")
    fault.add_argument("--for", dest="for_s", type=float, default=None, metavar="SECONDS",
                       help="lift the fault after this long (default: keep it until Ctrl-C; kills cannot be lifted)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rankscope.testbed import hosts, slurm

    try:
        if args.action == "up":
            bed = hosts.create(args.hosts, ranks_per_host=args.ranks_per_host, cores=args.cores, name=args.name)
            if args.slurm:
                bed = _with_slurm(bed)
            bed.save()
            print(f"test bed {bed.name} is up: {len(bed.hosts)} hosts of {bed.cores:g} CPUs, {bed.ranks_per_host} ranks each"
                  + (f"; Slurm partition {slurm.PARTITION} (rankscope testbed slurm -- sinfo)" if bed.slurm else ""))  # fmt: skip
            for h in bed.hosts:
                print(f"  {h.name:8} {h.address:14} namespace {h.namespace}")
            return 0
        if args.action == "list":
            for name in hosts.running():
                print(name)
            return 0
        if args.action == "down":
            # Without a name, only the bed `up` made: a bed a program made for itself (a test's, a
            # scenario's) has nobody else's business being removed.
            for name in [args.name] if args.name else [hosts.load().name]:
                hosts.destroy(name)
                print(f"test bed {name} is down")
            return 0
        bed = hosts.load(args.testbed)
        if args.action == "slurm":
            return _slurm_command(bed, args.argv[1:] if args.argv[:1] == ["--"] else args.argv)
        return _run_job(bed, args) if args.action == "run" else _fault(bed, args)
    except hosts.TestbedError as e:
        print(f"rankscope testbed: {e}", file=sys.stderr)
        return 1


def _with_slurm(bed: Testbed) -> Testbed:
    """``bed`` made a Slurm cluster; removed whole if that fails (a half-made bed is of no use)."""
    import dataclasses

    from rankscope.testbed import hosts, slurm

    try:
        slurm.start(bed)
    except BaseException:
        hosts.destroy(bed.name)
        raise
    return dataclasses.replace(bed, slurm=True)


def _slurm_command(bed: Testbed, command: list[str]) -> int:
    """A Slurm command on the test bed's control host, its output and exit status as they are."""
    import subprocess

    from rankscope.testbed.slurm import Slurm

    if not bed.slurm:
        print(f"rankscope testbed slurm: test bed {bed.name} has no Slurm cluster (rankscope testbed up --slurm makes one)", file=sys.stderr)
        return 2
    if not command:
        print("rankscope testbed slurm: name a Slurm command after --, e.g. -- sinfo -R", file=sys.stderr)
        return 2
    return subprocess.run(Slurm(bed).command(command)).returncode


def _run_job(bed: Testbed, args: argparse.Namespace) -> int:
    from rankscope.testbed.hosts import TestbedError
    from rankscope.testbed.job import launch

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        print("rankscope testbed run: name a program after --, e.g. -- -m rankscope.trainer --steps 10", file=sys.stderr)
        return 2
    env = {}
    if args.collector:
        if not args.collector.startswith("unix:/"):
            print("rankscope testbed run: --collector must be unix:/PATH (the hosts' networks reach nothing else)", file=sys.stderr)
            return 2
        env = agent_environment(args.collector)
    run_id = args.run_id or f"testbed-{uuid.uuid4().hex[:8]}"
    job = launch(bed, program, run_id=run_id, workdir=args.workdir, env=env, ranks_per_host=args.ranks_per_host)
    print(f"run {run_id}: {job.world_size} ranks on {len(job.launchers)} hosts; logs in {args.workdir}/", flush=True)
    try:
        placement = job.placement()
    except TestbedError as e:  # a rank that did not start: the hosts' logs say why
        print(f"rankscope testbed run: {e}", file=sys.stderr)
        job.stop()
        return 1
    for host in bed.hosts:
        print(f"  {host.name}: ranks {', '.join(str(r) for r, p in sorted(placement.items()) if p.host == host)}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: job.stop())
    try:
        exits = job.wait(timeout_s=float("inf"))
    except KeyboardInterrupt:
        job.stop()
        return 130
    for host, code in exits.items():
        print(f"  {host}: exit {code}")
    return max(exits.values(), key=abs)


def _fault(bed: Testbed, args: argparse.Namespace) -> int:
    from rankscope.testbed import host_faults
    from rankscope.testbed.job import find_ranks

    started_ns = time.time_ns()
    if args.at_step is not None and not args.collector:
        print("rankscope testbed fault: --at-step needs --collector, the address the job reports to", file=sys.stderr)
        return 2

    host = bed.host(int(args.host) if args.host.isdigit() else args.host) if args.host else None
    rank = None
    if args.kind.endswith("-rank"):
        ranks = find_ranks(bed)
        if args.rank is None or args.rank not in ranks:
            print(f"rankscope testbed fault: {args.kind} needs --rank, one of the running ranks {sorted(ranks)}", file=sys.stderr)
            return 2
        rank = ranks[args.rank]
    elif host is None:
        print(f"rankscope testbed fault: {args.kind} needs --host", file=sys.stderr)
        return 2
    if args.at_step is not None and not _reached(args.at_step, args.collector, started_ns):
        return 2
    applied = {
        "throttle-cpu": lambda: host_faults.throttle_cpu(bed, host, args.share),
        "slow-cpu": lambda: host_faults.slow_cpu(bed, host, args.factor, wait_s=args.wait_s),
        "freeze-rank": lambda: host_faults.freeze_rank(rank),
        "freeze-host": lambda: host_faults.freeze_host(host),
        "kill-rank": lambda: host_faults.kill_rank(rank),
        "kill-host": lambda: host_faults.kill_host(bed, host),
        "limit-bandwidth": lambda: host_faults.limit_bandwidth(bed, host, args.mbit),
        "delay-link": lambda: host_faults.delay_link(bed, host, args.delay_ms),
    }[args.kind]()
    print(applied.what, flush=True)
    if args.kind.startswith("kill"):
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop lifts the fault too
    try:
        time.sleep(args.for_s if args.for_s is not None else float("inf"))
    except KeyboardInterrupt:
        pass
    finally:
        applied.undo()
        print(f"lifted: {applied.what}")
    return 0


def _reached(step: int, address: str, since_ns: int) -> bool:
    """Wait for a run heard since ``since_ns`` to reach ``step``; False (said why) if the collector cannot be read."""
    from rankscope.collector.client import QueryFailed, open_reader
    from rankscope.collector.progress import wait_for_step

    print(f"waiting for the job to reach step {step} (as {address} hears it)", flush=True)
    try:
        with open_reader(collector=address, token=os.environ.get("RANKSCOPE_TOKEN") or None) as reader:
            run_id = wait_for_step(reader, step, since_ns=since_ns, poll_s=0.5)
    except QueryFailed as e:
        print(f"rankscope testbed fault: cannot read {address}: {e}", file=sys.stderr)
        return False
    print(f"{run_id} reached step {step}", flush=True)
    return True


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt

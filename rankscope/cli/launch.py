"""``rankscope launch``: a self-healing job on a test bed's hosts, or on the nodes of a Slurm allocation (``--slurm``).

torchrun's elastic agent runs on every host (``--nnodes MIN:N``, ``--max-restarts``), the agent is
on, and a driver acts on the collector's incidents: a lost host is evicted, a crash's, hang root's
or lasting straggler's host is self-checked against the others and evicted when it fails, and the
job restarts from its last complete checkpoint without it. Every decision is stored (``actions``).
Under Slurm the driver acts through Slurm alone: a condemned node is drained with the incident as
its reason (``rankscope.healing.slurm_job``). When the job ends, what its ranks could not send in
time is sent from the spool in ``--workdir``, so the run is whole in the store when the command returns.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.cli.args import count, seconds

if TYPE_CHECKING:
    from rankscope.healing.policy import Policy

HELP = "run a job that heals itself: evict the host an incident names, restart from the last checkpoint"
EXTRA = "collector"  # the healing driver reads the incidents


def configure(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--testbed", metavar="NAME", help="the test bed whose hosts run the job (default: the only one up)")
    where.add_argument("--slurm", action="store_true",
                       help="run on the nodes of the Slurm allocation this command runs in (from a batch script: sbatch --no-kill)")  # fmt: skip
    parser.add_argument("--collector", metavar="ADDRESS", required=True,
                        help="the collector (its diagnosis names the faults): unix:PATH on a test bed, whose hosts reach nothing else")  # fmt: skip
    parser.add_argument("--ranks-per-node", type=count(1), help="ranks on each node (default: the test bed's ranks per host; 1 under Slurm)")
    parser.add_argument("--run-id", help="the run and rendezvous id (default: a new one)")
    parser.add_argument("--min-hosts", type=count(1), help="the fewest hosts the job may shrink to (default: all but one)")
    parser.add_argument("--max-restarts", type=count(0), default=3, help="torchrun's restarts per host (default: 3)")
    parser.add_argument("--act-on", default="lost_host,crash,hang,straggler", metavar="KINDS",
                        help="incident kinds whose hosts are suspects (default: lost_host,crash,hang,straggler)")  # fmt: skip
    parser.add_argument("--requeue", action="store_true",
                        help="under Slurm, when evicting would leave fewer than --min-hosts nodes and no spare: requeue the job"
                             " (scontrol requeue) to resume on healthy nodes as the next attempt of the same run")  # fmt: skip
    parser.add_argument("--recheck-drained", type=seconds, default=0.0, metavar="SECONDS",
                        help="self-check a drained host again this often while the job runs; one that passes takes jobs again and"
                             " waits as a spare, unless drained twice within the hour (default: 0, never: rankscope node resume)")  # fmt: skip
    parser.add_argument("--straggler-steps", type=count(0), default=3, help="act on a straggler once it stayed slow this many steps (default: 3)")
    parser.add_argument("--spares", type=count(0), default=0,
                        help="the last N hosts (the test bed's, or the allocation's nodes) wait in the job's rendezvous from its first attempt;"
                             " one joins the first restart with a host gone (default: 0)")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("launch-logs"), help="hosts' logs and the rendezvous log (default: ./launch-logs)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="PROGRAM",
                        help="after --: -m rankscope.trainer ... --dp 0 --ckpt-dir DIR --ckpt-every N --resume, or a script that resumes by itself")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        print("rankscope launch: name a program after --, e.g. -- -m rankscope.trainer --dp 0 --ckpt-dir ckpt --ckpt-every 2 --resume",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.requeue and not args.slurm:
        print("rankscope launch: --requeue needs --slurm (a test bed has no scheduler to requeue the job)", file=sys.stderr)
        return 2
    if not args.slurm and not args.collector.startswith("unix:/"):
        print("rankscope launch: --collector must be unix:/PATH (the hosts' networks reach nothing else)", file=sys.stderr)
        return 2
    try:
        exits, evicted = (_on_slurm if args.slurm else _on_testbed)(args, program)
    except _Refused as e:
        print(f"rankscope launch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    _replay_leftovers(args)
    survivors = {h: c for h, c in exits.items() if h not in evicted}
    for host, code in exits.items():
        print(f"  {host}: exit {code}{' (evicted)' if host in evicted else ''}")
    return 0 if survivors and all(c == 0 for c in survivors.values()) else 1


def _replay_leftovers(args: argparse.Namespace) -> None:
    """Send what the job's ranks left in the spool they shared (the hosts' ``--workdir``), as ``rankscope train`` does."""
    from rankscope.cli.spool import replay_after_job
    from rankscope.common.agent_env import agent_environment

    replay_after_job({**os.environ, **agent_environment(args.collector, spool_dir=args.workdir / "spool")}, "rankscope launch")


class _Refused(Exception):
    """What cannot run, in one line."""


def _policy(args: argparse.Namespace, job_hosts: int) -> Policy:
    from rankscope.healing.policy import Policy

    if job_hosts < 1:
        raise _Refused(f"--spares {args.spares} leaves no host to run the job")
    min_hosts = args.min_hosts or max(1, job_hosts - 1)
    if min_hosts > job_hosts:
        raise _Refused(f"--min-hosts {min_hosts} is more than the job's {job_hosts} hosts")
    try:
        return Policy(act_on=tuple(k.strip() for k in args.act_on.split(",") if k.strip()), straggler_steps=args.straggler_steps,
                      min_hosts=min_hosts, requeue=args.requeue, recheck_s=args.recheck_drained)  # fmt: skip
    except ValueError as e:
        raise _Refused(str(e)) from None


def _on_testbed(args: argparse.Namespace, program: list[str]) -> tuple[dict[str, int], list[str]]:
    from rankscope.testbed import healing_job, hosts

    try:
        bed = hosts.load(args.testbed)
        policy = _policy(args, len(bed.hosts) - args.spares)
        run_id = args.run_id or f"launch-{uuid.uuid4().hex[:8]}"
        exits, driver = healing_job.run(bed, program, collector=args.collector, run_id=run_id, workdir=args.workdir, policy=policy,
                                        max_restarts=args.max_restarts, log=lambda line: print(line, flush=True), spares=args.spares,
                                        ranks_per_host=args.ranks_per_node)  # fmt: skip
    except hosts.TestbedError as e:
        raise _Refused(str(e)) from None
    return exits, driver.evicted


def _on_slurm(args: argparse.Namespace, program: list[str]) -> tuple[dict[str, int], list[str]]:
    from rankscope.healing import slurm_job
    from rankscope.healing.elastic import RendezvousError
    from rankscope.healing.slurm_fleet import SlurmError

    try:
        found = slurm_job.allocation()
        policy = _policy(args, len(found.nodes) - args.spares)
        # one run across the job's requeues: Slurm keeps the job id
        run_id = args.run_id or f"slurm-{found.job_id}"
        exits, driver = slurm_job.run(program, collector=args.collector, run_id=run_id, workdir=args.workdir, policy=policy,
                                      spares=args.spares, ranks_per_node=args.ranks_per_node or 1, max_restarts=args.max_restarts,
                                      log=lambda line: print(line, flush=True))  # fmt: skip
    except (SlurmError, RendezvousError) as e:
        raise _Refused(str(e)) from None
    return exits, driver.evicted

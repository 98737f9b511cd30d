"""``rankscope launch``: a self-healing job on a test bed's hosts.

torchrun's elastic agent runs on every host (``--nnodes MIN:N``, ``--max-restarts``), the agent is
on, and a driver acts on the collector's incidents: a lost host is evicted, a crash's, hang root's
or lasting straggler's host is self-checked against the others and evicted when it fails, and the
job restarts from its last complete checkpoint without it. Every decision is stored (``actions``).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

from rankscope.cli.args import count

HELP = "run a job that heals itself: evict the host an incident names, restart from the last checkpoint"
EXTRA = "collector"  # the healing driver reads the incidents


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--testbed", metavar="NAME", help="the test bed whose hosts run the job (default: the only one up)")
    parser.add_argument("--collector", metavar="unix:PATH", required=True,
                        help="the collector (its diagnosis names the faults); the hosts reach only Unix sockets of this machine")  # fmt: skip
    parser.add_argument("--run-id", help="the run and rendezvous id (default: a new one)")
    parser.add_argument("--min-hosts", type=count(1), help="the fewest hosts the job may shrink to (default: all but one)")
    parser.add_argument("--max-restarts", type=count(0), default=3, help="torchrun's restarts per host (default: 3)")
    parser.add_argument("--act-on", default="lost_host,crash,hang,straggler", metavar="KINDS",
                        help="incident kinds whose hosts are suspects (default: lost_host,crash,hang,straggler)")  # fmt: skip
    parser.add_argument("--straggler-steps", type=count(0), default=3, help="act on a straggler once it stayed slow this many steps (default: 3)")
    parser.add_argument("--spares", type=count(0), default=0,
                        help="the test bed's last N hosts wait outside the job; one joins it for each host evicted (default: 0)")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("launch-logs"), help="hosts' logs and the rendezvous log (default: ./launch-logs)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="PROGRAM",
                        help="after --: -m rankscope.trainer ... --dp 0 --ckpt-dir DIR --ckpt-every N --resume, or a script that resumes by itself")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rankscope.testbed import healing_job
    from rankscope.healing.policy import Policy
    from rankscope.testbed import hosts

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        print("rankscope launch: name a program after --, e.g. -- -m rankscope.trainer --dp 0 --ckpt-dir ckpt --ckpt-every 2 --resume",
              file=sys.stderr)  # fmt: skip
        return 2
    if not args.collector.startswith("unix:/"):
        print("rankscope launch: --collector must be unix:/PATH (the hosts' networks reach nothing else)", file=sys.stderr)
        return 2
    try:
        bed = hosts.load(args.testbed)
        job_hosts = len(bed.hosts) - args.spares
        if job_hosts < 1:
            print(f"rankscope launch: --spares {args.spares} leaves none of the test bed's {len(bed.hosts)} hosts to run the job", file=sys.stderr)
            return 2
        min_hosts = args.min_hosts or max(1, job_hosts - 1)
        if min_hosts > job_hosts:
            print(f"rankscope launch: --min-hosts {min_hosts} is more than the job's {job_hosts} hosts", file=sys.stderr)
            return 2
        policy = Policy(act_on=tuple(k.strip() for k in args.act_on.split(",") if k.strip()), straggler_steps=args.straggler_steps,
                        min_hosts=min_hosts)  # fmt: skip
        run_id = args.run_id or f"launch-{uuid.uuid4().hex[:8]}"
        exits, driver = healing_job.run(bed, program, collector=args.collector, run_id=run_id, workdir=args.workdir, policy=policy,
                                   max_restarts=args.max_restarts, log=lambda line: print(line, flush=True), spares=args.spares)  # fmt: skip
    except (hosts.TestbedError, ValueError) as e:
        print(f"rankscope launch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    survivors = {h: c for h, c in exits.items() if h not in driver.evicted}
    for host, code in exits.items():
        print(f"  {host}: exit {code}{' (evicted)' if host in driver.evicted else ''}")
    return 0 if survivors and all(c == 0 for c in survivors.values()) else 1

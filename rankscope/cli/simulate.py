"""``rankscope simulate``: a 3D-parallel job of thousands of simulated ranks, sent to a real collector.

MegaScale ran 12,288 GPUs; one machine cannot run that many trainers, so a few worker processes
play them (see ``rankscope.harness.simulate`` for what is simulated and how much detail is
sent). Faults use the trainer's ``--inject`` grammar (straggler, hang, crash).
"""

from __future__ import annotations

import argparse
import os
import sys

from rankscope.cli.args import count, positive, seconds

HELP = "simulate a 3D-parallel job of thousands of ranks (faults injected) against a collector"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=count(1), help="world size; must equal tp*pp*dp (a check, nothing more)")
    parser.add_argument("--tp", type=count(1), default=8, help="tensor-parallel size (default: 8)")
    parser.add_argument("--pp", type=count(1), default=16, help="pipeline stages (default: 16)")
    parser.add_argument("--dp", type=count(1), default=96, help="data-parallel replicas (default: 96, 12,288 ranks in all)")
    parser.add_argument("--steps", type=count(1), default=50, help="training steps (default: 50)")
    parser.add_argument("--step-time", metavar="SECONDS", type=seconds, default=2.0, help="nominal seconds per step (default: 2)")
    parser.add_argument("--microbatches", type=count(1), default=8, help="microbatches per step (default: 8)")
    parser.add_argument("--inject", metavar="SPEC", default="",
                        help="faults, the trainer's grammar: straggler:rank=R,factor=F,from_step=S; hang:rank=R,step=S; crash:rank=R,step=S")
    parser.add_argument("--collector", metavar="HOST:PORT", default=os.environ.get("RANKSCOPE_COLLECTOR") or "127.0.0.1:7777",
                        help="the collector (default: $RANKSCOPE_COLLECTOR or 127.0.0.1:7777)")
    parser.add_argument("--run-id", metavar="ID", default="", help="the run's id (default: sim-<random>)")
    parser.add_argument("--workers", type=count(1), default=2, help="worker processes, one Transport each (default: 2)")
    parser.add_argument("--batches-per-s", metavar="N", type=positive, default=300.0,
                        help="batches per second the collector is asked to take; sets the heartbeat and flush intervals (default: 300)")
    parser.add_argument("--ranks-per-batch", metavar="N", type=count(1), default=256,
                        help="ranks one batch speaks for (a heartbeat batch, a flush's span or collective batch; default: 256)")
    parser.add_argument("--via", choices=("direct", "relay"), default="direct",
                        help="direct: each worker sends its batches to the collector itself; relay: each worker's hosts send"
                             " their own batches (8 ranks each) to a relay process per worker, which sends the collector one"
                             " stream, as a real job's ranks do through `rankscope relay` (default: direct)")  # fmt: skip
    parser.add_argument("--heartbeat", metavar="SECONDS", type=seconds, help="seconds between a rank's heartbeats (default: from --batches-per-s)")
    parser.add_argument("--flush", metavar="SECONDS", type=seconds, help="seconds between a rank's data batches (default: twice the heartbeat)")
    parser.add_argument("--sample-every", metavar="N", type=count(1), default=10,
                        help="every N-th step (and the first) is sent in full detail, the others as per-rank summaries (default: 10)")
    parser.add_argument("--report-after", metavar="SECONDS", type=seconds, default=5.0,
                        help="a rank without progress this long sends a heartbeat at once (default: 5)")
    parser.add_argument("--hold", metavar="SECONDS", type=seconds, default=120.0,
                        help="after a hang, how long the ranks stay hung before the launcher stops them (default: 120)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default: 0)")


def run(args: argparse.Namespace) -> int:
    from rankscope.agent.autoload import forbid

    forbid("simulate")  # the simulated ranks speak through their own Transports, never through an agent here
    from rankscope.harness.simulate.runner import Options, make_plan
    from rankscope.harness.simulate.runner import run as simulate
    from rankscope.common.fault_spec import FaultSpecError

    world = args.tp * args.pp * args.dp
    if args.ranks is not None and args.ranks != world:
        print(f"rankscope simulate: --ranks {args.ranks} but tp*pp*dp = {args.tp}*{args.pp}*{args.dp} = {world}", file=sys.stderr)
        return 2
    options = Options(
        tp=args.tp, pp=args.pp, dp=args.dp, steps=args.steps, step_time_s=args.step_time, microbatches=args.microbatches,
        inject=args.inject, collector=args.collector, run_id=args.run_id,
        batches_per_s=args.batches_per_s, ranks_per_batch=args.ranks_per_batch, heartbeat_s=args.heartbeat, flush_s=args.flush,
        sample_every=args.sample_every, via=args.via,
        report_after_s=args.report_after, hold_s=args.hold, seed=args.seed,
    )  # fmt: skip
    try:
        plan = make_plan(options)
    except FaultSpecError as e:
        print(f"rankscope simulate: {e}", file=sys.stderr)
        return 2
    c = plan.cadence
    print(f"simulating run {plan.run_id}: {world:,} ranks (tp {args.tp} x pp {args.pp} x dp {args.dp}), {args.steps} steps of "
          f"~{args.step_time:g} s, {args.workers} workers -> {'relays -> ' if args.via == 'relay' else ''}{args.collector}; heartbeat every {c.heartbeat_s:.1f} s, "
          f"data every {c.flush_s:.1f} s (~{c.batches_per_s(world, args.dp):,.0f} batches/s), full timelines every "
          f"{c.sample_every} steps", flush=True)  # fmt: skip
    summary = simulate(plan, args.workers, log=lambda line: print(line, flush=True))
    rate = sum(summary.events.values()) / max(summary.seconds, 1e-9)
    print(f"done: {summary.steps} steps in {summary.seconds:.1f} s; {summary.acked:,} batches acknowledged, "
          f"{summary.refused:,} refused, {summary.dropped:,} dropped; events {summary.events} ({rate:,.0f}/s)", flush=True)
    return 1 if summary.failed else 0

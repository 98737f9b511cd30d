"""A node's end of a fleet that reaches it only through its scheduler: ``python -m
rankscope.healing.node_workers list`` prints the training ranks running on this node,
``... signal SIGNAL PID...`` signals those of them still running.

A Slurm fleet runs it on a node as a job step (``srun --overlap``): the driver never reaches a node
by any way the cluster does not provide. One JSON line on stdout each time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence

from rankscope.common.processes import signal_each, training_rank

__all__ = ["main", "ranks", "send"]


def ranks() -> dict[int, tuple[int, int]]:
    """pid -> (RANK, LOCAL_RANK) of every torchrun worker on this node."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _here(int(entry)) and (rank := training_rank(int(entry))) is not None:
            found[int(entry)] = rank
    return found


def send(sig: signal.Signals, pids: Sequence[int]) -> int:
    """Send ``sig`` to those of ``pids`` that are still training ranks of this node (a pid reused since is left alone)."""
    return signal_each([pid for pid in pids if _here(pid) and training_rank(pid) is not None], sig)


def _here(pid: int) -> bool:
    """Whether ``pid`` is a process of this node: of this network namespace (a machine's hosts, on the
    test bed, share one kernel and so one process table; a real node's processes share its network)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    from rankscope.common.cmdline import Parser

    parser = Parser(prog="python -m rankscope.healing.node_workers", description="a node's training ranks: list or signal them")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list")
    sig = sub.add_parser("signal")
    sig.add_argument("signal", type=lambda name: signal.Signals[name], metavar="SIGNAL", help="SIGSTOP, SIGCONT, SIGKILL, ...")
    sig.add_argument("pids", type=int, nargs="*")
    args = parser.parse_args(argv)
    if args.action == "list":
        print(json.dumps({"ranks": {str(pid): list(rank) for pid, rank in ranks().items()}}), flush=True)
    else:
        print(json.dumps({"sent": send(args.signal, args.pids)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

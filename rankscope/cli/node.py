"""``rankscope node``: each node's life as healing sees it, and a drained node taken back after it passes its self-check again.

``list`` prints every node healing has an opinion of (``node_states`` through the collector): its
state (healthy, suspect, checking, drained), since when, the incident and the reason, and with
``--slurm`` what Slurm says of it. ``resume NODE`` checks a drained node and takes it back: under
Slurm (``--slurm``, Slurm operator rights) the node is held by a maintenance reservation and resumed,
the self-check runs on it as a task in the reservation, and the reservation goes; on a test bed
(``--testbed``) the check runs inside the host. Its figures are judged against those its healthy
peers measured last (``rankscope.healing.node_life``). A node that fails stays drained, with the
check's finding as its reason. Exit status: 0 taken back (or listed), 1 still failing, 2 bad input.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from rankscope.cli.args import seconds

if TYPE_CHECKING:
    from rankscope.collector.client import Client
    from rankscope.healing.node_life import Nodes

HELP = "nodes as healing sees them (healthy, suspect, checking, drained): list them, or resume a drained one after it passes its self-check"
EXTRA = "collector"

PROG = "rankscope node"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "resume"), help="list: every node's state; resume NODE: check a drained node and take it back")
    parser.add_argument("node", nargs="?", help="resume: the node")
    parser.add_argument("--collector", required=True, metavar="ADDRESS", help="the collector that stores the states (HOST:PORT or unix:PATH)")
    parser.add_argument("--token", default=os.environ.get("RANKSCOPE_TOKEN") or None, help="the collector's token (default: $RANKSCOPE_TOKEN)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--slurm", action="store_true", help="the nodes are a Slurm cluster's (its commands on PATH, operator rights to resume)")
    where.add_argument("--testbed", nargs="?", const="", default=None, metavar="NAME", help="the nodes are a test bed's hosts (default: the only one up)")
    parser.add_argument("--timeout", type=seconds, default=20.0, metavar="SECONDS", help="the most each test may take on the node (default: 20)")
    parser.add_argument("--ranks", type=int, default=2, metavar="N", help="processes of the loopback all-reduce (default: 2)")


def _bad(message: str) -> int:
    print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from rankscope.collector.client import Client, QueryFailed

    if args.action == "resume" and not args.node:
        return _bad("resume names the node: rankscope node resume NODE")
    if args.action == "resume" and not args.slurm and args.testbed is None:
        return _bad("say where the node is: --slurm or --testbed")
    try:
        nodes = _nodes(args)
    except Exception as e:  # a test bed that is not up, Slurm that does not answer
        return _bad(str(e))
    try:
        with Client(args.collector, token=args.token) as client:
            if args.action == "list":
                return _list(client, nodes)
            return _resume(client, nodes, args)
    except QueryFailed as e:
        print(f"{PROG}: the collector did not answer: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # the scheduler refused or did not answer (SlurmError): what it said
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


def _nodes(args: argparse.Namespace) -> Nodes | None:
    if args.slurm:
        from rankscope.healing.slurm_fleet import SlurmNodes

        return SlurmNodes()
    if args.testbed is not None:
        from rankscope.testbed import hosts
        from rankscope.testbed.healing_fleet import TestbedNodes

        return TestbedNodes(hosts.load(args.testbed or None))
    return None


def _list(client: Client, nodes: Nodes | None) -> int:
    from rankscope.healing import node_life

    rows = node_life.nodes(client)
    scheduler = nodes.states() if nodes is not None else {}
    table = [("node", "state", "since", "drains/h", *(("scheduler",) if scheduler else ()), "incident", "reason")]
    for row in rows:
        said = scheduler.get(row["host"], ("", ""))[0]
        table.append((row["host"], row["state"] + (" (held)" if node_life.held(row) else ""), _when(row["since"]), str(row["drains"]),
                      *((said,) if scheduler else ()), row["incident_id"] or "-", row["reason"]))  # fmt: skip
    if len(table) == 1:
        print("no node has a state yet: healing has not suspected any")
        return 0
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return 0


def _resume(client: Client, nodes: Nodes, args: argparse.Namespace) -> int:
    from rankscope.healing import node_life, record

    host = args.node
    row = next((r for r in node_life.nodes(client) if r["host"] == host), None)
    if row is None or row["state"] != node_life.DRAINED:
        state = "has no state" if row is None else f"is {row['state']}"
        return _bad(f"{host} {state}: resume takes back a node healing drained (rankscope node list); Slurm's own: scontrol update State=RESUME")
    actor = os.environ.get("SUDO_USER") or getpass.getuser()
    if node_life.held(row):
        print(f"{host} was drained {row['drains']} times within the hour: resumed by {actor}, a person, after its self-check")

    def store(state: str, reason: str) -> None:
        client.send(record.node_state_batch(row["run_id"], host, state, actor=actor, incident_id=row["incident_id"], reason=reason))

    store(node_life.CHECKING, f"{actor} asked to resume it: self-check")
    peers = node_life.reference(client, host)
    began = time.monotonic()
    with nodes.holding(host) as runner:
        try:
            result = node_life.recheck(host, runner, peers, ranks=args.ranks, timeout_s=args.timeout)
        except Exception as e:  # the check could not run at all: the node stays out
            result, why = None, f"the self-check could not run: {e}"
        else:
            client.send(result.batch(row["run_id"]))
            why = f"failed its self-check again: {result.summary}"
        if result is None or not result.passed:
            nodes.drain(host, f"rankscope: {why}")
            store(node_life.DRAINED, f"rankscope: {why}")
            print(f"{host} stays drained: {why}")
            return 1
    against = f"against {len(peers)} healthy peers' figures" if peers else "no healthy peer's figures stored: measured, not judged"
    store(node_life.HEALTHY, f"resumed by {actor} after its self-check ({against}): {result.summary}")
    print(f"{host} is back ({time.monotonic() - began:.1f} s): passed its self-check, {against}: {result.summary}; it takes jobs again")
    return 0


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if hasattr(value, "strftime") else str(value)

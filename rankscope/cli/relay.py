"""``rankscope relay``: this host's relay, one per host, for the ranks that run on it.

The ranks reach it over a Unix socket when their environment says where
(``RANKSCOPE_RELAY=unix:/path``, beside ``RANKSCOPE_COLLECTOR``); it sends the collector one merged
batch per run and kind every ``--flush`` seconds, through its spool in the ranks' spool directory.
A rank whose relay is gone sends to the collector itself. docs/relay.md: starting one from the
launcher, a Slurm prolog or a Kubernetes DaemonSet.
"""

from __future__ import annotations

import argparse
import os
import sys

from rankscope.cli.args import seconds
from rankscope.common.agent_env import agent_environment

HELP = "run this host's relay: the host's ranks send through it, it sends the collector one stream"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", metavar="unix:/PATH", default=os.environ.get("RANKSCOPE_RELAY"),
                        help="where the ranks reach it (default: $RANKSCOPE_RELAY)")  # fmt: skip
    parser.add_argument("--collector", metavar="HOST:PORT", default=os.environ.get("RANKSCOPE_COLLECTOR"),
                        help="the collector (default: $RANKSCOPE_COLLECTOR, else 127.0.0.1:7777)")  # fmt: skip
    parser.add_argument("--spool-dir", metavar="DIR", default=os.environ.get("RANKSCOPE_SPOOL_DIR"),
                        help="its spool: the ranks' own spool directory, so that a rank adopts what a dead relay left"
                             " (default: $RANKSCOPE_SPOOL_DIR, else the agent's default)")  # fmt: skip
    parser.add_argument("--flush", metavar="SECONDS", type=seconds, default=None,
                        help="how long a rank's batch waits for its peers' (default: 0.1)")


def run(args: argparse.Namespace) -> int:
    from rankscope.agent.config import load_config
    from rankscope.agent.node_relay import FLUSH_S, serve

    if not args.listen:
        print("rankscope relay: say where the ranks reach it: --listen unix:/PATH (or RANKSCOPE_RELAY)", file=sys.stderr)
        return 2
    environ = {**{k: v for k, v in os.environ.items() if k.startswith("RANKSCOPE_")},
               **agent_environment(args.collector or None, spool_dir=args.spool_dir or None)}  # fmt: skip
    environ["RANKSCOPE_RELAY"] = args.listen
    config = load_config(environ)
    if config is None:  # load_config said which value is wrong
        return 2
    try:
        serve(config, config.relay or args.listen, flush_s=args.flush or FLUSH_S,
              on_ready=lambda: print(f"rankscope relay: ready on {args.listen}", flush=True))  # fmt: skip
    except RuntimeError as exc:
        print(f"rankscope relay: {exc}", file=sys.stderr)
        return 2
    return 0

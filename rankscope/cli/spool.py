"""``rankscope spool replay DIR``: send the telemetry that agents left on disk.

An agent spools batches to RANKSCOPE_SPOOL_DIR while the collector is unreachable and replays
them when it comes back; a process that ended first leaves them behind. The next agent on that
host picks them up by itself; this command does it by hand (a host where no job runs again,
or a spool copied from elsewhere). Batches the collector already has are acknowledged and not
written twice, so replaying twice is harmless.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.cli.args import seconds
from rankscope.common.agent_env import agent_environment

if TYPE_CHECKING:
    from rankscope.agent.config import AgentConfig

HELP = "replay telemetry that agents spooled to disk while the collector was unreachable"
#: how long a launcher spends sending what its job's ranks left in their spool
AFTER_JOB_TIMEOUT_S = 120.0


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    replay = actions.add_parser("replay", help="send every batch left in DIR by ended processes", description=__doc__)
    replay.add_argument("dir", metavar="DIR", type=Path, help="the spool directory (RANKSCOPE_SPOOL_DIR of the job)")
    replay.add_argument("--collector", metavar="HOST:PORT", default=os.environ.get("RANKSCOPE_COLLECTOR"),
                        help="the collector (default: $RANKSCOPE_COLLECTOR, else 127.0.0.1:7777)")
    replay.add_argument("--token", metavar="TOKEN", default=os.environ.get("RANKSCOPE_TOKEN"),
                        help="the collector's token (default: $RANKSCOPE_TOKEN)")
    replay.add_argument("--timeout", metavar="SECONDS", type=seconds, default=300.0,
                        help="give up after this long; what is left stays for next time (default: 300)")


def run(args: argparse.Namespace) -> int:
    from rankscope.agent.config import load_config

    if not args.dir.is_dir():
        print(f"rankscope spool: {args.dir} is not a directory", file=sys.stderr)
        return 2
    config = load_config(agent_environment(args.collector or None, spool_dir=args.dir, token=args.token or None,
                                           tls_ca=os.environ.get("RANKSCOPE_TLS_CA") or None))
    if config is None:  # load_config said which value is wrong
        return 2
    return 0 if replay(config, args.timeout, "rankscope spool") else 1


def replay(config: AgentConfig, timeout_s: float, who: str) -> bool:
    """Send what ended processes left in ``config.spool_dir`` and say how it went; True when nothing is left."""
    from rankscope.agent.spool import leftovers
    from rankscope.agent.transport import replay_leftovers

    stats = replay_leftovers(config, timeout_s)
    left = leftovers(config.spool_dir)
    failed = f"; failed calls: {', '.join(f'{code} x{n}' for code, n in sorted(stats.errors.items()))}" if stats.errors else ""
    print(f"{who}: replayed {stats.replayed} batches ({stats.duplicates} already stored, "
          f"{stats.dropped} refused) to {config.collector}; {len(left)} segment file(s) left in {config.spool_dir}{failed}")
    if left:
        print(f"{who}: `rankscope spool replay {config.spool_dir}` sends them once the collector can take them", file=sys.stderr)
    return not left


def replay_after_job(environ: Mapping[str, str], who: str) -> None:
    """Send the spool segments a job's ranks left behind (the collector too busy to acknowledge in
    time, or away), when the agent was on and left some: the run is then whole in the store when the
    launcher returns, so ``rankscope diagnose`` right after reads all of it."""
    from rankscope.agent.config import load_config
    from rankscope.agent.spool import leftovers

    if environ.get("RANKSCOPE_ENABLE") != "1":
        return
    config = load_config(environ)  # the ranks warned about any bad variable already
    if config is None or not config.spool_dir.is_dir():
        return
    left = leftovers(config.spool_dir)
    if left:
        print(f"{who}: the ranks left {len(left)} spool segment file(s) in {config.spool_dir}; "
              f"sending them to {config.collector} (up to {AFTER_JOB_TIMEOUT_S:.0f} s)", flush=True)  # fmt: skip
        replay(config, AFTER_JOB_TIMEOUT_S, who)

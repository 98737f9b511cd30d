"""``rankscope dashboard``: serve the Streamlit dashboard on the data of a collector, a ClickHouse
server or an embedded store (the same --collector / --clickhouse / --store / --token flags as
``rankscope sql``).

Streamlit runs headless in this process; the data source reaches the app through the
environment (``rankscope/dashboard/connection.py``). With ``--store`` this process opens the embedded
store itself, so no collector may hold it (chDB locks a store directory to one process): use it
for post mortems, and ``--collector`` while a collector runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from rankscope.cli import source
from rankscope.cli.args import port

HELP = "serve the dashboard: runs, step times, heat map, timeline, 3D-parallel graph, hosts, incidents, SQL"
EXTRA = "dashboard"

DEFAULT_PORT = 8501
DEFAULT_ADDRESS = "127.0.0.1"


def configure(parser: argparse.ArgumentParser) -> None:
    source.add_arguments(parser)
    parser.add_argument("--port", type=port(1), default=DEFAULT_PORT, help=f"HTTP port (default: {DEFAULT_PORT})")
    parser.add_argument("--address", default=DEFAULT_ADDRESS,
                        help=f"address to listen on (default: {DEFAULT_ADDRESS}; 0.0.0.0 for every interface)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    # Streamlit takes SIGTERM over once it serves; a stop asked for before then (a service manager,
    # a script that gives up waiting) is a clean exit too, not death by the default action.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    from rankscope.agent.autoload import forbid

    forbid("dashboard")  # first: this process and what it starts are no training ranks
    from rankscope.dashboard.connection import SOURCE_VARIABLE, TLS_CA_VARIABLE, TOKEN_VARIABLE, Source

    from rankscope.collector.client import is_store

    if args.store is not None and not is_store(args.store):
        print(f"rankscope dashboard: no store at {args.store} (a collector creates one: rankscope collector --store DIR)", file=sys.stderr)
        return 1
    chosen = Source(collector=args.collector, clickhouse=args.clickhouse, store=str(Path(args.store).resolve()) if args.store else None)
    os.environ[SOURCE_VARIABLE] = chosen.to_env()
    if args.token:
        os.environ[TOKEN_VARIABLE] = args.token
    if args.tls_ca:
        os.environ[TLS_CA_VARIABLE] = str(Path(args.tls_ca).resolve())
    print(f"rankscope dashboard: http://{args.address}:{args.port}/ reading {chosen.describe()}", flush=True)

    from streamlit.web import cli as streamlit_cli

    app = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
    flags = {
        "server.port": args.port, "server.address": args.address, "server.headless": "true",
        "server.fileWatcherType": "none", "server.runOnSave": "false", "browser.gatherUsageStats": "false",
        "client.toolbarMode": "viewer", "global.developmentMode": "false",
    }  # fmt: skip
    argv = ["run", str(app), *(f"--{name}={value}" for name, value in flags.items())]
    return streamlit_cli.main.main(args=argv, prog_name="streamlit", standalone_mode=False) or 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)

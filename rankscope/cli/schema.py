"""``rankscope schema``: print the DDL of rankscope's tables, for a ClickHouse server or cluster.

A collector creates its tables itself on a single server (and on the embedded store). A cluster
is prepared once by an administrator instead: ``rankscope schema --cluster NAME`` prints the
replicated ``<table>_local`` tables, the Distributed tables over them and the rollup views, from
the same table descriptions the collector uses, ready for ``clickhouse-client --multiquery``.
The statements are IF NOT EXISTS, so running them again changes nothing.
"""

from __future__ import annotations

import argparse
import re

from rankscope.cli.args import count

HELP = "print the CREATE statements of rankscope's tables (a ClickHouse cluster with --cluster)"

DEFAULT_DATABASE = "rankscope"
#: what ClickHouse accepts as a bare identifier (names are pasted into the DDL unquoted)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _identifier(text: str) -> str:
    if not _IDENTIFIER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a name of letters, digits and _ (not starting with a digit), got {text!r}")
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="NAME", type=_identifier,
                        help="a cluster of remote_servers: ON CLUSTER, ReplicatedMergeTree <table>_local, Distributed <table>"
                             " (default: one server)")  # fmt: skip
    parser.add_argument("--database", metavar="DB", type=_identifier, default=DEFAULT_DATABASE,
                        help=f"database name (default: {DEFAULT_DATABASE}; the collector's --clickhouse URL names the same)")  # fmt: skip
    parser.add_argument("--retention-days", metavar="N", type=count(1),
                        help="drop each day's partition N days after it ended (default: keep everything)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rankscope.collector.store.ddl import create_statements

    statements = create_statements(args.database, retention_days=args.retention_days, cluster=args.cluster)
    print(";\n\n".join(statements) + ";")
    return 0

"""Where a reading command gets its data: the collector (default), a ClickHouse server, or an embedded store.

Shared by ``rankscope sql``, ``rankscope diagnose`` and ``rankscope dashboard`` so they take the
same flags and mean the same by them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.cli.tls import pem_file

if TYPE_CHECKING:
    from rankscope.collector.client import Reader

DEFAULT_COLLECTOR = "127.0.0.1:7777"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--collector / --clickhouse / --store (one of them), --token and --tls-ca."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--collector", metavar="HOST:PORT",
                       help=f"ask the collector at HOST:PORT or unix:PATH (the default, {DEFAULT_COLLECTOR})")  # fmt: skip
    where.add_argument("--clickhouse", metavar="URL", help="read a ClickHouse server: http[s]://user:password@host:8123/database")
    where.add_argument("--store", metavar="DIR", type=Path,
                       help="open an embedded store directory (only while no collector runs on it)")  # fmt: skip
    parser.add_argument("--token", default=os.environ.get("RANKSCOPE_TOKEN") or None,
                        help="the collector's token (default: $RANKSCOPE_TOKEN)")  # fmt: skip
    parser.add_argument("--tls-ca", metavar="PEM", type=pem_file("CERTIFICATE"), default=os.environ.get("RANKSCOPE_TLS_CA") or None,
                        help="CA bundle that signed the collector's certificate: talk TLS to it (default: $RANKSCOPE_TLS_CA;"
                             " plain text if unset)")  # fmt: skip


def open_reader(args: argparse.Namespace) -> Reader:
    """The reader the flags name; raises the client's QueryFailed subclasses when it cannot be reached."""
    from rankscope.collector.client import open_reader as open_any

    return open_any(collector=args.collector, clickhouse=args.clickhouse, store=args.store, token=args.token, tls_ca=args.tls_ca)

"""``rankscope collector``: receive every rank's stream, store it, answer read-only queries.

With no arguments it listens on 127.0.0.1:7777 and stores in ./rankscope-data with the embedded
chDB engine. Every flag value is checked here, so a typo exits 2 with the reason before any
store is opened.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rankscope.cli.args import add_thresholds, count, listen, port, seconds, thresholds, within
from rankscope.cli.tls import pem_file

HELP = "run the collector: gRPC ingest from the agents, storage, read-only queries"
EXTRA = "collector"

DEFAULT_LISTEN = "127.0.0.1:7777"
DEFAULT_STORE = "rankscope-data"


def _window(text: str) -> tuple[float, float]:
    past, sep, future = text.partition(",")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected PAST,FUTURE in seconds (e.g. 86400,3600), got {text!r}")
    return seconds(past), seconds(future)


def _clickhouse(text: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected http[s]://user:password@host:8123/database, got {text!r}")
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--store", metavar="DIR", type=Path, default=Path(DEFAULT_STORE),
                       help=f"embedded chDB store directory (default: ./{DEFAULT_STORE}); one collector per directory")
    where.add_argument("--clickhouse", metavar="URL", type=_clickhouse,
                       help="store in a ClickHouse server instead: http[s]://user:password@host:8123/database")
    parser.add_argument("--listen", metavar="HOST:PORT", type=listen, default=DEFAULT_LISTEN,
                        help=f"gRPC address (default: {DEFAULT_LISTEN}; port 0 picks a free port, printed at start-up;"
                             " unix:PATH for a Unix socket)")
    parser.add_argument("--token", metavar="TOKEN", default=os.environ.get("RANKSCOPE_TOKEN") or None,
                        help="require 'authorization: Bearer TOKEN' on every call (default: $RANKSCOPE_TOKEN; none if unset)")
    parser.add_argument("--tls-cert", metavar="PEM", type=pem_file("CERTIFICATE"), default=os.environ.get("RANKSCOPE_TLS_CERT") or None,
                        help="serve gRPC over TLS with this certificate chain, with --tls-key (default: $RANKSCOPE_TLS_CERT;"
                             " plain text if unset); agents then need RANKSCOPE_TLS_CA")
    parser.add_argument("--tls-key", metavar="PEM", type=pem_file("PRIVATE KEY"), default=os.environ.get("RANKSCOPE_TLS_KEY") or None,
                        help="the certificate's private key (default: $RANKSCOPE_TLS_KEY)")
    parser.add_argument("--retention-days", metavar="N", type=count(0),
                        help="keep N days of data, 0 for ever (default: leave the store's retention as it is; a new store keeps everything)")
    parser.add_argument("--metrics-port", metavar="PORT", type=port(),
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST from --listen)")
    parser.add_argument("--time-window", metavar="PAST,FUTURE", type=_window, default=(86_400.0, 3_600.0),
                        help="refuse batches with times more than PAST seconds before or FUTURE seconds after the"
                             " collector's clock (default: 86400,3600)")
    parser.add_argument("--max-buffered-rows", metavar="N", type=count(1), default=2_000_000,
                        help="answer RESOURCE_EXHAUSTED (retry-after-ms) while more rows than N wait to be written"
                             " (default: 2000000; tests set it tiny to provoke back-pressure)")
    parser.add_argument("--flush-interval", metavar="SECONDS", type=seconds, default=2.0,
                        help="write a table's buffer once its oldest row is this old (default: 2); a batch is"
                             " acknowledged once written, so this bounds the ack latency of a lone batch")
    parser.add_argument("--query-max-rows", metavar="N", type=count(1), default=1_000_000,
                        help="largest query result in rows (default: 1000000); callers may ask for less")
    parser.add_argument("--query-max-bytes", metavar="N", type=count(1), default=128 * 2**20,
                        help="largest query result in bytes (default: 128 MiB; the collector holds a result a few times while it answers)")
    parser.add_argument("--query-timeout", metavar="SECONDS", type=seconds, default=60.0,
                        help="longest a query may run (default: 60; never longer than its caller waits)")
    parser.add_argument("--query-max-memory", metavar="N", type=count(1), default=2**30,
                        help="the engine's memory for one query, in bytes (default: 1 GiB)")
    parser.add_argument("--query-threads", metavar="N", type=count(1), default=2,
                        help="the engine's threads for one query (default: 2)")
    parser.add_argument("--query-concurrency", metavar="N", type=count(1), default=4,
                        help="queries run at once, on threads of their own apart from ingest (default: 4); four"
                             " times as many wait, more are refused with RESOURCE_EXHAUSTED")
    add_thresholds(parser)
    parser.add_argument("--diagnose-every", metavar="SECONDS", type=seconds, default=5.0,
                        help="seconds between two diagnosis passes over the active runs (default: 5); a run"
                             " with nothing new stored since its last pass waits for new rows")
    parser.add_argument("--no-diagnosis", action="store_true", help="store only; run no detectors")
    parser.add_argument("--nice", metavar="N", type=within(0, 19, "a nice value"), default=10,
                        help="CPU priority to run at, 0-19 (default: 10): on a machine it shares with training, the"
                             " collector's bursts (inserts, diagnosis passes) then take a small share of a busy CPU instead"
                             " of a whole core from the job; on a machine of its own it changes nothing")
    parser.add_argument("--alert-webhook", metavar="URL", help="POST every new incident as JSON to URL")


def _log_to_the_terminal() -> None:
    """rankscope's own log lines, without a prefix: news (a new run) on stdout, trouble on stderr."""
    import logging

    news = logging.StreamHandler(sys.stdout)
    news.addFilter(lambda record: record.levelno < logging.WARNING)
    trouble = logging.StreamHandler(sys.stderr)
    trouble.setLevel(logging.WARNING)
    logger = logging.getLogger("rankscope")
    logger.setLevel(logging.INFO)
    for handler in (news, trouble):
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.propagate = False


def run(args: argparse.Namespace) -> int:
    from rankscope.agent.autoload import forbid
    from rankscope.common.processes import yield_cpu

    forbid("collector")  # never a training rank, nor anything it starts
    yield_cpu(args.nice)  # first: the threads started from here on take its priority
    _log_to_the_terminal()
    from rankscope.collector.batch_columns import TimeWindow
    from rankscope.collector.query import Limits
    from rankscope.collector.server import ServerOptions, main

    past, future = args.time_window
    try:
        options = ServerOptions(
            listen=args.listen,
            store_dir=args.store,
            clickhouse_url=args.clickhouse,
            token=args.token,
            retention_days=args.retention_days,
            metrics_port=args.metrics_port,
            time_window=TimeWindow(past, future),
            max_buffered_rows=args.max_buffered_rows,
            flush_interval_s=args.flush_interval,
            limits=Limits(args.query_max_rows, args.query_max_bytes, args.query_timeout, args.query_max_memory, args.query_threads),
            query_concurrency=args.query_concurrency,
            diagnosis=None if args.no_diagnosis else thresholds(args),
            diagnose_interval_s=args.diagnose_every,
            alert_webhook=args.alert_webhook,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except ValueError as e:  # flags that only make sense together
        print(f"rankscope collector: {e}", file=sys.stderr)
        return 2
    return main(options)

"""Hostile batches against one collector: what it answers, what it stores, what memory it takes.

    python benchmarks/fuzz.py [--requests 10000] [--seed 30] [--concurrency 64]

Valid batches of every payload, one in eight sent as they are and the rest mutated one to three
times field by field (``rankscope.harness.ingest_fuzz``), go over gRPC to a ``rankscope collector``
on a fresh embedded store. Printed: the calls by status code (UNKNOWN: an exception the service
let out), the stored rows that break the ingest checks (read from the store once the collector
stopped), and the collector's resident memory once the runs registered and at its peak (issue 30:
within 200 MB), beside a second collector's under as many valid batches: the store's own growth.

The collectors run at ``--nice 0``: at its default 10 a collector yields the CPU to everything
else (as it should to training), and with four busy processes in other sessions it answered 640
fuzzed requests in 132 s instead of 9.5 s; at a load average of 40-55, 10,000 did not finish in 22
minutes. What is measured here is what it answers, stores and holds, not how it yields.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path

from rankscope.collector.store.base import open_store
from rankscope.harness import ingest_fuzz
from rankscope.harness.orchestration import start_collector, stop

COUNTED = ("spans", "collectives", "heartbeats", "metrics", "step_metrics", "exits", "ranks")


async def send_all(address: str, pid: int, args: argparse.Namespace, mutated: float) -> ingest_fuzz.Outcome:
    send = ingest_fuzz.OverGrpc(address)
    try:
        rss = lambda: ingest_fuzz.rss_bytes(pid)  # noqa: E731
        return await ingest_fuzz.fuzz(send, rss, args.requests, seed=args.seed, concurrency=args.concurrency, mutated=mutated)
    finally:
        await send.close()


def against_a_collector(workdir: Path, args: argparse.Namespace, mutated: float) -> tuple[ingest_fuzz.Outcome, dict[str, int], dict[str, int]]:
    """The requests sent to a fresh collector in ``workdir``; what broke the checks and the rows stored, read
    from its store once it stopped."""
    collector, address = start_collector(workdir / "store", workdir / "collector.log", "--no-diagnosis", "--flush-interval", "0.2", "--nice", "0")
    try:
        outcome = asyncio.run(send_all(address, collector.pid, args, mutated))
    finally:
        stop(collector, 60)  # SIGTERM: it writes what it holds
    store = open_store(store_dir=workdir / "store")
    try:
        found = ingest_fuzz.violations(store.query_arrow)
        stored = {t: store.query_arrow(f"SELECT count() AS n FROM {t}").column("n")[0].as_py() for t in COUNTED}
    finally:
        store.close()
    return outcome, found, stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=64, help="calls in flight at once (an accepted batch waits for its write)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rankscope-fuzz-"))
    try:
        outcome, found, stored = against_a_collector(workdir / "fuzzed", args, 7 / 8)
        baseline = against_a_collector(workdir / "valid", args, 0.0)[0]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    mib = 2**20
    print("| measure | value |")
    print("|---|---|")
    print(f"| requests over gRPC (seed {args.seed}, {args.concurrency} at once) | {outcome.requests:,} in {outcome.seconds:.1f} s |")
    for code, n in sorted(outcome.codes.items(), key=lambda item: -item[1]):
        print(f"| answered {code} | {n:,} |")
    print(f"| answered UNKNOWN (an exception let out) | {outcome.codes['UNKNOWN']:,} |")
    print(f"| the longest refusal's message | {outcome.longest_details:,} characters |")
    for what, n in found.items():
        print(f"| stored rows that break the checks: {what} | {n:,} |")
    print(f"| stored rows that break the checks | {sum(found.values()):,} |")
    print(f"| rows stored ({', '.join(COUNTED)}) | {', '.join(f'{n:,}' for n in stored.values())} |")
    for what, run in (("fuzzed", outcome), ("the same number of valid batches (baseline, another collector)", baseline)):
        print(f"| collector RSS idle / peak / growth, {what} | {run.rss_idle / mib:,.0f} / {run.rss_peak / mib:,.0f} /"
              f" {(run.rss_peak - run.rss_idle) / mib:,.0f} MiB |")  # fmt: skip
    print(f"| baseline: answered OK in {baseline.seconds:.1f} s | {baseline.codes['OK']:,} |")
    for details, kind in outcome.unknown[:5]:
        print(f"| UNKNOWN example ({kind}) | {details} |")


if __name__ == "__main__":
    main()

"""Readers against ingest: how long a new run's batches wait for their acks while slow queries run,
and what the queries that once broke the limits cost the collector now.

    python benchmarks/reads.py [--slow 6] [--batches 20] [--replies 3] [--reply-mb 120] [--hogs 0]

One ``rankscope collector`` (embedded chDB, no diagnosis). First a new run's batches are sent one
at a time with nothing else running; then ``--slow`` queries that sleep in the engine are started
(each as ``rankscope sql`` would: a 30 s deadline) and a second new run's batches are sent while
they run; then the same with queries that keep the CPU busy; then with the three queries of issue
30 (903 MB of one repeated string, 1 GB in one array, ``system.processes``), sent together, the
batches going on until all three are answered; then while a reader on a connection of its own
takes ``--replies`` results of ``--reply-mb`` MB one after another (answered under the
result limit, refused over it). Printed: each
phase's ack latency (median, 90th percentile, slowest) and the batches that missed their 30 s
deadline; then each limit query's answer, and the collector's peak RSS before and after them and after the replies. ``--hogs N`` keeps N busy processes running through
every phase, each in a session of its own as another user's job is: the loaded machine on which
reads once delayed acks by seconds, made repeatable.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
from ingest import spans

from rankscope.harness.orchestration import start_collector, stop
from rankscope.harness.simulate.payloads import register
from rankscope.harness.simulate.topology import build
from rankscope.protos.v1 import ingest_pb2, ingest_pb2_grpc, query_pb2, query_pb2_grpc

#: slow queries: one that sleeps half a second per block of numbers(), one that keeps the CPU busy; minutes, unless stopped
SLOW = {
    "sleeping": "SELECT sum(sleep(0.5)) AS s FROM numbers(100000000)",
    "CPU-bound": "SELECT count() AS n FROM numbers(100000000000) WHERE intHash64(number) % 7 = 3",
}
#: a result of about ``--reply-mb`` MB (a row of 1 kB per 1,000)
LARGE = "SELECT repeat('x', 1000) AS s FROM numbers({rows})"
LIMIT_QUERIES = (
    "SELECT repeat('x', 1000) FROM numbers(900000)",
    "SELECT max(length(arrayMap(x -> repeat('y', 100), range(10000000)))) AS n",
    "SELECT * FROM system.processes",
)
#: rankscope sql's and an agent's deadline
DEADLINE_S = 30.0


def acks(stub: ingest_pb2_grpc.IngestStub, run_id: str, batches: int, until: Callable[[], bool] = lambda: True) -> tuple[list[float], int]:
    """Seconds from send to ack of a new run's batches (a registration, then spans), and how many missed
    the deadline: ``batches`` of them, and more until ``until()``."""
    took, missed = [], 0
    step = 0
    while step < batches or not until():
        if step == 0:
            payload = {"register": register(build(1, 1, 1), 0, run_name=run_id, config_json="{}", start_ns=time.time_ns(), pid=os.getpid())}
        else:
            payload = {"spans": spans(0, 100, time.time_ns(), step)}
        batch = ingest_pb2.Batch(schema_version=1, run_id=run_id, rank=0, batch_id=os.urandom(16), sent_ns=time.time_ns(), **payload)
        sent = time.perf_counter()
        try:
            stub.Send(batch, timeout=DEADLINE_S)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                raise
            missed += 1
        took.append(time.perf_counter() - sent)
        step += 1
    return took, missed


@contextmanager
def hogs(n: int) -> Iterator[None]:
    """``n`` processes that keep a core busy, each in a session (an autogroup) of its own, until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def quantile(took: list[float], q: float) -> float:
    """The ``q`` quantile of ``took`` (nearest rank), in ms."""
    return sorted(took)[min(len(took) - 1, int(q * len(took)))] * 1e3


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def answer(call: grpc.Future) -> str:
    """A query's answer in one line: rows and bytes, or its status and the start of its message."""
    try:
        reply = call.result()
        return f"OK: {reply.rows} rows, {len(reply.arrow_ipc) / 1e6:.0f} MB"
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()[:90]}"  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=6, help="slow queries running while the second run sends (default: 6)")
    parser.add_argument("--batches", type=int, default=20, help="batches per run (default: 20)")
    parser.add_argument("--replies", type=int, default=3, help="large results taken while a fifth run sends (default: 3)")
    parser.add_argument("--reply-mb", type=int, default=120, help="the large results' size: 120 MB (default) is under the 128 MiB limit")
    parser.add_argument("--hogs", type=int, default=0, help="busy processes running meanwhile, each in a session of its own (default: 0)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rankscope-bench-reads-"))
    proc, address = start_collector(work / "store", work / "collector.log", "--no-diagnosis", "--flush-interval", "0.2")
    try:
        with hogs(args.hogs):
            with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
                ingest, query = ingest_pb2_grpc.IngestStub(channel), query_pb2_grpc.QueryStub(channel)
                rows = [("no queries", *acks(ingest, "reads-idle", args.batches))]
                for kind, sql in SLOW.items():
                    slow = [query.Query.future(query_pb2.QueryRequest(sql=sql), timeout=DEADLINE_S) for _ in range(args.slow)]
                    time.sleep(1.0)  # every slow query started
                    rows.append((f"{args.slow} {kind} queries", *acks(ingest, f"reads-{kind}", args.batches)))
                    for call in slow:
                        call.cancel()
                    time.sleep(1.0)
                idle_rss = peak_rss_mb(proc.pid)
                limits = [query.Query.future(query_pb2.QueryRequest(sql=sql), timeout=120) for sql in LIMIT_QUERIES]
                rows.append(("the 3 limit queries", *acks(ingest, "reads-limits", args.batches, lambda: all(c.done() for c in limits))))
                limits_rss = peak_rss_mb(proc.pid)
                # a reader's own connection, as `rankscope sql` has: not the agents' (HTTP/2 would queue their acks behind the reply)
                options = [("grpc.max_receive_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]
                with grpc.insecure_channel(address, options=options) as reader, ThreadPoolExecutor(1) as pool:
                    large = query_pb2_grpc.QueryStub(reader)
                    request = query_pb2.QueryRequest(sql=LARGE.format(rows=args.reply_mb * 1000))
                    taken = pool.submit(lambda: [answer(large.Query.future(request, timeout=120)) for _ in range(args.replies)])
                    rows.append((f"{args.replies} replies of {args.reply_mb} MB", *acks(ingest, "reads-large", args.batches, taken.done)))
                print(f"{'phase':<28} {'batches':>7} {'ack median ms':>14} {'ack p90 ms':>11} {'ack max ms':>11} {'deadline missed':>16}")
                for phase, took, missed in rows:
                    print(f"{phase:<28} {len(took):>7} {statistics.median(took) * 1e3:>14.1f} {quantile(took, 0.9):>11.1f} {max(took) * 1e3:>11.1f} {missed:>16}")
                print()
                print(f"collector peak RSS: {idle_rss:.0f} MB before the limit queries, {limits_rss:.0f} MB after them,"
                      f" {peak_rss_mb(proc.pid):.0f} MB after the replies\n")  # fmt: skip
                for sql, call in zip(LIMIT_QUERIES, limits):
                    print(f"{sql:<76} {answer(call)}")
                print(f"{request.sql:<76} {', '.join(taken.result())}")
    finally:
        stop(proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

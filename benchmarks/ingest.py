"""End-to-end ingest: agent-like senders -> gRPC -> one collector -> the embedded store.

    python benchmarks/ingest.py [--senders 4] [--seconds 20] [--batch 4096]

Each sender process pushes realistic span and collective batches through the agent's real
Transport into one ``rankscope collector`` (embedded chDB) for a fixed time. Printed, from one
run: events/s acknowledged and written (counted in the store afterwards), the collector's insert
latency, and the raw chDB insert rate of the same rows from one Arrow table, with the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from rankscope.harness.orchestration import free_port, start_collector, stop

SPAN_NAMES = ["forward", "backward", "optimizer", "data", "send_forward_recv_backward", "grad_sync"]
GROUPS = ["tp[0]", "tp[1]", "pp[0]", "dp[0]", "dp[1]"]


def spans(rank: int, n: int, t0: int, step: int):
    from rankscope.protos.v1 import telemetry_pb2

    start = t0 + np.arange(n, dtype=np.int64) * 1_000_000
    return telemetry_pb2.SpanBatch(
        count=n, strings=SPAN_NAMES,
        name=(np.arange(n, dtype=np.int32) % len(SPAN_NAMES)).astype("<i4").tobytes(),
        kind=(np.arange(n) % 3).astype("u1").tobytes(),
        step=np.full(n, step, "<i4").tobytes(),
        microbatch=(np.arange(n, dtype=np.int32) % 8).astype("<i4").tobytes(),
        start_ns=start.astype("<i8").tobytes(),
        end_ns=(start + 700_000 + rank).astype("<i8").tobytes(),
        attributes=np.full(n, -1, "<i4").tobytes(),
    )  # fmt: skip


def collectives(rank: int, n: int, t0: int, step: int):
    from rankscope.protos.v1 import telemetry_pb2

    issue = t0 + np.arange(n, dtype=np.int64) * 500_000
    return telemetry_pb2.CollectiveBatch(
        count=n, strings=[*GROUPS, "all_reduce", "float32"],
        group=(np.arange(n, dtype=np.int32) % len(GROUPS)).astype("<i4").tobytes(),
        seq=(np.arange(n, dtype=np.int64) + step * n).astype("<i8").tobytes(),
        op=np.full(n, len(GROUPS), "<i4").tobytes(),
        nbytes=np.full(n, 4 << 20, "<i8").tobytes(),
        dtype=np.full(n, len(GROUPS) + 1, "<i4").tobytes(),
        peer=np.full(n, -1, "<i4").tobytes(),
        issue_ns=issue.astype("<i8").tobytes(), start_ns=issue.astype("<i8").tobytes(),
        end_ns=(issue + 300_000).astype("<i8").tobytes(),
        state=np.zeros(n, "u1").tobytes(), step=np.full(n, step, "<i4").tobytes(),
    )  # fmt: skip


def registration(rank: int, world: int):
    """A data-parallel rank's registration: the collector takes rows of registered runs only."""
    from rankscope.protos.v1 import telemetry_pb2

    return telemetry_pb2.Register(world_size=world, host=f"bench-{rank}", pid=os.getpid(), tp=1, pp=1, dp=world, tp_rank=0,
                                  pp_rank=0, dp_rank=rank, start_time_ns=time.time_ns())  # fmt: skip


def sender(address: str, run_id: str, rank: int, world: int, seconds: float, batch: int, spool: str, out: mp.Queue) -> None:
    """One agent-like process: keep the Transport's queue fed for ``seconds``, then close it."""
    from rankscope.agent.config import load_config
    from rankscope.agent.transport import Transport
    from rankscope.common.agent_env import agent_environment

    config = load_config(agent_environment(address, spool_dir=spool))
    transport = Transport(config, run_id, rank, name=f"bench{rank}")
    transport.start()
    transport.submit(registration(rank, world))
    t0 = time.time_ns()
    began = time.time()
    # A few distinct payloads, built once: the benchmark measures transport and ingest, not numpy.
    payloads = [make(rank, batch, t0 + i * 10**9, i + 1) for i in range(4) for make in (spans, collectives)]
    submitted = refused = 0
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        if transport.submit(payloads[i % len(payloads)]):
            submitted += batch
        else:
            refused += 1
            time.sleep(0.001)  # the queue is full: the collector is the bottleneck
        i += 1
    transport.close(timeout_s=30)  # returns once everything is acknowledged (or spooled)
    stats = transport.stats()
    out.put((submitted, stats.acked, stats.dropped_events, refused, began, time.time()))


def insert_latency(metrics_port: int) -> tuple[float, int]:
    """Mean insert latency (s) and number of inserts, from the collector's Prometheus histogram."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    total = sum(float(v) for v in re.findall(r'^rankscope_insert_seconds_sum\{[^}]*\} (\S+)$', text, re.M))
    count = sum(float(v) for v in re.findall(r'^rankscope_insert_seconds_count\{[^}]*\} (\S+)$', text, re.M))
    return (total / count if count else float("nan")), int(count)


def raw_insert_rate(store: Path, rows_per_table: int) -> float:
    """Rows/s of one INSERT ... SELECT FROM Python(arrow) of the same decoded rows, spans and collectives."""
    from rankscope.collector.decode import decode
    from rankscope.collector.run_registry import RunRegistry
    from rankscope.collector.store.base import open_store
    from rankscope.protos.v1 import ingest_pb2

    now = time.time_ns()
    tables = {}
    registry = RunRegistry()
    decode(ingest_pb2.Batch(schema_version=1, run_id="raw", rank=0, batch_id=os.urandom(16), register=registration(0, 1)), registry, now)
    for kind, make in (("spans", spans), ("collectives", collectives)):
        batch = ingest_pb2.Batch(schema_version=1, run_id="raw", rank=0, batch_id=os.urandom(16), **{kind: make(0, rows_per_table, now, 1)})
        tables[kind] = decode(batch, registry, now).parts[kind]
    st = open_store(store_dir=store)
    try:
        started = time.perf_counter()
        for name, table in tables.items():
            st.insert_arrow(name, table)
        return 2 * rows_per_table / (time.perf_counter() - started)
    finally:
        st.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rankscope-ingest-"))
    store = workdir / "store"
    metrics_port = free_port()
    # The senders stand in for agents on other machines: the collector runs at full priority (--nice 0),
    # as on a machine of its own, instead of yielding to them as it yields to training beside it.
    collector, address = start_collector(store, workdir / "collector.log", "--metrics-port", str(metrics_port), "--no-diagnosis",
                                         "--nice", "0")  # fmt: skip
    run_id = f"bench-{os.getpid()}"
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    try:
        procs = [ctx.Process(target=sender, args=(address, run_id, r, args.senders, args.seconds, args.batch, str(workdir / "spool"), out))
                 for r in range(args.senders)]  # fmt: skip
        for p in procs:
            p.start()
        results = [out.get(timeout=args.seconds + 120) for _ in procs]
        for p in procs:
            p.join()
        # From the first submit to the last acknowledgement: process start-up is not ingest.
        elapsed = max(r[5] for r in results) - min(r[4] for r in results)
        latency, inserts = insert_latency(metrics_port)
        from rankscope.collector.client import Client

        with Client(address) as client:
            written = sum(
                client.query(f"SELECT count() AS n FROM {t} WHERE run_id = {{run:String}}", {"run": run_id})["n"][0].as_py()
                for t in ("spans", "collectives")
            )
    finally:
        stop(collector, 60)  # SIGTERM: it writes what it holds
    submitted = sum(r[0] for r in results)
    dropped = sum(r[2] for r in results)
    try:
        raw = raw_insert_rate(store, 1_000_000)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    e2e = written / elapsed
    print("| measure | value |")
    print("|---|---|")
    print(f"| senders (processes, one Transport each) | {args.senders} |")
    print(f"| events submitted / written in the store / dropped after acceptance | {submitted:,} / {written:,} / {dropped:,} |")
    print(f"| end-to-end events/s written (first submit to last acknowledgement) | {e2e:,.0f} |")
    print(f"| collector insert latency, mean over {inserts} inserts | {1e3 * latency:.1f} ms |")
    print(f"| raw chDB insert of the same rows (one Arrow table per table) | {raw:,.0f} rows/s |")
    print(f"| end-to-end / raw | {e2e / raw:.0%} |")


if __name__ == "__main__":
    main()

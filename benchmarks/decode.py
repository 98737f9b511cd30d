"""The collector's decode, in process: what one batch costs its event loop at 100,000 ranks.

    python benchmarks/decode.py [--ranks-per-batch 256] [--repeats 30]

At 100,096 ranks (tp 8, pp 16, dp 782) with a heartbeat every 10 s, 10,000 heartbeats a second
reach one collector, and every call is decoded on its event loop, where a hang's evidence waits
behind it. Printed, medians over ``--repeats``: a heartbeat batch of N ranks (running, and blocked
with two operations in flight) per heartbeat, the collector noting who it heard from, and
registrations and ends of N ranks sent a call each against one batch (``RegisterBatch``,
``EndBatch``), side by side, with the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from rankscope.collector.decode import decode
from rankscope.collector.liveness import LastHeard
from rankscope.collector.run_registry import RunRegistry
from rankscope.harness.simulate import payloads
from rankscope.harness.simulate.freeze import Flight
from rankscope.harness.simulate.topology import build
from rankscope.protos.v1 import ingest_pb2
from rankscope.protos.v1 import telemetry_pb2 as pb

TOPOLOGY = (8, 16, 782)


def envelope(rank: int, **payload: object) -> bytes:
    """A serialized batch, parsed again for every decode as the server does."""
    batch = ingest_pb2.Batch(schema_version=1, run_id="bench", rank=rank, batch_id=os.urandom(16), sent_ns=time.time_ns(), **payload)
    return batch.SerializeToString()


def timed(work: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``work()`` over ``repeats`` runs (after one to warm up)."""
    work()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks-per-batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    n, repeats = args.ranks_per_batch, args.repeats
    topo = build(*TOPOLOGY)
    now = time.time_ns()
    regs = [payloads.register(topo, r, run_name="bench", config_json="{}", start_ns=now, pid=1) for r in range(n)]
    ends = [payloads.end(now, pb.EndOfRank.REASON_NORMAL) for _ in range(n)]

    def registered() -> RunRegistry:
        registry = RunRegistry()
        decode(ingest_pb2.Batch.FromString(envelope(0, registers=pb.RegisterBatch(registers=regs, ranks=range(n)))), registry, time.time_ns())
        return registry

    def each(batches: list[bytes], registry: Callable[[], RunRegistry]) -> Callable[[], object]:
        def work() -> None:
            into = registry()
            for data in batches:
                decode(ingest_pb2.Batch.FromString(data), into, time.time_ns())
        return work

    registry = registered()
    flights = [Flight(group=0, seq=5, op=3, peer=-1, issue_ns=now - 10**9, waiting=True),
               Flight(group=2, seq=9, op=4, peer=17, issue_ns=now - 2 * 10**9, waiting=False)]  # fmt: skip
    rows = [f"| measure ({n} ranks a batch, {topo.world_size:,}-rank topology) | per rank | per batch |", "|---|---|---|"]
    heard = LastHeard(stale_ns=10**10)
    for state, in_flight in (("running", ()), ("blocked, 2 operations in flight", flights)):
        beats = [payloads.heartbeat(topo, r, time_ns=now, step=5, phase="forward", stalled=bool(in_flight), last_progress_ns=now - 10**9,
                                    in_flight=in_flight) for r in range(n)]  # fmt: skip
        data = envelope(0, heartbeats=pb.HeartbeatBatch(heartbeats=beats, ranks=range(n)))
        seconds = timed(lambda: decode(ingest_pb2.Batch.FromString(data), registry, time.time_ns()), repeats)
        rows.append(f"| heartbeats decoded, {state} | {seconds / n * 1e6:.1f} us | {seconds * 1e3:.2f} ms |")
    decoded = decode(ingest_pb2.Batch.FromString(data), registry, time.time_ns())
    seconds = timed(lambda: heard.note(decoded, time.time_ns()), repeats)
    rows.append(f"| who was heard, noted (`LastHeard.note`) | {seconds / n * 1e6:.2f} us | {seconds * 1e3:.2f} ms |")
    pairs = [  # registrations into an empty registry each time; ends (the same ends again: idempotent) into the registered one
        ("registrations", "RegisterBatch", [envelope(r, register=reg) for r, reg in enumerate(regs)],
         envelope(0, registers=pb.RegisterBatch(registers=regs, ranks=range(n))), RunRegistry),
        ("ends", "EndBatch", [envelope(r, end=e) for r, e in enumerate(ends)], envelope(0, ends=pb.EndBatch(ends=ends, ranks=range(n))),
         lambda: registry),
    ]  # fmt: skip
    for what, message, single, batched, into in pairs:
        one = timed(each(single, into), repeats)
        together = timed(each([batched], into), repeats)
        rows.append(f"| {what}, a call each | {one / n * 1e6:.1f} us | {one * 1e3:.2f} ms |")
        rows.append(f"| {what}, one batch (`{message}`) | {together / n * 1e6:.1f} us | {together * 1e3:.2f} ms ({together / one:.2f}x) |")
    print("\n".join(rows))
    print("\nNot counted: gRPC's own cost of a call on the event loop, about a millisecond (the calls a batch saves).")


if __name__ == "__main__":
    main()

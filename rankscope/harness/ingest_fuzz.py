"""Hostile batches against a collector: valid batches of every payload, mutated field by field
with a seeded generator, sent through its Ingest service in this process or over gRPC.

What a collector must hold under them (issue 30): no call answered UNKNOWN (an exception the
service did not turn into a status), nothing stored that breaks the ingest checks (``violations``),
and memory bounded by the requests' sizes. Used by tests/test_collector_fuzz.py (a few thousand
requests) and benchmarks/fuzz.py (the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from rankscope.collector import server
from rankscope.collector.batch_limits import MAX_ID_CHARS, MAX_TEXT_CHARS
from rankscope.collector.query import guard_for
from rankscope.collector.store.base import open_store
from rankscope.collector.store.migrations import migrate
from rankscope.collector.writer import Writer
from rankscope.protos.v1 import BATCH_SCHEMA_VERSION, ingest_pb2, ingest_pb2_grpc
from rankscope.protos.v1 import telemetry_pb2 as pb

#: the fuzzed runs (rows of any other run id must have been refused unless a mutated registration made it)
RUNS = ("fuzz-a", "fuzz-b")
WORLD = 4
#: a mutation that grows a field stops short of this many bytes: the request's memory is the
#: sender's, and this process is both (a larger one is what gRPC refuses at 64 MiB anyway)
GROWN_BYTES = 1 << 20
_T = FieldDescriptor


@contextlib.asynccontextmanager
async def in_process(store_dir: Path, flush_interval_s: float = 0.05) -> AsyncIterator[server.Collector]:
    """A collector's shared state over a fresh embedded store in ``store_dir``, in this process (no
    gRPC server, no diagnosis)."""
    store = open_store(store_dir=store_dir, database="rankscope")
    migrate(store, store.database, None)
    writer = Writer(store, store.database, flush_interval_s=flush_interval_s)
    await writer.start()
    try:
        yield server.Collector(store, writer, guard_for(store), server.ServerOptions(diagnosis=None))
    finally:
        await writer.close()
        store.close()


class _Aborted(Exception):
    pass


class _Call:
    """Stands in for a call's ``grpc.aio.ServicerContext``: what the service answered."""

    code = grpc.StatusCode.OK

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)

    def set_trailing_metadata(self, metadata: object) -> None:
        pass


def envelope(run_id: str, rank: int, **payload: object) -> ingest_pb2.Batch:
    return ingest_pb2.Batch(schema_version=BATCH_SCHEMA_VERSION, run_id=run_id, rank=rank, batch_id=os.urandom(16),
                            sent_ns=time.time_ns(), **payload)  # fmt: skip


def _register(rank: int, now: int) -> pb.Register:
    return pb.Register(
        world_size=WORLD, host=f"node-{rank // 2}", pid=100 + rank, local_rank=rank % 2, device="cpu", tp=1, pp=1, dp=WORLD,
        tp_rank=0, pp_rank=0, dp_rank=rank, groups=[pb.Group(name="world", ranks=range(WORLD))], run_name="fuzz",
        config_json="{}", start_time_ns=now - 10**9, agent_version="fuzz", time_ns=now, world="fuzz:1/4",
    )  # fmt: skip


def registrations(run_id: str, now: int) -> list[ingest_pb2.Batch]:
    """Every rank of ``run_id`` registered, as its own agents would."""
    return [envelope(run_id, rank, register=_register(rank, now)) for rank in range(WORLD)]


def i4(values: object) -> bytes:
    return np.asarray(values, "<i4").tobytes()


def i8(values: object) -> bytes:
    return np.asarray(values, "<i8").tobytes()


def seeds(run_id: str, now: int) -> list[ingest_pb2.Batch]:
    """One valid batch of every payload kind for ``run_id`` (registered with ``registrations``)."""
    n = 8
    i = np.arange(n, dtype=np.int64)
    t = now - 10**9 + i * 1000
    beat = pb.Heartbeat(time_ns=now, step=2, phase="forward", status="running", last_progress_ns=now - 10**6,
                        in_flight=[pb.InFlight(group="world", seq=3, op="all_reduce", peer=-1, issue_ns=now - 10**6, waiting=True)])
    end = pb.EndOfRank(time_ns=now, reason=pb.EndOfRank.REASON_NORMAL)
    return [
        envelope(run_id, 1, register=_register(1, now)),
        envelope(run_id, 0, registers=pb.RegisterBatch(registers=[_register(2, now), _register(3, now)], ranks=[2, 3])),
        envelope(run_id, 0, spans=pb.SpanBatch(
            count=n, strings=["forward", "{}"], name=i4(np.zeros(n)), kind=(i % 5).astype("u1").tobytes(), step=i4(np.ones(n)),
            microbatch=i4(i % 3 - 1), start_ns=i8(t), end_ns=i8(t + 500), attributes=i4(i % 2 * 2 - 1), cpu_ns=i8(np.full(n, 100)),
            rank=i4(i % WORLD))),
        envelope(run_id, 1, collectives=pb.CollectiveBatch(
            count=n, strings=["world", "all_reduce", "float32"], group=i4(np.zeros(n)), seq=i8(i), op=i4(np.ones(n)), nbytes=i8(i * 64),
            dtype=i4(np.full(n, 2)), peer=i4(np.full(n, -1)), issue_ns=i8(t), start_ns=i8(t + 1), end_ns=i8(t + 9),
            state=np.zeros(n, "u1").tobytes(), step=i4(np.ones(n)))),
        envelope(run_id, 2, heartbeats=pb.HeartbeatBatch(heartbeats=[beat, beat], ranks=[2, 3])),
        envelope(run_id, 3, metrics=pb.MetricBatch(
            count=n, strings=["gpu.utilization", "cuda:0"], time_ns=i8(t), name=i4(np.zeros(n)), device=i4(np.ones(n)),
            value=(i / n).astype("<f8").tobytes())),
        envelope(run_id, 0, step_metrics=pb.StepMetricBatch(
            count=n, strings=["loss"], step=i4(i + 1), name=i4(np.zeros(n)), value=(i * 0.5).astype("<f8").tobytes(), time_ns=i8(t))),
        envelope(run_id, 1, stack=pb.StackDump(time_ns=now, reason="requested", method="python-frames", text="Thread 1\n  train")),
        envelope(run_id, 2, end=end),
        envelope(run_id, 0, ends=pb.EndBatch(ends=[end, end], ranks=[1, 3])),
        envelope(run_id, 0, action=pb.Action(time_ns=now, action="evict", hosts=["node-1"], reason="slow", evidence_json="{}")),
        envelope(run_id, 0, selfcheck=pb.SelfCheck(time_ns=now, host="node-1", passed=True, summary="ok",
                                                   figures=[pb.SelfCheckFigure(check="matmul", value=1.0, unit="GFLOP/s", reference=1.0)])),
        envelope(run_id, 0, node_state=pb.NodeState(time_ns=now, host="node-1", state="suspect", reason="slow", actor="fuzz")),
    ]  # fmt: skip


def _slots(msg: Message) -> list[tuple[Message, FieldDescriptor]]:
    """Every field of ``msg`` and of the messages set in it, where a mutation may land."""
    found = []
    for f in msg.DESCRIPTOR.fields:
        if f.containing_oneof is not None and msg.WhichOneof(f.containing_oneof.name) != f.name:
            continue  # another payload: mutate the one the batch carries
        found.append((msg, f))
        if f.type == _T.TYPE_MESSAGE:
            children = getattr(msg, f.name) if f.is_repeated else [getattr(msg, f.name)]
            for child in list(children)[:4]:
                found.extend(_slots(child))
    return found


def _int(rng: random.Random, bits: int, signed: bool, now: int) -> int:
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    picks = [lo, hi, 0, 1, 2, 9, 70_000, 1 << 26, rng.randint(lo, hi)]
    if signed:
        picks += [-1, -2]
    if bits == 64:  # times: a day away, before the run, 1938, the far future
        picks += [now + 2 * 86_400 * 10**9, now - 3_600 * 10**9, -(32 * 365 * 86_400 * 10**9), now * 3]
    return min(hi, max(lo, rng.choice(picks)))


def _times(rng: random.Random, size: int) -> int:
    """How many times to repeat something of ``size`` bytes: the request stays under ``GROWN_BYTES``."""
    return max(1, min(rng.choice((2, 64, 4096)), GROWN_BYTES // max(size, 1)))


def _bytes(rng: random.Random, old: bytes) -> bytes:
    return rng.choice([
        b"", old[: rng.randrange(len(old) + 1)], old + os.urandom(rng.choice((1, 3, 8))), os.urandom(len(old)),
        old * _times(rng, len(old)), b"\xff" * len(old), b"\x00" * len(old),
    ])  # fmt: skip


def _text(rng: random.Random) -> str:
    """Empty, just past a limit, long but allowed for texts, non-ASCII, a new run's id, SQL, noise."""
    return rng.choice([
        "", "x" * (MAX_ID_CHARS + 1), "x" * (MAX_TEXT_CHARS + 1), "x" * 65_536, "é" * 300, "fuzz-c", "\x00\n;DROP TABLE spans",
        str(rng.random()),
    ])  # fmt: skip


def _value(rng: random.Random, f: FieldDescriptor, old: object, now: int) -> object:
    """A hostile value for one field of type ``f``."""
    t = f.type
    if t in (_T.TYPE_INT32, _T.TYPE_SINT32, _T.TYPE_SFIXED32):
        return _int(rng, 32, True, now)
    if t in (_T.TYPE_INT64, _T.TYPE_SINT64, _T.TYPE_SFIXED64):
        return _int(rng, 64, True, now)
    if t in (_T.TYPE_UINT32, _T.TYPE_FIXED32):
        return _int(rng, 32, False, now)
    if t in (_T.TYPE_UINT64, _T.TYPE_FIXED64):
        return _int(rng, 64, False, now)
    if t == _T.TYPE_ENUM:
        return rng.choice([0, 1, 3, 9, 255, -1])
    if t == _T.TYPE_BOOL:
        return not old
    if t in (_T.TYPE_DOUBLE, _T.TYPE_FLOAT):
        return rng.choice([float("nan"), float("inf"), -float("inf"), 1e308, -0.0])
    if t == _T.TYPE_STRING:
        return _text(rng)
    if t == _T.TYPE_BYTES:
        return _bytes(rng, old)  # type: ignore[arg-type]
    raise AssertionError(f"no mutation for field type {t}")


def mutate(batch: ingest_pb2.Batch, rng: random.Random, now: int) -> None:
    """One hostile change to ``batch`` or a message in it: a field set to an extreme, cut, grown,
    emptied, or a repeated field cleared or multiplied."""
    msg, f = rng.choice(_slots(batch))
    if f.is_repeated:
        values = getattr(msg, f.name)
        how = rng.choice(("clear", "grow", "add"))
        if how == "clear" or not values and how == "grow":
            msg.ClearField(f.name)
        elif how == "grow":
            values.extend(list(values) * _times(rng, msg.ByteSize()))
        elif f.type == _T.TYPE_MESSAGE:
            values.add()
        else:
            values.append(_value(rng, f, values[0] if values else (b"" if f.type == _T.TYPE_BYTES else 0), now))
    elif f.type == _T.TYPE_MESSAGE:
        msg.ClearField(f.name)
    else:
        setattr(msg, f.name, _value(rng, f, getattr(msg, f.name), now))


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of process ``pid`` (this one by default)."""
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: one call: the batch in, the status code's name and details out ("UNKNOWN": the service let an exception out)
Send = Callable[[ingest_pb2.Batch], Awaitable[tuple[str, str]]]


@dataclass
class Outcome:
    """What the fuzzed calls were answered, and the collector's memory meanwhile."""

    requests: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    #: calls answered UNKNOWN: what the service let out, and the batch's payload kind
    unknown: list[tuple[str, str]] = field(default_factory=list)
    rss_idle: int = 0
    rss_peak: int = 0
    seconds: float = 0.0
    #: characters of the longest refusal's message (gRPC clients refuse metadata beyond 16 KiB)
    longest_details: int = 0


async def fuzz(
    send: Send, rss: Callable[[], int], requests: int, seed: int = 0, concurrency: int = 64, mutated: float = 7 / 8
) -> Outcome:
    """Register ``RUNS``, then send ``requests`` batches, the share ``mutated`` of them mutated 1-3 times
    and the rest valid seeds (``mutated=0``: a baseline of good traffic), ``concurrency`` at a time (an
    accepted batch waits for its write); ``rss()`` is the collector's resident memory, read before and
    after every round."""
    rng = random.Random(seed)
    out = Outcome(requests=requests)
    now = time.time_ns()
    for run_id in RUNS:
        for batch in registrations(run_id, now):
            code, details = await send(batch)
            if code != "OK":
                raise RuntimeError(f"the registration of {run_id} was answered {code}: {details}")
    out.rss_idle = out.rss_peak = rss()
    began = time.perf_counter()
    sent = 0
    while sent < requests:
        batches = []
        for _ in range(min(concurrency, requests - sent)):
            now = time.time_ns()
            batch = rng.choice(seeds(rng.choice(RUNS), now))
            if rng.random() < mutated:
                for _ in range(rng.randint(1, 3)):
                    mutate(batch, rng, now)
            batches.append(batch)
        sent += len(batches)
        for batch, (code, details) in zip(batches, await asyncio.gather(*map(send, batches))):
            out.codes[code] += 1
            out.longest_details = max(out.longest_details, len(details))
            if code == "UNKNOWN":
                out.unknown.append((details[:300], str(batch.WhichOneof("payload"))))
        out.rss_peak = max(out.rss_peak, rss())
    out.seconds = time.perf_counter() - began
    return out


class InProcess:
    """``Send`` through the Ingest service's ``Send`` of a collector in this process, as gRPC calls it:
    an exception it lets out is what gRPC answers UNKNOWN."""

    def __init__(self, collector: server.Collector) -> None:
        self.ingest = server.IngestService(collector)

    async def __call__(self, batch: ingest_pb2.Batch) -> tuple[str, str]:
        if batch.ByteSize() > server.MAX_MESSAGE_BYTES:
            return grpc.StatusCode.RESOURCE_EXHAUSTED.name, "larger than the message limit"  # gRPC's own answer
        call = _Call()
        try:
            await self.ingest.Send(batch, call)  # type: ignore[arg-type]
        except _Aborted as e:
            return call.code.name, str(e)
        except Exception as e:  # noqa: BLE001 - what gRPC would answer UNKNOWN
            return grpc.StatusCode.UNKNOWN.name, repr(e)
        return grpc.StatusCode.OK.name, ""

    async def close(self) -> None:
        await self.ingest.timelines.close()


class OverGrpc:
    """``Send`` over a real gRPC channel to a collector at ``address``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
        self.stub = ingest_pb2_grpc.IngestStub(self.channel)

    async def __call__(self, batch: ingest_pb2.Batch) -> tuple[str, str]:
        try:
            await self.stub.Send(batch, timeout=60)
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details() or ""
        return grpc.StatusCode.OK.name, ""

    async def close(self) -> None:
        await self.channel.close()


#: stored rows that break the ingest checks: (what, SQL counting them); every table of the fuzzed runs
VIOLATIONS: Mapping[str, str] = {
    "a rank-level row of a run no rank registered": " UNION ALL ".join(
        f"SELECT count() AS n FROM {t} WHERE run_id NOT IN (SELECT run_id FROM ranks)"
        for t in ("spans", "collectives", "heartbeats", "metrics", "step_metrics", "stacks", "exits")),
    "a row's rank outside its run's world": " UNION ALL ".join(
        f"SELECT count() AS n FROM {t} AS r WHERE toUInt32(rank) >= (SELECT max(world_size) FROM runs WHERE runs.run_id = r.run_id)"
        f" AND (run_id, toUInt32(rank)) NOT IN (SELECT run_id, rank FROM ranks)"
        for t in ("spans", "collectives", "heartbeats", "step_metrics", "exits")),
    "a span or operation that ends before it starts": "SELECT count() AS n FROM spans WHERE end_time < start_time UNION ALL"
        " SELECT count() FROM collectives WHERE end_time != toDateTime64(0, 9) AND start_time != toDateTime64(0, 9) AND end_time < start_time",
    "a time outside the accepted window": " UNION ALL ".join(
        f"SELECT count() AS n FROM {t} WHERE {c} != toDateTime64(0, 9) AND abs(dateDiff('second', {c}, now64(9))) > 2 * 86400"
        for t, c in (("spans", "start_time"), ("spans", "end_time"), ("collectives", "issue_time"), ("heartbeats", "time"),
                     ("heartbeats", "last_progress"), ("metrics", "time"), ("step_metrics", "time"), ("exits", "time"),
                     ("stacks", "time"), ("actions", "time"), ("node_states", "time"), ("ranks", "registered"))),
    "an id longer than the limit": " UNION ALL ".join(
        f"SELECT count() AS n FROM {t} WHERE length(run_id) > {MAX_ID_CHARS}"
        for t in ("runs", "ranks", "spans", "heartbeats", "metrics", "exits", "actions", "selfchecks", "node_states")),
    "a run's sizes beyond its world": "SELECT count() AS n FROM runs WHERE tp > world_size OR pp > world_size OR dp > world_size"
        " OR world_size = 0",
}  # fmt: skip


def violations(query: Callable[[str], pa.Table]) -> dict[str, int]:
    """Each check of ``VIOLATIONS`` with the rows that break it (none: nothing untrue was stored)."""
    found = {}
    for what, sql in VIOLATIONS.items():
        n = query(f"SELECT sum(n) AS n FROM ({sql})").column("n")[0].as_py() or 0
        if n:
            found[what] = int(n)
    return found

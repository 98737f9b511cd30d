"""Decode one agent ``Batch`` into Arrow tables, one per schema table it touches.

``check_envelope`` refuses a batch before anything is decoded; ``decode`` hands its payload to the
decoder of its kind: the timelines, heartbeats and reports here, registrations and ends in
``run_lifecycle`` (they change what the run registry knows of the run). Columnar payloads are
read with ``numpy.frombuffer`` and turned into Arrow arrays without one Python object per event:
that is what lets one collector take more than a million events per second on two cores. Every
column is read through ``batch_columns``, which checks it before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from rankscope.collector.batch_columns import (
    SCHEMAS, BatchContext, Columns, IngestError, Layout, TimeWindow, arrow_table, check_ranks, enum_names, row_ranks, timestamps,
)
from rankscope.collector.batch_limits import (
    MAX_ID_CHARS, MAX_IN_FLIGHT, MAX_STACK_CHARS, MAX_TEXT_CHARS, MAX_UINT16, UnregisteredRun, check_count, check_range, check_repeated, check_text, shown,
)
from rankscope.collector.run_lifecycle import decode_end, decode_ends, decode_register, decode_registers
from rankscope.collector.run_registry import RunInfo, RunRegistry
from rankscope.common.node_states import NODE_STATES
from rankscope.protos.v1 import BATCH_SCHEMA_VERSION, ingest_pb2, telemetry_pb2

BATCH_ID_BYTES = 16
#: payloads about the run as a whole (their batch's rank is 0 and says nothing about rank 0)
RUN_LEVEL = ("action", "selfcheck", "node_state")
#: payloads that register ranks
REGISTRATIONS = frozenset({"register", "registers"})


class UnsupportedSchemaVersion(Exception):
    """A batch of a wire-contract version this collector does not speak (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class Decoded:
    """What one batch becomes: its payload kind, its rows per table, and the ranks it speaks for
    (the envelope's, or those its rows name)."""

    kind: str
    parts: dict[str, pa.Table]
    ranks: tuple[int, ...] = ()


SPAN_KINDS = enum_names(telemetry_pb2.SpanKind, "SPAN_KIND_")
COLLECTIVE_STATES = enum_names(telemetry_pb2.CollectiveState, "COLLECTIVE_STATE_")

#: the ``rank`` column of rows that name their rank (see telemetry.proto)
_ROW_RANK = {"rank": "<i4"}
SPAN_LAYOUT = Layout(
    {"name": "<i4", "kind": "u1", "step": "<i4", "microbatch": "<i4", "start_ns": "<i8", "end_ns": "<i8", "attributes": "<i4"},
    {"cpu_ns": "<i8", **_ROW_RANK},
)
COLLECTIVE_LAYOUT = Layout(
    {
        "group": "<i4", "seq": "<i8", "op": "<i4", "nbytes": "<i8", "dtype": "<i4", "peer": "<i4", "issue_ns": "<i8",
        "start_ns": "<i8", "end_ns": "<i8", "state": "u1", "step": "<i4",
    },
    _ROW_RANK,
)
METRIC_LAYOUT = Layout({"time_ns": "<i8", "name": "<i4", "device": "<i4", "value": "<f8"})
STEP_METRIC_LAYOUT = Layout({"step": "<i4", "name": "<i4", "value": "<f8", "time_ns": "<i8"}, _ROW_RANK)


def _spans(ctx: BatchContext, msg: telemetry_pb2.SpanBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    c = Columns(ctx, msg, SPAN_LAYOUT)
    who = c.run_rank()
    start, end = c.times("start_ns"), c.times("end_ns")
    c.ordered("start_ns", "end_ns", start, end)
    return {
        "spans": arrow_table(
            "spans",
            {
                **who, "step": c.unsigned("step"), "name": c.strings_at("name"),
                "kind": c.enum("kind", SPAN_KINDS), "start_time": timestamps(start), "end_time": timestamps(end),
                "microbatch": c.at_least("microbatch", -1),
                "attributes": c.strings_at("attributes", none_allowed=True, limit=MAX_TEXT_CHARS),
                "cpu_ns": c.at_least("cpu_ns", -1, c.optional("cpu_ns", missing=-1)),
            },
            ctx.attempts,
        )
    }


def _collectives(ctx: BatchContext, msg: telemetry_pb2.CollectiveBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    c = Columns(ctx, msg, COLLECTIVE_LAYOUT)
    who = c.run_rank()
    issue, start, end = c.times("issue_ns"), c.times("start_ns", zero_is_unknown=True), c.times("end_ns", zero_is_unknown=True)
    c.ordered("start_ns", "end_ns", start, end)
    c.ordered("issue_ns", "end_ns", issue, end)
    peers = c.array("peer")
    check_ranks(ctx.run, peers[peers != -1], c.where("peer"))
    return {
        "collectives": arrow_table(
            "collectives",
            {
                **who, "group_name": c.strings_at("group"), "seq": c.unsigned("seq"),
                "op": c.strings_at("op"), "nbytes": c.unsigned("nbytes"), "dtype": c.strings_at("dtype"),
                "peer": peers, "issue_time": timestamps(issue), "start_time": timestamps(start), "end_time": timestamps(end),
                "state": c.enum("state", COLLECTIVE_STATES), "step": c.unsigned("step"),
            },
            ctx.attempts,
        )
    }


#: bytes a heartbeat takes on the wire at least: its time in the window is a 9-byte varint and a tag
_HEARTBEAT_BYTES = 10


#: heartbeats in columns (HeartbeatColumns) and their operations in flight (InFlightColumns)
HEARTBEAT_LAYOUT = Layout(
    {"time_ns": "<i8", "step": "<i4", "phase": "<i4", "status": "<i4", "last_progress_ns": "<i8", "events_dropped": "<i8", "in_flight": "<i4"},
    _ROW_RANK,
)
IN_FLIGHT_LAYOUT = Layout({"group": "<i4", "seq": "<i8", "op": "<i4", "peer": "<i4", "issue_ns": "<i8", "waiting": "u1"})


def _heartbeats(ctx: BatchContext, msg: telemetry_pb2.HeartbeatBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    if msg.HasField("columns"):
        if msg.heartbeats or msg.ranks:
            raise IngestError("heartbeats: both rows and columns: a batch carries its heartbeats one way", "count")
        return _heartbeat_columns(ctx, msg.columns)
    # One pass over the messages, each field read once, the checks on whole columns: at 100,000
    # ranks 10,000 heartbeats a second arrive, and this runs on the collector's event loop.
    beats = msg.heartbeats
    n = len(beats)
    check_repeated("heartbeats.heartbeats", beats)
    check_count("heartbeats", n, _HEARTBEAT_BYTES, msg.ByteSize())
    fields = [(hb.time_ns, hb.step, hb.phase, hb.status, hb.last_progress_ns, hb.events_dropped, hb.in_flight) for hb in beats]
    time_ns, step, phase, status, progress, dropped, flights = zip(*fields) if n else ((),) * 7
    steps = np.array(step, dtype=np.int64)
    if n and steps.min() < 0:
        i = int(np.argmax(steps < 0))
        raise IngestError(f"heartbeats[{i}].step is {steps[i]}: steps are numbered from 1 (0 outside any step)", "range")
    times = ctx.shift("heartbeats.time_ns", np.array(time_ns, dtype=np.int64))
    last = np.array(progress, dtype=np.int64)
    ctx.shift("heartbeats.last_progress_ns", last[last != 0])
    last = np.where(last != 0, last + np.int64(ctx.offset), 0)
    for what, texts in (("phase", phase), ("status", status)):
        check_text(f"heartbeats.{what}", max(texts, key=len, default=""))
    check_repeated("heartbeats.in_flight", max(flights, key=len, default=()), MAX_IN_FLIGHT)
    ops = [(op.group, op.seq, op.op, op.peer, op.issue_ns, int(op.waiting)) for f in flights if f for op in f]
    in_flight = list(zip(*ops)) if ops else [()] * len(_IN_FLIGHT_COLUMNS)
    if ops:
        in_flight[4] = ctx.shift("heartbeats.in_flight.issue_ns", np.array(in_flight[4], dtype=np.int64))
        peers = np.array(in_flight[3], dtype=np.int64)
        check_ranks(ctx.run, peers[peers != -1], "heartbeats.in_flight.peer")
        for what, texts in (("group", in_flight[0]), ("op", in_flight[2])):
            check_text(f"heartbeats.in_flight.{what}", max(texts, key=len))
    offsets = pa.array(np.concatenate([[0], np.cumsum([len(f) for f in flights], dtype=np.int64)]).astype(np.int32))
    if msg.ranks:
        if len(msg.ranks) != n:
            raise IngestError(f"heartbeats.ranks: {len(msg.ranks)} ranks for {n} heartbeats: name one rank per heartbeat, or none", "count")
        ranks = row_ranks(ctx, np.array(msg.ranks, dtype=np.int64), "heartbeats.ranks").tolist()
    else:
        ranks = [ctx.rank] * n
    hosts = ctx.run.hosts
    return {
        "heartbeats": arrow_table(
            "heartbeats",
            {
                "run_id": [ctx.run_id] * n, "rank": ranks, "host": [hosts.get(r, "") for r in ranks],
                "time": timestamps(times), "step": steps.astype(np.uint32), "phase": list(phase), "status": list(status),
                "last_progress": timestamps(last), "events_dropped": list(dropped),
                **{name: _lists(name, offsets, values) for name, values in zip(_IN_FLIGHT_COLUMNS, in_flight)},
            },
            ctx.attempts,
        )
    }


def _heartbeat_columns(ctx: BatchContext, msg: telemetry_pb2.HeartbeatColumns) -> dict[str, pa.Table]:
    """The same rows as ``_heartbeats``, from columns: no Python object per heartbeat."""
    c = Columns(ctx, msg, HEARTBEAT_LAYOUT)
    who = c.run_rank()
    counts = c.at_least("in_flight", 0)
    if counts.size and counts.max() > MAX_IN_FLIGHT:
        raise IngestError(f"{c.where('in_flight')}: {counts.max()} operations in flight, more than the {MAX_IN_FLIGHT} allowed", "count")
    ops = Columns(ctx, msg.ops, IN_FLIGHT_LAYOUT)
    if int(counts.sum()) != ops.count:
        raise IngestError(f"{c.where('in_flight')}: the heartbeats name {int(counts.sum())} operations in flight, ops holds {ops.count}", "count")
    peers = ops.at_least("peer", -1)
    check_ranks(ctx.run, peers[peers != -1], ops.where("ops.peer"))
    waiting = ops.array("waiting")
    if waiting.size and waiting.max() > 1:
        raise IngestError(f"{ops.where('ops.waiting')}: value {waiting.max()} where only 0 and 1 are valid", "range")
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int32))
    in_flight = (ops.strings_at("group"), ops.array("seq"), ops.strings_at("op"), peers, timestamps(ops.times("issue_ns")), waiting)
    hosts = ctx.run.hosts
    return {
        "heartbeats": arrow_table(
            "heartbeats",
            {
                **who, "host": [hosts.get(r, "") for r in who["rank"].tolist()],  # type: ignore[attr-defined]
                "time": timestamps(c.times("time_ns")), "step": c.unsigned("step"),
                "phase": c.strings_at("phase"), "status": c.strings_at("status"),
                "last_progress": timestamps(c.times("last_progress_ns", zero_is_unknown=True)),
                "events_dropped": c.unsigned("events_dropped"),
                **{name: _lists(name, offsets, values) for name, values in zip(_IN_FLIGHT_COLUMNS, in_flight)},
            },
            ctx.attempts,
        )
    }


#: a heartbeat's operations in flight, a list column each (the order of the tuples ``_heartbeats`` builds)
_IN_FLIGHT_COLUMNS = ("inflight_group", "inflight_seq", "inflight_op", "inflight_peer", "inflight_issue", "inflight_waiting")


def _lists(column: str, offsets: pa.Array, values: Sequence[object] | np.ndarray | pa.Array) -> pa.ListArray:
    """Heartbeats' list column ``column`` from all their values in a row and where each heartbeat's begin."""
    type_ = SCHEMAS["heartbeats"].field(column).type
    flat = values.cast(type_.value_type) if isinstance(values, pa.Array) else pa.array(values, type=type_.value_type)
    return pa.ListArray.from_arrays(offsets, flat, type=type_)


def _metrics(ctx: BatchContext, msg: telemetry_pb2.MetricBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    c = Columns(ctx, msg, METRIC_LAYOUT)
    device, times, name = c.strings_at("device"), timestamps(c.times("time_ns")), c.strings_at("name")
    return {
        "metrics": arrow_table(
            "metrics",
            {
                "run_id": pa.repeat(pa.scalar(ctx.run_id), c.count), "rank": np.full(c.count, ctx.rank, dtype=np.int32),
                "host": pa.repeat(pa.scalar(registry.host(ctx.run_id, ctx.rank)), c.count),
                "device": device, "time": times, "name": name, "value": c.array("value"),
            },
            ctx.attempt,
        )
    }


def _step_metrics(ctx: BatchContext, msg: telemetry_pb2.StepMetricBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    c = Columns(ctx, msg, STEP_METRIC_LAYOUT)
    who = c.run_rank()
    return {
        "step_metrics": arrow_table(
            "step_metrics",
            {
                **who, "step": c.unsigned("step"), "name": c.strings_at("name"),
                "value": c.array("value"), "time": timestamps(c.times("time_ns")),
            },
            ctx.attempts,
        )
    }


def _stack(ctx: BatchContext, msg: telemetry_pb2.StackDump, registry: RunRegistry) -> dict[str, pa.Table]:
    check_text("stack.reason", msg.reason)
    check_text("stack.method", msg.method)
    check_text("stack.text", msg.text, MAX_STACK_CHARS)
    return {
        "stacks": arrow_table(
            "stacks",
            {
                "run_id": [ctx.run_id], "rank": [ctx.rank], "host": [registry.host(ctx.run_id, ctx.rank)],
                "time": [ctx.time("stack.time_ns", msg.time_ns)], "reason": [msg.reason], "method": [msg.method],
                "text": [msg.text],
            },
            ctx.attempt,
        )
    }


def _action(ctx: BatchContext, msg: telemetry_pb2.Action, registry: RunRegistry) -> dict[str, pa.Table]:
    if not msg.action:
        raise IngestError("action.action is empty: say what was decided or done")
    for what, text, limit in (("action", msg.action, MAX_ID_CHARS), ("incident_id", msg.incident_id, MAX_ID_CHARS),
                              ("reason", msg.reason, MAX_TEXT_CHARS), ("evidence_json", msg.evidence_json, MAX_TEXT_CHARS)):
        check_text(f"action.{what}", text, limit)
    check_repeated("action.hosts", msg.hosts)
    check_text("action.hosts", max(msg.hosts, key=len, default=""))
    return {
        "actions": arrow_table(
            "actions",
            {
                "run_id": [ctx.run_id], "time": [ctx.time("action.time_ns", msg.time_ns)], "action": [msg.action],
                "hosts": [list(msg.hosts)], "incident_id": [msg.incident_id], "reason": [msg.reason],
                "evidence": [msg.evidence_json],
            },
            ctx.attempt,
        )
    }


def _selfcheck(ctx: BatchContext, msg: telemetry_pb2.SelfCheck, registry: RunRegistry) -> dict[str, pa.Table]:
    if not msg.host:
        raise IngestError("selfcheck.host is empty: a self-check names the host it checked")
    check_text("selfcheck.host", msg.host)
    check_text("selfcheck.summary", msg.summary, MAX_TEXT_CHARS)
    check_repeated("selfcheck.figures", msg.figures)
    for i, f in enumerate(msg.figures):
        for what, text, limit in (("check", f.check, MAX_ID_CHARS), ("unit", f.unit, MAX_ID_CHARS), ("detail", f.detail, MAX_TEXT_CHARS)):
            check_text(f"selfcheck.figures[{i}].{what}", text, limit)
    n = len(msg.figures)
    return {
        "selfchecks": arrow_table(
            "selfchecks",
            {
                "run_id": [ctx.run_id] * n, "host": [msg.host] * n, "time": [ctx.time("selfcheck.time_ns", msg.time_ns)] * n,
                "check": [f.check for f in msg.figures], "value": [f.value for f in msg.figures],
                "unit": [f.unit for f in msg.figures], "reference": [f.reference for f in msg.figures],
                "passed": [int(f.passed) for f in msg.figures], "host_passed": [int(msg.passed)] * n,
                "summary": [msg.summary] * n, "detail": [f.detail for f in msg.figures],
            },
        )
    }


def _node_state(ctx: BatchContext, msg: telemetry_pb2.NodeState, registry: RunRegistry) -> dict[str, pa.Table]:
    if not msg.host:
        raise IngestError("node_state.host is empty: a node's state names the node")
    if msg.state not in NODE_STATES:
        raise IngestError(f"node_state.state is {shown(msg.state)}: one of {', '.join(NODE_STATES)}")
    for what, text, limit in (("host", msg.host, MAX_ID_CHARS), ("incident_id", msg.incident_id, MAX_ID_CHARS),
                              ("actor", msg.actor, MAX_ID_CHARS), ("reason", msg.reason, MAX_TEXT_CHARS)):
        check_text(f"node_state.{what}", text, limit)
    return {
        "node_states": arrow_table(
            "node_states",
            {
                "run_id": [ctx.run_id], "host": [msg.host], "time": [ctx.time("node_state.time_ns", msg.time_ns)], "state": [msg.state],
                "incident_id": [msg.incident_id], "reason": [msg.reason], "actor": [msg.actor],
            },
        )
    }


# Payload field of Batch -> builder(context, payload message, registry) -> tables.
_PAYLOADS: dict[str, Callable[[BatchContext, Any, RunRegistry], dict[str, pa.Table]]] = {
    "register": decode_register,
    "registers": decode_registers,
    "spans": _spans,
    "collectives": _collectives,
    "heartbeats": _heartbeats,
    "metrics": _metrics,
    "step_metrics": _step_metrics,
    "stack": _stack,
    "end": decode_end,
    "ends": decode_ends,
    "action": _action,
    "selfcheck": _selfcheck,
    "node_state": _node_state,
}


def check_envelope(batch: ingest_pb2.Batch) -> str:
    """The payload kind of ``batch`` after checking its envelope; raises before any decoding."""
    if batch.schema_version != BATCH_SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(
            f"schema_version {batch.schema_version} is not supported by this collector (it speaks"
            f" {BATCH_SCHEMA_VERSION}): upgrade the collector or run a matching agent"
        )
    if not batch.run_id:
        raise IngestError("run_id is empty: every batch names its run")
    check_text("run_id", batch.run_id)
    if batch.rank < 0:
        raise IngestError(f"rank is {batch.rank}: ranks are >= 0", "rank")
    if len(batch.batch_id) != BATCH_ID_BYTES:
        raise IngestError(f"batch_id has {len(batch.batch_id)} bytes: it must have {BATCH_ID_BYTES}", "length")
    check_range("attempt", batch.attempt, 0, MAX_UINT16)
    kind = batch.WhichOneof("payload")
    if kind is None:
        raise IngestError(
            "the batch carries no payload (empty, or a payload type this collector does not know):"
            f" expected one of {', '.join(_PAYLOADS)}"
        )
    return kind


def decode(batch: ingest_pb2.Batch, registry: RunRegistry, now_ns: int, window: TimeWindow = TimeWindow()) -> Decoded:
    """The Arrow tables of ``batch``; raises IngestError or UnsupportedSchemaVersion.

    ``now_ns`` is the collector's clock when the batch arrived: it anchors the time window and
    stamps the versions of replaced rows (runs, ranks, groups).
    """
    kind = check_envelope(batch)
    ctx = BatchContext(batch, now_ns, window, kind)
    if batch.sent_ns:
        ctx.time("sent_ns", batch.sent_ns)
    run = registry.known(batch.run_id)
    if kind in REGISTRATIONS:
        ctx.attempt = (run or RunInfo()).attempt_of(batch)
    elif kind not in RUN_LEVEL:
        if run is None or not run.world_size:
            raise UnregisteredRun(batch.run_id)
        check_ranks(run, np.array([batch.rank]), "rank")
        ctx.run = run
        ctx.attempt = run.attempt_of(batch)
        ctx.after_start(run.start_ns, window)
        ctx.before_end(run.end_ns, window)
    parts = _PAYLOADS[kind](ctx, getattr(batch, kind), registry)
    if kind not in REGISTRATIONS and kind not in RUN_LEVEL and not ctx.ranks and ctx.run.unregistered_sender(batch):
        raise UnregisteredRun(batch.run_id, batch.rank)  # rows of the envelope's rank (rows that name theirs: ``row_ranks``)
    if kind in REGISTRATIONS:  # accepted: its world keeps the number it was given
        registry.run(batch.run_id).note_world(batch, ctx.attempt)
    return Decoded(kind, parts, ctx.ranks or (() if kind in RUN_LEVEL else (batch.rank,)))

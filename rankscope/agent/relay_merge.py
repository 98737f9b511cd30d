"""Several ranks' payloads of one kind as one payload whose rows name their rank (telemetry.proto).

A relay (``node_relay.py``) takes its host's ranks' batches as they come and sends the collector one
batch per kind and flush instead: the collector pays about a millisecond per call whatever its
size. Columns are concatenated, the string tables united (each index moved to the united table),
and every row gets its rank in the ``rank`` column. Heartbeats become columns (``heartbeat_columns``).
Registrations and ends sent several ranks to a batch (``registers``, ``ends``: each entry names its
rank) are merged too, a world's to a batch: a host of 8 ranks sent one by one is 8 calls, but a
sender that speaks for thousands of ranks (the simulator's worker) would make the relay's
Transport, a call in flight per batch, pass on thousands of them before its ranks' first rows.
Kinds whose rows cannot name their rank (one rank's ``register`` or ``end``, stacks, metrics,
run-level records) are not merged: the relay forwards them one by one.

``select`` is the way back, for the collector: the rows of some of a merged payload's parts, when
the others were stored before (a rank sent them again itself after its relay died).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from google.protobuf.message import Message

from rankscope.agent.heartbeat_columns import to_columns
from rankscope.protos.v1 import telemetry_pb2 as pb

__all__ = ["MERGED", "merge", "rows", "select", "world"]

#: (dtype, string index: -1 allowed for "none" or not, value of an absent optional column)
_Column = tuple[str, bool | None, int | None]
_STR, _STR_OR_NONE, _NUM = True, None, False

#: kind -> its columns (telemetry.proto): what the collector's decode.py reads back
_LAYOUTS: dict[str, Mapping[str, _Column]] = {
    "spans": {
        "name": ("<i4", _STR, None), "kind": ("u1", _NUM, None), "step": ("<i4", _NUM, None), "microbatch": ("<i4", _NUM, None),
        "start_ns": ("<i8", _NUM, None), "end_ns": ("<i8", _NUM, None), "attributes": ("<i4", _STR_OR_NONE, None),
        "cpu_ns": ("<i8", _NUM, -1),
    },
    "collectives": {
        "group": ("<i4", _STR, None), "seq": ("<i8", _NUM, None), "op": ("<i4", _STR, None), "nbytes": ("<i8", _NUM, None),
        "dtype": ("<i4", _STR, None), "peer": ("<i4", _NUM, None), "issue_ns": ("<i8", _NUM, None), "start_ns": ("<i8", _NUM, None),
        "end_ns": ("<i8", _NUM, None), "state": ("u1", _NUM, None), "step": ("<i4", _NUM, None),
    },
    "step_metrics": {"step": ("<i4", _NUM, None), "name": ("<i4", _STR, None), "value": ("<f8", _NUM, None), "time_ns": ("<i8", _NUM, None)},
    "heartbeats": {
        "time_ns": ("<i8", _NUM, None), "step": ("<i4", _NUM, None), "phase": ("<i4", _STR, None), "status": ("<i4", _STR, None),
        "last_progress_ns": ("<i8", _NUM, None), "events_dropped": ("<i8", _NUM, None), "in_flight": ("<i4", _NUM, None),
    },
}  # fmt: skip
_IN_FLIGHT: Mapping[str, _Column] = {
    "group": ("<i4", _STR, None), "seq": ("<i8", _NUM, None), "op": ("<i4", _STR, None), "peer": ("<i4", _NUM, None),
    "issue_ns": ("<i8", _NUM, None), "waiting": ("u1", _NUM, None),
}  # fmt: skip
#: kinds of several ranks' entries (in the field named after the kind), each entry's rank in ``ranks`` beside it
_LISTED: dict[str, type[Message]] = {"registers": pb.RegisterBatch, "ends": pb.EndBatch}
#: the payload kinds a relay merges
MERGED = frozenset(_LAYOUTS) | frozenset(_LISTED)


def rows(kind: str, payload: Message) -> int:
    """The rows (entries, heartbeats) of a payload of a merged ``kind``: what a part's count counts."""
    if kind in _LISTED:
        return len(getattr(payload, kind))
    if kind == "heartbeats":  # a rank's own come as a list (agent.heartbeat), a relay's as columns
        return payload.columns.count if payload.HasField("columns") else len(payload.heartbeats)  # type: ignore[attr-defined, no-any-return]
    return payload.count  # type: ignore[attr-defined, no-any-return]


def world(kind: str, payload: Message) -> str:
    """The world a payload's registrations join (the collector takes one world's to a batch); "" for other kinds."""
    return payload.registers[0].world if kind == "registers" and payload.registers else ""  # type: ignore[attr-defined, no-any-return]


def merge(kind: str, parts: Sequence[tuple[int, Message]]) -> Message:
    """One payload of ``kind`` from ``(rank, payload)`` pairs, in order; rows keep their own rank
    where they name one, else take the rank of the batch they came in."""
    if kind in _LISTED:
        return _merge_listed(kind, parts)
    if kind == "heartbeats":
        beats = [(rank, p.columns if p.HasField("columns") else to_columns(p.heartbeats, p.ranks or [rank] * len(p.heartbeats)).columns)
                 for rank, p in parts]  # type: ignore[attr-defined]  # fmt: skip
        if any(np.frombuffer(c.in_flight, dtype="<i4").sum() != c.ops.count for _, c in beats):
            raise ValueError("in_flight: the heartbeats name another number of operations than ops holds")
        merged = _merge(pb.HeartbeatColumns, _LAYOUTS[kind], beats, with_rank=True)
        merged.ops.CopyFrom(_merge(pb.InFlightColumns, _IN_FLIGHT, [(rank, c.ops) for rank, c in beats], with_rank=False))
        return pb.HeartbeatBatch(columns=merged)
    type_ = {"spans": pb.SpanBatch, "collectives": pb.CollectiveBatch, "step_metrics": pb.StepMetricBatch}[kind]
    return _merge(type_, _LAYOUTS[kind], parts, with_rank=True)


def _merge_listed(kind: str, parts: Sequence[tuple[int, Message]]) -> Message:
    out = _LISTED[kind]()
    for _, part in parts:
        entries, ranks = getattr(part, kind), part.ranks  # type: ignore[attr-defined]
        if len(entries) != len(ranks):
            raise ValueError(f"{kind}: {len(ranks)} ranks for {len(entries)} entries")
        getattr(out, kind).extend(entries)
        out.ranks.extend(ranks)  # type: ignore[attr-defined]
    return out


def _merge(type_: type[Message], layout: Mapping[str, _Column], parts: Sequence[tuple[int, Message]], *, with_rank: bool) -> Message:
    strings: dict[str, int] = {}
    columns: dict[str, list[np.ndarray]] = {name: [] for name in layout}
    ranks: list[np.ndarray] = []
    for rank, part in parts:
        count = part.count  # type: ignore[attr-defined]
        moved = np.array([strings.setdefault(s, len(strings)) for s in part.strings] + [-1], dtype="<i4")  # type: ignore[attr-defined]
        for name, (dtype, text, missing) in layout.items():
            raw = getattr(part, name)
            if len(raw) % np.dtype(dtype).itemsize:
                raise ValueError(f"{name}: {len(raw)} bytes, not whole {dtype} values")
            values = np.frombuffer(raw, dtype=dtype) if raw or missing is None else np.full(count, missing, dtype=dtype)
            if len(values) != count:
                raise ValueError(f"{name}: {len(values)} values for count={count}")
            if text is not False and values.size and (values.min() < -1 or values.max() >= len(moved) - 1):
                raise ValueError(f"{name}: a string index outside the batch's {len(moved) - 1} strings")
            columns[name].append(moved[values] if text is not False else values)  # -1 ("none") takes the last entry: -1
        if with_rank:
            own = getattr(part, "rank")
            if own and len(own) != 4 * count:
                raise ValueError(f"rank: {len(own)} bytes for count={count}")
            ranks.append(np.frombuffer(own, dtype="<i4") if own else np.full(count, rank, dtype="<i4"))
    out = type_(count=sum(p.count for _, p in parts), strings=list(strings))  # type: ignore[attr-defined, call-arg]
    for name, (dtype, _, _) in layout.items():
        setattr(out, name, np.concatenate(columns[name]).astype(dtype).tobytes() if columns[name] else b"")
    if with_rank:
        out.rank = np.concatenate(ranks).astype("<i4").tobytes() if ranks else b""  # type: ignore[attr-defined]
    return out


def select(kind: str, payload: Message, counts: Sequence[int], keep: Sequence[bool]) -> Message:
    """The rows of the parts of a merged ``payload`` that ``keep`` names; part i holds the
    ``counts[i]`` rows after part i-1's. The string table is kept whole (indices stay true)."""
    total = rows(kind, payload)
    if len(counts) != len(keep) or sum(counts) != total:
        raise ValueError(f"parts: {sum(counts)} rows in {len(counts)} parts for a payload of {total}")
    kept_rows = np.repeat(np.asarray(keep, dtype=bool), np.asarray(counts, dtype=np.int64))
    if kind in _LISTED:
        out = _LISTED[kind]()
        getattr(out, kind).extend(e for e, k in zip(getattr(payload, kind), kept_rows) if k)
        out.ranks.extend(np.asarray(payload.ranks, dtype=np.int64)[kept_rows].tolist())  # type: ignore[attr-defined]
        return out
    if kind != "heartbeats":
        return _select(payload, _LAYOUTS[kind], kept_rows, with_rank=True)
    columns = payload.columns  # type: ignore[attr-defined]
    ops = np.repeat(kept_rows, np.frombuffer(columns.in_flight, dtype="<i4"))
    kept = _select(columns, _LAYOUTS[kind], kept_rows, with_rank=True)
    kept.ops.CopyFrom(_select(columns.ops, _IN_FLIGHT, ops, with_rank=False))
    return pb.HeartbeatBatch(columns=kept)


def _select(part: Message, layout: Mapping[str, _Column], rows: np.ndarray, *, with_rank: bool) -> Message:
    out = type(part)(count=int(rows.sum()), strings=list(part.strings))  # type: ignore[attr-defined, call-arg]
    for name, (dtype, _, _) in [*layout.items(), *([("rank", ("<i4", False, None))] if with_rank else [])]:
        raw = getattr(part, name)
        setattr(out, name, np.frombuffer(raw, dtype=dtype)[rows].tobytes() if raw else b"")
    return out

"""Heartbeats of several ranks as one ``HeartbeatColumns`` (telemetry.proto), the way spans travel.

A heartbeat as a message costs the collector a Python object per field to read, and at 100,000
ranks 10,000 arrive a second; as columns it reads them with numpy. The sender that speaks for many
ranks (a host's relay, the scale simulator) builds the columns once here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rankscope.protos.v1 import telemetry_pb2 as pb

__all__ = ["to_columns"]


class _Strings:
    """A batch's string table: each distinct string once, in order of first use."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        return self.index.setdefault(text, len(self.index))


def to_columns(beats: Sequence[pb.Heartbeat], ranks: Sequence[int]) -> pb.HeartbeatBatch:
    """``beats[i]`` of rank ``ranks[i]``, as one batch of columns."""
    if len(beats) != len(ranks):
        raise ValueError(f"{len(beats)} heartbeats for {len(ranks)} ranks")
    beat_strings, op_strings = _Strings(), _Strings()
    ops = [op for hb in beats for op in hb.in_flight]
    columns = pb.HeartbeatColumns(
        count=len(beats),
        time_ns=_packed([hb.time_ns for hb in beats], "<i8"),
        step=_packed([hb.step for hb in beats], "<i4"),
        phase=_packed([beat_strings(hb.phase) for hb in beats], "<i4"),
        status=_packed([beat_strings(hb.status) for hb in beats], "<i4"),
        last_progress_ns=_packed([hb.last_progress_ns for hb in beats], "<i8"),
        events_dropped=_packed([hb.events_dropped for hb in beats], "<i8"),
        in_flight=_packed([len(hb.in_flight) for hb in beats], "<i4"),
        rank=_packed(ranks, "<i4"),
        ops=pb.InFlightColumns(
            count=len(ops),
            group=_packed([op_strings(op.group) for op in ops], "<i4"),
            seq=_packed([op.seq for op in ops], "<i8"),
            op=_packed([op_strings(op.op) for op in ops], "<i4"),
            peer=_packed([op.peer for op in ops], "<i4"),
            issue_ns=_packed([op.issue_ns for op in ops], "<i8"),
            waiting=_packed([op.waiting for op in ops], "u1"),
            strings=list(op_strings.index),
        ),
        strings=list(beat_strings.index),
    )
    return pb.HeartbeatBatch(columns=columns)


def _packed(values: Sequence[int], dtype: str) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()

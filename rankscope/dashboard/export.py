"""A window of a run as a Chrome trace (JSON) that ui.perfetto.dev and chrome://tracing open.

One process per rank ("rank 5 (node-2)"), one track per stream: the rank's own segments
(compute, data, optimizer, user), its communication spans, and one track per process group for
its collectives and transfers. Slices on one track must nest strictly, so a stream whose slices
overlap without nesting (asynchronous collectives of one group in flight together) is spread
over as many tracks as it needs ("dp[0] (2)"). Flow arrows join the members of each collective
(same group and sequence number): from the member that arrived last, the one the others waited
for, to each of the others; and each send to its receive.

Times are microseconds from the earliest slice (``otherData.origin_ns`` gives it in ns since the
epoch: a span that began before the window still starts at 0 or later), so the floats keep
sub-microsecond precision.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pandas as pd

from rankscope.dashboard.figures import family

OWN_KINDS = ("compute", "data", "optimizer", "user")


def chrome_trace(spans: pd.DataFrame, ops: pd.DataFrame, who: pd.DataFrame, run_id: str, start_ns: int, end_ns: int) -> dict[str, Any]:
    """The trace as a JSON-ready dict; the frames as ``data.spans`` / ``data.operations`` / ``data.ranks`` return them."""
    origin = min([start_ns] + [int(frame[column].min()) for frame, column in ((spans, "start_ns"), (ops, "issue_ns")) if len(frame)])

    def us(ns: int) -> float:
        return round((int(ns) - origin) / 1e3, 3)

    events: list[dict[str, Any]] = []
    tracks = _Tracks(events)
    for rank, host in zip(who["rank"], who["host"]):
        events.append({"ph": "M", "name": "process_name", "pid": int(rank), "args": {"name": f"rank {rank} ({host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": int(rank), "args": {"sort_index": int(rank)}})
    for row in spans.sort_values("start_ns").itertuples(index=False):
        stream = "segments" if row.kind in OWN_KINDS else "communication"
        start, end = int(row.start_ns), int(row.end_ns)
        tid = tracks.place(int(row.rank), stream, start, end)
        events.append({"ph": "X", "name": row.name, "cat": row.kind, "pid": int(row.rank), "tid": tid, "ts": us(start),
                       "dur": round((end - start) / 1e3, 3), "args": {"step": int(row.step), "microbatch": int(row.microbatch)}})  # fmt: skip
    # one collective: its group and sequence number within one attempt (a restart numbers them anew)
    placed: dict[tuple[int, str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in ops.sort_values("issue_ns").itertuples(index=False):
        start = int(row.issue_ns)
        end = int(row.end_ns) if row.end_ns > 0 else max(end_ns, start + 1)
        tid = tracks.place(int(row.rank), row.group_name, start, end)
        events.append({"ph": "X", "name": f"{row.op} {row.group_name} #{row.seq}", "cat": family(row.group_name), "pid": int(row.rank),
                       "tid": tid, "ts": us(start), "dur": round((end - start) / 1e3, 3),
                       "args": {"group": row.group_name, "seq": int(row.seq), "op": row.op, "peer": int(row.peer), "bytes": int(row.nbytes),
                                "state": row.state, "step": int(row.step)}})  # fmt: skip
        placed[(int(getattr(row, "attempt", 0)), row.group_name, int(row.seq))].append(
            {"rank": int(row.rank), "peer": int(row.peer), "op": row.op, "tid": tid, "start": start, "end": end})  # fmt: skip
    flow = 0
    for (_, group, seq), members in placed.items():
        for source, target in _arrows(members):
            flow += 1
            # A flow end binds to the slice around its timestamp on its track: put each end inside its slice.
            at_source = min(max(source["start"], target["start"]), source["end"])
            at_target = min(max(at_source, target["start"]), target["end"])
            common = {"name": f"{group} #{seq}", "cat": "p2p" if source["peer"] >= 0 else "collective", "id": flow}
            events.append({**common, "ph": "s", "pid": source["rank"], "tid": source["tid"], "ts": us(at_source)})
            events.append({**common, "ph": "f", "bp": "e", "pid": target["rank"], "tid": target["tid"], "ts": us(at_target)})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run_id": run_id, "origin_ns": str(origin), "window_start_ns": str(start_ns), "window_end_ns": str(end_ns),
                      "producer": "rankscope dashboard"},
    }


def _arrows(members: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(from, to) pairs: send -> receive for a transfer, last arrival -> every other member for a collective."""
    if members[0]["peer"] >= 0:
        sends = [m for m in members if "send" in m["op"].lower()]
        recvs = {(m["rank"], m["peer"]): m for m in members if "send" not in m["op"].lower()}
        return [(s, recvs[(s["peer"], s["rank"])]) for s in sends if (s["peer"], s["rank"]) in recvs]
    if len(members) < 2:
        return []
    last = max(members, key=lambda m: m["start"])
    return [(last, m) for m in members if m is not last]


class _Tracks:
    """Thread ids per (rank, stream), adding a track wherever slices would overlap without nesting."""

    def __init__(self, events: list[dict[str, Any]]):
        self._events = events
        self._ends: dict[tuple[int, str], list[int]] = {}  # the last end on each track of a stream
        self._tids: dict[tuple[int, str, int], int] = {}
        self._count: dict[int, int] = defaultdict(int)

    def place(self, rank: int, stream: str, start: int, end: int) -> int:
        """The tid of the first track of ``stream`` free at ``start`` (slices arrive in start order)."""
        ends = self._ends.setdefault((rank, stream), [])
        for k, last_end in enumerate(ends):
            if last_end <= start:
                ends[k] = end
                return self._tids[(rank, stream, k)]
        ends.append(end)
        return self._new(rank, stream, len(ends) - 1)

    def _new(self, rank: int, stream: str, k: int) -> int:
        self._count[rank] += 1
        tid = self._tids[(rank, stream, k)] = self._count[rank]
        name = stream if k == 0 else f"{stream} ({k + 1})"
        self._events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
        self._events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
        return tid


def to_json(trace: dict[str, Any]) -> bytes:
    """The bytes of the file a person downloads (compact: traces of thousands of slices get big)."""
    return json.dumps(trace, separators=(",", ":")).encode()

"""A simulated job's rows written straight into a store: for the tests and the benchmark of the anatomy.

The timelines are the scale simulator's (``collector/simulate``): per-stage forward and backward
compute with noise, tensor-parallel all-reduces after every chunk, the 1F1B pipeline with its
point-to-point transfers, the data-parallel all-reduce, the optimizer, with injected stragglers;
every step at full detail (every span and every collective, as a real agent records them). Its
``Step`` objects come back, so a test knows the truth: how long each step took, and how long it
would have taken without the straggler (the same seed, no factor).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rankscope.collector.simulate.model import Step, StepModel, Timing
from rankscope.collector.simulate.rows import OP_NAMES, SPAN_KINDS, SPAN_NAMES, Slice
from rankscope.collector.simulate.topology import Topology
from rankscope.collector.store.base import Store, arrow_schema
from rankscope.collector.store.schema import BY_NAME

T0 = 1_767_225_600_000_000_000  # 2026-01-01 UTC, ns
KIND_NAMES = ("compute", "comm", "data", "optimizer")  # telemetry.proto's SpanKind order (SPAN_KINDS' values)
#: index of the first op name in a simulated rank's string table (its three groups come first)
FIRST_OP = 3


def model(topo: Topology, *, microbatches: int = 4, step_time_s: float = 1.0, seed: int = 0,
          stragglers: Sequence[tuple[int, int, float]] = (), noise: float = 0.02) -> StepModel:  # fmt: skip
    """The simulator's step model; ``stragglers``: (rank, from_step, factor)."""
    return StepModel(topo, Timing.for_step(step_time_s, topo.pp, microbatches, noise), microbatches, seed, list(stragglers))


def write_run(
    store: Store,
    topo: Topology,
    step_model: StepModel,
    steps: range,
    *,
    run_id: str,
    start_ns: int = T0,
    attempt: int = 0,
    steps_per_insert: int = 8,
    table_prefix: str = "",
) -> list[Step]:
    """Write the run's topology (once, for attempt 0) and ``steps`` of timelines; returns the steps.

    Steps follow each other without a gap (the simulator's steps are globally synchronous).
    ``table_prefix``: ``database.`` to write into another database than the store's default.
    """
    if attempt == 0:
        _topology(store, topo, run_id, start_ns, table_prefix)
    whole = Slice(step_model, 0, topo.world_size)
    out: list[Step] = []
    t = start_ns
    pending: list[tuple[pa.Table, pa.Table, pa.Table]] = []
    for number in steps:
        step = step_model.step(number, t)
        t = step.end_ns
        out.append(step)
        pending.append(_step_tables(whole, topo, step, run_id, attempt))
        if len(pending) >= steps_per_insert:
            _insert(store, pending, table_prefix)
            pending = []
    if pending:
        _insert(store, pending, table_prefix)
    return out


def _insert(store: Store, pending: list[tuple[pa.Table, pa.Table, pa.Table]], prefix: str) -> None:
    for i, table in enumerate(("spans", "collectives", "step_metrics")):
        store.insert_arrow(f"{prefix}{table}", pa.concat_tables([p[i] for p in pending]))


def _strings(values: Sequence[str], index: np.ndarray) -> pa.Array:
    return pc.take(pa.array(list(values)), pa.array(np.asarray(index, dtype=np.int64)))


def _step_tables(whole: Slice, topo: Topology, step: Step, run_id: str, attempt: int) -> tuple[pa.Table, pa.Table, pa.Table]:
    span_rows, coll_rows = whole.full(step)
    s, n = span_rows.columns, len(span_rows.columns["name"])
    rank = np.repeat(np.arange(topo.world_size, dtype=np.uint32), np.diff(span_rows.offsets))
    spans = pa.table(
        {
            "run_id": _strings([run_id], np.zeros(n)),
            "rank": rank,
            "step": np.broadcast_to(s["step"], n).astype(np.uint32),
            "name": _strings(SPAN_NAMES, s["name"]),
            "kind": _strings(KIND_NAMES, SPAN_KINDS[s["name"]]),
            "start_time": s["start_ns"].astype(np.int64),
            "end_time": s["end_ns"].astype(np.int64),
            "microbatch": np.broadcast_to(s["microbatch"], n).astype(np.int32),
            "attributes": _strings([""], np.zeros(n)),
            "cpu_ns": np.full(n, -1, np.int64),
            "attempt": np.full(n, attempt, np.uint16),
        },
        schema=arrow_schema(BY_NAME["spans"]),
    )
    c, m = coll_rows.columns, len(coll_rows.columns["group"])
    crank = np.repeat(np.arange(topo.world_size), np.diff(coll_rows.offsets))
    group = topo.group_of[crank, np.asarray(c["group"], dtype=np.int64)]
    collectives = pa.table(
        {
            "run_id": _strings([run_id], np.zeros(m)),
            "rank": crank.astype(np.uint32),
            "group_name": _strings(topo.names, group),
            "seq": np.broadcast_to(c["seq"], m).astype(np.int64),
            "op": _strings(OP_NAMES, np.asarray(c["op"], dtype=np.int64) - FIRST_OP),
            "nbytes": np.broadcast_to(c["nbytes"], m).astype(np.uint64),
            "dtype": _strings(["bfloat16"], np.zeros(m)),
            "peer": np.broadcast_to(c["peer"], m).astype(np.int32),
            "issue_time": c["issue_ns"].astype(np.int64),
            "start_time": c["issue_ns"].astype(np.int64),
            "end_time": c["end_ns"].astype(np.int64),
            "state": _strings(["completed"], np.zeros(m)),
            "step": np.broadcast_to(c["step"], m).astype(np.uint32),
            "attempt": np.full(m, attempt, np.uint16),
        },
        schema=arrow_schema(BY_NAME["collectives"]),
    )
    # every rank reports its step time (the trainer's ranks all do); the end of its optimizer ends it
    ends = step.opt_end.reshape(-1) + step.start_ns
    k = topo.world_size
    metrics = pa.table(
        {
            "run_id": _strings([run_id], np.zeros(k)),
            "rank": np.arange(k, dtype=np.uint32),
            "step": np.full(k, step.number, np.uint32),
            "name": _strings(["step_time_s"], np.zeros(k)),
            "value": np.full(k, step.duration_ns / 1e9),
            "time": ends.astype(np.int64),
            "attempt": np.full(k, attempt, np.uint16),
        },
        schema=arrow_schema(BY_NAME["step_metrics"]),
    )
    return spans, collectives, metrics


def _topology(store: Store, topo: Topology, run_id: str, start_ns: int, prefix: str) -> None:
    k = topo.world_size
    ranks = np.arange(k)
    store.insert_arrow(f"{prefix}runs", pa.table({
        "run_id": [run_id], "name": ["simulated"], "start_time": [start_ns], "end_time": [0], "world_size": np.array([k], np.uint32),
        "tp": np.array([topo.tp], np.uint16), "pp": np.array([topo.pp], np.uint16), "dp": np.array([topo.dp], np.uint16),
        "config": [json.dumps({"simulated": True})], "status": ["finished"], "updated": [start_ns],
    }, schema=arrow_schema(BY_NAME["runs"])))  # fmt: skip
    store.insert_arrow(f"{prefix}ranks", pa.table({
        "run_id": _strings([run_id], np.zeros(k)), "rank": ranks.astype(np.uint32),
        "host": _strings([f"node-{h}" for h in range(-(-k // topo.ranks_per_host))], ranks // topo.ranks_per_host),
        "pid": np.full(k, 1, np.uint32), "local_rank": (ranks % topo.ranks_per_host).astype(np.int32),
        "device": _strings(["cuda:0 (simulated)"], np.zeros(k)), "tp_rank": topo.coords[:, 0].astype(np.int32),
        "pp_rank": topo.coords[:, 1].astype(np.int32), "dp_rank": topo.coords[:, 2].astype(np.int32),
        "clock_offset_ns": np.zeros(k, np.int64), "agent_version": _strings(["simulated"], np.zeros(k)),
        "registered": np.full(k, start_ns, np.int64), "attempt": np.zeros(k, np.uint16), "world": _strings([""], np.zeros(k)),
    }, schema=arrow_schema(BY_NAME["ranks"])))  # fmt: skip
    names = list(topo.groups)
    store.insert_arrow(f"{prefix}groups", pa.table({
        "run_id": [run_id] * len(names), "name": names, "description": [n.split("[")[0] for n in names],
        "ranks": [topo.groups[n] for n in names], "registered": [start_ns] * len(names),
    }, schema=arrow_schema(BY_NAME["groups"])))  # fmt: skip

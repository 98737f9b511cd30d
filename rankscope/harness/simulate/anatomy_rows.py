"""A simulated job's rows written straight into a store: for the tests and benchmarks of the anatomy and the diagnosis.

The timelines are the scale simulator's (``rankscope/harness/simulate``): per-stage forward and backward
compute with noise, tensor-parallel all-reduces after every chunk, the 1F1B pipeline with its
point-to-point transfers, the data-parallel all-reduce, the optimizer, with injected stragglers;
every step at full detail (every span and every collective, as a real agent records them). Its
``Step`` objects come back, so a test knows the truth: how long each step took, and how long it
would have taken without the straggler (the same seed, no factor). With ``signals``, each rank
also beats (a heartbeat per step), the last stage reports its loss, and every rank its GPU's gauges
every few steps: what the detectors besides the anatomy's read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rankscope.harness.simulate.step_model import Step, StepModel, Timing
from rankscope.harness.simulate.rows import OP_NAMES, SPAN_KINDS, SPAN_NAMES, Slice
from rankscope.harness.simulate.topology import Topology
from rankscope.collector.store.base import Store, arrow_schema
from rankscope.collector.store.schema import BY_NAME

T0 = 1_767_225_600_000_000_000  # 2026-01-01 UTC, ns
KIND_NAMES = ("compute", "comm", "data", "optimizer")  # telemetry.proto's SpanKind order (SPAN_KINDS' values)
#: index of the first op name in a simulated rank's string table (its three groups come first)
FIRST_OP = 3
#: the GPU gauges a rank reports with ``signals`` (the agent's names; the last two are what the gpu detector reads)
GPU_GAUGES = ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.temperature", "hw.power", "hw.gpu.throttle.hw_thermal", "hw.errors.ecc_uncorrected")
GPU_EVERY = 5
#: the device every simulated rank reports
DEVICE = "cuda:0 (simulated)"


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
    signals: bool = False,
    register: bool = True,
) -> list[Step]:
    """Write the run's topology (once, for attempt 0) and ``steps`` of timelines; returns the steps.

    Steps follow each other without a gap (the simulator's steps are globally synchronous).
    ``table_prefix``: ``database.`` to write into another database than the store's default.
    ``signals``: heartbeats, losses and GPU gauges too (see the module docstring). ``register``: False
    to go on with a run already written (its topology is there).
    """
    if register and attempt == 0:
        _topology(store, topo, run_id, start_ns, table_prefix)
    whole = Slice(step_model, 0, topo.world_size)
    out: list[Step] = []
    t = start_ns
    pending: list[dict[str, pa.Table]] = []
    for number in steps:
        step = step_model.step(number, t)
        t = step.end_ns
        out.append(step)
        tables = _step_tables(whole, topo, step, run_id, attempt)
        if signals:
            tables = _with_signals(tables, topo, step, run_id, attempt)
        pending.append(tables)
        if len(pending) >= steps_per_insert:
            _insert(store, pending, table_prefix)
            pending = []
    if pending:
        _insert(store, pending, table_prefix)
    return out


def _insert(store: Store, pending: list[dict[str, pa.Table]], prefix: str) -> None:
    for table in dict.fromkeys(name for p in pending for name in p):
        store.insert_arrow(f"{prefix}{table}", pa.concat_tables([p[table] for p in pending if table in p]))


def _strings(values: Sequence[str], index: np.ndarray) -> pa.Array:
    return pc.take(pa.array(list(values)), pa.array(np.asarray(index, dtype=np.int64)))


def _step_tables(whole: Slice, topo: Topology, step: Step, run_id: str, attempt: int) -> dict[str, pa.Table]:
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
    return {"spans": spans, "collectives": collectives, "step_metrics": metrics}


def _with_signals(tables: dict[str, pa.Table], topo: Topology, step: Step, run_id: str, attempt: int) -> dict[str, pa.Table]:
    """The step's tables plus every rank's heartbeat in the middle of the step, the last stage's
    losses, and every ``GPU_EVERY`` steps each rank's GPU gauges (none throttled, no errors)."""
    k = topo.world_size
    ranks = np.arange(k)
    mid = step.start_ns + step.duration_ns // 2
    hosts = _strings([f"node-{h}" for h in range(-(-k // topo.ranks_per_host))], ranks // topo.ranks_per_host)
    schema = arrow_schema(BY_NAME["heartbeats"])
    empty = {f.name: pa.array([[]] * k, f.type) for f in schema if pa.types.is_list(f.type)}
    heartbeats = pa.table({
        "run_id": _strings([run_id], np.zeros(k)), "rank": ranks.astype(np.uint32), "host": hosts,
        "time": np.full(k, mid, np.int64), "step": np.full(k, step.number, np.uint32), "phase": _strings(["backward"], np.zeros(k)),
        "status": _strings(["running"], np.zeros(k)), "last_progress": np.full(k, mid - 1_000_000, np.int64), **empty,
        "events_dropped": np.zeros(k, np.uint64), "attempt": np.full(k, attempt, np.uint16),
    }, schema=schema)  # fmt: skip
    last = ranks[topo.coords[:, 1] == topo.pp - 1]
    losses = pa.table({
        "run_id": _strings([run_id], np.zeros(len(last))), "rank": last.astype(np.uint32), "step": np.full(len(last), step.number, np.uint32),
        "name": _strings(["loss"], np.zeros(len(last))), "value": step.loss[topo.coords[last, 2]].astype(np.float64),
        "time": np.full(len(last), step.end_ns, np.int64), "attempt": np.full(len(last), attempt, np.uint16),
    }, schema=arrow_schema(BY_NAME["step_metrics"]))  # fmt: skip
    out = {**tables, "heartbeats": heartbeats, "step_metrics": pa.concat_tables([tables["step_metrics"], losses])}
    if step.number % GPU_EVERY == 0:
        g = len(GPU_GAUGES)
        on = np.repeat(ranks, g)
        out["metrics"] = pa.table({
            "run_id": _strings([run_id], np.zeros(k * g)), "rank": on.astype(np.int32), "host": pc.take(hosts, pa.array(on)),
            "device": _strings([DEVICE], np.zeros(k * g)), "time": np.full(k * g, mid, np.int64),
            "name": _strings(GPU_GAUGES, np.tile(np.arange(g), k)), "value": np.tile([0.9, 6e10, 65.0, 500.0, 0.0, 0.0], k),
            "attempt": np.full(k * g, attempt, np.uint16),
        }, schema=arrow_schema(BY_NAME["metrics"]))  # fmt: skip
    return out


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
        "device": _strings([DEVICE], np.zeros(k)), "tp_rank": topo.coords[:, 0].astype(np.int32),
        "pp_rank": topo.coords[:, 1].astype(np.int32), "dp_rank": topo.coords[:, 2].astype(np.int32),
        "clock_offset_ns": np.zeros(k, np.int64), "agent_version": _strings(["simulated"], np.zeros(k)),
        "registered": np.full(k, start_ns, np.int64), "attempt": np.zeros(k, np.uint16), "world": _strings([""], np.zeros(k)),
    }, schema=arrow_schema(BY_NAME["ranks"])))  # fmt: skip
    names = list(topo.groups)
    store.insert_arrow(f"{prefix}groups", pa.table({
        "run_id": [run_id] * len(names), "name": names, "description": [n.split("[")[0] for n in names],
        "ranks": [topo.groups[n] for n in names], "registered": [start_ns] * len(names), "attempt": np.zeros(len(names), np.uint16),
    }, schema=arrow_schema(BY_NAME["groups"])))  # fmt: skip

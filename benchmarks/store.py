"""Storage throughput and the dashboard's query latency on the embedded store (chDB).

    python benchmarks/store.py [--rows N] [--batch-rows N] [--agents N] [--insert-repeats N]
                               [--ranks N] [--steps N] [--repeats N]

In one run, on one temporary store:

(a) raw insert: ``--rows`` realistic span rows as one Arrow table, one
    ``INSERT ... SELECT ... FROM Python(table)`` (EmbeddedStore.insert_arrow);
(b) the collector's Writer: the same rows arriving as ``--batch-rows`` batches from ``--agents``
    concurrent senders, each waiting for its acknowledgement before sending its next batch;
    rows/s, the Writer's insert latency, and b/a (medians of ``--insert-repeats`` alternated runs);
(c) a run of ``--ranks`` ranks x ``--steps`` steps (20 spans, 8 collectives and one heartbeat
    per rank and step: 10M spans by default), then the dashboard's own queries
    (``rankscope/dashboard/data.py``), each ``--repeats`` times: heat map by rank and by host, timeline,
    collective skew, the 3D-parallel graph's rank states, collective matching.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rankscope.collector.store.base import arrow_schema
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.migrations import migrate
from rankscope.collector.store.schema import BY_NAME
from rankscope.collector.writer import BatchKey, Writer

T0 = 1_767_225_600_000_000_000  # 2026-01-01 UTC, ns
RUN = "run-big"
#: the stored run's database: the store's default, as the collector's is, so that the
#: dashboard's queries run unchanged
RUN_DATABASE = "bench_run"
STEP_NS = 900_000_000
TP, PP = 8, 4
# One step of one rank: (name, kind, microbatch), in time order.
SEGMENTS = (
    [("data", "data", -1)]
    + [("forward", "compute", m) for m in range(4)]
    + [("pp_send", "comm", m) for m in range(4)]
    + [("backward", "compute", m) for m in range(4)]
    + [("pp_recv", "comm", m) for m in range(4)]
    + [("dp_reduce_scatter", "comm", -1), ("clip_grad", "optimizer", -1), ("optimizer", "optimizer", -1)]
)
# One step of one rank: (group kind, op); four tensor-parallel all-reduces per step, and so on.
COLLECTIVES = [("tp", "all_reduce")] * 4 + [("dp", "reduce_scatter"), ("dp", "all_gather"), ("pp", "send"), ("pp", "recv")]


def strings(values: list[str], index: np.ndarray) -> pa.Array:
    """values[index] as an Arrow string array, without a Python object per row."""
    return pc.take(pa.array(values), pa.array(index))


def spans(run_id: str, ranks: int, steps: range, seed: int = 0) -> pa.Table:
    """Every rank's segments for ``steps``, step by step (the order agents deliver them in)."""
    rng = np.random.default_rng(seed)
    per_step = ranks * len(SEGMENTS)
    n = per_step * len(steps)
    step = np.repeat(np.array(steps, "uint32"), per_step)
    rank = np.tile(np.repeat(np.arange(ranks, dtype="uint32"), len(SEGMENTS)), len(steps))
    segment = np.tile(np.arange(len(SEGMENTS)), ranks * len(steps))
    duration = rng.lognormal(np.log(STEP_NS / len(SEGMENTS) / 1.2), 0.1, n).astype("int64")
    duration[rank == 13] = duration[rank == 13] * 6 // 5  # a straggler, as the dashboard would show
    # Segments follow each other within a rank's step.
    offset = np.cumsum(duration.reshape(-1, len(SEGMENTS)), axis=1).reshape(-1) - duration
    start = T0 + (step.astype("int64") - 1) * STEP_NS + offset
    names, kinds, micro = zip(*SEGMENTS)
    return pa.table(
        {
            "run_id": strings([run_id], np.zeros(n, "int32")),
            "rank": rank,
            "step": step,
            "name": strings(list(names), segment),
            "kind": strings(list(kinds), segment),
            "start_time": start,
            "end_time": start + duration,
            "microbatch": np.array(micro, "int32")[segment],
            "attributes": strings(["", '{"layers": "0-5"}'], (segment == 0).astype("int32")),
            "cpu_ns": np.full(n, -1, "int64"),  # GPU-timed spans: no thread CPU time
        },
        schema=arrow_schema(BY_NAME["spans"]),
    )


def coords(rank: np.ndarray, ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tp, pp, dp) of each rank in Megatron's order: rank = tp + dp*TP + pp*TP*DP (the trainer's ``Layout``)."""
    dp_size = ranks // (TP * PP)
    return rank % TP, rank // (TP * dp_size), rank // TP % dp_size


def collectives(run_id: str, ranks: int, steps: range) -> pa.Table:
    """Each rank's collectives with Megatron's groups: rank = tp + dp*TP + pp*TP*DP."""
    dp_size = ranks // (TP * PP)
    per_step = ranks * len(COLLECTIVES)
    n = per_step * len(steps)
    step = np.repeat(np.array(steps, "int64"), per_step)
    rank = np.tile(np.repeat(np.arange(ranks), len(COLLECTIVES)), len(steps))
    which = np.tile(np.arange(len(COLLECTIVES)), ranks * len(steps))
    tp, pp, dp = coords(rank, ranks)
    kind = np.array([k for k, _ in COLLECTIVES])[which]
    group_index = np.select([kind == "tp", kind == "dp"], [rank // TP, pp * TP + tp], dp * TP + tp)
    group_names = [f"{k}[{i}]" for k in ("tp", "dp", "pp") for i in range(ranks)]
    group = np.select([kind == "tp", kind == "dp"], [0, ranks], 2 * ranks) + group_index
    # Per-group sequence numbers: identical on every member.
    slot = np.select([kind == "tp", kind == "dp"], [which, which - 4], which - 6)
    per_group = np.select([kind == "tp", kind == "dp"], [4, 2], 2)
    seq = (step - 1) * per_group + slot + 1
    issue = T0 + (step - 1) * STEP_NS + which * (STEP_NS // 10) + rank * 1000
    return pa.table(
        {
            "run_id": strings([run_id], np.zeros(n, "int32")),
            "rank": rank.astype("uint32"),
            "group_name": strings(group_names, group),
            "seq": seq,
            "op": strings([op for _, op in COLLECTIVES], which),
            "nbytes": np.full(n, 1 << 26, "uint64"),
            "dtype": strings(["bfloat16"], np.zeros(n, "int32")),
            "peer": np.where(kind == "pp", (rank + TP * dp_size) % ranks, -1).astype("int32"),
            "issue_time": issue,
            "start_time": issue + 20_000,
            "end_time": issue + 5_000_000,
            "state": strings(["completed"], np.zeros(n, "int32")),
            "step": step.astype("uint32"),
        },
        schema=arrow_schema(BY_NAME["collectives"]),
    )


def heartbeats(run_id: str, ranks: int, steps: range) -> pa.Table:
    """One heartbeat per rank and step, none in flight."""
    n = ranks * len(steps)
    step = np.repeat(np.array(steps, "int64"), ranks)
    rank = np.tile(np.arange(ranks), len(steps))
    time_ns = T0 + step * STEP_NS + rank * 1000
    empty = pa.array([[]] * n, pa.list_(pa.int64()))
    return pa.table(
        {
            "run_id": strings([run_id], np.zeros(n, "int32")),
            "rank": rank.astype("uint32"),
            "host": strings([f"node-{h:04d}" for h in range(ranks // 8)], rank // 8),
            "time": time_ns,
            "step": step.astype("uint32"),
            "phase": strings(["forward"], np.zeros(n, "int32")),
            "status": strings(["running"], np.zeros(n, "int32")),
            "last_progress": time_ns - 1_000_000,
            "inflight_group": pa.array([[]] * n, pa.list_(pa.string())),
            "inflight_seq": empty,
            "inflight_op": pa.array([[]] * n, pa.list_(pa.string())),
            "inflight_peer": pa.array([[]] * n, pa.list_(pa.int32())),
            "inflight_issue": empty,
            "inflight_waiting": pa.array([[]] * n, pa.list_(pa.uint8())),
            "events_dropped": np.zeros(n, "uint64"),
        },
        schema=arrow_schema(BY_NAME["heartbeats"]),
    )


def raw_insert(store: EmbeddedStore, rows: pa.Table, database: str) -> float:
    """Rows/s of one insert of the whole table into a new database."""
    migrate(store, database, None)
    started = time.perf_counter()
    store.insert_arrow(f"{database}.spans", rows)
    return rows.num_rows / (time.perf_counter() - started)


def writer_insert(store: EmbeddedStore, rows: pa.Table, database: str, batch_rows: int, agents: int) -> tuple[float, list[float]]:
    """Rows/s through a Writer into a new database, and its insert latencies (s)."""
    migrate(store, database, None)
    batches = [rows.slice(i, batch_rows) for i in range(0, rows.num_rows, batch_rows)]

    async def agent(writer: Writer, mine: list[int]) -> None:
        for i in mine:
            key = BatchKey("bench", i % 1024, i.to_bytes(16, "big"), "spans")
            await writer.write({"spans": batches[i]}, key)

    async def scenario() -> tuple[float, list[float]]:
        writer = Writer(store, database)
        await writer.start()
        started = time.perf_counter()
        await asyncio.gather(*(agent(writer, list(range(a, len(batches), agents))) for a in range(agents)))
        elapsed = time.perf_counter() - started
        latencies = writer.take_insert_latencies()["spans"]
        await writer.close()
        return elapsed, latencies

    elapsed, latencies = asyncio.run(scenario())
    return rows.num_rows / elapsed, latencies


def load_run(store: EmbeddedStore, ranks: int, steps: int, chunk_steps: int) -> dict[str, int]:
    """Store the run in inserts of ``chunk_steps`` steps (``step_segments`` rolls up as it goes); rows per table."""
    migrate(store, RUN_DATABASE, None)
    store.insert_arrow(f"{RUN_DATABASE}.ranks", registrations(RUN, ranks))
    stored = {"spans": 0, "collectives": 0, "heartbeats": 0}
    for first in range(1, steps + 1, chunk_steps):
        window = range(first, min(first + chunk_steps, steps + 1))
        for name, make in (("spans", spans), ("collectives", collectives), ("heartbeats", heartbeats)):
            rows = make(RUN, ranks, window)
            store.insert_arrow(f"{RUN_DATABASE}.{name}", rows)
            stored[name] += rows.num_rows
    return stored


def settle(store: EmbeddedStore, limit_s: float = 120.0) -> float:
    """Wait until the background merges of the load are done; returns the seconds waited.

    A run stores this much over minutes, not seconds, and its parts are merged as it goes:
    queries measured in the middle of a burst of merges on two cores would say little.
    """
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if store.query_arrow("SELECT count() AS n FROM system.merges")["n"][0].as_py() == 0:
            break
        time.sleep(0.2)
    return time.perf_counter() - started


def timed(query: Callable[[], pa.Table], repeats: int) -> tuple[list[float], int]:
    """Seconds of each run, and the result's rows."""
    seconds, rows = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        rows = query().num_rows
        seconds.append(time.perf_counter() - started)
    return seconds, rows


def registrations(run_id: str, ranks: int) -> pa.Table:
    """Every rank's registration: host (8 ranks each) and tp/pp/dp coordinates, as the heat map groups them."""
    rank = np.arange(ranks, dtype="uint32")
    tp, pp, dp = coords(rank, ranks)
    return pa.table(
        {
            "run_id": strings([run_id], np.zeros(ranks, "int32")),
            "rank": rank,
            "host": strings([f"node-{h:04d}" for h in range(-(-ranks // 8))], rank // 8),
            "pid": np.full(ranks, 1000, "uint32"),
            "local_rank": (rank % 8).astype("int32"),
            "device": strings(["cuda:0"], np.zeros(ranks, "int32")),
            "tp_rank": tp.astype("int32"),
            "pp_rank": pp.astype("int32"),
            "dp_rank": dp.astype("int32"),
            "clock_offset_ns": np.zeros(ranks, "int64"),
            "agent_version": strings(["bench"], np.zeros(ranks, "int32")),
            "registered": np.full(ranks, T0, "int64"),
        },
        schema=arrow_schema(BY_NAME["ranks"]),
    )


def dashboard_queries(ranks: int, steps: int) -> dict[str, tuple[str, str, dict[str, object]]]:
    """name -> (what it shows, SQL, parameters): the dashboard's own queries (``rankscope/dashboard/data.py``)."""
    import streamlit.logger

    streamlit.logger.set_log_level("error")  # not one "no runtime" warning per cached function
    from rankscope.dashboard import data

    run = {"run": RUN}
    middle = steps // 2
    window = {"start": T0 + (middle - 1) * STEP_NS, "end": T0 + (middle + 4) * STEP_NS}  # 5 steps
    eight = {"ranks": list(range(8, 16))}
    heat = data.HEAT_CELLS_SQL
    return {
        "segments of the run (heat map's picker)": ("one row per segment", data.SEGMENTS_SQL, run),
        "heat map by rank, whole run": (f"{ranks} x {steps} cells", heat + data.HEAT_BY["rank"],
                                        {**run, "segment": "forward", "first": 1, "last": steps}),
        "heat map by host, whole run": (f"{ranks // 8} x {steps} cells", heat + data.HEAT_BY["host"],
                                        {**run, "segment": "forward", "first": 1, "last": steps}),
        "heat map by rank, last 50 steps": (f"{ranks} x 50 cells", heat + data.HEAT_BY["rank"],
                                            {**run, "segment": "forward", "first": max(1, steps - 49), "last": steps}),
        "timeline: the window of 5 steps": ("start, end", data.WINDOW_SQL, {**run, "first": middle, "last": middle + 4}),
        "timeline: spans of 8 ranks, 5 steps": ("8 ranks x 5 steps", data.SPANS_SQL, {**run, **eight, **window}),
        "timeline: collectives of 8 ranks, 5 steps": ("8 ranks x 5 steps", data.OPS_SQL, {**run, **eight, **window}),
        "timeline: most skewed collectives, 5 steps": ("20 collectives", data.SKEW_SQL, {**run, **window, "limit": 20}),
        "3D-parallel graph: every rank's state": (f"{ranks} ranks", data.RANK_STATE_SQL, {**run, "at": window["end"]}),
        "matching: members of one (run, group, seq)": (
            "one collective",
            "SELECT rank, op, issue_time, end_time, state FROM collectives "
            "WHERE run_id = {run:String} AND group_name = {group:String} AND seq = {seq:Int64}",
            {**run, "group": "tp[13]", "seq": 2 * steps},
        ),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="span rows for (a) and (b)")
    parser.add_argument("--batch-rows", type=int, default=4096, help="rows per agent batch in (b)")
    parser.add_argument("--agents", type=int, default=64, help="concurrent senders in (b)")
    parser.add_argument("--ranks", type=int, default=1024, help="ranks of the stored run in (c)")
    parser.add_argument("--steps", type=int, default=500, help="steps of the stored run in (c): ranks x steps x 20 spans")
    parser.add_argument("--insert-repeats", type=int, default=3, help="runs of (a) and (b)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each query in (c)")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="rankscope-bench-"))
    store = EmbeddedStore(tmp / "store", database=RUN_DATABASE)
    try:
        print(f"store: {store.describe()}\n")
        rows = spans("bench", 1024, range(1, 1 + -(-args.rows // (1024 * len(SEGMENTS))))).slice(0, args.rows)
        raws, writers, latencies = [], [], []
        for i in range(args.insert_repeats):  # alternated, so that both see the same machine
            raws.append(raw_insert(store, rows, f"bench_raw_{i}"))
            rate, samples = writer_insert(store, rows, f"bench_writer_{i}", args.batch_rows, args.agents)
            writers.append(rate)
            latencies += samples
        raw, through_writer = statistics.median(raws), statistics.median(writers)
        p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
        print(f"| insert path (median of {args.insert_repeats}) | rows | rows/s | inserts | insert latency p50 / p99 | vs raw |")
        print("|---|---|---|---|---|---|")
        print(f"| (a) one INSERT ... SELECT FROM Python(table) | {rows.num_rows:,} | {raw:,.0f} | 1 | | 1.00 |")
        print(f"| (b) Writer: {args.batch_rows}-row batches from {args.agents} senders | {rows.num_rows:,} | {through_writer:,.0f} | "
              f"{len(latencies) / args.insert_repeats:.0f} | {p50:.0f} ms / {p99:.0f} ms | {through_writer / raw:.2f} |")

        started = time.perf_counter()
        stored = load_run(store, args.ranks, args.steps, chunk_steps=max(1, 1_000_000 // (args.ranks * len(SEGMENTS))))
        loading = time.perf_counter() - started
        settled = settle(store)
        print(f"\n(c) stored {', '.join(f'{n:,} {t}' for t, n in stored.items())} in {loading:.1f} s "
              f"({sum(stored.values()) / loading:,.0f} rows/s); the engine's merges then took {settled:.1f} s more\n")
        print(f"| dashboard query | result | rows | median ms | max ms (of {args.repeats}) | under 200 ms |")
        print("|---|---|---|---|---|---|")
        for name, (shape, sql, params) in dashboard_queries(args.ranks, args.steps).items():
            seconds, result_rows = timed(functools.partial(store.query_arrow, sql, params), args.repeats)
            median, worst = statistics.median(seconds) * 1e3, max(seconds) * 1e3
            verdict = "yes" if median < 200 else "no"
            print(f"| {name} | {shape} | {result_rows:,} | {median:.0f} | {worst:.0f} | {verdict} |", flush=True)
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

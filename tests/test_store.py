"""Storage: the generated DDL, both backends' insert/query contract, migrations and retention.

The backend tests run on the embedded store (real chDB on a temporary directory) and, when
RANKSCOPE_TEST_CLICKHOUSE_URL is set (http://user:password@host:8123, no database: each test
makes and drops its own), on that ClickHouse server as well.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from rankscope.collector.store.base import (
    QueryError,
    Store,
    StoreError,
    StoreUnreachableError,
    StoreVersionError,
    arrow_schema,
    open_store,
)
from rankscope.collector.store.chdb import EmbeddedStore
from rankscope.collector.store.ddl import add_column_statements, create_statements
from rankscope.collector.store.migrations import MIGRATIONS, Migration, migrate, retention
from rankscope.collector.store.schema import BY_NAME, SCHEMA_VERSION, TABLES, Table

SERVER_URL = os.environ.get("RANKSCOPE_TEST_CLICKHOUSE_URL")
T0 = 1_767_225_600_123_456_789  # 2026-01-01 00:00:00.123456789 UTC, in ns
NS_PER_DAY = 86_400 * 10**9


@pytest.fixture(params=["embedded", "server"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """An empty store on each backend (the server one is skipped without a server URL)."""
    if request.param == "server":
        if not SERVER_URL:
            pytest.skip("no ClickHouse server: set RANKSCOPE_TEST_CLICKHOUSE_URL=http://user:password@host:8123")
        server = open_store(clickhouse_url=SERVER_URL, database=f"rankscope_test_{uuid.uuid4().hex[:12]}")
        yield server
        server.command(f"DROP DATABASE IF EXISTS {server.database}")
        server.close()
    else:
        embedded = EmbeddedStore(tmp_path / "store")
        yield embedded
        embedded.close()


@pytest.fixture
def migrated(store: Store) -> Store:
    migrate(store, store.database, None)
    return store


def sample_rows(table: str, n: int = 3, *, run_id: str = "run-1", start_ns: int = T0) -> pa.Table:
    """``n`` realistic rows of ``table``: ns timestamps, arrays, NaN; unique order keys."""
    i = np.arange(n)
    ns = start_ns + i * 1_000_003
    def text() -> list[str]:
        return [f"text {k} with 'quotes' and \\ and é" for k in i]

    u32 = i.astype("uint32")
    columns = {  # built lazily: only the asked table's columns
        "schema_version": lambda: {"version": u32 + 100, "applied": ns, "rankscope_version": ["0.1.0"] * n},
        "runs": lambda: {"run_id": [f"{run_id}-{k}" for k in i], "name": text(), "start_time": ns, "end_time": np.zeros(n, "int64"),
                         "world_size": np.full(n, 1024, "uint32"), "tp": np.full(n, 8, "uint16"), "pp": np.full(n, 4, "uint16"),
                         "dp": np.full(n, 32, "uint16"), "config": ['{"lr": 0.0003}'] * n, "status": ["running"] * n, "updated": ns},
        "ranks": lambda: {"run_id": [run_id] * n, "rank": u32, "host": [f"node-{k // 8:02d}" for k in i], "pid": 4000 + u32,
                          "local_rank": (i % 8).astype("int32"), "device": ["cuda:0 (NVIDIA H100 80GB HBM3)"] * n,
                          "tp_rank": (i % 8).astype("int32"), "pp_rank": np.zeros(n, "int32"), "dp_rank": (i // 8).astype("int32"),
                          "clock_offset_ns": (i * -1234).astype("int64"), "agent_version": ["0.1.0"] * n, "registered": ns,
                          "world": ["10.0.0.1:29500/1024"] * n},
        "groups": lambda: {"run_id": [run_id] * n, "name": [f"dp[{k}]" for k in i], "description": ["data parallel"] * n,
                           "ranks": [[int(k), int(k) + 8, int(k) + 16] for k in i], "registered": ns},
        "spans": lambda: {"run_id": [run_id] * n, "rank": u32, "step": u32 + 1, "name": ["forward"] * n, "kind": ["compute"] * n,
                          "start_time": ns, "end_time": ns + 12_345_678 + i, "microbatch": (i % 4).astype("int32"),
                          "attributes": ['{"layer": 3}', ""] * (n // 2) + [""] * (n % 2),
                          "cpu_ns": np.where(i % 2 == 1, -1, 9_000_000 + i * 1_000_000).astype("int64")},
        "collectives": lambda: {"run_id": [run_id] * n, "rank": u32, "group_name": ["tp[0]"] * n, "seq": i.astype("int64") + 1,
                                "op": ["all_reduce"] * n, "nbytes": np.full(n, 1 << 24, "uint64"), "dtype": ["bfloat16"] * n,
                                "peer": np.full(n, -1, "int32"), "issue_time": ns, "start_time": ns + 1000, "end_time": ns + 2_000_001,
                                "state": ["completed"] * n, "step": u32 + 1},
        "heartbeats": lambda: {"run_id": [run_id] * n, "rank": u32, "host": ["node-00"] * n, "time": ns, "step": u32 + 1,
                               "phase": ["backward"] * n, "status": ["running"] * n, "last_progress": ns - 5,
                               "inflight_group": [["dp[0]", "tp[0]"][: k % 3] for k in i],
                               "inflight_seq": [[7, 8][: k % 3] for k in i],
                               "inflight_op": [["all_reduce", "send"][: k % 3] for k in i],
                               "inflight_peer": [[-1, 3][: k % 3] for k in i],
                               "inflight_issue": [[int(t), int(t) + 1][: k % 3] for k, t in zip(i, ns)],
                               "inflight_waiting": [[1, 0][: k % 3] for k in i], "events_dropped": np.zeros(n, "uint64")},
        "metrics": lambda: {"run_id": [run_id] * n, "rank": i.astype("int32"), "host": ["node-00"] * n, "device": ["cuda:0"] * n,
                            "time": ns, "name": ["gpu.utilization"] * n, "value": i * 0.5},
        "step_metrics": lambda: {"run_id": [run_id] * n, "rank": u32, "step": u32 + 1, "name": ["loss"] * n,
                                 "value": [float("nan"), float("inf"), 2.5][:n] + [1.0] * max(0, n - 3), "time": ns},
        "stacks": lambda: {"run_id": [run_id] * n, "rank": u32, "host": ["node-00"] * n, "time": ns, "reason": ["requested"] * n,
                           "method": ["py-spy"] * n, "text": ['Thread 1 (active): "MainThread"\n  forward (model.py:42)'] * n},
        "exits": lambda: {"run_id": [run_id] * n, "rank": u32, "host": ["node-00"] * n, "time": ns, "reason": ["signal"] * n,
                          "exit_code": np.full(n, -15, "int32"), "signal": np.full(n, 15, "int32"), "message": ["SIGTERM"] * n},
        "incidents": lambda: {"run_id": [run_id] * n, "incident_id": [f"straggler-{k}" for k in i], "kind": ["straggler"] * n,
                              "severity": ["warning"] * n, "status": ["open"] * n, "ranks": [[13]] * n, "hosts": [["node-06"]] * n,
                              "first_seen": ns, "last_seen": ns + 10**9, "summary": text(), "evidence": ['{"ratio": 1.21}'] * n,
                              "sql": ["SELECT 1"] * n, "version": u32.astype("uint64")},
        "actions": lambda: {"run_id": [run_id] * n, "time": ns, "action": ["evict"] * n, "hosts": [["node-06"]] * n,
                            "incident_id": [f"straggler-{k}" for k in i], "reason": text(), "evidence": ['{"steps_lost": 3}'] * n},
        "selfchecks": lambda: {"run_id": [run_id] * n, "host": [f"node-{k:02d}" for k in i], "time": ns, "check": ["matmul"] * n,
                               "value": i * 10.5, "unit": ["GFLOP/s"] * n, "reference": [float("nan")] + [20.0] * (n - 1),
                               "passed": (i % 2).astype("uint8"), "host_passed": (i % 2).astype("uint8"), "summary": text(),
                               "detail": [""] * n},
        "node_states": lambda: {"run_id": [run_id] * n, "host": [f"node-{k:02d}" for k in i], "time": ns,
                                "state": ["drained"] * n, "incident_id": [f"crash:rank={k}" for k in i], "reason": text(),
                                "actor": ["rankscope launch"] * n},
        "batches": lambda: {"run_id": [run_id] * n, "rank": u32, "batch_id": [int(k).to_bytes(16, "big") for k in i],
                            "kind": ["spans"] * n, "rows": np.full(n, 4096, "uint32"), "received": ns},
    }[table]()
    if "attempt" in arrow_schema(BY_NAME[table]).names:
        columns["attempt"] = (i % 2).astype("uint16")
    return pa.table(columns, schema=arrow_schema(BY_NAME[table]))


def read_back(store: Store, table: str) -> list[dict]:
    """Every row of ``table`` in insert-column order with times as integer ns, sorted by key."""
    spec = BY_NAME[table]
    columns = ", ".join(
        f"toUnixTimestamp64Nano({c.name}) AS {c.name}" if c.type == "DateTime64(9)"
        else f"arrayMap(t -> toUnixTimestamp64Nano(t), {c.name}) AS {c.name}" if c.type == "Array(DateTime64(9))"
        else c.name
        for c in spec.insert_columns
    )
    return store.query_arrow(f"SELECT {columns} FROM {store.database}.{table} ORDER BY {', '.join(spec.order_by)}").to_pylist()


def as_ns(rows: pa.Table) -> list[dict]:
    """``rows`` as read_back() shows them."""
    columns = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else
               c.cast(pa.list_(pa.int64())) if pa.types.is_list(c.type) and pa.types.is_timestamp(c.type.value_type) else c
               for c in rows.columns]
    return pa.table(columns, names=rows.column_names).to_pylist()


# --- DDL ---------------------------------------------------------------------------------------


def test_ddl_creates_every_table_with_its_columns_engine_and_keys(migrated: Store) -> None:
    tables = migrated.query_arrow(
        "SELECT name, engine, sorting_key, partition_key FROM system.tables WHERE database = {db:String}", {"db": migrated.database}
    ).to_pylist()
    by_name = {t["name"]: t for t in tables}
    assert set(by_name) == {t.name for t in TABLES} | {f"{t.name}_mv" for t in TABLES if t.source}
    for table in TABLES:
        got = by_name[table.name]
        assert got["engine"] == family(table)
        if table.source:
            assert by_name[f"{table.name}_mv"]["engine"] == "MaterializedView"
        assert got["sorting_key"] == ", ".join(table.order_by)
        assert got["partition_key"] == (f"toDate({table.time_column})" if table.time_column else "")
    columns = migrated.query_arrow(
        "SELECT table, name, type, default_kind FROM system.columns WHERE database = {db:String} ORDER BY table, position",
        {"db": migrated.database},
    ).to_pylist()
    for table in TABLES:
        mine = [(c["name"], c["type"], c["default_kind"]) for c in columns if c["table"] == table.name]
        assert mine == [(c.name, c.type, "MATERIALIZED" if c.materialized else "DEFAULT" if c.default else "") for c in table.columns]


def family(table: Table) -> str:
    """The MergeTree family a table description asks for."""
    return "AggregatingMergeTree" if table.source else "ReplacingMergeTree" if table.version_column else "MergeTree"


def without_name_and_engine(create_table: str) -> list[str]:
    lines = create_table.splitlines()
    return [line for line in lines[1:] if not line.startswith("ENGINE = ")]


def test_cluster_ddl_has_replicated_local_tables_and_distributed_tables_over_them() -> None:
    statements = create_statements("obs", retention_days=14, cluster="prod")
    assert statements[0] == "CREATE DATABASE IF NOT EXISTS obs ON CLUSTER prod"
    rollups = [t for t in TABLES if t.source]
    assert len(statements) == 1 + 2 * len(TABLES) + len(rollups) and all(" ON CLUSTER prod" in s for s in statements)
    for table in rollups:  # the view reads and writes the shard-local tables
        assert f"CREATE MATERIALIZED VIEW IF NOT EXISTS obs.{table.name}_mv ON CLUSTER prod TO obs.{table.name}_local AS " \
            f"{table.view.format(source=f'obs.{table.source}_local')}" in statements
    single = create_statements("obs", retention_days=14)
    for table in TABLES:
        local = next(s for s in statements if s.startswith(f"CREATE TABLE IF NOT EXISTS obs.{table.name}_local ON CLUSTER prod\n"))
        replicated = f"Replicated{family(table)}"
        version = f", {table.version_column}" if table.version_column else ""
        assert f"ENGINE = {replicated}('/clickhouse/tables/{{shard}}/{{database}}/{{table}}', '{{replica}}'{version})" in local
        # Columns, projections, keys, TTL and settings are the single-node table's.
        same = next(s for s in single if s.startswith(f"CREATE TABLE IF NOT EXISTS obs.{table.name}\n"))
        assert without_name_and_engine(local) == without_name_and_engine(same)
        # Rows of one rank (or run, for tables and rollups without ranks) stay on one shard.
        key = {"schema_version": "rand()", "runs": "cityHash64(run_id)", "groups": "cityHash64(run_id)",
               "incidents": "cityHash64(run_id)", "actions": "cityHash64(run_id)",
               "selfchecks": "cityHash64(run_id)", "node_states": "cityHash64(run_id)", "step_losses": "cityHash64(run_id)"}.get(table.name, "cityHash64(run_id, rank)")
        assert (
            f"CREATE TABLE IF NOT EXISTS obs.{table.name} ON CLUSTER prod AS obs.{table.name}_local "
            f"ENGINE = Distributed(prod, obs, {table.name}_local, {key})"
        ) in statements


def test_retention_is_a_day_partition_ttl_that_drops_whole_parts(migrated: Store) -> None:
    migrate(migrated, migrated.database, 30)
    timed = [t.name for t in TABLES if t.time_column]
    assert retention(migrated, migrated.database) == dict.fromkeys(timed, 30)
    create = migrated.query_arrow(f"SHOW CREATE TABLE {migrated.database}.spans").column(0)[0].as_py()
    assert "TTL toDateTime(start_time) + toIntervalDay(30)" in create
    assert "ttl_only_drop_parts = 1" in create
    migrate(migrated, migrated.database, 7)  # a changed --retention-days reaches the existing tables
    assert retention(migrated, migrated.database) == dict.fromkeys(timed, 7)
    migrate(migrated, migrated.database, None)  # not given: left as it is
    assert retention(migrated, migrated.database) == dict.fromkeys(timed, 7)
    migrate(migrated, migrated.database, 0)  # 0: keep everything
    assert retention(migrated, migrated.database) == dict.fromkeys(timed, 0)


# --- insert and query --------------------------------------------------------------------------


@pytest.mark.parametrize("table", [t.name for t in TABLES if not t.source])
def test_every_table_round_trips(migrated: Store, table: str) -> None:
    before = read_back(migrated, table)  # schema_version has a row already
    rows = sample_rows(table)
    migrated.insert_arrow(f"{migrated.database}.{table}", rows)
    by_key = sorted(before + as_ns(rows), key=lambda row: [row[k] for k in BY_NAME[table].order_by])
    assert repr(read_back(migrated, table)) == repr(by_key)  # repr: NaN equals NaN


def test_materialized_duration_is_computed_by_the_engine(migrated: Store) -> None:
    migrated.insert_arrow("spans", sample_rows("spans"))
    got = migrated.query_arrow(f"SELECT duration_ns FROM {migrated.database}.spans ORDER BY rank")["duration_ns"].to_pylist()
    assert got == [12_345_678, 12_345_679, 12_345_680]


def test_step_segments_sum_the_pieces_of_each_ranks_segment_per_step(migrated: Store) -> None:
    rows = sample_rows("spans")  # three ranks, one piece each
    for _ in range(2):  # a second piece of the same segment, step and rank: totals add up
        migrated.insert_arrow("spans", rows)
    got = migrated.query_arrow(
        f"SELECT rank, step, name, sum(total_ns) AS total, sum(pieces) AS pieces FROM {migrated.database}.step_segments "
        "GROUP BY rank, step, name ORDER BY rank"
    ).to_pylist()
    assert [(g["rank"], g["total"], g["pieces"]) for g in got] == [
        (r, 2 * d, 2) for r, d in zip(rows["rank"].to_pylist(), [12_345_678, 12_345_679, 12_345_680])
    ]
    cpu = migrated.query_arrow(
        f"SELECT rank, sum(total_cpu_ns) AS cpu, sum(cpu_pieces) AS measured FROM {migrated.database}.step_segments "
        "GROUP BY rank ORDER BY rank"
    ).to_pylist()  # only measured pieces count: the rank whose CPU time is -1 has none
    assert [(c["cpu"], c["measured"]) for c in cpu] == [(18_000_000, 2), (0, 0), (22_000_000, 2)]
    assert {(g["step"], g["name"]) for g in got} == set(zip(rows["step"].to_pylist(), rows["name"].to_pylist()))


def test_timestamps_with_or_without_utc_zone_and_in_microseconds_store_the_same_instant(migrated: Store) -> None:
    rows = sample_rows("heartbeats", 1)
    i = rows.schema.get_field_index("time")
    for t in (pa.timestamp("ns"), pa.timestamp("ns", tz="UTC"), pa.timestamp("us")):
        migrated.insert_arrow("heartbeats", rows.set_column(i, "time", rows["time"].cast(t, safe=False)))
    got = migrated.query_arrow(f"SELECT toUnixTimestamp64Nano(time) AS t FROM {migrated.database}.heartbeats ORDER BY t")
    assert got["t"].to_pylist() == [T0 // 1000 * 1000, T0, T0]


@pytest.mark.parametrize(
    ("column", "values", "message"),
    [
        ("rank", pa.array(["0", "one", "2"]), "spans.rank: cannot store string as uint32"),
        ("rank", pa.array([0, -1, 2]), "spans.rank: cannot store int64 as uint32"),
        ("step", pa.array([1, None, 3], pa.uint32()), "spans.step: 1 null values"),
    ],
)
def test_insert_refuses_values_the_column_cannot_hold(migrated: Store, column: str, values: pa.Array, message: str) -> None:
    rows = sample_rows("spans")
    with pytest.raises(QueryError, match=message):
        migrated.insert_arrow("spans", rows.set_column(rows.schema.get_field_index(column), column, values))
    with pytest.raises(QueryError, match="spans: columns must be"):
        migrated.insert_arrow("spans", rows.drop_columns(["microbatch"]))
    with pytest.raises(StoreError, match="unknown table 'nope'"):
        migrated.insert_arrow("nope", rows)
    assert read_back(migrated, "spans") == []


def test_concurrent_inserts_from_threads_each_store_their_own_rows(migrated: Store) -> None:
    errors: list[BaseException] = []

    def insert(k: int) -> None:
        try:
            for j in range(5):
                migrated.insert_arrow("spans", sample_rows("spans", 100 + k, run_id=f"run-{k}-{j}"))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=insert, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    counts = migrated.query_arrow(f"SELECT run_id, count() AS n FROM {migrated.database}.spans GROUP BY run_id").to_pylist()
    assert {c["run_id"]: c["n"] for c in counts} == {f"run-{k}-{j}": 100 + k for k in range(4) for j in range(5)}


def test_parameters_are_bound_by_the_engine_never_pasted(migrated: Store) -> None:
    migrated.insert_arrow("runs", sample_rows("runs"))
    sql = f"SELECT run_id FROM {migrated.database}.runs WHERE run_id = {{run:String}}"
    assert migrated.query_arrow(sql, {"run": "x' OR 1=1 --"}).num_rows == 0
    assert migrated.query_arrow(sql, {"run": "run-1-1"})["run_id"].to_pylist() == ["run-1-1"]
    tricky = "a'b\\c\td\n' ; DROP TABLE runs --"
    echo = "SELECT {s:String} AS s, {xs:Array(String)} AS xs, {n:UInt32} AS n"
    echoed = migrated.query_arrow(echo, {"s": tricky, "xs": [tricky, "y"], "n": 7})
    assert echoed.to_pylist() == [{"s": tricky, "xs": [tricky, "y"], "n": 7}]
    with pytest.raises(QueryError, match="cannot be parsed as UInt32"):
        migrated.query_arrow("SELECT {n:UInt32} AS n", {"n": "1 OR 1=1"})
    assert migrated.query_arrow(f"SELECT count() AS n FROM {migrated.database}.runs")["n"][0].as_py() == 3


def test_readonly_setting_refuses_writes_for_that_query_only(migrated: Store) -> None:
    insert = f"INSERT INTO {migrated.database}.metrics (run_id) VALUES ('x')"
    with pytest.raises(QueryError, match="readonly"):
        migrated.query_arrow(insert, settings={"readonly": 1})
    with pytest.raises(QueryError, match="readonly"):  # and a query cannot lift it
        migrated.query_arrow("SELECT 1 SETTINGS readonly = 0", settings={"readonly": 1})
    migrated.command(insert)
    assert migrated.query_arrow(f"SELECT count() AS n FROM {migrated.database}.metrics")["n"][0].as_py() == 1


def test_result_limits_apply_to_that_query(migrated: Store) -> None:
    sql = "SELECT number FROM system.numbers LIMIT 100000"
    with pytest.raises(QueryError, match="TOO_MANY_ROWS_OR_BYTES"):
        migrated.query_arrow(sql, settings={"max_result_rows": 1000, "result_overflow_mode": "throw"})
    cut = migrated.query_arrow(sql, settings={"max_result_rows": 1000, "result_overflow_mode": "break"})
    assert 1000 <= cut.num_rows < 100000  # "break" stops at a block boundary past the limit
    with pytest.raises(QueryError, match="TIMEOUT_EXCEEDED|Timeout exceeded"):
        slow = "SELECT count() FROM system.numbers WHERE sleepEachRow(0.1) = 0"
        migrated.query_arrow(slow, settings={"max_execution_time": 0.2, "max_block_size": 1})
    assert migrated.query_arrow(sql).num_rows == 100000
    with pytest.raises(StoreError, match="not a plain name and value"):
        migrated.query_arrow("SELECT 1", settings={"max_result_rows": "1&readonly=0"})


def test_bad_sql_keeps_the_engine_message(migrated: Store) -> None:
    with pytest.raises(QueryError, match="Syntax error"):
        migrated.query_arrow("SELEC 1")
    with pytest.raises(QueryError, match="UNKNOWN_TABLE|Unknown table"):
        migrated.query_arrow(f"SELECT * FROM {migrated.database}.nope")


def test_collective_lookup_by_group_and_seq_reads_the_projection(migrated: Store) -> None:
    n, ranks = 200_000, 64
    rows = sample_rows("collectives", n)
    rank = np.arange(n) % ranks
    rows = rows.set_column(1, "rank", pa.array(rank, pa.uint32()))
    rows = rows.set_column(2, "group_name", pa.array(np.where(rank % 2, "dp[1]", "dp[0]")))
    rows = rows.set_column(3, "seq", pa.array(np.arange(n) // ranks, pa.int64()))
    migrated.insert_arrow("collectives", rows)
    lookup = (f"SELECT rank, end_time FROM {migrated.database}.collectives "
              "WHERE run_id = {run:String} AND group_name = {group:String} AND seq = {seq:Int64}")
    params = {"run": "run-1", "group": "dp[1]", "seq": 1234}
    plan = "\n".join(migrated.query_arrow("EXPLAIN indexes = 1, projections = 1 " + lookup, params).column(0).to_pylist())
    assert "ReadFromMergeTree (by_group_seq)" in plan
    granules = next(line for line in plan.splitlines() if line.strip().startswith("Granules:")).split()[-1]
    assert int(granules.split("/")[0]) <= 2 < int(granules.split("/")[1])
    assert sorted(migrated.query_arrow(lookup, params)["rank"].to_pylist()) == list(range(1, ranks, 2))


# --- migrations --------------------------------------------------------------------------------


def versions(store: Store) -> list[int]:
    return store.query_arrow(f"SELECT version FROM {store.database}.schema_version ORDER BY version")["version"].to_pylist()


def test_migrate_creates_then_is_idempotent(store: Store) -> None:
    assert migrate(store, store.database, None) == SCHEMA_VERSION
    assert migrate(store, store.database, None) == SCHEMA_VERSION
    assert versions(store) == [m.version for m in MIGRATIONS]
    row = store.query_arrow(f"SELECT DISTINCT rankscope_version FROM {store.database}.schema_version").to_pylist()
    from rankscope import __version__

    assert row == [{"rankscope_version": __version__}]
    assert MIGRATIONS[-1].version == SCHEMA_VERSION


def test_the_attempts_step_refills_the_step_rollup_from_the_spans_already_stored(store: Store) -> None:
    migrate(store, store.database, None, steps=MIGRATIONS[:1])
    store.insert_arrow("spans", sample_rows("spans", 4))
    store.command(f"TRUNCATE TABLE {store.database}.step_segments")  # as a version-1 rollup would be dropped
    assert migrate(store, store.database, None) == SCHEMA_VERSION
    rows = store.query_arrow(
        f"SELECT attempt, step, rank, sum(total_ns) AS total FROM {store.database}.step_segments GROUP BY attempt, step, rank ORDER BY step"
    ).to_pylist()
    assert [(r["attempt"], r["step"], r["rank"]) for r in rows] == [(0, 1, 0), (1, 2, 1), (0, 3, 2), (1, 4, 3)]
    assert all(r["total"] > 12_000_000 for r in rows)


@pytest.mark.parametrize(
    ("name", "key", "shown", "added_before", "version"),
    [("ranks", "rank", "host", {"attempt", "world", "cycle"}, 6), ("groups", "name", "ranks", {"cycle"}, 7)],
)
def test_a_step_that_keys_a_table_by_attempt_keeps_its_rows_of_every_attempt(
    store: Store, name: str, key: str, shown: str, added_before: set[str], version: int
) -> None:
    """``ranks`` (version 6) and ``groups`` (version 7), keyed without the attempt: the engine's merges
    kept one row of a rank's (a group's) every attempt. The step makes the table anew, keyed by it."""
    db = store.database
    migrate(store, db, None)
    table = BY_NAME[name]
    rows = sample_rows(name, 2)
    rows = rows.set_column(rows.schema.get_field_index(key), key, pa.array([rows[key][0].as_py()] * 2, rows.schema.field(key).type))
    rows = rows.set_column(rows.schema.get_field_index("attempt"), "attempt", pa.array([0, 1], pa.uint16()))
    store.insert_arrow(name, rows.slice(0, 1))  # the first attempt's row, moved into the old table below
    # the table as the version before left it: keyed without the attempt, its later columns added at its end
    later = {"attempt", "world", "cycle"} & {c.name for c in table.columns}
    old = replace(table, name=f"{name}_old", columns=tuple(c for c in table.columns if c.name not in later),
                  order_by=tuple(k for k in table.order_by if k != "attempt"))  # fmt: skip
    for sql in create_statements(db, tables=[old])[1:]:
        store.command(sql)
    for column in (c for c in table.columns if c.name in added_before):
        for sql in add_column_statements(replace(table, name=old.name), column, db, None):
            store.command(sql)
    columns = ", ".join([c.name for c in old.columns] + sorted(added_before & {"attempt", "world"}))
    store.command(f"INSERT INTO {db}.{old.name} ({columns}) SELECT {columns} FROM {db}.{name}")
    store.command(f"DROP TABLE {db}.{name}")
    store.command(f"RENAME TABLE {db}.{old.name} TO {db}.{name}")
    store.command(f"DELETE FROM {db}.schema_version WHERE version >= {version}")
    assert migrate(store, db, None) == SCHEMA_VERSION
    store.insert_arrow(name, rows.slice(1, 1))  # the next attempt's row, after the step
    store.command(f"OPTIMIZE TABLE {db}.{name} FINAL")  # a merge: before, it kept attempt 1's row alone
    kept = store.query_arrow(f"SELECT attempt, {shown} FROM {db}.{name} ORDER BY attempt").to_pylist()
    assert kept == [{"attempt": a, shown: rows[shown][a].as_py()} for a in (0, 1)]
    assert store.query_arrow(f"SELECT count() AS n FROM system.tables WHERE database = '{db}' AND name = '{name}_by_attempt'")["n"][0].as_py() == 0
    assert migrate(store, db, None) == SCHEMA_VERSION  # nothing more to do


def test_migrate_runs_only_the_newer_steps_and_records_each(store: Store) -> None:
    migrate(store, store.database, None)
    later = SCHEMA_VERSION + 1
    note = Migration(later, "add a note to runs", lambda db, _days, _cluster: [f"ALTER TABLE {db}.runs ADD COLUMN IF NOT EXISTS note String"])
    assert migrate(store, store.database, None, steps=(*MIGRATIONS, note)) == later
    assert migrate(store, store.database, None, steps=(*MIGRATIONS, note)) == later
    assert versions(store) == [*range(1, later + 1)]
    columns = store.query_arrow(f"DESCRIBE TABLE {store.database}.runs")["name"].to_pylist()
    assert columns[-1] == "note"
    # This rankscope (which knows only up to SCHEMA_VERSION) now refuses the store.
    with pytest.raises(StoreVersionError, match=f"was written by schema version {later}; this rankscope knows up to {SCHEMA_VERSION}: upgrade"):
        migrate(store, store.database, None)


def test_a_store_written_by_a_newer_rankscope_is_refused_untouched(store: Store) -> None:
    migrate(store, store.database, None)
    newer = sample_rows("schema_version", 1).set_column(0, "version", pa.array([SCHEMA_VERSION + 2], pa.uint32()))
    store.insert_arrow("schema_version", newer)
    with pytest.raises(StoreVersionError) as refused:
        migrate(store, store.database, 5)
    assert str(refused.value) == (
        f"store at {store.describe()} was written by schema version {SCHEMA_VERSION + 2}; "
        f"this rankscope knows up to {SCHEMA_VERSION}: upgrade rankscope"
    )
    assert retention(store, store.database)["spans"] == 0  # nothing changed


# --- opening -----------------------------------------------------------------------------------


def test_a_second_process_on_the_same_directory_is_told_it_is_busy(tmp_path: Path) -> None:
    path = tmp_path / "store"
    held = EmbeddedStore(path)
    try:
        probe = (
            "import sys\nfrom pathlib import Path\nfrom rankscope.collector.store.chdb import EmbeddedStore\n"
            "from rankscope.collector.store.base import StoreBusyError\n"
            "try:\n    EmbeddedStore(Path(sys.argv[1]))\nexcept StoreBusyError as e:\n    print(e)\n    sys.exit(3)\n"
        )
        # A fresh interpreter, never a fork of this one: chDB hangs in a forked child.
        done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60)
    finally:
        held.close()
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == f"store {path.resolve()} is in use by another process (is a collector running on it?)"


def test_one_process_holds_one_embedded_store_at_a_time(tmp_path: Path) -> None:
    first = EmbeddedStore(tmp_path / "a")
    try:
        with pytest.raises(StoreError, match="this process already has another chDB store open"):
            EmbeddedStore(tmp_path / "b")
    finally:
        first.close()
    second = EmbeddedStore(tmp_path / "b")  # once the first is closed
    assert "embedded chDB" in second.describe() and str(tmp_path / "b") in second.describe()
    second.close()
    with pytest.raises(StoreError, match="is closed"):
        second.query_arrow("SELECT 1")
    with pytest.raises(StoreError, match="is closed"):
        second.query_arrow("SELECT 1", settings={"readonly": 1})


def test_open_store_needs_exactly_one_place(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="either a store directory"):
        open_store()
    with pytest.raises(StoreError, match="either a store directory"):
        open_store(store_dir=tmp_path, clickhouse_url="http://localhost:8123")
    with pytest.raises(StoreError, match="must look like"):
        open_store(clickhouse_url="localhost:8123")


def test_an_unreachable_server_is_reported_as_such() -> None:
    with socket.socket() as s:  # a loopback port that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreUnreachableError, match=f"cannot reach ClickHouse at http://127.0.0.1:{port}/rankscope"):
        open_store(clickhouse_url=f"http://default:secret@127.0.0.1:{port}")

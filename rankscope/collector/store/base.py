"""What the collector needs from a store, whichever engine is behind it.

Two backends implement ``Store``: ``EmbeddedStore`` (chDB in this process, the default) and
``ServerStore`` (a ClickHouse server or cluster over HTTP). Callers see one set of errors with
messages a person can act on, and one Arrow shape for each table (``arrow_schema``): inserts are
checked against it here, because chDB silently wraps or truncates values of the wrong type
(-1 into UInt32 becomes 4294967295, 'abc' becomes 0) instead of refusing them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from rankscope.collector.store.schema import BY_NAME, CYCLE, Table


class StoreError(Exception):
    """The store could not do what was asked; the message says why and what to do."""


class StoreBusyError(StoreError):
    """The embedded store's data path is held by another process."""


class StoreUnreachableError(StoreError):
    """The ClickHouse server cannot be reached (down, wrong address, refused credentials)."""


class StoreVersionError(StoreError):
    """The store was written by a newer rankscope than this one."""


class QueryError(StoreError):
    """The engine refused a statement or its data (bad SQL, read-only, a limit, a wrong type)."""


class Store(Protocol):
    """A ClickHouse engine holding rankscope's tables; safe to call from several threads."""

    #: default database for unqualified table names in SQL
    database: str

    def describe(self) -> str:
        """Where the data lives, for start-up lines and error messages."""
        ...

    def command(self, sql: str) -> None:
        """Run a statement that returns nothing (DDL, ALTER, INSERT ... SELECT)."""
        ...

    def insert_arrow(self, table: str, data: pa.Table, *, cycle: int = 0) -> None:
        """Insert rows; ``table`` is "db.name" or "name", ``data`` has the table's insert columns;
        ``cycle``: the writer's flush cycle, stored in every row's ``cycle`` (see ``stamped``)."""
        ...

    def query_arrow(
        self,
        sql: str,
        params: Mapping[str, object] | None = None,
        *,
        settings: Mapping[str, object] | None = None,
    ) -> pa.Table:
        """Run a query; ``params`` fill ``{name:Type}`` placeholders, ``settings`` apply to it alone."""
        ...

    def close(self) -> None:
        """Release the engine or connection; the store cannot be used afterwards."""
        ...


def open_store(*, store_dir: Path | None = None, clickhouse_url: str | None = None, database: str = "rankscope") -> Store:
    """The embedded store in ``store_dir`` or the server at ``clickhouse_url`` (exactly one of them)."""
    # Imported here: chdb is large, and a process that imported it must never fork.
    if store_dir is not None and clickhouse_url is None:
        from rankscope.collector.store.chdb import EmbeddedStore

        return EmbeddedStore(store_dir, database=database)
    if clickhouse_url is not None and store_dir is None:
        from rankscope.collector.store.clickhouse import ServerStore

        return ServerStore(clickhouse_url, database=database)
    raise StoreError("give either a store directory (embedded chDB) or a ClickHouse URL, not both or neither")


def capped_table(batches: Iterable[pa.RecordBatch], schema: pa.Schema, settings: Mapping[str, object] | None) -> pa.Table:
    """The batches of a result as one table, decoding no further than ``max_result_bytes`` (QueryError).

    The engine counts a constant column once: ``SELECT repeat('x', 1000) FROM numbers(900000)``
    is 1 KB to its limit and 903 MB decoded (its Arrow output compresses the repeats). So the
    setting is held again here, batch by batch, before the whole result is in memory.
    """
    limit = int((settings or {}).get("max_result_bytes", 0))  # type: ignore[call-overload]
    kept: list[pa.RecordBatch] = []
    size = 0
    for batch in batches:
        size += batch.nbytes
        if limit and size > limit:
            raise QueryError(
                f"the result decodes to more than max_result_bytes={limit} ({size} bytes after {sum(b.num_rows for b in kept)}"
                " rows): narrow the query (TOO_MANY_ROWS_OR_BYTES)"
            )
        kept.append(batch)
    return pa.Table.from_batches(kept, schema=schema)


def table_spec(name: str) -> Table:
    """The description of rankscope's table ``name``; StoreError for a table it does not have."""
    if name not in BY_NAME:
        raise StoreError(f"unknown table {name!r}: rankscope's tables are {', '.join(BY_NAME)}")
    return BY_NAME[name]


def split_table_name(table: str, default_database: str) -> tuple[str, Table]:
    """("db", its Table) for "db.name" or "name"."""
    database, _, name = table.rpartition(".")
    return database or default_database, table_spec(name)


# --- Arrow shapes ------------------------------------------------------------------------------

_SCALARS: dict[str, pa.DataType] = {
    "String": pa.string(),
    "UInt8": pa.uint8(),
    "UInt16": pa.uint16(),
    "UInt32": pa.uint32(),
    "UInt64": pa.uint64(),
    "Int32": pa.int32(),
    "Int64": pa.int64(),
    "Float64": pa.float64(),
    "DateTime64(9)": pa.timestamp("ns", tz="UTC"),
}


def arrow_type(clickhouse_type: str) -> pa.DataType:
    """The Arrow type a column of this ClickHouse type is inserted as (the types schema.py uses)."""
    inner = re.fullmatch(r"(LowCardinality|Array)\((.*)\)", clickhouse_type)
    if inner:
        element = arrow_type(inner.group(2))
        return pa.list_(element) if inner.group(1) == "Array" else element
    aggregate = re.fullmatch(r"SimpleAggregateFunction\(\w+, (.*)\)", clickhouse_type)
    if aggregate:  # a rollup column holds plain values of its argument type
        return arrow_type(aggregate.group(1))
    fixed = re.fullmatch(r"FixedString\((\d+)\)", clickhouse_type)
    if fixed:
        return pa.binary(int(fixed.group(1)))
    if clickhouse_type not in _SCALARS:
        raise ValueError(f"no Arrow type for ClickHouse type {clickhouse_type} (extend base._SCALARS)")
    return _SCALARS[clickhouse_type]


@functools.cache
def arrow_schema(table: Table) -> pa.Schema:
    """The exact schema of an insert into ``table``: build batches with it and no cast is needed.
    Kept per table: the writer conforms every part to it, a registration's one-row parts too."""
    return pa.schema([pa.field(c.name, arrow_type(c.type)) for c in table.insert_columns])


def stamped(table: Table, data: pa.Table, cycle: int) -> pa.Table:
    """``data`` conformed, with the flush ``cycle`` that writes it as a last column when not 0: a row is
    committed with its cycle's batch ids, and removed at the next start without them (``cycles.py``)."""
    rows = conform(table, data)
    if not cycle:
        return rows
    if CYCLE not in table.columns:
        raise QueryError(f"{table.name} has no {CYCLE.name} column: the collector's writer does not fill it")
    return rows.append_column(pa.field(CYCLE.name, pa.uint64()), pa.array([cycle] * rows.num_rows, pa.uint64()))


def conform(table: Table, data: pa.Table) -> pa.Table:
    """``data`` as ``arrow_schema(table)``: same column names in order, values cast without loss.

    Timestamps without a time zone are taken as UTC. Raises QueryError naming the column when a
    column is missing, holds nulls, or has values its ClickHouse type cannot hold.
    """
    schema = arrow_schema(table)
    if data.column_names != schema.names:
        raise QueryError(f"{table.name}: columns must be {schema.names}, got {data.column_names}")
    for field, column in zip(schema, data.columns):
        if column.null_count:
            raise QueryError(f"{table.name}.{field.name}: {column.null_count} null values (the column is not Nullable)")
    if data.schema.equals(schema):
        return data
    columns = []
    for field, column in zip(schema, data.columns):
        try:
            columns.append(column.cast(field.type, safe=True))
        except pa.ArrowException as e:
            raise QueryError(f"{table.name}.{field.name}: cannot store {column.type} as {field.type}: {e}") from None
    return pa.Table.from_arrays(columns, schema=schema)

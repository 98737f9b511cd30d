"""The CREATE statements for rankscope's tables, generated from ``schema.TABLES``.

One description gives three layouts: the embedded store and a single server get one MergeTree
table per name; a cluster gets a replicated table ``<name>_local`` on every node plus a
Distributed table ``<name>`` over them, so readers and writers use the same names everywhere.
Rows of one run (and rank) land on one shard, which keeps ReplacingMergeTree's replacement and
per-rank scans local to a shard.
"""

from __future__ import annotations

from collections.abc import Sequence

from rankscope.collector.store.schema import BY_NAME, TABLES, Column, Index, Table

#: where each replicated table keeps its state in ClickHouse Keeper (macros filled in per node)
REPLICA_PATH = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"


def create_statements(
    database: str = "rankscope", *, retention_days: int | None = None, cluster: str | None = None, tables: Sequence[Table] = TABLES
) -> list[str]:
    """CREATE DATABASE and the CREATE TABLE of each of ``tables`` (default: all), all IF NOT EXISTS (safe to run again)."""
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    statements = [f"CREATE DATABASE IF NOT EXISTS {database}{on_cluster}"]
    for table in tables:
        if cluster:
            statements += [
                _create_table(table, database, retention_days, cluster),
                f"CREATE TABLE IF NOT EXISTS {database}.{table.name}{on_cluster} AS {database}.{table.name}_local "
                f"ENGINE = Distributed({cluster}, {database}, {table.name}_local, {sharding_key(table)})",
            ]
        else:
            statements.append(_create_table(table, database, retention_days, None))
        if table.source:
            statements.append(_create_view(table, database, cluster))
    return statements


def ttl_clause(table: Table, retention_days: int) -> str:
    """The TTL expression that drops a day's partition ``retention_days`` after it ended."""
    return f"toDateTime({table.time_column}) + INTERVAL {retention_days} DAY"


def storage_table(table: Table, cluster: str | None) -> str:
    """The name of the table that holds the rows (and the TTL): ``<name>_local`` on a cluster."""
    return f"{table.name}_local" if cluster else table.name


def sharding_key(table: Table) -> str:
    """Which shard a row goes to: per rank for per-rank tables, else per run.

    A rollup is filled on each shard from that shard's source rows, so it shards like its source
    where it keeps the rank (rows refilled through the Distributed table land where the view puts
    them); one without the rank is merged across shards when read, and refilled per run.
    """
    names = [c.name for c in table.columns]
    if table.source:
        source = sharding_key(BY_NAME[table.source])
        return source if "rank" in names or "rank" not in source else "cityHash64(run_id)"
    if names[:2] == ["run_id", "rank"]:
        return "cityHash64(run_id, rank)"
    if names[0] == "run_id":
        return "cityHash64(run_id)"
    return "rand()"


def _create_table(table: Table, database: str, retention_days: int | None, cluster: str | None) -> str:
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    body = [f"    {_column(c)}" for c in table.columns]
    body += [f"    INDEX {_index(i)}" for i in table.indexes]
    body += [f"    PROJECTION {p.name} ({p.select})" for p in table.projections]
    lines = [
        f"CREATE TABLE IF NOT EXISTS {database}.{storage_table(table, cluster)}{on_cluster}",
        "(",
        ",\n".join(body),
        ")",
        f"ENGINE = {_engine(table, cluster)}",
    ]
    if table.time_column:
        lines.append(f"PARTITION BY toDate({table.time_column})")
    order_by = ", ".join(table.order_by)
    lines.append(f"ORDER BY {order_by if len(table.order_by) == 1 else f'({order_by})'}")
    if table.time_column:
        if retention_days is not None:
            lines.append(f"TTL {ttl_clause(table, retention_days)}")
        # Whole day partitions expire at once instead of being rewritten row by row; set
        # even without retention so that a TTL added later behaves the same.
        lines.append("SETTINGS ttl_only_drop_parts = 1")
    lines.append(f"COMMENT {_quote(table.doc)}")
    return "\n".join(lines)


def add_column_statements(table: Table, column: Column, database: str, cluster: str | None) -> list[str]:
    """ALTER TABLE ... ADD COLUMN IF NOT EXISTS for ``column`` of ``table`` (on a cluster: the local
    table on every node, then the Distributed table over them)."""
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    names = [storage_table(table, cluster), table.name] if cluster else [table.name]
    return [f"ALTER TABLE {database}.{name}{on_cluster} ADD COLUMN IF NOT EXISTS {_column(column)}" for name in names]


def add_index_statements(table: Table, index: Index, database: str, cluster: str | None) -> list[str]:
    """ALTER TABLE ... ADD INDEX IF NOT EXISTS, then MATERIALIZE INDEX for the parts already written
    (a mutation the engine runs in the background), on the table that holds the rows."""
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    name = f"{database}.{storage_table(table, cluster)}{on_cluster}"
    return [f"ALTER TABLE {name} ADD INDEX IF NOT EXISTS {_index(index)}", f"ALTER TABLE {name} MATERIALIZE INDEX {index.name}"]


def drop_rollup_statements(table: Table, database: str, cluster: str | None) -> list[str]:
    """DROP the rollup ``table`` and the view that fills it (to create it again with a new shape)."""
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    names = [f"{table.name}_mv", storage_table(table, cluster), *([table.name] if cluster else [])]
    return [f"DROP TABLE IF EXISTS {database}.{name}{on_cluster}" for name in names]


def backfill_rollup_statement(table: Table, database: str, source: str = "") -> str:
    """Fill the rollup ``table`` from every row its source holds now (through the Distributed tables
    on a cluster, which shard the rollup's rows as the view would), or from ``source``: a subquery
    of some of them."""
    columns = ", ".join(c.name for c in table.columns)
    return f"INSERT INTO {database}.{table.name} ({columns}) {table.view.format(source=source or f'{database}.{table.source}')}"


def _create_view(table: Table, database: str, cluster: str | None) -> str:
    """The materialized view that fills a rollup table from its source as rows are inserted.

    On a cluster it reads and writes the shard-local tables, so each node rolls up its own rows.
    """
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    source = f"{database}.{table.source}_local" if cluster else f"{database}.{table.source}"
    select = table.view.format(source=source)
    return (
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.{table.name}_mv{on_cluster} "
        f"TO {database}.{storage_table(table, cluster)} AS {select}"
    )


def _engine(table: Table, cluster: str | None) -> str:
    family = "AggregatingMergeTree" if table.source else "ReplacingMergeTree" if table.version_column else "MergeTree"
    args = [REPLICA_PATH] if cluster else []
    if table.version_column:
        args.append(table.version_column)
    return f"{'Replicated' if cluster else ''}{family}({', '.join(args)})"


def _index(index: Index) -> str:
    return f"{index.name} {index.expression} TYPE {index.type} GRANULARITY {index.granularity}"


def _column(column: Column) -> str:
    parts = [column.name, column.type]
    if column.materialized:
        parts.append(f"MATERIALIZED {column.materialized}")
    if column.default:
        parts.append(f"DEFAULT {column.default}")
    if column.comment:
        parts.append(f"COMMENT {_quote(column.comment)}")
    if column.codec:
        parts.append(column.codec)
    return " ".join(parts)


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"

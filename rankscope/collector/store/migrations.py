"""Bring a store to this rankscope's schema version, and keep its retention as asked.

Every step is recorded as a row of ``schema_version`` once its statements succeeded, so the
table is the store's history and its highest version is the store's version. A step's
statements must be safe to run again (IF NOT EXISTS, ADD COLUMN IF NOT EXISTS, ...): a collector
stopped half-way through a step runs it again at its next start.

When a table's shape changes: bump ``schema.SCHEMA_VERSION``, describe the new shape in
``schema.py`` (new stores are created from it by step 1) and append a step that brings older
stores there (ALTER TABLE ... ADD COLUMN IF NOT EXISTS, MATERIALIZE PROJECTION, ...).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pyarrow as pa

from rankscope import __version__

from rankscope.collector.store.base import Store, StoreVersionError, arrow_schema
from rankscope.collector.store.ddl import (
    add_column_statements,
    add_index_statements,
    backfill_rollup_statement,
    create_statements,
    drop_rollup_statements,
    storage_table,
    ttl_clause,
)
from rankscope.collector.store.schema import ATTEMPT, BY_NAME, CYCLE, SCHEMA_VERSION, TABLES, WORLD, Column


Step = Callable[[str, int | None, str | None], list[str]]
Needed = Callable[[Store, str, str | None], bool]


@dataclass(frozen=True)
class Migration:
    """One step forward: the statements that bring a store from version - 1 to ``version``."""

    version: int
    doc: str
    #: (database, retention_days, cluster) -> statements
    statements: Step
    #: (store, database, cluster) -> whether the store still needs the statements (for steps that
    #: cannot be written to be safe to run again, run again after a stop half-way: a table made anew)
    needed: Needed | None = None


def _attempts(database: str, retention_days: int | None, cluster: str | None) -> list[str]:
    """Version 2: restarts of a run are attempts of it. Every per-rank table gets ``attempt`` (0 for
    the rows already there); ``step_segments`` is keyed by it, so its rollup is made again and refilled
    from ``spans``; the self-healing tables ``actions`` and ``selfchecks`` are new."""
    statements = [
        sql
        for table in TABLES
        if not table.source and ATTEMPT in table.columns and table.name != "actions"
        for sql in add_column_statements(table, ATTEMPT, database, cluster)
    ]
    statements += add_column_statements(BY_NAME["ranks"], WORLD, database, cluster)
    rollup = BY_NAME["step_segments"]
    statements += drop_rollup_statements(rollup, database, cluster)
    new = [rollup, BY_NAME["actions"], BY_NAME["selfchecks"]]
    statements += create_statements(database, retention_days=retention_days, cluster=cluster, tables=new)[1:]
    return [*statements, backfill_rollup_statement(rollup, database)]


#: the rollups version 3 added: the live diagnosis's state, bounded however long a run grows
DIAGNOSIS_ROLLUPS = ("rank_state", "entered", "gpu_signals", "step_losses")


def _bounded_diagnosis(database: str, retention_days: int | None, cluster: str | None) -> list[str]:
    """Version 3: the live diagnosis reads a bounded state instead of a run's history. The rollups
    of each rank's latest heartbeat, the sequence numbers entered, GPU fault signals and per-step
    losses are new and filled from the rows already stored (dropped first: a step run again must
    not count rows twice); the per-rank tables it reads by step get a step-range index (materialized
    for their parts in the background)."""
    rollups = [BY_NAME[name] for name in DIAGNOSIS_ROLLUPS]
    statements = [sql for table in rollups for sql in drop_rollup_statements(table, database, cluster)]
    statements += create_statements(database, retention_days=retention_days, cluster=cluster, tables=rollups)[1:]
    statements += [backfill_rollup_statement(table, database) for table in rollups]
    return statements + [sql for table in TABLES for index in table.indexes for sql in add_index_statements(table, index, database, cluster)]


def _node_states(database: str, retention_days: int | None, cluster: str | None) -> list[str]:
    """Version 4: a node's life as healing sees it is stored (``node_states`` is new)."""
    return create_statements(database, retention_days=retention_days, cluster=cluster, tables=[BY_NAME["node_states"]])[1:]


def _cycles(database: str, retention_days: int | None, cluster: str | None) -> list[str]:
    """Version 5: every row the collector's writer stores says which flush cycle wrote it (``cycle``, 0
    for the rows already there, all committed), so that rows whose batch ids never reached ``batches``
    are rolled back (``cycles.py``)."""
    return [sql for table in TABLES if CYCLE in table.columns for sql in add_column_statements(table, CYCLE, database, cluster)]


def _keyed_by_attempt(name: str, *, added: tuple[Column, ...] = ()) -> tuple[Step, Needed]:
    """A step that makes table ``name`` anew in its schema's sorting key, which holds ``attempt``: keyed
    without it, the engine's merges replaced a row of one attempt by the next attempt's. The new
    table is filled from the old one (by column name, as the old table's later columns were added at
    its end; the columns the step ``added`` take their defaults), and the two exchanged; the check tells
    whether a store still needs it (its key lacks ``attempt``: safe after a stop half-way)."""
    old = BY_NAME[name]
    new = replace(old, name=f"{name}_by_attempt")

    def statements(database: str, retention_days: int | None, cluster: str | None) -> list[str]:
        on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
        columns = ", ".join(c.name for c in old.columns if c not in added)
        drop = [f"DROP TABLE IF EXISTS {database}.{table}{on_cluster}" for table in {storage_table(new, cluster), new.name}]
        foreground = " SETTINGS distributed_foreground_insert = 1" if cluster else ""  # in the new tables before they are exchanged
        return [
            *drop,  # a copy left by a step stopped half-way
            *create_statements(database, retention_days=retention_days, cluster=cluster, tables=[new])[1:],
            f"INSERT INTO {database}.{new.name} ({columns}) SELECT {columns} FROM {database}.{old.name}{foreground}",
            f"EXCHANGE TABLES {database}.{storage_table(old, cluster)} AND {database}.{storage_table(new, cluster)}{on_cluster}",
            *drop,
        ]

    def needed(store: Store, database: str, cluster: str | None) -> bool:
        rows = store.query_arrow(
            "SELECT sorting_key FROM system.tables WHERE database = {db:String} AND name = {name:String}",
            {"db": database, "name": storage_table(old, cluster)},
        ).to_pylist()
        return bool(rows) and "attempt" not in rows[0]["sorting_key"]

    return statements, needed


#: Version 6: ``ranks`` keeps each rank's row of every attempt: who each rank was before a restart (its
#: host, its process) was lost at the engine's next merge (a Slurm drill's store held the last
#: attempt's rows alone, session 37).
_RANKS_BY_ATTEMPT = _keyed_by_attempt("ranks")
#: Version 7: ``groups`` keeps each attempt's groups (``attempt`` is new, 0 for the rows already there):
#: a restart that changes the layout replaced the earlier attempts' membership.
_GROUPS_BY_ATTEMPT = _keyed_by_attempt("groups", added=(ATTEMPT,))


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "create the tables", lambda db, days, cluster: create_statements(db, retention_days=days, cluster=cluster)),
    Migration(2, "attempts of a run, self-healing actions and self-checks", _attempts),
    Migration(3, "a bounded state for the live diagnosis: rollups and step-range indexes", _bounded_diagnosis),
    Migration(4, "nodes' states as healing sees them", _node_states),
    Migration(5, "each row's flush cycle: a batch's rows and its id stored together or not at all", _cycles),
    Migration(6, "a rank's row of every attempt kept: ranks keyed by attempt", *_RANKS_BY_ATTEMPT),
    Migration(7, "each attempt's process groups kept: groups keyed by attempt", *_GROUPS_BY_ATTEMPT),
)


def migrate(
    store: Store,
    database: str,
    retention_days: int | None,
    *,
    cluster: str | None = None,
    steps: Sequence[Migration] = MIGRATIONS,
) -> int:
    """Create or migrate the store forward; returns its version. Idempotent.

    ``retention_days``: None leaves an existing store's retention as it is (a new store then
    keeps everything), 0 removes it, N keeps N days (by day partition). Raises StoreVersionError
    when a newer rankscope wrote the store, and changes nothing then.
    """
    current = stored_version(store, database)
    known = steps[-1].version
    if current > known:
        raise StoreVersionError(
            f"store at {store.describe()} was written by schema version {current}; "
            f"this rankscope knows up to {known}: upgrade rankscope"
        )
    fresh = current == 0
    for step in steps:
        if step.version > current:
            # A new store is created in this rankscope's shape by step 1: the steps up to this
            # schema version only bring older stores there, and are recorded without running.
            if not (fresh and 1 < step.version <= SCHEMA_VERSION) and (step.needed is None or step.needed(store, database, cluster)):
                for sql in step.statements(database, retention_days, cluster):
                    store.command(sql)
            _record(store, database, step.version)
            current = step.version
    if retention_days is not None:
        set_retention(store, database, retention_days, cluster=cluster)
    return current


def stored_version(store: Store, database: str) -> int:
    """The store's schema version: 0 for a store without rankscope's tables."""
    exists = store.query_arrow(
        "SELECT count() AS n FROM system.tables WHERE database = {db:String} AND name = 'schema_version'",
        {"db": database},
    )
    if exists["n"][0].as_py() == 0:
        return 0
    rows = store.query_arrow(f"SELECT max(version) AS v FROM {database}.schema_version")
    return int(rows["v"][0].as_py() or 0)


def set_retention(store: Store, database: str, retention_days: int, *, cluster: str | None = None) -> None:
    """Make every table with a time column keep ``retention_days`` days (0: forever), if not already so."""
    on_cluster = f" ON CLUSTER {cluster}" if cluster else ""
    current = retention(store, database, cluster=cluster)
    for table in TABLES:
        if not table.time_column or current.get(table.name, 0) == retention_days:
            continue
        change = f"MODIFY TTL {ttl_clause(table, retention_days)}" if retention_days else "REMOVE TTL"
        store.command(f"ALTER TABLE {database}.{storage_table(table, cluster)}{on_cluster} {change}")


def retention(store: Store, database: str, *, cluster: str | None = None) -> dict[str, int]:
    """Days each table with a time column keeps (0: no TTL), read from the engine's own DDL."""
    names = [storage_table(t, cluster) for t in TABLES if t.time_column]
    rows = store.query_arrow(
        "SELECT name, engine_full FROM system.tables WHERE database = {db:String} AND has({names:Array(String)}, name)",
        {"db": database, "names": names},
    )
    days = {}
    for name, engine in zip(rows["name"].to_pylist(), rows["engine_full"].to_pylist()):
        found = re.search(r"\bTTL .*?toIntervalDay\((\d+)\)", engine)
        days[name.removesuffix("_local") if cluster else name] = int(found.group(1)) if found else 0
    return days


def _record(store: Store, database: str, version: int) -> None:
    table = BY_NAME["schema_version"]
    row = pa.table({"version": [version], "applied": [time.time_ns()], "rankscope_version": [__version__]}, schema=arrow_schema(table))
    store.insert_arrow(f"{database}.{table.name}", row)

"""Flush cycles: what makes a batch's rows and its id stored together or not at all.

ClickHouse has no transaction over several tables, and the writer stores one flush cycle's rows with
an insert per table, then the cycle's batch ids into ``batches``. A collector killed between the
two left rows whose batch ids were never recorded: the agents send those batches again, and they
were stored twice. So every row the writer inserts carries its cycle (``schema.CYCLE``, a number
that only grows), the ``batches`` rows carry it too, and those are the cycle's commit: a cycle
without batch rows never happened. ``roll_back`` removes the rows of cycles after the last
committed one, on the store as it is after a kill, before the collector takes batches again (and
when a commit fails while it runs). The same SQL runs on chDB and on a ClickHouse server.

The rollups (tables with a ``source``) are filled by materialized views as rows are inserted, and
removing source rows does not take them out of a rollup: for the runs that had rows rolled back, a
rollup's rows are made again from the source's committed rows. Rollups first, source rows last, so
that a collector killed during a roll back finds the same runs to roll back at its next start.
"""

from __future__ import annotations

import logging

from clickhouse_connect.driver.binding import format_bind_value

from rankscope.collector.store.base import Store
from rankscope.collector.store.ddl import backfill_rollup_statement
from rankscope.collector.store.schema import BY_NAME, CYCLE, TABLES, Table

log = logging.getLogger(__name__)

#: mutations run synchronously (every replica) before the statement returns: the rows are gone then
_SYNC = "SETTINGS mutations_sync = 2"


def committed(store: Store, database: str) -> int:
    """The last committed cycle: the highest in ``batches`` (0 when none is)."""
    rows = store.query_arrow(f"SELECT max({CYCLE.name}) AS cycle FROM {database}.batches")
    return int(rows["cycle"][0].as_py() or 0)


def roll_back(store: Store, database: str) -> tuple[int, dict[str, int]]:
    """Remove every row of a cycle after the last committed one, and make the rollups of the runs
    they belonged to again; returns (the last committed cycle, rows removed per table).

    A lightweight DELETE is not used: on chDB 26.9 a table's projection (``collectives``) still
    returns the deleted rows until its parts merge; ``ALTER TABLE ... DELETE`` rewrites them.
    """
    last = committed(store, database)
    cycled = [t for t in TABLES if CYCLE in t.columns]
    runs: dict[str, list[str]] = {}
    removed: dict[str, int] = {}
    for table in cycled:
        found = store.query_arrow(
            f"SELECT run_id, count() AS n FROM {database}.{table.name} WHERE {CYCLE.name} > {{last:UInt64}} GROUP BY run_id",
            {"last": last},
        ).to_pydict()
        if found["run_id"]:
            runs[table.name] = sorted(found["run_id"])
            removed[table.name] = sum(found["n"])
    for rollup in (t for t in TABLES if t.source in runs):
        _rebuild(store, database, rollup, runs[rollup.source], last)
    for name in runs:
        store.command(f"ALTER TABLE {database}.{name} DELETE WHERE {CYCLE.name} > {last} {_SYNC}")
    if removed:
        log.warning("rolled back the rows of flush cycles after %d, never committed: %s", last, removed)
    return last, removed


def _rebuild(store: Store, database: str, rollup: Table, runs: list[str], last: int) -> None:
    """The rollup's rows of ``runs`` made again from its source's rows of committed cycles."""
    among = f"run_id IN {format_bind_value(runs)}"
    store.command(f"ALTER TABLE {database}.{rollup.name} DELETE WHERE {among} {_SYNC}")
    columns = ", ".join(c.name for c in BY_NAME[rollup.source].columns)  # materialized ones too: * leaves them out
    kept = f"(SELECT {columns} FROM {database}.{rollup.source} WHERE {among} AND {CYCLE.name} <= {last})"
    store.command(backfill_rollup_statement(rollup, database, kept))

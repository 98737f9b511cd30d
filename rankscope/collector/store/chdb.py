"""The embedded store: chDB (the ClickHouse engine as a library) on a directory of this machine.

Facts about chDB 4.4 this module is built on (each checked by a test or by experiment):

- One process holds one data path, locked with flock on ``<path>/status``; a second process
  fails with an unhelpful "Error initializing EmbeddedServer", so the lock is probed to say
  which process-level problem it is. Inside the process any number of connections share the
  engine, which stops when the last one closes.
- ``INSERT ... SELECT ... FROM Python(name)`` finds ``name`` by walking the calling thread's
  Python frames, innermost first. Two threads running such queries on ONE connection at the
  same time read each other's object (measured: wrong sums, no error), while separate
  connections are safe and run in parallel. Hence a pool: each call borrows a connection that
  no other thread uses meanwhile.
- ``query(..., params=...)`` binds ``{name:Type}`` placeholders in the engine, as a server does.
- Settings given in the connection string are that connection's session settings, and with
  ``readonly=1`` a query cannot change them back. Per-query settings therefore get a fresh
  connection (about 0.2 ms) that is closed afterwards.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import chdb
import pyarrow as pa
from clickhouse_connect.driver.binding import format_bind_value

from rankscope.collector.store.base import QueryError, StoreBusyError, StoreError, capped_table, split_table_name, stamped

_SETTING_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_SETTING_VALUE = re.compile(r"[\w.\-]*")


class EmbeddedStore:
    """chDB with its data in ``path``; thread-safe (a pool of connections, one per concurrent call)."""

    def __init__(self, path: Path, *, database: str = "rankscope"):
        self.path = Path(path).resolve()
        self.database = database
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._closed = False
        self._target = str(self.path)
        first = self._connect("")
        # The database must exist before a connection can name it as its default.
        _run(first, f"CREATE DATABASE IF NOT EXISTS {database}")
        _run(first, f"USE {database}")
        self._target = f"{self.path}?database={database}"
        self._idle.append(first)

    def describe(self) -> str:
        return f"{self.path} (embedded chDB {chdb.__version__}, engine {chdb.engine_version})"

    def command(self, sql: str) -> None:
        with self._connection() as conn:
            _run(conn, sql)

    def insert_arrow(self, table: str, data: pa.Table, *, cycle: int = 0) -> None:
        database, spec = split_table_name(table, self.database)
        # chDB's Python() finds this object by its name in the caller's frames: the name must
        # not be one that a frame nearer to the engine (chdb's own query method) also uses.
        rankscope_insert_rows = stamped(spec, data, cycle)
        if rankscope_insert_rows.num_rows == 0:
            return
        columns = ", ".join(rankscope_insert_rows.column_names)
        sql = f"INSERT INTO {database}.{spec.name} ({columns}) SELECT {columns} FROM Python(rankscope_insert_rows)"
        with self._connection() as conn:
            _run(conn, sql)

    def query_arrow(
        self,
        sql: str,
        params: Mapping[str, object] | None = None,
        *,
        settings: Mapping[str, object] | None = None,
    ) -> pa.Table:
        bound = {name: format_bind_value(value) for name, value in (params or {}).items()}
        with self._connection(settings) as conn:  # decoded before the connection closes: it owns the result's memory
            result = _run(conn, sql, "Arrow", bound)
            if len(result) == 0:  # chDB's empty answer (a statement that returns nothing) has no schema
                return pa.table({})
            reader = pa.ipc.open_file(result.get_memview().view())
            return capped_table((reader.get_batch(i) for i in range(reader.num_record_batches)), reader.schema, settings)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    @contextmanager
    def _connection(self, settings: Mapping[str, object] | None = None) -> Iterator[Any]:
        """A connection no other thread uses until the block ends (its own one for settings)."""
        with self._lock:
            if self._closed:
                raise StoreError(f"store {self.path} is closed")
            conn = self._idle.pop() if self._idle and not settings else None
        conn = conn or self._connect(_settings_query(settings or {}))
        try:
            yield conn
        finally:
            with self._lock:
                keep = not self._closed and not settings
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

    def _connect(self, settings_query: str) -> Any:
        """A new connection to the engine (the first one starts it)."""
        target = f"{self._target}&{settings_query}" if settings_query else self._target
        try:
            return chdb.connect(target)
        except RuntimeError as e:
            raise _open_error(self.path, str(e)) from None


def _run(conn: Any, sql: str, fmt: str = "CSV", params: Mapping[str, str] | None = None) -> Any:
    try:
        return conn.query(sql, fmt, params=dict(params or {}))
    except RuntimeError as e:  # chdb.ChdbError is a RuntimeError
        raise QueryError(str(e).strip()) from None


def _settings_query(settings: Mapping[str, object]) -> str:
    """Settings as connection-string parameters; only plain names and values get through."""
    parts = []
    for name, value in settings.items():
        text = str(int(value)) if isinstance(value, bool) else str(value)
        if not _SETTING_NAME.fullmatch(name) or not _SETTING_VALUE.fullmatch(text):
            raise StoreError(f"setting {name}={value!r} is not a plain name and value")
        parts.append(f"{name}={text}")
    return "&".join(parts)


def _open_error(path: Path, message: str) -> StoreError:
    if _locked_elsewhere(path / "status"):
        return StoreBusyError(f"store {path} is in use by another process (is a collector running on it?)")
    if "already initialized with path" in message:
        return StoreError(f"cannot open store {path}: this process already has another chDB store open ({message})")
    return StoreError(f"cannot open store {path}: {message}")


def _locked_elsewhere(status_file: Path) -> bool:
    """Whether a ClickHouse engine holds the flock that guards the data path."""
    try:
        fd = os.open(status_file, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the descriptor also releases a lock this probe took
    return False

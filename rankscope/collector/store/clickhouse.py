"""A ClickHouse server (or cluster) as the store, over HTTP with clickhouse-connect.

One client serves every thread: without a session id the server keeps no per-session state
that two concurrent requests could fight over. Inserts send Arrow (the fastest path of
clickhouse-connect) with the column names, so the server is never asked to DESCRIBE the
table; query parameters travel as ``param_<name>`` and are bound by the server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import clickhouse_connect
import pyarrow as pa
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from rankscope.collector.store.base import QueryError, StoreError, StoreUnreachableError, capped_table, split_table_name, stamped

T = TypeVar("T")


class ServerStore:
    """The server at ``url`` = http[s]://user:password@host:8123/database (database optional)."""

    def __init__(self, url: str, *, database: str = "rankscope"):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StoreError(f"ClickHouse URL must look like http[s]://user:password@host:8123/database, got {url!r}")
        self.database = parts.path.strip("/") or database
        host = parts.hostname + (f":{parts.port}" if parts.port else "")
        self._where = urlunsplit((parts.scheme, host, f"/{self.database}", "", ""))  # no credentials
        try:
            self._client = clickhouse_connect.get_client(
                dsn=urlunsplit((parts.scheme, parts.netloc, "", "", "")),
                database=self.database,
                autogenerate_session_id=False,
            )
        except OperationalError as e:
            raise StoreUnreachableError(f"cannot reach ClickHouse at {self._where}: {_reason(e)}") from None
        except DatabaseError as e:  # e.g. refused credentials
            raise StoreUnreachableError(f"ClickHouse at {self._where} refused the connection: {_reason(e)}") from None

    def describe(self) -> str:
        return f"{self._where} (ClickHouse {self._client.server_version})"

    def command(self, sql: str) -> None:
        # Without the default database: the statements that create it run through here.
        self._call(self._client.command, sql, use_database=False)

    def insert_arrow(self, table: str, data: pa.Table, *, cycle: int = 0) -> None:
        database, spec = split_table_name(table, self.database)
        rows = stamped(spec, data, cycle)
        if rows.num_rows:
            self._call(self._client.insert_arrow, spec.name, rows, database=database)

    def query_arrow(
        self,
        sql: str,
        params: Mapping[str, object] | None = None,
        *,
        settings: Mapping[str, object] | None = None,
    ) -> pa.Table:
        return self._call(self._read, sql, dict(params or {}), dict(settings or {}))

    def _read(self, sql: str, params: dict[str, object], settings: dict[str, object]) -> pa.Table:
        """The result streamed and decoded batch by batch (``capped_table``); leaving early closes the
        response, which ends the query. A server error after the first block breaks the Arrow stream."""
        with self._client.query_arrow_stream(sql, parameters=params, settings=settings, use_strings=True) as stream:
            reader = stream.gen  # clickhouse-connect's pyarrow RecordBatchStreamReader
            try:
                return capped_table(reader, reader.schema, settings)
            except pa.ArrowException as e:
                raise QueryError(f"the server's answer broke off: {e}") from None

    def close(self) -> None:
        self._client.close()

    def _call(self, method: Callable[..., T], *args: object, **kwargs: object) -> T:
        try:
            return method(*args, **kwargs)
        except DatabaseError as e:
            # OperationalError without a ClickHouse error code: the request never got an answer.
            if isinstance(e, OperationalError) and e.code is None:
                raise StoreUnreachableError(f"lost ClickHouse at {self._where}: {_reason(e)}") from None
            raise QueryError(_reason(e)) from None


def _reason(error: Exception) -> str:
    return str(error).strip() or type(error).__name__

"""Reading rankscope's data: the one entry point of the dashboard, the diagnosis, ``rankscope sql``
and users' notebooks.

``open_reader()`` gives a ``Reader`` with ``query(sql, params, max_rows) -> pyarrow.Table``:

- through a collector (the default, 127.0.0.1:7777): the collector holds the embedded store,
  so while it runs this is the only way in;
- straight to a ClickHouse server (``clickhouse=URL``), for deployments with one;
- on an embedded store directory (``store=DIR``) when no collector holds it (post mortem).

The read-only guard applies in every mode (``collector.query``), and every failure is one of a
few exceptions a caller can act on: ``QueryRefused``, ``ResultTooLarge``, ``QueryBusy``,
``Unauthenticated``, ``Unreachable`` (all ``QueryFailed``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import grpc
import pyarrow as pa

from rankscope.protos.v1 import ingest_pb2, ingest_pb2_grpc, query_pb2, query_pb2_grpc

from rankscope.collector.query import (
    BUSY_METADATA,
    Limits,
    QueryBusy,
    QueryFailed,
    QueryRefused,
    ResultTooLarge,
    from_ipc,
    guard_for,
    params_to_wire,
    run_read_only,
)
from rankscope.collector.store.base import Store, StoreBusyError, StoreError, StoreUnreachableError, open_store

DEFAULT_COLLECTOR = "127.0.0.1:7777"

__all__ = [
    "Client", "QueryBusy", "QueryFailed", "QueryRefused", "Reader", "ResultTooLarge", "StoreReader", "Unauthenticated",
    "Unreachable", "open_reader",
]


class Unauthenticated(QueryFailed):
    """The collector wants a token (``token=`` / RANKSCOPE_TOKEN) and got none or a wrong one."""


class Unreachable(QueryFailed):
    """No collector or store answers at the given place (or the store is held by a collector)."""


class Reader(Protocol):
    """What every way of reading offers."""

    def query(self, sql: str, params: Mapping[str, object] | None = None, max_rows: int = 0) -> pa.Table:
        """Run one read-only statement; ``params`` fill ``{name:Type}`` placeholders in the engine."""
        ...

    def close(self) -> None: ...


class Client:
    """A collector's Query service over gRPC (thread-safe: one channel, shared).

    ``tls_ca``: the CA bundle (PEM) that signed the collector's certificate, for a collector
    started with ``--tls-cert``; without it the channel is plain text. QueryFailed when the file
    cannot be read.

    ``timeout_s``: how long a call waits for its answer. The default is above the collector's own
    time limit for a read (``--query-timeout``, 60 s) with room for its queue, so a read the
    collector would still answer is not abandoned: a 30 s deadline gave up on a busy collector's
    answers (CI of c39eff8). A collector that is not there fails at once, whatever the deadline.
    """

    def __init__(self, target: str = DEFAULT_COLLECTOR, token: str | None = None, timeout_s: float = 90.0, tls_ca: Path | None = None):
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        # Results can be large (the collector caps them); the default 4 MiB receive limit is not.
        options = [("grpc.max_receive_message_length", -1)]
        if tls_ca is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            try:
                ca = Path(tls_ca).read_bytes()
            except OSError as e:
                raise QueryFailed(f"cannot read the CA bundle {tls_ca}: {e.strerror or e}") from None
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca), options=options)
        self._stub = query_pb2_grpc.QueryStub(self._channel)
        self._ingest = ingest_pb2_grpc.IngestStub(self._channel)

    def query(self, sql: str, params: Mapping[str, object] | None = None, max_rows: int = 0) -> pa.Table:
        request = query_pb2.QueryRequest(sql=sql, params=params_to_wire(params), max_rows=max_rows)
        reply = self._call(self._stub.Query, request)
        return from_ipc(reply.arrow_ipc)

    def request_stack(self, run_id: str, rank: int, reason: str) -> bool:
        """Ask that rank's agent for a stack dump; False when the rank has already ended."""
        request = query_pb2.StackRequest(run_id=run_id, rank=rank, reason=reason)
        return bool(self._call(self._stub.RequestStack, request).queued)

    def send(self, batch: ingest_pb2.Batch) -> bool:
        """Deliver one batch through the collector's Ingest service (the run-level records of
        ``rankscope.healing.record``); True when stored now, False when it was stored before."""
        return not self._call(self._ingest.Send, batch).duplicate

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object) -> object:
        try:
            return method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e, self.target, self.timeout_s) from None


def _error(e: grpc.RpcError, target: str, timeout_s: float) -> QueryFailed:
    code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return QueryRefused(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(f"the collector at {target} refused the call: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        busy = any(key == BUSY_METADATA for key, _ in e.trailing_metadata() or ())  # type: ignore[attr-defined]
        return QueryBusy(details) if busy else ResultTooLarge(details)
    if code == grpc.StatusCode.UNAVAILABLE:  # "failed to connect to all addresses; last error: ...: Connection refused"
        return Unreachable(f"cannot reach the collector at {target}: {details.rsplit(': ', 1)[-1]}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unreachable(f"no answer from the collector at {target} within {timeout_s:g} s")
    return QueryFailed(f"the collector at {target} answered {code.name}: {details}")


class StoreReader:
    """Reads a store directly (ClickHouse server or embedded directory) under the same guard."""

    def __init__(self, store: Store, limits: Limits = Limits()):
        self._store = store
        self._limits = limits
        try:
            self._guard = guard_for(store)
        except StoreError as e:
            raise Unreachable(f"cannot read {store.describe()}: {e}") from None

    def query(self, sql: str, params: Mapping[str, object] | None = None, max_rows: int = 0) -> pa.Table:
        try:
            return run_read_only(self._store, self._guard, sql, params, self._limits, max_rows)
        except StoreUnreachableError as e:
            raise Unreachable(str(e)) from None
        except StoreError as e:
            raise QueryFailed(str(e)) from None

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_store(path: str | Path) -> bool:
    """Whether ``path`` holds an embedded store: the engine's catalogue (a directory without it never held
    one, and must not become one by being read)."""
    return (Path(path) / "metadata").is_dir()


def open_reader(
    *,
    collector: str | None = None,
    clickhouse: str | None = None,
    store: Path | None = None,
    token: str | None = None,
    tls_ca: Path | None = None,
) -> Reader:
    """A reader for one of: a collector at HOST:PORT (default 127.0.0.1:7777), a ClickHouse URL,
    or an embedded store directory. Unreachable when a store cannot be opened.

    ``token`` and ``tls_ca`` (TLS to the collector) apply to a collector only; an https:// URL
    gives TLS to a ClickHouse server.

    The collector is not contacted here: its absence shows at the first query (Unreachable).
    """
    if sum(x is not None for x in (collector, clickhouse, store)) > 1:
        raise ValueError("give at most one of collector, clickhouse and store")
    if clickhouse is None and store is None:
        return Client(collector or DEFAULT_COLLECTOR, token=token, tls_ca=tls_ca)
    if store is not None and not is_store(store):
        raise Unreachable(f"no store at {store}: start a collector with --store {store} to create one")
    try:
        opened = open_store(clickhouse_url=clickhouse) if clickhouse else open_store(store_dir=store)
    except StoreBusyError:
        raise Unreachable(f"the store {store} is held by a running collector: use --collector (its address) instead") from None
    except StoreError as e:
        raise Unreachable(str(e)) from None
    try:
        return StoreReader(opened)
    except BaseException:
        opened.close()
        raise

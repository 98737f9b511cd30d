"""The collector process: gRPC (grpc.aio) in front of the batching writer and the read-only guard.

One event loop does all the gRPC work; store calls run on threads (the writer's own, the
Query service's own in ``read_pool``, one for each live diagnosis lane, whose detectors run in a
process of their own: ``diagnosis.lane_process``, and the default executor for run look-ups), so a
slow insert never stalls the acks of batches that are already stored and neither slow queries nor
a long diagnosis pass delays a batch. The timelines (spans, collectives, metrics) are decoded in a
lane of their own, one batch per turn of the loop, and everything else at once: a collector with
hundreds of timeline batches queued still decodes a heartbeat (where a rank is blocked) as soon as
it arrives. A batch is acknowledged only once written (``Writer.write``),
and SIGTERM or SIGINT stops accepting calls, lets those in flight finish, flushes every buffer
and closes the store: what was acknowledged survives a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import grpc

from rankscope.collector.batch_columns import IngestError, TimeWindow
from rankscope.collector.batch_limits import UnregisteredRun
from rankscope.collector.control import PendingCommands
from rankscope.collector.decode import REGISTRATIONS, Decoded, UnsupportedSchemaVersion, check_envelope, decode
from rankscope.collector.diagnosis.engine import DIAGNOSE_EVERY_S
from rankscope.collector.diagnosis.lane_process import LaneProcesses, Services
from rankscope.collector.liveness import LastHeard
from rankscope.collector.query import BUSY_METADATA, Limits, QueryBusy, QueryRefused, ReadOnlyGuard, ResultTooLarge, guard_for, params_from_wire
from rankscope.collector.read_pool import ReadPool
from rankscope.collector.run_registry import RunRegistry, read_run
from rankscope.collector.store.base import Store, StoreError, open_store
from rankscope.collector.store.migrations import migrate
from rankscope.collector.telemetry import Telemetry
from rankscope.collector.relay_parts import held_parts, leave_out
from rankscope.collector.writer import FLUSH_INTERVAL_S, BatchKey, PartsStored, Writer
from rankscope.common.listening import answers
from rankscope.common.settings import Settings
from rankscope.protos.v1 import ingest_pb2, ingest_pb2_grpc, query_pb2, query_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 2**20
DEFAULT_LISTEN = "127.0.0.1:7777"
DEFAULT_STORE = Path("rankscope-data")
#: seconds that calls in flight get to finish at shutdown before they are cancelled
SHUTDOWN_GRACE_S = 10.0
#: when a batch of a run not yet registered may be sent again: the run's registration can be in a
#: concurrent call (a spool replay sends several at once), decoded after the batch
UNREGISTERED_RETRY_MS = 1000


@dataclass(frozen=True)
class ServerOptions:
    """Everything ``rankscope collector`` can be told; the defaults are its defaults."""

    listen: str = DEFAULT_LISTEN
    #: the embedded store's directory; used when ``clickhouse_url`` is None
    store_dir: Path = DEFAULT_STORE
    #: http[s]://user:password@host:8123/database: a ClickHouse server instead of chDB
    clickhouse_url: str | None = None
    database: str = "rankscope"
    #: when set, every call must carry ``authorization: Bearer <token>``
    token: str | None = None
    #: days of data kept; None leaves the store's retention as it is (a new store keeps all)
    retention_days: int | None = None
    #: serve Prometheus metrics on this port (same host as ``listen``); None: no metrics
    metrics_port: int | None = None
    time_window: TimeWindow = field(default_factory=TimeWindow)
    #: batches are refused (RESOURCE_EXHAUSTED) while more rows than this wait to be written
    max_buffered_rows: int = 2_000_000
    #: a table's buffer is written when its oldest row is this old (or it holds flush_rows)
    flush_interval_s: float = FLUSH_INTERVAL_S
    flush_rows: int = 50_000
    limits: Limits = field(default_factory=Limits)
    #: queries run at once on their own threads; a few times as many wait, the rest are refused
    query_concurrency: int = 4
    #: detector thresholds (``--hang-after`` sets hang_after_s); None: no live diagnosis
    diagnosis: Settings | None = field(default_factory=Settings)
    #: seconds between two diagnosis passes over the active runs
    diagnose_interval_s: float = DIAGNOSE_EVERY_S
    #: POST every new incident as JSON to this URL
    alert_webhook: str | None = None
    #: PEM certificate chain and private key: serve gRPC over TLS (both or neither)
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and its private key (--tls-cert and --tls-key), or neither")


class _Refusal(Exception):
    """A call answered with an error status (and optional trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: Sequence[tuple[str, str]] = ()):
        super().__init__(message)
        self.code = code
        self.trailing = tuple(trailing)


class Collector:
    """The state the services share: store, writer, run registry, pending commands, metrics."""

    def __init__(self, store: Store, writer: Writer, guard: ReadOnlyGuard, options: ServerOptions):
        self.store = store
        self.writer = writer
        self.guard = guard
        self.options = options
        self.runs = RunRegistry()
        silent_after_s = options.diagnosis.silent_after_s if options.diagnosis is not None else 15.0
        self.heard = LastHeard(int(silent_after_s * 1e9))
        self.commands = PendingCommands()
        self.telemetry = Telemetry(writer)
        self.reads = ReadPool(store, guard, options.limits, options.query_concurrency)
        self.reads.export(self.telemetry.registry)
        self._loading: dict[str, asyncio.Future[None]] = {}  # run -> its load from the store, while in flight

    async def refuse(self, context: grpc.aio.ServicerContext, refusal: _Refusal) -> NoReturn:
        self.telemetry.rejected.labels(refusal.code.name).inc()
        if refusal.trailing:
            context.set_trailing_metadata(refusal.trailing)
        await context.abort(refusal.code, str(refusal))
        raise AssertionError("abort returned")  # abort always raises

    async def know_run(self, run_id: str, rank: int, registering: bool = False) -> None:
        """Read what the store knows about a run this process has not seen (after a restart).

        One load of a run at a time: the calls that need it meanwhile wait for that one (after a
        restart, every rank's first batch arrives at once, and each would read the whole run)."""
        if self.runs.needs_load(run_id, rank, time.monotonic(), registering):
            loading = self._loading.get(run_id)
            if loading is None:
                loading = self._loading[run_id] = asyncio.ensure_future(self._load(run_id))
            await asyncio.shield(loading)

    async def _load(self, run_id: str) -> None:
        try:
            began = time.monotonic()
            stored = await asyncio.to_thread(read_run, self.store.query_arrow, run_id)
            self.runs.merge_loaded(run_id, stored, began)
        finally:
            del self._loading[run_id]


#: payload kinds decoded in the timeline lane (``_TimelineLane``)
TIMELINES = frozenset({"spans", "collectives", "metrics", "step_metrics"})


class _TimelineLane:
    """Decodes timeline batches in arrival order, one per turn of the event loop.

    A call is decoded when its handler first runs, and handlers run in the order the calls
    arrived: a heartbeat behind 500 timeline batches waited for 500 decodes of milliseconds each.
    Here a timeline batch waits its turn in the lane, and the calls that arrive meanwhile run
    (and decode, when they are not timelines) between two of its decodes.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[Callable[[], Decoded], asyncio.Future[Decoded]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def decode(self, work: Callable[[], Decoded]) -> Decoded:
        """``work()``'s result (or exception) once the batches queued before it are decoded."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="rankscope-timeline-lane")
        future: asyncio.Future[Decoded] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((work, future))
        return await future

    async def _run(self) -> None:
        while True:
            work, future = await self._queue.get()
            if future.cancelled():  # its call was cancelled: the agent sends it again
                continue
            try:
                future.set_result(work())
            except Exception as e:  # the call answers with it
                future.set_exception(e)
            await asyncio.sleep(0)  # the calls that arrived meanwhile run before the next batch

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class _Arrivals:
    """Calls that arrived and whose rows are not in the writer's buffers yet (decoding, looking up their
    run): a stopping collector lets them reach the writer before it writes its buffers for the last time."""

    def __init__(self) -> None:
        self.count = 0
        self.none = asyncio.Event()
        self.none.set()

    def enter(self) -> Callable[[], None]:
        """Count one call; the callable (idempotent) says its rows reached the writer, or that it ended."""
        self.count += 1
        self.none.clear()
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left, self.count = True, self.count - 1
                if not self.count:
                    self.none.set()

        return leave


class IngestService(ingest_pb2_grpc.IngestServicer):
    def __init__(self, collector: Collector):
        self.c = collector
        self.timelines = _TimelineLane()
        self.arrivals = _Arrivals()

    async def Send(self, request: ingest_pb2.Batch, context: grpc.aio.ServicerContext) -> ingest_pb2.Ack:
        received_ns = time.time_ns()
        self.c.heard.sent(request.sent_ns + request.clock_offset_ns if request.sent_ns else 0, received_ns, request.run_id)
        arrived, answered = self.arrivals.enter(), self.c.heard.answering(received_ns)
        try:
            written, ranks = await self._store(request, received_ns, arrived)
        except _Refusal as refusal:
            await self.c.refuse(context, refusal)
        finally:
            arrived()
            answered()
        self.c.telemetry.seen(request.run_id, ranks)
        return ingest_pb2.Ack(
            batch_id=request.batch_id,
            duplicate=not written,
            received_ns=received_ns,
            commands=self._commands(request, ranks),
            replied_ns=time.time_ns(),
        )

    def _commands(self, request: ingest_pb2.Batch, ranks: tuple[int, ...]) -> list[ingest_pb2.Command]:
        """The commands for the batch's rank; for a relay's batch, those of every rank it speaks for,
        each naming its rank, for the relay to pass on."""
        if not request.parts:
            return self.c.commands.take(request.run_id, request.rank)
        commands = []
        for rank in ranks:
            for command in self.c.commands.take(request.run_id, rank):
                command.rank = rank
                commands.append(command)
        return commands

    async def _store(
        self, batch: ingest_pb2.Batch, received_ns: int, arrived: Callable[[], None], alone: bool = False,
    ) -> tuple[bool, tuple[int, ...]]:
        """Decode and write ``batch``: whether it was written (not a duplicate), and the ranks it speaks for;
        ``arrived()`` once its rows are handed to the writer. A relay's batch is stored without the
        parts its ranks stored themselves before (decoded again without them). ``alone``: under its
        parts' ids, not its own (what a relay's batch holds from registered processes, stored while the
        batch is refused for its other parts: the relay sends it whole again, and then only those)."""
        ranks = tuple(dict.fromkeys(p.rank for p in batch.parts))
        while True:
            try:
                return await self._store_once(batch, received_ns, arrived, alone)
            except PartsStored as e:
                batch = leave_out(batch, batch.WhichOneof("payload"), e.stored)
                if not batch.parts:
                    return False, ranks

    async def _store_registered(
        self, batch: ingest_pb2.Batch, kind: str, unregistered: frozenset[bytes], received_ns: int, arrived: Callable[[], None],
    ) -> None:
        """Store the parts of a relay's ``batch`` but the ``unregistered`` processes' (``alone``): the
        host's other ranks are heard while a restarted rank registers. Parts that do not hold together
        split nothing (the batch is refused whole, as before)."""
        try:
            held_parts(batch, kind)
        except IngestError:
            return
        if (registered := leave_out(batch, kind, unregistered)).parts:
            await self._store(registered, received_ns, arrived, alone=True)

    async def _store_once(
        self, batch: ingest_pb2.Batch, received_ns: int, arrived: Callable[[], None], alone: bool,
    ) -> tuple[bool, tuple[int, ...]]:
        c = self.c
        try:
            kind = check_envelope(batch)
            await c.know_run(batch.run_id, batch.rank, registering=kind in REGISTRATIONS)
            if kind in TIMELINES:
                decoded = await self.timelines.decode(lambda: decode(batch, c.runs, received_ns, c.options.time_window))
            else:
                decoded = decode(batch, c.runs, received_ns, c.options.time_window)
            held = held_parts(batch, kind)
        except UnsupportedSchemaVersion as e:
            raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except IngestError as e:
            c.telemetry.refused.labels(e.reason).inc()
            if isinstance(e, UnregisteredRun):  # its registration may be in a call of its own still on the way (a replay)
                if e.parts and not alone:
                    await self._store_registered(batch, kind, e.parts, received_ns, arrived)
                raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"batch refused: {e}", [("retry-after-ms", str(UNREGISTERED_RETRY_MS))]) from None
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"batch refused: {e}") from None
        except StoreError as e:
            raise _Refusal(grpc.StatusCode.UNAVAILABLE, f"store unavailable: {e}") from None
        if c.writer.overloaded():
            retry_ms = max(100, int(c.writer.flush_interval_s * 1000))
            raise _Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"collector busy: {c.writer.buffered_rows} rows wait to be written; retry after {retry_ms} ms",
                [("retry-after-ms", str(retry_ms))],
            )
        c.telemetry.batches_received.labels(decoded.kind).inc()
        for table, rows in decoded.parts.items():
            c.telemetry.rows_received.labels(table).inc(rows.num_rows)
        key = held[0] if alone else BatchKey(batch.run_id, batch.rank, batch.batch_id, decoded.kind)
        held = held[1:] if alone else held
        c.heard.note(decoded, received_ns)
        try:
            arrived()  # no await before the writer takes the rows
            written = await c.writer.write(decoded.parts, key, held)
        except StoreError as e:
            raise _Refusal(grpc.StatusCode.UNAVAILABLE, f"batch not stored, send it again: {e}") from None
        c.runs.stored(batch.run_id, decoded.parts)
        c.heard.note(decoded, received_ns, answered_ns=time.time_ns())
        sent_ns = batch.sent_ns + batch.clock_offset_ns if batch.sent_ns else 0
        c.telemetry.delivered(decoded.kind, sent_ns, received_ns, time.time_ns())
        return written, decoded.ranks


#: what a reader whose result was over a limit can do
TOO_LARGE_HINT = (" (ask for less: a LIMIT, fewer columns, an aggregate; or start the collector with larger --query-max-rows,"
                  " --query-max-bytes, --query-max-memory or --query-timeout)")  # fmt: skip


class QueryService(query_pb2_grpc.QueryServicer):
    def __init__(self, collector: Collector):
        self.c = collector

    async def Query(self, request: query_pb2.QueryRequest, context: grpc.aio.ServicerContext) -> bytes:
        """The reply serialised already (``query.to_reply``: the result copied once, not four times);
        ``add_to`` registers this method without a serialiser of its own."""
        started = time.perf_counter()
        c = self.c
        try:
            params = params_from_wire(request.params, request.sql)
            return await c.reads.read(request.sql, params, request.max_rows, context.time_remaining(), started)
        except QueryRefused as e:
            await c.refuse(context, _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        except ResultTooLarge as e:
            await c.refuse(context, _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"result over the limit: {e}{TOO_LARGE_HINT}"))
        except QueryBusy as e:
            await c.refuse(context, _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), [(BUSY_METADATA, "1")]))
        except StoreError as e:
            await c.refuse(context, _Refusal(grpc.StatusCode.UNAVAILABLE, f"store unavailable: {e}"))

    async def RequestStack(self, request: query_pb2.StackRequest, context: grpc.aio.ServicerContext) -> query_pb2.StackRequestReply:
        c = self.c
        if not request.run_id or request.rank < 0:
            await c.refuse(context, _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "a stack request names a run_id and a rank >= 0"))
        try:
            await c.know_run(request.run_id, request.rank)
        except StoreError as e:
            await c.refuse(context, _Refusal(grpc.StatusCode.UNAVAILABLE, f"store unavailable: {e}"))
        if c.runs.has_ended(request.run_id, request.rank):
            return query_pb2.StackRequestReply(queued=False)
        c.commands.request_stack(request.run_id, request.rank, request.reason or "requested")
        return query_pb2.StackRequestReply(queued=True)

    def add_to(self, server: grpc.aio.Server) -> None:
        """This service on ``server``, as the generated ``add_QueryServicer_to_server`` does but for
        ``Query``'s replies, which are bytes on the wire already."""
        handlers = {
            "Query": grpc.unary_unary_rpc_method_handler(
                self.Query, request_deserializer=query_pb2.QueryRequest.FromString, response_serializer=bytes
            ),
            "RequestStack": grpc.unary_unary_rpc_method_handler(
                self.RequestStack,
                request_deserializer=query_pb2.StackRequest.FromString,
                response_serializer=query_pb2.StackRequestReply.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("rankscope.v1.Query", handlers),))


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Every method of every service needs ``authorization: Bearer <token>``."""

    def __init__(self, token: str, on_refusal: Callable[[], None]):
        self._expected = f"Bearer {token}".encode()
        self._on_refusal = on_refusal

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        sent = dict(details.invocation_metadata or ()).get("authorization")
        if sent is not None and hmac.compare_digest(str(sent).encode(), self._expected):
            return await continuation(details)
        self._on_refusal()
        problem = "no token was sent" if sent is None else "the token is wrong"
        message = f"{problem}: send metadata 'authorization: Bearer <token>' with the collector's token (--token / RANKSCOPE_TOKEN)"

        async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.unary_unary_rpc_method_handler(deny)


#: ``--listen unix:PATH``: a Unix socket, for agents that share this machine's file system but not its
#: network (the test bed's namespace hosts, whose telemetry stays off the links its faults slow)
UNIX = "unix:"


def parse_listen(text: str) -> tuple[str, int]:
    """("host", port) from HOST:PORT ([v6]:PORT too), or ("unix:PATH", 0); ValueError with the reason."""
    if text.startswith(UNIX):
        if not text[len(UNIX) :]:
            raise ValueError(f"expected unix:PATH with the socket's path, got {text!r}")
        return text, 0
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port 0-65535, got {text!r}")
    return host, int(port)


def _where(options: ServerOptions, store: Store) -> str:
    if options.clickhouse_url is None:
        return f"{options.store_dir.resolve()} (chDB)"
    return store.describe()


async def serve(options: ServerOptions, ready: Callable[[str], None] | None = None) -> None:
    """Run the collector until SIGINT or SIGTERM; ``ready`` gets the start-up line (default: print).

    Raises StoreError (store unusable or held by another collector) or OSError (cannot listen, or
    cannot read the TLS files).
    """
    host, port = parse_listen(options.listen)
    credentials = server_credentials(options)  # before the store: a bad file costs no store start-up
    if options.clickhouse_url is None:
        store = open_store(store_dir=options.store_dir, database=options.database)
    else:
        store = open_store(clickhouse_url=options.clickhouse_url, database=options.database)
    try:
        await _run(store, options, host, port, credentials, ready or _print_line)
    finally:
        store.close()


def server_credentials(options: ServerOptions) -> grpc.ServerCredentials | None:
    """TLS credentials from ``tls_cert`` and ``tls_key``; None for plain text. OSError naming the file."""
    if options.tls_cert is None or options.tls_key is None:
        return None
    pair = (_read_pem("private key", options.tls_key), _read_pem("certificate", options.tls_cert))
    return grpc.ssl_server_credentials([pair])


def _read_pem(what: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OSError(f"cannot read the TLS {what} {path}: {e.strerror or e}") from None


async def _run(
    store: Store, options: ServerOptions, host: str, port: int, credentials: grpc.ServerCredentials | None,
    ready: Callable[[str], None],
) -> None:
    await asyncio.to_thread(migrate, store, store.database, options.retention_days)
    guard = await asyncio.to_thread(guard_for, store)
    writer = Writer(
        store, store.database, flush_rows=options.flush_rows, flush_interval_s=options.flush_interval_s,
        max_buffered_rows=options.max_buffered_rows,
    )
    await writer.start()
    collector = Collector(store, writer, guard, options)
    telemetry = collector.telemetry
    interceptors = [_TokenAuth(options.token, telemetry.rejected.labels("UNAUTHENTICATED").inc)] if options.token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", -1),
            # gRPC sets SO_REUSEPORT by default: a second collector on the port would then start
            # and silently take half of the agents' calls.
            ("grpc.so_reuseport", 0),
        ],
    )
    ingest = IngestService(collector)
    ingest_pb2_grpc.add_IngestServicer_to_server(ingest, server)
    QueryService(collector).add_to(server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ticker = asyncio.create_task(_tick(collector, stop))
    diagnosis = asyncio.create_task(_diagnose(collector, loop, stop)) if options.diagnosis is not None else None
    try:
        bound = _bind(server, host, port, credentials)
        await server.start()
        metrics = ""
        if options.metrics_port is not None:
            http_host = "127.0.0.1" if host.startswith(UNIX) else host
            metrics = f", metrics on http://{http_host}:{telemetry.serve(http_host, options.metrics_port)}/metrics"
        tls = ", with TLS" if credentials is not None else ""
        ready(f"rankscope collector listening on {bound}{tls}, storing in {_where(options, store)}{metrics}")
        await stop.wait()
    finally:
        # Stop taking calls at once and write every buffer now: the calls in flight get their
        # acks while the server waits for them (up to the grace time).
        stop.set()
        stopping = asyncio.create_task(server.stop(SHUTDOWN_GRACE_S))
        with contextlib.suppress(TimeoutError):  # calls still decoding hand their rows to the writer first
            await asyncio.wait_for(ingest.arrivals.none.wait(), SHUTDOWN_GRACE_S)
        await writer.close()
        await stopping
        await asyncio.to_thread(collector.reads.close)
        await ingest.timelines.close()
        await ticker
        if diagnosis is not None:
            await diagnosis
        telemetry.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _diagnose(collector: Collector, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """The live diagnosis, a process per lane (``lane_process``): detectors over the active runs, their
    queries and incidents through this process's store, stack requests to agents."""
    options, store = collector.options, collector.store
    assert options.diagnosis is not None

    def request_stack(run_id: str, rank: int, reason: str) -> None:  # called from a lane's thread
        loop.call_soon_threadsafe(collector.commands.request_stack, run_id, rank, reason)

    services = Services(
        query=store.query_arrow, insert_incidents=functools.partial(store.insert_arrow, "incidents"), request_stack=request_stack,
        stored=lambda run_id: collector.writer.stored.get(run_id, (0, 0)), heard=collector.heard.of, forget=collector.heard.forget,
        passed=collector.telemetry.diagnosed, detected=collector.telemetry.detected,
    )  # fmt: skip
    lanes = LaneProcesses(services, options.diagnosis, options.diagnose_interval_s, options.alert_webhook, collector.telemetry.restarted)
    await lanes.run(stop)


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> str:
    """Listen on host:port (or the ``unix:`` socket ``host``), over TLS when ``credentials`` are
    given; the address bound (port 0 picks a free one). OSError when it cannot."""
    address = host if host.startswith(UNIX) else f"{host}:{port}"
    if host.startswith(UNIX):
        _refuse_a_live_socket(host.removeprefix(UNIX))
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as e:
        if credentials is not None:  # gRPC says only "Failed to bind" when it cannot use the PEM files either
            raise OSError(
                f"cannot listen with TLS on {host}:{port} (in use, or the key does not belong to the certificate): {e}"
            ) from None
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {address} (in use, or not an address of this machine)")
    return address if host.startswith(UNIX) else f"{host}:{bound}"


def _refuse_a_live_socket(path: str) -> None:
    """OSError when a process answers on the Unix socket ``path``. gRPC replaces the socket's file
    when it binds, so a second collector there would silently take the agents of the first, and
    whichever stopped first would remove the other's socket. A file nobody answers on is stale:
    gRPC replaces it."""
    if os.path.exists(path) and answers(f"{UNIX}{path}", timeout_s=2.0):
        raise OSError(f"cannot listen on {UNIX}{path}: a process (another collector?) is listening there")


async def _tick(collector: Collector, stop: asyncio.Event) -> None:
    """Every second: the metrics' gauges, and the ranks' silence told that the loop is listening."""
    while not stop.is_set():
        collector.telemetry.tick()
        collector.heard.listening()
        collector.telemetry.calls_wait.set(collector.heard.waited_s)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


def _print_line(line: str) -> None:
    print(line, flush=True)


def main(options: ServerOptions) -> int:
    """Run the collector in this process; the exit status (0 after SIGTERM, 1 if it cannot start)."""
    try:
        asyncio.run(serve(options))
    except (StoreError, OSError) as e:
        print(f"rankscope collector: {e}", file=sys.stderr)
        return 1
    return 0

"""A host's relay (``rankscope relay``): its ranks' batches in over a Unix socket, one stream out.

At 100,000 ranks every rank talking to the collector itself means 100,000 connections and a call
per rank and kind every few seconds; the collector pays about a millisecond per call. One relay
per host (the OpenTelemetry agent's place) takes its ranks' ``Ingest/Send`` calls on a Unix
socket, and every ``flush_s`` (less often while the collector is behind: fewer, larger batches)
sends the collector one batch per run and kind: the spans,
collectives, step scalars and heartbeats of all its ranks merged, rows naming their rank, the
heartbeats in columns, and the registrations and ends of senders that speak for several ranks
(``relay_merge``). One rank's registration or end, stacks and gauges go on one by one.

Delivery: a rank's batch is acknowledged once the relay has written the batch it went into to its
spool (a durable ``Transport``: what is on disk survives the relay's death, SIGKILL included);
from there it is sent, and deleted once the collector has acknowledged it. A rank whose relay
does not answer sends to the collector directly (``Transport``), and adopts what the dead relay
left in the spool directory they share, and comes back to the relay once one answers again. So
nothing acknowledged to a rank is lost, and nothing is stored twice: a spooled batch keeps its id
whoever sends it, and names the ranks' batches it holds (``Batch.parts``), so that the collector
stores a rank's batch once also when the relay died between its spool's write and its reply and
the rank sent the batch again itself.

The acknowledgement carries the relay's clock offset estimate (collector clock minus this host's),
so the ranks' own estimates agree with it; the relay stamps its batches with the same estimate.
The collector's commands (stack-dump requests) for a rank come in the acknowledgement of a relay's
batch that speaks for it; the relay passes them on in that rank's next acknowledgement.

Test hook: ``RANKSCOPE_RELAY_TEST_DIE_AFTER_SPOOL=<kind>`` (read once, at the start) makes the relay
kill itself with SIGKILL right after it has spooled its first batch of that kind, before any rank
hears of it: the moment tests/test_relay.py needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message

from rankscope.agent.config import AgentConfig
from rankscope.agent.relay_merge import MERGED, merge, rows, world
from rankscope.agent.transport import REGISTRATIONS, Transport, event_count
from rankscope.protos.v1 import ingest_pb2, ingest_pb2_grpc

__all__ = ["FLUSH_S", "Relay", "serve"]

log = logging.getLogger("rankscope.relay")

#: how long a rank's batch waits for its peers' before the merged batch is spooled (and acknowledged)
FLUSH_S = 0.1
#: a flush starts early once this much is waiting
FLUSH_BYTES = 4 << 20
#: while more merged batches than this await the collector's acknowledgement, what the ranks send
#: waits for the next flush (up to ``MAX_FLUSH_S`` or ``FLUSH_BYTES``): a collector behind gets
#: fewer, larger batches instead of a call per kind every ``flush_s``
BEHIND_BATCHES = 32
MAX_FLUSH_S = 0.5
#: what a rank may send in one call (the collector takes up to 64 MiB)
MAX_MESSAGE_BYTES = 64 << 20
#: the relay's Transport may hold this much not yet on disk (then ranks are told to retry shortly)
QUEUE_BYTES = 256 << 20
#: the relay's calls in flight to the collector. Each waits for the collector's next write (a second
#: or more), and a flush makes a call per kind: with the agent's 64, a relay fell behind its own
#: flushes once the collector took 1.5 s to acknowledge, for good, since what waits is never merged again
WINDOW = 512
RETRY_AFTER_MS = 200
#: the order of a flush's batches: who a rank is first, its last word last
_FIRST, _LAST = REGISTRATIONS, frozenset({"end", "ends"})

BATCH_ID_BYTES = 16
#: the test hook (module doc)
DIE_AFTER_SPOOL = "RANKSCOPE_RELAY_TEST_DIE_AFTER_SPOOL"

_REFUSALS = {
    grpc.StatusCode.UNAVAILABLE: "the relay could not spool this batch: send it to the collector",
    grpc.StatusCode.INVALID_ARGUMENT: "a column of this batch does not hold together (its length, count or string indices)",
}


@dataclass(eq=False)
class _Part:
    rank: int
    batch_id: bytes
    payload: Message
    done: asyncio.Future[grpc.StatusCode | None]
    twins: list[_Part] = dataclasses.field(default_factory=list)  # the same batch sent again while this one waits


class Relay(ingest_pb2_grpc.IngestServicer):
    """The relay's ``Ingest`` service and its flushes; one durable Transport per run."""

    def __init__(self, config: AgentConfig, flush_s: float = FLUSH_S) -> None:
        self.config = dataclasses.replace(config, relay=None)  # the relay itself sends to the collector
        self.flush_s = flush_s
        self._waiting: dict[tuple[str, str, str], list[_Part]] = {}  # (run, kind, world) -> parts, in arrival order
        self._bytes = 0
        self._wake = asyncio.Event()
        self._transports: dict[str, Transport] = {}
        #: (run, rank) -> the collector's commands for that rank, until its next acknowledgement
        self._commands: dict[tuple[str, int], list[ingest_pb2.Command]] = {}
        self._die_after = os.environ.get(DIE_AFTER_SPOOL)
        self.received: dict[str, int] = {}  # run -> batches from its ranks, acknowledged or not

    async def Send(self, request: ingest_pb2.Batch, context: grpc.aio.ServicerContext) -> ingest_pb2.Ack:
        received_ns = time.time_ns()
        kind = request.WhichOneof("payload")
        if kind is None or not request.run_id or len(request.batch_id) != BATCH_ID_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the relay takes batches that name their run, have a 16-byte id and carry a payload")
        self.received[request.run_id] = self.received.get(request.run_id, 0) + 1
        part = _Part(request.rank, request.batch_id, getattr(request, kind), asyncio.get_running_loop().create_future())
        self._waiting.setdefault((request.run_id, kind, world(kind, part.payload)), []).append(part)
        self._bytes += request.ByteSize()
        if self._bytes >= FLUSH_BYTES:
            self._wake.set()
        code = await part.done
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            await context.abort(code, "the relay's queue is full: retry shortly", (("retry-after-ms", str(RETRY_AFTER_MS)),))
        elif code is not None:
            await context.abort(code, _REFUSALS[code])
        offset = self._transports[request.run_id].clock_offset_ns
        commands = self._commands.pop((request.run_id, request.rank), [])
        return ingest_pb2.Ack(batch_id=request.batch_id, received_ns=received_ns + offset, replied_ns=time.time_ns() + offset, commands=commands)

    async def flushing(self) -> None:
        """Flush every ``flush_s`` (or sooner, once ``FLUSH_BYTES`` wait; or later, up to ``MAX_FLUSH_S``,
        while the collector is behind: ``BEHIND_BATCHES``), until cancelled."""
        flushed = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.flush_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._bytes < FLUSH_BYTES and time.monotonic() - flushed < MAX_FLUSH_S and self.unacknowledged() > BEHIND_BATCHES:
                continue
            self.flush()
            flushed = time.monotonic()

    def unacknowledged(self) -> int:
        """Merged batches spooled and not yet acknowledged by the collector (nor given up), over all runs."""
        return sum(s.spooled - s.acked - s.dropped for s in (t.stats() for t in self._transports.values()))

    def flush(self) -> None:
        """Hand what waits to the Transports: a merged batch per (run, kind), the rest one by one."""
        waiting, self._waiting, self._bytes = self._waiting, {}, 0
        loop = asyncio.get_running_loop()
        for (run_id, kind, _), parts in sorted(waiting.items(), key=lambda item: (item[0][1] not in _FIRST, item[0][1] in _LAST)):
            parts = _unique(parts)
            try:
                transport = self._transport(run_id, parts[0].rank, loop)
                if kind in MERGED:
                    merged, parts = self._merged(kind, parts)
                    if parts:
                        self._submit(transport, kind, merged, parts, loop)
                else:
                    for part in parts:
                        self._submit(transport, kind, part.payload, [part], loop)
            except Exception:  # a relay's bug: its ranks send these themselves, and it goes on
                log.exception("rankscope relay: %d %s batches of run %s not taken", len(parts), kind, run_id)
                for part in parts:
                    _settle(part, grpc.StatusCode.UNAVAILABLE)

    async def close(self, timeout_s: float) -> None:
        """Spool what waits; send what can be sent within ``timeout_s``; the rest stays spooled."""
        self.flush()
        await asyncio.gather(*(asyncio.to_thread(t.close, timeout_s) for t in self._transports.values()))

    def _merged(self, kind: str, parts: list[_Part]) -> tuple[Message, list[_Part]]:
        """One payload of ``parts``, less those that cannot be merged (refused to their rank): one bad
        batch must not take its peers' rows with it."""
        try:
            return merge(kind, [(p.rank, p.payload) for p in parts]), parts
        except ValueError:
            pass
        good = []
        for part in parts:
            try:
                merge(kind, [(part.rank, part.payload)])
                good.append(part)
            except ValueError as exc:
                log.warning("rankscope relay: a %s batch of rank %d refused: %s", kind, part.rank, exc)
                _settle(part, grpc.StatusCode.INVALID_ARGUMENT)
        return merge(kind, [(p.rank, p.payload) for p in good]), good

    def _transport(self, run_id: str, rank: int, loop: asyncio.AbstractEventLoop) -> Transport:
        transport = self._transports.get(run_id)
        if transport is None:
            def on_command(command: ingest_pb2.Command) -> None:  # on the Transport's thread
                loop.call_soon_threadsafe(lambda: self._commands.setdefault((run_id, command.rank), []).append(command))

            transport = Transport(self.config, run_id, rank, name=f"relay-{run_id}", max_queue_bytes=QUEUE_BYTES, durable=True,
                                  window=WINDOW, on_command=on_command)  # fmt: skip
            transport.start()
            self._transports[run_id] = transport
        return transport

    def _submit(self, transport: Transport, kind: str, payload: Message, parts: list[_Part], loop: asyncio.AbstractEventLoop) -> None:
        """Spool ``payload`` (naming the ranks' batches it holds); each part is acknowledged once it is on disk."""
        def spooled(ok: bool) -> None:  # on the Transport's thread
            if ok and kind == self._die_after:
                os.kill(os.getpid(), signal.SIGKILL)  # the test hook: on disk, and no rank has heard
            for part in parts:
                loop.call_soon_threadsafe(_settle, part, None if ok else grpc.StatusCode.UNAVAILABLE)

        held = tuple(ingest_pb2.BatchPart(rank=p.rank, batch_id=p.batch_id, count=rows(kind, p.payload) if kind in MERGED else event_count(p.payload)) for p in parts)
        if not transport.submit(payload, rank=parts[0].rank, on_spooled=spooled, parts=held):
            for part in parts:
                _settle(part, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _unique(parts: list[_Part]) -> list[_Part]:
    """One part per batch id (a rank's call sent again while the first waits): the merged batch
    names each part once, and the second call is answered as the first."""
    first: dict[bytes, _Part] = {}
    for part in parts:
        kept = first.setdefault(part.batch_id, part)
        if kept is not part:
            kept.twins.append(part)
    return list(first.values())


def _settle(part: _Part, code: grpc.StatusCode | None) -> None:
    """Answer the part's call (and its twins'), unless it was cancelled meanwhile."""
    for future in (part.done, *(twin.done for twin in part.twins)):
        if not future.done():
            future.set_result(code)


def serve(config: AgentConfig, listen: str, *, flush_s: float = FLUSH_S, on_ready: Callable[[], None] | None = None) -> None:
    """Run a relay on ``listen`` (``unix:/path``) until SIGTERM or SIGINT; then spool what waits and
    send what can be sent within a few seconds."""
    asyncio.run(_serve(config, listen, flush_s, on_ready))


async def _serve(config: AgentConfig, listen: str, flush_s: float, on_ready: Callable[[], None] | None) -> None:
    _claim_socket(listen)
    relay = Relay(config, flush_s)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    ingest_pb2_grpc.add_IngestServicer_to_server(relay, server)
    server.add_insecure_port(listen)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    flushing = asyncio.create_task(relay.flushing())
    log.warning("rankscope relay: listening on %s, sending to %s (spool: %s)", listen, config.collector, config.spool_dir)
    if on_ready is not None:
        on_ready()
    await stop.wait()
    await server.stop(grace=1.0)
    flushing.cancel()
    await relay.close(timeout_s=10.0)
    log.warning("rankscope relay: stopped; batches received from ranks, by run: %s", ", ".join(f"{r} {n}" for r, n in relay.received.items()))


def _claim_socket(listen: str) -> None:
    """Remove a socket file no relay answers on any more; refuse to start beside a live one."""
    if not listen.startswith("unix:"):
        return
    path = listen.removeprefix("unix:")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # left by a relay that died
            return
    raise RuntimeError(f"a relay already listens on {listen}")

"""Delivery of a rank's telemetry to the collector: never in the way of training.

``submit`` is called on the training thread (and the agent's own threads) and only appends to
a bounded in-memory queue: O(1), never blocking, False when the queue is full (counted). One
background thread per Transport does everything else:

- wraps each payload in a ``Batch`` (run, rank, a 16-byte id: 8 random bytes per Transport and
  a counter) and sends it with the unary ``Ingest/Send``, several calls in flight at once;
  registrations, heartbeats, stack dumps and the rank's end (``URGENT``: who a rank is, where it
  is blocked, what a hang is named from, its last word) go ahead of the timelines queued before
  them, in calls of their own beyond the window (``URGENT_SLOTS``), so a collector that lags
  behind the bulk still hears them first, and a rank that ends is not called lost because its end
  waited behind its timelines;
- estimates the clock offset from each acknowledgement (``clock.py``) and stamps it, with the
  send time, on every batch;
- when the collector is unreachable (UNAVAILABLE, deadline, rejected token), writes batches to
  the spool on local disk (``spool.py``) and probes with exponential backoff and jitter; once a
  probe succeeds it resends the registration, then replays the spool in order, then new data;
- replays spools left behind by ended processes on this host (``rankscope spool replay`` does
  the same from the command line);
- RESOURCE_EXHAUSTED with "retry-after-ms": waits, then retries; FAILED_PRECONDITION with it (a run
  whose registration the collector has not decoded yet): the same, a few times; otherwise (a batch
  too large, INVALID_ARGUMENT, FAILED_PRECONDITION): drops the batch, counts it, warns once per kind.

A batch may reach the collector twice (a lost acknowledgement, a replay after a timeout); the
collector recognises its id, acknowledges it and writes it once. Several Transports can live
in one process, and one Transport can speak for many ranks of one run (``submit(payload,
rank=r)``; the scale simulator does both): each payload is enveloped with its own rank, and each
rank's latest registration is sent again after a reconnect.

Through a relay (``RANKSCOPE_RELAY``, ``node_relay.py``): the calls go to this host's relay, which
acknowledges a batch once it is in its own spool. When the relay cannot be reached (it died, it
was never started), the Transport sends to the collector directly from then on: its
registrations first, then what the relay did not acknowledge, then what the relay left in its
spool (adopted as any dead owner's leftovers: same spool directory), then new data. Every
``RELAY_PROBE_S`` it then tries the relay's socket (a connect, on the sender thread), and goes back
to the relay once one answers there and no call is in flight.

``durable`` (the relay's own Transport): every batch is written to the spool as it is accepted,
and sent from there; ``submit``'s ``on_spooled`` hears when it is on disk (or could not be).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from rankscope.agent.clock import ClockEstimator
from rankscope.agent.config import AgentConfig, warn_once
from rankscope.common.listening import answers
from rankscope.agent.spool import Segment, Spool
from rankscope.protos.v1 import BATCH_SCHEMA_VERSION, ingest_pb2

__all__ = ["Transport", "TransportStats", "event_count", "replay_leftovers"]

log = logging.getLogger("rankscope.agent")

METHOD = "/rankscope.v1.Ingest/Send"
WINDOW = 64  # calls in flight: the collector acknowledges a batch once written, in bulk
CALL_TIMEOUT_S = 30.0  # acknowledgements follow the write: a busy collector is slow, not gone
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 5.0
MAX_ATTEMPTS = 5  # for failures that are neither the network's nor the batch's fault
IDLE_WAKE_S = 1.0
RELAY_PROBE_S = 5.0  # how often a Transport that left its relay looks whether one answers again
# What submit charges the in-memory budget per payload, until the sender knows the real size.
# A columnar event takes 24 to 61 bytes.
_ESTIMATE_BASE = 256
_ESTIMATE_PER_EVENT = 64

_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED)
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED)

#: payload message type -> its field in Batch.payload
_FIELDS = {f.message_type.full_name: f.name for f in ingest_pb2.Batch.DESCRIPTOR.oneofs_by_name["payload"].fields}
_COLUMNAR = ("spans", "collectives", "metrics", "step_metrics")
#: payload kinds that register ranks (one, or a sender's several), sent again after an outage
REGISTRATIONS = frozenset({"register", "registers"})
#: payload kinds sent ahead of the queued timelines, in the order submitted: registrations among them,
#: since the collector takes a run's rows only once one of its ranks has registered
URGENT = frozenset({"heartbeats", "stack", "end", "ends", *REGISTRATIONS})
#: calls beyond the window that only URGENT batches may take: a window full of timelines that a
#: lagging collector acknowledges slowly does not hold them
URGENT_SLOTS = 4


@dataclass
class TransportStats:
    """Counts since the Transport started (batches unless the name says events).

    ``rejected`` are the payloads ``submit`` refused (it returned False: the caller knows);
    ``dropped`` are those lost after they were accepted (spool full, refused by the collector).
    """

    sent: int = 0  # calls made, retries included
    acked: int = 0
    duplicates: int = 0  # acknowledged as already written
    spooled: int = 0  # written to the spool
    replayed: int = 0  # acknowledged after coming out of a spool (this one's or a leftover)
    dropped: int = 0
    dropped_events: int = 0
    rejected: int = 0
    rejected_events: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # failed calls by status code
    #: events taken for sending, by payload kind: each is stored once, or counted in dropped_events
    events: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Out:
    """One batch on its way: serialized without its clock stamp, which is added per attempt."""

    seq: int  # order: spooled records by reading order, then the rest by creation
    data: bytes
    events: int
    kind: str
    charge: int = 0  # bytes it holds in the in-memory budget (0 once on disk)
    own: bool = True  # ours (stamped per attempt), or a leftover of another process (as stored)
    segment: Segment | None = None  # where it lies in the spool
    probe: bool = False  # a registration sent to find out whether the collector is back
    route: int = 0  # the channel it was last sent on (a new one after leaving the relay)
    attempts: int = 0
    sent_ns: int = 0


@dataclass
class _Done:
    out: _Out
    future: Any
    arrived_ns: int


_CLOSE = object()


class Transport:
    """Sends one rank's payloads (or many ranks' of one run) to the collector from a background thread; see the module doc."""

    def __init__(
        self,
        config: AgentConfig,
        run_id: str,
        rank: int,
        *,
        on_command: Callable[[ingest_pb2.Command], None] | None = None,
        max_queue_bytes: int = 64 << 20,
        name: str = "",
        window: int = WINDOW,
        clock: ClockEstimator | None = None,
        durable: bool = False,
    ) -> None:
        self.config = config
        self.run_id = run_id
        self.rank = rank
        self.name = name or f"rank{rank}"
        self.on_command = on_command
        self.max_queue_bytes = max_queue_bytes
        # Calls in flight. A batch is acknowledged once written (every flush interval), so one
        # Transport sends at most ``window`` batches per flush: one that speaks for many ranks
        # needs a window to match.
        self.window = window
        self.durable = durable
        #: where the calls go: this host's relay while it answers, else the collector
        self._target = config.relay or config.collector
        self._route = 0
        self._relay_probe = 0.0  # when to look whether the relay answers again (once left)
        self._instance = os.urandom(8)
        self._seq = 0
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._budget_lock = threading.Lock()
        self._queued_bytes = 0
        self._rejected = (0, 0)  # (batches, events) refused by submit; under _budget_lock
        self._stats = TransportStats()
        # Ranks that share one clock (a simulator's) may share one estimate that stops moving.
        self._clock = clock if clock is not None else ClockEstimator()
        self._spool = Spool(config.spool_dir, f"{_safe(self.name)}-{os.getpid()}-{self._instance.hex()}", config.spool_max_bytes)
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._forked = False
        # sender-thread state
        self._pending: deque[_Out] = deque()
        self._urgent: deque[_Out] = deque()  # URGENT kinds: sent before _pending
        self._retry: list[_Out] = []
        self._inflight: dict[int, _Out] = {}
        self._read_seq = 0
        self._down = False
        self._down_since = 0.0
        self._outage: tuple[int, int] = (0, 0)  # (spooled, dropped) when the outage began
        self._backoff_s = BACKOFF_FIRST_S
        self._next_probe = 0.0
        self._paused_until = 0.0
        # rank (a batch's first) -> its latest registration; the first is the probe after an outage, the rest follow it
        self._registers: dict[int, Message] = {}
        self._reregister: deque[_Out] = deque()
        self._closing_at: float | None = None
        self._close_probe = False  # closing while down: one more probe is owed
        self._channel: grpc.Channel | None = None
        self._send: Any = None
        self._metadata: tuple[tuple[str, str], ...] | None = None
        _live.add(self)

    # --- the training side -----------------------------------------------------------------

    def start(self) -> None:
        """Start the sender thread (payloads submitted before are kept)."""
        if self._thread is None and not self._forked:
            self._thread = threading.Thread(target=self._run, name=f"rankscope-transport-{self.name}", daemon=True)
            self._thread.start()

    def submit(
        self, payload: Message, rank: int | None = None, on_spooled: Callable[[bool], None] | None = None,
        parts: tuple[ingest_pb2.BatchPart, ...] = (),
    ) -> bool:  # fmt: skip
        """Queue one telemetry payload; False when refused (queue full, closed). Never blocks.

        ``rank``: the rank it is about, when this Transport speaks for several ranks of its run
        (default: the rank it was made for). ``on_spooled`` (durable Transports): called on the
        sender thread once the batch is on disk (True) or could not be written (False). ``parts``
        (a relay's): the ranks' batches the payload holds, in its order.

        A refusal is counted in ``stats().rejected``; the caller decides whether it also counts
        it as lost events (the agent's runtime adds them to RankState.dropped). The Transport
        owns ``payload`` from now on: do not change it afterwards.
        """
        events = event_count(payload)
        size = _ESTIMATE_BASE + _ESTIMATE_PER_EVENT * events  # measuring would cost a serialization
        with self._budget_lock:
            if not self._accepting or self._queued_bytes + size > self.max_queue_bytes:
                self._rejected = (self._rejected[0] + 1, self._rejected[1] + events)
                return False
            self._queued_bytes += size
        self._inbox.put((payload, size, self.rank if rank is None else rank, on_spooled, parts))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what can be sent within ``timeout_s``; the rest goes to the spool. Idempotent."""
        if not self._accepting or self._forked:
            return
        self._accepting = False
        if self._thread is None:
            self.start()
        self._inbox.put((_CLOSE, time.monotonic() + max(0.0, timeout_s)))
        if self._thread is not None:
            self._thread.join(timeout_s + 2.0)

    def cut_short(self, timeout_s: float = 1.0) -> None:
        """Spool what is not acknowledged yet, now, from any thread: the process is about to end (SIGTERM
        while its last word waits on a collector that is slow to answer). A call in flight is lost with
        the process; on disk, the batch (the rank's end above all) is replayed later (campaign seed
        1841970453: three ranks' ends lost, and named dead without a last word offline)."""
        if self._forked or self._thread is None or not self._thread.is_alive():
            return
        self._accepting = False
        self._inbox.put((_CLOSE, time.monotonic()))
        self._thread.join(timeout_s)

    @property
    def clock_offset_ns(self) -> int:
        """Collector clock minus this rank's clock (0 until the first acknowledgement)."""
        return self._clock.offset_ns

    def stats(self) -> TransportStats:
        """A copy of the counters (safe from any thread)."""
        s = self._stats
        rejected, rejected_events = self._rejected
        return TransportStats(
            s.sent, s.acked, s.duplicates, s.spooled, s.replayed, s.dropped, s.dropped_events, rejected, rejected_events, dict(s.errors),
            dict(s.events),
        )

    # --- the sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._connect()
            self._adopt_leftovers()
            while not self._finished():
                self._receive(self._wait_s())
                self._return_to_relay()
                self._issue()
        except Exception as exc:  # noqa: BLE001 - a sender bug must not reach training
            warn_once("sender", f"the sender of {self.name} stopped ({exc!r}); its telemetry goes to the spool")
        try:
            self._shut_down()
        except Exception as exc:  # noqa: BLE001 - nor may its last words
            warn_once("sender-end", f"the sender of {self.name} could not save what it held ({exc!r})")

    def _adopt_leftovers(self) -> None:
        try:
            adopted = self._spool.adopt_leftovers()
        except OSError as exc:
            warn_once(f"adopt:{self.config.spool_dir}", f"cannot read the spool directory {self.config.spool_dir} ({exc})")
            return
        if adopted:
            log.warning("rankscope agent: replaying %d spool segment(s) left by earlier agents in %s", adopted, self.config.spool_dir)

    def _connect(self) -> None:
        # gRPC's own reconnection backoff grows to minutes by default; ours decides instead.
        options = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", int(BACKOFF_MAX_S * 1000)),
        ]
        if self.config.tls_ca is not None and self._target == self.config.collector:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.config.tls_ca.read_bytes())
            self._channel = grpc.secure_channel(self._target, credentials, options=options)
        else:  # or this host's relay, over its Unix socket
            self._channel = grpc.insecure_channel(self._target, options=options)
        # Requests are bytes serialized here, so the call takes them as they are.
        self._send = self._channel.unary_unary(METHOD, request_serializer=None, response_deserializer=ingest_pb2.Ack.FromString)
        self._metadata = (("authorization", f"Bearer {self.config.token}"),) if self.config.token else None

    def _finished(self) -> bool:
        if self._closing_at is None:
            return False
        if time.monotonic() >= self._closing_at:
            return True
        idle = not (self._pending or self._urgent or self._retry or self._inflight) and self._spool.empty
        return idle or (self._down and not self._inflight and not self._close_probe)

    def _wait_s(self) -> float:
        now = time.monotonic()
        wake = now + IDLE_WAKE_S
        if self._down and not self._inflight:  # a probe in flight wakes us when it ends, not a clock
            wake = min(wake, self._next_probe)
        if self._paused_until > now:
            wake = min(wake, self._paused_until)
        if self._closing_at is not None:
            wake = min(wake, self._closing_at)
        return max(0.0, wake - now)

    def _receive(self, timeout_s: float) -> None:
        """Take everything in the inbox (waiting up to ``timeout_s`` for the first item)."""
        try:
            item = self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Done):
                self._completed(item)
            elif item[0] is _CLOSE:
                self._closing_at = item[1] if self._closing_at is None else min(self._closing_at, item[1])
                # Believed down? Ask once more before giving up: "down" may only have meant slow
                # acknowledgements, and the last batches (the rank's last word) matter most.
                self._close_probe = self._down
                if self._down:
                    self._next_probe = time.monotonic()  # one last try before spooling for good
            else:
                self._accept(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(
        self, payload: Message, size: int, rank: int, on_spooled: Callable[[bool], None] | None = None, parts: tuple[ingest_pb2.BatchPart, ...] = ()
    ) -> None:  # fmt: skip
        out = self._wrap(payload, size, rank, parts)
        self._stats.events[out.kind] = self._stats.events.get(out.kind, 0) + out.events
        if out.kind in REGISTRATIONS:
            self._registers[rank] = payload
        if self.durable:
            spooled = self._stats.spooled
            self._to_spool(out)
            if on_spooled is not None:
                on_spooled(self._stats.spooled > spooled)
            return
        (self._urgent if out.kind in URGENT else self._pending).append(out)
        if self._down:
            self._spool_memory()

    def _wrap(self, payload: Message, estimate: int, rank: int, parts: tuple[ingest_pb2.BatchPart, ...] = ()) -> _Out:
        """The payload in ``rank``'s envelope; what it holds of the budget becomes its real size."""
        kind = _FIELDS[payload.DESCRIPTOR.full_name]
        self._seq += 1
        batch = ingest_pb2.Batch(
            schema_version=BATCH_SCHEMA_VERSION,
            run_id=self.run_id,
            rank=rank,
            batch_id=self._instance + self._seq.to_bytes(8, "big"),
            parts=parts,
            **{kind: payload},
        )
        data = batch.SerializeToString()
        if estimate:
            with self._budget_lock:
                self._queued_bytes += len(data) - estimate
        return _Out(self._seq, data, event_count(payload), kind, len(data) if estimate else 0)

    def _stamp(self) -> bytes:
        """The clock fields, appended to a serialized batch: a later field wins when parsed."""
        return ingest_pb2.Batch(clock_offset_ns=self._clock.offset_ns, sent_ns=time.time_ns()).SerializeToString()

    def _issue(self) -> None:
        now = time.monotonic()
        if self._paused_until > now or self._closing_at is not None and now >= self._closing_at:
            return
        if self._down:
            if now < self._next_probe or self._inflight:
                return
            self._close_probe = False  # this is the probe closing asked for
            # The probe: its outcome decides whether the collector is back. The registrations
            # go first after a reconnect (the collector may have restarted, or be another).
            first = next(iter(self._registers.items()), None)
            out = self._wrap(first[1], 0, first[0]) if first is not None else self._next_out()
            if out is not None:
                out.probe = first is not None
                self._call(out)
            else:
                self._next_probe = now + self._backoff_s
            return
        while True:
            if len(self._inflight) < self.window:
                out = self._next_out()
            elif self._urgent and not self._reregister and len(self._inflight) < self.window + URGENT_SLOTS:
                out = self._urgent.popleft()
            else:
                return
            if out is None:
                return
            self._call(out)

    def _next_out(self) -> _Out | None:
        """Registrations after a reconnect, retries, heartbeats and stack dumps, then the spool, then
        new batches: oldest first."""
        if self._reregister:
            return self._reregister.popleft()
        if self._retry:
            return self._retry.pop(0)
        if self._urgent:
            return self._urgent.popleft()
        record = self._spool.pop()
        if record is not None:
            self._read_seq += 1
            return _Out(self._read_seq, record.data, record.events, "spooled", own=not record.segment.adopted, segment=record.segment)
        return self._pending.popleft() if self._pending else None

    def _call(self, out: _Out) -> None:
        out.attempts += 1
        out.sent_ns = time.time_ns()
        data = out.data + self._stamp() if out.own else out.data
        future = self._send.future(data, timeout=CALL_TIMEOUT_S, metadata=self._metadata)
        out.route = self._route
        self._inflight[id(out)] = out
        self._stats.sent += 1
        # Runs on a gRPC thread: hand the outcome to the sender with the arrival time.
        future.add_done_callback(lambda f, out=out: self._inbox.put(_Done(out, f, time.time_ns())))

    def _completed(self, done: _Done) -> None:
        out = done.out
        if self._inflight.pop(id(out), None) is None:
            return  # already given up on (closing)
        code = done.future.code()
        if code is grpc.StatusCode.OK:
            self._acked(out, done.future.result(), done.arrived_ns)
            return
        name = code.name if code is not None else "UNKNOWN"
        self._stats.errors[name] = self._stats.errors.get(name, 0) + 1
        details = done.future.details() or ""
        if out.route != self._route:  # sent to the relay since left: the collector hears it now
            self._requeue(out)
            return
        if code in _TRANSIENT and self._target != self.config.collector:
            self._requeue(out)
            self._bypass_relay(name, details)
            return
        if code in _TRANSIENT:
            if code is grpc.StatusCode.UNAUTHENTICATED:
                warn_once("UNAUTHENTICATED", f"the collector at {self.config.collector} refused the token (RANKSCOPE_TOKEN): {details}")
            if not out.probe:  # a failed probe is simply made afresh next time
                self._requeue(out)
            self._went_down(name, details)
            self._spool_memory()
            return
        if self._down:
            self._came_back()  # it answered: it is reachable
        # busy, or a run whose registration is still on its way (a few tries): the collector says when to come back
        retry = code is grpc.StatusCode.RESOURCE_EXHAUSTED or (code is grpc.StatusCode.FAILED_PRECONDITION and out.attempts < MAX_ATTEMPTS)
        if retry and (delay_ms := _retry_after_ms(done.future)) is not None:
            self._requeue(out)
            self._paused_until = max(self._paused_until, time.monotonic() + delay_ms / 1000)
        elif code is grpc.StatusCode.CANCELLED:  # an overloaded server drops calls it cannot serve: never the batch's fault
            self._requeue(out)
            self._paused_until = max(self._paused_until, time.monotonic() + BACKOFF_FIRST_S)
        elif code is grpc.StatusCode.FAILED_PRECONDITION and "is not registered" in details and self._registers and out.attempts < MAX_ATTEMPTS:
            # rows that overtook their run's registration, sent in the same window: it is on its way
            self._requeue(out)
            self._paused_until = max(self._paused_until, time.monotonic() + BACKOFF_FIRST_S)
        elif code in _REFUSED or out.attempts >= MAX_ATTEMPTS:  # RESOURCE_EXHAUSTED here: too large
            warn_once(f"drop:{name}", f"the collector refused a {out.kind} batch ({name}: {details}); such batches are dropped")
            self._give_up(out)
        else:  # INTERNAL, UNKNOWN, ...: maybe the collector's passing trouble; a few more tries
            self._requeue(out)
            self._paused_until = time.monotonic() + self._backoff_s

    def _acked(self, out: _Out, ack: ingest_pb2.Ack, arrived_ns: int) -> None:
        self._clock.add(out.sent_ns, ack.received_ns, ack.replied_ns, arrived_ns)
        self._stats.acked += 1
        self._stats.duplicates += ack.duplicate
        if out.segment is not None:
            self._stats.replayed += 1
            self._spool.done(out.segment)
        self._release(out)
        if out.probe:  # the other ranks' registrations follow the probe's, before anything else
            self._reregister.extend(self._wrap(p, 0, r) for r, p in list(self._registers.items())[1:])
        if self._down:
            self._came_back()
        for command in ack.commands:
            if self.on_command is not None:
                try:
                    self.on_command(command)
                except Exception as exc:  # noqa: BLE001 - the handler is not ours to crash
                    warn_once("on_command", f"the command handler failed ({exc!r})")

    def _requeue(self, out: _Out) -> None:
        """Back to the front, in order: a failed call is older than anything not yet sent."""
        self._retry.append(out)
        self._retry.sort(key=_order)

    def _give_up(self, out: _Out) -> None:
        self._stats.dropped += 1
        self._stats.dropped_events += out.events
        if out.segment is not None:
            self._spool.done(out.segment)
        self._release(out)

    def _bypass_relay(self, code: str, details: str) -> None:
        """The relay is gone: from now on the collector directly, registrations first, then what
        the relay did not acknowledge, then what it left in its spool, then the rest."""
        warn_once(f"relay:{self._target}", f"this host's relay at {self._target} does not answer ({code}: {details}); "
                  f"sending to the collector at {self.config.collector} directly")  # fmt: skip
        old, self._target = self._channel, self.config.collector
        self._route += 1
        self._connect()
        if old is not None:
            old.close()  # its calls still in flight end CANCELLED, and are sent again on the new route
        self._reregister.extend(self._wrap(p, 0, r) for r, p in self._registers.items())
        self._adopt_leftovers()
        self._relay_probe = time.monotonic() + RELAY_PROBE_S

    def _return_to_relay(self) -> None:
        """Back to this host's relay once one answers on its socket again (between calls, so that
        nothing sent to the collector is sent again through it)."""
        relay = self.config.relay
        if relay is None or self._target == relay or self._inflight or time.monotonic() < self._relay_probe:
            return
        self._relay_probe = time.monotonic() + RELAY_PROBE_S
        if not answers(relay):
            return
        log.warning("rankscope agent: this host's relay at %s answers again; %s sends through it", relay, self.name)
        old, self._target = self._channel, relay
        self._route += 1
        self._connect()
        if old is not None:
            old.close()

    def _went_down(self, code: str, details: str) -> None:
        self._reregister.clear()  # the next probe starts the registrations over
        if not self._down:
            self._down = True
            self._down_since = time.monotonic()
            self._outage = (self._stats.spooled, self._stats.dropped)
            self._backoff_s = BACKOFF_FIRST_S
            then = (f"training goes on, telemetry is spooled to {self.config.spool_dir} and replayed when it is back" if self.run_id
                    else f"what is not sent stays in {self.config.spool_dir}")  # a replay of leftovers: no run of its own  # fmt: skip
            warn_once(f"down:{self.config.collector}:{code}", f"cannot reach the collector at {self.config.collector} ({code}: {details}); {then}")
        else:
            self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
        self._next_probe = time.monotonic() + self._backoff_s * random.uniform(0.5, 1.0)

    def _spool_memory(self) -> None:
        """Move the batches held only in memory to the spool, oldest first.

        Not while calls are in flight: those that fail come back older than anything queued,
        and the spool must stay in order for whoever replays it.
        """
        if self._inflight:
            return
        keep = [out for out in self._retry if out.segment is not None]  # already on disk, in order
        for out in [*(out for out in self._retry if out.segment is None), *sorted([*self._urgent, *self._pending], key=_order)]:
            self._to_spool(out)
        self._retry = keep
        self._pending.clear()
        self._urgent.clear()

    def _came_back(self) -> None:
        self._down = False
        spooled = self._stats.spooled - self._outage[0]
        dropped = self._stats.dropped - self._outage[1]
        log.warning(
            "rankscope agent: the collector at %s is back after %.1f s; %d batches were spooled, %d dropped; replaying",
            self.config.collector, time.monotonic() - self._down_since, spooled, dropped,
        )

    def _to_spool(self, out: _Out) -> None:
        """Write a batch (with the clock estimate of now) to disk, making room oldest-first."""
        if out.segment is not None:
            return  # already on disk
        try:
            dropped, dropped_events = self._spool.append(out.data + self._stamp() if out.own else out.data, out.events)
            self._stats.spooled += 1
        except OSError as exc:  # disk full, no permission: this batch is lost
            warn_once(f"spool:{self.config.spool_dir}", f"cannot write the spool in {self.config.spool_dir} ({exc}); batches are dropped")
            dropped, dropped_events = 1, out.events
        self._stats.dropped += dropped
        self._stats.dropped_events += dropped_events
        self._release(out)

    def _release(self, out: _Out) -> None:
        if out.charge:
            with self._budget_lock:
                self._queued_bytes -= out.charge
            out.charge = 0

    def _shut_down(self) -> None:
        """Everything not acknowledged goes to the spool; files and channel are released."""
        self._accepting = False
        self._retry = sorted([*self._inflight.values(), *self._retry], key=_order)
        self._inflight.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, _Done) and item[0] is not _CLOSE:
                self._accept(*item)
        self._spool_memory()
        self._spool.close()
        if self._channel is not None:
            self._channel.close()

    def _after_fork_in_child(self) -> None:
        """A forked child must not send this rank's data, nor touch its files."""
        self._forked = True
        self._accepting = False
        self._spool.forget_after_fork()


def event_count(payload: Message) -> int:
    """How many events a payload carries: columnar batches say it, heartbeats are a list or columns."""
    kind = _FIELDS[payload.DESCRIPTOR.full_name]
    if kind in _COLUMNAR:
        return payload.count  # type: ignore[attr-defined, no-any-return]
    if kind == "heartbeats":
        return len(payload.heartbeats) + payload.columns.count  # type: ignore[attr-defined]
    return 1


def _order(out: _Out) -> tuple[int, int]:
    # Spooled records were written before anything now in memory was created.
    return (0 if out.segment is not None else 1, out.seq)


def _retry_after_ms(future: Any) -> float | None:
    for key, value in future.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                return max(0.0, float(value))
            except ValueError:
                return None
    return None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


_live: weakref.WeakSet[Transport] = weakref.WeakSet()


def _quiet_after_fork() -> None:
    for transport in list(_live):
        transport._after_fork_in_child()


os.register_at_fork(after_in_child=_quiet_after_fork)


def replay_leftovers(config: AgentConfig, timeout_s: float) -> TransportStats:
    """Send what ended processes left in ``config.spool_dir``, within ``timeout_s``.

    What ``rankscope spool replay`` does; an agent does the same when it starts. Batches that
    cannot be sent stay where they are for the next attempt.
    """
    transport = Transport(config, run_id="", rank=0, name="spool-replay")
    transport.start()
    transport.close(timeout_s)
    return transport.stats()

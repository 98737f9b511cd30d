"""Heartbeats and stall detection: what makes a hung rank visible.

A daemon thread reports the rank's state (``RankState``) every ``interval_s``. It keeps beating
while the training thread is blocked in a collective, in ``time.sleep`` or in any C call that
releases the GIL, which is exactly when the collector needs to hear that the rank is alive but
not progressing. When nothing has progressed (no span or collective ended) for ``stall_s``, the
status becomes "stalled" and one stack dump is sent per stall episode. A second daemon thread
takes the stack dumps: the stall's, those the collector asks for (``on_command``), and one per stop
of a sibling process (the host's other ranks) seen stopped at two beats in a row (a stopped rank
cannot take its own). Neither the training thread nor the transport's sender ever runs py-spy, and
the beats go on while it runs: a dump takes up to ``PY_SPY_TIMEOUT_S`` on a loaded host, and a rank
that stopped beating for it was judged silent with the rank it dumped (CI of 11134ce: "host node-1
is silent" for a stopped rank 2 whose host-mate was taking its stack).
"""

from __future__ import annotations

import functools
import queue
import threading
import time

from rankscope.agent.config import warn_once
from rankscope.agent.stacks import dump_stack, peer_stack, stopped_siblings
from rankscope.agent.state import RankState
from rankscope.agent.transport import Transport
from rankscope.protos.v1 import ingest_pb2, telemetry_pb2

__all__ = ["Heartbeat"]

IN_FLIGHT_LIMIT = 16
_STOP = object()


class Heartbeat:
    """Beats for one rank into ``transport``; ``start()`` it, ``stop()`` it at the end."""

    def __init__(self, state: RankState, transport: Transport, *, interval_s: float, stall_s: float) -> None:
        self.state = state
        self.transport = transport
        self.interval_s = interval_s
        self.stall_s = stall_s
        self._stops: queue.SimpleQueue[object] = queue.SimpleQueue()  # the beating thread's: only _STOP
        #: the dumping thread's: what takes a dump (its payload, or None), or _STOP
        self._dumps: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stall_episode: int | None = None  # last_progress_ns of the stall already dumped
        self._stopped: set[int] = set()  # siblings stopped at the last beat
        self._stopped_dumped: set[int] = set()  # siblings dumped in their current stop
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=self._run, name="rankscope-heartbeat", daemon=True),
                             threading.Thread(target=self._run_dumps, name="rankscope-stacks", daemon=True)]  # fmt: skip
            for thread in self._threads:
                thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop beating and dumping (a dump in progress may take up to its own timeout: not waited for
        beyond ``timeout_s``, its thread is a daemon)."""
        if self._threads:
            self._stops.put(_STOP)
            self._dumps.put(_STOP)
            for thread in self._threads:
                thread.join(timeout_s)
            self._threads = []

    def on_command(self, command: ingest_pb2.Command) -> None:
        """The Transport's ``on_command``: queue the collector's requests for the dumping thread."""
        if command.HasField("stack_dump"):
            self._dumps.put(functools.partial(dump_stack, "requested"))

    def beat(self) -> telemetry_pb2.Heartbeat:
        """Build and submit one heartbeat now; a new stall episode also gets its stack dump."""
        state = self.state
        now = time.time_ns()
        last = state.last_progress_ns
        stalled = now - last > self.stall_s * 1e9
        heartbeat = telemetry_pb2.Heartbeat(
            time_ns=now,
            step=state.step,
            phase=state.phase,
            status="stalled" if stalled else "running",
            last_progress_ns=last,
            in_flight=[
                telemetry_pb2.InFlight(group=op.group, seq=op.seq, op=op.op, peer=op.peer, issue_ns=op.issue_ns, waiting=op.waiting)
                for op in state.in_flight(IN_FLIGHT_LIMIT)
            ],
            # What submitters lost (they count refused submits there) and what the transport lost later.
            events_dropped=state.dropped + self.transport.stats().dropped_events,
        )
        self._submit(telemetry_pb2.HeartbeatBatch(heartbeats=[heartbeat]))
        if stalled and self._stall_episode != last:
            self._stall_episode = last
            self._dumps.put(functools.partial(dump_stack, "stalled"))
        self._dump_stopped_siblings()
        return heartbeat

    def _dump_stopped_siblings(self) -> None:
        stopped = stopped_siblings()
        for pid in sorted((stopped & self._stopped) - self._stopped_dumped):
            self._stopped_dumped.add(pid)
            self._dumps.put(functools.partial(peer_stack, pid))
        self._stopped = stopped
        self._stopped_dumped &= stopped  # a sibling resumed: its next stop is a new one

    def _submit(self, payload: telemetry_pb2.HeartbeatBatch | telemetry_pb2.StackDump) -> None:
        if not self.transport.submit(payload):
            self.state.dropped += 1

    def _run(self) -> None:
        next_beat = time.monotonic()
        while True:
            try:
                self._stops.get(timeout=max(0.0, next_beat - time.monotonic()))
                return
            except queue.Empty:
                pass
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - a broken beat must not end the thread
                warn_once("heartbeat", f"a heartbeat failed ({exc!r})")
            next_beat = max(next_beat + self.interval_s, time.monotonic())

    def _run_dumps(self) -> None:
        while (take := self._dumps.get()) is not _STOP:
            try:
                dump = take()  # type: ignore[operator]
                if dump is not None:
                    self._submit(dump)
            except Exception as exc:  # noqa: BLE001 - a failed dump must not end the thread
                warn_once("stack-dump", f"a stack dump failed ({exc!r})")

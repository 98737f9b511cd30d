"""Every collective and point-to-point operation, whichever path issued it, recorded once.

Two sources, merged on (process group, sequence number): the wrappers of ``collective_patches``,
which queue raw tuples on the caller's thread, and torch's flight recorder (``flight_recorder``),
read only for the sequence numbers no wrapper issued. gloo's recorder has no start or end times:
such an operation began when it was issued, and one DDP's reducer issued in a backward pass ended
when DDP's wait for it at the end of that pass returned (``backward_began``/``backward_synced``,
called by ``autospans``); it is done then whatever the recorder says.

Sequence numbers. For collectives the number is the flight recorder's ``collective_seq_id``:
the count of collectives on the group, identical on every member because all members issue
the same collectives in the same order. It comes from the backend's counter
(``_get_sequence_number_for_group``) read before the call: the call is the next number, once the
point-to-point operations that counter also counts are taken off (gloo counts them, NCCL does
not: measured per group on the first send/recv, whose counter is read after the call too). Where
a call may leave the counter alone (NCCL numbers the collectives of a coalesced block when the
block begins; any backend but gloo) it is read after the call as well, and a call that left it
alone has the number it holds. Numbers the counter passed without a wrapper call are gaps the
flight recorder fills. Without the counter (custom backends) the agent counts the group's
collectives itself.

Point-to-point operations are numbered per (group, sender, receiver) from 1: the n-th send
from A to B on a group matches the n-th receive at B from A, because both backends deliver a
pair's messages in order. A receive from any source (``recv_anysource``) has no peer and seq 0.

The background thread (``Collectives.poll``, every ``RANKSCOPE_FLUSH_S`` or when a queue fills)
derives everything the wrappers left out: sequence numbers and gaps, names and string ids, peers,
the heartbeat's in-flight list, the rows. An operation in that list leaves it as it completes, on
the completing thread (``Collectives.land``): the heartbeats never report one that has ended.
The background thread reads no counter of a group a wrapper marked ``busy`` (``Channel.busy``).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from rankscope.agent.config import warn_once
from rankscope.agent.flight_recorder import FlightRecorder
from rankscope.agent.process_groups import GroupInfo, Groups, backend
from rankscope.agent.recorder import COMPLETED, FAILED, PENDING, Recorder, Span, take_all
from rankscope.agent.state import InFlightOp

FLIGHT_AFTER_S = 0.5  # an operation pending this long shows in the heartbeats' in-flight list
#: a backward pass's start taken this much earlier: the flight recorder's clock and the agent's
#: (perf_counter anchored to the wall clock, re-anchored past a millisecond of drift) may differ that much
SYNC_SLACK_NS = 1_000_000

_DTYPES: dict[torch.dtype, str] = {}  # torch dtype -> its name in the rows


class Channel:
    """Sequence-number bookkeeping of one process group.

    The wrappers only read the backend's counter and mark their call in ``busy``; every other
    field belongs to the background thread, which derives sequence numbers from the counter
    readings the rows carry, in the order the rows were appended.
    """

    __slots__ = ("pg", "index", "info", "me", "group_id", "counter", "reread", "busy", "p2p_step", "p2p_in", "last", "p2p",
                 "closed", "lost_p2p")  # fmt: skip

    def __init__(self, pg: Any, index: int, info: GroupInfo, group_id: int) -> None:
        self.pg = pg
        self.index = index  # what rows carry: a row of plain values is untracked at the garbage collector's first pass
        self.info = info
        self.me = pg.rank()  # this rank's place in the group
        self.group_id = group_id
        self.counter: Callable[[], int] | None = getattr(pg, "_get_sequence_number_for_group", None)
        #: the counter once more, read after each collective call where the call may leave it alone
        #: (NCCL numbers the collectives of a coalesced block when the block begins); None on gloo,
        #: whose counter every collective moves by one (a test checks), so that a second reading
        #: there, a fifth of the agent's cost per call, would say nothing
        self.reread = None if backend(pg) == "gloo" else self.counter
        #: one entry per wrapper call between its first counter reading and its row (list append
        #: and pop are atomic): the poller reads no counter of a group meanwhile
        self.busy: list[None] = []
        self.p2p_step: int | None = None  # does the backend's counter count point-to-point ops (0/1)
        self.p2p_in = 0  # point-to-point ops inside the counter
        self.last = 0  # collective seq accounted for (issued by a wrapper, or a known gap)
        self.p2p: dict[tuple[int, int], int] = {}  # (sender, receiver) group ranks -> ops so far
        self.closed = False  # shut down: its counter is no longer read
        self.lost_p2p = 0  # point-to-point rows dropped on a full queue (their counter steps still count)

    def raw(self) -> int | None:
        """The backend's counter (collectives and, on gloo, point-to-point ops), None without one."""
        counter = self.counter
        if counter is None:
            return None
        try:
            return int(counter())
        except Exception:  # noqa: BLE001 - e.g. "backend does not support sequence numbers"
            self.counter = self.reread = None
            return None


class _Open:
    """A wrapper-issued operation, as the background thread keeps it until its completion arrives."""

    __slots__ = ("row", "ch", "seq", "op", "op_id", "nbytes", "dtype_id", "peer", "issue", "start", "step", "waiting", "flight")


# A row of ``Collectives.issued``, appended by the wrappers (a tuple: cheaper than any object; of
# plain values only, so that the garbage collector stops tracking it at its first pass): channel
# index, spec (op, tensor argument index, kind), synchronous, bytes, torch dtype (None without
# tensors), peer argument (group rank, -1 for collectives), issue token, start token, step, the
# backend's counter before the call and after it (None without, or not read again).
Row = tuple[int, tuple[str, int | None, str], bool, int, Any, Any, int, int, int, int | None, int | None]


class Collectives:
    """Turns wrapper calls and flight-recorder gaps into collective rows and in-flight state.

    The hot path (the wrappers of ``collective_patches``, and the completion callbacks of
    ``track``) appends raw tuples to three queues: operations ``issued``, ``waits`` entered,
    ``completions``. The background thread (``poll``) pops completions and waits first, then
    the issued rows, and does the rest: sequence numbers and gaps from the counter readings,
    names, dtype, peer, the in-flight list and the collective rows.
    """

    def __init__(self, rec: Recorder, groups: Groups, fr_interval_s: float = 2.0, fr_tries: int = 3) -> None:
        self.rec = rec
        self.state = rec.state
        self.groups = groups
        self.fr = FlightRecorder()
        self.fr_interval_s = fr_interval_s
        self.fr_tries = fr_tries
        self.lost = 0  # gaps the flight recorder could not fill
        self._lock = threading.Lock()  # a group's first sight
        self.channels: dict[Any, Channel] = {}  # by group (ProcessGroup hashes and compares by identity)
        self._index: list[Channel] = []  # by Channel.index
        # written by the hot path (appends, atomic), popped by the background thread
        self.issued: deque[Row] = deque()
        self.waits: deque[Row] = deque()  # asynchronous operations a thread waits in
        self.completions: deque[tuple[Row, int, int]] = deque()  # (row, end token, state)
        #: id(Work) -> (row, the spans its synchronous call paused (None: asynchronous, not seen to yet),
        #: whether it completes when its wait returns)
        self.by_work: dict[int, tuple[Row | None, list[Span] | tuple[()] | None, bool]] = {}
        self.flying: dict[int, _Open] = {}  # id(row) -> in the heartbeat's in-flight list (CPU clock), until it completes
        # the background thread's (under ``_polling``)
        self._open: dict[int, _Open] = {}  # id(row) -> the operation (holding its row: ids stay unique), until it completes
        self._on_gpu: list[tuple[int, _Open]] = []  # completed on the CPU side, in flight on the GPU
        self._gaps: dict[tuple[str, int], int] = {}  # (torch group name, seq) -> dumps it was looked for
        self._ids: dict[Any, int] = {}  # op names and torch dtypes -> string ids
        self._last_dump = 0.0
        #: DDP's backward passes as (began, synced) wall ns: the reducer issues its all-reduces in C++
        #: inside one and waits for all of them before the pass returns, so that is when they ended
        #: (gloo's flight recorder has no end times); written by ``backward_began``/``backward_synced``
        self.syncs: deque[tuple[int, int]] = deque(maxlen=256)
        self.syncing_since: int | None = None  # a DDP backward pass in progress began then
        self._polling = threading.Lock()  # the background thread polls; a group's shutdown, on its own thread

    # --- hot path: what the wrappers call ------------------------------------------------------

    def channel(self, pg: Any) -> Channel:
        """``pg``'s bookkeeping, made at its first sight (by a wrapper, or by the poller's scan)."""
        ch = self.channels.get(pg)
        if ch is not None:
            return ch
        with self._lock:  # first sight, possibly from two threads at once
            ch = self.channels.get(pg)
            if ch is None:
                info = self.groups.info(pg)
                ch = self.channels[pg] = Channel(pg, len(self._index), info, self.rec.strings.id(info.name))
                self._index.append(ch)
            return ch

    def rename(self, pg: Any, name: str) -> None:
        """Report ``pg`` as ``name`` (``name_groups``) in its rows from now on."""
        info = self.groups.rename(pg, name)
        self.channel(pg).group_id = self.rec.strings.id(info.name)

    def crowded(self, row: Row, ch: Channel) -> Row | None:
        """The queue holds ``flush_rows`` rows: wake the background thread; beyond ``capacity`` the
        row is dropped and counted (None)."""
        rec = self.rec
        if not rec.wake.is_set():
            rec.wake.set()
        if len(self.issued) < rec.capacity:
            self.issued.append(row)
            return row
        rec.state.dropped += 1
        if row[1][2] != "c":
            ch.lost_p2p += 1
        return None

    def track(self, work: Any, row: Row) -> None:
        """An asynchronous operation completes in a callback (gloo's thread, or inline when already
        done), whose exact time is worth the thread hand-off it costs; without a future, when its
        ``wait`` returns."""
        key = id(work)
        try:
            future = work.get_future()
        except Exception:  # noqa: BLE001 - no future for this Work: completed when its wait() returns
            self.by_work[key] = (row, None, True)
            return
        self.by_work[key] = (row, None, False)
        rec, completions, by_work, c = self.rec, self.completions, self.by_work, self

        def complete(fut: Any) -> None:
            state = COMPLETED
            try:
                fut.value()
            except Exception:  # noqa: BLE001 - the collective failed; the caller sees the error itself
                state = FAILED
            try:
                completions.append((row, rec.now(), state))
                if c.flying:
                    c.land(row)
                entry = by_work.get(key)
                if entry is not None and entry[0] is row:
                    by_work.pop(key, None)
            except Exception as exc:  # noqa: BLE001 - runs in torch's callback: never raise there
                warn_once("collective-finish", f"recording a collective failed ({exc!r})")

        future.then(complete)

    def backward_began(self, wall_ns: int) -> None:
        """A DDP module's backward pass began (on the autograd thread): its reducer's all-reduces follow."""
        self.syncing_since = wall_ns

    def backward_synced(self, wall_ns: int) -> None:
        """DDP waited for its reducer's all-reduces (its end-of-backward callback returned)."""
        began, self.syncing_since = self.syncing_since, None
        if began is not None:
            self.syncs.append((began - SYNC_SLACK_NS, wall_ns))

    # --- background thread ----------------------------------------------------------------------

    def poll(self) -> None:
        """Turn what the wrappers recorded into rows, find operations they did not see, and finish
        GPU-side completions."""
        with self._polling:
            self._poll(fill=False)

    def closing(self, pg: Any) -> None:
        """``pg`` is about to shut down: look for unseen operations while the groups and the flight
        recorder still hold them, then leave its counter alone."""
        try:
            with self._polling:
                self._poll(fill=True)
            self.channel(pg).closed = True
        except Exception as exc:  # noqa: BLE001 - runs inside destroy_process_group: never raise there
            warn_once("collective-closing", f"the last collectives of a group could not be looked for ({exc!r})")

    def _poll(self, fill: bool) -> None:
        for pg in self.groups.scan():
            self.channel(pg)
        self._collect()
        # A counter read while no wrapper call on its group is between its readings and its row
        # counts only operations whose rows are appended by then: collected just below, so what
        # is left beyond them was issued outside Python, a gap for the flight recorder.
        readings = []
        for ch in list(self._index):
            if not ch.closed and ch.counter is not None:
                raw = ch.raw()
                if raw is not None and not ch.busy:
                    readings.append((ch, raw))
        self._collect()
        for ch, raw in readings:
            self._account(ch, raw - ch.p2p_in)
        if self._show_in_flight():
            self._collect()  # those that completed meanwhile leave the list again (see ``land``)
        self._finish_on_gpu()
        if self._gaps and (fill or time.monotonic() - self._last_dump >= self.fr_interval_s or len(self._gaps) > 1000):
            self._fill_gaps(final=False)

    def _collect(self) -> None:
        """Everything the hot path appended: completions and waits are taken first, so that every
        row they name was appended before the issued rows are taken. An operation that completed
        within the same round (the common case) becomes its row at once; the others wait in
        ``_open``."""
        done, waits, issued = take_all(self.completions), take_all(self.waits), take_all(self.issued)
        ended: dict[int, tuple[int, int]] = {}
        for row, end, state in done:
            o = self._open.pop(id(row), None)
            if o is not None:  # opened in an earlier round
                self._finish(o, end, state)
            else:  # issued in this one
                ended[id(row)] = (end, state)
        rows = []
        strings = self.rec.strings
        for row in issued:
            try:
                index, (op, _, kind), synchronous, nbytes, dtype, peer, issue, start, step, before, after = row
                ch = self._index[index]
                # _sequence's common case, inline: a collective that moved the counter by one (or on gloo, always)
                if kind == "c" and before is not None and (after is None or after == before + 1):
                    count = before - ch.p2p_in
                    if count > ch.last:
                        self._gap(ch, ch.last + 1, count)
                    seq = count + 1
                    if seq > ch.last:
                        ch.last = seq
                    peer = -1
                else:
                    seq = self._sequence(ch, kind, before, after, peer)
                    peer = -1 if kind in ("c", "any") else ch.info.ranks[int(peer)]
                op_id = self._ids.get(op)
                if op_id is None:
                    op_id = self._ids[op] = strings.id(op)
                dtype_id = self._ids.get(dtype)
                if dtype_id is None:
                    name = "" if dtype is None else _DTYPES.get(dtype) or _DTYPES.setdefault(dtype, str(dtype).removeprefix("torch."))
                    dtype_id = self._ids[dtype] = strings.id(name)
                e = ended.pop(id(row), None)
                if e is not None:
                    rows.append((ch.group_id, seq, op_id, nbytes, dtype_id, peer, issue, start, e[0], e[1], step))
                    continue
                o = _Open()
                o.row, o.ch, o.seq, o.op, o.op_id, o.nbytes, o.dtype_id, o.peer = row, ch, seq, op, op_id, nbytes, dtype_id, peer
                o.issue, o.start, o.step = issue, start, step
                o.waiting, o.flight = synchronous, None  # torch waits for a synchronous one at once
                self._open[id(row)] = o
            except Exception as exc:  # noqa: BLE001 - one odd call must not stop the others
                warn_once("collective-row", f"a collective could not be recorded ({exc!r})")
        self.rec.add_collectives(rows)
        for ch in self._index:
            if ch.lost_p2p:  # dropped point-to-point rows: their counter steps still count
                lost, ch.lost_p2p = ch.lost_p2p, 0
                ch.p2p_in += lost * (ch.p2p_step or 0)
        for row in waits:
            o = self._open.get(id(row))
            if o is not None:
                o.waiting = True

    def _sequence(self, ch: Channel, kind: str, before: int | None, after: int | None, peer: Any) -> int:
        """The operation's number from the counter readings around its call (module docstring)."""
        if before is not None:
            before -= ch.p2p_in
            self._account(ch, before)
        if after is not None:
            after -= ch.p2p_in
        if kind != "c":
            if before is not None and ch.p2p_step is None:
                ch.p2p_step = 0 if after is None else after - before
            ch.p2p_in += ch.p2p_step or 0
            if kind == "any":
                return 0
            pair = (ch.me, int(peer)) if kind == "send" else (int(peer), ch.me)
            ch.p2p[pair] = n = ch.p2p.get(pair, 0) + 1
            return n
        if before is None:
            ch.last += 1  # counted here: the same on every member, which sees the same calls
            return ch.last
        if after is not None and after <= before:  # the call left the counter alone (see ``Channel.reread``)
            ch.last = max(ch.last, after)
            return after
        # The call moved the counter, so this one is the next number; the counter moving further
        # meanwhile (another thread on this group, or C++) leaves numbers unclaimed: gaps, found
        # now where it was read again, else by the next reading.
        seq = before + 1
        ch.last = max(ch.last, seq)
        if after is not None:
            self._account(ch, after)
        return seq

    def _account(self, ch: Channel, count: int) -> None:
        """The group's counter of collectives reached ``count``: numbers nobody claimed are gaps."""
        if count > ch.last:
            self._gap(ch, ch.last + 1, count)
            ch.last = count

    def _finish(self, o: _Open, end: int, state: int) -> None:
        """Record the row of a completed (or failed, or, at exit, pending) operation."""
        self.rec.add_collective(
            o.ch.group_id, o.seq, o.op_id, o.nbytes, o.dtype_id, o.peer, o.issue, o.start, end, state, o.step
        )  # fmt: skip
        if state == PENDING or o.flight is None:
            return
        self.flying.pop(id(o.row), None)
        if self.rec.cpu_clock:  # its completing thread may have taken it out already: leaving again is harmless
            self.state.leave(o.ch.info.name, o.seq, o.op, o.peer, self.rec.clock.wall_ns())
        else:
            self._on_gpu.append((end, o))

    def _show_in_flight(self) -> bool:
        """Operations pending for ``FLIGHT_AFTER_S`` enter (or update) the heartbeat's list; whether any did.

        On the CPU clock each is noted in ``flying`` first, so that its completion, on whichever
        thread, takes it out at once (``land``). One that completed before it was noted is among
        the completions the caller collects next.
        """
        now = time.perf_counter_ns()
        old = now - int(FLIGHT_AFTER_S * 1e9)
        to_wall = self.rec.clock.wall_ns() - now  # issue tokens are perf_counter_ns readings
        entered = False
        for o in self._open.values():
            if o.issue > old or (o.flight is not None and o.flight.waiting == o.waiting):
                continue
            o.flight = InFlightOp(o.ch.info.name, o.seq, o.op, o.peer, o.issue + to_wall, waiting=o.waiting)
            if self.rec.cpu_clock:
                self.flying[id(o.row)] = o
            self.state.enter(o.flight)
            entered = True
        return entered

    def land(self, row: Row) -> None:
        """``row``'s operation completed (on the completing thread): out of the heartbeat's
        in-flight list now, not at the next poll."""
        o = self.flying.pop(id(row), None)
        if o is not None:
            self.state.leave(o.ch.info.name, o.seq, o.op, o.peer, self.rec.clock.wall_ns())

    def _finish_on_gpu(self) -> None:
        still = []
        for end, o in self._on_gpu:
            if self.rec.clock.done(end):
                self.state.leave(o.ch.info.name, o.seq, o.op, o.peer, self.rec.clock.wall_ns())
            else:
                still.append((end, o))
        self._on_gpu = still

    def _gap(self, ch: Channel, first: int, last: int) -> None:
        for seq in range(max(first, last - 10_000 + 1), last + 1):  # older ones left the recorder long ago
            self._gaps.setdefault((ch.info.key, seq), 0)

    def _fill_gaps(self, final: bool) -> None:
        self._last_dump = time.monotonic()
        dump = self.fr.read()
        found = set()
        syncs, syncing = list(self.syncs), self.syncing_since
        for e in dump.entries if dump else ():
            key = (e.group, e.seq)
            if key not in self._gaps or e.p2p:
                continue
            info = self.groups.by_key(e.group)
            if info is None:
                continue
            synced = _synced_by(syncs, e.issue_ns)
            # in a DDP backward still in progress: done once DDP has waited for it, which tells when
            done = synced > 0 or (dump.done(e) and (syncing is None or e.issue_ns < syncing - SYNC_SLACK_NS))
            flight = InFlightOp(info.name, e.seq, e.op, -1, e.issue_ns, waiting=False)
            if not done and not final:
                self.state.enter(flight)
                found.add(key)
                continue
            start = e.start_ns or e.issue_ns  # gloo's recorder has neither start nor end: issued is when it began
            end = e.end_ns or synced or (start if done else 0)  # no end known: none measured, not one in 1970
            self.rec.add_collective(
                self.rec.strings.id(info.name), e.seq, self.rec.strings.id(e.op), e.nbytes, self.rec.strings.id(e.dtype), -1,
                e.issue_ns, start, end, COMPLETED if done else PENDING, self.rec.step_at(e.issue_ns),
            )  # fmt: skip
            self.state.leave(info.name, e.seq, e.op, -1, end or self.rec.clock.wall_ns())
            del self._gaps[key]
        for key in [k for k in self._gaps if k not in found]:
            self._gaps[key] += 1
            if final or dump is None or self._gaps[key] >= self.fr_tries:
                del self._gaps[key]
                self.lost += 1
        if self.lost and dump is not None:
            warn_once("fr-lost", "collectives issued outside Python left torch's flight recorder before it was read")

    def finish_all(self) -> None:
        """At exit: operations still in flight become PENDING rows; gaps get one last look."""
        with self._polling:
            self._collect()
            pending, self._open = list(self._open.values()), {}
            for o in pending:
                self._finish(o, 0, PENDING)
            self._poll(fill=False)
            if self._gaps:
                self._fill_gaps(final=True)


def _synced_by(syncs: list[tuple[int, int]], issue_ns: int) -> int:
    """When the DDP backward pass that ``issue_ns`` falls in had waited for its all-reduces; 0 when none does."""
    i = bisect.bisect_right(syncs, (issue_ns, math.inf)) - 1
    return syncs[i][1] if i >= 0 and issue_ns <= syncs[i][1] else 0

"""Every collective and point-to-point operation, whichever path issued it, recorded once.

Two sources, merged on (process group, sequence number):

1. Wrappers on the methods of ``torch._C._distributed_c10d.ProcessGroup`` (``allreduce``,
   ``allgather``, ``send``, ...) and on ``Work.wait``. Every ``torch.distributed`` Python
   function ends in one of these methods, however it was imported (``from torch.distributed
   import all_reduce`` included), so patching the class sees them all, including the ``*_object``
   variants (as the collectives they are made of), ``batch_isend_irecv`` and FSDP2's calls. The
   method returns the same ``Work``; a synchronous call (torch waits for it at once) completes
   when its ``wait`` returns, an asynchronous one in ``work.get_future().then(...)`` (gloo: when
   it finishes; NCCL: the callback runs with a stream that waits for the collective, so the
   CUDA clock's event marks its end). ``Work.wait`` is where a thread blocks: it marks the
   operation ``waiting`` for the heartbeat and splits the open compute spans around the wait.
2. torch's flight recorder (``_dump_fr_trace``, private), read by the background thread only
   for sequence numbers the wrappers did not issue: DDP's C++ gradient reducer, the functional
   collectives of DTensor, compiled graphs. Dumping costs about 20 ms for 2000 entries, so it
   happens only when such gaps exist, at most every ``fr_interval_s``, and once more when a
   group shuts down (``destroy_process_group`` calls ``ProcessGroup.shutdown``, also wrapped):
   the last operations of a job would otherwise leave with their group.

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

The caller's thread does as little as it can (``_method_wrapper``): it reads the counter, the
tensor's size and dtype object and the clock, and appends them as one tuple of plain values to a
queue; ``wait`` and the completion callbacks append the end the same way. The background thread
(``Collectives.poll``, every ``RANKSCOPE_FLUSH_S`` or when a queue fills) derives everything else:
sequence numbers and gaps, names and string ids, peers, the heartbeat's in-flight list, the rows.
An operation in that list leaves it as it completes, on the completing thread (``_land``): the
heartbeats never report one that has ended.
A wrapper takes no lock: it marks its group ``busy`` (a list append, atomic) while its counter
reading has no row yet, and the background thread reads no counter of a busy group.
Point-to-point operations are numbered per (group, sender, receiver) from 1: the n-th send
from A to B on a group matches the n-th receive at B from A, because both backends deliver a
pair's messages in order. A receive from any source (``recv_anysource``) has no peer and seq 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rankscope.agent.config import warn_once
from rankscope.agent.recorder import COMPLETED, FAILED, PENDING, Recorder, Span, take_all
from rankscope.agent.state import InFlightOp
from rankscope.protos.v1 import telemetry_pb2 as pb

# ProcessGroup method -> (op name, index of the argument holding this rank's tensors, kind)
# kind: "c" collective, "send", "recv", "any" (receive from any source). Methods missing in a
# torch version are skipped.
METHODS: dict[str, tuple[str, int | None, str]] = {
    "allreduce": ("all_reduce", 0, "c"),
    "allreduce_coalesced": ("all_reduce_coalesced", 0, "c"),
    "allgather": ("all_gather", 1, "c"),
    "allgather_coalesced": ("all_gather_coalesced", 1, "c"),
    "_allgather_base": ("all_gather_into_tensor", 1, "c"),
    "all_gather_single": ("all_gather_into_tensor", 1, "c"),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", 1, "c"),
    "all_gather_single_coalesced": ("all_gather_into_tensor_coalesced", 1, "c"),
    "reduce_scatter": ("reduce_scatter", 1, "c"),
    "_reduce_scatter_base": ("reduce_scatter_tensor", 1, "c"),
    "reduce_scatter_single": ("reduce_scatter_tensor", 1, "c"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 1, "c"),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor_coalesced", 1, "c"),
    "broadcast": ("broadcast", 0, "c"),
    "reduce": ("reduce", 0, "c"),
    "gather": ("gather", 1, "c"),
    "scatter": ("scatter", 0, "c"),
    "alltoall": ("all_to_all", 1, "c"),
    "alltoall_base": ("all_to_all_single", 1, "c"),
    "all_to_all_single": ("all_to_all_single", 1, "c"),
    "barrier": ("barrier", None, "c"),
    "send": ("send", 0, "send"),
    "recv": ("recv", 0, "recv"),
    "recv_anysource": ("recv", 0, "any"),
}
# Flight-recorder profiling names (after "gloo:" / "nccl:") in the wrappers' vocabulary.
FR_OPS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "reduce_scatter_base": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "allreduce_coalesced": "all_reduce_coalesced",
}
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
                "Bool": 1}  # fmt: skip
_DTYPE_NAMES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
                "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}  # fmt: skip

FLIGHT_AFTER_S = 0.5  # an operation pending this long shows in the heartbeats' in-flight list

_perf_ns = time.perf_counter_ns  # the CPU clock's tokens (``timing.CpuClock.now``)
_thread_id = threading.get_ident
_Tensor = torch.Tensor

_active: Collectives | None = None  # the wrappers' target; None passes every call straight through
_originals: dict[str, Callable[..., Any]] = {}


def install(collectives: Collectives) -> None:
    """Route ProcessGroup and Work calls through ``collectives`` (patching the classes once)."""
    global _active
    if not _originals:
        _patch()
    _active = collectives


def uninstall() -> None:
    """Stop recording; the class patches stay and pass calls straight through."""
    global _active
    _active = None


def _patch() -> None:
    pg_class = torch._C._distributed_c10d.ProcessGroup
    for method, spec in METHODS.items():
        original = getattr(pg_class, method, None)
        if original is not None:
            _originals[method] = original
            setattr(pg_class, method, _method_wrapper(original, spec))
    shutdown = getattr(pg_class, "shutdown", None)
    if shutdown is not None:
        _originals["shutdown"] = shutdown
        pg_class.shutdown = _shutdown_wrapper(shutdown)
    work_class = torch._C._distributed_c10d.Work
    _originals["wait"] = work_class.wait
    work_class.wait = _wait_wrapper(work_class.wait)


def _method_wrapper(original: Callable[..., Any], spec: tuple[str, int | None, str]) -> Callable[..., Any]:
    """``original`` (a ProcessGroup method), recording the operation it starts: the hot path.

    A synchronous call (``opts.asyncOp`` false: torch waits for it right away) ends the open
    compute pieces here, at its issue; its ``wait`` starts the next ones. What is taken here is
    raw and appended as one tuple (``_Row``): the backend's counter before the call (and after it,
    where it may not have moved: see ``_Channel.reread``), the tensor's size and dtype object, the
    clock and the step; the background
    thread (``Collectives._collect``) derives the rest. It is written out inline (no further
    Python call when nothing is open on the thread), because every call costs about 0.1 us here.
    """
    _, index, kind = spec
    peered = kind == "send" or kind == "recv"
    p2p = kind != "c"

    @functools.wraps(original)
    def wrapper(pg: Any, *args: Any, **kwargs: Any) -> Any:
        c = _active
        if c is None:
            return original(pg, *args, **kwargs) if kwargs else original(pg, *args)
        rec = c.rec
        paused = None
        try:
            try:
                ch = c._channels[pg]
            except KeyError:
                ch = c.channel(pg)
            synchronous = bool(args) and getattr(args[-1], "asyncOp", True) is False
            if synchronous:
                try:
                    stack = rec._tls.stack
                except AttributeError:
                    stack = None
                if stack or stack is not rec._main_stack:  # something open, or not the main thread
                    paused = rec.pause()
            x = args[index] if index is not None and index < len(args) else args
            if type(x) is list and len(x) == 1:
                x = x[0]
            if isinstance(x, _Tensor):
                try:
                    nbytes = x.nbytes
                except Exception:  # noqa: BLE001 - a layout without it (sparse)
                    nbytes = x.numel() * x.element_size()
                dtype = x.dtype
            else:
                nbytes, dtype = _measure(x)
            counter = ch.counter
            busy = ch.busy
            busy.append(None)
        except Exception as exc:  # noqa: BLE001 - recording must not stop the collective
            warn_once("collective-issue", f"a collective could not be recorded ({exc!r})")
            rec.resume(paused)
            return original(pg, *args, **kwargs)
        try:
            before = counter()
        except Exception:  # noqa: BLE001 - none (None), or e.g. "backend does not support sequence numbers"
            before = ch.counter = ch.reread = counter = None
        issue = _perf_ns()
        try:
            start = issue if rec.cpu_clock else rec.now()
            work = original(pg, *args, **kwargs) if kwargs else original(pg, *args)
        except BaseException:
            busy.pop()
            rec.resume(paused)
            raise
        try:
            try:
                reread = counter if p2p else ch.reread  # the first point-to-point one tells whether the counter counts them
                row: _Row | None = (
                    ch.index, spec, synchronous, nbytes, dtype, args[1] if peered else -1, issue, start, rec.state.step, before,
                    None if reread is None else reread(),
                )  # fmt: skip
                issued = c._issued
                if len(issued) < rec.flush_rows:
                    issued.append(row)
                else:
                    row = c._crowded(row, ch)
            finally:
                busy.pop()
            if synchronous and work is not None:  # its spans were seen to here: its wait need not look again
                c._by_work[id(work)] = (row, paused or (), True)
            elif work is None:
                rec.resume(paused)
                if row is not None:
                    c._done.append((row, rec.now(), COMPLETED))
            elif row is not None:
                c._track(work, row)
        except Exception as exc:  # noqa: BLE001 - the collective runs; only its record is lost
            rec.resume(paused)
            warn_once("collective-track", f"a collective could not be recorded ({exc!r})")
        return work

    return wrapper


def _wait_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Work.wait``: the thread blocks here, so the heartbeat says so and compute spans split.

    On a GPU the wait only makes the current stream wait for the collective: the pieces'
    events are then recorded on both sides of that wait, still excluding it.
    """

    @functools.wraps(original)
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        c = _active
        if c is None:
            return original(work, *args, **kwargs) if args or kwargs else original(work)
        rec = c.rec
        row, paused, completes_here = c._by_work.pop(id(work), _UNTRACKED)
        if row is not None and not row[2]:  # asynchronous: the heartbeat says it is waited for
            c._waits.append(row)
        if paused is None:  # the spans went on until now (a synchronous call saw to them at its issue)
            try:
                stack = rec._tls.stack
            except AttributeError:
                stack = None
            if stack or stack is not rec._main_stack:
                paused = rec.pause()
        state = FAILED
        try:
            result = original(work, *args, **kwargs) if args or kwargs else original(work)
            state = COMPLETED
        finally:
            if paused:
                rec.resume(paused)
            if completes_here and row is not None:
                c._done.append((row, rec.now(), state))
                if c._flying:
                    c._land(row)
        return result

    return wait


def _shutdown_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(pg: Any, *args: Any, **kwargs: Any) -> Any:
        c = _active
        if c is not None:
            c.closing(pg)
        return original(pg, *args, **kwargs)

    return shutdown


# --- process groups ---------------------------------------------------------------------------


@dataclasses.dataclass
class GroupInfo:
    """A process group as this rank reports it."""

    key: str  # torch's group name: unique in the job, what the flight recorder calls it
    name: str  # what the diagnosis reports
    description: str
    ranks: list[int]


class Groups:
    """Names and members of the groups this rank belongs to; ``version`` changes with them.

    Names: the ones given through ``name_groups``, else the group's description (the bundled
    trainer passes ``group_desc="tp[0]"``), else torch's group name. DeviceMesh gives every group
    of a mesh dimension the same description ("mesh_tp"), so those get torch's unique group name
    appended ("mesh_tp:3"); the default group is "default_pg".
    """

    def __init__(self) -> None:
        self._by_key: dict[str, GroupInfo] = {}
        self._explicit: dict[str, str] = {}
        self.version = 0

    def info(self, pg: Any) -> GroupInfo:
        key = pg.group_name
        found = self._by_key.get(key)
        if found is None:
            desc = getattr(pg, "group_desc", "") or ""
            found = GroupInfo(key, self._name(key, desc), desc, dist.get_process_group_ranks(pg))
            self._by_key[key] = found
            self.version += 1
        return found

    def _name(self, key: str, desc: str) -> str:
        if key in self._explicit:
            return self._explicit[key]
        if not desc or desc == "undefined":
            return key
        return f"{desc}:{key}" if desc.startswith("mesh_") else desc

    def rename(self, pg: Any, name: str) -> GroupInfo:
        self._explicit[pg.group_name] = name
        info = self.info(pg)
        if info.name != name:
            info.name = name
            self.version += 1
        return info

    def scan(self) -> Iterator[Any]:
        """Every process group torch knows in this process (private registry; empty without it)."""
        try:
            groups = list(dist.distributed_c10d._world.pg_names)
        except Exception:  # noqa: BLE001 - torch moved its registry: only groups seen in calls count
            return iter(())
        return iter(g for g in groups if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER)

    def protos(self) -> list[pb.Group]:
        return [pb.Group(name=g.name, description=g.description, ranks=g.ranks) for g in self._by_key.values()]

    def by_key(self, key: str) -> GroupInfo | None:
        return self._by_key.get(key)


class _Channel:
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
        self.reread = None if _backend(pg) == "gloo" else self.counter
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


def _backend(pg: Any) -> str:
    """The group's backend as torch names it ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...); "" unknown."""
    try:
        return str(dist.get_backend(pg))
    except Exception:  # noqa: BLE001 - a group torch does not know (a test's stand-in)
        return ""


class _Open:
    """A wrapper-issued operation, as the background thread keeps it until its completion arrives."""

    __slots__ = ("row", "ch", "seq", "op", "op_id", "nbytes", "dtype_id", "peer", "issue", "start", "step", "waiting", "flight")


# A row of ``Collectives._issued``, appended by the wrappers (a tuple: cheaper than any object; of
# plain values only, so that the garbage collector stops tracking it at its first pass): channel
# index, spec (op, tensor argument index, kind), synchronous, bytes, torch dtype (None without
# tensors), peer argument (group rank, -1 for collectives), issue token, start token, step, the
# backend's counter before the call and after it (None without, or not read again).
_Row = tuple[int, tuple[str, int | None, str], bool, int, Any, Any, int, int, int, int | None, int | None]
_UNTRACKED = (None, None, False)  # a Work that is not a wrapper's, or was waited for before


# --- the recorder of collectives ---------------------------------------------------------------


class Collectives:
    """Turns wrapper calls and flight-recorder gaps into collective rows and in-flight state.

    The hot path (the wrappers of ``_method_wrapper`` and ``_wait_wrapper``, and the completion
    callbacks of ``_track``) appends raw tuples to three queues: operations issued, waits entered,
    operations completed. The background thread (``poll``) pops completions and waits first, then
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
        self._channels: dict[Any, _Channel] = {}  # by group (ProcessGroup hashes and compares by identity)
        self._index: list[_Channel] = []  # by _Channel.index
        # written by the hot path (appends, atomic), popped by the background thread
        self._issued: deque[_Row] = deque()
        self._waits: deque[_Row] = deque()  # asynchronous operations a thread waits in
        self._done: deque[tuple[_Row, int, int]] = deque()  # (row, end token, state)
        #: id(Work) -> (row, the spans its synchronous call paused (None: asynchronous, not seen to yet),
        #: whether it completes when its wait returns)
        self._by_work: dict[int, tuple[_Row | None, list[Span] | tuple[()] | None, bool]] = {}
        self._flying: dict[int, _Open] = {}  # id(row) -> in the heartbeat's in-flight list (CPU clock), until it completes
        # the background thread's (under ``_polling``)
        self._open: dict[int, _Open] = {}  # id(row) -> the operation (holding its row: ids stay unique), until it completes
        self._on_gpu: list[tuple[int, _Open]] = []  # completed on the CPU side, in flight on the GPU
        self._gaps: dict[tuple[str, int], int] = {}  # (torch group name, seq) -> dumps it was looked for
        self._ids: dict[Any, int] = {}  # op names and torch dtypes -> string ids
        self._last_dump = 0.0
        self._polling = threading.Lock()  # the background thread polls; a group's shutdown, on its own thread

    # --- hot path -------------------------------------------------------------------------------

    def channel(self, pg: Any) -> _Channel:
        ch = self._channels.get(pg)
        if ch is not None:
            return ch
        with self._lock:  # first sight, possibly from two threads at once
            ch = self._channels.get(pg)
            if ch is None:
                info = self.groups.info(pg)
                ch = self._channels[pg] = _Channel(pg, len(self._index), info, self.rec.strings.id(info.name))
                self._index.append(ch)
            return ch

    def rename(self, pg: Any, name: str) -> None:
        info = self.groups.rename(pg, name)
        self.channel(pg).group_id = self.rec.strings.id(info.name)

    def _crowded(self, row: _Row, ch: _Channel) -> _Row | None:
        """The queue holds ``flush_rows`` rows: wake the background thread; beyond ``capacity`` the
        row is dropped and counted (None)."""
        rec = self.rec
        if not rec.wake.is_set():
            rec.wake.set()
        if len(self._issued) < rec.capacity:
            self._issued.append(row)
            return row
        rec.state.dropped += 1
        if row[1][2] != "c":
            ch.lost_p2p += 1
        return None

    def _track(self, work: Any, row: _Row) -> None:
        """An asynchronous operation completes in a callback (gloo's thread, or inline when already
        done), whose exact time is worth the thread hand-off it costs; without a future, when its
        ``wait`` returns."""
        key = id(work)
        try:
            future = work.get_future()
        except Exception:  # noqa: BLE001 - no future for this Work: completed when its wait() returns
            self._by_work[key] = (row, None, True)
            return
        self._by_work[key] = (row, None, False)
        rec, done, by_work, c = self.rec, self._done, self._by_work, self

        def complete(fut: Any) -> None:
            state = COMPLETED
            try:
                fut.value()
            except Exception:  # noqa: BLE001 - the collective failed; the caller sees the error itself
                state = FAILED
            try:
                done.append((row, rec.now(), state))
                if c._flying:
                    c._land(row)
                entry = by_work.get(key)
                if entry is not None and entry[0] is row:
                    by_work.pop(key, None)
            except Exception as exc:  # noqa: BLE001 - runs in torch's callback: never raise there
                warn_once("collective-finish", f"recording a collective failed ({exc!r})")

        future.then(complete)

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
            self._collect()  # those that completed meanwhile leave the list again (see ``_land``)
        self._finish_on_gpu()
        if self._gaps and (fill or time.monotonic() - self._last_dump >= self.fr_interval_s or len(self._gaps) > 1000):
            self._fill_gaps(final=False)

    def _collect(self) -> None:
        """Everything the hot path appended: completions and waits are taken first, so that every
        row they name was appended before the issued rows are taken. An operation that completed
        within the same round (the common case) becomes its row at once; the others wait in
        ``_open``."""
        done, waits, issued = take_all(self._done), take_all(self._waits), take_all(self._issued)
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

    def _sequence(self, ch: _Channel, kind: str, before: int | None, after: int | None, peer: Any) -> int:
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
        if after is not None and after <= before:  # the call left the counter alone (see ``_Channel.reread``)
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

    def _account(self, ch: _Channel, count: int) -> None:
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
        self._flying.pop(id(o.row), None)
        if self.rec.cpu_clock:  # its completing thread may have taken it out already: leaving again is harmless
            self.state.leave(o.ch.info.name, o.seq, o.op, o.peer, self.rec.clock.wall_ns())
        else:
            self._on_gpu.append((end, o))

    def _show_in_flight(self) -> bool:
        """Operations pending for ``FLIGHT_AFTER_S`` enter (or update) the heartbeat's list; whether any did.

        On the CPU clock each is noted in ``_flying`` first, so that its completion, on whichever
        thread, takes it out at once (``_land``). One that completed before it was noted is among
        the completions the caller collects next.
        """
        now = _perf_ns()
        old = now - int(FLIGHT_AFTER_S * 1e9)
        to_wall = self.rec.clock.wall_ns() - now  # issue tokens are perf_counter_ns readings
        entered = False
        for o in self._open.values():
            if o.issue > old or (o.flight is not None and o.flight.waiting == o.waiting):
                continue
            o.flight = InFlightOp(o.ch.info.name, o.seq, o.op, o.peer, o.issue + to_wall, waiting=o.waiting)
            if self.rec.cpu_clock:
                self._flying[id(o.row)] = o
            self.state.enter(o.flight)
            entered = True
        return entered

    def _land(self, row: _Row) -> None:
        """``row``'s operation completed (on the completing thread): out of the heartbeat's
        in-flight list now, not at the next poll."""
        o = self._flying.pop(id(row), None)
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

    def _gap(self, ch: _Channel, first: int, last: int) -> None:
        for seq in range(max(first, last - 10_000 + 1), last + 1):  # older ones left the recorder long ago
            self._gaps.setdefault((ch.info.key, seq), 0)

    def _fill_gaps(self, final: bool) -> None:
        self._last_dump = time.monotonic()
        dump = self.fr.read()
        found = set()
        for e in dump.entries if dump else ():
            key = (e.group, e.seq)
            if key not in self._gaps or e.p2p:
                continue
            info = self.groups.by_key(e.group)
            if info is None:
                continue
            done = dump.done(e)
            flight = InFlightOp(info.name, e.seq, e.op, -1, e.issue_ns, waiting=False)
            if not done and not final:
                self.state.enter(flight)
                found.add(key)
                continue
            self.rec.add_collective(
                self.rec.strings.id(info.name), e.seq, self.rec.strings.id(e.op), e.nbytes, self.rec.strings.id(e.dtype), -1,
                e.issue_ns, e.start_ns, e.end_ns, COMPLETED if done else PENDING, self.rec.step_at(e.issue_ns),
            )  # fmt: skip
            self.state.leave(info.name, e.seq, e.op, -1, e.end_ns or self.rec.clock.wall_ns())
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


# --- torch's flight recorder -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FrEntry:
    """The parts of a flight-recorder entry the agent uses."""

    group: str
    seq: int
    op: str
    p2p: bool
    nbytes: int
    dtype: str
    issue_ns: int
    start_ns: int
    end_ns: int
    completed: bool


@dataclasses.dataclass(frozen=True)
class FrDump:
    entries: list[FrEntry]
    #: torch group name -> last completed collective seq (gloo reports it; NCCL marks entries)
    last_completed: dict[str, int]

    def done(self, e: FrEntry) -> bool:
        """Whether ``e`` has completed; when torch says nothing either way, it is taken as done."""
        last = self.last_completed.get(e.group)
        return e.completed or e.end_ns > 0 or last is None or e.seq <= last


class FlightRecorder:
    """Reads torch's flight recorders (private: guarded, parsed defensively).

    gloo's operations go to ``_dump_fr_trace``, NCCL's to ``_dump_nccl_trace`` (a recorder of
    CUDA events, in CUDA builds): both are read and merged.
    """

    def __init__(self) -> None:
        c10d = torch._C._distributed_c10d
        self._dumps = {name: getattr(c10d, name) for name in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(c10d, name)}
        if not self._dumps:
            warn_once("fr-missing", "torch has no flight recorder here: collectives issued outside Python are not recorded")

    def read(self) -> FrDump | None:
        """Every entry both recorders hold now; None when none can be read."""
        entries: list[FrEntry] = []
        completed: dict[str, int] = {}
        for name, dump in list(self._dumps.items()):
            try:
                try:
                    raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
                except TypeError:
                    raw = dump()
                trace = pickle.loads(raw)
                entries += [_entry(e) for e in trace.get("entries", ())]
                for group, seq in _last_completed(trace.get("pg_status", {})).items():
                    completed[group] = max(seq, completed.get(group, seq))
            except Exception as exc:  # noqa: BLE001 - a changed format turns this source off, nothing else
                warn_once(f"fr-format:{name}", f"torch's {name} could not be read ({exc!r}); it is not used")
                del self._dumps[name]
        return FrDump(entries, completed) if self._dumps else None


def _entry(e: dict[str, Any]) -> FrEntry:
    op = str(e.get("profiling_name", "")).split(":", 1)[-1]
    sizes, dtypes = e.get("input_sizes") or [], e.get("input_dtypes") or []
    nbytes = sum(math.prod(map(int, s)) * _DTYPE_BYTES.get(d, 0) for s, d in zip(sizes, dtypes))
    started, completed = e.get("time_discovered_started_ns"), e.get("time_discovered_completed_ns")
    return FrEntry(
        group=str(e["process_group"][0]), seq=int(e["collective_seq_id"]), op=FR_OPS.get(op, op),
        p2p=bool(e.get("is_p2p", False)), nbytes=nbytes, dtype=_DTYPE_NAMES.get(dtypes[0], dtypes[0]) if dtypes else "",
        issue_ns=int(e["time_created_ns"]), start_ns=int(started or 0), end_ns=int(completed or 0),
        completed=e.get("state") == "completed",
    )  # fmt: skip


def _last_completed(status: dict[str, Any]) -> dict[str, int]:
    out = {}
    for group, s in status.items():
        value = s.get("last_completed_collective") if isinstance(s, dict) else None
        if isinstance(value, int) and value >= 0:
            out[str(group)] = value
    return out


_DTYPES: dict[torch.dtype, str] = {}


def _measure(x: Any) -> tuple[int, torch.dtype | None]:
    """Bytes this rank contributes, and the dtype of the first tensor (None without tensors).

    ``x`` is a tensor or a (nested) list or tuple of them, as the ProcessGroup methods take.
    """
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size(), x.dtype
    nbytes, dtype = 0, None
    if isinstance(x, (list, tuple)):
        for item in x:
            n, d = _measure(item)
            nbytes += n
            if dtype is None:
                dtype = d
    return nbytes, dtype


"""Every collective and point-to-point operation, whichever path issued it, recorded once.

Two sources, merged on (process group, sequence number):

1. Wrappers on the methods of ``torch._C._distributed_c10d.ProcessGroup`` (``allreduce``,
   ``allgather``, ``send``, ...) and on ``Work.wait``. Every ``torch.distributed`` Python
   function ends in one of these methods, however it was imported (``from torch.distributed
   import all_reduce`` included), so patching the class sees them all, including the ``*_object``
   variants (as the collectives they are made of), ``batch_isend_irecv`` and FSDP2's calls. The
   method returns the same ``Work``; completion comes from ``work.get_future().then(...)``
   (gloo: when it finishes; NCCL: the callback runs with a stream that waits for the
   collective, so the CUDA clock's event marks its end). ``Work.wait`` is where a thread
   blocks: it marks the operation ``waiting`` for the heartbeat and splits the open compute
   spans around the wait.
2. torch's flight recorder (``_dump_fr_trace``, private), read by the background thread only
   for sequence numbers the wrappers did not issue: DDP's C++ gradient reducer, the functional
   collectives of DTensor, compiled graphs. Dumping costs about 20 ms for 2000 entries, so it
   happens only when such gaps exist, at most every ``fr_interval_s``, and once more when a
   group shuts down (``destroy_process_group`` calls ``ProcessGroup.shutdown``, also wrapped):
   the last operations of a job would otherwise leave with their group.

Sequence numbers. For collectives the number is the flight recorder's ``collective_seq_id``:
the count of collectives on the group, identical on every member because all members issue
the same collectives in the same order. The wrappers derive it from the backend's counter
(``_get_sequence_number_for_group``) read right after the call, minus the point-to-point
operations that counter also counts (gloo counts them, NCCL does not: measured per group on
the first send/recv). A counter that moved without a wrapper call is a gap the flight recorder
fills. Without the counter (custom backends) the agent counts the group's collectives itself.
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
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rankscope.agent.config import warn_once
from rankscope.agent.recorder import COMPLETED, FAILED, PENDING, Recorder, Span
from rankscope.agent.state import InFlightOp
from rankscope.protos.rankscope.v1 import telemetry_pb2 as pb

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
    @functools.wraps(original)
    def wrapper(pg: Any, *args: Any, **kwargs: Any) -> Any:
        c = _active
        if c is None:
            return original(pg, *args, **kwargs)
        return c.issue(original, spec, pg, args, kwargs)

    return wrapper


def _wait_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        c = _active
        if c is None:
            return original(work, *args, **kwargs)
        return c.wait(original, work, args, kwargs)

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
    """Sequence-number bookkeeping of one process group."""

    __slots__ = ("pg", "info", "me", "group_id", "counter", "p2p_step", "p2p_in", "last", "issuing", "p2p", "closed")

    def __init__(self, pg: Any, info: GroupInfo, group_id: int) -> None:
        self.pg = pg
        self.info = info
        self.me = pg.rank()  # this rank's place in the group
        self.group_id = group_id
        self.counter: Callable[[], int] | None = getattr(pg, "_get_sequence_number_for_group", None)
        self.p2p_step: int | None = None  # does the backend's counter count point-to-point ops (0/1)
        self.p2p_in = 0  # point-to-point ops inside the counter
        self.last = 0  # collective seq accounted for (issued by a wrapper, or a known gap)
        self.issuing = 0  # wrapper calls in progress: the poller leaves the group alone meanwhile
        self.p2p: dict[tuple[int, int], int] = {}  # (sender, receiver) group ranks -> ops so far
        self.closed = False  # shut down: its counter is no longer read

    def collectives(self) -> int | None:
        """The backend's count of collectives on this group, None without a usable counter."""
        if self.counter is None:
            return None
        try:
            return int(self.counter()) - self.p2p_in
        except Exception:  # noqa: BLE001 - e.g. "backend does not support sequence numbers"
            self.counter = None
            return None


class _Pending:
    """A wrapper-issued operation that has not completed yet.

    It enters the heartbeat's in-flight list only once it has been pending for ``FLIGHT_AFTER_S``
    (the background thread does that), so the common, quick collective never builds one.
    """

    __slots__ = ("c", "ch", "seq", "op", "op_id", "nbytes", "dtype_id", "peer", "issue", "start", "step", "key",
                 "callback", "waiting", "finished", "flight", "paused")  # fmt: skip

    def complete(self, fut: Any) -> None:
        """Completion callback (gloo's thread, or inline when already done)."""
        state = COMPLETED
        try:
            fut.value()
        except Exception:  # noqa: BLE001 - the collective failed; the caller sees the error itself
            state = FAILED
        self.c.finish(self, state)


# --- the recorder of collectives ---------------------------------------------------------------


class Collectives:
    """Turns wrapper calls and flight-recorder gaps into collective rows and in-flight state."""

    def __init__(self, rec: Recorder, groups: Groups, fr_interval_s: float = 2.0, fr_tries: int = 3) -> None:
        self.rec = rec
        self.state = rec.state
        self.groups = groups
        self.fr = FlightRecorder()
        self.fr_interval_s = fr_interval_s
        self.fr_tries = fr_tries
        self.lost = 0  # gaps the flight recorder could not fill
        self._lock = threading.Lock()
        self._channels: dict[int, _Channel] = {}
        self._by_work: dict[int, _Pending] = {}
        self._pending: set[_Pending] = set()
        self._on_gpu: list[tuple[int, _Pending]] = []  # completed on the CPU side, in flight on the GPU
        self._gaps: dict[tuple[str, int], int] = {}  # (torch group name, seq) -> dumps it was looked for
        self._last_dump = 0.0
        self._polling = threading.Lock()  # the background thread polls; a group's shutdown, on its own thread

    # --- hot path -------------------------------------------------------------------------------

    def channel(self, pg: Any) -> _Channel:
        ch = self._channels.get(id(pg))
        if ch is not None and ch.pg is pg:
            return ch
        with self._lock:  # first sight, possibly from two threads at once
            ch = self._channels.get(id(pg))
            if ch is None or ch.pg is not pg:
                info = self.groups.info(pg)
                ch = self._channels[id(pg)] = _Channel(pg, info, self.rec.strings.id(info.name))
            return ch

    def rename(self, pg: Any, name: str) -> None:
        info = self.groups.rename(pg, name)
        self.channel(pg).group_id = self.rec.strings.id(info.name)

    def issue(self, original: Callable[..., Any], spec: tuple[str, int | None, str], pg: Any, args: tuple, kwargs: dict) -> Any:
        """Call ``original`` (a ProcessGroup method) and record the operation it starts.

        A synchronous call (``opts.asyncOp`` false: torch waits for it right away) ends the
        open compute pieces here, at its issue; its ``wait`` starts the next ones.
        """
        paused = None
        try:
            ch = self.channel(pg)
            synchronous = bool(args) and getattr(args[-1], "asyncOp", True) is False
            if synchronous:
                paused = self.rec.pause()
            issue = self.rec.clock.wall_ns()
            start = issue if self.rec.cpu_clock else self.rec.clock.now()
            with self._lock:
                before = self._before(ch)
                ch.issuing += 1
        except Exception as exc:  # noqa: BLE001 - recording must not stop the collective
            warn_once("collective-issue", f"a collective could not be recorded ({exc!r})")
            self.rec.resume(paused)
            return original(pg, *args, **kwargs)
        try:
            work = original(pg, *args, **kwargs)
        except BaseException:
            self.rec.resume(paused)
            with self._lock:  # a counter it moved anyway is a gap for the next call
                ch.issuing -= 1
            raise
        try:
            with self._lock:
                ch.issuing -= 1
                seq = self._after(ch, spec, before, args)
            self._track(work, ch, spec, seq, issue, start, args, synchronous, paused)
        except Exception as exc:  # noqa: BLE001 - the collective runs; only its record is lost
            self.rec.resume(paused)
            warn_once("collective-track", f"a collective could not be recorded ({exc!r})")
        return work

    def _before(self, ch: _Channel) -> int | None:
        count = ch.collectives()
        if count is not None and count > ch.last:
            self._gap(ch, ch.last + 1, count)
            ch.last = count
        return count

    def _after(self, ch: _Channel, spec: tuple[str, int | None, str], before: int | None, args: tuple) -> int:
        kind = spec[2]
        if kind != "c":
            if before is not None and ch.p2p_step is None:
                raw = ch.collectives()
                ch.p2p_step = 0 if raw is None else raw - before
            ch.p2p_in += ch.p2p_step or 0
            if kind == "any":
                return 0
            peer = int(args[1])
            pair = (ch.me, peer) if kind == "send" else (peer, ch.me)
            ch.p2p[pair] = ch.p2p.get(pair, 0) + 1
            return ch.p2p[pair]
        after = ch.collectives()
        if after is None or before is None:
            ch.last += 1  # counted here: the same on every member, which sees the same calls
            return ch.last
        if after > before + 1:  # another thread issued on this group meanwhile: the rest is a gap
            self._gap(ch, before + 2, after)
        ch.last = max(ch.last, after)
        return min(after, before + 1) if after > before else after

    def _track(
        self, work: Any, ch: _Channel, spec: tuple[str, int | None, str], seq: int, issue: int, start: int, args: tuple,
        synchronous: bool, paused: list[Span] | None,
    ) -> None:  # fmt: skip
        """Keep the operation until it completes: when its synchronous caller's ``wait`` returns,
        or, for asynchronous ones (``opts.asyncOp``, true unless torch says otherwise), in a
        completion callback, whose exact time is worth the thread hand-off it costs."""
        op, index, kind = spec
        nbytes, dtype = _measure(args[index] if index is not None and index < len(args) else args)
        p = _Pending()
        p.c, p.ch, p.seq, p.op, p.nbytes, p.issue, p.start = self, ch, seq, op, nbytes, issue, start
        p.op_id = self.rec.strings.id(op)
        p.dtype_id = self.rec.strings.id(dtype)
        p.peer = -1 if kind in ("c", "any") else ch.info.ranks[int(args[1])]
        p.step = self.state.step
        p.key, p.callback, p.waiting, p.finished, p.flight, p.paused = None, False, False, False, None, paused
        self._pending.add(p)
        if work is None:
            self.rec.resume(paused)
            self.finish(p, COMPLETED)
            return
        p.key = id(work)
        self._by_work[p.key] = p
        if not synchronous:
            try:
                future = work.get_future()
            except Exception:  # noqa: BLE001 - no future for this Work: completed when its wait() returns
                return
            p.callback = True
            future.then(p.complete)

    def wait(self, original: Callable[..., Any], work: Any, args: tuple, kwargs: dict) -> Any:
        """``Work.wait``: the thread blocks here, so the heartbeat says so and compute spans split.

        On a GPU the wait only makes the current stream wait for the collective: the pieces'
        events are then recorded on both sides of that wait, still excluding it.
        """
        p = self._by_work.get(id(work))
        if p is not None:
            p.waiting = True
        if p is not None and p.paused is not None:
            paused, p.paused = p.paused, None
        else:
            paused = self.rec.pause()
        state = FAILED
        try:
            result = original(work, *args, **kwargs)
            state = COMPLETED
            return result
        finally:
            self.rec.resume(paused)
            if p is not None and not p.callback:
                self.finish(p, state)

    def finish(self, p: _Pending, state: int) -> None:
        """Record the row of a completed (or failed, or, at exit, pending) operation."""
        try:
            end = self.rec.now() if state != PENDING else 0
            with self._lock:
                if p.finished:
                    return
                p.finished = True
                self._pending.discard(p)
                if self._by_work.get(p.key) is p:
                    del self._by_work[p.key]
            self.rec.add_collective(
                p.ch.group_id, p.seq, p.op_id, p.nbytes, p.dtype_id, p.peer, p.issue, p.start, end, state, p.step
            )
            if state == PENDING or p.flight is None:
                return
            if self.rec.cpu_clock:
                self.state.leave(p.ch.info.name, p.seq, p.op, p.peer, self.rec.clock.wall_ns())
            else:
                with self._lock:
                    self._on_gpu.append((end, p))
        except Exception as exc:  # noqa: BLE001 - runs inside torch's wait or callback: never raise there
            warn_once("collective-finish", f"recording a collective failed ({exc!r})")

    # --- background thread ----------------------------------------------------------------------

    def poll(self) -> None:
        """Find operations the wrappers did not see, and finish GPU-side completions."""
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
        with self._lock:
            for ch in list(self._channels.values()):
                if not ch.issuing and not ch.closed:
                    self._before(ch)
        self._show_in_flight()
        self._finish_on_gpu()
        if self._gaps and (fill or time.monotonic() - self._last_dump >= self.fr_interval_s or len(self._gaps) > 1000):
            self._fill_gaps(final=False)

    def _show_in_flight(self) -> None:
        """Operations pending for ``FLIGHT_AFTER_S`` enter (or update) the heartbeat's list."""
        old = self.rec.clock.wall_ns() - int(FLIGHT_AFTER_S * 1e9)
        for p in list(self._pending):
            if p.issue > old or p.finished or (p.flight is not None and p.flight.waiting == p.waiting):
                continue
            p.flight = InFlightOp(p.ch.info.name, p.seq, p.op, p.peer, p.issue, waiting=p.waiting)
            self.state.enter(p.flight)
            if p.finished:  # finished meanwhile on another thread: take it out again
                self.state.leave(p.ch.info.name, p.seq, p.op, p.peer, self.rec.clock.wall_ns())

    def _finish_on_gpu(self) -> None:
        with self._lock:
            waiting, self._on_gpu = self._on_gpu, []
        still = []
        for end, p in waiting:
            if self.rec.clock.done(end):
                self.state.leave(p.ch.info.name, p.seq, p.op, p.peer, self.rec.clock.wall_ns())
            else:
                still.append((end, p))
        with self._lock:
            self._on_gpu.extend(still)

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
        for p in list(self._pending):
            self.finish(p, PENDING)
        with self._polling:
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


def _measure(x: Any) -> tuple[int, str]:
    """Bytes this rank contributes, and the dtype of the first tensor ("" without tensors).

    ``x`` is a tensor or a (nested) list or tuple of them, as the ProcessGroup methods take.
    """
    if isinstance(x, torch.Tensor):
        dtype = _DTYPES.get(x.dtype) or _DTYPES.setdefault(x.dtype, str(x.dtype).removeprefix("torch."))
        return x.numel() * x.element_size(), dtype
    nbytes, dtype = 0, ""
    if isinstance(x, (list, tuple)):
        for item in x:
            n, d = _measure(item)
            nbytes += n
            dtype = dtype or d
    return nbytes, dtype

"""The hot path: spans, collectives and step scalars appended to preallocated columns.

Every row is a handful of integers written into numpy arrays allocated once, under one
``threading.Lock``: rows come from the training thread, autograd's threads, gloo's completion
callbacks and OpenTelemetry users' threads, and an uncontended lock costs about 0.15 us here,
which keeps the design simply correct (also without a GIL). The background thread takes the
lock only to swap the filled buffers for empty spares (O(1)) and builds the columnar protobuf
batches outside it. When the buffers are full because the background thread fell behind, rows
are dropped and counted in ``RankState.dropped``: the training thread never waits.

Strings (span names, group names, ops, attributes) are interned into one process-wide table;
each batch carries only the strings its rows use, renumbered.

Segment splitting: every thread keeps the stack of spans open on it. When that thread blocks in
a collective (``pause``), each open non-``comm`` span ends its current piece at that moment and
starts the next piece when the collective returns (``resume``); pieces carry ``"part": i`` in
their attributes, so a compute segment never includes time spent waiting for other ranks.

CPU time: on the CPU clock, when a host's ranks share cores (``timing.cores_shared``), each piece
also carries the CPU time its thread spent in it. Ranks sharing a few cores are descheduled at
random, so their wall-clock segments mostly measure the scheduler; CPU time measures the work,
which is what comparing ranks needs. On a device clock the host's CPU time says nothing about the
device, and a rank with cores of its own has a trustworthy wall clock: -1 (not measured).
"""

from __future__ import annotations

import bisect
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rankscope.agent.config import warn_once
from rankscope.agent.state import RankState
from rankscope.agent.timing import Clock, CpuClock, cores_shared
from rankscope.protos.rankscope.v1 import telemetry_pb2 as pb

KINDS: dict[str, int] = {
    "compute": pb.SPAN_KIND_COMPUTE,
    "comm": pb.SPAN_KIND_COMM,
    "data": pb.SPAN_KIND_DATA,
    "optimizer": pb.SPAN_KIND_OPTIMIZER,
    "user": pb.SPAN_KIND_USER,
}
KIND_NAMES = {code: name for name, code in KINDS.items()}
COMM = pb.SPAN_KIND_COMM
COMPLETED, FAILED, PENDING = pb.COLLECTIVE_STATE_COMPLETED, pb.COLLECTIVE_STATE_FAILED, pb.COLLECTIVE_STATE_PENDING

# Column layouts, in the order the add_* methods write them.
SPAN_COLUMNS = ("<i4", "u1", "<i4", "<i4", "<i8", "<i8", "<i4", "<i8")  # name kind step mb start end attrs cpu
_thread_cpu_ns = time.thread_time_ns
_thread_id = threading.get_ident
COLLECTIVE_COLUMNS = ("<i4", "<i8", "<i4", "<i8", "<i4", "<i4", "<i8", "<i8", "<i8", "u1", "<i4")
#                     group  seq    op     nbytes dtype  peer   issue  start  end    state step
SCALAR_COLUMNS = ("<i4", "<i4", "<f8", "<i8")  # step name value time


class StringTable:
    """Process-wide string -> int id; bounded, because attribute values can vary without end."""

    OVERFLOW = "<rankscope: too many distinct strings>"

    def __init__(self, limit: int = 200_000) -> None:
        self.ids: dict[str, int] = {}  # read directly on the hot path; written under the lock
        self._strings: list[str] = []
        self._limit = limit
        self._lock = threading.Lock()

    def id(self, s: str) -> int:
        i = self.ids.get(s)
        return self._add(s) if i is None else i

    def _add(self, s: str) -> int:
        with self._lock:
            i = self.ids.get(s)
            if i is not None:
                return i
            if len(self._strings) >= self._limit:
                warn_once("strings", f"more than {self._limit} distinct names/attributes; the rest are replaced")
                return self.ids.get(self.OVERFLOW) if self.OVERFLOW in self.ids else self._append(self.OVERFLOW)
            return self._append(s)

    def _append(self, s: str) -> int:
        self._strings.append(s)
        self.ids[s] = len(self._strings) - 1
        return len(self._strings) - 1

    def text(self, i: int) -> str:
        return self._strings[i]

    def local(self, *columns: np.ndarray) -> tuple[list[str], list[np.ndarray]]:
        """The strings ``columns`` use and the columns renumbered into them (-1 stays -1)."""
        used = np.unique(np.concatenate([c[c >= 0] for c in columns]))
        strings = [self._strings[i] for i in used.tolist()]
        out = []
        for c in columns:
            local = np.full(c.shape, -1, dtype="<i4")
            known = c >= 0
            local[known] = np.searchsorted(used, c[known])
            out.append(local)
        return strings, out


class _Rows:
    """One preallocated set of typed columns and the number of rows filled.

    Writers go through ``views`` (memoryviews of the arrays: a scalar store costs 35 ns there,
    50 ns through numpy); the drainer reads ``arrays``.
    """

    __slots__ = ("arrays", "views", "n")

    def __init__(self, dtypes: tuple[str, ...], capacity: int) -> None:
        self.arrays = tuple(np.zeros(capacity, dtype=dt) for dt in dtypes)
        self.views = tuple(memoryview(a) for a in self.arrays)
        self.n = 0

    def take(self) -> list[np.ndarray]:
        """Copies of the filled rows; the buffer is empty again afterwards."""
        cols = [a[: self.n].copy() for a in self.arrays]
        self.n = 0
        return cols


class _Table:
    """Double-buffered rows: writers fill ``active``, the drainer swaps in the empty ``spare``."""

    def __init__(self, dtypes: tuple[str, ...], capacity: int, tokens: tuple[int, ...]) -> None:
        self.active = _Rows(dtypes, capacity)
        self.spare = _Rows(dtypes, capacity)
        self.tokens = tokens  # columns holding clock tokens, resolved before sending
        self.carry: list[np.ndarray] | None = None  # rows whose tokens the GPU had not reached yet

    def swap(self) -> _Rows:
        full, self.active, self.spare = self.active, self.spare, self.active
        return full


class Span:
    """A timed segment: a context manager, and a decorator through ``__call__``.

    One object per ``with``; it is also the open-span record, so a span costs one allocation.
    Entering pushes it on its thread's stack (the heartbeat's phase is the innermost one);
    exiting writes its last piece. Both never raise into the script.
    """

    __slots__ = ("_rec", "name", "_name_id", "kind", "step", "_step_arg", "_mb", "_attrs", "_start", "_part", "_stack", "_cpu0", "_tid")

    def __init__(
        self, rec: Recorder, name: str, kind: str, step: int | None, microbatch: int | None,
        attributes: dict[str, Any], auto: bool = False,
    ) -> None:  # fmt: skip
        """``auto``: made by the agent itself, so it does not count as the script's own timing."""
        code = KINDS.get(kind)
        if code is None:
            warn_once(f"kind:{kind}", f"unknown span kind {kind!r} (known: {', '.join(KINDS)}); recorded as 'user'")
            code = pb.SPAN_KIND_USER
        if not auto:
            rec.explicit_kinds.add(code)
        self._rec = rec
        self.name = name
        name_id = rec.strings.ids.get(name)
        self._name_id = rec.strings.id(name) if name_id is None else name_id
        self.kind = code
        self._step_arg = step
        self.step = rec.state.step if step is None else step
        self._mb = -1 if microbatch is None else microbatch
        self._attrs = rec.attributes(attributes) if attributes else -1
        self._part = -1  # -1: never split; else the index of the current piece

    def __enter__(self) -> Span:
        rec = self._rec
        try:
            stack = rec._tls.stack
        except AttributeError:
            stack = rec._new_stack()
        self._stack = stack
        stack.append(self)
        rec.state.phase = self.name
        if rec.measure_cpu:
            self._tid = _thread_id()
            self._cpu0 = _thread_cpu_ns()
        else:
            self._cpu0 = self._tid = -1
        self._start = rec.now()
        return self

    def _cpu(self, tid: int, now_cpu: int) -> int:
        """CPU time of the current piece at ``now_cpu``, read on thread ``tid``; -1 when unmeasured
        or read on another thread (whose CPU clock says nothing about this one's)."""
        if self._cpu0 < 0 or now_cpu < 0 or tid != self._tid:
            return -1
        return now_cpu - self._cpu0

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        rec = self._rec
        end = rec.now()
        cpu = self._cpu(_thread_id(), _thread_cpu_ns()) if self._cpu0 >= 0 else -1  # no syscall when not measured
        stack = self._stack
        try:
            if stack[-1] is self:
                stack.pop()
            else:
                stack.remove(self)  # ended on another thread, or out of order
            attrs = self._attrs if self._part < 0 else rec._piece_attrs(self._attrs, self._part)
            rec.add_span(self._name_id, self.kind, self.step, self._mb, self._start, end, attrs, cpu)
            rec.state.phase = stack[-1].name if stack else "idle"
        except Exception as exc:  # noqa: BLE001 - closed twice, or a value out of range
            warn_once("span-exit", f"a span could not be recorded ({exc!r})")

    def discard(self) -> None:
        """Forget this open span without recording it (the code it timed raised past its end)."""
        try:
            self._stack.remove(self)
        except (AttributeError, ValueError):
            pass

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Used as ``@span(...)``: time every call, resolving the agent at call time."""
        from rankscope.agent import decorate

        attributes = json.loads(self._rec.strings.text(self._attrs)) if self._attrs >= 0 else {}
        mb = None if self._mb < 0 else self._mb
        return decorate(fn, self.name, KIND_NAMES[self.kind], self._step_arg, mb, attributes)


class Recorder:
    """Columns for spans, collectives and scalars, the open-span stacks, and the step timeline."""

    Span = Span  # the public API creates spans through the recorder it finds attached

    def __init__(self, clock: Clock, state: RankState, capacity: int = 1 << 16, flush_rows: int = 4096, batch_rows: int = 8192):
        self.clock = clock
        self.now = clock.now  # the hot path's bound method; follows ``use_clock``
        self.cpu_clock = isinstance(clock, CpuClock)  # the host's clock, not a device's; follows ``use_clock``
        self.measure_cpu = self.cpu_clock and cores_shared()
        self.state = state
        self.strings = StringTable()
        self.capacity = capacity
        self.flush_rows = flush_rows
        self.batch_rows = batch_rows
        #: set when a buffer reaches ``flush_rows``: the background thread drains early
        self.wake = threading.Event()
        #: which span kinds, and whether steps, the script gives explicitly (autospans defer to them)
        self.explicit_kinds: set[int] = set()
        self.explicit_steps = False
        self._lock = threading.Lock()
        self._spans = _Table(SPAN_COLUMNS, capacity, tokens=(4, 5))
        self._collectives = _Table(COLLECTIVE_COLUMNS, capacity, tokens=(7, 8))
        self._scalars = _Table(SCALAR_COLUMNS, capacity, tokens=())
        self._deferred: list[tuple[int, int, Any, int]] = []  # scalars given as tensors: read off the hot path
        self._tls = threading.local()
        self._main_stack: list[Span] = []
        self._part_attrs: dict[tuple[int, int], int] = {}
        self._attr_ids: dict[tuple[tuple[str, Any], ...], int] = {}
        self._steps: deque[tuple[int, int]] = deque(maxlen=4096)  # (wall ns, step) at each step start
        self._graph_task_id: Callable[[], int] | None = None

    def use_clock(self, clock: Clock) -> None:
        """Take timestamps from ``clock`` from now on (tokens already taken stay valid)."""
        self.clock = clock
        self.now = clock.now
        self.cpu_clock = isinstance(clock, CpuClock)
        self.measure_cpu = self.cpu_clock and cores_shared()

    # --- spans (hot path) -------------------------------------------------------------------

    def attributes(self, attributes: dict[str, Any]) -> int:
        """The string id of ``attributes`` as a JSON object, -1 for none (cached by value)."""
        if not attributes:
            return -1
        try:
            key = tuple(attributes.items())
            cached = self._attr_ids.get(key)
        except TypeError:  # unhashable values
            key, cached = None, None
        if cached is None:
            cached = self.strings.id(json.dumps(attributes, sort_keys=True, default=str))
            if key is not None and len(self._attr_ids) < 10_000:
                self._attr_ids[key] = cached
        return cached

    def _new_stack(self) -> list[Span]:
        """This thread's stack of open spans, created on its first span."""
        stack = self._main_stack if threading.current_thread() is threading.main_thread() else []
        self._tls.stack = stack
        return stack

    def pause(self) -> list[Span] | None:
        """This thread blocks in a collective: end the current piece of its open non-comm spans.

        Runs inside torch's collective calls, so it never raises.
        """
        paused: list[Span] = []
        try:
            tid = _thread_id()
            now_cpu = _thread_cpu_ns() if self.measure_cpu else -1
            for s in self._blocked_stack():
                if s.kind == COMM:
                    continue
                if s._part < 0:
                    s._part = 0
                paused.append(s)
                s._part += 1
                attrs = self._piece_attrs(s._attrs, s._part - 1)
                self.add_span(s._name_id, s.kind, s.step, s._mb, s._start, self.now(), attrs, s._cpu(tid, now_cpu))
        except Exception as exc:  # noqa: BLE001
            warn_once("span-pause", f"a span could not be split ({exc!r})")
        return paused or None

    def resume(self, paused: list[Span] | None) -> None:
        """The collective returned: the paused spans start their next piece now.

        A piece resumed on another thread than its span's (an autograd worker's wait) cannot be
        measured on the span's CPU clock: -1.
        """
        if paused:
            tid = _thread_id()
            now_cpu = _thread_cpu_ns() if self.measure_cpu else -1
            for s in paused:
                s._cpu0 = now_cpu if tid == s._tid else -1
                s._start = self.now()

    def _blocked_stack(self) -> list[Span]:
        """The spans a wait on this thread holds up: its own, or, on an autograd worker thread
        (CUDA backward runs there), those of the main thread that is inside ``backward``."""
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._new_stack()
        if stack or threading.current_thread() is threading.main_thread():
            return stack
        if self._graph_task_id is None:
            import torch

            self._graph_task_id = torch._C._current_graph_task_id
        try:
            return self._main_stack if self._graph_task_id() != -1 else stack
        except Exception:  # noqa: BLE001 - a private torch call; without it only this thread counts
            return stack

    def _piece_attrs(self, attrs: int, part: int) -> int:
        key = (attrs, part)
        found = self._part_attrs.get(key)
        if found is None:
            base = json.loads(self.strings.text(attrs)) if attrs >= 0 else {}
            found = self.strings.id(json.dumps({**base, "part": part}, sort_keys=True))
            if len(self._part_attrs) < 10_000:
                self._part_attrs[key] = found
        return found

    # --- rows (hot path) --------------------------------------------------------------------

    def add_span(self, name: int, kind: int, step: int, mb: int, start: int, end: int, attrs: int, cpu: int = -1) -> None:
        lock = self._lock
        lock.acquire()  # acquire/release: half the cost of ``with lock`` here
        try:
            rows = self._spans.active
            i = rows.n
            if i >= self.capacity:
                self.state.dropped += 1
                return
            c0, c1, c2, c3, c4, c5, c6, c7 = rows.views
            c0[i] = name
            c1[i] = kind
            c2[i] = step
            c3[i] = mb
            c4[i] = start
            c5[i] = end
            c6[i] = attrs
            c7[i] = cpu
            rows.n = i + 1
        finally:
            lock.release()
        if i + 1 == self.flush_rows:
            self.wake.set()

    def add_collective(
        self, group: int, seq: int, op: int, nbytes: int, dtype: int, peer: int,
        issue: int, start: int, end: int, state: int, step: int,
    ) -> None:  # fmt: skip
        self._append(self._collectives, (group, seq, op, nbytes, dtype, peer, issue, start, end, state, step))

    def add_scalar(self, step: int, name: int, value: Any, time_ns: int) -> None:
        """One step scalar; a tensor value is read later by the background thread (no device sync here)."""
        if isinstance(value, (int, float)):
            self._append(self._scalars, (step, name, value, time_ns))
            return
        detach = getattr(value, "detach", None)
        if detach is not None:
            value = detach()  # keeps the number, not the autograd graph behind it
        with self._lock:
            if len(self._deferred) >= self.capacity:  # bounded like the columns, for a drainer that falls behind
                self.state.dropped += 1
            else:
                self._deferred.append((step, name, value, time_ns))

    def _append(self, table: _Table, row: tuple[Any, ...]) -> None:
        """One row into ``table``: ``add_span`` generalised, for the rarer rows (it stays unrolled, for speed)."""
        lock = self._lock
        lock.acquire()
        try:
            rows = table.active
            i = rows.n
            if i >= self.capacity:
                self.state.dropped += 1
                return
            for column, value in zip(rows.views, row):
                column[i] = value
            rows.n = i + 1
        finally:
            lock.release()
        if i + 1 == self.flush_rows:
            self.wake.set()

    # --- steps --------------------------------------------------------------------------------

    def set_step(self, step: int) -> None:
        self.state.step = step
        self._steps.append((self.clock.wall_ns(), step))

    def step_at(self, time_ns: int) -> int:
        """The step that had started at wall-clock ``time_ns`` (0 before the first), for events
        the agent learns about later (collectives found in the flight recorder)."""
        marks = self._steps
        i = bisect.bisect_right(marks, (time_ns, math.inf)) - 1
        return marks[i][1] if i >= 0 else 0

    # --- draining (background thread) -----------------------------------------------------------

    def drain(self) -> Iterator[pb.SpanBatch | pb.CollectiveBatch | pb.StepMetricBatch]:
        """Everything recorded since the last drain, as columnar batches of at most ``batch_rows``.

        Rows whose GPU events have not completed yet stay behind for the next drain.
        """
        with self._lock:
            spans = self._spans.swap()
            collectives = self._collectives.swap()
            scalars = self._scalars.swap()
            deferred, self._deferred = self._deferred, []
        for cols in self._ready(self._spans, spans):
            yield self._span_batch(cols)
        for cols in self._ready(self._collectives, collectives):
            yield self._collective_batch(cols)
        scalar_cols = scalars.take()
        if deferred:
            scalar_cols = [np.concatenate([a, np.array(b, dtype=a.dtype)]) for a, b in zip(scalar_cols, _read_deferred(deferred))]
        for cols in self._chunks(scalar_cols):
            yield self._scalar_batch(cols)

    def _ready(self, table: _Table, rows: _Rows) -> Iterator[list[np.ndarray]]:
        cols = rows.take()
        if table.carry is not None:
            cols = [np.concatenate([a, b]) for a, b in zip(table.carry, cols)]
            table.carry = None
        ready: np.ndarray | None = None
        for t in table.tokens:
            cols[t], mask = self.clock.resolve(cols[t])
            if mask is not None:
                ready = mask if ready is None else ready & mask
        if ready is not None and not ready.all():
            late = ~ready
            keep = min(int(late.sum()), self.capacity)
            self.state.dropped += int(late.sum()) - keep
            table.carry = [c[late][-keep:] for c in cols]
            cols = [c[ready] for c in cols]
        return self._chunks(cols)

    def _chunks(self, cols: list[np.ndarray]) -> Iterator[list[np.ndarray]]:
        n = len(cols[0])
        for lo in range(0, n, self.batch_rows):
            yield [c[lo : lo + self.batch_rows] for c in cols]

    def _span_batch(self, cols: list[np.ndarray]) -> pb.SpanBatch:
        name, kind, step, mb, start, end, attrs, cpu = cols
        strings, (name, attrs) = self.strings.local(name, attrs)
        return pb.SpanBatch(
            count=len(name), strings=strings, name=name.tobytes(), kind=kind.tobytes(), step=step.tobytes(),
            microbatch=mb.tobytes(), start_ns=start.tobytes(), end_ns=end.tobytes(), attributes=attrs.tobytes(),
            cpu_ns=cpu.tobytes(),
        )  # fmt: skip

    def _collective_batch(self, cols: list[np.ndarray]) -> pb.CollectiveBatch:
        group, seq, op, nbytes, dtype, peer, issue, start, end, state, step = cols
        strings, (group, op, dtype) = self.strings.local(group, op, dtype)
        return pb.CollectiveBatch(
            count=len(group), strings=strings, group=group.tobytes(), seq=seq.tobytes(), op=op.tobytes(),
            nbytes=nbytes.tobytes(), dtype=dtype.tobytes(), peer=peer.tobytes(), issue_ns=issue.tobytes(),
            start_ns=start.tobytes(), end_ns=end.tobytes(), state=state.tobytes(), step=step.tobytes(),
        )  # fmt: skip

    def _scalar_batch(self, cols: list[np.ndarray]) -> pb.StepMetricBatch:
        step, name, value, time_ns = cols
        strings, (name,) = self.strings.local(name)
        return pb.StepMetricBatch(
            count=len(name), strings=strings, step=step.tobytes(), name=name.tobytes(), value=value.tobytes(),
            time_ns=time_ns.tobytes(),
        )  # fmt: skip


def _read_deferred(deferred: list[tuple[int, int, Any, int]]) -> tuple[list[int], list[int], list[float], list[int]]:
    """Columns of scalars that were given as tensors (or other numbers), read now."""
    values = []
    for _, _, value, _ in deferred:
        try:
            values.append(float(value.item() if hasattr(value, "item") else value))
        except Exception:  # noqa: BLE001 - a value that is not a number is recorded as NaN
            warn_once("scalar", f"a scalar of type {type(value).__name__} is not a number; recorded as NaN")
            values.append(math.nan)
    return [d[0] for d in deferred], [d[1] for d in deferred], values, [d[3] for d in deferred]

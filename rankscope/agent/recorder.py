"""The hot path: spans, collectives and step scalars appended as tuples, turned into columns later.

A row is one tuple of a handful of integers appended to a ``collections.deque``: rows come from
the training thread, autograd's threads, gloo's completion callbacks and OpenTelemetry users'
threads, and ``deque.append`` is atomic (under the GIL and in free-threaded builds alike), so
writers take no lock; building the tuple and appending it costs about 0.1 us here, against about
0.6 us for a locked write of eight scalars into preallocated numpy columns. The background thread
pops what is there (popping is atomic too, so a row appended meanwhile waits for the next drain)
and builds the typed columns and the columnar protobuf batches. A value a column cannot hold (a
step beyond int32) drops its row, counted and warned about once. When a queue holds ``capacity``
rows because the background thread fell behind, rows are dropped and counted in
``RankState.dropped``: the training thread never waits.

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
from rankscope.protos.v1 import telemetry_pb2 as pb

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
_new_object = object.__new__
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


def take_all(queue: deque[Any]) -> list[Any]:
    """What ``queue`` holds now, popped one by one: each pop is atomic, so rows appended meanwhile
    stay for the next time, and a second drainer (an agent ending while its loop still runs) only
    splits the rows with this one."""
    out: list[Any] = []
    append, pop = out.append, queue.popleft
    try:
        for _ in range(len(queue)):
            append(pop())
    except IndexError:  # the other drainer took the rest
        pass
    return out


class _Table:
    """Rows of one kind: writers append tuples to ``rows``; the drainer pops them into typed columns."""

    __slots__ = ("rows", "dtypes", "tokens", "carry", "what")

    def __init__(self, dtypes: tuple[str, ...], tokens: tuple[int, ...], what: str) -> None:
        self.rows: deque[tuple[Any, ...]] = deque()
        self.dtypes = dtypes
        self.tokens = tokens  # columns holding clock tokens, resolved before sending
        self.carry: list[np.ndarray] | None = None  # rows whose tokens the GPU had not reached yet
        self.what = what

    def take(self, state: RankState) -> list[np.ndarray]:
        """The rows appended so far, popped and made into columns."""
        taken = take_all(self.rows)
        try:
            return [np.array(column, dtype=dt) for column, dt in zip(zip(*taken), self.dtypes)] if taken else self.empty()
        except (TypeError, ValueError, OverflowError):
            pass
        good = []  # some value does not fit its column: keep the rows that do
        for row in taken:
            try:
                for value, dt in zip(row, self.dtypes):
                    np.array(value, dtype=dt)
            except (TypeError, ValueError, OverflowError) as exc:
                state.dropped += 1
                warn_once(f"row:{self.what}", f"a {self.what} could not be recorded ({exc!r})")
                continue
            good.append(row)
        return [np.array(column, dtype=dt) for column, dt in zip(zip(*good), self.dtypes)] if good else self.empty()

    def empty(self) -> list[np.ndarray]:
        return [np.zeros(0, dtype=dt) for dt in self.dtypes]


class Span:
    """A timed segment: a context manager, and a decorator through ``__call__``.

    One object per ``with``; it is also the open-span record, so a span costs one allocation.
    Entering pushes it on its thread's stack (the heartbeat's phase is the innermost one);
    exiting writes its last piece. Both never raise into the script.
    """

    __slots__ = ("_rec", "name", "_name_id", "kind", "step", "_step_arg", "_mb", "_attrs", "_start", "_part", "_stack", "_cpu0", "_tid")

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
            self._cpu0 = -1
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
            top = stack.pop()
            if top is not self:  # ended on another thread, or out of order
                stack.append(top)
                stack.remove(self)
            rows = rec._span_rows
            n = len(rows)
            if n < rec.capacity:  # add_span, inlined
                rows.append((self._name_id, self.kind, self.step, self._mb, self._start, end,
                             self._attrs if self._part < 0 else rec._piece_attrs(self._attrs, self._part), cpu))  # fmt: skip
                if n + 1 == rec.flush_rows:
                    rec.wake.set()
            else:
                rec.state.dropped += 1
            rec.state.phase = stack[-1].name if stack else "idle"
        except Exception as exc:  # noqa: BLE001 - closed twice
            warn_once("span-exit", f"a span could not be recorded ({exc!r})")

    def end_piece(self) -> None:
        """Record the span's piece up to now and leave it; entering it again starts its next piece
        (a closure that a framework runs inside the span is not the span's time)."""
        if self._part < 0:
            self._part = 0
        self.__exit__(None, None, None)
        self._part += 1

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
        self._lock = threading.Lock()  # the deferred scalars only
        self._spans = _Table(SPAN_COLUMNS, tokens=(4, 5), what="span")
        self._collectives = _Table(COLLECTIVE_COLUMNS, tokens=(6, 7, 8), what="collective")
        self._scalars = _Table(SCALAR_COLUMNS, tokens=(), what="scalar")
        self._span_rows = self._spans.rows  # appended to directly by Span.__exit__
        self._deferred: list[tuple[int, int, Any, int]] = []  # scalars given as tensors: read off the hot path
        self._tls = threading.local()
        self._main_stack: list[Span] = []
        self._part_attrs: dict[tuple[int, int], int] = {}
        self._attr_ids: dict[tuple[tuple[str, Any], ...], int] = {}
        self._steps: deque[tuple[int, int]] = deque(maxlen=4096)  # (wall ns, step) at each step start
        self._graph_task_id: Callable[[], int] | None = None
        self._main_ident = threading.main_thread().ident
        self._span_meta: dict[tuple[str, str], tuple[int, int]] = {}  # (name, kind) -> (name id, kind code)

    def use_clock(self, clock: Clock) -> None:
        """Take timestamps from ``clock`` from now on (tokens already taken stay valid)."""
        self.clock = clock
        self.now = clock.now
        self.cpu_clock = isinstance(clock, CpuClock)
        self.measure_cpu = self.cpu_clock and cores_shared()

    # --- spans (hot path) -------------------------------------------------------------------

    def span(
        self, name: str, kind: str, step: int | None, microbatch: int | None, attributes: dict[str, Any], auto: bool = False
    ) -> Span:
        """A new span, built without an ``__init__`` call (one Python frame fewer on the hot path).
        ``auto``: made by the agent itself, so it does not count as the script's own timing."""
        meta = None if auto else self._span_meta.get((name, kind))
        if meta is None:
            meta = self._span_kind(name, kind, auto)
        s = _new_object(Span)
        s._rec = self
        s.name = name
        s._name_id, s.kind = meta
        s._step_arg = step
        s.step = self.state.step if step is None else step
        s._mb = -1 if microbatch is None else microbatch
        s._attrs = self.attributes(attributes) if attributes else -1
        s._part = -1
        return s

    def _span_kind(self, name: str, kind: str, auto: bool) -> tuple[int, int]:
        """A span's (name id, kind code), first seen: an explicit kind is noted (autospans defer to it)."""
        code = KINDS.get(kind)
        if code is None:
            warn_once(f"kind:{kind}", f"unknown span kind {kind!r} (known: {', '.join(KINDS)}); recorded as 'user'")
            code = pb.SPAN_KIND_USER
        meta = (self.strings.id(name), code)
        if not auto:
            self.explicit_kinds.add(code)
            if len(self._span_meta) < 10_000:
                self._span_meta[name, kind] = meta
        return meta

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
        stack = self._main_stack if _thread_id() == self._main_ident else []
        self._tls.stack = stack
        return stack

    def pause(self) -> list[Span] | None:
        """This thread blocks in a collective: end the current piece of its open non-comm spans.

        Runs inside torch's collective calls, so it never raises.
        """
        try:
            stack = self._tls.stack
        except AttributeError:
            stack = None
        if not stack and (stack is None or _thread_id() != self._main_ident):
            stack = self._blocked_stack()  # another thread's first wait, or an autograd worker's
        if not stack:
            return None  # the common case: nothing open on this thread
        paused: list[Span] = []
        try:
            tid = _thread_id()
            now_cpu = _thread_cpu_ns() if self.measure_cpu else -1
            rows = self._span_rows
            for s in stack:
                if s.kind == COMM:
                    continue
                if s._part < 0:
                    s._part = 0
                paused.append(s)
                s._part += 1
                attrs = self._piece_attrs(s._attrs, s._part - 1)
                if len(rows) < self.capacity:
                    rows.append((s._name_id, s.kind, s.step, s._mb, s._start, self.now(), attrs, s._cpu(tid, now_cpu)))
                else:
                    self.state.dropped += 1
            if len(rows) >= self.flush_rows:
                self.wake.set()
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
                s._cpu0 = now_cpu if now_cpu >= 0 and tid == getattr(s, "_tid", None) else -1
                s._start = self.now()

    def _blocked_stack(self) -> list[Span]:
        """The spans a wait on this thread holds up: its own, or, on an autograd worker thread
        (CUDA backward runs there), those of the main thread that is inside ``backward``."""
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._new_stack()
        if stack or _thread_id() == self._main_ident:
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
        rows = self._span_rows
        if len(rows) >= self.capacity:
            self.state.dropped += 1
            return
        rows.append((name, kind, step, mb, start, end, attrs, cpu))
        if len(rows) == self.flush_rows:
            self.wake.set()

    def add_collective(
        self, group: int, seq: int, op: int, nbytes: int, dtype: int, peer: int,
        issue: int, start: int, end: int, state: int, step: int,
    ) -> None:  # fmt: skip
        self._append(self._collectives, (group, seq, op, nbytes, dtype, peer, issue, start, end, state, step))

    def add_collectives(self, rows: list[tuple[int, ...]]) -> None:
        """Rows of ``add_collective``'s fields at once (the background thread's)."""
        queue = self._collectives.rows
        room = max(0, self.capacity - len(queue))
        if len(rows) > room:
            self.state.dropped += len(rows) - room
            rows = rows[:room]
        queue.extend(rows)

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
        """One row into ``table`` (``add_span`` generalised)."""
        rows = table.rows
        if len(rows) >= self.capacity:
            self.state.dropped += 1
            return
        rows.append(row)
        if len(rows) == self.flush_rows:
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
        for cols in self._ready(self._spans):
            yield self._span_batch(cols)
        for cols in self._ready(self._collectives):
            yield self._collective_batch(cols)
        with self._lock:
            deferred, self._deferred = self._deferred, []
        scalar_cols = self._scalars.take(self.state)
        if deferred:
            scalar_cols = [np.concatenate([a, np.array(b, dtype=a.dtype)]) for a, b in zip(scalar_cols, _read_deferred(deferred))]
        for cols in self._chunks(scalar_cols):
            yield self._scalar_batch(cols)

    def _ready(self, table: _Table) -> Iterator[list[np.ndarray]]:
        cols = table.take(self.state)
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

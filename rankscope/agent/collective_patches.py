"""Patches on torch.distributed's ProcessGroup and Work: where every collective call is seen.

Wrappers on the methods of ``torch._C._distributed_c10d.ProcessGroup`` (``allreduce``,
``allgather``, ``send``, ...) and on ``Work.wait``. Every ``torch.distributed`` Python function
ends in one of these methods, however it was imported (``from torch.distributed import
all_reduce`` included), so patching the class sees them all, including the ``*_object`` variants
(as the collectives they are made of), ``batch_isend_irecv`` and FSDP2's calls. The method
returns the same ``Work``; a synchronous call (torch waits for it at once) completes when its
``wait`` returns, an asynchronous one in ``work.get_future().then(...)`` (gloo: when it finishes;
NCCL: the callback runs with a stream that waits for the collective, so the CUDA clock's event
marks its end). ``Work.wait`` is where a thread blocks: it marks the operation ``waiting`` for
the heartbeat and splits the open compute spans around the wait. ``ProcessGroup.shutdown``
(``destroy_process_group`` calls it) is wrapped too, so that the tracker looks for a group's last
operations before they leave with it.

The caller's thread does as little as it can (``_method_wrapper``): it reads the counter, the
tensor's size and dtype object and the clock, and appends them as one tuple of plain values to
the tracker's queue; ``wait`` and the completion callbacks append the end the same way. The
background thread derives everything else (``collective_tracker``). A wrapper takes no lock: it
marks its group ``busy`` (a list append, atomic) while its counter reading has no row yet, and
the background thread reads no counter of a busy group.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from rankscope.agent.collective_tracker import Collectives, Row
from rankscope.agent.config import warn_once
from rankscope.agent.recorder import COMPLETED, FAILED

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

_perf_ns = time.perf_counter_ns  # the CPU clock's tokens (``timing.CpuClock.now``)
_Tensor = torch.Tensor

_active: Collectives | None = None  # the wrappers' target; None passes every call straight through
_originals: dict[str, Callable[..., Any]] = {}
_UNTRACKED = (None, None, False)  # a Work that is not a wrapper's, or was waited for before


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
    raw and appended as one tuple (``collective_tracker.Row``): the backend's counter before the
    call (and after it, where it may not have moved: see ``Channel.reread``), the tensor's size and
    dtype object, the clock and the step; the background thread (``Collectives.poll``) derives the
    rest. It is written out inline (no further Python call when nothing is open on the thread),
    because every call costs about 0.1 us here.
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
                ch = c.channels[pg]
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
                row: Row | None = (
                    ch.index, spec, synchronous, nbytes, dtype, args[1] if peered else -1, issue, start, rec.state.step, before,
                    None if reread is None else reread(),
                )  # fmt: skip
                issued = c.issued
                if len(issued) < rec.flush_rows:
                    issued.append(row)
                else:
                    row = c.crowded(row, ch)
            finally:
                busy.pop()
            if synchronous and work is not None:  # its spans were seen to here: its wait need not look again
                c.by_work[id(work)] = (row, paused or (), True)
            elif work is None:
                rec.resume(paused)
                if row is not None:
                    c.completions.append((row, rec.now(), COMPLETED))
            elif row is not None:
                c.track(work, row)
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
        row, paused, completes_here = c.by_work.pop(id(work), _UNTRACKED)
        if row is not None and not row[2]:  # asynchronous: the heartbeat says it is waited for
            c.waits.append(row)
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
                c.completions.append((row, rec.now(), state))
                if c.flying:
                    c.land(row)
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


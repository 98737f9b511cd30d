"""Every collective the trainer issues passes through here.

One choke point gives the fault injector its hook before each collective (an injected hang
stops exactly there) and keeps a running total of the time spent blocked in collectives, so
that a compute segment's own time can be told apart from time spent waiting for other ranks.
Groups of one rank skip the call entirely.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from rankscope.trainer.injector import Injector

_injector: Injector | None = None
_blocked_s = 0.0


def install(injector: Injector | None) -> None:
    """Route the hook points of every later collective to ``injector``."""
    global _injector
    _injector = injector


def blocked_seconds() -> float:
    """Total seconds this process has spent inside blocking collectives (a monotonic counter)."""
    return _blocked_s


def size(group: Any) -> int:
    return dist.get_world_size(group)


class _Blocking:
    """Times one blocking collective into the running total, after the fault hook has run."""

    __slots__ = ("t0",)

    def __enter__(self) -> None:
        if _injector is not None:
            _injector.before_collective()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        global _blocked_s
        _blocked_s += time.perf_counter() - self.t0


def all_reduce(tensor: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``; returns it."""
    if size(group) > 1:
        with _Blocking():
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along ``dim``, in group-rank order."""
    n = size(group)
    if n == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(n)]
    with _Blocking():
        dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Sum ``tensor`` over the group and keep this member's chunk along ``dim``."""
    n = size(group)
    if n == 1:
        return tensor
    chunks = [c.contiguous() for c in tensor.chunk(n, dim=dim)]
    out = torch.empty_like(chunks[0])
    with _Blocking():
        dist.reduce_scatter(out, chunks, group=group)
    return out


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Any) -> None:
    """Post every point-to-point send and receive (peers are global ranks) together and wait for all.

    Posting both directions at once is what keeps the 1F1B schedule free of deadlocks. A send
    over an injected slow link is posted late, after everything else: only that direction waits.
    """
    if not sends and not recvs:
        return
    delay = {peer: _injector.link_delay(peer) for _, peer in sends} if _injector else {}
    slow = [(t, peer) for t, peer in sends if delay.get(peer)]
    with _Blocking():
        ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends if not delay.get(peer)]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if slow:  # the other operations are done: only this link's sends are late
            time.sleep(max(delay.values()))
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer, group) for t, peer in slow]):
                work.wait()


def launch_all_reduce(tensor: torch.Tensor, group: Any) -> Any:
    """Start an asynchronous in-place SUM all-reduce; returns the work handle (None for one rank)."""
    if size(group) == 1:
        return None
    if _injector is not None:
        _injector.before_collective()
    return dist.all_reduce(tensor, group=group, async_op=True)


def launch_reduce_scatter(out: torch.Tensor, tensor: torch.Tensor, group: Any) -> Any:
    """Start an asynchronous SUM reduce-scatter of flat ``tensor`` into ``out``; None for one rank."""
    if size(group) == 1:
        out.copy_(tensor)
        return None
    if _injector is not None:
        _injector.before_collective()
    return dist.reduce_scatter_tensor(out, tensor, group=group, async_op=True)


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: Any) -> None:
    """Gather every member's flat ``shard`` into ``out`` (ZeRO-1's parameter all-gather)."""
    if size(group) == 1:
        out.copy_(shard)
        return
    with _Blocking():
        dist.all_gather_into_tensor(out, shard, group=group)


def wait(work: Any) -> None:
    """Wait for an asynchronous collective, counting the wait as blocked time."""
    if work is not None:
        with _Blocking():
            work.wait()

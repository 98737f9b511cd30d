"""Data parallelism: gradients averaged over the dp group in buckets while backward still runs.

During the last micro-batch's backward, each parameter's gradient is final as soon as autograd
has accumulated it; a hook copies it into its bucket, and a full bucket starts its reduction at
once, so communication overlaps the rest of backward (MegaScale's overlap). ``finish`` waits for
the stragglers among the buckets.

With the distributed optimizer (ZeRO-1), buckets are reduce-scattered instead: each dp rank
keeps the averaged gradient of its own shard, updates only that shard's fp32 copy with AdamW,
and the parameters are all-gathered afterwards. Optimizer state is then 1/dp per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rankscope.trainer import comm


@dataclass
class _Bucket:
    """A contiguous flat buffer holding the gradients of a few parameters."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # padded to a multiple of dp
    grad: torch.Tensor
    shard: torch.Tensor  # this rank's averaged shard (distributed optimizer only)
    pending: int = 0
    work: Any = None
    launched: bool = False
    index: dict[int, int] = field(default_factory=dict)  # id(param) -> position in params


class GradSync:
    """Bucketed, overlapped gradient reduction over the dp group (all-reduce, or reduce-scatter for ZeRO-1)."""

    def __init__(
        self, params: list[nn.Parameter], dp_group: Any, tp_group: Any, bucket_numel: int, shard: bool
    ) -> None:
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.dp = comm.size(dp_group)
        self.dp_rank = torch.distributed.get_rank(dp_group) if self.dp > 1 else 0
        self.shard = shard
        self.buckets = self._make_buckets([p for p in reversed(params) if p.requires_grad], bucket_numel)
        self._bucket_of: dict[int, _Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self._armed = False
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _make_buckets(self, params: list[nn.Parameter], bucket_numel: int) -> list[_Bucket]:
        groups: list[list[nn.Parameter]] = [[]]
        filled = 0
        for p in params:  # reverse registration order: roughly the order backward produces them
            if groups[-1] and filled + p.numel() > bucket_numel:
                groups.append([])
                filled = 0
            groups[-1].append(p)
            filled += p.numel()
        buckets = []
        for group in (g for g in groups if g):
            offsets, total = [], 0
            for p in group:
                offsets.append(total)
                total += p.numel()
            padded = -(-total // self.dp) * self.dp
            device = group[0].device
            buckets.append(
                _Bucket(
                    params=group,
                    offsets=offsets,
                    numel=padded,
                    grad=torch.zeros(padded, device=device),
                    shard=torch.zeros(padded // self.dp, device=device),
                    index={id(p): i for i, p in enumerate(group)},
                )
            )
        return buckets

    def owned_range(self, bucket: _Bucket) -> tuple[int, int]:
        """The slice of ``bucket`` whose averaged gradient this rank holds after ``finish``."""
        if not self.shard:
            return 0, bucket.numel
        size = bucket.numel // self.dp
        return self.dp_rank * size, (self.dp_rank + 1) * size

    def arm(self) -> None:
        """The next backward is the step's last: reduce each bucket as soon as its gradients are final."""
        self._armed = True
        for b in self.buckets:
            b.pending, b.work, b.launched = len(b.params), None, False

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for p, off in zip(bucket.params, bucket.offsets):
            flat = bucket.grad[off : off + p.numel()]
            if p.grad is None:
                flat.zero_()
            else:
                flat.copy_(p.grad.reshape(-1))
        if self.shard:
            bucket.work = comm.launch_reduce_scatter(bucket.shard, bucket.grad, self.dp_group)
        else:
            bucket.work = comm.launch_all_reduce(bucket.grad, self.dp_group)
        bucket.launched = True

    def finish(self) -> None:
        """Wait for every bucket and leave averaged gradients (in ``p.grad``, or in the shards for ZeRO-1).

        Gradients of sequence-parallel parameters are partial sums per tp rank; they are summed
        over ``tp_group`` here, on the slices this rank holds, in one collective.
        """
        for b in self.buckets:
            if not b.launched:  # parameters that got no gradient this step still take part
                self._launch(b)
        for b in self.buckets:
            comm.wait(b.work)
            (b.shard if self.shard else b.grad).div_(self.dp)
        self._armed = False
        partial = [g for p, _, g in self.owned_grads() if p.sequence_parallel]  # type: ignore[attr-defined]
        if partial and comm.size(self.tp_group) > 1:
            flat = comm.all_reduce(torch.cat(partial), self.tp_group)
            for g, summed in zip(partial, flat.split([g.numel() for g in partial])):
                g.copy_(summed)
        if not self.shard:
            for b in self.buckets:
                for p, off in zip(b.params, b.offsets):
                    reduced = b.grad[off : off + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = reduced.clone()
                    else:
                        p.grad.copy_(reduced)

    def owned_grads(self) -> list[tuple[nn.Parameter, slice, torch.Tensor]]:
        """(parameter, flat slice of it, averaged gradient of that slice) for every slice this rank holds."""
        out = []
        for b in self.buckets:
            lo, hi = self.owned_range(b)
            for p, off in zip(b.params, b.offsets):
                a, z = max(off, lo), min(off + p.numel(), hi)
                if a >= z:
                    continue
                grad = b.shard[a - lo : z - lo] if self.shard else b.grad[a:z]
                out.append((p, slice(a - off, z - off), grad))
        return out

    def gather_params(self, updated: list[tuple[nn.Parameter, slice, torch.Tensor]]) -> None:
        """ZeRO-1: all-gather every rank's updated parameter shards back into the full parameters."""
        by_param = {(id(p), s.start): v for p, s, v in updated}
        for b in self.buckets:
            lo, hi = self.owned_range(b)
            mine = torch.zeros(hi - lo, device=b.grad.device)
            for p, off in zip(b.params, b.offsets):
                a, z = max(off, lo), min(off + p.numel(), hi)
                if a < z:
                    mine[a - lo : z - lo].copy_(by_param[(id(p), a - off)])
            full = torch.empty(b.numel, device=b.grad.device)
            comm.all_gather_flat(full, mine, self.dp_group)
            with torch.no_grad():
                for p, off in zip(b.params, b.offsets):
                    p.copy_(full[off : off + p.numel()].view_as(p))

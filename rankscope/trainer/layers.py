"""Tensor-parallel building blocks, as in Megatron-LM.

Activations are laid out [batch, sequence, hidden]. Without sequence parallelism, activations
between blocks are replicated on every tp rank; with it, each tp rank holds a slice of the
sequence (dim 1) and the column/row-parallel layers gather and reduce-scatter along it.

Every parameter carries two attributes the rest of the trainer reads:
``tp_dim`` (the dimension split across tp ranks, or None when replicated) and
``sequence_parallel`` (its gradient is a partial sum per tp rank and must be summed over tp).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rankscope.trainer import comm

SEQ_DIM = 1


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce the gradient backward (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (the partial sums of a row-parallel layer); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return comm.all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter backward (sequence-parallel entry)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.all_gather(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.reduce_scatter(grad, ctx.group, SEQ_DIM), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather backward (sequence-parallel exit)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return comm.reduce_scatter(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(grad, ctx.group, SEQ_DIM), None


class TPContext:
    """The tp group, this rank's place in it, and whether sequence parallelism is on."""

    def __init__(self, group: Any, sequence_parallel: bool) -> None:
        self.group = group
        self.size = comm.size(group)
        self.rank = dist.get_rank(group) if self.size > 1 else 0
        self.sequence_parallel = sequence_parallel and self.size > 1

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Bring a block's input into the tensor-parallel region (full sequence, gradient summed)."""
        if self.sequence_parallel:
            return _GatherSequence.apply(x, self.group)
        return _CopyToTP.apply(x, self.group) if self.size > 1 else x

    def exit(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum row-parallel partial outputs over tp (and shard the sequence if sequence-parallel)."""
        if self.sequence_parallel:
            return _ReduceScatterSequence.apply(partial, self.group)
        return _ReduceFromTP.apply(partial, self.group) if self.size > 1 else partial

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The full sequence from a sequence-parallel tensor (identity otherwise)."""
        return _GatherSequence.apply(x, self.group) if self.sequence_parallel else x


def param(shape: tuple[int, ...], init: str, tp_dim: int | None = None, sequence_parallel: bool = False) -> nn.Parameter:
    """A parameter of this rank's ``shape``, tagged with how to initialise and reduce it.

    ``init`` is one of ``normal``, ``residual`` (normal scaled down for residual projections),
    ``zeros`` and ``ones``; ``tp_dim`` and ``sequence_parallel`` are described in the module docstring.
    """
    p = nn.Parameter(torch.empty(shape))
    p.init = init  # type: ignore[attr-defined]
    p.tp_dim = tp_dim  # type: ignore[attr-defined]
    p.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over tp: each rank computes its slice of y."""

    def __init__(self, tp: TPContext, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = param((out_features // tp.size, in_features), "normal", tp_dim=0)
        self.bias = param((out_features // tp.size,), "zeros", tp_dim=0) if bias else None

    def forward(self, x_parallel_region: torch.Tensor) -> torch.Tensor:
        """``x_parallel_region`` comes from ``TPContext.enter`` (shared by the layers reading one input)."""
        return F.linear(x_parallel_region, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over tp: partial products summed over tp.

    ``forward`` returns the partial product; the caller sums it over tp with ``TPContext.exit``
    (several row-parallel outputs can share one reduction, as in the parallel block) and then
    adds ``bias``, which is replicated.
    """

    def __init__(self, tp: TPContext, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = param((out_features, in_features // tp.size), "residual", tp_dim=1)
        self.bias = param((out_features,), "zeros", sequence_parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tp: each rank looks up the tokens it owns."""

    def __init__(self, tp: TPContext, vocab: int, hidden: int) -> None:
        super().__init__()
        self.tp = tp
        per_rank = vocab // tp.size
        self.start, self.end = tp.rank * per_rank, (tp.rank + 1) * per_rank
        self.weight = param((per_rank, hidden), "normal", tp_dim=0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.exit(partial)


class LayerNorm(nn.Module):
    """LayerNorm whose parameters are marked sequence-parallel when the sequence is sharded."""

    def __init__(self, tp: TPContext, hidden: int) -> None:
        super().__init__()
        self.weight = param((hidden,), "ones", sequence_parallel=tp.sequence_parallel)
        self.bias = param((hidden,), "zeros", sequence_parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary is split over tp; no rank ever holds full logits."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp: TPContext) -> torch.Tensor:
        logits = logits.float()
        per_rank = logits.shape[-1]
        start = tp.rank * per_rank
        logits_max = comm.all_reduce(logits.max(dim=-1).values, tp.group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = comm.all_reduce(picked, tp.group)
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), tp.group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = (~outside).to(grad_logits.dtype)
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Per-token loss from vocabulary-parallel ``logits`` [..., vocab/tp] and global token ids ``target``."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp)

"""A GPT decoder split into pipeline stages and tensor-parallel shards.

``GPTStage`` is the part of the model one rank holds: the embedding on the first stage, a
contiguous range of blocks, the final norm and LM head on the last stage. With tp = pp = 1 it is
the whole model. Parameter names use global block indices (``blocks.5.attn.qkv.weight``), and
weights are initialised from the full, unsharded tensor, so every parallel layout starts from
exactly the same model.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rankscope.trainer.layers import (
    ColumnParallelLinear,
    LayerNorm,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    param,
    vocab_parallel_cross_entropy,
)

INIT_STD = 0.02


@dataclass(frozen=True)
class ModelArgs:
    """The model's shape, independent of how it is parallelised."""

    vocab: int
    hidden: int
    heads: int
    ffn: int
    layers: int
    seq: int
    parallel_block: bool = False
    window: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Attention(nn.Module):
    """Causal self-attention over this rank's heads; returns the output projection's partial sum."""

    def __init__(self, args: ModelArgs, tp: TPContext) -> None:
        super().__init__()
        self.local_heads = args.heads // tp.size
        self.head_dim = args.head_dim
        # Rows are head-major ([head][q|k|v][head_dim]) so a contiguous tp slice holds whole heads.
        self.qkv = ColumnParallelLinear(tp, args.hidden, 3 * args.hidden)
        self.proj = RowParallelLinear(tp, args.hidden, args.hidden)
        mask = None
        if args.window is not None:
            i = torch.arange(args.seq)
            distance = i.unsqueeze(1) - i.unsqueeze(0)
            mask = (distance >= 0) & (distance < args.window)
        self.register_buffer("window_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, self.local_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        if self.window_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.window_mask[:s, :s])
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    """GELU MLP; returns the second layer's partial sum."""

    def __init__(self, args: ModelArgs, tp: TPContext) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(tp, args.hidden, args.ffn)
        self.fc2 = RowParallelLinear(tp, args.ffn, args.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block; optionally MegaScale's parallel form x + attn(ln(x)) + mlp(ln(x)).

    The parallel form also sums the two row-parallel outputs before a single tp reduction.
    """

    def __init__(self, args: ModelArgs, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.parallel = args.parallel_block
        self.ln1 = LayerNorm(tp, args.hidden)
        self.attn = Attention(args, tp)
        self.ln2 = None if self.parallel else LayerNorm(tp, args.hidden)
        self.mlp = MLP(args, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if self.parallel:
            h = tp.enter(self.ln1(x))
            return x + tp.exit(self.attn(h) + self.mlp(h)) + self.attn.proj.bias + self.mlp.fc2.bias
        x = x + tp.exit(self.attn(tp.enter(self.ln1(x)))) + self.attn.proj.bias
        return x + tp.exit(self.mlp(tp.enter(self.ln2(x)))) + self.mlp.fc2.bias


class GPTStage(nn.Module):
    """The blocks of pipeline stage ``stage`` of ``num_stages``, with the embedding and head where they belong."""

    def __init__(self, args: ModelArgs, tp: TPContext, stage: int, num_stages: int) -> None:
        super().__init__()
        self.args = args
        self.tp = tp
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        per_stage = args.layers // num_stages
        first_block = stage * per_stage
        if self.is_first:
            self.embed = VocabParallelEmbedding(tp, args.vocab, args.hidden)
            self.pos = param((args.seq, args.hidden), "normal", sequence_parallel=tp.sequence_parallel)
        self.blocks = nn.ModuleDict({str(i): Block(args, tp) for i in range(first_block, first_block + per_stage)})
        if self.is_last:
            self.norm = LayerNorm(tp, args.hidden)
            self.head = ColumnParallelLinear(tp, args.hidden, args.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [b, s] on the first stage, else activations; returns activations or vocab-parallel logits."""
        if self.is_first:
            x = self.embed(x) + self._positions()
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.head(self.tp.enter(self.norm(x)))
        return x

    def _positions(self) -> torch.Tensor:
        if not self.tp.sequence_parallel:
            return self.pos
        return self.pos.chunk(self.tp.size, dim=0)[self.tp.rank]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token of the micro-batch."""
        return vocab_parallel_cross_entropy(logits, targets, self.tp).mean()

    def activation_shape(self, micro_batch: int) -> tuple[int, int, int]:
        """Shape of the activations this stage exchanges with its pipeline neighbours."""
        seq = self.args.seq // self.tp.size if self.tp.sequence_parallel else self.args.seq
        return (micro_batch, seq, self.args.hidden)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, num_layers: int) -> None:
    """Initialise every parameter from its full (unsharded) tensor, seeded by its name, then keep this rank's slice.

    Identical across parallel layouts by construction, which is what the parity tests rely on.
    """
    tp: TPContext = model.tp  # type: ignore[assignment]
    for name, p in model.named_parameters():
        kind = p.init  # type: ignore[attr-defined]
        if kind in ("zeros", "ones"):
            p.fill_(0.0 if kind == "zeros" else 1.0)
            continue
        full_shape = list(p.shape)
        tp_dim = p.tp_dim  # type: ignore[attr-defined]
        if tp_dim is not None:
            full_shape[tp_dim] *= tp.size
        std = INIT_STD / math.sqrt(2 * num_layers) if kind == "residual" else INIT_STD
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(full_shape).normal_(0.0, std, generator=generator)
        shard = full if tp_dim is None else full.chunk(tp.size, dim=tp_dim)[tp.rank]
        p.copy_(shard)


def count_parameters(args: ModelArgs) -> int:
    """Parameters of the whole model (all stages, all tp shards), position embeddings excluded."""
    per_block = 4 * args.hidden * args.hidden + 2 * args.hidden * args.ffn  # qkv, proj, fc1, fc2
    per_block += 3 * args.hidden + args.hidden + args.ffn + args.hidden  # their biases
    per_block += 4 * args.hidden if not args.parallel_block else 2 * args.hidden  # norms
    return args.layers * per_block + 2 * args.vocab * args.hidden + 2 * args.hidden

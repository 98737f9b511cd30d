"""Training data: a deterministic synthetic token stream, or a nanoGPT-style uint16 token file.

Every sample is a pure function of (seed, sample index), and the sample indices of a micro-batch
are a pure function of (step, dp rank, micro-batch). So every parallel layout sees exactly the
same global batch, and a resumed run needs no data-loader state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

NOISE = 0.1  # share of synthetic tokens replaced by random ones


class TokenSource:
    """Where samples come from; ``sample`` returns seq+1 tokens (inputs and shifted targets)."""

    def __init__(self, vocab: int, seq: int, seed: int, path: Path | None = None) -> None:
        self.vocab = vocab
        self.seq = seq
        self.seed = seed
        self.path = path
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r") if path is not None else None
        if self.tokens is not None and len(self.tokens) < seq + 1:
            raise ValueError(f"{path} holds {len(self.tokens)} tokens, fewer than one sequence of {seq + 1}")

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 7_919 + index)
        if self.tokens is None:
            return self._synthetic(generator)
        start = int(torch.randint(len(self.tokens) - self.seq, (1,), generator=generator))
        window = torch.from_numpy(self.tokens[start : start + self.seq + 1].astype(np.int64))
        if int(window.max()) >= self.vocab:
            raise ValueError(f"{self.path} holds token id {int(window.max())}, outside --vocab {self.vocab}")
        return window

    def _synthetic(self, generator: torch.Generator) -> torch.Tensor:
        """An arithmetic progression modulo the vocabulary with some noise: learnable, never trivial."""
        start = torch.randint(self.vocab, (1,), generator=generator)
        stride = torch.randint(1, 8, (1,), generator=generator)
        tokens = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        noisy = torch.rand(self.seq + 1, generator=generator) < NOISE
        return torch.where(noisy, torch.randint(self.vocab, (self.seq + 1,), generator=generator), tokens)


class MicroBatches:
    """The micro-batches of one data-parallel replica."""

    def __init__(self, source: TokenSource, global_batch: int, micro_batch: int, dp_rank: int, dp: int) -> None:
        self.source = source
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.first = dp_rank * (global_batch // dp)

    def get(self, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [micro_batch, seq], for ``step`` (from 1) and ``microbatch`` (from 0)."""
        base = (step - 1) * self.global_batch + self.first + microbatch * self.micro_batch
        rows = torch.stack([self.source.sample(base + j) for j in range(self.micro_batch)])
        return rows[:, :-1], rows[:, 1:]

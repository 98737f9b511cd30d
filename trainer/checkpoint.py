"""Checkpoints with torch.distributed.checkpoint (DCP), saved asynchronously.

Saving is MegaScale's two stages: ``async_save`` first stages a copy of the state in host
memory (training may go on changing the live tensors), then writes it from a background thread.
Keys carry the tensor- and pipeline-parallel coordinates (and the dp rank for ZeRO-1 shards),
so the shards of different ranks never collide, while dp replicas of the same shard share a key
and are written once. A checkpoint is complete once DCP has written its ``.metadata``.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from rankscope.trainer.optimizer import Optimizer
from rankscope.trainer.parallel_state import ParallelState

_PREFIX = "step-"


class Checkpointer:
    """Saves and restores one rank's model and optimizer shards under ``root/step-NNNNNNNN``."""

    def __init__(self, root: Path, ps: ParallelState) -> None:
        self.root = root
        self.ps = ps
        self._pending: Future[Any] | None = None

    def _state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        c = self.ps.coords
        shard = f"tp{c.tp}-pp{c.pp}"
        optim = f"{shard}-dp{c.dp}" if optimizer.sync.shard else shard
        state = {f"model/{shard}/{name}": p for name, p in model.named_parameters()}
        state.update({f"optim/{optim}/{name}": t for name, t in optimizer.state_tensors().items()})
        return state

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def save(self, step: int, model: nn.Module, optimizer: Optimizer) -> None:
        """Stage this step's state and write it in the background; waits for the previous save first."""
        self.wait()
        self._pending = dcp.async_save(
            self._state(model, optimizer), checkpoint_id=str(self.path(step)), process_group=self.ps.ckpt_group
        )

    def wait(self) -> None:
        """Block until the save in flight, if any, is on disk."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, as seen by rank 0 and agreed by every rank."""
        found: list[int | None] = [None]
        if dist.get_rank() == 0 and self.root.is_dir():
            steps = [
                int(d.name[len(_PREFIX) :])
                for d in self.root.iterdir()
                if d.name.startswith(_PREFIX) and d.name[len(_PREFIX) :].isdigit() and (d / ".metadata").is_file()
            ]
            found[0] = max(steps, default=None)
        dist.broadcast_object_list(found, src=0, group=self.ps.ckpt_group)
        return found[0]

    def load(self, step: int, model: nn.Module, optimizer: Optimizer) -> None:
        """Restore model and optimizer in place from the checkpoint of ``step``."""
        dcp.load(self._state(model, optimizer), checkpoint_id=str(self.path(step)), process_group=self.ps.ckpt_group)
        optimizer.reload_from_params()

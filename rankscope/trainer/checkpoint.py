"""Checkpoints with torch.distributed.checkpoint (DCP), saved asynchronously.

Saving is MegaScale's two stages: ``async_save`` first stages a copy of the state in host
memory (training may go on changing the live tensors), then writes it from a background thread.
Keys carry the tensor- and pipeline-parallel coordinates (and the dp rank for ZeRO-1 shards),
so the shards of different ranks never collide, while dp replicas of the same shard share a key
and are written once: a checkpoint without ZeRO-1 shards loads at any dp. A checkpoint is
complete once DCP has written its ``.metadata``; rank 0 writes ``layout.json`` (the layout it was
saved at) before DCP starts, so every complete checkpoint has one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from rankscope.trainer.train_config import ConfigError
from rankscope.trainer.optimizer import Optimizer
from rankscope.trainer.parallel_state import ParallelState

_PREFIX = "step-"
LAYOUT_FILE = "layout.json"
T = TypeVar("T")


@dataclass(frozen=True)
class SavedLayout:
    """The layout a checkpoint was saved at: what decides whether another layout can load it."""

    tp: int
    pp: int
    dp: int
    distributed_optimizer: bool

    def check_loadable_at(self, now: SavedLayout, name: str) -> None:
        """Raise ConfigError unless ``now`` can load checkpoint ``name``: only dp may change, and not with ZeRO-1 shards."""
        if (self.tp, self.pp) != (now.tp, now.pp):
            raise ConfigError(
                f"{name} was saved at tp {self.tp} x pp {self.pp}, not tp {now.tp} x pp {now.pp}; only dp may change on resume"
            )
        if self.distributed_optimizer != now.distributed_optimizer:
            saved = "with" if self.distributed_optimizer else "without"
            raise ConfigError(f"{name} was saved {saved} --distributed-optimizer; resume {saved} it")
        if self.distributed_optimizer and self.dp != now.dp:
            raise ConfigError(
                f"{name} was saved with --distributed-optimizer at dp {self.dp}: its optimizer shards are keyed by dp rank "
                f"and cannot be re-sharded to dp {now.dp}; resume at dp {self.dp} or from a new --ckpt-dir"
            )


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

    def _layout(self, optimizer: Optimizer) -> SavedLayout:
        layout = self.ps.layout
        return SavedLayout(tp=layout.tp, pp=layout.pp, dp=layout.dp, distributed_optimizer=optimizer.sync.shard)

    def _agreed(self, read: Callable[[], T]) -> T:
        """``read()`` on rank 0, the same answer on every rank: no rank acts on its own view of the directory."""
        found = [read() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0, group=self.ps.ckpt_group)
        return found[0]  # type: ignore[return-value]

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def save(self, step: int, model: nn.Module, optimizer: Optimizer) -> None:
        """Stage this step's state and write it in the background; waits for the previous save first."""
        self.wait()
        if dist.get_rank() == 0:
            _write_layout(self.path(step), self._layout(optimizer))
        self._pending = dcp.async_save(
            self._state(model, optimizer), checkpoint_id=str(self.path(step)), process_group=self.ps.ckpt_group
        )

    def wait(self) -> None:
        """Block until the save in flight, if any, is on disk."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (one whose ``.metadata`` DCP wrote), agreed by every rank."""
        return self._agreed(self._newest_complete)

    def _newest_complete(self) -> int | None:
        if not self.root.is_dir():
            return None
        return max(
            (
                int(d.name[len(_PREFIX) :])
                for d in self.root.iterdir()
                if d.name.startswith(_PREFIX) and d.name[len(_PREFIX) :].isdigit() and (d / ".metadata").is_file()
            ),
            default=None,
        )

    def load(self, step: int, model: nn.Module, optimizer: Optimizer) -> SavedLayout:
        """Restore model and optimizer in place from the checkpoint of ``step``; returns the layout it was saved at.

        Raises ConfigError (on every rank) when this layout cannot load it, instead of loading shards that do not fit.
        """
        path = self.path(step)
        saved = self._agreed(lambda: _read_layout(path))
        if saved is None:
            raise ConfigError(
                f"{path} has no {LAYOUT_FILE} (saved by an older rankscope), so its dp is unknown; resume from a new --ckpt-dir"
            )
        saved.check_loadable_at(self._layout(optimizer), path.name)
        dcp.load(self._state(model, optimizer), checkpoint_id=str(path), process_group=self.ps.ckpt_group)
        optimizer.reload_from_params()
        return saved


def _write_layout(path: Path, layout: SavedLayout) -> None:
    """Write ``layout.json`` atomically, so that a reader sees all of it or none."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{LAYOUT_FILE}.tmp"
    tmp.write_text(json.dumps(asdict(layout)) + "\n")
    os.replace(tmp, path / LAYOUT_FILE)


def _read_layout(path: Path) -> SavedLayout | None:
    file = path / LAYOUT_FILE
    return SavedLayout(**json.loads(file.read_text())) if file.is_file() else None

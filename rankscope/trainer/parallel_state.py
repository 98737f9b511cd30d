"""Where each rank sits in the 3D-parallel layout, and the named process groups that connect them.

Megatron's order: rank = tp_rank + dp_rank*TP + pp_rank*TP*DP, so the ranks of one tp group are
neighbours (on one host, where NVLink is) and pipeline stages are the farthest apart. Groups are
named ``tp[i]``, ``pp[i]``, ``dp[i]``; those names are what the diagnosis reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Coords:
    """A rank's coordinates in the layout."""

    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class Layout:
    """The pure mapping between ranks and coordinates; no process groups, usable anywhere."""

    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_of(self, tp: int, pp: int, dp: int) -> int:
        return tp + dp * self.tp + pp * self.tp * self.dp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return Coords(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def groups(self) -> dict[str, list[int]]:
        """Every process group of the job by name, in the order all ranks must create them."""
        named: dict[str, list[int]] = {}
        for pp in range(self.pp):
            for dp in range(self.dp):
                named[f"tp[{pp * self.dp + dp}]"] = [self.rank_of(t, pp, dp) for t in range(self.tp)]
        for dp in range(self.dp):
            for tp in range(self.tp):
                named[f"pp[{dp * self.tp + tp}]"] = [self.rank_of(tp, p, dp) for p in range(self.pp)]
        for pp in range(self.pp):
            for tp in range(self.tp):
                named[f"dp[{pp * self.tp + tp}]"] = [self.rank_of(tp, pp, d) for d in range(self.dp)]
        return named

    def group_names(self, rank: int) -> tuple[str, str, str]:
        """The (tp, pp, dp) group names that ``rank`` belongs to."""
        c = self.coords(rank)
        return f"tp[{c.pp * self.dp + c.dp}]", f"pp[{c.dp * self.tp + c.tp}]", f"dp[{c.pp * self.tp + c.tp}]"


@dataclass
class ParallelState:
    """This rank's place in the layout and the process groups it belongs to."""

    layout: Layout
    rank: int
    coords: Coords
    tp_group: Any
    pp_group: Any
    dp_group: Any
    ckpt_group: Any
    tp_ranks: list[int]
    pp_ranks: list[int]
    dp_ranks: list[int]
    my_groups: dict[str, Any]

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.layout.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage, or None on the first stage."""
        return None if self.is_first_stage else self.pp_ranks[self.coords.pp - 1]

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next pipeline stage, or None on the last stage."""
        return None if self.is_last_stage else self.pp_ranks[self.coords.pp + 1]

    @property
    def metrics_rank(self) -> int:
        """The one rank that reports the run's metrics: the first rank of the last stage."""
        return self.layout.rank_of(0, self.layout.pp - 1, 0)


def initialize(layout: Layout, timeout_s: float) -> ParallelState:
    """Create every named group (all ranks must call this, in the same order) and return this rank's view.

    Needs ``torch.distributed`` to be initialised with a world of ``layout.world_size`` ranks.
    """
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"the job has {world} ranks but tp*pp*dp = {layout.tp}*{layout.pp}*{layout.dp} = {layout.world_size}"
        )
    rank = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    mine = set(layout.group_names(rank))
    my_groups: dict[str, Any] = {}
    members: dict[str, list[int]] = {}
    for name, ranks in layout.groups().items():
        group = dist.new_group(ranks, timeout=timeout, group_desc=name)
        if name in mine:
            my_groups[name] = group
            members[name] = ranks
    # Checkpoints are written from a background thread: give them their own CPU-capable group.
    ckpt_group = dist.new_group(list(range(world)), timeout=timeout, backend="gloo", group_desc="checkpoint")
    tp_name, pp_name, dp_name = layout.group_names(rank)
    return ParallelState(
        layout=layout,
        rank=rank,
        coords=layout.coords(rank),
        tp_group=my_groups[tp_name],
        pp_group=my_groups[pp_name],
        dp_group=my_groups[dp_name],
        ckpt_group=ckpt_group,
        tp_ranks=members[tp_name],
        pp_ranks=members[pp_name],
        dp_ranks=members[dp_name],
        my_groups=my_groups,
    )

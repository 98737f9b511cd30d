"""Who is where in the simulated job: the trainer's own 3D-parallel layout, as plain arrays.

The layout (Megatron's rank order, the names ``tp[i]``, ``pp[i]``, ``dp[i]``) comes from
``rankscope.trainer.parallel_state.Layout``, so the simulator and the real trainer can never
disagree. That module imports ``torch.distributed`` (about 2 s, once, in the process that starts
the simulation); the worker processes get this picklable ``Topology`` instead and never import
torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the three kinds of group, in the order of ``Topology.group_of``'s columns
GROUP_KINDS = ("tp", "pp", "dp")


@dataclass(frozen=True)
class Topology:
    """A TP x PP x DP job: coordinates, hosts and groups of every rank."""

    tp: int
    pp: int
    dp: int
    ranks_per_host: int
    #: group name -> member ranks in group-rank order (``Layout.groups()``)
    groups: dict[str, list[int]]
    #: (world, 3) int32: each rank's tp, pp and dp coordinate
    coords: np.ndarray
    #: (world, 3) int32: index into ``names`` of each rank's tp, pp and dp group
    group_of: np.ndarray
    names: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def host(self, rank: int) -> str:
        return f"node-{rank // self.ranks_per_host}"

    def group_names(self, rank: int) -> tuple[str, str, str]:
        """The (tp, pp, dp) group names of ``rank``."""
        tp, pp, dp = (self.names[i] for i in self.group_of[rank])
        return tp, pp, dp


def build(tp: int, pp: int, dp: int, ranks_per_host: int = 8) -> Topology:
    """The topology of a TP x PP x DP job, from the trainer's ``Layout``."""
    from rankscope.trainer.parallel_state import Layout  # imports torch.distributed: only here

    layout = Layout(tp=tp, pp=pp, dp=dp)
    groups = layout.groups()
    coords = np.array([(c.tp, c.pp, c.dp) for c in map(layout.coords, range(layout.world_size))], dtype=np.int32)
    names = tuple(groups)
    group_of = np.full((layout.world_size, 3), -1, dtype=np.int32)
    for index, (name, members) in enumerate(groups.items()):
        group_of[members, GROUP_KINDS.index(name.split("[", 1)[0])] = index
    return Topology(tp, pp, dp, ranks_per_host, groups, coords, group_of, names)

"""The process groups this rank belongs to: torch's key, the name the diagnosis reports, the members.

The collective tracker numbers each group's operations; what it reports a group as, and which
ranks a point-to-point peer's group rank stands for, come from here. The names go to the
collector in the Register message (``Groups.protos``), again whenever they change (``version``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from rankscope.protos.v1 import telemetry_pb2 as pb


@dataclasses.dataclass
class GroupInfo:
    """A process group as this rank reports it."""

    key: str  # torch's group name: unique in the job, what the flight recorder calls it
    name: str  # what the diagnosis reports
    description: str
    ranks: list[int]


class Groups:
    """Names and members of the groups this rank belongs to; ``version`` changes with them.

    Names: the ones given through ``name_groups``, else the group's description (the bundled
    trainer passes ``group_desc="tp[0]"``), else torch's group name. DeviceMesh gives every group
    of a mesh dimension the same description ("mesh_tp"), so those get torch's unique group name
    appended ("mesh_tp:3"); the default group is "default_pg".
    """

    def __init__(self) -> None:
        self._by_key: dict[str, GroupInfo] = {}
        self._explicit: dict[str, str] = {}
        self.version = 0

    def info(self, pg: Any) -> GroupInfo:
        """``pg`` as reported, registered (and ``version`` moved) at its first sight."""
        key = pg.group_name
        found = self._by_key.get(key)
        if found is None:
            desc = getattr(pg, "group_desc", "") or ""
            found = GroupInfo(key, self._name(key, desc), desc, dist.get_process_group_ranks(pg))
            self._by_key[key] = found
            self.version += 1
        return found

    def _name(self, key: str, desc: str) -> str:
        if key in self._explicit:
            return self._explicit[key]
        if not desc or desc == "undefined":
            return key
        return f"{desc}:{key}" if desc.startswith("mesh_") else desc

    def rename(self, pg: Any, name: str) -> GroupInfo:
        """Report ``pg`` as ``name`` (``name_groups``): a user's name wins over any derived one."""
        self._explicit[pg.group_name] = name
        info = self.info(pg)
        if info.name != name:
            info.name = name
            self.version += 1
        return info

    def scan(self) -> Iterator[Any]:
        """Every process group torch knows in this process (private registry; empty without it)."""
        try:
            groups = list(dist.distributed_c10d._world.pg_names)
        except Exception:  # noqa: BLE001 - torch moved its registry: only groups seen in calls count
            return iter(())
        return iter(g for g in groups if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER)

    def protos(self) -> list[pb.Group]:
        """The groups as the Register message carries them to the collector."""
        return [pb.Group(name=g.name, description=g.description, ranks=g.ranks) for g in self._by_key.values()]

    def by_key(self, key: str) -> GroupInfo | None:
        """The group torch calls ``key`` (as the flight recorder names groups), if this rank has seen it."""
        return self._by_key.get(key)


def backend(pg: Any) -> str:
    """The group's backend as torch names it ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...); "" unknown.

    It decides how often the tracker reads the group's counter (``collective_tracker.Channel.reread``).
    """
    try:
        return str(dist.get_backend(pg))
    except Exception:  # noqa: BLE001 - a group torch does not know (a test's stand-in)
        return ""

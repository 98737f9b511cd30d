"""The critical path of one step: the chain of segments and waits, across ranks, that set its length.

The walk goes backwards in time from the rank that finished the step last. On the rank it is on,
at time ``t``, it takes what that rank was doing just before ``t``:

- a compute, optimizer or data segment: on the path; continue on the same rank before it began;
- a collective: who arrived last among its members (the greatest issue time of the group and
  sequence number) is whom everyone waited for. If that is another rank, the path is the
  collective from that arrival to its end, and continues on the late rank before it arrived;
  otherwise the collective itself (the rank arrived last: the transfer) and on before it;
- a point-to-point operation: the same with its one partner (the matching send or receive: the
  same group, sequence number and pair of ranks), so a pipeline stage waiting for its neighbour's
  activation continues on the neighbour;
- a ``comm`` span with no collective in it at that moment (time in a communication region not
  blocked in any operation: a late send, a copy), on the path as itself;
- nothing recorded: ``(untracked)`` time of that rank (Python between segments).

It stops when the rank it is on has nothing earlier in the step. Gaps under ``EPS_NS`` are
absorbed into the segment before them. Each link comes back as a row: rank, what, kind, start,
end, and whom it waited on.

Excess: how much slower a link is than its peers. For a segment (rank 5's ``backward``): its total in
the step (``step_segments``) minus the median of the other ranks of its pipeline stage (they do the
same work); for a ``comm`` region: its time outside any operation against the same on a few stage
peers; for a collective or a transfer: its time from the last arrival to its end against the same
operation (op and group kind) on those peers. A link's excess on the path (``Cost.cost_ns``) is that
share of its time on the path.

Cost (``CriticalPath.cost_of``): how much shorter the step would be with some links as fast as their
peers'. Their excess moves the path's later points earlier, but at each collective or transfer it
passes only as far as the second-latest arrival there allows, that member being itself earlier by
what it owed to the path or to the same links (followed back through the operations it waited in:
a tensor-parallel peer in lockstep moves with the path, another data-parallel replica does not),
and at the end as far as the second rank to finish allows. ``rank_costs``/``slowest``: per rank;
``without_slowest_ns``: the step's length less the slowest rank's cost.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

Query = Callable[[str, Mapping[str, object]], pa.Table]

log = logging.getLogger("rankscope.anatomy")

#: gaps shorter than this between what a rank did are absorbed, not shown as untracked time
EPS_NS = 200_000
#: a collective issued up to this long outside its step's span bounds still belongs to it (ns)
MARGIN_NS = 60 * 10**9
#: stage peers whose timelines are read to judge a rank's communication links
PEERS = 8
#: groups of up to this many ranks (tensor and pipeline parallel) are read together ...
SMALL_GROUP = 64
#: ... up to this many ranks at once
NEIGHBOURHOOD = 1024
SEGMENT_KINDS = ("compute", "optimizer", "data")

FRAME_SQL = """
SELECT attempt, min(first_ns) AS lo, max(last_ns) AS hi, count() AS ranks, sum(rank_pieces) AS pieces,
       arraySlice(arrayReverseSort(groupArray((last_ns, rank))), 1, 2) AS last_two,
       last_two[1].2 AS last_rank, if(ranks > 1, toInt64(last_two[2].2), -1) AS second_rank, last_two[2].1 AS second_end
FROM (
    SELECT attempt, rank, toUnixTimestamp64Nano(min(first_start)) AS first_ns, toUnixTimestamp64Nano(max(last_end)) AS last_ns,
           sum(pieces) AS rank_pieces
    FROM step_segments
    WHERE run_id = {run:String} AND step = {step:UInt32}
      AND attempt = if({attempt:Int32} >= 0, {attempt:Int32},
                       (SELECT max(attempt) FROM step_segments WHERE run_id = {run:String} AND step = {step:UInt32}))
    GROUP BY attempt, rank
)
GROUP BY attempt
"""

# One rank set's timeline of the step: its spans and its collectives.
TIMELINE_SQL = """
SELECT 0 AS row, rank, toString(kind) AS kind, toString(name) AS name, toUnixTimestamp64Nano(start_time) AS s,
       toUnixTimestamp64Nano(end_time) AS e, '' AS group_name, toInt64(0) AS seq, toUInt64(0) AS nbytes, toInt32(-1) AS peer
FROM spans
WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND rank IN {ranks:Array(UInt32)} AND step = {step:UInt32}
  AND start_time BETWEEN fromUnixTimestamp64Nano({lo:Int64}) AND fromUnixTimestamp64Nano({hi:Int64})
  AND kind IN ('compute', 'optimizer', 'data', 'comm')
UNION ALL
SELECT 1, rank, if(peer >= 0, 'p2p', 'collective'), toString(op), toUnixTimestamp64Nano(issue_time), toUnixTimestamp64Nano(end_time),
       toString(group_name), seq, nbytes, peer
FROM collectives
WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND rank IN {ranks:Array(UInt32)} AND step = {step:UInt32}
  AND issue_time BETWEEN fromUnixTimestamp64Nano({lo:Int64}) AND fromUnixTimestamp64Nano({hi:Int64}) AND end_time >= issue_time
"""

# For collectives whose members were not all read with them: who arrived last at each (group,
# sequence number), and the rows of point-to-point operations (the partners'): by the collectives
# table's by_group_seq projection.
ARRIVALS_SQL = """
SELECT 2 AS row, arrivals[1].2 AS rank, '' AS name, arrivals[1].1 AS s, group_name, seq, toInt32(-1) AS peer,
       if(length(arrivals) > 1, toInt64(arrivals[2].2), -1) AS rank2, arrivals[2].1 AS s2
FROM (
    SELECT toString(group_name) AS group_name, seq, arrayReverseSort(groupArray((toUnixTimestamp64Nano(issue_time), rank))) AS arrivals
    FROM collectives
    WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step = {step:UInt32} AND peer < 0
      AND (group_name, seq) IN {pairs:Array(Tuple(String, Int64))}
    GROUP BY group_name, seq
)
UNION ALL
SELECT 3, rank, toString(op), toUnixTimestamp64Nano(issue_time), toString(group_name), seq, peer, -1, 0
FROM collectives
WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step = {step:UInt32} AND peer >= 0
  AND (group_name, seq) IN {p2p:Array(Tuple(String, Int64))}
"""

# An attempt's groups are those its registrations stored; a store migrated from before groups had an
# attempt holds them all as attempt 0, so an attempt without groups of its own takes the newest before it.
_GROUPS_OF_ATTEMPT = """
groups WHERE run_id = {run:String}
  AND attempt = (SELECT max(attempt) FROM groups WHERE run_id = {run:String} AND attempt <= {attempt:UInt16})"""
GROUPS_SQL = f"SELECT name, argMax(ranks, registered) AS ranks FROM {_GROUPS_OF_ATTEMPT} GROUP BY name"

# Each rank's pipeline stage: its pp coordinate, or else its place in its pp group (a rank can
# register before its trainer set its coordinates), or else 0.
STAGES_SQL = """
SELECT r.rank AS rank, if(r.pp >= 0, r.pp, greatest(g.stage, 0)) AS stage
FROM (SELECT rank, argMax(pp_rank, registered) AS pp FROM ranks WHERE run_id = {run:String} AND attempt <= {attempt:UInt16} GROUP BY rank) AS r
LEFT JOIN (
    SELECT member AS rank, toInt32(position - 1) AS stage
    FROM (SELECT argMax(ranks, registered) AS members FROM""" + _GROUPS_OF_ATTEMPT + """ AND startsWith(name, 'pp[') GROUP BY name)
    ARRAY JOIN members AS member, arrayEnumerate(members) AS position
) AS g ON g.rank = r.rank
"""

TOTALS_SQL = """
SELECT name, rank, sum(total_ns) AS ns
FROM step_segments
WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step = {step:UInt32} AND name IN {names:Array(String)}
GROUP BY name, rank
"""


class Item(NamedTuple):
    """One thing a rank did in the step: a span, or a collective with who arrived last (``other``)."""

    rank: int
    kind: str  # compute | optimizer | data | comm | collective | p2p
    name: str  # the span's name or the operation
    s: int
    e: int
    group: str = ""
    seq: int = 0
    nbytes: int = 0
    peer: int = -1
    other: int = -1  # the last member to arrive (collective) or the partner (p2p); -1 unknown
    other_issue: int = 0

    @property
    def op_name(self) -> str:
        """How a communication link is named for its cost: ``all_reduce dp``, ``send to 5``."""
        if self.kind == "p2p":
            return f"{self.name} {'to' if _is_send(self.name) else 'from'} {self.peer}"
        return f"{self.name} {self.group.split('[', 1)[0]}" if self.kind == "collective" else self.name


@dataclass(frozen=True)
class Link:
    """One row of the critical path, in time order."""

    rank: int
    what: str
    kind: str  # compute | optimizer | data | comm | collective | p2p | untracked
    start_ns: int
    end_ns: int
    #: the rank whose late arrival this link waited for (a collective's or transfer's), else None
    waited_on: int | None = None
    #: the name its cost is counted under, per rank (``backward``, ``all_reduce dp``, ``recv from 4``)
    key: str = ""
    #: the span or operation it is (not part of its identity)
    item: Item | None = field(default=None, compare=False, repr=False)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "what": self.what, "kind": self.kind, "start_ns": self.start_ns, "end_ns": self.end_ns,
                "duration_ms": round(self.duration_ns / 1e6, 3), "waited_on": self.waited_on}  # fmt: skip


@dataclass(frozen=True)
class Cost:
    """What one link of the path (a rank's segment, region or operation) costs the step."""

    rank: int
    key: str
    kind: str
    on_path_ns: int
    #: its excess over its peers' median (before capping at ``on_path_ns``); None: no peers to compare
    excess_ns: float | None
    cost_ns: float
    share: float

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "link": self.key, "kind": self.kind, "on_path_ms": round(self.on_path_ns / 1e6, 3),
                "excess_ms": None if self.excess_ns is None else round(self.excess_ns / 1e6, 3),
                "cost_ms": round(self.cost_ns / 1e6, 3), "share": round(self.share, 4)}  # fmt: skip


@dataclass
class CriticalPath:
    run_id: str
    step: int
    attempt: int
    links: list[Link] = field(default_factory=list)
    costs: list[Cost] = field(default_factory=list)  # greatest first
    start_ns: int = 0
    end_ns: int = 0
    #: index of a link that is a collective or transfer -> who arrived second there
    joins: dict[int, Join] = field(default_factory=dict, repr=False)
    #: the step's end: the second rank to finish
    end: Join | None = field(default=None, repr=False)
    #: the timelines read (rank -> spans and operations): where the joins' second arrivers waited before
    items: dict[int, list[Item]] = field(default_factory=dict, repr=False)

    @property
    def step_ns(self) -> int:
        return self.end_ns - self.start_ns

    def rank_costs(self, limit: int = 8) -> list[tuple[int, float]]:
        """(rank, what it costs the step in ns: ``cost_of([rank])``), greatest first, for the ``limit`` ranks whose
        links' excess on the path is greatest (a rank's cost is at most that), those that cost something only."""
        excess: dict[int, float] = defaultdict(float)
        for c in self.costs:
            excess[c.rank] += c.cost_ns
        found: list[tuple[int, float]] = []
        for rank, most in sorted(excess.items(), key=lambda x: (-x[1], x[0]))[:limit]:
            if most <= 0 or (found and len(found) >= limit):
                break
            found.append((rank, self.cost_of([rank])))
        return sorted(((r, ns) for r, ns in found if ns > 0), key=lambda x: (-x[1], x[0]))

    @property
    def slowest(self) -> tuple[int, float] | None:
        """The slowest link: the rank whose links on the path cost the step the most together, and that cost."""
        ranked = self.rank_costs()
        return ranked[0] if ranked else None

    @property
    def without_slowest_ns(self) -> int:
        """The step's length with the slowest rank's links as fast as its peers'."""
        return self.step_ns - int(self.slowest[1] if self.slowest else 0)

    def cost_of(self, ranks: Iterable[int], kinds: Iterable[str] | None = None) -> float:
        """How much shorter the step would be (ns) with the links on ``ranks`` (of ``kinds``, all when None)
        as fast as their peers'.

        Their excess, link by link, moves the path's later points earlier, but at each collective or
        transfer the path passes only as far as the second-latest arrival there allows (the slack),
        itself earlier by what the path saved before it where that member waited in an earlier
        operation of the path (a tensor-parallel peer in lockstep), and not where it did not (another
        data-parallel replica); at the end, as far as the second rank to finish allows.
        """
        ranks, kinds = set(ranks), None if kinds is None else set(kinds)
        ratios = {(c.rank, c.key): c.cost_ns / c.on_path_ns for c in self.costs
                  if c.on_path_ns > 0 and c.cost_ns > 0 and c.rank in ranks and (kinds is None or c.kind in kinds)}  # fmt: skip
        excess = [ratios.get((k.rank, k.key), 0.0) * k.duration_ns for k in self.links]
        if not any(excess):
            return 0.0
        shifts = _Shifts(self.items, ratios)
        saved, pending = 0.0, 0.0
        for i, link in enumerate(self.links):
            join = self.joins.get(i)
            if join is None:
                pending += excess[i]
                continue
            saved = shifts.through(join, saved + pending) + excess[i]  # a slow transfer's own excess comes after the arrival
            shifts.path[join.key] = saved
            pending = 0.0
        return max(0.0, shifts.through(self.end, saved + pending) if self.end is not None else saved + pending)

    def describe_cost(self, rank: int, who: str | None = None) -> str:
        """``rank 5 costs 25% of step time (backward 17%, forward 8%)``: how the CLI says it (in brackets: its
        links' excess on the path, before the slack of the path's joins)."""
        mine = [c for c in self.costs if c.rank == rank and c.cost_ns > 0]
        share = self.cost_of([rank]) / self.step_ns if self.step_ns > 0 else 0.0
        parts = ", ".join(f"{c.key} {_pct(c.share)}" for c in mine[:3])
        return f"{who or f'rank {rank}'} costs {_pct(share)} of step time" + (f" ({parts})" if len(mine) > 1 else "")

    def as_json(self) -> dict[str, Any]:
        slowest = self.slowest
        return {
            "run_id": self.run_id, "step": self.step, "attempt": self.attempt, "start_ns": self.start_ns, "end_ns": self.end_ns,
            "step_ms": round(self.step_ns / 1e6, 3), "path": [link.as_json() for link in self.links],
            "costs": [c.as_json() for c in self.costs if c.cost_ns > 0],
            "slowest": None if slowest is None else {"rank": slowest[0], "cost_ms": round(slowest[1] / 1e6, 3),
                                                     "share": round(slowest[1] / self.step_ns, 4) if self.step_ns else 0.0},
            "without_slowest_ms": round(self.without_slowest_ns / 1e6, 3),
        }  # fmt: skip


@dataclass(frozen=True)
class Join:
    """Where the path passed a collective or transfer (or the step's end): who arrived second, and when."""

    key: tuple[Any, ...]
    #: the path's arrival (the last one)
    arrived: int
    #: the second-latest arrival (rank, time); None when unknown (the slack is then not limited)
    second: tuple[int, int] | None


class _Shifts:
    """How much earlier each point of the ranks read is reached with some links made faster, during one
    pass of ``CriticalPath.cost_of`` over the path's joins (``path``: the saving at each join passed so far).

    A rank reaches time ``t`` earlier by the excess (``ratios``: of the segments of a rank and name, the
    share that is excess) of its own segments and comm regions since the operation it last came out of, plus that
    operation's shift: at a join of the path, what the path saved there; elsewhere, the shift of whoever
    arrived last at it (itself: its own arrival). Followed back through the ranks read (a rank not read
    shifts by 0); each operation's shift is worked out once. Off the path no slack is applied: an upper
    bound there, which the join it feeds then caps.
    """

    def __init__(self, items: Mapping[int, list[Item]], ratios: Mapping[tuple[int, str], float]) -> None:
        self.items = items
        self.ratios = ratios
        self.path: dict[tuple[Any, ...], float] = {}
        self._memo: dict[tuple[Any, ...], float] = {}
        self._ops: dict[int, tuple[list[int], list[Item]]] = {}
        self._busy: dict[int, list[tuple[int, int]]] = {}  # per rank: when it was in an operation or segment

    def _last_op(self, rank: int, t: int) -> Item | None:
        if rank not in self._ops:
            ops = sorted((i for i in self.items.get(rank, ()) if i.kind in ("collective", "p2p")), key=lambda i: i.e)
            self._ops[rank] = ([i.e for i in ops], ops)
        ends, ops = self._ops[rank]
        k = bisect.bisect_right(ends, t + EPS_NS)
        while k and ops[k - 1].s >= t:  # one that began at t (and ended within EPS_NS of it) is not before t
            k -= 1
        return ops[k - 1] if k else None

    def _excess(self, rank: int, since: int, t: int) -> float:
        """The excess of ``rank``'s links between ``since`` and ``t``: its segments', and its comm regions'
        (a comm span's time outside its operations and segments, as the path counts them)."""
        items = [i for i in self.items.get(rank, ()) if i.s < t and i.e > since and (rank, i.name) in self.ratios]
        total = sum(self.ratios[(rank, i.name)] * (min(i.e, t) - max(i.s, since)) for i in items if i.kind in SEGMENT_KINDS)
        comm = [i for i in items if i.kind == "comm"]
        if comm:
            if rank not in self._busy:
                self._busy[rank] = _union([(i.s, i.e) for i in self.items[rank] if i.kind != "comm"])
            busy = self._busy[rank]
            for i in comm:
                lo, hi = max(i.s, since), min(i.e, t)
                total += self.ratios[(rank, i.name)] * (hi - lo - _overlap(lo, hi, busy))
        return total

    def at(self, rank: int, t: int) -> float:
        chain: list[tuple[float, tuple[Any, ...] | None]] = []
        base = 0.0
        for _ in range(100_000):
            op = self._last_op(rank, t)
            chain.append((self._excess(rank, op.e if op is not None else 0, t), None if op is None else _op_key(op)))
            if op is None:
                break
            key = _op_key(op)
            if key in self.path:
                base = self.path[key]
                break
            if key in self._memo:
                base = self._memo[key]
                break
            if op.other >= 0 and op.other_issue > op.s:  # it waited for another member: follow that one
                rank, t = op.other, op.other_issue
            else:  # it arrived last itself: its own timeline, back from its arrival
                rank, t = op.rank, op.s
        value = base
        for excess, key in reversed(chain):
            if key is not None and key not in self.path:
                self._memo.setdefault(key, value)
            value += excess
        return value

    def through(self, join: Join, saved: float) -> float:
        """How much earlier the path passes ``join`` when it arrives ``saved`` earlier: no earlier than the
        second arrival there allows."""
        if join.second is None:
            return saved
        rank, when = join.second
        return min(saved, self.at(rank, when) + max(0, join.arrived - when))


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%" if share >= 0.01 or share == 0 else f"{100 * share:.1f}%"


class _Timelines:
    """The step's timelines of the ranks asked for so far.

    A rank's timeline is read together with those of the ranks it shares small groups with (up to
    ``SMALL_GROUP`` members: tensor- and pipeline-parallel groups), transitively, up to ``NEIGHBOURHOOD``
    ranks: a path mostly stays inside one data-parallel replica, so a few queries read all it visits.
    """

    def __init__(self, query: Query, params: dict[str, object], groups: GroupIndex | None = None) -> None:
        self.query = query
        self.params = params
        self.items: dict[int, list[Item]] = {}
        self.queries = 0
        self._groups = groups
        #: (group, seq, rank, peer, is a send) -> issue time, of every operation read
        self._issued: dict[tuple[str, int, int, int, bool], int] = {}
        #: (group, seq) -> (rank, issue time) of the second-latest member to arrive at a collective
        self.second: dict[tuple[str, int], tuple[int, int]] = {}

    def fetch(self, ranks: Iterable[int]) -> None:
        missing = sorted({int(r) for r in ranks} - self.items.keys())
        if not missing:
            return
        for r in missing:
            self.items[r] = []
        cols = self.query(TIMELINE_SQL, {**self.params, "ranks": missing}).to_pydict()
        self.queries += 1
        ops = []
        for row, rank, kind, name, s, e, group, seq, nbytes, peer in zip(
            *(cols[n] for n in ("row", "rank", "kind", "name", "s", "e", "group_name", "seq", "nbytes", "peer"))
        ):
            if row == 0:
                self.items[rank].append(Item(rank, kind, name, s, e))
            else:
                ops.append(Item(rank, kind, name, s, e, group, seq, nbytes, peer))
                self._issued[(group, seq, rank, peer, _is_send(name) if peer >= 0 else False)] = s
        # who arrived last: from the rows read when every member's were, else asked for
        last: dict[tuple[str, int], tuple[int, int]] = {}
        ask, ask_p2p = set(), set()
        for op in ops:
            if op.peer >= 0:
                if (op.group, op.seq, op.peer, op.rank, not _is_send(op.name)) not in self._issued and op.peer not in self.items:
                    ask_p2p.add((op.group, op.seq))
            elif (op.group, op.seq) not in last:
                members = self.groups.members.get(op.group)
                if members and all(m in self.items for m in members):
                    issued = [(self._issued.get((op.group, op.seq, m, -1, False)), m) for m in members]
                    if all(i is not None for i, _ in issued):
                        ordered = sorted(issued, reverse=True)  # type: ignore[arg-type]
                        last[(op.group, op.seq)] = (ordered[0][1], ordered[0][0])
                        if len(ordered) > 1:
                            self.second[(op.group, op.seq)] = (ordered[1][1], ordered[1][0])
                        continue
                ask.add((op.group, op.seq))
        if ask or ask_p2p:
            found = self.query(ARRIVALS_SQL, {**self.params, "pairs": sorted(ask), "p2p": sorted(ask_p2p)}).to_pydict()
            self.queries += 1
            names = ("row", "rank", "name", "s", "group_name", "seq", "peer", "rank2", "s2")
            for row, rank, name, s, group, seq, peer, rank2, s2 in zip(*(found[n] for n in names)):
                if row == 2:
                    last[(group, seq)] = (rank, s)
                    if rank2 >= 0:
                        self.second[(group, seq)] = (rank2, s2)
                else:
                    self._issued.setdefault((group, seq, rank, peer, _is_send(name)), s)
        for op in ops:
            if op.peer >= 0:
                partner = self._issued.get((op.group, op.seq, op.peer, op.rank, not _is_send(op.name)))
                other, issue = (op.peer, partner) if partner is not None else (-1, 0)
            else:
                other, issue = last.get((op.group, op.seq), (-1, 0))
            self.items[op.rank].append(op._replace(other=other, other_issue=issue))

    def neighbourhood(self, rank: int) -> list[int]:
        """``rank`` and the ranks it shares small groups with, transitively (at most ``NEIGHBOURHOOD``)."""
        groups = self.groups
        seen, frontier = {rank}, [rank]
        while frontier and len(seen) < NEIGHBOURHOOD:
            reached = {m for r in frontier for g in groups.groups_of.get(r, ()) for m in groups.small[g]} - seen
            if len(seen) + len(reached) > NEIGHBOURHOOD:
                break
            seen |= reached
            frontier = list(reached)
        return sorted(seen)

    @property
    def groups(self) -> GroupIndex:
        """The run's groups: as given, else read once."""
        if self._groups is None:
            table = self.query(GROUPS_SQL, {"run": self.params["run"], "attempt": self.params["attempt"]}).to_pydict()
            self._groups = GroupIndex.of(dict(zip(table["name"], table["ranks"])))
            self.queries += 1
        return self._groups

    def __getitem__(self, rank: int) -> list[Item]:
        if rank not in self.items:
            self.fetch(self.neighbourhood(rank))
        return self.items[rank]


@dataclass(frozen=True)
class GroupIndex:
    """A run's groups as a critical path walks them; built once per run's groups and handed down
    (the live diagnosis builds it once a pass): 100,000 ranks are in about 20,000 groups."""

    #: group name -> its member ranks
    members: dict[str, list[int]]
    #: the groups of 2 to ``SMALL_GROUP`` members (tensor and pipeline parallel)
    small: list[list[int]]
    #: rank -> the indexes in ``small`` of its small groups
    groups_of: dict[int, list[int]]

    @classmethod
    def of(cls, groups: Mapping[str, list[int]]) -> GroupIndex:
        members = {name: list(m) for name, m in groups.items()}
        small = [m for m in members.values() if 1 < len(m) <= SMALL_GROUP]
        groups_of: dict[int, list[int]] = defaultdict(list)
        for g, ranks in enumerate(small):
            for r in ranks:
                groups_of[r].append(g)
        return cls(members, small, dict(groups_of))


def by_rank(values: Mapping[int, int], size: int = 0, missing: int = -1) -> np.ndarray:
    """Per rank (the index, up to ``size`` or the highest rank in ``values``), its value; ``missing``
    where it has none. A dense array: a stage of a 100,000-rank job is selected by a comparison."""
    ranks = np.fromiter(values.keys(), dtype=np.int64, count=len(values))
    out = np.full(max(size, int(ranks.max(initial=-1)) + 1), missing, dtype=np.int64)
    out[ranks] = np.fromiter(values.values(), dtype=np.int64, count=len(values))
    return out


def _is_send(op: str) -> bool:
    return "send" in op.lower()


def critical_path(
    query: Query, run_id: str, step: int, *, attempt: int | None = None, costs: bool = True, frame: Mapping[str, Any] | None = None,
    groups: GroupIndex | None = None,
) -> CriticalPath | None:  # fmt: skip
    """The critical path of ``step`` (of its latest attempt unless ``attempt``); None when the step has no data.

    ``frame``: the step's row of ``FRAME_SQL`` when already read; ``groups``: the run's groups
    (``GROUPS_SQL``) when already read and indexed.
    """
    f = frame if frame is not None else step_frame(query, run_id, step, attempt)
    if f is None:
        return None
    attempt = int(f["attempt"])
    params: dict[str, object] = {"run": run_id, "attempt": attempt, "step": step, "lo": int(f["lo"]) - MARGIN_NS, "hi": int(f["hi"]) + MARGIN_NS}
    timelines = _Timelines(query, params, groups)
    path = CriticalPath(run_id, step, attempt)
    path.links, path.start_ns, path.end_ns = walk(timelines, int(f["last_rank"]))
    if costs and path.links:
        path.costs = _costs(query, params, path, timelines)
        _joins(path, timelines, f)
    return path


def step_frame(query: Query, run_id: str, step: int, attempt: int | None = None) -> dict[str, Any] | None:
    """The step's attempt, time bounds, last rank to finish, how many ranks recorded it and how many span pieces (``FRAME_SQL``)."""
    rows = query(FRAME_SQL, {"run": run_id, "step": step, "attempt": -1 if attempt is None else attempt}).to_pylist()
    return rows[0] if rows and rows[0]["ranks"] else None


def walk(timelines: _Timelines | Mapping[int, list[Item]], last_rank: int) -> tuple[list[Link], int, int]:
    """(links in time order, start, end): the walk back from ``last_rank``'s last moment in the step."""
    rank = last_rank
    items = timelines[rank]
    if not items:
        return [], 0, 0
    t = end = max(i.e for i in items)
    links: list[Link] = []
    while True:
        items = timelines[rank]
        before = [i for i in items if i.s < t]
        if not before:
            break
        latest = max(min(i.e, t) for i in before)
        if latest < t - EPS_NS:
            links.append(Link(rank, "(untracked)", "untracked", latest, t, key="(untracked)"))
            t = latest
        now = [i for i in before if min(i.e, t) >= t - EPS_NS]
        item = _pick(now)
        if item.kind in SEGMENT_KINDS:
            links.append(Link(rank, item.name, item.kind, item.s, t, key=item.name, item=item))
            t = item.s
        elif item.kind in ("collective", "p2p"):
            what = _describe(item)
            arrived = item.other_issue
            other_known = item.other >= 0 and item.other != rank and (isinstance(timelines, _Timelines) or item.other in timelines)
            if other_known and item.s + EPS_NS < arrived < t:
                links.append(Link(rank, what, item.kind, arrived, t, waited_on=item.other, key=item.op_name, item=item))
                rank, t = item.other, arrived
            else:
                links.append(Link(rank, what, item.kind, item.s, t, key=item.op_name, item=item))
                t = item.s
        else:  # a comm region: back to where an operation or segment inside it ended, or to its start
            inside = [min(i.e, t) for i in before if i is not item and i.kind != "comm" and min(i.e, t) < t]
            start = max([item.s, *inside])
            links.append(Link(rank, item.name, "comm", start, t, key=item.name, item=item))
            t = start
    links.reverse()
    return links, t, end


_PRIORITY = {"compute": 0, "optimizer": 0, "data": 0, "collective": 1, "p2p": 1, "comm": 2}


def _pick(now: list[Item]) -> Item:
    """What the rank was doing: a segment over an operation over a comm region; among operations,
    the one whose last member (or partner) arrived latest (what the rank really waited for)."""
    return min(now, key=lambda i: (_PRIORITY.get(i.kind, 3), -i.other_issue if i.kind in ("collective", "p2p") else -i.e))


def _describe(item: Item) -> str:
    if item.kind == "p2p":
        return f"{item.name} {item.group}#{item.seq} {'to' if _is_send(item.name) else 'from'} rank {item.peer}"
    return f"{item.name} {item.group}#{item.seq}"


def _costs(query: Query, params: dict[str, object], path: CriticalPath, timelines: _Timelines) -> list[Cost]:
    on_path: dict[tuple[int, str], list[Link]] = defaultdict(list)
    for link in path.links:
        if link.kind != "untracked":
            on_path[(link.rank, link.key)].append(link)
    table = query(STAGES_SQL, params)
    stages = dict(zip(table.column("rank").to_pylist(), table.column("stage").to_pylist()))
    by_stage: dict[int, list[int]] = defaultdict(list)
    for r, st in stages.items():
        by_stage[st].append(r)
    # segments: each rank's totals of the step against its stage's (every rank of it), as arrays: a
    # stage of a 100,000-rank job has thousands of ranks
    names = sorted({key for (_, key), links in on_path.items() if links[0].kind in SEGMENT_KINDS})
    totals = _segment_totals(query(TOTALS_SQL, {**params, "names": names}), stages) if names else {}
    # communication: the timelines of a few stage peers of each rank with comm links on the path, those
    # already read first (the other tensor-parallel ranks of its stage, as a rule)
    read_by_stage: dict[int, list[int]] = defaultdict(list)
    for p, items in timelines.items.items():
        if items and p in stages:
            read_by_stage[stages[p]].append(p)
    peers: dict[int, list[int]] = {}
    for r in {r for r, key in on_path if on_path[(r, key)][0].kind not in SEGMENT_KINDS}:
        read = [p for p in read_by_stage.get(stages.get(r, 0), []) if p != r]
        peers[r] = _near(r, read, PEERS) if len(read) >= 2 else _near(r, by_stage.get(stages.get(r, 0), []), PEERS)
    timelines.fetch(p for ranks in peers.values() for p in ranks)
    out = []
    for (rank, key), links in on_path.items():
        kind = links[0].kind
        length = sum(link.duration_ns for link in links)
        # a segment or region slower than its peers' median by ``excess`` of its ``own`` total: that share of
        # each piece of it on the path is excess (all of it when the whole segment is on the path)
        if kind in SEGMENT_KINDS:
            ranks, stage_of, ns = totals.get(key, _NO_TOTALS)
            others = ns[(stage_of == stages.get(rank, 0)) & (ranks != rank)]
            mine = ns[ranks == rank]
            own = float(mine[0]) if len(mine) else float(length)
            excess = own - float(np.median(others)) if len(others) else None
        elif kind == "comm":
            mine = _region_ns(timelines.items.get(rank, []), key)
            others = [o for o in (_region_ns(timelines.items.get(p, []), key) for p in peers[rank]) if o is not None]
            own = float(mine or 0)
            excess = own - statistics.median(others) if mine is not None and others else None
        else:  # a collective or transfer: its own time on the path against the same operation's on the peers
            theirs = [d for p in peers[rank] for d in _transfers(timelines.items.get(p, []), links[0], key)]
            own = float(length)
            excess = length - statistics.median(theirs) * len(links) if theirs else None
        cost = 0.0 if excess is None or excess <= 0 or own <= 0 else min(float(length), length * excess / own)
        out.append(Cost(rank, key, kind, length, excess, cost, cost / path.step_ns if path.step_ns > 0 else 0.0))
    out.sort(key=lambda c: (-c.cost_ns, c.rank, c.key))
    return out


_NO_TOTALS = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))


def _segment_totals(table: pa.Table, stages: Mapping[int, int]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Segment -> (ranks, their stages (-1: unknown), their totals in ns) from ``TOTALS_SQL``'s rows."""
    names = table.column("name").cast(pa.string()).combine_chunks().dictionary_encode()
    code, ranks, ns = names.indices.to_numpy(), table.column("rank").to_numpy().astype(np.int64), table.column("ns").to_numpy().astype(float)
    lookup = by_rank(stages, int(ranks.max(initial=-1)) + 1)
    out = {}
    for i, name in enumerate(names.dictionary.to_pylist()):
        rows = code == i
        out[name] = (ranks[rows], lookup[ranks[rows]], ns[rows])
    return out


def _op_key(item: Item) -> tuple[Any, ...]:
    """A collective by (group, seq); a transfer by (group, seq, sender, receiver)."""
    if item.kind == "p2p":
        sender, receiver = (item.rank, item.peer) if _is_send(item.name) else (item.peer, item.rank)
        return (item.group, item.seq, sender, receiver)
    return (item.group, item.seq)


def _joins(path: CriticalPath, timelines: _Timelines, frame: Mapping[str, Any]) -> None:
    """The path's collectives and transfers, and its end, with who arrived (finished) second and what it waited in before."""
    seconds: dict[int, tuple[tuple[Any, ...], int, int, int]] = {}  # link index -> (key, arrival, second rank, second time)
    for i, link in enumerate(path.links):
        item = link.item
        if item is None or link.kind not in ("collective", "p2p"):
            continue
        if link.kind == "collective":
            second = timelines.second.get((item.group, item.seq))
        elif link.waited_on is not None:
            second = (link.rank, item.s)  # the receiver (or sender) the path was on arrived first
        else:
            second = (item.other, item.other_issue) if item.other >= 0 else None
        if second is None:
            path.joins[i] = Join(_op_key(item), link.start_ns, None)
        else:
            seconds[i] = (_op_key(item), link.start_ns, int(second[0]), int(second[1]))
    ends = int(frame.get("second_rank", -1))
    if ends >= 0:
        seconds[-1] = (("end",), path.end_ns, ends, int(frame["second_end"]))
    timelines.fetch(r for _, _, r, _ in seconds.values())  # what the second arrivers waited in (only those not read yet)
    for i, (key, arrived, rank, when) in seconds.items():
        join = Join(key, arrived, (rank, when))
        if i == -1:
            path.end = join
        else:
            path.joins[i] = join
    path.items = timelines.items


def _near(rank: int, stage: list[int], n: int) -> list[int]:
    """Up to ``n`` other ranks of ``stage``, the nearest in rank number first."""
    return sorted((r for r in stage if r != rank), key=lambda r: (abs(r - rank), r))[:n]


def _region_ns(items: list[Item], name: str) -> int | None:
    """Time in ``comm`` spans called ``name`` outside any operation or segment of the rank; None without such spans."""
    regions = [(i.s, i.e) for i in items if i.kind == "comm" and i.name == name]
    if not regions:
        return None
    busy = _union([(i.s, i.e) for i in items if i.kind != "comm"])
    return sum(e - s - _overlap(s, e, busy) for s, e in regions)


def _transfers(items: list[Item], like: Link, key: str) -> list[int]:
    """The times from last arrival to end of a peer's operations named like ``key`` (same op and group kind)."""
    op = key.split(" ", 1)[0]
    out = []
    for i in items:
        if i.kind != like.kind or i.name != op:
            continue
        if i.kind == "collective" and i.op_name != key:
            continue
        arrived = max(i.s, i.other_issue) if i.other >= 0 else i.s
        out.append(max(0, i.e - arrived))
    return out


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _overlap(s: int, e: int, merged: list[tuple[int, int]]) -> int:
    return sum(max(0, min(e, b) - max(s, a)) for a, b in merged if a < e and b > s)


#: the steps an incident's cost is the median of (the newest complete ones of its window)
INCIDENT_STEPS = 3
#: each step's pieces (rows of spans, summed) and ranks: which steps every rank has sent, and whether one grew
STEP_PIECES_SQL = (
    "SELECT step, sum(pieces) AS pieces, uniqExact(rank) AS ranks FROM step_segments WHERE run_id = {run:String} "
    "AND attempt = {attempt:UInt16} AND step IN {path_steps:Array(UInt32)} GROUP BY step"
)
#: (run, attempt, step) -> (what the step's frame was, its critical path): the live diagnosis asks every pass
_PATHS: dict[tuple[str, int, int], tuple[dict[str, Any], CriticalPath | None]] = {}
_PATHS_KEPT = 64
_PATHS_LOCK = threading.Lock()


def whole_steps(query: Query, run_id: str, window: Iterable[int], world: int, *, attempt: int) -> dict[int, int]:
    """The newest ``INCIDENT_STEPS`` steps of ``window`` that ``world`` ranks have sent -> their pieces: an
    incident's cost is walked on those. A path walked on a step still arriving can miss the rank that holds
    everyone (the demo's first straggler "costs 0% of step time"); the pieces tell a step that grew since."""
    counted = query(STEP_PIECES_SQL, {"run": run_id, "attempt": attempt, "path_steps": list(window)}).to_pylist()
    return dict(sorted((c["step"], c["pieces"]) for c in counted if c["ranks"] >= world)[-INCIDENT_STEPS:])


def incident_cost(query: Query, run_id: str, steps: Iterable[int], ranks: Iterable[int], *, attempt: int | None = None,
                  kinds: Iterable[str] | None = None, groups: GroupIndex | None = None, world: int = 0) -> dict[str, Any] | None:  # fmt: skip
    """What the links of ``ranks`` (of ``kinds``) cost the steps ``steps`` on their critical paths, for an
    incident: {steps, share (the median over the steps of cost / step length), cost_ms (their median),
    text, per_step: [{step, step_ms, cost_ms, share, links}]}; None when none of the steps has a timeline.

    A few steps, not one: on a busy machine a single step's path may run elsewhere. Paths are kept per
    (run, attempt, step) while the step's frame (its ranks, time bounds and spans) stays the same: the live
    diagnosis asks every pass, and walks again only when more of a step has arrived. ``world``: the
    ranks a whole step has; a step of fewer (still arriving: at 100,000 ranks a rank's rows come every
    20 s) keeps the path walked on part of it until it is whole, rather than a walk a pass (most of
    the straggler's pass at that size); 0: walked again whenever the step grew. The cost is
    evidence, never a reason to lose an incident: a failed read gives None (logged).
    """
    ranks, kinds = sorted(set(ranks)), None if kinds is None else set(kinds)
    per_step = []
    for step in sorted(set(steps)):
        path = _kept_path(query, run_id, step, attempt, groups, world)
        if path is None or path.step_ns <= 0:
            continue
        cost = path.cost_of(ranks, kinds)
        mine = [c for c in path.costs if c.rank in ranks and c.cost_ns > 0 and (kinds is None or c.kind in kinds)]
        per_step.append({"step": step, "step_ms": round(path.step_ns / 1e6, 3), "cost_ms": round(cost / 1e6, 3),
                         "share": round(cost / path.step_ns, 4), "links": [c.as_json() for c in mine[:5]]})  # fmt: skip
    if not per_step:
        return None
    share = statistics.median(p["share"] for p in per_step)
    first, last = per_step[0]["step"], per_step[-1]["step"]
    where = f"step {first}" if first == last else f"steps {first}-{last}"
    return {
        "steps": [p["step"] for p in per_step], "share": round(share, 4),
        "cost_ms": round(statistics.median(p["cost_ms"] for p in per_step), 3),
        "text": f"costs {_pct(share)} of step time (critical path of {where})", "per_step": per_step,
    }


def _kept_path(query: Query, run_id: str, step: int, attempt: int | None, groups: GroupIndex | None, world: int = 0) -> CriticalPath | None:
    key = (run_id, -1 if attempt is None else attempt, step)
    try:
        frame = step_frame(query, run_id, step, attempt)
        if frame is None:
            return None
        with _PATHS_LOCK:
            kept = _PATHS.get(key)
        if kept is not None and (kept[0] == frame or frame["ranks"] < world):
            return kept[1]
        path = critical_path(query, run_id, step, attempt=attempt, frame=frame, groups=groups)
    except Exception as e:  # noqa: BLE001
        log.warning("critical path of %s step %d: %s", run_id, step, e)
        return None
    with _PATHS_LOCK:
        _PATHS.pop(key, None)
        if len(_PATHS) >= _PATHS_KEPT:
            del _PATHS[next(iter(_PATHS))]
        _PATHS[key] = (frame, path)
    return path

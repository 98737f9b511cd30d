"""What the collector knows about runs and ranks: registrations, hosts, exits, attempts, stored groups.

One registry outlives every batch: the decoders of registrations and ends note into it
(``run_lifecycle``), every decoder reads hosts and attempts from it, and after a restart it is
filled from the store (``read_run``). It is kept apart from decoding because it is state, with
its own rules (which registration is newer, when to read a run again), where decoding is a
function of one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from rankscope.protos.v1 import ingest_pb2, telemetry_pb2


@dataclass(frozen=True)
class Registration:
    """A rank's newest registration: its process's start and the registration's time as the rank's
    own clock gave them (one rank's registrations come from one host's clock, so they are ordered
    without a clock offset, which the agent does not know yet when it first registers), and the
    version its rows were stored with (collector clock). Read back from the store after a restart,
    only the version is known (the times are 0)."""

    start_ns: int
    time_ns: int
    version: int
    #: the attempt (restart) of the run the registering process belongs to
    attempt: int = 0
    #: the agent instance that registered (``sender``; empty: read back from the store, or one sender for several ranks)
    instance: bytes = b""

    def newer(self, start_ns: int, time_ns: int, at_ns: int, attempt: int = 0) -> bool | None:
        """Whether a registration (its attempt, its process's start and time on the rank's clock, its
        time on the collector's) is newer than this one; None: this one again (sent again after a
        reconnect). A later attempt is newer whatever the clocks say: after a restart the same rank
        may run on another host, whose clock is not this one's."""
        if attempt != self.attempt:
            return attempt > self.attempt
        if not (time_ns and self.time_ns):  # read back from the store, or an agent that sends no time
            return at_ns >= self.version
        if (start_ns, time_ns) == (self.start_ns, self.time_ns):
            return None
        return (start_ns, time_ns) > (self.start_ns, self.time_ns)


@dataclass
class RunInfo:
    """One run as its ranks' registrations and exits describe it."""

    name: str = ""
    start_ns: int = 0
    world_size: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    config: str = ""
    #: whether tp, pp and dp come from a rank that knew its place in them
    placed: bool = False
    hosts: dict[int, str] = field(default_factory=dict)
    #: rank -> its newest registration
    registered: dict[int, Registration] = field(default_factory=dict)
    #: rank -> (exit reason, exit time ns)
    exits: dict[int, tuple[str, int]] = field(default_factory=dict)
    #: world (torchrun round, ``Register.world``) -> its attempt, numbered in the order worlds registered
    worlds: dict[str, int] = field(default_factory=dict)
    #: agent instance (the first 8 bytes of its batch ids) -> the attempt of the world that process
    #: registered in: what a late row of an earlier attempt is told apart by (``sender``)
    processes: dict[bytes, int] = field(default_factory=dict)
    #: (attempt, group name) -> the group as this collector last stored it (``group_key``): every rank's
    #: registration carries its groups, which need storing once, not once per member (at 100,000
    #: ranks, a data-parallel group of 782 members would be written 782 times)
    groups: dict[tuple[int, str], bytes] = field(default_factory=dict)

    def merge(self, other: RunInfo) -> None:
        """Fill what this record lacks from ``other`` (an older record read back from the store)."""
        if not self.world_size or (other.placed and not self.placed):
            self.tp, self.pp, self.dp, self.placed = other.tp, other.pp, other.dp, other.placed
        if not self.world_size:
            self.name, self.world_size, self.config = other.name, other.world_size, other.config
        if other.start_ns and (not self.start_ns or other.start_ns < self.start_ns):
            self.start_ns = other.start_ns
        self.hosts = {**other.hosts, **self.hosts}
        self.worlds = {**other.worlds, **self.worlds}
        self.registered = {**other.registered, **self.registered}
        self.exits = {**other.exits, **self.exits}

    @property
    def end_ns(self) -> int:
        """When the run ended (its last rank's exit, collector clock) once every rank of its world has
        ended and none registered since; 0 while it runs or its size is unknown."""
        if not self.world_size or len(self.exits) < self.world_size:  # while it runs, without a look at 100,000 ranks
            return 0
        ends = [self.exits.get(rank) for rank in range(self.world_size)]
        if None in ends:
            return 0
        return max(t for _, t in ends)  # type: ignore[misc]

    def ended_since(self, rank: int, at_ns: int) -> bool:
        """Whether ``rank`` ended after ``at_ns``: a registration made then is news of the past."""
        exited = self.exits.get(rank)
        return exited is not None and at_ns <= exited[1]

    def attempt(self, rank: int) -> int:
        """The attempt of ``rank``'s newest registration (0 before any)."""
        return self.attempts((rank,))[0]

    def attempts(self, ranks: Iterable[int]) -> list[int]:
        """:meth:`attempt` of each of ``ranks``."""
        registered = self.registered
        return [held.attempt if (held := registered.get(rank)) is not None else 0 for rank in ranks]

    def attempt_of(self, batch: ingest_pb2.Batch) -> int:
        """The attempt of the process that sent ``batch``: the number of the world it registers in (a
        new world would get the next number: ``note_world`` keeps it once the registration is
        accepted), else its rank's newest registration's (a collector that restarted since), else what
        the envelope says (an agent that sends no world)."""
        world = _world(batch)
        if world:
            return self.worlds[world] if world in self.worlds else max(self.worlds.values(), default=-1) + 1
        held = self.processes.get(sender(batch))
        if held is not None:
            return held
        return self.attempt(batch.rank) if batch.rank in self.registered else batch.attempt

    def unregistered_sender(self, batch: ingest_pb2.Batch) -> bool:
        """Whether rows ``batch`` carries come from a process that has not registered, while its rank's
        newest registration is another process's that registered in a world this collector saw: a
        restarted rank's first heartbeats can overtake its registration, and would be taken for the
        earlier attempt's, on the host it had then (CI of c2895eb: a host killed under Slurm heard
        "again" as the survivors restarted, and never named lost)."""
        return len(batch.parts) <= 1 and self.unregistered(sender(batch), batch.rank)

    def unregistered(self, process: bytes, rank: int) -> bool:
        """Whether ``process`` has not registered while ``rank``'s newest registration is another
        process's that registered in a world this collector saw (``unregistered_sender``)."""
        held = self.registered.get(rank)
        return process not in self.processes and held is not None and held.instance != process and held.instance in self.processes

    def unregistered_parts(self, parts: Iterable[ingest_pb2.BatchPart]) -> frozenset[bytes]:
        """The ids of a relay's batch's ``parts`` whose process is :meth:`unregistered` for the part's
        rank: a restarted rank's first rows, merged by its host's relay with its peers' (whose rows
        are stored meanwhile: ``server``)."""
        return frozenset(p.batch_id for p in parts if self.unregistered(_instance(p.batch_id), p.rank))

    def part_attempts(self, parts: Iterable[ingest_pb2.BatchPart]) -> list[int]:
        """The attempt of the process behind each of a relay's batch's ``parts``, -1 where this collector
        has not seen it register (it restarted since, or the agent sends no world): a relay's spool
        replayed after a restart holds the earlier attempt's rows, which its ranks' newest registration
        would mislabel."""
        return [self.processes.get(_instance(p.batch_id), -1) for p in parts]

    def note_world(self, batch: ingest_pb2.Batch, attempt: int) -> None:
        """Keep the world a registration ``batch`` that passed its checks names, and its process's attempt."""
        world = _world(batch)
        if world:
            self.worlds.setdefault(world, attempt)
            for process in [_instance(p.batch_id) for p in batch.parts] or [sender(batch)]:
                self.processes[process] = attempt

    def register(self, rank: int, start_ns: int, time_ns: int, at_ns: int, attempt: int = 0, instance: bytes = b"") -> int | None:
        """Note a registration of ``rank`` (its process's start and its time on the rank's clock,
        ``at_ns`` on the collector's); the version to store its rows with, or None when it is older
        than the rank's newest registration: one delivered late (a retry, a spool replay) must not
        undo what came after it. One made before the rank's exit but delivered after it is stored
        (the caller does not reopen the rank): the last registration, sent with the rank's end,
        carries the groups its last steps created, and its calls may be answered in any order."""
        held = self.registered.get(rank)
        newer = True if held is None else held.newer(start_ns, time_ns, at_ns, attempt)
        if newer is False:
            return None
        if held is None:
            version = at_ns
        elif newer is None:
            version = held.version  # the same registration again: its rows keep their version
        else:  # above the rank's earlier versions even when the agent's clock offset was corrected in between
            version = max(at_ns, held.version + 1)
        self.registered[rank] = Registration(start_ns, time_ns, version, attempt, instance)
        return version


class RunRegistry:
    """Runs and ranks seen by this collector: hosts for heartbeats, exits for a run's end.

    Filled by Register and EndOfRank batches; after a restart, by what the store holds (the
    server asks :meth:`needs_load` and merges :func:`read_run`). Entries are idempotent, so a
    batch decoded twice (a retry after a failed write) leaves the same state.
    """

    #: a rank missing from a loaded run is looked up again after this long (another collector
    #: behind the same load balancer may have taken its registration)
    RELOAD_AFTER_S = 10.0

    def __init__(self) -> None:
        self._runs: dict[str, RunInfo] = {}
        self._loaded_at: dict[str, float] = {}

    def run(self, run_id: str) -> RunInfo:
        """The record of ``run_id``, begun empty when first named: called once a batch that registers
        has passed its checks (a refused batch leaves no run behind)."""
        return self._runs.setdefault(run_id, RunInfo())

    def known(self, run_id: str) -> RunInfo | None:
        """The record of ``run_id``, None when this collector knows nothing of it."""
        return self._runs.get(run_id)

    def host(self, run_id: str, rank: int) -> str:
        """``rank``'s host as it registered it ('' before that): the rows of its batches carry it."""
        run = self._runs.get(run_id)
        return run.hosts.get(rank, "") if run else ""

    def has_ended(self, run_id: str, rank: int) -> bool:
        """Whether ``rank`` has ended and not registered since: nothing is asked of an ended rank."""
        run = self._runs.get(run_id)
        return bool(run) and rank in run.exits

    def needs_load(self, run_id: str, rank: int, now_s: float, registering: bool = False) -> bool:
        """Whether the store should be asked about this run before decoding (monotonic ``now_s``): once,
        and again for a rank it does not know, unless that rank is registering (it brings its host
        itself; while 100,000 ranks register, each reload would read the whole run again)."""
        loaded = self._loaded_at.get(run_id)
        if loaded is None:
            return True
        return not registering and rank not in self.run(run_id).hosts and now_s - loaded > self.RELOAD_AFTER_S

    def merge_loaded(self, run_id: str, stored: RunInfo, now_s: float) -> None:
        """Merge what the store knew of ``run_id`` (``read_run``) into what this process has seen since,
        loaded at monotonic ``now_s`` (``needs_load`` counts from then). A run the store does not know
        and this process has not seen is not kept: a stream of made-up run ids leaves nothing behind."""
        if run_id not in self._runs and not (stored.world_size or stored.registered or stored.exits or stored.hosts):
            return
        self.run(run_id).merge(stored)
        self._loaded_at[run_id] = now_s

    def stored(self, run_id: str, parts: Mapping[str, pa.Table]) -> None:
        """A decoded batch's tables (``Decoded.parts``) are in the store now: their groups need not be
        written again (a batch refused or failed before this is decoded again in full when it is sent
        again)."""
        groups = parts.get("groups")
        if groups is not None and groups.num_rows:
            known = self.run(run_id).groups
            for row in groups.select(["attempt", "name", "description", "ranks"]).to_pylist():
                attempt = row.pop("attempt")
                known[(attempt, row["name"])] = group_key(telemetry_pb2.Group(**row))


def sender(batch: ingest_pb2.Batch) -> bytes:
    """The agent instance that made ``batch``: its own id's, or its one part's when a relay passed it on
    (a relay's batch of several parts has several senders: ``RunInfo.part_attempts``)."""
    return _instance(batch.parts[0].batch_id if len(batch.parts) == 1 else batch.batch_id)


def _instance(batch_id: bytes) -> bytes:
    """The agent instance a batch id names: its first 8 bytes (the rest count the instance's batches)."""
    return bytes(batch_id[:8])


def _world(batch: ingest_pb2.Batch) -> str:
    """The world a registration batch names ('' for other payloads)."""
    kind = batch.WhichOneof("payload")
    if kind == "register":
        return batch.register.world
    return batch.registers.registers[0].world if kind == "registers" and batch.registers.registers else ""


def group_key(group: telemetry_pb2.Group) -> bytes:
    """A group's name, description and members as one comparable value (12 us for 782 members,
    against 48 us for a tuple of them): a group is stored again only when this changes."""
    return telemetry_pb2.Group(name=group.name, description=group.description, ranks=group.ranks).SerializeToString()


def read_run(query: Callable[[str, Mapping[str, object]], pa.Table], run_id: str) -> RunInfo:
    """What the store knows about ``run_id``: ``query(sql, params) -> pa.Table`` runs the SQL.

    Rows written by this process before a restart, or by another collector, are found here.
    """
    run_q = (
        "SELECT argMax(name, updated) AS name, toUnixTimestamp64Nano(min(start_time)) AS start,"
        " argMax(world_size, updated) AS ws,"
        " argMax(tp, updated) AS tp, argMax(pp, updated) AS pp, argMax(dp, updated) AS dp,"
        " argMax(config, updated) AS config FROM runs WHERE run_id = {run_id:String} HAVING count() > 0"
    )
    ranks_q = (
        "SELECT rank, argMax(host, registered) AS host, toUnixTimestamp64Nano(max(registered)) AS newest,"
        " argMax(pp_rank, registered) >= 0 AS placed, max(attempt) AS attempt FROM ranks WHERE run_id = {run_id:String} GROUP BY rank"
    )
    exits_q = (
        "SELECT rank, argMax(reason, time) AS reason, toUnixTimestamp64Nano(max(time)) AS t"
        " FROM exits WHERE run_id = {run_id:String} GROUP BY rank"
    )
    params = {"run_id": run_id}
    info = RunInfo()
    for row in query(run_q, params).to_pylist():
        info = RunInfo(row["name"], row["start"], row["ws"], row["tp"], row["pp"], row["dp"], row["config"])
    ranks = query(ranks_q, params).to_pylist()
    info.hosts = {r["rank"]: r["host"] for r in ranks}
    info.registered = {r["rank"]: Registration(0, 0, r["newest"], r["attempt"]) for r in ranks}
    info.placed = any(r["placed"] for r in ranks)
    info.exits = {r["rank"]: (r["reason"], r["t"]) for r in query(exits_q, params).to_pylist()}
    worlds_q = "SELECT world, min(attempt) AS attempt FROM ranks WHERE run_id = {run_id:String} AND world != '' GROUP BY world"
    info.worlds = {r["world"]: r["attempt"] for r in query(worlds_q, params).to_pylist()}
    return info

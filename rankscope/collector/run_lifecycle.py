"""The payloads that change what the collector knows of a run: registrations and ends of ranks.

They decode into the rows of ``ranks``, ``groups``, ``exits`` and ``runs`` and, once the whole
batch has passed its checks, note into the run registry: a rank's host, attempt and exit, the
world's size and shape, when the run began and whether it ended. They are apart from the other
decoders (``decode``), which only read the registry, because their rules are about the run's life
(which registration is news, when the last end ends the run), not about columns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sized

import numpy as np
import pyarrow as pa

from rankscope.collector.batch_columns import TIMESTAMP, BatchContext, IngestError, arrow_table, enum_names, row_ranks
from rankscope.collector.batch_limits import MAX_TEXT_CHARS, MAX_UINT16, MAX_WORLD, check_range, check_repeated, check_text, shown
from rankscope.collector.run_registry import RunInfo, RunRegistry, group_key
from rankscope.protos.v1 import telemetry_pb2

log = logging.getLogger("rankscope.collector")

EXIT_REASONS = enum_names(telemetry_pb2.EndOfRank.Reason, "REASON_")


def decode_register(ctx: BatchContext, reg: telemetry_pb2.Register, registry: RunRegistry) -> dict[str, pa.Table]:
    """One rank's registration, from its own agent."""
    return _registrations(ctx, [(ctx.rank, reg)], registry, lambda i: "register")


def decode_registers(ctx: BatchContext, msg: telemetry_pb2.RegisterBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    """Several ranks' registrations from one sender: one call and one table each for all of them."""
    _check_several("registers", "registration", msg.registers, msg.ranks)
    worlds = sorted({reg.world for reg in msg.registers})
    if len(worlds) > 1:
        raise IngestError(f"registers: registrations of {len(worlds)} worlds ({', '.join(map(shown, worlds[:3]))}) in one batch: send each world's in a batch of its own")
    ctx.ranks = tuple(sorted(set(msg.ranks)))
    return _registrations(ctx, list(zip(msg.ranks, msg.registers)), registry, lambda i: f"registers.registers[{i}]")


def _check_several(kind: str, what: str, items: Sized, ranks: Sized) -> None:
    """Refuse a batch of several ranks' ``items`` (``kind``'s repeated field, one ``what`` a rank) that
    holds none, too many, or not one rank for each."""
    if not items:
        raise IngestError(f"{kind}.{kind} is empty: a batch of {kind} holds at least one {what}")
    check_repeated(f"{kind}.{kind}", items)
    if len(ranks) != len(items):
        raise IngestError(f"{kind}: {len(ranks)} ranks for {len(items)} {what}s: give each {what} its rank")


def _registrations(
    ctx: BatchContext, regs: list[tuple[int, telemetry_pb2.Register]], registry: RunRegistry, where: Callable[[int], str]
) -> dict[str, pa.Table]:
    """The rows of ``regs`` (rank, its registration), each checked before any is noted: a batch is
    stored whole or refused whole, and a refused one leaves the registry as it was."""
    times, keys = [], []
    checked: set[tuple[bytes, int]] = set()  # (group, world size) found inside the world: a batch's ranks share their groups
    for i, (rank, reg) in enumerate(regs):
        if reg.world_size < 1:
            raise IngestError(f"{where(i)}.world_size is {reg.world_size}: it must be at least 1", "range")
        check_range(f"{where(i)}.world_size", reg.world_size, 1, MAX_WORLD)
        if rank < 0:
            raise IngestError(f"the rank of {where(i)} is {rank}: ranks are >= 0", "rank")
        if rank >= reg.world_size:
            raise IngestError(f"rank {rank} is not below {where(i)}.world_size {reg.world_size}", "rank")
        _check_register(reg, where(i))
        keys.append([group_key(g) for g in reg.groups])
        for g, key in zip(reg.groups, keys[-1]):
            if (key, reg.world_size) in checked:
                continue
            _check_group(g, reg.world_size, f"{where(i)}.groups[{shown(g.name)}]")
            checked.add((key, reg.world_size))
        start = ctx.time(f"{where(i)}.start_time_ns", reg.start_time_ns)
        times.append((start, ctx.time(f"{where(i)}.time_ns", reg.time_ns) if reg.time_ns else ctx.now_ns))
    run = registry.run(ctx.run_id)
    if not run.registered:  # the user needs the id for `rankscope diagnose --run` and the dashboard's ?run=
        rank, reg = regs[0]
        log.info("run %s: rank %d of %d registered from %s", ctx.run_id, rank, reg.world_size, reg.host)
    rows: list[tuple[int, telemetry_pb2.Register, int]] = []
    groups: dict[str, tuple[telemetry_pb2.Group, int]] = {}
    alive = late = False
    for (rank, reg), (start, at_ns), group_keys in zip(regs, times, keys):
        ended = run.ended_since(rank, at_ns)
        version = run.register(rank, reg.start_time_ns, reg.time_ns, at_ns, ctx.attempt, ctx.sender if len(ctx.parts) <= 1 else b"")
        if version is None:
            continue  # an older registration than the rank's newest (or than its end), delivered late
        rows.append((rank, reg, version))
        for g, key in zip(reg.groups, group_keys):  # stored once, not once per member
            if run.groups.get((ctx.attempt, g.name)) != key:
                groups[g.name] = (g, version)
        # A rank that does not know its coordinates yet (registered before the script set the topology)
        # does not undo the sizes a rank that knew them sent.
        placed = min(reg.tp_rank, reg.pp_rank, reg.dp_rank) >= 0
        if placed or not run.placed:
            run.tp, run.pp, run.dp, run.placed = max(reg.tp, 1), max(reg.pp, 1), max(reg.dp, 1), placed
        run.world_size = reg.world_size
        run.start_ns = min(run.start_ns, start) if run.start_ns else start
        # Ranks that leave the name or config empty do not erase what another rank sent.
        run.name, run.config = reg.run_name or run.name, reg.config_json or run.config
        run.hosts[rank] = reg.host
        if ended:  # the rank's identity is news, its being alive is not: it has ended since
            late = True
        else:
            run.exits.pop(rank, None)  # registered again: the rank (or its restart) is alive
            alive = True
    if not rows:
        return {}
    n, regs_of = len(rows), [reg for _, reg, _ in rows]
    # Rows versioned by when the agent registered, not by arrival: the newest stands whatever the order.
    parts = {
        "ranks": arrow_table(
            "ranks",
            {
                "run_id": [ctx.run_id] * n, "rank": [rank for rank, _, _ in rows], "host": [r.host for r in regs_of],
                "pid": [max(r.pid, 0) for r in regs_of], "local_rank": [r.local_rank for r in regs_of],
                "device": [r.device for r in regs_of], "tp_rank": [r.tp_rank for r in regs_of],
                "pp_rank": [r.pp_rank for r in regs_of], "dp_rank": [r.dp_rank for r in regs_of],
                "clock_offset_ns": [ctx.offset] * n, "agent_version": [r.agent_version for r in regs_of],
                "registered": pa.array([v for _, _, v in rows], type=TIMESTAMP), "world": [r.world for r in regs_of],
            },
            ctx.attempt,
        ),
        "groups": arrow_table(
            "groups",
            {
                "run_id": [ctx.run_id] * len(groups), "name": list(groups),
                "description": [g.description for g, _ in groups.values()], "ranks": [list(g.ranks) for g, _ in groups.values()],
                "registered": pa.array([v for _, v in groups.values()], type=TIMESTAMP),
            },
            ctx.attempt,
        ),
    }
    if alive:
        parts["runs"] = _runs_row(ctx, run, "running", end_ns=0)
    elif late:  # the world's size may be news too: the ends that came first may be all of it
        _add_ended_row(parts, ctx, run)
    return parts


def _check_register(reg: telemetry_pb2.Register, where: str) -> None:
    """Refuse a registration whose sizes, coordinates or texts the run's rows cannot hold or believe."""
    for what in ("host", "device", "run_name", "agent_version", "world"):
        check_text(f"{where}.{what}", getattr(reg, what))
    check_text(f"{where}.config_json", reg.config_json, MAX_TEXT_CHARS)
    check_range(f"{where}.local_rank", reg.local_rank, -1, reg.world_size - 1)
    for size, coordinate in (("tp", "tp_rank"), ("pp", "pp_rank"), ("dp", "dp_rank")):
        value = getattr(reg, size)
        check_range(f"{where}.{size}", value, 0, min(reg.world_size, MAX_UINT16))  # 0: unknown, taken as 1
        check_range(f"{where}.{coordinate}", getattr(reg, coordinate), -1, max(value, 1) - 1)  # -1: unknown
    check_repeated(f"{where}.groups", reg.groups)


def _check_group(g: telemetry_pb2.Group, world_size: int, where: str) -> None:
    """Refuse a group whose name or members do not fit the registration's world."""
    check_text(f"{where}.name", g.name)
    check_text(f"{where}.description", g.description, MAX_TEXT_CHARS)
    if g.ranks and (min(g.ranks) < 0 or max(g.ranks) >= world_size):  # min and max first: thousands of members
        outside = [r for r in g.ranks if not 0 <= r < world_size][:8]
        raise IngestError(f"{where}: ranks {outside} outside 0 .. {world_size - 1}", "rank")
    check_repeated(f"{where}.ranks", g.ranks, world_size)


def _runs_row(ctx: BatchContext, run: RunInfo, status: str, end_ns: int) -> pa.Table:
    return arrow_table(
        "runs",
        {
            "run_id": [ctx.run_id], "name": [run.name], "start_time": [run.start_ns], "end_time": [end_ns],
            "world_size": [run.world_size], "tp": [run.tp], "pp": [run.pp], "dp": [run.dp],
            "config": [run.config], "status": [status], "updated": [ctx.now_ns],
        },
    )


def decode_end(ctx: BatchContext, msg: telemetry_pb2.EndOfRank, registry: RunRegistry) -> dict[str, pa.Table]:
    """One rank's end, from its own agent: one from an attempt older than the rank's newest is stored
    but ends nothing."""
    run = registry.run(ctx.run_id)
    current = ctx.attempt >= run.attempt(ctx.rank)  # else the end of a process an earlier attempt left behind
    return _exits(ctx, [(ctx.rank, msg, current)], registry, lambda i: "end")


def decode_ends(ctx: BatchContext, msg: telemetry_pb2.EndBatch, registry: RunRegistry) -> dict[str, pa.Table]:
    """Several ranks' ends from one sender (a relay's, or a simulator's), each of its process's attempt
    (``row_ranks``): an end an earlier attempt left behind, replayed from a relay's spool after the
    rank registered again, is stored but ends nothing."""
    _check_several("ends", "end", msg.ends, msg.ranks)
    ranks = row_ranks(ctx, np.asarray(msg.ranks, dtype=np.int64), "ends.ranks").tolist()
    current = np.asarray(ctx.attempts) >= np.array(ctx.run.attempts(ranks))
    return _exits(ctx, [(r, end, bool(now)) for r, end, now in zip(ranks, msg.ends, current)], registry, lambda i: f"ends.ends[{i}]")


def _exits(ctx: BatchContext, ends: list[tuple[int, telemetry_pb2.EndOfRank, bool]], registry: RunRegistry, where: Callable[[int], str]) -> dict[str, pa.Table]:
    """The rows of ``ends`` (rank, its end, whether it ends the rank's current attempt), each checked
    before any is noted; the run's end once every rank of its world has ended."""
    checked = []
    for i, (rank, msg, current) in enumerate(ends):
        if not 0 <= msg.reason < len(EXIT_REASONS):
            known = ", ".join(f"{k}={name}" for k, name in enumerate(EXIT_REASONS))
            raise IngestError(f"{where(i)}.reason: unknown value {msg.reason} (known: {known})", "range")
        check_text(f"{where(i)}.message", msg.message, MAX_TEXT_CHARS)
        checked.append((rank, msg, current, EXIT_REASONS[msg.reason], ctx.time(f"{where(i)}.time_ns", msg.time_ns)))
    run = registry.run(ctx.run_id)
    for rank, _, current, reason, time_ns in checked:
        if current:
            run.exits[rank] = (reason, time_ns)
    parts = {
        "exits": arrow_table(
            "exits",
            {
                "run_id": [ctx.run_id] * len(checked), "rank": [c[0] for c in checked],
                "host": [registry.host(ctx.run_id, c[0]) for c in checked], "time": [c[4] for c in checked],
                "reason": [c[3] for c in checked], "exit_code": [c[1].exit_code for c in checked],
                "signal": [c[1].signal for c in checked], "message": [c[1].message for c in checked],
            },
            ctx.attempts,
        )
    }
    # Re-emitted when a retried last exit is decoded again: runs is a ReplacingMergeTree.
    if any(c[2] for c in checked):
        _add_ended_row(parts, ctx, run)
    return parts


def _add_ended_row(parts: dict[str, pa.Table], ctx: BatchContext, run: RunInfo) -> None:
    """Add the run's ``finished`` or ``failed`` row once every rank of its world has ended, whatever came
    first: a replay (or concurrent calls) can deliver ranks' ends before the registration that says
    how large the world is."""
    if not run.world_size or not all(r in run.exits for r in range(run.world_size)):
        return
    # Ranks past the world's end ran in an earlier, larger attempt: how they ended is history.
    ends = [run.exits[r] for r in range(run.world_size)]
    failed = any(why != EXIT_REASONS[0] for why, _ in ends)
    parts["runs"] = _runs_row(ctx, run, "failed" if failed else "finished", max(t for _, t in ends))


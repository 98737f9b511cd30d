"""Hangs: steps stopped advancing while heartbeats still arrive; which rank is everybody waiting for?

For every process group, the highest sequence number each member has entered (completed
collectives, plus those its last heartbeat shows in flight). A rank blocked in collective n of
group G waits for the members of G that have not entered n yet; a rank blocked in a receive
waits for its sender (and a send for its receiver) when the peer has not posted the matching
operation. Following these edges across tp, pp and dp groups leads to the rank(s) waiting on
nobody: the root of the hang, the rank to look at (its stack dump is requested and attached).

A root that went silent (stopped, frozen) is placed by its own newest stored rows, not by its last
heartbeat: heartbeats come a few seconds apart, spans and collectives as they end, so the last
heartbeat of a rank stopped at step 11 may say "idle at step 8". A stopped rank cannot dump its own
stack; a sibling rank on its host does (``rankscope.agent.stacks.peer_stack``), and that dump is
attached here, matched by host and pid.

At 100,000 ranks every rank waits in something: the pass works on tables, an operation in flight
a row (pandas), and on ranks as arrays, not on a Python object per rank (2.4 s a pass that way).
Roots need no walk: every waiting rank is a start, so the ranks reached are exactly the ranks
waited on, and the roots those of them that wait on nobody.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from rankscope.agent.stacks import STOPPED_PEER
from rankscope.collector.diagnosis.context import RunContext, died_at
from rankscope.collector.diagnosis.detector import FunctionDetector
from rankscope.collector.store.schema import BY_NAME
from rankscope.common.incidents import Finding
from rankscope.common.settings import Settings

# Every rank's latest heartbeat is kept as heartbeats arrive (the ``rank_state`` rollup): a pass
# reads a row per rank, however long the run; the heartbeats of one step through the step index.
#: the kinds of incident this detector names
KINDS = ("hang",)
#: urgent, and the root ranks it names are asked for their stack dumps
DETECTOR = FunctionDetector("hang", KINDS, "urgent", lambda scan: detect(scan.ctx), stack_dumps="hang root")
PROGRESS_SQL = (
    "SELECT max(max_step) AS step, toUnixTimestamp64Nano(max(last_heartbeat)) AS last_heartbeat_ns FROM rank_state "
    "WHERE run_id = {run:String} AND attempt = {attempt:UInt16}"
)
# When each of the last steps heard of was first heard of: the newest step's advance, and the pace of
# the steps before it (heartbeats are sparse: the steps heard of may skip some)
ADVANCED_SQL = (
    "SELECT step, toUnixTimestamp64Nano(min(time)) AS ns FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "AND step BETWEEN {first:UInt32} AND {step:UInt32} GROUP BY step ORDER BY step"
)
#: the steps before the newest that the pace is read over (at most)
PACE_STEPS = 4
#: a stall is a hang once it has lasted ``hang_after_s`` and this many steps of the pace before it
STALL_STEPS = 2.0
STATE_SQL = (
    "SELECT rank, toUnixTimestamp64Nano(max(last_heartbeat)) AS time_ns, toUnixTimestamp64Nano(argMaxMerge(last_progress)) AS progress_ns, "
    "argMaxMerge(latest_step) AS step, argMaxMerge(phase) AS phase, "
    "argMaxMerge(inflight_group) AS groups, argMaxMerge(inflight_seq) AS seqs, argMaxMerge(inflight_op) AS ops, "
    "argMaxMerge(inflight_peer) AS peers, argMaxMerge(inflight_waiting) AS waiting "
    "FROM rank_state WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank"
)
# Only the groups somebody waits in (all others are never looked at), from the ``entered`` rollup
# (kept as collectives arrive, the direction of a point-to-point operation by ``_direction``'s
# rule): a run's collectives are millions of rows at scale.
ENTERED_SQL = (
    "SELECT rank, group_name, peer, sends, max(seq) AS seq FROM entered "
    "WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND group_name IN {groups:Array(String)} GROUP BY rank, group_name, peer, sends"
)
# Of ``ranks``, those that went without a heartbeat for longer than ``gap`` between two of theirs since ``since`` (ns)
GAPS_SQL = (
    "SELECT rank FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND time >= fromUnixTimestamp64Nano({since:Int64}) "
    "AND rank IN {ranks:Array(UInt32)} GROUP BY rank HAVING arrayMax(arrayDifference(arraySort(groupArray(toUnixTimestamp64Nano(time))))) > {gap:Int64}"
)
EXITS_SQL = "SELECT rank, toUnixTimestamp64Nano(min(time)) AS time_ns FROM exits WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank"
EVIDENCE_SQL = (
    "SELECT rank, max(time) AS last_heartbeat, argMax(step, time) AS step, argMax(phase, time) AS phase, "
    "argMax(arrayZip(inflight_group, inflight_seq, inflight_op, inflight_peer, inflight_waiting), time) AS in_flight "
    "FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank ORDER BY rank"
)
# A silent root's newest stored span (by its end) and collective (by when it was issued, pending or not).
LAST_SPAN_SQL = (
    "SELECT rank, argMax(name, end_time) AS name, argMax(step, end_time) AS step, toUnixTimestamp64Nano(max(end_time)) AS time_ns "
    "FROM spans WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND rank IN {ranks:Array(UInt32)} GROUP BY rank"
)
LAST_COLLECTIVE_SQL = (
    "SELECT rank, argMax(op, issue_time) AS op, argMax(group_name, issue_time) AS group_name, argMax(seq, issue_time) AS seq, "
    "argMax(step, issue_time) AS step, argMax(toUnixTimestamp64Nano(end_time), issue_time) = 0 AS pending, "
    "toUnixTimestamp64Nano(max(issue_time)) AS time_ns "
    "FROM collectives WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND rank IN {ranks:Array(UInt32)} GROUP BY rank"
)
# Dumps a sibling took of a stopped process on its host, since the stall; the ranks' pids to match them.
PEER_STACKS_SQL = (
    "SELECT rank, host, reason, method, text FROM stacks WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "AND startsWith(reason, {prefix:String}) AND time >= fromUnixTimestamp64Nano({since:Int64}) ORDER BY time"
)
PIDS_SQL = (
    "SELECT rank, argMax(pid, registered) AS pid, argMax(host, registered) AS host FROM ranks "
    "WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND rank IN {ranks:Array(UInt32)} GROUP BY rank"
)

#: roots named one by one in a summary; the evidence lists all of them
MAX_NAMED = 8
#: waiting ranks the evidence details (what each waits for and in): all of them up to this many,
#: else those waiting on a root directly; at 100,000 ranks the rest would be megabytes in every version
EVIDENCE_RANKS = 64
#: a rank is heard as stuck when its heartbeat says nothing ended for this long (or a quarter of hang-after)
QUIET_S = 5.0
#: a stall whose roots are all inside operations every member entered, while each root's host moves at
#: least ``MOVING_BYTES_S`` over the network, is a transfer in progress (a slow link), named a hang only
#: once it has lasted this many times as long as a stall must (``stall_after_ns``)
MOVING_FACTOR = 3.0
#: bytes a second (sent and received, every interface but loopback) a host moves while its transfer is alive
MOVING_BYTES_S = 128 * 1024
#: the host network counters a stall's roots' hosts report (``metrics``, every few seconds, cumulative)
MOVED_SQL = (
    "SELECT host, rank, device, name, toUnixTimestamp64Nano(time) AS ns, value FROM metrics WHERE run_id = {run:String} "
    "AND attempt = {attempt:UInt16} AND name IN ('system.network.io.receive', 'system.network.io.transmit') "
    "AND host IN {hosts:Array(String)} AND time >= fromUnixTimestamp64Nano({since:Int64}) ORDER BY ns"
)
#: what a pass keeps in ``ctx.seen`` of the stall it named: a ``Named``
NAMED = "hang.named"


class Named(NamedTuple):
    """The stall a pass named last: its start, each root's last progress as that pass read it, and when
    a root was first seen working again (``_resuming``; kept while the same stall is named again)."""

    advanced: int
    progress_ns: dict[int, int]
    resumed_ns: int | None = None


class Wait(NamedTuple):
    """A rank blocked in an operation: collective ``seq`` of ``group``, or a point-to-point with ``peer``."""

    group: str
    seq: int
    op: str
    peer: int


# What a pass reads as of a moment (``RunContext.until_ns``, the postmortem's replay of a stall): each
# table's rows recorded by then, each rollup made again from those rows by its own view.
_AS_OF = {"heartbeats": "time", "exits": "time", "spans": "end_time", "collectives": "issue_time", "stacks": "time", "metrics": "time"}
_ROLLUPS = {"rank_state": "heartbeats", "entered": "collectives"}
_TABLE = re.compile(r"\bFROM (" + "|".join([*_AS_OF, *_ROLLUPS]) + r")\b")


def as_of(sql: str) -> str:
    """``sql`` reading what was recorded by ``{until:Int64}`` (ns) only."""

    def rows(table: str) -> str:
        return (f"(SELECT * FROM {table} WHERE run_id = {{run:String}} AND {_AS_OF[table]} <= "
                "fromUnixTimestamp64Nano({until:Int64}))")  # fmt: skip

    def bounded(match: re.Match[str]) -> str:
        table = match.group(1)
        if table in _ROLLUPS:
            return f"FROM ({BY_NAME[table].view.format(source=rows(_ROLLUPS[table]))}) AS {table}"
        return f"FROM {rows(table)} AS {table}"

    return _TABLE.sub(bounded, sql)


def detect(ctx: RunContext) -> list[Finding]:
    if ctx.until_ns is not None:  # a replayed moment: every query reads what was recorded by then
        whole, until = ctx, ctx.until_ns
        ctx = replace(ctx, query=lambda sql, params: whole.query(as_of(sql), {**params, "until": until}))
    s = ctx.settings
    progress = ctx.query(PROGRESS_SQL, {"run": ctx.run_id}).to_pylist()
    if not progress or progress[0]["step"] is None or not progress[0]["last_heartbeat_ns"]:
        return []
    step, last_heartbeat = int(progress[0]["step"]), int(progress[0]["last_heartbeat_ns"])
    steps_heard = ctx.query(ADVANCED_SQL, {"run": ctx.run_id, "first": max(0, step - PACE_STEPS), "step": step}).to_pydict()
    began = dict(zip(steps_heard["step"], steps_heard["ns"]))
    advanced = int(began.get(step) or last_heartbeat)
    prior = max((b for b in began if b < step and began[b]), default=None)
    after_ns = stall_after_ns(s, step, began.get(step), None if prior is None else (prior, began[prior]))
    if last_heartbeat - advanced < after_ns:
        return []
    st = _States(ctx.query(STATE_SQL, {"run": ctx.run_id}))
    quiet_ns = min(QUIET_S, s.hang_after_s / 4) * 1e9
    quiet = st.time_ns - st.progress_ns >= quiet_ns
    alive = (last_heartbeat - st.time_ns) / 1e9 < s.silent_after_s
    alive &= ~_silent_in_stall(ctx, st, alive & quiet, alive, advanced)
    # What a rank said before the stall, or while it was still making progress, is no evidence of
    # where it is stuck: at scale heartbeats are sparse (a minute apart) and the stalled ranks
    # report one by one. Only the ranks heard from since the stall, quiet for a while by their own
    # account (no span or collective ended), wait or can be named; the others are not heard yet.
    since_stall = alive & (st.time_ns > advanced)
    heard, moving = since_stall & quiet, since_stall & ~quiet
    waits = _waits(st, heard)
    entered = _entered(ctx, st, sorted({st.names[g] for g in np.unique(waits["group"])}))
    edges = pd.concat([_collective_edges(ctx, st, waits, entered, st.rank[~alive]), _p2p_edges(waits, entered)]).drop_duplicates()
    waiting = np.unique(edges["rank"].to_numpy())
    reached = np.unique(edges["on"].to_numpy())
    found = np.setdiff1d(reached, waiting)  # waited on, waiting on nobody
    roots = {int(r) for r in (found if found.size or not reached.size else reached)}  # none: a cycle, all of it
    # A rank waited on that works again (heard since the stall, progress by its own account) will
    # enter what the others wait in: the stall is ending, as a frozen host's ranks resume one by one
    # (seed 555533734: the host thawed, its rank 2 moving, its rank 3 not yet, was named alone).
    if any(moving[st.row[r]] for r in roots if r in st.row) or _resuming(ctx, st, advanced, last_heartbeat):
        return []
    # A root gone silent while the others wait on it (no exit came) stopped answering: a frozen
    # process or host, or one cut off the network. A rank not heard since the stall but not
    # silent may be blocked too: its report is not in yet.
    silent = {r for r in roots if r in st.row and not alive[st.row[r]]}
    silent |= _silent_host_mates(ctx, st, alive, silent)
    if silent:
        exits = {r["rank"]: r["time_ns"] for r in ctx.query(EXITS_SQL, {"run": ctx.run_id}).to_pylist()}
        if silent & set(exits) or died_at(min(int(st.time_ns[st.row[r]]) for r in silent), exits.values(), s):
            return []  # a root that ended or died is a crash or a lost host (the crash detector's)
    # A root heard again without moving that went silent for longer than silent_after in the stall was
    # stopped through it (a frozen rank thawed as its job is torn down): as silent as one not heard again
    # (campaign seed 104460427: rank 0 frozen, its tp peer named beside it once it was heard again).
    thawed = _gapped(ctx, sorted(r for r in roots if r in st.row and heard[st.row[r]]), advanced)
    silent |= thawed
    roots = {r for r in roots if r in st.row and heard[st.row[r]] and not _beside_silent(ctx, r, silent)} | silent
    if not roots:
        return []
    moving = {} if silent else _moving_bytes(ctx, st, waits, roots, advanced)
    if moving and last_heartbeat - advanced < MOVING_FACTOR * after_ns:
        return []
    root_list = sorted(roots)
    on_roots = edges[edges["on"].isin(root_list)]
    direct = np.unique(on_roots["rank"].to_numpy())
    at = {r: f"in {st.phase(r)} at step {st.step(r)}" for r in root_list[:MAX_NAMED]}
    at.update(_where_stopped(ctx, st, sorted(silent & set(at)), min((st.step(int(r)) for r in direct), default=0)))
    where = ", ".join(f"{ctx.who(r)} {at[r]}" for r in at)
    if len(root_list) > MAX_NAMED:
        where += f" and {len(root_list) - MAX_NAMED} more ranks"
    # Where the ranks waiting directly on a root are blocked: the operations the root never entered.
    in_direct = waits[waits["rank"].isin(direct)][["group", "seq"]].drop_duplicates()
    blocked_in = sorted(f"{st.names[g]} #{q}" for g, q in zip(in_direct["group"], in_direct["seq"]))[:6]
    what = "is" if len(root_list) == 1 else "are"
    hosts = ctx.whole_hosts(silent)
    if len(hosts) == 1 and silent == roots:  # a whole host stopped answering: name the host
        (host,) = hosts
        where = f"host {host} ({', '.join(f'rank {r} {at[r]}' for r in at)})"
        what = "is"
    state = "not in any collective the others wait in"
    if silent - thawed:
        quiet_s = (last_heartbeat - max(int(st.time_ns[st.row[r]]) for r in silent - thawed)) / 1e9
        state = f"silent for {quiet_s:.0f} s (frozen, stopped or cut off)"  # inside what the others wait in, or not
    elif silent:
        state = f"silent for over {s.silent_after_s:.0f} s in the stall (frozen or stopped), heard again without moving"
    summary = (
        f"hang: {where} {what} {state}; {len(waiting)} rank{'s' if len(waiting) != 1 else ''} wait on "
        f"{'it' if len(root_list) == 1 else 'them'} ({', '.join(blocked_in)}) since step {step}"
    )
    shown = [int(r) for r in (waiting if len(waiting) <= EVIDENCE_RANKS else direct[:EVIDENCE_RANKS])]
    evidence = {
        "step": step,
        "stalled_for_s": round((last_heartbeat - advanced) / 1e9, 1),
        "roots": root_list,
        "waiting": len(waiting),
        "waiting_on_roots": len(direct),
        "waits_for": _waits_for(edges, shown),
        "blocked_in": _blocked_in(st, waits, shown),
        "root_phase": {str(r): st.phase(r) for r in root_list},
        "silent_roots": sorted(silent),
        "not_heard_since_stall": int(alive.sum() - heard.sum()),
    }
    if moving:
        evidence["hosts_moving_bytes_s"] = moving
        summary += (f"; inside operations every member entered for {(last_heartbeat - advanced) / 1e9:.0f} s while their hosts "
                    f"still move {min(moving.values()) / 1e6:.2f} MB/s or more (a transfer stuck or very slow)")  # fmt: skip
    before = ctx.seen.get(NAMED)
    progress_ns = {r: int(st.progress_ns[st.row[r]]) for r in root_list if r in st.row}
    ctx.seen[NAMED] = Named(advanced, progress_ns, before.resumed_ns if before and before.advanced == advanced else None)
    stacks = _peer_stacks(ctx, sorted(silent), advanced)
    if stacks:  # beside the root's own dumps (``stacks``, attached by the engine: a stopped rank's are from before it stopped)
        evidence["stacks_from_outside"] = stacks
        taken = ", ".join(f"rank {r}'s by rank {d['taken_by']}" for r, d in stacks.items())
        summary += f"; stack taken from outside ({taken})"
    return [
        Finding(
            kind="hang",
            key="hang",
            severity="critical",
            ranks=tuple(root_list),
            hosts=ctx.hosts_of(root_list),
            first_seen_ns=advanced,
            last_seen_ns=last_heartbeat,
            summary=summary,
            evidence=evidence,
            sql=ctx.literal_sql(EVIDENCE_SQL),
        )
    ]


def stall_after_ns(s: Settings, step: int, began_ns: int | None, prior: tuple[int, int] | None) -> int:
    """How long step ``step``'s stall must last to be a hang: ``hang_after_s``, and ``STALL_STEPS`` steps
    at the pace before it (``began_ns``: when ``step`` was first heard of; ``prior``: the last step heard
    of before it, and when). A job whose steps all outlast hang_after is slow, not hung (seed 739796868:
    a host's link at 12 Mbit/s, every step 14 s, a hang of the ranks in their gradient all-reduce named
    11 s into each with hang_after at 10 s; the postmortem's moments fell outside, and it named none).
    Before the first step (step 0) a stall must last ``hang_first_step_factor`` times hang_after: start-up;
    and so must one in the first step with no pace before it: some ranks in step 1 wait for one still
    starting (CI of 4829125: a pipeline's rank 0 "idle at step 0" on a starved machine, its first step 18 s,
    named hung after 10 s)."""
    if step <= 0:  # the agent's start, before any rank of this attempt reached step 1
        return int(s.hang_after_s * s.hang_first_step_factor * 1e9)
    if prior is None or prior[0] <= 0 or not began_ns:
        return int(s.hang_after_s * (s.hang_first_step_factor if step <= 1 else 1.0) * 1e9)
    pace = (began_ns - prior[1]) / (step - prior[0])
    return int(max(s.hang_after_s * 1e9, STALL_STEPS * pace))


def _moving_bytes(ctx: RunContext, st: _States, waits: pd.DataFrame, roots: set[int], advanced: int) -> dict[str, float]:
    """host -> bytes a second it moved during the stall, when every root is blocked inside an operation
    that every member (or its peer) entered and each root's host moved at least ``MOVING_BYTES_S``
    between its two newest network readings since the stall began; else {}. Such roots wait on nobody
    because their data is still on the wire: a host's link at 9 Mbit/s made the first slow step 17 s,
    its ranks inside their gradient all-reduce named hung 10 s in, live only (campaign seed 1880171644).
    A link that is down moves nothing, and is named at once."""
    blocked = set(waits["rank"].to_numpy().tolist())
    if not roots <= blocked:
        return {}
    hosts = sorted(ctx.hosts_of(sorted(roots)))
    if not hosts:
        return {}
    rows = ctx.query(MOVED_SQL, {"run": ctx.run_id, "hosts": hosts, "since": advanced}).to_pylist()
    readings: dict[tuple[str, int, str, str], list[tuple[int, float]]] = {}  # a counter's readings, oldest first
    for row in rows:
        readings.setdefault((row["host"], row["rank"], row["device"], row["name"]), []).append((row["ns"], row["value"]))
    by_reporter: dict[tuple[str, int], float] = {}  # (host, the rank that reports it) -> its counters' rates summed
    for (host, rank, _, _), series in readings.items():
        if len(series) >= 2 and series[-1][0] > series[-2][0]:
            (t0, v0), (t1, v1) = series[-2:]
            by_reporter[host, rank] = by_reporter.get((host, rank), 0.0) + max(v1 - v0, 0.0) * 1e9 / (t1 - t0)
    moving = {host: max((rate for (h, _), rate in by_reporter.items() if h == host), default=0.0) for host in hosts}
    return {host: round(rate) for host, rate in moving.items()} if all(r >= MOVING_BYTES_S for r in moving.values()) else {}


def _silent_host_mates(ctx: RunContext, st: _States, alive: np.ndarray, silent: set[int]) -> set[int]:
    """The other ranks of a silent root's host that went silent within ``silent_after_s`` of it: the host
    stopped, whether or not anyone is seen to wait on them (campaign seed 365879949: node0 of a 2 x 2
    FSDP2 mesh frozen, rank 2 waiting on its tensor-parallel peer, which waited on rank 1; node0's rank 0,
    waited on by nobody, was named lost beside a hang of rank 1 alone)."""
    gap_ns = ctx.settings.silent_after_s * 1e9
    mates: set[int] = set()
    for host in ctx.hosts_of(sorted(silent)):
        went_quiet = min(int(st.time_ns[st.row[r]]) for r in silent if ctx.host.get(r) == host)
        mates.update(r for r in ctx.ranks_of_host.get(host, ()) if r not in silent and r in st.row and not alive[st.row[r]]
                     and abs(int(st.time_ns[st.row[r]]) - went_quiet) < gap_ns)  # fmt: skip
    return mates


def _beside_silent(ctx: RunContext, rank: int, silent: set[int]) -> bool:
    """Whether ``rank`` (heard, quiet, in no collective by its own account) shares a tensor- or
    pipeline-parallel group with a silent root: it waits on that one in a collective no wrapper saw, of
    which the flight recorder tells only later (DTensor's functional collectives). Replayed, campaign seed
    769188504 (FSDP2 with DTensor, rank 0 frozen) named rank 1 beside it, blocked in their tp all-reduce."""
    index = ctx.group_index
    return any(not silent.isdisjoint(index.small[g]) for g in index.groups_of.get(rank, ()))


def _silent_in_stall(ctx: RunContext, st: _States, heard: np.ndarray, alive: np.ndarray, advanced: int) -> np.ndarray:
    """Of the ranks ``heard`` (heard lately, quiet) on a host with a rank silent now, those silent for longer
    than ``silent_after_s`` since the stall began and not moving since: stopped through the stall with their
    host (frozen), as silent as their host-mate not heard again yet. A frozen host thaws a rank at a time,
    each still where it froze; heard again first, one would be a waiter on its host-mate, named alone
    (seed 1529690754: node0 frozen inside an all-reduce both its ranks had entered, rank 1's one heartbeat
    after the thaw, and the postmortem, judging a moment after it, named rank 0 alone where the live
    diagnosis had named the host). Only such ranks' heartbeats are read: a stall of minutes at 100,000
    ranks is millions of rows, and sparse heartbeats (a rank's first comes seconds into a run) are no gap."""
    hosts = {ctx.host.get(int(r)) for r in st.rank[~alive]} - {None}
    mates = [r for h in hosts for r in ctx.ranks_of_host.get(h, [])]
    candidates = st.rank[heard & np.isin(st.rank, mates)].tolist()
    out = np.zeros(len(st.rank), dtype=bool)
    if not candidates:
        return out
    out[[st.row[r] for r in _gapped(ctx, candidates, advanced) if r in st.row]] = True
    return out


def _gapped(ctx: RunContext, ranks: list[int], advanced: int) -> set[int]:
    """Of ``ranks``, those that went longer than ``silent_after_s`` between two of their own heartbeats since
    the stall began (``advanced``; a gap that began up to silent_after before it counts)."""
    if not ranks:
        return set()
    gap_ns = int(ctx.settings.silent_after_s * 1e9)
    return set(ctx.query(GAPS_SQL, {"run": ctx.run_id, "since": advanced - gap_ns, "gap": gap_ns, "ranks": ranks})["rank"].to_pylist())


def _resuming(ctx: RunContext, st: _States, advanced: int, now_ns: int) -> bool:
    """Whether a rank this stall was pinned on before works again (progress by its own account later
    than when the pass that named it read it): the stall is ending, as a frozen host's ranks resume one
    by one, and the one that resumed first may have entered what the others wait in already, leaving
    its host-mate the only rank waited on (seed 555533734 again: rank 2 named alone at the thaw). Its
    own progress, not the pass's newest heartbeat, is the mark: the heartbeat that says it resumed may
    be stored after a pass that read the others' later ones (campaign seed 1608066736, a collector
    behind at load 10: the host named, then its rank 3 alone). For ``hang_after_s`` from then no rank
    is named for this stall; one still waited on after that is."""
    named = ctx.seen.get(NAMED)
    if named is None or named.advanced != advanced:
        return False
    if not any(r in st.row and st.progress_ns[st.row[r]] > then for r, then in named.progress_ns.items()):
        return False
    if named.resumed_ns is None:
        named = ctx.seen[NAMED] = named._replace(resumed_ns=now_ns)
    return now_ns - named.resumed_ns < ctx.settings.hang_after_s * 1e9


def _where_stopped(ctx: RunContext, st: _States, ranks: list[int], waiting_step: int) -> dict[int, str]:
    """Where each silent rank stopped: in the step its waiters are in (it reached the collectives they
    completed with it), or later by its own newest stored span or collective. Its last heartbeat can be
    many steps older (heartbeats are seconds apart, sent behind the rows), its rows a flush older."""
    if not ranks:
        return {}
    spans = {r["rank"]: r for r in ctx.query(LAST_SPAN_SQL, {"run": ctx.run_id, "ranks": ranks}).to_pylist()}
    collectives = {r["rank"]: r for r in ctx.query(LAST_COLLECTIVE_SQL, {"run": ctx.run_id, "ranks": ranks}).to_pylist()}
    out = {}
    for r in ranks:
        span, op = spans.get(r), collectives.get(r)
        rows = []
        if span is not None:
            rows.append((span["time_ns"], span["step"], f"its last stored span: {span['name']} of step {span['step']}"))
        if op is not None:
            state = "in flight" if op["pending"] else "entered"
            rows.append((op["time_ns"], op["step"], f"its last stored collective: {op['op']} {op['group_name']} #{op['seq']} of step {op['step']}, {state}"))
        newest = max(rows, default=None)
        step = max(waiting_step, st.step(r), newest[1] if newest else 0)
        said = [newest[2]] if newest else []
        out[r] = f"in step {step} ({'; '.join([*said, f'its last heartbeat: {st.phase(r)} at step {st.step(r)}'])})"
    return out


def _peer_stacks(ctx: RunContext, ranks: list[int], since_ns: int) -> dict[str, dict[str, object]]:
    """The newest dump of each silent rank a sibling on its host took since ``since_ns``, by rank."""
    if not ranks:
        return {}
    dumps = ctx.query(PEER_STACKS_SQL, {"run": ctx.run_id, "prefix": STOPPED_PEER, "since": since_ns}).to_pylist()
    if not dumps:
        return {}
    by_pid = {(r["host"], f"{STOPPED_PEER}{r['pid']}"): r["rank"] for r in ctx.query(PIDS_SQL, {"run": ctx.run_id, "ranks": ranks}).to_pylist()}
    out: dict[str, dict[str, object]] = {}
    for d in dumps:  # oldest first: the newest of a rank is kept
        rank = by_pid.get((d["host"], d["reason"]))
        if rank is not None:
            out[str(rank)] = {"method": d["method"], "text": d["text"], "taken_by": d["rank"]}
    return out


class _States:
    """Every rank's newest state (a row per rank: ``row`` maps a rank to it) and every operation in
    flight (``ops``: a row each, with its rank's row, its group's code in ``names`` and its direction)."""

    IN_FLIGHT = ("groups", "seqs", "ops", "peers", "waiting")

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.rank = table["rank"].to_numpy()
        self.row = {int(r): i for i, r in enumerate(self.rank)}
        self.time_ns = table["time_ns"].fill_null(0).to_numpy().astype(np.int64)
        self.progress_ns = table["progress_ns"].fill_null(0).to_numpy().astype(np.int64)
        self.names: list[str] = []
        self._codes: dict[str, int] = {}
        lists = [table[c].combine_chunks() for c in self.IN_FLIGHT]
        own = [pc.list_value_length(x).fill_null(0).to_numpy() for x in lists]
        # the lists of a row go together; a row whose lists differ in length keeps what all of them have
        lengths = np.min(own, axis=0)
        flat = []
        for x, n in zip(lists, own):
            position = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
            flat.append(pc.list_flatten(x).filter(pa.array(position < np.repeat(lengths, n))))
        groups, seqs, ops, peers, waiting = flat
        op_codes = pc.dictionary_encode(ops)
        sends = np.array([_direction(op) == "send" for op in op_codes.dictionary.to_pylist()], dtype=bool)
        self.ops = pd.DataFrame({
            "row": np.repeat(np.arange(len(self.rank)), lengths),
            "group": self.codes(groups),
            "seq": seqs.to_numpy(zero_copy_only=False).astype(np.int64),
            "op": op_codes.indices.to_numpy(zero_copy_only=False),
            "peer": peers.to_numpy(zero_copy_only=False).astype(np.int64),
            "waiting": waiting.to_numpy(zero_copy_only=False).astype(bool),
            "sends": sends[op_codes.indices.to_numpy(zero_copy_only=False)] if len(sends) else np.zeros(0, dtype=bool),
        })  # fmt: skip
        self.ops["rank"] = self.rank[self.ops["row"].to_numpy()]
        self.op_names = op_codes.dictionary.to_pylist()

    def codes(self, names: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Each name's code (new names get the next ones)."""
        encoded = pc.dictionary_encode(names.combine_chunks() if isinstance(names, pa.ChunkedArray) else names)
        lookup = np.array([self._code(n) for n in encoded.dictionary.to_pylist()], dtype=np.int64)
        return lookup[encoded.indices.to_numpy(zero_copy_only=False)] if len(lookup) else np.zeros(len(names), dtype=np.int64)

    def _code(self, name: str) -> int:
        if name not in self._codes:
            self._codes[name] = len(self.names)
            self.names.append(name)
        return self._codes[name]

    def phase(self, rank: int) -> str:
        return self.table["phase"][self.row[rank]].as_py()

    def step(self, rank: int) -> int:
        return self.table["step"][self.row[rank]].as_py()


def _waits(st: _States, heard: np.ndarray) -> pd.DataFrame:
    """What each quiet rank is blocked in: the operations its thread waits in, or, when the agent saw
    it wait in none, every operation it has in flight. DDP's reducer waits for its gradient
    all-reduces in C++, and on a GPU the thread blocks later, in a synchronisation: either way
    none of those operations completed while the rank made no progress."""
    ops = st.ops[heard[st.ops["row"].to_numpy()]]
    some_waiting = ops.groupby("row")["waiting"].transform("any")
    return ops[ops["waiting"] | ~some_waiting]


def _entered(ctx: RunContext, st: _States, groups: list[str]) -> pd.DataFrame:
    """Highest sequence entered per (rank, group, peer, sends): peer -1 (and sends False) for a
    collective, the peer and direction for a point-to-point. From the store for ``groups`` only
    (those waited in); in flight, for every group."""
    rows = ctx.query(ENTERED_SQL, {"run": ctx.run_id, "groups": groups})
    stored = pd.DataFrame({
        "rank": rows["rank"].to_numpy().astype(np.int64), "group": st.codes(rows["group_name"]),
        "peer": rows["peer"].to_numpy().astype(np.int64), "sends": rows["sends"].to_numpy().astype(bool),
        "seq": rows["seq"].to_numpy().astype(np.int64),
    })  # fmt: skip
    both = pd.concat([stored, st.ops[["rank", "group", "peer", "sends", "seq"]]], ignore_index=True)
    both.loc[both["peer"] < 0, "sends"] = False
    return both.groupby(["rank", "group", "peer", "sends"], as_index=False)["seq"].max()


def _collective_edges(
    ctx: RunContext, st: _States, waits: pd.DataFrame, entered: pd.DataFrame, silent: np.ndarray
) -> pd.DataFrame:  # fmt: skip
    """(rank, on): a rank blocked in collective n of a group waits on the members that have not entered n,
    and on the ``silent`` ones, entered or not: a frozen member's part of n never comes. Its row of n is
    stored once it resumes, so live before that row and offline after it tell the same (seeds 111028093:
    rank 2 stopped inside DDP's all-reduce; 87878808: rank 3 inside a TP all-reduce, its peer rank 2,
    waited on in other groups, named beside it offline)."""
    blocked = waits[waits["peer"] < 0][["rank", "group", "seq"]]
    keys = blocked[["group", "seq"]].drop_duplicates()
    codes = np.unique(keys["group"].to_numpy())
    sizes = [len(ctx.groups.get(st.names[g], ())) for g in codes]
    members = pd.DataFrame({
        "group": np.repeat(codes, sizes),
        "on": np.fromiter((m for g in codes for m in ctx.groups.get(st.names[g], ())), dtype=np.int64, count=sum(sizes)),
    })  # fmt: skip
    has = entered[entered["peer"] < 0][["rank", "group", "seq"]].rename(columns={"rank": "on", "seq": "has"})
    behind = keys.merge(members, on="group").merge(has, on=["on", "group"], how="left")
    late = (behind["has"].fillna(0).to_numpy() < behind["seq"].to_numpy()) | behind["on"].isin(silent).to_numpy()
    behind = behind[late][["group", "seq", "on"]]
    edges = blocked.merge(behind, on=["group", "seq"])
    return edges[edges["rank"] != edges["on"]][["rank", "on"]]


def _p2p_edges(waits: pd.DataFrame, entered: pd.DataFrame) -> pd.DataFrame:
    """(rank, on): a rank blocked in a send waits on its receiver, a receive on its sender, until the
    peer has posted the matching operation (sequence numbers count per direction and pair)."""
    blocked = waits[waits["peer"] >= 0][["rank", "group", "seq", "peer", "sends"]].assign(opposite=lambda w: ~w["sends"])
    posted = entered[entered["peer"] >= 0].rename(columns={"rank": "peer", "peer": "rank", "sends": "opposite", "seq": "has"})
    joined = blocked.merge(posted, on=["peer", "group", "rank", "opposite"], how="left")
    late = joined[joined["has"].fillna(0).to_numpy() < joined["seq"].to_numpy()]
    return late[["rank", "peer"]].rename(columns={"peer": "on"})


def _waits_for(edges: pd.DataFrame, ranks: list[int]) -> dict[str, list[int]]:
    some = edges[edges["rank"].isin(ranks)]
    out = {str(r): [] for r in ranks}
    for r, on in some.groupby("rank")["on"]:
        out[str(r)] = sorted(int(x) for x in on)
    return out


def _blocked_in(st: _States, waits: pd.DataFrame, ranks: list[int]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {str(r): [] for r in ranks}
    for w in waits[waits["rank"].isin(ranks)].itertuples():
        out[str(w.rank)].append(f"{st.op_names[w.op]} {st.names[w.group]} #{w.seq}" + (f" peer {w.peer}" if w.peer >= 0 else ""))
    return out


def _direction(op: str) -> str:
    return "send" if "send" in op.rsplit(":", 1)[-1] else "recv"

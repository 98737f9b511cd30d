"""Hangs: steps stopped advancing while heartbeats still arrive; which rank is everybody waiting for?

For every process group, the highest sequence number each member has entered (completed
collectives, plus those its last heartbeat shows in flight). A rank blocked in collective n of
group G waits for the members of G that have not entered n yet; a rank blocked in a receive
waits for its sender (and a send for its receiver) when the peer has not posted the matching
operation. Following these edges across tp, pp and dp groups leads to the rank(s) waiting on
nobody: the root of the hang, the rank to look at (its stack dump is requested and attached).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from rankscope.collector.diagnosis.context import RunContext, died_at
from rankscope.collector.diagnosis.incidents import Finding

# Every rank's latest heartbeat is kept as heartbeats arrive (the ``rank_state`` rollup): a pass
# reads a row per rank, however long the run; the heartbeats of one step through the step index.
PROGRESS_SQL = (
    "SELECT max(max_step) AS step, toUnixTimestamp64Nano(max(last_heartbeat)) AS last_heartbeat_ns FROM rank_state "
    "WHERE run_id = {run:String} AND attempt = {attempt:UInt16}"
)
ADVANCED_SQL = (
    "SELECT toUnixTimestamp64Nano(min(time)) AS ns FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step = {step:UInt32}"
)
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
EXITS_SQL = "SELECT rank, toUnixTimestamp64Nano(min(time)) AS time_ns FROM exits WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank"
EVIDENCE_SQL = (
    "SELECT rank, max(time) AS last_heartbeat, argMax(step, time) AS step, argMax(phase, time) AS phase, "
    "argMax(arrayZip(inflight_group, inflight_seq, inflight_op, inflight_peer, inflight_waiting), time) AS in_flight "
    "FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank ORDER BY rank"
)

#: roots named one by one in a summary; the evidence lists all of them
MAX_NAMED = 8
#: waiting ranks the evidence details (what each waits for and in): all of them up to this many,
#: else those waiting on a root directly; at 100,000 ranks the rest would be megabytes in every version
EVIDENCE_RANKS = 64
#: a rank is heard as stuck when its heartbeat says nothing ended for this long (or a quarter of hang-after)
QUIET_S = 5.0


class Wait(NamedTuple):
    """A rank blocked in an operation: collective ``seq`` of ``group``, or a point-to-point with ``peer``."""

    group: str
    seq: int
    op: str
    peer: int


def detect(ctx: RunContext) -> list[Finding]:
    s = ctx.settings
    progress = ctx.query(PROGRESS_SQL, {"run": ctx.run_id}).to_pylist()
    if not progress or progress[0]["step"] is None or not progress[0]["last_heartbeat_ns"]:
        return []
    step, last_heartbeat = int(progress[0]["step"]), int(progress[0]["last_heartbeat_ns"])
    advanced = int(ctx.query(ADVANCED_SQL, {"run": ctx.run_id, "step": step}).to_pylist()[0]["ns"] or last_heartbeat)
    if (last_heartbeat - advanced) / 1e9 < s.hang_after_s:
        return []
    states = {r["rank"]: r for r in ctx.query(STATE_SQL, {"run": ctx.run_id}).to_pylist()}
    alive = {r for r, st in states.items() if (last_heartbeat - st["time_ns"]) / 1e9 < s.silent_after_s}
    # What a rank said before the stall, or while it was still making progress, is no evidence of
    # where it is stuck: at scale heartbeats are sparse (a minute apart) and the stalled ranks
    # report one by one. Only the ranks heard from since the stall, quiet for a while by their own
    # account (no span or collective ended), wait or can be named; the others are not heard yet.
    quiet_ns = min(QUIET_S, s.hang_after_s / 4) * 1e9
    heard = {r for r in alive if states[r]["time_ns"] > advanced and states[r]["time_ns"] - states[r]["progress_ns"] >= quiet_ns}
    waits = {r: _waits(states[r]) for r in heard}
    entered = _entered(ctx, states, sorted({w.group for ws in waits.values() for w in ws}))
    behind: dict[tuple[str, int], set[int]] = {}  # shared: thousands of ranks wait in the same collective
    edges = {r: _blockers(ctx, r, ws, entered, behind) for r, ws in waits.items()}
    roots = _roots(edges)
    # A root gone silent while the others wait on it (no exit came) stopped answering: a frozen
    # process or host, or one cut off the network. A rank not heard since the stall but not
    # silent may be blocked too: its report is not in yet.
    silent = {r for r in roots - alive if r in states}
    if silent:
        exits = {r["rank"]: r["time_ns"] for r in ctx.query(EXITS_SQL, {"run": ctx.run_id}).to_pylist()}
        if silent & set(exits) or died_at(min(states[r]["time_ns"] for r in silent), exits.values(), s):
            return []  # a root that ended or died is a crash or a lost host (the crash detector's)
    roots = (roots & heard) | silent
    if not roots:
        return []
    waiting = sorted(r for r, out in edges.items() if out)
    direct = [r for r in waiting if edges[r] & roots]
    root_list = sorted(roots)
    at = {r: f"in {states[r]['phase']} at step {states[r]['step']}" for r in root_list[:MAX_NAMED]}
    where = ", ".join(f"{ctx.who(r)} {at[r]}" for r in at)
    if len(root_list) > MAX_NAMED:
        where += f" and {len(root_list) - MAX_NAMED} more ranks"
    # Where the ranks waiting directly on a root are blocked: the operations the root never entered.
    blocked_in = sorted({f"{w.group} #{w.seq}" for r in direct for w in waits[r]})[:6]
    what = "is" if len(root_list) == 1 else "are"
    hosts = ctx.whole_hosts(silent)
    if len(hosts) == 1 and silent == roots:  # a whole host stopped answering: name the host
        (host,) = hosts
        where = f"host {host} ({', '.join(f'rank {r} {at[r]}' for r in at)})"
        what = "is"
    state = "not in any collective the others wait in"
    if silent:
        quiet_s = (last_heartbeat - max(states[r]["time_ns"] for r in silent)) / 1e9
        state = f"silent for {quiet_s:.0f} s (frozen, stopped or cut off), {state}"
    summary = (
        f"hang: {where} {what} {state}; {len(waiting)} rank{'s' if len(waiting) != 1 else ''} wait on "
        f"{'it' if len(root_list) == 1 else 'them'} ({', '.join(blocked_in)}) since step {step}"
    )
    shown = waiting if len(waiting) <= EVIDENCE_RANKS else direct[:EVIDENCE_RANKS]
    evidence = {
        "step": step,
        "stalled_for_s": round((last_heartbeat - advanced) / 1e9, 1),
        "roots": root_list,
        "waiting": len(waiting),
        "waiting_on_roots": len(direct),
        "waits_for": {str(r): sorted(edges[r]) for r in shown},
        "blocked_in": {str(r): [f"{w.op} {w.group} #{w.seq}" + (f" peer {w.peer}" if w.peer >= 0 else "") for w in waits[r]] for r in shown},
        "root_phase": {str(r): states[r]["phase"] for r in root_list},
        "silent_roots": sorted(silent),
        "not_heard_since_stall": len(alive - heard),
    }
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


def _waits(state: dict) -> list[Wait]:
    """What a quiet rank is blocked in: the operations its thread waits in, or, when the agent saw
    it wait in none, every operation it has in flight. DDP's reducer waits for its gradient
    all-reduces in C++, and on a GPU the thread blocks later, in a synchronisation: either way
    none of those operations completed while the rank made no progress."""
    ops = [Wait(g, seq, op, peer) for g, seq, op, peer in zip(state["groups"], state["seqs"], state["ops"], state["peers"])]
    return [w for w, waiting in zip(ops, state["waiting"]) if waiting] or ops


def _entered(ctx: RunContext, states: dict[int, dict], groups: list[str]) -> dict[tuple, int]:
    """Highest sequence entered: (rank, group) for collectives, (rank, group, op kind, peer) for point-to-point.

    From the store for ``groups`` only (those waited in); in flight, for every group.
    """
    entered: dict[tuple, int] = defaultdict(int)

    def note(rank: int, group: str, peer: int, sends: bool, seq: int) -> None:
        key = (rank, group) if peer < 0 else (rank, group, "send" if sends else "recv", peer)
        entered[key] = max(entered[key], seq)

    rows = ctx.query(ENTERED_SQL, {"run": ctx.run_id, "groups": groups}).to_pydict()
    for rank, group, peer, sends, seq in zip(rows["rank"], rows["group_name"], rows["peer"], rows["sends"], rows["seq"]):
        note(rank, group, peer, sends, seq)
    for rank, st in states.items():  # in flight counts as entered, waiting or launched
        for g, seq, op, peer in zip(st["groups"], st["seqs"], st["ops"], st["peers"]):
            note(rank, g, int(peer), _direction(op) == "send", int(seq))
    return entered


def _direction(op: str) -> str:
    return "send" if "send" in op.rsplit(":", 1)[-1] else "recv"


def _blockers(
    ctx: RunContext, rank: int, waits: list[Wait], entered: dict[tuple, int], behind: dict[tuple[str, int], set[int]]
) -> set[int]:
    """The ranks that have not entered an operation ``rank`` is blocked in.

    ``behind`` caches, per collective (group, seq), the members that have not entered it.
    """
    out: set[int] = set()
    for w in waits:
        if w.peer >= 0:
            opposite = "recv" if _direction(w.op) == "send" else "send"
            if entered.get((w.peer, w.group, opposite, rank), 0) < w.seq:
                out.add(w.peer)
            continue
        key = (w.group, w.seq)
        if key not in behind:
            behind[key] = {m for m in ctx.groups.get(w.group, []) if entered.get((m, w.group), 0) < w.seq}
        out |= behind[key] - {rank}
    return out


def _roots(edges: dict[int, set[int]]) -> set[int]:
    """Ranks reached from the waiting ranks that wait on nobody (or, in a cycle, the whole cycle)."""
    reached: set[int] = set()
    stack = [r for r, out in edges.items() if out]
    while stack:
        r = stack.pop()
        for nxt in edges.get(r, set()):
            if nxt not in reached:
                reached.add(nxt)
                stack.append(nxt)
    roots = {r for r in reached if not edges.get(r)}
    if roots or not reached:
        return roots
    return reached  # everybody reached waits on somebody: a cycle

"""Crashes and lost ranks: whose end brought the job down, and whose ends followed from it.

Each rank's last word (EndOfRank) says how it ended: normally, with an exit code, an uncaught
exception, or a signal. The culprit is the first rank to end abnormally on its own (exception,
non-zero exit, or a signal other than the launcher's SIGTERM/SIGINT). The ranks torchrun then
terminates (SIGTERM) or whose collectives time out are victims: evidence of the same incident.
A rank whose heartbeats stop without a last word lost its process or host (killed -9, kernel
panic, network gone): every rank of a host going silent together names the host (lost host); a
rank silent while another rank of its host ended after it lost its process (a crash).
After a hang, the ranks that time out and the hung rank killed by the launcher are the hang's
consequences, so no crash incident is opened for them.

A restart faster than ``silent_after_s`` (torchrun's elastic agents with a spare waiting, or ranks
forked from the agent) begins a new attempt before the rank that died was silent long enough to be
named, and the new attempt alone never shows it. So the attempt before the newest is judged too, as
it ended (``previous_attempt``).
"""

from __future__ import annotations

import signal
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from rankscope.collector.diagnosis.context import RunContext, died_at
from rankscope.collector.diagnosis.detector import FunctionDetector
from rankscope.common.incidents import Finding

#: the kinds of incident this detector names
KINDS = ("crash", "lost_rank", "lost_host")
#: urgent, after the hang detector: the hang of this pass is handed to ``detect``
DETECTOR = FunctionDetector(
    "crash", KINDS, "urgent",
    lambda scan: detect(scan.ctx, now_ns=scan.now_ns, hang=next(iter(scan.heeded), None), heard=scan.heard) + previous_attempt(scan.ctx),
    heeds=("hang",),
)
EXITS_SQL = (
    "SELECT rank, argMin(reason, time) AS reason, argMin(exit_code, time) AS exit_code, argMin(signal, time) AS signal, "
    "argMin(message, time) AS message, toUnixTimestamp64Nano(min(time)) AS time_ns "
    "FROM exits WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank"
)
# each rank's latest heartbeat, from the rollup kept as they arrive (a row per rank, however long the run)
HEARTBEATS_SQL = (
    "SELECT rank, toUnixTimestamp64Nano(max(last_heartbeat)) AS last_ns FROM rank_state WHERE run_id = {run:String} AND attempt = {attempt:UInt16} GROUP BY rank"
)
EXITS_EVIDENCE_SQL = (
    "SELECT rank, host, time, reason, exit_code, signal, message FROM exits WHERE run_id = {run:String} AND attempt = {attempt:UInt16} ORDER BY time"
)
SILENCE_EVIDENCE_SQL = (
    "SELECT rank, any(host) AS host, max(time) AS last_heartbeat FROM heartbeats WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "GROUP BY rank ORDER BY last_heartbeat"
)

#: when an attempt's ranks registered: the next attempt's start is the end of the one before
BEGAN_SQL = "SELECT toUnixTimestamp64Nano(min(registered)) AS ns FROM ranks WHERE run_id = {run:String} AND attempt = {attempt:UInt16}"
#: the self-healing driver's evictions during an attempt: it fences the hosts itself (their ranks
#: killed, with no last word) on an incident already raised, and stores each before it fences. One
#: decided after the next attempt began followed the end: what it acted on is the attempt's to name.
EVICTED_SQL = (
    "SELECT host, toUnixTimestamp64Nano(min(time)) AS time_ns FROM actions ARRAY JOIN hosts AS host WHERE run_id = {run:String} "
    "AND action = 'evict' AND time >= fromUnixTimestamp64Nano({since:Int64}) AND time < fromUnixTimestamp64Nano({until:Int64}) GROUP BY host"
)
#: what ``previous_attempt`` keeps in the newest attempt's ``RunContext.seen``
PREVIOUS = "crash:previous_attempt"

LAUNCHER_SIGNALS = (int(signal.SIGTERM), int(signal.SIGINT))
TIMEOUT_WORDS = ("timed out", "timeout", "watchdog", "connection reset", "connection closed", "aborted")


@dataclass(frozen=True)
class Ending:
    """How an attempt ended: the hosts the self-healing driver fenced during it (-> when it first
    decided to), and the hosts of the next attempt (a host there was up)."""

    fenced: Mapping[str, int]
    rejoined: Collection[str]


def detect(
    ctx: RunContext, *, now_ns: int, hang: Finding | None = None, heard: Mapping[int, int] | None = None, ended: Ending | None = None
) -> list[Finding]:
    """``now_ns``: the collector's clock (live) or when the live passes last looked at the run (offline).

    ``hang``: the hang found in this pass, if any: ends after it are its consequences, and its
    roots that went silent are its own (frozen, not lost). ``heard``: rank -> when the collector
    last heard from it (live): a rank is silent by that, not by its newest stored heartbeat, which
    a collector that lags stores late. ``ended``: the attempt is over (``previous_attempt``).
    """
    after_hang_ns = hang.first_seen_ns if hang is not None else None
    exits = {r["rank"]: r for r in ctx.query(EXITS_SQL, {"run": ctx.run_id}).to_pylist()}
    beats = ctx.query(HEARTBEATS_SQL, {"run": ctx.run_id}).to_pydict()  # a row per rank: columns, not 100,000 dicts
    own = dict(zip(beats["rank"], beats["last_ns"]))  # by each rank's clock, as its host-mates' ends
    last_beat = dict(own)
    for rank, heard_ns in (heard or {}).items():
        last_beat[rank] = max(last_beat.get(rank, 0), heard_ns)
    abnormal = sorted((r for r in exits.values() if r["reason"] != "normal"), key=lambda r: r["time_ns"])
    culprits = [r for r in abnormal if _on_its_own(r)]
    if after_hang_ns is not None:
        culprits = [r for r in culprits if r["time_ns"] < after_hang_ns]
    findings: list[Finding] = []
    if culprits:
        first = culprits[0]
        findings.append(_crash(ctx, first, [r for r in abnormal if r is not first]))
    silent = _silent(ctx, exits, last_beat, now_ns, over=ended is not None)
    if hang is not None:
        silent = {r: t for r, t in silent.items() if r not in hang.ranks}
    cutoffs = [culprits[0]["time_ns"] if culprits else after_hang_ns]
    if ended is not None:  # the driver fenced them itself, and what went silent after its first fence followed from it
        silent = {r: t for r, t in silent.items() if ctx.host.get(r) not in ended.fenced}
        cutoffs.append(min(ended.fenced.values(), default=None))
    cutoff = min((c for c in cutoffs if c is not None), default=None)
    if cutoff is not None:  # silence after the job started failing is a consequence
        silent = {r: t for r, t in silent.items() if t < cutoff}
    settled = _settled(ctx, silent, exits, now_ns, over=ended is not None)
    findings += _lost(ctx, settled, exits, own, rejoined=ended.rejoined if ended is not None else ())
    return findings


def previous_attempt(ctx: RunContext) -> list[Finding]:
    """The crashes and lost ranks of the attempt before ``ctx``'s, judged as it ended (a restarted
    run's: none before its second attempt). Every rank of it without a last word had gone silent;
    those whose death the others' ends soon after confirm are named (a silence that others waited
    on was the hang detector's, in its attempt). Its findings last until the newest attempt began,
    which is when a postmortem takes the newest attempt's incidents from."""
    if ctx.attempt == 0:
        return []
    kept = ctx.seen.get(PREVIOUS)
    if kept is None:  # an attempt's topology and start do not change once a newer one began
        before = RunContext.load(ctx.run_id, ctx.query, ctx.settings, attempt=ctx.attempt - 1)
        began = int(ctx.query(BEGAN_SQL, {"run": ctx.run_id}).to_pylist()[0]["ns"] or 0)
        since = int(before.query(BEGAN_SQL, {"run": ctx.run_id}).to_pylist()[0]["ns"] or 0)
        kept = ctx.seen[PREVIOUS] = (before, began, since)
    before, began, since = kept
    if not began:
        return []
    fenced = {r["host"]: r["time_ns"] for r in ctx.query(EVICTED_SQL, {"run": ctx.run_id, "since": since, "until": began}).to_pylist()}
    ended = Ending(fenced, frozenset(ctx.ranks_of_host))
    return [replace(f, last_seen_ns=max(f.last_seen_ns, began)) for f in detect(before, now_ns=began, ended=ended)]


def _settled(ctx: RunContext, silent: dict[int, int], exits: dict[int, dict], now_ns: int, *, over: bool = False) -> dict[int, int]:
    """The silent ranks whose fate is known. Silence alone does not tell a dead process or host from a
    frozen one (``died_at``); around a frozen one the others wait, and the hang detector names it
    once the run has stalled for ``hang_after_s``. Until ranks end, or well past that (a hang that
    was never named), silence is left undecided, whether others are still heard or not: a silence
    of every rank at once is as much the collector's (starved of CPU, the calls waiting unread in
    its sockets: seen, four hosts named lost while the calls waited 15 s, which shows only once they
    are taken up) or the network's as the hosts'. ``over``: the attempt ended, so a silence that
    lasted is one the passes of its time judged; only deaths are left to name."""
    if not silent:
        return silent
    since = min(silent.values())
    if died_at(since, (e["time_ns"] for e in exits.values()), ctx.settings):
        return silent
    if over:
        return {}
    patience_ns = (ctx.settings.hang_after_s + ctx.settings.silent_after_s) * 1e9
    return silent if now_ns - since > patience_ns else {}


def _on_its_own(row: dict) -> bool:
    """Whether a rank ended by its own fault, not because the launcher stopped it or a peer timed out."""
    if row["reason"] == "signal":
        return row["signal"] not in LAUNCHER_SIGNALS
    message = (row["message"] or "").lower()
    return not any(word in message for word in TIMEOUT_WORDS)


def _crash(ctx: RunContext, first: dict, others: list[dict]) -> Finding:
    rank = first["rank"]
    how = {
        "exception": f"raised {_first_line(first['message'])}",
        "exit_code": f"exited with code {first['exit_code']}",
        "signal": f"was killed by {_signal_name(first['signal'])}",
    }.get(first["reason"], first["reason"])
    victims = sorted(r["rank"] for r in others)
    summary = f"crash: {ctx.who(rank)} {how}"
    if victims:
        summary += f"; {len(victims)} other rank{'s' if len(victims) != 1 else ''} ended after it"
    evidence = {
        "reason": first["reason"],
        "exit_code": first["exit_code"],
        "signal": first["signal"],
        "message": first["message"],
        "victims": [
            {"rank": r["rank"], "reason": r["reason"], "signal": r["signal"], "message": _first_line(r["message"])}
            for r in others
        ],
    }
    return Finding(
        kind="crash",
        key=f"crash:rank={rank}",
        severity="critical",
        ranks=(rank,),
        hosts=ctx.hosts_of([rank]),
        first_seen_ns=first["time_ns"],
        last_seen_ns=max([first["time_ns"], *(r["time_ns"] for r in others)]),
        summary=summary,
        evidence=evidence,
        sql=ctx.literal_sql(EXITS_EVIDENCE_SQL),
    )


def _silent(ctx: RunContext, exits: dict[int, dict], last_beat: dict[int, int], now_ns: int, *, over: bool = False) -> dict[int, int]:
    """rank -> last heartbeat, for ranks without a last word whose heartbeats stopped (every one of
    them, once the attempt is ``over``)."""
    limit = ctx.settings.silent_after_s * 1e9
    return {r: t for r, t in last_beat.items() if r not in exits and (over or now_ns - t > limit)}


def _lost(ctx: RunContext, silent: dict[int, int], exits: dict[int, dict], own: dict[int, int], rejoined: Collection[str] = ()) -> list[Finding]:
    """Silent ranks: a lost host when all of a host's ranks went silent; a crash when another rank of
    the host ended after the silent one went quiet, or the host is in the next attempt (``rejoined``)
    (the machine was up and its launcher stopped the others: the process died, killed by SIGKILL or
    the kernel's OOM killer, which leave no last word); else a lost rank (a frozen process is the
    hang detector's: its host-mates wait on).
    "After" by the host's own clock (``own``: each rank's newest stored heartbeat), never by when the
    collector heard it: a last heartbeat that reached a lagging collector after the host-mate's end
    turned the crash into a lost rank live, and offline, which has no such time, said crash
    (seed 594157657: both raised live)."""
    if not silent:
        return []
    by_host: dict[str, list[int]] = {}
    for rank in silent:
        by_host.setdefault(ctx.host.get(rank, ""), []).append(rank)
    lost_hosts = ctx.whole_hosts(silent)
    findings = []
    for host, ranks in sorted(by_host.items()):
        ranks.sort()
        up = bool(host) and host in rejoined
        whole_host = host in lost_hosts and not up
        since = min(silent[r] for r in ranks)
        quiet_since = min(own.get(r, silent[r]) for r in ranks)
        stopped = [o for o in ctx.ranks_of_host.get(host, []) if o in exits and exits[o]["time_ns"] > quiet_since] if host else []
        names = ", ".join(ctx.who(r) for r in ranks)
        # a lost host or a crash continues the incident of the rank that fell silent first (heartbeats are
        # staggered; the lost rank was named before its host-mates' ends came)
        absorbs = tuple(f"lost:rank={r}" for r in sorted(ranks, key=lambda r: silent[r])) if whole_host or stopped or up else ()
        if whole_host:
            kind, key = "lost_host", f"lost:host={host}"
            summary = f"lost host: every rank of {host} ({', '.join(map(str, ranks))}) went silent without a last word"
        elif stopped or up:
            kind, key = "crash", f"crash:rank={ranks[0]}"
            how = f"rank {', '.join(map(str, stopped))} ended after it" if stopped else "it is in the next attempt"
            summary = f"crash: {names} died without a last word (SIGKILL or the OOM killer) while its host {host} was up ({how})"
        else:
            kind, key = "lost_rank", f"lost:rank={ranks[0]}"
            summary = f"lost rank: {names} went silent without a last word (process killed or host unreachable)"
        findings.append(
            Finding(
                kind=kind,
                key=key,
                severity="critical",
                ranks=tuple(ranks),
                hosts=ctx.hosts_of(ranks),
                first_seen_ns=since,
                last_seen_ns=max(silent[r] for r in ranks),
                summary=summary,
                evidence={"last_heartbeat_ns": {str(r): silent[r] for r in ranks}, "ranks_that_said_they_ended": sorted(exits)},
                sql=ctx.literal_sql(SILENCE_EVIDENCE_SQL),
                absorbs=absorbs,
            )
        )
    return findings


def _first_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "an exception"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"

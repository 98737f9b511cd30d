"""Crashes and lost ranks: whose end brought the job down, and whose ends followed from it.

Each rank's last word (EndOfRank) says how it ended: normally, with an exit code, an uncaught
exception, or a signal. The culprit is the first rank to end abnormally on its own (exception,
non-zero exit, or a signal other than the launcher's SIGTERM/SIGINT). The ranks torchrun then
terminates (SIGTERM) or whose collectives time out are victims: evidence of the same incident.
A rank whose heartbeats stop without a last word lost its process or host (killed -9, kernel
panic, network gone); every rank of a host going silent together names the host.
After a hang, the ranks that time out and the hung rank killed by the launcher are the hang's
consequences, so no crash incident is opened for them.
"""

from __future__ import annotations

import signal

from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis.incidents import Finding

EXITS_SQL = (
    "SELECT rank, argMin(reason, time) AS reason, argMin(exit_code, time) AS exit_code, argMin(signal, time) AS signal, "
    "argMin(message, time) AS message, toUnixTimestamp64Nano(min(time)) AS time_ns "
    "FROM exits WHERE run_id = {run:String} GROUP BY rank"
)
HEARTBEATS_SQL = (
    "SELECT rank, toUnixTimestamp64Nano(max(time)) AS last_ns FROM heartbeats WHERE run_id = {run:String} GROUP BY rank"
)
EXITS_EVIDENCE_SQL = (
    "SELECT rank, host, time, reason, exit_code, signal, message FROM exits WHERE run_id = {run:String} ORDER BY time"
)
SILENCE_EVIDENCE_SQL = (
    "SELECT rank, any(host) AS host, max(time) AS last_heartbeat FROM heartbeats WHERE run_id = {run:String} "
    "GROUP BY rank ORDER BY last_heartbeat"
)

LAUNCHER_SIGNALS = (int(signal.SIGTERM), int(signal.SIGINT))
TIMEOUT_WORDS = ("timed out", "timeout", "watchdog", "connection reset", "connection closed", "aborted")


def detect(ctx: RunContext, *, now_ns: int, after_hang_ns: int | None = None) -> list[Finding]:
    """``now_ns``: the collector's clock (live) or the run's last data time (offline).

    ``after_hang_ns``: when a hang was found, ends after it are that hang's consequences.
    """
    exits = {r["rank"]: r for r in ctx.query(EXITS_SQL, {"run": ctx.run_id}).to_pylist()}
    last_beat = {r["rank"]: r["last_ns"] for r in ctx.query(HEARTBEATS_SQL, {"run": ctx.run_id}).to_pylist()}
    abnormal = sorted((r for r in exits.values() if r["reason"] != "normal"), key=lambda r: r["time_ns"])
    culprits = [r for r in abnormal if _on_its_own(r)]
    if after_hang_ns is not None:
        culprits = [r for r in culprits if r["time_ns"] < after_hang_ns]
    findings: list[Finding] = []
    if culprits:
        first = culprits[0]
        findings.append(_crash(ctx, first, [r for r in abnormal if r is not first]))
    silent = _silent(ctx, exits, last_beat, now_ns)
    cutoff = culprits[0]["time_ns"] if culprits else after_hang_ns
    if cutoff is not None:  # silence after the job started failing is a consequence
        silent = {r: t for r, t in silent.items() if t < cutoff}
    findings += _lost(ctx, silent, exits)
    return findings


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


def _silent(ctx: RunContext, exits: dict[int, dict], last_beat: dict[int, int], now_ns: int) -> dict[int, int]:
    """rank -> last heartbeat, for ranks without a last word whose heartbeats stopped."""
    limit = ctx.settings.silent_after_s * 1e9
    return {r: t for r, t in last_beat.items() if r not in exits and now_ns - t > limit}


def _lost(ctx: RunContext, silent: dict[int, int], exits: dict[int, dict]) -> list[Finding]:
    if not silent:
        return []
    by_host: dict[str, list[int]] = {}
    for rank in silent:
        by_host.setdefault(ctx.host.get(rank, ""), []).append(rank)
    lost_hosts = ctx.whole_hosts(silent)
    findings = []
    for host, ranks in sorted(by_host.items()):
        ranks.sort()
        whole_host = host in lost_hosts
        since = min(silent[r] for r in ranks)
        if whole_host:
            key, summary = f"lost:host={host}", f"lost host: every rank of {host} ({', '.join(map(str, ranks))}) went silent without a last word"
        else:
            key = f"lost:ranks={','.join(map(str, ranks))}"
            names = ", ".join(ctx.who(r) for r in ranks)
            summary = f"lost rank: {names} went silent without a last word (process killed or host unreachable)"
        findings.append(
            Finding(
                kind="lost_host" if whole_host else "lost_rank",
                key=key,
                severity="critical",
                ranks=tuple(ranks),
                hosts=ctx.hosts_of(ranks),
                first_seen_ns=since,
                last_seen_ns=max(silent[r] for r in ranks),
                summary=summary,
                evidence={"last_heartbeat_ns": {str(r): silent[r] for r in ranks}, "ranks_that_said_they_ended": sorted(exits)},
                sql=ctx.literal_sql(SILENCE_EVIDENCE_SQL),
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

"""Slow links: point-to-point transfers between one pair of ranks far slower than between the others.

A transfer is timed from the moment both sides have arrived to the moment the receiver has the
data: a receiver waiting for a late sender is not a slow link, the sender is late. A rank
"arrives" when it enters the communication step: the start of the ``comm`` span around the
operation when the code marks one (the bundled trainer does), else the operation's issue time.
Pairs are compared with pairs moving the same number of bytes, and a pair is reported only when
its extra time costs a visible share of a training step: on shared or busy hosts every transfer
carries milliseconds of scheduling noise that no link is to blame for. The slow pairs between
the same two hosts make one incident: a slow NIC, cable or path between them slows every pair of
ranks across it.
"""

from __future__ import annotations

import numpy as np

from rankscope.collector.anatomy.path import incident_cost, whole_steps
from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis.detector import FunctionDetector
from rankscope.collector.diagnosis.transfer_window import TransferWindow
from rankscope.common.incidents import Finding

#: the kinds of incident this detector names
KINDS = ("slow_link",)
DETECTOR = FunctionDetector("slow_link", KINDS, "thorough", lambda scan: detect(scan.ctx))
MIN_STEPS = 3
#: the steps judged: the newest completed ones, at most this many back from the newest
WINDOW_STEPS = 10
NEWEST_SQL = (
    "SELECT max(step) AS newest FROM collectives WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND peer >= 0 "
    "AND step >= {since:UInt32}"
)

EVIDENCE_SQL = (
    "SELECT rank, peer, op, group_name, seq, step, issue_time, end_time, "
    "toUnixTimestamp64Nano(end_time) - toUnixTimestamp64Nano(issue_time) AS ns FROM collectives "
    "WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND peer >= 0 AND ((rank = {src:UInt32} AND peer = {dst:UInt32}) OR "
    "(rank = {dst:UInt32} AND peer = {src:UInt32})) ORDER BY issue_time DESC LIMIT 50"
)


def detect(ctx: RunContext) -> list[Finding]:
    s = ctx.settings
    last_step = ctx.newest_step(NEWEST_SQL)
    if last_step == 0:
        return []
    # Completed steps only (the newest is in progress, or cut short by a hang or crash), not the
    # first (start-up), and enough of them to judge; without a step time there is no yardstick.
    last_step -= 1
    first_step = max(2, last_step - WINDOW_STEPS)
    if last_step - first_step + 1 < MIN_STEPS:
        return []
    step_s = ctx.median_step_s(first_step, last_step)
    if not step_s:
        return []
    pairs, steps = TransferWindow.of(ctx).pairs_of(ctx, first_step, last_step)
    if pairs.empty:
        return []
    min_cost_s = max(s.slow_link_min_s, s.slow_link_step_share * step_s)
    median = pairs["median_ns"].to_numpy(dtype=np.float64)
    typical, compared = _typical(pairs["nbytes"].to_numpy(), median)
    cost_per_step_s = (median - typical) / 1e9 * pairs["transfers"].to_numpy() / max(steps, 1)
    with np.errstate(invalid="ignore"):  # NaN: fewer than two other pairs to compare with
        slower = median >= s.slow_link_ratio * np.maximum(typical, 1.0)
    costly = np.flatnonzero(slower & (cost_per_step_s >= min_cost_s))
    if not len(costly):
        return []
    column = {name: pairs[name].to_numpy() for name in ("src", "dst", "nbytes", "transfers", "first_ns", "last_ns")}

    def link(i: int) -> tuple[str, ...]:
        """The pair of hosts of row ``i`` (or of ranks, where both are on one host)."""
        src, dst = int(column["src"][i]), int(column["dst"][i])
        hosts = ctx.hosts_of((src, dst))
        return hosts if len(hosts) == 2 else (str(src), str(dst))

    # A link is slow when a pair of ranks across it costs the step a visible share; every pair across
    # it as many times slower than its peers is named with it, whatever it costs (which pairs queue
    # behind the link's other traffic changes from step to step).
    slow: dict[tuple[str, ...], list[dict]] = {link(i): [] for i in costly}  # the slow link -> its slow rank pairs
    for i in np.flatnonzero(slower):  # a few pairs of the window's hundreds of thousands
        found = slow.get(link(i))
        if found is None:
            continue
        found.append({
            "src": int(column["src"][i]), "dst": int(column["dst"][i]), "nbytes": int(column["nbytes"][i]),
            "transfers": int(column["transfers"][i]), "first_ns": int(column["first_ns"][i]), "last_ns": int(column["last_ns"][i]),
            "median": float(median[i]), "typical": float(typical[i]), "compared": int(compared[i]),
            "cost_per_step_s": float(cost_per_step_s[i]),
        })  # fmt: skip
    return [_finding(ctx, found, step_s, last_step) for found in slow.values()]


def _finding(ctx: RunContext, found: list[dict], step_s: float, last_step: int) -> Finding:
    """One incident per pair of hosts: the ranks on both sides of a slow link are all slow over it."""
    found.sort(key=lambda p: -p["median"])
    worst = found[0]
    src, dst, typical = worst["src"], worst["dst"], worst["typical"]
    ranks = tuple(sorted({r for p in found for r in (p["src"], p["dst"])}))
    hosts = ctx.hosts_of(ranks)
    transfers = f"{ctx.who(src)} -> {ctx.who(dst)}: point-to-point transfers take {worst['median'] / 1e6:.0f} ms"
    absorbs: tuple[str, ...] = ()
    if len(found) == 1:
        key, summary = f"slow_link:{src}->{dst}", f"slow link: {transfers}"
    else:  # continues the incident of the pair seen slow first, if any
        absorbs = tuple(f"slow_link:{p['src']}->{p['dst']}" for p in sorted(found, key=lambda p: p["first_ns"]))
        others = ", ".join(f"{p['src']} -> {p['dst']}" for p in found[1:])
        key = f"slow_link:{'<->'.join(hosts)}"
        summary = f"slow link between {' and '.join(hosts)}: {transfers} (and {others})"
    summary += f", {worst['median'] / max(typical, 1.0):.0f}x the {typical / 1e6:.1f} ms of other pairs moving {worst['nbytes']} bytes"
    # what the link's communication on the critical paths of the latest steps cost them (rankscope/collector/anatomy)
    steps = whole_steps(ctx.query, ctx.run_id, range(max(2, last_step - WINDOW_STEPS), last_step + 1), len(ctx.host), attempt=ctx.attempt)
    cost = incident_cost(ctx.query, ctx.run_id, steps, (src, dst), attempt=ctx.attempt, kinds=("comm", "p2p"), groups=ctx.group_index)
    if cost is not None:
        summary += f"; {cost['text']}"
    return Finding(
        kind="slow_link",
        key=key,
        severity="warning",
        ranks=ranks,
        hosts=hosts,
        first_seen_ns=min(p["first_ns"] for p in found),
        last_seen_ns=max(p["last_ns"] for p in found),
        summary=summary,
        evidence={"median_transfer_ms": round(worst["median"] / 1e6, 3), "typical_ms": round(typical / 1e6, 3),
                  "transfers": worst["transfers"], "bytes": worst["nbytes"], "compared_pairs": worst["compared"],
                  "cost_per_step_ms": round(worst["cost_per_step_s"] * 1e3, 1), "step_time_ms": round(1e3 * step_s, 1),
                  "slow_pairs": [{"src": p["src"], "dst": p["dst"], "median_transfer_ms": round(p["median"] / 1e6, 3)} for p in found],
                  **({"critical_path_cost": cost} if cost is not None else {})},  # fmt: skip
        sql=ctx.literal_sql(EVIDENCE_SQL, src=src, dst=dst),
        absorbs=absorbs,
    )


def _typical(sizes: np.ndarray, medians: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pair, the median of the other pairs' medians moving the same bytes, and how many others;
    NaN and 0 for a pair with fewer than two others.

    Exactly ``np.median`` of the others, from one sort per size: a 100,000-rank job has hundreds of
    thousands of pairs, and a list of the others per pair is quadratic.
    """
    typical = np.full(len(medians), np.nan)
    compared = np.zeros(len(medians), dtype=np.int64)
    for size in np.unique(sizes):
        members = np.flatnonzero(sizes == size)
        others = len(members) - 1
        if others < 2:
            continue
        values = medians[members]
        order = np.argsort(values, kind="stable")
        ranked = values[order]
        position = np.empty(len(members), dtype=np.int64)
        position[order] = np.arange(len(members))

        def kth_other(k: int) -> np.ndarray:
            """The k-th smallest of the others, for every pair (leaving out its own place in ``ranked``)."""
            return np.where(k < position, ranked[k], ranked[k + 1])

        middle = others // 2
        typical[members] = kth_other(middle) if others % 2 else (kth_other(middle - 1) + kth_other(middle)) / 2
        compared[members] = others
    return typical, compared

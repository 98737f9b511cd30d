"""NaN and loss spikes: the first step and rank where numbers stop being finite, or the loss jumps.

Once a NaN exists it spreads: through tensor-parallel reductions to the peers, down the pipeline
to the loss, through the data-parallel gradient average to every replica. So the origin is the
earliest step with a non-finite value, and within it the rank earliest in the data flow (the
lowest pipeline stage) reporting a non-finite output of its own (the bundled trainer records
``nonfinite_outputs`` per rank and step). Scripts that only report a loss get the first step
and the ranks whose loss is not finite.
"""

from __future__ import annotations

import math

from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis.detector import FunctionDetector
from rankscope.common.incidents import Finding

# The first step with a value not finite, from the per-step ``step_losses`` rollup (a row per step),
# then that step's rows through the step index: a run's step metrics grow with it.
#: the kinds of incident this detector names
KINDS = ("nan", "loss_spike")
DETECTOR = FunctionDetector("nan", KINDS, "thorough", lambda scan: detect(scan.ctx))
FIRST_STEP_SQL = (
    "SELECT step FROM step_losses WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND nonfinite > 0 ORDER BY step LIMIT 1"
)
FIRST_SQL = (
    "SELECT step, rank, name, value, toUnixTimestamp64Nano(time) AS time_ns FROM step_metrics "
    "WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step = {step:UInt32} "
    "AND ((name = 'loss' AND NOT isFinite(value)) OR (name = 'nonfinite_outputs' AND value > 0)) ORDER BY rank"
)
NEWEST_SQL = "SELECT max(step) AS newest FROM step_losses WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step >= {since:UInt32}"
LOSS_SQL = (
    "SELECT step, quantileIfMerge(loss) AS loss, groupArrayIfMerge(ranks) AS ranks, toUnixTimestamp64Nano(min(first_time)) AS time_ns "
    "FROM step_losses WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND step >= {from:UInt32} "
    "GROUP BY step HAVING notEmpty(ranks) ORDER BY step"
)
#: loss spikes are looked for in this many newest steps (an older one is closed: the run went on) ...
SPIKE_STEPS = 40
#: ... each against the median of up to this many steps before it
SPIKE_HISTORY = 20
EVIDENCE_SQL = (
    "SELECT step, rank, name, value FROM step_metrics WHERE run_id = {run:String} AND attempt = {attempt:UInt16} "
    "AND name IN ('loss', 'nonfinite_outputs', 'grad_norm') AND step BETWEEN {from:UInt32} AND {to:UInt32} ORDER BY step, rank, name"
)


def detect(ctx: RunContext) -> list[Finding]:
    return _nan(ctx) + _spikes(ctx)


def _nan(ctx: RunContext) -> list[Finding]:
    first = ctx.query(FIRST_STEP_SQL, {"run": ctx.run_id}).to_pylist()
    rows = ctx.query(FIRST_SQL, {"run": ctx.run_id, "step": first[0]["step"]}).to_pylist() if first else []
    if not rows:
        return []
    step = rows[0]["step"]
    outputs = [r for r in rows if r["name"] == "nonfinite_outputs"]
    if outputs:
        earliest = min(ctx.stage.get(r["rank"], 0) for r in outputs)
        origin = sorted({r["rank"] for r in outputs if ctx.stage.get(r["rank"], 0) == earliest})
        what = "output"
    else:
        origin = sorted({r["rank"] for r in rows})
        what = "loss"
    reached = sorted({r["rank"] for r in rows} - set(origin))
    names = ", ".join(ctx.who(r) for r in origin)
    summary = f"NaN: {names}: {what} not finite at step {step}"
    if reached:
        summary += f", first in the data flow; it reached {len(reached)} other rank{'s' if len(reached) != 1 else ''}"
    time_ns = min(r["time_ns"] for r in rows)
    return [
        Finding(
            kind="nan",
            key="nan",
            severity="critical",
            ranks=tuple(origin),
            hosts=ctx.hosts_of(origin),
            first_seen_ns=time_ns,
            last_seen_ns=max(r["time_ns"] for r in rows),
            summary=summary,
            evidence={"step": step, "origin": origin, "also_not_finite": reached,
                      "values": [{"rank": r["rank"], "name": r["name"], "value": str(r["value"])} for r in rows]},  # fmt: skip
            sql=ctx.literal_sql(EVIDENCE_SQL, **{"from": max(1, step - 2), "to": step + 1}),
        )
    ]


def _spikes(ctx: RunContext) -> list[Finding]:
    """A finite loss far above the median of the steps before it, in the newest ``SPIKE_STEPS`` steps
    (the run may recover; it is still worth a look)."""
    ratio = ctx.settings.loss_spike_ratio
    newest = ctx.newest_step(NEWEST_SQL)
    judged_from = newest - SPIKE_STEPS + 1
    history: list[float] = []
    findings = []
    for row in ctx.query(LOSS_SQL, {"run": ctx.run_id, "from": max(0, judged_from - SPIKE_HISTORY)}).to_pylist():
        loss = row["loss"]
        if loss is None or not math.isfinite(loss):
            break  # from here on it is the NaN incident's
        if len(history) >= 5 and row["step"] >= judged_from:
            median = sorted(history[-SPIKE_HISTORY:])[len(history[-SPIKE_HISTORY:]) // 2]
            if median > 0 and loss > ratio * median:
                ranks = sorted(row["ranks"])
                findings.append(
                    Finding(
                        kind="loss_spike",
                        key=f"loss_spike:step={row['step']}",
                        severity="warning",
                        ranks=tuple(ranks),
                        hosts=ctx.hosts_of(ranks),
                        first_seen_ns=row["time_ns"],
                        last_seen_ns=row["time_ns"],
                        summary=f"loss spike at step {row['step']}: {loss:.4g}, {loss / median:.1f}x the median {median:.4g} of the steps before",
                        evidence={"step": row["step"], "loss": loss, "median_before": median},
                        sql=ctx.literal_sql(EVIDENCE_SQL, **{"from": max(1, row["step"] - 5), "to": row["step"] + 1}),
                    )
                )
        history.append(loss)
    return findings

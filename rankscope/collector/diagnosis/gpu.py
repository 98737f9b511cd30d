"""GPU trouble from the device metrics: thermal or power-brake throttling, uncorrected ECC errors, Xid events.

Each GPU's metrics are reported by the rank that uses it, so a finding names that rank and its
host. Throttling counts when it is seen in at least two samples (a single sample can be a
transient); an uncorrected ECC error or an Xid event counts at once.
"""

from __future__ import annotations

from rankscope.collector.diagnosis.context import RunContext
from rankscope.collector.diagnosis.detector import FunctionDetector
from rankscope.common.incidents import Finding

#: the kinds of incident this detector names
KINDS = ("gpu_throttle", "gpu_ecc", "gpu_xid")
DETECTOR = FunctionDetector("gpu", KINDS, "thorough", lambda scan: detect(scan.ctx))
#: throttle reasons that mean trouble (NVML's; power capping under full load is normal and left out)
BAD_THROTTLE = ("hw_thermal", "sw_thermal", "hw_slowdown", "hw_power_brake")

# From the ``gpu_signals`` rollup, kept per rank and signal as metrics arrive: a run's metrics grow
# with it, its signals do not.
SIGNALS_SQL = (
    "SELECT rank, anyLast(host) AS host, anyLast(device) AS device, name, "
    "sum(samples_on) AS samples_on, max(highest) - min(lowest) AS increase, max(highest) AS peak, "
    "toUnixTimestamp64Nano(minIfMerge(first_on)) AS first_ns, toUnixTimestamp64Nano(max(last_seen)) AS last_ns "
    "FROM gpu_signals WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND (name IN {throttle:Array(String)} "
    "OR name = 'hw.errors.ecc_uncorrected' OR startsWith(name, 'hw.gpu.xid.')) GROUP BY rank, name"
)
EVIDENCE_SQL = (
    "SELECT time, rank, host, device, name, value FROM metrics WHERE run_id = {run:String} AND attempt = {attempt:UInt16} AND rank = {rank:Int32} "
    "AND (startsWith(name, 'hw.gpu.') OR startsWith(name, 'hw.errors') OR name IN ('hw.temperature', 'hw.power')) "
    "ORDER BY time DESC LIMIT 200"
)


def detect(ctx: RunContext) -> list[Finding]:
    throttle_names = [f"hw.gpu.throttle.{r}" for r in BAD_THROTTLE]
    rows = ctx.query(SIGNALS_SQL, {"run": ctx.run_id, "throttle": throttle_names}).to_pylist()
    by_fault: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        name = row["name"]
        if name in throttle_names and row["samples_on"] >= 2:
            kind = "gpu_throttle"
        elif name == "hw.errors.ecc_uncorrected" and row["increase"] > 0:
            kind = "gpu_ecc"
        elif name.startswith("hw.gpu.xid.") and row["peak"] > 0:
            kind = "gpu_xid"
        else:
            continue
        by_fault.setdefault((kind, row["rank"]), []).append(row)
    findings = []
    for (kind, rank), signals in sorted(by_fault.items()):
        device = signals[0]["device"]
        what = {
            "gpu_throttle": "throttled (" + ", ".join(s["name"].rsplit(".", 1)[-1] for s in signals) + ")",
            "gpu_ecc": f"{int(sum(s['increase'] for s in signals))} uncorrected ECC error(s)",
            "gpu_xid": "Xid " + ", ".join(s["name"].rsplit(".", 1)[-1] for s in signals),
        }[kind]
        findings.append(
            Finding(
                kind=kind,
                key=f"{kind}:rank={rank}",
                severity="warning" if kind == "gpu_throttle" else "critical",
                ranks=(rank,),
                hosts=ctx.hosts_of([rank]),
                first_seen_ns=min(s["first_ns"] or s["last_ns"] for s in signals),
                last_seen_ns=max(s["last_ns"] for s in signals),
                summary=f"GPU trouble: {ctx.who(rank)} GPU {device}: {what}",
                evidence={"device": device, "signals": {s["name"]: {"samples_on": s["samples_on"], "peak": s["peak"]} for s in signals}},
                sql=ctx.literal_sql(EVIDENCE_SQL, rank=rank),
            )
        )
    return findings

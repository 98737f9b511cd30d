"""Incidents: one per fault, updated while the fault lasts, closed when it ends.

A detector reports ``Finding``s on every pass; a finding's ``key`` names the fault (for example
``straggler:rank=5`` or ``hang``), so the same fault seen again updates the same incident (a new
row with a higher version in the ReplacingMergeTree) instead of opening another one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from rankscope.collector.store.base import arrow_schema
from rankscope.collector.store.schema import BY_NAME



def headline(kind: str, summary: str) -> str:
    """``kind: summary``, without saying the kind twice (some summaries start with it)."""
    return summary if summary.startswith(f"{kind}:") else f"{kind}: {summary}"


@dataclass(frozen=True)
class Finding:
    """What one detector pass says about one fault."""

    kind: str
    key: str
    severity: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    first_seen_ns: int
    last_seen_ns: int
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    sql: str = ""
    #: keys of narrower findings this one grew out of (the straggler ranks of a host that turned out
    #: slow as a whole): it continues the first of them that is an incident already, under its id
    absorbs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Incident:
    """A finding as stored: with its run, status and version."""

    run_id: str
    finding: Finding
    status: str  # "open", "closed" or "merged" (into another incident of the same fault: evidence.merged_into)
    version: int

    @property
    def incident_id(self) -> str:
        return self.finding.key

    def as_json(self) -> dict[str, Any]:
        """The incident as ``rankscope diagnose --format json`` prints it."""
        f = self.finding
        return {
            "run_id": self.run_id,
            "incident_id": f.key,
            "kind": f.kind,
            "severity": f.severity,
            "status": self.status,
            "ranks": list(f.ranks),
            "hosts": list(f.hosts),
            "first_seen": _iso(f.first_seen_ns),
            "last_seen": _iso(f.last_seen_ns),
            "summary": f.summary,
            "evidence": dict(f.evidence),
            "sql": f.sql,
        }


class Ledger:
    """The incidents of one run across passes: which are new, which changed, which ended."""

    def __init__(self, run_id: str, known: Iterable[Incident] = ()) -> None:
        self.run_id = run_id
        self.incidents: dict[str, Incident] = {i.incident_id: i for i in known}
        self._continues: dict[str, str] = {}  # a finding's key -> the id of the incident it absorbed

    def update(
        self, findings: Iterable[Finding], *, final: bool = False, owns: Callable[[str], bool] = lambda kind: True
    ) -> tuple[list[Incident], list[Incident]]:
        """Fold one pass's findings in; returns (incidents to store, incidents that are new).

        Open incidents not found again are closed, of the kinds the pass ``owns`` (a live lane looks
        for some kinds only). ``final``: the run is over, close everything it owns.
        """
        findings = list(findings)
        changed: list[Incident] = []
        new: list[Incident] = []
        seen: set[str] = set()
        taken = {f.key for f in findings}  # a finding's own incident is its own, whatever another absorbs
        for finding in findings:
            key, merged = self._incident_id(finding, taken | seen)
            changed += merged
            finding = replace(finding, key=key)
            seen.add(key)
            before = self.incidents.get(key)
            if before is not None:  # keep the first sighting of a fault that is seen again
                finding = replace(finding, first_seen_ns=min(finding.first_seen_ns, before.finding.first_seen_ns))
            status = "closed" if final else "open"
            if before is not None and before.finding == finding and before.status == status:
                continue
            incident = Incident(self.run_id, finding, status, _next_version(before))
            self.incidents[key] = incident
            changed.append(incident)
            if before is None:
                new.append(incident)
        for key, incident in list(self.incidents.items()):
            if key not in seen and incident.status == "open" and owns(incident.finding.kind):
                closed = Incident(self.run_id, incident.finding, "closed", _next_version(incident))
                self.incidents[key] = closed
                changed.append(closed)
        return changed, new

    def _incident_id(self, finding: Finding, taken: set[str]) -> tuple[str, list[Incident]]:
        """The finding's incident: its own, or the one it continues (the first incident among what it
        absorbs, when it first appeared), unless ``taken`` (another finding of the pass has it). The
        other incidents it absorbs then are the same fault seen in parts: returned merged into it."""
        merged: list[Incident] = []
        if finding.key not in self._continues and finding.key not in self.incidents:
            absorbed = list(dict.fromkeys(k for k in map(self._resolved, finding.absorbs) if k in self.incidents))
            if absorbed:
                self._continues[finding.key] = absorbed[0]
                for key in absorbed[1:]:
                    merged.append(self._merge(key, absorbed[0]))
        key = self._continues.get(finding.key, finding.key)
        return (finding.key if key != finding.key and key in taken else key), merged

    def _resolved(self, key: str) -> str:
        """The incident a finding's key stands for: the one it continued, if it did."""
        return self._continues.get(key, key)

    def _merge(self, key: str, into: str) -> Incident:
        """Incident ``key`` becomes part of incident ``into``: its row stays, as "merged" (not listed
        as an incident of its own), and a finding of ``key`` later continues ``into``."""
        before = self.incidents[key]
        finding = replace(before.finding, evidence={**before.finding.evidence, "merged_into": into})
        self.incidents[key] = merged = Incident(self.run_id, finding, "merged", _next_version(before))
        self._continues[key] = into
        return merged


def _next_version(before: Incident | None) -> int:
    """Versions order the rows of one incident; wall-clock ns keeps them increasing across restarts."""
    return max(time.time_ns(), before.version + 1 if before else 0)


def to_arrow(incidents: Iterable[Incident]) -> pa.Table:
    """Incident rows in the ``incidents`` table's insert schema."""
    rows = [
        {
            "run_id": i.run_id,
            "incident_id": i.incident_id,
            "kind": i.finding.kind,
            "severity": i.finding.severity,
            "status": i.status,
            "ranks": list(i.finding.ranks),
            "hosts": list(i.finding.hosts),
            "first_seen": i.finding.first_seen_ns,
            "last_seen": i.finding.last_seen_ns,
            "summary": i.finding.summary,
            "evidence": json.dumps(i.finding.evidence, default=str, allow_nan=True),
            "sql": i.finding.sql,
            "version": i.version,
        }
        for i in incidents
    ]
    schema = arrow_schema(BY_NAME["incidents"])
    columns = {f.name: pa.array([r[f.name] for r in rows], _arrow_input_type(f.type)).cast(f.type) for f in schema}
    return pa.table(columns, schema=schema)


def _arrow_input_type(target: pa.DataType) -> pa.DataType:
    return pa.int64() if pa.types.is_timestamp(target) else target


def from_rows(rows: Iterable[Mapping[str, Any]]) -> list[Incident]:
    """Incidents read back from ``SELECT ... FROM incidents FINAL`` (times as ns integers)."""
    out = []
    for r in rows:
        finding = Finding(
            kind=r["kind"],
            key=r["incident_id"],
            severity=r["severity"],
            ranks=tuple(int(x) for x in r["ranks"]),
            hosts=tuple(r["hosts"]),
            first_seen_ns=int(r["first_seen_ns"]),
            last_seen_ns=int(r["last_seen_ns"]),
            summary=r["summary"],
            evidence=_evidence(r["evidence"]),
            sql=r["sql"],
        )
        out.append(Incident(r["run_id"], finding, r["status"], int(r["version"])))
    return out


def _evidence(text: str) -> dict[str, Any]:
    """Evidence as stored: JSON text of an object. Anything else is kept, as text, under "unreadable evidence"."""
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"unreadable evidence": text}


INCIDENTS_SQL = (
    "SELECT run_id, incident_id, kind, severity, status, ranks, hosts, toUnixTimestamp64Nano(first_seen) AS first_seen_ns, "
    "toUnixTimestamp64Nano(last_seen) AS last_seen_ns, summary, evidence, sql, version "
    "FROM incidents FINAL WHERE run_id = {run:String} AND status != 'merged' ORDER BY first_seen, incident_id"
)


def _iso(ns: int) -> str:
    seconds, frac = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{frac:09d}Z"

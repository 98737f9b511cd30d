"""The ledger of a run's incidents: one per fault, updated while the fault lasts, closed when it
ends, and their rows for the ``incidents`` table (the types are ``rankscope.common.incidents``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import pyarrow as pa

from rankscope.collector.store.base import arrow_schema
from rankscope.collector.store.schema import BY_NAME
from rankscope.common.incidents import Finding, Incident


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



"""Incidents and findings: what diagnosis says about a run, as every part reads it.

A detector reports ``Finding``s on every pass; a finding's ``key`` names the fault (for example
``straggler:rank=5`` or ``hang``), so the same fault seen again updates the same incident (a new
row with a higher version in the ReplacingMergeTree) instead of opening another one. The collector
writes them (``rankscope.collector.diagnosis.ledger``); the CLI, the dashboard, the healing driver
and the harness read them back with ``INCIDENTS_SQL`` and ``from_rows``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


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


def who(rank: int, hosts: Mapping[int, str]) -> str:
    """``rank 5 (node-2)``: how incidents (and the dashboard, which must agree) name a rank."""
    host = hosts.get(int(rank))
    return f"rank {rank} ({host})" if host else f"rank {rank}"


def _iso(ns: int) -> str:
    seconds, frac = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{frac:09d}Z"

"""What a self-healing driver and a self-check store: run-level batches through the collector's Ingest.

The collector owns the store, so the driver and ``rankscope selfcheck`` write the way agents do:
one ``Batch`` per record, with a fresh batch id (a retry of the same batch is stored once). The
rows land in the ``actions``, ``selfchecks`` and ``node_states`` tables.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rankscope.protos.v1 import BATCH_SCHEMA_VERSION, ingest_pb2, telemetry_pb2

__all__ = ["Figure", "action_batch", "node_state_batch", "selfcheck_batch"]


@dataclass(frozen=True)
class Figure:
    """One figure of a host's self-check, beside its peers' median of the same figure."""

    check: str
    value: float
    unit: str
    reference: float = math.nan
    passed: bool = True
    detail: str = ""


def _batch(run_id: str, attempt: int, **payload: object) -> ingest_pb2.Batch:
    return ingest_pb2.Batch(
        schema_version=BATCH_SCHEMA_VERSION, run_id=run_id, rank=0, batch_id=secrets.token_bytes(16), attempt=attempt,
        sent_ns=time.time_ns(), **payload,
    )  # fmt: skip


def action_batch(
    run_id: str, action: str, *, attempt: int = 0, hosts: Sequence[str] = (), incident_id: str = "", reason: str = "",
    evidence: Mapping[str, object] | None = None, time_ns: int | None = None,
) -> ingest_pb2.Batch:  # fmt: skip
    """A batch that stores one row of ``actions``: what was decided or done, on which hosts, and why."""
    record = telemetry_pb2.Action(
        time_ns=time_ns or time.time_ns(), action=action, hosts=list(hosts), incident_id=incident_id, reason=reason,
        evidence_json=json.dumps(dict(evidence or {}), default=str),
    )  # fmt: skip
    return _batch(run_id, attempt, action=record)


def selfcheck_batch(
    run_id: str, host: str, passed: bool, summary: str, figures: Iterable[Figure], *, attempt: int = 0, time_ns: int | None = None
) -> ingest_pb2.Batch:
    """A batch that stores one host's self-check (one row of ``selfchecks`` per figure)."""
    record = telemetry_pb2.SelfCheck(
        time_ns=time_ns or time.time_ns(), host=host, passed=passed, summary=summary,
        figures=[
            telemetry_pb2.SelfCheckFigure(check=f.check, value=f.value, unit=f.unit, reference=f.reference, passed=f.passed, detail=f.detail)
            for f in figures
        ],
    )  # fmt: skip
    return _batch(run_id, attempt, selfcheck=record)


def node_state_batch(
    run_id: str, host: str, state: str, *, actor: str, incident_id: str = "", reason: str = "", time_ns: int | None = None
) -> ingest_pb2.Batch:
    """A batch that stores one row of ``node_states``: ``host`` is now ``state``, because of ``incident_id``, as ``actor`` decided."""
    record = telemetry_pb2.NodeState(
        time_ns=time_ns or time.time_ns(), host=host, state=state, incident_id=incident_id, reason=reason, actor=actor
    )
    return _batch(run_id, 0, node_state=record)

"""The ranks' batches a relay's batch holds (``Batch.parts``): checked, and left out once stored.

A relay may spool a merged batch and die before its ranks hear that it took their batches; they
then send those batches to the collector themselves, before or after the relay's spool is sent.
The collector records the parts' ids with the relay's batch (writer.py), so whichever comes second
is stored only for what the first did not hold: a part sent again is a duplicate, and a relay's
batch leaves out the parts stored before it (``relay_merge.select``).
"""

from __future__ import annotations

from rankscope.agent.relay_merge import MERGED, rows, select
from rankscope.collector.batch_limits import IngestError
from rankscope.collector.writer import BatchKey
from rankscope.protos.v1 import ingest_pb2

__all__ = ["held_parts", "leave_out"]


def held_parts(batch: ingest_pb2.Batch, kind: str) -> tuple[BatchKey, ...]:
    """The parts of a decoded ``batch`` as batch keys; IngestError when they do not hold together."""
    if not batch.parts:
        return ()
    ids = {p.batch_id for p in batch.parts}
    if len(ids) != len(batch.parts) or batch.batch_id in ids or any(len(i) != len(batch.batch_id) for i in ids):
        raise IngestError("parts: each names its own 16-byte batch_id, none the batch's", "malformed")
    if kind not in MERGED:  # passed on as it came: the one batch it is
        if len(batch.parts) != 1:
            raise IngestError(f"parts: {len(batch.parts)} parts of a {kind} batch, which a relay passes on one by one", "count")
    elif sum(p.count for p in batch.parts) != (total := rows(kind, getattr(batch, kind))):
        raise IngestError(f"parts: {sum(p.count for p in batch.parts)} rows in {len(batch.parts)} parts of a {kind} batch of {total}", "count")
    return tuple(BatchKey(batch.run_id, p.rank, p.batch_id, kind) for p in batch.parts)


def leave_out(batch: ingest_pb2.Batch, kind: str, stored: frozenset[bytes]) -> ingest_pb2.Batch:
    """``batch`` without the parts in ``stored`` (no parts at all: nothing is left to store)."""
    keep = [p.batch_id not in stored for p in batch.parts]
    rest = ingest_pb2.Batch()
    rest.CopyFrom(batch)
    del rest.parts[:]
    rest.parts.extend(p for p, kept in zip(batch.parts, keep) if kept)
    if rest.parts and kind in MERGED:
        getattr(rest, kind).CopyFrom(select(kind, getattr(batch, kind), [p.count for p in batch.parts], keep))
    return rest

"""torch's flight recorder, read for the collectives no wrapper saw.

torch keeps each process group's recent operations in its flight recorders (private: see
``FlightRecorder``). The collective tracker reads them only for sequence numbers the wrappers
did not issue: DDP's C++ gradient reducer, the functional collectives of DTensor, compiled
graphs. Dumping costs about 20 ms for 2000 entries, so it happens only when such gaps exist, at
most every ``fr_interval_s``, and once more when a group shuts down (``destroy_process_group``
calls ``ProcessGroup.shutdown``, also wrapped): the last operations of a job would otherwise
leave with their group.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import torch

from rankscope.agent.config import warn_once

# Flight-recorder profiling names (after "gloo:" / "nccl:") in the wrappers' vocabulary.
FR_OPS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "reduce_scatter_base": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "allreduce_coalesced": "all_reduce_coalesced",
}
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
                "Bool": 1}  # fmt: skip
_DTYPE_NAMES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
                "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FrEntry:
    """The parts of a flight-recorder entry the agent uses."""

    group: str
    seq: int
    op: str
    p2p: bool
    nbytes: int
    dtype: str
    issue_ns: int
    start_ns: int
    end_ns: int
    completed: bool


@dataclasses.dataclass(frozen=True)
class FrDump:
    """One reading of both recorders: the entries, and how far each group is known to have completed."""

    entries: list[FrEntry]
    #: torch group name -> last completed collective seq (gloo reports it; NCCL marks entries)
    last_completed: dict[str, int]

    def done(self, e: FrEntry) -> bool:
        """Whether ``e`` has completed; when torch says nothing either way, it is taken as done."""
        last = self.last_completed.get(e.group)
        return e.completed or e.end_ns > 0 or last is None or e.seq <= last


class FlightRecorder:
    """Reads torch's flight recorders (private: guarded, parsed defensively).

    gloo's operations go to ``_dump_fr_trace``, NCCL's to ``_dump_nccl_trace`` (a recorder of
    CUDA events, in CUDA builds): both are read and merged.
    """

    def __init__(self) -> None:
        c10d = torch._C._distributed_c10d
        self._dumps = {name: getattr(c10d, name) for name in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(c10d, name)}
        if not self._dumps:
            warn_once("fr-missing", "torch has no flight recorder here: collectives issued outside Python are not recorded")

    def read(self) -> FrDump | None:
        """Every entry both recorders hold now; None when none can be read."""
        entries: list[FrEntry] = []
        completed: dict[str, int] = {}
        for name, dump in list(self._dumps.items()):
            try:
                try:
                    raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
                except TypeError:
                    raw = dump()
                trace = pickle.loads(raw)
                entries += [_entry(e) for e in trace.get("entries", ())]
                for group, seq in _last_completed(trace.get("pg_status", {})).items():
                    completed[group] = max(seq, completed.get(group, seq))
            except Exception as exc:  # noqa: BLE001 - a changed format turns this source off, nothing else
                warn_once(f"fr-format:{name}", f"torch's {name} could not be read ({exc!r}); it is not used")
                del self._dumps[name]
        return FrDump(entries, completed) if self._dumps else None


def _entry(e: dict[str, Any]) -> FrEntry:
    op = str(e.get("profiling_name", "")).split(":", 1)[-1]
    sizes, dtypes = e.get("input_sizes") or [], e.get("input_dtypes") or []
    nbytes = sum(math.prod(map(int, s)) * _DTYPE_BYTES.get(d, 0) for s, d in zip(sizes, dtypes))
    started, completed = e.get("time_discovered_started_ns"), e.get("time_discovered_completed_ns")
    return FrEntry(
        group=str(e["process_group"][0]), seq=int(e["collective_seq_id"]), op=FR_OPS.get(op, op),
        p2p=bool(e.get("is_p2p", False)), nbytes=nbytes, dtype=_DTYPE_NAMES.get(dtypes[0], dtypes[0]) if dtypes else "",
        issue_ns=int(e["time_created_ns"]), start_ns=int(started or 0), end_ns=int(completed or 0),
        completed=e.get("state") == "completed",
    )  # fmt: skip


def _last_completed(status: dict[str, Any]) -> dict[str, int]:
    out = {}
    for group, s in status.items():
        value = s.get("last_completed_collective") if isinstance(s, dict) else None
        if isinstance(value, int) and value >= 0:
            out[str(group)] = value
    return out


"""What this rank is doing right now: written by the training thread, read by the agent's threads.

The heartbeat reports it every few seconds and the stall detector watches ``last_progress_ns``;
both keep working while the training thread is stuck, which is what makes hangs visible. Writes
are single attribute stores and dict operations (atomic under the GIL), so the hot path takes
no lock; readers copy what they read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class InFlightOp:
    """A collective this rank has entered and not yet seen complete."""

    group: str
    seq: int
    op: str
    peer: int
    issue_ns: int
    waiting: bool  # blocked in it, not merely launched asynchronously


@dataclass
class RankState:
    step: int = 0
    #: the innermost open span's name, or "idle"
    phase: str = "idle"
    #: wall-clock ns of the last completed span or collective
    last_progress_ns: int = field(default_factory=time.time_ns)
    #: events the agent had to drop (full buffers); reported with heartbeats
    dropped: int = 0
    _in_flight: dict[tuple[str, int, str, int], InFlightOp] = field(default_factory=dict)

    def enter(self, op: InFlightOp) -> None:
        self._in_flight[(op.group, op.seq, op.op, op.peer)] = op

    def leave(self, group: str, seq: int, op: str, peer: int, now_ns: int) -> None:
        self._in_flight.pop((group, seq, op, peer), None)
        self.last_progress_ns = now_ns

    def progress(self, now_ns: int) -> None:
        self.last_progress_ns = now_ns

    def in_flight(self, limit: int = 16) -> list[InFlightOp]:
        """The oldest ``limit`` operations in flight (a copy, safe from any thread)."""
        ops = sorted(list(self._in_flight.values()), key=lambda o: o.issue_ns)
        return ops[:limit]

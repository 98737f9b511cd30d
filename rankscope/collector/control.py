"""Commands waiting for a rank's next acknowledgement: the only way from the collector back to agents.

An agent opens no port of its own (clusters rarely allow one); it learns what the collector
wants from the ``Ack`` of its next batch. Heartbeats keep a rank sending every few seconds even
while its training thread is stuck, which is exactly when a stack dump is wanted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rankscope.protos.v1 import ingest_pb2


class PendingCommands:
    """Stack-dump requests per (run_id, rank), each delivered once, in that rank's next Ack.

    Two requests before delivery make one dump (it answers both; the first reason is kept). A
    request nobody collects (the rank is gone) is forgotten after ``ttl_s``, so the table cannot
    grow without bound. Used from the server's event loop only: no lock.
    """

    def __init__(self, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self._clock = clock
        self._stacks: dict[tuple[str, int], tuple[str, float]] = {}

    def request_stack(self, run_id: str, rank: int, reason: str) -> None:
        now = self._clock()
        self._stacks = {key: entry for key, entry in self._stacks.items() if now - entry[1] < self.ttl_s}
        self._stacks.setdefault((run_id, rank), (reason, now))

    def take(self, run_id: str, rank: int) -> list[ingest_pb2.Command]:
        """The commands for this rank's Ack; they are gone afterwards."""
        entry = self._stacks.pop((run_id, rank), None)
        if entry is None or self._clock() - entry[1] >= self.ttl_s:
            return []
        return [ingest_pb2.Command(stack_dump=ingest_pb2.StackDumpRequest(reason=entry[0]))]

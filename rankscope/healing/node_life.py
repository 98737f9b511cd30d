"""A node's life as healing sees it, stored: healthy, suspect, checking, drained (with the incident), and back.

Each change is a row of ``node_states`` (``record.node_state_batch``), written by the driver of a
self-healing job or by a person (``rankscope node resume``); a node's state is its newest row, so
the store answers "which nodes are out, since when, for which incident" across runs and schedulers.

The rules that keep healing from doing harm (fail open):

- a node drained ``HOLD_DRAINS`` times within ``HOLD_WINDOW_S`` stays drained for a person: no
  automatic re-check brings it back (a node that fails, passes and fails again is flapping);
- a node comes back only after it passed a self-check again, judged against the figures its
  healthy peers measured (``REFERENCE_SQL``); with none stored, its figures are measured, not judged,
  and it passes when every test ran;
- never below ``--min-hosts`` and nothing older than its run: the driver's (``policy``, ``driver``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from rankscope.collector.client import Client
from rankscope.common.node_states import CHECKING, DRAINED, HEALTHY, HOLD_DRAINS, HOLD_WINDOW_S, NODES_SQL, SUSPECT, held
from rankscope.healing.probes import LOCAL_CHECKS
from rankscope.healing.record import Figure
from rankscope.healing.selfcheck import Runner, check_hosts
from rankscope.healing.verdict import HostResult

__all__ = [
    "CHECKING", "DRAINED", "HEALTHY", "HOLD_DRAINS", "HOLD_WINDOW_S", "NODES_SQL", "SUSPECT", "Nodes", "held", "nodes", "recheck", "reference",
]  # fmt: skip

#: the newest local figures of every other host whose self-check passed: what a node checked alone is judged against
REFERENCE_SQL = (
    "SELECT host, check, argMax(v, time) AS value, argMax(u, time) AS unit FROM (SELECT host, check, time, value AS v, unit AS u "
    "FROM selfchecks WHERE host != {host:String} AND host_passed = 1 AND passed = 1 AND isFinite(value) AND check IN {checks:Array(String)}) "
    "GROUP BY host, check ORDER BY host, check"
)


class Nodes(Protocol):
    """What a scheduler lets healing do to a node outside any job's allocation (a person's ``rankscope node``)."""

    def drain(self, host: str, reason: str) -> str:
        """Keep every job off ``host``, with ``reason`` where the scheduler keeps one; what was done."""
        ...

    def holding(self, host: str) -> AbstractContextManager[Runner]:
        """``host`` reachable for a self-check while no job may land on it: the runner of its commands.
        Once the hold ends, jobs land on it again unless it was drained meanwhile."""
        ...

    def states(self) -> dict[str, tuple[str, str]]:
        """Each node's state as the scheduler says it, and its reason."""
        ...


def nodes(client: Client) -> list[dict[str, Any]]:
    """Every node healing has an opinion of: its newest state (``NODES_SQL``'s columns)."""
    return client.query(NODES_SQL).to_pylist()


def reference(client: Client, host: str) -> dict[str, list[Figure]]:
    """The figures ``host``'s healthy peers measured last: host -> its local figures."""
    rows = client.query(REFERENCE_SQL, {"host": host, "checks": list(LOCAL_CHECKS)}).to_pylist()
    peers: dict[str, list[Figure]] = {}
    for row in rows:
        peers.setdefault(row["host"], []).append(Figure(row["check"], float(row["value"]), row["unit"]))
    return peers


def recheck(host: str, runner: Runner, peers: Mapping[str, Sequence[Figure]], *, ranks: int = 2, timeout_s: float = 20.0) -> HostResult:
    """``host``'s local tests, judged against ``peers``' stored figures (not measured again)."""
    return check_hosts([host], runner, ranks=ranks, timeout_s=timeout_s, links=False, peers=peers).host(host)


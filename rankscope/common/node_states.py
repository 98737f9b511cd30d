"""A node's states in its life as healing sees it, and how every part reads them from ``node_states``.

The collector checks what is stored against ``NODE_STATES``, the healing driver and ``rankscope node``
write and read them (``rankscope.healing.node_life``), the dashboard's hosts page shows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CHECKING", "DRAINED", "HEALTHY", "HOLD_DRAINS", "HOLD_WINDOW_S", "NODES_SQL", "NODE_STATES", "SUSPECT", "held"]

NODE_STATES = ("healthy", "suspect", "checking", "drained")
HEALTHY, SUSPECT, CHECKING, DRAINED = NODE_STATES
#: a node drained this many times within ``HOLD_WINDOW_S`` stays drained until a person resumes it
HOLD_DRAINS = 2
HOLD_WINDOW_S = 3600

#: each node's newest state, and how many times it was drained within the hold window
NODES_SQL = (
    "SELECT host, argMax(s, time) AS state, max(time) AS since, argMax(r, time) AS run_id, argMax(i, time) AS incident_id, "
    "argMax(why, time) AS reason, argMax(who, time) AS actor, "
    f"countIf(s = '{DRAINED}' AND time > now64(9) - INTERVAL {HOLD_WINDOW_S} SECOND) AS drains "
    "FROM (SELECT host, time, state AS s, run_id AS r, incident_id AS i, reason AS why, actor AS who FROM node_states) "
    "GROUP BY host ORDER BY host"
)


def held(node: Mapping[str, Any]) -> bool:
    """Whether ``node`` (a row of ``NODES_SQL``) stays drained for a person: drained too often lately."""
    return node["state"] == DRAINED and int(node["drains"]) >= HOLD_DRAINS

"""What each rank was doing at a moment, named from its heartbeats, its exit and the incidents.

Pure functions over the rows of ``data.rank_states`` so the rules can be tested without a store.
The states, worst first (an aggregate of several ranks, a host or a stage, shows its worst):

- crashed: it ended abnormally (exception, non-zero exit, a signal);
- silent: no heartbeat for ``SILENT_AFTER_S`` and no last word (process or host lost);
- blocked: the root of an open hang (in no collective the others wait in: everybody waits for
  it), or its agent saw no progress for a long time (heartbeat status ``stalled``) outside any
  collective;
- straggler: an open straggler incident names it (it computes, but slower than its stage);
- waiting: in a collective or transfer (group G, sequence N) for the others to arrive;
- computing: in a segment of its own (forward, backward, optimizer ...);
- finished: it ended normally;
- not started: no heartbeat yet.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from rankscope.common.settings import Settings
from rankscope.common.incidents import Incident

STATES: tuple[str, ...] = ("crashed", "silent", "blocked", "straggler", "waiting", "computing", "finished", "not started")
#: the collector's default: a rank quiet this long without a last word is lost
SILENT_AFTER_S = Settings().silent_after_s
#: an incident still counts this long after its last sighting (a closed straggler incident's last
#: sighting is the start of its last slow step, not the end of the fault)
INCIDENT_GRACE_S = 30.0


def active_incidents(incidents: Iterable[Incident], kind: str, at_ns: int) -> list[Incident]:
    """The incidents of ``kind`` that had begun at ``at_ns`` and were not over yet."""
    grace = INCIDENT_GRACE_S * 1e9
    return [
        i for i in incidents
        if i.finding.kind == kind and i.finding.first_seen_ns <= at_ns
        and (i.status == "open" or at_ns <= i.finding.last_seen_ns + grace)
    ]  # fmt: skip


def classify(rows: pd.DataFrame, at_ns: int, stragglers: Iterable[int] = (), roots: Iterable[int] = ()) -> pd.DataFrame:
    """``rows`` with two more columns: ``state`` (one of STATES) and ``detail`` (a phrase for people).

    Vectorised with numpy: it runs on every rank of a 12,288-rank run on each redraw.
    """
    out = rows.copy()
    reason = out["exit_reason"].fillna("").astype(str)
    beat = out["beat_ns"].fillna(0).astype("int64")
    silent_for = (at_ns - beat) / 1e9
    waiting_in = out["wait_group"].fillna("").astype(str)
    where = out["wait_op"].astype(str) + " " + waiting_in + " #" + out["wait_seq"].astype(str)
    doing = out["phase"].astype(str) + " at step " + out["step"].astype(str)
    is_root = out["rank"].isin(list(roots))
    stalled = out["beat_status"] == "stalled"
    # First match wins. A finished rank's heartbeats also stop: its exit decides before silence does.
    # A rank stalled inside a collective is waiting (for whoever has not arrived); stalled elsewhere,
    # it is blocked on something of its own, like the root of a hang.
    rules = [
        ((reason != "") & (reason != "normal"), "crashed", "ended: " + reason + " " + out["exit_message"].fillna("").astype(str).str.slice(0, 120)),
        (reason == "normal", "finished", "finished normally"),
        (beat == 0, "not started", "no heartbeat yet"),
        (silent_for > SILENT_AFTER_S, "silent", "silent for " + silent_for.round(0).astype(int).astype(str) + " s, last in " + doing),
        (is_root, "blocked", "hang root: everybody waits for it; in " + doing),
        (out["rank"].isin(list(stragglers)), "straggler", "straggler, in " + doing),
        (waiting_in != "", "waiting", "waiting in " + where + np.where(stalled, " (no progress for a while)", "")),
        (stalled, "blocked", "no progress, in " + doing),
    ]
    out["state"] = np.select([r[0] for r in rules], [r[1] for r in rules], "computing")
    out["detail"] = np.select([r[0] for r in rules], [_text(r[2], out.index) for r in rules], "computing: in " + doing)
    return out


def _text(value: str | pd.Series, index: pd.Index) -> pd.Series:
    return value if isinstance(value, pd.Series) else pd.Series(value, index=index)


def worst(states: pd.Series) -> str:
    """The worst of several ranks' states (STATES order)."""
    present = set(states)
    return next(s for s in STATES if s in present) if present else "not started"

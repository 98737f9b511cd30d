"""Restarts and the self-healing driver's record as the pages show them; pure, no Streamlit.

A run restarted by torchrun's elastic agent under ``rankscope launch`` keeps its id; each restart
is an attempt (0 the first). The driver writes what it decided and did to the ``actions`` table
(incident, selfcheck, evict, restart, resumed, finished, gave_up) and each host's self-check, figure
by figure, to ``selfchecks``. These functions take what ``data.attempts``, ``data.actions`` and
``data.selfchecks`` return and make the rows the pages and figures show, so they can be tested
with small hand-written frames.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

RESTART_COLUMNS = ("attempt", "step", "time_ns", "left_out", "reason", "steps_lost", "seconds", "label")
#: the evidence keys of a "resumed" action
RESUMED_KEYS = ("resumed_step", "steps_lost", "seconds")


def evidence(text: object) -> dict[str, Any]:
    """An action's evidence (JSON text) as a dict; {} when there is none or it is not a JSON object."""
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(str(text)) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _number(value: object) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def restarts(attempts: pd.DataFrame, actions: pd.DataFrame) -> pd.DataFrame:
    """One row per attempt after the first, in order: where it began and why.

    ``attempts``: attempt, first_step, start_ns (``data.attempts``); ``actions``: time_ns, attempt,
    action, hosts, reason, evidence (``data.actions``); either may be empty. Returns attempt; step
    (its first step: the "resumed" action's ``resumed_step``, else the first step it recorded; -1
    while neither is known); time_ns (when it began: its first span, else the "resumed" action);
    left_out (the hosts evicted since the previous attempt began); reason (of its "restart" action,
    else of the last eviction); steps_lost, seconds (the "resumed" action's evidence, NaN without); label
    ("attempt 1: restarted without node-2").
    """
    firsts = {int(a.attempt): a for a in attempts.itertuples()} if len(attempts) else {}
    acts = actions.sort_values("time_ns", kind="stable") if len(actions) else actions
    resumed = {int(a.attempt): a for a in acts.itertuples() if a.action == "resumed"} if len(acts) else {}
    known = set(firsts) | set(resumed)
    if len(acts):
        known |= {int(a.attempt) for a in acts.itertuples() if a.action == "restart"}
    rows: list[dict[str, Any]] = []
    since = -math.inf  # when the previous attempt began: the actions after it led to this restart
    for attempt in sorted(a for a in known if a > 0):
        first, back = firsts.get(attempt), resumed.get(attempt)
        said = evidence(back.evidence) if back is not None else {}
        step = _number(said.get("resumed_step"))
        if step is None and first is not None:
            step = float(first.first_step)
        began = float(first.start_ns) if first is not None else float(back.time_ns) if back is not None else math.inf
        # the actions that led here: up to its first step ("resumed" is written once that has run);
        # while it has no step yet, everything since the previous attempt began
        until = max(began, float(back.time_ns)) if back is not None else began
        window = acts[(acts["time_ns"] > since) & (acts["time_ns"] <= until)] if len(acts) else acts
        left_out: list[str] = []
        for hosts in window[window["action"] == "evict"]["hosts"] if len(window) else ():
            left_out += [str(h) for h in hosts if str(h) not in left_out]
        # why: the restart recorded under this attempt (whenever the driver noticed it), else one in the
        # window, else the last eviction
        said_restart = [str(a.reason) for a in acts.itertuples() if a.action == "restart" and int(a.attempt) == attempt] if len(acts) else []
        why = {kind: [str(r) for r in window[window["action"] == kind]["reason"]] if len(window) else [] for kind in ("restart", "evict")}
        reason = next((r for r in reversed([*why["evict"], *why["restart"], *said_restart]) if r), "")  # the strongest last
        label = f"attempt {attempt}: restarted" + (f" without {', '.join(left_out)}" if left_out else "")
        rows.append({
            "attempt": attempt, "step": int(step) if step is not None else -1,
            "time_ns": int(began) if math.isfinite(began) else 0, "left_out": left_out, "reason": reason,
            "steps_lost": _number(said.get("steps_lost")), "seconds": _number(said.get("seconds")), "label": label,
        })  # fmt: skip
        since = until
    return pd.DataFrame(rows, columns=list(RESTART_COLUMNS)).astype({"steps_lost": float, "seconds": float})


def restart_sentence(restart: Mapping[str, Any]) -> str:
    """One restart in words: "attempt 1: restarted without node-2, from step 7 (2 steps run again,
    resumed after 41 s): reason"."""
    text = str(restart["label"])
    if int(restart["step"]) > 0:
        text += f", from step {int(restart['step'])}"
    extra = []
    lost = restart.get("steps_lost")
    if lost is not None and not pd.isna(lost):
        extra.append(f"{int(lost)} step{'s' if int(lost) != 1 else ''} run again")
    seconds = restart.get("seconds")
    if seconds is not None and not pd.isna(seconds):
        extra.append(f"resumed after {seconds:.0f} s")
    if extra:
        text += f" ({', '.join(extra)})"
    if restart.get("reason"):
        text += f": {restart['reason']}"
    return text


def _details(action: str, incident_id: str, said: Mapping[str, Any]) -> str:
    """The evidence of one action in a few words (a resumed action's figures; scalars otherwise)."""
    if action == "resumed" and any(k in said for k in RESUMED_KEYS):
        parts = []
        if "resumed_step" in said:
            parts.append(f"at step {said['resumed_step']}")
        if "steps_lost" in said:
            parts.append(f"{said['steps_lost']} steps lost")
        if _number(said.get("seconds")) is not None:
            parts.append(f"{float(said['seconds']):.0f} s")
        return ", ".join(parts)
    parts = [f"incident {incident_id}"] if incident_id else []
    parts += [f"{k}={v}" for k, v in said.items() if isinstance(v, (str, int, float, bool)) and len(str(v)) <= 40]
    text = ", ".join(parts)
    return text if len(text) <= 160 else text[:157] + "..."


def actions_table(actions: pd.DataFrame) -> pd.DataFrame:
    """The actions as a table: time_ns, attempt, action, hosts, reason, details (oldest first)."""
    columns = ["time_ns", "attempt", "action", "hosts", "reason", "details"]
    if actions.empty:
        return pd.DataFrame(columns=columns)
    rows = [
        {"time_ns": int(a.time_ns), "attempt": int(a.attempt), "action": str(a.action), "hosts": ", ".join(map(str, a.hosts)) or "-",
         "reason": str(a.reason) or "-", "details": _details(str(a.action), str(a.incident_id), evidence(a.evidence)) or "-"}
        for a in actions.sort_values("time_ns", kind="stable").itertuples()
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


def _figure(value: float) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.4g}"


def selfcheck_table(checks: pd.DataFrame) -> pd.DataFrame:
    """The self-check figures as a table, failures first: time_ns, host, check, value, unit,
    peers' median, passed (✅ or ❌)."""
    columns = ["time_ns", "host", "check", "value", "unit", "peers' median", "passed"]
    if checks.empty:
        return pd.DataFrame(columns=columns)
    ordered = checks.assign(ok=checks["passed"].astype(bool)).sort_values(["ok", "time_ns", "host", "check"], ascending=[True, False, True, True])
    return pd.DataFrame({
        "time_ns": ordered["time_ns"].astype("int64"), "host": ordered["host"].astype(str), "check": ordered["check"].astype(str),
        "value": ordered["value"].map(_figure), "unit": ordered["unit"].astype(str), "peers' median": ordered["reference"].map(_figure),
        "passed": ordered["ok"].map({True: "✅", False: "❌"}),
    }, columns=columns).reset_index(drop=True)  # fmt: skip


def host_verdicts(checks: pd.DataFrame) -> pd.DataFrame:
    """Each host's newest self-check verdict: host, time_ns, passed, summary, failed (its failed checks)."""
    columns = ["host", "time_ns", "passed", "summary", "failed"]
    if checks.empty:
        return pd.DataFrame(columns=columns)
    newest = checks[checks["time_ns"] == checks.groupby("host")["time_ns"].transform("max")]
    rows = []
    for host, one in newest.groupby("host", sort=True):
        failed = sorted(set(one.loc[~one["passed"].astype(bool), "check"].astype(str)))
        rows.append({"host": str(host), "time_ns": int(one["time_ns"].iloc[0]), "passed": bool(one["host_passed"].astype(bool).all()),
                     "summary": str(one["summary"].iloc[0]), "failed": failed})  # fmt: skip
    return pd.DataFrame(rows, columns=columns).sort_values(["passed", "host"]).reset_index(drop=True)

"""The environment that switches the agent on in a job's ranks, written in one place.

Whatever starts ranks with the agent (the demo, the scenarios, the test bed, the healing launcher,
``rankscope spool replay``) builds its ``RANKSCOPE_*`` variables here, so a new setting or a
renamed variable cannot be missed by one of them. ``rankscope.agent.config`` reads them back.
"""

from __future__ import annotations

from pathlib import Path


def agent_environment(
    collector: str | None,
    run_id: str | None = None,
    *,
    spool_dir: Path | str | None = None,
    host: str | None = None,
    every_s: float | None = None,
    token: str | None = None,
    tls_ca: str | None = None,
    relay: str | None = None,
) -> dict[str, str]:
    """``RANKSCOPE_*`` variables for ranks sending to ``collector`` (the agent's default when None)
    as run ``run_id`` (agreed between the ranks when None); ``host``: the host-name template;
    ``every_s``: heartbeats and sends this often (faster than the default makes faults show up
    sooner); ``relay``: this host's relay (``rankscope relay``). Settings left None are not set, so the
    agent's defaults apply."""
    settings = {
        "RANKSCOPE_COLLECTOR": collector, "RANKSCOPE_RUN_ID": run_id, "RANKSCOPE_HOST": host,
        "RANKSCOPE_HEARTBEAT_S": every_s, "RANKSCOPE_FLUSH_S": every_s,
        "RANKSCOPE_SPOOL_DIR": spool_dir, "RANKSCOPE_TOKEN": token, "RANKSCOPE_TLS_CA": tls_ca,
        "RANKSCOPE_RELAY": relay,
    }  # fmt: skip
    return {"RANKSCOPE_ENABLE": "1", **{name: _text(value) for name, value in settings.items() if value is not None}}


def _text(value: object) -> str:
    """``1`` for 1.0 (the agent's parser takes either, people read the shorter)."""
    return f"{value:g}" if isinstance(value, float) else str(value)

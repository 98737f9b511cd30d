"""This host's relay beside a job's processes: started before them, stopped once they have ended.

``rankscope train`` does this for its one host; ``rankscope launch`` runs every host's torchrun
agent as ``python -m rankscope.agent.host_relay --listen unix:PATH -- COMMAND...``, so that each
host gets a relay of its own (docs/relay.md). Nothing is started when the agent is off, or when a
relay already answers there; a relay that fails to start leaves the ranks to send to the
collector themselves.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from rankscope.common.listening import answers

__all__ = ["RELAY_STOP_S", "main", "requested", "start", "stop"]

#: how long the relay has to spool and send what waits once the ranks have ended
RELAY_STOP_S = 30.0


def requested(environ: Mapping[str, str]) -> str | None:
    """This host's relay (``unix:PATH``) when ``environ`` asks for one: the agent on and $RANKSCOPE_RELAY
    a Unix socket; else None (another host's address is not ours to start)."""
    relay = environ.get("RANKSCOPE_RELAY", "")
    return relay if environ.get("RANKSCOPE_ENABLE") == "1" and relay.startswith("unix:") else None


def start(environ: Mapping[str, str], who: str) -> subprocess.Popen[bytes] | None:
    """``rankscope relay`` on ``environ``'s $RANKSCOPE_RELAY, once it listens; None when none is asked
    for, one answers there already, or it did not start (``who`` says so)."""
    from rankscope.agent.config import load_config

    if requested(environ) is None:
        return None
    config = load_config(environ)
    if config is None or config.relay is None or answers(config.relay):
        return None
    relay = subprocess.Popen([sys.executable, "-m", "rankscope.cli.main", "relay"], stdout=subprocess.PIPE, env=dict(environ))
    line = relay.stdout.readline() if relay.stdout is not None else b""  # "ready on ...", or nothing: it failed
    if b"ready" not in line:
        relay.wait(RELAY_STOP_S)
        print(f"{who}: the relay on {config.relay} did not start; the ranks send to the collector directly", flush=True)
        return None
    return relay


def stop(relay: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM: it spools what waits and sends what it can within seconds; the rest stays spooled."""
    if relay is not None:
        relay.terminate()
        try:
            relay.wait(RELAY_STOP_S)
        except subprocess.TimeoutExpired:  # what it had not sent stays in its spool, replayed with the ranks' leftovers
            relay.kill()
            relay.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """``--listen unix:PATH -- COMMAND...``: COMMAND with this host's relay on PATH beside it (its
    ranks find it in $RANKSCOPE_RELAY); COMMAND's exit status. SIGTERM and SIGINT go on to COMMAND."""
    parser = argparse.ArgumentParser(prog="python -m rankscope.agent.host_relay")
    parser.add_argument("--listen", required=True, metavar="unix:PATH")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the command after --")
    environ = {**os.environ, "RANKSCOPE_RELAY": args.listen}
    relay = start(environ, "rankscope launch")
    try:
        child = subprocess.Popen(command, env=environ)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: child.send_signal(signum))
        return child.wait()
    finally:
        stop(relay)


if __name__ == "__main__":
    sys.exit(main())

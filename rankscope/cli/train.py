"""``rankscope train``: run the bundled trainer; every argument goes to it unparsed.

When the job ends, what its ranks' agents could not send before they exited (a collector too busy
to acknowledge in time, or away) is still in their spool: it is sent then, so that the run is whole
in the store when the command returns (``rankscope diagnose`` right after reads all of it).

With ``RANKSCOPE_RELAY=unix:/PATH`` and the agent on, it starts this host's relay there for the
job (``rankscope relay``; unless one already answers there), and stops it once the ranks have ended:
what the relay could not send in time is in the spool, sent with the ranks' leftovers.
"""

from __future__ import annotations

import argparse
import os

HELP = "run the bundled trainer (all arguments go to it: see `rankscope train --help`)"
PASSTHROUGH = True
#: how long the launcher spends sending what the ranks left in their spool
REPLAY_TIMEOUT_S = 120.0


def run(args: argparse.Namespace) -> int:
    # Imported here so that `rankscope --help` never imports torch.
    from rankscope.agent import host_relay
    from rankscope.trainer.torchrun import main as launch_main

    relay = host_relay.start(os.environ, "rankscope train")
    try:
        status = launch_main(list(args.argv))
    finally:
        host_relay.stop(relay)
    _replay_leftovers()
    return status


def _replay_leftovers() -> None:
    """Send the spool segments the ranks left behind, when the agent was on and left some."""
    from rankscope.agent.config import load_config
    from rankscope.agent.spool import leftovers
    from rankscope.cli.spool import replay

    if os.environ.get("RANKSCOPE_ENABLE") != "1":
        return
    config = load_config(os.environ)  # the ranks warned about any bad variable already
    if config is None or not config.spool_dir.is_dir():
        return
    left = leftovers(config.spool_dir)
    if left:
        print(f"rankscope train: the ranks left {len(left)} spool segment file(s) in {config.spool_dir}; "
              f"sending them to {config.collector} (up to {REPLAY_TIMEOUT_S:.0f} s)", flush=True)  # fmt: skip
        replay(config, REPLAY_TIMEOUT_S, "rankscope train")

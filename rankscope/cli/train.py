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


def run(args: argparse.Namespace) -> int:
    # Imported here so that `rankscope --help` never imports torch.
    from rankscope.agent import host_relay
    from rankscope.cli.spool import replay_after_job
    from rankscope.trainer.torchrun import main as launch_main

    relay = host_relay.start(os.environ, "rankscope train")
    try:
        status = launch_main(list(args.argv))
    finally:
        host_relay.stop(relay)
    replay_after_job(os.environ, "rankscope train")
    return status


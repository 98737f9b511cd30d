"""``rankscope train``: run the bundled trainer; every argument goes to it unparsed."""

from __future__ import annotations

import argparse

HELP = "run the bundled trainer (all arguments go to it: see `rankscope train --help`)"
PASSTHROUGH = True


def run(args: argparse.Namespace) -> int:
    # Imported here so that `rankscope --help` never imports torch.
    from rankscope.trainer.launch import main as launch_main

    return launch_main(list(args.argv))

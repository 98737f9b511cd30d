"""``rankscope train``: validate the configuration, then launch torchrun on this machine.

Sizes that do not divide and malformed fault specs are refused here, before any process starts.
The ranks get the validated configuration written back as a command line (``rank_argv``), not
the user's words: torchrun's parser would read those too (see ``rank_argv``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from rankscope.agent.autoload import forbid
from rankscope.trainer.config import parse_args, rank_argv


def torchrun_command(argv: list[str], nproc: int) -> list[str]:
    """The torchrun command line that runs the trainer with ``argv`` (``rank_argv``'s) on ``nproc`` local ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "rankscope.trainer", *argv,
    ]  # fmt: skip


def main(argv: list[str]) -> int:
    """Launch a standalone torchrun job for ``argv`` (trainer flags) and return its exit status."""
    forbid("launcher", children=False)  # the ranks it starts record; this process does not
    cfg = parse_args(argv)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # rank_argv carries --inject, also when the spec came from RANKSCOPE_INJECT
    process = subprocess.Popen(torchrun_command(rank_argv(cfg), cfg.world_size), env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:  # torchrun got the same SIGINT and stops its ranks; wait for it
        return process.wait()

"""``rankscope train``: validate the configuration, then launch torchrun on this machine.

Sizes that do not divide and malformed fault specs are refused here, before any process starts;
with ``--dp 0`` (auto) the launcher needs ``--nproc`` to know how many ranks it starts.
The ranks get the validated configuration written back as a command line (``rank_argv``), not
the user's words: torchrun's parser would read those too (see ``rank_argv``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from rankscope.agent.autoload import forbid
from rankscope.trainer import torchrun_launcher
from rankscope.trainer.train_config import ConfigError, TrainConfig, parse_args, rank_argv


def torchrun_command(argv: list[str], nproc: int) -> list[str]:
    """The torchrun command line that runs the trainer with ``argv`` (``rank_argv``'s) on ``nproc`` local ranks."""
    return torchrun_launcher.command("--standalone", f"--nproc-per-node={nproc}", "-m", "rankscope.trainer", *argv)


def planned(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as the ranks will resolve it on this machine, so that ``--dp 0`` is checked before anything starts."""
    if cfg.dp == 0 and cfg.nproc is None:
        raise ConfigError("--dp 0 (auto) needs --nproc: the data-parallel size follows the number of ranks started")
    return cfg.resolved(cfg.nproc if cfg.nproc is not None else cfg.world_size)


def main(argv: list[str]) -> int:
    """Launch a standalone torchrun job for ``argv`` (trainer flags) and return its exit status."""
    forbid("launcher", children=False)  # the ranks it starts record; this process does not
    cfg = parse_args(argv)
    try:
        nproc = planned(cfg).world_size
    except ConfigError as exc:
        print(f"rankscope train: error: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # rank_argv carries --inject (also when the spec came from RANKSCOPE_INJECT) and --dp 0, which the ranks resolve
    process = subprocess.Popen(torchrun_command(rank_argv(cfg), nproc), env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:  # torchrun got the same SIGINT and stops its ranks; wait for it
        return process.wait()

"""``python -m rankscope.trainer.torchrun_launcher ARGS``: torchrun (its console script's ``main``) as
rankscope runs its own jobs (``rankscope train``, ``rankscope launch``): torch imported under
``frozen_imports`` (0.7 s of CPU less for each agent), and the bundled trainer's ranks forked.

A rank of ``-m rankscope.trainer`` is forked from the agent process (``rankscope.trainer.forked_rank``),
which has imported torch, ``torch._dynamo`` (torch.optim's step imports it) and the trainer once: each
rank starts with them imported instead of importing them again. An 8-rank ``rankscope train`` of 3 tiny
steps on 2 cores: 15.9 s of wall and 28.7 s of CPU as fresh interpreters, 4.4 s and 5.0 s forked. Any
other program runs as torchrun runs it, a fresh interpreter a rank; a user's own ``torchrun`` is theirs.

A job that restarts (``rankscope launch``) restarts its ranks as forks too, faster than the collector's
``--silent-after``: the crash detector judges the attempt before the newest as it ended, so that the
host lost just before a restart is still named (``collector.diagnosis.crash.previous_attempt``).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["FORKED_MODULE", "command"]

#: the program whose ranks are forked: ``-m rankscope.trainer``
FORKED_MODULE = "rankscope.trainer"


def command(*args: str) -> list[str]:
    """The command line that runs torchrun with ``args`` in this interpreter (the bundled trainer's
    ranks forked from the agent, any other program started as torchrun starts it)."""
    return [sys.executable, "-m", "rankscope.trainer.torchrun_launcher", *args]


def _config_from_args(original: Any) -> Any:
    """torchrun's ``config_from_args``, with the trainer's ranks turned into forks of the agent."""

    def config_from_args(args: Any) -> tuple[Any, Any, list[str]]:
        config, cmd, cmd_args = original(args)
        if isinstance(cmd, str) and cmd_args[:3] == ["-u", "-m", FORKED_MODULE]:
            from rankscope.common.frozen_imports import frozen_imports

            with frozen_imports():  # what every rank would import, imported once
                import torch._dynamo  # noqa: F401 - torch.optim's step imports it

                from rankscope.trainer import forked_rank
            config.start_method = "fork"
            return config, forked_rank.run, cmd_args[3:]
        return config, cmd, cmd_args

    return config_from_args


if __name__ == "__main__":
    from rankscope.common.frozen_imports import frozen_imports

    with frozen_imports():
        from torch.distributed import run as torchrun
    torchrun.config_from_args = _config_from_args(torchrun.config_from_args)
    sys.argv[0] = "torchrun"
    sys.exit(torchrun.main())

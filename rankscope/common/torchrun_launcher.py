"""``python -m rankscope.common.torchrun_launcher ARGS``: torchrun (its console script's ``main``), with torch
imported under ``frozen_imports``: 0.7 s of CPU less for each agent, ahead of its ranks' start.
rankscope starts its own jobs' agents this way (``rankscope train``, ``rankscope launch``); a user's
``torchrun`` is theirs."""

from __future__ import annotations

import sys

__all__ = ["command"]


def command(*args: str) -> list[str]:
    """The command line that runs torchrun with ``args`` in this interpreter."""
    return [sys.executable, "-m", "rankscope.common.torchrun_launcher", *args]


if __name__ == "__main__":
    from rankscope.common.frozen_imports import frozen_imports

    with frozen_imports():
        from torch.distributed.run import main
    sys.argv[0] = "torchrun"
    sys.exit(main())

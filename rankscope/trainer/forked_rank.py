"""One rank of the bundled trainer forked from torchrun's agent (``rankscope.trainer.torchrun_launcher``):
what ``python -m rankscope.trainer`` does as a fresh interpreter, with torch already imported.

A fork starts as a copy of the agent: its name and, in /proc, its environment (``name_forked_rank``),
torch elastic's signal handlers, the agent's decision not to record (it is no rank), the interpreter's intra-op thread count from before torchrun set
``OMP_NUM_THREADS``. Each is made what a new process would have. It ends as an interpreter would:
an uncaught exception through ``sys.excepthook`` (printed; the rankscope agent records it),
``sys.exit``'s code, the ``atexit`` functions (the agent's last word) run; then a non-zero status ends
the process with it, and a clean end returns to torch elastic, which collects every rank's return.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
from pathlib import Path

from rankscope.common.processes import name_forked_rank
from rankscope.trainer.train import main  # imported once, by the agent that forks the ranks

__all__ = ["run"]

#: the signals torch elastic's agent handles in Python (it raises on them), back to an interpreter's defaults
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def run(*argv: str) -> None:
    """The rank: ``rankscope.trainer``'s main with ``argv``, started and ended as its own process."""
    _as_new_process(argv)
    try:
        code = _exit_code(main(list(argv)))
    except SystemExit as end:
        code = _exit_code(end.code)
    except BaseException:  # noqa: BLE001 - an interpreter reports any uncaught exception, then ends with 1
        sys.excepthook(*sys.exc_info())
        code = 1
    gc.freeze()  # what training made: the process ends here, nothing is collected any more
    atexit._run_exitfuncs()  # noqa: SLF001 - a forked process ends through os._exit, which runs none
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code:
        os._exit(code)


def _as_new_process(argv: tuple[str, ...]) -> None:
    for number in _AGENT_SIGNALS:
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [str(Path(__file__).with_name("__main__.py")), *argv]
    name_forked_rank(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]))
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # the agent imported torch before torchrun set the variable
    from rankscope.agent import autoload

    autoload.forked_rank()


def _exit_code(status: object) -> int:
    """The process's exit status for ``sys.exit(status)``, as the interpreter makes it."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    print(status, file=sys.stderr)
    return 1

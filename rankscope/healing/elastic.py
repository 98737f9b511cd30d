"""torchrun's elastic agent as a self-healing job starts it on each host, and the rendezvous store it meets at.

One agent per host (``--nnodes MIN:N``, ``--max-restarts``), all clients of a c10d store served by
a process of its own (``rankscope.healing.rendezvous``) outside the training hosts' fate: a host
whose keep-alive stops is dropped from the rendezvous within a few seconds (``keep_alive_interval``
x ``keep_alive_max_attempt``), and the survivors wait ``last_call_timeout`` for late joiners before
they go on without it. The test bed (``rankscope.testbed.healing_job``) and a Slurm allocation
(``rankscope.healing.slurm_job``) start the same command line. When the job asks for relays
(``RANKSCOPE_RELAY``), the agent runs beside its host's relay (``rankscope.agent.host_relay``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rankscope.agent.host_relay import requested
from rankscope.common.processes import terminate_tree
from rankscope.trainer import torchrun_launcher

__all__ = ["RDZV_CONF", "RDZV_PORT", "RendezvousError", "agent_command", "relay_socket", "start_rendezvous"]

RDZV_PORT = 29400
#: torchrun's c10d rendezvous settings of a self-healing job (seconds)
RDZV_CONF = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 8, "join_timeout": 300}


class RendezvousError(RuntimeError):
    """The rendezvous store did not start: what its log says."""


def agent_command(
    program: Sequence[str], *, run_id: str, nnodes: str, ranks_per_host: int, endpoint: str, max_restarts: int,
    rdzv_conf: Mapping[str, object], relay: str | None = None,
) -> list[str]:  # fmt: skip
    """torchrun's elastic agent for one host: ``program`` (a script and its arguments, or ``-m
    module ...``) on ``ranks_per_host`` ranks, meeting the others at ``endpoint`` under ``run_id``;
    with this host's relay on ``relay`` (``unix:PATH``) beside it, its ranks sending through it."""
    beside = [sys.executable, "-m", "rankscope.agent.host_relay", "--listen", relay, "--"] if relay else []
    return [
        *beside,
        *torchrun_launcher.command(
            f"--nnodes={nnodes}", f"--nproc-per-node={ranks_per_host}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", f"--rdzv-conf={','.join(f'{k}={v}' for k, v in rdzv_conf.items())}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", *program,
        ),
    ]  # fmt: skip


def relay_socket(environ: Mapping[str, str], host: str) -> str | None:
    """Where ``host``'s relay listens when the job asks for relays (``agent.host_relay.requested``),
    else None: the path with the host's name added, so that hosts sharing a file system (a test bed's,
    a cluster's home directories) each get a socket of their own."""
    relay = requested(environ)
    if relay is None:
        return None
    path = Path(relay.removeprefix("unix:"))
    return f"unix:{path.with_name(f'{path.stem}-{host}{path.suffix}')}"


def start_rendezvous(listen: str, log: Path, *, prefix: Sequence[str] = (), timeout_s: float = 30) -> subprocess.Popen[bytes]:
    """Serve a job's c10d store at ``listen`` (ADDRESS:PORT), run after ``prefix`` (a command that
    enters the host it must run on); returns once it listens. The agent stays off in it."""
    env = {k: v for k, v in os.environ.items() if k != "RANKSCOPE_ENABLE"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "rankscope.healing.rendezvous", "--listen", listen],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while b"serving" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            terminate_tree(proc, 1)
            raise RendezvousError(f"the rendezvous store did not start at {listen}: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return proc

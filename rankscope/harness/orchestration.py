"""Running a local rankscope set-up as child processes: a collector, an 8-rank training run, a dashboard.

Shared by the fault scenarios (``rankscope/harness/local_scenarios.py``) and ``rankscope demo``
(``rankscope/harness/demo.py``), so that both start the processes the same way and stop every one of them:
each child runs in a session of its own with its output in a log file (a chatty child never blocks
on a full pipe), and stopping one stops its whole tree (torchrun's workers included).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rankscope.agent.config import render_host
from rankscope.agent.spool import leftovers
from rankscope.common.agent_env import agent_environment
from rankscope.common.processes import terminate_tree

#: the ``rankscope`` command of this interpreter (works without the console script on PATH)
CLI = (sys.executable, "-m", "rankscope.cli.main")
#: RANKSCOPE_HOST template: two ranks per simulated host (``host_of`` spells it out)
HOSTS = "node-{rank//2}"

__all__ = ["CLI", "HOSTS", "agent_env", "await_diagnosis", "collector_command", "diagnosis_passes", "free_port", "host_of", "listen_address",
           "metrics_url", "start", "start_collector", "stop", "wait_for_address"]
#: the histogram of the collector's live diagnosis passes (its count: passes finished, per lane)
PASSES = "rankscope_diagnosis_pass_seconds"


def host_of(rank: int) -> str:
    """The simulated host ``HOSTS`` gives ``rank`` (the agent's own reading of the template)."""
    return render_host(HOSTS, rank, 0, 0)


def collector_command(store: Path, listen: str, hang_after_s: float, *, metrics: bool = False) -> list[str]:
    """``rankscope collector`` on an embedded store, diagnosing every second (incidents show up fast);
    ``metrics``: serving /metrics on a free port too (``await_diagnosis`` reads its passes there)."""
    return [
        *CLI, "collector", "--store", str(store), "--listen", listen, "--hang-after", str(hang_after_s),
        "--diagnose-every", "1", "--flush-interval", "0.5", *(["--metrics-port", "0"] if metrics else []),
    ]  # fmt: skip


@dataclass(frozen=True)
class Postmortem:
    """What `rankscope diagnose --format json` said after a run: its incidents, each with ``seen``
    (raised live and offline, or on one side only), or the error that stopped it."""

    incidents: list[dict]
    error: str = ""

    @property
    def disagreements(self) -> list[dict]:
        """The incidents the live and offline diagnoses do not both name (kind, ranks, hosts)."""
        return [i for i in self.incidents if i["seen"] != "live and offline"]

    def verdict(self) -> str:
        """One phrase for a score line: whether the postmortem agreed with the live diagnosis."""
        if self.error:
            return f"rankscope diagnose failed: {self.error}"
        if not self.disagreements:
            return "rankscope diagnose afterwards agrees"
        return "rankscope diagnose afterwards disagrees: " + "; ".join(f"{i['seen']}: {i['kind']} {i['ranks']} {i['hosts']}" for i in self.disagreements)

    def names(self) -> list[tuple[str, list[int], list[str], str]]:
        """(kind, ranks, hosts, seen) of each incident, in order."""
        return [(i["kind"], sorted(i["ranks"]), sorted(i["hosts"]), i["seen"]) for i in self.incidents]


def postmortem(address: str, run_id: str, *thresholds: str) -> Postmortem:
    """`rankscope diagnose --format json` of the run through the collector at ``address`` (``thresholds``: its flags)."""
    command = [*CLI, "diagnose", "--collector", address, "--run", run_id, "--format", "json", *thresholds]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode:
            return Postmortem([], f"{' '.join(command)}: exit status {done.returncode}: {done.stderr[-2000:].strip()}")
        return Postmortem(json.loads(done.stdout))
    except (subprocess.TimeoutExpired, ValueError) as e:
        return Postmortem([], f"{' '.join(command)}: {e}")


def agent_env(address: str, run_id: str, spool_dir: Path) -> dict[str, str]:
    """This process's environment plus the agent switched on, sending to ``address`` as run ``run_id``
    (heartbeats and data every second, twice as often as by default: faults show up fast)."""
    return {**os.environ, **agent_environment(address, run_id, spool_dir=spool_dir, host=HOSTS, every_s=1)}


def start(cmd: list[str], log_path: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session with stdout and stderr in ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )


def wait_for_address(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 180) -> str:
    """The HOST:PORT a collector started by ``start`` listens on, read from its start-up line (a
    collector took over 60 s to start at a load average of 64-78 on 2 cores: benchmarks/accuracy.py).

    Raises RuntimeError with the end of its log if it exits first (store held, port in use).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        address = listen_address(text)
        if address:
            return address
        if proc.poll() is not None:
            raise RuntimeError(f"the collector exited ({proc.returncode}):\n{text[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"the collector did not start within {timeout_s:.0f} s (log: {log_path})")


def listen_address(output: str) -> str | None:
    """The HOST:PORT of a collector's start-up line (``... listening on HOST:PORT, storing in ...``), if printed."""
    for line in output.splitlines():
        if "listening on " in line:
            return line.split("listening on ", 1)[1].split(",", 1)[0].strip()
    return None


def metrics_url(output: str) -> str | None:
    """The /metrics URL of a collector's start-up line (``..., metrics on URL``), if it serves metrics."""
    for line in output.splitlines():
        if "listening on " in line and "metrics on " in line:
            return line.split("metrics on ", 1)[1].split()[0].rstrip(",")
    return None


def diagnosis_passes(url: str) -> dict[str, int]:
    """How many live diagnosis passes each lane of the collector at ``url`` (its /metrics) has finished."""
    from prometheus_client.parser import text_string_to_metric_families

    from rankscope.collector.diagnosis.engine import THOROUGH, URGENT

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    passes = dict.fromkeys((URGENT.name, THOROUGH.name), 0)  # a lane not passed yet has no sample
    for family in text_string_to_metric_families(text):
        if family.name == PASSES:
            passes.update({s.labels["lane"]: int(s.value) for s in family.samples if s.name == f"{PASSES}_count"})
    return passes


def await_diagnosis(url: str, passes: int = 3, timeout_s: float = 180) -> None:
    """Return once every lane of the collector's live diagnosis has finished ``passes`` more passes
    than it had now: what was sent before this call is stored within the writer's flush interval, so
    a pass that began after that saw it (the first may have begun before, the next after the flush).
    How a script awaits the diagnosis of data it just sent, instead of sleeping a guessed time."""
    deadline = time.monotonic() + timeout_s
    wanted = {lane: count + passes for lane, count in diagnosis_passes(url).items()}
    while True:
        done = diagnosis_passes(url)
        if all(done[lane] >= count for lane, count in wanted.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the collector's diagnosis did not finish {passes} more passes per lane in {timeout_s:g} s: "
                               f"{done} of {wanted} ({url})")  # fmt: skip
        time.sleep(0.2)


def replay_spool(spool: Path, address: str, log: Path, tries: int = 3) -> None:
    """``rankscope spool replay`` of what the launcher left, again while segments are left: one replay
    gives up after its 300 s, and a collector behind a run's diagnosis at a low priority on a loaded
    machine took longer (seed 32: 6 of 10 segments left, counted as lost though still in the spool)."""
    for _ in range(tries):
        if not spool.is_dir() or not leftovers(spool):
            return
        with log.open("a") as out:
            subprocess.run([*CLI, "spool", "replay", str(spool), "--collector", address], stdout=out, stderr=out, timeout=900, check=False)


def start_collector(store: Path, log_path: Path, *flags: str, timeout_s: float = 120) -> tuple[subprocess.Popen[bytes], str]:
    """``rankscope collector`` on ``store`` and a free port, with ``flags``; its HOST:PORT once it listens.

    RuntimeError (the collector stopped again) if it does not come up.
    """
    proc = start([*CLI, "collector", "--store", str(store), "--listen", "127.0.0.1:0", *flags], log_path, os.environ)
    try:
        return proc, wait_for_address(proc, log_path, timeout_s)
    except RuntimeError:
        stop(proc, 5)
        raise


def free_port() -> int:
    """A TCP port nothing listens on now (for a metrics endpoint or a dashboard started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """Stop a process and every process under it (torchrun's workers live in sessions of their own)."""
    terminate_tree(proc, grace_s)
    proc.wait()

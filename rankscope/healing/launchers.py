"""The launchers of a job, one per host (torchrun's elastic agent, or the Slurm step that runs it): whether
they have ended, how, and what they wrote. A self-healing driver watches them (``driver.Job``) and
starts one more on a spare host that joins the job.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.common.processes import terminate_tree

__all__ = ["Launchers"]


@dataclass(kw_only=True)
class Launchers:
    """Each host's launcher and its log, by host name."""

    run_id: str
    launchers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    #: starts the job's launcher on the named host: the process and its log
    start_on: Callable[[str], tuple[subprocess.Popen[bytes], Path]] | None = field(default=None, repr=False)

    def add(self, host: str) -> None:
        """Start the job's launcher on ``host`` too (again, if its launcher ended): it joins the elastic job's next rendezvous."""
        running = host in self.launchers and self.launchers[host].poll() is None
        if self.start_on is None or running:
            raise ValueError(f"{host} cannot join job {self.run_id}: {'it runs the job already' if running else 'no way to start it'}")
        self.launchers[host], self.logs[host] = self.start_on(host)

    def finished(self, but: Collection[str] = ()) -> bool:
        """Whether every launcher has ended, those of the hosts ``but`` aside (spares waiting to join)."""
        return all(p.poll() is not None for name, p in self.launchers.items() if name not in but)

    def exited(self) -> dict[str, int]:
        """The exit status of each host's launcher that has ended."""
        return {name: code for name, p in self.launchers.items() if (code := p.poll()) is not None}

    def wait(self, timeout_s: float) -> dict[str, int]:
        """Each host's launcher exit status; TimeoutError (with the output) if the job runs on."""
        deadline = time.monotonic() + timeout_s
        while not self.finished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.run_id} still running after {timeout_s:.0f} s\n{self.output()}")
            time.sleep(0.2)
        return {name: p.returncode for name, p in self.launchers.items()}

    def stop(self, grace_s: float = 5.0, hosts: Collection[str] | None = None) -> None:
        """Stop every launcher (or those of ``hosts``) and what it started."""
        for name, proc in self.launchers.items():
            if hosts is None or name in hosts:
                terminate_tree(proc, grace_s)
                proc.wait()

    def output(self, tail: int = 4000) -> str:
        return "\n".join(f"--- {name} ---\n{path.read_text(errors='replace')[-tail:]}" for name, path in self.logs.items())

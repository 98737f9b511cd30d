"""Faults applied to a test bed from outside the job: the training processes never know.

Each function changes what the kernel does to a host or a process, as a sick machine would, and
returns an ``Applied`` that can undo it (``undo``) where undoing makes sense:

- ``throttle_cpu``: a share of the host's CPU quota (cgroup ``cpu.cfs_quota_us``): a slow host;
- ``slow_cpu``: the quota cut to a share of what the host's processes used lately: a host slower by
  that factor, also on cores it shares with other hosts and jobs;
- ``freeze_rank`` / ``freeze_host``: SIGSTOP one rank; the freezer cgroup for all of a host's
  processes, its launcher included: a hung process or machine;
- ``kill_rank`` / ``kill_host``: SIGKILL one rank; every process of the host: a crash, a lost machine;
- ``limit_bandwidth``: tbf on both directions of the host's link: a degraded NIC or cable;
- ``delay_link``: a fixed delay on both directions of the host's link (``relay``): a long or congested path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.testbed.hosts import HOST_IF, Host, Testbed, TestbedError, set_cpu_quota
from rankscope.testbed.job import Rank

__all__ = [
    "Applied", "cores_used", "delay_link", "freeze_host", "freeze_rank", "kill_host", "kill_rank", "limit_bandwidth", "slow_cpu",
    "throttle_cpu",
]  # fmt: skip

#: how long ``slow_cpu`` measures what a host uses before it cuts it
MEASURE_S = 2.0
#: the least CPU a slowed host keeps (cgroup v1 takes a quota of at least 1 ms a period)
MIN_CORES = 0.02
#: a host using less than this share of its cores is idle (its ranks wait on another host): nothing to slow
IDLE_SHARE = 0.1


@dataclass
class Applied:
    """A fault in force since ``at_ns`` (wall clock); ``undo`` lifts it (once; a no-op for kills)."""

    what: str
    at_ns: int
    _undo: Callable[[], None] | None = field(default=None, repr=False)

    def undo(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            try:
                undo()
            except FileNotFoundError:
                pass  # the host's cgroup is gone (the test bed is down), and the fault with it


def throttle_cpu(bed: Testbed, host: Host, share: float) -> Applied:
    """Cut the host's CPU to ``share`` (e.g. 0.25) of what it has, as a throttled or overheated machine."""
    if not 0 < share < 1:
        raise ValueError(f"a throttled host keeps a share of its CPU between 0 and 1, not {share}")
    set_cpu_quota(host, share * bed.cores)
    return Applied(f"{host.name}: CPU cut to {share:.0%} ({share * bed.cores:.2g} cores)", time.time_ns(),
                   lambda: set_cpu_quota(host, bed.cores))  # fmt: skip


def slow_cpu(bed: Testbed, host: Host, factor: float, over_s: float = MEASURE_S, wait_s: float = 0.0,
             log: Callable[[str], None] = print) -> Applied:  # fmt: skip
    """Cut the host's CPU to 1/``factor`` of what its processes used over the next ``over_s`` seconds: a host
    that many times slower. A cut of what it has (``throttle_cpu``) does not bind where its ranks got
    less than that anyway, on cores shared with other hosts and jobs (campaign seeds 1243506248,
    711678378 and 1991925407: hosts cut 1.6x, 1.5x and 2.6x, their jobs no slower). An idle host is
    measured again for up to ``wait_s`` seconds (a fault set before its job starts), then an error."""
    if factor <= 1:
        raise ValueError(f"a slowed host runs slower by a factor above 1, not {factor}")
    idle = IDLE_SHARE * bed.cores
    used = cores_used(bed, host, over_s)
    if used < idle:  # its ranks waited through the window (on another host), or its job has not started: look longer
        if wait_s > 0:
            log(f"{host.name} is idle: waiting up to {wait_s:g} s for its processes to use CPU")
        deadline = time.monotonic() + wait_s
        used = cores_used(bed, host, max(over_s, MEASURE_S))
        while used < idle and time.monotonic() < deadline:
            used = cores_used(bed, host, max(over_s, MEASURE_S))
    if used < idle:
        raise TestbedError(f"{host.name} used {used:.2g} of its {bed.cores:.2g} cores: it is idle, and a cut of what it uses would stop it")
    cores = max(used / factor, MIN_CORES)
    set_cpu_quota(host, cores)
    return Applied(f"{host.name}: CPU cut {factor:.3g}x, to {cores:.2g} of the {used:.2g} cores it used", time.time_ns(),
                   lambda: set_cpu_quota(host, bed.cores))  # fmt: skip


def cores_used(bed: Testbed, host: Host, over_s: float) -> float:
    """The CPUs the host's processes used between them over the next ``over_s`` seconds (user and system time)."""
    pids = bed.pids(host)
    before, began = _cpu_s(pids), time.monotonic()
    time.sleep(over_s)
    after, elapsed = _cpu_s(pids), time.monotonic() - began
    return sum(after[p] - before[p] for p in after if p in before) / elapsed


def _cpu_s(pids: list[int]) -> dict[int, float]:
    """pid -> the CPU seconds it has used, for the processes still there."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        out[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15 of proc(5))
    return out


def freeze_host(host: Host) -> Applied:
    """Freeze every process of the host (launcher and ranks): it neither computes nor answers."""
    state = host.cgroup("freezer") / "freezer.state"
    state.write_text("FROZEN")
    deadline = time.monotonic() + 10
    while state.read_text().strip() != "FROZEN":
        if time.monotonic() > deadline:
            raise TestbedError(f"{host.name} did not freeze within 10 s")
        time.sleep(0.02)
    return Applied(f"{host.name}: frozen", time.time_ns(), lambda: state.write_text("THAWED"))


def freeze_rank(rank: Rank) -> Applied:
    """Stop one rank's process (SIGSTOP): its threads, the agent's included, stand still."""
    os.kill(rank.pid, signal.SIGSTOP)
    return Applied(f"rank {rank.rank} on {rank.host.name}: stopped", time.time_ns(), lambda: _signal(rank.pid, signal.SIGCONT))


def kill_rank(rank: Rank) -> Applied:
    """SIGKILL one rank: no exception, no exit code of its own, no last word from its agent."""
    os.kill(rank.pid, signal.SIGKILL)
    return Applied(f"rank {rank.rank} on {rank.host.name}: killed", time.time_ns())


def kill_host(bed: Testbed, host: Host) -> Applied:
    """SIGKILL every process of the host at once (its launcher too): the machine is gone."""
    state = host.cgroup("freezer") / "freezer.state"
    state.write_text("FROZEN")  # nobody of the host acts between the first kill and the last
    pids = bed.pids(host)
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    state.write_text("THAWED")
    return Applied(f"{host.name}: all {len(pids)} processes killed", time.time_ns())


def limit_bandwidth(bed: Testbed, host: Host, mbit: float) -> Applied:
    """Token-bucket limit on the host's link, both ways: its eth0 and the switch's port towards it."""
    ends = [(host.namespace, HOST_IF), (bed.switch, f"h{host.index}")]
    rate = f"{mbit:g}mbit"
    for ns, dev in ends:
        _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kb", "latency", "400ms")

    def undo() -> None:
        for ns, dev in ends:
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)

    return Applied(f"{host.name}: link limited to {rate}", time.time_ns(), undo)


def delay_link(bed: Testbed, host: Host, delay_ms: float) -> Applied:
    """Every packet into and out of the host waits ``delay_ms`` (a round trip to it gains twice that)."""
    from rankscope.testbed.relay import start_delay

    relay = start_delay(bed.switch, host.namespace, host.index, delay_ms)
    return Applied(f"{host.name}: link delayed {delay_ms:g} ms each way", time.time_ns(), relay.stop)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _tc(namespace: str, *args: str, check: bool = True) -> None:
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise TestbedError(f"tc {' '.join(args)} in {namespace}: {done.stderr.strip()}")

"""Stopping a process and everything it started, for the commands that start other processes.

torchrun starts each worker in a session of its own, so signalling torchrun's process group
misses them, and once torchrun is dead its workers are re-parented and can no longer be found
from it. So the whole tree is read from /proc before any signal is sent: SIGTERM to the group and
every descendant, a grace period, then SIGKILL to what is left (Linux).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["alive", "lower_threads", "name_forked_rank", "process_tree", "signal_each", "terminate_tree", "training_rank", "yield_cpu"]

#: the name (``/proc/PID/comm``) of a rank forked from its torchrun agent: ``rank5:1`` is RANK 5, LOCAL_RANK 1
_FORKED_RANK = re.compile(r"rank(\d+):(\d+)")


def _proc_table() -> dict[int, tuple[int, int, str, int]]:
    """pid -> (ppid, pgid, state, start time) for every process, from /proc/<pid>/stat."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0], int(fields[19]))
    return table


def process_tree(root: int) -> dict[int, int]:
    """pid -> start time of the live (non-zombie) processes in root's group or below root.

    Read while root runs: what it started can only be found from it until it exits.
    """
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_, pgid, _, _) in table.items() if pgid == root}
    stack = [root]
    while stack:
        pid = stack.pop()
        found.add(pid)
        stack.extend(children.get(pid, []))
    return {pid: table[pid][3] for pid in found if pid in table and table[pid][2] != "Z"}


def alive(pids: dict[int, int]) -> dict[int, int]:
    """Those of `pids` (from ``process_tree``) still running; same start time, so a reused pid is not mistaken."""
    table = _proc_table()
    return {pid: start for pid, start in pids.items() if pid in table and table[pid][3] == start and table[pid][2] != "Z"}


def _signal(pids: dict[int, int], pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in alive(pids):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate_tree(popen: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM popen's group and descendants, wait up to `grace_s`, then SIGKILL the rest.

    The tree is read before any signal: once a parent dies its children are re-parented and
    can no longer be found from it.
    """
    pids = process_tree(popen.pid)
    if not pids:
        popen.poll()  # reap a zombie leader
        return
    _signal(pids, popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        popen.poll()
        pids = alive(pids)
        if not pids:
            return
        time.sleep(0.05)
    # Also whatever the tree started during the grace period.
    pids = {**pids, **process_tree(popen.pid)}
    _signal(pids, popen.pid, signal.SIGKILL)
    try:
        popen.wait(5.0)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5.0  # SIGKILL is not instant on a busy machine: wait until they are gone
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def yield_cpu(nice: int) -> None:
    """Run this process at CPU priority ``nice`` (0-19) or lower: training sharing the machine comes first.

    Linux keeps a nice value per thread and a new thread takes its creator's, so every thread
    there is now is lowered (call it early). Where the kernel schedules by autogroup (most
    distributions), CPU time is first shared between sessions, so a busy moment of a process
    would take a whole core from a job in another session whatever its threads' nice; a session
    leader therefore lowers its session's autogroup too. A process sharing its session (a
    shell's job) leaves it alone: that would lower everything else started from the same
    terminal. Failures change nothing.
    """
    lower_threads(nice)
    if os.getsid(0) != os.getpid():
        return
    try:
        with open("/proc/self/autogroup") as f:  # "/autogroup-123 nice 0"
            current = int(f.read().split()[-1])
        if current < nice:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
    except (OSError, ValueError, IndexError):
        pass


def lower_threads(nice: int, tids: Iterable[int] | None = None) -> None:
    """Each thread of this process (or each of ``tids``; 0 is the calling one) at CPU priority ``nice``
    or lower. Only ever lowers a priority, so it needs no privilege; a thread that ended meanwhile is skipped."""
    if tids is None:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            if nice > os.getpriority(os.PRIO_PROCESS, tid):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass  # ended meanwhile, or not allowed


def signal_each(pids: Iterable[int], sig: signal.Signals) -> int:
    """Send ``sig`` to each of ``pids``; how many were still there to get it."""
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def training_rank(pid: int) -> tuple[int, int] | None:
    """(RANK, LOCAL_RANK) of a torchrun worker (not of a process the worker started), else None: how
    the fleets that pause and fence a job's workers tell them from their launchers and helpers. A
    worker started by torchrun has them in its environment; one forked from torchrun's agent (the
    bundled trainer's ranks) has an environment of the agent's and says them in its name instead."""
    own = _rank_of(pid)
    if own is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None
    if _rank_of(ppid) is not None:  # a data loader worker or another child of a rank
        return None
    return own


def name_forked_rank(rank: int, local_rank: int) -> None:
    """Name this process for ``training_rank``: a rank forked from its agent, which /proc shows with
    the agent's environment (the name also tells the ranks apart in ``ps`` and ``top``)."""
    Path("/proc/self/comm").write_text(f"rank{rank}:{local_rank}")


def _rank_of(pid: int) -> tuple[int, int] | None:
    own = _environ(pid)
    if "RANK" in own and "LOCAL_RANK" in own:
        return int(own["RANK"]), int(own["LOCAL_RANK"])
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    forked = _FORKED_RANK.fullmatch(name)
    return (int(forked.group(1)), int(forked.group(2))) if forked else None


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)

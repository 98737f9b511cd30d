"""Stack dumps of this process: where every thread is when a rank stalls or the collector asks.

py-spy reads the stacks from outside (including threads blocked in C, with their native
frames' Python callers) and is what an engineer would run by hand; it is started as a child
on our own pid and takes about 15 ms. Clusters often deny ptrace, and py-spy may be missing (it is
the ``stacks`` extra): then Python's own view, ``sys._current_frames()``, is the fallback ("python-frames").

Dumps run on the agent's threads (heartbeat), never on the training thread: py-spy pauses the
process while it reads it, and a dump can take up to ``PY_SPY_TIMEOUT_S``.

A rank stopped from outside (SIGSTOP, a debugger) cannot dump itself: every thread of it, the
agent's included, stands still. Its siblings can (the launcher's other children: the host's other
ranks under torchrun or srun): ``stopped_siblings`` finds them and ``peer_stack`` reads one with
py-spy's ``--nonblocking`` (plain ``py-spy dump`` fails on a stopped process: it cannot suspend it).
The dump is sent by the sibling, its reason ``STOPPED_PEER`` and the pid; the hang detector matches
it to the frozen rank by host and pid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from rankscope.agent.config import warn_once
from rankscope.protos.v1 import telemetry_pb2

__all__ = ["STOPPED_PEER", "dump_stack", "peer_stack", "py_spy_path", "stopped_children", "stopped_siblings"]

PY_SPY_TIMEOUT_S = 10.0
#: the reason of a dump of a stopped sibling, followed by its pid
STOPPED_PEER = "stopped peer pid "


def dump_stack(reason: str) -> telemetry_pb2.StackDump:
    """Every thread's stack now, by py-spy or else Python's frames; ``reason`` as in the proto."""
    text = _py_spy_dump(os.getpid())
    method = "py-spy"
    if text is None:
        text, method = _python_frames(), "python-frames"
    return telemetry_pb2.StackDump(time_ns=time.time_ns(), reason=reason, method=method, text=text)


def peer_stack(pid: int) -> telemetry_pb2.StackDump | None:
    """A stopped sibling's stacks by py-spy (reason ``STOPPED_PEER`` and its pid), or None: without
    py-spy (or ptrace) nothing can read another process."""
    text = _py_spy_dump(pid, "--nonblocking")
    if text is None:
        return None
    return telemetry_pb2.StackDump(time_ns=time.time_ns(), reason=f"{STOPPED_PEER}{pid}", method="py-spy", text=text)


def stopped_siblings() -> set[int]:
    """The pids of this process's siblings (its parent's other children) that are stopped now."""
    parent = os.getppid()
    if parent <= 1:  # an orphan's siblings are every daemon of the host
        return set()
    return stopped_children(parent) - {os.getpid()}


def stopped_children(parent: int) -> set[int]:
    """The pids of ``parent``'s children that are stopped now (state ``T``: SIGSTOP, SIGTSTP)."""
    pids = set()
    for children in Path(f"/proc/{parent}/task").glob("*/children"):
        try:
            pids.update(int(p) for p in children.read_text().split())
        except (OSError, ValueError):
            continue
    return {pid for pid in pids if _state(pid) == "T"}


def _state(pid: int) -> str:
    """A process's state letter (``T``: stopped by a signal), '' when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] if fields else ""


def py_spy_path() -> str | None:
    """The py-spy executable installed with this Python (its wheel puts it next to python), or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def _py_spy_dump(pid: int, *flags: str) -> str | None:
    exe = py_spy_path()
    if exe is None:
        warn_once("py-spy", "py-spy is not installed: stack dumps use Python's own frames (pip install 'rankscope[stacks]')")
        return None
    try:
        done = subprocess.run(
            [exe, "dump", *flags, "--pid", str(pid)],
            capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        warn_once("py-spy", f"py-spy failed ({exc!r}): stack dumps use Python's own frames")
        return None
    if done.returncode != 0 or not done.stdout.strip():
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        warn_once("py-spy", f"py-spy cannot read process {pid} ({why}; ptrace denied?): stack dumps use Python's own frames")
        return None
    return done.stdout


def _python_frames() -> str:
    """py-spy's layout from ``sys._current_frames()``: innermost frame first, per thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    blocks = [f"Process {os.getpid()}: {' '.join(sys.argv)}"]
    for ident, frame in sys._current_frames().items():
        lines = [f'Thread {ident}: "{names.get(ident, "?")}"']
        for entry in reversed(traceback.extract_stack(frame)):
            lines.append(f"    {entry.name} ({entry.filename}:{entry.lineno})")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"

"""Stacks of a stopped process, taken from outside: a rank stopped with SIGSTOP cannot dump its own
(every thread of it stands still), its siblings can (issue 29). The multi-rank case, a rank of a job
stopped on a test bed host and its stack attached to the hang by its host-mate's agent, is
tests/test_testbed_scenarios.py's freeze scenarios."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rankscope.agent.stacks import STOPPED_PEER, peer_stack, py_spy_path, stopped_children

PARKED = "import time\ndef parked_in_here():\n    print('in', flush=True)\n    while True:\n        time.sleep(0.01)\nparked_in_here()\n"


@pytest.mark.timeout(60)
def test_a_stopped_child_is_found_and_read_without_resuming_it() -> None:
    if py_spy_path() is None:
        pytest.skip("py-spy is not installed (the stacks extra)")
    child = subprocess.Popen([sys.executable, "-c", PARKED], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "in\n"  # in its loop
        assert child.pid not in stopped_children(os.getpid())
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while child.pid not in stopped_children(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in stopped_children(os.getpid())
        dump = peer_stack(child.pid)  # plain `py-spy dump` fails here: it cannot suspend a stopped process
        assert dump is not None and (dump.reason, dump.method) == (f"{STOPPED_PEER}{child.pid}", "py-spy")
        assert dump.text.startswith(f"Process {child.pid}:") and "parked_in_here" in dump.text, dump.text
        assert child.pid in stopped_children(os.getpid())  # still stopped: reading it resumed nothing
    finally:
        child.kill()
        child.wait()

"""Faults in a plain DDP script that knows nothing about rankscope (tests/scripts/ddp_plain.py), not
the bundled trainer: only ``RANKSCOPE_ENABLE=1`` is set, and the live diagnosis still names the
rank and the host.

The script's gradient all-reduces come from DDP's C++ reducer, which waits for them in C++: the
agent sees them only in torch's flight recorder, in flight, never as a wait of the thread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Proc, ProcRunner, incidents, start_collector

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_plain.py"
FAST = {"RANKSCOPE_FLUSH_S": "0.5", "RANKSCOPE_HEARTBEAT_S": "1"}


def test_a_rank_stuck_outside_ddps_all_reduce_is_the_hangs_root(
    proc_runner: ProcRunner, torchrun: Callable[..., Proc], tmp_path: Path
) -> None:
    collector = start_collector(proc_runner, tmp_path / "store", "--hang-after", "6", "--diagnose-every", "1", "--flush-interval", "0.5")
    env = {"RANKSCOPE_ENABLE": "1", "RANKSCOPE_COLLECTOR": collector.target, "RANKSCOPE_SPOOL_DIR": str(tmp_path / "spool"),
           "RANKSCOPE_RUN_ID": "plain-hang", "RANKSCOPE_HOST": "node-{rank//2}", **FAST}  # fmt: skip
    proc = torchrun([str(SCRIPT), "--steps", "6", "--stall-rank", "2", "--stall-step", "4", "--stall-s", "25"], 4, env=env)
    found = incidents(collector.target, "plain-hang", lambda found, _: any(i["kind"] == "hang" for i in found), timeout_s=90)
    hangs = [i for i in found if i["kind"] == "hang"]
    assert hangs, f"no hang found\n{collector.proc.output(None)[-3000:]}"
    assert (hangs[0]["ranks"], hangs[0]["hosts"]) == ([2], ["node-1"]), hangs
    assert "default_pg" in hangs[0]["summary"]  # where the others wait: DDP's gradient all-reduce
    assert proc.wait(90) == 0, proc.output()  # the stalled rank went on: the job ends normally

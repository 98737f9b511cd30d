"""``rankscope collector`` flags: every bad value exits 2 with the reason, before anything starts."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ProcRunner, start_collector

from rankscope.cli import collector as cli
from rankscope.cli.main import main
from rankscope.harness.orchestration import CLI
from rankscope.collector.server import ServerOptions


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--listen", "7777"], "expected HOST:PORT"),
        (["--listen", "localhost:99999"], "expected HOST:PORT"),
        (["--listen", "unix:"], "expected unix:PATH"),
        (["--store", "a", "--clickhouse", "http://h:8123"], "not allowed with argument"),
        (["--clickhouse", "localhost:8123"], "expected http[s]://"),
        (["--retention-days", "-1"], "must be at least 0"),
        (["--metrics-port", "70000"], "a port is 0-65535"),
        (["--time-window", "3600"], "expected PAST,FUTURE"),
        (["--time-window", "3600,-5"], "more than 0 seconds"),
        (["--max-buffered-rows", "lots"], "expected a whole number"),
        (["--flush-interval", "0"], "more than 0 seconds"),
        (["--nice", "20"], "a nice value is 0-19"),
    ],
)
def test_bad_flag_values_exit_2_with_the_reason(args: list[str], reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["collector", *args])
    assert exit_info.value.code == 2
    assert reason in capsys.readouterr().err


def test_the_flag_defaults_are_the_collectors_own() -> None:
    """The command line spells its defaults out (it must not import the server to parse flags): they
    must still be the ones the collector uses when started from Python."""
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args, options = parser.parse_args([]), ServerOptions()
    assert (args.flush_interval, args.diagnose_every, args.max_buffered_rows) == (
        options.flush_interval_s, options.diagnose_interval_s, options.max_buffered_rows)
    limits = options.limits
    assert (args.query_max_rows, args.query_max_bytes, args.query_timeout, args.query_max_memory, args.query_threads) == (
        limits.max_rows, limits.max_bytes, limits.max_execution_s, limits.max_memory_bytes, limits.max_threads)
    assert args.query_concurrency == options.query_concurrency


YIELD = """
import os, sys, threading
threading.Thread(target=threading.Event().wait, daemon=True).start()  # a thread that exists before
from rankscope.common.processes import yield_cpu
yield_cpu(7)
threading.Thread(target=threading.Event().wait, daemon=True).start()  # and one started after
nices = sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})
print(nices, open("/proc/self/autogroup").read().split()[-1])
"""


def _autogroup() -> str:
    """This process's autogroup ("/autogroup-123 nice 0"); empty where the kernel has none or the
    process is in the root one (it never left the first session, as a CI runner's may not)."""
    try:
        with open("/proc/self/autogroup") as f:
            return f.read().strip()
    except OSError:
        return ""


@pytest.mark.skipif(not _autogroup(), reason="this process is not scheduled by an autogroup of its own")
@pytest.mark.parametrize("own_session", [True, False])
def test_the_collector_yields_the_cpu_and_its_session_only_when_it_leads_one(own_session: bool) -> None:
    """Every thread is lowered; the session's autogroup only when the process leads its session
    (lowering a shared one would lower everything else started from the same terminal)."""
    done = subprocess.run([sys.executable, "-c", YIELD], capture_output=True, text=True, timeout=60, start_new_session=own_session)
    assert done.returncode == 0, done.stderr
    mine = _autogroup().split()[-1]
    lowered = max(7, os.getpriority(os.PRIO_PROCESS, 0))  # lowered to 7, never raised (the suite's background lane runs at 15)
    assert done.stdout.split() == [f"[{lowered}]", "7" if own_session else mine]


def test_a_collector_on_a_unix_socket_answers_there(proc_runner: ProcRunner, tmp_path: Path) -> None:
    """``--listen unix:PATH``: what the test bed's namespace hosts reach the collector through."""
    socket_path = tmp_path / "collector.sock"
    collector = start_collector(proc_runner, tmp_path / "store", listen=f"unix:{socket_path}")
    assert collector.target == f"unix:{socket_path}" and socket_path.is_socket()
    done = subprocess.run([*CLI, "sql", "--collector", collector.target, "SELECT 1 AS one"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split()[-1] == "1", done
    # a second collector on the same path is refused: gRPC would replace the first one's socket
    second = subprocess.run([*CLI, "collector", "--store", str(tmp_path / "store2"), "--listen", collector.target],
                            capture_output=True, text=True, timeout=90)  # fmt: skip
    assert second.returncode == 1, second
    assert f"cannot listen on {collector.target}: a process (another collector?) is listening there" in second.stderr
    done = subprocess.run([*CLI, "sql", "--collector", collector.target, "SELECT 1 AS one"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and socket_path.is_socket(), done

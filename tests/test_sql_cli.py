"""``rankscope sql``: formats, parameters and exit codes, through a real collector and on the store
directory once the collector has stopped."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from test_collector_ingest import register, spans, step_metrics
from conftest import Running, start_collector

from rankscope.cli.main import main
from rankscope.protos.v1 import ingest_pb2_grpc

if TYPE_CHECKING:
    from conftest import ProcRunner

pytestmark = pytest.mark.slow

TOKEN = "sql-token"
T0 = 1_700_000_000_123_456_789  # 2023-11-14T22:13:20.123456789Z
#: runs `rankscope sql ARGS...` in this process: (exit status, stdout, stderr)
SqlRun = Callable[..., tuple[int, str, str]]
SPANS_SQL = "SELECT rank, name, start_time FROM spans WHERE run_id = {run:String} ORDER BY start_time LIMIT 2"


@pytest.fixture(scope="module")
def collector(module_runner: ProcRunner, tmp_path_factory: pytest.TempPathFactory) -> Running:
    """A collector holding run "sql": two spans from a fixed time, and a NaN loss."""
    running = start_collector(module_runner, tmp_path_factory.mktemp("sql") / "data", "--token", TOKEN, "--flush-interval", "0.2",
                              "--time-window", "1e10,3600")
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(running.target) as channel:
        stub = ingest_pb2_grpc.IngestStub(channel)
        for batch in (register("sql", 0, 1, start_ns=T0), spans("sql", 0, 2, t0=T0), step_metrics("sql", 0)):
            stub.Send(batch, metadata=auth, timeout=30)
    return running


@pytest.fixture
def sql(collector: Running, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> SqlRun:
    """`rankscope sql --collector <the collector> ARGS...`, the token from RANKSCOPE_TOKEN."""
    monkeypatch.setenv("RANKSCOPE_TOKEN", TOKEN)

    def run(*args: str) -> tuple[int, str, str]:
        status = main(["sql", "--collector", collector.target, *args])
        out, err = capfd.readouterr()
        return status, out, err

    return run


def test_csv_is_a_header_and_the_rows_and_nothing_else(sql: SqlRun) -> None:
    status, out, err = sql("--format", "csv", "--param", "run=sql", SPANS_SQL)
    assert (status, err) == (0, "")
    assert out == (
        "rank,name,start_time\n"
        "0,forward,2023-11-14T22:13:20.123456789Z\n"
        "0,backward,2023-11-14T22:13:20.123457789Z\n"
    )
    assert list(csv.reader(io.StringIO(out)))[1] == ["0", "forward", "2023-11-14T22:13:20.123456789Z"]


def test_json_is_one_array_of_objects(sql: SqlRun) -> None:
    status, out, err = sql("--format", "json", "--param", "run=sql",
                           "SELECT step, value, name FROM step_metrics WHERE run_id = {run:String} ORDER BY step")
    assert (status, err) == (0, "")
    assert json.loads(out) == [{"step": 1, "value": 2.5, "name": "loss"}, {"step": 2, "value": "NaN", "name": "loss"}]


def test_table_aligns_columns_and_numbers_right(sql: SqlRun) -> None:
    status, out, err = sql("--param", "run=sql", SPANS_SQL)
    assert (status, err) == (0, "")
    assert out.splitlines() == [
        "rank  name      start_time",
        "----  --------  ------------------------------",
        "   0  forward   2023-11-14T22:13:20.123456789Z",
        "   0  backward  2023-11-14T22:13:20.123457789Z",
    ]


@pytest.mark.parametrize(
    "args, reason",
    [
        (["DROP TABLE spans"], "only read statements"),
        (["SELECT 1; DROP TABLE spans"], "only one statement"),
        (["SELECT * FROM no_such_table"], "UNKNOWN_TABLE"),
        (["--max-rows", "5", "SELECT number FROM numbers(100)"], "result over the limit"),
    ],
)
def test_a_refused_statement_exits_2_with_the_reason(sql: SqlRun, args: list[str], reason: str) -> None:
    status, out, err = sql(*args)
    assert (status, out) == (2, "")
    assert err.startswith("rankscope sql: refused:") and reason in err


def test_a_wrong_token_or_no_collector_exits_1(sql: SqlRun, capfd: pytest.CaptureFixture[str]) -> None:
    status, out, err = sql("--token", "wrong", "SELECT 1")
    assert (status, out) == (1, "") and "token is wrong" in err
    assert main(["sql", "--collector", "127.0.0.1:1", "SELECT 1"]) == 1
    out, err = capfd.readouterr()
    assert out == "" and "cannot reach the collector at 127.0.0.1:1: Connection refused" in err


def _rankscope_sql(*args: str) -> subprocess.CompletedProcess[str]:
    """`rankscope sql` in a fresh process (the embedded store must not open inside pytest)."""
    cmd = [sys.executable, "-m", "rankscope.cli.main", "sql", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_store_directory_opens_only_once_its_collector_stopped(collector: Running) -> None:
    held = _rankscope_sql("--store", str(collector.store), "SELECT 1")
    assert (held.returncode, held.stdout) == (1, "")
    assert "held by a running collector: use --collector" in held.stderr

    collector.proc.popen.terminate()
    assert collector.proc.wait(30) == 0
    done = _rankscope_sql("--store", str(collector.store), "--format", "csv", "--param", "run=sql", SPANS_SQL)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[1] == "0,forward,2023-11-14T22:13:20.123456789Z"
    refused = _rankscope_sql("--store", str(collector.store), "SELECT * FROM file('/etc/passwd')")
    assert refused.returncode == 2 and "table function file()" in refused.stderr


def test_a_missing_store_or_a_bad_flag_is_explained(tmp_path: Path) -> None:
    missing = _rankscope_sql("--store", str(tmp_path / "nowhere"), "SELECT 1")
    assert missing.returncode == 1 and "no store at" in missing.stderr
    assert not (tmp_path / "nowhere").exists()
    bad = _rankscope_sql("--param", "no-equals-sign", "SELECT 1")
    assert bad.returncode == 2 and "expected NAME=VALUE" in bad.stderr

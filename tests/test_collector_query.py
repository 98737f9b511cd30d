"""The read-only guard (rankscope/collector/query.py) on its own; the engine's side is in test_collector_server.py."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rankscope.collector.query import (
    Limits,
    QueryRefused,
    ReadOnlyGuard,
    engine_settings,
    from_ipc,
    params_from_wire,
    params_to_wire,
    to_reply,
)
from rankscope.protos.v1 import query_pb2

GUARD = ReadOnlyGuard(["file", "url", "s3", "numbers", "someFutureLake", "merge"], ["otherdb"])


@pytest.mark.parametrize(
    "sql, expected",
    [
        ("SELECT 1", "SELECT 1"),
        ("select 1;", "select 1"),
        ("SELECT 1 ; -- done", "SELECT 1"),
        ("SELECT 1 -- a comment swallowing what follows", "SELECT 1"),
        ("  /* why */ WITH a AS (SELECT 1) SELECT * FROM a", "  /* why */ WITH a AS (SELECT 1) SELECT * FROM a"),
        ("SELECT 'x; DROP TABLE spans' AS s", "SELECT 'x; DROP TABLE spans' AS s"),
        ("SELECT 'it''s', 'a\\'b', `odd``name` FROM t", "SELECT 'it''s', 'a\\'b', `odd``name` FROM t"),
        ("SELECT * FROM numbers(3)", "SELECT * FROM numbers(3)"),
        ("SELECT format('{} {}', 'a', 'b')", "SELECT format('{} {}', 'a', 'b')"),
        ("SELECT value FROM metrics WHERE name = 'system.cpu.utilization'", "SELECT value FROM metrics WHERE name = 'system.cpu.utilization'"),
        ("SELECT currentDatabase(), t.settings FROM t", "SELECT currentDatabase(), t.settings FROM t"),
        ("SHOW TABLES", "SHOW TABLES"),
        ("SHOW COLUMNS FROM spans", "SHOW COLUMNS FROM spans"),
        ("SHOW CREATE TABLE spans", "SHOW CREATE TABLE spans"),
        ("DESC spans", "DESC spans"),
        ("DESCRIBE TABLE spans", "DESCRIBE TABLE spans"),
        ("EXPLAIN SELECT 1", "EXPLAIN SELECT 1"),
        ("SELECT count() FROM spans WHERE run_id = {run:String}", "SELECT count() FROM spans WHERE run_id = {run:String}"),
        ("SELECT 1 AS file", "SELECT 1 AS file"),
    ],
)
def test_reads_pass_without_their_trailing_semicolon_or_comment(sql: str, expected: str) -> None:
    assert GUARD.check(sql) == expected


@pytest.mark.parametrize(
    "sql, reason",
    [
        ("INSERT INTO spans SELECT * FROM spans", "only read statements"),
        ("ALTER TABLE spans DELETE WHERE 1", "only read statements"),
        ("DROP TABLE spans", "only read statements"),
        ("OPTIMIZE TABLE spans FINAL", "only read statements"),
        ("SET readonly = 0", "only read statements"),
        ("(SELECT 1)", "only read statements"),
        ("SELECT 1; DROP TABLE spans", "only one statement"),
        ("SELECT 1;; ", "only one statement"),
        ("SELECT 1 -- hidden\n; DROP TABLE spans", "only one statement"),
        ("SELECT 1 /* ; */ ; DROP TABLE spans", "only one statement"),
        ("SELECT 1 /* /* nested */ ; DROP TABLE spans */", "nested"),
        ("SELECT 1 /* never closed", "unterminated /\\* comment"),
        ("SELECT 'never closed", "unterminated ' quote"),
        ("SELECT $$x$$", "heredoc"),
        ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "table function file()"),
        ("SELECT file('/etc/passwd')", "table function file()"),
        ("SELECT * FROM `file` ('/etc/passwd')", "table function file()"),
        ("SELECT * FROM FILE /* x */ ('/etc/passwd')", "table function FILE()"),
        ("SELECT * FROM file\u200b('/etc/passwd')", "table function file()"),
        ("DESCRIBE url('http://example.com/x.csv')", "table function url()"),
        ("SELECT * FROM s3('https://bucket/x.parquet')", "table function s3()"),
        ("SELECT * FROM remote('other:9000', system.one)", "table function remote()"),
        ("SELECT * FROM python(df)", "table function python()"),
        ("SELECT * FROM someFutureLake('x')", "table function someFutureLake()"),
        ("SELECT 1 INTO OUTFILE '/tmp/x.csv'", "INTO OUTFILE"),
        ("SELECT 1 FORMAT JSON", "FORMAT clause"),
        ("SELECT 1 SETTINGS readonly = 0", "SETTINGS clause"),
        ("", "empty"),
        (" ; ", "empty"),
        ("SELECT * FROM system.processes", "database system is not readable"),
        ("SELECT * FROM `system`.`settings`", "database system is not readable"),
        ("SELECT * FROM \"SYSTEM\" . server_settings", "database SYSTEM is not readable"),
        ("SELECT * FROM INFORMATION_SCHEMA.TABLES", "database INFORMATION_SCHEMA is not readable"),
        ("DESCRIBE TABLE system.disks", "database system is not readable"),
        ("SELECT * FROM otherdb.t", "database otherdb is not readable"),
        ("SHOW TABLES FROM system", "database system is not readable"),
        ("SHOW PROCESSLIST", "'SHOW PROCESSLIST' is not accepted"),
        ("SHOW SETTINGS LIKE 'max%'", "'SHOW SETTINGS LIKE' is not accepted"),
        ("SHOW CREATE USER default", "'SHOW CREATE USER' is not accepted"),
        ("SHOW", "'SHOW' is not accepted"),
        ("SELECT getSetting('readonly')", "getSetting\\(\\) reveals"),
        ("SELECT getServerSetting('path')", "getServerSetting\\(\\) reveals"),
        ("SELECT GETMERGETREESETTING('index_granularity')", "GETMERGETREESETTING\\(\\) reveals"),
        ("SELECT filesystemCapacity()", "filesystemCapacity\\(\\) reveals"),
        ("SELECT dictGetString('system.d', 'x', 1)", "dictGetString\\(\\) reveals"),
        ("SELECT * FROM merge('system', 'processes')", "table function merge\\(\\)"),
        ("SELECT `\\x66ile`('/etc/hostname')", "backslash in a quoted name"),
        ('SELECT count() FROM "\\x73ystem".one', "backslash in a quoted name"),
        ("SELECT count() FROM {db:Identifier}.one", "Identifier} placeholder is not accepted"),
        ("DESC FILESYSTEM CACHE 's3_cache'", "DESCRIBE FILESYSTEM CACHE is not accepted"),
    ],
)
def test_everything_else_is_refused_with_the_reason(sql: str, reason: str) -> None:
    with pytest.raises(QueryRefused, match=reason):
        GUARD.check(sql)


def test_table_functions_of_the_engine_are_refused_unless_they_stay_in_the_store() -> None:
    guard = ReadOnlyGuard(["numbers", "brandNewConnector"])
    assert "brandnewconnector" in guard.refused_functions
    assert "numbers" not in guard.refused_functions
    assert {"file", "url", "s3", "python", "filesystem"} <= guard.refused_functions


def test_tuples_come_back_as_tuples_where_the_statement_says_tuple(tmp_path) -> None:
    """JSON has only lists: the critical path's ``(group_name, seq) IN {pairs:Array(Tuple(String, Int64))}``
    reached the engine as ``[['dp[0]', 16]]`` through the Query service and was refused."""
    from rankscope.collector.store.chdb import EmbeddedStore

    sql = ("SELECT count() AS n FROM (SELECT 'dp[0]' AS g, toInt64(16) AS s) WHERE (g, s) IN {pairs:Array(Tuple(String, Int64))}"
           " AND tupleElement({t:Tuple(String, Array(Tuple(UInt8, String)))}, 1) = 'a' AND 1 IN {ranks:Array(UInt32)}")  # fmt: skip
    params = {"pairs": [("dp[0]", 16), ("tp[1]", 3)], "t": ("a", [(1, "b")]), "ranks": [1, 2]}
    assert params_from_wire(params_to_wire(params), sql) == params
    store = EmbeddedStore(tmp_path / "store")
    try:
        assert store.query_arrow(sql, params_from_wire(params_to_wire(params), sql)).to_pylist() == [{"n": 1}]
    finally:
        store.close()


def test_params_travel_json_encoded_and_come_back_as_given() -> None:
    params = {"s": "a'b", "n": 3, "f": 0.5, "b": True, "ranks": [1, 2], "names": ["x", "it's"]}
    assert params_from_wire(params_to_wire(params)) == params
    with pytest.raises(QueryRefused, match="JSON-encoded"):
        params_from_wire({"s": "not json"})


def test_engine_settings_make_the_read_readonly_last_and_cap_the_rows() -> None:
    settings = engine_settings(Limits(max_rows=100), max_rows=10)
    assert list(settings)[-1] == "readonly" and settings["readonly"] == 1
    assert settings["max_result_rows"] == 10
    assert engine_settings(Limits(max_rows=100), max_rows=1000)["max_result_rows"] == 100
    assert engine_settings(Limits(max_rows=100))["max_result_rows"] == 100


def test_engine_settings_bound_memory_threads_and_time_by_the_callers_deadline() -> None:
    limits = Limits(max_execution_s=60, max_memory_bytes=2**28, max_threads=3)
    settings = engine_settings(limits, tag="rankscope-read-1", within_s=29.9996)
    assert (settings["max_memory_usage"], settings["max_threads"], settings["log_comment"]) == (2**28, 3, "rankscope-read-1")
    assert settings["max_execution_time"] == 30.0
    assert engine_settings(limits, within_s=600)["max_execution_time"] == 60
    assert engine_settings(limits, within_s=-1)["max_execution_time"] == 0.1  # past its deadline: the least, not none
    assert "log_comment" not in engine_settings(limits)


def test_results_travel_as_one_arrow_ipc_stream_in_a_reply_serialised_once() -> None:
    table = pa.table({"a": [1, 2], "t": pa.array([1, 2], pa.timestamp("ns", tz="UTC"))})
    reply = query_pb2.QueryResponse.FromString(to_reply(table, 0.25))  # what the client parses
    assert from_ipc(reply.arrow_ipc).equals(table)
    assert (reply.rows, reply.elapsed_s) == (2, 0.25)
    large = pa.table({"s": ["x" * 1000] * 200})  # a stream of 200 kB: its length in three varint bytes
    assert from_ipc(query_pb2.QueryResponse.FromString(to_reply(large, 0.0)).arrow_ipc).equals(large)
    assert query_pb2.QueryResponse.FromString(to_reply(pa.table({}), 0.0)).rows == 0

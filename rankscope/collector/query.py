"""The read-only guard: what every reader of the store (Query service, direct readers) runs through.

Two layers, because neither is enough alone:

1. The engine runs every statement with ``readonly=1`` and result limits. ``readonly`` stops
   writes, DDL and table functions such as ``file()``, ``url()`` or chDB's ``python()``, but
   (seen with chDB 4.4, engine 26.9) not ``INTO OUTFILE`` (it writes the file), not the scalar
   function ``file('/etc/passwd')`` (it reads the file), and it runs ``SELECT 1; SELECT 2`` as
   two statements.
2. This module checks the statement text first: one statement, starting with SELECT, WITH,
   SHOW (TABLES, COLUMNS, CREATE TABLE), DESCRIBE, DESC or EXPLAIN; no INTO OUTFILE, no FORMAT or
   SETTINGS clause (results travel as Arrow under the collector's limits); no table function that
   reaches outside the store; no other database than the store's (``system``,
   ``information_schema``: running queries, settings, the data path) and no function that reveals
   the engine's settings or its machine (``REVEALING_FUNCTIONS``: ``getSetting``,
   ``getServerSetting``, ``filesystemCapacity``...); no ``{name:Identifier}`` placeholder (its
   value, a name, would reach the engine unchecked).

Table functions: an allow-list, not a deny-list. ClickHouse 26.9 has about 110 of them and every
release adds more that reach outside (``filesystem``, ``arrowstream``, ``bigquery``, ``paimon*``,
``ytsaurus``, ``prometheusQuery``...): a deny-list is out of date the day the engine is
upgraded. So a call ``name(...)`` is refused when ``name`` is one of the engine's table
functions (``system.table_functions``, read when a reader opens, merged with
``OUTSIDE_TABLE_FUNCTIONS``) and is not one of the few that only compute or read tables of this
store (``LOCAL_TABLE_FUNCTIONS``; not ``merge``, ``loop`` or ``mergeTreeIndex``, which name
their database in a string, out of this check's sight). The
check matches names wherever they are called, not only after FROM: a position-based check
would need ClickHouse's whole grammar (DESCRIBE, JOIN, comma joins, ``IN``, ``view()``...), and
the only ordinary functions sharing a name with a table function are ``file`` (reads a server
file: refused on purpose), ``format`` (allowed) and ``fuzzQuery`` (refused, no loss).

The tokenizer follows ClickHouse's lexer (``'...'`` strings with backslash and doubled-quote
escapes, ``"..."``/`` `...` `` identifiers with doubled-quote escapes only: the engine reads
``\\x66`` in a name as ``f``, so a backslash there is refused, ``--`` and ``# `` comments to the end of
the line, ``/* */`` comments). Where the two could disagree about what is code and what is
text (a comment opened inside a comment, which ClickHouse nests; a ``$`` that may open a
heredoc string), the statement is refused rather than guessed at: a divergence there could hide
a second statement or an INTO OUTFILE from this check.
"""

from __future__ import annotations

import json

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from rankscope.collector.store.base import QueryError
from rankscope.protos.v1 import query_pb2

READ_STATEMENTS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN"})

#: Table functions that compute rows or read tables of this store, and nothing else.
LOCAL_TABLE_FUNCTIONS: tuple[str, ...] = (
    "numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateSeries", "primes",
    "generateRandom", "values", "SQLStandardValues", "null", "format", "view", "viewIfPermitted",
    "viewExplain", "fuzzJSON",
)
_LOCAL = frozenset(name.lower() for name in LOCAL_TABLE_FUNCTIONS)

#: Table functions that reach outside the store (ClickHouse 26.9 and chDB 4.4), refused even
#: when a reader could not read ``system.table_functions``.
OUTSIDE_TABLE_FUNCTIONS = frozenset(
    name.lower()
    for name in (
        "arrowstream", "azureBlobStorage", "azureBlobStorageCluster", "bigquery", "cluster",
        "clusterAllReplicas", "cosn", "deltaLake", "deltaLakeAzure", "deltaLakeAzureCluster",
        "deltaLakeCluster", "deltaLakeLocal", "deltaLakeS3", "deltaLakeS3Cluster", "dictionary", "eval",
        "executable", "file", "fileCluster", "filesystem", "fuzzQuery", "gcs", "hdfs", "hdfsCluster",
        "hudi", "hudiCluster", "iceberg", "icebergAzure", "icebergAzureCluster", "icebergCluster",
        "icebergHDFS", "icebergHDFSCluster", "icebergLocal", "icebergLocalCluster", "icebergS3",
        "icebergS3Cluster", "input", "jdbc", "mongodb", "mysql", "odbc", "oss", "paimon", "paimonAzure",
        "paimonAzureCluster", "paimonCluster", "paimonHDFS", "paimonHDFSCluster", "paimonLocal",
        "paimonS3", "paimonS3Cluster", "postgresql", "prometheusQuery", "prometheusQueryRange", "python",
        "redis", "remote", "remoteSecure", "s3", "s3Cluster", "sqlite", "timeSeriesData",
        "timeSeriesMetricFamilies", "timeSeriesMetrics", "timeSeriesSamples", "timeSeriesSelector",
        "timeSeriesTags", "url", "urlCluster", "ytsaurus",
    )
)


#: Databases no reader sees, whatever the engine lists: running queries, settings, the data path.
HIDDEN_DATABASES = frozenset({"system", "information_schema"})

#: Functions that reveal the engine's settings, its machine or tables outside the statement's text.
REVEALING_FUNCTIONS = frozenset(
    name.lower()
    for name in (
        "getSetting", "getSettingOrDefault", "getServerSetting", "getMergeTreeSetting", "getMacro",
        "getServerPort", "tcpPort", "getOSKernelVersion", "getClientHTTPHeader", "filesystemAvailable",
        "filesystemCapacity", "filesystemUnreserved", "serverUUID", "hostName", "fullHostName",
        "displayName", "uptime", "zookeeperSessionUptime", "currentProfiles", "enabledProfiles",
        "defaultProfiles", "currentRoles", "enabledRoles", "defaultRoles", "hasColumnInTable", "joinGet",
        "joinGetOrNull", "catboostEvaluate", "logTrace", "getMaxTableNameLengthForDatabase",
    )
)
#: ... and every dictionary function (dictGet*, dictHas, dictIsIn): a dictionary names its source in a string
_DICTIONARY_FUNCTION = re.compile(r"dict(get|has|isin)", re.IGNORECASE)

#: What may follow SHOW: the store's tables, their columns and definitions; not processes, settings, users...
SHOW_WHAT = frozenset({"TABLES", "COLUMNS", "CREATE"})


class QueryFailed(Exception):
    """A query that did not produce a result; the subclasses say what a caller can do about it."""


class QueryRefused(QueryFailed):
    """The statement is refused by the guard, or invalid for the engine: the message says why."""


class ResultTooLarge(QueryFailed):
    """The result is over the row, byte, memory or time limit: narrow the query or raise max_rows."""


class QueryBusy(QueryFailed):
    """The collector runs as many queries as it allows and as many wait: try again shortly."""


#: trailing metadata of the Query service's RESOURCE_EXHAUSTED that means QueryBusy, not ResultTooLarge
BUSY_METADATA = "rankscope-busy"


# --- tokenizer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Token:
    kind: str  # "word" (bare identifier or keyword), "quoted" (quoted identifier), "string", "punct"
    text: str  # without quotes or escapes for "quoted" and "string"
    start: int
    end: int


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIGITS = re.compile(r"[0-9]+")
_QUOTES = {"'": "string", '"': "quoted", "`": "quoted"}


def tokenize(sql: str) -> list[Token]:
    """The significant tokens of ``sql`` (comments and whitespace dropped); QueryRefused if unsure.

    Any non-ASCII character outside quotes counts as whitespace: wherever ClickHouse reads it
    otherwise, this only makes the check see more words than the engine does, never fewer.
    """
    tokens: list[Token] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c.isspace() or not c.isascii():
            i += 1
        elif sql.startswith("--", i) or c == "#":
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            if end < 0:
                raise QueryRefused(f"unterminated /* comment at position {i}")
            if "/*" in sql[i + 2 : end]:
                raise QueryRefused(f"nested /* comments (at position {i}) are not accepted")
            i = end + 2
        elif c in _QUOTES:
            text, end = _quoted(sql, i)
            if _QUOTES[c] == "quoted" and "\\" in sql[i:end]:
                # ClickHouse reads `\x66ile` as `file` and "\x73ystem" as "system": a name must be seen as the engine sees it
                raise QueryRefused(f"a backslash in a quoted name (position {i}) is not accepted: write the name without escapes")
            tokens.append(Token(_QUOTES[c], text, i, end))
            i = end
        elif c == "$":
            raise QueryRefused(f"'$' outside quotes (position {i}): heredoc strings are not accepted, use '...'")
        else:
            m = _WORD.match(sql, i) or _DIGITS.match(sql, i)
            end = m.end() if m else i + 1
            tokens.append(Token("word" if m and not c.isdigit() else "punct", sql[i:end], i, end))
            i = end
    return tokens


def _quoted(sql: str, start: int) -> tuple[str, int]:
    """The text of the quoted string or identifier opening at ``start``, and the index after it."""
    quote = sql[start]
    out: list[str] = []
    i = start + 1
    while i < len(sql):
        c = sql[i]
        if c == "\\" and i + 1 < len(sql):
            out.append(sql[i + 1])
            i += 2
        elif c == quote and sql.startswith(quote * 2, i):
            out.append(quote)
            i += 2
        elif c == quote:
            return "".join(out), i + 1
        else:
            out.append(c)
            i += 1
    raise QueryRefused(f"unterminated {quote} quote opened at position {start}")


# --- the guard --------------------------------------------------------------------------------


class ReadOnlyGuard:
    """Checks that a statement only reads the store; see the module docstring for the rules."""

    def __init__(self, table_functions: Iterable[str] = (), databases: Iterable[str] = ()):
        names = OUTSIDE_TABLE_FUNCTIONS | {name.lower() for name in table_functions}
        self.refused_functions = frozenset(names - _LOCAL)
        self.hidden_databases = HIDDEN_DATABASES | {name.lower() for name in databases}

    def check(self, sql: str) -> str:
        """``sql`` without its trailing ``;``, or QueryRefused with the reason."""
        tokens = tokenize(sql)
        semis = [k for k, t in enumerate(tokens) if t.kind == "punct" and t.text == ";"]
        if semis and semis[0] != len(tokens) - 1:
            raise QueryRefused("only one statement is accepted (found text after ';')")
        if semis:
            tokens = tokens[:-1]
        if not tokens:
            raise QueryRefused("the statement is empty")
        first = tokens[0]
        if first.kind != "word" or first.text.upper() not in READ_STATEMENTS:
            allowed = ", ".join(sorted(READ_STATEMENTS))
            raise QueryRefused(f"only read statements are accepted ({allowed}); this one starts with {first.text!r}")
        if first.text.upper() == "SHOW":
            _check_show(tokens)
        if first.text.upper() in ("DESCRIBE", "DESC") and len(tokens) > 1 and tokens[1].text.upper() == "FILESYSTEM":
            raise QueryRefused("DESCRIBE FILESYSTEM CACHE is not accepted: it shows the server's cache paths")
        for k, tok in enumerate(tokens):
            follows = tokens[k + 1] if k + 1 < len(tokens) else None
            called = follows is not None and follows.kind == "punct" and follows.text == "("
            if tok.kind in ("word", "quoted") and called and tok.text.lower() in self.refused_functions:
                raise QueryRefused(
                    f"table function {tok.text}() reaches outside the store and is not accepted"
                    f" (those that stay inside it: {', '.join(LOCAL_TABLE_FUNCTIONS)})"
                )
            if tok.kind in ("word", "quoted") and called and _reveals(tok.text):
                raise QueryRefused(f"function {tok.text}() reveals the collector's settings, machine or other tables and is not accepted")
            if tok.kind == "word" and tok.text.lower() == "identifier" and k and tokens[k - 1].text == ":":
                raise QueryRefused(
                    "an {name:Identifier} placeholder is not accepted: write names in the statement, where this check reads them"
                )
            if tok.kind in ("word", "quoted") and not called and tok.text.lower() in self.hidden_databases:
                raise QueryRefused(
                    f"database {tok.text} is not readable here: only the store's own tables are (SHOW TABLES lists them)"
                )
            if tok.kind != "word" or called:
                continue
            word = tok.text.upper()
            if word == "OUTFILE":
                raise QueryRefused("INTO OUTFILE is not accepted: results come back to the caller")
            if word in ("FORMAT", "SETTINGS") and not _is_name(tokens, k):
                raise QueryRefused(
                    f"a {word} clause is not accepted: results travel as Arrow under the collector's"
                    f" settings and limits (a column named {tok.text} must be quoted: `{tok.text}`)"
                )
        # Cut after the last token: a trailing `-- comment` must not swallow what the engine
        # appends (the store may add the SETTINGS that make it read-only).
        return sql[: tokens[-1].end]


def _is_name(tokens: list[Token], k: int) -> bool:
    """Whether word ``k`` names something (``t.settings``, ``AS format``)."""
    before = tokens[k - 1] if k else None
    return before is not None and (before.text == "." or before.text.upper() == "AS")


def _check_show(tokens: list[Token]) -> None:
    """SHOW TABLES, SHOW COLUMNS and SHOW CREATE TABLE only (SHOW PROCESSLIST, SETTINGS, USERS... are refused)."""
    what = [t.text.upper() for t in tokens[1:3]]
    if not what or what[0] not in SHOW_WHAT or (what[0] == "CREATE" and what[1:] != ["TABLE"]):
        shown = " ".join(t.text for t in tokens[:3])
        raise QueryRefused(f"{shown!r} is not accepted: SHOW TABLES, SHOW COLUMNS FROM t and SHOW CREATE TABLE t are")


def _reveals(name: str) -> bool:
    return name.lower() in REVEALING_FUNCTIONS or _DICTIONARY_FUNCTION.match(name) is not None


# --- running a statement under the guard -----------------------------------------------------


class ArrowReadable(Protocol):
    """The part of a store a reader needs (``store.base.Store`` has it)."""

    def query_arrow(
        self, sql: str, params: Mapping[str, object] | None = None, *, settings: Mapping[str, object] | None = None
    ) -> pa.Table: ...


class Commandable(Protocol):
    """The part of a store that stops a read (``store.base.Store`` has it)."""

    def command(self, sql: str) -> None: ...


@dataclass(frozen=True)
class Limits:
    """What one read may cost; a caller's ``max_rows`` can lower ``max_rows``, never raise it."""

    max_rows: int = 1_000_000
    #: the result's size, as the engine counts it and as it decodes (a repeated value counts each time).
    #: The collector holds an answered result a few times over (the engine's output, the table, the
    #: reply: 450 MB ones peaked it at 2.8 GB), so the default is what a reader looks at, not a dump
    max_bytes: int = 128 * 2**20
    max_execution_s: float = 60.0
    #: the engine's memory for one read (max_memory_usage)
    max_memory_bytes: int = 2**30
    #: the engine's threads for one read (max_threads): a read never takes every core from the inserts
    max_threads: int = 2
    #: the CPU priority (nice, 0-19) of a read's threads in the engine (os_thread_priority; where the
    #: engine may lower it: CAP_SYS_NICE) and in the collector (read_pool): inserts come first
    nice: int = 19


#: ClickHouse error names that mean "over a limit" rather than "wrong statement"
_LIMIT_ERRORS = ("TOO_MANY_ROWS_OR_BYTES", "TIMEOUT_EXCEEDED", "MEMORY_LIMIT_EXCEEDED")


def engine_settings(limits: Limits, max_rows: int = 0, *, tag: str = "", within_s: float | None = None) -> dict[str, object]:
    """The settings every read runs with; ``readonly`` comes last, since it forbids later changes.

    ``tag`` marks the read (``log_comment``) so that ``cancel_read`` can find and stop it;
    ``within_s`` (the caller's deadline) shortens the time limit: no read outlives its caller.
    """
    rows = min(max_rows, limits.max_rows) if max_rows > 0 else limits.max_rows
    seconds = limits.max_execution_s if within_s is None else max(0.1, min(within_s, limits.max_execution_s))
    return {
        "max_result_rows": rows,
        "max_result_bytes": limits.max_bytes,
        "result_overflow_mode": "throw",
        "max_execution_time": round(seconds, 3),
        "timeout_overflow_mode": "throw",
        "max_memory_usage": limits.max_memory_bytes,
        "max_threads": limits.max_threads,
        **({"os_thread_priority": limits.nice} if limits.nice else {}),
        **({"log_comment": tag} if tag else {}),
        "readonly": 1,
    }


def cancel_read(store: Commandable, tag: str) -> None:
    """Stop the read marked ``tag`` (``engine_settings``) wherever it is, on chDB and ClickHouse alike."""
    if not re.fullmatch(r"[\w\-]+", tag):
        raise ValueError(f"a read's tag is a plain word, got {tag!r}")
    store.command(f"KILL QUERY WHERE Settings['log_comment'] = '{tag}' ASYNC")


def guard_for(store: ArrowReadable) -> ReadOnlyGuard:
    """A guard that also knows the table functions and the other databases of this store's engine."""
    names = store.query_arrow("SELECT name FROM system.table_functions", settings={"readonly": 1})
    databases = store.query_arrow("SELECT name FROM system.databases WHERE name != currentDatabase()", settings={"readonly": 1})
    return ReadOnlyGuard(names["name"].to_pylist(), databases["name"].to_pylist())


def run_read_only(
    store: ArrowReadable,
    guard: ReadOnlyGuard,
    sql: str,
    params: Mapping[str, object] | None = None,
    limits: Limits = Limits(),
    max_rows: int = 0,
    *,
    tag: str = "",
    within_s: float | None = None,
) -> pa.Table:
    """Check ``sql``, run it read-only under ``limits``; QueryRefused or ResultTooLarge otherwise.

    ``tag`` and ``within_s``: see ``engine_settings``. Store errors other than the engine
    refusing the statement (an unreachable server, a closed store) pass through unchanged: they
    are not the statement's fault.
    """
    statement = guard.check(sql)
    settings = engine_settings(limits, max_rows, tag=tag, within_s=within_s)
    try:
        return store.query_arrow(statement, dict(params or {}), settings=settings)
    except QueryError as e:
        message = str(e)
        if any(f"({name})" in message for name in _LIMIT_ERRORS):
            raise ResultTooLarge(message) from None
        raise QueryRefused(message) from None


def params_to_wire(params: Mapping[str, object] | None) -> dict[str, str]:
    """Parameter values for the Query service: each one JSON-encoded, so lists stay lists.

    The store formats every value exactly once for its engine; text that was already formatted
    (an array literal) would be escaped a second time as a string.
    """
    return {name: json.dumps(value) for name, value in (params or {}).items()}


#: a ``{name:Type}`` placeholder of a statement
_PLACEHOLDER = re.compile(r"\{(\w+):([^{}]+)\}")


def params_from_wire(params: Mapping[str, str], sql: str = "") -> dict[str, object]:
    """The values ``params_to_wire`` encoded, tuples again where ``sql``'s placeholder types say Tuple
    (JSON has only lists, and the engine reads ``[['tp[0]', 3]]`` as no Array(Tuple(String, Int64)));
    raises QueryRefused for a value that is not JSON."""
    types = dict(_PLACEHOLDER.findall(sql))
    try:
        return {name: _typed(json.loads(text), types.get(name, "")) for name, text in params.items()}
    except json.JSONDecodeError as e:
        raise QueryRefused(f"parameter values travel JSON-encoded: {e}") from None


def _typed(value: object, type_: str) -> object:
    """``value`` with its lists made tuples where ClickHouse type ``type_`` has a Tuple."""
    type_ = type_.strip()
    inner = type_[type_.find("(") + 1 : -1] if type_.endswith(")") else ""
    if type_.startswith(("Nullable(", "LowCardinality(")):
        return _typed(value, inner)
    if not isinstance(value, list):
        return value
    if type_.startswith("Array("):
        return [_typed(v, inner) for v in value]
    if type_.startswith("Tuple("):
        return tuple(_typed(v, t) for v, t in zip(value, _top_level(inner)))
    return value


def _top_level(types: str) -> list[str]:
    """The comma-separated types of a Tuple's inside, commas inside parentheses left alone."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(types):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(types[start:i])
            start = i + 1
    return [*parts, types[start:]]


def to_reply(table: pa.Table, elapsed_s: float) -> bytes:
    """A ``QueryResponse`` of ``table`` as it goes on the wire, the Arrow IPC stream written once, in place.

    Built as a message and then serialised, a result was copied four times on its way out (its
    stream, that stream as bytes, the message, the message serialised): a 450 MB result took the
    collector 1.6 GB beyond the table. Protobuf fields may come in any order, so the small ones go
    first, then field 1's key and length, then the stream, into one buffer of the exact size.
    """
    head = query_pb2.QueryResponse(rows=table.num_rows, elapsed_s=elapsed_s).SerializeToString()
    counted = pa.MockOutputStream()
    _write_ipc(counted, table)
    size = counted.size()
    key = _varint(1 << 3 | 2) + _varint(size)  # field 1, length-delimited
    out = pa.allocate_buffer(len(head) + len(key) + size)
    with pa.FixedSizeBufferWriter(out) as sink:
        sink.write(head + key)
        _write_ipc(sink, table)
    return out.to_pybytes()


def _write_ipc(sink: pa.NativeFile, table: pa.Table) -> None:
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _varint(value: int) -> bytes:
    """A protobuf base-128 varint: the public protobuf API encodes whole messages only (its varint
    encoder is ``google.protobuf.internal``, free to change between releases)."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(data).read_all()

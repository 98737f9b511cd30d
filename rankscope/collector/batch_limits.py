"""What one batch may declare and carry: its counts against its bytes, the lengths of its ids and
texts, the ranges of its integers.

A batch is a few bytes on the wire that can claim millions of rows, names of megabytes, or sizes
the store's columns cannot hold. Each is checked here before the decoders allocate anything for
it, so that what a request costs the collector is bounded by its size, and a refusal names the
field (``IngestError``, gRPC INVALID_ARGUMENT) instead of failing later in Arrow or in the store.
Kept apart from ``batch_columns`` (how a column is read): these are the limits, said once.
"""

from __future__ import annotations

from collections.abc import Sized

#: characters of an id or a name: run ids, hosts, group names, worlds, devices, versions, string-table entries
MAX_ID_CHARS = 256
#: characters of a free text: configuration JSON, an exit's message, an action's evidence, a summary
MAX_TEXT_CHARS = 1 << 20
#: characters of a stack dump (every thread of a large process)
MAX_STACK_CHARS = 16 << 20
#: elements of a repeated field: heartbeats, registrations or ends per batch, groups, members, figures
MAX_REPEATED = 1 << 17
#: operations in flight per heartbeat (agents send at most 16)
MAX_IN_FLIGHT = 256
#: ranks in one world (the ``runs.world_size`` column holds more; no job has this many)
MAX_WORLD = 1 << 22
#: tensor-, pipeline- and data-parallel sizes, and a run's attempts (UInt16 columns)
MAX_UINT16 = (1 << 16) - 1
#: bytes of a string column's values once every row holds its own copy, per byte of the payload:
#: rows name strings of the batch's table by index, and a few bytes of indices can name a long
#: string a million times
STRING_EXPANSION = 16


class IngestError(ValueError):
    """A malformed or untrue batch (gRPC INVALID_ARGUMENT): resending it unchanged can never succeed.

    ``reason`` is one word for the metric of refusals: count, length, range, time, ended (rows dated
    after their run's end), order, rank, or malformed."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class UnregisteredRun(IngestError):
    """Rows of a run no rank has registered, or (``rank``) of a process that has not registered while
    an earlier one of its rank did (gRPC FAILED_PRECONDITION): they register first."""

    def __init__(self, run_id: str, rank: int | None = None, parts: frozenset[bytes] = frozenset()) -> None:
        #: in a relay's batch, the ids of the parts whose process is not registered (the others can be stored)
        self.parts = parts
        if rank is None:
            message = (f"run {shown(run_id)} is not registered: its ranks send a Register before their rows (healing's"
                       " actions and self-checks need none)")  # fmt: skip
        else:
            message = (f"rank {rank} of run {shown(run_id)}: the process that sent this batch is not registered, and the"
                       " rank's registration is an earlier process's: a restarted rank sends its Register before its rows")  # fmt: skip
        super().__init__(message, "unregistered")


def shown(text: str, limit: int = 64) -> str:
    """``text`` quoted for a refusal's message, cut at ``limit`` characters: the message travels back
    as gRPC metadata, which a client refuses beyond 16 KiB (it would see RESOURCE_EXHAUSTED)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def check_count(where: str, count: int, row_bytes: int, payload_bytes: int) -> None:
    """Refuse a declared row count that ``payload_bytes`` cannot hold at ``row_bytes`` a row."""
    if count * row_bytes > payload_bytes:
        raise IngestError(
            f"{where}: count={count} rows need at least {count * row_bytes} bytes ({row_bytes} a row), but the"
            f" payload has {payload_bytes}: every column holds exactly `count` values",
            "count",
        )


def check_repeated(where: str, values: Sized, limit: int = MAX_REPEATED) -> None:
    """Refuse a repeated field longer than ``limit``."""
    if len(values) > limit:
        raise IngestError(f"{where}: {len(values)} elements, more than the {limit} allowed", "count")


def check_text(where: str, value: str, limit: int = MAX_ID_CHARS) -> None:
    """Refuse a string longer than ``limit`` characters."""
    if len(value) > limit:
        raise IngestError(f"{where}: {len(value)} characters, more than the {limit} allowed", "length")


def check_range(where: str, value: int, lo: int, hi: int) -> None:
    """Refuse an integer outside ``lo .. hi``."""
    if not lo <= value <= hi:
        raise IngestError(f"{where} is {value}: it must lie in {lo} .. {hi}", "range")

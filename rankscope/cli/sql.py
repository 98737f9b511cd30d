"""``rankscope sql "SELECT ..."``: one read-only statement, printed as a table, CSV or JSON.

For post mortems and scripts, so the output is exact and quiet: stdout holds the result and
nothing else, stderr stays empty on success. Exit status: 0 done, 2 the statement is refused
or invalid (or its result is over the collector's limits), 1 the collector or store cannot be
reached (or refused the token).

Values: times are ISO 8601 UTC strings with nanoseconds (``2024-05-01T12:00:00.123456789Z``),
in every format, so a time pasted back into SQL means the same instant; binary values are
hexadecimal; non-finite floats are ``NaN``, ``Infinity``, ``-Infinity`` (JSON has no literal
for them: there they are strings); arrays and maps are JSON text in table and CSV output.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from typing import TYPE_CHECKING

from rankscope.cli import source

if TYPE_CHECKING:
    import pyarrow as pa

HELP = "run one read-only SQL statement on the stored data (SELECT, WITH, SHOW, DESCRIBE, EXPLAIN)"
EXTRA = "collector"


def _param(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE for a {{NAME:Type}} placeholder, got {text!r}")
    return name, value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("statement", metavar="SQL", help="the statement; {name:Type} placeholders take --param values")
    source.add_arguments(parser)
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table",
                        help="table: aligned columns; csv: a header line, then rows; json: one array of objects")
    parser.add_argument("--param", metavar="NAME=VALUE", type=_param, action="append", default=[],
                        help="a value for the placeholder {NAME:Type}, bound by the engine (repeatable)")
    parser.add_argument("--max-rows", metavar="N", type=int, default=0,
                        help="refuse results over N rows (default: the collector's limit)")


def run(args: argparse.Namespace) -> int:
    from rankscope.collector.client import QueryFailed, QueryRefused, ResultTooLarge

    try:
        reader = source.open_reader(args)
        try:
            table = reader.query(args.statement, dict(args.param), max_rows=max(args.max_rows, 0))
        finally:
            reader.close()
    except (QueryRefused, ResultTooLarge) as e:
        print(f"rankscope sql: refused: {e}", file=sys.stderr)
        return 2
    except QueryFailed as e:
        print(f"rankscope sql: {e}", file=sys.stderr)
        return 1
    rows = _rows(table)
    {"table": _print_table, "csv": _print_csv, "json": _print_json}[args.format](table.column_names, rows)
    return 0


def _rows(table: pa.Table) -> list[list[object]]:
    """Python values per row, times already turned into ISO strings."""
    columns = [_times_as_text(column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)) for column in table.columns]
    return [list(row) for row in zip(*(c.to_pylist() for c in columns))] if columns else []


def _times_as_text(array: pa.Array) -> pa.Array:
    """Timestamps (also inside lists) as ISO 8601 UTC strings with all their digits."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_timestamp(array.type):
        return pc.strftime(array, format="%Y-%m-%dT%H:%M:%SZ")
    if pa.types.is_list(array.type):
        return pa.ListArray.from_arrays(array.offsets, _times_as_text(array.values), mask=array.is_null())
    return array


def _plain(value: object) -> object:
    """A value JSON can hold, as the module docstring describes."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # dates, decimals, UUIDs


def _cell(value: object) -> str:
    plain = _plain(value)
    if plain is None:
        return "NULL"
    if isinstance(plain, (list, dict)):
        return json.dumps(plain, ensure_ascii=False)
    if isinstance(plain, bool):
        return "true" if plain else "false"
    return str(plain)


def _print_table(names: list[str], rows: list[list[object]]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(name)] + [len(row[i]) for row in cells]) for i, name in enumerate(names)]
    numeric = [all(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in rows) and bool(rows) for i in range(len(names))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(names), line(["-" * w for w in widths])] + [line(row) for row in cells]
    sys.stdout.write("\n".join(out) + "\n")


def _print_csv(names: list[str], rows: list[list[object]]) -> None:
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(names)
    writer.writerows([[("" if v is None else _cell(v)) for v in row] for row in rows])


def _print_json(names: list[str], rows: list[list[object]]) -> None:
    records = [{name: _plain(v) for name, v in zip(names, row)} for row in rows]
    json.dump(records, sys.stdout, ensure_ascii=False, allow_nan=False)
    sys.stdout.write("\n")

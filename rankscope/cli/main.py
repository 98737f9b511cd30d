"""Entry point of the ``rankscope`` command.

Each subcommand is one small module ``rankscope.cli.<name>`` listed in ``COMMANDS`` below. A
command module defines:

- ``HELP: str``: one line for ``rankscope --help``;
- ``PASSTHROUGH: bool`` (optional, default False): when true, every argument after the
  subcommand's name goes to it unparsed, including ``--help`` (``rankscope train --help``
  prints the trainer's own help);
- ``configure(parser: argparse.ArgumentParser) -> None``: adds its arguments (not called
  for passthrough commands);
- ``run(args: argparse.Namespace) -> int``: does the work; a passthrough command gets
  ``args.argv: list[str]``;
- ``EXTRA: str`` (optional): the extra of the package (pyproject.toml's optional-dependencies)
  whose packages the command needs beyond the agent's. ``pip install rankscope`` is the agent
  alone, so a command whose extra is missing says which one to install (``missing_extra``)
  instead of ending in an ImportError's traceback.

Command modules are imported to build ``rankscope --help``, so they must import nothing heavy
(torch, chdb, streamlit, grpc) nor anything of an extra at module level: do that inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

import rankscope
from rankscope.common.cmdline import Parser

# Subcommand name -> module under rankscope.cli. Add a command by adding one module and one
# entry here.
COMMANDS: dict[str, str] = {
    "train": "rankscope.cli.train",
    "collector": "rankscope.cli.collector",
    "schema": "rankscope.cli.schema",
    "sql": "rankscope.cli.sql",
    "diagnose": "rankscope.cli.diagnose",
    "anatomy": "rankscope.cli.anatomy",
    "compare": "rankscope.cli.compare",
    "scenario": "rankscope.cli.scenario",
    "spool": "rankscope.cli.spool",
    "relay": "rankscope.cli.relay",
    "simulate": "rankscope.cli.simulate",
    "testbed": "rankscope.cli.testbed",
    "selfcheck": "rankscope.cli.selfcheck",
    "launch": "rankscope.cli.launch",
    "node": "rankscope.cli.node",
    "dashboard": "rankscope.cli.dashboard",
    "demo": "rankscope.cli.demo",
}


def _command(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name])


def build_parser() -> argparse.ArgumentParser:
    """The full parser; passthrough commands appear in the help but parse nothing."""
    parser = Parser(
        prog="rankscope",
        description="Find what slows down or breaks a distributed training job, and where.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {rankscope.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = _command(name)
        if getattr(module, "PASSTHROUGH", False):
            p = sub.add_parser(name, help=module.HELP, description=module.HELP, add_help=False)
            p.add_argument("argv", nargs=argparse.REMAINDER, help="arguments for the command")
        else:
            p = sub.add_parser(name, help=module.HELP, description=module.HELP)
            module.configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``rankscope`` command line; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:  # Ctrl-C: what the command started is its to stop; no traceback
        print(f"{' '.join(['rankscope', *argv[:1]])}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as error:
        # parsing counts too: an argument type may import the command's code (--listen does)
        message = missing_extra(argv[0], error) if argv else None
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1


def missing_extra(command: str, error: ModuleNotFoundError) -> str | None:
    """What to install when ``command`` stopped on ``error``: its ``EXTRA``, or None where the missing
    module is rankscope's own (a broken install) or the command declares no extra."""
    extra = getattr(sys.modules.get(COMMANDS.get(command, "")), "EXTRA", None)
    missing = error.name or ""
    if extra is None or missing.partition(".")[0] in ("", "rankscope"):
        return None
    return f"rankscope {command} needs the {extra} extra: pip install 'rankscope[{extra}]' (no module named {missing})"


def _dispatch(argv: list[str]) -> int:
    # argparse cannot hand over arguments that start with '-' (argparse.REMAINDER rejects a
    # leading option such as `train --help`), so passthrough commands are dispatched here.
    if argv and argv[0] in COMMANDS:
        module = _command(argv[0])
        if getattr(module, "PASSTHROUGH", False):
            return _status(module.run(argparse.Namespace(command=argv[0], argv=argv[1:])))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return _status(_command(args.command).run(args))


def _status(code: int | None) -> int:
    return 0 if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())

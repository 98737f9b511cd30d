"""Argument types shared by the commands: a bad value is refused by argparse with a clear message
(``rankscope collector: error: argument --flush-interval: must be more than 0 seconds, got 0``)
before anything starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rankscope.common.settings import Settings

#: the detectors' thresholds shared by ``collector`` and ``diagnose`` (``Settings``' defaults: a test keeps them equal)
HANG_AFTER_S = 30.0
SILENT_AFTER_S = 15.0



def count(minimum: int) -> Callable[[str], int]:
    """A whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def within(minimum: int, maximum: int, what: str) -> Callable[[str], int]:
    """A whole number from ``minimum`` to ``maximum``; ``what`` names it in the message ("a port")."""

    def parse(text: str) -> int:
        value = count(minimum)(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{what} is {minimum}-{maximum}, got {value}")
        return value

    return parse


def port(minimum: int = 0) -> Callable[[str], int]:
    """A TCP port from ``minimum`` (0: the system picks a free one) to 65535."""
    return within(minimum, 65535, "a port")


def above(minimum: float, expected: str = "a number", unit: str = "") -> Callable[[str], float]:
    """A finite number above ``minimum`` (``unit`` follows it in the message)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not minimum < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be more than {minimum:g}{unit} and finite, got {text}")
        return value

    return parse


seconds = above(0, "seconds", " seconds")
#: a number more than 0 (a rate, a factor)
positive = above(0)


def listen(text: str) -> str:
    """HOST:PORT to listen on (port 0 picks a free one)."""
    from rankscope.collector.server import parse_listen  # light: no grpc call, no chdb

    try:
        parse_listen(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_thresholds(parser: argparse.ArgumentParser) -> None:
    """``--hang-after`` and ``--silent-after``: the same flags wherever the detectors run."""
    parser.add_argument("--hang-after", metavar="SECONDS", type=seconds, default=HANG_AFTER_S,
                        help=f"a run whose steps stop advancing this long while heartbeats arrive is hung (default: {HANG_AFTER_S:g})")
    parser.add_argument("--silent-after", metavar="SECONDS", type=seconds, default=SILENT_AFTER_S,
                        help=f"a rank whose heartbeats stop this long without a last word is lost (default: {SILENT_AFTER_S:g})")  # fmt: skip


def thresholds(args: argparse.Namespace) -> Settings:
    """The detectors' settings from ``add_thresholds``' flags."""
    from rankscope.common.settings import Settings  # pyarrow: only once the command runs

    return Settings(hang_after_s=args.hang_after, silent_after_s=args.silent_after)

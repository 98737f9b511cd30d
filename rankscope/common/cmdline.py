"""Command lines that refuse bad input in one line: ``PROG: error: WHAT (PROG --help lists ...)``.

argparse prints its whole usage before the error; with a dozen flags that buries the one line
that says what is wrong. Every parser of the ``rankscope`` command (the trainer's too) is a
``Parser``, so a new user meets the same one-line refusal everywhere, with exit status 2.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["Parser"]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

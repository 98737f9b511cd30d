"""Import a program's heavy modules with the garbage collector off, then freeze them.

Importing torch makes about a million objects and no garbage; with the collector on, its passes
over them cost each process 0.7-0.8 s of CPU at start, and the interpreter's last collection walks
them again at exit. Eight ranks and their torchrun agent on two cores pay that on every job.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["frozen_imports"]


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """Run the block (its imports) with the collector off; what it made is then frozen (``gc.freeze``:
    never collected, never walked again) and the collector is on again for what the program makes."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()

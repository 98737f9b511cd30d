"""The PEM file flags of ``rankscope collector`` (``--tls-cert``, ``--tls-key``) and of the reading
commands (``--tls-ca``), checked when the command line is parsed.

gRPC reports an unreadable or wrong PEM file only when the server binds or the first call
fails, as "Failed to bind" or "UNAVAILABLE"; checked here, a typo exits 2 with the file's name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def pem_file(block: str) -> Callable[[str], Path]:
    """An argparse type: a readable file holding a PEM ``block`` ("CERTIFICATE", "PRIVATE KEY")."""

    def parse(text: str) -> Path:
        path = Path(text)
        try:
            content = path.read_text(encoding="ascii", errors="replace")
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot read {text}: {e.strerror or e}") from None
        # "-----BEGIN PRIVATE KEY-----", "-----BEGIN RSA PRIVATE KEY-----", "-----BEGIN EC PRIVATE KEY-----"
        if not any(line.startswith("-----BEGIN ") and line.rstrip().endswith(f"{block}-----") for line in content.splitlines()):
            raise argparse.ArgumentTypeError(f"{text} holds no PEM {block} (-----BEGIN ...{block}-----)")
        return path

    return parse

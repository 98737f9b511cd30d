"""Whether a process listens at a gRPC target: before a relay or a collector takes a Unix socket's
path (gRPC replaces the file when it binds, taking the clients of whoever listened there), and
before a rank sends through a relay."""

from __future__ import annotations

import socket

__all__ = ["answers"]


def answers(target: str, timeout_s: float = 0.5) -> bool:
    """Whether something listens at ``target`` (``unix:/path`` or ``host:port``)."""
    try:
        if target.startswith("unix:"):
            with socket.socket(socket.AF_UNIX) as probe:
                probe.settimeout(timeout_s)
                probe.connect(target.removeprefix("unix:"))
        else:
            host, _, port = target.rpartition(":")
            socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except (OSError, ValueError):
        return False
    return True

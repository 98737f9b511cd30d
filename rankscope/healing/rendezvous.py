"""A c10d rendezvous store of its own: ``python -m rankscope.healing.rendezvous --listen ADDRESS:PORT``.

torchrun's c10d rendezvous keeps its state in a TCPStore that one node's agent serves by default
(``is_host``): when that node dies, the rendezvous dies with it and no survivor can restart. A
self-healing job serves it from a process outside the training hosts (the control host), and every
agent joins it as a client (``is_host=false``). Runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
from datetime import timedelta


def serve(host: str, port: int) -> None:
    """Serve the store at ``host:port`` until a signal ends this process."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timedelta(seconds=60))
    print(f"rendezvous store serving on {host}:{store.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rankscope.healing.rendezvous", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, metavar="ADDRESS:PORT")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--listen {args.listen!r}: expected ADDRESS:PORT")
    serve(host, int(port))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A fixed delay on every frame into and out of one simulated host, applied and removed while its
TCP connections stay open.

The kernel here has no netem, so a user-space relay holds the frames. For host I (namespace
``HOST``, interface ``eth0``, veth peer ``hI`` on the switch's bridge ``br0``):

- the relay creates two TAP devices: ``dly`` in the host's namespace, with ``eth0``'s MAC (the
  stack drops a frame that a device received for another MAC, even once redirected to ``eth0``),
  and ``dlyI``, a port of ``br0``, in the switch's. They exist while the relay holds them, so a
  relay that dies takes them (and their filters and bridge entries) along;
- a tc filter on ``eth0``'s egress redirects every frame the host sends into ``dly``; the relay
  reads it there, holds it, and writes it into ``dlyI``, where the bridge receives it;
- a static bridge entry sends the frames for the host's MAC to ``dlyI`` from the first one on;
  the relay holds those and writes them into ``dly``, whose ingress filter hands them to ``eth0``
  as received frames. ``dlyI`` does not learn, so the frames the relay writes there never move
  the host's MAC, not even while the delay is being removed;
- broadcasts still reach ``eth0`` through ``hI`` too (undelayed duplicates, harmless to ARP).

The host keeps its interface, address and MAC, so its connections see only the delay. While the
delay is on, the host's frames bypass ``eth0``'s root qdisc and the switch port ``hI``.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rankscope.common.cmdline import Parser

__all__ = ["DelayRelay", "RelayError", "main", "start_delay"]

HOST_TAP = "dly"
#: preference of our filter on the host's interface, so that ``stop`` deletes it and no other
FILTER_PREF = "7"
READY = "ready"
MAX_FRAME = 65536
READY_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0
CHECK_NAMESPACES_S = 2.0

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000


class RelayError(RuntimeError):
    """The delay could not be applied (the relay did not start, or a command failed)."""


@dataclass
class DelayRelay:
    """A delay on one host: the relay process, and what it changed outside its own TAP devices."""

    switch_ns: str
    host_ns: str
    host_if: str
    switch_tap: str
    host_mac: str
    process: subprocess.Popen[bytes]
    added_clsact: bool = False

    @classmethod
    def start(
        cls, switch_ns: str, host_ns: str, host_index: int, delay_ms: float, *,
        host_if: str = "eth0", bridge: str = "br0",
    ) -> DelayRelay:  # fmt: skip
        """Delay every frame into and out of host ``host_index`` by ``delay_ms`` until ``stop()``.

        The relay runs as a process of its own in a new session, so that freezing or killing the
        simulated hosts never touches it and the caller's GIL never slows it.
        """
        switch_tap = f"{HOST_TAP}{host_index}"
        (link,) = json.loads(_run("ip", "-n", host_ns, "-j", "link", "show", "dev", host_if).stdout)
        process = subprocess.Popen(
            [sys.executable, "-m", "rankscope.testbed.relay", switch_ns, host_ns, switch_tap, str(delay_ms)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        relay = cls(switch_ns, host_ns, host_if, switch_tap, link["address"], process)
        try:
            relay._wait_ready()
            _run("ip", "-n", host_ns, "link", "set", HOST_TAP, "address", relay.host_mac, "addrgenmode", "none")
            _run("ip", "-n", host_ns, "link", "set", HOST_TAP, "up")
            _tc(host_ns, "qdisc", "add", "dev", HOST_TAP, "clsact")
            _redirect(host_ns, "ingress", HOST_TAP, host_if)
            _run("ip", "-n", switch_ns, "link", "set", switch_tap, "addrgenmode", "none", "master", bridge)
            _run("bridge", "-n", switch_ns, "link", "set", "dev", switch_tap, "learning", "off")
            _run("ip", "-n", switch_ns, "link", "set", switch_tap, "up")
            _run("bridge", "-n", switch_ns, "fdb", "replace", relay.host_mac, "dev", switch_tap, "master", "static")
            # Last: from here on the host's frames go to the relay, which is ready for them.
            relay.added_clsact = _tc(host_ns, "qdisc", "add", "dev", host_if, "clsact", check=False).returncode == 0
            _redirect(host_ns, "egress", host_if, HOST_TAP, "pref", FILTER_PREF)
        except BaseException:
            relay.stop()
            raise
        return relay

    def _wait_ready(self) -> None:
        assert self.process.stdout is not None
        with self.process.stdout:
            readable, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT_S)
            if not readable or self.process.stdout.readline().decode().strip() != READY:
                status = self.process.poll()
                raise RelayError(f"the delay relay for {self.host_ns} did not start (exit status {status})")

    def stop(self) -> None:
        """Remove the delay (idempotent; also when the namespaces are gone) without losing or reordering a frame.

        The relay lets go of what it holds and passes frames on at once; then the host sends
        directly again, frames for it are flooded (so they reach it through ``hI``) until the
        bridge learns its MAC there, and the relay ends.
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
        _tc(self.host_ns, "filter", "del", "dev", self.host_if, "egress", "pref", FILTER_PREF, check=False)
        if self.added_clsact:
            _tc(self.host_ns, "qdisc", "del", "dev", self.host_if, "clsact", check=False)
            self.added_clsact = False
        _run("bridge", "-n", self.switch_ns, "fdb", "del", self.host_mac, "dev", self.switch_tap, "master", check=False)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


start_delay = DelayRelay.start


def _redirect(namespace: str, hook: str, dev: str, target: str, *options: str) -> None:
    """Every frame at ``dev``'s ``hook`` (ingress or egress) goes on at ``target``'s, as if received or sent there.

    A u32 filter with an empty key matches every frame (``matchall`` is not built into this kernel).
    """
    _tc(namespace, "filter", "add", "dev", dev, hook, *options, "protocol", "all", "u32", "match", "u32", "0", "0",
        "action", "mirred", hook, "redirect", "dev", target)  # fmt: skip


def _tc(namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("tc", "-n", namespace, *args, check=check)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    if check and done.returncode != 0:
        raise RelayError(f"{' '.join(cmd)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


# --- the relay process ---------------------------------------------------------------------------


@contextmanager
def _in_namespace(namespace: str) -> Iterator[None]:
    """Run the block in network namespace ``namespace`` (Python 3.11 has no os.setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {namespace}: {os.strerror(err)}")
        try:
            yield
        finally:
            libc.setns(home, CLONE_NEWNET)
    finally:
        os.close(target)
        os.close(home)


def open_tap(namespace: str, name: str) -> int:
    """A non-blocking fd of a new TAP device ``name`` in ``namespace``; the device lasts as long as the fd.

    The device belongs to the namespace /dev/net/tun was opened in, whichever this process is in later.
    """
    with _in_namespace(namespace):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def relay(host_fd: int, switch_fd: int, delay_s: float, signal_fd: int, still_there: Callable[[], bool]) -> None:
    """Pass frames between the two TAPs, each ``delay_s`` after it was read, in order per direction.

    ``signal_fd`` receives the numbers of the signals that came. SIGUSR1 lifts the delay: what is
    held goes at once and later frames pass straight through, so that the path through the relay
    can be taken down without reordering a connection's frames. SIGTERM sends what is held or
    queued and returns. So does a device that has gone, or, checked every few seconds,
    ``still_there()`` turning false: the TAP devices keep their namespaces alive, so a deleted
    namespace would otherwise live on, unnamed, as long as the relay.
    """
    peer = {host_fd: switch_fd, switch_fd: host_fd}
    held: dict[int, deque[tuple[float, bytes]]] = {fd: deque() for fd in peer}  # by the fd it was read from
    poller = select.epoll()
    for fd in (host_fd, switch_fd, signal_fd):
        poller.register(fd, select.EPOLLIN)
    next_check = time.monotonic() + CHECK_NAMESPACES_S
    while True:
        due = min([next_check, *(queue[0][0] for queue in held.values() if queue)])
        ready = poller.poll(max(0.0, due - time.monotonic()))
        signals = os.read(signal_fd, 64) if any(fd == signal_fd for fd, _ in ready) else b""
        if signals:
            delay_s = 0.0
        for fd, queue in held.items():
            while True:
                try:
                    frame = os.read(fd, MAX_FRAME)
                except BlockingIOError:
                    break
                except OSError:  # EBADFD: the device was deleted
                    return
                queue.append((time.monotonic() + delay_s, frame))
        now = time.monotonic()
        for fd, queue in held.items():
            while queue and (signals or queue[0][0] <= now):
                _send(peer[fd], queue.popleft()[1])
        if signal.SIGTERM in signals:
            return
        if now >= next_check:
            if not still_there():
                return
            next_check = now + CHECK_NAMESPACES_S


def _send(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:
        pass  # a frame the kernel refuses (its device going away) is lost, as on a wire


def _namespace_ids(names: tuple[str, ...]) -> list[int | None]:
    """Each named namespace's inode (None once deleted): it changes when the name goes or names another one."""
    ids: list[int | None] = []
    for name in names:
        try:
            ids.append(os.stat(f"/run/netns/{name}").st_ino)
        except FileNotFoundError:
            ids.append(None)
    return ids


def main(argv: list[str] | None = None) -> None:
    """``python -m rankscope.testbed.relay SWITCH_NS HOST_NS SWITCH_TAP DELAY_MS``, as ``start_delay`` runs it."""
    parser = Parser(prog="python -m rankscope.testbed.relay", description=main.__doc__)
    parser.add_argument("switch_ns", help="namespace of the switch, where the bridge's TAP port goes")
    parser.add_argument("host_ns", help="namespace of the delayed host, where its TAP goes")
    parser.add_argument("switch_tap", help="name of the TAP port on the bridge")
    parser.add_argument("delay_ms", type=float, help="delay per frame and direction")
    args = parser.parse_args(argv)
    # The signals reach the loop through a pipe: no handler runs between reading a frame and holding it.
    signal_r, signal_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(signal_w, warn_on_full_buffer=False)
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    namespaces = (args.host_ns, args.switch_ns)
    ids = _namespace_ids(namespaces)
    host_fd = open_tap(args.host_ns, HOST_TAP)
    switch_fd = open_tap(args.switch_ns, args.switch_tap)
    print(READY, flush=True)
    relay(host_fd, switch_fd, args.delay_ms / 1000, signal_r, lambda: _namespace_ids(namespaces) == ids)


if __name__ == "__main__":
    main()

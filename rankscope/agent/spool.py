"""Batches waiting on local disk while the collector is unreachable; replayed in order later.

One spool per Transport, in ``RANKSCOPE_SPOOL_DIR``. Its files are named after its owner
(``<owner>.lock`` and ``<owner>.<n>.seg``). A segment is a sequence of records: a
little-endian header (length of the serialized Batch, number of events in it) and the Batch.
Segments are deleted once every record in them has been acknowledged; when the spool grows
past its limit, whole segments are dropped, oldest first, and their records counted.

Owners hold an exclusive ``flock`` on their lock file while they live. The kernel releases it
when the process ends however it ends, so a lock file anybody can lock belongs to an ended
process: its segments are left over, and the next spool in that directory adopts them
(``adopt_leftovers``) and replays them before its own. The lock file is created under a
temporary name and renamed once locked, so nobody can mistake a starting owner for a dead one.

All methods are called from one thread (the transport's sender). Files are opened unbuffered: a
buffered file holds a lock while it reads or writes, and a process forked meanwhile (a data-loader
worker) would wait on that lock for ever when it lets go of its copy (``forget_after_fork``).
"""

from __future__ import annotations

import fcntl
import glob
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

__all__ = ["Record", "Segment", "Spool", "leftovers"]

HEADER = struct.Struct("<II")  # batch length, events in it
SEGMENT_BYTES = 4 << 20


class _OwnerLock:
    """An owner's lock file, held (flock) while the owner's segments are in use."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.segments = 0  # adopted segments not yet finished

    @classmethod
    def create(cls, directory: Path, owner: str) -> _OwnerLock:
        tmp = directory / f".{owner}.lock.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = directory / f"{owner}.lock"
        os.rename(tmp, path)
        return cls(path, fd)

    @classmethod
    def take_if_dead(cls, path: Path) -> _OwnerLock | None:
        """The lock of an ended owner, now ours; None while its owner lives (or it is gone)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return cls(path, fd)

    def release(self, *, delete: bool) -> None:
        if self.fd < 0:
            return
        if delete:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


@dataclass(eq=False)
class Segment:
    """One segment file: records are read from ``read_at``; ``outstanding`` are read, not yet done."""

    path: Path
    lock: _OwnerLock
    adopted: bool
    size: int = 0
    read_at: int = 0
    outstanding: int = 0
    sealed: bool = False  # no more appends
    reader: BinaryIO | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


@dataclass(frozen=True)
class Record:
    data: bytes
    events: int
    segment: Segment


class Spool:
    """An on-disk FIFO of serialized batches with a byte limit; files appear on first use."""

    def __init__(self, directory: Path, owner: str, max_bytes: int, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = directory
        self.owner = owner
        self.max_bytes = max_bytes
        # Room is made a whole segment at a time: keep segments small next to the limit.
        self.segment_bytes = max(1, min(segment_bytes, max_bytes // 8))
        self._segments: list[Segment] = []  # oldest first; adopted ones before our own
        self._lock: _OwnerLock | None = None
        self._writer: BinaryIO | None = None
        self._next_index = 0

    @property
    def empty(self) -> bool:
        """Nothing left to read (records read but not yet done do not count)."""
        return all(s.read_at >= s.size for s in self._segments)

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def adopt_leftovers(self) -> int:
        """Take over the segments of ended owners in the directory; returns how many."""
        if not self.directory.is_dir():
            return 0
        adopted: list[Segment] = []
        for lock_path in sorted(self.directory.glob("*.lock")):
            owner = lock_path.name[: -len(".lock")]
            if owner == self.owner:
                continue
            lock = _OwnerLock.take_if_dead(lock_path)
            if lock is None:
                continue
            paths = sorted(self.directory.glob(f"{glob.escape(owner)}.*.seg"))
            if not paths:
                lock.release(delete=True)
                continue
            lock.segments = len(paths)
            adopted += [Segment(p, lock, adopted=True, size=p.stat().st_size, sealed=True) for p in paths]
        self._segments[:0] = adopted
        return len(adopted)

    def append(self, data: bytes, events: int) -> tuple[int, int]:
        """Write one batch at the end; returns (batches, events) dropped, oldest first, to make room."""
        record_size = HEADER.size + len(data)
        dropped = (0, 0)
        if record_size > self.max_bytes:
            return 1, events
        while self._segments and self.size_bytes + record_size > self.max_bytes:
            dropped = _add(dropped, self._drop_oldest())
        _write_all(self._current_writer(), HEADER.pack(len(data), events) + data)
        segment = self._segments[-1]
        segment.size += record_size
        if segment.size >= self.segment_bytes:
            self._seal_current()
        return dropped

    def pop(self) -> Record | None:
        """The oldest unread record, marked outstanding until ``done``; None when there is none."""
        for segment in list(self._segments):
            record = self._read(segment)
            if record is not None:
                return record
            self._finish_if_done(segment)
        return None

    def done(self, segment: Segment) -> None:
        """A record popped from ``segment`` was acknowledged (or given up): the file may go."""
        segment.outstanding -= 1
        self._finish_if_done(segment)

    def close(self) -> None:
        """Release the files: what was fully acknowledged goes; the rest stays for the next owner."""
        self._seal_current()
        for segment in list(self._segments):
            segment.close()
            self._finish_if_done(segment)
        held = {id(s.lock): s.lock for s in self._segments}
        for lock in held.values():
            lock.release(delete=False)
        if self._lock is not None and id(self._lock) not in held:
            self._lock.release(delete=True)
        self._segments = []
        self._lock = None

    def forget_after_fork(self) -> None:
        """In a forked child: drop our copies of the descriptors, touch no file."""
        for segment in self._segments:
            segment.close()
            if segment.lock.fd >= 0:
                os.close(segment.lock.fd)
                segment.lock.fd = -1
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._lock is not None and self._lock.fd >= 0:
            os.close(self._lock.fd)
            self._lock.fd = -1
        self._segments = []

    # --- internals -------------------------------------------------------------------------

    def _current_writer(self) -> BinaryIO:
        if self._writer is None:
            if self._lock is None:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._lock = _OwnerLock.create(self.directory, self.owner)
            path = self.directory / f"{self.owner}.{self._next_index:06d}.seg"
            self._next_index += 1
            self._writer = open(path, "wb", buffering=0)  # noqa: SIM115 - kept open across appends
            self._segments.append(Segment(path, self._lock, adopted=False))
        return self._writer

    def _seal_current(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._segments[-1].sealed = True

    def _read(self, segment: Segment) -> Record | None:
        if segment.read_at + HEADER.size > segment.size:
            return None
        if segment.reader is None:
            segment.reader = open(segment.path, "rb", buffering=0)  # noqa: SIM115 - kept open while read
        segment.reader.seek(segment.read_at)
        header = _read_up_to(segment.reader, HEADER.size)
        if len(header) < HEADER.size:
            return None
        length, events = HEADER.unpack(header)
        data = _read_up_to(segment.reader, length)
        if len(data) < length:  # cut short by a crash while writing: the rest is lost
            segment.size = segment.read_at
            return None
        segment.read_at += HEADER.size + length
        segment.outstanding += 1
        return Record(data, events, segment)

    def _drop_oldest(self) -> tuple[int, int]:
        """Delete the oldest segment; returns its unread (batches, events)."""
        if self._segments[0] is self._segments[-1] and self._writer is not None:
            self._seal_current()
        segment = self._segments.pop(0)
        dropped = (0, 0)
        while True:
            record = self._read(segment)
            if record is None:
                break
            segment.outstanding -= 1
            dropped = _add(dropped, (1, record.events))
        segment.close()
        segment.path.unlink(missing_ok=True)
        segment.size = 0
        self._release_adopted(segment)
        return dropped

    def _finish_if_done(self, segment: Segment) -> None:
        """Delete a segment read to the end with every record done (the one being written too)."""
        if segment.outstanding > 0 or segment.read_at < segment.size or segment not in self._segments:
            return  # still in use, or already dropped while its records were in flight
        if not segment.sealed:
            self._seal_current()
        self._segments.remove(segment)
        segment.close()
        segment.path.unlink(missing_ok=True)
        self._release_adopted(segment)

    def _release_adopted(self, segment: Segment) -> None:
        if segment.adopted:
            segment.lock.segments -= 1
            if segment.lock.segments == 0:
                segment.lock.release(delete=True)


def leftovers(directory: Path) -> list[Path]:
    """Segment files of ended owners in ``directory`` (those of live owners are in use)."""
    found: list[Path] = []
    for lock_path in sorted(directory.glob("*.lock")):
        lock = _OwnerLock.take_if_dead(lock_path)
        if lock is not None:
            found += sorted(directory.glob(f"{glob.escape(lock_path.name[: -len('.lock')])}.*.seg"))
            lock.release(delete=False)
    return found


def _write_all(file: BinaryIO, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[file.write(view) :]


def _read_up_to(file: BinaryIO, size: int) -> bytes:
    """``size`` bytes, fewer only at the end of the file (an unbuffered read may return less)."""
    parts, left = [], size
    while left > 0:
        part = file.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]

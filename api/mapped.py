"""A file that all of `tputune serve --workers N`'s processes map, changed under flock(2): the state they
share (a key's rate-limit bucket, api.auth.SharedBuckets; the streams a key follows, api.streams). And
whether a process they know by pid is alive."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path


class MappedFile:
    """`size` bytes of `path`, mapped; zeroed if `reset` (a new server: nothing is left of the last one's)."""

    def __init__(self, path: Path, size: int, reset: bool = False) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if reset:
            os.ftruncate(self._fd, 0)
        os.ftruncate(self._fd, size)
        self.map = mmap.mmap(self._fd, size)
        self._lock = threading.Lock()  # flock(2) does not exclude this process's other threads

    @contextlib.contextmanager
    def locked(self) -> Iterator[mmap.mmap]:
        """The map, held against every other thread and process that maps the file."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self.map
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


def digest(key: str) -> int:
    """`key` as a nonzero 64-bit number (0 marks a free slot)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") or 1


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's
    return True

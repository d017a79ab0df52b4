"""One writer per index directory: an advisory lock on `DIR/.write.lock`, held for the whole of `cprag index`.

The lock is `flock` on an open file, so the kernel drops it the moment its holder exits, however it exits
(SIGKILL included): a lock file left by a killed process is stale by construction and the next writer takes it
over. The file itself only says who holds or last held the lock (pid and host), for the error message.
Readers never take it; they open the last committed version (cprag.index.reader) and only look at the lock to tell
"being built" from "damaged".
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from cprag.errors import IndexLocked
from cprag.index.layout import IndexLayout


def holder(path: Path) -> dict:
    """What the lock file says about its last holder ({} when unreadable)."""
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


class WriteLock:
    """`with WriteLock(index_dir):` holds the index's writer lock or raises `IndexLocked` at once."""

    def __init__(self, index_dir: str | Path):
        self.path = IndexLayout(index_dir).write_lock
        self._fd: int | None = None

    def acquire(self) -> WriteLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = holder(self.path)
            raise IndexLocked(str(self.path), info.get("pid"), info.get("host")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            # the file stays: deleting it would let a waiting writer lock an unlinked inode while a third
            # creates a fresh file, and two writers would both hold "the" lock
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> WriteLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def writer_pid(index_dir: str | Path) -> int | None:
    """The pid of the process writing `index_dir` now (0 when unknown), or None when no one holds the lock.
    Tested with a shared lock on the existing file, so a reader never creates it or holds it for long."""
    path = IndexLayout(index_dir).write_lock
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder(path).get("pid") or 0
    finally:
        os.close(fd)  # closing drops the shared lock, if it was taken
    return None

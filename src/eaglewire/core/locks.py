"""Exclusive locks on what a job writes: one writer per output directory (and per cache entry).

A lock is ``fcntl.flock`` on a lock file that holds its holder's pid and command line. The
kernel drops a flock when its holder dies however it dies, so a lock file whose lock can be
taken is stale: its pid ended (``kill -9``, a crash) without removing it; it is taken over with
a warning. A released lock removes its file, and a directory the lock itself created is removed
too while it is still empty, so a job that fails before writing anything leaves nothing behind.
Locks are per process and reentrant: a command that composes others (quickstart runs prepare,
train, bench) may lock a directory an inner step locks again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["LOCK_NAME", "DirectoryLocked", "directory_lock", "file_lock"]

log = logging.getLogger(__name__)

LOCK_NAME = ".eaglewire.lock"

_held: dict[Path, int] = {}  # lock files this process holds -> how many times (reentrancy)
_held_guard = threading.Lock()


class DirectoryLocked(RuntimeError):
    """Another live process holds the lock (a user error: the CLI prints it and exits 2)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def _holder(fd: int) -> dict:
    """What the lock file says of its holder ({} if it is empty or not ours)."""
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        data = json.loads(os.read(fd, 4096).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _open_locked(path: Path, wait: bool) -> tuple[int, dict] | tuple[None, dict]:
    """(fd holding the flock, what the file said before) or (None, the holder) if it is taken."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
            holder = _holder(fd)
            os.close(fd)
            return None, holder
        try:  # the holder may have removed the file between our open and our flock: lock the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, _holder(fd)
        os.close(fd)


def _created_dirs(directory: Path) -> list[Path]:
    """The directories ``mkdir(parents=True)`` would create for ``directory``, innermost first."""
    missing = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        missing.append(d)
    return missing


@contextmanager
def file_lock(path: str | Path, *, wait: bool = False, what: str | None = None) -> Iterator[Path]:
    """Hold an exclusive lock on the lock file ``path`` (created, and removed on release).

    ``wait``: block until a live holder releases it; otherwise raise DirectoryLocked naming the
    holder's pid and ``what`` (what is locked, for the message; default the lock file).
    """
    path = Path(path).absolute()
    with _held_guard:
        if path in _held:
            _held[path] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield path
        finally:
            with _held_guard:
                _held[path] -= 1
        return
    fd, before = _open_locked(path, wait)
    if fd is None:
        pid = before.get("pid")
        command = f" ({before['command']})" if before.get("command") else ""
        who = f"pid {pid}{command}" if pid else "another process"
        raise DirectoryLocked(f"{what or path} is in use: {who} is writing there (lock {path}); wait for it to "
                              f"finish{f' or stop it (kill {pid})' if pid else ''}, or choose another directory",
                              pid)
    try:
        old = before.get("pid")
        if old and old != os.getpid():
            state = "which is no longer running" if not _pid_alive(old) else "which no longer holds it"
            log.warning("taking over the stale lock %s left by pid %s, %s", path, old, state)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps({"pid": os.getpid(), "command": " ".join(sys.argv)[:300]}).encode())
        with _held_guard:
            _held[path] = 1
        try:
            yield path
        finally:
            with _held_guard:
                del _held[path]
            path.unlink(missing_ok=True)  # before the unlock: a waiter then sees the inode is gone
    finally:
        os.close(fd)


@contextmanager
def directory_lock(directory: str | Path, *, what: str | None = None, name: str = LOCK_NAME) -> Iterator[Path]:
    """Be the only writer of ``directory`` (created if missing) while the block runs; a second
    writer gets DirectoryLocked naming the first's pid. ``what`` names the directory for the
    message (``--out runs/data``); ``name`` is the lock file's (one per rank under torchrun).
    Yields the directory."""
    directory = Path(directory)
    created = _created_dirs(directory.absolute())
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with file_lock(directory / name, what=what or str(directory)):
            yield directory
    finally:
        for d in created:  # innermost first; stops at the first that holds something
            try:
                d.rmdir()
            except OSError:
                break

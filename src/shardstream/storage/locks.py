"""Who may write: exclusive flock on a file, held while the holder lives.

The kernel drops an flock when its holder dies, however it dies, so a lock that can be taken
proves the holder gone. Where a filesystem refuses locks, the holder's ``host pid`` line
written into the file lets this host tell a dead local process from a live one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator


def open_lock(path: str | os.PathLike, create: bool = True) -> int:
    """A descriptor on the lock file ``path`` (created if ``create``), to lock and close."""
    return os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)


def take(fd: int, wait: bool = False) -> bool:
    """Take ``fd``'s exclusive lock; without ``wait``, False if another holder has it.

    Other errors (a filesystem without locks) are raised.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def release(fd: int) -> None:
    """Drop the lock and close ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(path: str | os.PathLike) -> Iterator[int]:
    """Hold ``path``'s lock for the block, waiting for it first."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        take(fd, wait=True)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield fd
    finally:
        release(fd)


def holder_line() -> bytes:
    """This process as a lock file's content: ``host pid``."""
    return f"{socket.gethostname()} {os.getpid()}\n".encode()


def holder_dead(path: str | os.PathLike) -> int | None:
    """Lock ``path`` if its holder is dead; returns the descriptor holding the lock, else None.

    Getting the lock proves the holder gone. Where locks are unsupported, a dead pid on this
    host (from the ``host pid`` line) counts; another host's holder is taken as alive.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None  # its holder just finished, or another cleaner removed it
    try:
        if not take(fd):
            os.close(fd)
            return None  # alive
    except OSError:
        if not _dead_on_this_host(fd):
            os.close(fd)
            return None
        return fd
    if os.fstat(fd).st_nlink == 0:
        os.close(fd)  # released by its holder (or removed by another cleaner) after we opened it
        return None
    return fd


def _dead_on_this_host(fd: int) -> bool:
    try:
        host, pid = os.pread(fd, 256, 0).decode().split()
        pid = int(pid)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False

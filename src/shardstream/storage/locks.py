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
import stat
from collections.abc import Iterator
from pathlib import Path


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


# Readers and retention: a reader holds a shared lock on a committed checkpoint's manifest
# while it reads; retention deletes a checkpoint only when it can take that lock exclusively.


def _open_regular(path: str | os.PathLike) -> int | None:
    """``path`` opened for reading if it is a regular file, else None: a FIFO opened without
    O_NONBLOCK waits for a writer forever (its reader then refuses it by name)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def lease(path: str | os.PathLike) -> int | None:
    """A shared lock on ``path`` (a checkpoint's manifest) for a reader: the descriptor to
    ``release`` when done, or None when the file is gone or being deleted.

    Where the filesystem has no locks, the descriptor comes back unlocked: reading goes on
    unprotected, as it would without leases.
    """
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # retention holds it: being deleted
        os.close(fd)
        return None
    except OSError:
        return fd
    try:
        here = os.stat(path)
    except OSError:
        here = None
    mine = os.fstat(fd)
    if here is None or (here.st_dev, here.st_ino) != (mine.st_dev, mine.st_ino):
        release(fd)  # deleted (renamed away) between our open and our lock
        return None
    return fd


def claim_unread(path: str | os.PathLike) -> tuple[bool, int | None]:
    """For retention: ``(free, fd)``. ``free`` is False while a reader holds a ``lease`` on
    ``path`` (a checkpoint's manifest); otherwise ``fd`` holds its exclusive lock, to
    ``release`` after deleting, or is None where there is nothing to lock (no file, no
    locks)."""
    fd = _open_regular(path)
    if fd is None:
        return True, None
    try:
        if take(fd):
            return True, fd
    except OSError:
        os.close(fd)
        return True, None
    os.close(fd)
    return False, None


def manifest_read_by(directory: str | os.PathLike, name: str) -> Path:
    """The manifest (file ``name``) a reader of ``directory`` leases: its own, or for the
    ``huggingface/`` export inside a step, the step's (retention deletes the two together)."""
    directory = Path(directory)
    own = directory / name
    if not os.path.lexists(own) and directory.name == "huggingface":
        if os.path.lexists(directory.parent / name):
            return directory.parent / name
    return own


@contextlib.contextmanager
def reading(manifest: str | os.PathLike) -> Iterator[None]:
    """Hold a ``lease`` on a checkpoint's ``manifest`` for the block, where there is one
    (a checkpoint of another format has nothing to lease)."""
    fd = lease(manifest)
    try:
        yield
    finally:
        if fd is not None:
            release(fd)

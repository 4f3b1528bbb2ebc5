"""Nothing counts until it is complete: temporary names, fsync, then rename."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..errors import OutOfSpaceError, ShardstreamError, TargetExistsError, UsageError

TMP_MARK = ".tmp-"
# A staged directory ``T.tmp-<token>`` has an owner file ``T.tmp-<token>.owner`` beside it (not
# inside, so it never travels into the target): "host pid", flock-ed by the owner for as long as
# the directory exists. The lock goes when the owner dies, however it dies, so the next
# staged_directory for T can tell a dead merge's leftovers from a live one's work in progress.
OWNER_SUFFIX = ".owner"
# A claim whose new owner file a cleaner removes before it is locked starts again.
CLAIM_ATTEMPTS = 5


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory below ``root`` (files first, then their directories)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new content, never part."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.errno == 28:
            raise OutOfSpaceError(f"{path}: no space left on device") from None
        raise
    fsync_dir(path.parent)


def check_target(target: Path, overwrite: bool) -> None:
    """Refuse a target that is a file, or a non-empty directory unless ``overwrite``."""
    if target.is_symlink() or target.exists():
        if not target.is_dir():
            raise UsageError(f"target {target} exists and is not a directory")
        if any(target.iterdir()) and not overwrite:
            raise TargetExistsError(f"target {target} is not empty; pass --overwrite to replace it")


def check_target_apart(target: Path, inputs: Mapping[str, str | os.PathLike]) -> None:
    """Refuse a target that is, or contains, a directory the command reads (``inputs``: what
    each is, to name it): replacing the target would delete that input."""
    real_target = Path(os.path.realpath(target))
    for what, path in inputs.items():
        real = Path(os.path.realpath(path))
        if real == real_target or real_target in real.parents:
            relation = "is" if real == real_target else "contains"
            raise UsageError(
                f"target {target} {relation} {what} {path}, which replacing the target would "
                "delete; choose a target outside it"
            )


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``target``; on success it is fsynced and renamed into place.

    On any error the temporary directory is removed, and an existing target stays untouched.
    Leftovers of earlier runs for the same target whose owner process is dead (``kill -9``,
    a power cut) are removed first; a live owner's (a concurrent run) are kept.
    """
    target = Path(target).absolute()
    if target.parent.is_dir():
        remove_stale_staging(target)
    check_target(target, overwrite)
    if not target.parent.is_dir():
        raise UsageError(f"parent directory of target {target} does not exist")
    token = uuid.uuid4().hex[:8]
    tmp = target.with_name(f"{target.name}{TMP_MARK}{token}")
    owner = _claim(tmp)
    try:
        try:
            tmp.mkdir()
        except PermissionError:
            raise UsageError(f"cannot create {tmp}: permission denied") from None
        except OSError as exc:  # a read-only filesystem (EROFS), a full one, ...
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutOfSpaceError(f"cannot create {tmp}: no space left on device") from None
            raise UsageError(f"cannot create {tmp}: {exc.strerror}") from None
        try:
            yield tmp
            fsync_tree(tmp)
            _replace_directory(tmp, target, overwrite)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, ShardstreamError):
                if exc.errno == 28:
                    raise OutOfSpaceError(
                        f"no space left on device while writing {target}; partial output removed"
                    ) from None
            raise
        fsync_dir(target.parent)
    finally:
        _release(tmp, owner)


def _owner_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + OWNER_SUFFIX)


def _claim(tmp: Path) -> int | None:
    """Create and lock ``tmp``'s owner file; returns its descriptor (None where the filesystem
    refuses files or locks: the run goes on, its leftovers are then never removed for it)."""
    path = _owner_path(tmp)
    for _ in range(CLAIM_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except PermissionError:
            raise UsageError(f"cannot create {path}: permission denied") from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutOfSpaceError(f"cannot create {path}: no space left on device") from None
            raise UsageError(f"cannot create {path}: {exc.strerror}") from None
        try:
            # Between the create and the lock a cleaner may take this still-empty file for a
            # dead run's (one killed in that instant looks the same) and remove it: then the
            # lock is on a removed file, and the claim starts again.
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink == 0:
                os.close(fd)
                continue
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return fd
    return None


def _release(tmp: Path, fd: int | None) -> None:
    if fd is None:
        return
    with contextlib.suppress(OSError):
        _owner_path(tmp).unlink()
    os.close(fd)  # releases the lock, after the unlink: no one can see a dead owner of ours


def _owner_dead(path: Path) -> int | None:
    """Lock ``path`` if its owner is dead; returns the descriptor holding the lock, else None.

    The owner holds an exclusive flock for its whole run, so getting the lock proves it is gone.
    Where locks are unsupported, a dead pid on this host counts; another host's is kept.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None  # its owner just finished, or another cleaner removed it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None  # alive
    except OSError:
        if not _dead_on_this_host(fd):
            os.close(fd)
            return None
        return fd
    # An owner file without content is a claim cut between its create and its write (the run
    # is dead), or one between its create and its lock right now: that one redoes its claim
    # when it finds the file removed (``_claim``), so either way the file may go.
    if os.fstat(fd).st_nlink == 0:
        os.close(fd)  # released by its owner (or removed by another cleaner) after we opened it
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


def remove_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Remove ``target``'s staged directories (``T.tmp-<token>``, ``T.tmp-<token>.old``) whose
    owner process is dead; returns what was removed. A dead run that had swapped the old target
    out but not the new one in gets the old one back, never left without a target it had."""
    target = Path(target).absolute()
    pattern = re.compile(
        re.escape(target.name + TMP_MARK) + r"([0-9a-f]{8})" + re.escape(OWNER_SUFFIX)
    )
    removed: list[Path] = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return removed
    for name in names:
        if not pattern.fullmatch(name):
            continue
        owner = target.parent / name
        fd = _owner_dead(owner)
        if fd is None:
            continue
        try:
            tmp = owner.with_name(name[: -len(OWNER_SUFFIX)])
            old = _old_path(tmp)
            if old.is_dir() and not os.path.lexists(target):
                os.rename(old, target)  # the swap was cut between its two renames
                fsync_dir(target.parent)
            for path in (tmp, old):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
            owner.unlink()
        except OSError:
            pass  # another cleaner got there first, or the directory is not ours to change
        finally:
            os.close(fd)
    return removed


def _old_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".old")


def _replace_directory(tmp: Path, target: Path, overwrite: bool) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    check_target(target, overwrite)
    if not any(target.iterdir()):
        target.rmdir()
        os.rename(tmp, target)
        return
    # Swap the old directory out first so that a crash leaves either old or new in place (or,
    # cut between the renames, the old one under ``.old``, which remove_stale_staging restores).
    old = _old_path(tmp)
    os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def is_temporary(name: str) -> bool:
    return TMP_MARK in name

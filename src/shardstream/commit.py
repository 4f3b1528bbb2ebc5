"""Nothing counts until it is complete: temporary names, fsync, then rename."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import OutOfSpaceError, ShardstreamError, TargetExistsError, UsageError

TMP_MARK = ".tmp-"


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


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``target``; on success it is fsynced and renamed into place.

    On any error the temporary directory is removed, and an existing target stays untouched.
    """
    target = Path(target).absolute()
    check_target(target, overwrite)
    if not target.parent.is_dir():
        raise UsageError(f"parent directory of target {target} does not exist")
    tmp = target.with_name(f"{target.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
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


def _replace_directory(tmp: Path, target: Path, overwrite: bool) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    check_target(target, overwrite)
    if not any(target.iterdir()):
        target.rmdir()
        os.rename(tmp, target)
        return
    # Swap the old directory out first so that a crash leaves either old or new in place.
    old = target.with_name(f"{target.name}{TMP_MARK}old-{uuid.uuid4().hex[:8]}")
    os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def is_temporary(name: str) -> bool:
    return TMP_MARK in name

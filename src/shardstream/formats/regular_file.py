"""Opening a checkpoint file for reading only when it is a regular file.

A FIFO in a rank file's place blocks ``open()`` (or the first read) forever, and a device such
as ``/dev/zero`` reports size 0 but never ends, so a reader that looks for the end of a zip
archive reads without bound. Both are refused here, naming the file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointFormatError, UnsafeCheckpointError

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def open_regular(path: str | os.PathLike, buffering: int = -1) -> BinaryIO:
    """``open(path, "rb", buffering)``, links followed, for a regular file; anything else is a
    ``CheckpointFormatError`` naming ``path``. OSErrors of the open itself (no such file, a
    refused permission, a symlink loop) are raised as they are."""
    # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def present(path: str | os.PathLike) -> bool:
    """Whether an optional file (config.json, fsdp_config.json) is there: True for a regular
    file (links followed), False when nothing has the name; anything else under the name (a
    broken link, a symlink loop, a directory, a FIFO) is a ``CheckpointFormatError`` naming it,
    not an absent file."""
    mode = _mode_if_there(path, "")
    if mode is None:
        return False
    _check_regular(path, mode)
    return True


def present_directory(path: str | os.PathLike, what: str) -> bool:
    """``present`` for an optional directory (``what`` it holds, for the message): True for a
    directory (links followed), False when nothing has the name; a broken link, a loop, a
    file or a FIFO under the name is a ``CheckpointFormatError`` naming it."""
    expected = f", expected the directory of {what}"
    mode = _mode_if_there(path, expected)
    if mode is None:
        return False
    if not stat.S_ISDIR(mode):
        raise CheckpointFormatError(f"{os.fspath(path)}: is {_kind_name(mode)}{expected}")
    return True


def kind_of(path: str | os.PathLike) -> str | None:
    """What is at ``path`` (links followed), for a message: "a regular file", "a FIFO",
    "a broken symbolic link", ...; None when nothing has the name."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.lexists(path) else None
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"
    return _kind_name(mode)


def _kind_name(mode: int) -> str:
    """What a file of ``mode`` is, for a message: "a regular file", "a FIFO", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def _mode_if_there(path: str | os.PathLike, expected: str) -> int | None:
    """``path``'s mode, links followed; None when nothing has the name. A broken link (its
    message ending in ``expected``) or one that cannot be stat'ed is a ``CheckpointFormatError``."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.lexists(path):
            return None
        raise CheckpointFormatError(
            f"{os.fspath(path)}: is a broken symbolic link{expected}"
        ) from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise CheckpointFormatError(f"{os.fspath(path)}: cannot be read ({reason})") from None


def _check_regular(path: str | os.PathLike, mode: int) -> None:
    """A ``CheckpointFormatError`` naming ``path`` unless ``mode`` is a regular file's."""
    if not stat.S_ISREG(mode):
        raise CheckpointFormatError(
            f"{os.fspath(path)}: is {_kind_name(mode)}, expected a regular file"
        )


def check_inside(path: Path, directory: Path) -> Path:
    """A checkpoint file must lie inside the checkpoint ``directory``, and one that is a
    symlink must lead to a file inside it (as shardstream's own format requires of its files):
    a name out of it (``../``, an absolute path, from a file list) or a link out is refused,
    named."""
    here = os.path.abspath(directory)
    if os.path.commonpath([here, os.path.abspath(path)]) != here:
        raise UnsafeCheckpointError(f"{path}: lies outside the checkpoint {directory}")
    if path.is_symlink():
        real = Path(os.path.realpath(path))
        if Path(os.path.realpath(directory)) not in real.parents:
            raise UnsafeCheckpointError(f"{path}: symlink points outside the checkpoint")
    return path

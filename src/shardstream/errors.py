"""The error tree. Every error shardstream raises on purpose derives from ShardstreamError.

Each subclass also inherits the fitting builtin, so ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations

import errno
import os

# A full disk, a spent quota, or a file larger than the filesystem or the process may write.
OUT_OF_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# Permission bits, an ACL or a security module said no.
PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


class ShardstreamError(Exception):
    """Root of all deliberate shardstream errors. ``str(err)`` is a complete one-line message."""


class CheckpointNotFoundError(ShardstreamError, FileNotFoundError):
    """A directory or file the operation needs does not exist."""


class CheckpointFormatError(ShardstreamError, ValueError):
    """Input that is truncated, corrupt, or inconsistent with itself."""


class NamesUnderPrefixError(CheckpointFormatError):
    """Every stored name is the model's own behind one more prefix (``prefix``): the model was
    saved as an attribute of a training wrapper (a Lightning module's ``model``)."""

    def __init__(self, message: str, prefix: str = "") -> None:
        super().__init__(message)
        self.prefix = prefix

    def read_under(self, prefix: str | None) -> NamesUnderPrefixError:
        """This error where the names were read under ``prefix`` already (DCP's ``model.``):
        its ``--prefix`` advice names both, from the top of the checkpoint."""
        if not prefix:
            return self
        said = str(self).replace(f"--prefix {self.prefix!r}", f"--prefix {prefix + self.prefix!r}")
        return NamesUnderPrefixError(said, prefix + self.prefix)


class UnsafeCheckpointError(CheckpointFormatError):
    """Input that tries to run code, escape its directory, or allocate absurd amounts."""


class ChecksumMismatchError(CheckpointFormatError):
    """Bytes on disk differ from the checksum recorded when they were written."""


class TargetExistsError(ShardstreamError, FileExistsError):
    """The output location is taken and overwriting was not asked for."""


class OutOfSpaceError(ShardstreamError, OSError):
    """The disk filled up while writing; partial output has been removed."""


class CheckpointPermissionError(ShardstreamError, PermissionError):
    """A file or directory the operation needs may not be read (or written) by this user."""


class UsageError(ShardstreamError, ValueError):
    """An argument or configuration value is invalid."""


class CheckpointLockedError(ShardstreamError, RuntimeError):
    """Another live process holds the checkpoint directory's lock."""


class ReferenceMismatchError(ShardstreamError, AssertionError):
    """A checkpoint's tensors differ from the reference model they were compared with."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what a scheduler, torchrun or ``timeout`` sends), raised by the command's
    handler where the process is, so that the cleanup an interrupt runs runs for it too."""


# Set on an interrupt that came once the output was already in place (while the old one was
# being deleted): the target named there holds the new output.
COMMITTED_ATTR = "shardstream_committed"


def causes(exc: BaseException):
    """``exc`` and every exception behind it, including those DCP wraps per rank."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen or e is None:
            continue
        seen.add(id(e))
        yield e
        stack.extend([e.__cause__, e.__context__])
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # CheckpointException: rank -> (exception, traceback)
            for v in failures.values():
                v = v[0] if isinstance(v, tuple) and v else v
                if isinstance(v, BaseException):
                    stack.append(v)


def shardstream_cause(exc: BaseException) -> ShardstreamError | None:
    """The first deliberate error behind ``exc`` (DCP wraps a rank's failure in its own)."""
    return next((e for e in causes(exc) if isinstance(e, ShardstreamError)), None)


def out_of_space(
    exc: BaseException,
    path: str | os.PathLike,
    message: str = "{path}: no space left on device",
) -> OutOfSpaceError | None:
    """The error for ``exc``, met writing ``path``, if it is a full disk (also behind a wrapper
    such as DCP's): ``message`` with ``{path}`` filled in. None for any other error."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in OUT_OF_SPACE_ERRNOS:
            text = message.format(path=path)
            text = text.replace(_NO_SPACE, _SAID.get(e.errno, _NO_SPACE))
            met = os.fspath(e.filename) if e.filename else None
            if met and met != os.fspath(path):  # the file it met, inside ``path``
                named = f"{os.fspath(path)}:"
                if text.startswith(named):
                    text = f"{os.fspath(path)} (writing {met}):{text[len(named) :]}"
                else:
                    text = f"{text} (writing {met})"
            return OutOfSpaceError(text)
    return None


_NO_SPACE = "no space left on device"
_SAID = {
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit exceeded (ulimit -f, or the largest file the file system holds)",
}


def permission_denied(
    exc: BaseException, path: str | os.PathLike | None = None
) -> CheckpointPermissionError | None:
    """The error for ``exc`` if it is a refused permission (also behind a wrapper): "<file>:
    permission denied", naming ``path``, else the file the OSError names. None otherwise."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in PERMISSION_ERRNOS:
            where = path if path is not None else (e.filename or "(unnamed file)")
            return CheckpointPermissionError(f"{where}: {refusal(e)}")
    return None


def refusal(exc: OSError) -> str:
    """How to say a refused permission: "permission denied", or "read-only file system"."""
    return "read-only file system" if exc.errno == errno.EROFS else "permission denied"


def os_error(exc: BaseException, path: str | os.PathLike | None = None) -> ShardstreamError | None:
    """The one mapping of an OSError (behind any wrapper) to a shardstream error: a full disk
    (``out_of_space``) or a refused permission (``permission_denied``); None for others.
    ``path``: the file to name, else the one the OSError names."""
    if isinstance(exc, ShardstreamError):
        return exc
    where = path
    if where is None:
        where = next(
            (e.filename for e in causes(exc) if isinstance(e, OSError) and e.filename), None
        )
    return out_of_space(exc, where or "(unnamed file)") or permission_denied(exc, path)

"""Nothing counts until it is complete: stage under a temporary name, fsync, then swap in.

Every directory that appears whole (a merge's output, a saved step) and every one that goes
(retention) passes through here, so one crash-recovery rule covers them all.

Names beside a target ``T`` (a directory)::

    T.tmp-<token>         the staged new directory; after the swap, the old one on its way out
    T.tmp-<token>.owner   "host pid", flock-ed by the writer while it works (storage/locks.py)
    T.tmp-<token>.old     the old T, moved aside where the filesystem cannot exchange two names

The swap exchanges ``T.tmp-<token>`` and ``T`` in one atomic ``renameat2(RENAME_EXCHANGE)``;
where that is unsupported it renames T to ``.old`` and the new directory to T. The rule, once
a writer is known dead: an ``.old`` whose T is missing (the writer died between those two
renames) is renamed back to T; every other temporary is removed. A writer is dead when its
owner file's lock can be taken; one without an owner file only counts as dead to a caller that
holds the whole directory's lock (the manager).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import signal
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    COMMITTED_ATTR,
    CheckpointPermissionError,
    OutOfSpaceError,
    ShardstreamError,
    TargetExistsError,
    UsageError,
    os_error,
    out_of_space,
)
from . import locks
from .tree import is_mount_point, remove_tree, walk

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
OWNER_SUFFIX = ".owner"
OLD_SUFFIX = ".old"
_LONGEST_SUFFIX = max(len(OWNER_SUFFIX), len(OLD_SUFFIX))  # after the staged name's .tmp-<hex>
# A claim whose new owner file a cleaner removes before it is locked starts again.
CLAIM_ATTEMPTS = 5
_STAGED = re.compile(
    r"(?P<target>.+?)" + re.escape(TMP_MARK) + r"(?P<token>[0-9a-f]{8})(?P<kind>|\.owner|\.old)"
)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# What renameat2 answers where the kernel, the filesystem or the C library lacks the exchange.
_NO_EXCHANGE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory below ``root`` (files first, then their directories)."""
    folders = []
    for dirpath, _, files in walk(root):
        folders.append(dirpath)
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for dirpath in reversed(folders):  # each folder after everything below it
        fsync_dir(dirpath)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new content, never part."""
    path = Path(path)
    tmp = path.with_name(temporary_name(path.name))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        full = out_of_space(exc, path)
        if full is not None:
            raise full from None
        raise
    fsync_dir(path.parent)


def is_temporary(name: str) -> bool:
    return TMP_MARK in name


def temporary_name(name: str) -> str:
    """``name.tmp-<8 hex>``: a unique temporary name for ``name``, which ``_STAGED`` parses."""
    return f"{name}{TMP_MARK}{uuid.uuid4().hex[:8]}"


_NAME_MAX = 255  # bytes in a file name (ext4, xfs, btrfs, tmpfs)


def check_target(target: Path, overwrite: bool) -> None:
    """Refuse a target that is a file, a symlink, or a non-empty directory unless
    ``overwrite``.

    A symlinked target is refused, whatever it points to: the swap replaces the name, so it
    would replace the link (not the directory it names) and leave that directory behind under
    a temporary name, or fail on the link as a non-directory. Name the directory itself."""
    staged = len(os.fsencode(temporary_name(target.name))) + _LONGEST_SUFFIX
    if staged > _NAME_MAX:
        raise UsageError(
            f"target {target}: its name is too long to stage beside it (as "
            f"{target.name[:20]}...{TMP_MARK}<8 hex>{OWNER_SUFFIX}, {staged} bytes, over the "
            f"{_NAME_MAX} a file name may have): use a name of at most "
            f"{_NAME_MAX - staged + len(os.fsencode(target.name))} bytes"
        )
    if target.is_symlink():
        raise UsageError(
            f"target {target} is a symlink (to {os.readlink(target)}); shardstream replaces "
            "a target by renaming, which would replace the link itself: pass the directory it "
            f"points to ({os.path.realpath(target)}) instead"
        )
    if target.exists():
        if not target.is_dir():
            raise UsageError(f"target {target} exists and is not a directory")
        if is_mount_point(target):
            raise UsageError(
                f"target {target} is a mount point: shardstream writes beside a target and "
                "renames it into place, which cannot cross into a mount; pass a directory "
                "inside it"
            )
        if any(target.iterdir()) and not overwrite:
            raise TargetExistsError(f"target {target} is not empty; pass --overwrite to replace it")


def check_target_apart(
    target: Path,
    inputs: Mapping[str, str | os.PathLike],
    why: str = "which replacing the target would delete",
) -> None:
    """Refuse a target that is, or contains, a directory the command reads (``inputs``: what
    each is, to name it): replacing the target would delete that input (``why`` says what
    else writing there would do)."""
    real_target = Path(os.path.realpath(target))
    for what, path in inputs.items():
        real = Path(os.path.realpath(path))
        if _holds(real_target, real):
            relation = "is" if real == real_target else "contains"
            raise UsageError(
                f"target {target} {relation} {what} {path}, {why}; choose a target outside it"
            )


def check_links_apart(target: Path, paths: Iterable[str | os.PathLike]) -> None:
    """Refuse a target that is, or contains, where any of ``paths`` (the files a command
    reads, and what its directories hold) leads through a symbolic link: a Hugging Face
    cache snapshot's files link into its ``blobs/``, which replacing the target would delete."""
    real_target = Path(os.path.realpath(target))
    for path in paths:
        if not os.path.islink(path):
            continue
        real = Path(os.path.realpath(path))
        if _holds(real_target, real):
            raise UsageError(
                f"target {target} holds {real}, which {path} links to: replacing the target "
                "would delete what the command reads; choose a target outside it"
            )


def _holds(real_target: Path, real: Path) -> bool:
    """Whether replacing ``real_target`` would delete ``real`` (both resolved)."""
    return real == real_target or real_target in real.parents


# --- stage, swap -----------------------------------------------------------------------------


class Staged:
    """A directory being written under a temporary name beside its target, owned by this
    process until it is committed or abandoned."""

    def __init__(self, target: Path, path: Path, owner: int | None):
        self.target, self.path, self._owner = target, path, owner

    def commit(self) -> None:
        """Swap the (already fsynced) directory in as the target, replacing any old one, then
        delete the old one. An interrupt while it is deleted is raised marked committed
        (``errors.COMMITTED_ATTR``); an old output that cannot be deleted is named, and its
        owner file stays (unlocked), so that the next write of the target sweeps it."""
        aside: Path | None | bool = False  # False: not swapped
        try:
            # A signal during the swap waits for it, so that it is known to have happened.
            with target_locked(self.target), signals_held():  # not amid an update in place
                aside = swap_in(self.path, self.target)  # on failure the caller abandons
        except BaseException as exc:
            if aside is False:
                raise
            setattr(exc, COMMITTED_ATTR, str(self.target))  # in place; its old one not deleted
            self._release(keep_owner_file=aside is not None and os.path.lexists(aside))
            raise
        if aside is None:
            self._release()
            return
        try:
            _remove(aside)
        except BaseException as exc:
            setattr(exc, COMMITTED_ATTR, str(self.target))
            raise
        finally:
            self._release(keep_owner_file=os.path.lexists(aside))
        if os.path.lexists(aside):
            log.warning(
                "shardstream: %s is in place, but its old output, now %s, could not be "
                "deleted entirely: the next write of %s removes it, or delete it by hand",
                self.target,
                aside,
                self.target.name,
            )

    def abandon(self) -> None:
        """Remove the directory; an existing target stays untouched. What cannot be removed
        keeps its owner file (unlocked): the next write of the target sweeps it."""
        try:
            _remove(self.path)
        finally:
            self._release(keep_owner_file=os.path.lexists(self.path))

    def _release(self, keep_owner_file: bool = False) -> None:
        if self._owner is None:
            return
        if not keep_owner_file:
            with contextlib.suppress(OSError):
                _owner_path(self.path).unlink()
        os.close(self._owner)  # releases the lock, after the unlink: none sees a dead owner of ours
        self._owner = None


def stage(target: str | os.PathLike) -> Staged:
    """Create and claim a temporary sibling of ``target`` to write it in.

    Call ``remove_stale_staging(target)`` first, so that a dead writer's old copy is back.
    """
    target = Path(target).absolute()
    tmp = target.with_name(temporary_name(target.name))
    owner = _claim(tmp)
    staged = Staged(target, tmp, owner)
    try:
        tmp.mkdir()
    except OSError as exc:  # forbidden, a read-only filesystem, a full one, ...
        staged.abandon()
        raise _unwritable(exc, f"cannot write the target {target}") from None
    return staged


def _unwritable(exc: OSError, said: str) -> ShardstreamError:
    """``said`` and why: a refused permission, a read-only or full filesystem (exit 1, as any
    error of the environment: ``errors.os_error``), else the OS's words as a usage error."""
    return os_error(exc, said) or UsageError(f"{said}: {exc.strerror}")


def swap_in(tmp: Path, target: Path) -> Path | None:
    """Make the complete directory ``tmp`` the ``target``, atomically; returns where the old
    one now is (for the caller to delete), or None when there was none.

    A crash at any point leaves ``target`` old or new, or, cut between the two renames of the
    fallback, the old one under ``.old`` for ``remove_stale_staging`` to put back.
    """
    if not os.path.lexists(target):
        os.rename(tmp, target)
        fsync_dir(target.parent)
        return None
    if _exchange(tmp, target):
        aside = tmp  # the old directory, now under the temporary name
    else:
        aside = _old_path(tmp)
        os.rename(target, aside)
        try:
            os.rename(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                os.rename(aside, target)
            raise
    fsync_dir(target.parent)
    return aside


def discard(path: Path) -> None:
    """Remove the directory ``path`` so that it disappears at once: renamed to a temporary name
    (debris to the next sweep, should this die), then deleted."""
    _remove(bury(path))


def bury(path: Path) -> Path:
    """Make the directory ``path`` disappear at once: rename it to a temporary name beside it
    (``T.tmp-<hex>``, no owner file: debris to the next sweep of the directory's lock holder)
    and fsync the parent. Returns the new name, for ``remove`` or a ``Deleter`` to delete."""
    grave = path.with_name(temporary_name(path.name))
    os.rename(path, grave)
    fsync_dir(path.parent)
    return grave


class Deleter:
    """Deletes ``bury``-ed directories on a background thread, one batch at a time.

    ``submit`` first waits for the batch before it (deletions never pile up) and ``join``
    waits for the current one. A failure is logged as a warning, never raised; whatever it
    leaves, or a crash leaves, is debris to the next sweep. The thread is not a daemon, so a
    process that exits without ``join`` still finishes the deletion first."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def submit(self, graves: Sequence[Path], then: Callable[[Path], None] | None = None) -> None:
        """Delete ``graves`` in the background, calling ``then(grave)`` after each."""
        self.join()
        if not graves:
            return
        thread = threading.Thread(  # not a daemon even when started by one (an async save's)
            target=self._run, args=(list(graves), then), name="shardstream-delete", daemon=False
        )
        try:
            thread.start()
        except RuntimeError:  # no new thread at interpreter shutdown: delete them here
            self._run(list(graves), then)
            return
        with self._guard:
            self._thread = thread

    def join(self) -> None:
        """Wait until every submitted directory is deleted (or its deletion failed)."""
        with self._guard:
            thread = self._thread
        if thread is not None:
            thread.join()
            with self._guard:
                if self._thread is thread:
                    self._thread = None

    @staticmethod
    def _run(graves: list[Path], then: Callable[[Path], None] | None) -> None:
        for grave in graves:
            try:
                try:
                    if grave.is_dir() and not grave.is_symlink():
                        remove_tree(grave)
                    else:
                        grave.unlink()
                except OSError as exc:
                    log.warning(
                        "shardstream: could not delete %s (the next start removes it): %s",
                        grave,
                        exc,
                    )
                    _remove(grave)  # as much of the rest as it can
                if then is not None:
                    then(grave)
            except Exception as exc:  # noqa: BLE001  (never raised into training)
                log.warning("shardstream: could not delete %s: %s", grave, exc)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block (in the main thread; elsewhere signals do not
    arrive), then deliver what came to the handlers in place before it: removing what a
    failed write staged is not cut short by a signal that asks for exactly that removal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    kinds = (signal.SIGINT, signal.SIGTERM)
    before = {
        kind: signal.signal(kind, lambda number, frame: caught.append(number)) for kind in kinds
    }
    try:
        yield
    finally:
        for kind, handler in before.items():
            signal.signal(kind, handler)
        for number in dict.fromkeys(caught):
            signal.raise_signal(number)


def make_parents(target: Path) -> None:
    """Create the missing folders above ``target`` (as verl's merger does with
    ``os.makedirs``), each fsynced into its parent; one in the way is a usage error."""
    missing = []
    parent = target.parent
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    try:
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):  # another process made it meanwhile
                folder.mkdir()
            fsync_dir(folder.parent)
        if not target.parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(target.parent))
    except OSError as exc:
        where = exc.filename or target.parent
        raise UsageError(
            f"cannot make the parent directory of target {target}: {where}: {exc.strerror or exc}"
        ) from None


@dataclass(frozen=True)
class InPlace:
    """How ``staged_directory`` updates a non-empty target instead of replacing it (verl's
    merger writes into an existing directory): the target's entries of other names stay,
    but those ``stale`` names (another set of a model's weights) go, and those ``last``
    names (a model's weights, then its index: 1, 2) go first and arrive after the rest,
    in that order (``update_in_place``); 0: not last."""

    stale: Callable[[str], bool]
    last: Callable[[str], int]


@contextlib.contextmanager
def staged_directory(
    target: str | os.PathLike, overwrite: bool = False, in_place: InPlace | None = None
) -> Iterator[Path]:
    """Yield a temporary sibling of ``target``; on success it is fsynced and swapped in, or,
    with ``in_place`` and a non-empty target, its entries moved into the target.

    On any error the temporary directory is removed, and an existing target stays untouched.
    Leftovers of earlier runs for the same target whose owner process is dead (``kill -9``,
    a power cut) are removed first; a live owner's (a concurrent run) are kept.
    """
    target = Path(target).absolute()
    if target.parent.is_dir():
        remove_stale_staging(target)
    check_target(target, overwrite or in_place is not None)
    make_parents(target)
    staged = stage(target)
    try:
        yield staged.path
        fsync_tree(staged.path)
        if in_place is not None and target.is_dir() and any(target.iterdir()):
            update_in_place(staged.path, target, in_place)
            staged.abandon()  # emptied
            return
        try:
            check_target(target, overwrite)  # another run may have taken it meanwhile
        except TargetExistsError:
            raise TargetExistsError(
                f"target {target} was filled by another process while this one wrote (two "
                "merges into one target?); its output is kept, this one is discarded (pass "
                "--overwrite to replace it)"
            ) from None
        staged.commit()
    except BaseException as exc:
        if hasattr(exc, COMMITTED_ATTR):  # in place; the old output's deletion was cut short
            raise
        with signals_held():  # a SIGTERM now (torchrun stopping the others) waits for it
            staged.abandon()
        if isinstance(exc, OutOfSpaceError) and str(staged.path) in str(exc):
            # named as the user named it: the staging directory is gone
            said = str(exc).replace(str(staged.path), str(target))
            raise OutOfSpaceError(f"{said}; partial output removed") from None
        if isinstance(exc, OSError) and not isinstance(exc, ShardstreamError):
            message = "no space left on device while writing {path}; partial output removed"
            full = out_of_space(exc, target, message)
            if full is not None:
                raise full from None
        raise


@contextlib.contextmanager
def target_locked(target: Path) -> Iterator[None]:
    """Hold the exclusive flock of the directory at ``target`` (if one is there) for the
    block, taken on the directory the path names once it is held: an update in place and a
    swap of the same target take turns. A file system without locks goes unguarded."""
    while True:
        try:
            fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            yield
            return
        try:
            with contextlib.suppress(OSError):
                locks.take(fd, wait=True)
            try:
                held, now = os.fstat(fd), os.stat(target)
                same = (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
            except FileNotFoundError:  # swapped away while we waited: take the new one
                same = False
            if same:
                yield
                return
        finally:
            os.close(fd)


def update_in_place(staged: Path, target: Path, rule: InPlace) -> None:
    """Move the complete (fsynced) directory ``staged``'s entries into the directory
    ``target``, each taking the place of the target's entry of its name; the target's
    ``rule.stale`` and ``rule.last`` entries go too, and new ``rule.last`` entries arrive
    after every other.

    What leaves the target is first renamed into a folder inside it
    (``.shardstream-old.tmp-<hex>``), so the target never holds old and new weights at once,
    and a failure midway puts it all back: the target is then as it was. Only once every
    new entry is in is that folder deleted; a crash before leaves the old files there, until
    the next update of the target deletes them. An
    entry of a name the output uses but of the other kind (a file where it writes a folder)
    is refused before anything moves."""
    new = sorted(os.listdir(staged))
    refuse_other_kinds(target, {name: _is_folder(staged / name) for name in new})
    if not os.access(target, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(target).f_flag & os.ST_RDONLY)
        why = "read-only file system" if read_only else "permission denied"
        raise CheckpointPermissionError(f"cannot write into target {target}: {why}")
    with target_locked(target):
        leaving = [
            name
            for name in sorted(os.listdir(target))
            if name in new
            or ((rule.stale(name) or rule.last(name)) and not _is_folder(target / name))
        ]
        old = target / temporary_name(".shardstream-old")
        old.mkdir()
        moved_out: list[str] = []
        moved_in: list[str] = []
        updated = False
        try:
            # A signal waits for the moves (a cut would leave old and new files mixed); one
            # that came meanwhile is raised once they are done, marked committed.
            with signals_held():
                try:
                    for name in leaving:
                        os.rename(target / name, old / name)
                        moved_out.append(name)
                    fsync_dir(target)
                    for name in sorted(new, key=rule.last):  # 0 first: the weights, the index last
                        os.rename(staged / name, target / name)
                        moved_in.append(name)
                    fsync_dir(target)
                except OSError as exc:
                    put_back = _roll_back(staged, target, old, moved_in, moved_out)
                    state = (
                        "it is as it was"
                        if put_back
                        else f"it is partly updated, and its old files are in {old}"
                    )
                    raise UsageError(
                        f"could not update target {target} in place ({exc.filename or target}: "
                        f"{exc.strerror or exc}); {state}"
                    ) from None
                updated = True
        except BaseException as exc:
            if updated:  # its old files stay in ``old``, for the next update to delete
                setattr(exc, COMMITTED_ATTR, str(target))
            raise
        crashed = [target / name for name in old_folders(target)]
    for path in [old, *(p for p in crashed if p != old)]:
        _remove(path)


# The folder ``update_in_place`` parks replaced entries in. One left by an update that crashed
# holds files the update after it has replaced, so that one deletes it (under the lock: only
# its own update, holding the lock, ever moves entries in or out of such a folder).
_OLD_FOLDER = re.compile(re.escape(".shardstream-old" + TMP_MARK) + r"[0-9a-f]{8}")


def old_folders(target: Path) -> list[str]:
    """The names of ``target``'s folders of replaced entries (``update_in_place``'s), sorted."""
    return sorted(name for name in os.listdir(target) if _OLD_FOLDER.fullmatch(name))


def interrupted_update(target: Path) -> str:
    """ "" where ``target`` holds no folder of an update in place cut short (a killed merge);
    else a sentence naming it, and what to do."""
    try:
        found = old_folders(target)
    except OSError:
        return ""
    if not found:
        return ""
    return (
        f"an update of {target} by merge was cut short: the files it replaced are in "
        f"{target / found[0]}, so it may hold old and new files mixed; rerun the merge, which "
        "completes it (and removes that folder)"
    )


def refuse_other_kinds(target: Path, entries: Mapping[str, bool]) -> None:
    """Refuse to update ``target`` with ``entries`` (name: whether a folder) where it holds one
    of those names as the other kind, which an update cannot replace: a merge checks the names
    it will write before it writes them, and ``update_in_place`` what it has written."""
    for name, folder in entries.items():
        there = target / name
        if os.path.lexists(there) and _is_folder(there) != folder:
            kind = "folder" if _is_folder(there) else "link" if there.is_symlink() else "file"
            raise UsageError(
                f"target {there} is a {kind}, where the merge writes a "
                f"{'folder' if folder else 'file'} of that name; move it away"
            )


def _roll_back(staged: Path, target: Path, old: Path, moved_in, moved_out) -> bool:
    """Undo ``update_in_place``'s moves; whether all of them were undone."""
    done = True
    for name in reversed(moved_in):
        try:
            os.rename(target / name, staged / name)
        except OSError:
            done = False
    for name in reversed(moved_out):
        try:
            os.rename(old / name, target / name)
        except OSError:
            done = False
    with contextlib.suppress(OSError):
        fsync_dir(target)
        if done:
            old.rmdir()
    return done


def _is_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _exchange(tmp: Path, target: Path) -> bool:
    """Swap the two names in one step; False where this system cannot."""
    try:
        _renameat2(tmp, target, _RENAME_EXCHANGE)
    except OSError as exc:
        if exc.errno in _NO_EXCHANGE:
            return False
        raise
    return True


def _renameat2(src: Path, dst: Path, flags: int) -> None:
    function = getattr(_libc(), "renameat2", None)
    if function is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this C library", str(src))
    result = function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(src), None, str(dst))


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        function = getattr(_LIBC, "renameat2", None)
        if function is not None:
            function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
            function.argtypes += [ctypes.c_uint]
            function.restype = ctypes.c_int
    return _LIBC


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _owner_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + OWNER_SUFFIX)


def _old_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + OLD_SUFFIX)


def _claim(tmp: Path) -> int | None:
    """Create and lock ``tmp``'s owner file; returns its descriptor (None where the filesystem
    refuses files or locks: the write goes on, its leftovers are then never removed for it)."""
    path = _owner_path(tmp)
    for _ in range(CLAIM_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:  # named by the directory the user chose, not our own file
            full = out_of_space(exc, path, "cannot create {path}: no space left on device")
            raise full or _unwritable(
                exc, f"cannot write the target {tmp.name.split(TMP_MARK)[0]} in {tmp.parent}"
            ) from None
        try:
            # Between the create and the lock a cleaner may take this still-empty file for a
            # dead writer's (one killed in that instant looks the same) and remove it: then the
            # lock is on a removed file, and the claim starts again.
            locks.take(fd, wait=True)
            if os.fstat(fd).st_nlink == 0:
                os.close(fd)
                continue
            os.write(fd, locks.holder_line())
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return fd
    return None


# --- recovery --------------------------------------------------------------------------------


def remove_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Apply the recovery rule to ``target``'s temporaries whose owner is dead (those without
    an owner file are kept: nothing proves them dead); returns what was removed."""
    target = Path(target).absolute()
    return _sweep(target.parent, lambda name: name == target.name, ownerless_dead=False)


def take_debris(directory: Path, belongs: Callable[[str], bool]) -> list[Path]:
    """Apply the recovery rule to every temporary in ``directory`` whose target name
    ``belongs``; the caller holds the directory's lock, so no writer is at work and those
    without an owner file are dead too. Files go at once; directories are renamed to unique
    temporary names and returned for the caller to ``remove`` (after letting go of its lock)."""
    return _sweep(directory, belongs, ownerless_dead=True, take=True)


def remove(path: Path) -> None:
    """Delete a file or directory tree ``take_debris`` returned; whatever remains of it is
    debris to the next sweep."""
    _remove(path)


def _sweep(
    parent: Path, belongs: Callable[[str], bool], ownerless_dead: bool, take: bool = False
) -> list[Path]:
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    tokens: dict[str, set[str]] = {}
    loose: list[str] = []  # temporaries of no token (an older shardstream's, a taken one)
    for name in sorted(names):
        match = _STAGED.fullmatch(name)
        if match and belongs(match["target"]):
            staged = f"{match['target']}{TMP_MARK}{match['token']}"
            tokens.setdefault(staged, set()).add(match["kind"])
        elif not match and is_temporary(name) and belongs(name.split(TMP_MARK)[0]):
            loose.append(name)
    removed: list[Path] = []
    for name, kinds in tokens.items():
        tmp = parent / name
        fd = None
        if OWNER_SUFFIX in kinds:
            fd = locks.holder_dead(_owner_path(tmp))
            if fd is None:
                continue  # a live writer's
        elif not ownerless_dead:
            continue
        try:
            old = _old_path(tmp)
            target = parent / name[: name.rindex(TMP_MARK)]
            if OLD_SUFFIX in kinds and old.is_dir() and not os.path.lexists(target):
                os.rename(old, target)  # the writer died between the swap's two renames
                fsync_dir(parent)
            for path in (tmp, old):
                if os.path.lexists(path):
                    removed.append(_take(path) if take else _removed(path))
            if fd is not None:
                _owner_path(tmp).unlink()
        except OSError:
            pass  # another cleaner got there first, or the directory is not ours to change
        finally:
            if fd is not None:
                os.close(fd)
    if ownerless_dead:
        for name in loose:
            with contextlib.suppress(OSError):
                removed.append(_take(parent / name) if take else _removed(parent / name))
    return [path for path in removed if path is not None]


def _removed(path: Path) -> Path:
    _remove(path)
    return path


def _take(path: Path) -> Path | None:
    """A directory renamed to a name no writer uses (returned), or a file deleted (None)."""
    if path.is_dir() and not path.is_symlink():
        grave = path.with_name(f"{path.name}-{uuid.uuid4().hex[:8]}")
        os.rename(path, grave)
        return grave
    path.unlink(missing_ok=True)
    return None

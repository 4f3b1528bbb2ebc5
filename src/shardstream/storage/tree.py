"""Walking and deleting directory trees at any depth.

``os.walk`` and ``shutil.rmtree`` of Python 3.11 recurse once per level, so a checkpoint or an
old output holding a folder nested a thousand levels deep (legal: paths stay under PATH_MAX
with one-letter names) raised ``RecursionError`` from deep inside them. These keep a stack.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator


def walk(top: str | os.PathLike) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(top)`` (top down, links to folders listed but not entered, unreadable
    folders skipped), without recursion; pruning ``dirnames`` in place skips them, as there."""
    stack = [os.fspath(top)]
    while stack:
        path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        dirnames, filenames = [], []
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            (dirnames if is_dir else filenames).append(entry.name)
        yield path, dirnames, filenames
        for name in reversed(dirnames):
            child = os.path.join(path, name)
            if not os.path.islink(child):
                stack.append(child)


def remove_tree(path: str | os.PathLike, ignore_errors: bool = False) -> None:
    """``shutil.rmtree(path, ignore_errors)`` without recursion: links are removed, never
    followed, and a mount point below ``path`` (a bind mount too) is left with all it holds,
    with the folders above it. Raises the first OSError, as rmtree does (``EBUSY`` naming a
    mount point left), unless ``ignore_errors``: then removes what it can."""
    mounts = mount_points()
    root = os.fspath(path)
    root_real = os.path.realpath(root)
    root_dev = os.lstat(root).st_dev if os.path.lexists(root) else None
    folders: list[str] = []
    kept: list[str] = []
    stack = [(root, root_real)]
    while stack:
        folder, real = stack.pop()
        folders.append(folder)
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        info = entry.stat(follow_symlinks=False)
                        if not stat.S_ISDIR(info.st_mode):
                            os.unlink(entry.path)
                            continue
                        inner = os.path.join(real, entry.name)
                        if info.st_dev != root_dev or inner in mounts:
                            kept.append(entry.path)
                        else:
                            stack.append((entry.path, inner))
                    except OSError:
                        if not ignore_errors:
                            raise
        except OSError:
            if not ignore_errors:
                raise
    if kept and not ignore_errors:
        raise OSError(errno.EBUSY, "a mount point: left in place with what it holds", kept[0])
    for folder in reversed(folders):  # deepest first: each is empty by its turn
        try:
            os.rmdir(folder)
        except OSError:
            if not ignore_errors:
                raise


def mount_points() -> frozenset[str]:
    """Where something is mounted (``/proc/self/mountinfo``; bind mounts too), as real paths;
    empty where the system does not say."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    points = set()
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4:  # mountinfo escapes space, tab, newline and backslash as \ooo
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
            points.add(os.fsdecode(point))
    return frozenset(points)


def is_mount_point(path: str | os.PathLike) -> bool:
    return os.path.ismount(path) or os.path.realpath(path) in mount_points()

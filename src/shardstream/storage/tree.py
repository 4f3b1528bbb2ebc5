"""Walking and deleting directory trees at any depth.

``os.walk`` and ``shutil.rmtree`` of Python 3.11 recurse once per level, so a checkpoint or an
old output holding a folder nested a thousand levels deep (legal: paths stay under PATH_MAX
with one-letter names) raised ``RecursionError`` from deep inside them. These keep a stack.
"""

from __future__ import annotations

import os
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
    followed. Raises the first OSError, as rmtree does, unless ``ignore_errors``: then removes
    what it can."""
    folders = []
    stack = [os.fspath(path)]
    while stack:
        folder = stack.pop()
        folders.append(folder)
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        if stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode):
                            stack.append(entry.path)
                        else:
                            os.unlink(entry.path)
                    except OSError:
                        if not ignore_errors:
                            raise
        except OSError:
            if not ignore_errors:
                raise
    for folder in reversed(folders):  # deepest first: each is empty by its turn
        try:
            os.rmdir(folder)
        except OSError:
            if not ignore_errors:
                raise

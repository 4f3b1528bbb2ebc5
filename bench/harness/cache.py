"""The page cache around a measurement: warm it, drop it, flush what a run wrote, size trees."""

from __future__ import annotations

import os
from pathlib import Path

from harness import MiB


def drop_caches() -> tuple[bool, str]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``. Returns (done, reason-if-not)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def warm_cache(path: Path) -> int:
    """Read every file under ``path`` once (like ``cat > /dev/null``); returns bytes read."""
    total = 0
    buf = bytearray(8 * MiB)
    view = memoryview(buf)
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return total


def fsync_files(paths) -> None:
    """fsync each file (for tools that leave their output as dirty page cache)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def tree_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict(path: Path) -> None:
    """Drop every file under ``path`` from the page cache (``POSIX_FADV_DONTNEED``; clean pages
    only, so ``sync`` first). Unlike ``drop_caches`` it leaves the interpreter's and libraries'
    files cached, and needs no privilege."""
    for p in sorted(Path(path).rglob("*")):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def prepare(mode: str, path: Path, evict_first: Path | None = None) -> None:
    """Set the page cache for a timed run: ``sync`` first (nobody pays for the previous run's
    dirty pages), then ``warm`` reads every file under ``path`` once, ``cold`` drops the cache.

    ``evict_first`` (warm): every file under it leaves the page cache before ``path`` is read,
    so ``path`` is cached afresh each run, into free memory. How it got cached matters: a file
    cached while memory was full lies in small page-cache folios, and mapping it took 3-4x the
    page faults of one cached into free memory (measured on two bench checkpoints), a
    difference of page-cache history, not of the tool."""
    os.sync()
    if mode == "cold":
        ok, why = drop_caches()
        if not ok:
            raise RuntimeError(f"drop_caches failed mid-run: {why}")
    else:
        if evict_first is not None:
            evict(evict_first)
        warm_cache(path)

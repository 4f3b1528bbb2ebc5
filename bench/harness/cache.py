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


def prepare(mode: str, path: Path) -> None:
    """Set the page cache for a timed run: ``sync`` first (nobody pays for the previous run's
    dirty pages), then ``warm`` reads every file under ``path`` once, ``cold`` drops the cache."""
    os.sync()
    if mode == "cold":
        ok, why = drop_caches()
        if not ok:
            raise RuntimeError(f"drop_caches failed mid-run: {why}")
    else:
        warm_cache(path)

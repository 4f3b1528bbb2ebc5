"""Small filesystems for the full-disk and read-only trials (root only).

A tmpfs of a given size is tried first, then an ext4 image on a loop device; if the sandbox
refuses both, the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@contextlib.contextmanager
def small_filesystem(where: Path, size: str) -> Iterator[Path]:
    """Mount a ``size`` filesystem at ``where`` for the duration of the block."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    where.mkdir(parents=True, exist_ok=True)
    tmpfs = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where))
    image = None
    if tmpfs.returncode != 0:
        image = where.with_name(where.name + ".img")
        steps = [
            ("truncate", "-s", size, str(image)),
            ("mkfs.ext4", "-q", "-F", str(image)),
            ("mount", "-o", "loop", str(image), str(where)),
        ]
        for step in steps:
            result = _run(*step)
            if result.returncode != 0:
                pytest.skip(
                    f"cannot mount a small filesystem here: tmpfs: {tmpfs.stderr.strip()}; "
                    f"loop image: {' '.join(step)}: {result.stderr.strip()}"
                )
    try:
        yield where
    finally:
        _run("mount", "-o", "remount,rw", str(where))
        if _run("umount", str(where)).returncode != 0:
            _run("umount", "-l", str(where))
        if image is not None:
            image.unlink(missing_ok=True)


def remount(where: Path, mode: str) -> None:
    result = _run("mount", "-o", f"remount,{mode}", str(where))
    if result.returncode != 0:
        pytest.skip(f"cannot remount {where} {mode}: {result.stderr.strip()}")


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(ballast: Path, leave: int) -> None:
    """Take all free space of ``ballast``'s filesystem but ``leave`` bytes."""
    ballast.unlink(missing_ok=True)
    take = free_bytes(ballast.parent) - leave
    with open(ballast, "wb") as f:
        if take > 0:
            os.posix_fallocate(f.fileno(), 0, take)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path below ``root`` with its size and mtime, to prove nothing changed."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath, name)
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@contextlib.contextmanager
def bind_mount(source: Path, where: Path) -> Iterator[Path]:
    """Bind ``source`` at ``where`` for the block; on leaving, every mount below ``where``'s
    parent's parent that the block moved along (a renamed target carries it) is undone."""
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    where.mkdir(parents=True, exist_ok=True)
    result = _run("mount", "--bind", str(source), str(where))
    if result.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {result.stderr.strip()}")
    scope = str(where.parent.parent.resolve())
    try:
        yield where
    finally:
        with open("/proc/self/mountinfo") as f:  # no escaped characters in pytest's paths
            points = [line.split(" ")[4] for line in f if len(line.split(" ")) > 4]
        for point in sorted(points, reverse=True):
            if point.startswith(scope + os.sep) and _run("umount", point).returncode != 0:
                _run("umount", "-l", point)

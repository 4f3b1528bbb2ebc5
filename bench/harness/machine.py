"""What ran a benchmark: CPU, memory, swap, disk, kernel, Python and shardstream's revision."""

from __future__ import annotations

import os
import platform
import shutil
import time
from pathlib import Path

from harness import REPO, MiB
from harness.process import output


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def mem_total_bytes() -> int:
    """MemTotal of /proc/meminfo in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def swap() -> str:
    return output(["swapon", "--show=NAME,SIZE", "--noheadings"]) or "none"


def disk_of(path: Path) -> list[str]:
    """``df -hT PATH``'s row for the filesystem holding ``path``: device, type, size, used, …"""
    df = output(["df", "-hT", str(path)]).splitlines()
    return df[-1].split() if len(df) > 1 else []


def machine_facts(path: Path) -> dict:
    """The machine, with the disk that holds ``path``."""
    disk = disk_of(path)
    usage = shutil.disk_usage(path)
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "mem_total_gib": round(mem_total_bytes() / 2**30, 1),
        "swap": swap(),
        "disk_device": disk[0] if disk else "",
        "disk_fs": disk[1] if len(disk) > 1 else "",
        "disk_size_gib": round(usage.total / 2**30),
        "disk_free_gib": round(usage.free / 2**30),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def git_revision(rev: str = "HEAD") -> str:
    """The short hash of ``rev`` in this repository ("" when git cannot say)."""
    return output(["git", "rev-parse", "--short", rev], cwd=REPO)


def src_dirty() -> bool:
    """Whether src/ has uncommitted changes."""
    return bool(output(["git", "status", "--porcelain", "src"], cwd=REPO))


def disk_write_probe(directory: Path, mib: int = 512) -> float:
    """MB/s of a sequential write + fsync (the disk the checkpoints go to)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "probe.bin"
    block = os.urandom(16 * MiB)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mib // 16):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t
    path.unlink()
    return mib * MiB / 1e6 / elapsed

"""Run one command and measure it the way the kernel sees it; machine-wide CPU use.

Wall time is ``time.perf_counter`` around spawn .. reap. Peak RSS is the kernel's
``ru_maxrss`` of the command, read through GNU ``/usr/bin/time -f %M`` ("Maximum resident set
size" of ``time -v``).

Why not ``os.wait4`` on a child of this process: Linux carries the RSS high-water mark of the
address space a process had *before* ``exec`` into its ``ru_maxrss``, so a command forked from
a Python driver that has imported torch inherits the driver's ~200 MiB (``cp -r`` would "use"
229 MiB). GNU time is a tiny C program, so its child starts from a ~1 MiB floor. Without GNU
time we fall back to ``os.wait4`` and flag the result (``rss_source``).

``ru_maxrss`` is the high-water mark of the single largest process in the reaped tree, so a
sampler also sums the RSS of the whole process tree every 50 ms; a tool that forks workers
shows up there rather than being under-reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import MiB


@dataclass
class Measurement:
    argv: list[str]
    returncode: int
    wall_s: float
    peak_rss_bytes: int  # kernel: ru_maxrss of the reaped child
    tree_peak_rss_bytes: int  # sampled: max over time of the summed RSS of the process tree
    max_tree_procs: int
    user_s: float
    sys_s: float
    stdout: str = ""
    stderr_tail: str = ""
    rss_source: str = "gnu-time"
    # CPU seconds the whole machine was busy during the run minus the command's own user+sys:
    # what everyone else took. Divided by wall * cores it is the background load share.
    other_cpu_s: float | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_rss_mib"] = round(self.peak_rss_bytes / MiB, 1)
        d["tree_peak_rss_mib"] = round(self.tree_peak_rss_bytes / MiB, 1)
        return d


class _TreeSampler(threading.Thread):
    def __init__(self, pid: int, interval_s: float = 0.05):
        super().__init__(daemon=True)
        self.pid = pid
        self.interval_s = interval_s
        self.peak = 0
        self.max_procs = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil  # imported here: a measured child that imports harness stays lean

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop_event.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self.max_procs = max(self.max_procs, len(procs))
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


GNU_TIME = "/usr/bin/time"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float | None:
    """Machine-wide busy CPU seconds so far (everything in /proc/stat's cpu line but idle and
    iowait; guest time is already inside user/nice)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    v = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _CLK_TCK


def _gnu_time_ok() -> bool:
    try:
        r = subprocess.run(
            [GNU_TIME, "-f", "%M", "true"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and r.stderr.strip().splitlines()[-1].isdigit()


_HAVE_GNU_TIME: bool | None = None


def have_gnu_time() -> bool:
    global _HAVE_GNU_TIME
    if _HAVE_GNU_TIME is None:
        _HAVE_GNU_TIME = _gnu_time_ok()
    return _HAVE_GNU_TIME


def run_measured(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    capture_stdout: bool = False,
    timeout_s: float | None = None,
) -> Measurement:
    """Run ``argv`` to completion; never raises on a non-zero exit (the caller decides)."""
    stdout = subprocess.PIPE if capture_stdout else subprocess.DEVNULL
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    stderr_path = tmp / f"bench-stderr-{os.getpid()}.log"
    time_path = tmp / f"bench-time-{os.getpid()}.txt"
    use_time = have_gnu_time()
    full_argv = [GNU_TIME, "-f", "%M %U %S", "-o", str(time_path), *argv] if use_time else argv
    busy0 = busy_cpu_s()
    with open(stderr_path, "w+b") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(full_argv, stdout=stdout, stderr=err, env=env, cwd=cwd)
        sampler = _TreeSampler(proc.pid)
        sampler.start()
        out_chunks: list[bytes] = []
        reader = None
        if capture_stdout:
            # Drain stdout concurrently so a chatty child never blocks on a full pipe.
            reader = threading.Thread(
                target=lambda: out_chunks.append(proc.stdout.read()), daemon=True
            )
            reader.start()
        deadline = None if timeout_s is None else t0 + timeout_s
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                break
            if deadline is not None and time.perf_counter() > deadline:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.002)
        wall = time.perf_counter() - t0
        busy1 = busy_cpu_s()
        sampler.stop()
        if reader is not None:
            reader.join()
            proc.stdout.close()
        proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from re-reaping
        err.seek(0)
        stderr_tail = err.read()[-4000:].decode(errors="replace")
    stderr_path.unlink(missing_ok=True)
    # Linux reports ru_maxrss in KiB.
    maxrss_kib, user_s, sys_s, source = ru.ru_maxrss, ru.ru_utime, ru.ru_stime, "wait4"
    if use_time:
        try:
            # time writes "Command exited with non-zero status N" etc. before the numbers.
            last = time_path.read_text().strip().splitlines()[-1].split()
            maxrss_kib, user_s, sys_s = int(last[0]), float(last[1]), float(last[2])
            source = "gnu-time"
        except (OSError, IndexError, ValueError):
            source = "wait4 (gnu time output unreadable; includes the driver's pre-exec RSS)"
        time_path.unlink(missing_ok=True)
    else:
        source = "wait4 (no GNU time; includes the driver's pre-exec RSS)"
    return Measurement(
        argv=[str(a) for a in argv],
        returncode=proc.returncode,
        wall_s=wall,
        peak_rss_bytes=maxrss_kib * 1024,
        tree_peak_rss_bytes=max(sampler.peak, maxrss_kib * 1024),
        max_tree_procs=sampler.max_procs,
        user_s=user_s,
        sys_s=sys_s,
        rss_source=source,
        other_cpu_s=(
            None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - user_s - sys_s)
        ),
        stdout=b"".join(out_chunks).decode(errors="replace") if capture_stdout else "",
        stderr_tail=stderr_tail,
    )


def others_cpu_share(busy0: float | None, wall_s: float, own_cpu_s: float) -> float | None:
    """Share of the machine's CPU time (all cores) that others used since ``busy0`` (from
    ``busy_cpu_s``) over ``wall_s`` seconds in which the measured work used ``own_cpu_s``."""
    busy1 = busy_cpu_s()
    if busy0 is None or busy1 is None or wall_s <= 0:
        return None
    return max(0.0, busy1 - busy0 - own_cpu_s) / (wall_s * (os.cpu_count() or 1))


def output(argv: list[str], cwd: Path | None = None, timeout: float = 120) -> str:
    """``argv``'s stripped stdout, or "" when it cannot run or exits non-zero."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, check=True, cwd=cwd, timeout=timeout
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def torchrun(procs: int, *args: str, python: str = sys.executable) -> list[str]:
    """The argv of ``torchrun --standalone --nproc_per_node=PROCS ARGS…`` under ``python``."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={procs}",
        *args,
    ]

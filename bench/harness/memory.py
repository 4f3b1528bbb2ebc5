"""How much memory and CPU a stretch of *this* process uses (a rank of a training benchmark).

The peak is the kernel's ``VmHWM`` after ``shardstream.engine.memory.reset_peak_rss`` (through
``/proc/self/clear_refs``), the baseline ``VmRSS`` right before; a thread samples ``statm`` for
the memory-over-time plots. ``settle`` gives every measurement the same start.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import threading
import time

from harness import MiB

_PAGE = os.sysconf("SC_PAGE_SIZE")
PREFAULT_BYTES = 1280 * MiB
_libc = None


def malloc_trim() -> None:
    """Give freed heap memory back to the kernel so the next baseline is honest."""
    global _libc
    gc.collect()
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except OSError:
        pass


def prefault(nbytes: int = PREFAULT_BYTES) -> None:
    """Touch and free ``nbytes`` right before a measurement.

    This VM has a virtio balloon with free page reporting: memory freed for more than a few
    seconds goes back to the host, and touching it again costs ~10x a normal page fault
    (256 MiB: 0.7 s instead of 0.04-0.07 s). Without this, a method that allocates buffers
    would be charged a cost bare-metal hosts do not have; the ordinary page-fault cost stays in.
    The page cache a save writes into is taken from the same pool, so ``nbytes`` should cover
    what a method writes per rank: with 1.25 GiB per rank at world size 2 (1.56 GiB written per
    rank), the same shardstream save took 2.2 s after a shardstream save and 2.9-3.3 s after
    torch.save or dcp.save, with 3-4x the kernel CPU time; with 2.5 GiB, 2.2-2.3 s after either.
    """
    import numpy as np

    block = np.empty(nbytes, dtype=np.uint8)
    block[::_PAGE] = 1
    del block


def settle(prefault_bytes: int = PREFAULT_BYTES) -> None:
    """The common start of a measurement: heap trimmed, no dirty pages of anyone's left to
    flush, ``prefault_bytes`` touched and freed."""
    malloc_trim()
    os.sync()
    prefault(prefault_bytes)


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class RssSampler(threading.Thread):
    """This process's RSS every ``interval_s`` (reads /proc/self/statm; a few µs per sample)."""

    def __init__(self, interval_s: float = 0.02):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self.t0 = time.perf_counter()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.perf_counter() - self.t0, rss_now()))
            self._halt.wait(self.interval_s)

    def stop(self) -> list[tuple[float, int]]:
        self._halt.set()
        self.join()
        self.samples.append((time.perf_counter() - self.t0, rss_now()))
        return self.samples


def downsample(samples: list, limit: int = 1500) -> list:
    """At most about ``limit`` samples, evenly spaced, keeping the maximum."""
    if len(samples) <= limit:
        return samples
    step = len(samples) / limit
    out = [samples[int(i * step)] for i in range(limit)]
    peak = max(samples, key=lambda s: s[1])
    if peak not in out:
        out.append(peak)
        out.sort()
    return out


class Probe:
    """Peak RSS above the baseline, CPU seconds and (optionally) RSS samples between
    ``start()`` and ``stop()``."""

    def __init__(self, sample_every_s: float | None = 0.02):
        self.sampler = RssSampler(sample_every_s) if sample_every_s else None

    def start(self) -> Probe:
        from shardstream.engine.memory import current_rss_bytes, reset_peak_rss

        reset_peak_rss()
        self.base = current_rss_bytes()
        if self.sampler:
            self.sampler.t0 = time.perf_counter()
            self.sampler.start()
        self.cpu0 = cpu_seconds()
        return self

    def stop(self) -> dict:
        """``cpu_s``, ``base_rss_mib``, ``peak_rss_mib``, ``extra_rss_mib`` and, when sampled,
        ``samples``: (seconds, MiB above the baseline) pairs."""
        from shardstream.engine.memory import peak_rss_bytes

        cpu = cpu_seconds() - self.cpu0
        peak = peak_rss_bytes()
        out = {
            "cpu_s": cpu,
            "base_rss_mib": self.base / MiB,
            "peak_rss_mib": peak / MiB,
            "extra_rss_mib": (peak - self.base) / MiB,
        }
        samples = self.sampler.stop() if self.sampler else []
        if samples:
            out["samples"] = [
                (round(t, 3), round((r - self.base) / MiB, 1)) for t, r in downsample(samples)
            ]
        return out

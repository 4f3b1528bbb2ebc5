"""Peak resident memory as the kernel reports it, and the garbage collector around planning."""

from __future__ import annotations

import contextlib
import gc
import resource
import threading
from collections.abc import Iterator


def peak_rss_bytes() -> int:
    """VmHWM of this process (touched mmap pages included)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector around planning.

    Planning a wide checkpoint builds millions of small objects, none of them cyclic garbage;
    each collection would walk them all, so with the collector on, planning at 256 to 2,048
    ranks took 1.7 to 2.4 times as long (docs/scaling.md). Reference counting still frees
    everything. The collector's previous state is restored on exit. Off the main thread (an
    async save) this does nothing: the switch is process-wide, and training runs meanwhile.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

"""Host memory: peak resident memory as the kernel reports it, memory mappings of its own for
buffers, and the garbage collector around planning."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import resource
import sys
import threading
from collections.abc import Iterator

import numpy as np

_PAGE = 4096


def anonymous_memory(nbytes: int, touch: bool = False, huge: bool = True) -> np.ndarray:
    """Zeroed memory of its own mapping: untouched pages cost nothing, and dropping the last
    reference unmaps it, so it goes back to the kernel instead of staying in malloc's heap.

    Private (a shared anonymous mapping is shmem, which gets no huge pages) and advised for
    huge pages as ``np.empty`` does: with 4 KiB pages, faulting in the windows made saves
    measurably slower on a THP=madvise host. ``touch``: fault every page in now (a copy into
    it later then runs at memory speed: 1.2 GB in 0.07 s here, against 0.4 s into fresh pages).
    """
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE"
    if hasattr(mmap, advice):
        with contextlib.suppress(OSError):
            memory.madvise(getattr(mmap, advice))
    array = np.frombuffer(memory, dtype=np.uint8)[:nbytes]
    if touch:
        _touch_pages(array)
    return array


def _touch_pages(array: np.ndarray, threads: int = 4) -> None:
    """Fault in every page of ``array``, on up to ``threads`` threads (page faults scale with
    cores: two threads halved the time on the 2-core benchmark VM)."""
    pages = -(-array.nbytes // _PAGE)
    threads = max(1, min(threads, len(os.sched_getaffinity(0)), pages // 16384))  # 64 MiB each
    if threads == 1:
        array[::_PAGE] = 0
        return
    per = -(-pages // threads) * _PAGE

    def touch(lo: int) -> None:
        array[lo : lo + per : _PAGE] = 0  # numpy releases the GIL for the strided fill

    workers = [threading.Thread(target=touch, args=(lo,)) for lo in range(per, array.nbytes, per)]
    for worker in workers:
        worker.start()
    touch(0)
    for worker in workers:
        worker.join()


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


def give_back_freed_memory() -> None:
    """Hand the heap pages freed since (a layout plan's objects, once dropped) back to the
    kernel (glibc's ``malloc_trim``), so that the copy buffers allocated next do not add
    to them in the peak RSS; nothing where the C library has no such call."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


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


@contextlib.contextmanager
def imports_collector_held() -> Iterator[None]:
    """Python's cyclic garbage collector around large imports (torch, transformers).

    An import such as transformers' (with torch._dynamo, torch.distributed.tensor, sympy and a
    modeling module) creates ~300,000 objects, modules, classes and functions that live as
    long as the process. With the collector on, they trigger hundreds of collections during
    the import, several of them full ones (~0.5 s of a cold ``inspect`` on a 2-core VM);
    paused, they pile up in the youngest generation, and the first collection after walks
    them all (0.13-0.2 s at the end of a cold merge). So the collector is paused
    (``gc_paused``), and when something was imported, every object alive moves to the oldest
    generation before it resumes (``gc.freeze()`` then ``gc.unfreeze()``, which splice
    lists): the standing surviving two collections would have given them. Nothing is exempt
    from later full collections. Like ``gc_paused``, only on the main thread; and not when the
    process keeps objects frozen itself (``gc.unfreeze()`` would release them).
    """
    modules = len(sys.modules)
    with gc_paused():
        try:
            yield
        finally:
            if (
                len(sys.modules) > modules
                and threading.current_thread() is threading.main_thread()
                and not gc.get_freeze_count()
            ):
                gc.freeze()
                gc.unfreeze()

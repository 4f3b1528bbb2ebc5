"""Reading ahead while the plan is made: the disk fills the page cache with the source bytes a
copy reads first while the CPU plans it (a cold layout plan imports transformers and builds
the model on meta: seconds). A hint only: nothing is read into this process's memory (the
page cache is not its RSS), failures are ignored, and no more advice is given once the plan
is done, when the copy's own prefetch (``copy._prefetch_sources``) takes over. The kernel
queues an advised range at once (6 GB in about 0.6 s, measured), so the budget, not the
plan's length, bounds what is read.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence

from ..units import available_memory
from .plan import Block, block_span

log = logging.getLogger(__name__)

STEP_BYTES = 32 << 20  # one advice call at most: stopping waits for one
MAX_BYTES = 8 << 30  # more than a plan takes to make at any disk's speed
GAP_BYTES = 1 << 20  # ranges of one file closer than this are advised as one
BATCH_BLOCKS = 4096  # blocks walked between looks at whether to stop


def ranges_in_order(
    blocks: Iterable[Block], budget: int, gap: int = GAP_BYTES
) -> list[tuple[str, int, int]]:
    """``(file, start, stop)`` covering ``blocks`` in the order given, up to ``budget`` bytes;
    a block that follows the previous one of its file within ``gap`` extends its range."""
    out: list[tuple[str, int, int]] = []
    last: dict[str, int] = {}  # file -> index in ``out`` of its latest range
    total = 0
    for block in blocks:
        if total >= budget:
            break
        start, stop = block_span(block)
        if stop <= start:
            continue
        stop = min(stop, start + budget - total)
        i = last.get(block.location)
        if i is not None and out[i][1] - gap <= start <= out[i][2] + gap:
            _, lo, hi = out[i]
            grown = max(hi, stop) - min(lo, start)
            total += grown - (hi - lo)
            out[i] = (block.location, min(lo, start), max(hi, stop))
            continue
        last[block.location] = len(out)
        out.append((block.location, start, stop))
        total += stop - start
    return out


def default_budget() -> int:
    """A quarter of the memory available now, at most ``MAX_BYTES``: page cache it may fill
    without pushing out what the machine is using."""
    available = available_memory()
    return min(MAX_BYTES, (available or 0) // 4)


@contextlib.contextmanager
def reading_ahead(
    blocks: Sequence[Block] | Iterable[Block], budget: int | None = None
) -> Iterator[threading.Event]:
    """For the ``with`` block, advise the kernel (``POSIX_FADV_WILLNEED``) to read ``blocks``'
    bytes, in their order, up to ``budget`` bytes, from a background thread (which also
    walks ``blocks``: the caller plans meanwhile); the advice stops when the block ends.
    Yields the event that is set once every range has been advised."""
    done = threading.Event()
    budget = default_budget() if budget is None else budget
    if budget <= 0 or not hasattr(os, "posix_fadvise"):
        done.set()
        yield done
        return
    stopping = threading.Event()

    def advise() -> None:
        fds: dict[str, int] = {}
        left, pending = budget, iter(blocks)
        try:
            while left > 0 and not stopping.is_set():
                batch = list(itertools.islice(pending, BATCH_BLOCKS))
                if not batch:
                    break
                ranges = ranges_in_order(batch, left)
                left -= sum(stop - start for _, start, stop in ranges)
                if not _advise(ranges, stopping, fds):
                    return
            if not stopping.is_set():
                done.set()
        except Exception as exc:  # noqa: BLE001  (a hint: never the merge's error)
            log.debug("read-ahead stopped: %s", exc)
        finally:
            for fd in fds.values():
                os.close(fd)

    thread = threading.Thread(target=advise, name="shardstream-readahead", daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stopping.set()
        thread.join()


def _advise(
    ranges: Sequence[tuple[str, int, int]], stopping: threading.Event, fds: dict[str, int]
) -> bool:
    """Advise each range in turn (files opened once, into ``fds``); False when ``stopping``
    came first."""
    for path, start, end in ranges:
        fd = fds.get(path)
        if fd is None:
            with contextlib.suppress(OSError):  # opened non-blocking: a FIFO never waits
                fd = fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            if fd is None:
                continue
        for offset in range(start, end, STEP_BYTES):
            if stopping.is_set():
                return False
            with contextlib.suppress(OSError):
                length = min(STEP_BYTES, end - offset)
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    return True

"""The executor: streams ``CopyRun``s between endpoints (``endpoints.py``) with bounded, reused
buffers. All tensor I/O happens here and there.

Destination files are assembled window by window (a window is a contiguous byte range of the
destination, at most ``buffer_bytes`` split between the read, convert and write buffers), then
written with ``pwrite`` and hashed in fixed-size chunks as they go. Memory destinations (live
tensors during restore) are written run by run. Dtype conversion uses torch, so results are
bit-identical to ``tensor.to(dtype)``.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CheckpointFormatError, out_of_space
from ..units import DEFAULT_CHUNK_BYTES, DIRECT_ALIGN
from .checksum import ChunkHasher, new_hasher
from .dtypes import TORCH_BY_CODE, itemsize
from .endpoints import Endpoint, TensorEndpoint
from .memory import anonymous_memory
from .plan import CopyRun, coalesce_runs

_MIN_WINDOW = 4096
# Elements whose float16 overflow is counted at once: the test's temporaries stay a few MiB.
_OVERFLOW_SLICE = 1 << 18

# fix(rows_fp32, first_flat_index, index_step, elem_offset) -> rows_fp32; used for LoRA fusion.
RowTransform = Callable[[torch.Tensor, int, int, int], torch.Tensor]


@dataclass
class Buffers:
    """The reusable buffers, sized from one budget: two destination windows (one is written
    while the other fills), a source buffer and a conversion staging buffer."""

    window: np.ndarray
    src: np.ndarray
    staging: torch.Tensor
    spare: np.ndarray | None = None

    @property
    def windows(self) -> tuple[np.ndarray, np.ndarray]:
        if self.spare is None:
            self.spare = np.empty_like(self.window)
        return self.window, self.spare

    @classmethod
    def sized(cls, buffer_bytes: int, ratio: float = 1.0) -> Buffers:
        """Split ``buffer_bytes`` so that reading ``ratio`` source bytes per output byte fits.

        Inside ``one_buffer_set`` the split is carved from that set's one allocation.
        """
        ratio = max(ratio, 1e-3)
        # Whole pages, so both windows start page-aligned for direct writes.
        window = max(_MIN_WINDOW, int(buffer_bytes / (3 + ratio)) // DIRECT_ALIGN * DIRECT_ALIGN)
        src = max(_MIN_WINDOW, int(window * ratio))
        arena = getattr(_ARENA, "memory", None)
        if arena is None or 3 * window + src > arena.nbytes:
            arena = anonymous_memory(3 * window + src)
        # Windows first: a save touches them, an export or conversion the rest.
        window_a, spare = arena[:window], arena[window : 2 * window]
        src_part = arena[2 * window : 2 * window + src]
        staging = torch.from_numpy(arena[2 * window + src : 3 * window + src])
        return cls(window_a, src_part, staging, spare)


_ARENA = threading.local()


@contextlib.contextmanager
def one_buffer_set(buffer_bytes: int) -> Iterator[None]:
    """Make every ``Buffers.sized`` on this thread inside the block share one allocation.

    The phases of one save (sharded write, extra state, hf export) then stay within one
    ``buffer_bytes`` together, not each. The phases must run one after another.

    >>> with one_buffer_set(256 << 20):  # doctest: +SKIP
    ...     write_phase_1(); write_phase_2()
    """
    previous = getattr(_ARENA, "memory", None)
    if previous is None:
        _ARENA.memory = anonymous_memory(buffer_bytes)
    try:
        yield
    finally:
        _ARENA.memory = previous


class Streamer:
    """Moves rows of ``CopyRun``s from source endpoints, converting dtypes on the way."""

    def __init__(
        self,
        endpoints: Callable[[str], Endpoint],
        buffers: Buffers,
        transforms: dict[str, RowTransform] | None = None,
    ):
        self.endpoint = endpoints
        self.buf = buffers
        self.transforms = transforms or {}
        # output tensor -> values finite in the source that its narrower dtype made infinite
        self.overflowed: dict[str, int] = {}

    def rows(
        self, run: CopyRun, i0: int, i1: int, e0: int, e1: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows [i0, i1), elements [e0, e1) of each, as (rows, bytes) in the destination dtype.

        With ``out`` (a contiguous byte array of the right size), the result is produced there
        directly when possible, saving a pass over memory; the return value says where it is.
        """
        k, n = i1 - i0, e1 - e0
        s_isz, d_isz = itemsize(run.src_dtype), itemsize(run.dst_dtype)
        width = n * s_isz
        need = k * width
        transform = self.transforms.get(run.tensor)
        plain = run.src_dtype == run.dst_dtype and transform is None
        contiguous = k == 1 or run.src_step == width
        source = self.endpoint(run.src)
        first = run.src_offset + i0 * run.src_step + e0 * s_isz
        if plain and contiguous and out is not None:
            source.read_into(first, out)  # straight into the destination window
            return out.reshape(k, width)
        src = self.buf.src[:need].reshape(k, width) if need else self.buf.src[:0].reshape(k, 0)
        view = None
        if transform is None:
            view = getattr(source, "host_view", None) or getattr(source, "mapped", None)
        span = (k - 1) * run.src_step + width if k else 0
        lent = None  # the source's own bytes, when it can lend them
        if view is not None and not contiguous and span <= self.buf.src.nbytes:
            lent = view(first, span)
        elif view is not None and contiguous and not plain:
            lent = view(first, need)
        if contiguous and not plain and lent is not None:
            src = lent.reshape(k, width)  # convert straight from host memory or page cache
        elif contiguous:
            source.read_into(first, self.buf.src[:need])
        else:
            if lent is not None:
                rows = np.lib.stride_tricks.as_strided(
                    lent, shape=(k, width), strides=(run.src_step, 1)
                )
                # Packed first: torch converts NaNs in strided memory differently.
                np.copyto(src, rows)
            elif span <= self.buf.src.nbytes and span <= 2 * need:
                source.read_into(first, self.buf.src[:span])
                rows = np.lib.stride_tricks.as_strided(
                    self.buf.src, shape=(k, width), strides=(run.src_step, 1)
                )
                np.copyto(src, rows.copy() if span > need else rows)
            else:
                for j in range(k):
                    source.read_into(first + j * run.src_step, src[j])
        if plain:
            return src
        values = torch.from_numpy(src).view(TORCH_BY_CODE[run.src_dtype]).reshape(k, n)
        if transform is not None:
            first_index = run.elem_index + i0 * run.index_step + e0
            values = transform(values.float(), first_index, run.index_step, n)
        if out is not None and out.ctypes.data % d_isz == 0:
            target = torch.from_numpy(out).view(TORCH_BY_CODE[run.dst_dtype]).view(k, n)
            target.copy_(values)  # convert straight into the destination window
            self._count_overflow(run, values, target)
            return out.reshape(k, n * d_isz)
        staged = self.buf.staging[: k * n * d_isz].view(TORCH_BY_CODE[run.dst_dtype]).view(k, n)
        staged.copy_(values)
        self._count_overflow(run, values, staged)
        return self.buf.staging[: k * n * d_isz].numpy().reshape(k, n * d_isz)

    def _count_overflow(self, run: CopyRun, values: torch.Tensor, converted: torch.Tensor) -> None:
        """Count the values a cast to float16 (the one output dtype of a smaller range than
        the inputs') made infinite, though finite before: the merge says so, naming the
        tensor."""
        if run.dst_dtype != "F16" or not values.is_floating_point():
            return
        made = 0
        flat_values, flat_converted = values.reshape(-1), converted.reshape(-1)
        for lo in range(0, flat_values.numel(), _OVERFLOW_SLICE):  # bounded temporaries
            got = flat_converted[lo : lo + _OVERFLOW_SLICE]
            if torch.isinf(got).any():
                made += int(torch.isinf(got).sum())
                made -= int(torch.isinf(flat_values[lo : lo + _OVERFLOW_SLICE]).sum())
        if made > 0:
            self.overflowed[run.tensor] = self.overflowed.get(run.tensor, 0) + made

    def borrow(self, run: CopyRun, i0: int, i1: int, e0: int, e1: int) -> np.ndarray | None:
        """Rows [i0, i1), elements [e0, e1) as a (rows, bytes) view of the source's own host
        memory, strided as they lie there, when they need no conversion; None otherwise."""
        if run.src_dtype != run.dst_dtype or run.tensor in self.transforms:
            return None
        view = getattr(self.endpoint(run.src), "host_view", None)
        if view is None:
            return None
        count, isz = i1 - i0, itemsize(run.src_dtype)
        width = (e1 - e0) * isz
        first = run.src_offset + i0 * run.src_step + e0 * isz
        span = view(first, (count - 1) * run.src_step + width if count else 0)
        if span is None:
            return None
        step = run.src_step if count > 1 else 0
        return np.lib.stride_tricks.as_strided(span, shape=(count, width), strides=(step, 1))

    def batches(self, run: CopyRun, lo: int, hi: int, max_dst_bytes: int):
        """Yield (i0, i1, e0, e1) pieces of ``run`` restricted to destination bytes [lo, hi)."""
        d_isz, s_isz = itemsize(run.dst_dtype), itemsize(run.src_dtype)
        run_bytes = run.dst_run_bytes
        if run.count == 1 or run.dst_step == 0:
            first_row, last_row = 0, run.count
        else:
            first_row = max(0, -(-(lo - run.dst_offset - run_bytes + 1) // run.dst_step))
            last_row = min(run.count, (hi - 1 - run.dst_offset) // run.dst_step + 1)
        # Rows that fit whole into [lo, hi) go in batches; the rest are split by elements.
        limit_rows = max(
            1,
            min(
                max_dst_bytes // max(run_bytes, 1), self.buf.src.nbytes // max(run.elems * s_isz, 1)
            ),
        )
        # A row goes whole only if both its destination and its source bytes fit the buffers.
        whole = run_bytes <= max_dst_bytes and run.src_run_bytes <= self.buf.src.nbytes
        i = first_row
        while i < last_row:
            row_lo = run.dst_offset + i * run.dst_step
            if row_lo >= lo and row_lo + run_bytes <= hi and whole:
                j = i + 1
                while (
                    j < last_row
                    and j - i < limit_rows
                    and run.dst_offset + j * run.dst_step + run_bytes <= hi
                ):
                    j += 1
                yield i, j, 0, run.elems
                i = j
                continue
            a = max(lo, row_lo)
            b = min(hi, row_lo + run_bytes)
            e = (a - row_lo) // d_isz
            end = (b - row_lo) // d_isz
            step = max(1, min(max_dst_bytes // d_isz, self.buf.src.nbytes // s_isz))
            while e < end:
                yield i, i + 1, e, min(end, e + step)
                e += step
            i += 1


def _snap(offset: int, bounds: Sequence[tuple[int, int, int]], starts: Sequence[int]) -> int:
    """Move ``offset`` down to an element boundary of the tensor containing it (``bounds``
    in file order, ``starts`` their begins)."""
    i = bisect.bisect_right(starts, offset) - 1
    if i >= 0:
        begin, end, isz = bounds[i]
        if offset < end:
            return begin + (offset - begin) // isz * isz
    return offset


def stream_file(
    fd: int,
    path: str,
    data_start: int,
    data_size: int,
    runs: Sequence[CopyRun],
    tensor_bounds: Sequence[tuple[int, int, int, str]],
    streamer: Streamer,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
    window_hook: Callable[[int, int], None] | None = None,
    start: int = 0,
    end: int | None = None,
    borrow: bool = False,
    direct_fd: int | None = None,
) -> list[str]:
    """Fill the data section of an open file from ``runs``; return the chunk digests.

    ``tensor_bounds`` lists (begin, end, itemsize, name) per tensor, relative to the data start.
    Only data bytes [start, end) are filled when given (distributed merge splits files this
    way); ``start`` must be a multiple of ``chunk_bytes`` so the digests line up.
    ``window_hook(lo, hi)`` is told each data range before its sources are read; everything
    before ``lo`` has been read by then (async saves use it to track live tensors). Without
    ``borrow`` it is also told ``(hi, hi)`` once a window is filled, before it is written.
    Windows are written and hashed on a second thread while the next one fills.
    With ``borrow``, bytes that need no conversion and lie contiguous in a source's host memory
    (live CPU tensors) are hashed and written from there, not copied into the window first; the
    sources must then stay unchanged until this returns (a synchronous save).
    With ``direct_fd`` (the same file opened ``O_DIRECT``), windows are cut at
    ``DIRECT_ALIGN`` boundaries of the file and their aligned bytes written through it; a
    file system that refuses direct writes gets them through ``fd`` instead.
    Raises if any byte of the range is left without a source.
    """
    from concurrent.futures import ThreadPoolExecutor

    if start % chunk_bytes:
        raise ValueError(f"range start {start} is not a multiple of the chunk size {chunk_bytes}")
    end = data_size if end is None else min(end, data_size)
    runs = coalesce_runs(sorted(runs, key=lambda r: r.dst_offset), streamer.transforms)
    bounds = sorted((b, e, isz) for b, e, isz, _ in tensor_bounds)  # empty tensors first
    starts = [b for b, _, _ in bounds]
    chunks = ChunkHasher(chunk_bytes, max(0, end - start))

    def flush(parts: list[np.ndarray], lo: int) -> None:
        """pwrite a window's parts in order and hash them in fixed chunks, independent of
        window edges."""
        nonlocal direct_fd
        offset, rest = data_start + lo, parts
        if direct_fd is not None and len(parts) == 1:
            try:
                done = _pwrite_direct(direct_fd, path, parts[0], offset)
            except _DirectRefused:
                direct_fd, done = None, 0
            offset, rest = offset + done, [parts[0][done:]]
        _pwritev_all(fd, path, rest, offset)
        for view in parts:
            chunks.update(view)
        if progress:
            progress(sum(view.nbytes for view in parts))

    writer = ThreadPoolExecutor(1, thread_name_prefix="shardstream-write")
    pending = None
    try:
        active: list[CopyRun] = []
        next_run = 0
        lo, turn = start, 0
        capacity = streamer.buf.window.nbytes
        while lo < end:
            hi = min(end, lo + capacity)
            cut = (data_start + hi) % DIRECT_ALIGN
            if hi < end and direct_fd is not None and hi - cut > lo:
                hi -= cut  # the next window starts aligned too
            if hi < end:
                hi = max(_snap(hi, bounds, starts), lo + 1)
            while next_run < len(runs) and runs[next_run].dst_offset < hi:
                active.append(runs[next_run])
                next_run += 1
            active = [r for r in active if r.dst_end() > lo]
            if window_hook:
                window_hook(lo, hi)
            # The runs are known in advance: have the disk read the next window's sources
            # while this one is converted (the first window's own sources too).
            ahead = min(end, hi + capacity)
            upcoming = active + runs[next_run : _first_at_or_after(runs, next_run, ahead)]
            _prefetch_sources(upcoming, lo if turn == 0 else hi, ahead, streamer)
            window = streamer.buf.windows[turn % 2]
            turn += 1
            borrowed: list[tuple[int, np.ndarray]] | None = [] if borrow else None
            filled = _fill_window(window, lo, hi, active, streamer, borrowed)
            if window_hook and not borrow:
                window_hook(hi, hi)  # the window holds its bytes: no source is read any more
            if filled != hi - lo:
                name = next((n for b, e, _, n in tensor_bounds if b <= lo < e), "?")
                raise CheckpointFormatError(
                    f"{path}: internal plan error: window [{lo}, {hi}) near tensor {name!r} "
                    f"got {filled} of {hi - lo} bytes"
                )
            if pending is not None:
                pending.result()  # the other window is free again
            pending = writer.submit(flush, _window_parts(window[: hi - lo], borrowed), lo)
            lo = hi
        if pending is not None:
            pending.result()
    finally:
        writer.shutdown(wait=True)
    return chunks.digests


def _first_at_or_after(runs: Sequence[CopyRun], begin: int, offset: int) -> int:
    """Index of the first run from ``begin`` on whose destination starts at or after ``offset``
    (``runs`` are sorted by ``dst_offset``)."""
    i = begin
    while i < len(runs) and runs[i].dst_offset < offset:
        i += 1
    return i


def _prefetch_sources(
    runs: Sequence[CopyRun], lo: int, hi: int, streamer: Streamer, gap: int = 1 << 20
) -> None:
    """``prefetch`` the source bytes that destination bytes [lo, hi) of ``runs`` come from,
    merged per source into ranges (a gap under ``gap`` bytes is read along)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for run in runs:
        if hi <= lo or run.dst_offset >= hi or run.dst_end() <= lo or run.elems == 0:
            continue
        d_isz, s_isz = itemsize(run.dst_dtype), itemsize(run.src_dtype)
        row_bytes = run.dst_run_bytes
        if run.count == 1 or run.dst_step <= 0:
            first, last = 0, run.count - 1
        else:
            first = max(0, -(-(lo - run.dst_offset - row_bytes + 1) // run.dst_step))
            last = min(run.count - 1, (hi - 1 - run.dst_offset) // run.dst_step)
        e0 = min(run.elems, max(0, lo - run.dst_offset - first * run.dst_step) // d_isz)
        e1 = min(run.elems, -(-(hi - run.dst_offset - last * run.dst_step) // d_isz))
        a = run.src_offset + first * run.src_step + e0 * s_isz
        b = run.src_offset + last * run.src_step + e1 * s_isz
        if b > a:
            spans.setdefault(run.src, []).append((a, b))
    for src, ranges in spans.items():
        ranges.sort()
        endpoint = streamer.endpoint(src)
        start, stop = ranges[0]
        for a, b in ranges[1:]:
            if a > stop + gap:
                endpoint.prefetch(start, stop - start)
                start = a
            stop = max(stop, b)
        endpoint.prefetch(start, stop - start)


def _fill_window(
    window: np.ndarray,
    lo: int,
    hi: int,
    active: Sequence[CopyRun],
    streamer: Streamer,
    borrowed: list[tuple[int, np.ndarray]] | None = None,
) -> int:
    """Fill destination bytes [lo, hi) into ``window``; return how many bytes were placed.

    With a ``borrowed`` list, pieces the streamer can lend from host memory are appended to it
    as (window position, view) instead of being copied.
    """
    filled = 0
    for run in active:
        d_isz = itemsize(run.dst_dtype)
        for i0, i1, e0, e1 in streamer.batches(run, lo, hi, hi - lo):
            pos = run.dst_offset + i0 * run.dst_step + e0 * d_isz - lo
            count, width = i1 - i0, (e1 - e0) * d_isz
            if borrowed is not None and (count == 1 or run.dst_step == run.src_step == width):
                rows = streamer.borrow(run, i0, i1, e0, e1)  # contiguous at both ends
                if rows is not None:
                    borrowed.append((pos, rows.reshape(-1)))
                    filled += count * width
                    continue
            if count == 1 or run.dst_step == width:
                direct = window[pos : pos + count * width]
                rows = streamer.rows(run, i0, i1, e0, e1, out=direct)
                if not np.may_share_memory(rows, direct):
                    direct[...] = rows.reshape(-1)
            else:
                rows = streamer.rows(run, i0, i1, e0, e1)
                target = np.lib.stride_tricks.as_strided(
                    window[pos:], shape=(count, width), strides=(run.dst_step, 1)
                )
                target[...] = rows
            filled += count * width
    return filled


def _window_parts(
    window: np.ndarray, borrowed: list[tuple[int, np.ndarray]] | None
) -> list[np.ndarray]:
    """The window's bytes in order: borrowed views, and the window slices between them."""
    if not borrowed:
        return [window]
    parts, cursor = [], 0
    for pos, view in sorted(borrowed, key=lambda item: item[0]):
        if pos > cursor:
            parts.append(window[cursor:pos])
        parts.append(view)
        cursor = pos + view.nbytes
    if cursor < window.nbytes:
        parts.append(window[cursor:])
    return parts


_IOV_MAX = 512
_WRITE_FULL = "{path}: no space left on device while writing"


def _pwritev_all(fd: int, path: str, parts: Sequence[np.ndarray], offset: int) -> None:
    """``pwritev`` the parts back to back from ``offset``, resuming after short writes."""
    views = [memoryview(p).cast("B") for p in parts if p.nbytes]
    try:
        while views:
            n = os.pwritev(fd, views[:_IOV_MAX], offset)
            if n <= 0:
                raise OSError(errno.EIO, "pwritev wrote nothing")
            offset += n
            while n:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0], n = views[0][n:], 0
    except OSError as exc:
        full = out_of_space(exc, path, _WRITE_FULL)
        if full is not None:
            raise full from None
        raise


class _DirectRefused(Exception):
    """The file system rejected a direct write (EINVAL): write through the page cache."""


def _pwrite_direct(fd: int, path: str, data: np.ndarray, offset: int) -> int:
    """Write the largest ``DIRECT_ALIGN``-sized prefix of ``data`` at ``offset`` through an
    ``O_DIRECT`` descriptor; return how many bytes it wrote (0 where offset or address are
    unaligned). Raises ``_DirectRefused`` when the file system refuses before any byte."""
    n = data.nbytes // DIRECT_ALIGN * DIRECT_ALIGN
    if n == 0 or offset % DIRECT_ALIGN or data.ctypes.data % DIRECT_ALIGN:
        return 0
    view, done = memoryview(data[:n]).cast("B"), 0
    try:
        while done < n:
            wrote = os.pwrite(fd, view[done:], offset + done)
            if wrote <= 0 or wrote % DIRECT_ALIGN:
                return done + max(wrote, 0)
            done += wrote
    except OSError as exc:
        full = out_of_space(exc, path, _WRITE_FULL)
        if full is not None:
            raise full from None
        if exc.errno == errno.EINVAL and done == 0:
            raise _DirectRefused from None
        raise
    return done


def write_all(fd: int, path: str, data: bytes, offset: int) -> None:
    _pwritev_all(fd, path, [np.frombuffer(data, dtype=np.uint8)], offset)


def pwrite_array(fd: int, path: str, data: np.ndarray, offset: int) -> None:
    """``pwrite`` a contiguous array's bytes where they are (no copy)."""
    _pwritev_all(fd, path, [data], offset)


def stream_into_memory(
    runs: Sequence[CopyRun],
    streamer: Streamer,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Copy runs whose destinations are ``TensorEndpoint``s, batch by batch.

    Where the destination rows are contiguous in host memory, they are read (or converted)
    straight into the tensor, with no pass through the streamer's buffers.
    """
    cap = streamer.buf.window.nbytes
    for run in runs:
        dst = streamer.endpoint(run.dst)
        host_view = getattr(dst, "host_view", None)
        d_isz = itemsize(run.dst_dtype)
        for i0, i1, e0, e1 in streamer.batches(run, 0, 1 << 62, cap):
            offset = run.dst_offset + i0 * run.dst_step + e0 * d_isz
            count, width = i1 - i0, (e1 - e0) * d_isz
            direct = None
            if host_view is not None and (count == 1 or run.dst_step == width):
                direct = host_view(offset, count * width)
            if direct is not None:
                rows = streamer.rows(run, i0, i1, e0, e1, out=direct)
                if not np.may_share_memory(rows, direct):
                    direct[...] = rows.reshape(-1)
            else:
                rows = streamer.rows(run, i0, i1, e0, e1)
                dst.write_rows(offset, run.dst_step, rows)
            if progress:
                progress(count * width)


def hash_block(name: str, shape: Sequence[int], block, streamer: Streamer) -> str:
    """Digest of a block's elements in row-major order, read with the streamer's buffers."""
    from .plan import dense_block, plan_copy

    hasher = new_hasher()
    dst = dense_block("digest", 0, block.dtype, block.shape, block.start)
    for run in plan_copy(name, shape, block, dst):
        for i0, i1, e0, e1 in streamer.batches(run, 0, 1 << 62, streamer.buf.window.nbytes):
            hasher.update(memoryview(np.ascontiguousarray(streamer.rows(run, i0, i1, e0, e1))))
    return hasher.hexdigest()


def fill_window(
    streamer: Streamer, runs: Sequence[CopyRun], lo: int, hi: int, name: str
) -> np.ndarray:
    """Bytes [lo, hi) of a dense row-major tensor assembled from ``runs`` (planned into one
    ``dense_block``), in the streamer's window; the runs must cover the range."""
    out = streamer.buf.window[: hi - lo]
    filled = 0
    for run in runs:
        if run.dst_offset >= hi or run.dst_end() <= lo:
            continue
        d_isz = itemsize(run.dst_dtype)
        for i0, i1, e0, e1 in streamer.batches(run, lo, hi, hi - lo):
            rows = streamer.rows(run, i0, i1, e0, e1)
            pos = run.dst_offset + i0 * run.dst_step + e0 * d_isz - lo
            count, width = rows.shape
            target = np.lib.stride_tricks.as_strided(
                out[pos:], shape=(count, width), strides=(run.dst_step, 1)
            )
            target[...] = rows
            filled += rows.nbytes
    if filled != hi - lo:
        raise CheckpointFormatError(
            f"tensor {name!r}: internal plan error: window [{lo}, {hi}) got "
            f"{filled} of {hi - lo} bytes"
        )
    return out


def tensor_digest(tensor, streamer: Streamer, dtype: str) -> str:
    """Digest of a ``GlobalTensor``'s elements in row-major order, cast to ``dtype``, however
    its blocks lie: one window of the streamer's buffers at a time."""
    from .plan import dense_block, plan_copy

    shape = tuple(tensor.shape)
    isz = itemsize(dtype)
    dense = dense_block("digest", 0, dtype, shape)
    runs = sorted(
        (r for b in tensor.blocks for r in plan_copy(tensor.name, shape, b, dense)),
        key=lambda r: r.dst_offset,
    )
    capacity = streamer.buf.window.nbytes // isz * isz
    total = isz
    for size in shape:
        total *= size
    hasher = new_hasher()
    for lo in range(0, total, capacity):
        hi = min(total, lo + capacity)
        hasher.update(memoryview(fill_window(streamer, runs, lo, hi, tensor.name)))
    return hasher.hexdigest()


def read_tensor(tensor, streamer: Streamer, dtype: str | None = None) -> torch.Tensor:
    """Assemble a small ``GlobalTensor`` in memory (LoRA factors, extra state), in bounded steps."""
    from .plan import dense_block, plan_copy

    code = dtype or tensor.dtype
    out = torch.empty(tensor.shape, dtype=TORCH_BY_CODE[code])
    location = f"read:{tensor.name}"
    endpoint = TensorEndpoint(tensor.name, out)
    previous = streamer.endpoint

    def endpoints(name: str) -> Endpoint:
        return endpoint if name == location else previous(name)

    streamer.endpoint = endpoints
    try:
        dst = dense_block(location, 0, code, tensor.shape)
        runs = [r for b in tensor.blocks for r in plan_copy(tensor.name, tensor.shape, b, dst)]
        stream_into_memory(runs, streamer)
    finally:
        streamer.endpoint = previous
    return out

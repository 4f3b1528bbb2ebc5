"""Endpoints: the places the executor moves bytes between, a file or a live tensor's storage.

``FileEndpoint`` reads a file through short-lived mappings of the page cache and checks every
read against chunk digests (or zip CRC-32s) as the bytes stream past. ``TensorEndpoint`` reads
and writes a tensor's storage in place; device tensors reach the host through ``HostTransfer``,
a bounded ring of pinned buffers.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    UsageError,
)
from ..units import DEFAULT_CHUNK_BYTES
from .checksum import crc32, crc32_combine, new_hasher
from .dtypes import code_of
from .plan import Block
from .transfer import HostTransfer, default_transfer


class Endpoint:
    """A byte-addressable place: a file or a tensor's storage."""

    name: str

    def read_into(self, offset: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def write_rows(self, offset: int, step: int, rows: np.ndarray) -> None:
        raise NotImplementedError

    def prefetch(self, offset: int, nbytes: int) -> None:
        """Hint that bytes [offset, offset + nbytes) will be read soon; never required."""

    def finish(self) -> None:
        """Check whatever was read but not yet verified; raise if it is damaged."""

    def close(self) -> None:
        pass


class FileEndpoint(Endpoint):
    """A file read through the page cache; optionally every read is checked against chunk
    digests.

    Reads copy from short-lived mappings of the file (``preadv`` where it cannot be mapped),
    and ``mapped`` lends the bytes themselves, so a dtype conversion reads the page cache
    directly instead of a copy of it. A file truncated by someone else while it is mapped
    kills the process (SIGBUS); outputs are staged, so nothing half-written is committed.

    With digests, the chunk a read falls in is hashed as its bytes stream past: read straight
    into the caller's array and fed to the chunk's hash, and bytes the caller skips read into a
    small transient buffer and hashed too. When the last byte of a chunk has been hashed, its
    digest is compared, and a mismatch raises. Nothing is kept, so a merge reading thousands of
    rank files side by side holds a hash state per file, not a chunk. Bytes are handed out
    before the rest of their chunk has been read: ``finish()`` reads and checks the chunk in
    progress, and every caller calls it before it commits or returns what it read. Reads in
    file order touch each byte once; a read behind the chunk in progress restarts that chunk.

    Where the hasher is a CRC-32 (zip records), reads need no order: each read's bytes are
    hashed as a piece of their record, adjacent pieces are joined (``crc32_combine``), and a
    record is checked once its pieces cover it; ``finish()`` reads and hashes the gaps of the
    records left open. So the per-expert slices of a fused MoE tensor, which output order
    visits gate halves first and up halves after, are read once, not once per pass. Only a
    read of bytes already hashed in an open record checks that record first and opens it anew.

    Chunks are ``chunk_bytes`` apart from ``data_start`` (shardstream's safetensors files), or
    the given ``spans`` (zip records, whose CRC-32s ``hasher`` computes); bytes outside every
    span (zip headers) are read unchecked.
    """

    _SKIP_BYTES = 1 << 20  # the most bytes read at once to hash what a caller skips
    _MAP_PIECE_BYTES = 8 << 20  # the most bytes mapped at once by a copying read
    _MAP_MIN_BYTES = 1 << 20  # smaller reads use preadv: a mapping costs more than it saves
    _MAP_ALIGN = 2 << 20  # mappings start and end at multiples of this (a huge page)

    def __init__(
        self,
        path: str,
        digests: Sequence[str] | None = None,
        data_start: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        describe: Callable[[int, int], str] | None = None,
        spans: Sequence[tuple[int, int]] | None = None,
        hasher: Callable[[], Any] = new_hasher,
    ):
        self.name = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # listed when the checkpoint was opened: removed since
            raise CheckpointNotFoundError(
                f"{path}: no such file (removed while the checkpoint was being read?)"
            ) from None
        self.size = os.fstat(self.fd).st_size
        self.digests = list(digests) if digests is not None else None
        self.data_start = data_start
        self.chunk_bytes = chunk_bytes
        self.spans = list(spans) if spans is not None else None  # sorted, disjoint
        self._span_starts = [lo for lo, _ in self.spans] if self.spans is not None else None
        self.describe = describe or (lambda a, b: "")
        self._chunk: int | None = None  # index of the chunk being hashed, if any
        self._lo = self._hi = self._hashed_to = 0  # its bytes, and how far they are hashed
        self._hasher = hasher()
        self.chunks_read = 0  # chunks hashed and checked (tests and benchmarks watch this)
        # CRC-32 spans read out of order: span index -> sorted [start, end, crc] pieces hashed
        self._pieces: dict[int, list[list[int]]] | None = None
        if self.spans is not None and getattr(self._hasher, "combinable", False):
            self._pieces = {}
        self._unmappable = False
        self._no_probe = False  # prefetch: the file system refuses RWF_NOWAIT
        self._probe = bytearray(1)

    def _pread(self, offset: int, out: np.ndarray) -> None:
        """Copy bytes [offset, offset + out.nbytes) into ``out``: from a mapping of the page
        cache, a piece at a time, or with ``preadv`` where the file cannot be mapped."""
        view = memoryview(out).cast("B")
        flat = np.frombuffer(view, dtype=np.uint8)
        done = 0
        while done < len(view):
            take = min(len(view) - done, self._MAP_PIECE_BYTES)
            mapped = self._map(offset + done, take)
            if mapped is not None:
                np.copyto(flat[done : done + take], mapped)
                done += take
                continue
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                self._truncated(offset, offset + len(view))
            done += n

    def _map(self, offset: int, nbytes: int) -> np.ndarray | None:
        """Bytes [offset, offset + nbytes) mapped from the page cache, unmapped when the array
        is dropped; None for small reads and where mapping is refused (some network and FUSE
        file systems).

        Private and writable only so that torch accepts the array without a warning: nothing
        writes to it, and a write would touch a private copy, never the file.
        """
        if nbytes < self._MAP_MIN_BYTES or self._unmappable:
            return None
        if offset + nbytes > self.size:
            self._truncated(offset, offset + nbytes)
        # Whole 2 MiB-aligned spans of the file, so the kernel can map the page cache's large
        # folios a huge page at a time: touching a 2 MiB read took about a quarter less time
        # than through a mapping cut at its own bytes (measured). Up to 2 MiB more is mapped
        # at either end; only the bytes asked for are handed out.
        base = offset - offset % self._MAP_ALIGN
        end = min(self.size, -(-(offset + nbytes) // self._MAP_ALIGN) * self._MAP_ALIGN)
        try:
            memory = mmap.mmap(
                self.fd,
                end - base,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=base,
            )
        except (OSError, ValueError):
            self._unmappable = True
            return None
        return np.frombuffer(memory, dtype=np.uint8)[offset - base : offset - base + nbytes]

    def _truncated(self, lo: int, hi: int) -> None:
        try:
            now = os.fstat(self.fd).st_size  # it may have shrunk since it was opened
        except OSError:
            now = self.size
        since = f" (it was {self.size} bytes when opened)" if now != self.size else ""
        raise CheckpointFormatError(
            f"{self.name}: truncated: needed bytes [{lo}, {hi}) but the file ends at {now}{since}"
        )

    def read_into(self, offset: int, out: np.ndarray) -> None:
        if self.digests is None:
            self._pread(offset, out)
            return
        if not out.flags.c_contiguous:
            staged = np.empty(out.nbytes, dtype=np.uint8)
            self.read_into(offset, staged)
            out[...] = staged.view(out.dtype).reshape(out.shape)
            return
        self._checked(offset, out.reshape(-1).view(np.uint8), copy=True)

    def mapped(self, offset: int, nbytes: int) -> np.ndarray | None:
        """Bytes [offset, offset + nbytes) as an array over the page cache, with no copy
        (checked like ``read_into`` when the file has digests); None for small reads and where
        the file cannot be mapped. The mapping lives as long as the array, so keep ``nbytes``
        to a buffer's size: its pages count as resident while it lives."""
        view = self._map(offset, nbytes)
        if view is not None and self.digests is not None:
            self._checked(offset, view, copy=False)
        return view

    def _checked(self, offset: int, flat: np.ndarray, copy: bool) -> None:
        """Hash bytes [offset, offset + flat.nbytes) chunk by chunk, reading them into
        ``flat`` first with ``copy`` (else ``flat`` already holds them)."""
        if offset < self.data_start:
            raise CheckpointFormatError(
                f"{self.name}: bytes [{offset}, {offset + flat.nbytes}) start before the "
                f"checksummed data section at {self.data_start}"
            )
        if self._pieces is not None:
            self._checked_pieces(offset, flat, copy)
            return
        pos, end = offset, offset + flat.nbytes
        while pos < end:
            if pos >= self.size:
                self._truncated(offset, end)
            index, lo, hi = self._chunk_at(pos)
            if index is None:  # between spans: no digest covers these bytes
                take = min(end, hi) - pos
                if copy:
                    self._pread(pos, flat[pos - offset : pos - offset + take])
                pos += take
                continue
            if index != self._chunk or pos < self._hashed_to:
                self.finish()
                self._begin(index, lo, hi)
            self._hash_through(pos)
            take = min(end, self._hi) - pos
            piece = flat[pos - offset : pos - offset + take]
            if copy:
                self._pread(pos, piece)
            self._hasher.update(memoryview(piece))
            self._hashed_to = pos = pos + take
            if pos == self._hi:
                self._check()

    def _checked_pieces(self, offset: int, flat: np.ndarray, copy: bool) -> None:
        """``_checked`` for CRC-32 spans, in any order: each span's share of the bytes is
        hashed as one piece of it."""
        pos, end = offset, offset + flat.nbytes
        while pos < end:
            if pos >= self.size:
                self._truncated(offset, end)
            index, lo, hi = self._chunk_at(pos)
            take = min(end, hi) - pos
            piece = flat[pos - offset : pos - offset + take]
            if copy:
                self._pread(pos, piece)
            if index is not None:
                self._add_piece(index, lo, hi, pos, pos + take, crc32(memoryview(piece)))
            pos += take

    def _add_piece(self, index: int, lo: int, hi: int, a: int, b: int, crc: int) -> None:
        """Record that bytes [a, b) of span ``index`` ([lo, hi)) hash to ``crc``; join it to
        its neighbours and check the span once they cover it."""
        pieces = self._pieces.setdefault(index, [])
        at = bisect.bisect_left(pieces, [a])
        if (at > 0 and pieces[at - 1][1] > a) or (at < len(pieces) and pieces[at][0] < b):
            self._finish_span(index)  # these bytes were hashed already: check, then anew
            pieces = self._pieces.setdefault(index, [])
            at = 0
        if at < len(pieces) and pieces[at][0] == b:  # join the piece that follows
            nxt = pieces.pop(at)
            crc, b = crc32_combine(crc, nxt[2], nxt[1] - nxt[0]), nxt[1]
        if at > 0 and pieces[at - 1][1] == a:  # and the one before
            prev = pieces[at - 1]
            prev[1], prev[2] = b, crc32_combine(prev[2], crc, b - a)
        else:
            pieces.insert(at, [a, b, crc])
        if len(pieces) == 1 and pieces[0][0] == lo and pieces[0][1] == hi:
            del self._pieces[index]
            self.chunks_read += 1
            if index >= len(self.digests) or f"{pieces[0][2]:08x}" != self.digests[index]:
                raise ChecksumMismatchError(
                    f"{self.name}: checksum mismatch in bytes [{lo}, {hi}){self.describe(lo, hi)}"
                )

    def _finish_span(self, index: int) -> None:
        """Read and hash the bytes of open span ``index`` no read has covered, and check it."""
        lo, hi = self._chunk_bounds(index)
        gaps, cursor = [], lo
        for a, b, _ in self._pieces.get(index, ()):
            if a > cursor:
                gaps.append((cursor, a))
            cursor = b
        if cursor < hi:
            gaps.append((cursor, hi))
        if not gaps:  # covered pieces close their span as they join: nothing left open
            self._pieces.pop(index, None)
            return
        scratch = np.empty(min(max(b - a for a, b in gaps), self._SKIP_BYTES), dtype=np.uint8)
        for a, b in gaps:
            while a < b:
                if a >= self.size:
                    self._truncated(a, b)
                piece = scratch[: min(b - a, scratch.nbytes)]
                self._pread(a, piece)
                self._add_piece(index, lo, hi, a, a + piece.nbytes, crc32(memoryview(piece)))
                a += piece.nbytes

    def finish(self) -> None:
        """Read the rest of the chunk in progress and check it (every byte handed out from it
        is then verified). Raises ``ChecksumMismatchError`` naming the file and bytes."""
        if self._chunk is not None:
            self._hash_through(self._hi)
            self._check()
        while self._pieces:
            self._finish_span(min(self._pieces))

    def check_all(self) -> None:
        """Read and check every chunk (every span) of the file, front to back, through a small
        scratch buffer. Raises ``ChecksumMismatchError`` at the first damaged one."""
        self.finish()
        for index in range(len(self.digests or ())):
            self._begin(index, *self._chunk_bounds(index))
            self.finish()

    def _chunk_bounds(self, index: int) -> tuple[int, int]:
        """First byte and end of chunk (or span) ``index``."""
        if self.spans is not None:
            return self.spans[index]
        lo = self.data_start + index * self.chunk_bytes
        return lo, min(lo + self.chunk_bytes, self.size)

    def _chunk_at(self, pos: int) -> tuple[int | None, int, int]:
        """(index, first byte, end) of the chunk holding ``pos``; outside every span, (None,
        pos, where the next span starts)."""
        if self.spans is None:
            index = (pos - self.data_start) // self.chunk_bytes
            return index, *self._chunk_bounds(index)
        index = bisect.bisect_right(self._span_starts, pos) - 1
        if index >= 0 and pos < self.spans[index][1]:
            return index, *self.spans[index]
        following = self._span_starts[index + 1] if index + 1 < len(self.spans) else self.size
        return None, pos, max(following, pos + 1)

    def _begin(self, index: int, lo: int, hi: int) -> None:
        self._chunk = index
        self._lo = self._hashed_to = lo
        self._hi = hi
        self._hasher.reset()

    def _hash_through(self, pos: int) -> None:
        """Read and hash the chunk's bytes up to ``pos`` that no caller asked for."""
        if pos <= self._hashed_to:
            return
        scratch = np.empty(min(pos - self._hashed_to, self._SKIP_BYTES), dtype=np.uint8)
        while self._hashed_to < pos:
            piece = scratch[: min(pos - self._hashed_to, scratch.nbytes)]
            self._pread(self._hashed_to, piece)
            self._hasher.update(memoryview(piece))
            self._hashed_to += piece.nbytes

    def _check(self) -> None:
        index, lo, hi = self._chunk, self._lo, self._hi
        self._chunk = None
        self.chunks_read += 1
        if index >= len(self.digests) or self._hasher.hexdigest() != self.digests[index]:
            raise ChecksumMismatchError(
                f"{self.name}: checksum mismatch in bytes [{lo}, {hi}){self.describe(lo, hi)}"
            )

    def prefetch(self, offset: int, nbytes: int) -> None:
        """Start reading the range into the page cache (``POSIX_FADV_WILLNEED``), so the disk
        works while the caller converts what it already has. A hint: failures are ignored.

        A range already in the page cache is left alone: the advice would only walk its pages
        (about 0.02 s of CPU per GB on a warm cache, measured; see _cached)."""
        if nbytes > 0 and hasattr(os, "posix_fadvise") and not self._cached(offset, nbytes):
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_WILLNEED)

    _PROBE_STEP = 1 << 20  # _cached reads one byte per MiB

    def _cached(self, offset: int, nbytes: int) -> bool:
        """Whether bytes [offset, offset + nbytes) look page-cached: a non-blocking one-byte
        read (``RWF_NOWAIT``, which fails rather than wait for the disk) at every MiB and at
        the last byte succeeds. A probe costs ~1 us; any miss, or no ``RWF_NOWAIT``, says no."""
        flag = getattr(os, "RWF_NOWAIT", 0)
        end = min(offset + nbytes, self.size)
        if not flag or self._no_probe or end <= offset:
            return False
        probe = self._probe
        try:
            for pos in (*range(offset, end, self._PROBE_STEP), end - 1):
                if os.preadv(self.fd, [probe], pos, flag) != 1:
                    return False
        except BlockingIOError:  # EAGAIN: not in the page cache
            return False
        except OSError:  # the file system has no non-blocking reads: always advise
            self._no_probe = True
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)


class OpenEndpoints:
    """Endpoints opened on first use, then verified and closed together.

    Every user calls ``finish()`` before it commits or returns what it read (checked files
    verify the rest of their chunk in progress), and ``close()`` in a ``finally``.
    """

    def __init__(self, opener: Callable[[str], Endpoint] = FileEndpoint):
        self.opener = opener
        self.opened: dict[str, Endpoint] = {}

    def __call__(self, location: str) -> Endpoint:
        endpoint = self.opened.get(location)
        if endpoint is None:
            endpoint = self.opened[location] = self.opener(location)
        return endpoint

    def finish(self) -> None:
        for endpoint in list(self.opened.values()):
            endpoint.finish()

    def close(self) -> None:
        for endpoint in self.opened.values():
            endpoint.close()
        self.opened.clear()


def refuse_lazy_view(name: str, tensor: torch.Tensor) -> None:
    """A lazily conjugated or negated tensor's storage holds other values than the tensor
    (``torch._neg_view``, ``.conj()`` of a complex one): its bytes can be neither saved nor
    restored into as they are."""
    if tensor.is_conj() or tensor.is_neg():
        kind = "conjugated" if tensor.is_conj() else "negated"
        raise UsageError(
            f"tensor {name!r} is a lazily {kind} view: its storage does not hold its values. "
            "Make it a resolved tensor first (param.data = param.data.resolve_conj()"
            ".resolve_neg())"
        )


class TensorEndpoint(Endpoint):
    """The storage of a live tensor (CPU, or any device through host copies)."""

    def __init__(self, name: str, tensor: torch.Tensor, transfer: HostTransfer | None = None):
        self.name = name
        refuse_lazy_view(name, tensor)
        storage = tensor.untyped_storage()
        self.device = tensor.device
        self.bytes = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        if transfer is None and self.device.type != "cpu":
            transfer = default_transfer()
        self.transfer = transfer

    def snapshot(self, into: torch.Tensor | None = None) -> TensorEndpoint:
        """A private host copy of the whole storage, at the same offsets (async staging):
        in ``into`` (host bytes, at least ``nbytes``) when given, else in new memory."""
        copy = TensorEndpoint.__new__(TensorEndpoint)
        copy.name, copy.device, copy.transfer = self.name, torch.device("cpu"), None
        if into is None:
            pinned = self.device.type == "cuda"
            into = torch.empty(self.bytes.numel(), dtype=torch.uint8, pin_memory=pinned)
        copy.bytes = into[: self.bytes.numel()]
        copy.bytes.copy_(self.bytes)
        return copy

    @property
    def nbytes(self) -> int:
        return self.bytes.numel()

    def host_view(self, offset: int, nbytes: int) -> np.ndarray | None:
        """Bytes [offset, offset + nbytes) as a writable array, when the tensor is in host memory
        (reads land in it, writes and conversions read from it, with no copy); None otherwise."""
        if self.device.type != "cpu" or self.transfer is not None:
            return None
        return self.bytes.numpy()[offset : offset + nbytes]

    def read_into(self, offset: int, out: np.ndarray) -> None:
        src = self.bytes[offset : offset + out.nbytes]
        if self.transfer is not None:
            self.transfer.copy_to_host(src, out)
        elif self.device.type == "cpu":
            out[...] = src.numpy()
        else:
            torch.from_numpy(out).copy_(src)

    def write_rows(self, offset: int, step: int, rows: np.ndarray) -> None:
        count, width = rows.shape
        if count == 0 or width == 0:
            return
        if self.device.type == "cpu":
            flat = self.bytes.numpy()
            target = np.lib.stride_tricks.as_strided(
                flat[offset:], shape=(count, width), strides=(step, 1)
            )
            target[...] = rows
        else:
            target = torch.as_strided(self.bytes, (count, width), (step, 1), offset)
            target.copy_(torch.from_numpy(rows))


def live_block(location: str, tensor: torch.Tensor, start: tuple[int, ...] | None = None) -> Block:
    """The block of a live tensor inside its own storage (``TensorEndpoint`` bytes), strides
    and storage offset kept, so views are read where they lie; ``start`` places it in a larger
    global tensor (the origin by default)."""
    return Block(
        location,
        tensor.storage_offset() * tensor.element_size(),
        code_of(tensor.dtype),
        (0,) * tensor.dim() if start is None else tuple(start),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )

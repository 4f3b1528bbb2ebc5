"""Sink: safetensors files filled by the executor, with chunk checksums in the header."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..engine.checksum import DIGEST_WIDTH, digest
from ..engine.copy import Streamer, stream_file, write_all
from ..engine.dtypes import itemsize
from ..engine.plan import CopyRun, GlobalTensor, dense_block, plan_copy
from ..errors import CheckpointFormatError, out_of_space
from ..units import DEFAULT_CHUNK_BYTES
from .safetensors import (
    FILES_KEY,
    MAX_HEADER_BYTES,
    TensorEntry,
    checksum_metadata,
    encode_header,
    layout_entries,
)


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """A tensor to write: its output name and dtype, and the source that holds its values."""

    name: str
    dtype: str
    source: GlobalTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * itemsize(self.dtype)


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size: int
    data_start: int
    chunk_bytes: int
    chunks: tuple[str, ...]
    header_digest: str


def plan_file_runs(
    path: str, tensors: Sequence[OutputTensor], entries: Sequence[TensorEntry] | None = None
) -> list[CopyRun]:
    """The copy runs (data-relative offsets) for one output file; ``entries``: its
    ``layout_entries``, when already made."""
    if entries is None:
        entries = layout_entries([(t.name, t.dtype, t.shape) for t in tensors])
    runs: list[CopyRun] = []
    for tensor, entry in zip(tensors, entries):
        dst = dense_block(path, entry.begin, tensor.dtype, tensor.shape)
        for block in tensor.source.blocks:
            runs.extend(plan_copy(tensor.name, tensor.shape, block, dst))
    return runs


@dataclass
class FileJob:
    """One output file's plan: its layout, placeholder header and copy runs."""

    path: str
    entries: list[TensorEntry]
    metadata: dict[str, str]
    header_bytes: int
    data_size: int
    runs: list[CopyRun] | None  # None: planned when the file is filled (``copy_runs``)
    bounds: list[tuple[int, int, int, str]]
    chunk_bytes: int
    align: int = 8
    tensors: Sequence[OutputTensor] = ()
    placeholder: bytes = b""  # header(None), once made
    # Bytes kept in the header for a metadata value only known at the end (``FILES_KEY``)
    reserved: int = 0

    @property
    def chunk_count(self) -> int:
        return -(-self.data_size // self.chunk_bytes)

    def copy_runs(self) -> list[CopyRun]:
        """The file's copy runs: kept ones, or planned now (``plan_file(plan_runs=False)``)."""
        if self.runs is not None:
            return self.runs
        return plan_file_runs(self.path, self.tensors, self.entries)

    def header(self, chunks: list[str] | None, files: str = "") -> bytes:
        """The header with ``chunks``' digests, and with ``files`` (``FILES_KEY``'s value,
        at most ``reserved`` characters) where space was kept for it; None: the placeholder
        of the same size, which keeps that space."""
        if chunks is None and self.placeholder:
            return self.placeholder
        meta = {
            **self.metadata,
            **checksum_metadata(self.entries, self.chunk_bytes, chunks, self.data_size),
        }
        if not self.reserved:
            return encode_header(self.entries, meta, self.align)
        if chunks is None:  # the placeholder: the space kept, as a value of that length
            return encode_header(self.entries, {**meta, FILES_KEY: "0" * self.reserved}, self.align)
        length = len(self.placeholder)
        return encode_header(self.entries, {**meta, FILES_KEY: files}, self.align, length)


def plan_file(
    path: str,
    tensors: Sequence[OutputTensor],
    metadata: Mapping[str, str] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    align: int = 8,
    plan_runs: bool = True,
    reserved: int = 0,
) -> FileJob:
    """Plan one output file; ``align`` pads its header so the data starts at that multiple
    (``DIRECT_ALIGN`` for files that ``fill_range(direct=True)`` will fill); ``reserved``
    keeps that many characters of the header for ``FILES_KEY``, written when it is sealed.

    ``plan_runs=False`` leaves the copy runs to be planned when the file is filled, so that
    a caller planning many files holds one file's runs at a time, not all of them.
    """
    entries = layout_entries([(t.name, t.dtype, t.shape) for t in tensors])
    data_size = entries[-1].end if entries else 0
    if -(-data_size // chunk_bytes) * DIGEST_WIDTH > MAX_HEADER_BYTES:
        largest = max(tensors, key=lambda t: t.nbytes)
        raise CheckpointFormatError(
            f"tensor {largest.name!r} of shape {list(largest.shape)} ({largest.nbytes} bytes): "
            f"{os.path.basename(path)} would hold {data_size} bytes, more than the checksums of "
            f"one safetensors file can cover (its header is limited to {MAX_HEADER_BYTES} bytes)"
        )
    meta = {"format": "pt", **(metadata or {})}
    runs = plan_file_runs(path, tensors, entries) if plan_runs else None
    bounds = [(e.begin, e.end, itemsize(e.dtype), e.name) for e in entries]
    job = FileJob(
        path, entries, meta, 0, data_size, runs, bounds, chunk_bytes, align, tensors, b"", reserved
    )
    job.placeholder = job.header(None)
    job.header_bytes = len(job.placeholder)
    return job


def create_file(job: FileJob) -> None:
    """Create the file at full size (a full disk fails here) with the placeholder header."""
    fd = os.open(job.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        reserve_space(fd, job.path, job.header_bytes + job.data_size)
        write_all(fd, job.path, job.header(None), 0)
    finally:
        os.close(fd)


def fill_range(
    job: FileJob,
    streamer: Streamer,
    start: int = 0,
    end: int | None = None,
    progress: Callable[[int], None] | None = None,
    window_hook: Callable[[int, int], None] | None = None,
    writeback: bool = False,
    borrow: bool = False,
    direct: bool = False,
) -> list[str]:
    """Stream data bytes [start, end) (chunk-aligned) into the file; return their digests.

    With ``direct``, aligned windows bypass the page cache (``O_DIRECT``, where the file
    system allows it): the data goes to the disk as it streams and evicts nothing. Else, with
    ``writeback``, data already written is handed to the disk while the rest streams (see
    ``_writeback_behind``). Either way the closing fsync has little left to wait for.
    """
    fd = os.open(job.path, os.O_WRONLY)
    direct_fd = open_direct(job.path) if direct else None
    if writeback and direct_fd is None:
        window_hook = _writeback_behind(fd, job.header_bytes, start, window_hook)
    try:
        chunks = stream_file(
            fd,
            job.path,
            job.header_bytes,
            job.data_size,
            job.copy_runs(),
            job.bounds,
            streamer,
            job.chunk_bytes,
            progress,
            window_hook,
            start,
            job.data_size if end is None else end,
            borrow,
            direct_fd,
        )
        os.fsync(fd)
    finally:
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)
    return chunks


def open_direct(path: str) -> int | None:
    """A second descriptor of ``path`` for direct writes, or None where the platform or the
    file system has no ``O_DIRECT`` (the writes then go through the page cache)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Hand a written range to the disk now (``POSIX_FADV_DONTNEED`` starts its writeback
    without waiting), so a closing fsync has little left to wait for. Only a hint."""
    if length > 0 and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _writeback_behind(
    fd: int, data_start: int, start: int, then: Callable[[int, int], None] | None
) -> Callable[[int, int], None]:
    """A window hook that starts writeback of the windows the write thread has finished.

    ``stream_file`` waits for the write of window k-2 before it fills window k, so when window
    k begins, every byte before window k-1's start is written; those get
    ``POSIX_FADV_DONTNEED``, which on Linux starts their writeback without waiting for it (and
    drops them from the cache once clean). Only a hint: if that order ever changed, a range
    written later is simply dirty again and the closing fsync still covers it.
    """
    state = {"handed": start, "previous": start}

    def hook(lo: int, hi: int) -> None:
        if lo < hi:  # a window begins (an empty range only reports that one was filled)
            done = state["previous"]
            if done > state["handed"]:
                start_writeback(fd, data_start + state["handed"], done - state["handed"])
                state["handed"] = done
            state["previous"] = lo
        if then is not None:
            then(lo, hi)

    return hook


def seal_file(job: FileJob, chunks: list[str], files: str = "") -> WrittenFile:
    """Write the final header with every chunk digest (and ``files``, see ``header``); fsync."""
    final = job.header(chunks, files)
    if len(final) != job.header_bytes:
        raise AssertionError("checksum metadata changed the header length")
    fd = os.open(job.path, os.O_WRONLY)
    try:
        write_all(fd, job.path, final, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return WrittenFile(
        job.path,
        job.header_bytes + job.data_size,
        job.header_bytes,
        job.chunk_bytes,
        tuple(chunks),
        digest(final),
    )


def read_chunk_digest(job: FileJob, index: int) -> str:
    """The digest of the file's data chunk ``index``, read back from the file: for a chunk
    that no one writer wrote whole."""
    begin = index * job.chunk_bytes
    fd = os.open(job.path, os.O_RDONLY)
    try:  # a chunk is a few MiB: one read
        return digest(
            os.pread(fd, min(job.chunk_bytes, job.data_size - begin), job.header_bytes + begin)
        )
    finally:
        os.close(fd)


def write_safetensors(
    path: str,
    tensors: Sequence[OutputTensor],
    streamer: Streamer,
    metadata: Mapping[str, str] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
    window_hook: Callable[[int, int], None] | None = None,
    borrow: bool = False,
    writeback: bool = False,
) -> WrittenFile:
    """Write one safetensors file: header first (placeholder checksums), data, final header.

    ``borrow``: write unconverted bytes straight from live host tensors (see ``stream_file``);
    ``writeback``: hand written data to the disk while the rest streams (see ``fill_range``).
    """
    job = plan_file(path, tensors, metadata, chunk_bytes)
    create_file(job)
    chunks = fill_range(
        job, streamer, progress=progress, window_hook=window_hook, borrow=borrow,
        writeback=writeback,
    )  # fmt: skip
    return seal_file(job, chunks)


def reserve_space(fd: int, path: str, size: int) -> None:
    """Claim the file's blocks up front so a full disk fails before any data is streamed."""
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        full = out_of_space(exc, path, f"{{path}}: no space left on device for {size} bytes")
        if full is not None:
            raise full from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)

"""Sink: safetensors files filled by the executor, with chunk checksums in the header."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..checksum import digest
from ..copy import DEFAULT_CHUNK_BYTES, Streamer, stream_file, write_all
from ..dtypes import itemsize
from ..errors import OutOfSpaceError
from ..plan import CopyRun, GlobalTensor, dense_block, plan_copy
from .safetensors import build_header, checksum_metadata


@dataclass(frozen=True)
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


def plan_file_runs(path: str, tensors: Sequence[OutputTensor]) -> tuple[bytes, list[CopyRun]]:
    """The placeholder header and the copy runs (data-relative offsets) for one output file."""
    header, entries = build_header([(t.name, t.dtype, t.shape) for t in tensors])
    runs: list[CopyRun] = []
    for tensor, entry in zip(tensors, entries):
        dst = dense_block(path, entry.begin, tensor.dtype, tensor.shape)
        for block in tensor.source.blocks:
            runs.extend(plan_copy(tensor.name, tensor.shape, block, dst))
    return header, runs


def write_safetensors(
    path: str,
    tensors: Sequence[OutputTensor],
    streamer: Streamer,
    metadata: Mapping[str, str] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
    window_hook: Callable[[int, int], None] | None = None,
) -> WrittenFile:
    """Write one safetensors file: header first (placeholder checksums), data, final header."""
    layout = [(t.name, t.dtype, t.shape) for t in tensors]
    _, entries = build_header(layout)
    data_size = entries[-1].end if entries else 0
    meta = {"format": "pt", **(metadata or {})}
    header, _ = build_header(
        layout, {**meta, **checksum_metadata(entries, chunk_bytes, None, data_size)}
    )
    _, runs = plan_file_runs(path, tensors)
    bounds = [(e.begin, e.end, itemsize(e.dtype), e.name) for e in entries]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _reserve(fd, path, len(header) + data_size)
        write_all(fd, path, header, 0)
        chunks = stream_file(
            fd,
            path,
            len(header),
            data_size,
            runs,
            bounds,
            streamer,
            chunk_bytes,
            progress,
            window_hook,
        )
        final, _ = build_header(
            layout, {**meta, **checksum_metadata(entries, chunk_bytes, chunks, data_size)}
        )
        if len(final) != len(header):
            raise AssertionError("checksum metadata changed the header length")
        write_all(fd, path, final, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return WrittenFile(
        path, len(header) + data_size, len(header), chunk_bytes, tuple(chunks), digest(final)
    )


def _reserve(fd: int, path: str, size: int) -> None:
    """Claim the file's blocks up front so a full disk fails before any data is streamed."""
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OutOfSpaceError(f"{path}: no space left on device for {size} bytes") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)

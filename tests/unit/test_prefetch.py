"""stream_file asks its sources to prefetch each window's bytes before it reads them."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from shardstream.engine.copy import Buffers, Streamer, stream_file
from shardstream.engine.dtypes import CODE_BY_TORCH, itemsize
from shardstream.engine.endpoints import FileEndpoint, OpenEndpoints
from shardstream.engine.plan import Block, chunk_extent, dense_block, plan_copy


class Recording(FileEndpoint):
    """A FileEndpoint that logs its reads and prefetch hints, in order."""

    def __init__(self, path: str, log: list):
        super().__init__(path)
        self.log = log

    def read_into(self, offset: int, out: np.ndarray) -> None:
        self.log.append(("read", self.name, offset, offset + out.nbytes))
        super().read_into(offset, out)

    def prefetch(self, offset: int, nbytes: int) -> None:
        self.log.append(("prefetch", self.name, offset, offset + nbytes))
        super().prefetch(offset, nbytes)


def saved_shards(tmp_path, full: torch.Tensor, dim: int, parts: int, layout=None) -> list[Block]:
    """FSDP-style chunks of ``full`` along ``dim``, each stored after 16 junk bytes."""
    blocks = []
    for r in range(parts):
        s, n = chunk_extent(full.shape[dim], parts, r)
        piece = full.narrow(dim, s, n)
        stored = layout(piece) if layout else piece.clone()
        path = tmp_path / f"rank{r}.bin"
        path.write_bytes(b"\xab" * 16 + bytes(stored.untyped_storage()))
        isz = stored.element_size()
        start = [0] * full.dim()
        start[dim] = s
        blocks.append(
            Block(
                str(path),
                16 + stored.storage_offset() * isz,
                CODE_BY_TORCH[stored.dtype],
                tuple(start),
                tuple(stored.shape),
                tuple(stored.stride()),
            )
        )
    return blocks


def transposed(piece: torch.Tensor) -> torch.Tensor:
    return piece.t().contiguous().t()


def padded(piece: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros((piece.shape[0], piece.shape[1] + 3), dtype=piece.dtype)
    wide[:, 1 : 1 + piece.shape[1]] = piece
    return wide[:, 1 : 1 + piece.shape[1]]


def stream_logged(tmp_path, full, blocks, out_dtype, buffers):
    log: list = []
    opened: dict[str, Recording] = {}

    def endpoint(location: str) -> Recording:
        if location not in opened:
            opened[location] = Recording(location, log)
        return opened[location]

    shape = tuple(full.shape)
    path = str(tmp_path / "out.bin")
    dst = dense_block(path, 0, out_dtype, shape)
    runs = [r for b in blocks for r in plan_copy("t", shape, b, dst)]
    size = math.prod(shape) * itemsize(out_dtype)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        stream_file(
            fd,
            path,
            0,
            size,
            runs,
            [(0, size, itemsize(out_dtype), "t")],
            Streamer(endpoint, buffers),
        )
    finally:
        os.close(fd)
        for ep in opened.values():
            ep.close()
    data = bytearray(open(path, "rb").read())
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[out_dtype]
    return torch.frombuffer(data, dtype=torch_dtype).reshape(shape), log


def tiny(window: int, src: int) -> Buffers:
    return Buffers(
        np.empty(window, dtype=np.uint8),
        np.empty(src, dtype=np.uint8),
        torch.empty(window, dtype=torch.uint8),
    )


@pytest.mark.parametrize("buffers", [Buffers.sized(1 << 16, 2.0), tiny(24, 48), tiny(100, 40)])
@pytest.mark.parametrize("out_dtype", ["F32", "BF16"])
@pytest.mark.parametrize(
    "dim, layout", [(0, None), (1, None), (0, transposed), (1, transposed), (1, padded)]
)
def test_every_read_was_prefetched_first(tmp_path, buffers, out_dtype, dim, layout):
    torch.manual_seed(0)
    full = torch.randn(37, 29)
    blocks = saved_shards(tmp_path, full, dim, 3, layout)
    result, log = stream_logged(tmp_path, full, blocks, out_dtype, buffers)
    assert torch.equal(result, full.to(result.dtype))
    hinted: dict[str, list[tuple[int, int]]] = {}
    for kind, name, lo, hi in log:
        if kind == "prefetch":
            assert hi > lo
            hinted.setdefault(name, []).append((lo, hi))
            continue
        for b in range(lo, hi):  # each byte read lies in a range hinted earlier
            assert any(a <= b < z for a, z in hinted.get(name, ())), (name, b)
    # Hints follow the windows: the whole file is hinted at most about twice, not per window.
    for name, ranges in hinted.items():
        hinted_bytes = sum(z - a for a, z in ranges)
        assert hinted_bytes <= 2 * os.path.getsize(name) + (1 << 20) * len(ranges)


def test_prefetch_runs_one_window_ahead(tmp_path):
    """Before window k is read, window k+1's sources have been hinted (the disk runs ahead)."""
    full = torch.randn(64, 256)  # 64 KiB of fp32 per rank pair
    blocks = saved_shards(tmp_path, full, 0, 2)
    _, log = stream_logged(tmp_path, full, blocks, "BF16", tiny(4096, 8192))
    hinted_to = 0
    read_to = 0
    for kind, name, _lo, hi in log:
        if name != blocks[0].location:
            continue
        if kind == "prefetch":
            hinted_to = max(hinted_to, hi)
        else:
            read_to = max(read_to, hi)
            if read_to < os.path.getsize(name) - 8192:
                assert hinted_to >= read_to + 4096, (read_to, hinted_to)


def test_prefetch_is_a_hint(tmp_path, monkeypatch):
    """A failing fadvise (unsupported filesystem) changes nothing."""

    def refuse(*args):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    full = torch.randn(9, 7)
    blocks = saved_shards(tmp_path, full, 1, 2)
    result, _ = stream_logged(tmp_path, full, blocks, "F32", tiny(16, 16))
    assert torch.equal(result, full)


def test_writeback_hints_cover_written_windows_in_order(tmp_path, monkeypatch):
    """fill_range(writeback=True) hands finished windows to the disk in order, never past what
    was written, and the file is the same as without the hints."""
    from shardstream.engine.plan import GlobalTensor
    from shardstream.formats.writer import OutputTensor, create_file, fill_range, plan_file

    full = torch.randn(64, 48)
    blocks = saved_shards(tmp_path, full, 0, 2)
    tensor = GlobalTensor("w", "F32", tuple(full.shape), tuple(blocks))
    outputs = [OutputTensor("w", "BF16", tensor)]
    real = os.posix_fadvise
    hints = []

    def record(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            hints.append((offset, offset + length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    files = []
    for writeback in (False, True):
        job = plan_file(str(tmp_path / f"out-{writeback}.safetensors"), outputs, chunk_bytes=256)
        create_file(job)
        opened: dict[str, FileEndpoint] = {}

        def endpoint(location: str, opened=opened) -> FileEndpoint:
            if location not in opened:
                opened[location] = FileEndpoint(location)
            return opened[location]

        fill_range(job, Streamer(endpoint, tiny(512, 1024)), writeback=writeback)
        for ep in opened.values():
            ep.close()
        files.append(open(job.path, "rb").read())
        if not writeback:
            assert hints == []
    assert files[0] == files[1]
    assert len(hints) >= 4
    data_start = job.header_bytes
    assert hints[0][0] == data_start
    assert all(a[1] == b[0] for a, b in zip(hints, hints[1:]))  # contiguous, in order
    assert hints[-1][1] <= data_start + job.data_size - 512  # the last windows: fsync's job


def test_window_hook_hears_of_each_window_when_filled_before_it_is_written(tmp_path):
    """Without borrowing, each window is announced (lo, hi) before its sources are read and
    (hi, hi) once it holds its bytes, before they reach the file: an async save's step then
    waits for no write. The windows tile the data in order."""
    from shardstream.engine.plan import GlobalTensor
    from shardstream.formats.writer import OutputTensor, create_file, fill_range, plan_file

    full = torch.randn(64, 48)
    blocks = saved_shards(tmp_path, full, 0, 2)
    tensor = GlobalTensor("w", "F32", tuple(full.shape), tuple(blocks))
    job = plan_file(
        str(tmp_path / "out.safetensors"), [OutputTensor("w", "F32", tensor)], None, 256
    )
    create_file(job)
    calls, unwritten = [], []

    def hook(lo: int, hi: int) -> None:
        calls.append((lo, hi))
        if lo == hi and calls[-2][1] == hi:
            with open(job.path, "rb") as f:
                f.seek(job.header_bytes + calls[-2][0])
                unwritten.append(not any(f.read(hi - calls[-2][0])))

    endpoints = OpenEndpoints()
    try:
        fill_range(job, Streamer(endpoints, tiny(512, 1024)), window_hook=hook)
    finally:
        endpoints.close()
    starts, ends = calls[0::2], calls[1::2]
    assert len(calls) >= 4 and len(starts) == len(ends)
    assert [lo for lo, _ in starts] == [0] + [hi for _, hi in starts[:-1]]
    assert starts[-1][1] == job.data_size
    assert ends == [(hi, hi) for _, hi in starts]
    assert unwritten == [True] * len(ends)

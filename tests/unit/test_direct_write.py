"""Direct (O_DIRECT) writes of output files: same bytes and digests as the page-cache path,
aligned windows, and headers padded so the data starts on a direct-I/O boundary."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from shardstream.commands.verify import verify
from shardstream.engine.copy import Buffers, Streamer
from shardstream.engine.dtypes import CODE_BY_TORCH, itemsize
from shardstream.engine.endpoints import FileEndpoint
from shardstream.engine.plan import Block, GlobalTensor
from shardstream.formats.safetensors import build_header, read_header
from shardstream.formats.writer import (
    OutputTensor,
    create_file,
    fill_range,
    open_direct,
    plan_file,
    seal_file,
)
from shardstream.units import DIRECT_ALIGN

O_DIRECT = getattr(os, "O_DIRECT", 0)


def _sharded(tmp_path, name: str, full: torch.Tensor, parts: int) -> GlobalTensor:
    """``full`` split by rows over ``parts`` files, each stored after 16 junk bytes."""
    blocks, row = [], 0
    for r, piece in enumerate(torch.tensor_split(full, parts)):
        piece = piece.clone()
        path = tmp_path / f"{name}.rank{r}.bin"
        path.write_bytes(b"\xab" * 16 + bytes(piece.untyped_storage()))
        start = (row,) + (0,) * (full.dim() - 1)
        dtype = CODE_BY_TORCH[piece.dtype]
        blocks.append(Block(str(path), 16, dtype, start, tuple(piece.shape), piece.stride()))
        row += len(piece)
    return GlobalTensor(name, blocks[0].dtype, tuple(full.shape), tuple(blocks))


def _outputs(tmp_path) -> list[OutputTensor]:
    """fp32 sources cast to bf16 and kept in fp32, then an I64 after an odd number of BF16
    elements: it starts off its element size, so the last windows cannot be aligned."""
    torch.manual_seed(0)
    return [
        OutputTensor("a", "BF16", _sharded(tmp_path, "a", torch.randn(300, 37), 3)),
        OutputTensor("b", "F32", _sharded(tmp_path, "b", torch.randn(250, 41), 4)),
        OutputTensor("odd", "BF16", _sharded(tmp_path, "odd", torch.randn(5, 3), 1)),
        OutputTensor("steps", "I64", _sharded(tmp_path, "steps", torch.arange(700), 2)),
    ]


def _write(path, outputs, direct: bool, ranges=None, align: int = DIRECT_ALIGN):
    """Plan, create, fill (whole, or by data ``ranges``) and seal one safetensors file."""
    job = plan_file(str(path), outputs, chunk_bytes=8192, align=align)
    create_file(job)
    opened: dict[str, FileEndpoint] = {}

    def endpoint(location: str) -> FileEndpoint:
        if location not in opened:
            opened[location] = FileEndpoint(location)
        return opened[location]

    buffers = Buffers.sized(5 * 8192, 2.0)
    chunks: list[str] = []
    for lo, hi in ranges or [(0, None)]:
        chunks += fill_range(job, Streamer(endpoint, buffers), lo, hi, direct=direct)
    for ep in opened.values():
        ep.close()
    written = seal_file(job, chunks)
    return job, written, open(job.path, "rb").read()


def test_header_alignment_pads_with_spaces_and_stays_readable(tmp_path):
    layout = [("w", "F32", (3, 5)), ("b", "BF16", (7,))]
    prefix, entries = build_header(layout, {"format": "pt"}, align=DIRECT_ALIGN)
    assert len(prefix) % DIRECT_ALIGN == 0
    assert prefix.rstrip(b" ").endswith(b"}")
    data = torch.randn(3, 5), torch.randn(7).to(torch.bfloat16)
    path = tmp_path / "aligned.safetensors"
    path.write_bytes(prefix + b"".join(bytes(t.untyped_storage()) for t in data))
    assert read_header(path).data_start == len(prefix)
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("w"), data[0])
        assert torch.equal(f.get_tensor("b"), data[1])
    assert len(build_header(layout)[0]) % 8 == 0
    with pytest.raises(ValueError, match="multiple of 8"):
        build_header(layout, align=12)


@pytest.mark.parametrize("ranges", [None, [(0, 8192 * 3), (8192 * 3, None)]])
def test_direct_writes_the_same_bytes_and_digests(tmp_path, monkeypatch, ranges):
    """Whole file or two ranges (as two merging ranks split it): identical files; with
    O_DIRECT available, every direct write is aligned and only the unaligned rest is buffered."""
    outputs = _outputs(tmp_path)
    calls: list[tuple[bool, int, int]] = []
    real = os.pwrite

    def spy(fd, data, offset):
        calls.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT), offset, len(data)))
        return real(fd, data, offset)

    _, plain, expected = _write(tmp_path / "plain.st", outputs, direct=False, ranges=ranges)
    monkeypatch.setattr(os, "pwrite", spy)
    job, direct, got = _write(tmp_path / "direct.st", outputs, direct=True, ranges=ranges)
    assert got == expected
    assert direct.chunks == plain.chunks and direct.size == plain.size
    assert job.header_bytes % DIRECT_ALIGN == 0
    probe = open_direct(job.path)
    if probe is None:
        pytest.skip("this file system refuses O_DIRECT: only the fallback ran")
    os.close(probe)
    direct_calls = [(off, n) for is_direct, off, n in calls if is_direct]
    assert direct_calls, "no direct write happened"
    assert all(off % DIRECT_ALIGN == 0 and n % DIRECT_ALIGN == 0 for off, n in direct_calls)
    # The windows over the misaligned I64 tensor fall back; the aligned bulk before it went
    # direct.
    steps = next(e for e in job.entries if e.name == "steps")
    assert sum(n for _, n in direct_calls) >= steps.begin - 2 * 8192


def test_hf_files_start_every_tensor_on_its_element_size(tmp_path):
    """So a merging rank's chunk-aligned share never starts or ends inside an element."""
    from shardstream.formats.hf import plan_hf_files

    outputs = _outputs(tmp_path)
    for max_bytes in (10**9, 30_000):
        files = plan_hf_files(outputs, max_bytes)
        assert sorted(t.name for _, group in files for t in group) == sorted(
            "a b odd steps".split()
        )
        for _, group in files:
            _, entries = build_header([(t.name, t.dtype, t.shape) for t in group])
            assert all(e.begin % itemsize(e.dtype) == 0 for e in entries), entries


def test_unaligned_offsets_and_addresses_are_left_to_the_page_cache(tmp_path):
    from shardstream.engine.copy import _pwrite_direct

    path = str(tmp_path / "f.bin")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT))
    fd = open_direct(path)
    if fd is None:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        raw = np.zeros(4 * DIRECT_ALIGN, dtype=np.uint8)
        base = (-raw.ctypes.data) % DIRECT_ALIGN  # an aligned start inside ``raw``
        aligned = raw[base : base + 2 * DIRECT_ALIGN]
        assert _pwrite_direct(fd, path, aligned, 1) == 0  # unaligned file offset
        assert _pwrite_direct(fd, path, raw[base + 1 : base + 1 + DIRECT_ALIGN], 0) == 0
        assert _pwrite_direct(fd, path, aligned[: DIRECT_ALIGN - 1], 0) == 0  # under a block
        aligned[:] = 7
        assert _pwrite_direct(fd, path, aligned[: DIRECT_ALIGN + 5], 0) == DIRECT_ALIGN
    finally:
        os.close(fd)
    assert open(path, "rb").read() == b"\x07" * DIRECT_ALIGN


def test_verify_accepts_headers_padded_to_8_or_to_the_direct_boundary(tmp_path):
    """A merged model's header is checked for shardstream's exact form; files written before
    direct writes (padded to 8 bytes) keep passing."""
    outputs = _outputs(tmp_path)[:1]
    for align in (8, DIRECT_ALIGN):
        model = tmp_path / f"model-{align}"
        model.mkdir()
        job, _, _ = _write(model / "model.safetensors", outputs, direct=True, align=align)
        assert job.header_bytes % align == 0
        report = verify(model)
        assert report.ok, report.problems
    # Any other padding is an alteration.
    raw = (tmp_path / "model-8" / "model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    repadded = (length + 8).to_bytes(8, "little") + raw[8 : 8 + length] + b" " * 8
    (tmp_path / "model-8" / "model.safetensors").write_bytes(repadded + raw[8 + length :])
    assert not verify(tmp_path / "model-8").ok


def test_a_file_system_refusing_direct_writes_gets_them_through_the_page_cache(
    tmp_path, monkeypatch
):
    """EINVAL on the first direct write (some FUSE and network file systems): that window and
    every later one are written through the page cache, and the file is the same."""
    outputs = _outputs(tmp_path)
    _, plain, expected = _write(tmp_path / "plain.st", outputs, direct=False)
    real, refused = os.pwrite, []

    def refuse_direct(fd, data, offset):
        if O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            refused.append(offset)
            raise OSError(22, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    _, written, got = _write(tmp_path / "refused.st", outputs, direct=True)
    assert got == expected and written.chunks == plain.chunks
    probe = open_direct(str(tmp_path / "refused.st"))
    if probe is None:
        pytest.skip("this file system refuses O_DIRECT at open: the fallback never tried it")
    os.close(probe)
    assert len(refused) == 1  # tried once, then never again

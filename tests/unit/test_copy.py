"""The executor on real small files: strided sources, dtype conversion, tiny buffers, checksums."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardstream.engine.checksum import digest as xxh3_digest
from shardstream.engine.copy import (
    Buffers,
    Streamer,
    hash_block,
    stream_file,
    stream_into_memory,
    tensor_digest,
)
from shardstream.engine.dtypes import CODE_BY_TORCH, TORCH_BY_CODE, itemsize
from shardstream.engine.endpoints import FileEndpoint, TensorEndpoint, live_block
from shardstream.engine.plan import Block, GlobalTensor, chunk_extent, dense_block, plan_copy
from shardstream.errors import CheckpointFormatError, ChecksumMismatchError, OutOfSpaceError
from shardstream.formats.safetensors import read_header, stored_checksums
from shardstream.formats.writer import OutputTensor, write_safetensors

DEFAULT_MAP_MIN_BYTES = FileEndpoint._MAP_MIN_BYTES


@pytest.fixture(autouse=True, scope="module")
def map_reads_of_any_size():
    """These files are small; map their reads anyway, so the mapped path is what runs here.
    (Reads under 1 MiB normally use preadv, which the merge tests on real models cover.)"""
    FileEndpoint._MAP_MIN_BYTES = 1
    yield
    FileEndpoint._MAP_MIN_BYTES = DEFAULT_MAP_MIN_BYTES


def save_raw(tmp_path, name: str, tensor: torch.Tensor, lead: int = 24) -> tuple[str, Block, int]:
    """Write ``tensor``'s whole storage after ``lead`` junk bytes; return its block in the file.

    The block keeps the tensor's strides and storage offset, so a ``.t()`` or sliced view is
    stored exactly as torch would keep it: non-contiguous.
    """
    storage = tensor.untyped_storage()
    raw = bytes(storage)
    path = tmp_path / name
    path.write_bytes(b"\xab" * lead + raw + b"\xcd" * 16)
    isz = tensor.element_size()
    block = Block(
        str(path),
        lead + tensor.storage_offset() * isz,
        CODE_BY_TORCH[tensor.dtype],
        (0,) * tensor.dim(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )
    return str(path), block, len(raw)


class Endpoints:
    def __init__(self, **kwargs):
        self.open: dict[str, FileEndpoint] = {}
        self.kwargs = kwargs

    def __call__(self, location: str) -> FileEndpoint:
        if location not in self.open:
            self.open[location] = FileEndpoint(location, **self.kwargs.get(location, {}))
        return self.open[location]

    def close(self):
        for ep in self.open.values():
            ep.close()


def tiny_buffers(window: int, src: int) -> Buffers:
    return Buffers(
        np.empty(window, dtype=np.uint8),
        np.empty(src, dtype=np.uint8),
        torch.empty(window, dtype=torch.uint8),
    )


def merge_to_file(tmp_path, shape, dtype, pieces, buffers, out_dtype=None):
    """Stream blocks of one global tensor into a file as a dense tensor; return it."""
    out_dtype = out_dtype or dtype
    path = str(tmp_path / "out.bin")
    dst = dense_block(path, 0, out_dtype, shape)
    runs = [r for b in pieces for r in plan_copy("t", shape, b, dst)]
    size = math.prod(shape) * itemsize(out_dtype)
    endpoints = Endpoints()
    streamer = Streamer(endpoints, buffers)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        digests = stream_file(
            fd, path, 0, size, runs, [(0, size, itemsize(out_dtype), "t")], streamer
        )
    finally:
        os.close(fd)
        endpoints.close()
    from shardstream.engine.dtypes import TORCH_BY_CODE

    data = bytearray(open(path, "rb").read())
    result = torch.frombuffer(data, dtype=TORCH_BY_CODE[out_dtype]) if data else torch.empty(0)
    return result.reshape(shape), digests, data


def shards(tmp_path, full: torch.Tensor, dim: int, parts: int, transform=None):
    """Chunk ``full`` along ``dim`` like FSDP and save each piece (optionally re-laid out)."""
    blocks = []
    for r in range(parts):
        s, n = chunk_extent(full.shape[dim], parts, r)
        piece = full.narrow(dim, s, n)
        stored = transform(piece) if transform else piece.clone()
        _, block, _ = save_raw(tmp_path, f"rank{r}.bin", stored)
        start = [0] * full.dim()
        start[dim] = s
        blocks.append(
            Block(
                block.location, block.offset, block.dtype, tuple(start), block.shape, block.strides
            )
        )
    return blocks


def transposed_storage(piece: torch.Tensor) -> torch.Tensor:
    """Same values, column-major storage: a genuinely strided source."""
    return piece.t().contiguous().t()


def padded_storage(piece: torch.Tensor) -> torch.Tensor:
    """Same values inside a wider buffer: rows with gaps between them."""
    wide = torch.full((piece.shape[0], piece.shape[1] + 3), -7.0, dtype=piece.dtype)
    wide[:, 1 : 1 + piece.shape[1]] = piece
    return wide[:, 1 : 1 + piece.shape[1]]


BUFFER_CASES = [
    pytest.param(Buffers.sized(64 * 2**20), id="default"),
    pytest.param(Buffers.sized(1), id="minimum"),
    pytest.param(tiny_buffers(8, 8), id="w8-s8"),
    pytest.param(tiny_buffers(12, 8), id="w12-s8"),
    pytest.param(tiny_buffers(28, 20), id="w28-s20"),
    pytest.param(tiny_buffers(100, 16), id="w100-s16"),
]


@pytest.mark.parametrize("buffers", BUFFER_CASES)
@pytest.mark.parametrize(
    "dim, layout",
    [(0, None), (1, None), (0, transposed_storage), (1, transposed_storage), (1, padded_storage)],
)
def test_merge_strided_shards_any_buffer(tmp_path, buffers, dim, layout):
    torch.manual_seed(0)
    full = torch.randn(13, 11)
    blocks = shards(tmp_path, full, dim, 3, layout)
    result, _, _ = merge_to_file(tmp_path, tuple(full.shape), "F32", blocks, buffers)
    assert torch.equal(result, full)


@pytest.mark.parametrize("buffers", BUFFER_CASES[2:])
def test_three_dim_shard1_with_tiny_windows(tmp_path, buffers):
    full = torch.arange(4 * 5 * 6, dtype=torch.float64).reshape(4, 5, 6)
    blocks = shards(
        tmp_path, full, 1, 2, lambda p: p.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    )
    result, _, _ = merge_to_file(tmp_path, (4, 5, 6), "F64", blocks, buffers)
    assert torch.equal(result, full)


def special_floats(n: int) -> torch.Tensor:
    """Random bit patterns (every exponent, NaN payloads, subnormals) plus edge values."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32).clone()
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            65504.0,
            65520.0,
            1e-45,
            1e-40,
            3.4e38,
            1.00390625,
            1.001953125,
            2.0**-24,
            2.0**-25,
        ],
        dtype=torch.float32,
    )
    values[: len(edges)] = edges
    return values


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("buffers", [BUFFER_CASES[0], BUFFER_CASES[1], BUFFER_CASES[3]])
def test_fp32_conversion_is_bit_identical_to_tensor_to(tmp_path, target, buffers):
    full = special_floats(6000).reshape(600, 10)
    blocks = shards(tmp_path, full, 1, 4, transposed_storage)
    result, _, _ = merge_to_file(
        tmp_path, tuple(full.shape), "F32", blocks, buffers, out_dtype=CODE_BY_TORCH[target]
    )
    expected = full.to(target)
    assert torch.equal(result.view(torch.int16), expected.view(torch.int16))


def test_widening_and_integer_copies(tmp_path):
    full = torch.randn(9, 4).to(torch.bfloat16)
    blocks = shards(tmp_path, full, 0, 2)
    result, _, _ = merge_to_file(tmp_path, (9, 4), "BF16", blocks, tiny_buffers(12, 8), "F32")
    assert torch.equal(result, full.float())
    ints = torch.arange(-20, 20, dtype=torch.int64).reshape(8, 5)
    blocks = shards(tmp_path, ints, 1, 3)
    result, _, _ = merge_to_file(tmp_path, (8, 5), "I64", blocks, tiny_buffers(16, 8))
    assert torch.equal(result, ints)


def test_windows_cut_between_tensors_of_different_dtypes(tmp_path):
    """A real safetensors file with several tensors, written through windows of 12 bytes."""
    torch.manual_seed(2)
    a, b, c = (
        torch.randn(7, 3),
        torch.randn(5).to(torch.bfloat16),
        torch.arange(6, dtype=torch.int16),
    )
    sources = []
    for name, t in (("a", a), ("b", b), ("c", c)):
        _, block, _ = save_raw(tmp_path, f"{name}.bin", t)
        sources.append(GlobalTensor(name, block.dtype, tuple(t.shape), (block,)))
    outputs = [
        OutputTensor("a", "BF16", sources[0]),
        OutputTensor("b", "F32", sources[1]),
        OutputTensor("c", "I16", sources[2]),
    ]
    endpoints = Endpoints()
    path = tmp_path / "m.safetensors"
    written = write_safetensors(
        str(path), outputs, Streamer(endpoints, tiny_buffers(12, 8)), chunk_bytes=16
    )
    endpoints.close()
    from safetensors.torch import load_file

    loaded = load_file(str(path))
    assert torch.equal(loaded["a"].view(torch.int16), a.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(loaded["b"], b.float())
    assert torch.equal(loaded["c"], c)
    assert written.size == path.stat().st_size
    stored = stored_checksums(read_header(path))
    assert stored.chunks == list(written.chunks)


def test_stream_file_digests_cover_the_data_section(tmp_path):
    full = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    blocks = shards(tmp_path, full, 0, 3)
    result, digests, data = merge_to_file(tmp_path, (10, 10), "F32", blocks, tiny_buffers(28, 20))
    chunk = 4 * 2**20
    assert digests == [
        xxh3_digest(np.frombuffer(bytes(data[i : i + chunk]), dtype=np.uint8))
        for i in range(0, len(data), chunk)
    ]


def test_uncovered_bytes_are_an_error(tmp_path):
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    blocks = shards(tmp_path, full, 0, 2)
    with pytest.raises(CheckpointFormatError, match="internal plan error.*tensor 't'"):
        merge_to_file(tmp_path, (4, 3), "F32", blocks[:1], Buffers.sized(1))


def test_truncated_source_is_named(tmp_path):
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    path, block, size = save_raw(tmp_path, "short.bin", full, lead=0)
    with open(path, "r+b") as f:
        f.truncate(size - 4)
    with pytest.raises(
        CheckpointFormatError, match=r"short\.bin: truncated: needed bytes \[0, 48\).*ends at 44"
    ):
        merge_to_file(tmp_path, (4, 3), "F32", [block], Buffers.sized(1))


def test_a_source_truncated_while_open_is_said_with_its_size_now(tmp_path):
    """Cut short while a merge had it open: the message gave the size at opening, which the
    file no longer has."""
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    path, _, size = save_raw(tmp_path, "shrinking.bin", full, lead=0)
    endpoint = FileEndpoint(path)
    try:
        with open(path, "r+b") as f:
            f.truncate(20)
        with pytest.raises(CheckpointFormatError) as raised:
            endpoint.read_into(0, np.empty(size, dtype=np.uint8))
    finally:
        endpoint.close()
    assert str(raised.value) == (
        f"{path}: truncated: needed bytes [0, {size}) but the file ends at 20 (it was "
        f"{size + 16} bytes when opened)"
    )


def test_out_of_space_while_writing(tmp_path, monkeypatch):
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    blocks = shards(tmp_path, full, 0, 2)

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full_disk)
    with pytest.raises(OutOfSpaceError, match=r"out\.bin: no space left on device"):
        merge_to_file(tmp_path, (4, 3), "F32", blocks, Buffers.sized(1))


# ---------------------------------------------------------------------------- checksums


def written_file(tmp_path, chunk_bytes=64):
    torch.manual_seed(3)
    t = torch.randn(10, 20)
    _, block, _ = save_raw(tmp_path, "src.bin", t)
    src = GlobalTensor("w", "F32", (10, 20), (block,))
    endpoints = Endpoints()
    path = tmp_path / "m.safetensors"
    write_safetensors(
        str(path),
        [OutputTensor("w", "F32", src)],
        Streamer(endpoints, Buffers.sized(1)),
        chunk_bytes=chunk_bytes,
    )
    endpoints.close()
    header = read_header(path)
    return path, header, stored_checksums(header), t


def read_back(path, header, stored, buffers):
    entry = header.tensors["w"]
    src = dense_block(str(path), header.data_start + entry.begin, "F32", entry.shape)
    out = torch.empty(entry.shape)
    dst = Block("live", 0, "F32", (0, 0), tuple(out.shape), tuple(out.stride()))
    kwargs = {
        str(path): {
            "digests": stored.chunks,
            "data_start": header.data_start,
            "chunk_bytes": stored.chunk_bytes,
        }
    }
    endpoints = Endpoints(**kwargs)
    live = TensorEndpoint("live", out)

    def endpoint(location):
        return live if location == "live" else endpoints(location)

    try:
        stream_into_memory(plan_copy("w", entry.shape, src, dst), Streamer(endpoint, buffers))
    finally:
        endpoints.close()
    return out


def written_file_with_a_flip(tmp_path, position: int):
    """``written_file`` with one bit flipped at data byte ``position``, after the checksums."""
    path, header, stored, _ = written_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[header.data_start + position] ^= 0x01
    path.write_bytes(bytes(raw))
    return path, header, stored


@pytest.mark.parametrize("buffers", [BUFFER_CASES[1], BUFFER_CASES[4], BUFFER_CASES[5]])
def test_checksummed_reads_pass_on_intact_file(tmp_path, buffers):
    path, header, stored, t = written_file(tmp_path)
    assert stored.chunk_bytes == 64 and len(stored.chunks) == math.ceil(800 / 64)
    assert torch.equal(read_back(path, header, stored, buffers), t)


@pytest.mark.parametrize("position", [0, 63, 64, 500, 799])
def test_flipped_byte_is_detected(tmp_path, position):
    path, header, stored = written_file_with_a_flip(tmp_path, position)
    chunk = position // 64 * 64
    lo = header.data_start + chunk
    hi = lo + min(64, 800 - chunk)
    with pytest.raises(
        ChecksumMismatchError, match=rf"m\.safetensors: checksum mismatch in bytes \[{lo}, {hi}\)"
    ):
        read_back(path, header, stored, BUFFER_CASES[4].values[0])


def checked_endpoint(path, header, stored):
    return FileEndpoint(
        str(path), stored.chunks, header.data_start, stored.chunk_bytes, lambda a, b: " (w)"
    )


def test_check_all_reads_every_chunk(tmp_path):
    path, header, stored, _ = written_file(tmp_path)
    endpoint = checked_endpoint(path, header, stored)
    try:
        endpoint.check_all()
        assert endpoint.chunks_read == len(stored.chunks)
    finally:
        endpoint.close()
    (tmp_path / "flip").mkdir()
    path, header, stored = written_file_with_a_flip(tmp_path / "flip", 700)
    endpoint = checked_endpoint(path, header, stored)
    try:
        lo = header.data_start + 640  # the 64-byte chunk holding data byte 700
        with pytest.raises(ChecksumMismatchError, match=rf"bytes \[{lo}, {lo + 64}\) \(w\)"):
            endpoint.check_all()
    finally:
        endpoint.close()


def test_small_reads_in_file_order_read_each_chunk_once(tmp_path):
    """Many small pieces in one chunk (small tensors, a slice per rank) are one read + hash."""
    path, header, stored, t = written_file(tmp_path)
    raw = t.numpy().view(np.uint8).reshape(-1)
    endpoint = checked_endpoint(path, header, stored)
    try:
        for start in range(0, 800, 12):  # 12-byte reads, most inside a 64-byte chunk
            out = np.empty(min(12, 800 - start), dtype=np.uint8)
            endpoint.read_into(header.data_start + start, out)
            assert np.array_equal(out, raw[start : start + out.nbytes])
        assert endpoint.chunks_read == len(stored.chunks)
    finally:
        endpoint.close()


def test_large_reads_hash_whole_chunks_in_place(tmp_path):
    path, header, stored, t = written_file(tmp_path)
    raw = t.numpy().view(np.uint8).reshape(-1)
    endpoint = checked_endpoint(path, header, stored)
    try:
        out = np.empty(800 - 10, dtype=np.uint8)  # starts mid-chunk, runs to the end
        endpoint.read_into(header.data_start + 10, out)
        assert np.array_equal(out, raw[10:])
        assert endpoint.chunks_read == len(stored.chunks)
        assert endpoint._chunk is None  # read to the end: every chunk checked, none pending
    finally:
        endpoint.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 799), st.integers(0, 200)), min_size=1, max_size=12))
def test_checked_reads_in_any_order_match_plain_reads(tmp_path_factory, reads):
    path, header, stored, t = written_file(tmp_path_factory.mktemp("r"))
    raw = t.numpy().view(np.uint8).reshape(-1)
    endpoint = checked_endpoint(path, header, stored)
    try:
        for start, length in reads:
            length = min(length, 800 - start)
            out = np.empty(length, dtype=np.uint8)
            endpoint.read_into(header.data_start + start, out)
            assert np.array_equal(out, raw[start : start + length])
    finally:
        endpoint.close()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 799), st.integers(0, 200)), min_size=1, max_size=12
    )
)
def test_mapped_and_copied_reads_mix_and_stay_checked(tmp_path_factory, reads):
    """``mapped`` lends the page cache's bytes and feeds the same chunk checks as ``read_into``,
    in any order of the two."""
    path, header, stored, t = written_file(tmp_path_factory.mktemp("m"))
    raw = t.numpy().view(np.uint8).reshape(-1)
    endpoint = checked_endpoint(path, header, stored)
    try:
        for lend, start, length in reads:
            length = min(length, 800 - start)
            if lend and length:
                got = np.array(endpoint.mapped(header.data_start + start, length))
            else:
                got = np.empty(length, dtype=np.uint8)
                endpoint.read_into(header.data_start + start, got)
            assert np.array_equal(got, raw[start : start + length])
        endpoint.finish()
    finally:
        endpoint.close()


def test_files_that_cannot_be_mapped_are_read_with_preadv(tmp_path, monkeypatch):
    """Some network and FUSE file systems refuse mmap; reads then fall back to ``preadv``, and
    conversions read through the staging buffer, with the same bytes."""
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(errno.ENODEV, "No such device")

    full = special_floats(6000).reshape(600, 10)
    blocks = shards(tmp_path, full, 0, 3)
    mapped_result, _, _ = merge_to_file(
        tmp_path, tuple(full.shape), "F32", blocks, Buffers.sized(1 << 20), out_dtype="BF16"
    )
    buffers = Buffers.sized(1 << 20)  # anonymous memory is mapped too: before the refusal
    monkeypatch.setattr(mmap, "mmap", refuse)
    result, _, _ = merge_to_file(
        tmp_path, tuple(full.shape), "F32", blocks, buffers, out_dtype="BF16"
    )
    assert torch.equal(result.view(torch.int16), full.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(result.view(torch.int16), mapped_result.view(torch.int16))
    endpoint = FileEndpoint(blocks[0].location)
    try:
        assert endpoint.mapped(0, 8) is None
        out = np.empty(8, dtype=np.uint8)
        endpoint.read_into(0, out)
        assert out.tobytes() == Path(blocks[0].location).read_bytes()[:8]
    finally:
        endpoint.close()


def test_only_reads_of_a_mebibyte_or_more_are_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(FileEndpoint, "_MAP_MIN_BYTES", DEFAULT_MAP_MIN_BYTES)
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "big.bin"
    path.write_bytes(data.tobytes())
    endpoint = FileEndpoint(str(path))
    try:
        assert endpoint.mapped(5, 4096) is None  # a mapping costs more than it saves
        lent = endpoint.mapped(5, 1 << 20)
        assert lent is not None and np.array_equal(lent, data[5 : 5 + (1 << 20)])
        out = np.empty((3 << 20) - 7, dtype=np.uint8)  # copied a mapped piece at a time
        endpoint.read_into(7, out)
        assert np.array_equal(out, data[7:])
    finally:
        endpoint.close()


@pytest.mark.parametrize("lend", [False, True], ids=["5-byte-reads", "mapped"])
@pytest.mark.parametrize("position", [0, 70, 130, 799])
def test_flip_is_detected_after_neighbouring_chunks_were_cached(tmp_path, position, lend):
    path, header, stored = written_file_with_a_flip(tmp_path, position)
    lo = header.data_start + position // 64 * 64
    endpoint = checked_endpoint(path, header, stored)
    try:
        with pytest.raises(ChecksumMismatchError, match=rf"\[{lo}, \d+\) \(w\)"):
            if lend:  # the page cache's bytes lent whole, checked as they are handed out
                endpoint.mapped(header.data_start, 800)
            else:
                for start in range(0, 800, 5):
                    endpoint.read_into(header.data_start + start, np.empty(5, dtype=np.uint8))
        # a failed chunk is not kept: reading it again fails again, by the time it is finished
        with pytest.raises(ChecksumMismatchError):
            endpoint.read_into(lo, np.empty(1, dtype=np.uint8))
            endpoint.finish()
    finally:
        endpoint.close()


@pytest.mark.parametrize("position", [30, 63])
def test_finish_checks_the_unread_rest_of_a_chunk(tmp_path, position):
    """A read that stops inside a chunk hands its bytes out at once; ``finish`` reads the rest
    of that chunk and fails when the damage is in bytes nobody asked for."""
    path, header, stored = written_file_with_a_flip(tmp_path, position)
    endpoint = checked_endpoint(path, header, stored)
    try:
        endpoint.read_into(header.data_start + 2, np.empty(10, dtype=np.uint8))
        with pytest.raises(ChecksumMismatchError, match=rf"\[{header.data_start}, "):
            endpoint.finish()
        endpoint.finish()  # nothing pending after the failure
    finally:
        endpoint.close()


def test_side_by_side_reads_keep_no_chunk_in_memory(tmp_path):
    """A merge reads many rank files in turn, a slice of each: every file keeps a hash state,
    not a copy of the chunk it is in the middle of (that was 4 MiB per file)."""
    import tracemalloc

    chunk = 1 << 20
    files = []
    for i in range(6):
        t = torch.arange(i, i + 4 * chunk // 4, dtype=torch.float32)
        raw = tmp_path / f"src{i}.bin"
        raw.write_bytes(t.numpy().tobytes())  # save_raw's bytes(storage) is slow at this size
        block = dense_block(str(raw), 0, "F32", tuple(t.shape))
        path = tmp_path / f"rank{i}.safetensors"
        src = GlobalTensor("w", "F32", tuple(t.shape), (block,))
        endpoints = Endpoints()
        write_safetensors(
            str(path),
            [OutputTensor("w", "F32", src)],
            Streamer(endpoints, Buffers.sized(1 << 20)),
            chunk_bytes=chunk,
        )
        endpoints.close()
        header = read_header(path)
        files.append((checked_endpoint(path, header, stored_checksums(header)), header, t))
    out = np.empty(48 << 10, dtype=np.uint8)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        grown = 0
        for step in range(0, 4 * chunk, 3 * out.nbytes):  # a slice of each file in turn
            for endpoint, header, t in files:
                endpoint.read_into(header.data_start + step, out)
                expected = t.numpy().view(np.uint8)[step : step + out.nbytes]
                assert np.array_equal(out, expected)
                grown = max(grown, tracemalloc.get_traced_memory()[0] - base)
        for endpoint, _, _ in files:
            endpoint.finish()
            assert endpoint.chunks_read == 4
    finally:
        tracemalloc.stop()
        for endpoint, _, _ in files:
            endpoint.close()
    assert grown < chunk, grown  # six files, less than one chunk in all


def test_restore_reads_straight_into_a_contiguous_live_tensor(tmp_path):
    """A plain same-dtype restore never touches the streamer's source buffer."""
    path, header, stored, t = written_file(tmp_path)
    buffers = tiny_buffers(256, 256)
    buffers.src[...] = 0x5A
    out = read_back(path, header, stored, buffers)
    assert torch.equal(out, t)
    assert (buffers.src == 0x5A).all()


def test_live_tensor_destination_with_strides(tmp_path):
    """Restore into a non-contiguous live tensor (a transposed view)."""
    full = torch.randn(6, 4)
    blocks = shards(tmp_path, full, 0, 2)
    target = torch.zeros(4, 6).t()  # shape (6, 4), strides (1, 6)
    dst = Block("live", 0, "F32", (0, 0), (6, 4), tuple(target.stride()))
    endpoints = Endpoints()
    live = TensorEndpoint("live", target)
    streamer = Streamer(lambda loc: live if loc == "live" else endpoints(loc), tiny_buffers(12, 8))
    stream_into_memory([r for b in blocks for r in plan_copy("t", (6, 4), b, dst)], streamer)
    endpoints.close()
    assert torch.equal(target, full)


def test_hash_block_is_the_digest_of_row_major_bytes(tmp_path):
    full = torch.randn(5, 7)
    _, block, _ = save_raw(tmp_path, "t.bin", transposed_storage(full))
    endpoints = Endpoints()
    digest = hash_block("t", (5, 7), block, Streamer(endpoints, tiny_buffers(12, 8)))
    endpoints.close()
    assert digest == xxh3_digest(full.contiguous().numpy().view(np.uint8).reshape(-1))


@pytest.mark.parametrize("buffers", BUFFER_CASES)
@pytest.mark.parametrize("dim, layout", [(0, None), (1, transposed_storage), (1, padded_storage)])
def test_tensor_digest_is_the_digest_of_the_whole_tensor_however_it_is_split(
    tmp_path, buffers, dim, layout
):
    """A tensor's digest over all its blocks, cast to the dtype asked for, is that of its
    row-major bytes: equal for one tensor stored whole and split, unequal once one element
    differs."""
    torch.manual_seed(0)
    full = torch.randn(13, 11)
    split = GlobalTensor("t", "F32", (13, 11), tuple(shards(tmp_path, full, dim, 3, layout)))
    changed = full.clone()
    changed[12, 10] = changed[12, 10].nextafter(torch.tensor(1.0))
    other = GlobalTensor("u", "F32", (13, 11), (save_raw(tmp_path, "u.bin", changed)[1],))
    endpoints = Endpoints()
    streamer = Streamer(endpoints, buffers)
    try:
        for dtype in ("F32", "BF16"):
            want = full.to(TORCH_BY_CODE[dtype]).contiguous().view(torch.uint8).numpy()
            assert tensor_digest(split, streamer, dtype) == xxh3_digest(want.reshape(-1))
        assert tensor_digest(other, streamer, "F32") != tensor_digest(split, streamer, "F32")
    finally:
        endpoints.close()


def test_buffers_sized_respects_ratio_and_minimum():
    small = Buffers.sized(1)
    assert small.window.nbytes >= 4096 and small.src.nbytes >= 4096
    b = Buffers.sized(64 * 2**20, ratio=2.0)
    assert b.src.nbytes >= 2 * b.window.nbytes - 2
    assert b.window.nbytes * 2 + b.src.nbytes <= 64 * 2**20


# ---------------------------------------------------------------------------- property


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_layouts_dtypes_and_buffers(data):
    """Any chunked, re-laid-out source, any float conversion, any buffers of >= 8 bytes."""
    import tempfile
    from pathlib import Path

    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    src_dtype = data.draw(
        st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])
    )
    dst_dtype = data.draw(
        st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])
    )
    dim = data.draw(st.integers(0, ndim - 1))
    parts = data.draw(st.integers(1, 4))
    order = data.draw(st.permutations(range(ndim)))
    buffers = tiny_buffers(data.draw(st.integers(8, 96)), data.draw(st.integers(8, 96)))
    full = (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 1.37 - 5).to(
        src_dtype
    )

    def relayout(piece):
        inverse = [order.index(d) for d in range(ndim)]
        return piece.permute(*order).contiguous().permute(*inverse)

    with tempfile.TemporaryDirectory() as tmp:
        blocks = shards(Path(tmp), full, dim, parts, relayout)
        result, _, _ = merge_to_file(
            Path(tmp), shape, CODE_BY_TORCH[src_dtype], blocks, buffers, CODE_BY_TORCH[dst_dtype]
        )
    expected = full.to(dst_dtype)
    assert torch.equal(result.view(torch.uint8), expected.contiguous().view(torch.uint8))


def test_host_transfer_ring_copies_in_bounded_slots(tmp_path):
    from shardstream.engine.endpoints import TensorEndpoint
    from shardstream.engine.transfer import HostTransfer

    data = torch.arange(1000, dtype=torch.int32)
    lock = tmp_path / "d2h.lock"
    for stagger in (None, str(lock)):
        transfer = HostTransfer(slot_bytes=256, slots=3, stagger_path=stagger)
        endpoint = TensorEndpoint("t", data, transfer=transfer)
        out = np.empty(4000 - 12, dtype=np.uint8)
        endpoint.read_into(12, out)
        assert out.tobytes() == data.numpy().tobytes()[12:]
        assert transfer.transfers == -(-out.nbytes // 256)  # one transfer per slot's worth
        assert all(slot.numel() == 256 for slot in transfer.slots)
    assert lock.exists()  # ranks on one host took turns through this lock file


def test_one_buffer_set_is_shared_by_the_phases_inside_it():
    from shardstream.engine.copy import one_buffer_set

    with one_buffer_set(1 << 20):
        a, b = Buffers.sized(1 << 20), Buffers.sized(1 << 20, 2.0)
        assert np.shares_memory(a.window, b.window)
        for part in (b.window, b.spare, b.src, b.staging.numpy()):
            assert part.ctypes.data + part.nbytes <= a.window.ctypes.data + (1 << 20)
    c, d = Buffers.sized(1 << 20), Buffers.sized(1 << 20)
    assert not np.shares_memory(c.window, d.window)
    assert sum(x.nbytes for x in (c.window, c.spare, c.src)) + c.staging.numel() <= 1 << 20


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux /proc only")
def test_buffers_are_private_memory():
    """Shared anonymous memory is shmem (no huge pages, counted apart); buffers must be private."""
    buffers = Buffers.sized(8 << 20)
    address = buffers.window.ctypes.data
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                assert perms.endswith("p"), line
                return
    raise AssertionError("buffer mapping not found")


@pytest.mark.parametrize("window", [12, 40, 4096])
def test_borrowed_live_tensors_write_the_same_file_as_copies(tmp_path, monkeypatch, window):
    """A sync save writes unconverted live CPU tensors from their own memory: same bytes, same
    chunk digests as copying them through the window, however windows cut the tensors."""
    torch.manual_seed(5)
    base = torch.randn(9, 6)
    live = {
        "plain": torch.randn(7, 3),
        "converted": torch.randn(5),  # F32 -> BF16: must go through the window
        "strided": base[:, 1:4],  # rows not contiguous in memory: must be gathered
        "offset": base[2:5],  # contiguous, at a storage offset
        "ints": torch.arange(11, dtype=torch.int16),
    }
    endpoints, outputs = {}, []
    for name, t in live.items():
        location = f"memory:{name}"
        endpoints[location] = TensorEndpoint(name, t)
        block = live_block(location, t)
        dtype = block.dtype
        out_dtype = "BF16" if name == "converted" else dtype
        outputs.append(
            OutputTensor(name, out_dtype, GlobalTensor(name, dtype, block.shape, (block,)))
        )
    lent = []
    original = Streamer.borrow

    def counting_borrow(self, *args):
        view = original(self, *args)
        lent.append(0 if view is None else view.nbytes)
        return view

    monkeypatch.setattr(Streamer, "borrow", counting_borrow)
    results = {}
    for borrow in (False, True):
        path = tmp_path / f"borrow-{borrow}.safetensors"
        streamer = Streamer(endpoints.__getitem__, tiny_buffers(window, window))
        written = write_safetensors(str(path), outputs, streamer, chunk_bytes=16, borrow=borrow)
        results[borrow] = (path.read_bytes(), written.chunks)
    assert results[True] == results[False]
    # Lent: plain, offset and ints whole, and of the strided tensor the rows that a window
    # cuts into single-row pieces (each row is contiguous); never the converted tensor.
    whole = (7 * 3 + 3 * 6) * 4 + 11 * 2
    assert sum(lent) == whole + {12: 9, 40: 2, 4096: 0}[window] * 3 * 4
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "borrow-True.safetensors"))
    for name, t in live.items():
        expected = t.to(torch.bfloat16) if name == "converted" else t
        assert torch.equal(loaded[name], expected), name


def test_a_window_end_snaps_to_an_element_of_its_tensor_past_empty_ones():
    from shardstream.engine.copy import _snap

    # (begin, end, itemsize) in file order, as stream_file sorts them: an empty tensor first
    bounds = [(0, 10, 2), (10, 10, 4), (10, 30, 4), (30, 30, 8)]
    starts = [b for b, _, _ in bounds]
    assert [_snap(x, bounds, starts) for x in (5, 11, 17, 29, 30, 31)] == [4, 10, 14, 26, 30, 31]


@pytest.mark.parametrize(
    "offset, nbytes",
    [(0, 1 << 20), (123, 3 << 20), ((2 << 20) - 5, 1 << 20), ((4 << 20) + 7, (1 << 20) + 9)],
)
def test_mapped_reads_give_exactly_the_bytes_asked_for(tmp_path, offset, nbytes):
    # Mappings are widened to 2 MiB boundaries (clipped at the end of the file); what is
    # handed out is the requested range, no more.
    data = np.random.default_rng(3).integers(0, 256, (5 << 20) + 123, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    endpoint = FileEndpoint(str(path))
    try:
        lent = endpoint.mapped(offset, nbytes)
        assert lent is not None and lent.nbytes == nbytes
        assert np.array_equal(lent, data[offset : offset + nbytes])
        out = np.empty(nbytes, dtype=np.uint8)
        endpoint.read_into(offset, out)
        assert np.array_equal(out, data[offset : offset + nbytes])
        del lent
    finally:
        endpoint.close()

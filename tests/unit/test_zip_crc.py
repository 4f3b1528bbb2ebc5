"""Reading ``.pt`` files with each zip record's CRC-32 checked as its bytes stream past."""

from __future__ import annotations

import zipfile
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardstream.engine.checksum import Crc32
from shardstream.errors import CheckpointFormatError, ChecksumMismatchError
from shardstream.formats.torch_pt import crc_checked_endpoint, zip_records


def saved(tmp_path, name="t.pt") -> tuple[str, dict[str, torch.Tensor]]:
    tensors = {
        "a": torch.arange(300, dtype=torch.float32),
        "b": torch.arange(64, dtype=torch.int64).reshape(8, 8),
        "c": torch.ones(5, dtype=torch.bfloat16),
    }
    path = tmp_path / name
    torch.save(tensors, path)
    return str(path), tensors


def test_crc32_hasher_matches_zlib_in_pieces():
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    hasher = Crc32()
    for lo in range(0, 10_000, 777):
        hasher.update(memoryview(data[lo : lo + 777]))
    assert hasher.hexdigest() == f"{zlib.crc32(data.tobytes()):08x}"
    hasher.reset()
    assert hasher.hexdigest() == "00000000"


def test_crc32_is_zlib_ngs():
    """The declared dependency is the one in use: the stdlib's is ~10x slower."""
    from shardstream.engine import checksum

    assert checksum.crc32.__module__ == "zlib_ng.zlib_ng"


def test_records_are_the_archives_stored_records(tmp_path):
    path, _ = saved(tmp_path)
    records = zip_records(path)
    raw = open(path, "rb").read()
    with zipfile.ZipFile(path) as archive:
        names = {i.filename for i in archive.infolist() if i.CRC or not i.file_size}
        assert {r.name for r in records} == names
        for record in records:  # the span holds exactly the record's bytes, CRC as recorded
            assert raw[record.start : record.end] == archive.read(record.name)
            assert record.crc == f"{zlib.crc32(archive.read(record.name)):08x}"
    assert all(a.end <= b.start for a, b in zip(records, records[1:]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 1500)), min_size=1, max_size=10))
def test_checked_reads_in_any_order_match_the_file(tmp_path_factory, reads):
    path, _ = saved(tmp_path_factory.mktemp("z"))
    raw = open(path, "rb").read()
    endpoint = crc_checked_endpoint(path)
    try:
        for start, length in reads:
            start = min(start, len(raw) - 1)
            length = min(length, len(raw) - start)
            out = np.empty(length, dtype=np.uint8)
            endpoint.read_into(start, out)  # headers between records pass through unchecked
            assert out.tobytes() == raw[start : start + length]
        endpoint.finish()
    finally:
        endpoint.close()


@pytest.mark.parametrize("tensor", ["a", "b", "c"])
def test_a_flipped_byte_in_tensor_data_is_named(tmp_path, tensor):
    path, tensors = saved(tmp_path)
    records = {r.name.split("/", 1)[1]: r for r in zip_records(path)}  # "t/data/0" -> "data/0"
    # torch.save numbers storages in the order the pickle meets them: a, b, c -> data/0, 1, 2
    record = records[f"data/{'abc'.index(tensor)}"]
    data = bytearray(open(path, "rb").read())
    data[(record.start + record.end) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    endpoint = crc_checked_endpoint(path, lambda lo, hi: [tensor] if lo == record.start else [])
    try:
        out = np.empty(4, dtype=np.uint8)  # a read of the record's first bytes only
        endpoint.read_into(record.start, out)
        with pytest.raises(
            ChecksumMismatchError,
            match=rf"t\.pt: checksum mismatch in bytes \[{record.start}, {record.end}\) "
            rf"\(zip record .*data/{'abc'.index(tensor)}: '{tensor}'\)",
        ):
            endpoint.finish()  # the rest of the record is read and checked before use
    finally:
        endpoint.close()


def test_records_saved_without_a_crc_are_read_unchecked(tmp_path):
    path, tensors = saved(tmp_path)
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    data = bytearray(open(path, "rb").read())
    # Zero every CRC field (local headers and central directory), as compute_crc32=False does.
    for info in infos:
        data[info.header_offset + 14 : info.header_offset + 18] = bytes(4)
    directory = data.rfind(b"PK\x05\x06")
    pos = int.from_bytes(data[directory + 16 : directory + 20], "little")
    for _ in infos:
        assert data[pos : pos + 4] == b"PK\x01\x02"
        data[pos + 16 : pos + 20] = bytes(4)
        pos += 46 + sum(int.from_bytes(data[pos + k : pos + k + 2], "little") for k in (28, 30, 32))
    open(path, "wb").write(bytes(data))
    assert all(r.end == r.start for r in zip_records(path))  # only empty records stay
    endpoint = crc_checked_endpoint(path)
    try:
        out = np.empty(len(data), dtype=np.uint8)
        endpoint.read_into(0, out)
        endpoint.finish()
        assert out.tobytes() == bytes(data)
    finally:
        endpoint.close()


def test_a_damaged_central_directory_is_a_format_error(tmp_path):
    path, _ = saved(tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 30])
    with pytest.raises(CheckpointFormatError, match=r"t\.pt: corrupt torch checkpoint"):
        zip_records(path)

"""FileEndpoint over CRC-32 spans (zip records) read out of order: each read is a piece of its
record, joined with crc32_combine; a record is checked when its pieces cover it, the rest at
finish(). A fused MoE tensor split into per-expert outputs reads its record this way."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardstream.engine.checksum import Crc32
from shardstream.engine.endpoints import FileEndpoint
from shardstream.errors import ChecksumMismatchError

pytestmark = pytest.mark.skipif(not Crc32.combinable, reason="no crc32_combine")

HEADER = 16  # unchecked bytes before the first record, as a zip's local header
SIZES = (300, 1, 257)  # three records, with 5 unchecked bytes between them


def records(tmp_path, flip: int | None = None):
    """A file of HEADER bytes, then the records with 5-byte gaps; their spans and CRC-32s (of
    the intended bytes: ``flip`` damages one data byte on disk)."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, HEADER + sum(SIZES) + 5 * len(SIZES), dtype=np.uint8)
    spans, pos = [], HEADER
    for size in SIZES:
        spans.append((pos, pos + size))
        pos += size + 5
    crcs = [f"{zlib.crc32(data[a:b].tobytes()):08x}" for a, b in spans]
    disk = data.copy()
    if flip is not None:
        disk[flip] ^= 0x10
    path = tmp_path / "r.bin"
    path.write_bytes(disk.tobytes())
    return path, data, spans, crcs


def endpoint(path, spans, crcs):
    return FileEndpoint(str(path), crcs, spans=spans, hasher=Crc32)


def test_reads_in_any_order_check_each_record_once(tmp_path):
    path, data, spans, crcs = records(tmp_path)
    e = endpoint(path, spans, crcs)
    try:
        lo, hi = spans[0]
        # Second halves first, then first halves: as gate/up slices of a fused record.
        order = [(lo + 150, lo + 200), (lo + 250, hi), (lo, lo + 50), (lo + 100, lo + 150)]
        order += [(lo + 50, lo + 100), (lo + 200, lo + 250)]
        for a, b in order:
            out = np.empty(b - a, dtype=np.uint8)
            e.read_into(a, out)
            assert np.array_equal(out, data[a:b])
        assert e.chunks_read == 1 and not e._pieces  # covered: checked, nothing left open
        e.finish()
        assert e.chunks_read == 1
    finally:
        e.close()


def test_finish_reads_what_no_read_covered(tmp_path):
    path, data, spans, crcs = records(tmp_path)
    e = endpoint(path, spans, crcs)
    try:
        lo, hi = spans[2]
        out = np.empty(20, dtype=np.uint8)
        e.read_into(lo + 100, out)  # a piece across nothing else; rest unread
        # across the end of record 0, its gap and into record 1 (1 byte)
        across = np.empty(spans[1][1] - (spans[0][1] - 10), dtype=np.uint8)
        e.read_into(spans[0][1] - 10, across)
        assert np.array_equal(across, data[spans[0][1] - 10 : spans[1][1]])
        assert e.chunks_read == 1  # record 1 (one byte) is covered
        e.finish()
        assert e.chunks_read == 3 and not e._pieces
    finally:
        e.close()


def test_overlapping_read_checks_the_record_then_opens_it_anew(tmp_path):
    path, data, spans, crcs = records(tmp_path)
    e = endpoint(path, spans, crcs)
    try:
        lo, _ = spans[0]
        for a, b in ((lo + 10, lo + 60), (lo + 40, lo + 90)):  # the second overlaps the first
            out = np.empty(b - a, dtype=np.uint8)
            e.read_into(a, out)
            assert np.array_equal(out, data[a:b])
        assert e.chunks_read == 1  # checked whole before the overlapping piece was taken
        assert e._pieces[0] == [[lo + 40, lo + 90, zlib.crc32(data[lo + 40 : lo + 90])]]
        e.finish()
        assert e.chunks_read == 2
    finally:
        e.close()


@pytest.mark.parametrize("where", ["read", "unread"])
def test_damage_is_found_read_or_not(tmp_path, where):
    lo = HEADER
    path, data, spans, crcs = records(tmp_path, flip=lo + 120)
    e = endpoint(path, spans, crcs)
    try:
        with pytest.raises(ChecksumMismatchError, match=rf"bytes \[{lo}, {lo + 300}\)"):
            if where == "read":  # pieces out of order, the damaged one among them
                for a, b in ((lo + 100, lo + 300), (lo, lo + 100)):
                    e.read_into(a, np.empty(b - a, dtype=np.uint8))
            else:  # the damaged byte lies in a gap finish() reads
                e.read_into(lo + 200, np.empty(50, dtype=np.uint8))
                e.finish()
    finally:
        e.close()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 330), st.integers(1, 120)), min_size=1, max_size=12))
def test_any_reads_then_finish_check_every_record(tmp_path_factory, reads):
    path, data, spans, crcs = records(tmp_path_factory.mktemp("p"))
    e = endpoint(path, spans, crcs)
    try:
        end, touched = spans[-1][1], set()
        for a, n in reads:
            a = HEADER + a % (end - HEADER)
            b = min(end, a + n)
            out = np.empty(b - a, dtype=np.uint8)
            e.read_into(a, out)
            assert np.array_equal(out, data[a:b])
            touched |= {i for i, (lo, hi) in enumerate(spans) if a < hi and lo < b}
        e.finish()
        assert not e._pieces
        assert e.chunks_read >= len(touched)
    finally:
        e.close()

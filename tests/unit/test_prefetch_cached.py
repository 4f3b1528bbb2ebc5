"""FileEndpoint.prefetch leaves ranges already in the page cache alone, and advises the rest."""

from __future__ import annotations

import errno
import os

import pytest

from shardstream.engine.endpoints import FileEndpoint

pytestmark = pytest.mark.skipif(
    not (hasattr(os, "RWF_NOWAIT") and hasattr(os, "posix_fadvise")), reason="Linux only"
)


@pytest.fixture
def advised(monkeypatch):
    calls = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        calls.append((offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


@pytest.fixture
def cached_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(3 << 20))  # just written: in the page cache
    with open(path, "rb") as f:
        f.read()
    return str(path)


def test_cached_range_is_not_advised(cached_file, advised):
    ep = FileEndpoint(cached_file)
    try:
        ep.prefetch(0, 3 << 20)
        ep.prefetch(1 << 20, 5)
    finally:
        ep.close()
    assert advised == []


def test_missing_page_is_advised(cached_file, advised, monkeypatch):
    real = os.preadv
    probed = []

    def miss_second_mib(fd, buffers, offset, flags=0):
        probed.append(offset)
        if flags and offset == 1 << 20:
            raise BlockingIOError(errno.EAGAIN, "would block")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", miss_second_mib)
    ep = FileEndpoint(cached_file)
    try:
        ep.prefetch(0, 3 << 20)
    finally:
        ep.close()
    assert probed[:2] == [0, 1 << 20]
    assert advised == [(0, 3 << 20, os.POSIX_FADV_WILLNEED)]


def test_no_nonblocking_reads_means_always_advise(cached_file, advised, monkeypatch):
    probes = []

    def refuse(fd, buffers, offset, flags=0):
        probes.append(offset)
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "preadv", refuse)
    ep = FileEndpoint(cached_file)
    try:
        ep.prefetch(0, 4096)
        ep.prefetch(4096, 4096)
    finally:
        ep.close()
    assert probes == [0]  # refused once: not probed again
    assert [a[:2] for a in advised] == [(0, 4096), (4096, 4096)]


def test_past_the_end_is_advised_as_before(cached_file, advised):
    ep = FileEndpoint(cached_file)
    try:
        ep.prefetch(4 << 20, 4096)
    finally:
        ep.close()
    assert [a[:2] for a in advised] == [(4 << 20, 4096)]

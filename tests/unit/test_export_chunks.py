"""Export sealing: chunk digests hashed from memory while a rank writes its stretches."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardstream.engine.checksum import digest as xxh3_digest
from shardstream.training.hf_export import _WrittenChunks


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(0, 300),
    chunk=st.sampled_from([1, 7, 16, 64]),
    header=st.integers(0, 40),
    cuts=st.lists(st.integers(0, 300), max_size=12),
    mine=st.lists(st.booleans(), min_size=13, max_size=13),
    split=st.integers(1, 50),
)
def test_chunks_inside_one_stretch_are_hashed_from_memory(size, chunk, header, cuts, mine, split):
    """The file's data is cut into pieces; this rank writes some of them, in file order, each
    possibly in several writes. Exactly the chunks inside a run of adjacent pieces it wrote
    get a digest, and each digest is that chunk's."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    edges = sorted({0, size, *(c for c in cuts if c < size)})
    pieces = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    tracker = _WrittenChunks([header], [size], chunk)
    written = np.zeros(size, dtype=bool)
    for (a, b), take in zip(pieces, mine):
        if not take:
            continue
        for lo in range(a, b, split):
            hi = min(b, lo + split)
            tracker.wrote(0, header + lo, data[lo:hi])
        written[a:b] = True

    expected = {}
    for j in range(-(-size // chunk)):
        lo, hi = j * chunk, min(size, (j + 1) * chunk)
        if written[lo:hi].all():
            expected[(0, j)] = xxh3_digest(data[lo:hi])
    assert tracker.digests == expected

"""Reading ahead while a merge plans: which byte ranges, in what order, within what budget
(pure), and the background advice itself on real files."""

from __future__ import annotations

import os

import pytest

from shardstream.engine.plan import Block, block_span, dense_block
from shardstream.engine.readahead import ranges_in_order, reading_ahead


def test_span_of_a_dense_and_a_strided_block():
    assert block_span(dense_block("f", 100, "F32", (3, 4))) == (100, 148)
    # 2 rows of 3 elements, rows 10 elements apart (a column slice of a wider tensor)
    strided = Block("f", 40, "BF16", (0, 0), (2, 3), (10, 1))
    assert block_span(strided) == (40, 40 + (10 + 2 + 1) * 2)
    assert block_span(dense_block("f", 8, "F32", (0, 4))) == (8, 8)


def test_ranges_keep_the_blocks_order_and_join_neighbours_in_a_file():
    blocks = [
        dense_block("a", 0, "U8", (100,)),
        dense_block("b", 0, "U8", (50,)),
        dense_block("a", 100, "U8", (100,)),  # right after a's first: one range
        dense_block("a", 10_000, "U8", (10,)),  # far from it: a range of its own
    ]
    assert ranges_in_order(blocks, budget=10**9, gap=16) == [
        ("a", 0, 200),
        ("b", 0, 50),
        ("a", 10_000, 10_010),
    ]


def test_ranges_stop_at_the_budget():
    blocks = [dense_block(f"f{i}", 0, "U8", (100,)) for i in range(5)]
    ranges = ranges_in_order(blocks, budget=250)
    assert ranges == [("f0", 0, 100), ("f1", 0, 100), ("f2", 0, 50)]
    assert sum(stop - start for _, start, stop in ranges) == 250
    assert ranges_in_order(blocks, budget=0) == []


def test_advice_covers_every_range_and_skips_what_cannot_be_opened(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(1 << 20))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened non-blocking: never waits for a writer
    blocks = [
        dense_block(str(tmp_path / "missing"), 0, "U8", (10,)),
        dense_block(str(fifo), 0, "U8", (10,)),
        dense_block(str(path), 0, "U8", (1 << 20,)),
    ]
    with reading_ahead(blocks, budget=1 << 30) as done:
        assert done.wait(60)  # a safety net: advice of 1 MiB takes microseconds
    assert path.read_bytes()  # the file is as it was, readable


@pytest.mark.parametrize("budget", [0, -1])
def test_no_budget_advises_nothing(budget):
    with reading_ahead([dense_block("/nonexistent", 0, "U8", (10,))], budget) as done:
        assert done.is_set()


def test_the_advice_stops_with_the_block(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"\0" * 4096)
    many = (dense_block(str(path), 0, "U8", (4096,)) for _ in range(10**12))  # endless
    empty = (dense_block(str(path), 0, "U8", (0,)) for _ in range(10**12))  # nothing to read
    for blocks in (many, empty):
        with reading_ahead(blocks, budget=1 << 60) as done:
            pass  # leaving the block stops the thread, which is joined: no hang
        assert not done.is_set()  # stopped, not finished

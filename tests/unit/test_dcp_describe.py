"""How inspect describes a DCP tensor's chunks: the chunks that hold elements, and the empty
ones FSDP2 lists for the ranks past a small tensor's end."""

from shardstream.formats.dcp import _describe


def test_empty_chunks_are_counted_apart():
    # a 3-element bias over 4 ranks: FSDP2 saves 1 + 1 + 1 + 0 rows
    bias = [((0,), (1,)), ((1,), (1,)), ((2,), (1,)), ((3,), (0,))]
    assert _describe(bias) == "3 chunks along dim 0, and 1 empty"
    # a 1-element one: one chunk holds it whole
    one = [((0,), (1,)), ((1,), (0,))]
    assert _describe(one) == "whole (1 chunk), and 1 empty"


def test_chunks_without_empty_ones():
    assert _describe([((0, 0), (4, 2))]) == "whole (1 chunk)"
    assert _describe([((0, 0), (2, 4)), ((2, 0), (2, 4))]) == "2 chunks along dim 0"
    grid = [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))]
    assert _describe(grid) == "4 chunks along dims 0, 1"

"""plan.flat_boxes: a range of row-major elements as rectangular boxes, in order."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from shardstream.engine.plan import flat_boxes


def _elements(shape, boxes) -> list[int]:
    """The flat indices the boxes cover, box by box, each box in row-major order."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    out = []
    for start, size in boxes:
        for index in itertools.product(*(range(s, s + n) for s, n in zip(start, size))):
            out.append(sum(i * st for i, st in zip(index, strides)))
    return out


SHAPES = [(7,), (3, 5), (4, 1, 6), (2, 3, 4), (1, 9), (5, 2, 3, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_range_is_covered_exactly_and_in_order(shape):
    numel = math.prod(shape)
    for begin in range(numel):
        for end in range(begin + 1, numel + 1):
            boxes = flat_boxes(shape, begin, end)
            assert _elements(shape, boxes) == list(range(begin, end)), (begin, end)
            assert all(len(s) == len(shape) and len(z) == len(shape) for s, z in boxes)


def test_box_count_stays_small():
    """A range of an n-dimensional tensor needs at most 2n - 1 boxes."""
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        begin = rng.randrange(numel)
        end = rng.randint(begin + 1, numel)
        assert len(flat_boxes(shape, begin, end)) <= 2 * len(shape) - 1


def test_whole_rows_are_one_box_and_empty_ranges_none():
    assert flat_boxes((4, 3), 3, 9) == [((1, 0), (2, 3))]
    assert flat_boxes((4, 3), 0, 12) == [((0, 0), (4, 3))]
    assert flat_boxes((4, 3), 5, 5) == []
    assert flat_boxes((), 0, 1) == [((), ())]

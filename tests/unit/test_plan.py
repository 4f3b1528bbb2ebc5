"""The pure planner: byte-range runs between blocks, checked by executing them on byte arrays.

No file is opened: a tiny interpreter below applies ``CopyRun``s to in-memory buffers, so the
plans themselves (offsets, steps, counts, element indices) are what is under test.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardstream.engine import plan
from shardstream.engine.plan import (
    Block,
    CopyRun,
    GlobalTensor,
    check_blocks_tile,
    chunk_extent,
    coalesce_runs,
    dense_block,
    plan_copy,
    row_major_strides,
    split_into_files,
)
from shardstream.errors import CheckpointFormatError

ISZ = 8  # every test tensor is int64 holding its own flat index, so values locate elements


def global_values(shape) -> np.ndarray:
    return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)


def store_block(
    memory: dict[str, np.ndarray],
    location: str,
    values: np.ndarray,
    start,
    shape,
    *,
    order=None,
    pad: int = 0,
    offset: int = 3 * ISZ,
) -> Block:
    """Put ``values[start:start+shape]`` in a fresh buffer with a chosen dim order and padding.

    ``order`` lists dims from slowest to fastest varying (default row-major); ``pad`` extra
    elements follow each fastest-dim run, so the block is genuinely non-contiguous.
    """
    ndim = len(shape)
    order = list(order) if order is not None else list(range(ndim))
    strides = [0] * ndim
    acc = 1
    for k, d in enumerate(reversed(order)):
        strides[d] = acc
        acc *= shape[d] + (pad if k == 0 else 0)
    span = acc if all(shape) else 0
    buf = np.full(offset // ISZ + span + 4, -1, dtype=np.int64)
    piece = values[tuple(slice(s, s + n) for s, n in zip(start, shape))]
    if piece.size:
        view = np.lib.stride_tricks.as_strided(
            buf[offset // ISZ :], shape=tuple(shape), strides=tuple(s * ISZ for s in strides)
        )
        view[...] = piece
    memory[location] = buf.view(np.uint8)
    return Block(location, offset, "I64", tuple(start), tuple(shape), tuple(strides))


def execute(runs, memory: dict[str, np.ndarray], writes: dict[str, np.ndarray] | None = None):
    """Apply runs byte by byte (same dtype only); count writes per destination byte."""
    for run in runs:
        assert run.src_dtype == run.dst_dtype
        src, dst = memory[run.src], memory[run.dst]
        n = run.src_run_bytes
        for i in range(run.count):
            s = run.src_offset + i * run.src_step
            d = run.dst_offset + i * run.dst_step
            assert 0 <= s and s + n <= src.nbytes, "run reads outside its source"
            assert 0 <= d and d + n <= dst.nbytes, "run writes outside its destination"
            dst[d : d + n] = src[s : s + n]
            if writes is not None:
                writes[run.dst][d : d + n] += 1


def check_elem_index(runs, memory):
    """``elem_index``/``index_step`` name the global flat index of each run's first element."""
    for run in runs:
        src = memory[run.src]
        for i in range(run.count):
            s = run.src_offset + i * run.src_step
            value = int(src[s : s + ISZ].view(np.int64)[0])
            assert value == run.elem_index + i * run.index_step


def dense_destination(memory, location, shape, start=None, offset=16):
    shape = tuple(shape)
    memory[location] = np.full(offset + math.prod(shape) * ISZ, 0xEE, dtype=np.uint8)
    return dense_block(location, offset, "I64", shape, start)


def read_dense(memory, block: Block) -> np.ndarray:
    raw = memory[block.location][block.offset : block.offset + block.numel * ISZ]
    return raw.view(np.int64).reshape(block.shape)


def merge_blocks(shape, blocks, memory):
    """Plan every block into one dense destination, execute, and return (result, write counts)."""
    dst = dense_destination(memory, "out", shape)
    runs = [r for b in blocks for r in plan_copy("t", shape, b, dst)]
    writes = {"out": np.zeros(memory["out"].nbytes, dtype=np.int64)}
    execute(runs, memory, writes)
    check_elem_index(runs, memory)
    return read_dense(memory, dst), writes["out"][dst.offset :], runs


def chunk_blocks(memory, values, dim, parts, **layout):
    shape = values.shape
    blocks = []
    for r in range(parts):
        s, n = chunk_extent(shape[dim], parts, r) if shape else (0, 0)
        start = [0] * len(shape)
        length = list(shape)
        if shape:
            start[dim], length[dim] = s, n
        blocks.append(store_block(memory, f"rank{r}", values, start, length, **layout))
    return blocks


# ---------------------------------------------------------------------------- sharded merges


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_shard0_rows_merge_uneven(parts):
    memory: dict = {}
    values = global_values((30, 5))
    blocks = chunk_blocks(memory, values, 0, parts)
    out, writes, runs = merge_blocks(values.shape, blocks, memory)
    np.testing.assert_array_equal(out, values)
    assert (writes == 1).all()
    # Row-major shards of row-major tensors are one contiguous run each.
    assert all(r.count == 1 for r in runs)
    assert len(runs) == sum(1 for b in blocks if b.numel)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_shard1_columns_become_strided_runs(parts):
    memory: dict = {}
    values = global_values((6, 10))
    blocks = chunk_blocks(memory, values, 1, parts)
    out, writes, runs = merge_blocks(values.shape, blocks, memory)
    np.testing.assert_array_equal(out, values)
    assert (writes == 1).all()
    for run in runs:
        assert run.count == 6  # one run of columns per row
        assert run.dst_step == 10 * ISZ
        assert run.index_step == 10


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_three_dims(dim):
    memory: dict = {}
    values = global_values((5, 4, 6))
    blocks = chunk_blocks(memory, values, dim, 3)
    out, writes, _ = merge_blocks(values.shape, blocks, memory)
    np.testing.assert_array_equal(out, values)
    assert (writes == 1).all()


def test_zero_dim_tensor():
    memory: dict = {}
    values = np.array(42, dtype=np.int64)
    block = store_block(memory, "rank0", values, (), ())
    dst = dense_destination(memory, "out", ())
    runs = plan_copy("scalar", (), block, dst)
    assert len(runs) == 1 and runs[0].elems == 1 and runs[0].count == 1
    execute(runs, memory)
    assert int(read_dense(memory, dst)) == 42


def test_empty_blocks_plan_nothing():
    memory: dict = {}
    values = global_values((5, 6))
    # torch.chunk gives 2/2/1/0 rows over 4 parts: the last rank holds nothing.
    blocks = chunk_blocks(memory, values, 0, 4)
    assert blocks[3].numel == 0
    dst = dense_destination(memory, "out", values.shape)
    assert plan_copy("t", values.shape, blocks[3], dst) == []
    out, writes, _ = merge_blocks(values.shape, blocks, memory)
    np.testing.assert_array_equal(out, values)


def test_empty_tensor():
    memory: dict = {}
    values = global_values((0, 4))
    block = store_block(memory, "rank0", values, (0, 0), (0, 4))
    dst = dense_destination(memory, "out", (0, 4))
    assert plan_copy("t", (0, 4), block, dst) == []


def test_rank_mismatch_is_a_format_error():
    a = dense_block("a", 0, "F32", (2, 3))
    b = dense_block("b", 0, "F32", (6,))
    with pytest.raises(CheckpointFormatError, match="'w'.*block rank"):
        plan_copy("w", (2, 3), a, b)


@pytest.mark.parametrize("order", [(1, 0), (0, 1)])
@pytest.mark.parametrize("pad", [0, 3])
def test_non_contiguous_sources(order, pad):
    """Transposed storage and padded rows (as ``.t()`` or narrow views would save them)."""
    memory: dict = {}
    values = global_values((7, 5))
    blocks = chunk_blocks(memory, values, 0, 2, order=order, pad=pad)
    out, writes, _ = merge_blocks(values.shape, blocks, memory)
    np.testing.assert_array_equal(out, values)
    assert (writes == 1).all()


def test_non_contiguous_three_dims_split_enumerates_outer_dims():
    memory: dict = {}
    values = global_values((3, 4, 5))
    blocks = chunk_blocks(memory, values, 2, 2, order=(2, 0, 1), pad=1)
    out, writes, runs = merge_blocks(values.shape, blocks, memory)
    np.testing.assert_array_equal(out, values)
    assert (writes == 1).all()


def test_contiguous_merge_collapses_to_one_run():
    memory: dict = {}
    values = global_values((4, 3, 2))
    block = store_block(memory, "r", values, (0, 0, 0), (4, 3, 2))
    dst = dense_destination(memory, "out", values.shape)
    (run,) = plan_copy("t", values.shape, block, dst)
    assert run.elems == 24 and run.count == 1


def test_size_one_dims_do_not_break_contiguity():
    memory: dict = {}
    values = global_values((1, 6, 1))
    block = store_block(memory, "r", values, (0, 0, 0), (1, 6, 1), order=(2, 1, 0))
    dst = dense_destination(memory, "out", values.shape)
    runs = plan_copy("t", values.shape, block, dst)
    assert len(runs) == 1 and runs[0].elems == 6


def test_dtype_and_offsets_scale_by_itemsize():
    # Rows 2-3 of a (4, 4) tensor, stored with one padding element per row.
    src = Block("s", 100, "F32", (2, 0), (2, 4), (5, 1))
    dst = dense_block("d", 8, "BF16", (4, 4))
    runs = plan_copy("t", (4, 4), src, dst)
    assert [(r.src_offset, r.dst_offset, r.count, r.elems) for r in runs] == [(100, 24, 2, 4)]
    (run,) = runs
    assert run.src_step == 20 and run.dst_step == 8
    assert run.src_nbytes == 32 and run.dst_nbytes == 16
    assert run.dst_end() == 24 + 8 + 8
    assert run.elem_index == 8 and run.index_step == 4
    # Without the padding the two rows are one run.
    (whole,) = plan_copy("t", (4, 4), Block("s", 100, "F32", (2, 0), (2, 4), (4, 1)), dst)
    assert (whole.count, whole.elems) == (1, 8)


# ---------------------------------------------------------------------------- resharding


def test_reshard_rows_to_columns():
    """Source sharded by rows over 3, destination by columns over 2: every pair may overlap."""
    memory: dict = {}
    values = global_values((9, 8))
    sources = chunk_blocks(memory, values, 0, 3)
    for part in range(2):
        s, n = chunk_extent(8, 2, part)
        dst = dense_destination(memory, f"dst{part}", (9, n), start=(0, s))
        runs = [r for b in sources for r in plan_copy("t", values.shape, b, dst)]
        writes = {dst.location: np.zeros(memory[dst.location].nbytes, dtype=np.int64)}
        execute(runs, memory, writes)
        check_elem_index(runs, memory)
        np.testing.assert_array_equal(read_dense(memory, dst), values[:, s : s + n])
        assert (writes[dst.location][dst.offset :] == 1).all()


layouts = st.tuples(
    st.lists(st.integers(0, 5), min_size=1, max_size=3),  # shape
    st.data(),
)


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_reshard_between_random_layouts(case):
    """Any chunked source layout copied into any chunked destination layout, exactly once."""
    shape, data = case
    shape = tuple(shape)
    ndim = len(shape)
    values = global_values(shape)
    memory: dict = {}
    src_dim = data.draw(st.integers(0, ndim - 1))
    src_parts = data.draw(st.integers(1, 4))
    order = data.draw(st.permutations(range(ndim)))
    pad = data.draw(st.integers(0, 2))
    sources = chunk_blocks(memory, values, src_dim, src_parts, order=order, pad=pad)
    check_blocks_tile("t", shape, sources)
    dst_dim = data.draw(st.integers(0, ndim - 1))
    dst_parts = data.draw(st.integers(1, 4))
    for part in range(dst_parts):
        s, n = chunk_extent(shape[dst_dim], dst_parts, part)
        start = [0] * ndim
        length = list(shape)
        start[dst_dim], length[dst_dim] = s, n
        dst = dense_destination(memory, f"dst{part}", length, start=start)
        runs = [r for b in sources for r in plan_copy("t", shape, b, dst)]
        writes = {dst.location: np.zeros(memory[dst.location].nbytes, dtype=np.int64)}
        execute(runs, memory, writes)
        check_elem_index(runs, memory)
        expected = values[tuple(slice(a, a + m) for a, m in zip(start, length))]
        np.testing.assert_array_equal(read_dense(memory, dst), expected)
        assert (writes[dst.location][dst.offset :] == 1).all()


# ---------------------------------------------------------------------------- chunk_extent


@pytest.mark.parametrize("size", [0, 1, 2, 5, 6, 7, 30, 31, 101])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 8])
def test_chunk_extent_matches_torch_chunk(size, parts):
    chunks = torch.chunk(torch.arange(size), parts) if size else ()
    expected = []
    position = 0
    for index in range(parts):
        if index < len(chunks):
            expected.append(
                (int(chunks[index][0]) if len(chunks[index]) else position, len(chunks[index]))
            )
            position += len(chunks[index])
        else:
            expected.append((size, 0))
    got = [chunk_extent(size, parts, i) for i in range(parts)]
    assert [n for _, n in got] == [n for _, n in expected]
    assert [s for s, n in got if n] == [s for s, n in expected if n]
    assert sum(n for _, n in got) == size


def test_chunk_extent_example_from_docstring():
    assert [chunk_extent(30, 4, i)[1] for i in range(4)] == [8, 8, 8, 6]
    assert [chunk_extent(5, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]


# ---------------------------------------------------------------------------- split_into_files


def hub_groups(sizes, limit):
    from huggingface_hub import split_torch_state_dict_into_shards

    names = [f"t{i:04d}" for i in range(len(sizes))]
    state = {n: torch.zeros(s, dtype=torch.uint8) for n, s in zip(names, sizes)}
    split = split_torch_state_dict_into_shards(state, max_shard_size=limit)
    position = {n: i for i, n in enumerate(names)}
    return [[position[n] for n in keys] for keys in split.filename_to_tensors.values()]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=25), st.integers(1, 100))
def test_split_into_files_matches_huggingface_hub(sizes, limit):
    assert split_into_files(sizes, limit) == hub_groups(sizes, limit)


def test_split_into_files_examples():
    assert split_into_files([], 10) == []
    assert split_into_files([4, 4, 4], 10) == [[0, 1], [2]]
    # A tensor over the limit gets a file of its own, ahead of the file being filled.
    assert split_into_files([3, 20, 3, 5], 10) == [[1], [0, 2], [3]]
    assert split_into_files([10, 10], 10) == [[0], [1]]
    assert split_into_files([0, 0, 5], 5) == [[0, 1, 2]]


# ---------------------------------------------------------------------------- check_blocks_tile


def rows(location, start, n, width=4):
    return dense_block(location, 0, "F32", (n, width), (start, 0))


def test_tiling_accepts_exact_cover_with_empty_blocks():
    check_blocks_tile("w", (5, 4), [rows("a", 0, 2), rows("b", 2, 3), rows("c", 5, 0)])


def test_tiling_rejects_block_outside_shape():
    with pytest.raises(
        CheckpointFormatError, match=r"'w'.*outside the tensor's shape \[5, 4\].*in b"
    ):
        check_blocks_tile("w", (5, 4), [rows("a", 0, 3), rows("b", 3, 3)])


def test_tiling_rejects_negative_start():
    with pytest.raises(CheckpointFormatError, match="outside"):
        check_blocks_tile("w", (5, 4), [rows("a", -1, 5)])


def test_tiling_rejects_missing_elements():
    with pytest.raises(CheckpointFormatError, match=r"'w'.*hold 12 elements.*needs 20"):
        check_blocks_tile("w", (5, 4), [rows("a", 0, 3)])


def test_tiling_rejects_overlap_with_right_count():
    # 2 + 3 rows = 5 rows, but rows 1-2 are held twice and row 4 not at all.
    with pytest.raises(CheckpointFormatError, match=r"'w'.*a and b overlap"):
        check_blocks_tile("w", (5, 4), [rows("a", 0, 2), rows("b", 1, 3)])


def cols(location, start, n, height=4):
    return dense_block(location, 0, "F32", (height, n), (0, start))


def test_tiling_rejects_overlap_along_dim_1():
    # Shard(1)-style: every block spans all rows; the overlap is in the columns.
    blocks = [cols("a", 0, 2), cols("b", 2, 2), cols("c", 3, 2), cols("d", 6, 1)]
    with pytest.raises(CheckpointFormatError, match=r"b and c overlap|c and b overlap"):
        check_blocks_tile("w", (4, 6), blocks[:3] + [cols("d", 5, 0)])
    check_blocks_tile("w", (4, 7), [cols("a", 0, 2), cols("b", 2, 2), cols("c", 4, 3)])


@pytest.mark.parametrize("sweep_budget", [16, 0])  # 0: every check goes to the grid
@settings(max_examples=300, deadline=None)
@given(
    boxes=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 4), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    )
)
def test_tiling_agrees_with_brute_force(boxes, sweep_budget):
    with mock.patch.object(plan, "SWEEP_PAIRS_PER_BLOCK", sweep_budget):
        _tiling_agrees_with_brute_force(boxes)


def _tiling_agrees_with_brute_force(boxes):
    shape = (4, 3)
    blocks = [
        dense_block(f"b{i}", 0, "F32", (h, w), (r, c)) for i, (r, c, h, w) in enumerate(boxes)
    ]
    inside = all(r + h <= 4 and c + w <= 3 for r, c, h, w in boxes)
    cells = [(r + i, c + j) for r, c, h, w in boxes for i in range(h) for j in range(w)]
    exact = inside and len(cells) == 12 and len(set(cells)) == 12
    if exact:
        check_blocks_tile("t", shape, blocks)
    else:
        with pytest.raises(CheckpointFormatError):
            check_blocks_tile("t", shape, blocks)


def staircase(n: int, overlap: bool = False) -> list[Block]:
    """An exact tiling of an [n, n] tensor by 2n column chunks: column j as rows [0, j) and
    rows [j, n) (a layout no save writes, but legal). ``overlap``: the last column's bottom
    chunk one row taller, into its top chunk, and column 1's top chunk empty, so that the
    element count still holds."""
    blocks = []
    for j in range(n):
        blocks.append(dense_block(f"top{j}", 0, "U8", (j, 1), (0, j)))
        blocks.append(dense_block(f"bottom{j}", 0, "U8", (n - j, 1), (j, j)))
    if overlap:
        blocks[-1] = dense_block(f"bottom{n - 1}", 0, "U8", (2, 1), (n - 2, n - 1))
        blocks[2] = dense_block("top1", 0, "U8", (0, 1), (0, 1))
    return blocks


def test_a_staircase_of_chunks_is_checked_in_linear_work():
    """The sweep would compare ~n^2 pairs of a staircase (its chunks all start at row 0 and
    span far); past its budget it checks on the grid instead, comparing no more pairs."""
    n = 600
    compared = 0
    overlap = plan._overlap

    def counted(a, b):
        nonlocal compared
        compared += 1
        return overlap(a, b)

    with mock.patch.object(plan, "_overlap", counted):
        check_blocks_tile("x", (n, n), staircase(n))
        assert compared <= plan.SWEEP_PAIRS_PER_BLOCK * 2 * n, compared
        with pytest.raises(
            CheckpointFormatError, match=r"'x': shards in top599 and bottom599 overlap"
        ):
            check_blocks_tile("x", (n, n), staircase(n, overlap=True))


def test_a_layout_cut_into_too_many_cells_is_refused_by_name():
    with (
        mock.patch.object(plan, "MAX_GRID_CELLS", 1000),
        mock.patch.object(plan, "SWEEP_PAIRS_PER_BLOCK", 0),
    ):
        with pytest.raises(CheckpointFormatError, match=r"'x': 199 chunks .* 10,000 cells"):
            check_blocks_tile("x", (100, 100), staircase(100))


def test_global_tensor_nbytes():
    t = GlobalTensor("w", "BF16", (3, 5), ())
    assert t.nbytes == 30
    assert row_major_strides((2, 3, 4)) == (12, 4, 1)
    assert row_major_strides(()) == ()


def _run(tensor, src_offset, dst_offset, elems, count=1, src="a", step=None):
    step = elems * 4 if step is None else step
    return CopyRun(tensor, src, src_offset, step, "F32", "out", dst_offset, elems * 2, "BF16",
                   elems, count)  # fmt: skip


def test_runs_that_continue_each_other_at_both_ends_are_joined():
    """An expert's gate and up halves: adjacent in the fused source and in the output."""
    gate, up = _run("e0.gate", 1000, 0, 6, count=4), _run("e0.up", 1096, 48, 24)
    (joined,) = coalesce_runs([gate, up])
    assert (joined.src_offset, joined.dst_offset, joined.elems, joined.count) == (1000, 0, 48, 1)
    assert joined.src_nbytes == gate.src_nbytes + up.src_nbytes
    assert joined.dst_end() == up.dst_end()


@pytest.mark.parametrize(
    "second",
    [
        _run("b", 1100, 48, 24),  # a gap in the source
        _run("b", 1096, 50, 24),  # a gap in the destination
        _run("b", 1096, 48, 24, src="other"),  # another source
        _run("b", 1096, 48, 6, count=4, step=40),  # strided rows
    ],
    ids=["source gap", "destination gap", "other source", "strided"],
)
def test_runs_that_do_not_continue_each_other_stay_apart(second):
    first = _run("a", 1000, 0, 24)
    assert coalesce_runs([first, second]) == [first, second]


def test_runs_of_a_rewritten_tensor_are_never_joined():
    runs = [_run("a", 1000, 0, 24), _run("b", 1096, 48, 24), _run("c", 1192, 96, 24)]
    assert coalesce_runs(runs, apart={"b"}) == runs
    assert len(coalesce_runs(runs)) == 1


def test_the_same_dense_box_at_both_ends_is_one_run_with_its_element_index():
    src = Block("src", 100, "F32", (2, 0), (3, 4), (4, 1))
    dst = dense_block("dst", 64, "BF16", (3, 4), (2, 0))
    (run,) = plan_copy("w", (8, 4), src, dst)
    assert (run.src_offset, run.dst_offset, run.elems, run.count) == (100, 64, 12, 1)
    assert (run.elem_index, run.src_dtype, run.dst_dtype) == (8, "F32", "BF16")
    assert plan_copy("w", (8, 4), Block("src", 0, "F32", (2, 0), (3, 0), (0, 1)), dst) == []


def test_the_same_box_strided_in_the_source_is_copied_row_by_row():
    src = Block("src", 0, "F32", (0, 0), (3, 4), (8, 1))  # rows of a wider tensor
    dst = Block("dst", 0, "F32", (0, 0), (3, 4), (8, 1))
    (run,) = plan_copy("w", (3, 4), src, dst)
    assert (run.elems, run.count, run.src_step, run.dst_step) == (4, 3, 32, 32)

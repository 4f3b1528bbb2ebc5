"""Pure planning: which byte ranges go where. No file is opened here.

Every operation (merge, save, restore, export) describes its inputs and outputs as ``Block``s,
rectangular pieces of a global tensor laid out somewhere with element strides. ``plan_copy``
intersects a source block with a destination block and returns strided ``CopyRun``s; the
executor in ``copy.py`` streams them with bounded buffers.
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..errors import CheckpointFormatError
from .dtypes import itemsize


@dataclass(frozen=True, slots=True)
class Block:
    """A rectangular block of a global tensor stored in ``location`` from byte ``offset``."""

    location: str
    offset: int
    dtype: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@functools.lru_cache(maxsize=4096)
def _shared(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One shape tuple and its strides for all the blocks of that shape (millions of blocks
    in a merge of a many-rank checkpoint share a few dozen shapes)."""
    return shape, row_major_strides(shape)


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def dense_block(
    location: str, offset: int, dtype: str, shape: Sequence[int], start: Sequence[int] | None = None
) -> Block:
    """A contiguous row-major block, e.g. a tensor in a safetensors file."""
    shape, strides = _shared(tuple(shape))
    return Block(location, offset, dtype, tuple(start or (0,) * len(shape)), shape, strides)


class GridBlocks(Sequence):
    """The blocks of a tensor split by ``torch.chunk`` along ``dim``, each stored dense and
    row-major: made when asked for, from one byte offset per part.

    A many-rank checkpoint keeps 8 bytes per part this way instead of a ``Block`` (about 300
    bytes with its tuples; docs/scaling.md). Part i, in ``paths[i]`` at ``offsets[i]``, is
    ``torch.chunk``'s part i of ``world``; trailing empty parts are left out. Reads like a tuple.
    """

    __slots__ = ("dtype", "shape", "world", "paths", "offsets", "dim")

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        world: int,
        paths: Sequence[str],
        offsets: array,
        dim: int = 0,
    ):
        self.dtype, self.shape, self.world = dtype, shape, world
        self.paths, self.offsets, self.dim = paths, offsets, dim

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        part = range(len(self))[index]  # negative indices and IndexError, as a tuple's
        start, size = chunk_extent(self.shape[self.dim], self.world, part)
        origin = [0] * len(self.shape)
        origin[self.dim] = start
        sizes = list(self.shape)
        sizes[self.dim] = size
        return dense_block(self.paths[part], self.offsets[part], self.dtype, sizes, origin)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))


@dataclass(frozen=True, slots=True)
class CopyRun:
    """``count`` runs of ``elems`` elements; run i reads ``src_offset + i*src_step`` (bytes) and
    writes ``dst_offset + i*dst_step``, converting ``src_dtype`` to ``dst_dtype``.

    ``elem_index`` is the flat row-major index in the global tensor of the first element, and
    ``index_step`` its increment per run, so hooks (such as LoRA fusion) know where they are.
    """

    tensor: str
    src: str
    src_offset: int
    src_step: int
    src_dtype: str
    dst: str
    dst_offset: int
    dst_step: int
    dst_dtype: str
    elems: int
    count: int
    elem_index: int = 0
    index_step: int = 0

    @property
    def src_run_bytes(self) -> int:
        return self.elems * itemsize(self.src_dtype)

    @property
    def dst_run_bytes(self) -> int:
        return self.elems * itemsize(self.dst_dtype)

    @property
    def dst_nbytes(self) -> int:
        return self.dst_run_bytes * self.count

    @property
    def src_nbytes(self) -> int:
        return self.src_run_bytes * self.count

    def dst_end(self) -> int:
        return self.dst_offset + (self.count - 1) * self.dst_step + self.dst_run_bytes


def _flat(run: CopyRun) -> bool:
    """Whether ``run`` reads and writes one contiguous stretch of bytes each."""
    return run.count == 1 or (
        run.src_step == run.src_run_bytes and run.dst_step == run.dst_run_bytes
    )


def coalesce_runs(runs: Sequence[CopyRun], apart: Container[str] = ()) -> list[CopyRun]:
    """``runs`` (sorted by destination offset) with each run that continues the one before
    in both its source and its destination, between the same endpoints and dtypes, joined
    to it: neighbouring tensors copied from one contiguous stretch (an expert's gate and up
    halves of a fused tensor) then move as one run. Runs of tensors in ``apart`` (rows a
    hook rewrites by their index) are never joined, nor runs of two tensors into float16
    (values it makes infinite are counted under the run's tensor)."""
    out: list[CopyRun] = []
    for run in runs:
        last = out[-1] if out else None
        if (
            last is not None
            and run.tensor not in apart
            and last.tensor not in apart
            and (run.tensor == last.tensor or run.dst_dtype != "F16")
            and (run.src, run.dst, run.src_dtype, run.dst_dtype)
            == (last.src, last.dst, last.src_dtype, last.dst_dtype)
            and _flat(last)
            and _flat(run)
            and run.dst_offset == last.dst_offset + last.dst_nbytes
            and run.src_offset == last.src_offset + last.src_nbytes
        ):
            elems = last.elems * last.count + run.elems * run.count
            out[-1] = CopyRun(
                last.tensor, last.src, last.src_offset, 0, last.src_dtype, last.dst,
                last.dst_offset, 0, last.dst_dtype, elems, 1, last.elem_index, 0,
            )  # fmt: skip
            continue
        out.append(run)
    return out


def _contiguous_from(shape: Sequence[int], strides: Sequence[int], j: int) -> bool:
    """Whether dims j.. of a block are one row-major run (size-1 dims don't matter)."""
    expected = 1
    for d in range(len(shape) - 1, j - 1, -1):
        if shape[d] != 1 and strides[d] != expected:
            return False
        expected *= shape[d]
    return True


def plan_copy(tensor: str, global_shape: Sequence[int], src: Block, dst: Block) -> list[CopyRun]:
    """Runs that copy the intersection of ``src`` and ``dst`` (both blocks of one global tensor)."""
    ndim = len(global_shape)
    if len(src.shape) != ndim or len(dst.shape) != ndim:
        raise CheckpointFormatError(
            f"tensor {tensor!r}: block rank differs from the tensor's {ndim} dims"
        )
    if src.start == dst.start and src.shape == dst.shape and src.strides == dst.strides:
        shape, strides = _shared(src.shape)
        if src.strides == strides:  # the same box, dense at both ends: one run (the common case)
            n = math.prod(shape)
            if n == 0:
                return []
            index = sum(a * st for a, st in zip(src.start, row_major_strides(global_shape)))
            return [
                CopyRun(
                    tensor,
                    src.location,
                    src.offset,
                    0,
                    src.dtype,
                    dst.location,
                    dst.offset,
                    0,
                    dst.dtype,
                    n,
                    1,
                    index,
                    0,
                )
            ]
    lo = [max(a, b) for a, b in zip(src.start, dst.start)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(src.start, src.shape, dst.start, dst.shape)]
    inter = [h - low for low, h in zip(lo, hi)]
    if any(n <= 0 for n in inter):
        return []
    src_isz, dst_isz = itemsize(src.dtype), itemsize(dst.dtype)
    src_base = src.offset + src_isz * sum(
        (a - s) * st for a, s, st in zip(lo, src.start, src.strides)
    )
    dst_base = dst.offset + dst_isz * sum(
        (a - s) * st for a, s, st in zip(lo, dst.start, dst.strides)
    )
    global_strides = row_major_strides(global_shape)
    index_base = sum(a * st for a, st in zip(lo, global_strides))

    # Smallest j such that dims j.. are one contiguous run in source and destination alike.
    j = ndim
    while (
        j > 0
        and _contiguous_from(inter, src.strides, j - 1)
        and _contiguous_from(inter, dst.strides, j - 1)
    ):
        j -= 1
    elems = math.prod(inter[j:])
    if j == 0:
        return [
            CopyRun(
                tensor,
                src.location,
                src_base,
                0,
                src.dtype,
                dst.location,
                dst_base,
                0,
                dst.dtype,
                elems,
                1,
                index_base,
                0,
            )
        ]
    # Dim j-1 becomes the repeat count; dims before it are enumerated.
    count = inter[j - 1]
    runs = []
    for outer in _indices(inter[: j - 1]):
        s_off = src_base + src_isz * sum(i * st for i, st in zip(outer, src.strides))
        d_off = dst_base + dst_isz * sum(i * st for i, st in zip(outer, dst.strides))
        idx = index_base + sum(i * st for i, st in zip(outer, global_strides))
        runs.append(
            CopyRun(
                tensor,
                src.location,
                s_off,
                src_isz * src.strides[j - 1],
                src.dtype,
                dst.location,
                d_off,
                dst_isz * dst.strides[j - 1],
                dst.dtype,
                elems,
                count,
                idx,
                global_strides[j - 1],
            )
        )
    return runs


def _indices(shape: Sequence[int]) -> Iterable[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def chunk_extent(size: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s split of ``size`` into ``parts``: (start, length) of part ``index``.

    30 rows over 4 parts is 8/8/8/6; trailing parts may be empty.
    """
    step = -(-size // parts) if parts else 0
    start = min(index * step, size)
    return start, max(0, min(step, size - start))


def split_into_files(sizes: Sequence[int], max_file_bytes: int) -> list[list[int]]:
    """Group tensors (by index, in order) into files of at most ``max_file_bytes``.

    The same rule as huggingface_hub: a tensor larger than the limit gets a file of its own;
    otherwise a new file starts when the next tensor would not fit.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index, size in enumerate(sizes):
        if size > max_file_bytes:
            groups.append([index])
            continue
        if current and current_bytes + size > max_file_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        groups.append(current)
    return groups


def check_blocks_tile(tensor: str, shape: Sequence[int], blocks: Sequence[Block]) -> None:
    """Raise unless ``blocks`` cover the global tensor exactly once."""
    for b in blocks:
        if any(s < 0 or s + n > g for s, n, g in zip(b.start, b.shape, shape)):
            raise CheckpointFormatError(
                f"tensor {tensor!r}: block at {list(b.start)} of shape {list(b.shape)} lies "
                f"outside the tensor's shape {list(shape)} (in {b.location})"
            )
    covered = sum(b.numel for b in blocks)
    total = math.prod(shape)
    if covered != total:
        raise CheckpointFormatError(
            f"tensor {tensor!r}: shards hold {covered} elements but shape {list(shape)} "
            f"needs {total}; shapes or placements disagree across ranks"
        )
    # Sweep along the dimension the blocks are split on: sorted by their start there, a block
    # can only overlap later blocks that start inside its extent, so the scan stops early.
    # Linear (after the sort) for layouts sharded along one dimension, whichever it is; a
    # layout that makes it compare many pairs (a staircase of chunks) goes to the grid.
    nonempty = [b for b in blocks if b.numel]
    if len(nonempty) < 2:
        return
    dim = max(range(len(shape)), key=lambda d: len({b.start[d] for b in nonempty}))
    nonempty.sort(key=lambda b: b.start[dim])
    budget = SWEEP_PAIRS_PER_BLOCK * len(nonempty)
    for i, a in enumerate(nonempty):
        a_end = a.start[dim] + a.shape[dim]
        for j in range(i + 1, len(nonempty)):
            b = nonempty[j]
            if b.start[dim] >= a_end:
                break
            budget -= 1
            if budget < 0:
                _check_on_grid(tensor, shape, nonempty)
                return
            if _overlap(a, b):
                _refuse_overlap(tensor, a, b)


SWEEP_PAIRS_PER_BLOCK = 16  # pairs the sweep compares per block before it takes the grid
MAX_GRID_CELLS = 1 << 24  # cells of the grid check (one byte each)


def _overlap(a: Block, b: Block) -> bool:
    return all(
        max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a.start, a.shape, b.start, b.shape)
    )


def _refuse_overlap(tensor: str, a: Block, b: Block) -> None:
    raise CheckpointFormatError(
        f"tensor {tensor!r}: shards in {a.location} and {b.location} overlap; "
        "placements disagree across ranks"
    )


def _check_on_grid(tensor: str, shape: Sequence[int], blocks: Sequence[Block]) -> None:
    """No two ``blocks`` overlap, checked on the grid their boundaries cut the tensor into:
    each block marks its cells, which no earlier block may have marked (work and memory in
    proportion to the cells). A layout cut into more than ``MAX_GRID_CELLS`` cells is
    refused: no save writes one, and checking it pair by pair takes time quadratic in its
    chunks."""
    import numpy as np

    cuts = [
        sorted({0, size} | {b.start[d] for b in blocks} | {b.start[d] + b.shape[d] for b in blocks})
        for d, size in enumerate(shape)
    ]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_GRID_CELLS:
        raise CheckpointFormatError(
            f"tensor {tensor!r}: {len(blocks)} chunks whose boundaries cut it into {cells:,} "
            f"cells (more than {MAX_GRID_CELLS:,}); too fragmented to check that no two "
            "overlap, so it is not read"
        )
    index = [{at: i for i, at in enumerate(c)} for c in cuts]
    marked = np.zeros([len(c) - 1 for c in cuts], dtype=np.bool_)
    for k, block in enumerate(blocks):
        box = tuple(
            slice(index[d][s], index[d][s + n])
            for d, (s, n) in enumerate(zip(block.start, block.shape))
        )
        cells_of_block = marked[box]
        if cells_of_block.any():
            other = next(b for b in blocks[:k] if _overlap(b, block))
            _refuse_overlap(tensor, other, block)
        cells_of_block[...] = True


@dataclass(frozen=True, slots=True)
class GlobalTensor:
    """A logical tensor of a checkpoint and the blocks that hold its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    blocks: Sequence[Block]  # a tuple, or GridBlocks

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def block_span(block: Block) -> tuple[int, int]:
    """The bytes ``[start, stop)`` of its file that ``block`` lies in (empty: no element)."""
    if not block.numel:
        return block.offset, block.offset
    last = sum((n - 1) * s for n, s in zip(block.shape, block.strides))
    return block.offset, block.offset + (last + 1) * itemsize(block.dtype)


def tensors_touching(
    named_blocks: Iterable[tuple[str, Sequence[Block]]], location: str, lo: int, hi: int
) -> list[str]:
    """Names whose blocks touch bytes [lo, hi) of ``location`` (for error messages)."""
    names = []
    for name, blocks in named_blocks:
        for block in blocks:
            if block.location != location or not block.numel:
                continue
            start, stop = block_span(block)
            if start < hi and stop > lo:
                names.append(name)
                break
    return names


def stored_at(tensor: GlobalTensor) -> tuple[str, int]:
    """Where a tensor's first block is stored: sorting by it reads each file front to back."""
    blocks = tensor.blocks
    return (blocks[0].location, blocks[0].offset) if len(blocks) else ("", 0)


def split_ranges(
    sizes: Sequence[int], parts: int, align: int, units_per_part: int = 4
) -> list[list[tuple[int, int, int]]]:
    """Cut files of ``sizes`` bytes into ``align``-aligned ranges and deal them to ``parts``.

    Returns, per part, (file index, start, end) triples; together they cover every byte once.
    ``split_ranges([10, 0], 1, 4) == [[(0, 0, 10), (1, 0, 0)]]``.
    """
    total = sum(sizes)
    unit = max(align, -(-total // max(1, parts * units_per_part)))
    unit = -(-unit // align) * align
    pieces = []
    for index, size in enumerate(sizes):
        if size == 0:
            pieces.append((index, 0, 0))
        for start in range(0, size, unit):
            pieces.append((index, start, min(size, start + unit)))
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    for n, piece in enumerate(pieces):
        out[n % parts].append(piece)
    return out


@dataclass(frozen=True, slots=True)
class TensorSlice(GlobalTensor):
    """A box of a stored global tensor seen as a tensor of its own (an expert of a fused MoE
    weight, one half of a gate_up projection): ``blocks`` are the stored blocks clipped to
    the box, in the slice's coordinates, so copying it plans byte ranges of the stored bytes.

    ``name`` is the stored tensor's; ``start`` and ``extent`` place the box in it; output dim
    k is stored dim ``dims[k]`` (None: a size-1 dim the stored tensor does not have)."""

    stored_shape: tuple[int, ...] = ()
    start: tuple[int, ...] = ()
    extent: tuple[int, ...] = ()
    dims: tuple[int | None, ...] = ()


def slice_tensor(
    tensor: GlobalTensor,
    start: Sequence[int],
    extent: Sequence[int],
    dims: Sequence[int | None],
) -> TensorSlice:
    """The box ``start``/``extent`` of ``tensor``, with output dim k taken from stored dim
    ``dims[k]``; stored dims not in ``dims`` must have extent 1 (they are dropped)."""
    shape = tuple(1 if d is None else extent[d] for d in dims)
    kept = set(dims)
    if any(extent[d] != 1 for d in range(len(extent)) if d not in kept):
        raise ValueError(f"tensor {tensor.name!r}: a dropped dim of the slice is not of size 1")
    blocks = []
    for block in blocks_in_box(tensor.blocks, start, extent):
        clipped = slice_block(block, start, extent, dims)
        if clipped is not None:
            blocks.append(clipped)
    return TensorSlice(
        tensor.name,
        tensor.dtype,
        shape,
        tuple(blocks),
        tensor.shape,
        tuple(start),
        tuple(extent),
        tuple(dims),
    )


def slice_block(
    block: Block, start: Sequence[int], extent: Sequence[int], dims: Sequence[int | None]
) -> Block | None:
    """``block`` (of a stored tensor) clipped to a box and expressed in the box's coordinates,
    dims picked by ``dims`` as in ``slice_tensor``; None when they do not meet."""
    lo, hi, skip = [], [], 0
    for a, n, s, e, stride in zip(block.start, block.shape, start, extent, block.strides):
        low, high = max(a, s), min(a + n, s + e)
        if high <= low:
            return None
        lo.append(low)
        hi.append(high)
        skip += (low - a) * stride
    starts, sizes, strides = [], [], []
    for d in dims:
        if d is None:
            starts.append(0)
            sizes.append(1)
            strides.append(1)
        else:
            starts.append(lo[d] - start[d])
            sizes.append(hi[d] - lo[d])
            strides.append(block.strides[d])
    offset = block.offset + itemsize(block.dtype) * skip
    return Block(block.location, offset, block.dtype, tuple(starts), tuple(sizes), tuple(strides))


def blocks_in_box(
    blocks: Sequence[Block], start: Sequence[int], extent: Sequence[int]
) -> Iterable[Block]:
    """The blocks that may meet the box: for a ``GridBlocks`` only the parts along its split
    dim that the box spans (a many-rank grid is not walked once per slice)."""
    if not isinstance(blocks, GridBlocks) or not len(blocks):
        return blocks
    size = blocks.shape[blocks.dim]
    step = -(-size // blocks.world) if blocks.world else 1
    lo, hi = start[blocks.dim], start[blocks.dim] + extent[blocks.dim]
    first, last = lo // step, min(len(blocks), -(-hi // step))
    return [blocks[i] for i in range(first, last)]


def flat_boxes(
    shape: Sequence[int], begin: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Pure: the (start, size) boxes that cover row-major elements ``[begin, end)`` of a tensor
    of ``shape``, in element order, so each box is a contiguous run of the range."""
    shape = tuple(shape)
    if begin >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    first, last = begin // inner, (end - 1) // inner
    lo, hi = begin - first * inner, end - last * inner  # 0 <= lo < inner, 0 < hi <= inner

    def within(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *s), (1, *z)) for s, z in flat_boxes(shape[1:], a, b)]

    if first == last:
        if lo == 0 and hi == inner:
            return [((first, *zeros), (1, *shape[1:]))]
        return within(first, lo, hi)
    boxes = within(first, lo, inner) if lo else []
    rows_from = first + 1 if lo else first
    rows_to = last + 1 if hi == inner else last
    if rows_to > rows_from:
        boxes.append(((rows_from, *zeros), (rows_to - rows_from, *shape[1:])))
    if hi != inner:
        boxes += within(last, 0, hi)
    return boxes


def flat_runs(
    shape: Sequence[int], begin: int, end: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Pure: ``flat_boxes`` with where each box starts, in elements from ``begin``: the boxes
    follow each other, so a range held contiguously holds box k at that offset."""
    at = 0
    for start, size in flat_boxes(shape, begin, end):
        yield start, size, at
        at += math.prod(size)

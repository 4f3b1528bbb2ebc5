"""torch.distributed.checkpoint plug-ins for shardstream's format (``native``): the
StorageWriter that streams each rank's items into its safetensors file, the save planner, and
the StorageReader that restores any set of ``GlobalTensor``s at any world size.

Tensors go through DCP's planners (DTensor flattening, replica dedup, resharding overlaps);
these classes move their bytes with the copy engine. See docs/format.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..engine.copy import Buffers, Streamer, stream_into_memory
from ..engine.dtypes import TORCH_BY_CODE, code_of
from ..engine.endpoints import Endpoint, FileEndpoint, OpenEndpoints, TensorEndpoint, live_block
from ..engine.plan import (
    Block,
    GlobalTensor,
    blocks_in_box,
    check_blocks_tile,
    dense_block,
    plan_copy,
)
from ..errors import CheckpointFormatError
from ..formats.native import _is_grid, item_key, rank_file
from ..formats.safetensors import build_header
from ..formats.writer import OutputTensor, WrittenFile, write_safetensors
from ..units import DEFAULT_BUFFER_BYTES, DEFAULT_CHUNK_BYTES


class StreamingWriter(StorageWriter):
    """Each rank streams its items into one safetensors file; nothing is staged whole."""

    def __init__(
        self,
        path: str | os.PathLike,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        guard: Any = None,
    ):
        super().__init__()
        self.path = Path(path)
        self.guard = guard
        self.buffer_bytes = buffer_bytes
        self.chunk_bytes = chunk_bytes
        self.metadata: Metadata | None = None
        self.results: list[list[WriteResult]] = []
        self.written: Any = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=rank_file(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = plan.storage_data
        items = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointFormatError(
                    f"state entry {item.index.fqn!r} is not a tensor; shardstream keeps "
                    "non-tensor state in JSON"
                )
            items.append((_item_key(item.index), planner.resolve_data(item).detach()))
        written = self.write_tensors(name, items)
        results = [
            WriteResult(
                index=item.index,
                size_in_bytes=item.tensor_storage_size() or 0,
                storage_data={
                    "file": name,
                    "key": _item_key(item.index),
                    "file_size": written.size,
                    "header": written.header_digest,
                },
            )
            for item in plan.items
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def write_tensors(self, name: str, items: list[tuple[str, torch.Tensor]]) -> WrittenFile:
        """Stream (key, local tensor) pairs into the rank file ``name``; nothing is staged whole."""
        outputs: list[OutputTensor] = []
        endpoints: dict[str, Endpoint] = {}
        for key, tensor in items:
            location = f"memory:{key}"
            endpoints[location] = TensorEndpoint(key, tensor)
            block = live_block(location, tensor)
            outputs.append(
                OutputTensor(
                    key, block.dtype, GlobalTensor(key, block.dtype, block.shape, (block,))
                )
            )
        lookup = endpoints.__getitem__
        window_hook = None
        if self.guard is not None:
            _, entries = build_header([(t.name, t.dtype, t.shape) for t in outputs])
            self.guard.register(
                [
                    (f"memory:{e.name}", endpoints[f"memory:{e.name}"], e.begin, e.end)
                    for e in entries
                ]
            )
            lookup, window_hook = self.guard.endpoint, self.guard.window
        streamer = Streamer(lookup, Buffers.sized(self.buffer_bytes))
        try:
            written = write_safetensors(
                str(self.path / name),
                outputs,
                streamer,
                chunk_bytes=self.chunk_bytes,
                window_hook=window_hook,
                borrow=self.guard is None,  # an async save reads live tensors only under guard
                writeback=True,  # the closing fsync then has little left to wait for
            )
        finally:
            if self.guard is not None:
                self.guard.rank_file_read()
        self.written = written
        return written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # The manifest needs more than DCP knows (objects, extra, hf files); the caller writes it.
        self.metadata = metadata
        self.results = results

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class LinearCheckSavePlanner(DefaultSavePlanner):
    """DCP's default planner with a linear tiling check in place of ``_validate_global_plan``,
    which compares chunks pairwise along each tensor's largest dimension: quadratic in the
    world size when that is not the sharded one (1.5 h on rank 0 at 8,192 ranks, see
    docs/scaling.md). Planning, dedup and metadata are DCP's own."""

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return dedup_plans(all_plans)

    def _create_global_plan(self, all_plans):
        from collections import ChainMap

        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        global_plan, metadata = create_default_global_save_plan(self._dedup_save_plans(all_plans))
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                blocks = [
                    dense_block(fqn, 0, "U8", tuple(c.sizes), tuple(c.offsets)) for c in md.chunks
                ]
                check_blocks_tile(fqn, tuple(md.size), blocks)
        return global_plan, metadata


SMALL_REPLICATED_BYTES = 64 << 10


def dedup_plans(all_plans: list[SavePlan]) -> list[SavePlan]:
    """DCP's dedup (an item several ranks hold is written once, by the least loaded of them),
    except that small items (AdamW's ``step`` scalars, norms under HSDP) all go to the lowest
    rank holding them: a restoring rank then finds them in a file or two instead of in
    hundreds of rank files, each of whose headers it would have to read."""
    from collections import defaultdict

    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    holders: dict[MetadataIndex, list[int]] = defaultdict(list)
    small: set[MetadataIndex] = set()
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders[item.index].append(rank)
            if (item.tensor_storage_size() or 0) <= SMALL_REPLICATED_BYTES:
                small.add(item.index)
    keep = {index: min(ranks) for index, ranks in holders.items() if index in small}
    trimmed = [
        dataclasses.replace(
            plan,
            items=[i for i in plan.items if i.index not in keep or keep[i.index] == rank],
        )
        for rank, plan in enumerate(all_plans)
    ]
    return dedup_save_plans(trimmed, False)


def save_planner() -> DefaultSavePlanner:
    """Ours where this torch has the hook we override, else DCP's default."""
    if hasattr(DefaultSavePlanner, "_create_global_plan") and hasattr(
        DefaultSavePlanner, "_dedup_save_plans"
    ):
        return LinearCheckSavePlanner()
    return DefaultSavePlanner()


def _item_key(index: MetadataIndex) -> str:
    return item_key(index.fqn, list(index.offset or ()))


def tensor_manifest(metadata: Metadata, results: list[list[WriteResult]]) -> tuple[dict, dict]:
    """The manifest's ``tensors`` and ``files`` sections from DCP's global metadata."""
    storage = {wr.index: wr.storage_data for rank in results for wr in rank}
    tensors: dict[str, dict] = {}
    files: dict[str, dict] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointFormatError(f"state entry {fqn!r} is not a tensor")
        chunks = []
        for chunk in md.chunks:
            info = storage[MetadataIndex(fqn, chunk.offsets)]
            chunks.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "file": info["file"],
                    "key": info["key"],
                }
            )
            files[info["file"]] = {"size": info["file_size"], "header_xxh3": info["header"]}
        entry = {"dtype": code_of(md.properties.dtype), "shape": list(md.size)}
        if _is_grid(fqn, entry["shape"], chunks, len(results)):
            entry["grid"] = len(results)
        else:
            entry["chunks"] = chunks
        tensors[fqn] = entry
    return tensors, files


def _read_block(
    endpoints: OpenEndpoints,
    streamer: Streamer,
    fqn: str,
    shape: tuple[int, ...],
    src: Block,
    start: tuple[int, ...],
    target: torch.Tensor,
) -> int:
    """Fill the part of ``target`` (which holds the global tensor's box at ``start``) that the
    source block ``src`` covers; returns the bytes read."""
    dst_name = f"target:{fqn}@{start}"
    endpoints.opened[dst_name] = TensorEndpoint(fqn, target)
    try:
        runs = plan_copy(fqn, shape, src, live_block(dst_name, target, start))
        stream_into_memory(runs, streamer)
    finally:
        del endpoints.opened[dst_name]
    return sum(r.src_nbytes for r in runs)


def read_into_boxes(
    boxes: list[tuple[str, tuple[int, ...], torch.Tensor]],
    tensors: dict[str, GlobalTensor],
    endpoint: Any = FileEndpoint,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
) -> int:
    """Fill live boxes ``(name, global start, tensor)`` from the saved ``tensors``, source
    file by file and in file order, without DCP's planner (FSDP1's flat shards are boxes no
    DTensor describes). Returns the bytes read; every byte is verified before it returns."""
    work = []
    for name, start, target in boxes:
        end = [s + n for s, n in zip(start, target.shape)]
        for src in blocks_in_box(tensors[name].blocks, start, target.shape):  # grids: a few
            if _overlaps(start, end, src):
                work.append((src.location, src.offset, name, start, target, src))
    work.sort(key=lambda w: (w[0], w[1]))
    endpoints = OpenEndpoints(endpoint)
    streamer = Streamer(endpoints, Buffers.sized(buffer_bytes, 2.0))
    read = 0
    try:
        for _, _, name, start, target, src in work:
            shape = tensors[name].shape
            read += _read_block(endpoints, streamer, name, shape, src, start, target.detach())
        endpoints.finish()
    finally:
        endpoints.close()
    return read


def _overlaps(start, end, block: Block) -> bool:
    """Whether the box [``start``, ``end``) and ``block`` share an element."""
    return all(s < b + n and b < e for s, e, b, n in zip(start, end, block.start, block.shape))


def saved_boxes_equal(
    a: str,
    b: str,
    start: tuple[int, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    tensors: dict[str, GlobalTensor],
    endpoint: Any = FileEndpoint,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
) -> bool:
    """Whether saved tensors ``a`` and ``b``, cast to ``dtype``, hold the same bytes in the
    box (``start``, ``shape``): read a window of each at a time, through separate endpoints so
    that each tensor is read in its own order; every byte read is verified."""
    item = torch.empty((), dtype=dtype).element_size()
    limit = max(1, buffer_bytes // (2 * item))
    per_tensor = {name: OpenEndpoints(endpoint) for name in (a, b)}
    buffers = Buffers.sized(buffer_bytes, 2.0)  # used by one read at a time
    streamers = {n: Streamer(e, buffers) for n, e in per_tensor.items()}
    try:
        for w_start, w_shape in box_windows(start, shape, limit):
            end = [s + n for s, n in zip(w_start, w_shape)]
            held = []
            for name in (a, b):
                window = torch.empty(w_shape, dtype=dtype)
                for src in blocks_in_box(tensors[name].blocks, w_start, w_shape):
                    if _overlaps(w_start, end, src):
                        _read_block(
                            per_tensor[name],
                            streamers[name],
                            name,
                            tensors[name].shape,
                            src,
                            w_start,
                            window,
                        )
                held.append(window.reshape(-1).view(torch.uint8))
            if not torch.equal(*held):
                return False
        for endpoints in per_tensor.values():
            endpoints.finish()
    finally:
        for endpoints in per_tensor.values():
            endpoints.close()
    return True


def box_windows(
    start: tuple[int, ...], shape: tuple[int, ...], limit: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The box (``start``, ``shape``) as sub-boxes of at most ``limit`` elements (>= 1) that
    follow one another in row-major order."""
    if not shape or math.prod(shape) <= limit:
        return [(tuple(start), tuple(shape))]
    inner = math.prod(shape[1:])
    if inner <= limit:
        rows = limit // inner
        return [
            ((start[0] + r, *start[1:]), (min(rows, shape[0] - r), *shape[1:]))
            for r in range(0, shape[0], rows)
        ]
    return [
        ((start[0] + r, *s), (1, *n))
        for r in range(shape[0])
        for s, n in box_windows(start[1:], shape[1:], limit)
    ]


class StreamingReader(StorageReader):
    """Presents any set of ``GlobalTensor``s to DCP's load planner and streams the reads."""

    def __init__(
        self,
        tensors: dict[str, GlobalTensor],
        endpoint: Any = FileEndpoint,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ):
        super().__init__()
        self.tensors = tensors
        self.make_endpoint = endpoint
        self.buffer_bytes = buffer_bytes
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        state, storage = {}, {}
        for fqn, tensor in self.tensors.items():
            chunks = []
            for block in tensor.blocks:
                chunks.append(
                    ChunkStorageMetadata(torch.Size(block.start), torch.Size(block.shape))
                )
                storage[MetadataIndex(fqn, torch.Size(block.start))] = block
            state[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=TORCH_BY_CODE[tensor.dtype]),
                torch.Size(tensor.shape),
                chunks,
            )
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a, **k) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        endpoints = OpenEndpoints(self.make_endpoint)
        streamer = Streamer(endpoints, Buffers.sized(self.buffer_bytes, 2.0))
        items = sorted(
            plan.items,
            key=lambda r: (
                self.storage[r.storage_index].location,
                self.storage[r.storage_index].offset,
            ),
        )
        try:
            for req in items:
                if req.type == LoadItemType.BYTE_IO:
                    raise CheckpointFormatError(f"entry {req.dest_index.fqn!r} is not a tensor")
                src: Block = self.storage[req.storage_index]
                fqn = req.storage_index.fqn
                target = planner.resolve_tensor(req).detach()
                start = tuple(s + o for s, o in zip(src.start, req.storage_offsets))
                shape = self.tensors[fqn].shape
                self.bytes_read += _read_block(endpoints, streamer, fqn, shape, src, start, target)
                planner.commit_tensor(req, target)
            endpoints.finish()  # every byte read is verified before the load returns
        finally:
            endpoints.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

"""Rank-local save planning for the common FSDP2 layout: no plans gathered to rank 0.

When every tensor of the state is either a ``Shard(0)`` DTensor over the whole process group
(FSDP2 on a 1-D mesh), a ``(Replicate(), Shard(0))`` one (HSDP: the first replica writes), or
a plain tensor (a replica, written once by rank 0), each rank already knows what it writes
(its ``torch.chunk`` rows, under the key DCP would give them) and rank 0 knows the whole
manifest: grid entries, O(tensors). DCP's global plan would gather every rank's plan and
write results to rank 0 and walk them, O(ranks × tensors) there (docs/scaling.md: 10 min and
21 GiB at 8,192 ranks). Any other layout (``Shard(1)``, other meshes, uneven splits, empty
dimensions) goes through DCP's planner as before; ranks agree on the path with one small
gather, so they never take different ones.

FSDP1's flat shards (``fsdp1_shards.FlatShard``) are written rank-locally too, box by box;
their boxes depend on how each unit's flat parameter was cut, so rank 0 learns every rank's
boxes from that same gather (``flat_boxes_held``) to write their chunks into the manifest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..engine.checksum import digest
from ..engine.dtypes import code_of
from ..engine.plan import chunk_extent
from ..errors import UsageError
from ..formats.native import _is_grid, item_key, rank_file, whole_chunk
from .fsdp1_shards import FlatShard

# A rank's FSDP1 boxes: (name, dtype code, global shape, start, size)
Boxes = list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def _shard_group(tensor, rank: int, world: int) -> tuple[int, int, bool] | None:
    """(shard-group size, this rank's index in it, whether this rank writes) for a DTensor
    sharded as FSDP2 (``Shard(0)`` on a 1-D mesh) or HSDP (``(Replicate(), Shard(0))`` on a
    (replicas, shards) mesh whose first replica is ranks 0..shards-1, which write); else None."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.mesh.flatten().tolist() != list(range(world)):
        return None
    if mesh.ndim == 1 and placements == (Shard(0),):
        return (world, rank, True) if mesh.get_local_rank() == rank else None
    if mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
        replica, shard = mesh.get_local_rank(0), mesh.get_local_rank(1)
        shards = mesh.size(1)
        return (shards, shard, replica == 0) if replica * shards + shard == rank else None
    return None


def local_items(
    tensors: Mapping[str, torch.Tensor], rank: int, world: int
) -> list[tuple[str, torch.Tensor]] | None:
    """(file key, local tensor) for what this rank writes, or None if some tensor's layout is
    not one that rank-local planning covers."""
    from torch.distributed.tensor import DTensor

    items = []
    for fqn, tensor in tensors.items():
        shape = list(tensor.shape)
        if isinstance(tensor, FlatShard):  # every rank writes its boxes
            items.extend((item_key(fqn, list(start)), view) for start, view in tensor.pieces)
            continue
        if 0 in shape:
            return None
        if isinstance(tensor, DTensor):
            group = _shard_group(tensor, rank, world)
            if group is None or not shape:
                return None
            shards, index, writes = group
            start, rows = chunk_extent(shape[0], shards, index)
            local = tensor.to_local().detach()
            if list(local.shape) != [rows, *shape[1:]]:
                return None
            if rows and writes:  # rank ``index`` of the first replica: rank_file(index)
                items.append((item_key(fqn, [start] + [0] * (len(shape) - 1)), local))
        elif type(tensor) is torch.Tensor or isinstance(tensor, torch.nn.Parameter):
            if rank == 0:
                items.append((item_key(fqn, [0] * len(shape)), tensor.detach()))
        else:
            return None
    return items


def flat_boxes_held(tensors: Mapping[str, torch.Tensor]) -> Boxes:
    """Each box of this rank's FSDP1 flat shards, with its tensor's dtype and shape."""
    return [
        (fqn, code_of(tensor.dtype), tuple(tensor.shape), start, tuple(view.shape))
        for fqn, tensor in tensors.items()
        if isinstance(tensor, FlatShard)
        for start, view in tensor.pieces
    ]


def layout_signature(tensors: Mapping[str, torch.Tensor]) -> str:
    """What every rank must agree on before planning alone: names, global shapes, dtypes and
    the shard-group size of each sharded tensor."""
    layout = sorted(
        (k, list(t.shape), str(t.dtype), _grid(t))
        for k, t in tensors.items()
        if not isinstance(t, FlatShard)  # ranks hold different ones; their boxes tell
    )
    return digest(repr(layout).encode())


def _grid(tensor: torch.Tensor) -> int | None:
    """The shard-group size of a sharded tensor (its grid), None for a plain one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    mesh = tensor.device_mesh
    return mesh.size(mesh.ndim - 1)


def manifest_tensors(
    tensors: Mapping[str, torch.Tensor], world: int, boxes: list[Boxes] | None = None
) -> dict[str, dict]:
    """The manifest's ``tensors`` section for a state planned by ``local_items``; ``boxes``:
    every rank's ``flat_boxes_held``, in rank order."""
    layout = [
        (fqn, list(t.shape), code_of(t.dtype), _grid(t))
        for fqn, t in tensors.items()
        if not isinstance(t, FlatShard)
    ]
    section = manifest_entries(layout, world)
    section.update(flat_entries(boxes or []))
    return section


def flat_entries(boxes: list[Boxes]) -> dict[str, dict]:
    """Pure: manifest entries of FSDP1 tensors from every rank's boxes; raises naming a tensor
    whose boxes disagree on dtype or shape, or do not add up to it."""
    section: dict[str, dict] = {}
    covered: dict[str, int] = {}
    for rank, held in enumerate(boxes):
        for fqn, dtype, shape, start, size in held:
            entry = section.setdefault(fqn, {"dtype": dtype, "shape": list(shape), "chunks": []})
            if (entry["dtype"], entry["shape"]) != (dtype, list(shape)):
                raise UsageError(
                    f"{fqn}: rank {rank} holds it as {dtype} {list(shape)}, another rank as "
                    f"{entry['dtype']} {entry['shape']}; nothing was written"
                )
            entry["chunks"].append(
                {
                    "offsets": list(start),
                    "sizes": list(size),
                    "file": rank_file(rank),
                    "key": item_key(fqn, list(start)),
                }
            )
            covered[fqn] = covered.get(fqn, 0) + math.prod(size)
    for fqn, entry in section.items():
        if covered[fqn] != math.prod(entry["shape"]):
            raise UsageError(
                f"{fqn}: the ranks' FSDP1 shards hold {covered[fqn]} of its "
                f"{math.prod(entry['shape'])} elements; nothing was written"
            )
    return section


def manifest_entries(
    layout: list[tuple[str, list[int], str, int | None]], world: int
) -> dict[str, dict]:
    """Pure: (name, global shape, dtype code, grid or None) per tensor -> ``tensors`` section.

    A sharded tensor is a grid entry over its shard group (ranks 0..grid-1 hold the rows); a
    plain one is a single chunk in rank 0's file (a grid too at world size 1)."""
    section = {}
    for fqn, shape, dtype, grid in layout:
        entry: dict = {"dtype": dtype, "shape": shape}
        if grid is not None:
            entry["grid"] = grid
        else:
            chunk = whole_chunk(shape, rank_file(0), item_key(fqn, [0] * len(shape)))
            if _is_grid(fqn, shape, [chunk], world):
                entry["grid"] = world
            else:
                entry["chunks"] = [chunk]
        section[fqn] = entry
    return section

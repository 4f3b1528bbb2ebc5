"""Rank-local save planning for the common FSDP2 layout: no plans gathered to rank 0.

When every tensor of the state is either a ``Shard(0)`` DTensor over the whole process group
(FSDP2 on a 1-D mesh) or a plain tensor (a replica, written once by rank 0), each rank already
knows what it writes (its ``torch.chunk`` rows, under the key DCP would give them) and rank 0
knows the whole manifest: grid entries, O(tensors). DCP's global plan would gather every
rank's plan and write results to rank 0 and walk them, O(ranks × tensors) there
(docs/scaling.md: 10 min and 21 GiB at 8,192 ranks). Any other layout (HSDP, ``Shard(1)``,
uneven splits, empty dimensions) goes through DCP's planner as before; ranks agree on the path
with one small gather, so they never take different ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..checksum import digest
from ..dtypes import code_of
from ..plan import chunk_extent
from .native import _is_grid, rank_file


def _key(fqn: str, offsets: list[int]) -> str:
    return f"{fqn}@{','.join(map(str, offsets))}"


def local_items(
    tensors: Mapping[str, torch.Tensor], rank: int, world: int
) -> list[tuple[str, torch.Tensor]] | None:
    """(file key, local tensor) for what this rank writes, or None if some tensor's layout is
    not one that rank-local planning covers."""
    from torch.distributed.tensor import DTensor, Shard

    items = []
    for fqn, tensor in tensors.items():
        shape = list(tensor.shape)
        if 0 in shape:
            return None
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if (
                mesh.ndim != 1
                or mesh.size() != world
                or mesh.get_local_rank() != rank
                or tuple(tensor.placements) != (Shard(0),)
            ):
                return None
            start, rows = chunk_extent(shape[0], world, rank)
            local = tensor.to_local().detach()
            if list(local.shape) != [rows, *shape[1:]]:
                return None
            if rows:
                items.append((_key(fqn, [start] + [0] * (len(shape) - 1)), local))
        elif type(tensor) is torch.Tensor or isinstance(tensor, torch.nn.Parameter):
            if rank == 0:
                items.append((_key(fqn, [0] * len(shape)), tensor.detach()))
        else:
            return None
    return items


def layout_signature(tensors: Mapping[str, torch.Tensor]) -> str:
    """What every rank must agree on before planning alone: names, global shapes, dtypes."""
    layout = sorted((k, list(t.shape), str(t.dtype)) for k, t in tensors.items())
    return digest(repr(layout).encode())


def manifest_tensors(tensors: Mapping[str, torch.Tensor], world: int) -> dict[str, dict]:
    """The manifest's ``tensors`` section for a state planned by ``local_items``."""
    from torch.distributed.tensor import DTensor

    layout = [
        (fqn, list(t.shape), code_of(t.dtype), isinstance(t, DTensor)) for fqn, t in tensors.items()
    ]
    return manifest_entries(layout, world)


def manifest_entries(layout: list[tuple[str, list[int], str, bool]], world: int) -> dict[str, dict]:
    """Pure: (name, global shape, dtype code, sharded) per tensor -> the ``tensors`` section.

    A sharded tensor is a grid entry; a plain one is a single chunk in rank 0's file (a grid
    too at world size 1)."""
    section = {}
    for fqn, shape, dtype, sharded in layout:
        entry: dict = {"dtype": dtype, "shape": shape}
        if sharded:
            entry["grid"] = world
        else:
            offsets = [0] * len(shape)
            chunk = {
                "offsets": offsets,
                "sizes": shape,
                "file": rank_file(0),
                "key": _key(fqn, offsets),
            }
            if _is_grid(fqn, shape, [chunk], world):
                entry["grid"] = world
            else:
                entry["chunks"] = [chunk]
        section[fqn] = entry
    return section

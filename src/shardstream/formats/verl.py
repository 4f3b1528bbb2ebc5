"""Source: verl's FSDP checkpoint layout (``model_world_size_{W}_rank_{r}.pt`` files).

Each rank file holds ``model.state_dict()`` of one rank. FSDP2 values are DTensors with global
shapes and placements on a ("fsdp",) or ("ddp", "fsdp") mesh; plain tensors are replicas.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ..plan import Block, GlobalTensor, check_blocks_tile, chunk_extent
from .torch_pt import load_layout, local_layout

MODEL_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
FSDP_CONFIG = "fsdp_config.json"
HF_SUBDIR = "huggingface"


@dataclass
class VerlCheckpoint:
    directory: Path
    world_size: int
    fsdp_version: int | None
    tensors: list[GlobalTensor]
    placements: dict[str, str]
    mesh: str
    files: list[str]
    replicas: dict[str, list[Block]] = field(default_factory=dict)

    @property
    def format(self) -> str:
        return "verl"

    def config_dir(self) -> Path | None:
        """Where config.json and tokenizer files live (``huggingface/``, or the dir itself)."""
        for candidate in (self.directory / HF_SUBDIR, self.directory):
            if (candidate / "config.json").is_file():
                return candidate
        return None


def is_verl_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and any(MODEL_FILE.match(p.name) for p in directory.iterdir())


def _rank_files(directory: Path) -> tuple[int, list[str]]:
    found: dict[int, dict[int, str]] = {}
    for entry in directory.iterdir():
        match = MODEL_FILE.match(entry.name)
        if match:
            found.setdefault(int(match[1]), {})[int(match[2])] = str(entry)
    if not found:
        raise CheckpointNotFoundError(
            f"{directory}: no model files (expected model_world_size_W_rank_R.pt)"
        )
    if len(found) > 1:
        sizes = ", ".join(str(w) for w in sorted(found))
        raise CheckpointFormatError(
            f"{directory}: model files from several world sizes ({sizes}); keep one set"
        )
    ((world_size, ranks),) = found.items()
    config = directory / FSDP_CONFIG
    if config.is_file():
        try:
            declared = json.loads(config.read_text()).get("world_size")
        except (ValueError, AttributeError) as exc:
            raise CheckpointFormatError(f"{config}: not valid JSON ({exc})") from None
        if declared is not None and declared != world_size:
            raise CheckpointFormatError(
                f"{config}: says world_size {declared}, but the model files are named for "
                f"world size {world_size}"
            )
    missing = [r for r in range(world_size) if r not in ranks]
    if missing:
        names = ", ".join(f"model_world_size_{world_size}_rank_{r}.pt" for r in missing[:4])
        raise CheckpointNotFoundError(f"{directory}: missing rank file(s): {names}")
    extra = sorted(r for r in ranks if r >= world_size)
    if extra:
        raise CheckpointFormatError(
            f"{directory}: rank {extra[0]} file exists but world size is {world_size}"
        )
    return world_size, [ranks[r] for r in range(world_size)]


def _mesh_coordinate(mesh, rank: int, path: str) -> tuple[int, ...]:
    shape = tuple(mesh.shape)
    coordinate = getattr(mesh, "_coordinate_on_dim", None)
    saved_rank = getattr(mesh, "_rank", rank)
    if saved_rank != rank:
        raise CheckpointFormatError(
            f"{path}: file is named for rank {rank} but was saved by rank {saved_rank}"
        )
    if coordinate is None:
        rank_map = getattr(mesh, "_flatten_rank_map", None) or tuple(range(math.prod(shape)))
        flat = list(rank_map).index(rank)
        coordinate = []
        for size in reversed(shape):
            coordinate.append(flat % size)
            flat //= size
        coordinate = tuple(reversed(coordinate))
    return tuple(int(c) for c in coordinate)


def _describe_placements(placements, mesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(len(placements)))
    return ", ".join(f"{n}:{p}" for n, p in zip(names, placements))


def open_verl(directory: str | os.PathLike) -> VerlCheckpoint:
    """Read the layout of every rank file and describe each tensor as blocks of byte ranges."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    directory = Path(directory)
    world_size, files = _rank_files(directory)
    fsdp_version = None
    config = directory / FSDP_CONFIG
    if config.is_file():
        fsdp_version = json.loads(config.read_text()).get("FSDP_version")

    order: list[str] = []
    meta: dict[str, tuple] = {}
    blocks: dict[str, list[Block]] = {}
    replicas: dict[str, list[Block]] = {}
    placements: dict[str, str] = {}
    mesh_desc = "none (plain tensors)"
    for rank, path in enumerate(files):
        state = load_layout(path)
        if not isinstance(state, dict):
            raise CheckpointFormatError(
                f"{path}: expected a state dict, got {type(state).__name__}"
            )
        file_size = os.path.getsize(path)
        if rank == 0:
            order = list(state)
        elif set(state) != set(order):
            diff = sorted(set(state) ^ set(order))
            raise CheckpointFormatError(
                f"{path}: tensor names differ from rank 0's (first difference: {diff[0]!r})"
            )
        for name, value in state.items():
            if isinstance(value, DTensor):
                mesh = value.device_mesh
                local = local_layout(path, name, value._local_tensor, file_size)
                key = (local.dtype, tuple(value.shape), tuple(value.placements), tuple(mesh.shape))
                desc = _describe_placements(value.placements, mesh)
                mesh_desc = f"{tuple(mesh.shape)} {mesh.mesh_dim_names}"
                coordinate = _mesh_coordinate(mesh, rank, path)
                start, length = [0] * len(value.shape), list(value.shape)
                keep = True
                for dim, (placement, c) in enumerate(zip(value.placements, coordinate)):
                    if isinstance(placement, Shard) and type(placement) is Shard:
                        d = placement.dim
                        s, n = chunk_extent(length[d], mesh.shape[dim], c)
                        start[d] += s
                        length[d] = n
                    elif isinstance(placement, Replicate):
                        keep = keep and c == 0
                    else:
                        raise CheckpointFormatError(
                            f"{path}: tensor {name!r} has placement {placement}, which shardstream "
                            "does not support (only Shard and Replicate)"
                        )
                if tuple(length) != local.shape:
                    raise CheckpointFormatError(
                        f"{path}: tensor {name!r} holds a shard of shape {list(local.shape)}, but "
                        f"placements {desc} of global shape {list(value.shape)} give "
                        f"{length} to rank {rank}; shapes or placements disagree across ranks"
                    )
                block = local.block(path, tuple(start))
                if keep:
                    blocks.setdefault(name, []).append(block)
            elif isinstance(value, torch.Tensor):
                local = local_layout(path, name, value, file_size)
                key = (local.dtype, local.shape, "replicated")
                desc = "replicated (plain tensor)"
                block = local.block(path, (0,) * len(local.shape))
                if rank == 0:
                    blocks[name] = [block]
                else:
                    replicas.setdefault(name, []).append(block)
            else:
                raise CheckpointFormatError(
                    f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor"
                )
            if rank == 0:
                meta[name] = key
                placements[name] = desc
            elif meta[name] != key:
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} is {_show(key)} on rank {rank} but "
                    f"{_show(meta[name])} on rank 0; shapes or placements disagree across ranks"
                )
    tensors = []
    for name in order:
        dtype, shape = meta[name][0], tuple(meta[name][1])
        check_blocks_tile(name, shape, blocks[name])
        tensors.append(GlobalTensor(name, dtype, shape, tuple(blocks[name])))
    return VerlCheckpoint(
        directory, world_size, fsdp_version, tensors, placements, mesh_desc, files, replicas
    )


def _show(key: tuple) -> str:
    dtype, shape, *rest = key
    return f"{dtype}{list(shape)} {rest[0] if rest else ''}".strip()

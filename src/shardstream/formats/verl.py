"""Source: verl's FSDP checkpoint layout (``model_world_size_{W}_rank_{r}.pt`` files).

Each rank file holds ``model.state_dict()`` of one rank. FSDP2 values are DTensors with global
shapes and placements on a ("fsdp",) or ("ddp", "fsdp") mesh; plain tensors are replicas.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.dtypes import itemsize
from ..engine.endpoints import FileEndpoint
from ..engine.plan import (
    Block,
    GlobalTensor,
    GridBlocks,
    check_blocks_tile,
    chunk_extent,
    dense_block,
    flat_runs,
    row_major_strides,
    tensors_touching,
)
from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ..storage import collectives as coll
from .jsondoc import read_object
from .layout_names import describe_mesh, describe_placements
from .regular_file import check_inside, present
from .source import VERL_FILE_PATTERN as FILE_PATTERN
from .source import VERL_MODEL_FILE as MODEL_FILE
from .torch_pt import (
    DistributedTensor,
    LocalTensor,
    MeshLayout,
    Placement,
    ZipRecord,
    check_records,
    crc_checked_endpoint,
    load_layout,
    load_restricted,
    local_layout,
    numpy_globals,
    storage_records,
    zip_records,
)

FSDP_CONFIG = "fsdp_config.json"
HF_SUBDIR = "huggingface"

log = logging.getLogger(__name__)


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
    # with open_verl(keep_shard_replicas=True): each DTensor piece a replicated mesh dimension
    # stores again, beside the piece merge reads: (replica, first) per tensor
    shard_replicas: dict[str, list[tuple[Block, Block]]] = field(default_factory=dict)
    # file -> starts of zip records checked before the merge read them (check_split_records)
    checked_records: dict[str, set[int]] = field(default_factory=dict)
    mesh_layout: MeshLayout | None = None  # the saving device mesh, where DTensors record one

    @property
    def format(self) -> str:
        return "verl"

    @property
    def manifest(self) -> dict:
        return {}  # verl writes none

    @property
    def lora_settings(self) -> dict | None:
        return None  # not recorded apart: lora.lora_settings reads verl's adapter files

    @property
    def model_objects(self) -> tuple[str, ...]:
        return ()  # every model entry is a tensor

    def config_dir(self) -> Path | None:
        """Where config.json and tokenizer files live: ``huggingface/``, which verl writes
        them into (anything else under that name, a link out of the checkpoint, or one without
        config.json is refused, naming it: merged without it, the model would have no
        config), or in older layouts the directory itself."""
        from .hf import check_no_links_out
        from .regular_file import present_directory

        hf_dir = self.directory / HF_SUBDIR
        if present_directory(hf_dir, "the model's config.json and tokenizer files"):
            check_no_links_out(hf_dir, self.directory)
            if not os.path.lexists(hf_dir / "config.json"):  # read_config refuses a non-file
                raise CheckpointFormatError(
                    f"{hf_dir}: holds no config.json, which verl writes there with the "
                    "tokenizer; restore it, or name the model's config folder with "
                    "--hf_model_config_path"
                )
            return hf_dir
        if os.path.lexists(self.directory / "config.json"):
            return check_no_links_out(self.directory, self.directory)
        return None

    def endpoint(self, location: str) -> FileEndpoint:
        """A reader of one rank file that checks every zip record's CRC-32 as it reads it
        (but those ``check_split_records`` checked already)."""
        if location not in self.files:
            raise CheckpointFormatError(f"{location}: not a rank file of this checkpoint")
        done = self.checked_records.get(location, set())
        return crc_checked_endpoint(
            location,
            lambda lo, hi: tensors_touching(self._named_blocks(), location, lo, hi),
            [r for r in zip_records(location) if r.start not in done],
        )

    def check_split_records(self, tensors: Sequence[GlobalTensor]) -> None:
        """For a merge whose processes split the output: a record holds a whole saved shard,
        and a tensor not split along dim 0 has every process that writes part of it read part
        of each of its records, so each would hash them whole. Those records are checked once
        here instead, dealt out over the processes (a damaged one fails every process alike),
        and ``endpoint`` reads them unchecked after. Dim-0 grids stay checked on read."""
        wanted: dict[str, set[int]] = {}
        for tensor in tensors:
            blocks = tensor.blocks
            if isinstance(blocks, GridBlocks) and blocks.dim == 0:
                continue
            for block in blocks:
                if block.numel:
                    wanted.setdefault(block.location, set()).add(block.offset)
        error, pairs = None, set()  # (file, record) holding a block of such a tensor
        try:
            for location in sorted(wanted):
                records = zip_records(location)
                starts = [r.start for r in records]
                for offset in wanted[location]:
                    index = bisect.bisect_right(starts, offset) - 1
                    if index >= 0 and offset < records[index].end:
                        pairs.add((location, records[index]))
        except Exception as exc:  # noqa: BLE001  (every process must learn of it)
            error = exc
        coll.agree_or_raise(error, "merge")
        pairs = sorted(pairs, key=lambda pair: (pair[0], pair[1].start))
        check_dealt_out(pairs, self._named_blocks(), "merge")
        for location, record in pairs:
            self.checked_records.setdefault(location, set()).add(record.start)

    def _named_blocks(self) -> list:
        return [*((t.name, t.blocks) for t in self.tensors), *self.replicas.items()]


def check_dealt_out(
    work: Sequence[tuple[str, ZipRecord | None]], named_blocks: list, what: str
) -> None:
    """Check zip records once across the process group: item i of ``work`` (a record of a
    file, or None for all of the file's records) by process i % K. A damaged record fails
    every process alike, its error naming the tensors of ``named_blocks`` it holds."""
    mine: dict[str, list[ZipRecord] | None] = {}
    for location, record in work[coll.rank() :: coll.world()]:
        if record is None:
            mine[location] = None
        else:
            mine.setdefault(location, []).append(record)
    error = None
    try:
        for location, records in mine.items():
            check_records(
                location,
                lambda lo, hi, at=location: tensors_touching(named_blocks, at, lo, hi),
                records,
            )
    except Exception as exc:  # noqa: BLE001  (every process must learn of it)
        error = exc
    coll.agree_or_raise(error, what)


def files_by_world_size(directory: Path, kind: str) -> dict[int, dict[int, str]]:
    """verl's ``{kind}_world_size_W_rank_R.pt`` files (kind: model, optim, extra_state):
    world size -> rank -> path."""
    pattern = MODEL_FILE if kind == "model" else re.compile(FILE_PATTERN.format(kind=kind))
    found: dict[int, dict[int, str]] = {}
    for entry in directory.iterdir():
        match = pattern.match(entry.name)
        if match:
            found.setdefault(int(match[1]), {})[int(match[2])] = str(entry)
    return found


def _rank_files(directory: Path) -> tuple[int, list[str]]:
    found = files_by_world_size(directory, "model")
    if not found:
        raise CheckpointNotFoundError(
            f"{directory}: no model files (expected model_world_size_W_rank_R.pt)"
        )
    config = directory / FSDP_CONFIG
    declared = None
    if present(config):
        try:
            declared = read_object(config, "FSDP config (JSON object)").get("world_size")
        except CheckpointFormatError:
            raise
        except (ValueError, AttributeError) as exc:
            raise CheckpointFormatError(f"{config}: not valid JSON ({exc})") from None
    if len(found) > 1:
        sizes = ", ".join(str(w) for w in sorted(found))
        if type(declared) is not int or declared not in found:
            raise CheckpointFormatError(
                f"{directory}: model files from several world sizes ({sizes}), and no "
                f"{FSDP_CONFIG} names one of them; keep one set"
            )
        # A step saved again at another world size: verl reads the set its config names.
        log.warning(
            "%s: holds model files of world sizes %s; reading those of world size %d, which "
            "%s names (the others are an earlier save's: delete them)",
            directory,
            sizes,
            declared,
            FSDP_CONFIG,
        )
        found = {declared: found[declared]}
    ((world_size, ranks),) = found.items()
    if declared is not None and type(declared) is not int:
        raise CheckpointFormatError(
            f"{config}: world_size is {str(declared)[:100]!r} ({type(declared).__name__}), "
            "not a whole number"
        )
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
    files = [ranks[r] for r in range(world_size)]
    for file in files:
        check_inside(Path(file), directory)
    return world_size, files


def _mesh_coordinate(mesh: MeshLayout, rank: int, path: str) -> tuple[int, ...]:
    shape = mesh.shape
    coordinate = mesh.coordinate
    saved_rank = rank if mesh.rank is None else mesh.rank
    if saved_rank != rank:
        raise CheckpointFormatError(
            f"{path}: file is named for rank {rank} but was saved by rank {saved_rank}"
        )
    if coordinate is None:
        rank_map = mesh.rank_map or tuple(range(math.prod(shape)))
        flat = list(rank_map).index(rank)
        coordinate = []
        for size in reversed(shape):
            coordinate.append(flat % size)
            flat //= size
        coordinate = tuple(reversed(coordinate))
    return tuple(int(c) for c in coordinate)


def open_verl(
    directory: str | os.PathLike, *, shared: bool = False, keep_shard_replicas: bool = False
) -> VerlCheckpoint:
    """Read the layout of every rank file and describe each tensor as blocks of byte ranges.

    ``shared``: every process of the current group calls this together and each unpickles
    a share of the rank files (a ``--distributed`` merge, a restore). ``keep_shard_replicas``:
    also note the pieces of DTensors that replicated mesh dimensions (HSDP's ``ddp``) store
    again, which merge does not read (verify compares them).
    """
    directory = Path(directory)
    world_size, files = _rank_files(directory)
    fsdp_version = None
    config = directory / FSDP_CONFIG
    if present(config):
        fsdp_version = read_object(config, "FSDP config (JSON object)").get("FSDP_version")
    layout = read_rank_layouts(files, _model_state, shared, keep_shard_replicas=keep_shard_replicas)
    return VerlCheckpoint(
        directory,
        world_size,
        fsdp_version,
        layout.tensors,
        layout.placements,
        layout.mesh,
        files,
        layout.replicas,
        layout.shard_replicas,
        mesh_layout=layout.mesh_layout,
    )


def _model_state(state: dict, path: str) -> dict:
    """A model file's state dict, whose keys must be tensor names."""
    for name in state:
        if not isinstance(name, str):
            raise CheckpointFormatError(
                f"{path}: state dict key {name!r} is a {type(name).__name__}, not a tensor name"
            )
    return state


@dataclass
class RankLayouts:
    tensors: list[GlobalTensor]
    placements: dict[str, str]
    mesh: str
    replicas: dict[str, list[Block]]
    scalars: dict[str, object] = field(default_factory=dict)  # with keep_scalars
    shard_replicas: dict[str, list[tuple[Block, Block]]] = field(default_factory=dict)
    mesh_layout: MeshLayout | None = None


def _grid_part(
    value: _Entry, local, coordinate: tuple[int, ...], path: str, part_paths: dict
) -> tuple[int, int, int, list[str]] | None:
    """(tensor dim, parts, part index, shared path list) when this rank's piece can join a
    grid: one Shard over the mesh, Replicate elsewhere, stored dense and row-major."""
    shards = [(m, p.dim) for m, p in enumerate(value.placements) if p.kind == "Shard"]
    dense = local.strides == row_major_strides(local.shape) or 0 in local.shape
    if len(shards) != 1 or not dense:
        return None
    (mesh_dim, dim), parts = shards[0], value.mesh.shape[shards[0][0]]
    index = coordinate[mesh_dim]
    paths = part_paths.setdefault((mesh_dim, value.mesh.shape), [])
    if len(paths) == index:  # the first tensor that meets this rank's part notes its file
        paths.append(path)
    if index >= len(paths) or paths[index] != path:
        return None
    return dim, parts, index, paths


@dataclass(frozen=True)
class _Entry:
    """One state-dict entry of a rank file, located in it. Plain data, so ranks can share it."""

    local: LocalTensor
    shape: tuple[int, ...] | None = None  # the global shape of a DTensor; None: a plain tensor
    placements: tuple[Placement, ...] = ()
    mesh: MeshLayout | None = None


def read_entries(
    path: str, flatten, keep_scalars: bool = False
) -> tuple[dict[str, _Entry], dict[str, object]]:
    """Unpickle one rank file's layout and locate each of its tensors; other values are an
    error, or with ``keep_scalars`` returned beside them."""
    state = load_layout(path)
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"{path}: expected a state dict, got {type(state).__name__}")
    state = flatten(state, path)
    file_size = os.path.getsize(path)
    records = storage_records(path)
    entries, scalars = {}, {}
    for name, value in state.items():
        if isinstance(value, DistributedTensor):
            local = local_layout(path, name, value.local, file_size, records)
            entries[name] = _Entry(local, value.shape, value.placements, value.mesh)
        elif isinstance(value, torch.Tensor):
            entries[name] = _Entry(local_layout(path, name, value, file_size, records))
        elif keep_scalars:
            scalars[name] = value
        else:
            raise CheckpointFormatError(
                f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor"
            )
    return entries, scalars


def read_rank_layouts(
    files: list[str],
    flatten,
    shared: bool = False,
    keep_scalars: bool = False,
    keep_shard_replicas: bool = False,
) -> RankLayouts:
    """Blocks of every tensor over all rank files; ``flatten(obj, path)`` gives name -> value.

    A DTensor split along one dimension keeps one offset per rank (``GridBlocks``) while every
    piece is dense; any other layout keeps a ``Block`` per piece. ``shared``: the processes
    of the current group (a ``--distributed`` merge, a restore) split the unpickling of the files
    (``collectives.in_turns``).
    ``keep_shard_replicas``: ``shard_replicas`` pairs each DTensor
    piece stored at a replicated mesh coordinate other than 0 with the piece read in its place.
    """
    order: list[str] = []
    meta: dict[str, tuple] = {}
    blocks: dict[str, list[Block]] = {}
    grids: dict[str, GridBlocks] = {}  # while every piece so far is the grid's next one
    part_paths: dict[tuple, list[str]] = {}
    replicas: dict[str, list[Block]] = {}
    placements: dict[str, str] = {}
    last_mesh: MeshLayout | None = None
    scalars: dict[str, object] = {}
    firsts: dict[tuple[str, tuple[int, ...]], Block] = {}
    shard_replicas: dict[str, list[tuple[Block, Block]]] = {}

    def read(_: int, path: str):
        return read_entries(path, flatten, keep_scalars)

    for rank, path, (state, file_scalars) in coll.in_turns(files, read, shared):
        scalars.update(file_scalars)
        if rank == 0:
            order = list(state)
        elif set(state) != set(order):
            diff = sorted(set(state) ^ set(order))
            raise CheckpointFormatError(
                f"{path}: tensor names differ from rank 0's (first difference: {diff[0]!r})"
            )
        for name, entry in state.items():
            local = entry.local
            if entry.shape is not None:
                mesh = entry.mesh
                key = (local.dtype, entry.shape, entry.placements, mesh.shape)
                desc = describe_placements(mesh.dim_names, [str(p) for p in entry.placements])
                last_mesh = mesh
                coordinate = _mesh_coordinate(mesh, rank, path)
                start, length = [0] * len(entry.shape), list(entry.shape)
                keep = True
                if len(entry.placements) != len(mesh.shape):
                    raise CheckpointFormatError(
                        f"{path}: tensor {name!r} has {len(entry.placements)} placement(s) "
                        f"({', '.join(map(str, entry.placements)) or 'none'}) for a "
                        f"{len(mesh.shape)}-D device mesh; a DTensor has one per mesh dimension"
                    )
                for dim, (placement, c) in enumerate(zip(entry.placements, coordinate)):
                    if placement.kind == "Shard" and 0 <= placement.dim < len(length):
                        d = placement.dim
                        s, n = chunk_extent(length[d], mesh.shape[dim], c)
                        start[d] += s
                        length[d] = n
                    elif placement.kind == "Replicate":
                        keep = keep and c == 0
                    elif placement.kind == "Shard":
                        raise CheckpointFormatError(
                            f"{path}: tensor {name!r} is sharded along dimension "
                            f"{placement.dim}, which its {len(length)}-D global shape "
                            f"{list(entry.shape)} does not have"
                        )
                    else:
                        raise CheckpointFormatError(
                            f"{path}: tensor {name!r} has placement {placement}, which shardstream "
                            "does not support (only Shard and Replicate)"
                        )
                if tuple(length) != local.shape:
                    raise CheckpointFormatError(
                        f"{path}: tensor {name!r} holds a shard of shape {list(local.shape)}, but "
                        f"placements {desc} of global shape {list(entry.shape)} give "
                        f"{length} to rank {rank}; shapes or placements disagree across ranks"
                    )
                if keep:
                    part = _grid_part(entry, local, coordinate, path, part_paths)
                    _add_piece(name, entry.shape, local, tuple(start), path, part, blocks, grids)
                if keep_shard_replicas and "Replicate" in {p.kind for p in entry.placements}:
                    piece = local.block(path, tuple(start))
                    if keep:
                        firsts[(name, piece.start)] = piece
                    elif (name, piece.start) in firsts:
                        first = firsts[(name, piece.start)]
                        shard_replicas.setdefault(name, []).append((piece, first))
            else:
                key = (local.dtype, local.shape, "replicated")
                desc = "replicated (plain tensor)"
                block = local.block(path, (0,) * len(local.shape))
                if rank == 0:
                    blocks[name] = [block]
                else:
                    replicas.setdefault(name, []).append(block)
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
        parts = grids[name] if name in grids else tuple(blocks.get(name, ()))
        check_blocks_tile(name, shape, parts)
        tensors.append(GlobalTensor(name, dtype, shape, parts))
    mesh_desc = (
        describe_mesh(last_mesh.dim_names, last_mesh.shape)
        if last_mesh is not None
        else "none (plain tensors)"
    )
    return RankLayouts(
        tensors,
        placements,
        mesh_desc,
        replicas,
        scalars,
        mesh_layout=last_mesh,
        shard_replicas=shard_replicas,
    )


def _add_piece(name, shape, local, start, path, part, blocks: dict, grids: dict) -> None:
    """Note one rank's piece of a DTensor: in its grid while it fits one, else as a Block."""
    grid = grids.get(name)
    if part is not None:
        dim, parts, index, paths = part
        if index == 0 and grid is None and name not in blocks:  # the tensor's first piece
            grid = grids[name] = GridBlocks(
                local.dtype, tuple(shape), parts, paths, array("q"), dim
            )
        if grid is not None and (grid.dim, grid.world) == (dim, parts) and grid.paths is paths:
            if local.shape[dim] == 0:  # torch.chunk's trailing empty parts are left out
                return
            if index == len(grid.offsets):
                grid.offsets.append(local.offset)
                return
    if grid is not None:  # this piece breaks the pattern: a Block per piece from here on
        blocks[name] = list(grid)
        del grids[name]
    blocks.setdefault(name, []).append(local.block(path, start))


def _show(key: tuple) -> str:
    dtype, shape, *rest = key
    return f"{dtype}{list(shape)} {rest[0] if rest else ''}".strip()


# --- optimizer and extra state, for restore() at any world size -------------------------------


def optimizer_files(directory: Path, world_size: int) -> list[str]:
    files = [directory / f"optim_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointNotFoundError(f"{directory}: missing optimizer file(s): {missing[:4]}")
    return [str(check_inside(f, directory)) for f in files]


def saved_param_groups(directory: Path, world_size: int) -> tuple[list[dict], bool]:
    """The optimizer's param groups as verl saved them (``params`` are integer ids), and
    whether rank 0's state tensors are all plain (FSDP1's per-rank runs) rather than DTensors:
    ``open_verl_flat_optimizer``'s input."""
    path = optimizer_files(directory, world_size)[0]
    state = load_layout(path)
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointFormatError(f"{path}: not an optimizer state dict (no param_groups)")
    entries = state.get("state")
    values = [
        v
        for per_param in (entries.values() if isinstance(entries, dict) else ())
        if isinstance(per_param, dict)
        for v in per_param.values()
    ]
    plain = not any(isinstance(v, DistributedTensor) for v in values)
    return groups, plain


def _optimizer_entries(state: dict, path: str, known) -> list[tuple[int, dict]]:
    """(parameter id, its state) of a verl optimizer file; an id ``known`` lacks is refused."""
    entries = state.get("state")
    if not isinstance(entries, dict):
        raise CheckpointFormatError(f"{path}: not an optimizer state dict (no state)")
    for pid, values in entries.items():
        if pid not in known or not isinstance(values, dict):
            raise CheckpointFormatError(
                f"{path}: optimizer state for parameter id {pid!r}, which the model's "
                "optimizer does not have; was it built differently?"
            )
    return list(entries.items())


def open_verl_optimizer(
    directory: Path, world_size: int, names: dict[int, str], prefix: str, *, shared: bool = False
) -> tuple[list[GlobalTensor], dict[str, object]]:
    """Optimizer tensors renamed ``<prefix><fqn>.<key>`` (``names`` maps verl's ids to FQNs),
    and the non-tensor per-parameter values. ``shared``: as for ``open_verl``."""

    def flatten(state: dict, path: str) -> dict:
        out = {}
        for pid, values in _optimizer_entries(state, path, names):
            for key, value in values.items():
                flat = f"{prefix}{names[pid]}.{key}"
                if isinstance(value, torch.Tensor) and value.dim() > 0 and world_size > 1:
                    raise CheckpointFormatError(
                        f"{path}: optimizer state {names[pid]}.{key} is a plain per-rank "
                        "fragment (FSDP1 keeps flat-parameter shards), which cannot be placed "
                        "in the model; restore without 'optimizer' in load_contents (the "
                        "model and extra restore at any world size)"
                    )
                out[flat] = value
        return out

    files = optimizer_files(directory, world_size)
    layout = read_rank_layouts(files, flatten, shared, keep_scalars=True)
    return layout.tensors, layout.scalars


def flat_shard_of_ranks(mesh: MeshLayout | None, world_size: int) -> list[int]:
    """Which part of each FSDP1 flat tensor each saving rank held: its place along the last
    dim of the mesh the model's DTensors record (verl's ``("ddp", "fsdp")`` mesh of hybrid
    sharding: the ranks of one ``fsdp`` row hold the parts, the rows are replicas), or its
    rank where there is no mesh or a 1-D one."""
    if mesh is None or len(mesh.shape) < 2:
        return list(range(world_size))
    positions = mesh.rank_map or tuple(range(math.prod(mesh.shape)))
    if sorted(positions) != list(range(world_size)):
        raise CheckpointFormatError(
            f"the model's device mesh {describe_mesh(mesh.dim_names, mesh.shape)} does not "
            f"hold the {world_size} ranks that saved the checkpoint"
        )
    shard = [0] * world_size
    for position, rank in enumerate(positions):
        shard[rank] = position % mesh.shape[-1]
    return shard


def open_verl_flat_optimizer(
    directory: Path,
    world_size: int,
    segments: dict[int, list[tuple[str, tuple[int, ...], int]]],
    prefix: str,
    *,
    shared: bool = False,
    shard_of_rank: list[int] | None = None,
) -> tuple[list[GlobalTensor], dict[str, object]]:
    """verl's FSDP1 optimizer state, saved as plain per-rank parts of flat tensors, as tensors
    ``<prefix><fqn>.<key>``. Each part holds the next run of elements: part p starts where
    part p-1 ends. ``shard_of_rank``: the part each rank holds (``flat_shard_of_ranks``;
    default: its rank); the ranks after the first that hold a part are its replicas (hybrid
    sharding), read only for their sizes. ``segments`` says, by verl's parameter id, which
    parameters lie where in that flat tensor: several for a flat parameter
    (``use_orig_params=False``, the padded flat state), one at 0 for a parameter of
    ``use_orig_params=True``. A scalar (AdamW's ``step``) is rank 0's, for every parameter of
    the id. For files whose rank 0 holds plain tensors (``saved_param_groups``); a file
    holding DTensors is refused."""
    shard_of_rank = shard_of_rank or list(range(world_size))

    def raw(state: dict, path: str) -> dict:
        out = {}
        for pid, values in _optimizer_entries(state, path, segments):
            out.update({(pid, key): value for key, value in values.items()})
        return out

    files = optimizer_files(directory, world_size)
    parts: dict[tuple, list[tuple[int, str, LocalTensor]]] = {}
    scalars: dict[str, object] = {}
    read = lambda _, path: read_entries(path, raw, keep_scalars=True)  # noqa: E731
    for rank, path, (entries, file_scalars) in coll.in_turns(files, read, shared):
        if any(entry.shape is not None for entry in entries.values()):
            raise CheckpointFormatError(
                f"{path}: holds DTensors where rank 0's optimizer file holds plain per-rank "
                "parts; the ranks' optimizer files come from different saves"
            )
        for (pid, key), value in file_scalars.items():
            if rank == 0:
                scalars.update({f"{prefix}{fqn}.{key}": value for fqn, _, _ in segments[pid]})
        for name, entry in entries.items():
            parts.setdefault(name, []).append((rank, path, entry.local))
    tensors = []
    for (pid, key), every in parts.items():
        held = _first_of_each_part(every, shard_of_rank, f"{prefix}{pid}.{key}")
        _check_flat_size(directory, pid, key, segments[pid], held, len(held))
        for fqn, shape, offset in segments[pid]:
            name = f"{prefix}{fqn}.{key}"
            dtype, blocks = held[0][2].dtype, _flat_part_blocks(name, shape, offset, held)
            try:
                check_blocks_tile(name, shape if held[0][2].shape else (), blocks)
            except CheckpointFormatError as exc:
                raise CheckpointFormatError(
                    f"{directory}: verl's FSDP1 optimizer state does not fit the model's "
                    f"parameters (wrapped differently?): {exc}"
                ) from None
            tensors.append(GlobalTensor(name, dtype, shape if held[0][2].shape else (), blocks))
    return tensors, scalars


def _first_of_each_part(
    held: list[tuple[int, str, LocalTensor]], shard_of_rank: list[int], name: str
) -> list[tuple[int, str, LocalTensor]]:
    """The run of each part, from the lowest rank that holds it, as (part, file, run); the
    replicas' runs must have its size."""
    first: dict[int, tuple[int, str, LocalTensor]] = {}
    for rank, path, local in sorted(held, key=lambda h: h[0]):
        part = shard_of_rank[rank]
        if part not in first:
            first[part] = (part, path, local)
        elif local.shape != first[part][2].shape:
            raise CheckpointFormatError(
                f"{path}: optimizer state {name} holds {local.shape} where its replica "
                f"{first[part][1]} holds {first[part][2].shape}; the ranks' optimizer files "
                "come from different saves"
            )
    return [first[part] for part in sorted(first)]


def _check_flat_size(
    directory: Path,
    pid: int,
    key: str,
    segments: list[tuple[str, tuple[int, ...], int]],
    held: list[tuple[int, str, LocalTensor]],
    world_size: int,
) -> None:
    """The parts of a flat state tensor together hold the parameters ``segments`` place in
    it, and at most the padding FSDP1 adds to make it divisible by the number of parts."""
    if not held[0][2].shape:
        return  # a scalar (AdamW's step)
    total = sum(math.prod(local.shape) for _, _, local in held)
    need = max(offset + math.prod(shape) for _, shape, offset in segments)
    if not need <= total < need + world_size:
        names = ", ".join(fqn for fqn, _, _ in segments[:3])
        names += ", ..." if len(segments) > 3 else ""
        raise CheckpointFormatError(
            f"{directory}: verl's FSDP1 optimizer state {key!r} of parameter id {pid} holds "
            f"{total} elements over {world_size} parts, where the model's parameters {names} "
            f"need {need} (and less than {world_size} of padding): the run wrapped the model "
            "in other units"
        )


def _flat_part_blocks(
    name: str, shape: tuple[int, ...], offset: int, held: list[tuple[int, str, LocalTensor]]
) -> tuple[Block, ...]:
    """The blocks of the parameter at ``offset`` of a flat tensor whose consecutive runs the
    ranks hold (``held``: rank, file, where the run is), or rank 0's scalar."""
    held = sorted(held, key=lambda h: h[0])
    _, path, local = held[0]
    if not local.shape:
        return (local.block(path, ()),)
    blocks, begin = [], 0  # where each rank's run starts in the flat tensor
    for _, path, local in held:
        if len(local.shape) != 1 or local.strides != (1,):
            raise CheckpointFormatError(f"{path}: optimizer state {name} is not a flat part")
        size = local.shape[0]
        lo, hi = max(offset, begin), min(offset + math.prod(shape), begin + size)
        first = lo - begin  # where this parameter's range starts in the rank's run
        for start, extent, at in flat_runs(shape, lo - offset, hi - offset):
            byte = local.offset + (first + at) * itemsize(local.dtype)
            blocks.append(dense_block(path, byte, local.dtype, extent, start))
        begin += size
    return tuple(blocks)


def read_extra_state(directory: Path, world_size: int, rank: int, verify: bool = True) -> dict:
    """verl's extra state of ``rank`` (rank 0's beyond the saved world size): scheduler, RNG.

    Loaded with the restricted unpickler of ``load_restricted``; numpy's array reconstruction
    is admitted because verl stores numpy's RNG state. ``verify``: every zip record is checked
    against its CRC-32 first (torch checks none).
    """
    source = rank if rank < world_size else 0
    path = directory / f"extra_state_world_size_{world_size}_rank_{source}.pt"
    if not path.is_file():
        return {}
    check_inside(path, directory)
    if verify:
        check_records(str(path))
    state = load_restricted(str(path), str(path), "cpu", numpy_globals())
    return state if isinstance(state, dict) else {}

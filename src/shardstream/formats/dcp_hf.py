"""Source: what DCP's ``HuggingFaceStorageWriter`` writes.

With ``save_distributed=True`` every rank writes its own safetensors file,
``shard-{rank+1:05d}-model-{i:05d}-of-{n:05d}.safetensors``, holding its chunk of each tensor
under the tensor's name; the header's ``__metadata__["DCP_SHARDING_INFO"]`` (a JSON object)
gives each chunk's ``saved_offsets`` in the global tensor. The global shape is not written: it
is the extent the chunks cover, and they must tile it. With ``enable_consolidation=True`` the
same files go to ``sharded/`` and a plain Hugging Face model (``model-*-of-*.safetensors`` and
its index) is written beside it; that model is read as whole tensors, as is any Hugging Face
safetensors model directory (``open_hf_model``: merge re-lays it out as ``save_pretrained``
would, in the dtype and file size asked for).

Only safetensors headers are read (no pickle, no torch); tensor bytes are read later by the copy
engine, exactly the ranges needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.plan import Block, GlobalTensor, check_blocks_tile, dense_block
from ..errors import CheckpointFormatError, CheckpointNotFoundError
from . import hf, jsondoc
from .regular_file import present
from .safetensors import (
    SafetensorsHeader,
    StoredChecksums,
    entries_digest,
    range_description,
    read_header,
    stored_checksums,
)
from .source import DCP_HF_SHARD_FILE as SHARD_FILE
from .source import DCP_HF_SHARDED_SUBDIR as SHARDED_SUBDIR

if TYPE_CHECKING:
    from ..engine.endpoints import FileEndpoint

SHARDING_INFO = "DCP_SHARDING_INFO"
HF_MODEL_FORMAT = "huggingface"


def shard_files(directory: Path) -> list[Path]:
    """The per-rank files of a distributed HF save in ``directory``, by name."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if SHARD_FILE.match(p.name) and p.is_file())


@dataclass
class DcpHfCheckpoint:
    directory: Path
    world_size: int
    tensors: list[GlobalTensor]
    placements: dict[str, str]
    files: list[str]
    consolidated: bool
    replicas: dict[str, list[Block]] = field(default_factory=dict)
    prefix: str = ""  # keys are the state dict's own
    label: str = "dcp_hf"  # HF_MODEL_FORMAT: a Hugging Face model directory
    # safetensors files list their tensors by dtype and name, not in the model's order
    in_model_order = False

    @property
    def format(self) -> str:
        return self.label

    @property
    def mesh(self) -> str:
        if self.label != "dcp_hf":  # a Hugging Face model, alone or in a save without FSDP
            return "none: whole tensors (a Hugging Face model)"
        return f"not recorded ({self.world_size} rank(s) wrote files, DCP HF storage writer)"

    @property
    def fsdp_version(self) -> int | None:
        return None

    @property
    def manifest(self) -> dict:
        return {}

    @property
    def lora_settings(self) -> dict | None:
        return None

    @property
    def model_objects(self) -> tuple[str, ...]:
        return ()  # safetensors holds tensors only

    def endpoint(self, location: str) -> FileEndpoint:
        return safetensors_endpoint(location)

    def check_split_records(self, tensors: list[GlobalTensor]) -> None:
        """Nothing to check ahead of a merge: no checksums."""

    def config_dir(self) -> Path | None:
        """The directory whose config.json describes the model: its own, or for the rank files
        in ``sharded/`` of a consolidated save, the model directory above. Never another
        parent: a model directory without config.json inside a run directory would take the
        run's."""
        candidates = [self.directory]
        if self.label != HF_MODEL_FORMAT and self.directory.name == SHARDED_SUBDIR:
            candidates.append(self.directory.parent)
        for candidate in candidates:
            if (candidate / "config.json").is_file() or (candidate / "config.json").is_symlink():
                # merge copies these files: none may lead out of the directory that holds them
                return hf.check_no_links_out(candidate, link_root(candidate))
        return None


def safetensors_endpoint(location: str) -> FileEndpoint:
    """A reader of one safetensors file that checks every chunk it reads against the
    checksums shardstream wrote into its header (a model it merged or exported); a plain
    reader for other files, which carry none (DCP's, save_pretrained's)."""
    from ..engine.endpoints import FileEndpoint  # it imports torch: reading layouts needs none

    header = read_header(location)
    sums = _checked_entries(location, header)
    if sums is None:
        return FileEndpoint(location)
    return FileEndpoint(
        location,
        sums.chunks,
        header.data_start,
        sums.chunk_bytes,
        describe=lambda lo, hi: range_description(header, lo, hi),
    )


def _checked_entries(location: str, header: SafetensorsHeader) -> StoredChecksums | None:
    """The checksums shardstream recorded in ``header`` (None: none), once its tensor table
    matches their digest: names, dtypes, shapes and offsets as written."""
    sums = stored_checksums(header)
    if sums is not None and entries_digest(header.tensors.values()) != sums.entries:
        raise CheckpointFormatError(
            f"{location}: tensor table does not match its recorded digest (header altered)"
        )
    return sums


def link_root(directory: Path) -> Path:
    """Where the links of a model directory may lead: into the directory itself, or for a
    huggingface_hub cache snapshot (``<repo>/snapshots/<revision>/``, whose files are links
    to ``<repo>/blobs/``) into its repository directory."""
    real = Path(os.path.realpath(directory))
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return directory


def open_dcp_hf(directory: str | os.PathLike) -> DcpHfCheckpoint:
    """The per-rank files of ``directory`` (or of its ``sharded/``), else its consolidated
    model; tensors as blocks."""
    directory = Path(directory)
    _check_shard_names(directory)
    files = shard_files(directory)
    if files:
        return _open_sharded(directory, files)
    if hf.SINGLE_FILE in os.listdir(directory) or (directory / hf.INDEX_FILE).is_file():
        return _open_consolidated(directory)
    raise CheckpointNotFoundError(
        f"{directory}: no shard-N-model-I-of-K.safetensors files nor a consolidated model"
    )


def open_hf_model(directory: str | os.PathLike) -> DcpHfCheckpoint:
    """A Hugging Face safetensors model (``model.safetensors``, or an index and its files) as
    a source of whole tensors. No file of it may be a link out of it (``link_root``)."""
    directory = Path(directory)
    hf.check_no_links_out(directory, link_root(directory))
    return _open_consolidated(directory, HF_MODEL_FORMAT)


def _open_consolidated(directory: Path, label: str = "dcp_hf") -> DcpHfCheckpoint:
    tensors = hf.whole_tensors(hf.read_hf_model(directory)[0])
    files = sorted({b.location for t in tensors for b in t.blocks})
    headers = {path: read_header(Path(path)) for path in files}
    for path, header in headers.items():  # a table altered under its digest, before any plan
        _checked_entries(path, header)
    _refuse_one_ranks_chunks(directory, headers, sum(t.nbytes for t in tensors))
    placements = {t.name: "whole (consolidated)" for t in tensors}
    ranks = _ranks(shard_files(directory / SHARDED_SUBDIR))
    return DcpHfCheckpoint(directory, ranks, tensors, placements, files, True, label=label)


def _refuse_one_ranks_chunks(
    directory: Path, headers: dict[str, SafetensorsHeader], nbytes: int
) -> None:
    """A model whose files DCP's HuggingFaceStorageWriter wrote without ``save_distributed``
    on several ranks: every rank wrote the same file names, so each file holds the chunks of
    the rank that wrote it last. Its ``DCP_SHARDING_INFO`` then places a chunk away from the
    tensor's start, or the index's ``total_size`` (counted over every rank) exceeds the bytes
    the files hold; either is a ``CheckpointFormatError``, never a model of partial tensors."""
    written_by_dcp = False
    for path, header in headers.items():
        raw = header.metadata.get(SHARDING_INFO)
        if not isinstance(raw, str):
            continue
        written_by_dcp = True
        info = jsondoc.loads(raw, f"{path}: {SHARDING_INFO}")
        for name, entry in info.items() if isinstance(info, dict) else ():
            offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
            if isinstance(offsets, list) and any(o != 0 for o in offsets):
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} is the chunk at {offsets} of a larger tensor "
                    f"({SHARDING_INFO}): {_ONE_RANKS_FILES}"
                )
    index = directory / hf.INDEX_FILE
    if written_by_dcp and index.is_file():
        metadata = jsondoc.read_object(index, "safetensors index (JSON object)").get("metadata")
        total = metadata.get("total_size") if isinstance(metadata, dict) else None
        if type(total) is int and total > nbytes:
            raise CheckpointFormatError(
                f"{index}: total_size {total} but the files hold {nbytes} bytes of tensors: "
                f"{_ONE_RANKS_FILES}"
            )


_ONE_RANKS_FILES = (
    "DCP's HuggingFaceStorageWriter without save_distributed=True, run on several ranks, has "
    "every rank write the same files, so they hold one rank's chunks; save with "
    "save_distributed=True"
)


def _check_shard_names(directory: Path) -> None:
    """Every entry named as a rank's file is a regular file, and all come from one save (one
    output file count): otherwise a FIFO under such a name would be skipped, or a file of
    another save merged in, with exit 0. A missing rank file cannot be told: the files
    record no global shape."""
    counts: dict[int, str] = {}
    for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
        if match := SHARD_FILE.match(entry.name):
            present(entry)  # a FIFO, device, directory or broken link: named
            counts.setdefault(int(match[3]), entry.name)
    if len(counts) > 1:
        names = " and ".join(sorted(counts.values())[:2])
        raise CheckpointFormatError(
            f"{directory}: {names} name different output file counts; the files come from "
            "two saves (remove the one not meant)"
        )


def _ranks(files: list[Path]) -> int:
    """The ranks that wrote ``files`` (named ``shard-{rank+1}-model-{i}-of-{n}``): the highest
    rank number, not the file count, since a rank writes one file per output file index."""
    return max((int(SHARD_FILE.match(p.name)[1]) for p in files), default=1)


def _open_sharded(directory: Path, files: list[Path]) -> DcpHfCheckpoint:
    blocks: dict[str, list[Block]] = {}
    dtypes: dict[str, str] = {}
    for path in files:
        header = read_header(path)
        raw = header.metadata.get(SHARDING_INFO)
        # strict and bounded: deep nesting raised RecursionError from json
        info = jsondoc.loads(raw, f"{path}: {SHARDING_INFO}") if isinstance(raw, str) else None
        if not isinstance(info, dict):
            raise CheckpointFormatError(
                f"{path}: no {SHARDING_INFO} in the safetensors metadata; not written by DCP's "
                "HuggingFaceStorageWriter(save_distributed=True)"
            )
        for name, entry in header.tensors.items():
            offsets = (
                info.get(name, {}).get("saved_offsets")
                if isinstance(info.get(name), dict)
                else None
            )
            if (
                not isinstance(offsets, list)
                or len(offsets) != len(entry.shape)
                or not all(type(o) is int and o >= 0 for o in offsets)
            ):
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} has no valid saved_offsets in {SHARDING_INFO}"
                )
            if dtypes.setdefault(name, entry.dtype) != entry.dtype:
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} is {entry.dtype} here, {dtypes[name]} elsewhere"
                )
            blocks.setdefault(name, []).append(
                dense_block(
                    str(path), header.data_start + entry.begin, entry.dtype, entry.shape, offsets
                )
            )
    tensors, placements = [], {}
    for name, pieces in blocks.items():
        shape = tuple(
            max(b.start[d] + b.shape[d] for b in pieces) for d in range(len(pieces[0].shape))
        )
        pieces.sort(key=lambda b: b.start)
        check_blocks_tile(name, shape, pieces)
        tensors.append(GlobalTensor(name, dtypes[name], shape, tuple(pieces)))
        dims = sorted({d for b in pieces for d, o in enumerate(b.start) if o})
        where = ", ".join(map(str, dims))  # as the DCP reader words it
        placements[name] = (
            "whole (1 chunk)"
            if len(pieces) == 1
            else f"{len(pieces)} chunks along dim{'s' if len(dims) > 1 else ''} {where}"
        )
    return DcpHfCheckpoint(
        directory, _ranks(files), tensors, placements, [str(p) for p in files], False
    )

"""Source: PyTorch Distributed Checkpoint (DCP) directories (``.metadata`` + ``__R_i.distcp``).

Written by ``torch.distributed.checkpoint.save`` (FileSystemWriter), torchtitan and accelerate's
FSDP ``SHARDED_STATE_DICT``. ``.metadata`` is a pickle of DCP's ``Metadata``: for every key of the
(flattened) state dict, the global shape and dtype and the chunks (``offsets``, ``sizes``) it was
saved in, and for every chunk a ``StorageInfo(relative_path, offset, length)``: the byte range
of a ``.distcp`` file that holds it.

Each tensor chunk's byte range is a complete ``torch.save`` zip archive of that one chunk tensor.
torch stores zip records uncompressed, so the chunk's elements sit verbatim inside the file. To
find them we read the archive's central directory (at the end of the range), then the local
header of the ``data/<key>`` record, whose data starts right after the header's name and extra
field; ``data.pkl`` (a few hundred bytes) gives the chunk's storage offset, shape and strides.
No tensor bytes are read here; the merge engine later reads exactly the ranges it needs.

Both pickles (``.metadata`` and each chunk's ``data.pkl``) are read by restricted unpicklers that
resolve only the handful of names DCP writes, each to an inert stand-in (``dcp_pickles.py``): a
hostile checkpoint cannot run code.

Which keys are model weights: DCP flattens nested state dicts (``{"model": {...}}`` becomes
``model.<fqn>``) and records the original path of every key in ``planner_data``. When some key's
path starts with a ``model`` container (accelerate, older torchtitan, ``{"model": ..., "optim":
...}`` train states) the model is what lies under it, renamed to the inner key; everything else
(optimizer, lr scheduler, dataloader, train state) is skipped. Otherwise (a plain model state
dict, or torchtitan's train state whose model keys sit at the top level) the model is every
top-level key and anything nested under a container (``optimizer.*``, ``train_state.*``) is
skipped. An optimizer flattened beside the model at the top level (``dcp.save({**model_sd,
**optim_sd})`` with ``flatten_optimizer_state_dict``: ``state.<fqn>.<key>``,
``param_groups.<fqn>.<key>``) is the optimizer, not part of the model. Non-tensor entries
(``BytesStorageMetadata``) are always skipped.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..engine.dtypes import code_of
from ..engine.endpoints import FileEndpoint
from ..engine.plan import Block, GlobalTensor, check_blocks_tile
from ..errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from .dcp_pickles import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    _Frozen,
    check_passed_pickle,
    int_sequence,
    ints,
    load_metadata,
    read_chunk_layout,
    short_repr,
)
from .native import is_safe_name
from .regular_file import check_inside, present
from .safetensors import MAX_DIMENSION
from .source import DCP_DATA_FILE as DATA_FILE
from .source import DCP_METADATA_FILE as METADATA_FILE
from .source import DCP_RANK_METADATA_FILE as RANK_METADATA_FILE
from .source import folders_around

MODEL_CONTAINER = "model"
# accelerate saves the model of a Trainer checkpoint in <checkpoint>/pytorch_model_fsdp_<i>/ and
# the config and tokenizer next to it.
# Top-level keys that are training state, never model weights (used without planner_data).
EXTRA_STATE = "_extra_state"  # nn.Module's key for get_extra_state() (DCP flattens a dict)
NON_MODEL_PREFIXES = (
    "optim.",
    "optimizer.",
    "optimizers.",
    "lr_scheduler.",
    "lr_schedulers.",
    "scheduler.",
    "dataloader.",
    "train_state.",
    "rng_state.",
    "extra_state.",
)
SUPPORTED_DCP_MAJOR = "1"


# --------------------------------------------------------------------------- the reader's result


@dataclass
class DcpCheckpoint:
    directory: Path
    world_size: int
    tensors: list[GlobalTensor]
    placements: dict[str, str]
    files: list[str]
    layout: str
    dcp_version: str | None
    skipped: dict[str, str] = field(default_factory=dict)
    replicas: dict[str, list[Block]] = field(default_factory=dict)
    metadata: Metadata | None = field(default=None, repr=False)  # the unpickled .metadata
    # Non-tensor entries of the model's own state (a module's ``get_extra_state``, pickled by
    # DCP): safetensors holds tensors only, so merge leaves them out and says so.
    model_objects: tuple[str, ...] = ()
    prefix: str = ""  # what the model's keys start with: "model." (accelerate), "app.model."
    label: str = "dcp"  # or ACCELERATE_SHARDED_FORMAT: the model of an accelerate save_state
    # .metadata lists the entries in its global plan's order (the ranks' items merged, a
    # replica moved to the rank deduplication gave it), not always the model's
    in_model_order = False

    @property
    def format(self) -> str:
        return self.label

    @property
    def mesh(self) -> str:
        return f"not recorded by DCP ({self.world_size} rank(s) wrote files)"

    @property
    def fsdp_version(self) -> int | None:
        return None  # not recorded

    @property
    def manifest(self) -> dict:
        return {}  # DCP's .metadata is no manifest

    @property
    def lora_settings(self) -> dict | None:
        return None

    def endpoint(self, location: str) -> FileEndpoint:
        """A reader that checks the CRC-32 of every zip record it reads: DCP writes each item
        with ``torch.save``, whose records carry one (torch checks none when it loads)."""
        from ..engine.plan import tensors_touching
        from .torch_pt import crc_checked_endpoint

        named = [(t.name, t.blocks) for t in self.tensors]
        # Only the items this reader's tensors lie in: the others are never read.
        offsets = sorted(b.offset for _, blocks in named for b in blocks if b.location == location)
        return crc_checked_endpoint(
            location,
            lambda lo, hi: tensors_touching(named, location, lo, hi),
            item_records(location, self._items_by_file.get(str(location), []), offsets),
        )

    @cached_property
    def _items_by_file(self) -> dict[str, list[tuple[int, int]]]:
        """(start, length) of every item, by data file; once per checkpoint (endpoints open
        file by file)."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for _, path, start, length in item_ranges(self.directory, self.metadata):
            by_file.setdefault(str(path), []).append((start, length))
        return by_file

    def check_split_records(self, tensors: list[GlobalTensor]) -> None:
        """Nothing to check ahead of a merge: no checksums."""

    def config_dir(self) -> Path | None:
        return config_dir_of(self.directory)


def config_dir_of(directory: Path) -> Path | None:
    """A DCP checkpoint's config.json directory: the checkpoint itself, the Trainer
    checkpoint around accelerate's ``pytorch_model_fsdp_N``, or that ``checkpoint-N``'s
    output_dir (the Trainer writes no config.json into a sharded FSDP checkpoint; save_model
    writes one above it); None when none has one."""
    from .hf import check_no_links_out

    for candidate in folders_around(directory):
        # a FIFO or directory under the name is refused by name (present), not passed over
        if present(candidate / "config.json") or (candidate / "config.json").is_symlink():
            # merge copies these files: none may lead out of the directory that holds them
            return check_no_links_out(candidate, candidate)
    return None


# torchtitan's step-N, accelerate's checkpoint_N, the Trainer's checkpoint-N, verl's global_step_N
STEP_NAME = re.compile(r"(?:global_step_|step-|step_|checkpoint-|checkpoint_)(\d+)\Z", re.ASCII)


def step_of_name(name: str) -> int | None:
    """The step a checkpoint directory is named for, or None."""
    match = STEP_NAME.search(name)
    return int(match[1]) if match else None


# --------------------------------------------------------------------------- validation helpers


def _index_key(index, meta_path: Path) -> tuple[str, tuple[int, ...] | None]:
    if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
        raise CheckpointFormatError(
            f"{meta_path}: storage_data key {short_repr(index)} is not a MetadataIndex"
        )
    offset = index.offset
    if offset is not None:
        what = f"{meta_path}: storage_data key {index.fqn!r}: chunk offset"
        offset = ints(tuple(offset) if isinstance(offset, list) else offset, what)
    return index.fqn, offset


def _data_file(directory: Path, relative: object, meta_path: Path) -> Path:
    if not isinstance(relative, str) or not relative:
        raise CheckpointFormatError(
            f"{meta_path}: storage entry with file name {short_repr(relative)}"
        )
    candidate = Path(relative)
    if candidate.is_absolute() or ".." in candidate.parts or "\\" in relative:
        raise UnsafeCheckpointError(
            f"{meta_path}: storage file {short_repr(relative)} lies outside the checkpoint "
            "directory"
        )
    if not is_safe_name(relative):  # a lone surrogate, a NUL or control character: no file
        raise UnsafeCheckpointError(
            f"{meta_path}: storage file {short_repr(relative)} is not a plain file name inside "
            "the checkpoint"
        )
    full = directory / candidate
    try:
        full.resolve().relative_to(directory.resolve())
    except ValueError:
        raise UnsafeCheckpointError(
            f"{meta_path}: storage file {relative!r} lies outside the checkpoint directory"
        ) from None
    return full


def _object_paths(planner_data, meta_path: Path) -> dict[str, tuple] | None:
    """DCP's ``planner_data``: flattened key -> path in the original nested state dict.

    DCP makes every key by joining its path with dots, so a path that joins to another key
    is damage: trusted, it would name a tensor after another's path (or put it outside the
    model), and the merge would write wrong weights under right-looking names."""
    if not isinstance(planner_data, dict):
        return None
    paths = {}
    for key, path in planner_data.items():
        if isinstance(path, list):
            path = tuple(path)
        if (
            not isinstance(key, str)
            or not isinstance(path, tuple)
            or not path
            or not all(isinstance(p, (str, int)) for p in path)
        ):
            return None
        joined = ".".join(map(str, path))
        if joined != key:
            raise CheckpointFormatError(
                f"{meta_path}: planner_data puts key {short_repr(key)} at path "
                f"{short_repr(list(path))}, which DCP would have named {short_repr(joined)}; "
                "the metadata is damaged"
            )
        paths[key] = path
    return paths


def normalize_prefix(prefix: str | None) -> str | None:
    """A user's ``prefix`` ("app.model", "app.model.", "" for top level) as keys start with it."""
    if prefix is None:
        return None
    prefix = prefix.strip()
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def _containers(keys: list[str], paths: dict[str, tuple] | None) -> set[tuple]:
    """The model containers tensor keys lie under: each key's path up to its first ``model``
    component (``("model",)`` for accelerate, ``("app", "model")`` for PyTorch's recipe)."""
    found = set()
    for key in keys:
        path = paths[key] if paths is not None else tuple(key.split("."))
        for i, part in enumerate(path[:-1]):
            if part == MODEL_CONTAINER:
                found.add(tuple(path[: i + 1]))
                break
    return found


def _model_names(
    keys: list[str], paths: dict[str, tuple] | None, prefix: str | None = None
) -> tuple[dict[str, str], str, str]:
    """Which tensor keys are model weights, under which HF name; a description of the layout;
    and the prefix the model's keys share ("" at top level).

    ``prefix`` (``normalize_prefix``'d): the model's keys, when detection is ambiguous or
    wrong. Keys missing from the result are training state (reported as skipped).
    """
    if paths is not None and not all(k in paths for k in keys):
        paths = None
    if prefix:
        names = {k: k[len(prefix) :] for k in keys if k.startswith(prefix) and len(k) > len(prefix)}
        return names, f"model under {prefix[:-1]!r} (prefix given)", prefix
    if prefix == "":
        if paths is not None:
            names = {k: k for k in keys if len(paths[k]) == 1}
        else:
            names = {k: k for k in keys if not k.startswith(NON_MODEL_PREFIXES)}
        names = {k: v for k, v in names.items() if not is_rng_state(k)}
        return names, "model at top level (prefix given)", ""
    if paths is not None:
        found = _containers(keys, paths)
        if len(found) > 1:
            listed = ", ".join(repr(".".join(map(str, c)) + ".") for c in sorted(found, key=str))
            raise CheckpointFormatError(
                f"tensor keys lie under several model containers ({listed}); pass the one to "
                "read as prefix= (--prefix)"
            )
        if found:
            (container,) = found
            depth = len(container)
            names = {
                k: ".".join(str(p) for p in paths[k][depth:])
                for k in keys
                if len(paths[k]) > depth and tuple(paths[k][:depth]) == container
            }
            where = ".".join(map(str, container))
            kind = "train state" if len(names) < len(keys) else "model"
            text = (
                f"{kind} (model under {where!r})"
                if kind == "train state"
                else (f"model under {where!r}")
            )
            return names, text, where + "."
        names = {k: k for k in keys if len(paths[k]) == 1 and not is_rng_state(k)}
        return (
            names,
            "model at top level" + (" with training state" if len(names) < len(keys) else ""),
            "",
        )
    # No planner_data (custom planners): decide by key prefixes.
    model = [k for k in keys if not k.startswith(NON_MODEL_PREFIXES) and not is_rng_state(k)]
    if len(model) < len(keys) and model and all(k.startswith("model.") for k in model):
        names = {k: k[len("model.") :] for k in model}
        return names, "train state (model under 'model')", "model."
    return {k: k for k in model}, "model at top level (no planner_data; named by prefix)", ""


def is_rng_state(key: str) -> bool:
    """Whether a top-level entry is a random generator's state saved beside a model at the top
    level (PyTorch's DCP tutorial's ``"rng": torch.get_rng_state()``), not a model tensor: no
    dot, "rng" in its name."""
    return isinstance(key, str) and "." not in key and "rng" in key.lower()


def _containers_held(keys: list[str], paths: dict[str, tuple] | None) -> str:
    """ ", whose tensors lie under 'ema.' (54) and 'policy.' (54)": the top-level containers of
    tensor ``keys``, for a message asking which one is the model; "" for none."""
    held = Counter(
        str(paths[k][0]) if paths and k in paths and len(paths[k]) > 1 else k.split(".", 1)[0]
        for k in keys
        if "." in k
    )
    if not held:
        return ""
    listed = " and ".join(f"{name + '.'!r} ({count})" for name, count in sorted(held.items())[:6])
    return f", whose tensors lie under {listed}"


NOT_UNDER_MODEL = "not under the model"  # a skipped tensor of no known training state


def _reason(key: str, paths: dict[str, tuple] | None) -> str:
    container = paths[key][0] if paths and key in paths and len(paths[key]) > 1 else None
    if container is None:
        container = key.split(".", 1)[0] if key.startswith(NON_MODEL_PREFIXES) else None
    return f"training state ({container})" if container else NOT_UNDER_MODEL


def unread_groups(skipped: dict[str, str], prefix: str) -> dict[str, int]:
    """The containers beside the model (under ``prefix``'s parent: ``app.`` for
    ``app.model.``) that hold tensors and are no known training state (another model, an EMA
    copy: ``{"ema.": 54}``), with their tensor counts: not read, and said so (``--prefix
    ema.`` reads one)."""
    parent = prefix[: prefix.rstrip(".").rfind(".") + 1] if prefix else ""
    groups: Counter = Counter()
    for key, why in skipped.items():
        if why.startswith(("training state (", NOT_UNDER_MODEL)) and key.startswith(parent):
            group = key[len(parent) :].split(".", 1)[0] + "."
            if "." in key[len(parent) :] and not _training_state_group(group):
                groups[parent + group] += 1
    if parent + "param_groups." in groups:  # a flattened optimizer's state.* and param_groups.*
        groups.pop(parent + "param_groups.")
        groups.pop(parent + "state.", None)
    return {g: n for g, n in sorted(groups.items()) if n > 1}


# Lightning's optimizer_0., lr_scheduler_0., ... (one container per optimizer of the module)
NUMBERED_TRAINING_STATE = re.compile(r"(optimizer|optim|lr_scheduler|scheduler)_\d+\.\Z")


def _training_state_group(group: str) -> bool:
    """Whether the container ``group`` (``"optimizer."``) holds training state, not a model."""
    return group.startswith(NON_MODEL_PREFIXES) or bool(NUMBERED_TRAINING_STATE.match(group))


def _describe(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """How a tensor's chunks lie, counting those that hold elements (FSDP2 lists an empty
    chunk for each rank past the tensor's end: a 3-element bias over 4 ranks)."""
    empty = sum(0 in sizes for _, sizes in chunks)
    held = [(offsets, sizes) for offsets, sizes in chunks if 0 not in sizes] or chunks[:1]
    if len(held) == 1 and all(o == 0 for o in held[0][0]):
        text = "whole (1 chunk)"
    else:
        dims = sorted({d for offsets, _ in held for d, o in enumerate(offsets) if o})
        where = ", ".join(str(d) for d in dims)
        text = f"{len(held)} chunks along dim{'s' if len(dims) > 1 else ''} {where}".rstrip()
    return text + (f", and {empty} empty" if empty and len(held) < len(chunks) else "")


# --------------------------------------------------------------------------- opening


def _supported_version(meta, meta_path: Path) -> str | None:
    """The metadata's DCP version (None: written before torch recorded one), if 1.x."""
    version = meta.version
    if version is not None and (
        not isinstance(version, str) or version.split(".")[0] != SUPPORTED_DCP_MAJOR
    ):
        raise CheckpointFormatError(
            f"{meta_path}: DCP metadata version {short_repr(version)} is not supported "
            "(expected 1.x)"
        )
    return version


def open_dcp(directory: str | os.PathLike, prefix: str | None = None) -> DcpCheckpoint:
    """Read ``.metadata`` and each model chunk's record header; describe tensors as blocks.

    ``prefix``: what the model's keys start with ("app.model.", "" for the top level), when
    detection (``_model_names``) finds several candidates or the wrong one."""
    directory = Path(directory)
    on_disk = sorted(p.name for p in directory.iterdir() if DATA_FILE.match(p.name))
    meta, meta_path = read_metadata(directory)
    version = _supported_version(meta, meta_path)
    entries = meta.state_dict_metadata
    storage = meta.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointFormatError(
            f"{meta_path}: state_dict_metadata/storage_data missing; not a FileSystemWriter "
            "checkpoint"
        )
    for key, value in entries.items():
        if not isinstance(key, str) or not isinstance(
            value, (TensorStorageMetadata, BytesStorageMetadata)
        ):
            raise CheckpointFormatError(f"{meta_path}: entry {key!r} is not tensor or bytes")

    skipped: dict[str, str] = {}
    tensor_keys = []
    for key, value in entries.items():
        if isinstance(value, BytesStorageMetadata):
            skipped[key] = "not a tensor (pickled bytes)"
        else:
            tensor_keys.append(key)
    paths = _object_paths(meta.planner_data, meta_path)
    flat_optimizer = flat_optimizer_keys(list(entries), paths)
    for key in flat_optimizer:
        skipped[key] = "training state (optimizer, flattened beside the model)"
    tensor_keys = [k for k in tensor_keys if k not in flat_optimizer]
    try:
        names, layout, found_prefix = _model_names(tensor_keys, paths, normalize_prefix(prefix))
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{directory}: {exc}") from None
    for key in tensor_keys:
        if key not in names:
            skipped[key] = _reason(key, paths)
    if not entries:
        raise CheckpointNotFoundError(
            f"{directory}: the DCP checkpoint holds no entries: an empty state dict was saved"
        )
    if not tensor_keys:
        raise CheckpointNotFoundError(
            f"{directory}: the DCP checkpoint holds no tensors: its {len(entries)} entries (e.g. "
            + ", ".join(repr(k) for k in list(entries)[:3])
            + ") are pickled objects (DefaultSavePlanner(flatten_state_dict=False) pickles each "
            "container whole); shardstream reads tensors DCP stores as chunks, which the "
            "default planner writes"
        )
    if not names:
        raise CheckpointNotFoundError(
            f"{directory}: the DCP checkpoint holds no model tensors ({len(entries)} entries, "
            "e.g. "
            + ", ".join(repr(k) for k in list(entries)[:3])
            + ")"
            + (
                f" under prefix {prefix!r}"
                if prefix is not None
                else f"{_containers_held(tensor_keys, paths)}; pass the prefix the model's keys "
                "start with as prefix= (--prefix)"
            )
        )
    seen: dict[str, str] = {}
    for key, name in names.items():
        if not name:
            raise CheckpointFormatError(f"{meta_path}: key {key!r} gives an empty tensor name")
        if name in seen:
            raise CheckpointFormatError(
                f"{meta_path}: keys {seen[name]!r} and {key!r} both map to tensor {name!r}"
            )
        seen[name] = key

    by_chunk = _storage_by_chunk(storage, meta_path)

    sizes: dict[Path, int] = {}
    fds: dict[Path, int] = {}
    tensors: list[GlobalTensor] = []
    placements: dict[str, str] = {}
    try:
        for key, name in names.items():
            md = entries[key]
            tensors.append(
                _global_tensor(directory, meta_path, key, name, md, by_chunk, sizes, fds)
            )
            placements[name] = _describe([(b.start, b.shape) for b in tensors[-1].blocks])
    finally:
        for fd in fds.values():
            os.close(fd)
    _check_storage_apart(by_chunk, meta_path)
    objects = [k for k, v in entries.items() if isinstance(v, BytesStorageMetadata)]
    model_objects = tuple(
        k
        for k in objects
        if (k.startswith(found_prefix) if found_prefix else EXTRA_STATE in k.split("."))
    )

    # The files .metadata names: a save at fewer ranks into the same directory leaves the
    # older save's __R_0.distcp behind, which is no part of this checkpoint.
    named = {getattr(info, "relative_path", None) for info in storage.values()}
    on_disk = [n for n in on_disk if n in named]
    ranks = {int(DATA_FILE.match(n)[1]) for n in on_disk}
    ranks |= {int(m[1]) for p in sizes if (m := DATA_FILE.match(p.name))}
    world_size = max(ranks) + 1 if ranks else 1
    files = sorted({str(directory / n) for n in on_disk} | {str(p) for p in sizes})
    return DcpCheckpoint(
        directory=directory,
        world_size=world_size,
        tensors=tensors,
        placements=placements,
        files=files,
        layout=layout,
        dcp_version=version,
        skipped=skipped,
        metadata=meta,
        prefix=found_prefix,
        model_objects=model_objects,
    )


def check_dcp(directory: str | os.PathLike) -> list[str]:
    """Check every entry of a DCP directory, model or not (an optimizer's ``optimizer_N``
    too): each tensor chunk's record and shape, each byte entry's range inside an existing
    data file. DCP stores no checksums, so no data is hashed. Returns the files named."""
    directory = Path(directory)
    meta, meta_path = read_metadata(directory)
    _supported_version(meta, meta_path)
    entries, storage = meta.state_dict_metadata, meta.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointFormatError(f"{meta_path}: state_dict_metadata/storage_data missing")
    by_chunk = _storage_by_chunk(storage, meta_path)
    _object_paths(meta.planner_data, meta_path)  # the names merge and restore give the keys
    sizes: dict[Path, int] = {}
    fds: dict[Path, int] = {}
    try:
        for key, md in entries.items():
            if not isinstance(key, str):
                raise CheckpointFormatError(f"{meta_path}: entry {key!r} is not named by a str")
            if isinstance(md, TensorStorageMetadata):
                _global_tensor(directory, meta_path, key, key, md, by_chunk, sizes, fds)
            elif isinstance(md, BytesStorageMetadata):
                info = by_chunk.get((key, None))
                if info is None:
                    raise CheckpointFormatError(f"{meta_path}: entry {key!r} has no storage entry")
                _stored_range(directory, meta_path, key, info, sizes, fds, "entry")
            else:
                raise CheckpointFormatError(f"{meta_path}: entry {key!r} is not tensor or bytes")
    finally:
        for fd in fds.values():
            os.close(fd)
    _check_storage_apart(by_chunk, meta_path)
    return sorted({str(meta_path), *(str(p) for p in sizes)})


def read_metadata(directory: Path) -> tuple[Metadata, Path]:
    """DCP's metadata of ``directory`` and the file it names in errors: ``.metadata``, or for a
    save without collectives (``dcp.save(use_collectives=False)``) every rank's
    ``__R.metadata`` joined into one."""
    meta_path = directory / METADATA_FILE
    if os.path.lexists(meta_path):
        present(meta_path)  # a directory, FIFO, device or broken link: named, not "missing"
        check_inside(meta_path, directory)
        return load_metadata(meta_path), meta_path
    per_rank = sorted(
        (int(m[1]), p) for p in directory.iterdir() if (m := RANK_METADATA_FILE.match(p.name))
    )
    if not per_rank:
        data = any(DATA_FILE.match(p.name) for p in directory.iterdir())
        held = "DCP data files" if data else "no DCP data files"
        raise CheckpointNotFoundError(
            f"{directory}: {held} and no .metadata; DCP writes it last, so the save "
            "did not finish (or the file was not copied)"
        )
    return _joined([(path, load_metadata(path)) for _, path in per_rank]), per_rank[0][1]


def _joined(metas: list[tuple[Path, Metadata]]) -> Metadata:
    """Per-rank metadata (in rank order) as one: every rank's entries, chunks and storage; an
    item several ranks saved (a replicated tensor, a shared object) from the lowest of them."""
    entries: dict = {}
    storage: dict = {}
    planner: dict = {}
    stored: set = set()
    version = metas[0][1].version
    for path, meta in metas:
        if meta.version != version:
            raise CheckpointFormatError(
                f"{path}: DCP version {short_repr(meta.version)}, but {metas[0][0].name} has "
                f"{short_repr(version)}"
            )
        if not isinstance(meta.state_dict_metadata, dict) or not isinstance(
            meta.storage_data, dict
        ):
            raise CheckpointFormatError(f"{path}: state_dict_metadata/storage_data missing")
        for key, md in meta.state_dict_metadata.items():
            have = entries.setdefault(key, md)
            if have is md:
                continue
            if type(have) is not type(md):
                raise CheckpointFormatError(f"{path}: entry {key!r} is another kind elsewhere")
            if isinstance(md, TensorStorageMetadata):
                _join_chunks(have, md, key, path)
        for index, info in meta.storage_data.items():
            where = _index_key(index, path)
            if where not in stored:
                stored.add(where)
                storage[index] = info
        if isinstance(meta.planner_data, dict):
            planner.update(meta.planner_data)
    joined = Metadata()
    joined.__dict__.update(
        state_dict_metadata=entries, storage_data=storage, planner_data=planner, version=version
    )
    return joined


def _join_chunks(have: TensorStorageMetadata, md: TensorStorageMetadata, key: str, path: Path):
    """Add ``md``'s chunks of tensor ``key`` that ``have`` lacks; shape and dtype must agree."""
    same_dtype = getattr(have.properties, "dtype", None) == getattr(md.properties, "dtype", None)
    if not same_dtype or int_sequence(have.size, key) != int_sequence(md.size, key):
        raise CheckpointFormatError(
            f"{path}: tensor {key!r} has another shape or dtype than in a lower rank's metadata"
        )
    if not isinstance(have.chunks, list) or not isinstance(md.chunks, list):
        raise CheckpointFormatError(f"{path}: tensor {key!r} has malformed chunks")

    def extent(chunk) -> tuple:
        what = f"{path}: tensor {key!r} chunk"
        return (int_sequence(getattr(chunk, "offsets", None), what),
                int_sequence(getattr(chunk, "sizes", None), what))  # fmt: skip

    known = {extent(c) for c in have.chunks}
    have.chunks.extend(c for c in md.chunks if extent(c) not in known)


def _storage_by_chunk(storage: dict, meta_path: Path) -> dict:
    """``storage_data`` keyed by (key, chunk offsets), each entry checked to be a StorageInfo."""
    by_chunk: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    for index, info in storage.items():
        if not isinstance(info, StorageInfo):
            raise CheckpointFormatError(
                f"{meta_path}: storage entry {short_repr(index)} is malformed"
            )
        by_chunk[_index_key(index, meta_path)] = info
    return by_chunk


def _check_storage_apart(by_chunk: dict, meta_path: Path) -> None:
    """``check_items_apart`` of ``_storage_by_chunk``'s entries; after the tensors are read,
    so that a chunk's own damage (a wrong shape, chunks overlapping) is named first."""
    items = [(key, i.relative_path, i.offset, i.length) for (key, _), i in by_chunk.items()]
    check_items_apart(items, meta_path)


def check_items_apart(items: list[tuple[str, object, object, object]], meta_path: Path) -> None:
    """DCP writes every item (key, file, start, length) to a byte range of its own. Two that
    share bytes would each read the other's archive (``zipfile`` finds an archive by its end,
    and tolerates bytes before it): a tensor merged with another's weights, or one chunk's
    twice. A file is told by what it is, not by its name: another name of it (a hard link, a
    symlink, a linked folder) shares its bytes too. Entries of the wrong types are left to the
    checks that name them."""
    by_file: dict[object, list[tuple[int, int, str, str]]] = {}
    identities: dict[str, object] = {}  # each name stat'ed once: many items share a file
    for key, relative, start, length in items:
        if isinstance(relative, str) and type(start) is int and type(length) is int and length:
            if relative not in identities:
                try:
                    found = os.stat(meta_path.parent / relative)  # an absolute one stands alone
                    identities[relative] = (found.st_dev, found.st_ino)
                except (OSError, ValueError):  # missing, or no name at all: named elsewhere
                    identities[relative] = Path(relative)
            entry = (start, start + length, key, relative)
            by_file.setdefault(identities[relative], []).append(entry)
    for ranges in by_file.values():
        ranges.sort()
        for (start, end, key, name), (next_start, next_end, next_key, next_name) in zip(
            ranges, ranges[1:]
        ):
            if next_start < end:
                also = f" (also named {next_name}: the same file)" if next_name != name else ""
                raise CheckpointFormatError(
                    f"{meta_path}: {short_repr(key)} and {short_repr(next_key)} share bytes of "
                    f"{name}{also} ([{start}, {end}) and [{next_start}, {next_end})); DCP "
                    "writes each item to its own byte range, so the metadata is damaged"
                )


def _stored_range(directory: Path, meta_path: Path, key: str, info, sizes, fds, kind="tensor"):
    """The data file and byte range of a storage entry, opened once and checked to fit."""
    _check_no_transforms(info.transform_descriptors, meta_path, key, kind)
    path = _data_file(directory, info.relative_path, meta_path)
    if path not in sizes:
        if not path.is_file():
            raise CheckpointNotFoundError(
                f"{path}: missing DCP data file (referenced by {meta_path.name} for {key!r})"
            )
        fds[path] = os.open(path, os.O_RDONLY)
        sizes[path] = os.fstat(fds[path]).st_size
    start, length = info.offset, info.length
    if type(start) is not int or type(length) is not int or start < 0 or length < 0:
        raise CheckpointFormatError(
            f"{meta_path}: {kind} {key!r} has an invalid byte range {start!r}+{length!r}"
        )
    if start + length > sizes[path]:
        raise CheckpointFormatError(
            f"{path}: truncated: {kind} {key!r} needs bytes [{start}, {start + length}) but the "
            f"file has {sizes[path]}"
        )
    return path, start, length


def _check_no_transforms(descriptors: object, meta_path: Path, key: str, kind: str) -> None:
    """DCP's ``transform_descriptors`` of a storage entry: None or empty, else refused (a
    transformed record is not a plain byte range; a value of another type is malformed)."""
    if descriptors is None:
        return
    if not isinstance(descriptors, (list, tuple)):
        raise CheckpointFormatError(
            f"{meta_path}: {kind} {key!r} has transform_descriptors {short_repr(descriptors)}, "
            "not a list of transform names"
        )
    if descriptors:
        raise CheckpointFormatError(
            f"{meta_path}: {kind} {key!r} is stored through transform(s) "
            f"{short_repr(list(descriptors))} (e.g. zstd compression); shardstream streams "
            "byte ranges and cannot read transformed chunks; save without _extensions"
        )


def _global_tensor(directory, meta_path, key, name, md, by_chunk, sizes, fds) -> GlobalTensor:
    try:
        dtype = code_of(getattr(md.properties, "dtype", None))
    except (CheckpointFormatError, TypeError):
        raise CheckpointFormatError(
            f"{meta_path}: tensor {key!r} has unsupported dtype "
            f"{short_repr(getattr(md.properties, 'dtype', None))}"
        ) from None
    shape = md.size
    if isinstance(shape, list):
        shape = tuple(shape)
    shape = ints(shape, f"{meta_path}: tensor {key!r} shape")
    if any(not 0 <= n <= MAX_DIMENSION for n in shape) or not isinstance(md.chunks, list):
        raise CheckpointFormatError(
            f"{meta_path}: tensor {key!r} has an invalid shape {short_repr(list(shape))} or "
            f"chunks (each dimension from 0 to {MAX_DIMENSION}, torch's largest)"
        )
    chunks = []
    for chunk in md.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise CheckpointFormatError(f"{meta_path}: tensor {key!r} has a malformed chunk")
        offsets = int_sequence(chunk.offsets, f"{meta_path}: tensor {key!r} chunk offsets")
        lengths = int_sequence(chunk.sizes, f"{meta_path}: tensor {key!r} chunk sizes")
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            raise CheckpointFormatError(
                f"{meta_path}: tensor {key!r} of shape {list(shape)} has a chunk of rank "
                f"{len(lengths)}"
            )
        if any(n < 0 for n in lengths):
            raise CheckpointFormatError(f"{meta_path}: tensor {key!r} has a negative chunk size")
        chunks.append((offsets, lengths))
    # Chunks tile the tensor: counted before a record is read (a few hundred bytes of
    # .metadata can list one chunk a million times, each a record to parse)
    covered = sum(math.prod(lengths) for _, lengths in chunks)
    if covered != math.prod(shape):
        raise CheckpointFormatError(
            f"{meta_path}: tensor {key!r}: shards hold {covered} elements but shape "
            f"{list(shape)} needs {math.prod(shape)} ({len(chunks)} chunks listed)"
        )
    blocks = []
    for offsets, lengths in chunks:
        info = by_chunk.get((key, offsets))
        if info is None:
            raise CheckpointFormatError(
                f"{meta_path}: chunk of tensor {key!r} at offsets {list(offsets)} has no storage "
                "entry"
            )
        path, start, length = _stored_range(directory, meta_path, key, info, sizes, fds)
        what = f"chunk of {key!r} at {list(offsets)}"
        layout = read_chunk_layout(fds[path], str(path), start, length, what)
        if layout.shape != lengths:
            raise CheckpointFormatError(
                f"{path}: {what} holds shape {list(layout.shape)}, but .metadata says "
                f"{list(lengths)}"
            )
        if layout.dtype != dtype:
            raise CheckpointFormatError(
                f"{path}: {what} holds {layout.dtype}, but .metadata says {dtype}"
            )
        blocks.append(Block(str(path), layout.offset, dtype, offsets, lengths, layout.strides))
    blocks.sort(key=lambda b: b.start)
    check_blocks_tile(name, shape, blocks)
    return GlobalTensor(name, dtype, shape, tuple(blocks))


# --------------------------------------------------------------------------- training state

# Non-tensor entries (param group values, scheduler fields) are small torch.save archives.
MAX_OBJECT_BYTES = 64 << 20
OPTIMIZER_STATE_PREFIX = "optimizer.state."


# A train state's containers beside the model's, under the names tools give them -> the name
# restore uses: torchtitan ("optimizer", "lr_scheduler", "dataloader", "train_state"), PyTorch's
# DCP recipe ("optim"), accelerate ("optimizer" in optimizer_N/).
CONTAINER_NAMES = {
    "optimizer": "optimizer",
    "optim": "optimizer",
    "optimizers": "optimizer",
    "lr_scheduler": "lr_scheduler",
    "lr_schedulers": "lr_scheduler",
    "scheduler": "lr_scheduler",
    "train_state": "train_state",
    "dataloader": "dataloader",
}


@dataclass
class DcpTrainState:
    """What a DCP train state holds besides the model, for ``restore()``.

    ``optimizer_tensors`` are named ``optimizer.state.<fqn>.<key>``, as shardstream names them,
    whatever the container was called and wherever it sat. ``objects`` maps a container
    (``optimizer``, ``lr_scheduler``, ``train_state``) to its non-tensor values, nested as they
    were saved: under ``flatten_optimizer_state_dict`` (torchtitan) the optimizer's values are
    keyed ``param_groups.<fqn>.<key>`` and ``state.<fqn>.<key>``. ``tensor_objects`` names the
    small non-optimizer tensors (torchtitan's ``train_state.step``) by the same paths.
    """

    optimizer_tensors: list[GlobalTensor]
    objects: dict[str, object]
    tensor_objects: dict[str, GlobalTensor] = field(default_factory=dict)


FLAT_OPTIMIZER_HEADS = ("state.", "param_groups.")


def flat_optimizer_keys(keys: list[str], paths: dict[str, tuple] | None) -> set[str]:
    """The top-level keys of an optimizer state dict saved flattened beside the model's
    (``dcp.save({**model_sd, **optim_sd})`` with ``flatten_optimizer_state_dict=True``):
    ``state.<fqn>.<key>`` and ``param_groups.<fqn>.<key>``, told by the ``param_groups.``
    entries every such optimizer has; empty for any other checkpoint. Beside the model, an
    ``<fqn>`` is one of its keys: a model's own ``state.weight`` (a submodule named "state")
    stays the model's."""
    top = [
        k
        for k in keys
        if k.startswith(FLAT_OPTIMIZER_HEADS) and (paths is None or len(paths.get(k, (k,))) == 1)
    ]

    def fqn(key: str) -> str:  # <fqn> of <head><fqn>.<key>; the key names no module
        return key.split(".", 1)[1].rpartition(".")[0]

    grouped = {fqn(k) for k in top if k.startswith("param_groups.")} - {""}
    if not grouped:
        return set()
    beside = grouped & set(keys)  # the parameters of a model saved beside
    owned = beside or grouped
    return {k for k in top if fqn(k) in owned}


def _container_path(
    key: str, path: tuple | None, root: tuple, names: dict[str, str] = CONTAINER_NAMES
) -> tuple | None:
    """``key``'s path below ``root`` with its container renamed (``CONTAINER_NAMES``), or None
    for a key that lies elsewhere or in no known container."""
    if path is None:
        head = ".".join(map(str, root)) + "." if root else ""
        if not key.startswith(head):
            return None
        path = tuple(key[len(head) :].split(".", 1))
    else:
        if tuple(path[: len(root)]) != tuple(root):
            return None
        path = tuple(path[len(root) :])
    if len(path) < 2 or path[0] not in names:
        return None
    return (names[path[0]], *path[1:])


def open_dcp_train_state(
    directory: str | os.PathLike,
    containers: tuple[str, ...] = ("optimizer", "lr_scheduler", "train_state"),
    metadata: Metadata | None = None,
    prefix: str = "",
) -> DcpTrainState:
    """Describe the optimizer tensors of a DCP checkpoint and read its small non-tensor state.

    ``metadata``: the ``.metadata`` ``open_dcp`` already unpickled, so it is not read twice.
    ``prefix``: the model's (``DcpCheckpoint.prefix``); the containers are its siblings
    (``app.model.`` -> ``app.optim.``), at the top level when it is "" or "model.".
    """
    directory = Path(directory)
    meta_path = directory / METADATA_FILE
    if metadata is None:
        metadata, meta_path = read_metadata(directory)
    meta = metadata
    entries, storage = meta.state_dict_metadata, meta.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointFormatError(f"{meta_path}: state_dict_metadata/storage_data missing")
    by_chunk = _storage_by_chunk(storage, meta_path)
    paths = _object_paths(meta.planner_data, meta_path)
    root = tuple(prefix.split(".")[:-2]) if prefix else ()
    names = {**{c: c for c in containers}, **CONTAINER_NAMES}
    flat_optimizer = flat_optimizer_keys(list(entries), paths) if not root else set()
    sizes: dict[Path, int] = {}
    fds: dict[Path, int] = {}
    tensors: list[GlobalTensor] = []
    small: dict[str, GlobalTensor] = {}
    objects: dict[str, object] = {}
    try:
        for key, md in entries.items():
            if not isinstance(key, str):
                raise CheckpointFormatError(f"{meta_path}: entry {key!r} is not named by a str")
            path = _container_path(key, paths.get(key) if paths else None, root, names)
            if key in flat_optimizer:  # the optimizer's keys beside the model's
                path = ("optimizer", key)
            if path is None or path[0] not in containers:
                continue
            if isinstance(md, TensorStorageMetadata):
                flat = ".".join(map(str, path))
                if path[0] == "optimizer" and flat.startswith(OPTIMIZER_STATE_PREFIX):
                    tensors.append(
                        _global_tensor(directory, meta_path, key, flat, md, by_chunk, sizes, fds)
                    )
                else:
                    if path[0] != "optimizer":
                        small[flat] = _global_tensor(
                            directory, meta_path, key, flat, md, by_chunk, sizes, fds
                        )
                    # a Stateful's tensors (a TrainState's step, a counter) are its values, and
                    # so are a param group's (a tensor learning rate)
                    value = _read_small_tensor(directory, meta_path, key, md, by_chunk,
                                               sizes, fds)  # fmt: skip
                    _place(objects, path, value, meta_path, key)
                continue
            value = _read_object(directory, meta_path, key, by_chunk, sizes, fds)
            _place(objects, path, value, meta_path, key)
    finally:
        for fd in fds.values():
            os.close(fd)
    _check_storage_apart(by_chunk, meta_path)
    return DcpTrainState(tensors, {k: _lists(v) for k, v in objects.items()}, small)


def _read_object(directory: Path, meta_path: Path, key: str, by_chunk, sizes, fds) -> object:
    info = by_chunk.get((key, None))
    if info is None:
        raise CheckpointFormatError(f"{meta_path}: entry {key!r} has no storage entry")
    path, start, length = _stored_range(directory, meta_path, key, info, sizes, fds, "entry")
    if length > MAX_OBJECT_BYTES:
        raise UnsafeCheckpointError(
            f"{path}: entry {key!r} declares {length} bytes, over the {MAX_OBJECT_BYTES} limit"
        )
    from .torch_pt import load_restricted

    data = os.pread(fds[path], length, start)
    name = f"{path}: entry {key!r}"
    try:
        # The restricted unpickler: containers, numbers, strings and tensors; nothing runs code.
        value = load_restricted(data, name, "cpu", {("_io", "BytesIO"): _SavedBytesIO})
        if isinstance(value, _SavedBytesIO):  # torchtitan's TrainState: torch.save'd histories
            load_restricted(value.data, f"{name} (its BytesIO)", "cpu")  # checked, not kept
            value = io.BytesIO(value.data)
        elif isinstance(value, bytes):  # torchtitan's dataloader: pickle.dumps of its state
            check_passed_pickle(value, name)
        return value
    except CheckpointFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here is a bad record
        raise CheckpointFormatError(
            f"{path}: entry {key!r} is not a readable weights-only record "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


class _SavedBytesIO(metaclass=_Frozen):
    """An ``io.BytesIO`` as DCP pickles one (``torch.save`` of it): only its bytes are kept,
    and ``_read_object`` checks them as a weights-only archive before a real BytesIO is made."""

    def __setstate__(self, state) -> None:
        if type(state) is not tuple or len(state) != 3 or type(state[0]) is not bytes:
            raise CheckpointFormatError("a BytesIO with an unexpected state")
        self.__dict__["data"] = state[0]


def _read_small_tensor(directory: Path, meta_path: Path, key: str, md, by_chunk, sizes, fds):
    """A small tensor stored whole (one chunk, as a replicated plain tensor is): its record is a
    ``torch.save`` archive, read like the other objects."""
    chunks = md.chunks if isinstance(md.chunks, list) else []
    offsets = getattr(chunks[0], "offsets", None) if len(chunks) == 1 else None
    offsets = tuple(offsets) if isinstance(offsets, (list, tuple)) else None
    if offsets is None or any(offsets) or (key, offsets) not in by_chunk:
        raise CheckpointFormatError(
            f"{meta_path}: entry {key!r} is not stored as one tensor ({len(chunks)} chunks): a "
            "sharded tensor outside the model and optimizer, which shardstream does not restore"
        )
    by_key = {(key, None): by_chunk[(key, offsets)]}
    return _read_object(directory, meta_path, key, by_key, sizes, fds)


def _place(root: dict, path: tuple, value: object, meta_path: Path, key: str) -> None:
    """Set ``value`` at ``path`` in nested dicts (list indices stay int keys until _lists)."""
    node = root
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise CheckpointFormatError(f"{meta_path}: entry {key!r} overlaps another entry")
        node = child
    if path[-1] in node:
        raise CheckpointFormatError(f"{meta_path}: entry {key!r} is stored twice")
    node[path[-1]] = value


def _lists(node: object) -> object:
    """Dicts keyed 0..n-1 by int (DCP's flattened lists) back into lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


# --------------------------------------------------------------------------- item checksums


def item_ranges(
    directory: str | os.PathLike, metadata: Metadata | None = None
) -> list[tuple[str, Path, int, int]]:
    """(key, data file, start, length) of every item ``.metadata`` names, model or not, each
    file checked to lie inside the checkpoint; in file order."""
    directory = Path(directory)
    meta_path = directory / METADATA_FILE
    if metadata is None:
        metadata, meta_path = read_metadata(directory)
    meta = metadata
    storage = meta.storage_data if isinstance(meta.storage_data, dict) else {}
    out = []
    for index, info in storage.items():
        if not isinstance(info, StorageInfo):
            raise CheckpointFormatError(f"{meta_path}: storage entry {index!r} is malformed")
        start, length = info.offset, info.length
        if type(start) is not int or type(length) is not int or start < 0 or length < 0:
            raise CheckpointFormatError(
                f"{meta_path}: item {index!r} has an invalid byte range {start!r}+{length!r}"
            )
        key = index.fqn if isinstance(index, MetadataIndex) else repr(index)
        out.append((key, _data_file(directory, info.relative_path, meta_path), start, length))
    check_items_apart([(key, str(path), start, n) for key, path, start, n in out], meta_path)
    return sorted(out, key=lambda item: (str(item[1]), item[2]))


def holds_offset(offsets: list[int], start: int, length: int) -> bool:
    """Whether one of ``offsets`` (sorted) lies in the item [start, start + length)."""
    i = bisect.bisect_left(offsets, start)
    return i < len(offsets) and offsets[i] < start + length


def item_records(
    location: str, items: list[tuple[int, int]], offsets: list[int] | None = None
) -> list:
    """The CRC-carrying zip records of the items (start, length) of data file ``location``;
    with ``offsets`` (sorted), only of the items that hold one of them."""
    from .torch_pt import zip_records_in

    items = sorted(items)
    if offsets is not None:
        items = [(start, n) for start, n in items if holds_offset(offsets, start, n)]
    records = []
    fd = os.open(location, os.O_RDONLY)
    try:
        for start, length in items:
            records.extend(zip_records_in(location, start, length, fd))
    finally:
        os.close(fd)
    return sorted(records, key=lambda r: r.start)


def check_items_dealt_out(items: list[tuple[str, Path, int, int]], what: str = "restore") -> None:
    """Check the zip records of DCP ``items`` (as ``item_ranges`` gives them) against their
    CRC-32s once across the process group, item i by process i % K, before anything is read
    for real: each item is a ``torch.save`` archive, and torch checks no CRC when it loads.
    A damaged record fails every process alike, naming the file, the zip record and the item."""
    from ..storage import collectives as coll
    from .torch_pt import check_records

    mine: dict[str, list[tuple[str, int, int]]] = {}
    for key, path, start, length in items[coll.rank() :: coll.world()]:
        mine.setdefault(str(path), []).append((key, start, length))
    error = None
    try:
        for location, held in mine.items():

            def item_of(lo: int, hi: int, held=held) -> list[str]:
                return [k for k, s, n in held if s < hi and lo < s + n]

            check_records(location, item_of, item_records(location, [(s, n) for _, s, n in held]))
    except Exception as exc:  # noqa: BLE001  (every process must learn of it)
        error = exc
    coll.agree_or_raise(error, what)

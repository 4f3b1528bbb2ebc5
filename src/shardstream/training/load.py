"""load: read a checkpoint directory back into live objects, at any world size, in place.

Every rank calls the same function and reads only the byte ranges of its own shards, through
torch.distributed.checkpoint's load planner with shardstream's streaming StorageReader. Input
is a shardstream checkpoint (``saving.py``), or a verl or PyTorch DCP one read as if it were.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from ..engine.checksum import digest
from ..engine.dtypes import TORCH_BY_CODE
from ..engine.endpoints import FileEndpoint
from ..engine.memory import gc_paused
from ..engine.plan import GlobalTensor, tensors_touching
from ..errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    ChecksumMismatchError,
    ShardstreamError,
    UsageError,
    causes,
    shardstream_cause,
)
from ..formats import hf_names, native
from ..formats.regular_file import open_regular
from ..formats.safetensors import read_header
from ..storage import collectives as coll
from ..storage.run_layout import step_in_path
from ..units import DEFAULT_BUFFER_BYTES, parse_size
from . import fsdp1_shards, hooks, native_storage, schedulers
from . import state as st
from .arguments import check_live_objects, optimizer_parts

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    step: int
    extra: dict[str, Any]
    bytes_read: int
    wall_s: float


@dataclass
class _Source:
    """What a checkpoint directory offers to ``load``, whatever its format."""

    tensors: dict[str, GlobalTensor]
    endpoint: Any
    saved: set[str]
    objects: dict[str, Any]
    step: int
    read_extra: Any  # rank -> {"user": ..., "rng": ...}
    # Every tensor name saved, when model tensors the live model lacks are an error
    # (shardstream's format: saved with the same state-dict function). None: ignored, as DCP's
    # and verl's own loaders do.
    all_names: frozenset[str] | None = None
    # Run by every rank together once all have opened the source, before anything is read
    # into the live objects: DCP's items checked against their zip records' CRC-32s.
    precheck: Any = None
    # The file each part this rank restores comes from, where it is one ("lr_scheduler",
    # "optimizer", "extra state (RNG)"): a refusal names it rather than the directory.
    origins: dict[str, str] = dataclasses.field(default_factory=dict)
    # Describes only the tensors of the regions it was opened for (shardstream's format):
    # opened again when the targets grow.
    regional: bool = False


def _same_request_everywhere(
    path: Path, want_model: bool, want_optimizer: bool, contents: Iterable[str]
) -> tuple[bool, bool]:
    """Every rank restores the same checkpoint (by directory name), the same parts, and sees
    the same files there, or every rank raises: a rank that restored another step, or not
    the optimizer, would leave the others waiting in a collective or mix two states.
    Returns (a verl checkpoint, with optimizer files): the ranks then read a verl
    checkpoint's rank files in turns, a share each, which only works if all take that path."""
    from ..formats.source import Kind, detect, second_model

    here, error = None, None
    try:
        kind = detect(path)
        if not path.is_dir() and kind is not Kind.TORCH_FILE:
            what = "a file, not a checkpoint directory" if path.exists() else "no such directory"
            raise CheckpointNotFoundError(f"{path}: {what}")
        if (beside := second_model(path, kind)) is not None:
            raise CheckpointFormatError(beside)
        is_verl = kind is Kind.VERL
        layout = (is_verl, is_verl and any(path.glob("optim_world_size_*_rank_*.pt")))
        parts = tuple(sorted(contents)), want_model, want_optimizer
        here = (path.name, parts, layout)
    except Exception as exc:  # noqa: BLE001  (every rank must learn of it)
        error = exc
    seen = coll.gather_or_raise(here, error, "restore")
    odd = next((r for r, other in enumerate(seen) if other != seen[0]), None)
    if odd is not None:
        (name, parts, layout), (name0, parts0, layout0) = seen[odd], seen[0]
        if name != name0:
            why = f"rank {odd} restores {name!r}, rank 0 {name0!r}"
        elif parts != parts0:
            why = (
                f"rank {odd} restores {_parts(parts)}, rank 0 {_parts(parts0)} (load_contents, "
                "and whether a model and an optimizer are given, must agree)"
            )
        else:
            why = (
                f"rank {odd} sees other files there than rank 0 (verl model / optimizer "
                f"files: {layout} against {layout0})"
            )
        raise CheckpointFormatError(
            f"{path}: {why}; restore needs the same checkpoint and parts on every rank"
        )
    return here[2]


def _parts(parts: tuple) -> str:
    contents, model, optimizer = parts
    given = [w for w, on in (("model", model), ("optimizer", optimizer)) if on]
    return f"contents {list(contents)} into {' and '.join(given) or 'nothing'}"


def _open_source(
    path: Path,
    verify: bool,
    model,
    optimizer,
    want_optimizer: bool,
    regions=None,
    *,
    verl_optimizer_files: bool,
    prefix: str | None = None,
    presented: dict | None = None,
    states: tuple[str, ...] = (),
    fsdp1: fsdp1_shards.Layout | None = None,
) -> _Source:
    """A native checkpoint, or a verl one (model, optimizer and extra) under the same names.

    ``regions`` (name -> the part of the tensor this rank restores) lets a native checkpoint
    open only what this rank reads. Every rank opens a verl checkpoint together, reading a
    share of its rank files; ``verl_optimizer_files`` comes from ``_same_request_everywhere``,
    so all of them agree on whether its optimizer files are read too. ``fsdp1``: the live
    model's FSDP1 layout, which places verl's flat-parameter optimizer state."""
    from ..formats.source import PREFIXED_KINDS, Kind, checkpoints_below, detect

    kind = detect(path)
    if prefix is not None and kind not in PREFIXED_KINDS:
        raise UsageError(
            f"{path}: prefix= applies to DCP checkpoints (keys such as 'app.model.*') and "
            f"torch.save files; this is a {kind.value} one"
        )
    if kind is Kind.NATIVE:
        ckpt = native.open_native(path, regions)
        manifest = ckpt.manifest  # its step is the directory name's (read_manifest)
        return _Source(
            dict(ckpt.all_tensors),
            ckpt.endpoint if verify else FileEndpoint,
            set(manifest.get("contents", ())),
            _decoded_objects(path, manifest.get("objects", {})),
            int(manifest.get("step", 0)),
            lambda rank: _read_extra(ckpt, rank),
            all_names=frozenset(manifest.get("tensors", ())),
            regional=regions is not None,
        )
    if kind is Kind.DCP:
        chosen = _accelerate_model_part(path, want_optimizer or bool(states))
        if chosen is not None:  # <save_state dir>/pytorch_model_fsdp_N: model N's train state
            return _accelerate_source(
                path.parent, model, optimizer, want_optimizer, verify, prefix, presented,
                states, index=chosen,
            )  # fmt: skip
        # PyTorch DCP (torchtitan, PyTorch's recipe, accelerate's model directory): the model,
        # and the optimizer, scheduler and step of a train state when they are asked for.
        return _dcp_source(
            path, path, model, optimizer, want_optimizer, prefix, presented, states, verify
        )
    if kind is Kind.TORCH_SAVE:  # PyTorch's FSDP2 example: whole state dicts, torch.save
        from ..formats.source import TORCH_SAVE_OPTIMIZER_FILE

        optimizer_file = path / TORCH_SAVE_OPTIMIZER_FILE
        return _plain_state_source(
            path,
            optimizer_file if os.path.lexists(optimizer_file) else None,
            model,
            optimizer,
            want_optimizer,
            verify,
            prefix,
        )
    if kind is Kind.TORCH_FILE:  # one torch.save file: a state dict, or a general checkpoint
        from ..formats.torch_pt import load_layout
        from ..formats.torch_state_dict import torch_file_layout

        layout = torch_file_layout(load_layout(str(path)), path)
        source = _plain_state_source(
            path,
            path if layout.has_optimizer else None,
            model,
            optimizer,
            want_optimizer,
            verify,
            prefix,
            optimizer_part=layout.optimizer,
        )
        if layout.values:  # the recipe's epoch: LoadResult.extra
            source.saved.add("extra")
            source.read_extra = lambda rank: {"user": layout.values}
        return source
    if kind is Kind.DCP_HF:  # DCP's HuggingFaceStorageWriter: model tensors only
        from ..formats.dcp_hf import open_dcp_hf

        ckpt = open_dcp_hf(path)
        tensors = {native.MODEL_PREFIX + t.name: t for t in ckpt.tensors}
        return _Source(tensors, FileEndpoint, {"model"}, {}, _step_of(path), lambda rank: {})
    if kind is Kind.ACCELERATE:
        return _accelerate_source(
            path, model, optimizer, want_optimizer, verify, prefix, presented, states
        )
    if kind in (Kind.HF_MODEL, Kind.HF_TORCH):  # a model alone (save_pretrained's): the model
        source = _plain_state_source(path, None, model, optimizer, False, verify, prefix)
        source.step = _step_of(path)
        return source
    if kind is not Kind.VERL:
        from ..formats.source import refuse_local_state_dict, training_state_files

        refuse_local_state_dict(path)
        if state_files := training_state_files(path):
            raise CheckpointFormatError(
                f"{path}: holds a run's training state ({', '.join(state_files[:3])}) but no "
                "model: no model.safetensors, pytorch_model.bin, pytorch_model_fsdp_0/ or "
                "pytorch_model_fsdp.bin"
            )
        below = checkpoints_below(path)
        hint = (
            f"; {' and '.join(map(str, below))} "
            + ("holds one: pass that path" if len(below) == 1 else "hold one each: pass one")
            if below
            else ""
        )
        from ..formats.source import EXPECTED, unfinished_note, unread_hint

        unfinished = unfinished_note(path)
        hint = hint + unfinished if hint else unfinished or unread_hint(path)
        raise CheckpointNotFoundError(
            f"{path}: not a checkpoint shardstream restores ({EXPECTED}){hint}"
        )
    from ..formats import verl

    ckpt = verl.open_verl(path, shared=True)
    tensors = {native.MODEL_PREFIX + t.name: t for t in ckpt.tensors}
    saved, objects = {"model"}, {}
    world = ckpt.world_size
    if want_optimizer and verl_optimizer_files:
        error = flat = None
        prefix = native.OPTIMIZER_PREFIX + st.STATE
        try:  # local work between two shared reads: fail on every rank or on none
            groups, plain = verl.saved_param_groups(path, world)
            # the live model's flat parameters (FSDP1, use_orig_params=False), if it has them
            flat_live = fsdp1.optimizer_segments(optimizer) if fsdp1 else None
            segments = None
            if plain and fsdp1:
                segments = flat_live
            elif plain and world > 1 and not fsdp1_shards.wrapped(model):
                segments = fsdp1_shards.wrap_policy_segments(model, optimizer)
            if segments is not None and [len(g["params"]) for g in groups] == [
                len(units) for units in segments
            ]:  # an FSDP1 model as verl's FSDP1 run saved it: one entry per flat parameter
                live = [
                    {"params": [fqn for unit in units for fqn, _, _ in unit]} for units in segments
                ]
                flat = {
                    pid: unit
                    for saved_group, units in zip(groups, segments)
                    for pid, unit in zip(saved_group["params"], units)
                }
            else:
                live = st.optimizer_param_groups(model, optimizer)
                if flat_live is not None:
                    # saved per parameter (FSDP2, use_orig_params=True), restored into flat
                    # parameters, which list them in their own order
                    live = _in_saved_order(live, [t.name for t in ckpt.tensors])
                names = _parameter_names_by_position(path, groups, live)
                shapes = {t.name: t.shape for t in ckpt.tensors}
                if plain and world > 1 and all(fqn in shapes for fqn in names.values()):
                    # FSDP1 with use_orig_params: each rank holds a run of each parameter
                    flat = {pid: [(fqn, shapes[fqn], 0)] for pid, fqn in names.items()}
        except Exception as exc:  # noqa: BLE001
            error = exc
        coll.agree_or_raise(error, "restore")
        if flat is not None:
            parts = verl.flat_shard_of_ranks(ckpt.mesh_layout, world)
            optim, scalars = verl.open_verl_flat_optimizer(
                path, world, flat, prefix, shared=True, shard_of_rank=parts
            )
        else:
            optim, scalars = verl.open_verl_optimizer(path, world, names, prefix, shared=True)
        tensors.update({t.name: t for t in optim})
        objects["optimizer"] = {
            "param_groups": [
                {**saved_group, "params": live_group["params"]}
                for saved_group, live_group in zip(groups, live)
            ],
            "scalars": scalars,
        }
        saved.add("optimizer")
        scheduler = verl.read_extra_state(path, world, 0, verify).get("lr_scheduler")
        if scheduler is not None:
            objects["lr_scheduler"] = scheduler
    if any(path.glob("extra_state_world_size_*_rank_*.pt")):
        saved.add("extra")
    run_step = step_in_path(path)
    named = [(t.name, t.blocks) for t in tensors.values()]
    from ..formats.torch_pt import crc_checked_endpoint

    def tensors_in(location: str):
        return lambda lo, hi: tensors_touching(named, location, lo, hi)

    def checked_endpoint(location: str) -> FileEndpoint:  # each zip record's CRC-32
        return crc_checked_endpoint(location, tensors_in(location))

    endpoint = checked_endpoint if verify else FileEndpoint
    if verify and coll.world() > world:
        # A record's CRC covers the whole record (a saved rank's shard), and at a larger world
        # size each restoring rank reads only part of one: checked on read, every rank would
        # read W'/W times its share. Instead the ranks check the files between them first
        # (each file once, all bytes read twice in all) and read unchecked after.
        files = [*ckpt.files, *(verl.optimizer_files(path, world) if "optimizer" in saved else [])]
        verl.check_dealt_out([(location, None) for location in files], named, "restore")
        endpoint = FileEndpoint
    return _Source(
        tensors,
        endpoint,
        saved,
        objects,
        run_step or 0,
        lambda rank: _verl_extra(verl.read_extra_state(path, world, rank, verify)),
    )


def _decoded_objects(path: Path, objects: Any) -> dict[str, Any]:
    """A native manifest's ``objects`` (optimizer param groups, scheduler state) decoded;
    an entry ``state.encode`` could not have written is a ``CheckpointFormatError``."""
    if not isinstance(objects, dict):
        raise CheckpointFormatError(f"{path / native.MANIFEST}: 'objects' is not an object")
    out = {}
    for name, value in objects.items():
        try:
            out[name] = st.decode(value, {})
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise CheckpointFormatError(
                f"{path / native.MANIFEST}: objects entry {name!r} is malformed "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
    return out


def _dcp_source(
    path: Path,
    optimizer_dir: Path | None,
    model,
    optimizer,
    want_optimizer: bool,
    prefix,
    presented: dict | None = None,
    states: tuple[str, ...] = (),
    verify: bool = True,
) -> _Source:
    """A DCP model directory, with the train state in ``optimizer_dir`` (itself, for one
    ``dcp.save`` of everything; accelerate's ``optimizer_N`` beside it). ``states``: other
    containers to read (torchtitan's ``dataloader``). ``verify``: every item read is checked
    against its CRC-32s first (``_dcp_precheck``)."""
    from ..formats import dcp as dcp_format

    ckpt = dcp_format.open_dcp(path, prefix)
    unwrap = _unwrapper([t.name for t in ckpt.tensors], model)
    tensors = {
        native.MODEL_PREFIX + unwrap(t.name): dataclasses.replace(t, name=unwrap(t.name))
        for t in ckpt.tensors
    }
    saved, objects = {"model"}, {}
    step = _step_of(path)
    unread: list[GlobalTensor] = []  # optimizer tensors not restored: not checked either
    if optimizer_dir is not None:
        same = optimizer_dir == path
        train = dcp_format.open_dcp_train_state(
            optimizer_dir,
            containers=("optimizer", "lr_scheduler", "train_state", *states),
            metadata=ckpt.metadata if same else None,
            prefix=ckpt.prefix if same else "",
        )
        saved_step = train.objects.get("train_state", {})
        saved_step = saved_step.get("step") if isinstance(saved_step, dict) else None
        if isinstance(saved_step, torch.Tensor) and saved_step.numel() == 1:
            saved_step = saved_step.item()
        if type(saved_step) is int:
            step = saved_step
        if train.optimizer_tensors or "optimizer" in train.objects:
            saved.add("optimizer")
            if want_optimizer:
                state_head = native.OPTIMIZER_PREFIX + st.STATE
                for t in train.optimizer_tensors:
                    name = state_head + unwrap(t.name[len(state_head) :])
                    tensors[name] = dataclasses.replace(t, name=name)
                live = st.optimizer_param_groups(model, optimizer)
                saved_optimizer = train.objects.get("optimizer", {})
                if presented and isinstance(saved_optimizer, dict):
                    saved_optimizer = _presented_optimizer(saved_optimizer, presented)
                elif isinstance(saved_optimizer, dict):
                    saved_optimizer = _renamed_optimizer(saved_optimizer, unwrap, unwrap)
                objects["optimizer"] = _dcp_optimizer_objects(optimizer_dir, saved_optimizer, live)
            else:
                unread = train.optimizer_tensors
        if "lr_scheduler" in train.objects:
            objects["lr_scheduler"] = train.objects["lr_scheduler"]
        for name in states:
            if name in train.objects:
                objects[_STATE + name] = train.objects[name]
    source = _Source(tensors, FileEndpoint, saved, objects, step, lambda rank: {})
    if verify:
        directories = {path: ckpt.metadata}
        if optimizer_dir is not None and optimizer_dir != path:
            directories[optimizer_dir] = None
        source.precheck = _dcp_precheck(directories, unread)
    return source


def _dcp_precheck(directories: dict[Path, Any], unread: list[GlobalTensor]):
    """A ``precheck`` of every DCP item of ``directories`` (each with its unpickled
    ``.metadata``, or None) that a restore may read: model, optimizer, scheduler, train state;
    all but the items of ``unread`` (optimizer tensors not restored). Each item is a
    ``torch.save`` archive whose zip records carry CRC-32s, checked as verify checks them."""
    from ..formats.dcp import check_items_dealt_out, holds_offset, item_ranges

    skip: dict[str, list[int]] = {}
    for tensor in unread:
        for block in tensor.blocks:
            skip.setdefault(str(block.location), []).append(block.offset)
    for offsets in skip.values():
        offsets.sort()
    items = []
    for directory, metadata in directories.items():
        for item in item_ranges(directory, metadata):
            _, file, start, length = item
            if not holds_offset(skip.get(str(file), []), start, length):
                items.append(item)  # else it holds an optimizer tensor not restored here
    return lambda: check_items_dealt_out(items, "restore")


# objects["state:<name>"]: a Stateful's saved state, passed as load(states={name: obj})
_STATE = "state:"


def _accelerate_source(
    path: Path,
    model,
    optimizer,
    want_optimizer: bool,
    verify: bool,
    prefix,
    presented=None,
    states: tuple[str, ...] = (),
    index: int | None = None,
) -> _Source:
    """accelerate's ``save_state`` directory: model ``index`` and its optimizer (DCP), its
    scheduler, the RNG and the ``states`` asked for (``torch.save`` files by stem: scaler,
    custom_checkpoint_N, dl_state_dict[_N], scheduler_N), all read by the restricted
    unpickler. ``index`` None: the directory itself was passed, which must hold one model."""
    from ..formats.source import accelerate_state, several_models

    parts = accelerate_state(path, index or 0)
    if index is None and parts.models > 1 and (parts.full_state or parts.plain):
        model = "pytorch_model_fsdp.bin"
        if parts.plain:
            model = "model.safetensors or pytorch_model.bin"
        raise UsageError(
            f"{path}: {several_models(parts)}; restoring one of several models saved whole "
            "is not supported: put the files of the one meant in a directory of their own as "
            f"model 0's ({model}, optimizer.bin, scheduler.bin) with the RNG files"
        )
    if index is None and parts.models > 1:
        raise UsageError(
            f"{path}: holds {parts.models} models ("
            + ", ".join(f"pytorch_model_fsdp_{i}" for i in parts.indices)
            + f"); pass {path}/pytorch_model_fsdp_<i> to restore model i with its optimizer_<i>"
            " and scheduler (scheduler.bin for 0, scheduler_<i>.bin), the RNG and the states"
            " asked for"
        )
    if parts.plain:  # without FSDP: a HF model and the optimizer's own state_dict()
        source = _plain_state_source(
            path, parts.optimizer, model, optimizer, want_optimizer, verify, prefix
        )
    elif parts.full_state:  # FULL_STATE_DICT: pytorch_model_fsdp.bin, optimizer.bin
        source = _full_state_source(parts, model, optimizer, want_optimizer, verify, prefix)
    else:
        source = _dcp_source(
            parts.model,
            parts.optimizer,
            model,
            optimizer,
            want_optimizer,
            prefix,
            presented,
            verify=verify,
        )
    source.step = _step_of(path)
    unfinished = parts.unfinished_optimizers.get(parts.index)
    if parts.optimizer is None and want_optimizer and unfinished is not None:
        from ..formats.dcp import read_metadata

        read_metadata(unfinished)  # raises, naming the directory and the unfinished save
    if parts.optimizer is None:
        source.saved.discard("optimizer")
    else:
        source.origins["optimizer"] = str(parts.optimizer)
    if parts.scheduler is not None:
        source.objects["lr_scheduler"] = _read_pickle(parts.scheduler, verify, "the scheduler")
        source.origins["lr_scheduler"] = str(parts.scheduler)
    else:
        source.objects.pop("lr_scheduler", None)
    for name in states:
        stem = name.rsplit(".", 1)[0] if name.endswith((".pt", ".pkl", ".bin")) else name
        if stem in parts.samplers:
            raise UsageError(
                f"{parts.samplers[stem]}: accelerate pickles the SeedableRandomSampler object "
                "itself (with its dataset), which shardstream never unpickles; nothing was "
                "restored. Leave it out of states= and set the sampler's epoch yourself"
            )
        file = parts.states.get(stem)
        if file is None:
            raise CheckpointFormatError(
                f"{path}: holds no {name!r} state, so nothing was restored (states here: "
                f"{sorted(parts.states) or 'none'})"
            )
        source.objects[_STATE + name] = _read_pickle(file, verify, f"the {name}")
    if parts.rng:
        source.saved.add("extra")
        rng = parts.rng
        source.origins["extra state (RNG)"] = str(rng.get(coll.rank(), rng[min(rng)]))

        def read_extra(rank: int) -> dict:
            state = _read_pickle(rng.get(rank, rng[min(rng)]), verify, "the RNG state")
            return {"user": {}, "rng": _accelerate_rng(state)}

        source.read_extra = read_extra
    return source


def _full_state_source(
    parts, model, optimizer, want_optimizer: bool, verify: bool, prefix
) -> _Source:
    """accelerate's ``FULL_STATE_DICT``: the model's whole state dict and the optimizer's,
    one ``torch.save`` file each, read as a verl rank file of world size 1. ``verify``: the
    processes check the records they read against their CRC-32s between them first (each
    record once; every process reads part of each whole tensor), then read unchecked."""
    from ..formats.torch_state_dict import open_torch_optimizer, open_torch_state_dict

    ckpt = open_torch_state_dict(
        parts.model, world_size=parts.world_size, shared=True, prefix=prefix
    )
    tensors = {native.MODEL_PREFIX + t.name: t for t in ckpt.tensors}
    saved, objects = {"model"}, {}
    files = list(ckpt.files)
    if parts.optimizer is not None:
        saved.add("optimizer")
        if want_optimizer:
            state_prefix = native.OPTIMIZER_PREFIX + st.STATE
            optim, scalars, groups = open_torch_optimizer(parts.optimizer, state_prefix)
            tensors.update({t.name: t for t in optim})
            # saved by name: check_param_groups matches them to the live groups by name
            objects["optimizer"] = {"param_groups": groups, "scalars": scalars}
            files.append(str(parts.optimizer))
    source = _Source(tensors, FileEndpoint, saved, objects, 0, lambda rank: {})
    if verify:
        _check_records_first(source, files)
    return source


def _check_records_first(source: _Source, files: list[str]) -> None:
    """The zip records of the ``torch.save`` ``files`` are checked against their CRC-32s by
    the processes between them (each record once) before anything is read; a damaged one
    names the tensors of ``source`` it holds."""
    from ..formats import verl
    from ..formats.torch_pt import zip_records

    named = [(t.name, t.blocks) for t in source.tensors.values()]
    work = [(file, record) for file in files for record in zip_records(file)]
    source.precheck = lambda: verl.check_dealt_out(work, named, "restore")


def _plain_state_source(
    path: Path,
    optimizer_file: Path | None,
    model,
    optimizer,
    want_optimizer: bool,
    verify: bool,
    prefix,
    optimizer_part: str | None = None,
) -> _Source:
    """Saved whole (accelerate's ``save_state`` and the Trainer's ``checkpoint-N`` without
    FSDP, PyTorch's FSDP2 example): the model as its files hold it (whole tensors under the
    model's own names, or save_pretrained's), and the
    optimizer's own ``state_dict()``, whose integer parameter ids are the live optimizer's
    parameters position by position, param group by param group. ``verify``: the zip records
    of its ``torch.save`` files are checked by the processes between them first (as
    ``_full_state_source``), a safetensors model's chunks as they are read where shardstream
    wrote checksums into it (save_pretrained writes none)."""
    from ..formats.source import open_checkpoint
    from ..formats.torch_state_dict import TorchStateDict, open_torch_optimizer

    ckpt = open_checkpoint(path, shared=True, prefix=prefix)
    model_tensors, unused = ckpt.tensors, []
    if model is not None:
        model_tensors, unused = _in_memory_names(ckpt, model)
    if unused and optimizer_file is not None:  # a run's own save: all of it is the model's
        raise CheckpointFormatError(
            f"{path}: holds tensor {unused[0]!r}, which the live model has no place for "
            f"({len(unused)} such); was it saved from a different model?"
        )
    if unused:  # a model alone may hold more (DeepSeek's multi-token-prediction layers)
        log.warning(
            "%s: %d saved tensor(s) the live model has no place for were not read (%s)",
            path,
            len(unused),
            ", ".join(repr(n) for n in unused[:3]) + (", ..." if len(unused) > 3 else ""),
        )
    left = set(unused)  # not read, said above: not the restore's to refuse
    tensors = {native.MODEL_PREFIX + t.name: t for t in model_tensors if t.name not in left}
    saved, objects = {"model"}, {}
    pickled = list(ckpt.files) if isinstance(ckpt, TorchStateDict) else []
    if optimizer_file is not None:
        saved.add("optimizer")
        if want_optimizer:
            live = st.optimizer_param_groups(model, optimizer)

            def names_of(groups: list[dict]) -> dict[int, str]:
                return _parameter_names_by_position(optimizer_file, groups, live)

            state_prefix = native.OPTIMIZER_PREFIX + st.STATE
            optim, scalars, groups = open_torch_optimizer(
                optimizer_file, state_prefix, names_of, optimizer_part
            )
            tensors.update({t.name: t for t in optim})
            objects["optimizer"] = {"param_groups": groups, "scalars": scalars}
            pickled.append(str(optimizer_file))
    pickled = list(dict.fromkeys(pickled))  # one file may hold both (a general checkpoint)
    checked = set(pickled)

    def endpoint(location: str):
        if location in checked or not verify:  # prechecked, or not to be checked
            return FileEndpoint(location)
        return ckpt.endpoint(location)

    source = _Source(tensors, endpoint, saved, objects, 0, lambda rank: {})
    if verify and pickled:
        _check_records_first(source, pickled)
    return source


def _in_memory_names(ckpt, model: torch.nn.Module) -> tuple[list[GlobalTensor], list[str]]:
    """The model tensors of a HF model that ``save_pretrained`` wrote, under the live model's
    own names: where they differ (Qwen2.5-VL's ``model.language_model.*``, a fused MoE
    expert tensor saved as one tensor per expert), as blocks of the saved ones placed by the
    layout plan merge writes by (``hf_names``), planned for the live model's tensors; a head
    the live model ties to its embedding (save_pretrained leaves it out) is the embedding.
    Also returns the saved tensors none of the live ones is read from."""
    from ..engine.dtypes import code_of
    from ..formats import hf, hf_names

    stripped = hf_names.strip_wrappers([t.name for t in ckpt.tensors])  # DDP's module. too
    saved = {stripped[t.name]: t for t in ckpt.tensors}
    live = {k[len(native.MODEL_PREFIX) :]: v for k, v in st.model_tensors(model).items()}
    if all(name in saved for name in live):
        named = [dataclasses.replace(t, name=n) for n, t in saved.items()]
        return named, sorted(saved.keys() - live.keys())
    # Without config.json (accelerate's save) no layout is known: wrapper prefixes go only.
    config = hf.read_config(ckpt.config_dir()) if ckpt.config_dir() is not None else {}
    listed = [(name, code_of(t.dtype), tuple(t.shape)) for name, t in live.items()]
    shapes = {name: tuple(t.shape) for name, t in live.items()}
    plan = hf_names.plan_names(listed, config)
    view = hf_names.stored_view(plan, saved, shapes)
    storage = {}  # tied: one storage under two names
    for name, tensor in live.items():
        if (key := _storage_key(tensor)) is not None and name in view:
            storage.setdefault(key, view[name])
    for name, tensor in live.items():
        if name not in view and (key := _storage_key(tensor)) in storage:
            view[name] = dataclasses.replace(storage[key], name=name)
    used = {p.name for p in plan.pieces if p.stored in view}
    return list(view.values()), sorted(saved.keys() - used)


def _storage_key(tensor: Any) -> tuple | None:
    """Where a live tensor's elements lie on this rank (its storage, offset, shape, strides),
    equal for names the model ties; None for one without elements, or no tensor."""
    if isinstance(tensor, fsdp1_shards.FlatShard):  # FSDP1: its boxes of the flat storage
        keys = tuple(_storage_key(view) for _, view in tensor.pieces)
        return keys if keys and None not in keys else None
    local = st.local_shard(tensor)
    if not isinstance(local, torch.Tensor) or local.numel() == 0:
        return None
    storage = local.untyped_storage().data_ptr()
    return storage, local.storage_offset(), tuple(local.shape), local.stride()


def _unwrapper(saved: list[str], model: torch.nn.Module | None) -> Callable[[str], str]:
    """Saved FQN -> live FQN for a model state saved under wrapper prefixes (a compiled
    model's own ``state_dict()``: ``_orig_mod.``; FSDP1's and activation checkpointing's
    modules; DDP's leading ``module.`` on every key), which torch's state-dict API, and so
    the live names, leave out. Two saved names that become one are refused."""
    stripped = hf_names.strip_wrappers(saved)  # raises on a collision
    wrapped = any(k != v for k, v in stripped.items())
    bare_lora = any(_BARE_LORA.search(n) for n in saved)
    if not wrapped and not bare_lora:
        return lambda fqn: fqn
    live = [] if model is None else st.model_tensors(model)
    live = [n[len(native.MODEL_PREFIX) :] for n in live]
    adapters = _adapter_names(live, saved) if bare_lora else {}
    if not wrapped and not adapters:
        return lambda fqn: fqn
    drop_module = all(
        hf_names.without_wrapper_parts(n).startswith(hf_names.DDP_PREFIX) for n in saved
    ) and not any(n.startswith(hf_names.DDP_PREFIX) for n in live)

    def unwrap(fqn: str) -> str:
        fqn = hf_names.without_wrapper_parts(fqn)
        if drop_module and fqn.startswith(hf_names.DDP_PREFIX):
            fqn = fqn[len(hf_names.DDP_PREFIX) :]
        return adapters.get(fqn, fqn)

    return unwrap


# PEFT's LoRA modules. A weight's live name holds the adapter's name after the module's
# (``q_proj.lora_A.default.weight``, ``lora_embedding_A.default``); PEFT saves it without.
_LORA_MODULE = r"\.(?:lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
_ADAPTER_NAME = re.compile(rf"(.*{_LORA_MODULE})\.[^.]+((?:\.weight|\.bias)?)")
_BARE_LORA = re.compile(rf"{_LORA_MODULE}(?:\.weight|\.bias)?\Z")


def _adapter_names(live: list[str], saved: list[str]) -> dict[str, str]:
    """Saved name -> live name for LoRA weights PEFT saved without the adapter's name (its
    ``get_peft_model_state_dict``: what accelerate's sharded save of a PeftModel holds), where
    the live model names them with it and the saved names lack the live ones."""
    names = set(saved)
    out: dict[str, str] = {}
    for name in live:
        match = _ADAPTER_NAME.fullmatch(name)
        if match is None or name in names:
            continue
        bare = match[1] + match[2]
        if bare in names:
            if bare in out:  # two adapters: which is meant is unknown
                return {}
            out[bare] = name
    return out


def _renamed_optimizer(
    saved: dict, rename: Callable[[str], str], rename_flat: Callable[[str], str]
) -> dict:
    """A DCP optimizer entry with its parameter names renamed: ``rename`` for the nested
    state's keys and param groups' ``params``, ``rename_flat`` for the FQN in flattened
    ``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>`` keys."""
    out: dict = {}
    for key, value in saved.items():
        for head in (st.STATE, "param_groups."):
            if isinstance(key, str) and key.startswith(head):
                key = head + rename_flat(key[len(head) :])
                break
        out.setdefault(key, value)
    return _renamed_nested(out, rename)


def _presented_optimizer(saved: dict, presented: dict) -> dict:
    """A DCP optimizer entry saved under a hooked model's presented names, in live FQNs:
    nested state and param groups' ``params``, or flattened ``state.``/``param_groups.`` keys."""
    out = hooks.translate_names(saved, presented, (st.STATE, "param_groups."))
    return _renamed_nested(out, hooks.renamer(presented))


def _renamed_nested(out: dict, rename: Callable[[str], str]) -> dict:
    nested = out.get("state")
    if isinstance(nested, dict):
        out["state"] = {}
        for fqn, entries in nested.items():
            out["state"].setdefault(rename(fqn), entries)
    groups = out.get("param_groups")
    if isinstance(groups, list):
        renamed = []
        for group in groups:
            if isinstance(group, dict) and isinstance(group.get("params"), list):
                names = [rename(p) if isinstance(p, str) else p for p in group["params"]]
                group = {**group, "params": list(dict.fromkeys(names))}
            renamed.append(group)
        out["param_groups"] = renamed
    return out


def _accelerate_model_part(path: Path, whole: bool) -> int | None:
    """N, when ``path`` is ``pytorch_model_fsdp_N`` of an accelerate ``save_state`` directory
    holding several models and ``whole`` (more than the model asked for): that directory
    restores with model N. Else such a part (``optimizer_N``, or the model of a directory
    with one) is refused, naming what to pass: the directory, or with several models
    ``pytorch_model_fsdp_N``."""
    from ..formats.source import (
        ACCELERATE_MODEL_DIR,
        ACCELERATE_OPTIMIZER_DIR,
        accelerate_state,
    )

    model = ACCELERATE_MODEL_DIR.match(path.name)
    optimizer = ACCELERATE_OPTIMIZER_DIR.match(path.name)
    if not (model or optimizer) or (model and not whole):
        return None
    parts = accelerate_state(path.parent)
    if parts is None:
        return None
    index = int((model or optimizer)[1])
    if model and parts.models > 1 and index in parts.indices:
        return index  # the directory holds several: this path picks one
    target = path.parent
    if parts.models > 1 and index in parts.indices:
        target = path.parent / f"pytorch_model_fsdp_{index}"
    raise CheckpointFormatError(
        f"{path}: one part of accelerate's save_state directory {path.parent}; pass "
        f"{target} to restore its model, optimizer, scheduler and RNG state together"
    )


def _read_pickle(file: Path, verify: bool, what: str) -> Any:
    """A small ``torch.save`` file (scheduler, RNG) through the restricted unpickler, which
    admits containers, numbers, strings, tensors and numpy arrays and refuses any code."""
    from ..formats.torch_pt import check_records, load_restricted, numpy_globals

    if verify:
        check_records(str(file))
    return load_restricted(str(file), f"{file} ({what})", "cpu", numpy_globals())


def _accelerate_rng(state: Any) -> dict:
    """accelerate's (``random_states_N.pkl``) or the Trainer's (``rng_state_N.pth``) RNG
    entries in shardstream's form."""
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"RNG state is a {type(state).__name__}, not a dict")
    names = {
        "torch": ("torch_manual_seed", "cpu"),
        "random": ("random_state", "python"),
        "numpy": ("numpy_random_seed", "numpy"),
        "cuda": ("torch_cuda_manual_seed", "cuda"),
    }
    out = {}
    for ours, theirs in names.items():
        for name in theirs:
            if name in state:
                out[ours] = state[name]
                break
    if "torch" not in out:
        raise CheckpointFormatError("RNG state holds no torch generator state")
    return out


def _shown(name: str) -> str:
    """A restore's internal tensor name as a message shows it: a model tensor by its own
    name, an optimizer's as ``optimizer.state.<fqn>.<kind>``."""
    if name.startswith(native.MODEL_PREFIX):
        return f"model tensor {name[len(native.MODEL_PREFIX) :]!r}"
    return f"tensor {name!r}"


def _checked_targets(
    path: Path,
    source: _Source,
    model_tensors: dict | None,
    optim_tensors: dict | None,
    live_kinds: set[str] | None = None,
    frozen: frozenset[str] = frozenset(),
    ignore_frozen_params: bool = False,
) -> dict[str, torch.Tensor]:
    """The live tensors to fill (None: not restored), once the checkpoint is known to hold
    them with their shapes, and no kind of optimizer state the live optimizer lacks
    (``live_kinds``: the kinds it keeps, on any rank; None when it is not restored). The
    model tensors named in ``frozen`` (parameters without a gradient) may be missing with
    ``ignore_frozen_params``: they are left as they are."""
    saved, available = source.saved, source.tensors
    for what, tensors in (("model", model_tensors), ("optimizer", optim_tensors)):
        if tensors is not None and what not in saved:
            raise CheckpointFormatError(f"{path}: holds no {what} state (saved: {sorted(saved)})")
    saved_model = [k for k in available if k.startswith(native.MODEL_PREFIX)]
    if model_tensors and saved_model and all(st.is_lora_name(k) for k in saved_model):
        # A LoRA-only checkpoint (save_lora_only): fill the adapters, keep the base weights.
        model_tensors = {k: v for k, v in model_tensors.items() if st.is_lora_name(k)}
    targets = {**(model_tensors or {}), **(optim_tensors or {})}
    missing = [k for k in targets if k not in available]
    if missing and ignore_frozen_params:
        targets = {k: v for k, v in targets.items() if k in available or k not in frozen}
        missing = [k for k in missing if k not in frozen]
    if missing and all(k.startswith(native.OPTIMIZER_PREFIX) for k in missing):
        wanted = ", ".join(sorted({_state_kind(k) for k in missing}))
        everything = source.all_names or available
        kept = {_state_kind(k) for k in everything if k.startswith(native.OPTIMIZER_PREFIX)}
        raise CheckpointFormatError(
            f"{path}: checkpoint has no {_shown(missing[0])} ({len(missing)} missing): the "
            f"live optimizer keeps {wanted}, the checkpoint "
            f"{', '.join(sorted(kept)) if kept else 'no optimizer tensors'}; saved by another "
            "optimizer or other settings (momentum, amsgrad)? Restore the model alone "
            "(load_contents without 'optimizer') to start the optimizer afresh"
        )
    if missing and set(missing) <= frozen:
        raise CheckpointFormatError(
            f"{path}: checkpoint has no {_shown(missing[0])} ({len(missing)} missing), each "
            "a parameter that requires no gradient (saved with ignore_frozen_params=True?); "
            "restore with ignore_frozen_params=True to keep their live values"
        )
    if missing:
        raise CheckpointFormatError(
            f"{path}: checkpoint has no {_shown(missing[0])} ({len(missing)} missing); "
            "was it saved from a different model?"
        )
    everything = source.all_names if source.all_names is not None else available
    saved_names = sorted(k for k in everything if k.startswith(native.MODEL_PREFIX))
    unexpected = [k for k in saved_names if k not in model_tensors] if model_tensors else []
    if unexpected:
        raise CheckpointFormatError(
            f"{path}: checkpoint has {_shown(unexpected[0])}, which the model lacks "
            f"({len(unexpected)} such); was it saved from a different model?"
        )
    if live_kinds is not None:  # every format: the names saved, else those the source holds
        saved_optimizer = source.objects.get("optimizer")
        scalars = saved_optimizer.get("scalars") if isinstance(saved_optimizer, dict) else None
        names = [*(source.all_names or available), *(scalars if isinstance(scalars, dict) else ())]
        lacking = [
            k
            for k in names
            if isinstance(k, str)
            and k.startswith(native.OPTIMIZER_PREFIX)
            and _state_kind(k) not in live_kinds
        ]
        if lacking:
            kinds = ", ".join(sorted({_state_kind(k) for k in lacking}))
            raise CheckpointFormatError(
                f"{path}: checkpoint has optimizer state the live optimizer lacks ({kinds}; "
                f"{len(lacking)} values, e.g. {lacking[0]!r}): saved by another optimizer or "
                "other settings (momentum, amsgrad). Restore the model alone (load_contents "
                "without 'optimizer') to start the optimizer afresh"
            )
    for name, tensor in targets.items():
        if tuple(tensor.shape) != available[name].shape:
            raise CheckpointFormatError(
                f"{path}: {_shown(name)} has shape {list(available[name].shape)} in the "
                f"checkpoint but {list(tensor.shape)} in the model"
            )
    return targets


def _frozen_names(model: torch.nn.Module) -> frozenset[str]:
    """The model tensors (``model.<fqn>``, as ``state.model_tensors`` names them) that are
    parameters requiring no gradient: those torch's ``ignore_frozen_params`` leaves out."""
    if not any(not p.requires_grad for p in model.parameters()):
        return frozenset()
    kept = st.model_tensors(model, ignore_frozen_params=True)
    return frozenset(k for k in st.model_tensors(model) if k not in kept)


def _one_per_storage(
    path: Path,
    source: _Source,
    targets: dict[str, torch.Tensor],
    regions: dict,
    buffer_bytes: int,
) -> dict[str, torch.Tensor]:
    """``targets`` with one name per live storage: names the live model ties (an embedding
    and its head) hold one tensor, which can take the checkpoint's only if the checkpoint
    holds the same bytes under each (each rank compares its own part). Refused otherwise,
    naming both: whichever was read last would silently win."""
    _refuse_overlaps(path, targets)
    first: dict[tuple, str] = {}
    kept = {}
    for name, tensor in targets.items():
        key = _storage_key(tensor)
        if key is None:
            kept[name] = tensor
            continue
        if key not in first:
            first[key] = name
            kept[name] = tensor
            continue
        other = first[key]
        start, shape = regions[name]
        if source.tensors[other].blocks == source.tensors[name].blocks:
            continue  # one saved tensor under both names (a head left out, read from its twin)
        if not native_storage.saved_boxes_equal(
            other, name, start, shape, tensor.dtype, source.tensors, source.endpoint, buffer_bytes
        ):
            if name.startswith(native.OPTIMIZER_PREFIX):
                raise CheckpointFormatError(
                    f"{path}: {other!r} and {name!r} are one value in the live optimizer (the "
                    "state of one FSDP1 flat parameter, use_orig_params=False), but the "
                    "checkpoint holds different values for them. Wrap the model with "
                    "use_orig_params=True to restore each"
                )
            raise CheckpointFormatError(
                f"{path}: the live model ties {_fqn(other)!r} and {_fqn(name)!r} (one "
                "parameter), but the checkpoint holds different values for them: saved "
                "from an untied model? Untie them in the live model (tie_word_embeddings="
                "False) to restore both"
            )
    return kept


def _refuse_overlaps(path: Path, targets: dict[str, Any]) -> None:
    """Live tensors that overlap in memory without being one tensor under two names (a buffer
    that is another's transpose), or whose own elements share memory (an expanded tensor):
    whichever value is written last would win, so the restore is refused, as torch's
    ``load_state_dict`` refuses the second."""
    spans: dict[int, list[tuple[int, int, str, tuple | None]]] = {}
    for name, tensor in targets.items():
        local = st.local_shard(tensor)
        if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.numel() == 0:
            continue  # an FSDP1 flat shard: its own layout, placed by fsdp1_shards
        if torch._debug_has_internal_overlap(local) == 1:
            raise CheckpointFormatError(
                f"{path}: the live tensor {_fqn(name)!r} has elements that share memory (an "
                "expanded tensor), so restoring it would keep one saved value for many; "
                "make it a tensor of its own (.clone()) to restore it"
            )
        size = local.element_size()
        low = local.storage_offset() * size
        high = low + (sum((n - 1) * st for n, st in zip(local.shape, local.stride())) + 1) * size
        spans.setdefault(local.untyped_storage().data_ptr(), []).append(
            (low, high, name, _storage_key(tensor))
        )
    for found in spans.values():
        found.sort()
        for (_, high, a, key_a), (low, _, b, key_b) in zip(found, found[1:]):
            if low < high and key_a != key_b:
                raise CheckpointFormatError(
                    f"{path}: the live tensors {_fqn(a)!r} and {_fqn(b)!r} overlap in memory "
                    "without being one tensor, so restoring both would leave whichever is "
                    "written last"
                )


def _fqn(name: str) -> str:
    return name.removeprefix(native.MODEL_PREFIX)


def _lacking_state(model, optimizer, source: _Source, flat) -> list[torch.Tensor]:
    """The live optimizer's parameters (``flat``: FSDP1's, as its optimizer keys them) that
    the checkpoint keeps state for and the live optimizer does not."""
    owners = flat.params if flat is not None else st.parameters_by_fqn(model)
    grouped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    lacking: dict[int, torch.Tensor] = {}
    for fqn in sorted(_saved_stateful(source)):
        param = owners.get(fqn)
        if param is not None and id(param) in grouped and not optimizer.state.get(param):
            lacking[id(param)] = param
    return list(lacking.values())


def _saved_stateful(source: _Source) -> set[str]:
    """The parameters (FQNs) the checkpoint keeps optimizer state for."""
    saved_optimizer = source.objects.get("optimizer")  # checked by _checked_parts, named there
    scalars = saved_optimizer.get("scalars") if isinstance(saved_optimizer, dict) else None
    names = (*(source.all_names or source.tensors), *(scalars if isinstance(scalars, dict) else ()))
    return _stateful(names)


def _with_saved_state(optim_tensors: dict, source: _Source) -> dict:
    """The live optimizer's entries for the parameters the checkpoint keeps state for. One
    that never had a gradient (a tower trained on other data, an expert never routed to)
    has none there: it gets none here either, as torch's ``Optimizer.load_state_dict`` does.
    A parameter with some kinds of state but not others is still missing state, and so is
    every parameter of a checkpoint with no state at all (a stateless optimizer's, such as
    plain SGD's, is not restored into one that keeps state)."""
    saved = _saved_stateful(source)
    if not saved:
        return optim_tensors
    return {k: v for k, v in optim_tensors.items() if (p := _param_of(k)) is None or p in saved}


def _stateful(names: Iterable[str]) -> set[str]:
    """The parameters (FQNs) that ``optimizer.state.<fqn>.<kind>`` names among ``names``
    give state."""
    return {p for p in map(_param_of, names) if p is not None}


def _param_of(name: str) -> str | None:
    """``optimizer.state.<fqn>.<kind>`` -> ``<fqn>``; None for any other name."""
    prefix = native.OPTIMIZER_PREFIX + st.STATE
    if not isinstance(name, str) or not name.startswith(prefix):
        return None
    return name[len(prefix) :].rpartition(".")[0]


def _state_kind(name: str) -> str:
    """``optimizer.state.<fqn>.exp_avg`` -> ``exp_avg``."""
    return name.rsplit(".", 1)[-1]


def _local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global start, shape) of the part of ``tensor`` this rank holds."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, fsdp1_shards.FlatShard):
        return fsdp1_shards.region(tensor)
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, start = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        return tuple(start), tuple(shape)
    return (0,) * tensor.dim(), tuple(tensor.shape)


def _step_of(path: Path) -> int:
    """The step a directory is named for (``global_step_N``, torchtitan's ``step-N``), else 0."""
    from ..formats.dcp import step_of_name

    return step_of_name(path.name) or 0


def _dcp_optimizer_objects(path: Path, saved: Any, live: list[dict]) -> dict:
    """DCP's optimizer values (nested, or flattened by ``flatten_optimizer_state_dict``) as
    ``apply_optimizer_state`` takes them: param groups with the live FQNs, and scalar state."""
    if not isinstance(saved, dict):
        raise CheckpointFormatError(f"{path}: the optimizer entry is not a mapping")
    prefix = native.OPTIMIZER_PREFIX + st.STATE
    scalars: dict[str, Any] = {}
    nested_state = saved.get("state")
    if isinstance(nested_state, dict):
        for fqn, entries in nested_state.items():
            for key, value in (entries if isinstance(entries, dict) else {}).items():
                scalars[f"{prefix}{fqn}.{key}"] = value
    for key, value in saved.items():
        if isinstance(key, str) and key.startswith(st.STATE):
            scalars[native.OPTIMIZER_PREFIX + key] = value
    groups = saved.get("param_groups")
    if isinstance(groups, list):  # nested: hyperparameters per group, params as FQNs
        _check_group_sizes(path, groups, live)
        restored = [{**g, "params": h["params"]} for g, h in zip(groups, live)]
    else:  # flattened: param_groups.<fqn>.<key>, the same for every parameter of a group
        restored = []
        for group in live:
            values = None
            for fqn in group["params"]:
                head = f"param_groups.{fqn}."
                mine = {k[len(head) :]: v for k, v in saved.items() if str(k).startswith(head)}
                if not mine:
                    raise CheckpointFormatError(
                        f"{path}: no saved param group holds parameter {fqn!r}"
                    )
                if values is None:
                    values, first = mine, fqn
                elif not _same_settings(mine, values):
                    raise CheckpointFormatError(
                        f"{path}: parameters {first!r} and {fqn!r} share a param group in the "
                        "live optimizer but were saved with different settings (another "
                        "grouping); build the optimizer's param groups as the run did"
                    )
            restored.append({**group, **(values or {}), "params": group["params"]})
    return {"param_groups": restored, "scalars": scalars}


def _check_group_sizes(path: Path, groups: list, live: list[dict]) -> None:
    """DCP's nested param groups hold as many parameters as the live optimizer's, group by
    group; where they do not, the parameters one side lacks are named (a model of another
    depth shows here first: its optimizer's groups differ too)."""
    if len(groups) != len(live):
        raise CheckpointFormatError(
            f"{path}: the optimizer's param groups: {len(groups)} saved, {len(live)} live; "
            "build the optimizer's param groups as the run did"
        )
    for index, (group, mine) in enumerate(zip(groups, live)):
        params = group.get("params", ()) if isinstance(group, dict) else ()
        if len(params) == len(mine["params"]):
            continue
        saved = {p for p in params if isinstance(p, str)}
        missing = [p for p in mine["params"] if p not in saved]
        unexpected = sorted(saved - set(mine["params"]))
        said = (
            f"param group {index} holds {len(params)} parameters saved, {len(mine['params'])} live"
        )
        if missing or unexpected:
            first = (
                f"no saved state of live parameter {missing[0]!r}"
                if missing
                else f"saved state of {unexpected[0]!r}, which the live model lacks"
            )
            said += (
                f": {first} ({len(missing)} missing, {len(unexpected)} unexpected); was it "
                "saved from a different model?"
            )
        else:
            said += "; build the optimizer's param groups as the run did"
        raise CheckpointFormatError(f"{path}: {said}")


def _same_settings(a: dict, b: dict) -> bool:
    """Two param groups' saved hyperparameters (tensors compared by value)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            x, y = torch.as_tensor(x), torch.as_tensor(y)
            if x.shape != y.shape or not torch.equal(x, y.to(x.dtype)):
                return False
        elif x != y:
            return False
    return True


def _in_saved_order(live: list[dict], saved_names: list[str]) -> list[dict]:
    """``live`` param groups, each group's FQNs in the order of ``saved_names`` (the saving
    model's state dict: the order of its ``parameters()``, by which its optimizer numbered
    them), where every FQN is among them; else as they are."""
    at = {name: i for i, name in enumerate(saved_names)}
    if not all(fqn in at for group in live for fqn in group["params"]):
        return live
    return [{**group, "params": sorted(group["params"], key=at.__getitem__)} for group in live]


def _parameter_names_by_position(path: Path, saved: list[dict], live: list[dict]) -> dict[int, str]:
    """An optimizer's own integer parameter ids (verl's files, a save without FSDP) -> FQNs,
    matching param groups position by position."""
    if len(saved) != len(live) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved, live)
    ):
        raise CheckpointFormatError(
            f"{path}: the saved optimizer has param groups of sizes "
            f"{[len(g['params']) for g in saved]}, the live one "
            f"{[len(g['params']) for g in live]}; build the optimizer as the run did"
        )
    return {pid: fqn for s, g in zip(saved, live) for pid, fqn in zip(s["params"], g["params"])}


def _verl_extra(state: dict) -> dict:
    """verl's RNG entry ({"cpu", "numpy", "random"[, "cuda"]}) in shardstream's form."""
    rng = state.get("rng") or {}
    out = {}
    if "cpu" in rng:
        out["torch"] = rng["cpu"]
    for key in ("numpy", "random", "cuda"):
        if key in rng:
            out[key] = rng[key]
    return {"user": {}, "rng": out} if "torch" in out else {"user": {}}


def _warn_of_extra_state_left_as_it_is(model: torch.nn.Module) -> None:
    """Say which modules keep extra state (``get_extra_state``) that is not a tensor: restore
    sets tensors, so theirs stays the live value (TransformerEngine's FP8 metadata as older
    versions keep it, a dict; newer ones keep a tensor, which is restored)."""
    kept = []
    for name, module in model.named_modules():
        if type(module).get_extra_state is torch.nn.Module.get_extra_state:
            continue
        value = module.get_extra_state()
        if not isinstance(value, torch.Tensor):
            kept.append(f"{name or '<root>'} ({type(value).__name__})")
    if kept and coll.rank() == 0:
        log.warning(
            "shardstream: not restored, left as the live model has it: the extra state "
            "(get_extra_state) of %d module%s that is not a tensor: %s",
            len(kept),
            "s" if len(kept) != 1 else "",
            ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else ""),
        )


@gc_paused()
def load(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    contents: Iterable[str] = native.DEFAULT_CONTENTS,
    verify: bool = True,
    buffer_size: int | str = DEFAULT_BUFFER_BYTES,
    restore_rng: bool = True,
    prefix: str | None = None,
    states: Mapping[str, Any] | None = None,
    ignore_frozen_params: bool = False,
) -> LoadResult:
    """Load ``path`` into live (possibly FSDP2-sharded) objects at any world size, in place.

    Every part asked for (model, optimizer, scheduler, RNG) is opened and checked against the
    live objects first, and every rank must ask for the same checkpoint and parts; if one
    cannot be restored, nothing is touched and every rank raises an error naming it. A
    checksum mismatch met while streaming stops the restore, naming the file; what was read
    before it is in place by then.
    ``prefix``: what a DCP checkpoint's model keys start with ("app.model.", "" for the top
    level), where detection finds several candidates. ``states``: other Stateful objects of
    a DCP train state by container name (torchtitan's ``{"dataloader": ..., "train_state":
    ...}``), or of an accelerate ``save_state`` directory by file stem (``"scaler"``,
    ``"custom_checkpoint_0"``, ``"dl_state_dict"``, ``"scheduler_1"``), each loaded with its
    saved values merged over its own ``state_dict()``. An accelerate directory with several
    models restores one: pass its ``pytorch_model_fsdp_N`` for model N.
    ``ignore_frozen_params``: the checkpoint may lack parameters that do not require a gradient
    (saved with torch's ``StateDictOptions(ignore_frozen_params=True)``); those it lacks keep
    their live values, those it holds are restored.

    >>> step = shardstream.load("ckpt/step_10", model=model, optimizer=opt).step  # doctest: +SKIP
    """
    started = time.perf_counter()
    check_live_objects(model, optimizer, lr_scheduler)
    contents = native.check_contents(contents, "load_contents")
    parts = optimizer_parts(optimizer)
    if parts is not None:  # torchtitan's OptimizersContainer: each optimizer in turn
        kinds: set[str] = set()  # of state, over the container: what any of them keeps
        for part in parts if "optimizer" in contents and model is not None else ():
            fresh = not part.state
            kinds |= {_state_kind(k) for k in st.optimizer_state(model, part)[0]}
            if fresh:
                part.state.clear()  # as it was: its own restore makes it again
        token = _CONTAINER_KINDS.set(frozenset().union(*coll.gather(sorted(kinds))))
        try:
            return _load_parts(
                path, model, parts, lr_scheduler, contents, verify, buffer_size,
                restore_rng, prefix, states, ignore_frozen_params,
            )  # fmt: skip
        finally:
            _CONTAINER_KINDS.reset(token)
    if "optimizer" in contents and optimizer is not None and model is None:
        raise UsageError(
            "load_contents includes 'optimizer' but no model was given: optimizer state is "
            "restored by the names of the model's parameters"
        )
    path = Path(path)
    want_model = "model" in contents and model is not None
    want_optimizer = "optimizer" in contents and optimizer is not None
    _, verl_optimizer_files = _same_request_everywhere(path, want_model, want_optimizer, contents)
    if want_model:
        _warn_of_extra_state_left_as_it_is(model)
    # A model whose state_dict hooks present other keys (torchtitan's fused QKV): its live
    # tensors by attribute, the saved ones described in their terms (training/hooks.py).
    presented = None
    if (want_model or want_optimizer) and st.has_state_dict_hooks(model):
        presented = hooks.presented_regions(model)
    # FSDP1: fill the flat parameters' shards and the optimizer state in place, not torch's
    # gathered copies (training/fsdp1_shards.py).
    fsdp1 = fsdp1_shards.layout(model) if (want_model or want_optimizer) and not presented else None
    # torch's state-dict API creates a never-stepped optimizer's state (a step at lr 0) to
    # name the targets; a restore refused before any tensor is read takes it away again.
    fresh = optimizer.state if want_optimizer and not optimizer.state else None
    flat = fsdp1.restore_targets(model, optimizer if want_optimizer else None) if fsdp1 else None
    if flat is not None:
        model_tensors = flat.model if want_model else {}
        optim_tensors, live_optimizer = (
            (flat.optimizer, flat.objects) if want_optimizer else ({}, {})
        )
    else:
        if want_model:
            model_tensors = hooks.live_tensors(model) if presented else st.model_tensors(model)
        else:
            model_tensors = {}
        optim_tensors, live_optimizer = (
            st.optimizer_state(model, optimizer) if want_optimizer else ({}, {})
        )
    regions = {n: _local_region(t) for n, t in {**model_tensors, **optim_tensors}.items()}
    # The kinds of state (exp_avg, momentum_buffer...) the live optimizer keeps, over all
    # ranks: a rank of FSDP1 holds some parameters' state only.
    live_kinds = None
    if want_optimizer:
        mine = sorted({_state_kind(k) for k in optim_tensors})
        live_kinds = set().union(*coll.gather(mine)) | _CONTAINER_KINDS.get()

    def opened() -> _Source:
        source = _open_source(
            path,
            verify,
            model,
            optimizer,
            want_optimizer,
            regions,
            verl_optimizer_files=verl_optimizer_files,
            prefix=prefix,
            presented=presented,
            states=tuple(states or ()),
            fsdp1=fsdp1,
        )
        if presented:
            source.tensors = hooks.translate(source.tensors, presented, hooks.live_tensors(model))
            if "optimizer" in source.objects:
                optimizer_objects = source.objects["optimizer"]
                optimizer_objects["scalars"] = hooks.translate_names(
                    optimizer_objects.get("scalars", {}), presented
                )
        return source

    # Ranks open only the files they read, so one may fail where others do not: fail together,
    # before the collective load.
    error: Exception | None = None
    created: list[torch.Tensor] = []  # parameters given state here, for the saved state
    try:
        source = opened()
        if want_optimizer and (created := _lacking_state(model, optimizer, source, flat)):
            # Saved state for parameters the live optimizer keeps none for (frozen, or never
            # given a gradient in this run): torch's load_state_dict gives it to them, and so
            # does this, into state their first step creates.
            st.create_optimizer_state(optimizer, created)
            if flat is not None:
                flat = fsdp1.restore_targets(model, optimizer)
                optim_tensors, live_optimizer = flat.optimizer, flat.objects
            else:
                optim_tensors, live_optimizer = st.optimizer_state(model, optimizer)
            live_kinds = live_kinds | {_state_kind(k) for k in optim_tensors}
            for name, tensor in optim_tensors.items():
                regions.setdefault(name, _local_region(tensor))
            if source.regional:
                source = opened()
        if want_optimizer:
            optim_tensors = _with_saved_state(optim_tensors, source)
        targets = _checked_targets(
            path,
            source,
            model_tensors if want_model else None,
            optim_tensors if want_optimizer else None,
            live_kinds,
            _frozen_names(model) if want_model else frozenset(),
            ignore_frozen_params,
        )
        pending = _checked_parts(
            path,
            source,
            model,
            optim_tensors,
            live_optimizer.get("param_groups"),
            lr_scheduler,
            contents,
            restore_rng,
            flat.names if flat is not None else None,
            frozenset(optimizer.defaults) if want_optimizer else frozenset(),
        )
        pending.states = _checked_states(path, source, states or {})
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the others hear of it
        error = exc
    try:
        coll.agree_or_raise(error, "restore")
        if source.precheck is not None:
            source.precheck()
        try:  # after the precheck: compares verified bytes
            targets = _one_per_storage(path, source, targets, regions, parse_size(buffer_size))
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others hear of it
            error = exc
        coll.agree_or_raise(error, "restore")
    except BaseException:
        if fresh is not None:
            fresh.clear()
        for param in created:
            optimizer.state.pop(param, None)
        raise
    available, endpoint = source.tensors, source.endpoint
    reader = native_storage.StreamingReader(
        {k: available[k] for k in targets}, endpoint, parse_size(buffer_size)
    )
    if targets:
        try:
            if flat is not None:  # boxes no DTensor describes; each rank reads its own
                failure = None
                try:
                    reader.bytes_read = native_storage.read_into_boxes(
                        fsdp1_shards.boxes(targets), reader.tensors, endpoint, reader.buffer_bytes
                    )
                except Exception as exc:  # noqa: BLE001 - every rank hears of it
                    failure = exc
                coll.agree_or_raise(failure, "restore")
            else:
                with coll.quiet_without_group():
                    dcp.load(targets, storage_reader=reader, process_group=coll.group())
        except ShardstreamError:
            raise
        except BaseException as exc:  # DCP wraps rank failures (CheckpointException is a
            # BaseException, not an Exception); surface ours
            cause = shardstream_cause(exc)
            if cause is not None:
                raise cause from None
            lost = next((e for e in causes(exc) if isinstance(e, FileNotFoundError)), None)
            if lost is not None:  # e.g. deleted by the saving run's retention while we read
                raise CheckpointNotFoundError(
                    f"{path}: {lost.filename or 'a data file'} disappeared while being read"
                ) from None
            raise
    objects = source.objects
    extra: dict[str, Any] = pending.extra
    error: Exception | None = None
    try:  # local work from here on: a rank that fails must tell the others, not leave them
        if want_model and targets and flat is None:  # waiting in a barrier for a process
            st.apply_model_copies(  # that may never exit
                model, {k: v for k, v in model_tensors.items() if k in targets}
            )
        if want_optimizer:  # a stateless one (plain SGD) too: its param groups
            groups = objects["optimizer"]["param_groups"]
            if flat is not None:
                flat.apply_optimizer(optimizer, pending.optimizer, groups, _stateful(optim_tensors))
            else:
                st.apply_optimizer_state(model, optimizer, pending.optimizer, groups)
        if pending.scheduler is not None:
            schedulers.load(lr_scheduler, pending.scheduler)
        if pending.rng is not None:
            st.set_rng_state(pending.rng)
        for name, saved_state in pending.states.items():
            schedulers.load(states[name], saved_state, name)
    except Exception as exc:  # noqa: BLE001
        error = exc
    failed = [
        e for e in coll.gather(None if error is None else f"rank {coll.rank()}: {error}") if e
    ]
    if error is not None:
        raise error
    if failed:
        raise ShardstreamError(f"restore failed on another rank: {failed[0]}")
    return LoadResult(source.step, extra, reader.bytes_read, time.perf_counter() - started)


@dataclass
class _Pending:
    """The small parts, read and checked before any tensor is written, applied after."""

    # optimizer state by parameter (``st.nest_optimizer_state``), its tensors the targets
    optimizer: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    scheduler: Any = None  # saved scheduler state for ``schedulers.load``
    rng: Any = None  # RNG state for ``st.set_rng_state``
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    states: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> saved state


def _checked_states(path: Path, source: _Source, states: Mapping[str, Any]) -> dict[str, Any]:
    """Each Stateful's saved state, checked to load (and put back) before anything is touched."""
    out = {}
    for name, obj in states.items():
        saved = source.objects.get(_STATE + name)
        if saved is None:
            raise CheckpointFormatError(
                f"{path}: holds no {name!r} state, so nothing was restored (containers read: "
                f"{sorted(k[len(_STATE) :] for k in source.objects if k.startswith(_STATE))})"
            )
        try:
            schedulers.check(obj, saved, name)
        except Exception as exc:  # noqa: BLE001 - named
            raise CheckpointFormatError(
                f"{path}: cannot restore the {name}, so nothing was restored: {exc}"
            ) from None
        out[name] = saved
    return out


def _checked_parts(
    path: Path,
    source: _Source,
    model,
    optim_tensors: dict,
    live_groups: list | None,
    lr_scheduler,
    contents: tuple[str, ...],
    restore_rng: bool,
    param_names: set[str] | None = None,
    settings: frozenset[str] = frozenset(),
) -> _Pending:
    """Open and check every part but the tensors (already checked by ``_checked_targets``)
    against the live objects, so that a restore that cannot finish touches nothing.
    ``settings``: the live optimizer's own hyperparameters (its ``defaults``)."""
    pending = _Pending()
    part = "optimizer"
    try:
        if live_groups is not None:  # the optimizer is restored, with or without tensors
            optim = source.objects["optimizer"]
            values = {**optim.get("scalars", {}), **optim_tensors}
            pending.optimizer = st.nest_optimizer_state(model, values, param_names)
            st.check_param_groups(live_groups, optim.get("param_groups"), settings)
        part = "lr_scheduler"
        if lr_scheduler is not None and "optimizer" in contents:
            saved = source.objects.get("lr_scheduler")
            if saved is not None:
                foreign = schedulers.foreign_keys(lr_scheduler, saved)
                schedulers.check(lr_scheduler, saved)
                pending.scheduler = saved
                if foreign and coll.rank() == 0:
                    log.warning(
                        "%s: the saved LR scheduler state holds %s, which the live %s does not "
                        "keep: saved by another kind of scheduler? The live one keeps its own "
                        "schedule",
                        source.origins.get(part, path),
                        ", ".join(foreign),
                        type(lr_scheduler).__name__,
                    )
            elif "optimizer" in source.saved and coll.rank() == 0:
                log.warning(
                    "%s: holds no LR scheduler state; the live scheduler keeps its own "
                    "(its step count starts afresh; the optimizer's learning rates are the "
                    "saved ones until the scheduler next steps)",
                    path,
                )
        part = "extra state (RNG)"
        if "extra" in contents and "extra" in source.saved:
            payload = source.read_extra(coll.rank())
            pending.extra = payload.get("user", {})
            if restore_rng and "rng" in payload:
                st.check_rng_state(payload["rng"])
                pending.rng = payload["rng"]
    except Exception as exc:  # noqa: BLE001 - named and re-raised
        where = source.origins.get(part, path)
        text = f"{where}: cannot restore the {part}, so nothing was restored: {exc}"
        kind = type(exc) if isinstance(exc, ShardstreamError) else CheckpointFormatError
        raise kind(text) from None
    return pending


def _read_extra(ckpt, rank: int) -> dict[str, Any]:
    """This rank's extra state (rank 0's when the checkpoint had fewer ranks)."""
    files = ckpt.manifest.get("files", {})
    json_name, tensor_name = native.extra_files(rank)
    if json_name not in files:
        json_name, tensor_name = native.extra_files(0)
        if rank > 0 and json_name in files and native.extra_files(rank - 1)[0] in files:
            log.warning(  # said once: by the first rank the save did not have
                "%s: saved at world size %d; ranks from %d on restore rank 0's extra state and "
                "random number generators (they draw rank 0's numbers until reseeded)",
                ckpt.directory,
                rank,
                rank,
            )
    if json_name not in files:
        return {}
    json_path = native.check_name(ckpt.directory, json_name, "extra")
    try:
        with open_regular(json_path) as f:
            body = f.read()
    except PermissionError:
        raise CheckpointPermissionError(f"{json_path}: cannot read: permission denied") from None
    except FileNotFoundError:  # listed in the manifest: removed since (retention, by hand)
        raise CheckpointNotFoundError(f"{json_path}: missing (named in the manifest)") from None
    if digest(body) != files[json_name].get("xxh3"):
        raise ChecksumMismatchError(f"{json_path}: checksum mismatch in extra state")
    tensors: dict[str, torch.Tensor] = {}
    if tensor_name in files:
        tensor_path = str(native.check_name(ckpt.directory, tensor_name, "extra"))
        header = read_header(tensor_path)
        try:
            endpoint = ckpt.endpoint(tensor_path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{tensor_path}: missing (removed meanwhile)") from None
        try:
            for name, entry in header.tensors.items():
                out = torch.empty(entry.shape, dtype=TORCH_BY_CODE[entry.dtype])
                view = (
                    out.view(-1).view(torch.uint8).numpy() if out.numel() else np.empty(0, np.uint8)
                )
                endpoint.read_into(header.data_start + entry.begin, view)
                tensors[name] = out
            endpoint.finish()
        finally:
            endpoint.close()
    return st.decode(json.loads(body), tensors)


# The kinds of optimizer state a container's optimizers keep together (load of a container).
_CONTAINER_KINDS: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "shardstream_container_kinds", default=frozenset()
)


def _load_parts(
    path,
    model,
    parts,
    lr_scheduler,
    contents,
    verify,
    buffer_size,
    restore_rng,
    prefix,
    states,
    ignore_frozen_params,
) -> LoadResult:
    """``load`` with each of a container's optimizers in turn: the first with the rest of
    what ``contents`` asks for, the others their optimizer state alone."""
    result = load(
        path,
        model=model,
        optimizer=parts[0],
        lr_scheduler=lr_scheduler,
        contents=contents,
        verify=verify,
        buffer_size=buffer_size,
        restore_rng=restore_rng,
        prefix=prefix,
        states=states,
        ignore_frozen_params=ignore_frozen_params,
    )
    for part in parts[1:] if "optimizer" in contents else ():
        load(
            path,
            model=model,
            optimizer=part,
            contents=("optimizer",),
            verify=verify,
            buffer_size=buffer_size,
            restore_rng=False,
            prefix=prefix,
        )
    return result

"""save: one checkpoint directory written by every rank: streamed, checksummed, committed
atomically.

Every rank calls the same function. Each rank writes the tensors it holds into its own rank
file when every rank can plan alone (``formats/local_save.py``), else through
torch.distributed.checkpoint's planners with shardstream's streaming StorageWriter; non-tensor
state is JSON. ``loading.py`` reads it back.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..engine.checksum import digest
from ..engine.copy import Buffers, Streamer, one_buffer_set
from ..engine.dtypes import TORCH_NAME, code_of
from ..engine.endpoints import TensorEndpoint
from ..engine.memory import gc_paused, peak_rss_bytes
from ..engine.plan import GlobalTensor, dense_block
from ..errors import ShardstreamError, UsageError, out_of_space, shardstream_cause
from ..formats import native
from ..formats.writer import OutputTensor, write_safetensors
from ..storage import collectives as coll
from ..storage import commit
from ..storage.commit import fsync_tree
from ..storage.run_layout import step_of
from ..units import DEFAULT_BUFFER_BYTES, parse_size
from . import fsdp1_shards, local_save, native_storage
from . import state as st
from .arguments import check_live_objects, checked_step, one_optimizer


@dataclass
class SaveResult:
    path: str
    step: int
    bytes_written: int
    wall_s: float
    peak_rss_bytes: int


def encode_extra(extra: Mapping[str, Any] | None) -> tuple[Any, dict[str, torch.Tensor]]:
    """This rank's extra state and RNG as tagged JSON plus private copies of its tensors."""
    tensors: dict[str, torch.Tensor] = {}
    doc = st.encode({"user": dict(extra or {}), "rng": st.rng_state()}, tensors)
    return doc, {k: v.clone() for k, v in tensors.items()}


def _write_extra(
    tmp: Path, rank: int, doc: Any, tensors: dict[str, torch.Tensor], buffer_bytes: int
) -> dict:
    """This rank's extra state: JSON plus a safetensors file for the tensors inside it."""
    json_name, tensor_name = native.extra_files(rank)
    records = {}
    body = json.dumps(doc, sort_keys=True).encode()
    try:
        with open(tmp / json_name, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:  # write() names no file: a full disk's message does
        raise OSError(exc.errno, exc.strerror, str(tmp / json_name)) from exc
    records[json_name] = {"size": len(body), "xxh3": digest(body)}
    if tensors:
        endpoints = {}
        outputs = []
        for key, tensor in tensors.items():
            location = f"memory:{key}"
            endpoints[location] = TensorEndpoint(key, tensor)
            block = dense_block(location, 0, code_of(tensor.dtype), tuple(tensor.shape))
            outputs.append(
                OutputTensor(
                    key, block.dtype, GlobalTensor(key, block.dtype, block.shape, (block,))
                )
            )
        written = write_safetensors(
            str(tmp / tensor_name),
            outputs,
            Streamer(endpoints.__getitem__, Buffers.sized(buffer_bytes)),
            borrow=True,
        )
        records[tensor_name] = {"size": written.size, "header_xxh3": written.header_digest}
    return records


@dataclass
class PreparedSave:
    """Everything a save needs, captured on the training thread without copying tensors."""

    target: Path
    step: int
    contents: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    extra: tuple[Any, dict[str, torch.Tensor]] | None
    buffer_bytes: int
    overwrite: bool
    hf_export: Any = None  # export.ExportPlan, captured with the tensors
    hf_entries: dict[str, dict] = field(default_factory=dict)  # model tensors kept in huggingface/
    guard: Any = None  # async saves: coordinates reads of live tensors with optimizer steps
    # async saves: every live tensor the save reads (rank file and export), to watch for writes
    live: dict[str, Any] = field(default_factory=dict)
    placements: dict[str, str] = field(default_factory=dict)  # rank 0: name -> st.placement_of
    mesh: dict[str, Any] | None = None  # rank 0: the device mesh, for the manifest


def prepare_save(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    extra: Mapping[str, Any] | None = None,
    contents: Iterable[str] = native.DEFAULT_CONTENTS,
    step: int = 0,
    buffer_size: int | str = DEFAULT_BUFFER_BYTES,
    overwrite: bool = False,
    hf_export: Any = None,
    lora_only: bool = False,
    share_hf_weights: bool = False,
    background: bool = False,
) -> PreparedSave:
    """Capture references to the state to save; local to this rank, no collectives.

    ``lora_only``: "model" saves only LoRA weights when the model has any (verl's
    ``save_lora_only``). ``share_hf_weights``: with "model" and "hf_model", a model tensor
    exported in its own dtype is stored once, in ``huggingface/``, and the manifest points
    there. ``background`` (an async save): the model's buffers are copied now, since they
    change outside optimizer.step(), and ``live`` lists the tensors the save reads live."""
    check_live_objects(model, optimizer, lr_scheduler, saving=True)
    optimizer = one_optimizer(optimizer)
    step = checked_step(step)
    contents = native.check_contents(contents, "save_contents")
    if "model" in contents and model is None:
        raise UsageError("save_contents includes 'model' but no model was given")
    if "optimizer" in contents and (optimizer is None or model is None):
        raise UsageError(
            "save_contents includes 'optimizer' but no optimizer (and model) was given"
        )
    if "hf_model" in contents and hf_export is None:
        raise UsageError(
            "save_contents includes 'hf_model' but no HF export was set up (hf_config= or "
            "hf_source_dir=)"
        )
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    hf_entries: dict[str, dict] = {}
    # FSDP1: views of the flat parameters' shards, not torch's gathered and cloned copies.
    fsdp1 = fsdp1_shards.layout(model)
    model_part = None
    if "model" in contents:
        model_part = fsdp1.model_tensors(model) if fsdp1 else st.model_tensors(model)
    elif background and "hf_model" in contents and not fsdp1:
        model_part = st.model_tensors(model)  # the export's, with its buffers copied below
    if background and model_part is not None:
        model_part = own_buffers(model_part, model)
    # Without "hf_model", an hf_export given writes config files only (hf_export.ConfigFiles).
    export_plan = hf_export.capture(model_part) if "hf_model" in contents else hf_export
    live: dict[str, Any] = dict(model_part or {})
    if background and live and not fsdp1:
        # the parameters themselves too: a write through a DTensor's to_local() counts in
        # the parameter's local tensor, not in the state dict's
        for fqn, parameter in st.parameters_by_fqn(model).items():
            if (name := native.MODEL_PREFIX + fqn) in live:
                live[name] = (live[name], parameter)
    placements: dict[str, str] = {}
    mesh = None
    if model_part is not None and "model" in contents:
        tensors.update(st.lora_only(model_part) if lora_only else model_part)
        if coll.rank() == 0:  # before share_hf_weights moves some into huggingface/
            placements.update({k: _placement(v) for k, v in tensors.items()})
            mesh = st.mesh_of(tensors)
        lora = st.model_lora_meta(model)
        if lora is not None:  # merge needs r and alpha to write or fuse the adapter
            objects["lora"] = lora
        elif share_hf_weights and export_plan is not None:
            hf_entries = export_plan.same_bytes(tensors)
            tensors = {k: v for k, v in tensors.items() if k not in hf_entries}
            if not hf_entries and export_plan.out_dtype is not None:
                warnings.warn(
                    "share_hf_weights: the export converts the weights to "
                    f"{TORCH_NAME[export_plan.out_dtype]}, so none is stored once; the rank "
                    "files keep them (export in the weights' own dtype, hf_dtype=, to share)",
                    stacklevel=3,
                )
    if "optimizer" in contents:
        optim = fsdp1.optimizer_tensors(optimizer) if fsdp1 else None
        optim_tensors, optim_objects = optim or st.optimizer_state(model, optimizer)
        tensors.update(optim_tensors)
        live.update(optim_tensors)
        if coll.rank() == 0:
            placements.update({k: _placement(v) for k, v in optim_tensors.items()})
            mesh = mesh or st.mesh_of(optim_tensors)
        objects["optimizer"] = st.encode(optim_objects, None)
        if lr_scheduler is not None:
            objects["lr_scheduler"] = st.encode(lr_scheduler.state_dict(), None)
    return PreparedSave(
        target=Path(path).absolute(),
        step=step,
        contents=contents,
        tensors=tensors,
        objects=objects,
        extra=encode_extra(extra) if "extra" in contents else None,
        buffer_bytes=parse_size(buffer_size),
        overwrite=overwrite,
        hf_export=export_plan,
        hf_entries=hf_entries,
        placements=placements,
        mesh=mesh,
        live=live if background else {},
    )


def own_buffers(tensors: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """``tensors`` with the model's buffers among them copied: they change outside
    optimizer.step() (BatchNorm's running statistics in every forward, a router's bias in a
    step pre-hook), which an async save does not wait for. Buffers are small; parameters and
    FSDP1's flat shards are left as they are."""
    parameters = {st.storage_of(p) for p in model.parameters()}
    return {
        name: t.detach().clone()
        if isinstance(t, torch.Tensor) and t.numel() and st.storage_of(t) not in parameters
        else t
        for name, t in tensors.items()
    }


def save(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    extra: Mapping[str, Any] | None = None,
    contents: Iterable[str] = native.DEFAULT_CONTENTS,
    step: int | None = None,
    buffer_size: int | str = DEFAULT_BUFFER_BYTES,
    overwrite: bool = False,
    hf_config: Any = None,
    tokenizer: Any = None,
    hf_source_dir: str | os.PathLike | None = None,
    hf_dtype: str | None = None,
    share_hf_weights: bool = False,
) -> SaveResult:
    """Save a checkpoint to ``path`` from every rank; it appears there only when complete.

    With "hf_model" in ``contents``, ``huggingface/`` gets the model in its publish dtype
    (``hf_dtype``, else the config's), with the config of ``hf_config`` (a transformers config)
    or of ``hf_source_dir``, and ``tokenizer``'s files; see ``CheckpointConfig`` for
    ``share_hf_weights``. ``step``: recorded in the manifest; by default the N of a
    ``global_step_N`` path (which must hold step N), else 0.

    >>> shardstream.save("ckpt/step_10", model=model, optimizer=opt, step=10)  # doctest: +SKIP
    """
    if os.fspath(path) == "":  # Path("") is the working directory, which overwrite replaces
        raise UsageError("save: the path is empty; name the checkpoint's directory")
    if hf_source_dir is not None:
        from ..storage.commit import check_target_apart

        check_target_apart(Path(path), {"hf_source_dir": hf_source_dir})
    check_live_objects(model, optimizer, lr_scheduler, saving=True)
    optimizer = one_optimizer(optimizer)
    contents = native.check_contents(contents, "contents")
    named = step_of(Path(path).name)
    if step is None:
        step = named or 0
    if named is not None and named != step:
        raise UsageError(
            f"{path}: a directory named for step {named} must hold step {named}, not step={step} "
            "(readers refuse the mismatch)"
        )
    exporter = None
    if "hf_model" in contents:
        from .hf_export import hf_exporter

        exporter = hf_exporter(model, hf_config, tokenizer, hf_source_dir, hf_dtype)
    else:
        from .hf_export import config_files

        exporter = config_files(hf_config, tokenizer, hf_source_dir)
    prepared = prepare_save(
        path,
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        extra=extra,
        contents=contents,
        step=step,
        buffer_size=buffer_size,
        overwrite=overwrite,
        hf_export=exporter,
        share_hf_weights=share_hf_weights,
    )
    return execute_save(prepared)


def _placement(tensor: Any) -> str:
    """How a tensor was laid out over the saving ranks, for the manifest."""
    if isinstance(tensor, fsdp1_shards.FlatShard):
        return fsdp1_shards.PLACEMENT
    return st.placement_of(tensor)


def _rank_local_plan(
    tensors: dict[str, torch.Tensor],
) -> tuple[list[tuple[str, torch.Tensor]], list[local_save.Boxes]] | None:
    """This rank's items when every rank can plan alone (formats/local_save.py), and on rank 0
    every rank's FSDP1 boxes; else None.

    One gather of a short signature makes every rank take the same path; FSDP1's boxes go to
    rank 0 alone, which writes the manifest."""
    try:
        items = local_save.local_items(tensors, coll.rank(), coll.world())
        mine = None if items is None else local_save.layout_signature(tensors)
    except Exception:  # noqa: BLE001 - DCP's path then plans it, or reports it on every rank
        items = mine = None
    everyone = coll.gather(mine)
    flat = any(isinstance(t, fsdp1_shards.FlatShard) for t in tensors.values())
    if mine is None or any(sig != mine for sig in everyone):
        if flat:
            raise UsageError("FSDP1 state: ranks hold different tensors; nothing was written")
        return None
    boxes = coll.gather_to_root(local_save.flat_boxes_held(tensors)) if flat else None
    return items, boxes or []


@gc_paused()
def execute_save(prepared: PreparedSave) -> SaveResult:
    """Write, agree, commit: every rank calls this (on the thread's checkpoint group)."""
    started = time.perf_counter()
    target, step, contents = prepared.target, prepared.step, prepared.contents
    buffer_bytes, overwrite = prepared.buffer_bytes, prepared.overwrite
    error: BaseException | None = None
    tmp_name = staged = None
    if coll.rank() == 0:
        try:
            commit.remove_stale_staging(target)  # a dead save's old copy comes back first
            if target.exists() and not overwrite:
                raise UsageError(f"{target} already exists; pass overwrite=True to replace it")
            target.parent.mkdir(parents=True, exist_ok=True)
            staged = commit.stage(target)
            tmp_name = staged.path.name
        except (OSError, ShardstreamError) as exc:
            error = exc if isinstance(exc, ShardstreamError) else UsageError(f"{target}: {exc}")
    tmp_name = coll.broadcast(tmp_name)
    coll.agree_or_raise(error)
    tmp = target.parent / tmp_name

    try:
        # One buffer set, sized from the budget, for every phase: the sharded write, the
        # extra state and the hf export share it instead of each allocating their own.
        with one_buffer_set(buffer_bytes):
            tensors, objects = prepared.tensors, prepared.objects
            writer = native_storage.StreamingWriter(tmp, buffer_bytes, guard=prepared.guard)
            tensor_section, file_section = {}, {}
            records: dict[str, Any] = {}
            planned = _rank_local_plan(tensors) if tensors else None
            local, boxes = planned if planned is not None else (None, None)
            guard, export_keys, rank_rows = prepared.guard, None, None
            if guard is not None and prepared.hf_export is not None:
                # An async export reads this rank's rows back from its rank file when that holds
                # them all; else the guard learns of its live reads before any read starts.
                if local is not None:
                    export_keys = prepared.hf_export.rank_file_keys(local)
                if export_keys is None:
                    guard.register_export(prepared.hf_export.live_reads())
            # What each rank writes alone may fail on one rank only: those errors are agreed
            # on before the next collective (the export, or the gather below), never skipped.
            local_error: BaseException | None = None
            if local is not None:
                # Each rank knows its part and rank 0 the manifest: no plans are gathered.
                try:
                    name = native.rank_file(coll.rank())
                    written = writer.write_tensors(name, local)
                    records[name] = {"size": written.size, "header_xxh3": written.header_digest}
                    if export_keys is not None:
                        from .hf_export import RankFileRows

                        rank_rows = RankFileRows.of(written, local, export_keys)
                    if coll.rank() == 0:
                        tensor_section = local_save.manifest_tensors(tensors, coll.world(), boxes)
                except Exception as exc:  # noqa: BLE001
                    local_error = _save_error(exc, target)
            elif tensors:
                with coll.quiet_without_group():
                    dcp.save(
                        tensors,
                        storage_writer=writer,
                        planner=native_storage.save_planner(),
                        process_group=coll.group(),
                    )
                if coll.rank() == 0:
                    tensor_section, file_section = native_storage.tensor_manifest(
                        writer.metadata, writer.results
                    )
            if prepared.extra is not None and local_error is None:
                try:
                    records.update(_write_extra(tmp, coll.rank(), *prepared.extra, buffer_bytes))
                except Exception as exc:  # noqa: BLE001
                    local_error = _save_error(exc, target)
            if prepared.hf_export is not None:
                coll.agree_or_raise(local_error)  # the export's collectives need every rank
                if guard is not None:
                    guard.mark_ready()  # with no rank file, the export's reads are all there is
                records.update(prepared.hf_export(tmp, buffer_bytes, guard, rank_rows))
                tensor_section.update(prepared.hf_entries)
            elif local_error is not None:
                raise local_error
    except BaseException as exc:  # noqa: BLE001  (every rank must learn of a failure)
        error = _save_error(exc, target)
    if error is None and prepared.guard is not None:
        error = _written_meanwhile(prepared.guard.reads_done(), step)
    try:  # one collective whatever happened: every rank's records, or its error
        gathered = coll.gather_or_raise(records if error is None else None, error)
    except BaseException:
        if staged is not None:  # every rank has stopped writing: leave no partial output behind
            staged.abandon()
        raise

    if coll.rank() == 0:
        try:
            for rank_records in gathered:
                file_section.update(rank_records)
            for name, entry in tensor_section.items():
                if name in prepared.placements:
                    entry["placement"] = prepared.placements[name]
            manifest = {
                "format": native.FORMAT,
                "version": native.FORMAT_VERSION,
                "step": int(step),
                "world_size": coll.world(),
                **({"mesh": prepared.mesh} if prepared.mesh else {}),
                "contents": list(contents),
                "created_unix": time.time(),
                "torch_version": torch.__version__,
                "tensors": tensor_section,
                "files": file_section,
                "objects": objects,
            }
            # Configs, tokenizer files, LoRA metadata: every other file is checksummed too.
            file_section.update(native.side_file_records(tmp, file_section))
            manifest[native.FILES_COMPLETE] = True
            fsync_tree(tmp)
            native.write_manifest(tmp, manifest)
            staged.commit()
        except BaseException as exc:  # noqa: BLE001
            error = _save_error(exc, target)
            staged.abandon()
    coll.agree_or_raise(error)
    written = (
        sum(f.stat().st_size for f in target.iterdir() if f.is_file()) if coll.rank() == 0 else 0
    )
    return SaveResult(
        str(target), int(step), written, time.perf_counter() - started, peak_rss_bytes()
    )


def _written_meanwhile(changed: list[str], step: int) -> UsageError | None:
    """An async save whose tensors were written in place, outside optimizer.step(), before
    it had read them all: it may hold some values from after save(), so it is not committed."""
    if not changed:
        return None
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return UsageError(
        f"async save of step {step}: tensor {changed[0]!r}{more} was written in place outside "
        "optimizer.step() while the save was reading the live tensors, so the checkpoint could "
        "hold values from after save(); it was not committed. Call the manager's "
        "wait_for_reads() (or wait()) before writing weights in place (an EMA swap, "
        "load_state_dict)"
    )


def _save_error(exc: BaseException, target: Path) -> BaseException:
    """The error to report for a failed save: ours if DCP wrapped one, a full disk named."""
    cause = shardstream_cause(exc)
    if cause is not None:
        return cause
    message = "{path}: no space left on device while saving; partial output removed"
    return out_of_space(exc, target, message) or exc

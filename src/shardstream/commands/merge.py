"""merge: a sharded checkpoint to a Hugging Face safetensors model, streamed."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..engine.copy import Buffers, Streamer
from ..engine.dtypes import TORCH_NAME, is_floating, itemsize
from ..engine.endpoints import OpenEndpoints
from ..engine.memory import gc_paused, give_back_freed_memory, peak_rss_bytes
from ..engine.plan import GlobalTensor, TensorSlice, split_ranges
from ..engine.readahead import reading_ahead
from ..errors import (
    COMMITTED_ATTR,
    CheckpointFormatError,
    NamesUnderPrefixError,
    ShardstreamError,
    UsageError,
)
from ..formats import hf, lora
from ..formats.hf import output_dtype, tied_duplicates
from ..formats.hf_writer import HfModelFiles, output_layout
from ..formats.native import MANIFEST
from ..formats.source import models_beside, open_checkpoint, verl_merges
from ..formats.writer import OutputTensor, fill_range, write_safetensors
from ..storage import collectives as coll
from ..storage import locks
from ..storage.commit import InPlace, refuse_other_kinds, staged_directory
from ..units import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_CHUNK_BYTES,
    DIRECT_ALIGN,
    parse_size,
)

log = logging.getLogger(__name__)


@dataclass
class MergeSummary:
    target: str
    format: str
    files: list[str]
    tensors: int
    bytes_written: int
    wall_s: float
    peak_rss_bytes: int
    dtype: str | None
    skipped: list[str] = field(default_factory=list)
    layout: str = ""  # the output names' rule (hf_names.NamePlan.describe)
    kept_names: bool = False  # --keep-names: in-memory names written on purpose
    not_tensors: list[str] = field(default_factory=list)  # model entries safetensors can't hold
    layout_s: float = 0.0  # of wall_s: planning the output names (transformers, if it is asked)
    notes: list[str] = field(default_factory=list)  # what a user may not expect, said once

    @property
    def throughput_bytes_per_s(self) -> float:
        return self.bytes_written / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "throughput_bytes_per_s": self.throughput_bytes_per_s}


@contextlib.contextmanager
def one_conversion_thread() -> Iterator[None]:
    """Run torch's dtype conversions on the calling thread alone, restoring the setting after.

    The executor already overlaps two threads (fill and convert; write and hash). Letting the
    conversion fan out over OpenMP's workers too oversubscribes the cores: each ``copy_`` waits
    for its slowest worker, and on a busy 2-core machine the cast ran 3-7x slower than on one
    thread, which converts far faster (~10 GB/s of fp32) than the disk delivers anyway.
    """
    import torch

    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


@one_conversion_thread()
@gc_paused()
def merge(
    local_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: int | str | None = None,
    buffer_size: int | str = DEFAULT_BUFFER_BYTES,
    overwrite: bool = False,
    update: bool = False,
    hf_model_path: str | os.PathLike | None = None,
    tie_word_embedding: bool = False,
    fuse_lora: bool = False,
    keep_names: bool = False,
    distributed: bool = False,
    direct_io: bool = True,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    prefix: str | None = None,
) -> MergeSummary:
    """Merge the sharded checkpoint in ``local_dir`` into a HF model directory ``target_dir``.

    The output holds the names, shapes and bytes ``save_pretrained`` of the installed
    transformers writes for the model (``formats.hf_names``); ``keep_names=True`` writes the
    in-memory names instead. A non-empty ``target_dir`` is refused, replaced whole with
    ``overwrite``, or with ``update`` written into as verl's merger does: the output's files
    replace those of their names, another set of weights there is removed, the rest stays
    (``storage.commit.update_in_place``). ``direct_io=False`` writes the output through the
    page cache instead of with ``O_DIRECT`` (which is used where the file system accepts it).
    ``prefix``: what a DCP checkpoint's model keys start with ("app.model.", "" for the top
    level), where detection finds several candidates.

    >>> merge("ckpt/global_step_100/actor", "merged", dtype="bfloat16")  # doctest: +SKIP
    """
    start = time.perf_counter()
    # Our own group (under torchrun): left cleanly at the end, or gloo's threads can abort the
    # process at exit; after a failure without the barrier, since the others may be gone.
    own_group = distributed and coll.init_from_environment()
    try:
        # A run saving beside us does not delete the checkpoint while we read it.
        with locks.reading(locks.manifest_read_by(local_dir, MANIFEST)):
            summary = _merge(
                local_dir,
                target_dir,
                start,
                dtype=dtype,
                max_shard_size=max_shard_size,
                buffer_size=buffer_size,
                overwrite=overwrite,
                update=update and not overwrite,
                hf_model_path=hf_model_path,
                tie_word_embedding=tie_word_embedding,
                fuse_lora=fuse_lora,
                keep_names=keep_names,
                distributed=distributed,
                direct_io=direct_io,
                progress=progress,
                on_plan=on_plan,
                prefix=prefix,
            )
    except BaseException:
        if own_group:
            coll.leave(failed=True)
        raise
    if own_group:
        _leave_after_commit(summary.target)
    return summary


def _leave_after_commit(target: str) -> None:
    """Leave the process group once the output is in place: a process lost at the last
    barrier leaves the output as it is (complete), which is said as a warning, not a failure;
    a signal then is raised marked committed (``errors.COMMITTED_ATTR``)."""
    try:
        coll.leave()
    except Exception as exc:  # noqa: BLE001  (a peer gone: the merge is done all the same)
        log.warning(
            "shardstream: %s is in place and complete; leaving the process group after it "
            "failed: %s",
            target,
            coll.lost_peer(exc) or exc,
        )
        coll.leave(failed=True)
    except BaseException as exc:
        setattr(exc, COMMITTED_ATTR, target)
        coll.leave(failed=True)
        raise


def _merge(
    local_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    start: float,
    *,
    dtype: str | None,
    max_shard_size: int | str | None,
    buffer_size: int | str,
    overwrite: bool,
    update: bool,
    hf_model_path: str | os.PathLike | None,
    tie_word_embedding: bool,
    fuse_lora: bool,
    keep_names: bool,
    distributed: bool,
    direct_io: bool,
    progress: Callable[[int], None] | None,
    on_plan: Callable[[int], None] | None,
    prefix: str | None,
) -> MergeSummary:
    if max_shard_size is None:  # as save_pretrained of the installed transformers
        max_shard_size = hf.default_shard_bytes()
    max_file_bytes = parse_size(max_shard_size)
    buffer_bytes = parse_size(buffer_size)
    if max_file_bytes <= 0:
        raise UsageError("--max-shard-size must be positive")
    if buffer_bytes < 1 << 16:
        raise UsageError("--buffer-size must be at least 64KiB")
    if os.fspath(target_dir) == "":  # Path("") is the working directory: an unset variable
        raise UsageError("--target_dir is empty; name the directory to write the model to")
    target = Path(target_dir)
    from ..storage.commit import check_links_apart, check_target, check_target_apart

    checkpoint = open_checkpoint(local_dir, model_only=True, shared=distributed, prefix=prefix)
    config_dir = Path(hf_model_path) if hf_model_path else checkpoint.config_dir()
    if hf_model_path and not (config_dir / "config.json").is_file():
        raise UsageError(f"--hf_model_path {config_dir}: no config.json there")
    inputs = {"the checkpoint": local_dir}
    # Updated in place, the config directory may be the target (verl's documented
    # --target_dir .../actor/huggingface): its files are copied before any file moves.
    if hf_model_path and not update:
        inputs["--hf_model_path"] = hf_model_path
    elif config_dir is not None and not update:
        inputs["the checkpoint's config directory"] = config_dir
    if update:
        why = "where a model written beside (or above) it would leave unclear which one to read"
        check_target_apart(target, inputs, why)
    else:
        check_target_apart(target, inputs)
    check_links_apart(target, [*checkpoint.files, *_entries(*inputs.values())])
    from ..formats.native import NativeCheckpoint

    real = Path(os.path.realpath(local_dir))
    if isinstance(checkpoint, NativeCheckpoint) and real in Path(os.path.realpath(target)).parents:
        # Its manifest names every file it holds: one written into it is foreign there.
        raise UsageError(
            f"target {target} is inside the checkpoint {local_dir}, whose manifest names "
            "every file it holds (verify would report the merged files as added); choose a "
            "target outside it"
        )
    try:
        check_target(target.absolute(), overwrite or update)
    except ShardstreamError:
        raise
    except OSError as exc:  # a name longer than the file system allows, a loop in its path
        raise UsageError(f"target {target}: {exc.strerror or exc}") from None
    config = hf.read_config(config_dir)
    as_verl = verl_merges(checkpoint)
    out_dtype = output_dtype(dtype, config, as_verl, config_dir)
    notes = []
    named = hf.named_dtype(config, config_dir)
    if as_verl and not dtype and named not in (None, out_dtype):
        name, out_name = TORCH_NAME[named], TORCH_NAME[out_dtype]
        notes.append(
            f"wrote {out_name}, as verl's merger does; the checkpoint's config.json names "
            f"{name} (pass --dtype {name} to write that)"
        )
    for group, count in models_beside(checkpoint).items():
        notes.append(
            f"read the model under {checkpoint.prefix or 'the top level'!r}; the checkpoint "
            f"also holds {count} tensors under {group!r} (another model, an EMA copy?), not read: "
            f"--prefix {group} merges those"
        )
    lora.refuse_unsupported_peft(local_dir, (t.name for t in checkpoint.tensors))
    split = lora.split_lora(checkpoint.tensors)
    lora.require_lora(split, fuse_lora)
    adapter_only = split is not None and not split.base  # saved with save_lora_only
    if config_dir is None and not adapter_only:  # an adapter is loaded onto its base model
        notes.append(
            "found no config.json for the model (the checkpoint's huggingface/ folder, or "
            "--hf_model_path), so wrote the weights only, which transformers cannot load as a "
            "model; pass --hf_model_path DIR (a folder holding its config.json) to add it"
        )
    if adapter_only and fuse_lora:
        raise UsageError(
            f"{local_dir}: the checkpoint holds LoRA weights only (save_lora_only), so there "
            "are no base weights to fuse them into; merge without --fuse-lora for the adapter"
        )
    tensors = split.base if split else checkpoint.tensors
    if split:
        settings = lora.lora_settings(checkpoint.directory, checkpoint.lora_settings)
        lora.check_factors(split, settings.r)
    drop = tied_duplicates(tensors, config, tie_word_embedding)
    where = str(config_dir / "config.json") if config_dir else "config.json"
    if split and not settings.rslora_stated:
        notes.append(
            f"LoRA scale taken as {settings.scale_rule} ({settings.scale:g}): no file of the "
            "checkpoint says whether the run used rsLoRA (verl's lora_train_meta.json does not "
            "record use_rslora); if it did, the "
            + ("fused weights are wrong" if fuse_lora else "adapter's use_rslora must be true")
        )
    # A layout transformers must plan takes seconds (its import, the model on meta): the disk
    # reads the first source bytes meanwhile. Ranks of a distributed merge read their own.
    budget = 0 if coll.world() > 1 else None
    # save_pretrained splits its files in the model's order, which an HF directory's files
    # (listed by name) do not keep: asked of the model where the output has several files.
    total = sum(
        math.prod(t.shape) * itemsize(hf.cast_dtype(t.dtype, out_dtype))
        for t in tensors
        if t.name not in drop
    )
    reorder = not getattr(checkpoint, "in_model_order", True) and total > max_file_bytes
    planning = time.perf_counter()
    with reading_ahead((b for t in tensors for b in t.blocks), budget):
        try:
            names, outputs = output_layout(
                tensors, out_dtype, drop, config, keep_names, where, model_order=reorder
            )
        except NamesUnderPrefixError as exc:
            raise exc.read_under(getattr(checkpoint, "prefix", None)) from None
    drop -= set(names.untied)  # a head the model holds apart all the same: written
    kept = set()
    if drop:
        kept = settle_dropped_heads(
            drop, tensors, config, out_dtype, where, checkpoint, buffer_bytes
        )
    if kept:
        drop -= kept  # the only copy of what its class ties: written, as save_pretrained does
        names, outputs = output_layout(
            tensors, out_dtype, drop, config, keep_names, where, model_order=reorder
        )
        drop -= set(names.untied)
    if names.aliases:
        check_aliases(names.aliases, tensors, out_dtype, where, checkpoint, buffer_bytes)
    give_back_freed_memory()  # what planning dropped, before the copy's buffers
    layout_s = time.perf_counter() - planning
    if split and fuse_lora:
        tied = sorted(m for m in split.factors if f"{m}.weight" in drop)
        if tied:
            raise UsageError(
                f"{local_dir}: LoRA on {tied[0]!r}, which {where} ties to the input embedding: "
                "save_pretrained writes no such head, so its fused update would be lost; merge "
                "without --fuse-lora for the base model and the adapter (which keeps it)"
            )
    if drop:
        notes.append(
            f"left out {', '.join(sorted(drop))}: {where} ties it to the input embedding, so "
            "save_pretrained writes none and a loaded model uses the embedding in its place "
            "(a head that holds other values is refused)"
        )
    files = [] if adapter_only else hf.plan_hf_files(outputs, max_file_bytes, names.storage())
    if update and target.is_dir():  # found now, not once the whole model is written
        refuse_other_kinds(target, _entries_written(files, split, fuse_lora, config_dir))
    if on_plan:
        on_plan(sum(t.nbytes for t in outputs))

    # Sources with checksums verify every byte they hand out: shardstream's chunk digests,
    # the CRC-32 of each record of verl's .pt files. DCP's files carry none.
    endpoints = OpenEndpoints(checkpoint.endpoint)
    ratio = max((itemsize(t.source.dtype) / itemsize(t.dtype) for t in outputs), default=1.0)
    streamer = Streamer(endpoints, Buffers.sized(buffer_bytes, ratio))
    written = 0
    rank = coll.rank()
    try:
        error = None
        try:
            if coll.world() > 1:
                checkpoint.check_split_records([t for t in tensors if t.name not in drop])
            if rank == 0:
                check_replicas(checkpoint, streamer)
            if split and fuse_lora:
                fused = lora.fuse_transforms(split, settings, streamer)
                streamer.transforms = _by_output_name(fused, outputs)
        except BaseException as exc:  # noqa: BLE001  (every rank must learn of it)
            error = exc
        coll.agree_or_raise(error, "merge")
        with contextlib.ExitStack() as stack:
            tmp = None
            if rank == 0:
                try:
                    in_place = _update_rule(adapter_only) if update else None
                    tmp = stack.enter_context(staged_directory(target, overwrite, in_place))
                except BaseException as exc:  # noqa: BLE001
                    error = exc
            coll.agree_or_raise(error, "merge")
            tmp = Path(coll.broadcast(str(tmp) if tmp is not None else None))
            # Each file's copy runs are planned when it is filled, and dropped after: a merge
            # of a many-rank checkpoint holds one file's runs, not the whole model's.
            beside = _files_beside(files, split, fuse_lora, config_dir, adapter_only)
            output = HfModelFiles.plan(
                tmp, files, align=DIRECT_ALIGN, side_files=beside, buffers=names.buffers
            )
            jobs = output.jobs
            error = None
            if rank == 0:
                try:
                    output.create()
                except BaseException as exc:  # noqa: BLE001  (a full disk: every rank hears)
                    error = exc
            coll.agree_or_raise(error, "merge")  # and the files exist before any rank fills them
            try:
                mine = {}
                planned = None  # this rank's ranges come in file order
                for index, lo, hi in split_ranges(
                    [job.data_size for job in jobs], coll.world(), DEFAULT_CHUNK_BYTES
                )[rank]:
                    if planned is not jobs[index]:
                        if planned is not None:
                            planned.runs = None
                        planned = jobs[index]
                        planned.runs = planned.copy_runs()
                    digests = fill_range(
                        jobs[index],
                        streamer,
                        lo,
                        hi,
                        progress=progress,
                        direct=direct_io,
                        writeback=True,
                    )
                    mine[(index, lo // DEFAULT_CHUNK_BYTES)] = digests
                endpoints.finish()  # every source byte this rank read is verified before commit
            except BaseException as exc:  # noqa: BLE001  (every rank must learn of it)
                error = exc
            gathered = coll.gather(mine if error is None else None)
            coll.agree_or_raise(error, "merge")
            overflowed = coll.gather_to_root(streamer.overflowed)
            if rank == 0:
                try:
                    # Everything beside the weights first: the first file's header lists it.
                    output.write_index()
                    if split and not fuse_lora:
                        adapter_dir = tmp if adapter_only else tmp / lora.ADAPTER_DIR
                        written += write_adapter(
                            adapter_dir, split, settings, out_dtype, streamer, config
                        )
                        endpoints.finish()
                    if config_dir is not None:
                        named = out_dtype or hf.one_floating_dtype(t.dtype for t in outputs)
                        hf.write_configs(tmp, named, config_dir)
                    sealed = output.seal(gathered, side_files=True)
                    written += sum(file.size for file in sealed)
                except BaseException as exc:  # noqa: BLE001  (the others wait to hear of it)
                    error = exc
            coll.agree_or_raise(error, "merge")
    finally:
        endpoints.close()
    if rank == 0:
        notes += _overflow_notes([*overflowed[1:], streamer.overflowed], out_dtype)
    return MergeSummary(
        target=str(target),
        format=checkpoint.format,
        files=[lora.ADAPTER_FILE] if adapter_only else [name for name, _ in files],
        tensors=2 * len(split.factors) if adapter_only else len(outputs),
        bytes_written=written,
        wall_s=time.perf_counter() - start,
        peak_rss_bytes=peak_rss_bytes(),
        dtype=out_dtype,
        skipped=sorted(drop),
        layout=names.describe(),
        kept_names=names.kept_names,
        not_tensors=list(checkpoint.model_objects),
        layout_s=layout_s,
        notes=notes,
    )


def _overflow_notes(counts: list[dict[str, int]], out_dtype: str | None) -> list[str]:
    """A note naming the tensors whose values were beyond the output dtype's range (finite in
    the checkpoint, infinite in the output), from every rank's counts."""
    total: dict[str, int] = {}
    for part in counts:
        for name, count in part.items():
            total[name] = total.get(name, 0) + count
    if not total:
        return []
    worst = sorted(total, key=lambda n: (-total[n], n))
    shown = ", ".join(f"{n!r} ({total[n]})" for n in worst[:3])
    more = f" and {len(worst) - 3} more" if len(worst) > 3 else ""
    name = TORCH_NAME.get(out_dtype or "", "the output dtype")
    values = sum(total.values())
    return [
        f"{_count(values, 'value')} of {_count(len(total), 'tensor')} "
        f"{'was' if values == 1 else 'were'} beyond {name}'s range and became inf: "
        f"{shown}{more}; a wider dtype (--dtype bfloat16) keeps {'it' if values == 1 else 'them'}"
    ]


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _entries_written(
    files: list, split: lora.LoraSplit | None, fuse_lora: bool, config_dir: Path | None
) -> dict[str, bool]:
    """The names a merge writes into its target, each with whether it is a folder."""
    entries = dict.fromkeys((name for name, _ in files), False)
    if len(files) > 1:
        entries[hf.INDEX_FILE] = False
    if split and not fuse_lora:
        if split.base:
            entries[lora.ADAPTER_DIR] = True
        else:
            entries.update(dict.fromkeys((lora.ADAPTER_FILE, lora.ADAPTER_CONFIG), False))
    if config_dir is not None:
        entries.update(dict.fromkeys((p.name for p in hf.config_files(config_dir)), False))
        entries["generation_config.json"] = False
    return entries


def _files_beside(
    files: list, split, fuse_lora: bool, config_dir: Path | None, adapter_only: bool
) -> list[str]:
    """The names of the files merge may write beside the weight files: the index, the LoRA
    adapter, the config and tokenizer files (and a derived generation config)."""
    names = [hf.INDEX_FILE] if len(files) > 1 else []
    if split and not fuse_lora and not adapter_only:
        names += [f"{lora.ADAPTER_DIR}/{name}" for name in (lora.ADAPTER_FILE, lora.ADAPTER_CONFIG)]
    if config_dir is not None:
        names += [p.name for p in hf.config_files(config_dir)] + ["generation_config.json"]
    return names


def _update_rule(adapter_only: bool) -> InPlace:
    """A merge into a non-empty target: a model's other weight files there go (two sets
    would leave which one loads to chance), and its weights, then its index, arrive last:
    a crash midway leaves the target without them, not a model with the old tokenizer
    gone. An adapter alone leaves the weights there be."""
    if adapter_only:
        return InPlace(stale=lambda name: False, last=lambda name: 0)
    return InPlace(
        stale=hf.is_weight_file,
        last=lambda name: 2 if hf.is_weight_index(name) else int(hf.is_weight_file(name)),
    )


def _by_output_name(transforms: dict, outputs: list[OutputTensor]) -> dict:
    """LoRA row hooks (keyed by stored name) keyed by the output name that copies run under;
    a LoRA weight that the output layout splits is refused."""
    out = {}
    for tensor in outputs:
        hook = transforms.get(tensor.source.name)
        if hook is None:
            continue
        if isinstance(tensor.source, TensorSlice):
            raise UsageError(
                f"tensor {tensor.source.name!r}: --fuse-lora into a weight the output layout "
                f"splits ({tensor.name!r}) is not supported; merge with --keep-names"
            )
        out[tensor.name] = hook
    return out


def write_adapter(
    adapter_dir: Path,
    split: lora.LoraSplit,
    settings: lora.LoraSettings,
    dtype: str | None,
    streamer: Streamer,
    config: dict,
) -> int:
    """The LoRA factors as a PEFT adapter in ``adapter_dir``: ``lora_adapter/`` beside the
    base model, or the output itself for a LoRA-only checkpoint."""
    adapter_dir.mkdir(exist_ok=True)
    factors = [
        OutputTensor(name, hf.cast_dtype(t.dtype, dtype), t)
        for name, t in lora.adapter_tensors(split)
    ]
    record = write_safetensors(str(adapter_dir / lora.ADAPTER_FILE), factors, streamer)
    adapter = lora.adapter_config(split, settings, config.get("_name_or_path") or None)
    (adapter_dir / lora.ADAPTER_CONFIG).write_text(json.dumps(adapter, indent=2) + "\n")
    return record.size


def check_replicas(checkpoint, streamer: Streamer) -> None:
    """Plain tensors stored on every rank must agree; compare their digests, never concatenate."""
    from ..engine.copy import hash_block

    by_name = {t.name: t for t in checkpoint.tensors}
    for name, copies in checkpoint.replicas.items():
        tensor = by_name[name]
        expected = hash_block(name, tensor.shape, tensor.blocks[0], streamer)
        for block in copies:
            if hash_block(name, tensor.shape, block, streamer) != expected:
                raise CheckpointFormatError(
                    f"{block.location}: replica of tensor {name!r} differs from "
                    f"{tensor.blocks[0].location}; the ranks disagree"
                )


def heads_trained_apart(
    drop: Collection[str],
    tensors: Sequence[GlobalTensor],
    config: dict,
    out_dtype: str | None,
    streamer: Streamer,
) -> Iterator[tuple[GlobalTensor, str, GlobalTensor | None]]:
    """The heads left out as tied that hold none of the values they may be tied to (their
    embedding's, as written), each with what it was compared with, said and the first such
    tensor (None: none has its shape). Compared by digest, one buffer window at a time."""
    from ..engine.copy import tensor_digest

    by_name = {t.name: t for t in tensors}
    for name in sorted(drop):
        head = by_name[name]
        dtype = hf.cast_dtype(head.dtype, out_dtype)
        sources = hf.tied_sources(head, tensors, drop, config)
        # a float embedding is no integer head's source (casting would make them agree)
        sources = [s for s in sources if is_floating(s.dtype) == is_floating(head.dtype)]
        if any(s.dtype == head.dtype and s.blocks == head.blocks for s in sources):
            continue  # one storage saved under both names (torch.save of a tied model)
        digest = tensor_digest(head, streamer, dtype) if sources else None
        if any(tensor_digest(s, streamer, dtype) == digest for s in sources):
            continue
        if not sources:
            kind = "floating" if is_floating(head.dtype) else "integer"
            yield head, f"has the shape of no other {kind} tensor ({list(head.shape)})", None
            continue
        more = f" and the {len(sources) - 1} other tensors of its shape" * (len(sources) > 1)
        yield head, f"differs from {sources[0].name!r}{more}", sources[0]


def settle_dropped_heads(
    drop: set[str],
    tensors: Sequence[GlobalTensor],
    config: dict,
    out_dtype: str | None,
    where: str,
    checkpoint,
    buffer_bytes: int,
) -> set[str]:
    """Each head left out as tied must hold the values it is tied to, as written: the heads
    that are the only copy of what their class ties (save_pretrained kept BLT's under the
    head's name) are returned, to be written; one trained apart (the run's config untied it,
    the config.json given ties it) is refused, since a loaded model would use the embedding
    in its place. Process 0 reads; every process learns the answer."""

    def settle(streamer: Streamer) -> list[str]:
        kept = []
        for head, said, source in heads_trained_apart(drop, tensors, config, out_dtype, streamer):
            if hf.only_copy_of_tied(head, tensors, config):
                kept.append(head.name)
                continue
            by_class = config and "tie_word_embeddings" not in config
            default = " (by its class's default)" if by_class else ""
            who = f"{where} ties" if config else "--tie-word-embedding ties"
            raise CheckpointFormatError(
                f"{differing_file(head, source, streamer)}: tensor {head.name!r} {said}, but "
                f"{who} the output "
                f"head to the input embedding{default}, so save_pretrained would write no head "
                "and a loaded model would use the embedding in its place: the trained head "
                "would be lost. Merge with the run's own config.json (--hf_model_path DIR, "
                "with tie_word_embeddings false)"
            )
        return sorted(kept)

    return set(_read_on_rank_0(checkpoint, buffer_bytes, settle))


def _read_on_rank_0(checkpoint, buffer_bytes: int, work: Callable[[Streamer], Any]) -> Any:
    """``work(streamer)`` on process 0, over the checkpoint's files; its error raised on every
    process, its result (plain data) returned on every process."""
    error, result = None, None
    if coll.rank() == 0:
        try:
            endpoints = OpenEndpoints(checkpoint.endpoint)
            try:
                result = work(Streamer(endpoints, Buffers.sized(buffer_bytes)))
            finally:
                endpoints.close()
        except BaseException as exc:  # noqa: BLE001  (every rank must learn of it)
            error = exc
    coll.agree_or_raise(error, "merge")
    return coll.broadcast(result)


def values_differ(left: GlobalTensor, kept: GlobalTensor, streamer: Streamer, dtype: str) -> bool:
    """Whether stored tensor ``left`` holds other values than ``kept`` (digests of both cast
    to ``dtype``, one buffer window at a time); one storage saved under both names (torch.save
    of a tied model) is not read, and an integer tensor never equals a float one."""
    from ..engine.copy import tensor_digest

    if left.dtype == kept.dtype and left.blocks == kept.blocks:
        return False
    if tuple(left.shape) != tuple(kept.shape) or is_floating(left.dtype) != is_floating(kept.dtype):
        return True
    return tensor_digest(left, streamer, dtype) != tensor_digest(kept, streamer, dtype)


def differing_file(tensor: GlobalTensor, other: GlobalTensor | None, streamer: Streamer) -> str:
    """The file of ``tensor``'s first block whose elements differ from those of ``other``'s
    block of the same region (rank 1's file where only rank 1's shard of a head differs);
    its first block's file where the two are not stored alike."""
    from ..engine.copy import hash_block

    if other is not None and other.dtype == tensor.dtype:
        theirs = {(b.start, b.shape): b for b in other.blocks}
        if all((b.start, b.shape) in theirs for b in tensor.blocks):
            for block in tensor.blocks:
                twin = theirs[block.start, block.shape]
                mine = hash_block(tensor.name, tensor.shape, block, streamer)
                if mine != hash_block(other.name, other.shape, twin, streamer):
                    return block.location
    return tensor.blocks[0].location


def check_aliases(
    aliases: Collection[tuple[str, str]],
    tensors: Sequence[GlobalTensor],
    out_dtype: str | None,
    where: str,
    checkpoint,
    buffer_bytes: int,
) -> None:
    """Each stored tensor the layout leaves out as an alias (``NamePlan.aliases``: the model
    answers to it and a written one with one parameter) must hold the written one's values,
    as written; one that holds others (a head the run untied, the config.json given ties) is
    refused, since a loaded model would take the written one's values in its place. Process 0
    reads; every process learns the answer."""
    by_name = {t.name: t for t in tensors}

    def check(streamer: Streamer) -> None:
        for left_name, kept_name in sorted(aliases):
            left, kept = by_name[left_name], by_name[kept_name]
            if not values_differ(left, kept, streamer, hf.cast_dtype(kept.dtype, out_dtype)):
                continue
            raise CheckpointFormatError(
                f"{differing_file(left, kept, streamer)}: tensor {left_name!r} differs from "
                f"{kept_name!r}, "
                f"but the model {where} describes answers to both with one parameter (its class "
                f"ties them), so save_pretrained would write only {kept_name!r} and a loaded "
                f"model would use its values for both: the trained {left_name!r} would be lost. "
                "Merge with the run's own config.json (--hf_model_path DIR, with "
                "tie_word_embeddings false where that unties them), or with --keep-names to "
                "write every stored tensor"
            )

    _read_on_rank_0(checkpoint, buffer_bytes, check)


def _entries(*directories: str | os.PathLike) -> list[str]:
    """What ``directories`` hold, one level down (an unlistable one: nothing)."""
    found: list[str] = []
    for directory in directories:
        try:
            found += [entry.path for entry in os.scandir(directory)]
        except OSError:
            continue
    return found

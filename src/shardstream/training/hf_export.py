"""hf_model during training: every rank writes its own slices straight into the final HF files.

No rank gathers a full tensor. The layout (file split, headers, offsets) is computed identically
on every rank from global shapes; rank 0 creates the files, each rank ``pwrite``s its rows, and
the chunk checksums are computed in parallel and sealed into the headers by rank 0. When ranks
do not share a filesystem, pieces stream to rank 0 in bounded messages instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..engine.checksum import ChunkHasher
from ..engine.copy import Buffers, Streamer, pwrite_array
from ..engine.dtypes import code_of, itemsize
from ..engine.endpoints import Endpoint, FileEndpoint, TensorEndpoint, live_block
from ..engine.plan import (
    Block,
    CopyRun,
    GlobalTensor,
    TensorSlice,
    dense_block,
    plan_copy,
    slice_block,
)
from ..errors import UsageError
from ..formats import hf
from ..formats.hf_writer import HfModelFiles, output_layout
from ..formats.native import MODEL_PREFIX, item_key, whole_chunk
from ..formats.safetensors import build_header
from ..formats.writer import OutputTensor, WrittenFile, read_chunk_digest, start_writeback
from ..storage import collectives as coll
from ..units import DEFAULT_CHUNK_BYTES
from .fsdp1_shards import FlatShard
from .state import local_shard, model_tensors

if TYPE_CHECKING:
    from .async_save import SourceGuard

HF_DIR = "huggingface"


def _local_blocks(location: str, tensor: Any) -> Iterator[tuple[Block, torch.Tensor]]:
    """This rank's blocks of a (D)Tensor or FSDP1 flat shard, none where another rank owns
    the bytes."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(tensor, FlatShard):  # each box of a flat shard is read on its own
        for start, view in tensor.pieces:
            yield live_block(item_key(location, list(start)), view, start), view
        return
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        mesh = tensor.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None or any(
            isinstance(p, Replicate) and c != 0 for p, c in zip(tensor.placements, coordinate)
        ):
            return
        _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
        start = tuple(int(o) for o in offset)
    else:
        if coll.rank() != 0:
            return
        local, start = tensor, (0,) * tensor.dim()
    yield live_block(location, local, start), local


def _config(hf_config: Any, source: Path | None) -> dict:
    """config.json's content, as the HF output policy reads it: the transformers config's,
    else the source directory's."""
    return hf_config.to_dict() if hf_config is not None else hf.read_config(source)


@dataclass(frozen=True)
class HfExport:
    """hf_model for ``saving.save``: writes ``huggingface/`` into the step directory.

    ``source``: a directory with config.json (and tokenizer files) to copy; ``dtype``: the
    publish dtype (None: the config's); ``shared_filesystem``: None detects it at save time."""

    model: torch.nn.Module
    hf_config: Any
    tokenizer: Any
    source: Path | None
    dtype: str | None
    shared_filesystem: bool | None

    def capture(self, tensors: dict[str, torch.Tensor] | None = None) -> ExportPlan:
        """One save's export, on the training thread: references to the live (sharded)
        tensors and the HF files. A background save must not touch the model itself: its
        state dict hooks would race with FSDP's forward and backward. ``tensors``: the
        model's ``state.model_tensors``, when the caller has them already."""
        tensors = model_tensors(self.model) if tensors is None else tensors
        live = {k[len(MODEL_PREFIX) :]: v for k, v in tensors.items()}
        out_dtype, files, buffers = _plan_files(live, self.hf_config, self.source, self.dtype)
        return ExportPlan(self, out_dtype, files, tuple(_owned(live, files)), buffers)


@dataclass(frozen=True)
class ExportPlan:
    """hf_model of one save (``HfExport.capture``): the HF files, and what this rank reads."""

    export: HfExport
    out_dtype: str | None
    files: list[tuple[str, list[OutputTensor]]]  # as hf.plan_hf_files gives them
    reads: tuple[tuple[str, Block, torch.Tensor], ...]  # see _owned
    buffers: tuple[str, ...] = ()  # outputs total_parameters leaves out (NamePlan.buffers)

    def __call__(
        self,
        tmp: Path,
        buffer_bytes: int,
        guard: SourceGuard | None = None,
        rank_file: RankFileRows | None = None,
    ) -> dict:
        return write_hf_model(self, tmp, buffer_bytes, guard, rank_file)

    def live_reads(self) -> list[tuple[str, TensorEndpoint]]:
        """(location, live endpoint) of what this rank reads, in order: for an async save's
        ``SourceGuard.register_export``."""
        return [(block.location, TensorEndpoint(name, local)) for name, block, local in self.reads]

    def rank_file_keys(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, str] | None:
        """Read location -> rank-file key of every block this rank exports, when ``items``
        (what this rank's file of the same save holds: ``local_save.local_items``) hold each
        of them with the same shape and dtype; else None."""
        held = dict(items)
        keys = {}
        for name, block, _ in self.reads:
            key = item_key(MODEL_PREFIX + name, list(block.start))
            saved = held.get(key)
            if saved is None or (tuple(saved.shape), code_of(saved.dtype)) != (
                block.shape,
                block.dtype,
            ):
                return None
            keys[block.location] = key
        return keys

    def same_bytes(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
        """Manifest entries for those of ``tensors`` (``model.<fqn>``) whose exported copy holds
        exactly their bytes (same dtype, not a dropped tied weight): one chunk each, the whole
        tensor in its ``huggingface/`` file."""
        entries = {}
        for file_name, outputs in self.files:
            for out in outputs:
                name = MODEL_PREFIX + out.source.name
                if (
                    name not in tensors
                    or out.dtype != code_of(tensors[name].dtype)
                    or isinstance(out.source, TensorSlice)  # holds a part of it only
                ):
                    continue
                chunk = whole_chunk(list(out.shape), f"{HF_DIR}/{file_name}", out.name)
                entries[name] = {"dtype": out.dtype, "shape": list(out.shape), "chunks": [chunk]}
        return entries


def hf_exporter(
    model: torch.nn.Module | None,
    hf_config: Any = None,
    tokenizer: Any = None,
    source_dir: str | os.PathLike | None = None,
    dtype: str | None = None,
    shared_filesystem: bool | None = None,
) -> HfExport:
    """The hf_model writer for ``saving.save``, its arguments checked now."""
    if model is None:
        raise UsageError("save_contents includes 'hf_model' but no model was given")
    refuse_peft_export(model)
    if hf_config is None and source_dir is None:
        raise UsageError(
            "save_contents includes 'hf_model': give hf_config= (a transformers config) or "
            "hf_source_dir= (a directory with config.json)"
        )
    source = Path(source_dir) if source_dir is not None else None
    return HfExport(model, hf_config, tokenizer, source, dtype, shared_filesystem)


def refuse_peft_export(model: torch.nn.Module) -> None:
    """hf_model of a PEFT (LoRA) model would hold PEFT's in-memory names
    (``base_model.model.*.base_layer.weight``, ``lora_A``), which transformers loads as a
    model of random weights (verl's own export does so): refused, as save_contents names it."""
    lora = next((n for n, _ in model.named_parameters() if ".lora_A." in f".{n}."), None)
    if lora is not None:
        raise UsageError(
            f"save_contents includes 'hf_model', but the model is a PEFT (LoRA) model "
            f"({lora!r}): its export would hold PEFT's names, which transformers does not "
            "load. Leave hf_model out and merge the checkpoint: shardstream merge writes the "
            "base model and lora_adapter/ (or, with --fuse-lora, the fused model)"
        )


@dataclass(frozen=True)
class ConfigFiles:
    """``huggingface/`` without weights: the config and tokenizer files a step saved without
    "hf_model" still carries (as verl's steps do), so that merge finds the model's config.
    Rank 0 writes them into the staged step (``saving.execute_save`` calls this in the
    export's place)."""

    hf_config: Any
    tokenizer: Any
    source: Path | None

    def rank_file_keys(self, items) -> None:
        return None

    def live_reads(self) -> list:
        return []

    def __call__(self, tmp: Path, buffer_bytes: int, guard=None, rank_file=None) -> dict:
        error = None
        if coll.rank() == 0:
            try:
                target = tmp / HF_DIR
                target.mkdir(exist_ok=True)
                hf.write_configs(target, None, self.source, self.hf_config, self.tokenizer)
            except Exception as exc:  # noqa: BLE001  (every rank must learn of it)
                error = exc
        coll.agree_or_raise(error)
        return {}


def config_files(
    hf_config: Any, tokenizer: Any, source_dir: str | os.PathLike | None
) -> ConfigFiles | None:
    """The config-only writer for a save without "hf_model"; None when nothing is given."""
    if hf_config is None and tokenizer is None and source_dir is None:
        return None
    return ConfigFiles(hf_config, tokenizer, Path(source_dir) if source_dir is not None else None)


@dataclass(frozen=True)
class RankFileRows:
    """Where this rank's exported rows lie in its rank file of the same save: an async save's
    export reads them there, so the next optimizer step need not wait for the export."""

    file: WrittenFile
    offsets: dict[str, int]  # read location -> absolute byte offset of those rows

    @classmethod
    def of(
        cls, file: WrittenFile, items: list[tuple[str, torch.Tensor]], keys: dict[str, str]
    ) -> RankFileRows:
        """``file`` as written from ``items``; ``keys`` from ``HfExport.rank_file_keys``."""
        _, entries = build_header([(k, code_of(t.dtype), tuple(t.shape)) for k, t in items])
        begin = {e.name: file.data_start + e.begin for e in entries}
        return cls(file, {location: begin[key] for location, key in keys.items()})

    def endpoint(self) -> FileEndpoint:
        """The rank file, every read checked against the chunk digests just written."""
        f = self.file
        return FileEndpoint(f.path, f.chunks, f.data_start, f.chunk_bytes)


def transformers_class_name(model: torch.nn.Module) -> str | None:
    """The name of the transformers class of ``model`` (under FSDP1/DDP wrappers, FSDP2's
    subclass, ``torch.compile``), which ``save_pretrained`` writes as ``architectures``; None
    for a model of another library."""
    while isinstance(getattr(model, "module", None), torch.nn.Module) and type(
        model
    ).__module__.startswith("torch."):
        model = model.module
    model = getattr(model, "_orig_mod", model)
    found = next((c for c in type(model).__mro__ if not c.__module__.startswith("torch.")), None)
    if found is None or not found.__module__.startswith("transformers."):
        return None
    return found.__name__


def _plan_files(
    live: dict[str, torch.Tensor], hf_config: Any, source: Path | None, dtype: str | None
) -> tuple[str | None, list[tuple[str, list[OutputTensor]]], tuple[str, ...]]:
    """The publish dtype, the HF files (name, tensors) for the model's tensors ``live`` and the
    outputs of its buffers (``NamePlan.buffers``);
    computed from shapes and dtypes (and where a head is tied, from every rank's answer to
    ``_heads_held_apart``), so every rank gets the same answer."""
    config = _config(hf_config, source)
    out_dtype = hf.output_dtype(dtype, config)
    tensors = [GlobalTensor(n, code_of(t.dtype), tuple(t.shape), ()) for n, t in live.items()]
    drop = hf.tied_duplicates(tensors, config, False, hf_config)
    if drop:
        drop -= _heads_held_apart(live, drop, tensors, config)
    names, outputs = output_layout(tensors, out_dtype, drop, config)
    return out_dtype, hf.plan_hf_files(outputs, storage=names.storage()), names.buffers


def _heads_held_apart(
    live: dict[str, Any], drop: set[str], tensors: list[GlobalTensor], config: dict
) -> set[str]:
    """The heads of ``drop`` (the config ties them) that the live model holds apart from every
    tensor they may be tied to (``hf.tied_sources``): not the same tensor or memory, and other
    values on some rank (a head untied by hand, the config left as it was). save_pretrained
    writes such a head (transformers 5 looks at what the model shares), and so does the
    export: left out, the trained head would be lost. Every rank learns every rank's answer."""

    def together(head: Any, source: Any) -> bool:
        if head is source:
            return True
        head, source = local_shard(head), local_shard(source)
        if not (isinstance(head, torch.Tensor) and isinstance(source, torch.Tensor)):
            return True  # FSDP1 shards of a shared parameter are one object; others: as tied
        if head.shape != source.shape or head.dtype != source.dtype:
            return False
        if head.data_ptr() == source.data_ptr() and head.stride() == source.stride():
            return True
        return torch.equal(head, source)

    by_name = {t.name: t for t in tensors}
    apart = []
    for name in sorted(drop):
        sources = hf.tied_sources(by_name[name], tensors, drop, config)
        if not any(together(live[name], live[s.name]) for s in sources):
            apart.append(name)
    return {name for answer in coll.gather(apart) for name in answer}


def _layout(plan: ExportPlan) -> tuple[str, str]:
    """The output dtype, and a digest of every file's tensors (names, dtypes, shapes)."""
    files = [[(t.name, t.dtype, tuple(t.shape)) for t in ts] for _, ts in plan.files]
    return (plan.out_dtype, hashlib.sha256(repr(files).encode()).hexdigest())


def _check_same_layout(plan: ExportPlan) -> None:
    """Every rank planned the export from its own copy of the config; one that differs (a
    config changed on some ranks only) would write its rows at other offsets. Refuse by name.
    Ranks compare digests, so the collective stays small whatever the model. The dtype the
    configs name may differ where the files do not (``save_pretrained`` on rank 0 alone sets
    its config's to the weights' own): rank 0 writes config.json."""
    layouts = coll.gather(_layout(plan))
    for rank, layout in enumerate(layouts):
        if layout[1] != layouts[0][1]:
            raise UsageError(
                f"hf_model: rank {rank} plans the export differently from rank 0 (dtype "
                f"{layout[0]} against {layouts[0][0]}): the model's config differs between "
                "ranks; nothing was written"
            )


def write_hf_model(
    plan: ExportPlan,
    tmp: Path,
    buffer_bytes: int,
    guard: SourceGuard | None = None,
    rank_file: RankFileRows | None = None,
) -> dict:
    """Write ``huggingface/`` into ``tmp`` from every rank; rank 0 returns the manifest's file
    records. With ``rank_file``, this rank's rows are read from there, not from the live
    tensors; else an async save's ``guard`` (where ``live_reads()`` is registered) hands out
    the live or staged tensors and learns how far the reads are."""
    export = plan.export
    _check_same_layout(plan)
    output = HfModelFiles.plan(tmp / HF_DIR, plan.files, buffers=plan.buffers)
    shared = export.shared_filesystem
    if shared is None:
        shared = _shared_filesystem(tmp)

    error = None
    if coll.rank() == 0:
        try:
            output.create()
            written = (t.dtype for _, tensors in plan.files for t in tensors)
            hf.write_configs(
                output.directory,
                plan.out_dtype or hf.one_floating_dtype(written),
                export.source,
                export.hf_config,
                export.tokenizer,
                transformers_class_name(export.model),
            )
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
            error = exc
    coll.agree_or_raise(error)  # also the barrier before any rank writes

    # Plan this rank's runs, then write (or ship) them.
    endpoints: dict[str, Endpoint] = {}
    guarded = guard is not None and rank_file is None
    runs: list[tuple[int, CopyRun]] = []
    mine: dict[str, list[tuple[Block, torch.Tensor]]] = {}
    for name, block, local in plan.reads:
        mine.setdefault(name, []).append((block, local))
    for index, job in enumerate(output.jobs):
        for tensor, entry in zip(job.tensors, job.entries):
            name = tensor.source.name
            dst = dense_block(
                str(index), job.header_bytes + entry.begin, tensor.dtype, tensor.shape
            )
            for block, local in mine.get(name, ()):  # none: other ranks export its rows
                if rank_file is not None:
                    at = rank_file.offsets[block.location]
                    block = dense_block(
                        rank_file.file.path, at, block.dtype, block.shape, block.start
                    )
                elif not guarded:
                    endpoints[block.location] = TensorEndpoint(name, local)
                source = tensor.source
                if isinstance(source, TensorSlice):  # an expert, half a gate_up: its box only
                    block = slice_block(block, source.start, source.extent, source.dims)
                    if block is None:
                        continue
                runs.extend((index, r) for r in plan_copy(name, tensor.shape, block, dst))
    if guarded:  # in the order the guard was told (live_reads), so a source read is done
        order = {block.location: i for i, (_, block, _) in enumerate(plan.reads)}
        runs.sort(key=lambda item: order[item[1].src])
    ratio = max((itemsize(r.src_dtype) / itemsize(r.dst_dtype) for _, r in runs), default=1.0)
    lookup = _guarded_lookup(guard) if guarded else endpoints.__getitem__
    streamer = Streamer(lookup, Buffers.sized(buffer_bytes, ratio))
    hashed = _WrittenChunks(
        [job.header_bytes for job in output.jobs], [job.data_size for job in output.jobs]
    )
    hf_files = _HfFiles([Path(job.path) for job in output.jobs], hashed)
    error = None
    try:
        if rank_file is not None:
            endpoints[rank_file.file.path] = rank_file.endpoint()
        # Once this rank's pieces are read, the next optimizer step need not wait for the
        # rest (rank 0 receiving the others' pieces, the fsync, the sealing).
        reads_done = guard.all_read if guarded else None
        if shared:
            _write_local(hf_files, runs, streamer)
        else:
            _ship_to_rank0(hf_files, runs, streamer, reads_done)
        for endpoint in endpoints.values():
            endpoint.finish()  # the rank file's last chunk read is checked
        if reads_done is not None:
            reads_done()
        hf_files.fsync()  # the files this rank wrote (none on a shipping rank)
    except Exception as exc:  # noqa: BLE001 - a full disk on one rank: all must stop here
        error = exc
    finally:
        hf_files.close()
        for endpoint in endpoints.values():
            endpoint.close()
    coll.agree_or_raise(error)  # also the barrier before sealing
    return _seal(output, shared, hashed.digests)


def _owned(live: dict[str, torch.Tensor], files: list[tuple[str, list[OutputTensor]]]):
    """(model name, this rank's block, its local tensor) for every tensor of ``files`` this
    rank exports rows of, in file order: the order the export reads them. A tensor split
    into several outputs is read once."""
    seen = set()
    for _, tensors in files:
        for tensor in tensors:
            name = tensor.source.name
            if name in seen:
                continue
            seen.add(name)
            for block, local in _local_blocks(f"export:{name}", live[name]):
                yield name, block, local


def _guarded_lookup(guard: SourceGuard) -> Callable[[str], Endpoint]:
    """The export's endpoint lookup under an async save's guard: the live or staged tensor,
    and moving to a new source tells the guard the ones before it are read."""
    current = None

    def lookup(location: str) -> Endpoint:
        nonlocal current
        if location != current:
            guard.reading(location)
            current = location
        return guard.endpoint(location)

    return lookup


class _WrittenChunks:
    """Digests of the checksum chunks a rank writes whole in one contiguous stretch, hashed
    from memory as they go to the file, so sealing reads back only the chunks ranks share."""

    def __init__(self, data_starts: list[int], sizes: list[int], chunk: int = DEFAULT_CHUNK_BYTES):
        self.starts, self.sizes, self.chunk = data_starts, sizes, chunk
        self.digests: dict[tuple[int, int], str] = {}
        # file -> [next data offset, first chunk index, its hasher, digests recorded from it]
        self._stretch: dict[int, list] = {}

    def wrote(self, index: int, offset: int, data: np.ndarray) -> None:
        """``data`` (contiguous bytes) was written at file ``index``'s byte ``offset``."""
        at, chunk = offset - self.starts[index], self.chunk
        stretch = self._stretch.get(index)
        if stretch is None or stretch[0] != at:  # a new stretch: hash from its first boundary
            first = -(-at // chunk)
            hasher = ChunkHasher(chunk, max(0, self.sizes[index] - first * chunk))
            stretch = self._stretch[index] = [at, first, hasher, 0]
        _, first, hasher, recorded = stretch
        hasher.update(data[max(0, first * chunk + hasher.fed - at) :])  # bytes before a boundary
        for k in range(recorded, len(hasher.digests)):
            self.digests[(index, first + k)] = hasher.digests[k]
        stretch[0], stretch[3] = at + data.nbytes, len(hasher.digests)


def _pieces(runs: list[tuple[int, CopyRun]], streamer: Streamer):
    """(file index, offset, step, rows) per batch; rows of a same-dtype run in host memory are
    views of the live tensor itself (``Streamer.borrow``), so they go to the file with no copy
    and no buffer."""
    cap = streamer.buf.window.nbytes
    for index, run in runs:
        for i0, i1, e0, e1 in streamer.batches(run, 0, 1 << 62, cap):
            offset = run.dst_offset + i0 * run.dst_step + e0 * itemsize(run.dst_dtype)
            rows = streamer.borrow(run, i0, i1, e0, e1)
            if rows is None:
                rows = streamer.rows(run, i0, i1, e0, e1)
            yield index, offset, run.dst_step, rows


def _pwrite_rows(
    fd: int, path: str, offset: int, step: int, rows: np.ndarray, on_written: Callable
) -> None:
    count, width = rows.shape
    if count == 1 or step == width:
        data = np.ascontiguousarray(rows).reshape(-1)
        pwrite_array(fd, path, data, offset)
        on_written(offset, data)
        return
    for i in range(count):
        pwrite_array(fd, path, rows[i], offset + i * step)
        on_written(offset + i * step, rows[i])


class _HfFiles:
    """The HF files a rank writes pieces into, each opened on first use; every write is
    hashed from memory as it goes (``_WrittenChunks``)."""

    def __init__(self, paths: list[Path], hashed: _WrittenChunks):
        self.paths, self.hashed = paths, hashed
        self.fds: dict[int, int] = {}

    def write(self, index: int, offset: int, step: int, rows: np.ndarray) -> None:
        if index not in self.fds:
            self.fds[index] = os.open(self.paths[index], os.O_WRONLY)
        written = functools.partial(self.hashed.wrote, index)
        _pwrite_rows(self.fds[index], str(self.paths[index]), offset, step, rows, written)
        start_writeback(self.fds[index], offset, (rows.shape[0] - 1) * step + rows.shape[1])

    def fsync(self) -> None:
        for fd in self.fds.values():
            os.fsync(fd)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _write_local(files: _HfFiles, runs, streamer: Streamer) -> None:
    for piece in _pieces(runs, streamer):
        files.write(*piece)


def _ship_to_rank0(
    files: _HfFiles, runs, streamer: Streamer, reads_done: Callable[[], None] | None = None
) -> None:
    """Non-shared filesystems: ranks send bounded pieces; rank 0 writes them in rank order.
    ``reads_done`` is called once this rank has read all of its own."""
    rank, world = coll.rank(), coll.world()
    grp, root = coll.group(), coll.global_rank(0)
    if rank != 0:
        for index, offset, step, rows in _pieces(runs, streamer):
            count, width = rows.shape
            dist.send(
                torch.tensor([index, offset, step, count, width], dtype=torch.int64),
                root,
                group=grp,
            )
            dist.send(torch.from_numpy(np.ascontiguousarray(rows)).view(-1), root, group=grp)
        dist.send(torch.tensor([-1, 0, 0, 0, 0], dtype=torch.int64), root, group=grp)
        return
    # A write that fails (a full disk) stops the writing, not the receiving: the peers'
    # sends must all be matched, or they would wait forever. The error is raised at the end.
    error = None
    try:
        _write_local(files, runs, streamer)
        if reads_done is not None:
            reads_done()
    except Exception as exc:  # noqa: BLE001
        error = exc
    for peer in range(1, world):
        while True:
            meta = torch.empty(5, dtype=torch.int64)
            dist.recv(meta, coll.global_rank(peer), group=grp)
            index, offset, step, count, width = (int(v) for v in meta)
            if index < 0:
                break
            data = torch.empty(count * width, dtype=torch.uint8)
            dist.recv(data, coll.global_rank(peer), group=grp)
            if error is None:
                try:
                    files.write(index, offset, step, data.numpy().reshape(count, width))
                except Exception as exc:  # noqa: BLE001
                    error = exc
    if error is not None:
        raise error


def _seal(output: HfModelFiles, shared: bool, from_memory: dict[tuple[int, int], str]) -> dict:
    """Seal the files with every chunk's digest: those hashed from memory while writing, and
    the rest read back from the files (spread over ranks when they share the files). Rank 0
    returns the manifest's file records."""
    rank, world = coll.rank(), coll.world()
    hashers = world if shared else 1
    known = {key for keys in coll.gather(sorted(from_memory)) for key in map(tuple, keys)}
    mine = {key: [value] for key, value in from_memory.items()}
    counter = 0
    for index, job in enumerate(output.jobs):
        for j in range(job.chunk_count):
            if (index, j) in known:
                continue
            if counter % hashers == rank:
                mine[(index, j)] = [read_chunk_digest(job, j)]
            counter += 1
    gathered = coll.gather(mine)
    if rank != 0:
        return {}
    return {
        f"{HF_DIR}/{Path(file.path).name}": {"size": file.size, "header_xxh3": file.header_digest}
        for file in output.seal(gathered)
    }


def _shared_filesystem(tmp: Path) -> bool:
    """Whether every rank sees the file rank 0 just wrote into the save directory."""
    token, error = None, None
    if coll.rank() == 0:
        token = uuid.uuid4().hex
        try:
            (tmp / f".probe-{token}").write_text(token)
        except OSError as exc:  # a full disk: every rank must hear of it, not wait for a token
            error = exc
    token = coll.broadcast(token)
    coll.agree_or_raise(error)  # also the barrier: the probe is written
    probe = tmp / f".probe-{token}"
    sees = probe.is_file() and probe.read_text() == token
    everyone = coll.gather(sees)
    coll.barrier()
    if coll.rank() == 0:
        probe.unlink(missing_ok=True)
    return all(everyone)

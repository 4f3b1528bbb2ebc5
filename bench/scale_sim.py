#!/usr/bin/env python
"""Scale simulation: shardstream's planning for a 70B model at 64 .. 8,192 ranks, metadata only.

Nothing here touches tensor data. For every rank count N the script builds what a real FSDP2
(``Shard(0)``) save and restore of a Llama-70B-shaped model with AdamW state would build, by
calling the real code on synthetic inputs:

- **save, every rank**: the rank's DCP write items (model + ``exp_avg``/``exp_avg_sq`` shards
  from ``chunk_extent``, replicated ``step`` scalars), its rank-file header
  (``build_header``/``checksum_metadata``) and copy runs (``plan_file_runs``).
- **save, rank 0**: unpickling N gathered ``SavePlan``s, DCP's global plan
  (``dedup_save_plans``, ``create_default_global_save_plan``, the planner-data merge),
  ``LinearCheckSavePlanner``'s tiling check (DCP's quadratic ``_validate_global_plan``, which
  it replaces, is timed as a reference), ``StreamingWriter.prepare_global_plan``, unpickling N
  lists of ``WriteResult``s, shardstream's ``tensor_manifest`` and the manifest's canonical
  JSON + digest.
- **load, every rank** (resharding N -> N/8, e.g. 8,192 -> 1,024, one destination rank):
  ``read_manifest`` (the real file), N rank-file headers (``parse_header``), every tensor's
  blocks (``native._global_tensor``), ``StreamingReader.read_metadata``, DCP's
  ``create_read_items_for_chunk_list`` for the rank's shards, and ``plan_copy`` per overlap.
- **merge, one process**: ``output_tensors``, ``plan_hf_files`` (5 GB files) and
  ``plan_file_runs`` for every model tensor, bf16 output.
- **hf_model export, every rank**: the HF layout and the rank's own runs (``plan_copy``).

The 80 layers have identical shapes, so the per-chunk work is done for the non-layer tensors
and one representative layer, counted once per layer. Manifest bytes come out exact (shorter
names of layers 0-9 are corrected for, and the total is checked against a full build at the
smallest rank count); times are the representative's times so weighted. Times are CPU seconds
of this process with the cyclic GC paused (``--gc on`` to run it); the heap is measured with
tracemalloc at one rank count (``--mem-ranks``) and scaled by chunk count.

The script fits log(time) against log(ranks) for every stage and exits 1 when a stage grows
faster than linearly beyond the tolerance. Run ``--help`` for options; see docs/scaling.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from shardstream.engine.checksum import digest
from shardstream.engine.plan import (
    Block,
    GlobalTensor,
    check_blocks_tile,
    chunk_extent,
    dense_block,
    plan_copy,
)
from shardstream.formats import hf, native
from shardstream.formats.hf_writer import output_tensors
from shardstream.formats.safetensors import (
    SafetensorsHeader,
    build_header,
    checksum_metadata,
    parse_header,
    stored_checksums,
)
from shardstream.formats.writer import OutputTensor, plan_file_runs
from shardstream.training import local_save, native_storage
from shardstream.units import DEFAULT_BUFFER_BYTES, DEFAULT_CHUNK_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by file path
from harness.render import table as md_table  # noqa: E402

DEFAULT_RANKS = (64, 256, 1024, 2048, 4096, 8192)
HF_FILE_BYTES = 5 * 10**9
F32, BF16 = "F32", "BF16"
PROPS = TensorProperties(dtype=torch.float32)
CREATED = 1.8e9  # a fixed created_unix, so manifest sizes are reproducible
MiB, GiB = 2**20, 2**30


# --- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A Llama-2/3-70B-shaped decoder (untied head). Parameter names as in transformers."""

    hidden: int = 8192
    layers: int = 80
    intermediate: int = 28672
    heads: int = 64
    kv_heads: int = 8
    vocab: int = 128256

    def layer(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        h, kv = self.hidden, self.kv_heads * (self.hidden // self.heads)
        p = f"model.layers.{i}."
        return [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (self.intermediate, h)),
            (p + "mlp.up_proj.weight", (self.intermediate, h)),
            (p + "mlp.down_proj.weight", (h, self.intermediate)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]

    def outer(self) -> list[tuple[str, tuple[int, ...]]]:
        return [
            ("model.embed_tokens.weight", (self.vocab, self.hidden)),
            ("model.norm.weight", (self.hidden,)),
            ("lm_head.weight", (self.vocab, self.hidden)),
        ]

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        outer = self.outer()
        layers = [p for i in range(self.layers) for p in self.layer(i)]
        return [outer[0], *layers, *outer[1:]]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.params())


@dataclass(frozen=True)
class Entry:
    """One tensor of the flat state dict shardstream saves."""

    fqn: str
    shape: tuple[int, ...]
    sharded: bool  # FSDP2 Shard(0) DTensor; False: a plain tensor every rank holds (``step``)


def state_entries(params: list[tuple[str, tuple[int, ...]]]) -> list[Entry]:
    """``model.<fqn>`` then, per parameter, AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``."""
    model = [Entry(f"{native.MODEL_PREFIX}{n}", s, True) for n, s in params]
    optim = []
    for n, s in params:
        prefix = f"{native.OPTIMIZER_PREFIX}state.{n}."
        optim += [
            Entry(prefix + "step", (), False),
            Entry(prefix + "exp_avg", s, True),
            Entry(prefix + "exp_avg_sq", s, True),
        ]
    return model + optim


@dataclass
class Group:
    """Tensors measured once and counted ``weight`` times (every layer has the same shapes).

    ``digits`` maps a layer-number length to how many layers have it: their manifest bytes
    differ from the representative's only by that length in every name containing
    ``layers.<i>.``, which the caller adjusts exactly.
    """

    label: str
    weight: int
    params: list[tuple[str, tuple[int, ...]]]
    layer: int | None = None
    digits: dict[int, int] = field(default_factory=dict)

    @property
    def entries(self) -> list[Entry]:
        return state_entries(self.params)


def groups(layout: Layout, full: bool = False) -> list[Group]:
    if full:
        return [Group("all tensors", 1, layout.params())]
    out = [Group("embed/norm/head", 1, layout.outer())]
    if layout.layers:
        digits: dict[int, int] = {}
        for i in range(layout.layers):
            digits[len(str(i))] = digits.get(len(str(i)), 0) + 1
        rep = layout.layers - 1
        out.append(
            Group(f"layer {rep} (x{layout.layers})", layout.layers, layout.layer(rep), rep, digits)
        )
    return out


def weighted_bytes(group: Group, body: bytes) -> int:
    """Bytes of ``body`` (the group's part of the manifest) summed over the layers it stands
    for: names of layer i are ``len(str(rep)) - len(str(i))`` bytes shorter per mention."""
    if group.layer is None:
        return group.weight * len(body)
    mentions = body.count(b"layers.%d." % group.layer)
    rep = len(str(group.layer))
    return sum(n * (len(body) - (rep - d) * mentions) for d, n in group.digits.items())


def local_chunk(e: Entry, world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of ``rank``'s shard: ``torch.chunk``'s split of dim 0, as FSDP2 does."""
    if not e.shape or not e.sharded:
        return (0,) * len(e.shape), e.shape
    start, rows = chunk_extent(e.shape[0], world, rank)
    return (start,) + (0,) * (len(e.shape) - 1), (rows, *e.shape[1:])


# --- save -----------------------------------------------------------------------------------


def write_item(e: Entry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> WriteItem:
    """What DCP's ``_create_write_items`` makes for a DTensor shard or a plain tensor."""
    off = torch.Size(offsets)
    return WriteItem(
        index=MetadataIndex(e.fqn, off),
        type=WriteItemType.SHARD if e.sharded else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(sizes)),
            properties=PROPS,
            size=torch.Size(e.shape),
        ),
    )


def local_plan(entries: list[Entry], world: int, rank: int) -> SavePlan:
    """DefaultSavePlanner.create_local_plan: items plus the flatten mapping (planner_data)."""
    items = [write_item(e, *local_chunk(e, world, rank)) for e in entries]
    return SavePlan(items, planner_data={e.fqn: (e.fqn,) for e in entries})


def rank_write_plan(items: list[WriteItem], name: str) -> tuple[bytes, list]:
    """StreamingWriter.write_data's planning: blocks of the live shards, the file's header
    (placeholder checksums, as ``write_safetensors``) and its copy runs."""
    outputs = []
    for item in items:
        key = native_storage._item_key(item.index)
        sizes = tuple(item.tensor_data.chunk.sizes)
        block = dense_block(f"memory:{key}", 0, F32, sizes)
        outputs.append(OutputTensor(key, F32, GlobalTensor(key, F32, sizes, (block,))))
    layout = [(t.name, t.dtype, t.shape) for t in outputs]
    _, entries = build_header(layout)
    data_size = entries[-1].end if entries else 0
    meta = {"format": "pt", **checksum_metadata(entries, DEFAULT_CHUNK_BYTES, None, data_size)}
    header, _ = build_header(layout, meta)
    runs = plan_file_runs(name, outputs, entries)
    return header, runs, data_size


def write_results(plan: SavePlan, file_size: int) -> list[WriteResult]:
    """The WriteResults StreamingWriter.write_data returns (file, key, size, header digest)."""
    name = plan.storage_data
    info = {"file": name, "key": "", "file_size": file_size, "header": digest(name.encode())}
    return [
        WriteResult(
            index=item.index,
            size_in_bytes=item.tensor_storage_size() or 0,
            storage_data={**info, "key": native_storage._item_key(item.index)},
        )
        for item in plan.items
    ]


def global_save_plan(all_plans: list[SavePlan], writer: native_storage.StreamingWriter):
    """DefaultSavePlanner._create_global_plan without its validation, then shardstream's
    ``prepare_global_plan`` (one file name per rank)."""
    deduped = native_storage.dedup_plans(all_plans)  # what LinearCheckSavePlanner runs
    global_plan, metadata = create_default_global_save_plan(deduped)
    merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
    metadata = dataclasses.replace(metadata, planner_data=merged)
    return writer.prepare_global_plan(global_plan), metadata


def manifest_skeleton(world: int, params: list[tuple[str, tuple[int, ...]]], mean_file: int):
    """Every manifest key but ``tensors``: files (3 per rank) and objects, as ``execute_save``."""
    files = {}
    for r in range(world):
        files[native.rank_file(r)] = {"size": mean_file, "header_xxh3": digest(b"r%d" % r)}
        files[f"extra-rank-{r:05d}.json"] = {"size": 7573, "xxh3": digest(b"j%d" % r)}
        files[f"extra-rank-{r:05d}.safetensors"] = {"size": 7888, "header_xxh3": digest(b"%d" % r)}
    group = {
        "amsgrad": False,
        "betas": {"__tuple__": [0.9, 0.95]},
        "capturable": False,
        "decoupled_weight_decay": True,
        "differentiable": False,
        "eps": 1e-08,
        "foreach": None,
        "fused": None,
        "lr": 0.00015,
        "initial_lr": 0.00015,
        "maximize": False,
        "params": [n for n, _ in params],
        "weight_decay": 0.1,
    }
    return {
        "format": native.FORMAT,
        "version": native.FORMAT_VERSION,
        "step": 1000,
        "world_size": world,
        "contents": ["model", "optimizer", "extra"],
        "created_unix": CREATED,
        "torch_version": torch.__version__,
        "tensors": {},
        "files": files,
        "objects": {"optimizer": {"param_groups": [group], "scalars": {}}},
    }


def seal(doc: dict) -> bytes:
    """The bytes ``native.write_manifest`` writes (canonical JSON with its checksum)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return native.canonical({**body, "checksum": digest(native.canonical(body))})


def list_tensors(section: dict) -> dict:
    """The ``tensors`` section in format version 1's encoding: every grid entry spelled out as
    its chunk list (what the manifest held before grid entries)."""
    out = {}
    for fqn, info in section.items():
        if "grid" in info:
            chunks = list(native.grid_chunks(fqn, info["shape"], info["grid"]))
            info = {"dtype": info["dtype"], "shape": info["shape"], "chunks": chunks}
        out[fqn] = info
    return out


# --- load and merge -------------------------------------------------------------------------


def header_stand_ins(directory: Path, plans: list[SavePlan]) -> dict[str, SafetensorsHeader]:
    """The parsed rank-file headers ``open_native`` would hold (this group's tensors only)."""
    headers = {}
    for plan in plans:
        layout = [
            (native_storage._item_key(it.index), F32, tuple(it.tensor_data.chunk.sizes))
            for it in plan.items
        ]
        _, entries = build_header(layout)
        path = str(directory / plan.storage_data)
        size = entries[-1].end if entries else 0
        headers[path] = SafetensorsHeader(path, 4096, 4096 + size, {e.name: e for e in entries})
    return headers


def destination_reads(
    metadata: Metadata, tensors: dict[str, GlobalTensor], world: int, rank: int
) -> tuple[list, int]:
    """DCP's read items for ``rank``'s shards of every tensor (``_create_read_items``)."""
    reads = []
    needed = 0
    for fqn, md in metadata.state_dict_metadata.items():
        t = tensors[fqn]
        e = Entry(fqn, t.shape, bool(t.shape))
        offsets, sizes = local_chunk(e, world, rank)
        needed += math.prod(sizes) * 4
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        reads.append((fqn, sizes, create_read_items_for_chunk_list(fqn, md, [chunk])))
    return reads, needed


def destination_runs(metadata: Metadata, tensors: dict[str, GlobalTensor], reads) -> tuple:
    """``plan_copy`` for every read item, as ``StreamingReader.read_data`` does."""
    runs = overlaps = nbytes = 0
    for fqn, sizes, items in reads:
        strides = tuple(math.prod(sizes[d + 1 :]) for d in range(len(sizes)))
        for req in items:
            src: Block = metadata.storage_data[req.storage_index]
            start = tuple(s + o for s, o in zip(src.start, req.storage_offsets))
            offset = 4 * sum(o * st for o, st in zip(req.dest_offsets, strides))
            dst = Block(f"target:{fqn}", offset, F32, start, tuple(req.lengths), strides)
            planned = plan_copy(fqn, tensors[fqn].shape, src, dst)
            runs += len(planned)
            overlaps += 1
            nbytes += sum(r.src_nbytes for r in planned)
    return runs, overlaps, nbytes


# --- measurement ----------------------------------------------------------------------------


PAUSE_GC = True


def timed(fn: Callable[[], Any], repeat_below: float = 0.05) -> tuple[Any, float]:
    """CPU seconds of ``fn`` (this process; planning is single-threaded, and CPU time is not
    inflated by other load on a shared machine). Under ``repeat_below`` s: best of three.

    With ``PAUSE_GC`` the cyclic garbage collector is paused while ``fn`` runs: a collection
    walks the whole heap and lands in whichever stage crosses a threshold, which makes
    per-stage times lumpy. ``--gc on`` measures them with it, as the real code runs.
    """
    was = gc.isenabled()
    if PAUSE_GC:
        gc.disable()
    else:
        gc.collect()
    try:
        t0 = time.process_time()
        result = fn()
        best = time.process_time() - t0
        if best < repeat_below:
            for _ in range(2):
                t0 = time.process_time()
                fn()
                best = min(best, time.process_time() - t0)
    finally:
        if was:
            gc.enable()
    return result, best


@dataclass
class Stage:
    name: str
    scope: str  # who pays: "rank 0", "every rank", "one process"
    owner: str  # "shardstream", "torch DCP", "reference" (what shardstream no longer runs)
    what: str


STAGES = [
    Stage("save.rank_plan", "every rank", "shardstream", "own write items, header, copy runs"),
    Stage("save.gather_plans", "rank 0", "torch DCP", "unpickle N SavePlans"),
    Stage("save.global_plan", "rank 0", "torch DCP", "dedup + global plan + planner data"),
    Stage("save.validate", "rank 0", "shardstream", "LinearCheckSavePlanner tiling check"),
    Stage("save.gather_results", "rank 0", "torch DCP", "unpickle N lists of WriteResults"),
    Stage("save.manifest_build", "rank 0", "shardstream", "tensor_manifest"),
    Stage("save.manifest_serialize", "rank 0", "shardstream", "canonical JSON x2 + digest"),
    Stage(
        "save.local_plan",
        "rank 0",
        "shardstream",
        "rank-local path: N signatures + N file records + grid manifest",
    ),
    Stage("load.read_manifest", "every rank", "shardstream", "read_manifest"),
    Stage("load.headers", "every rank", "shardstream", "parse the headers of the files it reads"),
    Stage("load.open", "every rank", "shardstream", "_global_tensor for its own regions"),
    Stage("load.read_metadata", "every rank", "shardstream", "StreamingReader.read_metadata"),
    Stage("load.read_items", "every rank", "torch DCP", "create_read_items_for_chunk_list"),
    Stage("load.plan_copy", "every rank", "shardstream", "plan_copy per overlapping chunk"),
    Stage("merge.headers", "one process", "shardstream", "N x parse a rank-file header"),
    Stage("merge.open", "one process", "shardstream", "merge_view: an offset per chunk"),
    Stage("merge.tile_check", "one process", "shardstream", "of which check_blocks_tile"),
    Stage("merge.split_files", "one process", "shardstream", "output_tensors + plan_hf_files"),
    Stage("merge.plan_runs", "one process", "shardstream", "plan_file_runs, all model tensors"),
    Stage("export.rank_plan", "every rank", "shardstream", "hf_model layout + own runs"),
    Stage("reference.dcp_validate", "rank 0", "reference", "DCP _validate_global_plan (not run)"),
]
STAGE = {s.name: s for s in STAGES}
TOTALS = {
    "save, rank 0": [
        "save.rank_plan",
        "save.gather_plans",
        "save.global_plan",
        "save.validate",
        "save.gather_results",
        "save.manifest_build",
        "save.manifest_serialize",
    ],
    "save, rank 0, rank-local path": [
        "save.rank_plan",
        "save.local_plan",
        "save.manifest_serialize",
    ],
    "save, other ranks": ["save.rank_plan"],
    "load, every rank": [
        "load.read_manifest",
        "load.headers",
        "load.open",
        "load.read_metadata",
        "load.read_items",
        "load.plan_copy",
    ],
    "merge, planning": [
        "load.read_manifest",
        "merge.headers",
        "merge.open",
        "merge.split_files",
        "merge.plan_runs",
    ],
}


@dataclass
class Point:
    """Everything measured at one rank count."""

    ranks: int
    dest_ranks: int
    chunks: int = 0
    manifest_bytes: int = 0
    v1_manifest_bytes: int = 0
    tensors_section_bytes: int = 0
    rank_header_bytes: int = 0
    gathered_plan_bytes: int = 0
    gathered_result_bytes: int = 0
    times: dict[str, float] = field(default_factory=dict)
    projected: list[str] = field(default_factory=list)
    load_overlaps: int = 0
    load_runs: int = 0
    load_bytes: int = 0
    merge_runs: int = 0
    merge_files: int = 0
    rank0_bytes_written: int = 0
    mean_bytes_written: int = 0
    memory: dict[str, float] = field(default_factory=dict)
    validate: dict[str, dict] = field(default_factory=dict)
    wall_s: float = 0.0
    tile_share: float = 1.0
    merge_file_share: float = 1.0  # the largest output file's share of the model's bytes
    files: set = field(default_factory=set)  # data files one restoring rank reads

    @property
    def files_read(self) -> int:
        return len(self.files)

    def add(self, stage: str, seconds: float) -> None:
        self.times[stage] = self.times.get(stage, 0.0) + seconds


class Probe:
    """Live Python heap (tracemalloc) after each step, when memory is being measured."""

    def __init__(self, on: bool):
        self.on = on
        self.marks: dict[str, int] = {}
        self.last = 0

    def start(self) -> None:
        if self.on:
            self.last = tracemalloc.get_traced_memory()[0]

    def mark(self, name: str, weight: int) -> None:
        if self.on:
            now = tracemalloc.get_traced_memory()[0]
            self.marks[name] = self.marks.get(name, 0) + (now - self.last) * weight
            self.last = now


def run_group(point: Point, group: Group, mean_file: int, scratch: Path, probe: Probe):
    """Save on rank 0, load on one rank and merge-plan this group's tensors at N ranks; adds
    the weighted times and counts to ``point``; returns the group's share of the manifest's
    ``tensors`` object (bytes inside the braces) in the real and the version-1 encoding."""
    world, dest, w = point.ranks, point.dest_ranks, group.weight
    entries = group.entries
    gdir = scratch / f"n{world}-{group.params[0][0]}"
    gdir.mkdir(parents=True, exist_ok=True)
    writer = native_storage.StreamingWriter(gdir)

    # save: rank 0 receives every rank's plan (pickled by gather_object), plans, validates
    blobs = [pickle.dumps(local_plan(entries, world, r)) for r in range(world)]
    point.gathered_plan_bytes += w * sum(len(b) for b in blobs)
    probe.start()
    all_plans, t = timed(lambda b=blobs: [pickle.loads(x) for x in b], 0)
    del blobs
    point.add("save.gather_plans", t * w)
    probe.mark("save.plans", w)
    (global_plan, metadata), t = timed(lambda p=all_plans: global_save_plan(p, writer), 0)
    point.add("save.global_plan", t * w)
    probe.mark("save.global_plan", w)
    del all_plans

    # save: every rank's WriteResults come back to rank 0, which builds the manifest
    blobs = [pickle.dumps(write_results(p, mean_file)) for p in global_plan]
    point.gathered_result_bytes += w * sum(len(b) for b in blobs)
    probe.start()
    results, t = timed(lambda b=blobs: [pickle.loads(x) for x in b], 0)
    del blobs
    point.add("save.gather_results", t * w)
    probe.mark("save.results", w)
    (section, _), t = timed(lambda m=metadata, r=results: native_storage.tensor_manifest(m, r), 0)
    point.add("save.manifest_build", t * w)
    probe.mark("save.tensors_section", w)
    del results
    doc = {"format": native.FORMAT, "version": native.FORMAT_VERSION, "tensors": section}
    sealed, t = timed(lambda d=doc: seal(d), 0)
    point.add("save.manifest_serialize", t * w)
    body = native.canonical(section)[1:-1]
    listed = list_tensors(section)
    compact = native.canonical(listed)[1:-1]  # version 1: chunk lists
    point.chunks += w * sum(len(v["chunks"]) for v in listed.values())
    del listed
    (gdir / native.MANIFEST).write_bytes(sealed)
    del sealed, doc, section
    headers = header_stand_ins(gdir, global_plan)
    del global_plan, metadata

    # load, one rank of N/reshard: open the checkpoint (manifest, blocks), DCP's read plan
    probe.start()
    loaded, t = timed(lambda: native.read_manifest(gdir), 0)
    point.add("load.read_manifest", t * w)
    probe.mark("load.manifest", w)

    # a merge describes the model tensors only (open_native(model_only=True) -> merge_view):
    # grids as one offset per rank, each header let go once read ("merge.headers" times the
    # parsing; the stand-ins here are parsed already)
    def open_for_merge(headers=headers):
        cache = native._Headers()
        cache.update(headers)
        return native.merge_view(gdir, loaded, cache, {})

    probe.start()
    merged, t = timed(open_for_merge, 0)
    point.add("merge.open", t * w)
    probe.mark("merge.open", w)
    if group.layer is None:  # the tiling check inside it, on this group
        share = point.tile_share
        blocks = [
            (f, t_.shape, t_.blocks)
            for f, t_ in merged.items()
            if "grid" not in loaded["tensors"][f]  # grids tile by construction
        ]
        _, t = timed(lambda: [check_blocks_tile(*b) for b in blocks])
        point.add("merge.tile_check", t * share)

    # restore opens only the regions this rank restores (loading.load -> open_native)
    regions = {}
    for fqn, info in loaded["tensors"].items():
        shape = tuple(info["shape"])
        regions[fqn] = local_chunk(Entry(fqn, shape, bool(shape)), dest, dest // 2)

    def open_lazy(headers=headers):
        return {
            fqn: native._global_tensor(gdir, fqn, info, headers, region=regions[fqn])
            for fqn, info in loaded["tensors"].items()
        }

    probe.start()
    mine, t = timed(open_lazy, 0)
    point.add("load.open", t * w)
    probe.mark("load.open", w)
    del headers
    # Every layer reads the same rank files: its rows sit at the same place in each, and small
    # replicated tensors (the step scalars) all live in the lowest rank's file (dedup_plans).
    point.files |= {Path(b.location).name for t_ in mine.values() for b in t_.blocks}
    reader = native_storage.StreamingReader(mine)
    md, t = timed(reader.read_metadata, 0)
    point.add("load.read_metadata", t * w)
    probe.mark("load.read_metadata", w)
    (reads, needed), t = timed(lambda m=md, o=mine: destination_reads(m, o, dest, dest // 2))
    point.add("load.read_items", t * w)
    (runs, overlaps, nbytes), t = timed(lambda m=md, r=reads, o=mine: destination_runs(m, o, r))
    point.add("load.plan_copy", t * w)
    if nbytes != needed:
        raise AssertionError(f"load plan covers {nbytes} of {needed} bytes at N={world}")
    point.load_runs += w * runs
    point.load_overlaps += w * overlaps
    point.load_bytes += w * nbytes
    del md, reads, reader, mine

    # merge: every model tensor into bf16 output files
    model = [
        GlobalTensor(name[len(native.MODEL_PREFIX) :], t_.dtype, t_.shape, t_.blocks)
        for name, t_ in merged.items()
    ]
    outputs = output_tensors(model, BF16, set(), {})
    probe.start()
    mruns, t = timed(lambda: plan_file_runs("merged.safetensors", outputs))
    point.add("merge.plan_runs", t * w)
    probe.mark("merge.runs", w)  # all files' runs; a merge holds one file's at a time
    if sum(r.dst_nbytes for r in mruns) != sum(o.nbytes for o in outputs):
        raise AssertionError(f"merge runs do not cover the output at N={world}")
    point.merge_runs += w * len(mruns)
    shutil.rmtree(gdir)
    return body, compact


def simulate(
    layout: Layout,
    world: int,
    *,
    reshard: int = 8,
    full: bool = False,
    validate_budget: float = 15.0,
    previous: Point | None = None,
    memory: bool = False,
    scratch: Path,
) -> Point:
    dest = max(1, world // reshard)
    point = Point(world, dest)
    probe = Probe(memory)
    params = layout.params()
    all_entries = state_entries(params)
    total_param_bytes = 12 * layout.numel  # fp32 params + exp_avg + exp_avg_sq

    # save, every rank: rank 0's own plan over every tensor (no dependence on N but through rows)
    def rank_plan():
        plan = local_plan(all_entries, world, 0)
        blob = pickle.dumps(plan)
        mine = pickle.loads(blob)  # the scattered final plan
        header, runs, size = rank_write_plan(mine.items, native.rank_file(0))
        results = write_results(dataclasses.replace(mine, storage_data="rank-00000"), 0)
        return header, runs, size, len(pickle.dumps(results))

    (header0, runs0, data0, _), t = timed(rank_plan)
    point.add("save.rank_plan", t)
    point.rank_header_bytes = len(header0)
    point.rank0_bytes_written = sum(r.dst_nbytes for r in runs0)
    point.mean_bytes_written = total_param_bytes // world
    mean_file = point.mean_bytes_written + len(header0)

    # save, rank 0, on the rank-local path (FSDP2 on a 1-D mesh, formats/local_save.py): agree
    # on the path (N signatures), collect N file records, build the grid manifest
    def local_plan_rank0():
        signature = digest(repr([(e.fqn, list(e.shape)) for e in all_entries]).encode())
        everyone = [signature] * world  # what the gather hands rank 0
        assert all(s == signature for s in everyone)
        files = {
            native.rank_file(r): {"size": mean_file, "header_xxh3": signature} for r in range(world)
        }
        layout_ = [(e.fqn, list(e.shape), F32, world if e.sharded else None) for e in all_entries]
        return files, local_save.manifest_entries(layout_, world)

    _, t = timed(local_plan_rank0)
    point.add("save.local_plan", t)

    # load: every rank parses every rank file's header (open_native); measured on one, times N
    def parse_one():
        parsed = parse_header("rank-00000.safetensors", header0[8:], len(header0) + data0)
        stored_checksums(parsed)
        digest(header0)
        return parsed

    _, header_s = timed(parse_one)
    point.add("merge.headers", header_s * world)
    if memory:
        before = tracemalloc.get_traced_memory()[0]
        keep = parse_one()
        point.memory["header"] = tracemalloc.get_traced_memory()[0] - before
        del keep

    # the manifest skeleton (files, objects) and its load cost
    skeleton = manifest_skeleton(world, params, mean_file)
    skeleton_bytes = seal(skeleton)
    tensors_bytes = 0
    v1_bytes = 0
    skel_dir = scratch / f"skeleton-{world}"
    skel_dir.mkdir(parents=True, exist_ok=True)
    (skel_dir / native.MANIFEST).write_bytes(skeleton_bytes)
    _, t = timed(lambda: native.read_manifest(skel_dir))
    point.add("load.read_manifest", t)

    # merge: the file split over every model tensor (cheap, O(tensors))
    def split_files():
        outs = [GlobalTensor(n, F32, s, ()) for n, s in params]
        return hf.plan_hf_files(output_tensors(outs, BF16, set(), {}), HF_FILE_BYTES)

    files, t = timed(split_files)
    point.add("merge.split_files", t)
    point.merge_files = len(files)
    model_bytes = sum(o.nbytes for _, group in files for o in group)
    point.merge_file_share = max(sum(o.nbytes for o in g) for _, g in files) / model_bytes

    # export (hf_model in training), every rank: layout of every HF file + this rank's runs
    def export_plan():
        runs = []
        for index, (_, tensors) in enumerate(files):
            layout_ = [(o.name, o.dtype, o.shape) for o in tensors]
            _, entries = build_header(layout_)
            size = entries[-1].end if entries else 0
            meta = {"format": "pt", **checksum_metadata(entries, DEFAULT_CHUNK_BYTES, None, size)}
            header, _ = build_header(layout_, meta)
            for o, entry in zip(tensors, entries):
                offsets, sizes = local_chunk(Entry(o.name, o.shape, True), world, 0)
                src = dense_block(f"memory:{o.name}", 0, F32, sizes, offsets)
                dst = dense_block(str(index), len(header) + entry.begin, o.dtype, o.shape)
                runs += plan_copy(o.name, o.shape, src, dst)
        return runs

    _, t = timed(export_plan)
    point.add("export.rank_plan", t)

    # rank 0's DCP validation, per distinct shape (every tensor of a shape costs the same)
    shapes: dict[tuple[int, ...], int] = {}
    for e in all_entries:
        if e.sharded:
            shapes[e.shape] = shapes.get(e.shape, 0) + 1
    for shape, count in shapes.items():
        e = Entry("x", shape, True)
        chunks = []
        for r in range(world):
            offsets, sizes = local_chunk(e, world, r)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        md = Metadata({"x": TensorStorageMetadata(PROPS, torch.Size(shape), chunks)})
        key = "x".join(map(str, shape))
        last = previous.validate.get(key) if previous is not None else None
        guess = None
        if last is not None:
            guess = last["per_tensor_s"] * (world / previous.ranks) ** max(1.0, last["exponent"])
        if guess is not None and guess > validate_budget:
            t, exponent, projected = guess, last["exponent"], True
        else:
            errors, t = timed(lambda md=md: _validate_global_plan([None, None], md))
            assert not errors, errors
            exponent, projected = 1.0, False
            if last is not None and not last["projected"]:
                ratio = max(t, 1e-9) / max(last["per_tensor_s"], 1e-9)
                exponent = math.log(ratio) / math.log(world / previous.ranks)
        point.validate[key] = {
            "per_tensor_s": t,
            "tensors": count,
            "exponent": exponent,
            "projected": projected,
        }
        if projected:
            point.projected.append(key)
        point.add("reference.dcp_validate", t * count)
        # What shardstream runs instead (LinearCheckSavePlanner): blocks + tiling check.
        _, t = timed(
            lambda chunks=chunks, shape=shape: check_blocks_tile(
                "x",
                tuple(shape),
                [dense_block("x", 0, "U8", tuple(c.sizes), tuple(c.offsets)) for c in chunks],
            )
        )
        point.add("save.validate", t * count)

    # the per-chunk pipeline, once per group
    point.tile_share = len(all_entries) / len(groups(layout, full)[0].entries)
    for group in groups(layout, full):
        body, compact = run_group(point, group, mean_file, scratch, probe)
        tensors_bytes += weighted_bytes(group, body) + group.weight  # + a comma each
        v1_bytes += weighted_bytes(group, compact) + group.weight

    point.tensors_section_bytes = tensors_bytes - 1 + 2
    point.add("load.headers", header_s * point.files_read)
    point.manifest_bytes = len(skeleton_bytes) + tensors_bytes - 1
    point.v1_manifest_bytes = len(skeleton_bytes) + v1_bytes - 1
    shutil.rmtree(skel_dir)
    if memory:
        point.memory.update(probe.marks)
    return point


def full_manifest_bytes(layout: Layout, world: int) -> int:
    """The manifest of every tensor at once (no weighting), for checking the extrapolation."""
    entries = state_entries(layout.params())
    writer = native_storage.StreamingWriter("unused")
    plans = [local_plan(entries, world, r) for r in range(world)]
    global_plan, metadata = global_save_plan(plans, writer)
    mean_file = 12 * layout.numel // world
    probe_header = rank_write_plan(plans[0].items, native.rank_file(0))[0]
    mean_file += len(probe_header)
    results = [write_results(p, mean_file) for p in global_plan]
    section, files = native_storage.tensor_manifest(metadata, results)
    doc = manifest_skeleton(world, layout.params(), mean_file)
    doc["tensors"] = section
    return len(seal(doc))


# --- analysis -------------------------------------------------------------------------------


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else 0.0


def verdicts(points: list[Point], fit_min: int, tolerance: float, floor: float) -> list[dict]:
    """Growth exponent of every stage (and of the manifest size) over ranks >= ``fit_min``."""
    out = []
    series: dict[str, tuple[str, str, list[tuple[int, float, bool]]]] = {}
    for s in STAGES:
        series[s.name] = (
            s.owner,
            s.scope,
            [(p.ranks, p.times.get(s.name, 0.0), s.name in _projected(p)) for p in points],
        )
    for total, names in TOTALS.items():
        series[f"total: {total}"] = (
            "all",
            "",
            [
                (p.ranks, sum(p.times.get(n, 0.0) for n in names), bool(_projected(p) & set(names)))
                for p in points
            ],
        )
    series["manifest bytes"] = (
        "shardstream",
        "",
        [(p.ranks, p.manifest_bytes, False) for p in points],
    )
    for name, (owner, scope, values) in series.items():
        fit = [(n, v) for n, v, proj in values if n >= fit_min and not proj]
        verdict = {"name": name, "owner": owner, "scope": scope}
        largest = max((v for _, v in fit), default=0.0)
        if len(fit) < 2:
            verdict.update(exponent=None, status="too few points")
        else:
            b = slope([n for n, _ in fit], [v for _, v in fit])
            (n1, v1), (n2, v2) = fit[-2], fit[-1]
            ratio = (v2 / v1) / (n2 / n1) if v1 > 0 else None
            verdict.update(exponent=round(b, 3), last_step_ratio=ratio)
            if name != "manifest bytes" and largest < floor:
                verdict["status"] = f"ok (under {floor:g} s: not judged)"
            elif b > 1 + tolerance:
                verdict["status"] = "SUPER-LINEAR"
            else:
                verdict["status"] = "ok"
        out.append(verdict)
    return out


def _projected(p: Point) -> set[str]:
    return {"reference.dcp_validate"} if p.projected else set()


# --- reporting ------------------------------------------------------------------------------


def fmt_s(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.1f} h"
    if x >= 60:
        return f"{x / 60:.1f} min"
    if x >= 1:
        return f"{x:.1f} s"
    return f"{x * 1000:.0f} ms"


def fmt_b(x: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if x >= size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


def memory_estimates(mem: Point | None, points: list[Point]) -> None:
    """Scale the heap measured at one rank count to the others (it is linear in chunks)."""
    if mem is None:
        return
    m = mem.memory
    for p in points:
        k = p.chunks / mem.chunks
        plans = (m.get("save.plans", 0) + m.get("save.global_plan", 0)) * k
        manifest = (
            m.get("save.global_plan", 0)
            + m.get("save.results", 0)
            + m.get("save.tensors_section", 0)
        ) * k + 2 * p.manifest_bytes
        p.memory["rank0_save_heap"] = max(plans, manifest)
        # A restoring rank's blocks do not grow with the ranks that saved; its headers do not
        # either beyond the files it reads. Merge (one process) holds every chunk and header.
        manifest_heap = m.get("load.manifest", 0) * p.manifest_bytes / max(1, mem.manifest_bytes)
        p.memory["load_heap_per_rank"] = (
            manifest_heap
            + m.get("load.open", 0)
            + m.get("load.read_metadata", 0)
            + m.get("header", 0) * p.files_read
        )
        # A merge holds one offset per grid chunk, one parsed header at a time, and the copy
        # runs of the output file it is filling (the largest file's share of all runs).
        p.memory["merge_heap"] = (
            manifest_heap
            + m.get("merge.open", 0) * k
            + m.get("header", 0)
            + m.get("merge.runs", 0) * k * p.merge_file_share
        )


def table(points: list[Point]) -> str:
    head = (
        "ranks | chunks | manifest | v1 manifest | v1 per chunk | save: rank 0 | save: other "
        "ranks | load: per rank (N -> N/8) | files read per rank | merge planning "
        "| rank-0 heap (save) | heap per rank (load) | heap (merge)"
    )
    rows = []
    for p in points:
        t = {k: fmt_s(sum(p.times.get(n, 0.0) for n in v)) for k, v in TOTALS.items()}
        rows.append(
            (f"{p.ranks:,}", f"{p.chunks:,}", fmt_b(p.manifest_bytes),
             fmt_b(p.v1_manifest_bytes), f"{p.v1_manifest_bytes / p.chunks:.0f} B",
             t["save, rank 0"], t["save, other ranks"], t["load, every rank"],
             f"{p.files_read:,}", t["merge, planning"],
             *(fmt_b(p.memory.get(k, 0))
               for k in ("rank0_save_heap", "load_heap_per_rank", "merge_heap")))
        )  # fmt: skip
    return "\n".join(md_table(head, "r" * 13, rows))


def stage_table(points: list[Point], found: list[dict]) -> str:
    exps = {v["name"]: v for v in found}
    head = ["stage", "who", "code", *(f"{p.ranks:,}" for p in points), "exponent", "verdict"]
    rows = []
    for s in STAGES:
        cells = []
        for p in points:
            v = p.times.get(s.name, 0.0)
            cells.append(
                ("~" if s.name == "reference.dcp_validate" and p.projected else "") + fmt_s(v)
            )
        v = exps[s.name]
        exp = "" if v.get("exponent") is None else f"{v['exponent']:.2f}"
        rows.append([s.name, s.scope, s.owner, *cells, exp, v["status"]])
    return "\n".join(md_table(head, "lll" + "r" * (len(points) + 1) + "l", rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)))
    ap.add_argument("--vocab", type=int, default=128256, help="128256 (Llama 3) or 32000")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--intermediate", type=int, default=28672)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--reshard", type=int, default=8, help="load at N/reshard ranks (default 8)")
    ap.add_argument(
        "--validate-budget",
        type=float,
        default=15.0,
        help="project DCP validation from the fitted exponent when one tensor "
        "would take longer than this many seconds (default 15)",
    )
    ap.add_argument(
        "--mem-ranks", type=int, default=256, help="rank count of the tracemalloc pass (0: skip)"
    )
    ap.add_argument(
        "--check-ranks",
        type=int,
        default=-1,
        help="build the full manifest at this rank count and compare its size "
        "with the extrapolation (default: the smallest; 0: skip)",
    )
    ap.add_argument("--fit-min-ranks", type=int, default=256)
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.25,
        help="fail when a stage's exponent exceeds 1 + tolerance (default 0.25)",
    )
    ap.add_argument(
        "--floor",
        type=float,
        default=0.05,
        help="stages under this many seconds at every rank count are not judged",
    )
    ap.add_argument(
        "--gate",
        choices=("all", "shardstream"),
        default="all",
        help="which stages fail the run when super-linear (default: all)",
    )
    ap.add_argument(
        "--gc",
        choices=("off", "on"),
        default="off",
        help="time stages with Python's cyclic GC paused (off, default) or running (on)",
    )
    ap.add_argument("--json", default="bench/results/scale_sim.json")
    args = ap.parse_args(argv)
    global PAUSE_GC
    PAUSE_GC = args.gc == "off"
    was = gc.isenabled()
    if PAUSE_GC:
        gc.disable()  # the untimed synthetic inputs build faster too
    try:
        return run(args)
    finally:
        if was:
            gc.enable()


def run(args: argparse.Namespace) -> int:

    ranks = sorted({int(r) for r in args.ranks.split(",")})
    layout = Layout(
        args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads, args.vocab
    )
    print(
        f"layout: {layout.numel / 1e9:.2f} B parameters, {len(layout.params())} parameters, "
        f"{len(state_entries(layout.params()))} saved tensors (model + AdamW); "
        f"ranks {ranks}; load reshards N -> N/{args.reshard}",
        flush=True,
    )
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="scale-sim-"))
    points: list[Point] = []
    check = None
    mem_point = None
    try:
        previous = None
        for n in ranks:
            t0 = time.perf_counter()
            p = simulate(
                layout,
                n,
                reshard=args.reshard,
                validate_budget=args.validate_budget,
                previous=previous,
                scratch=scratch,
            )
            p.wall_s = time.perf_counter() - t0
            points.append(p)
            previous = p
            print(
                f"N={n:>5}: {p.chunks:>10,} chunks, manifest {fmt_b(p.manifest_bytes):>10}, "
                f"simulated in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        check_ranks = ranks[0] if args.check_ranks < 0 else args.check_ranks
        if check_ranks:
            exact = full_manifest_bytes(layout, check_ranks)
            known = {p.ranks: p for p in points}
            sampled = known.get(check_ranks) or simulate(
                layout, check_ranks, reshard=args.reshard, scratch=scratch
            )
            check = {"ranks": check_ranks, "full": exact, "extrapolated": sampled.manifest_bytes}
            same = "identical" if exact == sampled.manifest_bytes else "DIFFERENT"
            print(
                f"check at N={check_ranks}: manifest of every tensor {exact:,} B, "
                f"extrapolated from the groups {sampled.manifest_bytes:,} B ({same})",
                flush=True,
            )
        if args.mem_ranks:
            tracemalloc.start()
            try:
                mem_point = simulate(
                    layout,
                    args.mem_ranks,
                    reshard=args.reshard,
                    memory=True,
                    validate_budget=0.0,
                    previous=points[0],
                    scratch=scratch,
                )
            finally:
                tracemalloc.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    memory_estimates(mem_point, points)
    found = verdicts(points, args.fit_min_ranks, args.tolerance, args.floor)
    print()
    print(table(points))
    print()
    print(stage_table(points, found))
    print()
    failed = []
    for v in found:
        if not v["name"].startswith(("total", "manifest")) and v["status"] != "SUPER-LINEAR":
            continue
        exp = "n/a" if v.get("exponent") is None else f"{v['exponent']:.2f}"
        print(f"  {v['name']:<32} exponent {exp:>5}  {v['status']}")
        gate = v["owner"] != "reference" and (args.gate == "all" or v["owner"] == "shardstream")
        if v["status"] == "SUPER-LINEAR" and gate:
            failed.append(v["name"])
    for p in points:
        if p.manifest_bytes > native.MAX_MANIFEST_BYTES:
            print(
                f"!!! N={p.ranks}: the manifest ({fmt_b(p.manifest_bytes)}) exceeds "
                f"native.MAX_MANIFEST_BYTES ({fmt_b(native.MAX_MANIFEST_BYTES)}); "
                "read_manifest would refuse to open this checkpoint"
            )
    if any(p.projected for p in points):
        print("~ projected from the fitted exponent (over --validate-budget), not measured")
    out = {
        "layout": dataclasses.asdict(layout),
        "parameters": layout.numel,
        "ranks": ranks,
        "reshard": args.reshard,
        "buffer_bytes": DEFAULT_BUFFER_BYTES,
        "check": check,
        "points": [dataclasses.asdict(p) for p in points],
        "memory_pass_ranks": args.mem_ranks,
        "memory_pass": dataclasses.asdict(mem_point) if mem_point else None,
        "verdicts": found,
        "failed": failed,
        "wall_s": time.perf_counter() - started,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\nwall {time.perf_counter() - started:.0f} s; results in {args.json}")
    if check and check["full"] != check["extrapolated"]:
        print("!!! the extrapolated manifest size differs from the full build")
        return 1
    if failed:
        print(f"!!! super-linear: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

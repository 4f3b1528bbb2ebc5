"""Rank functions for test_fsdp1_shards: FSDP1 (verl's ``strategy: fsdp``) on a CPU mesh."""

from __future__ import annotations

from pathlib import Path

import torch

from shardstream.training import fsdp1_shards
from shardstream.training import state as st

from .workers import build, full_state, train_step


def fsdp1_model(
    world: int, seed: int, use_orig_params: bool, tie: bool = False, strategy: str = "FULL_SHARD"
):
    """The tiny Qwen2 with one FSDP1 unit per decoder layer inside a root unit; a hybrid
    ``strategy`` shards over pairs of ranks, which the other pairs replicate."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model, _, _, config = build(None, seed=seed, tie=tie)
    layer = type(model.model.layers[0])
    hybrid = "HYBRID" in strategy
    model = FullyShardedDataParallel(
        model,
        device_mesh=init_device_mesh("cpu", (world // 2, 2) if hybrid else (world,)),
        device_id=torch.device("cpu"),
        sharding_strategy=getattr(ShardingStrategy, strategy),
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({layer}),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler, config


def fsdp1_flat(world: int, seed: int):
    """verl's default FSDP1 wrapping (``use_orig_params=False``), for ``workers.async_run``."""
    return fsdp1_model(world, seed, use_orig_params=False)


def _storage_ranges(model) -> list[tuple[int, int]]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    ranges = []
    for module in FullyShardedDataParallel.fsdp_modules(model):
        if module._handle is not None:
            flat = module._handle.flat_param
            local = getattr(flat, "_local_shard", flat)  # before the first forward: itself
            start = local.data_ptr()
            ranges.append((start, start + local.numel() * local.element_size()))
    return ranges


def _is_view_of(view: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    lo = view.data_ptr()
    hi = lo + view.numel() * view.element_size()
    return any(a <= lo and hi <= b for a, b in ranges)


def _save_step_2(root: str, model, optimizer, scheduler, config) -> None:
    """Model, optimizer, extra and hf_model as step 2 in ``root/ckpt``."""
    import shardstream

    shardstream.save(
        Path(root) / "ckpt",
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        contents=("model", "optimizer", "extra", "hf_model"),
        step=2,
        hf_config=config,
    )


def save_run(rank: int, world: int, root: str, use_orig_params: bool, tie: bool) -> dict:
    """Two steps, then a save through the flat shards (model, optimizer, hf_model); rank 0
    writes the full state as the reference. Returns what the flat-shard path presented."""

    model, optimizer, scheduler, config = fsdp1_model(world, 0, use_orig_params, tie)
    for step in (1, 2):
        train_step(model, optimizer, scheduler, step)
    fresh = fsdp1_model(world, 5, use_orig_params, tie)[0]  # no forward yet: no lazy init
    fresh_shards = fsdp1_shards.layout(fresh).model_tensors(fresh)
    fresh_views = fresh_shards is not None and all(
        _is_view_of(v, _storage_ranges(fresh))
        for t in fresh_shards.values()
        if hasattr(t, "pieces")
        for _, v in t.pieces
    )
    layout = fsdp1_shards.layout(model)
    shards = layout.model_tensors(model)
    optim = layout.optimizer_tensors(optimizer)
    torch_model = st.model_tensors(model)
    torch_optim, torch_objects = st.optimizer_state(model, optimizer)
    ranges = _storage_ranges(model)
    pieces = [
        view
        for value in (*shards.values(), *optim[0].values())
        if isinstance(value, fsdp1_shards.FlatShard)
        for _, view in value.pieces
    ]
    model_pieces = [v for t in shards.values() if hasattr(t, "pieces") for _, v in t.pieces]
    _save_step_2(root, model, optimizer, scheduler, config)
    reference = full_state(model, optimizer, scheduler)
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")
    groups = lambda objects: [sorted(g["params"]) for g in objects["param_groups"]]  # noqa: E731
    return {
        "model_keys": (sorted(shards), sorted(torch_model)),
        "optim_keys": (sorted(optim[0]), sorted(torch_optim)),
        "groups": (groups(optim[1]), groups(torch_objects)),
        "model_views": all(_is_view_of(v, ranges) for v in model_pieces),
        "fresh_views": fresh_views,
        "pieces": len(pieces),
    }


def save_replicated_run(rank: int, world: int, root: str, strategy: str, orig: bool) -> dict:
    """Two steps under a replicating ``strategy``, then a save (model, optimizer, hf_model);
    rank 0 writes the full state as the reference. Returns whether the flat-shard path took
    the model and what this rank presented for saving."""

    model, optimizer, scheduler, config = fsdp1_model(world, 0, orig, strategy=strategy)
    for step in (1, 2):
        train_step(model, optimizer, scheduler, step)
    layout = fsdp1_shards.layout(model)
    presented = [
        t
        for part in (layout.model_tensors(model), layout.optimizer_tensors(optimizer)[0])
        for t in part.values()
        if isinstance(t, fsdp1_shards.FlatShard)
    ]
    _save_step_2(root, model, optimizer, scheduler, config)
    reference = full_state(model, optimizer, scheduler)  # collective: on every rank
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")
    return {"writes": layout.writes, "boxes": sum(len(t.pieces) for t in presented)}


def load_run(rank: int, world: int, path: str, kind: str, tie: bool) -> dict:
    """A fresh model (another seed, one step taken) restores ``path``: ``kind`` "fsdp1" or
    "fsdp2" at this world size; "fsdp1-fresh" before any step (as verl resumes)."""
    import shardstream

    if kind.startswith("fsdp1-hybrid"):
        model, optimizer, scheduler, _ = fsdp1_model(world, 123, True, tie, "HYBRID_SHARD")
    elif kind.startswith("fsdp1"):
        model, optimizer, scheduler, _ = fsdp1_model(world, 123, False, tie)
    else:
        model, optimizer, scheduler, _ = build((world,), seed=123, tie=tie)
    if kind != "fsdp1-fresh":  # fresh: no step yet, no optimizer state (a resume)
        train_step(model, optimizer, scheduler, 1)
    shardstream.load(path, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    return full_state(model, optimizer, scheduler)

"""Training scenarios run on several real processes (FSDP2 over gloo) by the integration tests."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from shardstream import CheckpointConfig, CheckpointManager
from shardstream.formats import verl
from shardstream.testing.compare import (
    assert_nested_equal,  # noqa: F401  (tests use it here)
    clone_nested,
)
from shardstream.testing.gathered import full_state_dicts
from shardstream.testing.tiny_models import build_tiny_model, tiny_config

FULL = StateDictOptions(full_state_dict=True)


def build(mesh_shape: tuple[int, ...] | None, seed: int = 0, tie: bool = False):
    """A tiny Qwen2 (uneven dims), FSDP2-sharded on ``mesh_shape`` (None: plain module)."""
    config = tiny_config("qwen2", tie_word_embeddings=tie)
    model = build_tiny_model(config, seed=seed)
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        names = ("fsdp",) if len(mesh_shape) == 1 else ("ddp", "fsdp")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler, config


def batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 101, (2, 12), generator=generator)


def train_step(model, optimizer, scheduler, step: int) -> float:
    ids = batch(step)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return float(loss.detach())


def full_state(model, optimizer, scheduler) -> dict:
    """Everything that must survive a checkpoint, gathered in full (test-side reference only)."""
    model_sd, optim_sd = full_state_dicts(model, optimizer)  # cloned: no live tensor aliased
    return {"model": model_sd, "optim": optim_sd, "scheduler": clone_nested(scheduler.state_dict())}


def _world_mesh(world: int, layout: str) -> tuple[int, ...] | None:
    """``layout``: "fsdp" (1-D mesh), "hsdp" (2 x world/2 mesh) or "plain" (no sharding)."""
    return {"plain": None, "fsdp": (world,), "hsdp": (2, world // 2)}[layout]


def save_run(
    rank: int, world: int, root: str, layout: str, steps: int, extra_steps: int, contents: tuple
) -> dict:
    """Train ``steps`` steps saving each (keep_last=2), then record ``extra_steps`` more losses."""
    model, optimizer, scheduler, config = build(_world_mesh(world, layout))
    cfg = CheckpointConfig(directory=root, save_contents=contents, save_interval=1, keep_last=2)
    manager = CheckpointManager(
        cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, hf_config=config
    )
    losses = []
    for step in range(1, steps + 1):
        losses.append(train_step(model, optimizer, scheduler, step))
        manager.maybe_save(
            step, extra={"data": {"epoch": 1, "offset": step * 7}, "rank_seen": rank}
        )
    reference = full_state(model, optimizer, scheduler)
    reference["rng_next"] = torch.rand(3)  # what restore must reproduce on this rank
    after = [
        train_step(model, optimizer, scheduler, s)
        for s in range(steps + 1, steps + 1 + extra_steps)
    ]
    manager.close()
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")
    return {"losses": losses, "after": after, "steps": manager.all_steps()}


def restore_run(
    rank: int,
    world: int,
    root: str,
    layout: str,
    first_step: int,
    extra_steps: int,
    load_contents: tuple,
    path: str | None = None,
    tie: bool = False,
) -> dict:
    """Restore into a freshly built (differently seeded) model, compare, continue training."""
    model, optimizer, scheduler, _ = build(_world_mesh(world, layout), seed=123, tie=tie)
    cfg = CheckpointConfig(directory=root, load_contents=load_contents)
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    restored = manager.restore(path=path)
    state = full_state(model, optimizer, scheduler)
    rng_next = torch.rand(3)
    after = [
        train_step(model, optimizer, scheduler, s)
        for s in range(first_step, first_step + extra_steps)
    ]
    manager.close()
    return {
        "restored": restored,
        "state": state,
        "rng_next": rng_next,
        "after": after,
        "rank": rank,
        "world": dist.get_world_size(),
    }


def _fsdp2(world: int, seed: int):
    return build((world,), seed=seed)


def async_run(
    rank: int,
    world: int,
    root: str,
    steps: int,
    budget: str,
    hf_model: str | None = None,
    builder=_fsdp2,
) -> dict:
    """Train with async saves at every step; then restore each step and compare with the
    state the model had when that save was requested. Reads of live tensors are slowed down
    so that every optimizer step meets a save still in flight. ``hf_model``: "export" adds
    hf_model to the contents, "shared" also sets ``share_hf_weights``. ``builder(world,
    seed)``: the model, optimizer, scheduler and config (FSDP2 by default)."""
    import time as _time

    from shardstream.engine import endpoints as engine

    original = engine.TensorEndpoint.read_into

    def slow_read(self, offset, out):
        _time.sleep(0.002)
        return original(self, offset, out)

    engine.TensorEndpoint.read_into = slow_read
    model, optimizer, scheduler, config = builder(world, 0)
    contents = ("model", "optimizer", "extra") + (("hf_model",) if hf_model else ())
    cfg = CheckpointConfig(
        directory=root,
        save_contents=contents,
        save_interval=1,
        async_save=True,
        staging_budget=budget,
        share_hf_weights=hf_model == "shared",
    )
    manager = CheckpointManager(
        cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler, hf_config=config
    )
    expected = {}
    for step in range(1, steps + 1):
        train_step(model, optimizer, scheduler, step)
        manager.maybe_save(step, extra={"step": step})
        expected[step] = full_state(model, optimizer, scheduler)
    manager.wait()
    engine.TensorEndpoint.read_into = original
    stalls = list(manager._async.stalls)
    manager.close()
    fresh, fresh_opt, fresh_sched, _ = builder(world, 7)
    checker = CheckpointManager(
        CheckpointConfig(directory=root),
        model=fresh,
        optimizer=fresh_opt,
        lr_scheduler=fresh_sched,
    )
    restored = {}
    for step in checker.all_steps():
        assert checker.restore(step=step) == (step, {"step": step})
        restored[step] = full_state(fresh, fresh_opt, fresh_sched)
    checker.close()
    return {"expected": expected, "restored": restored, "stalls": stalls}


def async_hf_only_run(rank: int, world: int, root: str, steps: int) -> dict:
    """Async saves of hf_model alone, each followed at once by a training step: the export
    runs beside forward, backward and the optimizer step. Returns the model at each save."""
    model, optimizer, scheduler, config = build((world,))
    cfg = CheckpointConfig(
        directory=root, save_contents=("hf_model",), async_save=True, staging_budget="2MiB"
    )
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, hf_config=config)
    expected = {}
    for step in range(1, steps + 1):
        expected[step] = full_state(model, optimizer, scheduler)["model"]
        manager.save(step)
        train_step(model, optimizer, scheduler, step)
    manager.close()
    return {"expected": expected}


def verl_restore_run(rank: int, world: int, actor: str, contents: tuple) -> dict:
    """Restore a verl checkpoint (saved at another world size) through the manager."""
    model, optimizer, scheduler, _ = build((world,), seed=99)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    root = str(Path(actor).parent.parent / f"shardstream-{world}")
    cfg = CheckpointConfig(directory=root, load_contents=contents)
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    with counting_calls(verl, "load_layout") as parsed:
        restored = manager.restore(path=actor)
    state = full_state(model, optimizer, scheduler)
    rng_next = torch.rand(2)
    manager.close()
    return {"restored": restored, "state": state, "rng_next": rng_next, "parsed": parsed}


def verl_directory_run(rank: int, world: int, root: str) -> dict:
    """A manager pointed at verl's run directory (a one-word tool swap keeps verl's
    default_local_dir): what restore() and save() do beside verl's checkpoints, on each rank."""
    from shardstream.errors import ShardstreamError

    model, optimizer, scheduler, _ = build((world,), seed=99)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    cfg = CheckpointConfig(directory=root, keep_last=1)
    out = {}
    with CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler) as mgr:
        for what, call in (
            ("restore", mgr.restore),
            ("resume", lambda: mgr.restore(path=f"{root}/global_step_2/actor")),
            ("save_2", lambda: mgr.save(2)),
            ("save_3", lambda: mgr.save(3)),
        ):
            try:
                out[what] = call()
            except ShardstreamError as exc:
                out[what] = f"{type(exc).__name__}: {exc}"
        out["steps"] = mgr.all_steps()
    # verl's resume keys: resume_from_path names the step directory, its actor/ is read.
    for mode in ("resume_path", "disable"):
        keys = {"resume_mode": mode, "resume_from_path": f"{root}/global_step_2"}
        cfg = CheckpointConfig.from_dict({"save_freq": 1, **keys}, directory=f"{root}/elsewhere")
        model, optimizer, scheduler, _ = build((world,), seed=7)
        with CheckpointManager(cfg, model=model, optimizer=optimizer) as mgr:
            out[mode] = mgr.restore()
            out[f"{mode}_weights"] = full_state(model, optimizer, scheduler)["model"]
    return out


@contextlib.contextmanager
def counting_calls(module, name: str):
    """The file names ``module.name(path, ...)`` is called with, while the block runs."""
    calls: list[str] = []
    original = getattr(module, name)

    def counting(file, *args, **kwargs):
        calls.append(Path(file).name)
        return original(file, *args, **kwargs)

    setattr(module, name, counting)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def dcp_restore_run(rank: int, world: int, root: str, stage: str) -> dict:
    """stage "save": dcp.save a model-only state dict at this world size; stage "restore":
    restore it through the manager into a differently seeded model at this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, optimizer, scheduler, _ = build((world,), seed=0 if stage == "save" else 5)
    if stage == "save":
        train_step(model, optimizer, scheduler, 1)
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{root}/dcp")
        return full_state(model, optimizer, scheduler)["model"]
    cfg = CheckpointConfig(directory=f"{root}/run-{world}", load_contents=("model",))
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer)
    manager.restore(path=f"{root}/dcp")
    manager.close()
    return full_state(model, optimizer, scheduler)["model"]


def hf_export_run(
    rank: int,
    world: int,
    root: str,
    shared: bool | None,
    tie: bool,
    async_save: bool = False,
    share_weights: bool = False,
) -> dict:
    """Save hf_model from FSDP2 ranks; return the unsharded model's state for comparison."""
    model, optimizer, scheduler, config = build((world,), tie=tie)
    train_step(model, optimizer, scheduler, 1)
    cfg = CheckpointConfig(
        directory=root,
        save_contents=("model", "hf_model"),
        shared_filesystem=shared,
        async_save=async_save,
        share_hf_weights=share_weights,
    )
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, hf_config=config)
    manager.save(1)
    manager.close()
    full = full_state(model, optimizer, scheduler)["model"]
    return {"full": full}


def hf_export_untied_by_hand_run(rank: int, world: int, root: str) -> dict:
    """A model whose config ties the head, untied by hand before sharding (its head a
    Parameter of its own, trained apart): hf_model must write the head, as save_pretrained
    does for a model that holds it apart."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = tiny_config("qwen2", tie_word_embeddings=True)
    model = build_tiny_model(config, seed=0)
    embedding = model.get_input_embeddings().weight
    model.lm_head.weight = torch.nn.Parameter(embedding.detach().clone() * 1.5)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    train_step(model, optimizer, scheduler, 1)
    cfg = CheckpointConfig(directory=root, save_contents=("model", "hf_model"))
    with CheckpointManager(cfg, model=model, optimizer=optimizer, hf_config=config) as manager:
        manager.save(1)
    return {"full": get_model_state_dict(model, options=FULL)}


def hf_export_config_differs_run(
    rank: int, world: int, root: str, same_bytes: bool = False
) -> dict:
    """Rank 1's model config names another dtype than rank 0's (as after a tool that changes
    it on rank 0 only): the hf_model save must fail on every rank, naming the cause. With
    ``same_bytes``, rank 0's names the weights' own dtype where rank 1's names none, as a
    ``save_pretrained`` on rank 0 alone leaves them: the files are the same, and it saves.
    Returns the error, and the full model state (to compare the export with)."""
    import copy

    model, optimizer, _, config = build((world,), tie=False)
    config = copy.deepcopy(config)
    if same_bytes:
        config.dtype = torch.float32 if rank == 0 else None
    elif rank == 1:
        config.dtype = "bfloat16" if str(config.dtype) != "torch.bfloat16" else "float32"
    cfg = CheckpointConfig(directory=root, save_contents=("model", "hf_model"))
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, hf_config=config)
    try:
        manager.save(1)
    except Exception as exc:  # noqa: BLE001 - the test reads what every rank saw
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        manager.close()
    return {"error": None, "model": full_state(model, optimizer, _)["model"]}


def shared_hf_save_run(
    rank: int, world: int, root: str, layout: str, tie: bool, hf_dtype: str | None
) -> dict:
    """Train two steps, then save model, optimizer, extra and hf_model with
    ``share_hf_weights``; the reference state goes to ``root/reference.pt``."""
    model, optimizer, scheduler, config = build(_world_mesh(world, layout), tie=tie)
    for step in (1, 2):
        train_step(model, optimizer, scheduler, step)
    cfg = CheckpointConfig(
        directory=root,
        save_contents=("model", "optimizer", "extra", "hf_model"),
        share_hf_weights=True,
    )
    manager = CheckpointManager(
        cfg,
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        hf_config=config,
        hf_dtype=hf_dtype,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(2, extra={"data": {"epoch": 1, "offset": 14}})
    manager.close()
    reference = full_state(model, optimizer, scheduler)
    reference["rng_next"] = torch.rand(3)
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")
    after = [train_step(model, optimizer, scheduler, 3)]
    return {"after": after, "warnings": [str(w.message) for w in caught]}


def dcp_train_state_run(
    rank: int, world: int, root: str, stage: str, flatten: bool, model_keys: str = "api"
) -> dict:
    """stage "save": two steps, then ``dcp.save`` of a torchtitan-style train state (model,
    optimizer, scheduler, train_state) to ``root/step-2``; stage "restore": restore all of it
    through the manager at this world size. Both return the full state and the next loss.
    ``model_keys``: the model's state as torch's state-dict API names it ("api"), as a
    ``torch.compile``d model's own ``state_dict()`` does ("compiled": ``_orig_mod.*``), or as
    DDP's does ("ddp": ``module.*``), or at the top level beside the flattened optimizer's
    ``state.*``/``param_groups.*`` keys ("beside": ``dcp.save({**model_sd, **optim_sd})``)."""
    import torch.distributed.checkpoint as dcp

    model, optimizer, scheduler, _ = build((world,), seed=0 if stage == "save" else 5)
    path = f"{root}/step-2"
    restored = None
    if stage == "save":
        for step in (1, 2):
            train_step(model, optimizer, scheduler, step)
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        model_state = get_model_state_dict(model)
        if model_keys == "compiled":
            model_state = torch.compile(model, backend="eager").state_dict()
            assert all(k.startswith("_orig_mod.") for k in model_state)
        elif model_keys == "ddp":
            model_state = {f"module.{k}": v for k, v in model_state.items()}
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
        if model_keys == "beside":
            assert flatten
            state = {**model_state, **optimizer_state}
        state.update(lr_scheduler=scheduler.state_dict(), train_state={"step": 2})
        dcp.save(state, checkpoint_id=path)
    else:
        cfg = CheckpointConfig(directory=f"{root}/run-{world}")
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        restored = manager.restore(path=path)
        manager.close()
    reference = full_state(model, optimizer, scheduler)
    return {
        "state": reference,
        "next": train_step(model, optimizer, scheduler, 3),
        "step": restored,
    }


def planning_paths_run(rank: int, world: int, root: str, layout: str) -> dict:
    """Save one trained state twice: as shardstream plans it, and forced through DCP's global
    planner. Returns (rank 0) both manifests and which path each save took."""
    import json

    from torch.distributed import checkpoint as dcp

    from shardstream import save
    from shardstream.formats import native
    from shardstream.training import save as saving

    model, optimizer, scheduler, _ = build(_world_mesh(world, layout))
    train_step(model, optimizer, scheduler, 0)
    calls = []
    real_save = dcp.save

    def counting_save(*args, **kwargs):
        calls.append(1)
        return real_save(*args, **kwargs)

    saving.dcp.save = counting_save
    out = {}
    try:
        save(Path(root) / "planned", model=model, optimizer=optimizer, step=1)
        out["planned_used_dcp"] = bool(calls)
        real_plan, saving._rank_local_plan = saving._rank_local_plan, lambda tensors: None
        try:
            save(Path(root) / "dcp", model=model, optimizer=optimizer, step=1)
        finally:
            saving._rank_local_plan = real_plan
    finally:
        saving.dcp.save = real_save
    if rank == 0:
        for name in ("planned", "dcp"):
            out[name] = json.loads((Path(root) / name / native.MANIFEST).read_text())
    return out


def lora_only_run(rank: int, world: int, root: str, stage: str, seed: int) -> dict:
    """A LoRA model (PEFT's key names) on FSDP2: stage "save" trains a step and saves with
    ``save_lora_only``; "restore" restores into a model built from ``seed``; "fresh" only
    builds it."""
    from shardstream.testing.tiny_models import add_lora

    torch.manual_seed(seed)
    model = add_lora(build_tiny_model(tiny_config("qwen2"), seed=seed))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    cfg = CheckpointConfig(directory=root, save_lora_only=True)
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer)
    if stage == "save":
        ids = batch(1)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save(1)
    elif stage == "restore":
        manager.restore()
    manager.close()
    return {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def shared_open_run(rank: int, world: int, path: str) -> dict:
    """Open a checkpoint for a merge with the rank files' headers split over the group (as
    ``merge --distributed`` does); report which files this process parsed and what it learned
    (or the error it raised)."""
    from shardstream.formats import native
    from shardstream.formats import source as sources

    is_native = Path(path, "manifest.json").exists()
    target = (native, "read_header_bytes") if is_native else (verl, "load_layout")
    with counting_calls(*target) as parsed:
        try:
            checkpoint = sources.open_checkpoint(path, model_only=True, shared=True)
        except Exception as exc:  # noqa: BLE001  (the test compares the errors of every rank)
            return {"parsed": parsed, "error": f"{type(exc).__name__}: {exc}"}
    return {"parsed": parsed, **opened(checkpoint)}


def opened(checkpoint) -> dict:
    """What a merge learns from opening a checkpoint, as comparable plain data."""
    return {
        "tensors": [(t.name, t.dtype, t.shape, list(t.blocks)) for t in checkpoint.tensors],
        "replicas": {n: list(b) for n, b in getattr(checkpoint, "replicas", {}).items()},
        "digests": getattr(checkpoint, "digests", {}),
    }


def verl_restore_error_run(rank: int, world: int, actors: list[str]) -> str:
    """Restore from ``actors[rank]``; return the error message this rank got."""
    model, optimizer, _, _ = build((world,), seed=99)
    cfg = CheckpointConfig(directory=str(Path(actors[rank]).parent / f"run-{rank}"))
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer)
    try:
        manager.restore(path=actors[rank])
    except Exception as exc:  # noqa: BLE001  (the test reads every rank's message)
        return f"{type(exc).__name__}: {exc}"
    finally:
        manager.close()
    return "restored"


def merge_hashing_run(rank: int, world: int, actor: str, target: str) -> dict:
    """Merge ``actor`` split over the group; report the bytes this process fed to CRC-32 (the
    checks of verl's zip records), and the error it raised if any."""
    from shardstream.commands.merge import merge
    from shardstream.engine import checksum

    hashed = [0]
    original = checksum.Crc32.update

    def counting(self, data) -> None:
        hashed[0] += memoryview(data).nbytes
        original(self, data)

    checksum.Crc32.update = counting
    try:
        merge(actor, target)
    except Exception as exc:  # noqa: BLE001  (the test compares every process's error)
        return {"hashed": hashed[0], "error": f"{type(exc).__name__}: {exc}"}
    finally:
        checksum.Crc32.update = original
    return {"hashed": hashed[0], "error": None}


def frozen_params_run(
    rank: int, world: int, root: str, stage: str, in_optimizer: bool, ignore: bool
) -> dict:
    """A Qwen2 whose embedding is frozen, as a fine-tune freezes a tower. stage "save": two
    steps, then ``dcp.save`` of model and optimizer state with torch's
    ``ignore_frozen_params=True`` (no embedding saved); stage "restore": restore that into a
    differently seeded model whose frozen embedding is the saving run's (a fine-tune loads it
    from the same pretrained weights), with ``ignore_frozen_params`` as given. Returns the full
    state and the next loss, or the error's message."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, _, _, _ = build((world,), seed=0 if stage == "save" else 5)
    frozen = model.model.embed_tokens.weight
    if stage == "restore":  # the saving run's (seed 0) embedding: what it never changed
        from torch.distributed.tensor import distribute_tensor

        pretrained = build_tiny_model(tiny_config("qwen2"), seed=0).model.embed_tokens.weight
        with torch.no_grad():
            frozen.copy_(
                distribute_tensor(pretrained.detach(), frozen.device_mesh, frozen.placements)
            )
    frozen.requires_grad_(False)
    params = (
        model.parameters() if in_optimizer else [p for p in model.parameters() if p.requires_grad]
    )
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    path = f"{root}/step-2"
    if stage == "save":
        for step in (1, 2):
            train_step(model, optimizer, scheduler, step)
        options = StateDictOptions(ignore_frozen_params=True)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        assert not any("embed_tokens" in k for k in model_state)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    else:
        cfg = CheckpointConfig(
            directory=f"{root}/run-{world}", load_contents=("model", "optimizer")
        )
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer)
        try:
            manager.restore(path=path, ignore_frozen_params=ignore)
        except Exception as exc:  # noqa: BLE001  (the test reads the message)
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            manager.close()
    return {
        "state": full_state(model, optimizer, scheduler),
        "next": train_step(model, optimizer, scheduler, 3),
    }

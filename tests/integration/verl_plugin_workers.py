"""Rank functions for test_verl_plugin.py: verl's checkpoint-manager calls, as verl's FSDP
engine makes them, on FSDP2 over gloo."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from shardstream.testing.tiny_models import (
    add_lora,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_config,
)

from .workers import FULL, batch, build, full_state, train_step

CONTENTS = ["model", "optimizer", "extra"]


def _engine_class():
    """The class verl's FSDP engine module builds, once ``import verl`` loaded the plug-in."""
    os.environ["SHARDSTREAM_VERL"] = "1"
    import verl  # noqa: F401  (loads the verl.plugins entry points)
    from verl.workers.engine.fsdp import transformer_impl

    from shardstream.integrations import verl_plugin
    from shardstream.integrations.verl import FSDPCheckpointManager

    found = transformer_impl.FSDPCheckpointManager
    assert found is FSDPCheckpointManager, found
    return transformer_impl.FSDPCheckpointManager, verl_plugin.original()


def _manager(cls, model, optimizer, scheduler, config, tokenizer=None):
    # the keywords verl's FSDPEngine.initialize passes
    return cls(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        processing_class=tokenizer,
        checkpoint_config=config,
        trust_remote_code=False,
    )


def _actor(root: str, step: int) -> str:
    return str(Path(root) / f"global_step_{step}" / "actor")


def save_run(rank: int, world: int, root: str, verl_root: str) -> dict:
    """Three steps saved through the plug-in (hf_model too, max_ckpt_to_keep=2) beside a
    step 0 of verl's own manager; the last state also saved by verl's manager into
    ``verl_root``. Rank 0 writes the reference state."""
    ours, verls = _engine_class()  # first: the variable is set before verl is imported
    from verl.trainer.config import CheckpointConfig

    model, optimizer, scheduler, _ = build((world,))
    tokenizer = build_tiny_tokenizer()
    plain = CheckpointConfig(save_contents=CONTENTS, load_contents=CONTENTS)
    verl_manager = _manager(verls, model, optimizer, scheduler, plain, tokenizer)
    verl_manager.save_checkpoint(_actor(root, 0), None, 0, max_ckpt_to_keep=None)
    config = CheckpointConfig(save_contents=[*CONTENTS, "hf_model"], load_contents=CONTENTS)
    manager = _manager(ours, model, optimizer, scheduler, config, tokenizer)
    for step in (1, 2, 3):
        train_step(model, optimizer, scheduler, step)
        manager.save_checkpoint(_actor(root, step), None, step, max_ckpt_to_keep=2)
    previous = list(manager.previous_saved_paths)  # as save_checkpoint left it
    gone_at_once = not Path(_actor(root, 1)).exists()
    manager.wait()  # retention's background deletion ends (the ranks skip interpreter exit)
    verl_manager.save_checkpoint(_actor(verl_root, 3), None, 3)
    reference = full_state(model, optimizer, scheduler)
    reference["rng_next"] = torch.rand(3)
    torch.save(reference, Path(root) / f"reference_rank{rank}.pt")
    return {"previous": previous, "gone_at_once": gone_at_once, "rank": manager.rank}


def load_run(rank: int, world: int, actors: list[str], mesh: bool, use_verl: bool) -> list:
    """A fresh, differently seeded model loads each of ``actors``; returns each state and the
    RNG stream after it."""
    if use_verl:
        cls, _ = _engine_class()
        from verl.trainer.config import CheckpointConfig

        config = CheckpointConfig(save_contents=CONTENTS, load_contents=CONTENTS)
    else:
        from shardstream.integrations.verl import FSDPCheckpointManager as cls

        config = {"save_contents": CONTENTS, "load_contents": CONTENTS}
    out = []
    for actor in actors:
        model, optimizer, scheduler, _ = build((world,) if mesh else None, seed=123)
        train_step(model, optimizer, scheduler, 1)  # optimizer state exists, and differs
        manager = _manager(cls, model, optimizer, scheduler, config)
        manager.load_checkpoint(actor, None, del_local_after_load=False)
        out.append({"state": full_state(model, optimizer, scheduler), "rng_next": torch.rand(3)})
    return out


def fsdp2_switch_run(rank: int, world: int, actor: str, wrong_units: set[str] | None) -> dict:
    """A run switching to FSDP2 resumes ``actor``: with ``wrong_units``, first into a model
    naming other wrap units (``load_error_run``'s result under "refused"); then into the
    model as it is (``load_run``'s state and RNG stream)."""
    refused = load_error_run(rank, world, actor, wrong_units) if wrong_units else None
    (loaded,) = load_run(rank, world, [actor], True, False)
    return {"refused": refused, **loaded}


def load_error_run(rank: int, world: int, actor: str, units: set[str] | None = None) -> dict:
    """Load a damaged checkpoint: the error, and whether the model changed. ``units``: the
    classes the model names as its wrap units (``_no_split_modules``) instead of its own."""
    from shardstream.integrations.verl import FSDPCheckpointManager

    model, optimizer, scheduler, _ = build((world,), seed=123)
    if units is not None:
        model._no_split_modules = units
    before = {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}
    manager = _manager(FSDPCheckpointManager, model, optimizer, scheduler, {})
    try:
        manager.load_checkpoint(actor)
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    after = get_model_state_dict(model, options=FULL)
    return {"error": error, "untouched": all(torch.equal(before[k], after[k]) for k in before)}


def _lora_model(world: int, seed: int):
    torch.manual_seed(seed)
    model = add_lora(build_tiny_model(tiny_config("qwen2"), seed=seed))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-2)


def lora_run(rank: int, world: int, root: str) -> dict:
    """save_lora_only: a LoRA model trains a step and saves; a model with other LoRA weights
    and the same base loads it."""
    from shardstream.integrations.verl import FSDPCheckpointManager

    config = {"save_contents": CONTENTS, "load_contents": CONTENTS, "save_lora_only": True}
    model, optimizer = _lora_model(world, seed=0)
    ids = batch(1)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    manager = _manager(FSDPCheckpointManager, model, optimizer, None, config)
    manager.save_checkpoint(_actor(root, 1), global_step=1)
    saved = {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}
    fresh, fresh_optimizer = _lora_model(world, seed=0)
    torch.manual_seed(7)  # other LoRA weights, same base
    with torch.no_grad():
        for name, param in fresh.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param))
    loader = _manager(FSDPCheckpointManager, fresh, fresh_optimizer, None, config)
    loader.load_checkpoint(_actor(root, 1))
    loaded = get_model_state_dict(fresh, options=FULL)
    return {"equal": all(torch.equal(saved[k], loaded[k]) for k in saved)}


def async_kill_run(rank: int, world: int, root: str, delay: float, steps: int) -> None:
    """Async saves every step; once step 1 has committed, every rank kills itself (SIGKILL)
    ``delay`` seconds later, wherever the saves are."""
    from shardstream.integrations.verl import FSDPCheckpointManager

    config = {"save_contents": CONTENTS, "load_contents": CONTENTS, "async_save": True}
    model, optimizer, scheduler, _ = build((world,))
    manager = _manager(FSDPCheckpointManager, model, optimizer, scheduler, config)
    for step in range(1, steps + 1):
        train_step(model, optimizer, scheduler, step)
        manager.save_checkpoint(_actor(root, step), global_step=step, max_ckpt_to_keep=2)
        if step == 1:
            manager.wait()
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
    manager.wait()
    threading.Event().wait(delay + 30)  # the timer ends it, in a save or after the last


def misc_run(rank: int, world: int, lora_root: str, damaged: list[str]) -> dict:
    """The LoRA round trip, then loads of damaged checkpoints (one process group for both)."""
    return {
        "lora": lora_run(rank, world, lora_root),
        "damaged": [load_error_run(rank, world, actor) for actor in damaged],
    }


def actor_critic_run(rank: int, world: int, root: str) -> None:
    """verl's actor and critic saving side by side into one run, as its trainer drives them:
    the actor synchronously (max_ckpt_to_keep=2), the critic with async_save (keep 1), steps
    1-3 into ``global_step_N/actor`` and ``global_step_N/critic``. Rank 0 writes each role's
    final state as the reference."""
    from shardstream.integrations.verl import FSDPCheckpointManager

    roles = {}
    for role, seed, keep, async_save in (("actor", 0, 2, False), ("critic", 5, 1, True)):
        model, optimizer, scheduler, _ = build((world,), seed=seed)
        config = {"save_contents": CONTENTS, "load_contents": CONTENTS, "async_save": async_save}
        manager = _manager(FSDPCheckpointManager, model, optimizer, scheduler, config)
        roles[role] = (model, optimizer, scheduler, manager, keep)
    for step in (1, 2, 3):
        for role, (model, optimizer, scheduler, manager, keep) in roles.items():
            train_step(model, optimizer, scheduler, step)  # the critic's overlaps its last save
            path = str(Path(root) / f"global_step_{step}" / role)
            manager.save_checkpoint(path, None, step, max_ckpt_to_keep=keep)
    for role, (model, optimizer, scheduler, manager, _) in roles.items():
        manager.wait()
        reference = full_state(model, optimizer, scheduler)
        if rank == 0:
            torch.save(reference, Path(root) / f"reference_{role}.pt")
        manager.close()


def load_roles_run(rank: int, world: int, root: str, step: int) -> dict:
    """Fresh models load ``global_step_<step>``'s actor and critic; returns each role's state."""
    from shardstream.integrations.verl import FSDPCheckpointManager

    out = {}
    for role in ("actor", "critic"):
        model, optimizer, scheduler, _ = build((world,), seed=123)
        train_step(model, optimizer, scheduler, 1)  # optimizer state exists, and differs
        config = {"save_contents": CONTENTS, "load_contents": CONTENTS}
        manager = _manager(FSDPCheckpointManager, model, optimizer, scheduler, config)
        manager.load_checkpoint(str(Path(root) / f"global_step_{step}" / role), None, False)
        out[role] = full_state(model, optimizer, scheduler)
    return out


def _fsdp1(world: int, seed: int, use_orig_params: bool = True, fsdp_size: int = -1):
    """The tiny Qwen2 wrapped by FSDP1 (verl's ``strategy: fsdp``) with verl's own wrap
    policy (a unit per decoder layer inside the root's), on a CPU mesh shaped as verl's
    ``create_device_mesh`` shapes it: ``fsdp_size`` below the world size is hybrid sharding
    over ``("ddp", "fsdp")``, with the strategy verl's ``get_sharding_strategy`` picks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy
    from verl.workers.engine.fsdp.utils import get_sharding_strategy

    if 0 < fsdp_size < world:
        mesh = init_device_mesh(
            "cpu", (world // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp")
        )
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model, _, _, _ = build(None, seed=seed)
    model = FullyShardedDataParallel(
        model,
        device_mesh=mesh,
        sharding_strategy=get_sharding_strategy(mesh),
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
        auto_wrap_policy=get_fsdp_wrap_policy(model),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def fsdp1_save_run(rank: int, world: int, root: str) -> None:
    """Two steps of an FSDP1 model saved through the plug-in; rank 0 writes the reference."""
    from shardstream.integrations.verl import FSDPCheckpointManager

    model, optimizer, scheduler = _fsdp1(world, seed=0)
    config = {"save_contents": CONTENTS, "load_contents": CONTENTS}
    manager = _manager(FSDPCheckpointManager, model, optimizer, scheduler, config)
    for step in (1, 2):
        train_step(model, optimizer, scheduler, step)
        manager.save_checkpoint(_actor(root, step), None, step, max_ckpt_to_keep=1)
    reference = full_state(model, optimizer, scheduler)
    if rank == 0:
        torch.save(reference, Path(root) / "reference_fsdp1.pt")


def fsdp1_verl_save_run(
    rank: int, world: int, root: str, use_orig_params: bool, fsdp_size: int = -1
) -> None:
    """verl's own manager saves two steps of the FSDP1 model (verl's default is
    ``use_orig_params=False``), its ``.pt`` files per rank; rank 0 writes the reference."""
    _, verls = _engine_class()
    model, optimizer, scheduler = _fsdp1(world, 0, use_orig_params, fsdp_size)
    config = {"save_contents": CONTENTS, "load_contents": CONTENTS}
    manager = _manager(verls, model, optimizer, scheduler, config)
    for step in (1, 2):
        train_step(model, optimizer, scheduler, step)
    manager.save_checkpoint(_actor(root, 2), None, 2, max_ckpt_to_keep=1)
    reference = full_state(model, optimizer, scheduler)
    if rank == 0:
        torch.save(reference, Path(root) / "reference_fsdp1.pt")


def fsdp1_load_run(
    rank: int,
    world: int,
    actor: str,
    use_orig_params: bool = True,
    contents=CONTENTS,
    fsdp_size: int = -1,
) -> dict:
    """A fresh FSDP1 model (another seed, one step taken) loads ``contents`` of ``actor``."""
    from shardstream.integrations.verl import FSDPCheckpointManager

    model, optimizer, scheduler = _fsdp1(world, 123, use_orig_params, fsdp_size)
    train_step(model, optimizer, scheduler, 1)
    config = {"save_contents": CONTENTS, "load_contents": list(contents)}
    manager = _manager(FSDPCheckpointManager, model, optimizer, scheduler, config)
    manager.load_checkpoint(actor, None, False)
    return full_state(model, optimizer, scheduler)


def _peft_model(world: int, seed: int = 0):
    """A tiny Qwen2 wrapped by PEFT's own LoRA and sharded by verl's apply_fsdp2, as verl's FSDP
    engine builds it; the adapters start non-zero, so merging them changes the base weights."""
    from peft import LoraConfig, TaskType, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.fsdp_utils import apply_fsdp2

    model = build_tiny_model(tiny_config("qwen2"), seed=seed)
    lora = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules="all-linear")
    model = get_peft_model(model, lora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-2)


def lora_sync_run(rank: int, world: int, root: str) -> dict:
    """An async save still reading when verl's merged-LoRA weight sync (``merged_lora_context``,
    as its engine runs it for the rollout) merges the adapters into the base weights in place
    and later restores them. The save's writer is held until the sync's first in-place write
    is attempted (the plug-in's fence, when there is one) or has happened (when there is none).
    Returns whether the sync changed the live weights and whether the checkpoint holds the
    weights of its step."""
    ours, _ = _engine_class()
    from verl.utils import fsdp_utils

    from shardstream.integrations import verl as plugged
    from shardstream.training.async_save import SourceGuard

    model, optimizer = _peft_model(world)
    ids = batch(1)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    config = {"save_contents": ["model"], "load_contents": ["model"], "async_save": True}
    manager = _manager(ours, model, optimizer, None, config)
    go = threading.Event()
    fence, window, stage_ahead = (
        plugged.wait_for_reads,
        SourceGuard.window,
        SourceGuard._stage_ahead,
    )

    def fence_entered() -> float:
        go.set()
        return fence()

    def held(method):
        def wrapped(self, *args):
            assert go.wait(timeout=600), "the save was never released"
            return method(self, *args)

        return wrapped

    plugged.wait_for_reads = fence_entered
    SourceGuard.window, SourceGuard._stage_ahead = held(window), held(stage_ahead)
    try:
        at_save = {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}
        manager.save_checkpoint(_actor(root, 1), global_step=1)
        with fsdp_utils.merged_lora_context(model, backup_adapters=True):
            go.set()  # no fence: the save reads the merged weights now
            manager.wait_for_reads()  # before the restore, either way
            merged = get_model_state_dict(model, options=FULL)
            changed = any(not torch.equal(merged[k], at_save[k]) for k in at_save)
        manager.wait()
    finally:
        plugged.wait_for_reads = fence
        SourceGuard.window, SourceGuard._stage_ahead = window, stage_ahead
    fresh, fresh_optimizer = _peft_model(world, seed=1)
    _manager(ours, fresh, fresh_optimizer, None, config).load_checkpoint(_actor(root, 1))
    loaded = get_model_state_dict(fresh, options=FULL)
    differ = sorted(k for k in at_save if not torch.equal(loaded[k], at_save[k]))
    return {"sync_changed_weights": changed, "differ": differ}


def finalize_run(rank: int, world: int, root: str) -> dict:
    """verl's trainer asks its actor workers' group for ``async_calls_finalize_fn_exec`` after
    the last step (``blocking=True``): the plug-in's method on verl's worker class, bound by
    verl's own worker-group code, returns only once the async save has committed."""
    ours, _ = _engine_class()
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
    from verl.single_controller.base.worker_group import WorkerGroup
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from shardstream.training.async_save import SourceGuard

    bound = []

    def generator(group, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
        bound.append(method_name)
        return lambda *args, **kwargs: None

    class Group:  # what verl's worker group binds to: its execute_* functions
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    WorkerGroup._bind_worker_method(Group(), ActorRolloutRefWorker, generator)
    finalize = ActorRolloutRefWorker.async_calls_finalize_fn_exec
    dispatch = getattr(finalize, MAGIC_ATTR)["dispatch_mode"]

    model, optimizer, scheduler, _ = build((world,))
    config = {"save_contents": CONTENTS, "load_contents": CONTENTS, "async_save": True}
    manager = _manager(ours, model, optimizer, scheduler, config)
    train_step(model, optimizer, scheduler, 1)
    go = threading.Event()
    finish = SourceGuard.finish

    def held_finish(self):
        assert go.wait(timeout=600), "the save was never released"
        finish(self)

    SourceGuard.finish = held_finish
    try:
        manager.save_checkpoint(_actor(root, 1), global_step=1)
        finalize(None, blocking=False)  # before each step: returns at once
        early = Path(_actor(root, 1)).exists()
        finished = threading.Thread(target=finalize, args=(None,), kwargs={"blocking": True})
        finished.start()
        finished.join(timeout=1.0)
        waited = finished.is_alive()  # held: it cannot have returned
        go.set()
        finished.join(timeout=600)
        committed = Path(_actor(root, 1)).exists()
    finally:
        SourceGuard.finish = finish
    return {
        "bound": "async_calls_finalize_fn_exec" in bound,
        "one_to_all": dispatch is Dispatch.ONE_TO_ALL,
        "committed_early": early,
        "waited": waited,
        "committed": committed,
    }

"""Trainers' own checkpoints, saved and restored on real processes (FSDP2 over gloo).

Each scenario saves at one world size with the tool's own saving code (``dcp.save`` of
PyTorch's ``{"app": AppState}`` recipe, accelerate's ``Accelerator.save_state``) and restores
through shardstream at another, returning full (gathered) state for the test to compare.
"""

from __future__ import annotations

import functools
import os
import random

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import get_cosine_schedule_with_warmup

from shardstream import CheckpointConfig, CheckpointManager

from . import workers


def _build(world: int, seed: int, shard: bool = True):
    model, optimizer, _, config = workers.build((world,) if shard else None, seed=seed)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 1, 10)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps=(1, 2)) -> None:
    for step in steps:
        workers.train_step(model, optimizer, scheduler, step)


class AppState:
    """PyTorch's DCP recipe: one Stateful holding model, optimizer and scheduler."""

    def __init__(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state):  # pragma: no cover - the recipe's own restore
        raise NotImplementedError


def recipe_run(rank: int, world: int, root: str, stage: str) -> dict:
    """stage "save": two steps, then ``dcp.save({"app": AppState})`` (transformers' cosine
    schedule); stage "restore": the manager's restore(path=...) at this world size."""
    import torch.distributed.checkpoint as dcp

    model, optimizer, scheduler = _build(world, seed=0 if stage == "save" else 5)
    path = f"{root}/step-2"
    restored = None
    if stage == "save":
        _train(model, optimizer, scheduler)
        dcp.save({"app": AppState(model, optimizer, scheduler)}, checkpoint_id=path)
    else:
        cfg = CheckpointConfig(directory=f"{root}/run-{world}")
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        restored = manager.restore(path=path)
        manager.close()
    return {"state": workers.full_state(model, optimizer, scheduler), "step": restored}


def _sequential(optimizer, parts: int):
    lam = torch.optim.lr_scheduler.LambdaLR
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [lam(optimizer, functools.partial(_factor, i)) for i in range(parts)],
        milestones=list(range(2, 2 * parts, 2)),
    )


def _factor(i: int, step: int) -> float:
    return 1.0 / (1 + i + step)


def refused_run(rank: int, world: int, root: str) -> dict:
    """A train state whose SequentialLR chains three schedules, restored into objects whose
    SequentialLR chains two: the error, and the state before and after (untouched)."""
    import torch.distributed.checkpoint as dcp

    model, optimizer, _ = _build(world, seed=0)
    scheduler = _sequential(optimizer, 3)
    _train(model, optimizer, scheduler, steps=(1,))
    dcp.save({"app": AppState(model, optimizer, scheduler)}, checkpoint_id=f"{root}/seq-1")

    model, optimizer, _ = _build(world, seed=5)
    scheduler = _sequential(optimizer, 2)
    before = workers.full_state(model, optimizer, scheduler)
    cfg = CheckpointConfig(directory=f"{root}/refused-{world}")
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    try:
        manager.restore(path=f"{root}/seq-1")
        error = None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        error = f"{type(exc).__name__}: {exc}"
    manager.close()
    after = workers.full_state(model, optimizer, scheduler)
    return {"error": error, "before": before, "after": after}


def _accelerate_env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # the process group exists already; accelerate does not open one
        OMP_NUM_THREADS="1",
    )


def accelerate_run(rank: int, world: int, root: str, stage: str) -> dict:
    """stage "save": accelerate's own prepare (FSDP2, sharded state dict) and two steps, then
    ``Accelerator.save_state``; stage "restore": the manager's restore(path=...) of that
    directory into FSDP2 objects at this world size. Both return the full state and this
    rank's torch RNG state after the save / restore."""
    path = f"{root}/accelerate_state"
    restored = None
    if stage == "save":
        _accelerate_env(rank, world)
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True
        )
        accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
        # accelerate enables FSDP only on accelerators (its AcceleratorState turns FSDP on
        # from GPU-like distributed types, never from MULTI_CPU); its FSDP2 preparation and
        # checkpoint code run on CPU all the same once the state says FSDP.
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        model, optimizer, scheduler = _build(world, seed=0, shard=False)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        _train(model, optimizer, scheduler)
        accelerator.state.distributed_type = DistributedType.FSDP
        torch.manual_seed(1234 + rank)
        random.seed(99 + rank)
        accelerator.save_state(path)
        optimizer, scheduler = optimizer.optimizer, scheduler.scheduler
        names = sorted(os.listdir(path))
    else:
        model, optimizer, scheduler = _build(world, seed=5)
        torch.manual_seed(0)
        cfg = CheckpointConfig(directory=f"{root}/run-{world}")
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        restored = manager.restore(path=path)
        manager.close()
        names = None
    return {
        "state": workers.full_state(model, optimizer, scheduler),
        "rng": (torch.get_rng_state(), random.getstate()),
        "step": restored,
        "files": names,
    }

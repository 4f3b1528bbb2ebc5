"""accelerate's ``Accelerator.save_state`` with every part it writes besides model 0: a
GradScaler, an object registered with ``register_for_checkpointing``, a second model with its
own optimizer and scheduler (FSDP2 over gloo), restored through shardstream elsewhere."""

from __future__ import annotations

import os
import shutil

import torch

from shardstream import CheckpointConfig, CheckpointManager

from . import workers
from .trainer_workers import _accelerator, _build, _save_state, _train

# A GradScaler state no fresh scaler has: every field restored shows.
SCALER_STATE = {
    "scale": 512.0,
    "growth_factor": 3.0,
    "backoff_factor": 0.25,
    "growth_interval": 7,
    "_growth_tracker": 3,
}


class Counter:
    """What a user registers for checkpointing: a state_dict of plain values and a tensor."""

    def __init__(self, count: int = 0):
        self.count, self.name = count, "fresh"
        self.history = torch.zeros(3)

    def state_dict(self):
        return {"count": self.count, "name": self.name, "history": self.history.clone()}

    def load_state_dict(self, state):
        self.count, self.name = state["count"], state["name"]
        self.history = state["history"].clone()


def _scaler():
    return torch.amp.GradScaler("cpu")


def _state(model, optimizer, scheduler, scaler, counter) -> dict:
    return {
        **workers.full_state(model, optimizer, scheduler),
        "scaler": scaler.state_dict(),
        "counter": counter.state_dict(),
    }


def save_run(rank: int, world: int, root: str) -> dict:
    """Two FSDP2 models, each prepared with its optimizer and scheduler, two steps each; a
    GradScaler and a Counter; ``Accelerator.save_state``. Returns each model's full state."""
    accelerator = _accelerator(rank, world)
    states = []
    for seed in (0, 1):
        model, optimizer, scheduler = _build(world, seed=seed, shard=False)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        _train(model, optimizer, scheduler, steps=(1, 2) if seed == 0 else (1, 2, 3))
        states.append((model, optimizer.optimizer, scheduler.scheduler))
    scaler = _scaler()
    scaler.load_state_dict(SCALER_STATE)
    accelerator.scaler = scaler  # accelerate makes one only for fp16 on an accelerator
    counter = Counter()
    counter.count, counter.name, counter.history = 7, "saved", torch.randn(3)
    accelerator.register_for_checkpointing(counter)
    _save_state(accelerator, f"{root}/accelerate_state")
    return {
        "states": [_state(*parts, scaler, counter) for parts in states],
        "files": sorted(os.listdir(f"{root}/accelerate_state")),
    }


def restore_run(rank: int, world: int, root: str) -> dict:
    """At this world size: the directory itself (refused: two models), then model 0 and model
    1 picked by their pytorch_model_fsdp_N path, each with the scaler and Counter."""
    path = f"{root}/accelerate_state"
    out: dict = {"states": []}
    for index in (0, 1):
        model, optimizer, scheduler = _build(world, seed=5)
        scaler, counter = _scaler(), Counter()
        cfg = CheckpointConfig(directory=f"{root}/run-{world}-{index}")
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        names = {"scaler": scaler, "custom_checkpoint_0": counter}
        if index == 0:
            try:
                manager.restore(path=path, states=names)
                out["whole"] = None
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                out["whole"] = f"{type(exc).__name__}: {exc}"
        restored = manager.restore(path=f"{path}/pytorch_model_fsdp_{index}", states=names)
        manager.close()
        out["states"].append(_state(model, optimizer, scheduler, scaler, counter))
        out.setdefault("steps", []).append(restored)
    return out


def hostile_run(rank: int, world: int, root: str) -> dict:
    """A copy of the directory whose custom_checkpoint_0.pkl names os.system: the error, and
    model, optimizer, scheduler, scaler and Counter before and after (untouched)."""
    source, path = f"{root}/accelerate_state", f"{root}/hostile"
    if rank == 0:
        shutil.copytree(source, path)
        shutil.rmtree(f"{path}/pytorch_model_fsdp_1")
        shutil.rmtree(f"{path}/optimizer_1")
        os.remove(f"{path}/scheduler_1.bin")
        torch.save({"count": _Hostile(f"{root}/ran")}, f"{path}/custom_checkpoint_0.pkl")
    torch.distributed.barrier()
    model, optimizer, scheduler = _build(world, seed=5)
    scaler, counter = _scaler(), Counter()
    before = _state(model, optimizer, scheduler, scaler, counter)
    cfg = CheckpointConfig(directory=f"{root}/hostile-run-{world}")
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    try:
        manager.restore(path=path, states={"scaler": scaler, "custom_checkpoint_0": counter})
        error = None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        error = f"{type(exc).__name__}: {exc}"
    manager.close()
    after = _state(model, optimizer, scheduler, scaler, counter)
    return {"error": error, "before": before, "after": after, "ran": os.path.exists(f"{root}/ran")}


class _Hostile:
    def __init__(self, mark: str):
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))

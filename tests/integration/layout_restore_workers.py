"""transformers' Trainer without FSDP on models whose save_pretrained layout differs from the
names they hold (Qwen2.5-VL, Qwen3-MoE) or that tie their head: its checkpoint-N (the model
as save_pretrained writes it, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``) restored
into the live model's own names at 1 process and into FSDP2 at 2 ranks."""

from __future__ import annotations

import torch
from transformers import Trainer

import shardstream
from shardstream.testing.distributed import shard_units
from shardstream.testing.tiny_models import build_layout_model, build_tiny_model, tiny_config

from . import workers
from .hf_trainer_workers import CHECKPOINT, STEPS, Snapshot, dataset, training_args
from .trainer_workers import _accelerate_env


def build(case: str, seed: int) -> torch.nn.Module:
    if case == "qwen2-tied":
        return build_tiny_model(tiny_config("qwen2", tie_word_embeddings=True), seed=seed)
    return build_layout_model(case, seed=seed)


def save_run(rank: int, world: int, root: str, case: str) -> None:
    """Two steps of ``trainer.train()`` without FSDP, then checkpoint-2; the state at the save
    in ``root/reference.pt``."""
    _accelerate_env(rank, world)
    snapshot = Snapshot(rank)
    trainer = Trainer(
        model=build(case, seed=0),
        args=training_args(f"{root}/out", None),
        train_dataset=dataset(),
        callbacks=[snapshot],
    )
    snapshot.trainer = trainer
    trainer.train()
    trainer.save_model(f"{root}/model")  # the model alone, as save_pretrained writes it
    torch.save(snapshot.saved["state"], f"{root}/reference.pt")


def load_model_run(rank: int, world: int, root: str, case: str) -> dict:
    """A fresh model, FSDP2 over ``world`` ranks, filled from the HF model directory alone
    (``contents=("model",)``): how a run starts from pretrained weights."""
    _accelerate_env(rank, world)
    model = _sharded(build(case, seed=5), world)
    shardstream.load(f"{root}/model", model=model, contents=("model",))
    return workers.full_state(model, torch.optim.SGD(model.parameters(), lr=0.1), _NoSchedule())


class _NoSchedule:
    def state_dict(self) -> dict:
        return {}


def _sharded(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """FSDP2 over ``world`` ranks (each decoder layer and vision block a unit); as it is at 1."""
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
        shard_units(model, blocks, mesh)
    return model


def restore_run(rank: int, world: int, root: str, case: str) -> dict:
    """The Trainer's optimizer and scheduler for a fresh model (FSDP2 over ``world`` ranks
    when more than one: each decoder layer and vision block a unit), filled by
    ``shardstream.load`` from checkpoint-2."""
    _accelerate_env(rank, world)
    model = _sharded(build(case, seed=5), world)
    trainer = Trainer(model=model, args=training_args(f"{root}/resume", None))
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    result = shardstream.load(
        f"{root}/out/{CHECKPOINT}", model=model, optimizer=optimizer, lr_scheduler=scheduler
    )
    return {"step": result.step, "state": workers.full_state(model, optimizer, scheduler)}

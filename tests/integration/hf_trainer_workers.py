"""transformers' ``Trainer`` with FSDP2 on CPU ranks (gloo): its own ``checkpoint-N``, written
by ``trainer.train()`` (``save_strategy="steps"``), restored through shardstream elsewhere.

accelerate turns FSDP on only from GPU-like distributed types (``AcceleratorState`` sets it
for MULTI_GPU, MULTI_NPU...; never for MULTI_CPU), so on CPU a Trainer given ``fsdp=`` trains
with DDP without a word. ``CpuFsdpTrainer`` sets the state accelerate would have set on GPUs
(``accelerate/state.py``: ``distributed_type = FSDP``, ``fsdp_plugin``, and the same type in
``PartialState``'s shared state, which every later ``AcceleratorState()`` copies back); every
other line, the FSDP2 preparation and all the checkpoint code included, is the Trainer's and
accelerate's own.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import shardstream
from shardstream import CheckpointConfig, CheckpointManager
from shardstream.testing.tiny_models import build_tiny_model, tiny_config

from . import workers
from .trainer_workers import _accelerate_env

STEPS = 2  # checkpoint-2 is written after the last step
CHECKPOINT = f"checkpoint-{STEPS}"


def dataset(size: int = 8) -> list[dict]:
    """Token ids (and labels) of a tiny in-memory dataset: a batch of 2 per rank and step."""
    rows = []
    for i in range(size):
        ids = torch.randint(4, 101, (12,), generator=torch.Generator().manual_seed(100 + i))
        rows.append({"input_ids": ids.tolist(), "labels": ids.tolist()})
    return rows


def training_args(out: str, state_dict_type: str | None) -> TrainingArguments:
    """The run's arguments; ``state_dict_type`` None: no FSDP (a one-process resume)."""
    fsdp = {}
    if state_dict_type is not None:
        fsdp_config = {
            "fsdp_version": 2,
            "state_dict_type": state_dict_type,
            "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
            "reshard_after_forward": True,
        }
        fsdp = {"fsdp": True, "fsdp_config": fsdp_config}
    return TrainingArguments(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.1,  # two param groups: decay and no decay
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": 1e-3},  # not 0 at the last step
        warmup_steps=1,
        seed=0,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **fsdp,
    )


class CpuFsdpTrainer(Trainer):
    """The Trainer, its accelerate state set to FSDP as accelerate sets it on GPUs."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is None:
            return
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = plugin
        # AcceleratorState() copies PartialState's shared state over its own each time it is
        # made (accelerate does so during training): without this the type is MULTI_CPU
        # again by the time the Trainer saves, and FULL_STATE_DICT's get_state_dict then
        # hands save_pretrained the sharded DTensors ("Attempted to access the data pointer
        # on an invalid python storage"). On GPUs AcceleratorState writes it there itself.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True


class Snapshot(TrainerCallback):
    """Per-rank RNG moved apart at each step (as dropout would), and at ``on_save`` (right
    after the Trainer wrote its checkpoint) everything gathered in full, with this rank's RNG."""

    def __init__(self, rank: int):
        self.rank, self.trainer, self.saved = rank, None, None

    def on_step_end(self, args, state, control, **kwargs):
        torch.manual_seed(1000 * state.global_step + self.rank)
        random.seed(2000 * state.global_step + self.rank)
        np.random.seed(3000 * state.global_step + self.rank)

    def on_save(self, args, state, control, **kwargs):
        trainer = self.trainer
        self.saved = {
            "rng": _rng(),
            "state": workers.full_state(
                trainer.model, trainer.optimizer.optimizer, trainer.lr_scheduler
            ),
        }


def _rng():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def _model(seed: int, tie: bool):
    return build_tiny_model(tiny_config("qwen2", tie_word_embeddings=tie), seed=seed)


def save_run(rank: int, world: int, root: str, state_dict_type: str, tie: bool) -> dict:
    """``trainer.train()`` with FSDP2 (``state_dict_type``; ``tie``: tied embeddings): two
    steps and checkpoint-2. Then
    ``trainer.save_model`` of the same weights into ``root/ref`` (with a sharded state dict
    type the Trainer saves no weights there: the FSDP plugin is switched to FULL_STATE_DICT
    first, as Hugging Face's docs and TRL do). Rank 0 keeps the state at the save in
    ``root/reference.pt``; every rank returns its RNG and the checkpoint's file list."""
    _accelerate_env(rank, world)
    snapshot = Snapshot(rank)
    trainer = CpuFsdpTrainer(
        model=_model(seed=0, tie=tie),
        args=training_args(f"{root}/out", state_dict_type),
        train_dataset=dataset(),
        callbacks=[snapshot],
    )
    snapshot.trainer = trainer
    trainer.train()
    assert trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2
    if state_dict_type != "FULL_STATE_DICT":
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(f"{root}/ref")
    if rank == 0:
        torch.save(snapshot.saved["state"], f"{root}/reference.pt")
    path = f"{root}/out/{CHECKPOINT}"
    files = sorted(
        f"{name}/" if os.path.isdir(f"{path}/{name}") else name for name in os.listdir(path)
    )
    return {"rng": snapshot.saved["rng"], "files": files}


def restore_plain_run(rank: int, world: int, root: str, tie: bool) -> dict:
    """One process, no FSDP: a Trainer's own optimizer and scheduler for a plain model
    (``create_optimizer_and_scheduler``), filled by ``shardstream.load``."""
    _accelerate_env(rank, world)
    trainer = Trainer(
        model=_model(seed=5, tie=tie),
        args=training_args(f"{root}/resume-plain", None),
        train_dataset=dataset(),
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=STEPS)
    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.lr_scheduler
    torch.manual_seed(0)
    result = shardstream.load(
        f"{root}/out/{CHECKPOINT}", model=model, optimizer=optimizer, lr_scheduler=scheduler
    )
    return {
        "step": result.step,
        "rng": _rng(),
        "state": workers.full_state(model, optimizer, scheduler),
    }


def restore_fsdp_run(rank: int, world: int, root: str, state_dict_type: str, tie: bool) -> dict:
    """FSDP2 at this world size, prepared as the Trainer prepares it (its optimizer made
    for the unsharded model, ``accelerator.prepare(model, optimizer)``, then its scheduler),
    filled by ``CheckpointManager.restore(path=...)`` given the Trainer's own optimizer
    object (accelerate's ``AcceleratedOptimizer``), as a Trainer user holds it."""
    _accelerate_env(rank, world)
    trainer = CpuFsdpTrainer(
        model=_model(seed=5, tie=tie),
        args=training_args(f"{root}/resume-{world}", state_dict_type),
        train_dataset=dataset(),
    )
    trainer.create_optimizer()
    model, optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    scheduler = trainer.create_scheduler(num_training_steps=STEPS, optimizer=optimizer)
    torch.manual_seed(0)
    cfg = CheckpointConfig(directory=f"{root}/run-{world}")
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    restored = manager.restore(path=f"{root}/out/{CHECKPOINT}")
    manager.close()
    return {
        "step": restored[0],
        "rng": _rng(),
        "state": workers.full_state(model, optimizer.optimizer, scheduler),
    }

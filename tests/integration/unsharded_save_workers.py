"""Checkpoints saved WITHOUT FSDP (the common DDP or single-process run), by the tools' own
code on real processes (gloo), and restored through shardstream elsewhere: at 1 process into a
plain model, at 3 ranks into FSDP2.

* accelerate's ``Accelerator(cpu=True).save_state(dir)``: ``model.safetensors`` (the unwrapped
  model's state dict, a tied ``lm_head.weight`` left out; ``safe_serialization=False``:
  ``pytorch_model.bin``, both tied names kept), ``optimizer.bin``
  (``optimizer.state_dict()``: integer parameter ids), ``scheduler.bin`` and each rank's
  ``random_states_<rank>.pkl``;
* transformers' ``Trainer`` (``trainer.train()``, ``save_strategy="steps"``): ``checkpoint-N/``
  with ``save_pretrained``'s ``model.safetensors`` (a tied ``lm_head.weight`` left out),
  ``config.json`` and ``generation_config.json``, ``optimizer.pt``
  (integer ids), ``scheduler.pt``, ``rng_state.pth`` (1 process) or ``rng_state_<rank>.pth``,
  ``trainer_state.json`` and ``training_args.bin``.

Every save also leaves, on rank 0, ``reference.pt`` beside the checkpoint: the state at the
save gathered in full by name (model, optimizer by FQN, scheduler), for the test to compare.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist
from transformers import Trainer, get_cosine_schedule_with_warmup

import shardstream
from shardstream import CheckpointConfig, CheckpointManager
from shardstream.errors import CheckpointFormatError
from shardstream.testing.tiny_models import build_tiny_model, tiny_config

from . import hf_trainer_workers as hw
from . import workers
from .trainer_workers import _accelerate_env

STEPS = hw.STEPS
ACCELERATE_DIR = "accelerate_state"


def checkpoint_dir(root: str, tool: str) -> str:
    """Where ``tool``'s save lies under ``root``: accelerate's save_state directory, or the
    Trainer's ``checkpoint-N`` in its output_dir."""
    return f"{root}/{ACCELERATE_DIR}" if tool == "accelerate" else f"{root}/out/{hw.CHECKPOINT}"


def _model(seed: int, tie: bool):
    return build_tiny_model(tiny_config("qwen2", tie_word_embeddings=tie), seed=seed)


def _rng() -> tuple:
    """This process's torch, Python and numpy generator states."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _files(path: str) -> list[str]:
    return sorted(f"{n}/" if os.path.isdir(f"{path}/{n}") else n for n in os.listdir(path))


def _env(rank: int, world: int) -> None:
    """A launcher's environment at several ranks (torchrun's variables: accelerate and the
    Trainer then use DDP); at one, a plain ``python train.py``'s, which sets none (with
    ``LOCAL_RANK`` set, accelerate takes even one process for MULTI_CPU and wraps it in DDP)."""
    if world > 1:
        _accelerate_env(rank, world)
        return
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    os.environ["OMP_NUM_THREADS"] = "1"


def _fully_shard(model, world: int) -> None:
    """FSDP2 on a 1-D CPU mesh of ``world`` ranks: each decoder layer a unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


# --------------------------------------------------------------------------- accelerate


def param_groups(model, groups: int = 2) -> list[dict]:
    """The accelerate run's param groups: matrices with weight decay, then vectors (biases,
    norms) without. Both interleave in ``named_parameters`` order, so optimizer.bin's integer
    id ``i`` is not the ``i``-th parameter. ``groups=1``: every parameter in one group."""
    named = list(model.named_parameters())
    if groups == 1:
        return [{"params": [p for _, p in named], "weight_decay": 0.1}]
    return [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


def _accelerate_objects(model, groups: int = 2):
    optimizer = torch.optim.AdamW(param_groups(model, groups), lr=1e-2)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 1, 10)
    return optimizer, scheduler


def accelerate_save_run(rank: int, world: int, root: str, tie: bool, safe: bool) -> dict:
    """``Accelerator(cpu=True)`` without FSDP (one process: no wrapper; more: DDP over the
    existing gloo group), ``prepare`` of model, optimizer and scheduler, two steps (each rank
    its own batch), each rank's RNG moved apart, ``save_state`` (``safe``: safetensors, else
    ``pytorch_model.bin``). Rank 0 keeps the state at the save in ``root/reference.pt``;
    every rank returns its RNG at the save, and rank 0 what the directory holds."""
    _env(rank, world)
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=True)
    expected = DistributedType.MULTI_CPU if world > 1 else DistributedType.NO
    assert accelerator.distributed_type == expected, accelerator.distributed_type
    model = _model(seed=0, tie=tie)
    optimizer, scheduler = _accelerate_objects(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel) == (world > 1)
    for step in (1, 2):
        ids = workers.batch(world * step + rank)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    torch.manual_seed(1234 + rank)
    random.seed(99 + rank)
    np.random.seed(7 + rank)
    rng = _rng()
    path = checkpoint_dir(root, "accelerate")
    accelerator.save_state(path, safe_serialization=safe)
    dist.barrier()  # every rank's random_states file is written
    inner = accelerator.unwrap_model(model)
    state = workers.full_state(inner, optimizer.optimizer, scheduler.scheduler)
    if rank == 0:
        torch.save(state, f"{root}/reference.pt")
    # The optimizer as accelerate hands it to torch.save (what optimizer.bin holds).
    raw = optimizer.optimizer.state_dict()
    return {
        "rng": rng,
        "files": _files(path) if rank == 0 else None,
        "ids": [list(g["params"]) for g in raw["param_groups"]],
        "names": [n for n, _ in inner.named_parameters()],
    }


# --------------------------------------------------------------------------- Trainer


class FullRngSnapshot(hw.Snapshot):
    """``hw.Snapshot`` keeping numpy's whole generator state too (its position included)."""

    def on_save(self, args, state, control, **kwargs):
        super().on_save(args, state, control, **kwargs)
        self.saved["rng_full"] = _rng()


def trainer_save_run(rank: int, world: int, root: str, tie: bool) -> dict:
    """``trainer.train()`` without FSDP (one process; more: DDP over gloo on CPU), two steps
    and checkpoint-2, its two param groups the Trainer's own (decay, no decay). The
    ``Snapshot`` callback moves each rank's RNG apart at each step and gathers the state at
    the save; rank 0 keeps it in ``root/reference.pt``; every rank returns its RNG at the save,
    and rank 0 what checkpoint-2 holds."""
    _env(rank, world)
    snapshot = FullRngSnapshot(rank)
    trainer = Trainer(
        model=_model(seed=0, tie=tie),
        args=hw.training_args(f"{root}/out", None),
        train_dataset=hw.dataset(),
        callbacks=[snapshot],
    )
    snapshot.trainer = trainer
    trainer.train()
    assert not trainer.is_fsdp_enabled
    wrapped = isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    assert wrapped == (world > 1), type(trainer.model_wrapped)
    dist.barrier()  # every rank's rng_state file is written
    if rank == 0:
        torch.save(snapshot.saved["state"], f"{root}/reference.pt")
    raw = trainer.optimizer.optimizer.state_dict()
    path = checkpoint_dir(root, "trainer")
    return {
        "rng": snapshot.saved["rng_full"],
        "files": _files(path) if rank == 0 else None,
        "ids": [list(g["params"]) for g in raw["param_groups"]],
        "names": [n for n, _ in trainer.model.named_parameters()],
    }


def _trainer_objects(root: str, world: int, tie: bool, shard: bool):
    """A Trainer's own optimizer and scheduler (``create_optimizer``, ``create_scheduler``),
    built as the run built them, for a fresh, differently seeded model; ``shard``: that model
    under FSDP2 first (the optimizer then holds its DTensor parameters)."""
    trainer = Trainer(
        model=_model(seed=5, tie=tie),
        args=hw.training_args(f"{root}/resume-{world}", None),
        train_dataset=hw.dataset(),
    )
    if shard:
        _fully_shard(trainer.model, world)
    optimizer = trainer.create_optimizer()
    scheduler = trainer.create_scheduler(num_training_steps=STEPS, optimizer=optimizer)
    return trainer.model, optimizer, scheduler


# --------------------------------------------------------------------------- restore


def _objects(tool: str, root: str, world: int, tie: bool, shard: bool):
    if tool == "trainer":
        return _trainer_objects(root, world, tie, shard)
    model = _model(seed=5, tie=tie)
    if shard:
        _fully_shard(model, world)
    return (model, *_accelerate_objects(model))


def restore_plain_run(rank: int, world: int, tool: str, root: str, tie: bool) -> dict:
    """One process, no FSDP: a plain model and the optimizer and scheduler built as the run
    built them, filled by ``shardstream.load(path, model=, optimizer=, lr_scheduler=)``."""
    _env(rank, world)
    model, optimizer, scheduler = _objects(tool, root, world, tie, shard=False)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    result = shardstream.load(
        checkpoint_dir(root, tool), model=model, optimizer=optimizer, lr_scheduler=scheduler
    )
    rng = _rng()
    return {
        "step": result.step,
        "rng": rng,
        "state": workers.full_state(model, optimizer, scheduler),
    }


def restore_fsdp_run(
    rank: int, world: int, tool: str, root: str, tie: bool, directory: str
) -> dict:
    """FSDP2 at this world size (each decoder layer and the root, an explicit CPU mesh), the
    optimizer and scheduler built as the run built them, filled by
    ``CheckpointManager(directory=<fresh>).restore(path=<the checkpoint>)``."""
    _env(rank, world)
    model, optimizer, scheduler = _objects(tool, root, world, tie, shard=True)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    cfg = CheckpointConfig(directory=directory)
    manager = CheckpointManager(cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    restored = manager.restore(path=checkpoint_dir(root, tool))
    rng = _rng()
    manager.close()
    return {
        "step": restored[0],
        "rng": rng,
        "state": workers.full_state(model, optimizer, scheduler),
    }


def refused_groups_run(rank: int, world: int, root: str, tie: bool) -> dict:
    """accelerate's save restored into an optimizer whose param groups are not the run's (one
    group instead of two): the error, and the live state before and after."""
    _env(rank, world)
    model = _model(seed=5, tie=tie)
    optimizer, scheduler = _accelerate_objects(model, groups=1)
    before = workers.full_state(model, optimizer, scheduler)
    try:
        shardstream.load(
            checkpoint_dir(root, "accelerate"),
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
        )
        error = None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        error = exc
    after = workers.full_state(model, optimizer, scheduler)
    return {
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "format_error": isinstance(error, CheckpointFormatError),
        "before": before,
        "after": after,
    }

"""accelerate's own ``save_state`` with an FSDP2 ``FULL_STATE_DICT`` plugin on gloo CPU ranks,
for test_accelerate_full_state.py (run through ``shardstream.testing.distributed.run``)."""

from __future__ import annotations

import torch
from integration.trainer_workers import _accelerator

from shardstream.testing.tiny_models import build_tiny_model, tiny_config, write_config_json

STATE_DIR = "accelerate_state"
REFERENCE_DIR = "reference"  # save_pretrained of the saved weights
CONFIG_DIR = "config"  # config.json alone, for --hf_model_path


def save_full_state(rank: int, world: int, root: str) -> dict | None:
    """Prepare a tiny Qwen2 with AdamW and a scheduler, one training step, then
    ``Accelerator.save_state``. Rank 0 also writes the saved weights with ``save_pretrained``
    and config.json apart, and returns the model's full state dict."""
    from accelerate.utils import DistributedType

    accelerator = _accelerator(rank, world, "FULL_STATE_DICT")
    config = tiny_config("qwen2")
    model = build_tiny_model(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()

    saved = full_state(model, optimizer.optimizer, scheduler.scheduler)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.save_state(f"{root}/{STATE_DIR}")
    if rank != 0:
        return None
    reference = build_tiny_model(config, seed=None)
    reference.load_state_dict(saved["model"])
    reference.save_pretrained(f"{root}/{REFERENCE_DIR}")
    write_config_json(f"{root}/{CONFIG_DIR}", config, config_dtype="float32")
    return saved


def restore_full_state(rank: int, world: int, root: str) -> dict | None:
    """A fresh tiny Qwen2 (other seed) sharded with FSDP2 at this world size, AdamW and the
    scheduler, restored by ``CheckpointManager.restore(path=<save_state dir>)``; rank 0
    returns the full state after it, and the step restore returned."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardstream import CheckpointConfig, CheckpointManager

    model = build_tiny_model(tiny_config("qwen2"), seed=5)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    config = CheckpointConfig(directory=f"{root}/restored-{world}")
    manager = CheckpointManager(config, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    step = manager.restore(path=f"{root}/{STATE_DIR}")
    manager.close()
    state = full_state(model, optimizer, scheduler)
    return {**state, "step": step} if rank == 0 else None


def full_state(model, optimizer, scheduler) -> dict:
    """Model, optimizer (by parameter name) and scheduler state, gathered whole on rank 0."""
    from shardstream.testing.gathered import full_state_dicts

    model_state, optimizer_state = full_state_dicts(model, optimizer)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": _cloned(scheduler.state_dict()),
    }


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value

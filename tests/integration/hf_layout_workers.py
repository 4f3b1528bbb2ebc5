"""Models whose save_pretrained layout differs from their in-memory names, and the FSDP2 run
that saves each as a verl checkpoint and with the CheckpointManager's hf_model export."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shardstream.testing import tiny_models

CASES = tiny_models.LAYOUT_CASES
tiny_config = tiny_models.layout_config


class Compiled(nn.Module):
    """What ``torch.compile`` wraps a model in, as far as its state dict shows: ``_orig_mod.``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._orig_mod = model

    @property
    def config(self):
        return self._orig_mod.config


def build_model(case: str) -> nn.Module:
    """``case``'s model in fp32, the same weights in every process (seeded)."""
    model = tiny_models.build_layout_model(case)
    return Compiled(model) if case == "compiled_qwen2" else model


def inner(model: nn.Module) -> nn.Module:
    return model._orig_mod if isinstance(model, Compiled) else model


def save_run(rank: int, world: int, root: str) -> None:
    """Every case, FSDP2-sharded over ``world`` ranks: ``root/<case>/verl/...`` (verl's
    layout) and ``root/<case>/run`` (CheckpointManager with hf_model)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardstream import CheckpointConfig, CheckpointManager

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for case in CASES:
        model = build_model(case)
        layers = set(inner(model)._no_split_modules or ())
        for module in inner(model).modules():
            if type(module).__name__ in layers:
                fully_shard(module, mesh=mesh)
        fully_shard(inner(model), mesh=mesh)
        base = Path(root) / case
        actor = base / "verl" / "global_step_1" / "actor"
        if rank == 0:
            (actor / "huggingface").mkdir(parents=True)
            inner(model).config.save_pretrained(actor / "huggingface")
            (actor / "fsdp_config.json").write_text(
                json.dumps({"FSDP_version": 2, "world_size": world})
            )
        dist.barrier()
        torch.save(model.state_dict(), actor / f"model_world_size_{world}_rank_{rank}.pt")
        config = CheckpointConfig(directory=str(base / "run"), save_contents=("model", "hf_model"))
        manager = CheckpointManager(
            config, model=model, hf_config=inner(model).config, hf_dtype="bfloat16"
        )
        manager.save(1)
        manager.close()
        dist.barrier()

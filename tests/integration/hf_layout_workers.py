"""Models whose save_pretrained layout differs from their in-memory names, and the FSDP2 run
that saves each as a verl checkpoint and with the CheckpointManager's hf_model export."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

CASES = ("qwen2_5_vl", "qwen3_moe", "compiled_qwen2", "qwen2_critic")
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 101,
    "max_position_embeddings": 128,
}


MROPE = {"mrope_section": [2, 1, 1]}  # sums to head_dim / 2


class Compiled(nn.Module):
    """What ``torch.compile`` wraps a model in, as far as its state dict shows: ``_orig_mod.``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._orig_mod = model

    @property
    def config(self):
        return self._orig_mod.config


def tiny_config(case: str):
    """The transformers config of ``case``, its ``architectures`` named as a hub config does."""
    import transformers

    if case == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(SMALL, rope_parameters={"rope_type": "default", **MROPE}),
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 24,
                "num_heads": 2,
                "out_hidden_size": 32,
                "fullatt_block_indexes": [0],
            },
        )
        cls = "Qwen2_5_VLForConditionalGeneration"
    elif case == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **dict(SMALL, intermediate_size=48),
            head_dim=8,
            moe_intermediate_size=16,  # bf16 grouped_mm: 16-byte strides
            num_experts=3,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
        )
        cls = "Qwen3MoeForCausalLM"
    elif case == "qwen2_critic":
        config = transformers.Qwen2Config(**SMALL, num_labels=1)
        cls = "Qwen2ForTokenClassification"
    else:
        config = transformers.Qwen2Config(**SMALL)
        cls = "Qwen2ForCausalLM"
    config.architectures = [cls]
    config.dtype = "bfloat16"
    return config


def build_model(case: str) -> nn.Module:
    """``case``'s model in fp32, the same weights in every process (seeded)."""
    import transformers

    config = tiny_config(case)
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config).float()
    with torch.no_grad():  # no weight left at a constant init: every byte tells
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
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

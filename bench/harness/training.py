"""What the training benchmarks save and restore: a Qwen2-shaped FSDP2 model with AdamW.

Rank-side helpers (called inside ``shardstream.testing.distributed.run`` processes) import
torch lazily, so a driver that only renders never pays for it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from harness import MiB
from harness.process import busy_cpu_s, others_cpu_share

BUDGET = "256MiB"  # shardstream's staging_budget in every training benchmark
BUDGET_BYTES = 256 * MiB

# Qwen2-shaped widths (GQA with 4 KV heads, head_dim 64); the layer count sets the size.
QWEN2_WIDTHS = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)
# Untied lm_head. FULL: 279.8 M params = 1.12 GB fp32 (1.04 GiB).
MODEL_FULL = dict(QWEN2_WIDTHS, num_hidden_layers=19, max_position_embeddings=512)
MODEL_QUICK = dict(MODEL_FULL, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                   num_key_value_heads=2, num_hidden_layers=4)  # fmt: skip


def param_count(c: dict) -> int:
    """Parameters of a Qwen2 config (q/k/v biases; lm_head untied unless the config ties it)."""
    h, i, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    per_layer = (
        (h * h + h)  # q_proj (+bias)
        + 2 * (h * kv + kv)  # k_proj, v_proj (+bias)
        + h * h  # o_proj
        + 3 * h * i  # gate, up, down
        + 2 * h  # input / post-attention RMSNorm
    )
    embed = v * h * (1 if c.get("tie_word_embeddings") else 2)
    return embed + n * per_layer + h  # + final norm


def make_config(overrides: dict):
    from shardstream.testing.tiny_models import tiny_config

    return tiny_config("qwen2", tie_word_embeddings=False, overrides=overrides)


def build_fsdp_model(config, seed: int = 0):
    """FSDP2 model built on meta, sharded, then materialised shard by shard (memory-safe)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardstream.testing.tiny_models import build_tiny_model

    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("fsdp",))
    with torch.device("meta"):
        model = build_tiny_model(config, seed=None)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            elif name.endswith(".bias"):
                local.zero_()
            else:
                local.normal_(0.0, 0.02, generator=gen)
        fresh = type(model.model.rotary_emb)(config)  # non-persistent buffers: recompute
        for name, buf in fresh.named_buffers():
            getattr(model.model.rotary_emb, name).copy_(buf)
    return model


def make_optimizer(model):
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    return optimizer, scheduler


def zero_step(model, optimizer, scheduler) -> None:
    """One AdamW step on zero gradients: exp_avg / exp_avg_sq / step exist, as after training."""
    import torch

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def fsdp_state(overrides: dict):
    """(config, model, optimizer, scheduler) after one zero-gradient step, on this rank."""
    config = make_config(overrides)
    model = build_fsdp_model(config)
    optimizer, scheduler = make_optimizer(model)
    zero_step(model, optimizer, scheduler)
    return config, model, optimizer, scheduler


def train_step(model, optimizer, scheduler, step: int, seq: int, vocab: int) -> float:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(step * 131 + dist.get_rank())
    ids = torch.randint(4, vocab, (1, seq), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(loss.detach())


def run_ranks(worker, world_size: int, spec: dict) -> tuple[list, float, float | None]:
    """``worker(rank, world_size, spec)`` on real gloo ranks: (per-rank results, wall seconds,
    share of the machine's CPU others used meanwhile). Each result holds ``cpu_s_total``."""
    from shardstream.testing.distributed import run

    busy0, t0 = busy_cpu_s(), time.perf_counter()
    ranks = run(worker, world_size, spec, timeout=3600)
    wall = time.perf_counter() - t0
    share = others_cpu_share(busy0, wall, sum(r["cpu_s_total"] for r in ranks))
    return ranks, wall, share


def run_in_scratch(
    worker, world_size: int, spec: dict, scratch: Path
) -> tuple[list, float, float | None]:
    """``run_ranks`` with ``spec["out"]`` a fresh ``scratch`` directory, removed afterwards
    (also when a rank fails: the checkpoints there are large)."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        return run_ranks(worker, world_size, {**spec, "out": str(scratch)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

"""The same save/restore paths on CPU and, where CUDA is present, on a GPU.

Each test runs once per device. The CPU run proves the test itself here; the CUDA run (skipped
without a GPU) exercises what only a device has: host copies through the pinned ring
(``HostTransfer``) on a side stream, pinned async snapshots, and FSDP2 over NCCL.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

import shardstream
from shardstream import CheckpointConfig, CheckpointManager
from shardstream.engine.endpoints import TensorEndpoint
from shardstream.engine.transfer import HostTransfer, default_transfer

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


def tiny(device: str, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(48, 80), torch.nn.GELU(), torch.nn.Linear(80, 16)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def train_step(model, optimizer, device: str) -> None:
    model(torch.randn(8, 48, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def host_state(model, optimizer) -> dict:
    """Model and optimizer state as CPU copies (for bitwise comparison across devices)."""
    moved = {
        "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(optimizer.state_dict()),
    }
    for entries in moved["optim"]["state"].values():
        for key, value in entries.items():
            if torch.is_tensor(value):
                entries[key] = value.detach().cpu().clone()
    return moved


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for pid, entries in a["optim"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, b["optim"]["state"][pid][key]), (pid, key)


@pytest.mark.parametrize("device", DEVICES)
def test_host_transfer_ring_copies_device_bytes_exactly(device):
    data = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, device=device)
    ring = HostTransfer(slot_bytes=1 << 20, slots=3)
    endpoint = TensorEndpoint("t", data, transfer=ring)
    offset, nbytes = 12345, (3 << 20) + 777  # not slot-aligned at either end
    out = np.empty(nbytes, dtype=np.uint8)
    endpoint.read_into(offset, out)
    assert np.array_equal(out, data[offset : offset + nbytes].cpu().numpy())
    assert ring.transfers == -(-nbytes // (1 << 20))
    assert (ring.stream is not None) == (device == "cuda")  # a side stream only on a GPU


@pytest.mark.parametrize("device", DEVICES)
def test_save_and_load_round_trip_bitwise(tmp_path, device):
    model, optimizer = tiny(device)
    for _ in range(2):
        train_step(model, optimizer, device)
    before = host_state(model, optimizer)
    transfers = default_transfer().transfers
    shardstream.save(tmp_path / "ckpt", model=model, optimizer=optimizer, step=2)
    # device tensors reach the host through the ring; host tensors are read where they lie
    assert (default_transfer().transfers > transfers) == (device == "cuda")

    fresh_model, fresh_optimizer = tiny(device, seed=1)
    train_step(fresh_model, fresh_optimizer, device)  # optimizer state exists, all different
    result = shardstream.load(tmp_path / "ckpt", model=fresh_model, optimizer=fresh_optimizer)
    assert result.step == 2
    assert_bitwise_equal(before, host_state(fresh_model, fresh_optimizer))
    assert all(p.device.type == device for p in fresh_model.parameters())

    # a checkpoint saved on one device restores onto another
    cpu_model, cpu_optimizer = tiny("cpu", seed=2)
    train_step(cpu_model, cpu_optimizer, "cpu")
    shardstream.load(tmp_path / "ckpt", model=cpu_model, optimizer=cpu_optimizer)
    assert_bitwise_equal(before, host_state(cpu_model, cpu_optimizer))


@pytest.mark.parametrize("device", DEVICES)
def test_async_save_keeps_the_state_of_its_step(tmp_path, device):
    model, optimizer = tiny(device)
    train_step(model, optimizer, device)
    config = CheckpointConfig(directory=str(tmp_path / "run"), async_save=True, keep_last=None)
    manager = CheckpointManager(config, model=model, optimizer=optimizer)
    try:
        expected = host_state(model, optimizer)
        manager.save(1)
        for _ in range(3):  # training goes on while the save streams
            train_step(model, optimizer, device)
        manager.wait()
    finally:
        manager.close()
    assert not torch.equal(
        next(model.parameters()).detach().cpu(), next(iter(expected["model"].values()))
    )

    fresh_model, fresh_optimizer = tiny(device, seed=3)
    train_step(fresh_model, fresh_optimizer, device)
    reader = CheckpointManager(config, model=fresh_model, optimizer=fresh_optimizer)
    try:
        step, _ = reader.restore()
    finally:
        reader.close()
    assert step == 1
    assert_bitwise_equal(expected, host_state(fresh_model, fresh_optimizer))


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_one_rank_save_restore_and_hf_export(tmp_path, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from shardstream.testing.tiny_models import build_tiny_model, tiny_config

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh(device, (1,), mesh_dim_names=("fsdp",))
        config = tiny_config()

        def sharded(seed: int):
            model = build_tiny_model(config, seed=seed).to(device)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=0.01)

        def step(model, optimizer):
            ids = torch.randint(0, config.vocab_size, (2, 12), device=device)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        model, optimizer = sharded(0)
        step(model, optimizer)
        cfg = CheckpointConfig(
            directory=str(tmp_path / "run"),
            save_contents=("model", "optimizer", "extra", "hf_model"),
        )
        manager = CheckpointManager(cfg, model=model, optimizer=optimizer, hf_config=config)
        manager.save(1)
        manager.close()
        ids = torch.randint(0, config.vocab_size, (1, 10))
        with torch.no_grad():
            expected_logits = model(input_ids=ids.to(device)).logits.cpu()
        expected = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}

        fresh, fresh_optimizer = sharded(7)
        step(fresh, fresh_optimizer)
        reader = CheckpointManager(cfg, model=fresh, optimizer=fresh_optimizer)
        assert reader.restore()[0] == 1
        reader.close()
        for key, value in fresh.state_dict().items():
            assert torch.equal(value.full_tensor().cpu(), expected[key]), key
    finally:
        dist.destroy_process_group()

    exported = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "global_step_1" / "huggingface", dtype=torch.float32
    )
    with torch.no_grad():
        logits = exported(input_ids=ids).logits
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)

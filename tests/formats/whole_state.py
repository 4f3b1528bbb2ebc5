"""A small model, its FSDP2 (or plain) live objects and their state as whole tensors: shared
by the tests of checkpoints that hold whole state dicts saved with ``torch.save``."""

from __future__ import annotations

from pathlib import Path

import torch


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))


def live_objects(seed: int, world: int):
    """The model sharded with FSDP2 over ``world`` ranks (plain at 1) and its AdamW."""
    model = small_model(seed)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def whole_state(model, optimizer) -> dict:
    """Model and optimizer state as whole tensors by name (every rank takes part)."""
    from torch.distributed.tensor import DTensor

    def whole(value):
        return value.full_tensor() if isinstance(value, DTensor) else value

    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "model": {n: whole(p).detach().clone() for n, p in model.named_parameters()},
        "optim": {
            f"{names[id(p)]}.{kind}": whole(v).clone()
            for p, entries in optimizer.state.items()
            for kind, v in entries.items()
        },
    }


def assert_read_by_every_command(path, label: str, model: dict, out) -> None:
    """``inspect`` names the format ``label``, ``verify`` passes, and ``merge`` into ``out``
    writes ``model`` bit for bit."""
    from safetensors.torch import load_file

    from shardstream.testing.cli import main_stdout
    from shardstream.testing.compare import assert_nested_equal

    assert label in main_stdout("inspect", path)
    assert main_stdout("verify", path).startswith("OK: ")
    main_stdout("merge", "--local_dir", path, "--target_dir", out, "--quiet")
    assert_nested_equal(load_file(out / "model.safetensors"), model, "merged")


def flip_a_tensor_bit(file: Path) -> None:
    """One bit of the first tensor data record of the torch.save ``file``, flipped in place."""
    from shardstream.formats.torch_pt import zip_records

    record = next(r for r in zip_records(str(file)) if "/data/" in r.name)
    data = bytearray(file.read_bytes())
    data[record.start] ^= 0x40
    file.write_bytes(bytes(data))

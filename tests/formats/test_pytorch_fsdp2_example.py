"""Checkpoints laid out as PyTorch's FSDP2 example writes them (pytorch/examples,
``distributed/FSDP2/checkpoint.py``): rank 0 ``torch.save``s the whole model state dict into
``<folder>/<api>/<time>/model_state_dict.pt`` and the optimizer's into
``optim_state_dict.pt``. Its two ways of gathering them are both saved here from a real FSDP2
run at 2 ranks over gloo: the state-dict API (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict=True``: optimizer state by parameter
name) and DTensors gathered by hand (``full_tensor()`` of each entry of the optimizer's own
``state_dict()``: integer parameter ids). Each is inspected, verified, merged and restored at
1 process and into FSDP2 at 3 ranks, bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from whole_state import (
    assert_read_by_every_command,
    flip_a_tensor_bit,
    live_objects,
    whole_state,
)

import shardstream
from shardstream.errors import ShardstreamError
from shardstream.testing.compare import assert_nested_equal
from shardstream.testing.distributed import preload, run

preload("torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict", "pytest")

SAVED_AT = 2
APIS = ("dcp_api", "dtensor_api")  # the example's folder names for its two ways
TIME = "1764979200000"  # the example names each save's folder by its time in ms


def _step(model, optimizer, seed: int) -> None:
    torch.manual_seed(100 + seed)
    model(torch.randn(6, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_as_the_example(rank: int, world: int, root: str) -> dict:
    """Train 2 steps with FSDP2, then write both of the example's layouts from rank 0."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    model, optimizer = live_objects(0, world)
    for seed in range(2):
        _step(model, optimizer, seed)
    whole_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    by_api = {
        "dcp_api": (
            get_model_state_dict(model, options=whole_options),
            get_optimizer_state_dict(model, optimizer, options=whole_options),
        ),
    }
    # by hand: each sharded entry gathered whole, the optimizer's own ids kept
    own = optimizer.state_dict()
    gathered = {
        pid: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in entries.items()}
        for pid, entries in own["state"].items()
    }
    by_api["dtensor_api"] = (
        {name: tensor.full_tensor() for name, tensor in model.state_dict().items()},
        {"param_groups": own["param_groups"], "state": gathered},
    )
    if rank == 0:
        for api, (model_state, optimizer_state) in by_api.items():
            folder = Path(root) / api / TIME
            folder.mkdir(parents=True)
            torch.save(model_state, folder / "model_state_dict.pt")
            torch.save(optimizer_state, folder / "optim_state_dict.pt")
    saved = whole_state(model, optimizer)
    dist.barrier()
    return saved


def restore(rank: int, world: int, path: str) -> dict:
    """Restore into fresh FSDP2 objects (a plain model at 1 process), then step once."""
    model, optimizer = live_objects(7, world)
    try:
        shardstream.load(path, model=model, optimizer=optimizer)
    except ShardstreamError as exc:
        return {"error": str(exc)}
    restored = whole_state(model, optimizer)
    _step(model, optimizer, 9)  # training goes on
    return {"restored": restored}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp2-example")
    state = run(save_as_the_example, SAVED_AT, str(root))[0]
    return {"root": root, "state": state}


def _folder(saved, api: str) -> Path:
    return saved["root"] / api / TIME


@pytest.mark.parametrize("api", APIS)
def test_inspect_verify_and_merge(saved, api, tmp_path):
    label = "torch.save (PyTorch FSDP2 example)"
    assert_read_by_every_command(_folder(saved, api), label, saved["state"]["model"], tmp_path)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("api", APIS)
def test_restore_at_another_world_size(saved, api, world):
    path = str(_folder(saved, api))
    reports = [restore(0, 1, path)] if world == 1 else run(restore, world, path)
    for report in reports:
        assert "error" not in report, report.get("error")
        assert_nested_equal(report["restored"]["model"], saved["state"]["model"], "model")
        assert_nested_equal(report["restored"]["optim"], saved["state"]["optim"], "optimizer")


def test_damaged_file_is_named_and_nothing_restored(saved, tmp_path):
    folder = tmp_path / "damaged"
    folder.mkdir()
    for name in ("model_state_dict.pt", "optim_state_dict.pt"):
        (folder / name).write_bytes((_folder(saved, "dcp_api") / name).read_bytes())
    flip_a_tensor_bit(folder / "model_state_dict.pt")
    from shardstream.commands.verify import verify

    report = verify(folder)
    assert not report.ok
    assert any("model_state_dict.pt" in p.path for p in report.problems), report.problems
    model, optimizer = live_objects(7, 1)
    before = whole_state(model, optimizer)
    with pytest.raises(ShardstreamError, match="model_state_dict.pt"):
        shardstream.load(folder, model=model, optimizer=optimizer)
    assert_nested_equal(whole_state(model, optimizer), before, "live state")


def test_optimizer_file_alone_is_named(saved, tmp_path):
    folder = tmp_path / "no-model"
    folder.mkdir()
    os.link(_folder(saved, "dcp_api") / "optim_state_dict.pt", folder / "optim_state_dict.pt")
    model, optimizer = live_objects(7, 1)
    with pytest.raises(ShardstreamError, match="optim_state_dict.pt"):
        shardstream.load(folder, model=model, optimizer=optimizer)

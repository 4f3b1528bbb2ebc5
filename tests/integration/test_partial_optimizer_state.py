"""Optimizer state for some parameters only, restored at another world size.

Parameters that never had a gradient (a vision tower trained on text alone, an expert never
routed to, an unused branch) have no AdamW state, and torch's ``Optimizer.load_state_dict``
leaves them without. A restore from shardstream's own checkpoint, DCP's or verl's does the
same: the state that was saved comes back bit for bit, those parameters get none, and training
goes on. Real FSDP2 over gloo.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardstream.testing.compare import assert_nested_equal, gathered_state
from shardstream.testing.distributed import preload, run, shard_units
from shardstream.testing.verl_checkpoint import save_rank_files, write_fsdp_config

preload("torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict", "pytest")

SAVED_AT, RESTORED_AT = 2, 3
NO_GRADIENT = ["tower.bias", "tower.weight"]


class Towered(nn.Module):
    """A body trained on every step and a tower that the forward pass never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 5))
        self.tower = nn.Linear(6, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _build(world: int, wrap: str = "fsdp2"):
    """FSDP2, or FSDP1 with (``fsdp1-orig``) or without (``fsdp1-flat``) use_orig_params;
    each linear layer a unit."""
    from torch.distributed.device_mesh import init_device_mesh

    model = Towered()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = shard_units(model, [model.body[0], model.body[2], model.tower], mesh, wrap)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, optimizer, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _stateless(full: dict) -> list[str]:
    """The parameters of a ``gathered_state`` without optimizer state."""
    return sorted(set(full["model"]) - set(full["optim"]["state"]))


def save(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from shardstream import CheckpointConfig, CheckpointManager

    model, optimizer = _build(world)
    for seed in (1, 2):
        _step(model, optimizer, seed)
    manager = CheckpointManager(
        CheckpointConfig(f"{root}/native"), model=model, optimizer=optimizer
    )
    manager.save(2)
    manager.close()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, checkpoint_id=f"{root}/dcp")
    actor = Path(root, "verl", "global_step_2", "actor")  # as verl's FSDPCheckpointManager
    actor.mkdir(parents=True, exist_ok=True)
    save_rank_files(actor, rank, world, model.state_dict(), optimizer.state_dict())
    if rank == 0:
        write_fsdp_config(actor, world)
    full = gathered_state(model, optimizer)
    return {"full": full, "stateless": _stateless(full)}


def restore(rank: int, world: int, path: str, api: str, wrap: str) -> dict:
    import shardstream
    from shardstream import CheckpointConfig, CheckpointManager

    model, optimizer = _build(world, wrap)
    if api == "manager":
        manager = CheckpointManager(CheckpointConfig(path), model=model, optimizer=optimizer)
        manager.restore()
        manager.close()
    else:
        shardstream.load(path, model=model, optimizer=optimizer, contents=("model", "optimizer"))
    full = gathered_state(model, optimizer)
    _step(model, optimizer, 3)  # training goes on; the tower still gets no gradient
    return {
        "full": full,
        "stateless": _stateless(full),
        "stateless_after_a_step": _stateless(gathered_state(model, optimizer)),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("partial-optimizer-state")
    states = run(save, SAVED_AT, str(root))
    return root, states[0]


# (the manager restores the newest step under its root; load() takes the step's directory)
SOURCES = {"native": "native", "dcp": "dcp", "verl": "verl/global_step_2/actor"}


@pytest.mark.parametrize(
    "source, api, wrap",
    [
        ("native", "manager", "fsdp2"),
        ("dcp", "load", "fsdp2"),
        ("verl", "load", "fsdp2"),
        ("native", "manager", "fsdp1-orig"),
        ("verl", "load", "fsdp1-flat"),
    ],
)
def test_parameters_without_saved_state_get_none(saved, source, api, wrap):
    root, want = saved
    assert want["stateless"] == NO_GRADIENT  # what the saving run kept: state for the body only
    path = root / SOURCES[source]
    for got in run(restore, RESTORED_AT, str(path), api, wrap):
        assert got["stateless"] == NO_GRADIENT
        assert_nested_equal(got["full"], want["full"], unordered=("params",))
        assert got["stateless_after_a_step"] == NO_GRADIENT


def _plain(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)


def test_fresh_optimizer_with_gradients_pending_gets_the_saved_state(tmp_path):
    """A script that runs a forward and backward pass before restoring: the never-stepped
    optimizer has no state and torch's state-dict API creates none while gradients exist.
    The saved state is restored as saved, the pending gradients are left as they were."""
    import shardstream

    model, optimizer = _plain()
    for seed in range(2):
        torch.manual_seed(seed)
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    shardstream.save(tmp_path / "ckpt", model=model, optimizer=optimizer)

    live, live_optimizer = _plain(seed=5)
    live(torch.randn(3, 4)).square().sum().backward()
    pending = {n: p.grad.clone() for n, p in live.named_parameters()}
    shardstream.load(tmp_path / "ckpt", model=live, optimizer=live_optimizer)

    for (name, saved), restored in zip(model.named_parameters(), live.parameters()):
        assert torch.equal(restored, saved), name
        assert sorted(live_optimizer.state[restored]) == sorted(optimizer.state[saved])
        for kind, value in optimizer.state[saved].items():
            assert torch.equal(live_optimizer.state[restored][kind], value), f"{name}.{kind}"
        assert torch.equal(restored.grad, pending[name]), name

"""The test references' gather (``shardstream.testing.gathered``): the same full state as
torch's ``get_*_state_dict(full_state_dict=True)``, bit for bit, on 1-D and 2-D meshes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from shardstream.testing.compare import assert_nested_equal
from shardstream.testing.distributed import run
from shardstream.testing.gathered import full_state_dicts

from . import workers


def _both_gathers(rank: int, world: int, mesh: tuple | None) -> tuple:
    model, optimizer, scheduler, _ = workers.build(mesh)
    workers.train_step(model, optimizer, scheduler, 1)
    ours = full_state_dicts(model, optimizer)
    torchs = (
        get_model_state_dict(model, options=workers.FULL),
        get_optimizer_state_dict(model, optimizer, options=workers.FULL),
    )
    return ours, torchs


@pytest.mark.parametrize("world, mesh", [(2, (2,)), (4, (2, 2)), (3, (3,)), (2, None)])
def test_gathered_state_equals_torchs_full_state_dict(world, mesh):
    for ours, torchs in run(_both_gathers, world, mesh):
        assert ours[0].keys() == torchs[0].keys()
        for name, tensor in torchs[0].items():
            assert type(ours[0][name]) is torch.Tensor, name
            assert torch.equal(ours[0][name], tensor), name
        assert_nested_equal(ours[1], torchs[1])
        assert ours[1]["state"], "the optimizer has state after a step"

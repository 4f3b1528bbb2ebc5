"""A sharded model's and optimizer's full state on every rank, for test references.

The DTensors of an FSDP2 model are gathered with plain c10d collectives (one
``all_gather_object`` of each rank's shard and its offset), not with DTensor's
``full_tensor()``: functional collectives over gloo have crashed a rank natively (SIGSEGV in
``wait_tensor``) on a busy machine, which made the tests that build references flaky.
"""

from __future__ import annotations

from typing import Any

import torch

from .compare import clone_nested


def full_state_dicts(model: Any, optimizer: Any = None) -> tuple[dict, dict | None]:
    """``(model state, optimizer state by FQN)``, every tensor whole and cloned (the optimizer's
    None without ``optimizer``); a collective when the model is sharded."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        options = StateDictOptions(full_state_dict=False)
        gather = _gathered
    else:  # a plain module, or FSDP1 (which gathers with c10d itself)
        options = StateDictOptions(full_state_dict=True)
        gather = clone_nested
    model_state = gather(get_model_state_dict(model, options=options))
    if optimizer is None:
        return model_state, None
    return model_state, gather(get_optimizer_state_dict(model, optimizer, options=options))


def _gathered(value: Any) -> Any:
    """``value`` with each DTensor replaced by its whole tensor (every rank must call this on
    the same structure, as it gathers one DTensor at a time)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return _whole(value)
    if isinstance(value, dict):
        return {k: _gathered(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered(v) for v in value)
    return clone_nested(value)


def _whole(tensor: Any) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (tuple(offset), tensor.to_local().detach().cpu()))
    whole = torch.empty(tensor.shape, dtype=tensor.dtype)
    covered = torch.zeros(tensor.shape, dtype=torch.bool)
    for at, shard in shards:
        box = tuple(slice(o, o + n) for o, n in zip(at, shard.shape))
        whole[box] = shard
        covered[box] = True
    if not bool(covered.all()):
        raise AssertionError(f"the ranks' shards do not cover a tensor of shape {tensor.shape}")
    return whole

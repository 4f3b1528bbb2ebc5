"""Test-side comparisons of saved and restored state: bit for bit, with dtypes and shapes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, row-major (NaNs and signed zeros compare as stored)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def clone_nested(value: Any, local: bool = False) -> Any:
    """A copy of nested state (dicts, lists, tuples) with every tensor detached and cloned;
    ``local``: a DTensor becomes a clone of this rank's shard."""
    if local:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_nested(v, local) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_nested(v, local) for v in value)
    return value


def gathered_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The whole model and optimizer state (``{"model", "optim"}``), gathered from every rank
    as torch's state-dict API presents it and cloned (a collective where they are sharded)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    return clone_nested(
        {
            "model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, optimizer, options=full),
        },
        local=True,
    )


def assert_bit_identical(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]):
    """The same names, and each tensor the same dtype, shape and bytes."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(bits(got[name]), bits(tensor)), name


def assert_nested_equal(got: Any, want: Any, where: str = "", unordered: tuple[str, ...] = ()):
    """``got`` equals ``want`` all the way down: tensors bit for bit with the same dtype,
    dicts by keys, sequences item by item; the lists under a key in ``unordered`` as sets
    (e.g. ``"params"``, whose order follows how the model was wrapped). ``where`` names the
    path in a failure."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_nested_equal(got[key], want[key], f"{where}.{key}", unordered)
    elif where.rpartition(".")[2] in unordered:
        assert sorted(got) == sorted(want), where
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_nested_equal(g, w, f"{where}[{i}]", unordered)
    else:
        assert got == want, where

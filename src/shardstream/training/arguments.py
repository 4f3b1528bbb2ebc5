"""What callers hand to save, load and the manager, checked where it enters: a UsageError
naming the argument, not an AttributeError from inside torch."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UsageError


def optimizer_parts(optimizer: Any) -> list[torch.optim.Optimizer] | None:
    """The optimizers inside a container of them (torchtitan's ``OptimizersContainer``, which
    its trainer holds as ``optimizers``: one per model part or parameter pattern, each
    saved under the parameters' names), else None."""
    parts = getattr(optimizer, "optimizers", None)
    if (
        isinstance(parts, (list, tuple))
        and parts
        and all(isinstance(p, torch.optim.Optimizer) for p in parts)
    ):
        return list(parts)
    return None


def one_optimizer(optimizer: Any) -> Any:
    """A container of one optimizer (torchtitan's default) as that optimizer; else as given."""
    parts = optimizer_parts(optimizer)
    return parts[0] if parts is not None and len(parts) == 1 else optimizer


def check_live_objects(
    model: Any = None, optimizer: Any = None, lr_scheduler: Any = None, saving: bool = False
) -> None:
    """``model`` a module, ``optimizer`` an optimizer (its ``param_groups`` and ``state``),
    ``lr_scheduler`` anything with ``state_dict`` and ``load_state_dict``; None for each is
    fine here (the contents asked for decide whether it is needed). A container of several
    optimizers restores (each in turn) but is not ``saving``'s."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise UsageError(f"model= must be a torch.nn.Module, got {_kind(model)}")
    parts = optimizer_parts(optimizer)
    if parts is not None and len(parts) > 1 and saving:
        raise UsageError(
            f"optimizer= is {_kind(optimizer)}, holding {len(parts)} optimizers: shardstream "
            "saves one torch optimizer's state per checkpoint; restoring from a container "
            "works (each optimizer in turn), saving one does not (save with the container's "
            "own tool, e.g. torchtitan's checkpointer)"
        )
    if parts is not None:
        return
    if optimizer is not None and not (
        isinstance(getattr(optimizer, "param_groups", None), list)
        and isinstance(getattr(optimizer, "state", None), Mapping)
    ):
        raise UsageError(f"optimizer= must be a torch.optim.Optimizer, got {_kind(optimizer)}")
    if lr_scheduler is not None and not all(
        callable(getattr(lr_scheduler, method, None))
        for method in ("state_dict", "load_state_dict")
    ):
        raise UsageError(
            "lr_scheduler= must have state_dict() and load_state_dict() (a torch LR "
            f"scheduler), got {_kind(lr_scheduler)}"
        )


def checked_step(step: Any) -> int:
    """``step`` as an int: a non-negative integer (numpy's too), not a bool."""
    try:
        value = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise UsageError(f"step must be a non-negative integer, got {step!r}")
    return value


def _kind(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")

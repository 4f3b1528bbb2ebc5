"""What callers hand to save, load and the manager, checked where it enters: a UsageError
naming the argument, not an AttributeError from inside torch."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UsageError


def check_live_objects(model: Any = None, optimizer: Any = None, lr_scheduler: Any = None) -> None:
    """``model`` a module, ``optimizer`` an optimizer (its ``param_groups`` and ``state``),
    ``lr_scheduler`` anything with ``state_dict`` and ``load_state_dict``; None for each is
    fine here (the contents asked for decide whether it is needed)."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise UsageError(f"model= must be a torch.nn.Module, got {_kind(model)}")
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
